/*
 * daemon/options.h: the command line, parsed into plain data.
 *
 * Owns: struct options and the export specifications. Dependency-free (no
 * libevent, no liburing) so it is unit tested on amd64 and i386 alike.
 * Called once from main() before anything starts; not thread-safe, and
 * needs not be.
 *
 *   nbdcached [--config FILE] [--check-config] [--control PATH|none]
 *             [--user USER] [--group GROUP]
 *             [--foreground] [--listen HOST:PORT]... [--unix PATH]...
 *             [--export NAME=BACKEND[,KEY=VALUE]...]...
 *             [--threads N] [--pidfile FILE] [--log-level LEVEL]
 *             [--metrics HOST:PORT] [--metrics-allow LIST] [--metrics-deny LIST]
 *             [--metrics-export-names listed|all]
 *             [--cache-size SIZE] [--hugepages auto|require|off]
 *             [--block-size N] [--cache-mode MODE] [--seq-cutoff SIZE]
 *             [--dirty-high PCT] [--dirty-low PCT] [--dirty-expire SECONDS]
 *             [--backend-timeout SECONDS] [--rbd-takeover refuse|wait]
 *             [--compact on|off] [--compact-interval-ms MS] [--compact-threshold PERMILLE]
 *             [--max-clients N] [--max-reply-memory SIZE] [--max-pinned-replies SIZE]
 *             [--stall-timeout SECONDS] [--negotiation-timeout SECONDS]
 *             [--allow LIST] [--deny LIST] [--allow-users LIST] [--allow-groups LIST]
 *             [--max-connections-per-client N]
 *             [--tls off|on|require] [--tls-certificates DIR] [--tls-psk FILE]
 *             [--tls-verify-peer[=true|false]] [--tls-priority STRING]
 *
 * BACKEND is a file or block device path, an NBD URI (nbd://, nbds://,
 * nbd+unix://...) or "nbdkit:PLUGIN [ARG...]". The global settings and an
 * export's KEYs are the rows of settings.h's two tables.
 *
 * Per-export settings left out take the global value, whatever the order of
 * the options on the command line.
 *
 * With a config file (config.h) the order is: defaults, then the file, then
 * the command line, which wins for every setting it gives (options.given
 * records which); exports from both are served. options_parse() leaves the
 * per-export defaults unresolved when a config file is named: the caller
 * loads it, then calls options_finish().
 *
 * The value parsers (sizes, seconds, modes, HOST:PORT) are in
 * option_values.h; this module is the option table, argv, --export specs,
 * defaults and the checks on the whole.
 */
#ifndef NBDCACHED_DAEMON_OPTIONS_H
#define NBDCACHED_DAEMON_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/access.h"
#include "daemon/qos.h"
#include "daemon/log.h"
#include "daemon/option_values.h"

#define OPTIONS_DEFAULT_LISTEN "127.0.0.1:10809"
/* The host of --metrics :PORT (loopback: every address must be asked for). */
#define OPTIONS_METRICS_DEFAULT_HOST "127.0.0.1"
#define OPTIONS_DEFAULT_BLOCK_SIZE 4096u
#define OPTIONS_MAX_THREADS 256
#define OPTIONS_DEFAULT_CACHE_SIZE (1ull << 30)
#define OPTIONS_MIN_CACHE_SIZE (1ull << 20)
#define OPTIONS_DEFAULT_DIRTY_HIGH 50
#define OPTIONS_DEFAULT_DIRTY_LOW 25
#define OPTIONS_DEFAULT_DIRTY_EXPIRE 30
#define OPTIONS_DEFAULT_BACKEND_TIMEOUT 30
#define OPTIONS_DEFAULT_CONFIG "/etc/nbdcached/nbdcached.conf"
#define OPTIONS_MAX_CONNECTIONS 65536
#define OPTIONS_DEFAULT_COMPACT_INTERVAL_MS 1000
#define OPTIONS_DEFAULT_COMPACT_THRESHOLD 200 /* per mille */
/* Limits on what all clients together hold (daemon/budget.h). */
#define OPTIONS_DEFAULT_MAX_CLIENTS 1024
#define OPTIONS_DEFAULT_MAX_REPLY_MEMORY (512ull << 20)
#define OPTIONS_MIN_REPLY_MEMORY (64ull << 20) /* two of the largest requests */
/* max_pinned_replies when not given: 1/8 of cache_size (options_pinned_replies). */
#define OPTIONS_PINNED_DEFAULT UINT64_MAX
/* The largest export or window end (the NBD protocol's offsets are signed). */
#define OPTIONS_MAX_EXPORT_SIZE ((uint64_t)INT64_MAX)
/* Seconds pending replies may go without the client reading them (conn.h). */
#define OPTIONS_DEFAULT_STALL_TIMEOUT 30
#define OPTIONS_MAX_STALL_TIMEOUT 3600
/* Seconds a client may take from connecting to GO / EXPORT_NAME (conn.h). */
#define OPTIONS_DEFAULT_NEGOTIATION_TIMEOUT 60
#define OPTIONS_MAX_NEGOTIATION_TIMEOUT 3600
/* GnuTLS priorities when tls-priority is not given: TLS 1.3 and 1.2 only,
 * AEAD ciphers only, forward-secret key exchanges only (no static RSA, no
 * plain PSK), PSK with (EC)DHE allowed (daemon/tls.h). */
#define OPTIONS_DEFAULT_TLS_PRIORITY                                                               \
	"SECURE128:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2:-CIPHER-ALL:+AES-256-GCM:"                  \
	"+CHACHA20-POLY1305:+AES-128-GCM:-MAC-ALL:+AEAD:-RSA:-PSK:+ECDHE-PSK:+DHE-PSK"

struct export_spec {
	char *name;
	char *backend;	   /* a path, an NBD URI or "nbdkit:PLUGIN ARG..." */
	char *description; /* NULL when none */
	bool readonly;
	uint32_t block_size; /* power of two, 512..65536 */
	enum cache_mode cache_mode;
	uint64_t seq_cutoff; /* bytes; 0: off */
	unsigned max_connections; /* 0: unlimited */
	unsigned dirty_high, dirty_low; /* percent of the cache */
	/* A window: bytes [offset, offset + size) of the backend; size 0 (not
	 * given) runs to the backend's end. */
	uint64_t offset, size;
	/* Non-zero: NAME/0, NAME/1, ... windows of this many bytes of the
	 * export are published too (daemon/export.h). */
	uint64_t split;
	/* tls = require: only clients that did STARTTLS may use it (needs the
	 * global tls on or require). */
	bool tls_require;
	/* allow-resize: clients may send NBD_CMD_RESIZE (advertised with
	 * NBD_FLAG_SEND_RESIZE on a writable export; export_resize.c). */
	bool allow_resize;
	/* cache-device-warm for this export: all says nothing else writes its
	 * backend, so a restart may use its level-2 pages even where no
	 * timestamp can prove it unchanged (the global setting when not
	 * given). Read at start. */
	bool cache_device_warm_all;
	/* cache-device-l2: this export's use of the level-2 cache. Read when
	 * it joins the cache. */
	enum cache_l2_policy cache_device_l2;
	/* Which keys were given: a bit per row of export_settings
	 * (settings.h); options_finish() gives the others their global value. */
	uint32_t given;
	/* Where it was defined: "FILE:LINE" or NULL (command line). */
	char *origin;
	/* Access rules of this export, on top of the global ones (access.h). */
	struct access_spec access;
	/* QoS limits (qos.h): iops-limit, bytes-limit, client-... ; all 0: none. */
	struct qos_limits qos;
	/* A file or block device backend as options_finish() found it: its
	 * identity (st_dev and st_ino; a block device's st_rdev and 0, as
	 * backend.h's ident_dev and ident_ino), so that two paths of one file
	 * are one backend (options_same_backend()). has_file_id is false for
	 * the other backends and for a path that stat(2) does not find. */
	bool has_file_id;
	uint64_t file_dev, file_ino;
};

/* Bits of options.given: global settings the command line gave. */
#define OPT_GIVEN_LISTEN (UINT64_C(1) << 0) /* --listen or --unix */
#define OPT_GIVEN_THREADS (UINT64_C(1) << 1)
#define OPT_GIVEN_PIDFILE (UINT64_C(1) << 2)
#define OPT_GIVEN_LOG_LEVEL (UINT64_C(1) << 3)
#define OPT_GIVEN_CACHE_SIZE (UINT64_C(1) << 4)
#define OPT_GIVEN_HUGEPAGES (UINT64_C(1) << 5)
#define OPT_GIVEN_BLOCK_SIZE (UINT64_C(1) << 6)
#define OPT_GIVEN_CACHE_MODE (UINT64_C(1) << 7)
#define OPT_GIVEN_SEQ_CUTOFF (UINT64_C(1) << 8)
#define OPT_GIVEN_DIRTY_HIGH (UINT64_C(1) << 9)
#define OPT_GIVEN_DIRTY_LOW (UINT64_C(1) << 10)
#define OPT_GIVEN_DIRTY_EXPIRE (UINT64_C(1) << 11)
#define OPT_GIVEN_BACKEND_TIMEOUT (UINT64_C(1) << 12)
#define OPT_GIVEN_CONTROL (UINT64_C(1) << 13)
#define OPT_GIVEN_USER (UINT64_C(1) << 14)
#define OPT_GIVEN_GROUP (UINT64_C(1) << 15)
#define OPT_GIVEN_MAX_CONNECTIONS (UINT64_C(1) << 16)
#define OPT_GIVEN_COMPACT (UINT64_C(1) << 17)
#define OPT_GIVEN_COMPACT_INTERVAL (UINT64_C(1) << 18)
#define OPT_GIVEN_COMPACT_THRESHOLD (UINT64_C(1) << 19)
#define OPT_GIVEN_MAX_CLIENTS (UINT64_C(1) << 20)
#define OPT_GIVEN_MAX_REPLY_MEMORY (UINT64_C(1) << 21)
#define OPT_GIVEN_MAX_PINNED_REPLIES (UINT64_C(1) << 22)
#define OPT_GIVEN_STALL_TIMEOUT (UINT64_C(1) << 23)
#define OPT_GIVEN_NEGOTIATION_TIMEOUT (UINT64_C(1) << 24)
#define OPT_GIVEN_ALLOW (UINT64_C(1) << 25)
#define OPT_GIVEN_DENY (UINT64_C(1) << 26)
#define OPT_GIVEN_ALLOW_USERS (UINT64_C(1) << 27)
#define OPT_GIVEN_ALLOW_GROUPS (UINT64_C(1) << 28)
#define OPT_GIVEN_MAX_PER_CLIENT (UINT64_C(1) << 29)
#define OPT_GIVEN_TLS (UINT64_C(1) << 30)
#define OPT_GIVEN_TLS_CERTIFICATES (UINT64_C(1) << 31)
#define OPT_GIVEN_TLS_PSK (UINT64_C(1) << 32)
#define OPT_GIVEN_TLS_VERIFY_PEER (UINT64_C(1) << 33)
#define OPT_GIVEN_TLS_PRIORITY (UINT64_C(1) << 34)
#define OPT_GIVEN_ALLOW_IDENTITIES (UINT64_C(1) << 35)
#define OPT_GIVEN_METRICS (UINT64_C(1) << 36)
#define OPT_GIVEN_METRICS_ALLOW (UINT64_C(1) << 37)
#define OPT_GIVEN_METRICS_DENY (UINT64_C(1) << 38)
#define OPT_GIVEN_RBD_TAKEOVER (UINT64_C(1) << 39)
#define OPT_GIVEN_CACHE_DEVICE (UINT64_C(1) << 40)
#define OPT_GIVEN_CACHE_DEVICE_DISCARD (UINT64_C(1) << 41)
#define OPT_GIVEN_CACHE_DEVICE_USE (UINT64_C(1) << 42)
#define OPT_GIVEN_CACHE_DEVICE_WARM (UINT64_C(1) << 43)
#define OPT_GIVEN_METRICS_EXPORT_NAMES (UINT64_C(1) << 44)

struct options {
	bool foreground;
	char **listen; /* HOST:PORT strings */
	size_t listen_count;
	char **unix_paths;
	size_t unix_count;
	bool listen_default; /* listen holds only the default (no --listen/--unix) */
	bool listen_from_config; /* listen and unix_paths came from the config file */
	struct export_spec *exports;
	size_t export_count;
	unsigned threads; /* 0: one per CPU */
	char *pidfile;
	enum log_level log_level;
	/* --cache-device: a file or block device holding the intent log
	 * (daemon/cache/device.h); NULL: none. */
	char *cache_device;
	/* --cache-device-discard-dirty: export names (commas between) whose
	 * records on the cache device are thrown away at start rather than
	 * refused; NULL: none. */
	char *cache_device_discard;
	/* --cache-device-use: what the device holds, CACHE_DEVICE_USE_* bits
	 * (1 the intent log, 2 the level-2 cache; default both). */
	unsigned cache_device_use;
	/* --cache-device-warm all: a clean restart keeps the level-2 pages of
	 * every backend, not only of regular files (whose modification time
	 * shows a write made while the daemon was down). */
	bool cache_device_warm_all;
	/* The cache (shared by every export). */
	uint64_t cache_size;
	enum hugepages_policy hugepages;
	uint32_t block_size;
	enum cache_mode cache_mode;
	uint64_t seq_cutoff;
	unsigned dirty_high, dirty_low; /* percent of cache_size */
	unsigned dirty_expire;		/* seconds */
	unsigned backend_timeout;	/* seconds a request waits for a lost backend */
	/* rbd: exports whose image another client owns: refused at start
	 * (false), or the daemon waits until the lock is theirs (true). */
	bool rbd_takeover_wait;
	unsigned max_connections;	/* per export; 0: unlimited */
	char *config_path;		/* NULL: none */
	bool check_config;		/* validate, print a summary, exit */
	char *control_path;		/* NULL: the default; "none": no control socket */
	char *user, *group;		/* drop privileges to these after start-up */
	uint64_t given;			/* OPT_GIVEN_* bits */
	/* Background compaction (daemon/cache/compact.h): on or off, how often
	 * the compactor looks, and the fragmentation index (per mille) above
	 * which it compacts without being nudged (0: on every look). */
	bool compact;
	unsigned compact_interval_ms;
	unsigned compact_threshold;
	/* What all clients together may hold (daemon/budget.h): connections
	 * (0: unlimited), bytes of requests in service and unsent replies, and
	 * arena bytes pinned by unsent replies (past it replies are copied). */
	unsigned max_clients;
	uint64_t max_reply_memory;
	uint64_t max_pinned_replies; /* as given; see options_pinned_replies() */
	/* Seconds in which a client must take CONN_STALL_PROGRESS of its
	 * pending replies (or of an announced payload must arrive) before it
	 * is reset (daemon/conn.h). */
	unsigned stall_timeout;
	/* Seconds a client may take from connecting to finishing negotiation
	 * (GO / EXPORT_NAME) before it is disconnected (daemon/conn.h). */
	unsigned negotiation_timeout;
	/* Who may connect (daemon/access.h): global rules, and connections per
	 * client address (Unix: per uid), negotiating ones too (0: unlimited). */
	struct access_spec access;
	unsigned max_connections_per_client;
	/* Prometheus /metrics over HTTP (daemon/metrics.h): HOST:PORT (":PORT"
	 * is stored as 127.0.0.1:PORT, loopback), NULL (the default): off; who
	 * may fetch it (allow and deny only, as the global rules' syntax and
	 * meaning); whether exports that LIST hides from some clients are on
	 * the page by name (metrics-export-names all; default listed: not). */
	char *metrics;
	struct access_spec metrics_access;
	bool metrics_export_names_all;
	/* TLS (daemon/tls.h): off (STARTTLS refused), on (SELECTIVETLS: at the
	 * client's choice, required by exports with tls = require) or require
	 * (FORCEDTLS); the credentials (certificate directory with
	 * ca-cert.pem, server-cert.pem, server-key.pem, ca-crl.pem; psktool's
	 * key file), whether a client certificate is required and verified,
	 * the GnuTLS priority string (NULL: OPTIONS_DEFAULT_TLS_PRIORITY). */
	enum tls_mode tls;
	char *tls_certificates;
	char *tls_psk;
	bool tls_verify_peer;
	char *tls_priority;
	bool help;
	bool version;
};

/*
 * Parse argv. On error returns -EINVAL (or -ENOMEM) and writes a one-line
 * reason into err. Defaults are applied: with no --listen and no --unix the
 * daemon listens on OPTIONS_DEFAULT_LISTEN.
 */
int options_parse(int argc, char **argv, struct options *out, char *err, size_t errlen);
/* options_parse() without its options_finish(): for config_options(), which
 * decides about the default config file once it knows whether the command
 * line gave an export. */
int options_parse_args(int argc, char **argv, struct options *out, char *err, size_t errlen);
/* Resolve per-export defaults, identify file backends (stat(2): two paths
 * of one file are one backend), check the whole, add the default listen
 * address. Called by options_parse() unless a config file is named. */
int options_finish(struct options *opts, char *err, size_t errlen);
/* The first export (index) with the same backend as export i (i itself when
 * it is the first, or its backend is not shared): exports over one backend
 * share it and its cache (daemon/export.h); options_finish()
 * checks they agree on what the cache holds per backend (block size, cache
 * mode, watermarks). */
size_t options_backend_first(const struct options *opts, size_t i);
/* Can exports share this backend? Not an "nbdkit:" one: each such export
 * starts an nbdkit of its own (its split windows share it). */
bool options_backend_shared(const char *backend);
/* Is this backend a path (a file or a block device), not an NBD URI,
 * "nbdkit:" or "rbd:"? */
bool options_backend_is_path(const char *backend);
/* Are a and b one backend: the same backend string, or two paths of one
 * file or block device (the same identity when options_finish() looked:
 * "x.img", "./x.img", a link to it)? Never for "nbdkit:" backends. An NBD
 * server or an RBD image named two ways is not recognised. */
bool options_same_backend(const struct export_spec *a, const struct export_spec *b);
/* Set every global default (what options_parse() starts from). */
void options_defaults(struct options *opts);
/* The pinned-reply limit in force: as given, or 1/8 of cache_size. */
uint64_t options_pinned_replies(const struct options *opts);
/* Append a copy of a string to a vector. */
int options_push_string(char ***vec, size_t *count, const char *s);
/* Add an export; -EEXIST (message in err) when the name is taken. */
int options_add_export(struct options *opts, struct export_spec *spec, char *err, size_t errlen);
void options_export_spec_free(struct export_spec *e);
/* Parse one --export value (exposed for tests). */
int options_parse_export(const char *text, struct export_spec *out, char *err, size_t errlen);
void options_free(struct options *opts);
/* key "metrics" (HOST:PORT; an empty HOST is 127.0.0.1), "metrics-allow"
 * or "metrics-deny" (added to the list), or "metrics-export-names" (listed
 * or all) set in opts: 0, -EINVAL (why in err) or -ENOMEM. */
int options_metrics_value(struct options *opts, const char *key, const char *value, char *err,
			  size_t errlen);
const char *options_usage(void);

#endif
