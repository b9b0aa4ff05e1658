/*
 * daemon/conn.c: connection lifetime and the read loop (see conn.h).
 *
 * The read callback hands the input buffer to the phase's step function
 * until it needs more bytes; then every SQE those steps prepared is
 * submitted in one io_uring_enter. Reading pauses while too many requests
 * or too many reply bytes are pending, and resumes from conn_update_reading()
 * when replies complete or the output drains.
 */
#include "daemon/conn.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/worker.h"

struct evbuffer *conn_output(struct conn *c)
{
	return bufferevent_get_output(c->bev);
}

struct evbuffer *conn_input(struct conn *c)
{
	return bufferevent_get_input(c->bev);
}

void conn_ref(struct conn *c)
{
	c->refs++;
}

void conn_unref(struct conn *c)
{
	if (--c->refs > 0)
		return;
	log_debug("conn %llu: freed", (unsigned long long)c->id);
	worker_conn_removed(c->worker, c);
	if (c->export) {
		export_detach(c->export);
		export_put(c->export);
	}
	export_put(c->meta_export);
	if (c->timer)
		event_free(c->timer);
	free(c);
}

void conn_kill(struct conn *c, const char *why)
{
	if (!c->bev)
		return;
	log_debug("conn %llu: closing: %s", (unsigned long long)c->id, why);
	struct bufferevent *bev = c->bev;
	c->bev = NULL;
	c->reading = false;
	if (c->timer)
		evtimer_del(c->timer);
	bufferevent_free(bev);
	conn_unref(c);
}

/* The connection's one timer: a negotiation deadline, then a close deadline. */
static void conn_on_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	conn_ref(c);
	conn_kill(c, c->closing ? "client did not read its last replies in time"
				: "negotiation did not finish in time");
	conn_unref(c);
}

static void conn_arm_timer(struct conn *c, int seconds)
{
	struct timeval tv = {seconds, 0};
	if (c->timer)
		evtimer_add(c->timer, &tv);
}

void conn_negotiation_done(struct conn *c)
{
	if (c->timer)
		evtimer_del(c->timer);
}

void conn_begin_close(struct conn *c)
{
	if (!c->bev || c->closing)
		return;
	c->closing = true;
	c->reading = false;
	bufferevent_disable(c->bev, EV_READ);
	conn_arm_timer(c, CONN_CLOSE_TIMEOUT);
	conn_update_reading(c);
}

static bool conn_drained(struct conn *c)
{
	return c->inflight == 0 && evbuffer_get_length(conn_output(c)) == 0;
}

void conn_update_reading(struct conn *c)
{
	if (!c->bev)
		return;
	if (c->closing) {
		if (conn_drained(c))
			conn_kill(c, "finished");
		return;
	}
	/* Negotiation replies are small: a client that does not read them stops us early. */
	size_t max_output =
		c->phase == CONN_TRANSMISSION ? CONN_MAX_OUTPUT : CONN_MAX_NEGOTIATION_OUTPUT;
	bool want = c->inflight < CONN_MAX_INFLIGHT &&
		    c->inflight_bytes < CONN_MAX_INFLIGHT_BYTES &&
		    evbuffer_get_length(conn_output(c)) < max_output;
	if (want == c->reading)
		return;
	c->reading = want;
	if (want) {
		bufferevent_enable(c->bev, EV_READ);
		/* Requests may already sit in the input buffer. */
		conn_process_input(c);
	} else {
		bufferevent_disable(c->bev, EV_READ);
	}
}

void conn_process_input(struct conn *c)
{
	int rc = 1;
	while (rc > 0 && c->bev && c->reading && !c->closing) {
		if (c->phase == CONN_TRANSMISSION)
			rc = transmit_step(c);
		else
			rc = handshake_step(c);
		if (c->bev && !c->closing)
			conn_update_reading(c);
	}
	uring_submit(&c->worker->ring);
}

static void conn_on_read(struct bufferevent *bev, void *arg)
{
	(void)bev;
	struct conn *c = arg;
	conn_ref(c);
	conn_process_input(c);
	conn_unref(c);
}

static void conn_on_write(struct bufferevent *bev, void *arg)
{
	(void)bev;
	struct conn *c = arg;
	conn_ref(c);
	conn_update_reading(c);
	conn_unref(c);
}

static void conn_on_event(struct bufferevent *bev, short what, void *arg)
{
	(void)bev;
	struct conn *c = arg;
	if (what & BEV_EVENT_TIMEOUT)
		conn_kill(c, "client has not read its replies for " STRINGIFY(CONN_STALL_TIMEOUT) " s");
	else if (what & BEV_EVENT_EOF)
		conn_kill(c, "client closed the connection");
	else if (what & BEV_EVENT_ERROR)
		conn_kill(c, strerror(EVUTIL_SOCKET_ERROR()));
}

int conn_start(struct worker *w, int fd, uint64_t id)
{
	struct conn *c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return -ENOMEM;
	}
	evutil_make_socket_nonblocking(fd);
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* fails on Unix: fine */
	c->id = id;
	c->worker = w;
	c->phase = CONN_FLAGS;
	c->refs = 1; /* the socket */
	c->bev = bufferevent_socket_new(w->base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (!c->bev) {
		close(fd);
		free(c);
		return -ENOMEM;
	}
	worker_conn_added(w, c);
	bufferevent_setcb(c->bev, conn_on_read, conn_on_write, conn_on_event, c);
	/* Larger reads than libevent's 16 KiB default: payloads are up to 32 MiB. */
	bufferevent_set_max_single_read(c->bev, 1 << 20);
	bufferevent_set_max_single_write(c->bev, 1 << 20);
	/* The write callback fires when the output drains below this. */
	bufferevent_setwatermark(c->bev, EV_WRITE, CONN_MAX_OUTPUT / 2, 0);
	/* A client gets CONN_NEGOTIATION_TIMEOUT seconds, in all, to negotiate. */
	c->timer = evtimer_new(w->base, conn_on_timer, c);
	if (!c->timer) {
		worker_conn_removed(w, c);
		bufferevent_free(c->bev);
		free(c);
		return -ENOMEM;
	}
	conn_arm_timer(c, CONN_NEGOTIATION_TIMEOUT);
	/*
	 * Replies that make no progress for this long end the connection: while
	 * its output is backed up the connection reads nothing (not even a
	 * DISC), so without it a client could park its buffers here forever.
	 */
	struct timeval stall = {CONN_STALL_TIMEOUT, 0};
	bufferevent_set_timeouts(c->bev, NULL, &stall);
	c->reading = true;
	bufferevent_enable(c->bev, EV_READ | EV_WRITE);
	log_debug("conn %llu: accepted on worker %u", (unsigned long long)id, w->index);
	handshake_send_greeting(c);
	return 0;
}

void conn_shutdown(struct conn *c)
{
	if (!c->bev)
		return;
	if (c->phase != CONN_TRANSMISSION) {
		conn_kill(c, "server shutting down");
		return;
	}
	conn_begin_close(c);
}
