/*
 * daemon/options.h: the command line, parsed into plain data.
 *
 * Owns: struct options and the export specifications. Dependency-free (no
 * libevent, no liburing) so it is unit tested on amd64 and i386 alike.
 * Called once from main() before anything starts; not thread-safe, and
 * needs not be.
 *
 *   nbdcached [--foreground] [--listen HOST:PORT]... [--unix PATH]...
 *             [--export NAME=BACKEND[,readonly][,description=TEXT][,block-size=N]]...
 *             [--threads N] [--pidfile FILE] [--log-level LEVEL]
 */
#ifndef NBDCACHED_DAEMON_OPTIONS_H
#define NBDCACHED_DAEMON_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/log.h"

#define OPTIONS_DEFAULT_LISTEN "127.0.0.1:10809"
#define OPTIONS_DEFAULT_BLOCK_SIZE 4096u
#define OPTIONS_MAX_THREADS 256

struct export_spec {
	char *name;
	char *backend;	   /* a path for now; URIs come with the nbd backend */
	char *description; /* NULL when none */
	bool readonly;
	uint32_t block_size; /* power of two, 512..65536 */
};

struct options {
	bool foreground;
	char **listen; /* HOST:PORT strings */
	size_t listen_count;
	char **unix_paths;
	size_t unix_count;
	struct export_spec *exports;
	size_t export_count;
	unsigned threads; /* 0: one per CPU */
	char *pidfile;
	enum log_level log_level;
	bool help;
	bool version;
};

/*
 * Parse argv. On error returns -EINVAL (or -ENOMEM) and writes a one-line
 * reason into err. Defaults are applied: with no --listen and no --unix the
 * daemon listens on OPTIONS_DEFAULT_LISTEN.
 */
int options_parse(int argc, char **argv, struct options *out, char *err, size_t errlen);
/* Parse one --export value (exposed for tests). */
int options_parse_export(const char *text, struct export_spec *out, char *err, size_t errlen);
/* Split "HOST:PORT", "[V6]:PORT" or ":PORT" into host (maybe "") and port. */
int options_split_host_port(const char *text, char *host, size_t hostlen, char *port,
			    size_t portlen);
void options_free(struct options *opts);
const char *options_usage(void);

#endif
