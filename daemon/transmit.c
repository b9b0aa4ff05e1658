/*
 * daemon/transmit.c: the transmission phase, server side.
 *
 * transmit_step() takes one request off the input buffer: the header is
 * decoded and checked by proto/ (nbd_check_request, the one place that knows
 * the protocol's rules), a WRITE payload is moved into the request's own
 * buffer, and the request goes to the cache (cache_submit, in every cache
 * mode: in mode none the cache passes it to the backend as it is).
 * Completions come back through request_cache_done() on the same thread, in
 * any order, and each reply is queued
 * on the output buffer whole (header and payload together), so replies to
 * different requests never interleave on the wire.
 *
 * Read data is not copied again: the reply references the op's data
 * (cache_op_segment: the arena, or in mode none the op's own buffer;
 * evbuffer_add_reference), and is freed or unpinned when libevent has sent
 * it. The arena bytes unsent replies pin
 * are bounded daemon-wide (budget_pin, --max-pinned-replies): past that, a
 * cached read's data is copied into the request's own buffer and the cache
 * op released at once, so slow readers never hold the cache still.
 *
 * Each request is admitted against the daemon-wide budget (conn_admit)
 * for what it costs (request_cost) before it is read, payload included; it
 * gives that reservation back once its reply is queued, where the output
 * buffer's count takes over. A request's life and references: struct
 * request, drawn in transmit_internal.h.
 *
 * A WRITE's payload is received by transmit_receive.c (receive_write):
 * straight into the cache's arena where it can be, else into a buffer of
 * the request's.
 *
 * Between admission and the cache stand the export's QoS limits
 * (transmit_throttle.c, throttle_submit): a request over them waits there,
 * in order, holding nothing of the cache; with no limit set it goes
 * straight on.
 *
 * A payload that must not be acted on (a request that fails its checks) is
 * still consumed, by draining it as it arrives (conn->discard) without ever
 * allocating it, and then answered with the error.
 */
#include "daemon/transmit.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "daemon/budget.h"
#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/transmit_internal.h"
#include "daemon/worker.h"

/* Copies of cached read data this large are mmap'd (request_copy_out). */
#define COPY_MMAP_MIN (1u << 20)

/* Largest extent a compact (32-bit) block status descriptor carries. */
#define COMPACT_EXTENT_MAX 0xfffff000u

/*
 * What a request may hold from when it is read until it is answered: the
 * request itself, its data (READ and WRITE lengths; a CACHE fills its
 * length of the cache, counted up to the maximum payload: with extended
 * headers it may name a terabyte, which no budget could admit), its
 * extents and the block status reply they make. Counted per connection
 * (CONN_MAX_INFLIGHT_BYTES) and daemon-wide; never above the maximum
 * payload and a little, so a request always fits an empty budget.
 */
static uint64_t request_cost(const struct conn *c, const struct nbd_request *req,
			     size_t max_extents)
{
	uint64_t cost = sizeof(struct request);
	switch (req->type) {
	case NBD_CMD_READ:
		cost += req->length;
		break;
	case NBD_CMD_CACHE:
		cost += req->length < c->session.max_payload ? req->length : c->session.max_payload;
		break;
	case NBD_CMD_WRITE:
		cost += req->payload_length;
		break;
	case NBD_CMD_BLOCK_STATUS:
		cost += max_extents * sizeof(struct nbd_extent) +
			nbd_block_status_size(c->extended, max_extents);
		break;
	default:
		break;
	}
	return cost;
}

/* r becomes one of c's live requests, with the reservation its header got. */
void request_attach(struct conn *c, struct request *r, const struct nbd_request *hdr,
		    uint64_t accounted)
{
	r->conn = c;
	r->hdr = *hdr;
	r->accounted = accounted;
	r->reserved = c->admitted; /* the reservation made for its header */
	c->admitted = 0;
	r->refs = 1;
	r->arrived_ns = clock_now_ns();
	conn_ref(c);
	conn_inflight_add(c, 1);
	c->inflight_bytes += accounted;
}

static struct request *request_new(struct conn *c, const struct nbd_request *hdr, size_t buf_len,
				   uint64_t accounted, size_t max_extents)
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
	r->buf_len = buf_len;
	r->op.extents = r->extents;
	r->op.max_extents = max_extents;
	request_attach(c, r, hdr, accounted);
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
	c->inflight_bytes -= r->accounted;
	if (!r->copied)
		cache_op_release(&r->op);
	if (r->pinned)
		budget_unpin(r->pinned);
	if (r->buf_mapped)
		munmap(r->buf, r->buf_len);
	else
		free(r->buf);
	free(r->extents);
	if (r->iov != &r->buf_iov)
		free(r->iov);
	free(r);
	/*
	 * No conn_update_reading() here: this may run inside libevent's drain
	 * of the output buffer. The write callback and request_done() do it.
	 */
	conn_unref(c);
}

/* A reference's owner, counted in CONN_REF_OVERHEAD beside libevent's two
 * chains of 1 KiB. */
_Static_assert(sizeof(struct request) + 2048 + 256 <= CONN_REF_OVERHEAD,
	       "CONN_REF_OVERHEAD counts a request and its pieces");

static void request_buf_release(const void *data, size_t len, void *arg)
{
	(void)data;
	struct request *r = arg;
	conn_ref_released(r->conn, len);
	request_put(r);
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
	conn_add(c, hdr, n);
}

/* An NBD error reply in whatever form was negotiated. */
static void reply_error(struct conn *c, const struct nbd_request *req, uint32_t error,
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
		conn_add(c, buf, n);
		return;
	}
	uint8_t payload[NBD_ERROR_CHUNK_FIXED_SIZE + 256];
	char msg[256];
	snprintf(msg, sizeof(msg), "%s", message ? message : "");
	size_t n = nbd_encode_error_chunk(payload, sizeof(payload), error, msg);
	add_chunk_header(c, req, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, n);
	conn_add(c, payload, n);
}

static void reply_ok(struct conn *c, const struct nbd_request *req)
{
	if (!c->bev)
		return;
	if (!c->structured) {
		uint8_t buf[NBD_SIMPLE_REPLY_SIZE];
		size_t n = nbd_encode_simple_reply(buf, req->cookie, 0);
		conn_add(c, buf, n);
		return;
	}
	add_chunk_header(c, req, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, 0);
}

/*
 * Reference len bytes of read data (the op's data, the arena while the op
 * holds its entries pinned, or the copy) from the output buffer: no copy.
 */
static void add_data_ref(struct request *r, const uint8_t *data, size_t len)
{
	r->refs++;
	if (!conn_add_ref(r->conn, data, len, request_buf_release, r))
		r->refs--; /* not referenced: the request's own reference holds it */
}

/* One data chunk at request offset at: its header, then the data. */
static void add_data_chunk_header(struct request *r, size_t at, size_t len, uint16_t flags)
{
	if (!r->conn->bev)
		return;
	uint8_t prefix[NBD_OFFSET_DATA_PREFIX_SIZE];
	add_chunk_header(r->conn, &r->hdr, flags, NBD_REPLY_TYPE_OFFSET_DATA,
			 NBD_OFFSET_DATA_PREFIX_SIZE + (uint64_t)len);
	nbd_encode_offset_data_prefix(prefix, r->hdr.offset + at);
	conn_add(r->conn, prefix, sizeof(prefix));
}

/*
 * A READ reply is planned before anything is queued: runs of the request,
 * each a hole (structured replies only) or data contiguous in memory. Only
 * the data runs are then pinned, or copied out of the cache; a hole costs
 * neither (a 32 MiB READ of a sparse range is one hole chunk, whatever the
 * pinned-replies limit).
 */
struct reply_run {
	size_t at, len;	     /* in the request */
	const uint8_t *data; /* NULL: a hole */
};

struct reply_plan {
	struct reply_run *runs;
	size_t count, cap;
	size_t data_bytes; /* the data runs' lengths, summed */
	struct reply_run stack_runs[16];
};

static int plan_add(struct reply_plan *p, size_t at, size_t len, const uint8_t *data)
{
	struct reply_run *last = p->count ? &p->runs[p->count - 1] : NULL;
	if (data)
		p->data_bytes += len;
	/* Holes join holes; data joins data that it continues in memory. */
	if (last && last->at + last->len == at &&
	    (data ? last->data && last->data + last->len == data : !last->data)) {
		last->len += len;
		return 0;
	}
	if (p->count == p->cap) {
		size_t cap = p->cap * 2;
		struct reply_run *v = p->runs == p->stack_runs ? malloc(cap * sizeof(*v))
							       : realloc(p->runs, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		if (p->runs == p->stack_runs)
			memcpy(v, p->stack_runs, sizeof(p->stack_runs));
		p->runs = v;
		p->cap = cap;
	}
	p->runs[p->count++] = (struct reply_run){at, len, data};
	return 0;
}

static void plan_free(struct reply_plan *p)
{
	if (p->runs != p->stack_runs)
		free(p->runs);
}

/*
 * The runs of r's read data. With sparse, all-zero, export-aligned
 * CONN_HOLE_GRANULE blocks are holes (partial blocks at either end are
 * data): zero blocks are what the client would read, whatever the
 * backend's allocation, and the test is cheap for data (it stops at the
 * first non-zero byte; a segment the cache knows holds no zero block is
 * not looked at). Asking the file system instead (SEEK_HOLE) costs a walk
 * over every cached page on tmpfs. 0 or -ENOMEM.
 */
static int reply_plan_build(const struct request *r, bool sparse, struct reply_plan *p)
{
	*p = (struct reply_plan){.runs = p->stack_runs, .cap = 16};
	const uint8_t *data;
	size_t seg_len, pos = 0;
	bool zeros;
	for (size_t i = 0; cache_op_segment(&r->op, i, &data, &seg_len, &zeros); i++) {
		for (size_t off = 0; off < seg_len;) {
			size_t at = pos + off;
			size_t n = sparse && zeros
				       ? CONN_HOLE_GRANULE -
					     (size_t)((r->hdr.offset + at) % CONN_HOLE_GRANULE)
				       : seg_len - off;
			if (n > seg_len - off)
				n = seg_len - off;
			bool hole = sparse && zeros && n == CONN_HOLE_GRANULE &&
				    cache_all_zero(data + off, n);
			if (plan_add(p, at, n, hole ? NULL : data + off) < 0)
				return -ENOMEM;
			off += n;
		}
		pos += seg_len;
	}
	return 0;
}

/*
 * A cached read's data runs, out of the cache into the request's own
 * buffer, one after the other (the runs then point there); the op is
 * released now (its entries unpinned). False when out of memory.
 */
static bool request_copy_out(struct request *r, struct reply_plan *p)
{
	/*
	 * Large copies are mapped, not malloc'd: freeing one gives the memory
	 * back at once, where glibc would raise its mmap threshold and keep
	 * the next ones in a heap that slow readers leave full of holes.
	 */
	size_t len = p->data_bytes;
	bool mapped = len >= COPY_MMAP_MIN;
	uint8_t *buf = mapped ? mmap(NULL, len, PROT_READ | PROT_WRITE,
				      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
			      : malloc(len);
	if (mapped && buf == MAP_FAILED)
		buf = NULL;
	if (!buf)
		return false;
	size_t at = 0;
	for (size_t i = 0; i < p->count; i++) {
		struct reply_run *run = &p->runs[i];
		if (!run->data)
			continue;
		memcpy(buf + at, run->data, run->len);
		run->data = buf + at;
		at += run->len;
	}
	cache_op_release(&r->op);
	r->copied = true;
	r->buf_mapped = mapped;
	r->buf = buf;
	r->buf_len = len;
	budget_count_copy(len);
	return true;
}

/*
 * Before a read's reply references the arena: pin its data bytes in the
 * daemon-wide count, or copy them out when that is full. Without memory
 * for the copy the reply pins anyway (counted, over the limit). Data the
 * op owns (mode none) pins nothing, and neither does a reply of holes.
 */
static void request_hold_data(struct request *r, struct reply_plan *p)
{
	if (!cache_op_pins_arena(&r->op) || !p->data_bytes)
		return;
	if (!budget_pin(p->data_bytes, false)) {
		if (request_copy_out(r, p))
			return;
		budget_pin(p->data_bytes, true);
	}
	r->pinned = p->data_bytes;
}

static void add_hole_chunk(struct request *r, size_t at, size_t len, uint16_t flags)
{
	if (!r->conn->bev)
		return;
	uint8_t payload[NBD_OFFSET_HOLE_SIZE];
	add_chunk_header(r->conn, &r->hdr, flags, NBD_REPLY_TYPE_OFFSET_HOLE, sizeof(payload));
	nbd_encode_offset_hole(payload, r->hdr.offset + at, (uint32_t)len);
	conn_add(r->conn, payload, sizeof(payload));
}

/*
 * A read reply: one simple reply, one data chunk (DF, or shorter than a
 * hole granule), or one chunk per run, the last one flagged DONE (runs
 * that became adjacent in a copy go as one chunk).
 */
static void reply_read(struct request *r)
{
	struct conn *c = r->conn;
	size_t len = (size_t)r->hdr.length;
	if (len == 0) {
		/* A data chunk must carry at least one byte. */
		reply_ok(c, &r->hdr);
		return;
	}
	bool sparse =
	    c->structured && !(r->hdr.flags & NBD_CMD_FLAG_DF) && len >= CONN_HOLE_GRANULE;
	struct reply_plan p;
	if (reply_plan_build(r, sparse, &p) < 0) {
		plan_free(&p);
		reply_error(c, &r->hdr, NBD_ENOMEM, "out of memory");
		return;
	}
	request_hold_data(r, &p);
	if (!c->structured) {
		uint8_t buf[NBD_SIMPLE_REPLY_SIZE];
		size_t n = nbd_encode_simple_reply(buf, r->hdr.cookie, 0);
		conn_add(c, buf, n);
	} else if (!sparse) {
		add_data_chunk_header(r, 0, len, NBD_REPLY_FLAG_DONE);
	}
	for (size_t i = 0; i < p.count; i++) {
		struct reply_run run = p.runs[i];
		while (sparse && run.data && i + 1 < p.count &&
		       p.runs[i + 1].data == run.data + run.len)
			run.len += p.runs[++i].len;
		uint16_t flags = i + 1 == p.count ? NBD_REPLY_FLAG_DONE : 0;
		if (!run.data) {
			add_hole_chunk(r, run.at, run.len, flags);
			continue;
		}
		if (sparse)
			add_data_chunk_header(r, run.at, run.len, flags);
		add_data_ref(r, run.data, run.len);
	}
	plan_free(&p);
}

/*
 * Block status: the extents the backend found, cut to what the protocol
 * allows: one extent within the request for REQ_ONE; otherwise stop once
 * the request is covered; nothing past the export's end (a window's
 * backend goes on after it); in compact form no extent above 32 bits, and
 * nothing after an extent that had to be shortened (extents are contiguous).
 */
static void reply_block_status(struct request *r)
{
	struct conn *c = r->conn;
	size_t n = 0;
	uint64_t covered = 0;
	bool req_one = r->hdr.flags & NBD_CMD_FLAG_REQ_ONE;
	uint64_t room = c->session.size - r->hdr.offset; /* checked: above 0 (an
							  * NBD_CMD_RESIZE may grow it) */
	for (size_t i = 0; i < r->n_extents; i++) {
		struct nbd_extent *e = &r->extents[n];
		*e = r->extents[i];
		bool cut = false;
		if (e->length > room - covered)
			e->length = room - covered, cut = true;
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
	conn_add(c, payload, size);
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
		why = req->type == NBD_CMD_WRITE || req->type == NBD_CMD_WRITE_ZEROES
			  ? "the request goes past the end of the export"
			  : "the request goes past the end of the export (resized smaller since "
			    "this connection began)";
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

/*
 * The reply in the export's statistics, on this worker's own slot: the
 * latency from the request's arrival to its reply queued (READ, a hit or
 * not, WRITE and FLUSH: the second of two clock reads per request), the
 * bytes moved, an error (cache.h, cache_export_record_reply).
 */
static void record_reply(const struct request *r, int result)
{
	struct cache_reply s = {.kind = CACHE_LATENCIES, .failed = result < 0};
	switch (r->hdr.type) {
	case NBD_CMD_READ:
		s.kind =
		    cache_op_read_missed(&r->op) ? CACHE_LATENCY_READ_MISS : CACHE_LATENCY_READ_HIT;
		s.read_bytes = result < 0 ? 0 : r->hdr.length;
		break;
	case NBD_CMD_WRITE:
		s.kind = CACHE_LATENCY_WRITE;
		s.written_bytes = result < 0 ? 0 : r->hdr.length;
		break;
	case NBD_CMD_FLUSH:
		s.kind = CACHE_LATENCY_FLUSH;
		break;
	default:
		break;
	}
	if (s.kind < CACHE_LATENCIES)
		s.ns = clock_now_ns() - r->arrived_ns;
	struct conn *c = r->conn;
	cache_export_record_reply(c->export->cache, c->worker, &s);
}

/* The request's work is done (result 0 or -errno): reply, let it go. */
void request_finish(struct request *r, int result)
{
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
			reply_block_status(r);
		} else {
			reply_ok(c, &r->hdr);
		}
	}
	record_reply(r, result);
	conn_counter_add(&c->requests, 1);
	if (result >= 0 && r->hdr.type == NBD_CMD_READ)
		conn_counter_add(&c->bytes_read, r->hdr.length);
	else if (result >= 0 && r->hdr.type == NBD_CMD_WRITE)
		conn_counter_add(&c->bytes_written, r->hdr.length);
	conn_ref(c);
	conn_inflight_add(c, -1);
	/* The reply is in the output buffer now, counted there. */
	conn_unreserve(c, r->reserved);
	r->reserved = 0;
	request_put(r);
	conn_update_reading(c);
	conn_unref(c);
}

void request_cache_done(struct cache_op *op, int result)
{
	struct request *r = (struct request *)((char *)op - offsetof(struct request, op));
	r->n_extents = op->n_extents;
	request_finish(r, result);
}

static enum backend_cmd backend_cmd_of(uint16_t type)
{
	switch (type) {
	case NBD_CMD_READ:
		return BACKEND_READ;
	case NBD_CMD_WRITE:
		return BACKEND_WRITE;
	case NBD_CMD_FLUSH:
		return BACKEND_FLUSH;
	case NBD_CMD_TRIM:
		return BACKEND_TRIM;
	case NBD_CMD_WRITE_ZEROES:
		return BACKEND_ZERO;
	case NBD_CMD_CACHE:
		return BACKEND_CACHE;
	default:
		return BACKEND_BLOCK_STATUS;
	}
}

/* The cache op of r (c's, header h): what the request asks of the cache. */
void request_op_init(struct request *r, struct conn *c, const struct nbd_request *h)
{
	uint32_t flags = (h->flags & NBD_CMD_FLAG_FUA) ? BACKEND_FUA : 0;
	if (h->type == NBD_CMD_WRITE_ZEROES) {
		if (h->flags & NBD_CMD_FLAG_NO_HOLE)
			flags |= BACKEND_NO_HOLE;
		if (h->flags & NBD_CMD_FLAG_FAST_ZERO)
			flags |= BACKEND_FAST_ONLY;
	}
	uint64_t length = h->type == NBD_CMD_WRITE ? h->payload_length : h->length;
	struct cache_op *op = &r->op;
	op->ce = c->export->cache;
	op->worker = c->worker;
	op->cmd = backend_cmd_of(h->type);
	op->flags = flags;
	op->offset = c->export->offset + h->offset; /* a window's bytes in its backend */
	op->length = length;
	op->payload = r->buf;
	op->seen_error = &c->seen_error;
	op->cancel = &c->cancel_requests; /* the request holds c */
	op->done = request_cache_done;
	op->sequential = false;
	if (h->type == NBD_CMD_READ) {
		/* A read continuing this connection's last one is sequential: the
		 * cache reads ahead into 2 MiB entries; a long stream is read
		 * around the cache when --seq-cutoff says so. */
		op->sequential = h->offset == c->seq_next && h->offset != 0;
		c->seq_run = op->sequential ? c->seq_run + h->length : h->length;
		c->seq_next = h->offset + h->length;
		if (c->export->seq_cutoff)
			op->no_allocate = c->seq_run > c->export->seq_cutoff;
	}
}

/*
 * Start a checked request (its payload already in r->buf) through the
 * cache, whatever the export's mode (in mode none the cache passes it on).
 */
void request_start(struct request *r)
{
	request_op_init(r, r->conn, &r->hdr);
	cache_export_count_command(r->op.ce, r->op.cmd, r->op.flags);
	cache_submit(&r->op);
}

/* Does the command address bytes of the export (offset, length)? */
static bool has_range(uint16_t type)
{
	return type == NBD_CMD_READ || type == NBD_CMD_WRITE || type == NBD_CMD_TRIM ||
	       type == NBD_CMD_WRITE_ZEROES || type == NBD_CMD_CACHE ||
	       type == NBD_CMD_BLOCK_STATUS;
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
	if (c->sink.left)
		return 0; /* conn.c fills it, then reads on */
	if (c->discard)
		return discard_step(c, in);
	if (c->parking && !c->admitted)
		return 0; /* a request boundary: a live upgrade takes it from here */
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
	/* Within the size this connection negotiated, but past the end of a
	 * backend resized smaller since: ENOSPC, as the resize extension asks
	 * for requests between a new end and the old one. */
	if (verdict == NBD_SUCCESS && has_range(req.type) &&
	    export_past_end(c->export, req.offset, req.length))
		verdict = NBD_ENOSPC;
	if (verdict == NBD_CHECK_DISCONNECT) {
		conn_kill(c, "request payload above the maximum");
		return -1;
	}
	if (req.type == NBD_CMD_DISC && verdict == NBD_SUCCESS) {
		evbuffer_drain(in, hsize);
		log_debug("conn %llu: NBD_CMD_DISC", (unsigned long long)c->id);
		conn_begin_close(c, "client disconnected (NBD_CMD_DISC)");
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
	/* Read data is the op's (the arena, or a buffer of its own in mode
	 * none), or copied (the cost counts it either way). */
	size_t buf_len = 0, max_extents = 0;
	switch (req.type) {
	case NBD_CMD_WRITE:
		buf_len = (size_t)req.payload_length;
		break;
	case NBD_CMD_BLOCK_STATUS:
		max_extents = (req.flags & NBD_CMD_FLAG_REQ_ONE) ? 1 : CONN_MAX_EXTENTS;
		break;
	default:
		break;
	}
	/* Admitted before its payload is read: a refused request stays unread. */
	uint64_t cost = request_cost(c, &req, max_extents);
	bool started = !c->admitted;
	if (started && !conn_admit(c, cost))
		return 0;
	c->admitted = cost;
	if (started)
		c->turn_work += cost; /* this turn's share (session.c) */
	if (req.type == NBD_CMD_WRITE && req.payload_length)
		return receive_write(c, &req, cost, hsize);
	if (req.payload_length && avail < hsize + req.payload_length) {
		conn_payload_progress(c, avail, started);
		return 0; /* wait for the whole payload */
	}

	evbuffer_drain(in, hsize);
	struct request *r = request_new(c, &req, buf_len, cost, max_extents);
	if (!r) {
		conn_unreserve(c, c->admitted);
		c->admitted = 0;
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
	if (req.type == NBD_CMD_RESIZE) {
		resize_start(r);
		return 1;
	}
	log_debug("conn %llu: %s flags 0x%x offset %llu length %llu", (unsigned long long)c->id,
		  nbd_cmd_name(req.type), req.flags, (unsigned long long)req.offset,
		  (unsigned long long)req.length);
	throttle_submit(r); /* the export's QoS limits may hold it back */
	return 1;
}
