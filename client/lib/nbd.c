/*
 * client/lib/nbd.c: the NBD client (see nbd.h).
 *
 * Requests go out as the caller sizes them (within c->max_payload and
 * nbd_client_max_effect for what one request can carry). Every reply is
 * read whole, chunk by chunk, before the next request goes out.
 *
 *   nbd_client_go -> haggle (one option exchange, every option)
 *   nbd_client_transact -> send_request
 *                       -> receive_reply -> receive_reply_header, *_chunk
 */
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/lib/io.h"
#include "client/lib/nbd.h"
#include "client/lib/report.h"
#include "proto/nbd.h"

#define STATUS_PAYLOAD_MAX (8u + (16u << 21)) /* 2^21 extended descriptors */
#define COMPACT_LENGTH_MAX 0xffffffffu
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

__attribute__((format(printf, 2, 3))) static void debugf(const struct nbd_client *c,
							 const char *fmt, ...)
{
	va_list ap;

	if (!c->debug)
		return;
	va_start(ap, fmt);
	report_v("", fmt, ap);
	va_end(ap);
}

/* Report a protocol violation by the server; the caller returns -EPROTO. */
__attribute__((format(printf, 1, 2))) static int violation(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	report_v("protocol error: ", fmt, ap);
	va_end(ap);
	return -EPROTO;
}

static const char *err_name(uint32_t error)
{
	static char unknown[32];
	const char *name = nbd_err_name(error);

	if (strncmp(name, "NBD_", 4) == 0)
		return name;
	snprintf(unknown, sizeof(unknown), "NBD_E? (%" PRIu32 ")", error);
	return unknown;
}

static const char *reply_type_name(uint16_t type)
{
	static const char *const names[] = {"NONE",   "OFFSET_DATA",  "OFFSET_HOLE",	 "type 3",
					    "type 4", "BLOCK_STATUS", "BLOCK_STATUS_EXT"};

	if (type < ARRAY_SIZE(names))
		return names[type];
	return type == NBD_REPLY_TYPE_ERROR	     ? "ERROR"
	       : type == NBD_REPLY_TYPE_ERROR_OFFSET ? "ERROR_OFFSET"
						     : "unknown type";
}

/* Socket I/O: any failure is the connection's, reported as -EPROTO. */
static int receive(struct nbd_client *c, void *buf, size_t length)
{
	int err = io_full(c->fd, buf, length, false);

	if (err == -ENODATA)
		return violation("server closed the connection");
	return err ? violation("connection lost: %s", strerror(-err)) : 0;
}

static int transmit(struct nbd_client *c, const void *buf, size_t length)
{
	int err = io_full(c->fd, (void *)buf, length, true);

	return err ? violation("connection lost: %s", strerror(-err)) : 0;
}

/* A Unix socket PATH, or HOST:PORT where HOST may be a [bracketed] IPv6 address. */
int nbd_client_connect(const char *unix_path, const char *spec)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
	struct addrinfo local = {.ai_family = AF_UNIX,
				 .ai_socktype = SOCK_STREAM,
				 .ai_addr = (struct sockaddr *)&addr,
				 .ai_addrlen = sizeof(addr)};
	struct addrinfo *list = &local, *ai;
	const char *colon = spec ? strrchr(spec, ':') : NULL;
	char host[256];
	size_t host_length;
	int fd = -EINVAL, one = 1;

	if (unix_path) {
		if (strlen(unix_path) >= sizeof(addr.sun_path))
			return -ENAMETOOLONG;
		strcpy(addr.sun_path, unix_path);
	} else {
		if (!colon || colon == spec || !colon[1])
			return -EINVAL;
		host_length = (size_t)(colon - spec);
		if (spec[0] == '[' && colon[-1] == ']') {
			spec++;
			host_length -= 2;
		}
		if (host_length >= sizeof(host))
			return -ENAMETOOLONG;
		memcpy(host, spec, host_length);
		host[host_length] = '\0';
		if (getaddrinfo(host, colon + 1, &hints, &list) != 0)
			return -EHOSTUNREACH;
	}
	for (ai = list; ai; ai = ai->ai_next) {
		fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
		if (fd < 0) {
			fd = -errno;
			continue;
		}
		if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
			break;
		close(fd);
		fd = -errno;
	}
	if (list != &local)
		freeaddrinfo(list);
	if (fd >= 0 && !unix_path)
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	return fd;
}

/* ---- Option haggling. ---- */

static int send_option(struct nbd_client *c, uint32_t option, const void *data, uint32_t length)
{
	uint8_t header[NBD_OPTION_HEADER_SIZE];
	int err;

	debugf(c, "-> %s length=%" PRIu32, nbd_opt_name(option), length);
	nbd_encode_option(header, option, length);
	err = transmit(c, header, sizeof(header));
	if (!err && length)
		err = transmit(c, data, length);
	return err;
}

/* Handles one informational reply (payload NUL-terminated in c->payload). */
typedef int take_reply(struct nbd_client *c, const struct nbd_option_reply *r, void *opaque);

/*
 * One option exchange, the shape every option we send shares: send it, then
 * read replies until NBD_REP_ACK or an error reply. Replies of type `info`
 * go to `take` (with `opaque`); any other type is a violation. On return r holds the final
 * reply (its payload still in c->payload, for option_refused).
 */
static int haggle(struct nbd_client *c, uint32_t option, const void *data, uint32_t length,
		  uint32_t info, take_reply *take, void *opaque, struct nbd_option_reply *r)
{
	uint8_t header[NBD_OPTION_REPLY_HEADER_SIZE];
	int err = send_option(c, option, data, length);

	while (!err) {
		err = receive(c, header, sizeof(header));
		if (err)
			return err;
		if (nbd_decode_option_reply(header, sizeof(header), r) != 0)
			return violation("bad option reply magic");
		debugf(c, "<- %s %s length=%" PRIu32, nbd_opt_name(r->option),
		       nbd_rep_name(r->type), r->length);
		if (r->option != option)
			return violation("reply to %s while %s was pending",
					 nbd_opt_name(r->option), nbd_opt_name(option));
		if (r->length > NBD_CLIENT_PAYLOAD_MAX)
			return violation("option reply of %" PRIu32 " bytes", r->length);
		err = receive(c, c->payload, r->length);
		c->payload[r->length] = '\0';
		if (err || r->type == NBD_REP_ACK || (r->type & NBD_REP_FLAG_ERROR))
			return err;
		if (!take || r->type != info)
			return violation("unexpected %s to %s", nbd_rep_name(r->type),
					 nbd_opt_name(option));
		err = take(c, r, opaque);
	}
	return err;
}

/* Print an option error reply (and its message, if any) as a server error. */
static int option_refused(struct nbd_client *c, const struct nbd_option_reply *r)
{
	fprintf(stderr, "%s: %s: %s", report_program(), nbd_opt_name(r->option),
		nbd_rep_name(r->type));
	if (r->length) {
		fputs(": ", stderr);
		print_safe(stderr, c->payload, r->length);
	}
	fputc('\n', stderr);
	return -EREMOTEIO;
}

/* Where NBD_REP_SERVER replies go. */
struct list_sink {
	nbd_list_entry *entry;
	void *opaque;
};

/* NBD_REP_SERVER: a name, then (the rest of the payload) a description. */
static int take_server(struct nbd_client *c, const struct nbd_option_reply *r, void *opaque)
{
	const struct list_sink *sink = opaque;
	if (r->length < 4)
		return violation("malformed NBD_REP_SERVER");
	uint32_t name_length = nbd_get32(c->payload);

	if (name_length > r->length - 4)
		return violation("malformed NBD_REP_SERVER");
	sink->entry(sink->opaque, (const char *)c->payload + 4, name_length,
		    (const char *)c->payload + 4 + name_length, r->length - 4 - name_length);
	return 0;
}

int nbd_client_list(struct nbd_client *c, nbd_list_entry *entry, void *opaque)
{
	struct list_sink sink = {.entry = entry, .opaque = opaque};
	struct nbd_option_reply r;
	int err = haggle(c, NBD_OPT_LIST, NULL, 0, NBD_REP_SERVER, take_server, &sink, &r);

	if (!err && r.type != NBD_REP_ACK)
		return option_refused(c, &r);
	/* The server may acknowledge NBD_OPT_ABORT or just close: either will do. */
	if (!err && send_option(c, NBD_OPT_ABORT, NULL, 0) == 0)
		(void)io_full(c->fd, c->payload, NBD_OPTION_REPLY_HEADER_SIZE, false);
	return err;
}

/* Export name followed by a 32-bit length prefix, as GO and META options want. */
static size_t put_name(uint8_t *p, const char *name)
{
	uint32_t length = (uint32_t)strlen(name);

	nbd_put32(p, length);
	memcpy(p + 4, name, length);
	return 4 + length;
}

static int take_meta_context(struct nbd_client *c, const struct nbd_option_reply *r, void *opaque)
{
	static const char wanted[] = NBD_META_BASE_ALLOCATION;

	(void)opaque;
	if (r->length < 4)
		return violation("NBD_REP_META_CONTEXT of %" PRIu32 " bytes", r->length);
	if (r->length - 4 == strlen(wanted) && memcmp(c->payload + 4, wanted, r->length - 4) == 0) {
		c->meta = true;
		c->meta_id = nbd_get32(c->payload);
	}
	return 0;
}

static int set_meta_context(struct nbd_client *c, const char *export_name)
{
	uint8_t data[4 + NBD_MAX_STRING + 8 + sizeof(NBD_META_BASE_ALLOCATION)];
	size_t length = put_name(data, export_name);
	struct nbd_option_reply r;
	int err;

	nbd_put32(data + length, 1);
	length += 4 + put_name(data + length + 4, NBD_META_BASE_ALLOCATION);
	err = haggle(c, NBD_OPT_SET_META_CONTEXT, data, (uint32_t)length, NBD_REP_META_CONTEXT,
		     take_meta_context, NULL, &r);
	if (!err && r.type != NBD_REP_ACK) {
		/* Contexts sent before an error do not count. */
		debugf(c, "meta context refused: %s", nbd_rep_name(r.type));
		c->meta = false;
	}
	return err;
}

/* Decode one NBD_REP_INFO payload into the client. Unknown types are ignored. */
static int take_info(struct nbd_client *c, const struct nbd_option_reply *r, void *opaque)
{
	const uint8_t *p = c->payload;
	uint32_t length = r->length;
	char *s;

	(void)opaque;
	if (length < 2)
		return violation("NBD_REP_INFO without a type");
	switch (nbd_get16(p)) {
	case NBD_INFO_EXPORT:
		if (length != NBD_INFO_EXPORT_SIZE)
			return violation("NBD_INFO_EXPORT of %" PRIu32 " bytes", length);
		c->size = nbd_get64(p + 2);
		c->eflags = nbd_get16(p + 10);
		c->have_export = true;
		break;
	case NBD_INFO_NAME:
	case NBD_INFO_DESCRIPTION:
		if (length - 2 > NBD_MAX_STRING)
			return violation("NBD_INFO string of %" PRIu32 " bytes", length - 2);
		s = nbd_get16(p) == NBD_INFO_NAME ? c->name : c->description;
		memcpy(s, p + 2, length - 2);
		s[length - 2] = '\0';
		break;
	case NBD_INFO_BLOCK_SIZE:
		if (length != NBD_INFO_BLOCK_SIZE_SIZE)
			return violation("NBD_INFO_BLOCK_SIZE of %" PRIu32 " bytes", length);
		c->have_block_size = true;
		c->min_block = nbd_get32(p + 2);
		c->preferred_block = nbd_get32(p + 6);
		c->max_block = nbd_get32(p + 10);
		break;
	}
	return 0;
}

/* The fallback for servers without NBD_OPT_GO: no errors, no block sizes. */
static int export_name(struct nbd_client *c, const char *name)
{
	uint8_t reply[NBD_EXPORT_NAME_REPLY_SIZE];
	int err = send_option(c, NBD_OPT_EXPORT_NAME, name, (uint32_t)strlen(name));

	if (!err)
		err = receive(c, reply,
			      c->no_zeroes ? NBD_EXPORT_NAME_REPLY_SHORT_SIZE : sizeof(reply));
	if (err)
		return err;
	c->size = nbd_get64(reply);
	c->eflags = nbd_get16(reply + 8);
	return 0;
}

static int go(struct nbd_client *c, const char *name)
{
	static const uint16_t wanted[] = {NBD_INFO_BLOCK_SIZE, NBD_INFO_NAME, NBD_INFO_DESCRIPTION};
	uint8_t data[4 + NBD_MAX_STRING + 2 + sizeof(wanted)];
	size_t length = put_name(data, name);
	struct nbd_option_reply r;
	int err;

	nbd_put16(data + length, ARRAY_SIZE(wanted));
	length += 2;
	for (size_t i = 0; i < ARRAY_SIZE(wanted); i++, length += 2)
		nbd_put16(data + length, wanted[i]);
	err = haggle(c, NBD_OPT_GO, data, (uint32_t)length, NBD_REP_INFO, take_info, NULL, &r);
	if (err)
		return err;
	if (r.type == NBD_REP_ERR_UNSUP && !c->extended)
		return export_name(c, name);
	if (r.type != NBD_REP_ACK)
		return option_refused(c, &r);
	if (!c->have_export)
		return violation("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT");
	return 0;
}

/* An option with no data answered by ACK or an error: 1 if acknowledged. */
static int simple_option(struct nbd_client *c, uint32_t option)
{
	struct nbd_option_reply r;
	int err = haggle(c, option, NULL, 0, 0, NULL, NULL, &r);

	return err ? err : r.type == NBD_REP_ACK;
}

void nbd_client_init(struct nbd_client *c, int fd, bool debug)
{
	memset(c, 0, sizeof(*c));
	c->fd = fd;
	c->debug = debug;
	c->next_cookie = 1;
}

int nbd_client_handshake(struct nbd_client *c)
{
	uint8_t buf[NBD_GREETING_SIZE];
	uint16_t flags;
	int err = receive(c, buf, sizeof(buf));

	if (err)
		return err;
	if (nbd_decode_greeting(buf, sizeof(buf), &flags) != 0)
		return violation("not a newstyle NBD greeting");
	if (!(flags & NBD_FLAG_FIXED_NEWSTYLE))
		return violation("server does not offer fixed newstyle negotiation");
	c->no_zeroes = flags & NBD_FLAG_NO_ZEROES;
	nbd_encode_client_flags(buf, NBD_FLAG_C_FIXED_NEWSTYLE |
					 (c->no_zeroes ? NBD_FLAG_C_NO_ZEROES : 0));
	return transmit(c, buf, NBD_CLIENT_FLAGS_SIZE);
}

int nbd_client_go(struct nbd_client *c, const struct nbd_client_options *o)
{
	int err = 0;

	/* Extended headers imply structured replies: no_structured excludes both. */
	if (!o->no_extended && !o->no_structured) {
		err = simple_option(c, NBD_OPT_EXTENDED_HEADERS);
		c->extended = c->structured = err > 0;
	}
	if (err >= 0 && !c->extended && !o->no_structured) {
		err = simple_option(c, NBD_OPT_STRUCTURED_REPLY);
		c->structured = err > 0;
	}
	if (err >= 0 && c->structured && o->meta)
		err = set_meta_context(c, o->export_name);
	if (err >= 0)
		err = go(c, o->export_name);
	if (err)
		return err;
	/* One READ or WRITE carries at most 32 MiB, aligned to the minimum block. */
	c->max_payload = NBD_DEFAULT_MAX_PAYLOAD;
	if (c->have_block_size && c->max_block && c->max_block < c->max_payload)
		c->max_payload = c->max_block;
	if (c->have_block_size && c->min_block > 1 && c->max_payload > c->min_block)
		c->max_payload -= c->max_payload % c->min_block;
	return 0;
}

/* ---- Transmission. ---- */

static int send_request(struct nbd_client *c, struct nbd_transaction *t, const void *payload)
{
	uint8_t header[NBD_EXTENDED_REQUEST_SIZE];
	struct nbd_request req = {
	    .flags = t->flags,
	    .type = t->type,
	    .cookie = t->cookie = c->next_cookie++,
	    .offset = t->offset,
	    .length = t->length,
	    .payload_length = payload ? t->length : 0,
	};
	int err;

	if (payload && c->extended)
		req.flags |= NBD_CMD_FLAG_PAYLOAD_LEN;
	debugf(c, "-> %s flags=0x%x offset=%" PRIu64 " length=%" PRIu64 " cookie=%" PRIu64,
	       nbd_cmd_name(req.type), req.flags, req.offset, req.length, req.cookie);
	err = transmit(c, header, nbd_encode_request(header, c->extended, &req));
	if (!err && payload)
		err = transmit(c, payload, (size_t)t->length);
	return err;
}

/*
 * The magic says how long a header is; reading the 16 bytes every header
 * has first lets a wrong magic be reported at once instead of waiting for
 * bytes that never come.
 */
static int receive_reply_header(struct nbd_client *c, struct nbd_reply *r)
{
	uint8_t buf[NBD_CHUNK_HEADER_MAX];
	size_t full = c->extended ? NBD_EXTENDED_REPLY_SIZE : NBD_STRUCTURED_REPLY_SIZE;
	int err = receive(c, buf, NBD_SIMPLE_REPLY_SIZE);

	if (err)
		return err;
	err = nbd_decode_reply(buf, NBD_SIMPLE_REPLY_SIZE, c->extended, r);
	if (err == -EAGAIN) {
		err = receive(c, buf + NBD_SIMPLE_REPLY_SIZE, full - NBD_SIMPLE_REPLY_SIZE);
		if (err)
			return err;
		err = nbd_decode_reply(buf, full, c->extended, r);
	}
	if (err)
		return violation("bad reply magic 0x%08" PRIx32, nbd_get32(buf));
	if (!c->structured && r->magic != NBD_SIMPLE_REPLY_MAGIC)
		return violation("reply magic 0x%08" PRIx32 " not negotiated", r->magic);
	debugf(c, "<- %s flags=0x%x error=%" PRIu32 " offset=%" PRIu64 " length=%" PRIu64,
	       r->magic == NBD_SIMPLE_REPLY_MAGIC ? "simple" : reply_type_name(r->type), r->flags,
	       r->error, r->offset, r->length);
	return 0;
}

/* An error chunk: remember the first error and show the server's message. */
static int error_chunk(struct nbd_client *c, struct nbd_transaction *t, const struct nbd_reply *r)
{
	uint8_t *p = c->payload; /* idle in transmission; large enough */
	uint32_t error;
	uint16_t message_length;
	int err;

	if (r->length < NBD_ERROR_CHUNK_FIXED_SIZE || r->length > NBD_CLIENT_PAYLOAD_MAX)
		return violation("error chunk of %" PRIu64 " bytes", r->length);
	err = receive(c, p, (size_t)r->length);
	if (err)
		return err;
	error = nbd_get32(p);
	message_length = nbd_get16(p + 4);
	if (error == 0 || message_length > r->length - NBD_ERROR_CHUNK_FIXED_SIZE ||
	    (r->type == NBD_REPLY_TYPE_ERROR_OFFSET &&
	     r->length - NBD_ERROR_CHUNK_FIXED_SIZE - message_length != 8))
		return violation("malformed %s chunk", reply_type_name(r->type));
	if (message_length) {
		fprintf(stderr, "%s: %s: server says: ", report_program(), t->command);
		print_safe(stderr, p + NBD_ERROR_CHUNK_FIXED_SIZE, message_length);
		fputc('\n', stderr);
	}
	if (!t->error)
		t->error = error;
	return 0;
}

/*
 * Mark bytes [from, from + n) of a READ as delivered; false if any already
 * was. Content chunks must not overlap, and with overlap ruled out, bytes
 * delivered == bytes requested means no gap is left unfilled.
 */
static bool claim(uint8_t *map, uint64_t from, uint64_t n)
{
	for (uint64_t i = from, end = from + n; i < end;) {
		if (i % 8 == 0 && end - i >= 8) {
			if (map[i / 8])
				return false;
			map[i / 8] = 0xff;
			i += 8;
		} else {
			if (map[i / 8] & (1u << (i % 8)))
				return false;
			map[i / 8] |= (uint8_t)(1u << (i % 8));
			i++;
		}
	}
	return true;
}

/* OFFSET_DATA or OFFSET_HOLE: must lie inside the request, is copied in place. */
static int content_chunk(struct nbd_client *c, struct nbd_transaction *t, const struct nbd_reply *r)
{
	uint8_t prefix[NBD_OFFSET_HOLE_SIZE];
	bool hole = r->type == NBD_REPLY_TYPE_OFFSET_HOLE;
	uint64_t offset, length;
	int err;

	if (t->type != NBD_CMD_READ ||
	    (hole ? r->length != NBD_OFFSET_HOLE_SIZE : r->length <= NBD_OFFSET_DATA_PREFIX_SIZE))
		return violation("%s chunk of %" PRIu64 " bytes to %s", reply_type_name(r->type),
				 r->length, nbd_cmd_name(t->type));
	err = receive(c, prefix, hole ? NBD_OFFSET_HOLE_SIZE : NBD_OFFSET_DATA_PREFIX_SIZE);
	if (err)
		return err;
	offset = nbd_get64(prefix);
	length = hole ? nbd_get32(prefix + 8) : r->length - NBD_OFFSET_DATA_PREFIX_SIZE;
	debugf(c, "   %s offset=%" PRIu64 " length=%" PRIu64, reply_type_name(r->type), offset,
	       length);
	if (length == 0 || offset < t->offset || offset - t->offset > t->length ||
	    length > t->length - (offset - t->offset))
		return violation("%s [%" PRIu64 ", +%" PRIu64 ") outside the request",
				 reply_type_name(r->type), offset, length);
	if (!claim(t->map, offset - t->offset, length))
		return violation("%s [%" PRIu64 ", +%" PRIu64 ") overlaps an earlier chunk",
				 reply_type_name(r->type), offset, length);
	t->covered += length;
	if (hole) {
		memset(t->data + (offset - t->offset), 0, (size_t)length);
		return 0;
	}
	return receive(c, t->data + (offset - t->offset), (size_t)length);
}

/*
 * A status chunk: print "offset length flags" per extent. Checks the rules
 * a client can rely on: the right chunk type for the mode, our context, at
 * least one extent, no zero lengths, 32-bit base:allocation flags; with
 * REQ_ONE exactly one extent not longer than the request, otherwise only
 * the last extent may reach the end of the request (or go beyond it).
 */
static int status_chunk(struct nbd_client *c, struct nbd_transaction *t, const struct nbd_reply *r)
{
	size_t prefix =
	    c->extended ? NBD_BLOCK_STATUS_EXT_PREFIX_SIZE : NBD_BLOCK_STATUS_PREFIX_SIZE;
	size_t size = c->extended ? NBD_BLOCK_DESC_EXT_SIZE : NBD_BLOCK_DESC_SIZE;
	bool req_one = t->flags & NBD_CMD_FLAG_REQ_ONE;
	uint64_t offset = t->offset, sum = 0;
	const char *bad = NULL;
	size_t count;
	uint8_t *p;
	int err;

	if (t->type != NBD_CMD_BLOCK_STATUS ||
	    r->type !=
		(c->extended ? NBD_REPLY_TYPE_BLOCK_STATUS_EXT : NBD_REPLY_TYPE_BLOCK_STATUS))
		return violation("%s chunk to %s", reply_type_name(r->type), nbd_cmd_name(t->type));
	if (r->length < prefix + size || (r->length - prefix) % size ||
	    r->length > STATUS_PAYLOAD_MAX)
		return violation("%s chunk of %" PRIu64 " bytes", reply_type_name(r->type),
				 r->length);
	count = ((size_t)r->length - prefix) / size;
	p = malloc((size_t)r->length);
	if (!p)
		return -ENOMEM;
	err = receive(c, p, (size_t)r->length);
	if (err)
		goto out;
	if (nbd_get32(p) != c->meta_id)
		bad = "unknown context id";
	else if (c->extended && nbd_get32(p + 4) != count)
		bad = "descriptor count does not match the length";
	else if (req_one && count != 1)
		bad = "several extents despite NBD_CMD_FLAG_REQ_ONE";
	for (size_t i = 0; !bad && i < count; i++) {
		const uint8_t *d = p + prefix + i * size;
		uint64_t length = c->extended ? nbd_get64(d) : nbd_get32(d);
		uint64_t flags = c->extended ? nbd_get64(d + 8) : nbd_get32(d + 4);
		/* sum < t->length holds here, so t->length - sum cannot wrap. */
		if (length == 0 || (flags >> 32) != 0)
			bad = "zero extent length or 64-bit base:allocation flags";
		else if (i + 1 < count ? length >= t->length - sum : req_one && length > t->length)
			bad = "extents reach beyond the request";
		else if (t->extent)
			t->extent(t->opaque, offset, length, flags);
		offset += length;
		sum += length;
	}
	t->statuses++;
	if (bad)
		err = violation("%s chunk: %s", reply_type_name(r->type), bad);
out:
	free(p);
	return err;
}

/* A simple reply: the whole answer in one header (and READ data, if no error). */
static int simple_reply(struct nbd_client *c, struct nbd_transaction *t, const struct nbd_reply *r)
{
	if (c->structured && t->type == NBD_CMD_READ)
		return violation("simple reply to NBD_CMD_READ");
	if (r->error) {
		t->error = r->error;
		return 0;
	}
	if (t->type == NBD_CMD_BLOCK_STATUS)
		return violation("simple reply to a successful block status");
	t->covered = t->length;
	return t->type == NBD_CMD_READ ? receive(c, t->data, (size_t)t->length) : 0;
}

/* Receive every chunk of the reply to `t` (or its simple reply). */
static int receive_reply(struct nbd_client *c, struct nbd_transaction *t)
{
	struct nbd_reply r;
	int err;

	do {
		err = receive_reply_header(c, &r);
		if (err)
			return err;
		if (r.cookie != t->cookie)
			return violation("reply cookie %" PRIu64 ", expected %" PRIu64, r.cookie,
					 t->cookie);
		if (r.magic == NBD_SIMPLE_REPLY_MAGIC)
			return simple_reply(c, t, &r);
		if (c->extended && r.offset != t->offset)
			return violation("reply offset %" PRIu64 ", request offset %" PRIu64,
					 r.offset, t->offset);
		switch (r.type) {
		case NBD_REPLY_TYPE_NONE:
			if (r.length || !(r.flags & NBD_REPLY_FLAG_DONE))
				return violation("NONE chunk with length or without DONE");
			break;
		case NBD_REPLY_TYPE_OFFSET_DATA:
		case NBD_REPLY_TYPE_OFFSET_HOLE:
			err = content_chunk(c, t, &r);
			break;
		case NBD_REPLY_TYPE_BLOCK_STATUS:
		case NBD_REPLY_TYPE_BLOCK_STATUS_EXT:
			err = status_chunk(c, t, &r);
			break;
		default:
			if (!NBD_REPLY_TYPE_IS_ERR(r.type))
				return violation("unknown chunk type %u", r.type);
			err = error_chunk(c, t, &r);
		}
		if (err)
			return err;
	} while (!(r.flags & NBD_REPLY_FLAG_DONE));
	if (t->error)
		return 0;
	if (t->type == NBD_CMD_READ && t->covered != t->length)
		return violation("read reply covers %" PRIu64 " of %" PRIu64 " bytes", t->covered,
				 t->length);
	if (t->type == NBD_CMD_BLOCK_STATUS && t->statuses != 1)
		return violation("%u status chunks for one context", t->statuses);
	return 0;
}

int nbd_client_transact(struct nbd_client *c, struct nbd_transaction *t, const void *payload)
{
	int err;

	t->covered = 0;
	t->statuses = 0;
	t->error = 0;
	if (t->map)
		memset(t->map, 0, (size_t)t->length / 8 + 1);
	err = send_request(c, t, payload);
	if (!err)
		err = receive_reply(c, t);
	if (!err && t->error) {
		report("%s: %s", t->command, err_name(t->error));
		err = -EREMOTEIO;
	}
	return err;
}

int nbd_client_disconnect(struct nbd_client *c)
{
	struct nbd_transaction disc = {.command = "disconnect", .type = NBD_CMD_DISC};

	return send_request(c, &disc, NULL);
}

uint64_t nbd_client_max_effect(const struct nbd_client *c)
{
	uint64_t align = c->min_block > 4096 ? c->min_block : 4096;

	return c->extended ? UINT64_MAX : COMPACT_LENGTH_MAX / align * align;
}
