/*
 * daemon/transmit_throttle.c: the export's QoS limits on the transmission
 * path (transmit_internal.h; the buckets are qos.h's).
 *
 * A request over its limits is delayed, never failed. It is held back
 * after it was read and admitted (its reply memory reserved, its payload
 * in a buffer of its own) and before it reaches the cache: it holds no
 * cache op, no pin and no worker thread while it waits. Held requests
 * wait on the connection, in arrival order, and one timer on the
 * connection's worker is due when the first may go; the worker serves
 * every other connection meanwhile. They count as in flight
 * (CONN_MAX_INFLIGHT, CONN_MAX_INFLIGHT_BYTES), so a client flooding a
 * limited export is soon not read at all.
 *
 *   c->throttle_head -> [READ] -> [WRITE buf] -> [TRIM] <- c->throttle_tail
 *          ^ throttle_timer: qos_admit() of the head, re-armed for the
 *            time its buckets need (at most THROTTLE_RECHECK_NS)
 *
 * What counts: one request each for READ, WRITE, TRIM, WRITE_ZEROES,
 * CACHE and BLOCK_STATUS; the bytes of READ and WRITE payloads only.
 * FLUSH is never held: NBD asks it to cover the writes that were answered
 * before it was sent, and a held write has not been answered, so a FLUSH
 * goes past held requests without breaking that promise. DISC is not a
 * request here (transmit_step closes).
 *
 * Unlimited costs one relaxed load of the limiter's flag and a test of the
 * connection's list head.
 *
 * Worker thread only (the connection's).
 */
#include <errno.h>
#include <event2/event.h>

#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/transmit_internal.h"
#include "daemon/worker.h"

/* A held request looks at its buckets again at least this often, so a
 * limit raised or removed live applies to requests already waiting. */
#define THROTTLE_RECHECK_NS (100u * 1000000u)

static struct qos_limiter *limiter_of(struct conn *c)
{
	return c->export->counter->qos;
}

/* Requests and bytes h costs against the limits. */
static void request_tokens(const struct nbd_request *h, uint64_t *ios, uint64_t *bytes)
{
	*ios = 1;
	*bytes = 0;
	if (h->type == NBD_CMD_READ)
		*bytes = h->length;
	else if (h->type == NBD_CMD_WRITE)
		*bytes = h->payload_length;
}

/* 0: h's tokens were taken; else nanoseconds to wait. */
static uint64_t try_admit(struct conn *c, const struct nbd_request *h, uint64_t now)
{
	struct qos_limiter *q = limiter_of(c);
	if (!c->qos_client) {
		char key[300];
		qos_client_key(&c->peer, key, sizeof(key));
		c->qos_client = qos_client_get(q, key, now);
	}
	uint64_t ios, bytes;
	request_tokens(h, &ios, &bytes);
	return qos_admit(q, c->qos_client, ios, bytes, now);
}

bool throttle_pass(struct conn *c, const struct nbd_request *h)
{
	if (h->type == NBD_CMD_FLUSH)
		return true;
	if (!c->throttle_head && !qos_limiter_active(limiter_of(c)))
		return true;
	return !c->throttle_head && try_admit(c, h, clock_now_ns()) == 0;
}

static void arm(struct conn *c, uint64_t ns)
{
	if (ns > THROTTLE_RECHECK_NS)
		ns = THROTTLE_RECHECK_NS;
	struct timeval tv = {(time_t)(ns / 1000000000u),
			     (suseconds_t)((ns % 1000000000u + 999) / 1000u)};
	evtimer_add(c->throttle_timer, &tv);
}

/* The request leaves the list: counted with the time it waited. */
static struct request *pop(struct conn *c, uint64_t now)
{
	struct request *r = c->throttle_head;
	c->throttle_head = r->throttle_next;
	if (!c->throttle_head)
		c->throttle_tail = NULL;
	r->throttle_next = NULL;
	qos_count_throttled(limiter_of(c), false,
			    now > r->throttled_at_ns ? now - r->throttled_at_ns : 0);
	return r;
}

/* The timer: every held request whose buckets allow it starts, in order. */
static void throttle_on_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	conn_ref(c);
	uint64_t now = clock_now_ns();
	while (c->throttle_head) {
		uint64_t wait = qos_limiter_active(limiter_of(c))
				    ? try_admit(c, &c->throttle_head->hdr, now)
				    : 0;
		if (wait) {
			arm(c, wait);
			break;
		}
		request_start(pop(c, now));
	}
	uring_submit(&c->worker->ring);
	conn_unref(c);
}

/* conn_kill, conn_shutdown: held requests end (with ESHUTDOWN while the
 * client can still be answered). */
static void throttle_cancel(struct conn *c)
{
	if (c->throttle_timer)
		evtimer_del(c->throttle_timer);
	struct request *r = c->throttle_head;
	uint64_t now = clock_now_ns();
	/* Detached first: finishing one may end the connection, which calls
	 * here again. */
	struct request *list = NULL, **tail = &list;
	while (c->throttle_head) {
		*tail = pop(c, now);
		tail = &(*tail)->throttle_next;
	}
	conn_ref(c);
	for (r = list; r;) {
		struct request *next = r->throttle_next;
		request_finish(r, c->bev ? -ESHUTDOWN : -ECONNRESET);
		r = next;
	}
	conn_unref(c);
}

void throttle_submit(struct request *r)
{
	struct conn *c = r->conn;
	/* Nobody waits for its reply any more (cancel_requests): not held, it
	 * goes its way as those in flight do. */
	if (r->qos_passed || r->hdr.type == NBD_CMD_FLUSH || c->cancel_requests ||
	    (!c->throttle_head && !qos_limiter_active(limiter_of(c)))) {
		request_start(r);
		return;
	}
	/* Admitted at its arrival (no clock read on the way through; a
	 * WRITE's came at its header, throttle_pass, unless that held it). */
	uint64_t wait = c->throttle_head ? 0 : try_admit(c, &r->hdr, r->arrived_ns);
	if (!c->throttle_head && wait == 0) {
		request_start(r);
		return;
	}
	uint64_t now = clock_now_ns();
	if (wait) /* the wait from now on */
		wait = wait > now - r->arrived_ns ? wait - (now - r->arrived_ns) : 1;
	if (!c->throttle_timer) {
		c->throttle_timer = evtimer_new(c->worker->base, throttle_on_timer, c);
		if (!c->throttle_timer) {
			request_start(r); /* no timer to wait on: not held */
			return;
		}
		c->on_cancel = throttle_cancel;
	}
	r->throttled_at_ns = now;
	qos_count_throttled(limiter_of(c), true, 0);
	if (c->throttle_tail) {
		c->throttle_tail->throttle_next = r;
		c->throttle_tail = r;
		return; /* the timer is armed for the head */
	}
	c->throttle_head = c->throttle_tail = r;
	arm(c, wait);
}
