/*
 * daemon/export_spec.c: one --export value (NAME=BACKEND[,KEY=VALUE]...)
 * parsed into a struct export_spec (options.h declares both functions).
 *
 * The keys are the rows of export_settings (settings.h): KEY=VALUE, or KEY
 * alone for a flag (readonly, allow-resize), read as the row says. The
 * access-rule lists (access.c) and the QoS limits (qos.c) keep their own
 * code. A comma-separated piece that is not a known key continues the
 * value before it where that value runs on: a description
 * ("description=disk, fast" stays whole) or an access-rule list; an
 * identity (allow-identities=, a DN) keeps its commas. Dependency-free,
 * like options.c.
 */
#include "daemon/options.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/access.h"
#include "daemon/option_values.h"
#include "daemon/qos.h"
#include "daemon/settings.h"

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
	free(e->origin);
	export_settings_free(e);
	access_spec_free(&e->access);
	memset(e, 0, sizeof(*e));
}

/* The row of export_settings the piece (n bytes at s) sets: "KEY=..." of a
 * value, the KEY alone of a flag. NULL: none. */
static const struct setting *setting_of(const char *s, size_t n)
{
	for (size_t i = 0; i < export_settings_count; i++) {
		const struct setting *st = &export_settings[i];
		size_t k = strlen(st->name);
		if (n >= k && memcmp(s, st->name, k) == 0 &&
		    (st->optional ? n == k : n > k && s[k] == '='))
			return st;
	}
	return NULL;
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
	return setting_of(s, n) || access_list_key(s, n) || is_qos_key(s, n);
}

/* Where a value that runs on over commas ends: the comma (next, or one
 * after it) before the next known key, or NULL (the end). */
static const char *run_on(const char *next)
{
	const char *q = next;
	while (q) {
		const char *after = q + 1;
		const char *nn = strchr(after, ',');
		if (is_known_key(after, nn ? (size_t)(nn - after) : strlen(after)))
			break;
		q = nn;
	}
	return q;
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
	const char *q = run_on(next);
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

/* A bad value of row s, the piece "KEY=VALUE" (n bytes at p). */
static int bad_value(const struct export_spec *out, const struct setting *s, const char *p,
		     size_t n, char *err, size_t errlen)
{
	char expect[200];
	settings_expect(s, s->name, expect, sizeof(expect));
	return fail(err, errlen, -EINVAL, "--export %s: bad %.*s: %s", out->name, (int)n, p,
		    expect);
}

/*
 * The piece of row s at p (n bytes, then *next): its value read into out.
 * A value is at most 31 bytes; a text runs on over commas (*next moves to
 * where it ends).
 */
static int export_setting(struct export_spec *out, const struct setting *s, const char *p, size_t n,
			  const char **next, char *err, size_t errlen)
{
	const char *v = p + strlen(s->name) + 1; /* after "KEY=" */
	char buf[32], why[200], *text = NULL;
	const char *value = NULL; /* a flag's: its KEY alone */
	if (s->type == SETTING_VALUE && !s->optional) {
		size_t vn = n - (size_t)(v - p);
		if (vn >= sizeof(buf))
			return bad_value(out, s, p, n, err, errlen);
		memcpy(buf, v, vn);
		buf[vn] = '\0';
		value = buf;
	} else if (!s->optional) {
		if (s->type == SETTING_TEXT)
			*next = run_on(*next);
		value = text = dup_range(v, *next ? (size_t)(*next - v) : strlen(v));
		if (!text)
			return -ENOMEM;
	}
	int rc = export_settings_read(s, out, s->name, value, why, sizeof(why));
	free(text);
	if (rc == -EINVAL && s->type == SETTING_VALUE)
		return bad_value(out, s, p, n, err, errlen);
	if (rc == -EINVAL)
		return fail(err, errlen, rc, "--export %s: %s", out->name, why);
	return rc;
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
		const struct setting *s = setting_of(p, n);
		if (access_list_key(p, n)) {
			rc = 0;
			p = export_access_key(p, next, out, &rc, err, errlen);
			if (rc < 0)
				goto error;
			continue;
		}
		if (s) {
			if ((rc = export_setting(out, s, p, n, &next, err, errlen)) < 0)
				goto error;
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
