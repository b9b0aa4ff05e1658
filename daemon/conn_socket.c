/*
 * daemon/conn_socket.c: a plaintext connection's socket, read and written by
 * the connection itself (see conn.h), and payload sinks.
 *
 * Reading (conn_on_readable): one readv per readable event, into what a
 * sink still wants (a WRITE's payload, received straight into the cache's
 * arena or its request's buffer) and then into the input buffer, whose
 * read size adapts (CONN_READ_SIZE). libevent's own reads are 4 KiB each,
 * with an ioctl(FIONREAD) before every one. Under TLS the filter
 * bufferevent reads, and sinks are filled from the decrypted input
 * (sink_from_input).
 *
 * Writing (conn_on_writable): replies queued during a round of events go
 * out in one writev when the round ends; the bufferevent writes only what
 * the socket would not take then, and hands back once it is all gone.
 *
 * Same thread and lifetime rules as conn.c: the connection's worker only,
 * and a reference held across anything that may kill the connection.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <string.h>
#include <sys/uio.h>

#include "daemon/conn.h"
#include "daemon/conn_internal.h"
#include "daemon/log.h"
#include "daemon/uring.h"
#include "daemon/worker.h"

/* Reading on or off: the connection's own reader, or the bufferevent's. */
void conn_read_set(struct conn *c, bool on)
{
	if (on && c->yielded)
		return; /* until its next turn (conn_resume_next) */
	if (c->reader) {
		if (on == c->reader_on)
			return;
		c->reader_on = on;
		if (on)
			event_add(c->reader, NULL);
		else
			event_del(c->reader);
	} else if (on) {
		bufferevent_enable(c->bev, EV_READ);
	} else {
		bufferevent_disable(c->bev, EV_READ);
	}
}

/* n more bytes are in the sink's segments. */
static void sink_advance(struct conn_sink *k, size_t n)
{
	k->left -= n;
	k->filled += n;
	while (n) {
		size_t room = k->iov[k->at].iov_len - k->at_filled;
		size_t take = n < room ? n : room;
		k->at_filled += take;
		n -= take;
		if (k->at_filled == k->iov[k->at].iov_len) {
			k->at++;
			k->at_filled = 0;
		}
	}
}

/* Move what the input buffer holds of the sink's bytes into it. */
static void sink_from_input(struct conn *c)
{
	struct conn_sink *k = &c->sink;
	struct evbuffer *in = conn_input(c);
	size_t copied = 0;
	while (k->left && evbuffer_get_length(in)) {
		size_t room = k->iov[k->at].iov_len - k->at_filled;
		int n = evbuffer_remove(in, (char *)k->iov[k->at].iov_base + k->at_filled, room);
		if (n <= 0)
			break;
		sink_advance(k, (size_t)n);
		copied += (size_t)n;
	}
	conn_counter_add(&c->payload_copied, copied);
}

/* The sink is full, or will never be: hand it back. */
void conn_sink_end(struct conn *c)
{
	struct conn_sink k = c->sink;
	memset(&c->sink, 0, sizeof(c->sink));
	if (c->closing && c->bev)
		conn_read_set(c, false); /* it was reading for the sink only */
	k.done(c, k.arg, k.filled);
}

bool conn_sink_start(struct conn *c, const struct iovec *iov, size_t niov, uint64_t len,
		     void (*done)(struct conn *c, void *arg, uint64_t received), void *arg)
{
	c->sink =
	    (struct conn_sink){.iov = iov, .niov = niov, .left = len, .done = done, .arg = arg};
	c->after_large_payload = len >= CONN_SINK_LARGE;
	sink_from_input(c);
	if (!c->sink.left) {
		memset(&c->sink, 0, sizeof(c->sink));
		return true;
	}
	conn_payload_progress(c, (size_t)c->sink.filled, true);
	return false;
}

/* The sink got bytes: the stall clock; once full, handed back (its request
 * may prepare backend I/O on the ring, submitted here). True when full. */
static bool sink_moved(struct conn *c)
{
	conn_payload_progress(c, (size_t)c->sink.filled, false);
	if (c->sink.left)
		return false;
	conn_sink_end(c);
	uring_submit(&c->worker->ring);
	return true;
}

/*
 * The input buffer got bytes: a sink takes its own first (under TLS, the
 * filter decrypted them there), then the phase reads what follows.
 */
void conn_input_ready(struct conn *c)
{
	if (c->yielded)
		return; /* its share of this turn is spent: the next one */
	if (c->sink.left) {
		sink_from_input(c);
		if (!sink_moved(c))
			return;
	}
	if (c->bev && !c->closing)
		c->on_input(c);
}

static void read_resume(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	if (c->bev && (c->reading || c->sink.left))
		conn_read_set(c, true);
	conn_unref(c);
}

/*
 * No memory for the input buffer: reading stops for 10 ms, and then tries
 * again. Ending the connection would fail every request in flight, and
 * going on would spin on a socket that stays readable; memory that runs
 * short often comes back (writeback, replies sent). The deadlines still
 * run meanwhile.
 */
static void read_pause(struct conn *c)
{
	static _Atomic uint64_t logged_ns;
	if (log_due(&logged_ns, 1000000000u))
		log_error("conn %llu: no memory to read requests into: reading again in 10 ms",
			  (unsigned long long)c->id);
	struct timeval tv = {0, 10000};
	conn_read_set(c, false);
	conn_ref(c);
	if (event_base_once(c->worker->base, -1, EV_TIMEOUT, read_resume, c, &tv) < 0) {
		conn_kill(c, "out of memory reading requests");
		conn_unref(c);
	}
}

/*
 * The plaintext socket is readable: one readv, into what a sink still
 * wants and then up to CONN_READ_CHUNK of the input buffer (while a sink
 * waits, only a little of it: the next request's header and the start of
 * its payload, so that the next sink gets its bytes straight too).
 */
void conn_on_readable(evutil_socket_t fd, short what, void *arg)
{
	(void)what;
	struct conn *c = arg;
	if (c->yielded)
		return; /* its next turn reads (conn_resume_next) */
	struct conn_sink *k = &c->sink;
	struct iovec iov[CONN_SINK_IOV + 2];
	size_t n = 0;
	uint64_t want = 0;
	for (size_t i = k->at; k->left && i < k->niov && n < CONN_SINK_IOV; i++) {
		size_t skip = i == k->at ? k->at_filled : 0;
		iov[n].iov_base = (char *)k->iov[i].iov_base + skip;
		iov[n].iov_len = k->iov[i].iov_len - skip;
		want += iov[n++].iov_len;
	}
	struct evbuffer *in = conn_input(c);
	struct evbuffer_iovec ev[2];
	int nev = 0;
	/* While a sink waits, or right after a large one (the next request may
	 * be another), the input buffer takes 4 KiB: the next header and the
	 * start of its payload, so that the rest of a large one goes straight
	 * into its sink and not through the input buffer. */
	bool small = k->left || c->after_large_payload;
	if (!k->left)
		c->after_large_payload = false; /* this read takes the next header */
	/* The bufferevent keeps its input's end frozen but while it reads. */
	evbuffer_unfreeze(in, 0);
	/* The input buffer only after the sink's last byte: a sink of more
	 * than CONN_SINK_IOV segments takes them in several reads, and bytes
	 * of it read into the input buffer meanwhile would come before the
	 * next read's (the sink would take those out of order, then wait
	 * for bytes already read). */
	if (!c->closing && want == k->left) {
		size_t size = small ? 4096 : CONN_READ_SIZE(c->read_shift);
		nev = evbuffer_reserve_space(in, size, ev, 2);
		if (nev < 0 && size > 4096) {
			c->read_shift = CONN_READ_MIN_SHIFT;
			nev = evbuffer_reserve_space(in, 4096, ev, 2);
		}
		if (nev < 0)
			nev = 0;
		for (int i = 0; i < nev; i++) {
			iov[n].iov_base = ev[i].iov_base;
			iov[n++].iov_len = ev[i].iov_len;
		}
	}
	if (!n) {
		evbuffer_freeze(in, 0);
		read_pause(c);
		return;
	}
	ssize_t got = readv(fd, iov, (int)n);
	if (got <= 0) {
		int err = errno;
		evbuffer_freeze(in, 0);
		if (got < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR))
			return;
		conn_ref(c);
		conn_kill(c, got == 0 ? "client closed the connection" : strerror(err));
		conn_unref(c);
		return;
	}
	size_t rest = (size_t)got;
	if (!small) {
		size_t asked = CONN_READ_SIZE(c->read_shift);
		if (rest >= asked && c->read_shift < CONN_READ_MAX_SHIFT)
			c->read_shift++;
		else if (rest < asked / 4 && c->read_shift > CONN_READ_MIN_SHIFT)
			c->read_shift--;
	}
	if (want) {
		size_t to_sink = rest < want ? rest : (size_t)want;
		sink_advance(k, to_sink);
		rest -= to_sink;
	}
	for (int i = 0; i < nev; i++) {
		size_t take = rest < ev[i].iov_len ? rest : ev[i].iov_len;
		ev[i].iov_len = take;
		rest -= take;
	}
	if (nev)
		evbuffer_commit_space(in, ev, nev);
	evbuffer_freeze(in, 0);
	conn_ref(c);
	if (want)
		sink_moved(c);
	if (c->bev && !c->closing && !k->left && evbuffer_get_length(in))
		c->on_input(c);
	conn_unref(c);
}

/*
 * Replies were queued (conn_on_output made this event active, so it runs
 * once this round of events is done, after every request the round read):
 * one writev for all of them, straight away. Only what the socket will not
 * take now goes to the bufferevent, which waits for EPOLLOUT. Without this
 * every reply batch cost an epoll_ctl to watch for EPOLLOUT, an epoll_wait
 * that reported it, and another epoll_ctl to stop watching.
 */
void conn_on_writable(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn *c = arg;
	c->write_queued = false;
	if (!c->bev)
		return;
	struct evbuffer *out = bufferevent_get_output(c->bev);
	conn_ref(c);
	/* The bufferevent keeps its output's start frozen but while it writes. */
	evbuffer_unfreeze(out, 1);
	errno = 0;
	int n = evbuffer_write(out, conn_fd(c));
	int err = errno;
	evbuffer_freeze(out, 1);
	if (n < 0 && err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
		conn_kill(c, strerror(err ? err : EIO));
	else if (evbuffer_get_length(out))
		bufferevent_enable(c->bev, EV_WRITE);
	else
		conn_output_drained(c);
	conn_unref(c);
}

int conn_add_input(struct conn *c, const void *data, size_t len)
{
	struct evbuffer *in = conn_input(c);
	/* The input's end is the reader's (frozen between its reads). */
	evbuffer_unfreeze(in, 0);
	int rc = evbuffer_add(in, data, len);
	evbuffer_freeze(in, 0);
	return rc < 0 ? -ENOMEM : 0;
}
