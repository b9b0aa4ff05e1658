/*
 * daemon/transmit_receive.c: a WRITE's payload, from the socket to where
 * the cache takes it (transmit_internal.h).
 *
 * transmit_step() hands over a WRITE once it is checked and admitted, its
 * header still in the input buffer (receive_write). The payload does not
 * go through the input buffer: the connection moves it (conn_sink_start),
 * in large reads, straight to its destination. A WRITE of whole blocks is
 * received into the cache's arena when the cache can reserve its blocks
 * at once (receive_into_arena, cache_write_begin): from the socket into
 * the entries, with no buffer of the request's and no copy. Otherwise it
 * goes into a buffer of the request's, and the request is submitted as
 * any other once that is full.
 *
 * A connection that ends before the whole payload is in hands back what it
 * got (request_received): then nothing changes and no reply goes out.
 *
 * Worker thread only (the connection's); called only by transmit.c.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <stdlib.h>

#include "daemon/conn.h"
#include "daemon/log.h"
#include "daemon/transmit_internal.h"

static void request_dropped(struct cache_op *op, int result)
{
	(void)op;
	(void)result;
}

/* The payload of a WRITE is in: all of it, or what came before the
 * connection ended (then nothing may change, and no reply goes out). */
static void request_received(struct conn *c, void *arg, uint64_t received)
{
	(void)c;
	struct request *r = arg;
	if (r->in_arena)
		cache_write_end(&r->op, received);
	else if (received == r->buf_len)
		throttle_submit(r);
	else
		request_finish(r, -ECONNRESET);
}

/*
 * r's payload straight into the arena, if the cache can reserve its blocks
 * now (cache_write_begin): r->iov are their segments (*niov). false: it
 * cannot, nothing changed.
 */
static bool receive_into_arena(struct request *r, size_t *niov, bool payload_here)
{
	if (cache_write_begin(&r->op, payload_here) < 0)
		return false;
	size_t n = 0, len;
	const uint8_t *data;
	bool zeros;
	while (cache_op_segment(&r->op, n, &data, &len, &zeros))
		n++;
	/* One segment (a small WRITE) needs no array of its own. */
	r->iov = n == 1 ? &r->buf_iov : malloc(n * sizeof(*r->iov));
	if (!r->iov) {
		r->op.done = request_dropped;
		cache_write_end(&r->op, 0); /* nothing received: nothing changes */
		cache_op_release(&r->op);
		return false;
	}
	/* Adjacent segments (neighbouring entries in the arena) are one. */
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		cache_op_segment(&r->op, i, &data, &len, &zeros);
		if (k && (uint8_t *)r->iov[k - 1].iov_base + r->iov[k - 1].iov_len == data) {
			r->iov[k - 1].iov_len += len;
		} else {
			r->iov[k].iov_base = (void *)data;
			r->iov[k++].iov_len = len;
		}
	}
	r->in_arena = true;
	r->op.done = request_cache_done;
	cache_export_count_command(r->op.ce, r->op.cmd, r->op.flags);
	*niov = k;
	return true;
}

/*
 * A WRITE (checked, admitted, its header still in the input buffer): its
 * payload is received by the connection (conn_sink_start) straight into
 * the arena where the cache can take it so, else into a buffer of the
 * request's, which is then submitted as usual. Either way in large reads,
 * not through the input buffer.
 */
int receive_write(struct conn *c, const struct nbd_request *req, uint64_t cost, size_t hsize)
{
	struct request *r = calloc(1, sizeof(*r));
	size_t niov = 1;
	if (r)
		request_op_init(r, c, req);
	/* Already in the input buffer: it cannot be cut short any more. */
	bool here = evbuffer_get_length(conn_input(c)) >= hsize + req->payload_length;
	/* Into the arena only when the QoS limits let it start now: a write
	 * held back must not hold the cache's blocks while it waits. */
	if (r)
		r->qos_passed = throttle_pass(c, req);
	if (r && (!r->qos_passed || !receive_into_arena(r, &niov, here))) {
		r->buf_len = (size_t)req->payload_length;
		r->buf = malloc(r->buf_len);
		r->buf_iov.iov_base = r->buf;
		r->buf_iov.iov_len = r->buf_len;
		r->iov = &r->buf_iov;
		if (!r->buf) {
			free(r);
			r = NULL;
		}
	}
	evbuffer_drain(conn_input(c), hsize);
	if (!r) {
		conn_unreserve(c, c->admitted);
		c->admitted = 0;
		c->discard = req->payload_length;
		c->discard_req = *req;
		c->discard_error = NBD_ENOMEM;
		return 1;
	}
	request_attach(c, r, req, cost);
	log_debug("conn %llu: NBD_CMD_WRITE flags 0x%x offset %llu length %llu%s",
		  (unsigned long long)c->id, req->flags, (unsigned long long)req->offset,
		  (unsigned long long)req->length, r->in_arena ? " (into the cache)" : "");
	if (conn_sink_start(c, r->iov, niov, req->payload_length, request_received, r))
		request_received(c, r, req->payload_length);
	return 1;
}
