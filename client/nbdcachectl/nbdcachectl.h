/*
 * client/nbdcachectl/nbdcachectl.h: what nbdcachectl's files share: the
 * parsed command line and the commands (main.c parses and dispatches;
 * show.c, flush.c, top.c and attach.c run and print).
 *
 * Locking: none; nbdcachectl is single-threaded.
 */
#ifndef CLIENT_NBDCACHECTL_H
#define CLIENT_NBDCACHECTL_H

#include <stdbool.h>
#include <time.h>

#include <json-c/json.h>

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

struct options {
	const char *control;
	bool json;
	bool run;	  /* attach --run */
	long count;	  /* top --count; 0: forever */
	double interval;  /* top --interval, seconds */
	bool top_options; /* --count or --interval given */
	const char *binary;   /* upgrade --binary */
	long timeout;	      /* upgrade --timeout, seconds; 0: the daemon's default */
	bool upgrade_options; /* --binary or --timeout given */
	const struct command *command;
	char **args;
	int nargs;
};

struct command {
	const char *name;
	const char *keys[2]; /* request fields filled by the positional ARGS, in order */
	int min_args, max_args;
	void (*print)(json_object *reply); /* human output of a one-request command */
	int (*run)(const struct options *o);
};

/* Human output of the one-request commands (show.c). */
void print_status(json_object *r);
void print_exports(json_object *r);
void print_stats(json_object *r);
void print_cache_device(json_object *r);
void print_drop_clean(json_object *r);
void print_resize(json_object *r);
void print_compact(json_object *r);
void print_set_mode(json_object *r);
void print_reload(json_object *r);
void print_connections(json_object *r); /* conns.c */
/* The latency table of a stats reply: per export and kind, the count and
 * p50 / p99 / p999 (show.c; stats and top). */
void print_latency(json_object *stats);

/* The commands that do more than one request and one reply: 0 or -errno. */
int run_flush(const struct options *o);
int run_top(const struct options *o);
int run_attach(const struct options *o);
int run_windows(const struct options *o);
/*
 * Send req (taken) on a new connection to the control socket; print the
 * reply line as it came (--json), else print(reply, o). 0 or -errno (an
 * ok=false reply, or the socket's failure, reported).
 */
int run_request(const struct options *o, json_object *req,
		void (*print)(json_object *reply, const struct options *o));
int run_upgrade(const struct options *o);
int run_disconnect(const struct options *o); /* conns.c */
int run_limit(const struct options *o);	     /* limit.c */

/* Seconds on the monotonic clock. */
static inline double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#endif
