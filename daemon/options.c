/*
 * daemon/options.c: command-line parsing (see options.h).
 *
 * getopt_long does the flag syntax; this file validates values and turns
 * each --export into a struct export_spec. A description may contain commas:
 * a comma-separated piece that is not a known key continues the description
 * before it ("description=disk, fast" stays whole).
 */
#include "daemon/options.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	if (err && errlen)
		vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return rc;
}

const char *options_usage(void)
{
	return "usage: nbdcached [--foreground] [--listen HOST:PORT]... [--unix PATH]...\n"
	       "                 [--export NAME=BACKEND[,readonly][,description=TEXT]"
	       "[,cache-mode=MODE][,seq-cutoff=SIZE]]...\n"
	       "                 [--threads N] [--pidfile FILE] [--log-level LEVEL]\n"
	       "                 [--cache-size SIZE] [--hugepages auto|require|off]\n"
	       "                 [--block-size N] [--cache-mode MODE] [--seq-cutoff SIZE]\n"
	       "                 [--dirty-high PCT] [--dirty-low PCT] [--dirty-expire SECONDS]\n"
	       "                 [--backend-timeout SECONDS]\n"
	       "                 [--compact on|off] [--compact-interval-ms MS]\n"
	       "                 [--compact-threshold PERMILLE]\n"
	       "BACKEND is a file or block device, an NBD URI (nbd://HOST[:PORT]/NAME,\n"
	       "nbd+unix:///NAME?socket=PATH, nbds://...) or nbdkit:PLUGIN [ARG...].\n"
	       "LEVEL is error, warn, info or debug. MODE is writeback (default), writethrough,\n"
	       "writearound or none. SIZE takes a K, M, G or T suffix. Default listen: "
	       OPTIONS_DEFAULT_LISTEN " (when neither --listen nor --unix is given).\n"
	       "The empty export name selects the first export.\n";
}

/* Parse a decimal unsigned number with optional K/M/G/T suffix (binary). */
static int parse_u64(const char *text, uint64_t *out)
{
	char *end;
	if (text[0] == '\0' || text[0] == '-')
		return -EINVAL;
	errno = 0;
	unsigned long long v = strtoull(text, &end, 0);
	if (errno != 0)
		return -EINVAL;
	unsigned shift = 0;
	if (*end == 'k' || *end == 'K')
		shift = 10, end++;
	else if (*end == 'm' || *end == 'M')
		shift = 20, end++;
	else if (*end == 'g' || *end == 'G')
		shift = 30, end++;
	else if (*end == 't' || *end == 'T')
		shift = 40, end++;
	if (*end != '\0')
		return -EINVAL;
	if (shift && v > (UINT64_MAX >> shift))
		return -EINVAL;
	*out = (uint64_t)v << shift;
	return 0;
}

static bool is_power_of_two(uint64_t v)
{
	return v && (v & (v - 1)) == 0;
}

static char *dup_range(const char *p, size_t n)
{
	char *s = malloc(n + 1);
	if (s) {
		memcpy(s, p, n);
		s[n] = '\0';
	}
	return s;
}

static void export_spec_free(struct export_spec *e)
{
	free(e->name);
	free(e->backend);
	free(e->description);
	memset(e, 0, sizeof(*e));
}

static bool starts_with(const char *s, size_t n, const char *prefix)
{
	size_t p = strlen(prefix);
	return n >= p && memcmp(s, prefix, p) == 0;
}

static bool is_known_key(const char *s, size_t n)
{
	return (n == 8 && memcmp(s, "readonly", 8) == 0) || starts_with(s, n, "description=") ||
	       starts_with(s, n, "block-size=") || starts_with(s, n, "cache-mode=") ||
	       starts_with(s, n, "seq-cutoff=");
}

static const char *const cache_mode_names[] = {
	[CACHE_MODE_WRITEBACK] = "writeback",
	[CACHE_MODE_WRITETHROUGH] = "writethrough",
	[CACHE_MODE_WRITEAROUND] = "writearound",
	[CACHE_MODE_NONE] = "none",
};

const char *options_cache_mode_name(enum cache_mode mode)
{
	if (mode <= CACHE_MODE_DEFAULT || mode > CACHE_MODE_NONE)
		return NULL;
	return cache_mode_names[mode];
}

static int parse_cache_mode(const char *text, enum cache_mode *out)
{
	for (int m = CACHE_MODE_WRITEBACK; m <= CACHE_MODE_NONE; m++) {
		if (strcmp(text, cache_mode_names[m]) == 0) {
			*out = (enum cache_mode)m;
			return 0;
		}
	}
	return -EINVAL;
}

static int parse_block_size(const char *text, uint32_t *out)
{
	uint64_t v;
	if (parse_u64(text, &v) < 0 || !is_power_of_two(v) || v < 512 || v > 65536)
		return -EINVAL;
	*out = (uint32_t)v;
	return 0;
}

/* Copy the value of "key=value" (n bytes at p) into buf; -EINVAL if too long. */
static int key_value(const char *p, size_t n, const char *key, char *buf, size_t buflen)
{
	size_t vn = n - strlen(key);
	if (vn >= buflen)
		return -EINVAL;
	memcpy(buf, p + strlen(key), vn);
	buf[vn] = '\0';
	return 0;
}

int options_parse_export(const char *text, struct export_spec *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	out->block_size = OPTIONS_DEFAULT_BLOCK_SIZE;
	const char *eq = strchr(text, '=');
	if (!eq)
		return fail(err, errlen, -EINVAL, "--export %s: expected NAME=BACKEND", text);
	size_t name_len = (size_t)(eq - text);
	if (name_len > 4096)
		return fail(err, errlen, -EINVAL, "--export: name longer than 4096 bytes");
	const char *rest = eq + 1;
	const char *comma = strchr(rest, ',');
	size_t backend_len = comma ? (size_t)(comma - rest) : strlen(rest);
	int rc = -ENOMEM;
	if (backend_len == 0) {
		rc = fail(err, errlen, -EINVAL, "--export %s: empty backend", text);
		goto error;
	}
	out->name = dup_range(text, name_len);
	out->backend = dup_range(rest, backend_len);
	if (!out->name || !out->backend)
		goto error;

	const char *p = comma ? comma + 1 : NULL;
	while (p) {
		const char *next = strchr(p, ',');
		size_t n = next ? (size_t)(next - p) : strlen(p);
		/* A description runs on over commas until the next known key. */
		if (starts_with(p, n, "description=")) {
			const char *d = p + strlen("description=");
			const char *q = next;
			while (q) {
				const char *after = q + 1;
				const char *nn = strchr(after, ',');
				size_t an = nn ? (size_t)(nn - after) : strlen(after);
				if (is_known_key(after, an))
					break;
				q = nn;
			}
			size_t dn = q ? (size_t)(q - d) : strlen(d);
			if (dn > 4096) {
				rc = fail(err, errlen, -EINVAL, "--export: description too long");
				goto error;
			}
			free(out->description);
			out->description = dup_range(d, dn);
			if (!out->description)
				goto error;
			p = q ? q + 1 : NULL;
			continue;
		}
		if (n == 8 && memcmp(p, "readonly", 8) == 0) {
			out->readonly = true;
		} else if (starts_with(p, n, "block-size=")) {
			char buf[32];
			if (key_value(p, n, "block-size=", buf, sizeof(buf)) < 0 ||
			    parse_block_size(buf, &out->block_size) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: block-size %.*s must be a power of two from 512 "
					  "to 65536",
					  (int)n, p);
				goto error;
			}
			out->has_block_size = true;
		} else if (starts_with(p, n, "cache-mode=")) {
			char buf[32];
			if (key_value(p, n, "cache-mode=", buf, sizeof(buf)) < 0 ||
			    parse_cache_mode(buf, &out->cache_mode) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: %.*s: expected writeback, writethrough, "
					  "writearound or none",
					  (int)n, p);
				goto error;
			}
		} else if (starts_with(p, n, "seq-cutoff=")) {
			char buf[32];
			if (key_value(p, n, "seq-cutoff=", buf, sizeof(buf)) < 0 ||
			    parse_u64(buf, &out->seq_cutoff) < 0) {
				rc = fail(err, errlen, -EINVAL, "--export: bad %.*s", (int)n, p);
				goto error;
			}
			out->has_seq_cutoff = true;
		} else {
			rc = fail(err, errlen, -EINVAL, "--export %s: unknown option '%.*s'", text,
				  (int)n, p);
			goto error;
		}
		p = next ? next + 1 : NULL;
	}
	return 0;
error:
	if (rc == -ENOMEM)
		fail(err, errlen, rc, "out of memory");
	export_spec_free(out);
	return rc;
}

int options_split_host_port(const char *text, char *host, size_t hostlen, char *port,
			    size_t portlen)
{
	const char *colon;
	const char *h = text;
	size_t hn;
	if (text[0] == '[') {
		const char *close = strchr(text, ']');
		if (!close || close[1] != ':')
			return -EINVAL;
		h = text + 1;
		hn = (size_t)(close - h);
		colon = close + 1;
	} else {
		colon = strrchr(text, ':');
		if (!colon)
			return -EINVAL;
		hn = (size_t)(colon - text);
		if (memchr(text, ':', hn))
			return -EINVAL; /* bare IPv6 needs brackets */
	}
	const char *pt = colon + 1;
	size_t pn = strlen(pt);
	if (pn == 0 || hn >= hostlen || pn >= portlen)
		return -EINVAL;
	for (size_t i = 0; i < pn; i++)
		if (pt[i] < '0' || pt[i] > '9')
			return -EINVAL;
	if (strtoul(pt, NULL, 10) > 65535)
		return -EINVAL;
	memcpy(host, h, hn);
	host[hn] = '\0';
	memcpy(port, pt, pn + 1);
	return 0;
}

static int push_string(char ***vec, size_t *count, const char *s)
{
	char **v = realloc(*vec, (*count + 1) * sizeof(**vec));
	if (!v)
		return -ENOMEM;
	*vec = v;
	v[*count] = strdup(s);
	if (!v[*count])
		return -ENOMEM;
	(*count)++;
	return 0;
}

void options_free(struct options *opts)
{
	for (size_t i = 0; i < opts->listen_count; i++)
		free(opts->listen[i]);
	free(opts->listen);
	for (size_t i = 0; i < opts->unix_count; i++)
		free(opts->unix_paths[i]);
	free(opts->unix_paths);
	for (size_t i = 0; i < opts->export_count; i++)
		export_spec_free(&opts->exports[i]);
	free(opts->exports);
	free(opts->pidfile);
	memset(opts, 0, sizeof(*opts));
}

int options_parse(int argc, char **argv, struct options *out, char *err, size_t errlen)
{
	static const struct option longopts[] = {
		{"foreground", no_argument, NULL, 'f'},
		{"listen", required_argument, NULL, 'l'},
		{"unix", required_argument, NULL, 'u'},
		{"export", required_argument, NULL, 'e'},
		{"threads", required_argument, NULL, 't'},
		{"pidfile", required_argument, NULL, 'p'},
		{"log-level", required_argument, NULL, 'L'},
		{"cache-size", required_argument, NULL, 'C'},
		{"hugepages", required_argument, NULL, 'H'},
		{"block-size", required_argument, NULL, 'B'},
		{"cache-mode", required_argument, NULL, 'M'},
		{"seq-cutoff", required_argument, NULL, 'S'},
		{"dirty-high", required_argument, NULL, 'D'},
		{"dirty-low", required_argument, NULL, 'd'},
		{"dirty-expire", required_argument, NULL, 'E'},
		{"backend-timeout", required_argument, NULL, 'T'},
		{"compact", required_argument, NULL, 'c'},
		{"compact-interval-ms", required_argument, NULL, 'I'},
		{"compact-threshold", required_argument, NULL, 'F'},
		{"help", no_argument, NULL, 'h'},
		{"version", no_argument, NULL, 'V'},
		{NULL, 0, NULL, 0},
	};
	int rc = 0;
	memset(out, 0, sizeof(*out));
	out->log_level = LOG_INFO;
	out->cache_size = OPTIONS_DEFAULT_CACHE_SIZE;
	out->block_size = OPTIONS_DEFAULT_BLOCK_SIZE;
	out->cache_mode = CACHE_MODE_WRITEBACK;
	out->dirty_high = OPTIONS_DEFAULT_DIRTY_HIGH;
	out->dirty_low = OPTIONS_DEFAULT_DIRTY_LOW;
	out->dirty_expire = OPTIONS_DEFAULT_DIRTY_EXPIRE;
	out->backend_timeout = OPTIONS_DEFAULT_BACKEND_TIMEOUT;
	out->compact = true;
	out->compact_interval_ms = OPTIONS_DEFAULT_COMPACT_INTERVAL_MS;
	out->compact_threshold = OPTIONS_DEFAULT_COMPACT_THRESHOLD;
	optind = 1;
	opterr = 0;
	for (;;) {
		int c = getopt_long(argc, argv, "fl:u:e:t:p:L:C:H:B:M:S:D:d:E:T:c:I:F:hV", longopts, NULL);
		if (c == -1)
			break;
		switch (c) {
		case 'f':
			out->foreground = true;
			break;
		case 'l': {
			char host[256], port[16];
			if (options_split_host_port(optarg, host, sizeof(host), port,
						    sizeof(port)) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--listen %s: expected HOST:PORT or [IPV6]:PORT", optarg);
				goto error;
			}
			if ((rc = push_string(&out->listen, &out->listen_count, optarg)) < 0)
				goto error;
			break;
		}
		case 'u':
			if (optarg[0] == '\0' || strlen(optarg) >= 108) {
				rc = fail(err, errlen, -EINVAL,
					  "--unix: path empty or longer than 107 bytes");
				goto error;
			}
			if ((rc = push_string(&out->unix_paths, &out->unix_count, optarg)) < 0)
				goto error;
			break;
		case 'e': {
			struct export_spec spec;
			rc = options_parse_export(optarg, &spec, err, errlen);
			if (rc < 0)
				goto error;
			for (size_t i = 0; i < out->export_count; i++) {
				if (strcmp(out->exports[i].name, spec.name) == 0) {
					rc = fail(err, errlen, -EINVAL, "--export: duplicate name '%s'",
						  spec.name);
					export_spec_free(&spec);
					goto error;
				}
			}
			struct export_spec *v =
				realloc(out->exports, (out->export_count + 1) * sizeof(*v));
			if (!v) {
				export_spec_free(&spec);
				rc = -ENOMEM;
				goto error;
			}
			out->exports = v;
			v[out->export_count++] = spec;
			break;
		}
		case 't': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v > OPTIONS_MAX_THREADS) {
				rc = fail(err, errlen, -EINVAL, "--threads %s: expected 0..%d", optarg,
					  OPTIONS_MAX_THREADS);
				goto error;
			}
			out->threads = (unsigned)v;
			break;
		}
		case 'p':
			free(out->pidfile);
			out->pidfile = strdup(optarg);
			if (!out->pidfile) {
				rc = -ENOMEM;
				goto error;
			}
			break;
		case 'L':
			if (log_parse_level(optarg, &out->log_level) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--log-level %s: expected error, warn, info or debug",
					  optarg);
				goto error;
			}
			break;
		case 'C':
			if (parse_u64(optarg, &out->cache_size) < 0 ||
			    out->cache_size < OPTIONS_MIN_CACHE_SIZE ||
			    out->cache_size > (uint64_t)SIZE_MAX / 2) {
				rc = fail(err, errlen, -EINVAL,
					  "--cache-size %s: expected a size from 1M up to half the "
					  "address space",
					  optarg);
				goto error;
			}
			out->cache_size &= ~(uint64_t)4095;
			break;
		case 'H':
			if (strcmp(optarg, "auto") == 0)
				out->hugepages = HUGEPAGES_AUTO;
			else if (strcmp(optarg, "require") == 0)
				out->hugepages = HUGEPAGES_REQUIRE;
			else if (strcmp(optarg, "off") == 0)
				out->hugepages = HUGEPAGES_OFF;
			else {
				rc = fail(err, errlen, -EINVAL,
					  "--hugepages %s: expected auto, require or off", optarg);
				goto error;
			}
			break;
		case 'B':
			if (parse_block_size(optarg, &out->block_size) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--block-size %s: must be a power of two from 512 to 65536",
					  optarg);
				goto error;
			}
			break;
		case 'M':
			if (parse_cache_mode(optarg, &out->cache_mode) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--cache-mode %s: expected writeback, writethrough, "
					  "writearound or none",
					  optarg);
				goto error;
			}
			break;
		case 'S':
			if (parse_u64(optarg, &out->seq_cutoff) < 0) {
				rc = fail(err, errlen, -EINVAL, "--seq-cutoff %s: expected a size",
					  optarg);
				goto error;
			}
			break;
		case 'D':
		case 'd': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v > 100) {
				rc = fail(err, errlen, -EINVAL, "--dirty-%s %s: expected 0..100",
					  c == 'D' ? "high" : "low", optarg);
				goto error;
			}
			*(c == 'D' ? &out->dirty_high : &out->dirty_low) = (unsigned)v;
			break;
		}
		case 'E': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v == 0 || v > 86400) {
				rc = fail(err, errlen, -EINVAL,
					  "--dirty-expire %s: expected 1..86400 seconds", optarg);
				goto error;
			}
			out->dirty_expire = (unsigned)v;
			break;
		}
		case 'T': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v == 0 || v > 86400) {
				rc = fail(err, errlen, -EINVAL,
					  "--backend-timeout %s: expected 1..86400 seconds", optarg);
				goto error;
			}
			out->backend_timeout = (unsigned)v;
			break;
		}
		case 'c':
			if (strcmp(optarg, "on") == 0)
				out->compact = true;
			else if (strcmp(optarg, "off") == 0)
				out->compact = false;
			else {
				rc = fail(err, errlen, -EINVAL, "--compact %s: expected on or off",
					  optarg);
				goto error;
			}
			break;
		case 'I': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v == 0 || v > 3600000) {
				rc = fail(err, errlen, -EINVAL,
					  "--compact-interval-ms %s: expected 1..3600000", optarg);
				goto error;
			}
			out->compact_interval_ms = (unsigned)v;
			break;
		}
		case 'F': {
			uint64_t v;
			if (parse_u64(optarg, &v) < 0 || v > 1000) {
				rc = fail(err, errlen, -EINVAL,
					  "--compact-threshold %s: expected 0..1000 (per mille)", optarg);
				goto error;
			}
			out->compact_threshold = (unsigned)v;
			break;
		}
		case 'h':
			out->help = true;
			break;
		case 'V':
			out->version = true;
			break;
		default:
			rc = fail(err, errlen, -EINVAL, "unknown or incomplete option '%s'",
				  argv[optind - 1]);
			goto error;
		}
	}
	if (optind < argc) {
		rc = fail(err, errlen, -EINVAL, "unexpected argument '%s'", argv[optind]);
		goto error;
	}
	if (out->help || out->version)
		return 0;
	if (out->export_count == 0) {
		rc = fail(err, errlen, -EINVAL, "no export: give at least one --export NAME=PATH");
		goto error;
	}
	if (out->dirty_low > out->dirty_high) {
		rc = fail(err, errlen, -EINVAL, "--dirty-low %u is above --dirty-high %u",
			  out->dirty_low, out->dirty_high);
		goto error;
	}
	for (size_t i = 0; i < out->export_count; i++) {
		struct export_spec *e = &out->exports[i];
		if (!e->has_block_size)
			e->block_size = out->block_size;
		if (!e->has_seq_cutoff)
			e->seq_cutoff = out->seq_cutoff;
		if (e->cache_mode == CACHE_MODE_DEFAULT)
			e->cache_mode = out->cache_mode;
	}
	if (out->listen_count == 0 && out->unix_count == 0) {
		if ((rc = push_string(&out->listen, &out->listen_count, OPTIONS_DEFAULT_LISTEN)) <
		    0)
			goto error;
		out->listen_default = true;
	}
	return 0;
error:
	if (rc == -ENOMEM)
		fail(err, errlen, rc, "out of memory");
	options_free(out);
	return rc;
}
