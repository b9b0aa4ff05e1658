/*
 * daemon/option_values.h: the syntax of one option's value (a size, a
 * number of seconds, a percentage, a cache mode, HOST:PORT), with the
 * range each setting allows.
 *
 * Owns: nothing but that syntax. Dependency-free and stateless: the
 * command line (options.c), the config file (config.c) and the control
 * socket's set-mode all parse with these, so a value means the same
 * wherever it is given. Any thread.
 *
 * Each parser returns 0, or -EINVAL (and leaves *out alone) when the text
 * is not entirely a valid value. Ranges use the limits in options.h.
 */
#ifndef NBDCACHED_DAEMON_OPTION_VALUES_H
#define NBDCACHED_DAEMON_OPTION_VALUES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What the cache does with an export's reads and writes
 * (docs/architecture.md, "Cache modes"). */
enum cache_mode {
	CACHE_MODE_DEFAULT = 0, /* none given (an export_spec's before options_finish()) */
	CACHE_MODE_WRITEBACK,
	CACHE_MODE_WRITETHROUGH,
	CACHE_MODE_WRITEAROUND,
	CACHE_MODE_NONE,
};

enum hugepages_policy { HUGEPAGES_AUTO, HUGEPAGES_REQUIRE, HUGEPAGES_OFF };
/* An export's use of the cache device's level-2 cache (cache-device-l2):
 * auto weighs small fills against its backend, on reads every fill the
 * level 2 holds from it, off keeps its pages out. */
enum cache_l2_policy { CACHE_L2_AUTO, CACHE_L2_ON, CACHE_L2_OFF };
/* TLS: none, at the client's choice (SELECTIVETLS), required (FORCEDTLS). */
enum tls_mode { TLS_OFF, TLS_ON, TLS_REQUIRE };

/* A decimal number with an optional K, M, G or T suffix (binary). */
int options_parse_size(const char *text, uint64_t *out);
int options_parse_block_size(const char *text, uint32_t *out); /* power of two, 512..65536 */
int options_parse_cache_mode(const char *text, enum cache_mode *out);
/* "writeback" etc.; NULL for an unknown name. */
const char *options_cache_mode_name(enum cache_mode mode);
int options_parse_hugepages(const char *text, enum hugepages_policy *out);
int options_parse_percent(const char *text, unsigned *out);
/* Write a reason (printf-style) into err (errlen bytes; none when err is
 * NULL) and return rc: how every parser here and in options.c, config.c and
 * access.c reports an error. */
int options_fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A split= value: "32bit" (OPTIONS_SPLIT_32BIT) or a size above 0. */
int options_parse_split(const char *text, uint64_t *out);
/* A size= value (a window's): a size above 0. */
int options_parse_window_size(const char *text, uint64_t *out);
/*
 * The window size split=32bit stands for: the largest multiple of 2 MiB (one
 * cache range) a 32-bit Linux kernel can address as a block device. Its
 * page cache indexes a device by a 32-bit page number, so a device holds at
 * most 2^32 - 1 pages of 4 KiB (16 TiB - 4 KiB); rounded down to 2 MiB that
 * is 16 TiB - 2 MiB, and every window then starts on a 2 MiB boundary.
 */
#define OPTIONS_SPLIT_32BIT ((1ull << 44) - (2ull << 20))
int options_parse_seconds(const char *text, unsigned *out); /* 1..86400 */
int options_parse_cache_size(const char *text, uint64_t *out);
int options_parse_threads(const char *text, unsigned *out);
int options_parse_max_connections(const char *text, unsigned *out);
int options_parse_compact(const char *text, bool *out);		      /* on, off */
/* log 1, l2 2, both 3 (CACHE_DEVICE_USE_* bits) */
int options_parse_cache_device_use(const char *text, unsigned *use);
int options_parse_cache_device_warm(const char *text, bool *all);
int options_parse_cache_device_l2(const char *text, enum cache_l2_policy *out); /* auto, on, off */     /* files, all */
int options_parse_rbd_takeover(const char *text, bool *wait);	      /* refuse, wait */
int options_parse_compact_interval(const char *text, unsigned *out);  /* 1..3600000 */
int options_parse_compact_threshold(const char *text, unsigned *out); /* 0..1000 */
int options_parse_max_clients(const char *text, unsigned *out);	      /* 0..65536 */
int options_parse_reply_memory(const char *text, uint64_t *out);   /* 64M..half the address space */
int options_parse_pinned_replies(const char *text, uint64_t *out); /* a size */
int options_parse_stall_timeout(const char *text, unsigned *out);  /* 1..3600 */
int options_parse_negotiation_timeout(const char *text, unsigned *out); /* 1..3600 */
int options_parse_tls(const char *text, enum tls_mode *out); /* off, on, require */
const char *options_tls_name(enum tls_mode mode);
/* An export's tls: "require" (true), or "on", which means the global
 * setting and leaves *require alone. */
int options_parse_export_tls(const char *text, bool *require);
int options_parse_bool(const char *text, bool *out); /* true/false, yes/no, on/off, 1/0 */
/*
 * A --unix value (and the config file's unix key): PATH[,mode=OCTAL]
 * [,group=GROUP], e.g. "/run/nbd.sock,mode=0660,group=disk". The socket
 * is made with that mode (0..0777; default: the umask's) and group (a
 * name, looked up now, or a number; default: the daemon's). A comma not
 * followed by mode= or group= belongs to the path. -EINVAL with the
 * reason in err (the caller names the option): a path empty or over 107
 * bytes, a bad mode, no such group, a key given twice.
 */
struct unix_listen {
	char path[108];
	bool has_mode, has_group;
	unsigned mode;
	uint32_t gid;
};
int options_parse_unix(const char *text, struct unix_listen *out, char *err, size_t errlen);

/* Split "HOST:PORT", "[V6]:PORT" or ":PORT" into host (maybe "") and port. */
int options_split_host_port(const char *text, char *host, size_t hostlen, char *port,
			    size_t portlen);

#endif
