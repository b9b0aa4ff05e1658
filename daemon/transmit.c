/*
 * daemon/transmit.c: the transmission phase, server side.
 *
 * transmit_step() takes one request off the input buffer: the header is
 * decoded and checked by proto/ (nbd_check_request, the one place that knows
 * the protocol's rules), a WRITE payload is moved into the request's own
 * buffer, and the request goes to the backend. Completions come back through
 * request_done() on the same thread, in any order, and each reply is queued
 * on the output buffer whole (header and payload together), so replies to
 * different requests never interleave on the wire.
 *
 * Read data is not copied again: the reply references the request buffer
 * (evbuffer_add_reference) and the buffer is freed when libevent has sent
 * it.
 *
 *   struct request            refs: 1 while the request is live
 *   +-----------+                   + 1 per output-buffer reference
 *   | hdr, io   |--buf-->[ data ... ]    freed at 0: buffer, then request,
 *   | extents   |                        then the connection reference
 *   +-----------+
 *
 * A payload that must not be acted on (a request that fails its checks) is
 * still consumed, by draining it as it arrives (conn->discard) without ever
 * allocating it, and then answered with the error.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/worker.h"

/* Largest extent a compact (32-bit) block status descriptor carries. */
#define COMPACT_EXTENT_MAX 0xfffff000u

struct request {
	struct conn *conn;
	struct nbd_request hdr;
	struct backend_io io;
	uint8_t *buf;
	size_t buf_len;
	unsigned refs;
	struct nbd_extent *extents;
	size_t n_extents;
};

static struct request *request_new(struct conn *c, const struct nbd_request *hdr, size_t buf_len,
				   size_t max_extents)
{
	struct request *r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	if (buf_len) {
		r->buf = malloc(buf_len);
		if (!r->buf)
			goto err;
	}
	if (max_extents) {
		r->extents = calloc(max_extents, sizeof(*r->extents));
		if (!r->extents)
			goto err;
	}
	r->conn = c;
	r->hdr = *hdr;
	r->buf_len = buf_len;
	r->refs = 1;
	r->io.extents = r->extents;
	r->io.max_extents = max_extents;
	conn_ref(c);
	c->inflight++;
	c->inflight_bytes += buf_len;
	return r;
err:
	free(r->buf);
	free(r);
	return NULL;
}

static void request_put(struct request *r)
{
	if (--r->refs > 0)
		return;
	struct conn *c = r->conn;
	c->inflight_bytes -= r->buf_len;
	free(r->buf);
	free(r->extents);
	free(r);
	/*
	 * No conn_update_reading() here: this may run inside libevent's drain
	 * of the output buffer. The write callback and request_done() do it.
	 */
	conn_unref(c);
}

static void request_buf_release(const void *data, size_t len, void *arg)
{
	(void)data;
	(void)len;
	request_put(arg);
}

/* Queue a chunk header (structured or extended form). */
static void add_chunk_header(struct conn *c, const struct nbd_request *req, uint16_t flags,
			     uint16_t type, uint64_t payload_length)
{
	if (!c->bev)
		return; /* killed while queueing an earlier chunk */
	uint8_t hdr[NBD_CHUNK_HEADER_MAX];
	size_t n = nbd_encode_chunk_header(hdr, c->extended, flags, type, req->cookie,
					   req->offset, payload_length);
	evbuffer_add(conn_output(c), hdr, n);
}

void reply_error(struct conn *c, const struct nbd_request *req, uint32_t error,
		 const char *message)
{
	log_debug("conn %llu: %s offset %llu length %llu -> %s (%s)", (unsigned long long)c->id,
		  nbd_cmd_name(req->type), (unsigned long long)req->offset,
		  (unsigned long long)req->length, nbd_err_name(error), message ? message : "");
	if (!c->bev)
		return;
	if (!c->structured) {
		uint8_t buf[NBD_SIMPLE_REPLY_SIZE];
		size_t n = nbd_encode_simple_reply(buf, req->cookie, error);
		evbuffer_add(conn_output(c), buf, n);
		return;
	}
	uint8_t payload[NBD_ERROR_CHUNK_FIXED_SIZE + 256];
	char msg[256];
	snprintf(msg, sizeof(msg), "%s", message ? message : "");
	size_t n = nbd_encode_error_chunk(payload, sizeof(payload), error, msg);
	add_chunk_header(c, req, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, n);
	evbuffer_add(conn_output(c), payload, n);
}

void reply_ok(struct conn *c, const struct nbd_request *req)
{
	if (!c->bev)
		return;
	if (!c->structured) {
		uint8_t buf[NBD_SIMPLE_REPLY_SIZE];
		size_t n = nbd_encode_simple_reply(buf, req->cookie, 0);
		evbuffer_add(conn_output(c), buf, n);
		return;
	}
	add_chunk_header(c, req, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, 0);
}

/* Reference len bytes of the request buffer from the output buffer. */
static void add_data_ref(struct request *r, size_t at, size_t len)
{
	if (!r->conn->bev)
		return;
	r->refs++;
	if (evbuffer_add_reference(conn_output(r->conn), r->buf + at, len, request_buf_release,
				   r) < 0) {
		r->refs--;
		conn_kill(r->conn, "out of memory queueing a reply");
	}
}

static void add_data_chunk(struct request *r, size_t at, size_t len, uint16_t flags)
{
	if (!r->conn->bev)
		return;
	uint8_t prefix[NBD_OFFSET_DATA_PREFIX_SIZE];
	add_chunk_header(r->conn, &r->hdr, flags, NBD_REPLY_TYPE_OFFSET_DATA,
			 NBD_OFFSET_DATA_PREFIX_SIZE + (uint64_t)len);
	nbd_encode_offset_data_prefix(prefix, r->hdr.offset + at);
	evbuffer_add(conn_output(r->conn), prefix, sizeof(prefix));
	add_data_ref(r, at, len);
}

static void add_hole_chunk(struct request *r, size_t at, size_t len, uint16_t flags)
{
	if (!r->conn->bev)
		return;
	uint8_t payload[NBD_OFFSET_HOLE_SIZE];
	add_chunk_header(r->conn, &r->hdr, flags, NBD_REPLY_TYPE_OFFSET_HOLE, sizeof(payload));
	nbd_encode_offset_hole(payload, r->hdr.offset + at, (uint32_t)len);
	evbuffer_add(conn_output(r->conn), payload, sizeof(payload));
}

/* Is [p, p + n) all zero bytes? (n >= 16; memcmp does the long stretch) */
static bool all_zero(const uint8_t *p, size_t n)
{
	static const uint8_t zero16[16];
	return memcmp(p, zero16, 16) == 0 && memcmp(p, p + 16, n - 16) == 0;
}

/*
 * A read reply: one simple reply, one data chunk (DF, or nothing sparse), or
 * runs of data and hole chunks, the last one flagged DONE. Holes are found
 * in the bytes just read, one export-aligned CONN_HOLE_GRANULE block at a
 * time (partial blocks at either end are data): zero blocks are what
 * the client would read, whatever the backend's allocation, and the test is
 * cheap for data (it stops at the first non-zero byte). Asking the file
 * system instead (SEEK_HOLE) costs a walk over every cached page on tmpfs.
 */
static void reply_read(struct request *r)
{
	struct conn *c = r->conn;
	size_t len = r->buf_len;
	if (len == 0) {
		/* A data chunk must carry at least one byte. */
		reply_ok(c, &r->hdr);
		return;
	}
	if (!c->structured) {
		uint8_t buf[NBD_SIMPLE_REPLY_SIZE];
		size_t n = nbd_encode_simple_reply(buf, r->hdr.cookie, 0);
		evbuffer_add(conn_output(c), buf, n);
		add_data_ref(r, 0, len);
		return;
	}
	if ((r->hdr.flags & NBD_CMD_FLAG_DF) || len < CONN_HOLE_GRANULE) {
		add_data_chunk(r, 0, len, NBD_REPLY_FLAG_DONE);
		return;
	}
	size_t pos = 0, run_start = 0;
	bool run_hole = false;
	while (pos < len) {
		/* Granules are aligned to the export, not to the request. */
		size_t n = CONN_HOLE_GRANULE - (size_t)((r->hdr.offset + pos) % CONN_HOLE_GRANULE);
		if (n > len - pos)
			n = len - pos;
		bool hole = n == CONN_HOLE_GRANULE && all_zero(r->buf + pos, n);
		if (pos > run_start && hole != run_hole) {
			if (run_hole)
				add_hole_chunk(r, run_start, pos - run_start, 0);
			else
				add_data_chunk(r, run_start, pos - run_start, 0);
			run_start = pos;
		}
		run_hole = hole;
		pos += n;
	}
	if (run_hole)
		add_hole_chunk(r, run_start, pos - run_start, NBD_REPLY_FLAG_DONE);
	else
		add_data_chunk(r, run_start, pos - run_start, NBD_REPLY_FLAG_DONE);
}

/*
 * Block status: the extents the backend found, cut to what the protocol
 * allows: one extent within the request for REQ_ONE; otherwise stop once
 * the request is covered; in compact form no extent above 32 bits, and
 * nothing after an extent that had to be shortened (extents are contiguous).
 */
static void reply_block_status(struct request *r)
{
	struct conn *c = r->conn;
	size_t n = 0;
	uint64_t covered = 0;
	bool req_one = r->hdr.flags & NBD_CMD_FLAG_REQ_ONE;
	for (size_t i = 0; i < r->n_extents; i++) {
		struct nbd_extent *e = &r->extents[n];
		*e = r->extents[i];
		bool cut = false;
		if (req_one && e->length > r->hdr.length)
			e->length = r->hdr.length, cut = true;
		if (!c->extended && e->length > COMPACT_EXTENT_MAX)
			e->length = COMPACT_EXTENT_MAX, cut = true;
		n++;
		covered += e->length;
		if (req_one || cut || covered >= r->hdr.length)
			break;
	}
	size_t size = nbd_block_status_size(c->extended, n);
	uint8_t *payload = malloc(size);
	if (!payload) {
		reply_error(c, &r->hdr, NBD_ENOMEM, "out of memory");
		return;
	}
	nbd_encode_block_status(payload, c->extended, CONN_META_CONTEXT_ID, r->extents, n);
	add_chunk_header(c, &r->hdr, NBD_REPLY_FLAG_DONE,
			 c->extended ? NBD_REPLY_TYPE_BLOCK_STATUS_EXT : NBD_REPLY_TYPE_BLOCK_STATUS,
			 size);
	evbuffer_add(conn_output(c), payload, size);
	free(payload);
}

/* Answer a request that nbd_check_request() refused, saying why in words. */
static void reply_refused(struct conn *c, const struct nbd_request *req, uint32_t error)
{
	const char *why;
	switch (error) {
	case NBD_EPERM:
		why = "the export is read-only";
		break;
	case NBD_ENOSPC:
		why = "the request goes past the end of the export";
		break;
	case NBD_EOVERFLOW:
		why = "the request is longer than the maximum payload";
		break;
	case NBD_ENOMEM:
		why = "out of memory";
		break;
	default:
		why = "the request is not valid here (command, flags, range or alignment)";
		break;
	}
	char msg[160];
	snprintf(msg, sizeof(msg), "%s: %s", nbd_cmd_name(req->type), why);
	reply_error(c, req, error, msg);
}

static void request_done(struct backend_io *io, int result)
{
	struct request *r = (struct request *)((char *)io - offsetof(struct request, io));
	struct conn *c = r->conn;
	if (c->bev) {
		if (result < 0) {
			char msg[128];
			snprintf(msg, sizeof(msg), "%s failed: %s", nbd_cmd_name(r->hdr.type),
				 strerror(-result));
			reply_error(c, &r->hdr, nbd_error_from_errno(-result), msg);
		} else if (r->hdr.type == NBD_CMD_READ) {
			reply_read(r);
		} else if (r->hdr.type == NBD_CMD_BLOCK_STATUS) {
			r->n_extents = io->n_extents;
			reply_block_status(r);
		} else {
			reply_ok(c, &r->hdr);
		}
	}
	conn_ref(c);
	c->inflight--;
	request_put(r);
	conn_update_reading(c);
	conn_unref(c);
}

/* Start the backend work for a checked request (payload already in r->buf). */
static void request_start(struct request *r)
{
	struct conn *c = r->conn;
	struct backend_io *io = &r->io;
	const struct nbd_request *h = &r->hdr;
	io->offset = h->offset;
	io->length = h->length;
	io->buf = r->buf;
	io->done = request_done;
	io->flags = (h->flags & NBD_CMD_FLAG_FUA) ? BACKEND_FUA : 0;
	switch (h->type) {
	case NBD_CMD_READ:
		io->cmd = BACKEND_READ;
		break;
	case NBD_CMD_WRITE:
		io->cmd = BACKEND_WRITE;
		io->length = r->buf_len;
		break;
	case NBD_CMD_FLUSH:
		io->cmd = BACKEND_FLUSH;
		break;
	case NBD_CMD_TRIM:
		io->cmd = BACKEND_TRIM;
		break;
	case NBD_CMD_WRITE_ZEROES:
		io->cmd = BACKEND_ZERO;
		if (h->flags & NBD_CMD_FLAG_NO_HOLE)
			io->flags |= BACKEND_NO_HOLE;
		if (h->flags & NBD_CMD_FLAG_FAST_ZERO)
			io->flags |= BACKEND_FAST_ONLY;
		break;
	case NBD_CMD_CACHE:
		io->cmd = BACKEND_CACHE;
		break;
	case NBD_CMD_BLOCK_STATUS:
		io->cmd = BACKEND_BLOCK_STATUS;
		break;
	}
	backend_submit(c->export->backend, &c->worker->ring, io);
}

/* Drop payload bytes of a refused request as they arrive; then answer it. */
static int discard_step(struct conn *c, struct evbuffer *in)
{
	size_t avail = evbuffer_get_length(in);
	size_t n = avail < c->discard ? avail : (size_t)c->discard;
	evbuffer_drain(in, n);
	c->discard -= n;
	if (c->discard)
		return 0;
	reply_refused(c, &c->discard_req, c->discard_error);
	return 1;
}

int transmit_step(struct conn *c)
{
	struct evbuffer *in = conn_input(c);
	if (c->discard)
		return discard_step(c, in);
	size_t hsize = nbd_request_header_size(c->extended);
	size_t avail = evbuffer_get_length(in);
	if (avail < hsize)
		return 0;
	uint8_t hbuf[NBD_EXTENDED_REQUEST_SIZE];
	struct nbd_request req;
	evbuffer_copyout(in, hbuf, hsize);
	if (nbd_decode_request(hbuf, hsize, c->extended, &req) < 0) {
		conn_kill(c, "bad request magic");
		return -1;
	}
	int verdict = nbd_check_request(&req, &c->session);
	if (verdict == NBD_CHECK_DISCONNECT) {
		conn_kill(c, "request payload above the maximum");
		return -1;
	}
	if (req.type == NBD_CMD_DISC && verdict == NBD_SUCCESS) {
		evbuffer_drain(in, hsize);
		log_debug("conn %llu: NBD_CMD_DISC", (unsigned long long)c->id);
		conn_begin_close(c);
		return -1;
	}
	if (verdict != NBD_SUCCESS) {
		evbuffer_drain(in, hsize);
		if (req.payload_length) {
			c->discard = req.payload_length;
			c->discard_req = req;
			c->discard_error = (uint32_t)verdict;
			return 1;
		}
		reply_refused(c, &req, (uint32_t)verdict);
		return 1;
	}
	if (req.payload_length && avail < hsize + req.payload_length)
		return 0; /* wait for the whole payload */

	size_t buf_len = 0, max_extents = 0;
	switch (req.type) {
	case NBD_CMD_READ:
		buf_len = (size_t)req.length;
		break;
	case NBD_CMD_WRITE:
		buf_len = (size_t)req.payload_length;
		break;
	case NBD_CMD_BLOCK_STATUS:
		max_extents = (req.flags & NBD_CMD_FLAG_REQ_ONE) ? 1 : CONN_MAX_EXTENTS;
		break;
	default:
		break;
	}
	evbuffer_drain(in, hsize);
	struct request *r = request_new(c, &req, buf_len, max_extents);
	if (!r) {
		if (req.payload_length) {
			c->discard = req.payload_length;
			c->discard_req = req;
			c->discard_error = NBD_ENOMEM;
			return 1;
		}
		reply_error(c, &req, NBD_ENOMEM, "out of memory");
		return 1;
	}
	if (req.payload_length)
		evbuffer_remove(in, r->buf, buf_len);
	log_debug("conn %llu: %s flags 0x%x offset %llu length %llu", (unsigned long long)c->id,
		  nbd_cmd_name(req.type), req.flags, (unsigned long long)req.offset,
		  (unsigned long long)req.length);
	request_start(r);
	return 1;
}
