/*
 * daemon/conn.c: connection lifetime and the read loop (see conn.h).
 *
 * The phase gets its input through c->on_input (session.c, which runs the
 * phase's step function until it needs more bytes). A plaintext
 * connection reads and writes its socket itself (conn_socket.c); under TLS
 * the bufferevent reads (the filter decrypts into the input buffer) and
 * writes. Reading pauses while too many requests or too many reply bytes
 * are pending, or while the daemon-wide budget refuses the connection, and
 * resumes from conn_update_reading() when replies complete, the output
 * drains or the budget has room again; input already buffered goes to
 * c->on_input then.
 *
 * The output buffer's callback keeps two facts: what it holds, in the
 * budget (conn_output_sync), and when the replies last moved, for the
 * stall deadline. That deadline is ours, not libevent's write timeout, so
 * that its meaning is written down: --stall-timeout seconds in which
 * the socket took less than CONN_STALL_PROGRESS bytes of the replies. A
 * stalled connection is reset, not closed (conn_on_timer).
 */
#include "daemon/conn.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/budget.h"
#include "daemon/conn_internal.h"
#include "daemon/clock.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/tls.h"
#include "daemon/worker.h"

struct evbuffer *conn_output(struct conn *c)
{
	return bufferevent_get_output(c->bev);
}

void conn_add(struct conn *c, const void *data, size_t n)
{
	if (!c->bev)
		return;
	struct evbuffer *out = bufferevent_get_output(c->bev);
	int rc;
	if (c->output_after_ref) {
		/*
		 * evbuffer_add() would size the chain after a reference like
		 * the reference (a 4 KiB READ's data: an 8 KiB chain for the
		 * next reply's 16-byte header; a 32 MiB one: 32 MiB). Space
		 * reserved is a chain of its own size, at least 1 KiB, which
		 * CONN_REF_OVERHEAD counts.
		 */
		struct evbuffer_iovec v;
		rc = evbuffer_reserve_space(out, n, &v, 1) == 1 ? 0 : -1;
		if (rc == 0) {
			memcpy(v.iov_base, data, n);
			v.iov_len = n;
			rc = evbuffer_commit_space(out, &v, 1);
		}
	} else {
		rc = evbuffer_add(out, data, n);
	}
	if (rc < 0) {
		conn_kill(c, "out of memory queueing a reply");
		return;
	}
	c->output_after_ref = false;
}

bool conn_add_ref(struct conn *c, const void *data, size_t len,
		  void (*done)(const void *data, size_t len, void *arg), void *arg)
{
	if (!c->bev)
		return false;
	if (evbuffer_add_reference(conn_output(c), data, len, done, arg) < 0) {
		conn_kill(c, "out of memory queueing a reply");
		return false;
	}
	c->output_after_ref = true;
	c->output_refs += len + CONN_REF_OVERHEAD;
	conn_output_sync(c);
	return true;
}

void conn_ref_released(struct conn *c, size_t len)
{
	c->output_refs -= len + CONN_REF_OVERHEAD;
	conn_output_sync(c);
}

struct evbuffer *conn_input(struct conn *c)
{
	return bufferevent_get_input(c->bev);
}

int conn_fd(struct conn *c)
{
	if (!c->bev)
		return -1;
	struct bufferevent *under = bufferevent_get_underlying(c->bev);
	return bufferevent_getfd(under ? under : c->bev);
}

/* Reply bytes not yet taken by the socket: the output buffer's, and under
 * a filter (TLS) the ciphertext it made of them. */
static size_t conn_unsent(struct conn *c)
{
	size_t n = evbuffer_get_length(conn_output(c));
	struct bufferevent *under = bufferevent_get_underlying(c->bev);
	if (under)
		n += evbuffer_get_length(bufferevent_get_output(under));
	return n;
}

void conn_ref(struct conn *c)
{
	c->refs++;
}

LOG_LIMIT(ended_negotiating_log, "connections ended in negotiation");
LOG_LIMIT_SESSIONS(ended_log, "connections ended");

void conn_unref(struct conn *c)
{
	if (--c->refs > 0)
		return;
	conn_registry_remove(c);
	uint64_t ms = (clock_now_ns() - c->started_ns) / 1000000u;
	char line[2048];
	snprintf(line, sizeof(line),
		 "ended after %llu.%03llu s: %s; export \"%s\", %llu requests, %llu bytes read, "
		 "%llu bytes written",
		 (unsigned long long)(ms / 1000), (unsigned long long)(ms % 1000),
		 c->end_why[0] ? c->end_why : "closed", c->export ? c->export->name : "",
		 (unsigned long long)c->requests, (unsigned long long)c->bytes_read,
		 (unsigned long long)c->bytes_written);
	/* One that never opened an export is any client's to make, as many as
	 * it likes (refused ones too): its line is rate-limited. */
	if (c->export)
		log_limited(&ended_log, LOG_INFO, "conn %llu: %s", (unsigned long long)c->id, line);
	else
		log_limited(&ended_negotiating_log, LOG_INFO, "conn %llu: %s",
			    (unsigned long long)c->id, line);
	if (c->budget_waiting)
		budget_wait_done(c->worker);
	budget_client_remove();
	budget_peer_remove(&c->peer);
	access_peer_release(&c->peer);
	conn_set_remove(c->set, c);
	if (c->throttle_timer)
		event_free(c->throttle_timer);
	if (c->export) {
		if (c->qos_client)
			qos_client_put(c->export->counter->qos, c->qos_client, clock_now_ns());
		export_detach(c->export);
		export_put(c->export);
	}
	export_put(c->meta_export);
	if (c->timer)
		event_free(c->timer);
	if (c->hangup)
		event_free(c->hangup);
	if (c->reader)
		event_free(c->reader);
	if (c->writer)
		event_free(c->writer);
	free(c);
}

void conn_kill(struct conn *c, const char *why)
{
	if (!c->bev)
		return;
	log_debug("conn %llu: closing: %s", (unsigned long long)c->id, why);
	/* "finished" is the orderly end of a close begun for a reason given then. */
	if (!c->end_why[0] || strcmp(why, "finished") != 0)
		snprintf(c->end_why, sizeof(c->end_why), "%s", why);
	struct bufferevent *bev = c->bev;
	c->bev = NULL;
	c->reading = false;
	c->cancel_requests = true; /* no reply can reach the client now */
	if (c->on_cancel)
		c->on_cancel(c); /* requests held back end unanswered */
	if (c->timer)
		evtimer_del(c->timer);
	if (c->budget_waiting) {
		c->budget_waiting = false;
		budget_wait_done(c->worker);
	}
	if (c->hangup)
		event_del(c->hangup);
	if (c->reader)
		event_del(c->reader);
	c->reader_on = false;
	if (c->writer)
		event_del(c->writer);
	c->write_queued = false;
	/* A payload half received: its request ends without a reply. */
	if (c->sink.left)
		conn_sink_end(c);
	tls_conn_end(c, why);
	/* What the output holds goes with it; so does a half-read request. */
	evbuffer_remove_cb_entry(bufferevent_get_output(bev), c->output_cb);
	conn_output_sync(c); /* down to the references, freed with the buffer */
	conn_unreserve(c, c->admitted);
	c->admitted = 0;
	/* Under a filter (TLS), the socket's bufferevent goes after it. */
	struct bufferevent *under = bufferevent_get_underlying(bev);
	bufferevent_free(bev);
	if (under)
		bufferevent_free(under);
	conn_unref(c);
}

static void conn_arm_timer_ns(struct conn *c, uint64_t ns)
{
	struct timeval tv = {(time_t)(ns / 1000000000u), (suseconds_t)(ns % 1000000000u / 1000u)};
	if (c->timer)
		evtimer_add(c->timer, &tv);
}

static void conn_arm_timer(struct conn *c, int seconds)
{
	conn_arm_timer_ns(c, (uint64_t)seconds * 1000000000u);
}

/*
 * The stall deadline: set once on the main thread before the workers start
 * (thread creation orders it before their reads), read-only after. The
 * reasons a stalled connection is reset with are written once, here, so the
 * log names the deadline in force.
 */
static struct {
	uint64_t ns;
	char replies_why[80], payload_why[128];
} stall;

void conn_set_stall_timeout(unsigned seconds)
{
	stall.ns = (uint64_t)seconds * 1000000000u;
	snprintf(stall.replies_why, sizeof(stall.replies_why),
		 "client has not read its replies for %u s", seconds);
	snprintf(stall.payload_why, sizeof(stall.payload_why),
		 "client sent a request's payload too slowly (under 1 MiB/s after %u s, or "
		 "nothing for %u s)",
		 seconds, seconds);
}

/* The negotiation deadline, likewise set once before the workers start. */
static struct {
	unsigned seconds;
	char why[64];
} negotiation;

void conn_set_negotiation_timeout(unsigned seconds)
{
	negotiation.seconds = seconds;
	snprintf(negotiation.why, sizeof(negotiation.why), "negotiation did not finish in %u s",
		 seconds);
}

/*
 * In transmission: how long until a stall deadline, 0 if one has passed,
 * UINT64_MAX if none runs. Two of them: replies that do not move (the
 * client does not read), and an admitted request whose payload does not
 * come (it holds its reservation in the budget meanwhile).
 */
static uint64_t conn_stall_left(struct conn *c, const char **why)
{
	uint64_t now = clock_now_ns(), left = UINT64_MAX;
	if (conn_unsent(c) > 0) {
		uint64_t still = now - c->output_moved_ns;
		*why = stall.replies_why;
		left = still < stall.ns ? stall.ns - still : 0;
	}
	if ((c->admitted || c->sink.left) && left) {
		uint64_t still = now - c->payload_moved_ns;
		uint64_t payload_left = still < stall.ns ? stall.ns - still : 0;
		if (c->sink.left) {
			/* The floor: the grace, then CONN_PAYLOAD_FLOOR on average. */
			uint64_t due = c->payload_start_ns + stall.ns +
				       c->sink.filled * 1000000000u / CONN_PAYLOAD_FLOOR;
			uint64_t floor_left = due > now ? due - now : 0;
			if (floor_left < payload_left)
				payload_left = floor_left;
		}
		if (payload_left == 0)
			*why = stall.payload_why;
		if (payload_left < left)
			left = payload_left;
	}
	return left;
}

/*
 * The connection's one timer: the negotiation deadline; in transmission
 * the stall checks (conn_stall_left), armed when there is something to
 * watch and run again until a deadline passes or nothing is left to
 * watch; the close deadline once closing.
 */
static void conn_on_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	const char *why =
	    c->closing ? "client did not read its last replies in time" : negotiation.why;
	if (c->phase == CONN_TRANSMISSION && !c->closing) {
		if (!c->bev)
			return;
		uint64_t left = conn_stall_left(c, &why);
		if (left == UINT64_MAX)
			return;
		if (left > 0) {
			conn_arm_timer_ns(c, left);
			return;
		}
	}
	/*
	 * Reset, not close: a FIN would wait behind the unread replies for a
	 * window the client never opens, and the kernel would keep them (and
	 * the client would not learn it was cut off) for minutes.
	 */
	struct linger reset = {.l_onoff = 1, .l_linger = 0};
	if (c->bev)
		setsockopt(conn_fd(c), SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
	conn_ref(c);
	conn_kill(c, why);
	conn_unref(c);
}

static void conn_watch_stall(struct conn *c)
{
	if (c->phase == CONN_TRANSMISSION && !c->closing && c->timer &&
	    !evtimer_pending(c->timer, NULL))
		conn_arm_timer_ns(c, stall.ns);
}

void conn_payload_progress(struct conn *c, size_t avail, bool started)
{
	if (started || avail >= c->payload_seen + CONN_STALL_PROGRESS) {
		c->payload_seen = avail;
		c->payload_moved_ns = clock_now_ns();
		if (started)
			c->payload_start_ns = c->payload_moved_ns;
	}
	conn_watch_stall(c);
}

/*
 * What the output buffer holds, in the budget: its bytes, but at least the
 * whole of the data it references. A reference is freed only once all of
 * it is sent, and the socket may have taken most of it (a kernel buffers
 * megabytes for a client that reads nothing): its length alone would let
 * such memory go uncounted.
 */
void conn_output_sync(struct conn *c)
{
	/* Once killed, the references live until libevent frees the buffer. */
	uint64_t held = c->bev ? conn_unsent(c) : 0;
	if (held < c->output_refs)
		held = c->output_refs;
	if (held > c->output_counted)
		budget_add(held - c->output_counted);
	else
		budget_release(c->output_counted - held);
	c->output_counted = held;
}

/*
 * Every change of the output buffer: the budget's count, and the stall
 * clock, which starts when the buffer stops being empty and again whenever
 * the socket took CONN_STALL_PROGRESS from it. Adding replies does not
 * move it.
 */
static void conn_on_output(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg)
{
	(void)buf;
	struct conn *c = arg;
	conn_output_sync(c);
	/* Under a filter, the socket taking ciphertext is what moves (tls.c). */
	if (info->n_deleted && !bufferevent_get_underlying(c->bev))
		conn_output_moved(c, info->n_deleted);
	if (!info->n_added)
		return;
	if (c->writer && !c->write_queued && !(bufferevent_get_enabled(c->bev) & EV_WRITE)) {
		c->write_queued = true;
		event_active(c->writer, 0, 0);
	}
	if (info->orig_size == 0) {
		c->output_moved_ns = clock_now_ns();
		c->output_moved_bytes = 0;
	}
	conn_watch_stall(c);
}

void conn_output_moved(struct conn *c, size_t n)
{
	c->output_moved_bytes += n;
	if (c->output_moved_bytes >= CONN_STALL_PROGRESS) {
		c->output_moved_ns = clock_now_ns();
		c->output_moved_bytes = 0;
	}
}

static void conn_on_read(struct bufferevent *bev, void *arg);
static void conn_on_write(struct bufferevent *bev, void *arg);
static void conn_on_event(struct bufferevent *bev, short what, void *arg);

int conn_set_filter(struct conn *c, struct bufferevent *filter)
{
	struct evbuffer_cb_entry *cb =
	    evbuffer_add_cb(bufferevent_get_output(filter), conn_on_output, c);
	if (!cb)
		return -ENOMEM;
	/* The filter reads through the socket's bufferevent from now on. */
	if (c->reader) {
		event_free(c->reader);
		c->reader = NULL;
		c->reader_on = false;
		bufferevent_enable(c->bev, EV_READ);
	}
	/* ... and writes it: the ciphertext, after what plaintext is queued. */
	if (c->writer) {
		event_free(c->writer);
		c->writer = NULL;
		c->write_queued = false;
		bufferevent_enable(c->bev, EV_WRITE);
	}
	evbuffer_remove_cb_entry(bufferevent_get_output(c->bev), c->output_cb);
	c->output_cb = cb;
	c->bev = filter;
	bufferevent_setcb(filter, conn_on_read, conn_on_write, conn_on_event, c);
	bufferevent_setwatermark(filter, EV_WRITE, CONN_MAX_OUTPUT / 2, 0);
	bufferevent_enable(filter, EV_WRITE);
	if (c->reading)
		bufferevent_enable(filter, EV_READ);
	else
		bufferevent_disable(filter, EV_READ);
	conn_output_sync(c);
	return 0;
}

void conn_negotiation_done(struct conn *c)
{
	if (c->timer)
		evtimer_del(c->timer);
}

void conn_begin_close(struct conn *c, const char *why)
{
	if (!c->bev || c->closing)
		return;
	snprintf(c->end_why, sizeof(c->end_why), "%s", why);
	c->closing = true;
	c->reading = false;
	/* A payload half received is read to its end: its request is answered. */
	conn_read_set(c, c->sink.left > 0);
	conn_arm_timer(c, CONN_CLOSE_TIMEOUT);
	conn_update_reading(c);
}

static bool conn_drained(struct conn *c)
{
	return c->inflight == 0 && conn_unsent(c) == 0;
}

void conn_park(struct conn *c, bool on)
{
	if (!c->bev || c->closing)
		return;
	c->parking = on;
	c->park_negotiation = on && c->phase != CONN_TRANSMISSION;
	conn_update_reading(c);
	/* Resumed: the requests that arrived meanwhile wait in the input. */
	if (!on && c->reading)
		conn_input_ready(c);
}

void conn_park_negotiation_end(struct conn *c)
{
	if (!c->park_negotiation)
		return;
	c->park_negotiation = false;
	if (c->bev && !c->closing)
		conn_update_reading(c);
}

/* Parking and still negotiating, with leave to finish. */
static bool conn_park_negotiating(const struct conn *c)
{
	return c->park_negotiation && c->phase != CONN_TRANSMISSION;
}

bool conn_parked(struct conn *c)
{
	return c->parking && c->bev && !c->closing && !c->sink.left && !c->discard &&
	       !c->admitted && !conn_park_negotiating(c) && conn_drained(c);
}

/* What the connection holds in the budget: reservations and its output. */
static uint64_t conn_held(struct conn *c)
{
	return c->reserved + c->output_counted;
}

static void conn_on_hangup(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	conn_ref(c);
	conn_kill(c, c->budget_waiting
			 ? "client closed the connection while waiting for reply memory"
			 : "client closed the connection with its most requests in flight");
	conn_unref(c);
}

/*
 * Watch for the client closing while nothing reads the socket (EV_CLOSED,
 * epoll's RDHUP): waiting for reply memory, or at the most requests in
 * flight. Either would otherwise be noticed only once a reply is written,
 * after requests were served for nobody; and a long TRIM or WRITE_ZEROES
 * replies only when done, so its steps would go on (cancel_requests).
 */
static void conn_watch_hangup(struct conn *c, bool on)
{
	if (on && !c->hangup)
		c->hangup = event_new(c->worker->base, conn_fd(c), EV_CLOSED | EV_PERSIST,
				      conn_on_hangup, c);
	if (c->hangup && on)
		event_add(c->hangup, NULL);
	else if (c->hangup)
		event_del(c->hangup);
}

/* Register as a waiter for cost; false if budget came back meanwhile. */
static bool conn_wait(struct conn *c, uint64_t cost)
{
	budget_wait(c->worker, cost);
	if (budget_fits(cost, conn_held(c))) {
		budget_wait_done(c->worker);
		return false;
	}
	c->budget_waiting = true;
	c->budget_cost = cost;
	conn_watch_hangup(c, true);
	return true;
}

bool conn_admit(struct conn *c, uint64_t cost)
{
	while (!budget_reserve(cost, conn_held(c))) {
		if (conn_wait(c, cost)) {
			c->reading = false;
			conn_read_set(c, c->sink.left > 0);
			return false;
		}
	}
	c->reserved += cost;
	return true;
}

void conn_unreserve(struct conn *c, uint64_t bytes)
{
	c->reserved -= bytes;
	budget_release(bytes);
}

static void conn_stop_waiting(struct conn *c)
{
	c->budget_waiting = false;
	budget_wait_done(c->worker);
	conn_watch_hangup(c, false);
	conn_update_reading(c);
}

/*
 * Retry the waiting connections that fit now; the others say again what
 * they wait for (and look once more, so that no release is missed).
 */
void conn_budget_wake(struct conn_set *set)
{
	struct worker *w = set->worker;
	struct conn *c = set->conns;
	while (c) {
		conn_ref(c);
		if (c->budget_waiting && c->bev) {
			if (!budget_fits(c->budget_cost, conn_held(c)))
				budget_wait_more(w, c->budget_cost);
			if (budget_fits(c->budget_cost, conn_held(c)))
				conn_stop_waiting(c);
		}
		struct conn *next = c->next;
		conn_unref(c);
		c = next;
	}
	uring_submit(&w->ring);
}

/* Reading on, and whatever input is buffered to the phase. */
void conn_reading_on(struct conn *c)
{
	conn_read_set(c, true);
	/* Under a filter, records read before reading stopped are decrypted
	 * now (the socket will not say so again). */
	if (bufferevent_get_underlying(c->bev))
		bufferevent_flush(c->bev, EV_READ, BEV_NORMAL);
	/* Requests may already sit in the input buffer. */
	conn_input_ready(c);
}

void conn_update_reading(struct conn *c)
{
	if (!c->bev)
		return;
	if (c->closing) {
		/* TLS ends with its close_notify, sent once the rest has gone. */
		if (conn_drained(c) && !tls_close_notify(c))
			conn_kill(c, "finished");
		return;
	}
	/* Negotiation replies are small: a client that does not read them stops us early. */
	size_t max_output =
		c->phase == CONN_TRANSMISSION ? CONN_MAX_OUTPUT : CONN_MAX_NEGOTIATION_OUTPUT;
	bool want = !(c->parking && !conn_park_negotiating(c) && !c->discard && !c->admitted) &&
		    c->inflight < CONN_MAX_INFLIGHT &&
		    c->inflight_bytes < CONN_MAX_INFLIGHT_BYTES &&
		    evbuffer_get_length(conn_output(c)) < max_output && !c->budget_waiting;
	/* Replies that bypass admission (refusals, errors) are small, but many.
	 * An admitted payload is read whatever: its room is reserved. */
	if (want && c->phase == CONN_TRANSMISSION && !c->admitted && !c->sink.left &&
	    !budget_fits(0, conn_held(c)) && conn_wait(c, 0))
		want = false;
	/* So is a payload that has its sink: its request holds its room. */
	if (c->sink.left)
		want = true;
	if (want == c->reading)
		return;
	c->reading = want;
	/* At the most requests in flight a client that is gone would not be
	 * noticed (the budget's wait watches for it itself). */
	if (c->phase == CONN_TRANSMISSION && !c->budget_waiting)
		conn_watch_hangup(c, !want && c->inflight >= CONN_MAX_INFLIGHT);
	if (want)
		conn_reading_on(c);
	else
		conn_read_set(c, false);
}

static void conn_on_read(struct bufferevent *bev, void *arg)
{
	(void)bev;
	struct conn *c = arg;
	conn_ref(c);
	conn_input_ready(c);
	conn_unref(c);
}

/* Replies drained: what it holds may fit its reserve now. */
void conn_output_drained(struct conn *c)
{
	if (c->budget_waiting && budget_fits(c->budget_cost, conn_held(c)))
		conn_stop_waiting(c);
	else
		conn_update_reading(c);
}

static void conn_on_write(struct bufferevent *bev, void *arg)
{
	struct conn *c = arg;
	conn_ref(c);
	/* The socket took all of it: the writer (conn_on_writable) again. */
	if (c->writer && !evbuffer_get_length(bufferevent_get_output(bev)))
		bufferevent_disable(bev, EV_WRITE);
	conn_output_drained(c);
	conn_unref(c);
}

static void conn_on_event(struct bufferevent *bev, short what, void *arg)
{
	(void)bev;
	struct conn *c = arg;
	if (tls_closing(c) && (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)))
		conn_kill(c, "finished"); /* gone before TLS's close_notify: as asked */
	else if (what & BEV_EVENT_TIMEOUT)
		conn_kill(c, stall.replies_why);
	else if (what & BEV_EVENT_EOF)
		conn_kill(c, "client closed the connection");
	else if (what & BEV_EVENT_ERROR)
		conn_kill(c, strerror(EVUTIL_SOCKET_ERROR()));
}

int conn_start(struct conn_set *set, int fd, uint64_t id, const struct access_peer *peer,
	       void (*on_input)(struct conn *c), struct conn **out)
{
	struct worker *w = set->worker;
	struct conn *c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		budget_client_remove();
		budget_peer_remove(peer);
		access_peer_release(peer);
		return -ENOMEM;
	}
	c->peer = *peer;
	evutil_make_socket_nonblocking(fd);
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* fails on Unix: fine */
	c->id = id;
	c->worker = w;
	c->set = set;
	c->phase = CONN_FLAGS;
	c->refs = 1; /* the socket */
	c->on_input = on_input;
	c->started_ns = clock_now_ns();
	c->bev = bufferevent_socket_new(w->base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (!c->bev) {
		close(fd);
		free(c);
		budget_client_remove();
		budget_peer_remove(peer);
		access_peer_release(peer);
		return -ENOMEM;
	}
	conn_set_add(set, c);
	bufferevent_setcb(c->bev, conn_on_read, conn_on_write, conn_on_event, c);
	/* Larger reads than libevent's 16 KiB default: payloads are up to 32 MiB. */
	bufferevent_set_max_single_read(c->bev, 1 << 20);
	bufferevent_set_max_single_write(c->bev, 1 << 20);
	/* The write callback fires when the output drains below this. */
	bufferevent_setwatermark(c->bev, EV_WRITE, CONN_MAX_OUTPUT / 2, 0);
	/* A client gets --negotiation-timeout seconds, in all, to negotiate. */
	c->timer = evtimer_new(w->base, conn_on_timer, c);
	/*
	 * Replies that make no progress for --stall-timeout end the
	 * connection: while its output is backed up the connection reads
	 * nothing (not even a DISC), so without it a client could park its
	 * buffers here forever.
	 */
	c->output_cb = evbuffer_add_cb(bufferevent_get_output(c->bev), conn_on_output, c);
	if (!c->timer || !c->output_cb) {
		if (c->timer)
			event_free(c->timer);
		conn_set_remove(set, c);
		bufferevent_free(c->bev);
		free(c);
		budget_client_remove();
		budget_peer_remove(peer);
		access_peer_release(peer);
		return -ENOMEM;
	}
	conn_registry_add(c);
	conn_arm_timer(c, (int)negotiation.seconds);
	c->reading = true;
	/* Plaintext: the socket is read by conn_on_readable (STARTTLS hands
	 * reading back to the bufferevent, conn_set_filter). */
	c->read_shift = CONN_READ_MIN_SHIFT;
	c->reader = event_new(w->base, fd, EV_READ | EV_PERSIST, conn_on_readable, c);
	c->writer = c->reader ? event_new(w->base, -1, 0, conn_on_writable, c) : NULL;
	if (c->reader) {
		c->reader_on = true;
		event_add(c->reader, NULL);
		/* ... and written by conn_on_writable, the bufferevent's writes
		 * only while the socket is full. */
		if (!c->writer)
			bufferevent_enable(c->bev, EV_WRITE);
		else
			bufferevent_disable(c->bev, EV_WRITE);
	} else {
		bufferevent_enable(c->bev, EV_READ | EV_WRITE);
	}
	log_debug("conn %llu: accepted on worker %u", (unsigned long long)id, w->index);
	*out = c;
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
	/* The replies of short requests go out; a long one stops at its next
	 * step and says ESHUTDOWN. */
	c->cancel_requests = true;
	if (c->on_cancel)
		c->on_cancel(c); /* requests held back: ESHUTDOWN */
	conn_begin_close(c, "server shutting down");
}
