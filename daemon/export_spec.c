/*
 * daemon/export_spec.c: one --export value (NAME=BACKEND[,KEY=VALUE]...)
 * parsed into a struct export_spec (options.h declares both functions).
 *
 * Each value is checked by the parsers of option_values.c and access.c. A
 * description may contain commas: a comma-separated piece that is not a
 * known key continues the description before it ("description=disk, fast"
 * stays whole); an access-rule list runs on the same way, and an identity
 * (allow-identities=, a DN) keeps its commas. Dependency-free, like
 * options.c.
 */
#include "daemon/options.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/access.h"
#include "daemon/option_values.h"
#include "daemon/qos.h"

#define fail options_fail
static char *dup_range(const char *p, size_t n)
{
	char *s = malloc(n + 1);
	if (s) {
		memcpy(s, p, n);
		s[n] = '\0';
	}
	return s;
}

void options_export_spec_free(struct export_spec *e)
{
	free(e->name);
	free(e->backend);
	free(e->description);
	free(e->origin);
	access_spec_free(&e->access);
	memset(e, 0, sizeof(*e));
}

static bool starts_with(const char *s, size_t n, const char *prefix)
{
	size_t p = strlen(prefix);
	return n >= p && memcmp(s, prefix, p) == 0;
}

/* The access-rule list whose "KEY=" starts the n bytes at s, or NULL. */
static const struct access_list *access_list_key(const char *s, size_t n)
{
	const char *eq = memchr(s, '=', n);
	return eq ? access_list_named(s, (size_t)(eq - s)) : NULL;
}

/* Is "KEY=..." (n bytes at s) a QoS limit (qos.h)? */
static bool is_qos_key(const char *s, size_t n)
{
	const char *eq = memchr(s, '=', n);
	char key[32];
	if (!eq || (size_t)(eq - s) >= sizeof(key))
		return false;
	memcpy(key, s, (size_t)(eq - s));
	key[eq - s] = '\0';
	return qos_is_key(key);
}

static bool is_known_key(const char *s, size_t n)
{
	if (access_list_key(s, n))
		return true;
	return (n == 8 && memcmp(s, "readonly", 8) == 0) ||
	       (n == 12 && memcmp(s, "allow-resize", 12) == 0) ||
	       starts_with(s, n, "description=") || starts_with(s, n, "block-size=") ||
	       starts_with(s, n, "cache-mode=") || starts_with(s, n, "seq-cutoff=") ||
	       starts_with(s, n, "max-connections=") || starts_with(s, n, "dirty-high=") ||
	       starts_with(s, n, "dirty-low=") || starts_with(s, n, "offset=") ||
	       starts_with(s, n, "size=") || starts_with(s, n, "split=") ||
	       starts_with(s, n, "tls=") || starts_with(s, n, "cache-device-warm=") ||
	       is_qos_key(s, n);
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

/*
 * An access-rule key of --export at p (n bytes, then next): its list runs
 * on over commas until the next known key, as a description does, so
 * "allow=10.0.0.0/8,192.168.0.0/16,readonly" is two rules and a flag. An
 * identity keeps its commas (a DN has them): allow-identities= is one.
 * Returns where parsing goes on (NULL: the end), or sets *rc.
 */
static const char *export_access_key(const char *p, const char *next, struct export_spec *out,
				     int *rc, char *err, size_t errlen)
{
	const struct access_list *l = access_list_key(p, next ? (size_t)(next - p) : strlen(p));
	const char *v = p + strlen(l->key) + 1;
	const char *q = next;
	while (q) {
		const char *after = q + 1;
		const char *nn = strchr(after, ',');
		if (is_known_key(after, nn ? (size_t)(nn - after) : strlen(after)))
			break;
		q = nn;
	}
	char *list = dup_range(v, q ? (size_t)(q - v) : strlen(v));
	if (!list) {
		*rc = -ENOMEM;
		return NULL;
	}
	char *comma;
	while (l->separator == ' ' && (comma = strchr(list, ',')))
		*comma = ' ';
	char why[200];
	int added = access_spec_add(&out->access, l, list, why, sizeof(why));
	if (added == -EINVAL)
		*rc = fail(err, errlen, -EINVAL, "--export %s: %s", out->name, why);
	else if (added < 0)
		*rc = added;
	free(list);
	return q ? q + 1 : NULL;
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
		if (access_list_key(p, n)) {
			rc = 0;
			p = export_access_key(p, next, out, &rc, err, errlen);
			if (rc < 0)
				goto error;
			continue;
		}
		if (n == 8 && memcmp(p, "readonly", 8) == 0) {
			out->readonly = true;
		} else if (n == 12 && memcmp(p, "allow-resize", 12) == 0) {
			out->allow_resize = true;
		} else if (starts_with(p, n, "block-size=")) {
			char buf[32];
			if (key_value(p, n, "block-size=", buf, sizeof(buf)) < 0 ||
			    options_parse_block_size(buf, &out->block_size) < 0) {
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
			    options_parse_cache_mode(buf, &out->cache_mode) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: %.*s: expected writeback, writethrough, "
					  "writearound or none",
					  (int)n, p);
				goto error;
			}
		} else if (starts_with(p, n, "seq-cutoff=")) {
			char buf[32];
			if (key_value(p, n, "seq-cutoff=", buf, sizeof(buf)) < 0 ||
			    options_parse_size(buf, &out->seq_cutoff) < 0) {
				rc = fail(err, errlen, -EINVAL, "--export: bad %.*s", (int)n, p);
				goto error;
			}
			out->has_seq_cutoff = true;
		} else if (starts_with(p, n, "max-connections=")) {
			char buf[32];
			if (key_value(p, n, "max-connections=", buf, sizeof(buf)) < 0 ||
			    options_parse_max_connections(buf, &out->max_connections) < 0) {
				rc = fail(err, errlen, -EINVAL, "--export: bad %.*s (0..%d)", (int)n,
					  p, OPTIONS_MAX_CONNECTIONS);
				goto error;
			}
			out->has_max_connections = true;
		} else if (starts_with(p, n, "dirty-high=") || starts_with(p, n, "dirty-low=")) {
			bool high = starts_with(p, n, "dirty-high=");
			char buf[32];
			if (key_value(p, n, high ? "dirty-high=" : "dirty-low=", buf, sizeof(buf)) <
				    0 ||
			    options_parse_percent(buf, high ? &out->dirty_high : &out->dirty_low) <
				    0) {
				rc = fail(err, errlen, -EINVAL, "--export: bad %.*s (0..100)", (int)n,
					  p);
				goto error;
			}
			*(high ? &out->has_dirty_high : &out->has_dirty_low) = true;
		} else if (starts_with(p, n, "offset=") || starts_with(p, n, "size=")) {
			bool off = starts_with(p, n, "offset=");
			char buf[32];
			if (key_value(p, n, off ? "offset=" : "size=", buf, sizeof(buf)) < 0 ||
			    options_parse_size(buf, off ? &out->offset : &out->size) < 0 ||
			    (!off && out->size == 0)) {
				rc = fail(err, errlen, -EINVAL, "--export: bad %.*s", (int)n, p);
				goto error;
			}
		} else if (starts_with(p, n, "split=")) {
			char buf[32];
			if (key_value(p, n, "split=", buf, sizeof(buf)) < 0 ||
			    options_parse_split(buf, &out->split) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: bad %.*s (a size, or 32bit)", (int)n, p);
				goto error;
			}
		} else if (starts_with(p, n, "cache-device-warm=")) {
			char buf[32];
			if (key_value(p, n, "cache-device-warm=", buf, sizeof(buf)) < 0 ||
			    options_parse_cache_device_warm(buf, &out->cache_device_warm_all) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: %.*s: expected cache-device-warm=files or "
					  "cache-device-warm=all",
					  (int)n, p);
				goto error;
			}
			out->has_cache_device_warm = true;
		} else if (starts_with(p, n, "tls=")) {
			/* Only require: on and off are the global setting's. */
			if (n == 11 && memcmp(p, "tls=require", 11) == 0) {
				out->tls_require = true;
			} else if (!(n == 6 && memcmp(p, "tls=on", 6) == 0)) {
				rc = fail(err, errlen, -EINVAL,
					  "--export: %.*s: expected tls=require (or tls=on)", (int)n, p);
				goto error;
			}
		} else if (is_qos_key(p, n)) {
			const char *eqs = memchr(p, '=', n);
			char key[32], buf[64], why[200];
			memcpy(key, p, (size_t)(eqs - p));
			key[eqs - p] = '\0';
			size_t vn = n - (size_t)(eqs - p) - 1;
			if (vn >= sizeof(buf))
				vn = sizeof(buf) - 1;
			memcpy(buf, eqs + 1, vn);
			buf[vn] = '\0';
			if (qos_limits_set(&out->qos, key, buf, why, sizeof(why)) < 0) {
				rc = fail(err, errlen, -EINVAL, "--export %s: %s", out->name, why);
				goto error;
			}
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
	options_export_spec_free(out);
	return rc;
}
