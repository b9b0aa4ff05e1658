/*
 * daemon/rbd_spec.c: see rbd_spec.h.
 */
#include "daemon/rbd_spec.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* "BACKEND: what is wrong", the backend string cut short if long, so that
 * the reason always fits. */
static int fail(char *err, size_t errlen, const char *backend, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t errlen, const char *backend, const char *fmt, ...)
{
	int n = snprintf(err, errlen, "%.64s%s: ", backend, strlen(backend) > 64 ? "..." : "");
	if (n < 0 || (size_t)n >= errlen)
		return -EINVAL;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
	va_end(ap);
	return -EINVAL;
}

bool rbd_spec_handles(const char *backend)
{
	return strncmp(backend, "rbd:", 4) == 0;
}

/* Copy n bytes at s into a buffer of cap; false if it does not fit. */
static bool take(char *dst, size_t cap, const char *s, size_t n)
{
	if (n >= cap)
		return false;
	memcpy(dst, s, n);
	dst[n] = '\0';
	return true;
}

/* A pool, namespace, image or snapshot name: not empty, no control
 * character, none of the separators of the string. */
static bool good_name(const char *s)
{
	if (!*s)
		return false;
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || *s == 0x7f || *s == '/' || *s == '@' || *s == '?' ||
		    *s == '&')
			return false;
	return true;
}

static int parse_query(const char *q, struct rbd_spec *out, const char *backend, char *err,
		       size_t errlen)
{
	while (*q) {
		const char *amp = strchr(q, '&');
		size_t n = amp ? (size_t)(amp - q) : strlen(q);
		const char *eq = memchr(q, '=', n);
		if (!eq || eq == q)
			return fail(err, errlen, backend,
				    "expected KEY=VALUE after '?', got '%.*s'", (int)n, q);
		size_t kn = (size_t)(eq - q), vn = n - kn - 1;
		char *dst;
		size_t cap;
		if (kn == 4 && memcmp(q, "conf", 4) == 0) {
			dst = out->conf;
			cap = sizeof(out->conf);
		} else if (kn == 2 && memcmp(q, "id", 2) == 0) {
			dst = out->id;
			cap = sizeof(out->id);
		} else if (kn == 7 && memcmp(q, "keyring", 7) == 0) {
			dst = out->keyring;
			cap = sizeof(out->keyring);
		} else {
			return fail(err, errlen, backend,
				    "unknown key '%.*s' (expected conf, id or keyring)", (int)kn,
				    q);
		}
		if (*dst)
			return fail(err, errlen, backend, "%.*s given twice", (int)kn, q);
		if (vn == 0 || !take(dst, cap, eq + 1, vn))
			return fail(err, errlen, backend, "%.*s: empty or too long", (int)kn, q);
		for (const char *c = dst; *c; c++)
			if ((unsigned char)*c < 0x20 || *c == 0x7f)
				return fail(err, errlen, backend, "%.*s: a control character",
					    (int)kn, q);
		q = amp ? amp + 1 : q + n;
		if (amp && !*q)
			return fail(err, errlen, backend, "nothing after the last '&'");
	}
	return 0;
}

int rbd_spec_parse(const char *backend, struct rbd_spec *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	if (!rbd_spec_handles(backend))
		return fail(err, errlen, backend, "not an rbd: backend");
	const char *p = backend + 4;
	const char *query = strchr(p, '?');
	size_t pn = query ? (size_t)(query - p) : strlen(p);
	char path[3 * RBD_SPEC_NAME_MAX + 4];
	if (!take(path, sizeof(path), p, pn))
		return fail(err, errlen, backend, "too long");
	char *at = strchr(path, '@');
	if (at) {
		*at = '\0';
		if (!take(out->snap, sizeof(out->snap), at + 1, strlen(at + 1)) ||
		    !good_name(out->snap))
			return fail(err, errlen, backend, "bad snapshot name after '@'");
	}
	/* POOL/IMAGE or POOL/NAMESPACE/IMAGE */
	char *parts[3];
	size_t nparts = 0;
	char *s = path;
	for (;;) {
		char *slash = strchr(s, '/');
		if (nparts == 3)
			return fail(err, errlen, backend,
				    "expected rbd:POOL/IMAGE or rbd:POOL/NAMESPACE/IMAGE");
		parts[nparts++] = s;
		if (!slash)
			break;
		*slash = '\0';
		s = slash + 1;
	}
	if (nparts < 2)
		return fail(err, errlen, backend,
			    "expected rbd:POOL/IMAGE or rbd:POOL/NAMESPACE/IMAGE");
	const char *pool = parts[0], *image = parts[nparts - 1];
	const char *ns = nparts == 3 ? parts[1] : "";
	if (!good_name(pool) || !take(out->pool, sizeof(out->pool), pool, strlen(pool)))
		return fail(err, errlen, backend, "bad pool name");
	if (nparts == 3 && (!good_name(ns) || !take(out->ns, sizeof(out->ns), ns, strlen(ns))))
		return fail(err, errlen, backend, "bad namespace name");
	if (!good_name(image) || !take(out->image, sizeof(out->image), image, strlen(image)))
		return fail(err, errlen, backend, "bad image name");
	if (query) {
		if (!query[1])
			return fail(err, errlen, backend, "nothing after '?'");
		return parse_query(query + 1, out, backend, err, errlen);
	}
	return 0;
}
