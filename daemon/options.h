/*
 * daemon/options.h: the command line, parsed into plain data.
 *
 * Owns: struct options and the export specifications. Dependency-free (no
 * libevent, no liburing) so it is unit tested on amd64 and i386 alike.
 * Called once from main() before anything starts; not thread-safe, and
 * needs not be.
 *
 *   nbdcached [--foreground] [--listen HOST:PORT]... [--unix PATH]...
 *             [--export NAME=BACKEND[,readonly][,description=TEXT][,block-size=N]
 *                       [,cache-mode=MODE][,seq-cutoff=SIZE]]...
 *             [--threads N] [--pidfile FILE] [--log-level LEVEL]
 *             [--cache-size SIZE] [--hugepages auto|require|off]
 *             [--block-size N] [--cache-mode MODE] [--seq-cutoff SIZE]
 *             [--dirty-high PCT] [--dirty-low PCT] [--dirty-expire SECONDS]
 *             [--backend-timeout SECONDS]
 *             [--compact on|off] [--compact-interval-ms MS] [--compact-threshold PERMILLE]
 *
 * BACKEND is a file or block device path, an NBD URI (nbd://, nbds://,
 * nbd+unix://...) or "nbdkit:PLUGIN [ARG...]".
 *
 * Per-export settings left out take the global value, whatever the order of
 * the options on the command line.
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
#define OPTIONS_DEFAULT_CACHE_SIZE (1ull << 30)
#define OPTIONS_MIN_CACHE_SIZE (1ull << 20)
#define OPTIONS_DEFAULT_DIRTY_HIGH 50
#define OPTIONS_DEFAULT_DIRTY_LOW 25
#define OPTIONS_DEFAULT_DIRTY_EXPIRE 30
#define OPTIONS_DEFAULT_BACKEND_TIMEOUT 30
#define OPTIONS_DEFAULT_COMPACT_INTERVAL_MS 1000
#define OPTIONS_DEFAULT_COMPACT_THRESHOLD 200 /* per mille */

/* What the cache does with an export's reads and writes (DESIGN.md). */
enum cache_mode {
	CACHE_MODE_DEFAULT = 0, /* export_spec only: take options.cache_mode */
	CACHE_MODE_WRITEBACK,
	CACHE_MODE_WRITETHROUGH,
	CACHE_MODE_WRITEAROUND,
	CACHE_MODE_NONE,
};

enum hugepages_policy { HUGEPAGES_AUTO, HUGEPAGES_REQUIRE, HUGEPAGES_OFF };

struct export_spec {
	char *name;
	char *backend;	   /* a path, an NBD URI or "nbdkit:PLUGIN ARG..." */
	char *description; /* NULL when none */
	bool readonly;
	uint32_t block_size; /* power of two, 512..65536 */
	enum cache_mode cache_mode;
	uint64_t seq_cutoff; /* bytes; 0: off */
	/* Which of the above were given (the rest come from struct options). */
	bool has_block_size, has_seq_cutoff;
};

struct options {
	bool foreground;
	char **listen; /* HOST:PORT strings */
	size_t listen_count;
	char **unix_paths;
	size_t unix_count;
	bool listen_default; /* listen holds only the default (no --listen/--unix) */
	struct export_spec *exports;
	size_t export_count;
	unsigned threads; /* 0: one per CPU */
	char *pidfile;
	enum log_level log_level;
	/* The cache (shared by every export). */
	uint64_t cache_size;
	enum hugepages_policy hugepages;
	uint32_t block_size;
	enum cache_mode cache_mode;
	uint64_t seq_cutoff;
	unsigned dirty_high, dirty_low; /* percent of cache_size */
	unsigned dirty_expire;		/* seconds */
	unsigned backend_timeout;	/* seconds a request waits for a lost backend */
	/* Background compaction (daemon/cache/compact.h): on or off, how often
	 * the compactor looks, and the fragmentation index (per mille) above
	 * which it compacts without being nudged (0: on every look). */
	bool compact;
	unsigned compact_interval_ms;
	unsigned compact_threshold;
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
/* "writeback" etc.; NULL for an unknown name. */
const char *options_cache_mode_name(enum cache_mode mode);
const char *options_usage(void);

#endif
