/*
 * daemon/control_internal.h: what the control thread's files share. Not for
 * anything outside daemon/control*.c.
 *
 *   control.c          the socket: clients, request lines, dispatch, the
 *                      tick, start and stop; the reply functions below
 *   control_stats.c    status, exports, stats: the daemon's state as JSON,
 *                      and the writeback rate slots sampled by the tick
 *   control_cache.c    flush, set-mode (they wait for the cache),
 *                      drop-clean, compact; the flush a reap needs
 *   control_reload.c   reload (from SIGHUP or a client) and the reaper
 *   control_conns.c    connections, disconnect: the NBD connections
 *   control_resize.c   resize: an export's new size (export_resize)
 *   control_limit.c    limit: an export's QoS limits set live
 *   control_upgrade.c  upgrade: hand everything to a new daemon
 *
 * Calls run one way: control.c calls into the other three; they answer
 * only through the reply functions (control_send and its helpers) and
 * control_client_resume(), and control_reload.c uses control_cache.c's
 * flush for reaping. Everything here runs on the control thread, except
 * control_reload() (control.h), which takes reload_lock.
 */
#ifndef NBDCACHED_DAEMON_CONTROL_INTERNAL_H
#define NBDCACHED_DAEMON_CONTROL_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <json-c/json.h>

#include "daemon/control.h"
#include "daemon/worker.h"

#ifndef NBDCACHED_VERSION
#define NBDCACHED_VERSION "0.1"
#endif

#define CONTROL_MAX_RATES 1024

struct bufferevent;
struct evconnlistener;
struct event;

struct control_client;

/* A request that waits for the cache: one per client at most. */
struct control_wait {
	struct cache_op op;
	struct control_client *client; /* NULL: the client left meanwhile */
	struct export *export;
	struct export_backing *reap; /* a reap flush: no client */
	uint64_t seen_error;
	uint64_t started_ns, dirty_at_start;
	enum cache_mode set_mode; /* set-mode: the mode to set after the flush */
	enum cache_mode previous;
	bool is_set_mode;
	struct control *ctl;
	/* cache-device flush and detach: the exports on the device, written
	 * back one after another (the next one's index), the first error. */
	struct export **dev_list;
	size_t dev_n, dev_next;
	unsigned dev_passes; /* detach: passes over them so far */
	int dev_error;
	bool dev_detach;
};

struct control_client {
	struct control *ctl;
	struct bufferevent *bev;
	struct control_wait *wait; /* a request in progress */
	bool eof;		   /* the client shut its side: answer what was read */
	bool closing;		   /* nothing more to answer: close once the output drained */
	struct control_client *prev, *next;
};

/* Writeback bytes one second ago, per cache export, for the rates. */
struct control_rate {
	struct cache_export *ce;
	uint64_t last_bytes, rate;
	bool seen;
};

struct control {
	struct control_config cfg;
	struct worker worker;
	struct evconnlistener *listener;
	struct event *tick;
	struct control_client *clients;
	unsigned client_count;
	bool refusing;	  /* at CONTROL_MAX_CLIENTS: refusal logged for this spell */
	unsigned pending; /* cache ops in flight */
	bool stopping;
	uint64_t started_ns;
	struct worker_task reload_task, start_task, stop_task;
	pthread_mutex_t reload_lock; /* a reload already posted and not yet run */
	bool reload_posted;
	struct control_rate rates[CONTROL_MAX_RATES];
	size_t rate_count;
	uint64_t cache_last_bytes, cache_rate;
};

/* ---- replies (control.c): the one way back to a client ---- */

/* Queue a reply line to the client (none when it has gone); takes reply. */
void control_send(struct control_client *cl, json_object *reply);
/* A new {"ok": true} object, to add fields to and send. */
json_object *control_reply_ok(void);
/* Send {"ok": false, "error": TEXT, "errno": NAME}; err is a positive errno. */
void control_send_error(struct control_client *cl, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A request that waited (cl->wait) has been answered: read the client's
 * next requests. */
void control_client_resume(struct control_client *cl);

static inline void control_add_u64(json_object *o, const char *key, uint64_t v)
{
	json_object_object_add(o, key, json_object_new_int64((int64_t)v));
}

static inline void control_add_string(json_object *o, const char *key, const char *v)
{
	json_object_object_add(o, key, v ? json_object_new_string(v) : NULL);
}

/* ---- control_stats.c ---- */

void control_cmd_status(struct control_client *cl);
void control_cmd_exports(struct control_client *cl);
/* only: one export's name, or NULL for all of them. */
void control_cmd_stats(struct control_client *cl, const char *only);
/* cache-device: the intent log's figures (control_stats.c). */
void control_cmd_cache_device(struct control_client *cl, json_object *req);
/* The device's figures (cache.cache_device in stats), NULL: none. */
json_object *control_device_object(struct cache *cache);
/* Once a second, from the tick: the writeback rates. */
void control_sample_rates(struct control *ctl);

/* ---- control_cache.c ---- */

/* flush, or set-mode when set_mode: replies when the cache is done. */
void control_cmd_flush(struct control_client *cl, json_object *req, bool set_mode);
void control_cmd_drop_clean(struct control_client *cl, json_object *req);
/* Debug hooks (tests break an invariant on purpose with them; check.h):
 * only when the daemon started with NBDCACHED_DEBUG_HOOKS=1 in its
 * environment; otherwise the command is unknown. */
bool control_debug_hooks(void);
/* {"command":"debug-unpin","export":NAME,"offset":N}: cache_debug_unpin. */
void control_cmd_debug_unpin(struct control_client *cl, json_object *req);
void control_cmd_compact(struct control_client *cl);
/* Flush w's cache export through the cache; w (calloc'd, with client,
 * export or reap set) is answered and freed when it completes. */
void control_flush_start(struct control *ctl, struct control_wait *w, struct cache_export *ce);
/* cache-device flush (detach false) or detach: every export on the device
 * written back and flushed, its log emptied (detach: then not used again
 * until a restart); the client waits for the reply. */
void control_device_flush(struct control_client *cl, bool detach);
/* Stopping and no cache op in flight: end the thread. */
void control_stop_when_idle(struct control *ctl);

/* ---- control_upgrade.c ---- */

void control_cmd_upgrade(struct control_client *cl, json_object *req);

/* ---- control_conns.c ---- */

void control_cmd_connections(struct control_client *cl);
void control_cmd_disconnect(struct control_client *cl, json_object *req);

/* ---- control_resize.c ---- */

void control_cmd_resize(struct control_client *cl, json_object *req);

/* ---- control_limit.c ---- */

/* limit export: NAME, limits: {KEY: VALUE...}: QoS limits set live. */
void control_cmd_limit(struct control_client *cl, json_object *req);
/* An export's limits as JSON (exports, stats, limit); 0: none. */
struct qos_limits;
json_object *control_limits_object(const struct qos_limits *l);

/* ---- control_reload.c ---- */

/* Re-read the configuration and apply it; cl NULL: no one to answer (SIGHUP). */
void control_reload_now(struct control *ctl, struct control_client *cl);
/* The worker task control_reload() posts. */
void control_reload_task(struct worker_task *task);
/* From the tick: close what removed exports left behind. */
void control_reap(struct control *ctl);

#endif
