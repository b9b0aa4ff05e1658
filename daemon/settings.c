/*
 * daemon/settings.c: the tables of global and per-export settings
 * (settings.h). A row: the name, getopt's value (the short letter where
 * there is one), the given bit (an export's: its global setting's), the
 * field, how the text is read and what a bad one is told, whether a reload
 * may change it, whether the name alone says true, its --help argument.
 */
#include "daemon/settings.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/option_values.h"

/* A reader of its own type for each parser: the table holds them as one. */
#define READER(fn, type)                                                                           \
	static int read_##fn(const char *text, void *field)                                        \
	{                                                                                          \
		return fn(text, (type *)field);                                                    \
	}
READER(options_parse_threads, unsigned)
READER(log_parse_level, enum log_level)
READER(options_parse_cache_size, uint64_t)
READER(options_parse_hugepages, enum hugepages_policy)
READER(options_parse_block_size, uint32_t)
READER(options_parse_cache_mode, enum cache_mode)
READER(options_parse_size, uint64_t)
READER(options_parse_percent, unsigned)
READER(options_parse_seconds, unsigned)
READER(options_parse_rbd_takeover, bool)
READER(options_parse_cache_device_use, unsigned)
READER(options_parse_cache_device_warm, bool)
READER(options_parse_cache_device_l2, enum cache_l2_policy)
READER(options_parse_max_connections, unsigned)
READER(options_parse_compact, bool)
READER(options_parse_compact_interval, unsigned)
READER(options_parse_compact_threshold, unsigned)
READER(options_parse_max_clients, unsigned)
READER(options_parse_reply_memory, uint64_t)
READER(options_parse_pinned_replies, uint64_t)
READER(options_parse_stall_timeout, unsigned)
READER(options_parse_negotiation_timeout, unsigned)
READER(options_parse_tls, enum tls_mode)
READER(options_parse_bool, bool)
READER(options_parse_window_size, uint64_t)
READER(options_parse_split, uint64_t)
READER(options_parse_export_tls, bool)
#undef READER

#define STR2(x) #x
#define STR(x) STR2(x)
#define FIELD(f) offsetof(struct options, f), sizeof(((struct options *)0)->f)
#define VALUE(f, fn) SETTING_VALUE, FIELD(f), read_##fn
#define STRING(f) SETTING_STRING, FIELD(f), NULL

/* getopt's values of the settings without a short letter. */
enum {
	OPT_SETTING = 2000,
	OPT_RBD_TAKEOVER,
	OPT_CACHE_DEVICE,
	OPT_CACHE_DEVICE_DISCARD,
	OPT_CACHE_DEVICE_USE,
	OPT_CACHE_DEVICE_WARM,
	OPT_MAX_PER_CLIENT,
	OPT_TLS,
	OPT_TLS_CERTIFICATES,
	OPT_TLS_PSK,
	OPT_TLS_VERIFY_PEER,
	OPT_TLS_PRIORITY,
};

const struct setting settings[] = {
    {"threads", 't', OPT_GIVEN_THREADS, VALUE(threads, options_parse_threads),
     "expected 0.." STR(OPTIONS_MAX_THREADS), 0, true, false, "N"},
    {"pidfile", 'p', OPT_GIVEN_PIDFILE, STRING(pidfile), "empty path", 0, true, false, "FILE"},
    {"log-level", 'L', OPT_GIVEN_LOG_LEVEL, VALUE(log_level, log_parse_level),
     "expected error, warn, info or debug", 0, false, false, "LEVEL"},
    {"cache-size", 'C', OPT_GIVEN_CACHE_SIZE, VALUE(cache_size, options_parse_cache_size),
     "expected a size from 1M up to half the address space (K, M, G, T suffixes)", 0, true,
     false, "SIZE"},
    {"hugepages", 'H', OPT_GIVEN_HUGEPAGES, VALUE(hugepages, options_parse_hugepages),
     "expected auto, require or off", 0, true, false, "auto|require|off"},
    {"block-size", 'B', OPT_GIVEN_BLOCK_SIZE, VALUE(block_size, options_parse_block_size),
     "must be a power of two from 512 to 65536", 0, false, false, "N"},
    {"cache-mode", 'M', OPT_GIVEN_CACHE_MODE, VALUE(cache_mode, options_parse_cache_mode),
     "expected writeback, writethrough, writearound or none", 0, false, false, "MODE"},
    {"seq-cutoff", 'S', OPT_GIVEN_SEQ_CUTOFF, VALUE(seq_cutoff, options_parse_size),
     "expected a size", 0, false, false, "SIZE"},
    {"dirty-high", 'D', OPT_GIVEN_DIRTY_HIGH, VALUE(dirty_high, options_parse_percent),
     "expected 0..100", 0, false, false, "PCT"},
    {"dirty-low", 'd', OPT_GIVEN_DIRTY_LOW, VALUE(dirty_low, options_parse_percent),
     "expected 0..100", 0, false, false, "PCT"},
    {"dirty-expire", 'E', OPT_GIVEN_DIRTY_EXPIRE, VALUE(dirty_expire, options_parse_seconds),
     "expected 1..86400 seconds", 0, false, false, "SECONDS"},
    {"backend-timeout", 'T', OPT_GIVEN_BACKEND_TIMEOUT,
     VALUE(backend_timeout, options_parse_seconds), "expected 1..86400 seconds", 0, true, false, "SECONDS"},
    {"rbd-takeover", OPT_RBD_TAKEOVER, OPT_GIVEN_RBD_TAKEOVER,
     VALUE(rbd_takeover_wait, options_parse_rbd_takeover), "expected refuse or wait", 0, true,
     false, "refuse|wait"},
    {"cache-device", OPT_CACHE_DEVICE, OPT_GIVEN_CACHE_DEVICE, STRING(cache_device), "empty path",
     0, true, false, "PATH"},
    {"cache-device-discard-dirty", OPT_CACHE_DEVICE_DISCARD, OPT_GIVEN_CACHE_DEVICE_DISCARD,
     STRING(cache_device_discard), "no export named", 0, true, false, "NAMES"},
    {"cache-device-use", OPT_CACHE_DEVICE_USE, OPT_GIVEN_CACHE_DEVICE_USE,
     VALUE(cache_device_use, options_parse_cache_device_use), "expected log, l2 or both", 0,
     true, false, "log|l2|both"},
    {"cache-device-warm", OPT_CACHE_DEVICE_WARM, OPT_GIVEN_CACHE_DEVICE_WARM,
     VALUE(cache_device_warm_all, options_parse_cache_device_warm), "expected files or all", 0,
     true, false, "files|all"},
    {"control", 'x', OPT_GIVEN_CONTROL, STRING(control_path),
     "path empty or longer than 107 bytes", 108, true, false, "PATH|none"},
    {"user", 'U', OPT_GIVEN_USER, STRING(user), "empty name", 0, true, false, "USER"},
    {"group", 'G', OPT_GIVEN_GROUP, STRING(group), "empty name", 0, true, false, "GROUP"},
    {"max-connections", 'm', OPT_GIVEN_MAX_CONNECTIONS,
     VALUE(max_connections, options_parse_max_connections),
     "expected 0.." STR(OPTIONS_MAX_CONNECTIONS) " (0: unlimited)", 0, false, false, "N"},
    {"compact", 'P', OPT_GIVEN_COMPACT, VALUE(compact, options_parse_compact),
     "expected on or off", 0, true, false, "on|off"},
    {"compact-interval-ms", 'I', OPT_GIVEN_COMPACT_INTERVAL,
     VALUE(compact_interval_ms, options_parse_compact_interval), "expected 1..3600000", 0, true,
     false, "MS"},
    {"compact-threshold", 'F', OPT_GIVEN_COMPACT_THRESHOLD,
     VALUE(compact_threshold, options_parse_compact_threshold),
     "expected 0..1000 (per mille)", 0, true, false, "PERMILLE"},
    {"max-clients", 'N', OPT_GIVEN_MAX_CLIENTS, VALUE(max_clients, options_parse_max_clients),
     "expected 0.." STR(OPTIONS_MAX_CONNECTIONS) " (0: unlimited)", 0, true, false, "N"},
    {"max-reply-memory", 'R', OPT_GIVEN_MAX_REPLY_MEMORY,
     VALUE(max_reply_memory, options_parse_reply_memory),
     "expected a size from 64M up to half the address space (K, M, G, T suffixes)", 0, true,
     false, "SIZE"},
    {"max-pinned-replies", 'Q', OPT_GIVEN_MAX_PINNED_REPLIES,
     VALUE(max_pinned_replies, options_parse_pinned_replies), "expected a size", 0, true, false, "SIZE"},
    {"stall-timeout", 'W', OPT_GIVEN_STALL_TIMEOUT,
     VALUE(stall_timeout, options_parse_stall_timeout),
     "expected 1.." STR(OPTIONS_MAX_STALL_TIMEOUT) " seconds", 0, true, false, "SECONDS"},
    {"negotiation-timeout", 'O', OPT_GIVEN_NEGOTIATION_TIMEOUT,
     VALUE(negotiation_timeout, options_parse_negotiation_timeout),
     "expected 1.." STR(OPTIONS_MAX_NEGOTIATION_TIMEOUT) " seconds", 0, true, false, "SECONDS"},
    {"max-connections-per-client", OPT_MAX_PER_CLIENT, OPT_GIVEN_MAX_PER_CLIENT,
     VALUE(max_connections_per_client, options_parse_max_connections),
     "expected 0.." STR(OPTIONS_MAX_CONNECTIONS) " (0: unlimited)", 0, false, false, "N"},
    {"tls", OPT_TLS, OPT_GIVEN_TLS, VALUE(tls, options_parse_tls),
     "expected off, on or require", 0, false, false, "off|on|require"},
    {"tls-certificates", OPT_TLS_CERTIFICATES, OPT_GIVEN_TLS_CERTIFICATES,
     STRING(tls_certificates), "empty", 0, false, false, "DIR"},
    {"tls-psk", OPT_TLS_PSK, OPT_GIVEN_TLS_PSK, STRING(tls_psk), "empty", 0, false, false, "FILE"},
    /* --tls-verify-peer alone says true. */
    {"tls-verify-peer", OPT_TLS_VERIFY_PEER, OPT_GIVEN_TLS_VERIFY_PEER,
     VALUE(tls_verify_peer, options_parse_bool), "expected true or false", 0, false, true, "true|false"},
    {"tls-priority", OPT_TLS_PRIORITY, OPT_GIVEN_TLS_PRIORITY, STRING(tls_priority), "empty", 0,
     false, false, "STRING"},
};
const size_t settings_count = sizeof(settings) / sizeof(settings[0]);

#define EXPORT_FIELD(f) offsetof(struct export_spec, f), sizeof(((struct export_spec *)0)->f)
#define EXPORT_VALUE(f, fn) SETTING_VALUE, EXPORT_FIELD(f), read_##fn
#define EXPORT_TEXT(f) SETTING_TEXT, EXPORT_FIELD(f), NULL

/* In --help's order. At most 32 rows (export_spec.given). */
const struct setting export_settings[] = {
    {"readonly", 0, 0, EXPORT_VALUE(readonly, options_parse_bool), "expected true or false", 0,
     false, true, "true|false"},
    {"description", 0, 0, EXPORT_TEXT(description), "longer than 4096 bytes", 4097, false, false,
     "TEXT"},
    {"block-size", 0, OPT_GIVEN_BLOCK_SIZE, EXPORT_VALUE(block_size, options_parse_block_size),
     "must be a power of two from 512 to 65536", 0, true, false, "N"},
    {"cache-mode", 0, OPT_GIVEN_CACHE_MODE, EXPORT_VALUE(cache_mode, options_parse_cache_mode),
     "expected writeback, writethrough, writearound or none", 0, false, false, "MODE"},
    {"seq-cutoff", 0, OPT_GIVEN_SEQ_CUTOFF, EXPORT_VALUE(seq_cutoff, options_parse_size),
     "expected a size", 0, false, false, "SIZE"},
    {"max-connections", 0, OPT_GIVEN_MAX_CONNECTIONS,
     EXPORT_VALUE(max_connections, options_parse_max_connections),
     "expected 0.." STR(OPTIONS_MAX_CONNECTIONS) " (0: unlimited)", 0, false, false, "N"},
    {"dirty-high", 0, OPT_GIVEN_DIRTY_HIGH, EXPORT_VALUE(dirty_high, options_parse_percent),
     "expected 0..100", 0, false, false, "PCT"},
    /* (not given: never above the export's dirty-high; options_finish) */
    {"dirty-low", 0, OPT_GIVEN_DIRTY_LOW, EXPORT_VALUE(dirty_low, options_parse_percent),
     "expected 0..100", 0, false, false, "PCT"},
    {"offset", 0, 0, EXPORT_VALUE(offset, options_parse_size), "expected a size", 0, false, false,
     "SIZE"},
    {"size", 0, 0, EXPORT_VALUE(size, options_parse_window_size), "expected a size above 0", 0,
     false, false, "SIZE"},
    {"split", 0, 0, EXPORT_VALUE(split, options_parse_split), "expected a size above 0, or 32bit",
     0, false, false, "SIZE|32bit"},
    {"allow-resize", 0, 0, EXPORT_VALUE(allow_resize, options_parse_bool), "expected true or false",
     0, false, true, "true|false"},
    {"cache-device-warm", 0, OPT_GIVEN_CACHE_DEVICE_WARM,
     EXPORT_VALUE(cache_device_warm_all, options_parse_cache_device_warm),
     "expected =files or =all", 0, true, false, "files|all"},
    {"cache-device-l2", 0, 0, EXPORT_VALUE(cache_device_l2, options_parse_cache_device_l2),
     "expected =auto, =on or =off", 0, true, false, "auto|on|off"},
    /* Only require: on and off are the global setting's. */
    {"tls", 0, 0, EXPORT_VALUE(tls_require, options_parse_export_tls),
     "expected =require (or =on) in an export", 0, false, false, "require"},
};
const size_t export_settings_count = sizeof(export_settings) / sizeof(export_settings[0]);

bool settings_key_is(const char *name, const char *key)
{
	for (; *name && *key; name++, key++) {
		char a = *name == '_' ? '-' : *name;
		if (a != *key)
			return false;
	}
	return *name == '\0' && *key == '\0';
}

/* name's row of table, nbd-server's spelling of max-connections too. */
static const struct setting *find(const struct setting *table, size_t count, const char *name)
{
	if (settings_key_is(name, "maxconnections"))
		name = "max-connections";
	for (size_t i = 0; i < count; i++)
		if (settings_key_is(name, table[i].name))
			return &table[i];
	return NULL;
}

const struct setting *settings_find(const char *name)
{
	return find(settings, settings_count, name);
}

const struct setting *export_settings_find(const char *name)
{
	return find(export_settings, export_settings_count, name);
}

const struct setting *settings_by_opt(int opt)
{
	for (size_t i = 0; i < settings_count; i++)
		if (settings[i].opt == opt)
			return &settings[i];
	return NULL;
}

const char *settings_expect(const struct setting *s, const char *key, char *buf, size_t len)
{
	size_t at = 0;
	for (const char *p = s->expect; *p && at + 1 < len; p++) {
		bool word = p[0] == '=' && (p == s->expect || p[-1] == ' ' || p[-1] == '(');
		if (!word)
			buf[at++] = *p;
		else if (key)
			at += (size_t)snprintf(buf + at, len - at, "%s=", key);
	}
	buf[at < len ? at : len - 1] = '\0';
	return buf;
}

/* text into field, s's; a bad one is told as name's. */
static int read_field(const struct setting *s, void *field, const char *name, const char *text,
		      char *why, size_t why_len)
{
	char expect[200];
	settings_expect(s, NULL, expect, sizeof(expect));
	if (s->type == SETTING_VALUE) {
		if (!text && s->optional) {
			*(bool *)field = true;
			return 0;
		}
		if (!text || s->parse(text, field) < 0) {
			snprintf(why, why_len, "%s %s: %s", name, text ? text : "", expect);
			return -EINVAL;
		}
		return 0;
	}
	if (!text || (text[0] == '\0' && s->type == SETTING_STRING) ||
	    (s->max_len && strlen(text) >= s->max_len)) {
		snprintf(why, why_len, "%s: %s", name, expect);
		return -EINVAL;
	}
	char *copy = strdup(text);
	if (!copy)
		return -ENOMEM;
	char **p = field;
	free(*p);
	*p = copy;
	return 0;
}

int settings_read(const struct setting *s, struct options *o, const char *text, char *why,
		  size_t why_len)
{
	return read_field(s, (char *)o + s->offset, s->name, text, why, why_len);
}

uint32_t export_settings_bit(const struct setting *s)
{
	return UINT32_C(1) << (s - export_settings);
}

int export_settings_read(const struct setting *s, struct export_spec *e, const char *key,
			 const char *text, char *why, size_t why_len)
{
	int rc = read_field(s, (char *)e + s->offset, key, text, why, why_len);
	if (rc == 0)
		e->given |= export_settings_bit(s);
	return rc;
}

void export_settings_defaults(struct export_spec *e, const struct options *o)
{
	for (size_t i = 0; i < export_settings_count; i++) {
		const struct setting *s = &export_settings[i];
		if (!s->given || (e->given & export_settings_bit(s)))
			continue;
		for (size_t g = 0; g < settings_count; g++)
			if (settings[g].given == s->given)
				memcpy((char *)e + s->offset, (const char *)o + settings[g].offset,
				       s->size);
	}
}

void export_settings_free(struct export_spec *e)
{
	for (size_t i = 0; i < export_settings_count; i++) {
		if (export_settings[i].type == SETTING_VALUE)
			continue;
		char **p = (char **)((char *)e + export_settings[i].offset);
		free(*p);
		*p = NULL;
	}
}

void settings_take(const struct setting *s, struct options *dst, struct options *src)
{
	void *to = (char *)dst + s->offset, *from = (char *)src + s->offset;
	if (s->type != SETTING_VALUE) {
		char **t = to, **f = from;
		free(*t);
		*t = *f;
		*f = NULL;
		return;
	}
	memcpy(to, from, s->size);
}

/* --help's lines: items put one after the other, wrapped before column 80. */
struct usage {
	char *buf;
	size_t len, at;
	size_t col;	 /* 0: at the start of a line */
	unsigned indent; /* spaces before each line begun from now */
};

static void usage_printf(struct usage *u, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void usage_printf(struct usage *u, const char *fmt, ...)
{
	if (u->at + 1 >= u->len)
		return;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(u->buf + u->at, u->len - u->at, fmt, ap);
	va_end(ap);
	if (n > 0)
		u->at += (size_t)n < u->len - u->at ? (size_t)n : u->len - u->at - 1;
}

/* item, after sep unless it starts a line. */
static void usage_put(struct usage *u, const char *item, const char *sep)
{
	size_t n = strlen(item);
	if (u->col && u->col + strlen(sep) + n > 79) {
		usage_printf(u, "\n");
		u->col = 0;
	}
	if (u->col == 0) {
		usage_printf(u, "%*s%s", (int)u->indent, "", item);
		u->col = u->indent + n;
	} else {
		usage_printf(u, "%s%s", sep, item);
		u->col += strlen(sep) + n;
	}
}

static size_t usage_end(struct usage *u)
{
	if (u->col)
		usage_printf(u, "\n");
	return u->at;
}

size_t settings_usage(char *buf, size_t len, unsigned indent)
{
	struct usage u = {buf, len, 0, 0, indent};
	for (size_t i = 0; i < settings_count; i++) {
		char item[200];
		const struct setting *s = &settings[i];
		snprintf(item, sizeof(item), s->optional ? "[--%s[=%s]]" : "[--%s %s]", s->name,
			 s->arg);
		usage_put(&u, item, " ");
	}
	return usage_end(&u);
}

size_t export_settings_usage(char *buf, size_t len, unsigned indent)
{
	struct usage u = {buf, len, 0, 0, indent};
	usage_put(&u, "[--export NAME=BACKEND", "");
	u.indent = indent + (unsigned)strlen("[--export ");
	for (size_t i = 0; i < export_settings_count; i++) {
		const struct setting *s = &export_settings[i];
		char item[200];
		if (s->optional)
			snprintf(item, sizeof(item), "[,%s]%s", s->name,
				 i + 1 == export_settings_count ? "]..." : "");
		else
			snprintf(item, sizeof(item), "[,%s=%s]%s", s->name, s->arg,
				 i + 1 == export_settings_count ? "]..." : "");
		usage_put(&u, item, "");
	}
	return usage_end(&u);
}

bool settings_differ(const struct setting *s, const struct options *a, const struct options *b)
{
	const void *x = (const char *)a + s->offset, *y = (const char *)b + s->offset;
	if (s->type != SETTING_VALUE) {
		const char *p = *(char *const *)x, *q = *(char *const *)y;
		return !((!p && !q) || (p && q && strcmp(p, q) == 0));
	}
	return memcmp(x, y, s->size) != 0;
}
