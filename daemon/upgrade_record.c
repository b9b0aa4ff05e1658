/*
 * daemon/upgrade_record.c: see upgrade_record.h.
 *
 * The decoder walks the body with a cursor that refuses to move past its
 * end (struct cursor): every field read is bounds-checked in one place, and
 * a body with bytes left over once its type's fields are read is refused
 * too (a record of another layout under the same version).
 */
#include "daemon/upgrade_record.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "proto/nbd.h"

struct cursor {
	const uint8_t *p;
	size_t left;
	bool short_read; /* a read past the end was refused */
};

static const uint8_t *take(struct cursor *c, size_t n)
{
	if (c->short_read || n > c->left) {
		c->short_read = true;
		return NULL;
	}
	const uint8_t *p = c->p;
	c->p += n;
	c->left -= n;
	return p;
}

static uint64_t get64(struct cursor *c)
{
	const uint8_t *p = take(c, 8);
	return p ? nbd_get64(p) : 0;
}

static uint32_t get32(struct cursor *c)
{
	const uint8_t *p = take(c, 4);
	return p ? nbd_get32(p) : 0;
}

static uint16_t get16(struct cursor *c)
{
	const uint8_t *p = take(c, 2);
	return p ? nbd_get16(p) : 0;
}

static uint8_t get8(struct cursor *c)
{
	const uint8_t *p = take(c, 1);
	return p ? *p : 0;
}

/* n bytes of text into out (cap bytes with its NUL); false: too long, or
 * holding a NUL. */
static bool get_text(struct cursor *c, size_t n, char *out, size_t cap)
{
	if (n >= cap)
		return false;
	const uint8_t *p = take(c, n);
	if (!p)
		return false;
	if (memchr(p, '\0', n))
		return false;
	memcpy(out, p, n);
	out[n] = '\0';
	return true;
}

static int refuse(char *why, size_t why_len, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, why_len, fmt, ap);
	va_end(ap);
	return -EPROTO;
}

static const char *type_name(unsigned type)
{
	switch (type) {
	case UPGRADE_HELLO:
		return "HELLO";
	case UPGRADE_LISTENER:
		return "LISTENER";
	case UPGRADE_CONNECTION:
		return "CONNECTION";
	case UPGRADE_END:
		return "END";
	case UPGRADE_TAKEN:
		return "TAKEN";
	case UPGRADE_COMMIT:
		return "COMMIT";
	case UPGRADE_ERROR:
		return "ERROR";
	}
	return NULL;
}

int upgrade_record_decode(const uint8_t *buf, size_t len, unsigned nfds, struct upgrade_record *out,
			  char *why, size_t why_len)
{
	if (len < UPGRADE_RECORD_HEADER)
		return refuse(why, why_len, "state record of %zu bytes: shorter than its header",
			      len);
	uint32_t magic = nbd_get32(buf);
	unsigned version = nbd_get16(buf + 4), type = nbd_get16(buf + 6);
	uint32_t length = nbd_get32(buf + 8), fds = nbd_get32(buf + 12);
	if (magic != UPGRADE_RECORD_MAGIC)
		return refuse(why, why_len, "not a state record (magic 0x%08x)", magic);
	if (version != UPGRADE_RECORD_VERSION)
		return refuse(why, why_len,
			      "state record version %u, this daemon reads version %u only", version,
			      UPGRADE_RECORD_VERSION);
	const char *name = type_name(type);
	if (!name)
		return refuse(why, why_len, "state record of unknown type %u", type);
	if (length != len - UPGRADE_RECORD_HEADER)
		return refuse(why, why_len,
			      "%s record says %u body bytes, the message holds %zu (cut short?)",
			      name, length, len - UPGRADE_RECORD_HEADER);
	unsigned want_fds = type == UPGRADE_LISTENER || type == UPGRADE_CONNECTION ? 1 : 0;
	if (fds != want_fds || nfds != want_fds)
		return refuse(why, why_len,
			      "%s record with %u descriptor(s) announced and %u received, "
			      "expected %u",
			      name, fds, nfds, want_fds);
	memset(out, 0, sizeof(*out));
	out->type = (enum upgrade_record_type)type;
	struct cursor c = {buf + UPGRADE_RECORD_HEADER, length, false};
	switch (out->type) {
	case UPGRADE_HELLO:
		out->pid = get32(&c);
		if (!c.short_read && out->pid == 0)
			return refuse(why, why_len, "HELLO record with pid 0");
		break;
	case UPGRADE_LISTENER: {
		unsigned kind = get8(&c);
		if (!c.short_read && (kind < UPGRADE_LISTEN_TCP || kind > UPGRADE_LISTEN_METRICS))
			return refuse(why, why_len, "LISTENER record of unknown kind %u", kind);
		out->kind = (enum upgrade_listener_kind)kind;
		uint16_t n = get16(&c);
		if (c.short_read || get_text(&c, n, out->spec, sizeof(out->spec)) || c.short_read)
			break;
		return refuse(why, why_len, "LISTENER record: a spec of %u bytes, or with a NUL",
			      n);
	}
	case UPGRADE_CONNECTION: {
		struct upgrade_conn_state *s = &out->conn;
		s->id = get64(&c);
		s->age_ms = get64(&c);
		s->requests = get64(&c);
		s->bytes_read = get64(&c);
		s->bytes_written = get64(&c);
		s->payload_copied = get64(&c);
		s->size = get64(&c);
		s->tx_flags = get16(&c);
		s->flags = get8(&c);
		s->upgrades = get32(&c);
		s->min_block = get32(&c);
		s->pref_block = get32(&c);
		s->max_payload = get32(&c);
		uint16_t n = get16(&c);
		if (c.short_read)
			break;
		if (s->flags & ~UPGRADE_CONN_FLAGS)
			return refuse(why, why_len, "CONNECTION record %llu: unknown flags 0x%02x",
				      (unsigned long long)s->id, s->flags);
		if (n == 0 || n > UPGRADE_MAX_NAME)
			return refuse(why, why_len,
				      "CONNECTION record %llu: an export name of %u bytes",
				      (unsigned long long)s->id, n);
		if (!get_text(&c, n, s->name, sizeof(s->name))) {
			if (c.short_read)
				break;
			return refuse(why, why_len,
				      "CONNECTION record %llu: a NUL in the export name",
				      (unsigned long long)s->id);
		}
		uint32_t m = get32(&c);
		if (!c.short_read && m > UPGRADE_MAX_PENDING)
			return refuse(why, why_len,
				      "CONNECTION record %llu: %u bytes of pending input, at most "
				      "%u",
				      (unsigned long long)s->id, m, UPGRADE_MAX_PENDING);
		s->pending = take(&c, m);
		s->pending_len = s->pending ? m : 0;
		if (c.short_read || !(s->flags & UPGRADE_CONN_IDENTITY))
			break;
		s->offset = get64(&c);
		unsigned kind = get8(&c);
		s->backend_dev = get64(&c);
		s->backend_ino = get64(&c);
		uint16_t b = get16(&c);
		if (c.short_read)
			break;
		if (kind > UPGRADE_BACKEND_FILE ||
		    (kind == UPGRADE_BACKEND_NAMED && (s->backend_dev || s->backend_ino)))
			return refuse(why, why_len,
				      "CONNECTION record %llu: a backend of unknown kind %u, or "
				      "named with a device and inode",
				      (unsigned long long)s->id, kind);
		s->backend_kind = (enum upgrade_backend_kind)kind;
		if (b == 0 || b > UPGRADE_MAX_BACKEND)
			return refuse(why, why_len,
				      "CONNECTION record %llu: a backend string of %u bytes",
				      (unsigned long long)s->id, b);
		if (!get_text(&c, b, s->backend, sizeof(s->backend)) && !c.short_read)
			return refuse(why, why_len,
				      "CONNECTION record %llu: a NUL in the backend string",
				      (unsigned long long)s->id);
		break;
	}
	case UPGRADE_END:
		out->connections = get32(&c);
		out->listeners = get32(&c);
		break;
	case UPGRADE_TAKEN: {
		out->connections = get32(&c);
		if (c.short_read || c.left == 0)
			break; /* the plain one: it closes none */
		out->closed = get32(&c);
		uint16_t n = get16(&c);
		if (c.short_read)
			break;
		if (out->closed == 0 || out->closed > out->connections)
			return refuse(why, why_len, "TAKEN record: closes %u of %u connections",
				      out->closed, out->connections);
		if (!get_text(&c, n, out->text, sizeof(out->text)) && !c.short_read)
			return refuse(why, why_len, "TAKEN record: %u bytes of text, or with a NUL",
				      n);
		break;
	}
	case UPGRADE_COMMIT:
		break;
	case UPGRADE_ERROR:
		if (!get_text(&c, length, out->text, sizeof(out->text)))
			return refuse(why, why_len, "ERROR record: %u bytes of text, or with a NUL",
				      length);
		break;
	}
	if (c.short_read)
		return refuse(why, why_len, "%s record cut short (%u body bytes)", name, length);
	if (c.left)
		return refuse(why, why_len, "%s record with %zu bytes more than its fields", name,
			      c.left);
	return 0;
}

/* The header for a body of length bytes; the body's start. */
static uint8_t *header(uint8_t *buf, enum upgrade_record_type type, size_t length, unsigned fds)
{
	nbd_put32(buf, UPGRADE_RECORD_MAGIC);
	nbd_put16(buf + 4, UPGRADE_RECORD_VERSION);
	nbd_put16(buf + 6, (uint16_t)type);
	nbd_put32(buf + 8, (uint32_t)length);
	nbd_put32(buf + 12, fds);
	return buf + UPGRADE_RECORD_HEADER;
}

size_t upgrade_record_hello(uint8_t *buf, uint32_t pid)
{
	uint8_t *p = header(buf, UPGRADE_HELLO, 4, 0);
	nbd_put32(p, pid);
	return UPGRADE_RECORD_HEADER + 4;
}

size_t upgrade_record_listener(uint8_t *buf, enum upgrade_listener_kind kind, const char *spec)
{
	size_t n = strlen(spec);
	if (n > UPGRADE_MAX_SPEC)
		return 0;
	uint8_t *p = header(buf, UPGRADE_LISTENER, 3 + n, 1);
	p[0] = (uint8_t)kind;
	nbd_put16(p + 1, (uint16_t)n);
	memcpy(p + 3, spec, n);
	return UPGRADE_RECORD_HEADER + 3 + n;
}

size_t upgrade_record_connection(uint8_t *buf, const struct upgrade_conn_state *s)
{
	size_t n = strlen(s->name);
	if (n == 0 || n > UPGRADE_MAX_NAME || s->pending_len > UPGRADE_MAX_PENDING ||
	    (s->flags & ~UPGRADE_CONN_FLAGS))
		return 0;
	bool identity = (s->flags & UPGRADE_CONN_IDENTITY) != 0;
	size_t b = identity ? strnlen(s->backend, sizeof(s->backend)) : 0;
	if (identity &&
	    (b == 0 || b > UPGRADE_MAX_BACKEND || s->backend_kind > UPGRADE_BACKEND_FILE ||
	     (s->backend_kind == UPGRADE_BACKEND_NAMED && (s->backend_dev || s->backend_ino))))
		return 0;
	size_t length = 7 * 8 + 2 + 1 + 4 * 4 + 2 + n + 4 + s->pending_len +
			(identity ? 8 + 1 + 8 + 8 + 2 + b : 0);
	uint8_t *p = header(buf, UPGRADE_CONNECTION, length, 1);
	const uint64_t v[7] = {s->id,	      s->age_ms,	s->requests,
			       s->bytes_read, s->bytes_written, s->payload_copied,
			       s->size};
	for (int i = 0; i < 7; i++, p += 8)
		nbd_put64(p, v[i]);
	nbd_put16(p, s->tx_flags);
	p[2] = s->flags;
	nbd_put32(p + 3, s->upgrades);
	nbd_put32(p + 7, s->min_block);
	nbd_put32(p + 11, s->pref_block);
	nbd_put32(p + 15, s->max_payload);
	nbd_put16(p + 19, (uint16_t)n);
	memcpy(p + 21, s->name, n);
	p += 21 + n;
	nbd_put32(p, s->pending_len);
	if (s->pending_len)
		memcpy(p + 4, s->pending, s->pending_len);
	p += 4 + s->pending_len;
	if (identity) {
		nbd_put64(p, s->offset);
		p[8] = (uint8_t)s->backend_kind;
		nbd_put64(p + 9, s->backend_dev);
		nbd_put64(p + 17, s->backend_ino);
		nbd_put16(p + 25, (uint16_t)b);
		memcpy(p + 27, s->backend, b);
	}
	return UPGRADE_RECORD_HEADER + length;
}

size_t upgrade_record_end(uint8_t *buf, uint32_t connections, uint32_t listeners)
{
	uint8_t *p = header(buf, UPGRADE_END, 8, 0);
	nbd_put32(p, connections);
	nbd_put32(p + 4, listeners);
	return UPGRADE_RECORD_HEADER + 8;
}

size_t upgrade_record_taken(uint8_t *buf, uint32_t connections, uint32_t closed, const char *why)
{
	if (closed > connections)
		return 0;
	size_t n = closed ? strnlen(why ? why : "", UPGRADE_MAX_TEXT) : 0;
	size_t length = closed ? 4 + 4 + 2 + n : 4;
	uint8_t *p = header(buf, UPGRADE_TAKEN, length, 0);
	nbd_put32(p, connections);
	if (closed) {
		nbd_put32(p + 4, closed);
		nbd_put16(p + 8, (uint16_t)n);
		if (n)
			memcpy(p + 10, why, n);
	}
	return UPGRADE_RECORD_HEADER + length;
}

size_t upgrade_record_commit(uint8_t *buf)
{
	header(buf, UPGRADE_COMMIT, 0, 0);
	return UPGRADE_RECORD_HEADER;
}

size_t upgrade_record_error(uint8_t *buf, const char *text)
{
	size_t n = strnlen(text, UPGRADE_MAX_TEXT);
	uint8_t *p = header(buf, UPGRADE_ERROR, n, 0);
	memcpy(p, text, n);
	return UPGRADE_RECORD_HEADER + n;
}
