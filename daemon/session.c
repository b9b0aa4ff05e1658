/*
 * daemon/session.c: the dispatch from a connection's input to its phase's
 * code (see session.h).
 *
 * session_input() runs the phase's step function until it needs more
 * bytes, re-evaluating after each step whether the connection may read on
 * (the step may have queued replies or reserved budget), or until the
 * connection had its share of this turn of the worker's loop
 * (CONN_TURN_MESSAGES steps, CONN_TURN_BYTES of requests' work: then it
 * yields, conn_yield); then every SQE those steps prepared is submitted
 * in one io_uring_enter. The phase is read before each step, so a GO
 * answered in one step has the next message parsed as a request.
 */
#include "daemon/session.h"

#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/handshake.h"
#include "daemon/log.h"
#include "daemon/transmit.h"
#include "daemon/upgrade_record.h"
#include "daemon/worker.h"

static void session_input(struct conn *c)
{
	int rc = 1;
	unsigned messages = 0;
	c->turn_work = 0;
	while (rc > 0 && c->bev && c->reading && !c->closing && !c->yielded) {
		if (messages == CONN_TURN_MESSAGES || c->turn_work >= CONN_TURN_BYTES) {
			conn_yield(c);
			break;
		}
		if (c->phase == CONN_TRANSMISSION)
			rc = transmit_step(c);
		else
			rc = handshake_step(c);
		if (rc > 0)
			messages++;
		if (c->bev && !c->closing)
			conn_update_reading(c);
	}
	uring_submit(&c->worker->ring);
}

int session_start(struct conn_set *set, int fd, uint64_t id, const struct access_peer *peer)
{
	struct conn *c;
	int rc = conn_start(set, fd, id, peer, session_input, &c);
	if (rc < 0)
		return rc;
	handshake_send_greeting(c);
	return 0;
}

int session_adopt(struct conn_set *set, int fd, const struct access_peer *peer,
		  const struct upgrade_conn_state *st)
{
	struct conn *c;
	int rc = conn_start(set, fd, st->id, peer, session_input, &c);
	if (rc < 0)
		return rc;
	conn_ref(c);
	if (handshake_resume(c, st)) {
		uint64_t now = clock_now_ns(), age = st->age_ms * 1000000u;
		c->started_ns = age < now ? now - age : 0;
		conn_counter_add(&c->requests, st->requests);
		conn_counter_add(&c->bytes_read, st->bytes_read);
		conn_counter_add(&c->bytes_written, st->bytes_written);
		conn_counter_add(&c->payload_copied, st->payload_copied);
		atomic_store_explicit(&c->upgrades, st->upgrades + 1, memory_order_relaxed);
		log_info(
		    "conn %llu: resumed after the upgrade: export \"%s\", %llu requests so far, "
		    "%u bytes of input to parse",
		    (unsigned long long)c->id, st->name, (unsigned long long)st->requests,
		    st->pending_len);
		if (st->pending_len && conn_add_input(c, st->pending, st->pending_len) < 0)
			conn_kill(c, "upgrade: out of memory for its pending input");
		else if (st->pending_len)
			session_input(c);
	}
	conn_unref(c);
	return 0;
}
