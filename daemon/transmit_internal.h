/*
 * daemon/transmit_internal.h: what the transmission phase's files share.
 * Not for anything outside daemon/transmit*.c.
 *
 *   transmit.c          requests off the input buffer (transmit_step), a
 *                       request's life, its cache op, the replies
 *   transmit_receive.c  a WRITE's payload: from the socket into the arena
 *                       or a buffer of the request's, then to the cache
 *   transmit_throttle.c the export's QoS limits: requests over them held
 *                       back, in order, before they reach the cache
 *   transmit_resize.c   NBD_CMD_RESIZE, run on the control thread and
 *                       answered through request_finish()
 *
 * Calls: transmit.c hands a checked, admitted WRITE to receive_write(); the
 * receive path attaches, starts and finishes it through the request
 * functions below, and never replies itself. Worker thread only (the
 * connection's), so nothing here takes a lock.
 */
#ifndef NBDCACHED_DAEMON_TRANSMIT_INTERNAL_H
#define NBDCACHED_DAEMON_TRANSMIT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "daemon/cache/cache.h"
#include "proto/nbd.h"

struct conn;

/*
 *   struct request            refs: 1 while the request is live
 *   +-----------+                   + 1 per output-buffer reference
 *   | hdr, op   |--buf-->[ data ... ]    freed at 0: op released, buffer,
 *   | extents   |                        request, connection reference
 *   +-----------+
 */
struct request {
	struct conn *conn;
	struct nbd_request hdr;
	struct cache_op op;
	uint8_t *buf;	 /* WRITE payload; READ data when copied */
	size_t buf_len;
	bool copied;	       /* cached READ's data runs copied into buf, op released */
	bool buf_mapped;       /* buf is an mmap of buf_len bytes (a large copy) */
	uint64_t accounted; /* bytes counted in conn->inflight_bytes */
	uint64_t reserved;  /* reply bytes reserved (conn->reserved) until answered */
	uint64_t pinned;    /* arena bytes counted by budget_pin until sent */
	unsigned refs;
	struct nbd_extent *extents;
	size_t n_extents;
	struct iovec *iov; /* WRITE: where its payload is received (conn_sink_start) */
	struct iovec buf_iov; /* ... when that is buf, or one arena segment */
	bool in_arena;	      /* ... when that is the arena (cache_write_begin) */
	uint64_t arrived_ns;  /* its header was read (latency: until replied) */
	bool qos_passed;      /* the QoS limits admitted it already (a WRITE at its header) */
	struct request *throttle_next; /* c->throttle_head's list */
	uint64_t throttled_at_ns;      /* when it was held back */
};

/* ---- transmit.c ---- */

/* r becomes one of c's live requests, with the reservation its header got. */
void request_attach(struct conn *c, struct request *r, const struct nbd_request *hdr,
		    uint64_t accounted);
/* The cache op of r (c's, header h): what the request asks of the cache. */
void request_op_init(struct request *r, struct conn *c, const struct nbd_request *h);
/* Start a checked request (its payload already in r->buf) through the cache. */
void request_start(struct request *r);
/* The request's work is done (result 0 or -errno): reply, let it go. */
void request_finish(struct request *r, int result);
/* The cache op's done callback: the request finishes with its result. */
void request_cache_done(struct cache_op *op, int result);

/* ---- transmit_throttle.c ---- */

/*
 * May a request with header h start now as far as the export's QoS limits
 * go? true: no limit is set, or nothing of c's is held back and its
 * tokens were taken. false: it must wait (throttle_submit will hold it).
 */
bool throttle_pass(struct conn *c, const struct nbd_request *h);
/*
 * Start a checked request r (its payload in), or hold it back behind c's
 * requests already held, until the export's limits let it go (a timer on
 * c's worker; the worker serves others meanwhile). FLUSH and requests
 * already admitted (qos_passed) start at once.
 */
void throttle_submit(struct request *r);

/* ---- transmit_receive.c ---- */

/*
 * A WRITE, checked and admitted (cost), its header (hsize bytes) still in
 * the input buffer: its payload is received into the arena or a buffer of
 * the request's, and the request started once it is in. Always 1 (one
 * request consumed; out of memory, its payload is drained and refused).
 */
int receive_write(struct conn *c, const struct nbd_request *req, uint64_t cost, size_t hsize);

/* ---- transmit_resize.c ---- */

/* NBD_CMD_RESIZE: run on the control thread, answered (request_finish) when
 * done. */
void resize_start(struct request *r);

#endif
