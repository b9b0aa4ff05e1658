/*
 * daemon/option_values.c: the syntax of option values (see
 * option_values.h). Each parser takes the whole text and either accepts
 * all of it or returns -EINVAL with *out untouched.
 */
#include "daemon/option_values.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "daemon/access.h"
#include "daemon/options.h"

/* Parse a decimal unsigned number with optional K/M/G/T suffix (binary). */
int options_parse_size(const char *text, uint64_t *out)
{
	char *end;
	if (text[0] < '0' || text[0] > '9')
		return -EINVAL;
	errno = 0;
	unsigned long long v = strtoull(text, &end, 10); /* "010" is ten, not eight */
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

/* text's index among names (count of them), or -EINVAL: the parsers of
 * a word whose values an enum numbers in that order. */
static int word_index(const char *text, const char *const *names, unsigned count)
{
	for (unsigned i = 0; i < count; i++)
		if (names[i] && strcmp(text, names[i]) == 0)
			return (int)i;
	return -EINVAL;
}
#define WORD_INDEX(text, names) word_index(text, names, sizeof(names) / sizeof(names[0]))

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

int options_parse_cache_mode(const char *text, enum cache_mode *out)
{
	for (int m = CACHE_MODE_WRITEBACK; m <= CACHE_MODE_NONE; m++) {
		if (strcmp(text, cache_mode_names[m]) == 0) {
			*out = (enum cache_mode)m;
			return 0;
		}
	}
	return -EINVAL;
}

int options_parse_block_size(const char *text, uint32_t *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || !is_power_of_two(v) || v < 512 || v > 65536)
		return -EINVAL;
	*out = (uint32_t)v;
	return 0;
}

int options_fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	if (err && errlen)
		vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return rc;
}

int options_parse_split(const char *text, uint64_t *out)
{
	uint64_t v;
	if (strcmp(text, "32bit") == 0)
		v = OPTIONS_SPLIT_32BIT;
	else if (options_parse_size(text, &v) < 0 || v == 0)
		return -EINVAL;
	*out = v;
	return 0;
}

int options_parse_window_size(const char *text, uint64_t *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || v == 0)
		return -EINVAL;
	*out = v;
	return 0;
}

int options_parse_hugepages(const char *text, enum hugepages_policy *out)
{
	if (strcmp(text, "auto") == 0)
		*out = HUGEPAGES_AUTO;
	else if (strcmp(text, "require") == 0)
		*out = HUGEPAGES_REQUIRE;
	else if (strcmp(text, "off") == 0)
		*out = HUGEPAGES_OFF;
	else
		return -EINVAL;
	return 0;
}

/* A number (K/M/G/T suffixes allowed) from min to max. */
static int parse_unsigned_in(const char *text, uint64_t min, uint64_t max, unsigned *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || v < min || v > max)
		return -EINVAL;
	*out = (unsigned)v;
	return 0;
}

int options_parse_percent(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 0, 100, out);
}

int options_parse_seconds(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 1, 86400, out);
}

int options_parse_cache_size(const char *text, uint64_t *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || v < OPTIONS_MIN_CACHE_SIZE ||
	    v > (uint64_t)SIZE_MAX / 2)
		return -EINVAL;
	*out = v & ~(uint64_t)4095;
	return 0;
}

int options_parse_threads(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 0, OPTIONS_MAX_THREADS, out);
}

int options_parse_max_connections(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 0, OPTIONS_MAX_CONNECTIONS, out);
}

int options_parse_compact(const char *text, bool *out)
{
	if (strcmp(text, "on") == 0)
		*out = true;
	else if (strcmp(text, "off") == 0)
		*out = false;
	else
		return -EINVAL;
	return 0;
}

int options_parse_cache_device_use(const char *text, unsigned *use)
{
	if (strcmp(text, "log") == 0)
		*use = 1;
	else if (strcmp(text, "l2") == 0)
		*use = 2;
	else if (strcmp(text, "both") == 0)
		*use = 3;
	else
		return -EINVAL;
	return 0;
}

int options_parse_cache_device_warm(const char *text, bool *all)
{
	if (strcmp(text, "files") == 0)
		*all = false;
	else if (strcmp(text, "all") == 0)
		*all = true;
	else
		return -EINVAL;
	return 0;
}

int options_parse_cache_device_l2(const char *text, enum cache_l2_policy *out)
{
	static const char *const names[] = {"auto", "on", "off"};
	int i = WORD_INDEX(text, names);
	if (i < 0)
		return i;
	*out = (enum cache_l2_policy)i;
	return 0;
}

int options_parse_rbd_takeover(const char *text, bool *wait)
{
	if (strcmp(text, "refuse") == 0)
		*wait = false;
	else if (strcmp(text, "wait") == 0)
		*wait = true;
	else
		return -EINVAL;
	return 0;
}

int options_parse_tls(const char *text, enum tls_mode *out)
{
	static const char *const names[] = {"off", "on", "require"};
	int i = WORD_INDEX(text, names);
	if (i < 0)
		return i;
	*out = (enum tls_mode)i;
	return 0;
}

int options_parse_export_tls(const char *text, bool *require)
{
	if (strcmp(text, "require") == 0)
		*require = true;
	else if (strcmp(text, "on") != 0)
		return -EINVAL;
	return 0;
}

const char *options_tls_name(enum tls_mode mode)
{
	return mode == TLS_REQUIRE ? "require" : mode == TLS_ON ? "on" : "off";
}

int options_parse_bool(const char *text, bool *out)
{
	static const char *const yes[] = {"true", "yes", "on", "1"};
	static const char *const no[] = {"false", "no", "off", "0"};
	for (size_t i = 0; i < 4; i++) {
		if (strcasecmp(text, yes[i]) == 0) {
			*out = true;
			return 0;
		}
		if (strcasecmp(text, no[i]) == 0) {
			*out = false;
			return 0;
		}
	}
	return -EINVAL;
}

int options_parse_compact_interval(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 1, 3600000, out);
}

int options_parse_compact_threshold(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 0, 1000, out);
}

int options_parse_max_clients(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 0, OPTIONS_MAX_CONNECTIONS, out);
}

int options_parse_reply_memory(const char *text, uint64_t *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || v < OPTIONS_MIN_REPLY_MEMORY ||
	    v > (uint64_t)SIZE_MAX / 2)
		return -EINVAL;
	*out = v;
	return 0;
}

int options_parse_pinned_replies(const char *text, uint64_t *out)
{
	uint64_t v;
	if (options_parse_size(text, &v) < 0 || v == OPTIONS_PINNED_DEFAULT)
		return -EINVAL;
	*out = v;
	return 0;
}

int options_parse_stall_timeout(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 1, OPTIONS_MAX_STALL_TIMEOUT, out);
}

int options_parse_negotiation_timeout(const char *text, unsigned *out)
{
	return parse_unsigned_in(text, 1, OPTIONS_MAX_NEGOTIATION_TIMEOUT, out);
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

/* Where the ",mode=" or ",group=" that ends the path (or the key before)
 * begins in text, or its end. */
static const char *unix_next_key(const char *text)
{
	const char *p = text;
	while ((p = strchr(p, ',')))
		if (strncmp(p + 1, "mode=", 5) == 0 || strncmp(p + 1, "group=", 6) == 0)
			return p;
		else
			p++;
	return text + strlen(text);
}

int options_parse_unix(const char *text, struct unix_listen *out, char *err, size_t errlen)
{
	struct unix_listen u = {0};
	const char *end = unix_next_key(text);
	size_t n = (size_t)(end - text);
	if (n == 0 || n >= sizeof(u.path))
		return options_fail(err, errlen, -EINVAL, "path empty or longer than 107 bytes");
	memcpy(u.path, text, n);
	while (*end) {
		const char *key = end + 1, *next = unix_next_key(key);
		bool mode = strncmp(key, "mode=", 5) == 0;
		const char *v = key + (mode ? 5 : 6);
		char value[256];
		if ((size_t)(next - v) >= sizeof(value))
			return options_fail(err, errlen, -EINVAL, "value too long");
		memcpy(value, v, (size_t)(next - v));
		value[next - v] = '\0';
		if (mode ? u.has_mode : u.has_group)
			return options_fail(err, errlen, -EINVAL, "%s given twice",
					    mode ? "mode" : "group");
		if (mode) {
			char *e;
			unsigned long m = strtoul(value, &e, 8);
			if (value[0] < '0' || value[0] > '7' || *e || strlen(value) > 4 || m > 0777)
				return options_fail(err, errlen, -EINVAL,
						    "mode '%s' is not an octal mode 0 to 0777",
						    value);
			u.mode = (unsigned)m;
			u.has_mode = true;
		} else {
			uint32_t *gids = NULL;
			size_t count = 0;
			char why[200];
			int rc = strpbrk(value, " \t")
				     ? -EINVAL
				     : access_parse_groups(value, &gids, &count, why, sizeof(why));
			if (rc == 0 && count == 1)
				u.gid = gids[0];
			free(gids);
			if (rc == -ENOMEM)
				return options_fail(err, errlen, rc, "out of memory");
			if (rc < 0 || count != 1)
				return options_fail(err, errlen, -EINVAL, "no such group '%s'",
						    value);
			u.has_group = true;
		}
		end = next;
	}
	*out = u;
	return 0;
}
