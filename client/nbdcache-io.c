/*
 * nbdcache-io: nbdcached's own small NBD client.
 *
 * One connection, one command, blocking I/O, one request in flight. Every
 * byte on the wire is built or parsed by proto/nbd.h, so this program is a
 * second user of the codec the daemon relies on; the interop tests run it
 * against nbdcached and against qemu-nbd, an independent implementation.
 *
 * Negotiation: fixed newstyle; NBD_OPT_EXTENDED_HEADERS, falling back to
 * NBD_OPT_STRUCTURED_REPLY; NBD_OPT_SET_META_CONTEXT base:allocation when
 * block status is wanted; NBD_OPT_GO asking for block size, name and
 * description (NBD_OPT_EXPORT_NAME only if the server lacks GO).
 *
 * The client does not second-guess the server: out-of-range, unaligned or
 * unadvertised requests go out as asked, so tests see the server's answer.
 * It only splits what one request cannot carry: payloads beyond the maximum
 * payload size, and effect lengths beyond 32 bits in compact mode. What the
 * server sends back is checked strictly against the specification.
 *
 *   main -> negotiate -> haggle (one option exchange, every option)
 *        -> run_command -> run_range -> transact -> send_request
 *                                               -> receive_reply -> *_chunk
 *
 * Errors are 0 / -errno inside and are reported where detected. main() maps
 * them to the exit status: 0 success; 1 an NBD error from the server
 * (-EREMOTEIO) or a local failure; 2 a protocol violation by the server or a
 * lost connection (-EPROTO).
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "proto/nbd.h"

#define PROGRAM "nbdcache-io"
#define OPTION_PAYLOAD_MAX 65536u	      /* largest option reply or error chunk */
#define STATUS_PAYLOAD_MAX (8u + (16u << 21)) /* 2^21 extended descriptors */
#define COMPACT_LENGTH_MAX 0xffffffffu
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

struct client {
	int fd;
	bool debug;
	bool no_zeroes;
	bool structured; /* structured replies, or implied by extended headers */
	bool extended;
	bool meta; /* base:allocation selected, with id meta_id */
	uint32_t meta_id;
	bool have_export; /* NBD_OPT_GO delivered NBD_INFO_EXPORT */
	uint64_t size;
	uint16_t eflags;
	bool have_block_size;
	uint32_t min_block, preferred_block, max_block;
	uint32_t max_payload; /* what we put in one READ or WRITE */
	char name[NBD_MAX_STRING + 1], description[NBD_MAX_STRING + 1];
	uint64_t next_cookie;
	uint8_t payload[OPTION_PAYLOAD_MAX + 1]; /* option reply or error chunk */
};

/* One request and what its reply has delivered so far. */
struct transaction {
	const char *command; /* for messages: "read", "trim", ... */
	uint16_t type;
	uint16_t flags;
	uint64_t cookie, offset, length;
	uint8_t *data;	   /* READ: `length` bytes to fill */
	uint8_t *map;	   /* READ: one bit per byte delivered, to catch overlaps */
	uint64_t covered;  /* READ: bytes described by content chunks */
	unsigned statuses; /* BLOCK_STATUS: status chunks received */
	uint32_t error;	   /* first NBD error reported, 0 if none */
};

/* What each COMMAND does: how it runs and which NBD_CMD_FLAG_* it may add. */
enum run { RUN_INFO, RUN_LIST, RUN_ONCE, RUN_PAYLOAD, RUN_EFFECT, RUN_STATUS };
struct command {
	const char *name;
	uint16_t type;
	enum run run; /* RUN_PAYLOAD and later take OFF LEN */
	uint16_t flags;
};

static const struct command commands[] = {
    {"info", 0, RUN_INFO, 0},
    {"list", 0, RUN_LIST, 0},
    {"flush", NBD_CMD_FLUSH, RUN_ONCE, 0},
    {"read", NBD_CMD_READ, RUN_PAYLOAD, 0},
    {"write", NBD_CMD_WRITE, RUN_PAYLOAD, NBD_CMD_FLAG_FUA},
    {"trim", NBD_CMD_TRIM, RUN_EFFECT, NBD_CMD_FLAG_FUA},
    {"zero", NBD_CMD_WRITE_ZEROES, RUN_EFFECT,
     NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO},
    {"cache", NBD_CMD_CACHE, RUN_EFFECT, 0},
    {"status", NBD_CMD_BLOCK_STATUS, RUN_STATUS, NBD_CMD_FLAG_REQ_ONE},
};

struct args {
	const char *unix_path, *tcp, *export_name;
	const struct command *command;
	int no_extended, no_structured, meta, debug; /* set by getopt_long */
	uint16_t flags;
	uint64_t offset, length;
};

/* One line on stderr: "nbdcache-io: " PREFIX MESSAGE. */
static void report(const char *prefix, const char *fmt, va_list ap)
{
	fprintf(stderr, PROGRAM ": %s", prefix);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}

__attribute__((format(printf, 2, 3))) static void debugf(const struct client *c, const char *fmt,
							 ...)
{
	va_list ap;

	if (!c->debug)
		return;
	va_start(ap, fmt);
	report("", fmt, ap);
	va_end(ap);
}

/* Report a protocol violation by the server; the caller returns -EPROTO. */
__attribute__((format(printf, 1, 2))) static int violation(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	report("protocol error: ", fmt, ap);
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

/* Print a server-supplied string on one line, neutralising control bytes. */
static void print_safe(FILE *f, const void *s, size_t length)
{
	for (size_t i = 0; i < length; i++) {
		int ch = ((const unsigned char *)s)[i];
		fputc(isprint(ch) ? ch : '?', f);
	}
}

/* Plain I/O, all or nothing: 0 or -errno; -ENODATA when the input ends early. */
static int io_full(int fd, void *buf, size_t length, bool writing)
{
	uint8_t *p = buf;

	while (length) {
		ssize_t n = writing ? write(fd, p, length) : read(fd, p, length);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -ENODATA;
		p += n;
		length -= (size_t)n;
	}
	return 0;
}

/* Socket I/O: any failure is the connection's, reported as -EPROTO. */
static int receive(struct client *c, void *buf, size_t length)
{
	int err = io_full(c->fd, buf, length, false);

	if (err == -ENODATA)
		return violation("server closed the connection");
	return err ? violation("connection lost: %s", strerror(-err)) : 0;
}

static int transmit(struct client *c, const void *buf, size_t length)
{
	int err = io_full(c->fd, (void *)buf, length, true);

	return err ? violation("connection lost: %s", strerror(-err)) : 0;
}

/* A Unix socket PATH, or HOST:PORT where HOST may be a [bracketed] IPv6 address. */
static int connect_to(const char *unix_path, const char *spec)
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

static int send_option(struct client *c, uint32_t option, const void *data, uint32_t length)
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
typedef int take_reply(struct client *c, const struct nbd_option_reply *r);

/*
 * One option exchange, the shape every option we send shares: send it, then
 * read replies until NBD_REP_ACK or an error reply. Replies of type `info`
 * go to `take`; any other type is a violation. On return r holds the final
 * reply (its payload still in c->payload, for option_refused).
 */
static int haggle(struct client *c, uint32_t option, const void *data, uint32_t length,
		  uint32_t info, take_reply *take, struct nbd_option_reply *r)
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
		if (r->length > OPTION_PAYLOAD_MAX)
			return violation("option reply of %" PRIu32 " bytes", r->length);
		err = receive(c, c->payload, r->length);
		c->payload[r->length] = '\0';
		if (err || r->type == NBD_REP_ACK || (r->type & NBD_REP_FLAG_ERROR))
			return err;
		if (!take || r->type != info)
			return violation("unexpected %s to %s", nbd_rep_name(r->type),
					 nbd_opt_name(option));
		err = take(c, r);
	}
	return err;
}

/* Print an option error reply (and its message, if any) as a server error. */
static int option_refused(struct client *c, const struct nbd_option_reply *r)
{
	fprintf(stderr, PROGRAM ": %s: %s", nbd_opt_name(r->option), nbd_rep_name(r->type));
	if (r->length) {
		fputs(": ", stderr);
		print_safe(stderr, c->payload, r->length);
	}
	fputc('\n', stderr);
	return -EREMOTEIO;
}

/* NBD_REP_SERVER: one line, "NAME" or "NAME<TAB>DESCRIPTION". */
static int take_server(struct client *c, const struct nbd_option_reply *r)
{
	uint32_t name_length = r->length >= 4 ? nbd_get32(c->payload) : UINT32_MAX;

	if (name_length > r->length - 4)
		return violation("malformed NBD_REP_SERVER");
	print_safe(stdout, c->payload + 4, name_length);
	if (r->length - 4 > name_length) {
		putchar('\t');
		print_safe(stdout, c->payload + 4 + name_length, r->length - 4 - name_length);
	}
	putchar('\n');
	return 0;
}

static int list_exports(struct client *c)
{
	struct nbd_option_reply r;
	int err = haggle(c, NBD_OPT_LIST, NULL, 0, NBD_REP_SERVER, take_server, &r);

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

static int take_meta_context(struct client *c, const struct nbd_option_reply *r)
{
	static const char wanted[] = NBD_META_BASE_ALLOCATION;

	if (r->length < 4)
		return violation("NBD_REP_META_CONTEXT of %" PRIu32 " bytes", r->length);
	if (r->length - 4 == strlen(wanted) && memcmp(c->payload + 4, wanted, r->length - 4) == 0) {
		c->meta = true;
		c->meta_id = nbd_get32(c->payload);
	}
	return 0;
}

static int set_meta_context(struct client *c, const char *export_name)
{
	uint8_t data[4 + NBD_MAX_STRING + 8 + sizeof(NBD_META_BASE_ALLOCATION)];
	size_t length = put_name(data, export_name);
	struct nbd_option_reply r;
	int err;

	nbd_put32(data + length, 1);
	length += 4 + put_name(data + length + 4, NBD_META_BASE_ALLOCATION);
	err = haggle(c, NBD_OPT_SET_META_CONTEXT, data, (uint32_t)length, NBD_REP_META_CONTEXT,
		     take_meta_context, &r);
	if (!err && r.type != NBD_REP_ACK) {
		/* Contexts sent before an error do not count. */
		debugf(c, "meta context refused: %s", nbd_rep_name(r.type));
		c->meta = false;
	}
	return err;
}

/* Decode one NBD_REP_INFO payload into the client. Unknown types are ignored. */
static int take_info(struct client *c, const struct nbd_option_reply *r)
{
	const uint8_t *p = c->payload;
	uint32_t length = r->length;
	char *s;

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
static int export_name(struct client *c, const char *name)
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

static int go(struct client *c, const char *name)
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
	err = haggle(c, NBD_OPT_GO, data, (uint32_t)length, NBD_REP_INFO, take_info, &r);
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
static int simple_option(struct client *c, uint32_t option)
{
	struct nbd_option_reply r;
	int err = haggle(c, option, NULL, 0, 0, NULL, &r);

	return err ? err : r.type == NBD_REP_ACK;
}

static int negotiate(struct client *c, const struct args *a)
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
	err = transmit(c, buf, NBD_CLIENT_FLAGS_SIZE);
	if (err || a->command->run == RUN_LIST)
		return err ? err : list_exports(c);
	/* Extended headers imply structured replies: --no-structured excludes both. */
	if (!a->no_extended && !a->no_structured) {
		err = simple_option(c, NBD_OPT_EXTENDED_HEADERS);
		c->extended = c->structured = err > 0;
	}
	if (err >= 0 && !c->extended && !a->no_structured) {
		err = simple_option(c, NBD_OPT_STRUCTURED_REPLY);
		c->structured = err > 0;
	}
	if (err >= 0 && c->structured && (a->meta || a->command->run == RUN_STATUS))
		err = set_meta_context(c, a->export_name);
	if (err >= 0)
		err = go(c, a->export_name);
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

static int send_request(struct client *c, struct transaction *t, const void *payload)
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
static int receive_reply_header(struct client *c, struct nbd_reply *r)
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
static int error_chunk(struct client *c, struct transaction *t, const struct nbd_reply *r)
{
	uint8_t *p = c->payload; /* idle in transmission; large enough */
	uint32_t error;
	uint16_t message_length;
	int err;

	if (r->length < NBD_ERROR_CHUNK_FIXED_SIZE || r->length > OPTION_PAYLOAD_MAX)
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
		fprintf(stderr, PROGRAM ": %s: server says: ", t->command);
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
static int content_chunk(struct client *c, struct transaction *t, const struct nbd_reply *r)
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
static int status_chunk(struct client *c, struct transaction *t, const struct nbd_reply *r)
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
		else
			printf("%" PRIu64 " %" PRIu64 " %" PRIu64 "\n", offset, length, flags);
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
static int simple_reply(struct client *c, struct transaction *t, const struct nbd_reply *r)
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
static int receive_reply(struct client *c, struct transaction *t)
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

/* One request and its whole reply; an NBD error is reported here. */
static int transact(struct client *c, struct transaction *t, const void *payload)
{
	int err = send_request(c, t, payload);

	if (!err)
		err = receive_reply(c, t);
	if (!err && t->error) {
		fprintf(stderr, PROGRAM ": %s: %s\n", t->command, err_name(t->error));
		err = -EREMOTEIO;
	}
	return err;
}

/*
 * Every transmission command over [offset, offset + length): split into
 * requests of at most `step` bytes (always at least one request, so a zero
 * length, or FLUSH, reaches the server too). READ output goes to stdout,
 * WRITE input comes from stdin.
 */
static int run_range(struct client *c, struct transaction *t, uint64_t step)
{
	uint64_t offset = t->offset, done = 0, total = t->length;
	size_t buffer = total < step ? (size_t)total + 1 : (size_t)step;
	uint8_t *data = NULL, *map = NULL;
	int err = 0;

	if (t->type == NBD_CMD_READ || t->type == NBD_CMD_WRITE) {
		data = malloc(buffer);
		if (t->type == NBD_CMD_READ)
			map = malloc(buffer / 8 + 1);
		if (!data || (t->type == NBD_CMD_READ && !map)) {
			err = -ENOMEM;
			goto out;
		}
	}
	do {
		t->offset = offset + done;
		t->length = total - done < step ? total - done : step;
		t->data = data;
		t->map = map;
		t->covered = 0;
		if (map)
			memset(map, 0, (size_t)t->length / 8 + 1);
		if (t->type == NBD_CMD_WRITE) {
			err = io_full(STDIN_FILENO, data, (size_t)t->length, false);
			if (err) {
				fprintf(stderr, PROGRAM ": write: standard input: %s\n",
					err == -ENODATA ? "shorter than LEN" : strerror(-err));
				break;
			}
		}
		err = transact(c, t, t->type == NBD_CMD_WRITE ? data : NULL);
		if (!err && t->type == NBD_CMD_READ) {
			err = io_full(STDOUT_FILENO, data, (size_t)t->length, true);
			if (err)
				fprintf(stderr, PROGRAM ": read: standard output: %s\n",
					strerror(-err));
		}
		done += t->length;
	} while (!err && done < total);
out:
	free(map);
	free(data);
	return err;
}

static void print_info(const struct client *c, const struct args *a)
{
	static const char *const names[] = {
	    "HAS_FLAGS",	   "READ_ONLY",	  "SEND_FLUSH",	       "SEND_FUA",
	    "ROTATIONAL",	   "SEND_TRIM",	  "SEND_WRITE_ZEROES", "SEND_DF",
	    "CAN_MULTI_CONN",	   "SEND_RESIZE", "SEND_CACHE",	       "SEND_FAST_ZERO",
	    "BLOCK_STATUS_PAYLOAD"};
	const char *sep = "";

	printf("export=%s\nsize=%" PRIu64 "\neflags=0x%04x\neflags_names=", a->export_name, c->size,
	       c->eflags);
	for (unsigned bit = 0; bit < 16; bit++) {
		if (!(c->eflags >> bit & 1))
			continue;
		if (bit < ARRAY_SIZE(names))
			printf("%s%s", sep, names[bit]);
		else
			printf("%sbit%u", sep, bit);
		sep = ",";
	}
	printf("\nstructured=%d\nextended=%d\n", c->structured, c->extended);
	if (c->have_block_size)
		printf("block_size_minimum=%" PRIu32 "\nblock_size_preferred=%" PRIu32
		       "\nblock_size_maximum=%" PRIu32 "\n",
		       c->min_block, c->preferred_block, c->max_block);
	for (int i = 0; i < 2; i++) {
		const char *value = i ? c->description : c->name;
		if (!value[0])
			continue;
		fputs(i ? "description=" : "name=", stdout);
		print_safe(stdout, value, strlen(value));
		putchar('\n');
	}
	if (a->meta) {
		printf("meta_context=%s\n", c->meta ? NBD_META_BASE_ALLOCATION : "");
		if (c->meta)
			printf("meta_context_id=%" PRIu32 "\n", c->meta_id);
	}
}

/* Transmission phase: the command, then NBD_CMD_DISC. */
static int run_command(struct client *c, const struct args *a)
{
	const struct command *cmd = a->command;
	struct transaction t = {.command = cmd->name,
				.type = cmd->type,
				.flags = a->flags,
				.offset = a->offset,
				.length = a->length};
	/* In compact mode an effect length is 32 bits: split at an aligned bound. */
	uint64_t align = c->min_block > 4096 ? c->min_block : 4096;
	uint64_t effect_step = c->extended ? UINT64_MAX : COMPACT_LENGTH_MAX / align * align;
	int err = 0;

	if (cmd->run == RUN_INFO) {
		print_info(c, a);
	} else if (cmd->run == RUN_STATUS && !c->meta) {
		fprintf(stderr, PROGRAM ": status: no base:allocation context (%s)\n",
			c->structured ? "refused by the server" : "needs structured replies");
		err = -ENOTSUP;
	} else {
		/* Block status is one request: its length is a hint, so clamp it. */
		if (cmd->run == RUN_STATUS && t.length > effect_step)
			t.length = effect_step;
		err = run_range(c, &t, cmd->run == RUN_PAYLOAD ? c->max_payload : effect_step);
	}
	if (err != -EPROTO) {
		struct transaction disc = {.command = "disconnect", .type = NBD_CMD_DISC};
		int e = send_request(c, &disc, NULL);
		err = err ? err : e;
	}
	return err;
}

static void usage(FILE *f)
{
	fputs("usage: " PROGRAM " (--unix PATH | --tcp HOST:PORT) [--export NAME]\n"
	      "           [--no-extended] [--no-structured] [--meta] [--debug] COMMAND [ARGS]\n"
	      "commands: info | list | read OFF LEN | write OFF LEN (data on stdin)\n"
	      "          | trim OFF LEN [--fua] | zero OFF LEN [--fua] [--no-hole] [--fast]\n"
	      "          | flush | cache OFF LEN | status OFF LEN [--req-one]\n"
	      "OFF and LEN: decimal or 0x hex, optional suffix K M G T P E (powers of 1024)\n"
	      "exit status: 0 success, 1 NBD error or local failure, 2 protocol violation\n",
	      f);
}

/* Decimal or 0x hex, with an optional binary suffix; all 64 bits. */
static int parse_number(const char *s, uint64_t *out)
{
	static const char suffixes[] = "KMGTPE";
	const char *p = s, *suffix;
	int base = 10;
	unsigned shift = 0;
	unsigned long long value;
	char *end;

	if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
		base = 16;
		p += 2;
	}
	if (!(base == 16 ? isxdigit((unsigned char)*p) : isdigit((unsigned char)*p)))
		return -EINVAL;
	errno = 0;
	value = strtoull(p, &end, base);
	if (errno)
		return -errno;
	if (*end) {
		suffix = strchr(suffixes, toupper((unsigned char)*end));
		if (!suffix || end[1])
			return -EINVAL;
		shift = 10 * (unsigned)(suffix - suffixes + 1);
		if (value > (UINT64_MAX >> shift))
			return -ERANGE;
	}
	*out = (uint64_t)value << shift;
	return 0;
}

/* Options anywhere on the line; 0, or -EINVAL after printing why. */
static int parse_args(int argc, char **argv, struct args *a)
{
	enum { FLAG_OPTION = 1 << 16 }; /* getopt value of a command flag option */
	const struct option options[] = {
	    {"unix", required_argument, NULL, 'u'},
	    {"tcp", required_argument, NULL, 't'},
	    {"export", required_argument, NULL, 'e'},
	    {"no-extended", no_argument, &a->no_extended, 1},
	    {"no-structured", no_argument, &a->no_structured, 1},
	    {"meta", no_argument, &a->meta, 1},
	    {"debug", no_argument, &a->debug, 1},
	    {"fua", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_FUA},
	    {"no-hole", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_NO_HOLE},
	    {"fast", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_FAST_ZERO},
	    {"req-one", no_argument, NULL, FLAG_OPTION | NBD_CMD_FLAG_REQ_ONE},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	const char *name;
	int opt;

	a->export_name = "";
	while ((opt = getopt_long(argc, argv, "u:t:e:dh", options, NULL)) != -1) {
		if (opt == 'u')
			a->unix_path = optarg;
		else if (opt == 't')
			a->tcp = optarg;
		else if (opt == 'e')
			a->export_name = optarg;
		else if (opt == 'd')
			a->debug = 1;
		else if (opt == 'h') {
			usage(stdout);
			exit(0);
		} else if (opt & FLAG_OPTION)
			a->flags |= (uint16_t)opt;
		else if (opt != 0)
			return -EINVAL;
	}
	if (!a->unix_path == !a->tcp || optind >= argc || strlen(a->export_name) > NBD_MAX_STRING) {
		fputs(PROGRAM ": give one of --unix and --tcp, and a COMMAND\n", stderr);
		return -EINVAL;
	}
	name = argv[optind++];
	for (size_t i = 0; i < ARRAY_SIZE(commands); i++)
		if (strcmp(commands[i].name, name) == 0)
			a->command = &commands[i];
	if (!a->command) {
		fprintf(stderr, PROGRAM ": unknown command %s\n", name);
		return -EINVAL;
	}
	if (argc - optind != (a->command->run >= RUN_PAYLOAD ? 2 : 0) ||
	    (a->flags & ~a->command->flags)) {
		fprintf(stderr, PROGRAM ": %s: wrong arguments or flags\n", name);
		return -EINVAL;
	}
	if (optind < argc && (parse_number(argv[optind], &a->offset) != 0 ||
			      parse_number(argv[optind + 1], &a->length) != 0)) {
		fprintf(stderr, PROGRAM ": %s: bad number\n", name);
		return -EINVAL;
	}
	return 0;
}

int main(int argc, char **argv)
{
	static struct client c; /* large: holds the option payload buffer */
	struct args a = {0};
	int err;

	if (parse_args(argc, argv, &a) != 0) {
		usage(stderr);
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	c.debug = a.debug;
	c.next_cookie = 1;
	c.fd = connect_to(a.unix_path, a.tcp);
	if (c.fd < 0) {
		fprintf(stderr, PROGRAM ": connect %s: %s\n", a.unix_path ? a.unix_path : a.tcp,
			strerror(-c.fd));
		return 1;
	}
	err = negotiate(&c, &a);
	if (!err && a.command->run != RUN_LIST)
		err = run_command(&c, &a);
	close(c.fd);
	if (fflush(stdout) != 0 && !err) {
		fprintf(stderr, PROGRAM ": standard output: %s\n", strerror(errno));
		err = -EIO;
	}
	return err == 0 ? 0 : err == -EPROTO ? 2 : 1;
}
