/*
 * daemon/backend/nbd.c: an export whose bytes live on another NBD server,
 * reached through libnbd: nbd://, nbds://, nbd+unix:// URIs, or
 * "nbdkit:PLUGIN ARG..." for any nbdkit plugin, which the daemon starts
 * itself through libnbd's systemd socket activation (nbdkit exits with us).
 *
 * The backend owns one thread with its own libevent loop; it drives every
 * libnbd handle of the backend through nbd_aio_* calls, each handle's
 * socket watched in the direction libnbd asks for. backend_submit() may be
 * called from any worker: it queues the request and wakes the backend
 * thread; the completion is posted back to the submitting worker.
 *
 *   worker --submit--> queue --wake--> backend thread --aio--> server
 *   worker <--post---- done  <-------- free callback  <------- reply
 *
 * Connections. One slot, or NBD_MAX_CONNS when the server advertises
 * multi-conn (URIs only: each nbdkit: handle is a process of its own).
 * Each slot lives on its own:
 *
 *   IDLE --timer--> CONNECTING --handshake done--> READY
 *     ^                 |  no handshake within          |  EOF, error, a reply
 *     |                 |  NBD_CONNECT_TIMEOUT_MS        |  pending longer than
 *     +---- backoff ----+-------------------------------+  --backend-timeout
 *
 * (OFF: a slot not wanted, or given up.)
 *
 * Connecting is asynchronous (only the first connection, in
 * backend_nbd_open, is waited for), so a server that accepts but never
 * answers costs one slot, not the thread. A failed slot is tried again
 * after 0.1 s, doubling to 5 s. An extra slot that fails NBD_EXTRA_ATTEMPTS
 * times before it ever worked is given up (the server serves fewer
 * connections than it advertises); while the server reached through slot
 * 0 lacks multi-conn, only slot 0 is used.
 *
 * Requests. A request is cut into chunks the server accepts (its maximum
 * block size; 32-bit lengths for TRIM, WRITE_ZEROES and BLOCK_STATUS), at
 * most NBD_WINDOW in flight, spread over the ready connections. What the
 * server lacks is emulated or answered honestly: no WRITE_ZEROES -> zeros
 * are written; no FUA -> a flush after the write; no FAST_ZERO -> ENOTSUP;
 * no TRIM or CACHE -> nothing to do; no base:allocation -> all data.
 *
 * A FLUSH covers every write completed before it was sent: one flush when
 * every ready connection advertises multi-conn, else one on each.
 *
 * Failures. A chunk lost with its connection sends the whole request
 * again, on another connection or once one is back, while the request is
 * younger than --backend-timeout; after that it fails with EIO, as does a
 * request that waited that long for a connection. A connection whose
 * oldest command has had no reply for --backend-timeout is closed. When no
 * connection had any reply meanwhile the server is silent: every
 * connection is closed, and until a handshake succeeds again a request
 * that finds no connection fails at once. So no request waits much longer
 * than the timeout. An error the server returns is the request's error; a
 * connection error (ESHUTDOWN) also closes the connection.
 *
 * A connection given up with commands in flight is not simply closed: its
 * socket is kept (a duplicate, after nbd_close() retired the commands) and
 * read, the replies discarded, until the server closes it (its write side
 * is shut when no request is half sent), or it was quiet for
 * NBD_DRAIN_QUIET_MS after answering, or NBD_DRAIN_MAX_MS passed. A server
 * that resumes after a stop then finds its client still reading: nbdkit
 * 1.32.4 to 1.33.9 abort when a client hangs up while several threads
 * have replies to send (RHBZ#2173054), and the backend would be gone for
 * good. (Not for nbdkit: backends: nbd_close() waits for that process.)
 *
 * Durability is the cache's: a connection lost after commands that write
 * were sent on it moves base.loss_seq (backend.h), since writes the server
 * acknowledged may be gone with it. An emulated FUA write whose flush
 * completes after loss_seq moved is sent again. A write sent on a
 * connection declared dead may still be carried out by a server that was
 * only slow; nothing on the client side can take it back.
 *
 * The backend going down (no ready connection left) and coming back are
 * logged once each; single connections at debug level.
 *
 * libnbd ownership (libnbd(3) "Callback lifetimes", lib/rw.c): every
 * nbd_aio_* command's free callback runs exactly once. When the call
 * returns -1 it has already run; otherwise the command was queued, and the
 * callbacks run when it retires: when the reply comes, when the connection
 * dies (even inside the very nbd_aio_* call that queued it), or in
 * nbd_close(). So a chunk belongs to libnbd from the call on, and only
 * chunk_free() accounts for it.
 */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <libnbd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/backend/backend.h"
#include "daemon/clock.h"
#include "daemon/log.h"

#define NBD_MAX_CONNS 4
#define NBD_WINDOW 16 /* chunks of one request in flight */
#define NBD_ZERO_CHUNK (1u << 20)
#define NBD_COMPACT_MAX (0xffffffffu & ~(uint32_t)((1u << 20) - 1)) /* 32-bit lengths */
#define NBD_BACKOFF_MIN_MS 100
#define NBD_BACKOFF_MAX_MS 5000
#define NBD_CONNECT_TIMEOUT_MS 10000
#define NBD_EXTRA_ATTEMPTS 3 /* an extra slot that never worked is given up after these */
#define NBD_TICK_MS 100	     /* how often deadlines are looked at, while any is set */
#define NBD_ADVANCE_PASSES 8
#define NBD_DRAIN_MAX 16	      /* given-up sockets read at once */
#define NBD_DRAIN_QUIET_MS 1000	      /* a half-sent request: closed after this quiet */
#define NBD_DRAIN_MAX_MS 60000	      /* longest a given-up socket is read */

static const uint8_t zero_chunk[NBD_ZERO_CHUNK];

/* backend_io.state */
#define IO_DEFERRED (1u << 0) /* on nb->deferred */
#define IO_WAITING (1u << 1)  /* on nb->waiting, for a connection */
#define IO_RESTART (1u << 2)  /* a chunk was lost with its connection */
#define IO_FLUSHING (1u << 3) /* FUA emulated: the write is done, flush now */

enum conn_state {
	CONN_OFF,	 /* not wanted, or given up */
	CONN_IDLE,	 /* the timer starts the next attempt */
	CONN_CONNECTING, /* the timer is the handshake's deadline */
	CONN_READY,
};

struct nbd_backend;
struct nbd_chunk;

/* The socket of a given-up connection, read until the server is done with it. */
struct nbd_drain {
	struct nbd_backend *nb;
	struct nbd_drain *next;
	struct event *ev; /* readable, or NBD_DRAIN_QUIET_MS without data */
	int fd;
	bool half_sent; /* a request was half sent: the write side stays open */
	bool answered;	/* the server sent something since */
	uint64_t deadline_ns;
};

struct nbd_conn {
	struct nbd_backend *nb;
	unsigned index;
	enum conn_state state;
	struct nbd_handle *h; /* CONNECTING, READY */
	struct event *ev;     /* h's socket, in direction dir */
	int fd;
	unsigned dir;
	struct event *timer;
	unsigned backoff_ms; /* before the next attempt */
	bool ever_ready;
	bool given_up;
	unsigned failures; /* failed attempts before it ever worked */
	bool multi_conn;   /* this handle's server advertises it */
	bool wrote;	   /* a command that writes was sent on this handle */
	int broken;	   /* errno of a command that failed with a connection error */
	struct nbd_chunk *oldest, *newest; /* what libnbd holds, by age */
};

struct nbd_backend {
	struct backend base;
	char *name;  /* for logs: the URI or the nbdkit command */
	char *uri;   /* NULL for nbdkit */
	char **argv; /* nbdkit command line, NULL-terminated */
	uint64_t timeout_ns;
	unsigned timeout_s;
	bool can_flush, can_fua, can_fast_zero, can_cache, can_block_status;
	uint32_t max_block;
	unsigned max_conns; /* slots: NBD_MAX_CONNS with multi-conn, else 1 */

	pthread_t thread;
	bool started;
	struct event_base *loop;
	struct event *wake, *tick;

	pthread_mutex_t lock; /* guards the submit queue and stop */
	struct backend_io *queue_head, *queue_tail;
	bool stop;

	/* Backend thread only. */
	struct nbd_conn conns[NBD_MAX_CONNS];
	unsigned want_conns; /* max_conns, or 1 while slot 0's server lacks multi-conn */
	unsigned nready, next_conn;
	bool down;   /* the loss of the last ready connection was logged */
	bool silent; /* no reply on any connection for --backend-timeout, no handshake since */
	uint64_t last_reply_ns;
	struct backend_io *waiting, *waiting_tail; /* for a connection, in arrival order */
	struct backend_io *deferred;		   /* touched by libnbd callbacks: look again */
	struct nbd_drain *drains;
	unsigned ndrains;
};

/* One libnbd command: a chunk of a request. */
struct nbd_chunk {
	struct backend_io *io;
	struct nbd_conn *conn;
	struct nbd_chunk *older, *newer; /* conn's list */
	uint64_t sent_ns;
	int error;	/* from the completion callback */
	bool completed; /* the completion callback ran */
};

static struct nbd_backend *to_nbd(struct backend *be)
{
	return (struct nbd_backend *)be;
}

static void process_deferred(struct nbd_backend *nb);
static void issue_waiting(struct nbd_backend *nb);
static void tick_arm(struct nbd_backend *nb);

/* ---- connections ---- */

/* A new handle with its connection started, or NULL with the reason in err. */
static struct nbd_handle *handle_begin(struct nbd_backend *nb, char *err, size_t errlen)
{
	struct nbd_handle *h = nbd_create();
	if (!h) {
		snprintf(err, errlen, "%s", nbd_get_error());
		return NULL;
	}
	if (nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION) < 0 ||
	    (nb->uri ? nbd_aio_connect_uri(h, nb->uri)
		     : nbd_aio_connect_systemd_socket_activation(h, nb->argv)) < 0) {
		snprintf(err, errlen, "%s", nbd_get_error() ? nbd_get_error() : "connect failed");
		nbd_close(h);
		return NULL;
	}
	return h;
}

/*
 * The first connection, waited for (at most NBD_CONNECT_TIMEOUT_MS): the
 * export's size and capabilities come from it. Later ones are driven by
 * the backend thread's loop.
 */
static struct nbd_handle *connect_first(struct nbd_backend *nb, char *err, size_t errlen)
{
	struct nbd_handle *h = handle_begin(nb, err, errlen);
	if (!h)
		return NULL;
	uint64_t deadline = clock_now_ns() + (uint64_t)NBD_CONNECT_TIMEOUT_MS * 1000000u;
	int rc = 0;
	while (rc == 0 && !nbd_aio_is_ready(h)) {
		if (nbd_aio_is_dead(h) || nbd_aio_is_closed(h)) {
			rc = -1;
			break;
		}
		uint64_t now = clock_now_ns();
		if (now >= deadline) {
			snprintf(err, errlen, "no answer within %u ms", NBD_CONNECT_TIMEOUT_MS);
			nbd_close(h);
			return NULL;
		}
		unsigned dir = nbd_aio_get_direction(h);
		struct pollfd pfd = {.fd = nbd_aio_get_fd(h),
				     .events =
					 (short)((dir & LIBNBD_AIO_DIRECTION_READ ? POLLIN : 0) |
						 (dir & LIBNBD_AIO_DIRECTION_WRITE ? POLLOUT : 0))};
		int wait_ms = (int)((deadline - now) / 1000000u) + 1;
		if (pfd.fd < 0 || poll(&pfd, 1, wait_ms > 100 ? 100 : wait_ms) < 0) {
			rc = -1;
			break;
		}
		if (pfd.revents & (POLLIN | POLLHUP | POLLERR))
			rc = nbd_aio_notify_read(h);
		else if (pfd.revents & POLLOUT)
			rc = nbd_aio_notify_write(h);
	}
	if (rc < 0) {
		snprintf(err, errlen, "%s",
			 nbd_get_error() ? nbd_get_error() : "connection failed");
		nbd_close(h);
		return NULL;
	}
	return h;
}

static void conn_on_event(evutil_socket_t fd, short what, void *arg);

/* Watch what libnbd wants next on c's socket; false if it cannot be. */
static bool conn_watch(struct nbd_conn *c)
{
	unsigned dir = nbd_aio_get_direction(c->h);
	int fd = nbd_aio_get_fd(c->h);
	if (c->ev && c->dir == dir && c->fd == fd)
		return true;
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	if (fd < 0)
		return false;
	short what = (dir & LIBNBD_AIO_DIRECTION_READ ? EV_READ : 0) |
		     (dir & LIBNBD_AIO_DIRECTION_WRITE ? EV_WRITE : 0);
	c->ev = event_new(c->nb->loop, fd, what | EV_PERSIST, conn_on_event, c);
	if (!c->ev || event_add(c->ev, NULL) < 0)
		return false;
	c->dir = dir;
	c->fd = fd;
	return true;
}

static void drain_end(struct nbd_drain *d)
{
	struct nbd_backend *nb = d->nb;
	struct nbd_drain **p = &nb->drains;
	while (*p != d)
		p = &(*p)->next;
	*p = d->next;
	nb->ndrains--;
	if (d->ev)
		event_free(d->ev);
	close(d->fd);
	free(d);
}

static void drain_on_event(evutil_socket_t fd, short what, void *arg)
{
	struct nbd_drain *d = arg;
	static char sink[65536];
	if (what & EV_READ) {
		for (unsigned i = 0; i < 16; i++) {
			ssize_t n = read(fd, sink, sizeof(sink));
			if (n > 0) {
				d->answered = true;
				continue;
			}
			if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
				break;
			drain_end(d); /* the server closed it, or it broke */
			return;
		}
	} else if (d->half_sent && d->answered) {
		drain_end(d); /* answered, then quiet: nothing more is coming */
		return;
	}
	if (clock_now_ns() >= d->deadline_ns)
		drain_end(d);
}

/*
 * Keep h's socket open and read after nbd_close(h) (the file header says
 * why). False if it cannot be: the caller just closes.
 */
static bool drain_start(struct nbd_backend *nb, struct nbd_handle *h)
{
	int fd = nbd_aio_get_fd(h);
	if (fd < 0 || nb->ndrains >= NBD_DRAIN_MAX)
		return false;
	struct nbd_drain *d = calloc(1, sizeof(*d));
	if (!d)
		return false;
	d->nb = nb;
	d->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (d->fd < 0) {
		free(d);
		return false;
	}
	d->half_sent = (nbd_aio_get_direction(h) & LIBNBD_AIO_DIRECTION_WRITE) != 0;
	d->deadline_ns = clock_now_ns() + (uint64_t)NBD_DRAIN_MAX_MS * 1000000u;
	struct timeval quiet = {NBD_DRAIN_QUIET_MS / 1000, (NBD_DRAIN_QUIET_MS % 1000) * 1000};
	d->ev = event_new(nb->loop, d->fd, EV_READ | EV_PERSIST, drain_on_event, d);
	if (!d->ev || event_add(d->ev, &quiet) < 0) {
		if (d->ev)
			event_free(d->ev);
		close(d->fd);
		free(d);
		return false;
	}
	if (!d->half_sent)
		shutdown(d->fd, SHUT_WR); /* the server sees EOF after whole requests */
	d->next = nb->drains;
	nb->drains = d;
	nb->ndrains++;
	return true;
}

/*
 * Close c's handle. libnbd retires every command it still holds inside
 * nbd_close(): their chunk_free() marks the requests to be sent again.
 * An nbdkit we started is killed first when it stopped answering, so that
 * nbd_close() does not wait for it.
 */
static void conn_close(struct nbd_conn *c, bool kill)
{
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	evtimer_del(c->timer);
	struct nbd_handle *h = c->h;
	c->h = NULL;
	c->state = CONN_OFF;
	if (h) {
		if (kill && c->nb->argv)
			nbd_kill_subprocess(h, SIGKILL);
		if (!c->nb->argv && !nbd_aio_is_dead(h) && !nbd_aio_is_closed(h) &&
		    (c->oldest || nbd_aio_in_flight(h) > 0) && drain_start(c->nb, h))
			log_debug("backend %s: connection %u: its socket is read until the server "
				  "is done with it",
				  c->nb->name, c->index + 1);
		nbd_close(h);
	}
	if (c->oldest)
		log_error("backend %s: connection %u: commands left after close", c->nb->name,
			  c->index + 1);
	c->oldest = c->newest = NULL;
}

/* The next attempt in delay_ms, if the slot is wanted. */
static void conn_schedule(struct nbd_conn *c, unsigned delay_ms)
{
	struct nbd_backend *nb = c->nb;
	if (c->index >= nb->want_conns || c->given_up) {
		c->state = CONN_OFF;
		return;
	}
	c->state = CONN_IDLE;
	struct timeval tv = {delay_ms / 1000, (delay_ms % 1000) * 1000};
	if (evtimer_add(c->timer, &tv) < 0) {
		log_error("backend %s: connection %u: cannot arm its timer; left closed", nb->name,
			  c->index + 1);
		c->state = CONN_OFF;
	}
}

/*
 * c failed: close it and try again later. Writes acknowledged on a ready
 * connection may be lost with it (loss_seq). Never calls back into the
 * requests: the ones it held are deferred (chunk_free).
 */
static void conn_fail(struct nbd_conn *c, const char *why, bool kill)
{
	struct nbd_backend *nb = c->nb;
	if (c->state == CONN_READY) {
		nb->nready--;
		if (c->wrote)
			atomic_fetch_add(&nb->base.loss_seq, 1);
		log_debug("backend %s: connection %u lost (%s)", nb->name, c->index + 1, why);
		if (nb->nready == 0 && !nb->down) {
			nb->down = true;
			log_error("backend %s: backend connection lost (%s); reconnecting",
				  nb->name, why);
		}
	} else if (c->state == CONN_CONNECTING) {
		log_debug("backend %s: connection %u: connecting failed: %s", nb->name,
			  c->index + 1, why);
		if (c->index > 0 && !c->ever_ready && ++c->failures >= NBD_EXTRA_ATTEMPTS) {
			c->given_up = true;
			log_info("backend %s: connection %u: %s; using fewer", nb->name,
				 c->index + 1, why);
		}
	}
	conn_close(c, kill);
	unsigned delay = c->backoff_ms;
	c->backoff_ms = delay * 2 > NBD_BACKOFF_MAX_MS ? NBD_BACKOFF_MAX_MS : delay * 2;
	conn_schedule(c, delay);
}

/* The error libnbd gave for the last failed call, copied (later calls change it). */
static void last_error(char *buf, size_t len, const char *fallback)
{
	const char *e = nbd_get_error();
	snprintf(buf, len, "%s", e && *e ? e : fallback);
}

/* After a libnbd call on c: close it if it died, else watch it. False if it failed. */
static bool conn_settle(struct nbd_conn *c)
{
	char why[256];
	if (nbd_aio_is_dead(c->h) || nbd_aio_is_closed(c->h)) {
		last_error(why, sizeof(why), "closed");
		conn_fail(c, why, false);
		return false;
	}
	if (c->broken) {
		snprintf(why, sizeof(why), "a command failed: %s", strerror(c->broken));
		conn_fail(c, why, false);
		return false;
	}
	if (!conn_watch(c)) {
		conn_fail(c, "cannot watch its socket", false);
		return false;
	}
	return true;
}

static void conn_set_want(struct nbd_backend *nb, unsigned want);

/* The handshake is done: c takes requests. */
static void conn_ready(struct nbd_conn *c)
{
	struct nbd_backend *nb = c->nb;
	evtimer_del(c->timer);
	c->multi_conn = nb->uri && nbd_can_multi_conn(c->h) == 1;
	int64_t size = nbd_get_size(c->h);
	if (size < 0 || (uint64_t)size != nb->base.size)
		log_warn("backend %s: size changed to %lld after reconnecting", nb->name,
			 (long long)size);
	if (c->index > 0 && !c->multi_conn) {
		/* Without multi-conn the NBD standard asks for one connection. */
		log_debug("backend %s: connection %u: no multi-conn; closed", nb->name,
			  c->index + 1);
		conn_close(c, false);
		return;
	}
	c->state = CONN_READY;
	c->ever_ready = true;
	c->wrote = false;
	c->broken = 0;
	nb->nready++;
	nb->silent = false;
	log_debug("backend %s: connection %u ready", nb->name, c->index + 1);
	if (nb->down) {
		nb->down = false;
		log_info("backend %s: backend reconnected", nb->name);
	}
	if (c->index == 0)
		conn_set_want(nb, c->multi_conn ? nb->max_conns : 1);
	issue_waiting(nb);
}

/* Start an attempt on an idle slot. */
static void conn_connect(struct nbd_conn *c)
{
	char err[256];
	c->state = CONN_CONNECTING;
	c->broken = 0;
	c->h = handle_begin(c->nb, err, sizeof(err));
	if (!c->h) {
		conn_fail(c, err, false);
		return;
	}
	struct timeval tv = {NBD_CONNECT_TIMEOUT_MS / 1000, (NBD_CONNECT_TIMEOUT_MS % 1000) * 1000};
	if (evtimer_add(c->timer, &tv) < 0) {
		conn_fail(c, "cannot arm its timer", false);
		return;
	}
	if (conn_settle(c) && nbd_aio_is_ready(c->h))
		conn_ready(c);
}

/* Slots [0, want) are kept connected; the others are left as they are. */
static void conn_set_want(struct nbd_backend *nb, unsigned want)
{
	nb->want_conns = want;
	for (unsigned i = 1; i < want; i++) {
		struct nbd_conn *c = &nb->conns[i];
		if (c->state == CONN_OFF && !c->given_up)
			conn_schedule(c, 0);
	}
}

static void conn_on_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_conn *c = arg;
	char why[64];
	if (c->state == CONN_IDLE) {
		conn_connect(c);
	} else if (c->state == CONN_CONNECTING) {
		snprintf(why, sizeof(why), "no handshake within %u s",
			 NBD_CONNECT_TIMEOUT_MS / 1000);
		conn_fail(c, why, true);
	}
	process_deferred(c->nb);
}

static void conn_on_event(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	struct nbd_conn *c = arg;
	if (c->state != CONN_CONNECTING && c->state != CONN_READY)
		return;
	if (what & EV_READ)
		nbd_aio_notify_read(c->h);
	if ((what & EV_WRITE) && !nbd_aio_is_dead(c->h) && !nbd_aio_is_closed(c->h))
		nbd_aio_notify_write(c->h);
	if (conn_settle(c) && c->state == CONN_CONNECTING && nbd_aio_is_ready(c->h))
		conn_ready(c);
	process_deferred(c->nb);
}

/* The next ready connection, round robin. */
static struct nbd_conn *pick_conn(struct nbd_backend *nb)
{
	for (unsigned k = 0; k < NBD_MAX_CONNS; k++) {
		struct nbd_conn *c = &nb->conns[nb->next_conn++ % NBD_MAX_CONNS];
		if (c->state == CONN_READY)
			return c;
	}
	return NULL;
}

/* ---- chunks: what libnbd holds ---- */

/* Errors that say the connection broke, not that the server refused. */
static bool connection_error(int e)
{
	return e == ENOTCONN || e == ESHUTDOWN || e == ECONNRESET || e == EPIPE ||
	       e == ECONNABORTED || e == ETIMEDOUT;
}

static void defer(struct nbd_backend *nb, struct backend_io *io)
{
	if (io->state & IO_DEFERRED)
		return;
	io->state |= IO_DEFERRED;
	io->deferred_next = nb->deferred;
	nb->deferred = io;
}

static int chunk_complete(void *user_data, int *error)
{
	struct nbd_chunk *ch = user_data;
	ch->completed = true;
	ch->error = *error;
	return 1; /* retire the command: chunk_free follows */
}

static int extent_callback(void *user_data, const char *metacontext, uint64_t offset,
			   uint32_t *entries, size_t nr_entries, int *error)
{
	(void)error;
	(void)offset;
	struct nbd_chunk *ch = user_data;
	struct backend_io *io = ch->io;
	if (strcmp(metacontext, LIBNBD_CONTEXT_BASE_ALLOCATION) != 0 || io->n_extents)
		return 0;
	for (size_t i = 0; i + 1 < nr_entries && io->n_extents < io->max_extents; i += 2)
		io->extents[io->n_extents++] =
		    (struct nbd_extent){.length = entries[i], .flags = entries[i + 1]};
	return 0;
}

/*
 * libnbd is done with the command (answered, refused, or its connection
 * gone): account for it, exactly once. Called with the handle's lock held,
 * possibly inside any nbd_* call on it, so no nbd_* call here and nothing
 * but marks: process_deferred() moves the request along.
 *
 * Freed without completing (the call failed, or nbd_close()) or completed
 * with a connection error: the request is sent again; an error the server
 * returned is the request's.
 */
static void chunk_free(void *user_data)
{
	struct nbd_chunk *ch = user_data;
	struct backend_io *io = ch->io;
	struct nbd_conn *c = ch->conn;
	if (!ch->completed) {
		io->state |= IO_RESTART;
	} else if (ch->error == 0) {
		c->backoff_ms = NBD_BACKOFF_MIN_MS; /* the server works: reconnect at once */
		c->nb->last_reply_ns = clock_now_ns();
	} else if (connection_error(ch->error)) {
		io->state |= IO_RESTART;
		c->broken = ch->error;
	} else {
		c->nb->last_reply_ns = clock_now_ns();
		if (!io->result)
			io->result = -ch->error;
	}
	*(ch->older ? &ch->older->newer : &c->oldest) = ch->newer;
	*(ch->newer ? &ch->newer->older : &c->newest) = ch->older;
	free(ch);
	io->stage--;
	defer(c->nb, io);
}

static bool cmd_writes(enum backend_cmd cmd)
{
	return cmd == BACKEND_WRITE || cmd == BACKEND_ZERO || cmd == BACKEND_TRIM;
}

/* The command the request sends now: its own, or the flush of an emulated FUA. */
static enum backend_cmd io_phase_cmd(const struct backend_io *io)
{
	return io->state & IO_FLUSHING ? BACKEND_FLUSH : io->cmd;
}

/* Send cmd for [at, at+len) of io on c. */
static void issue_chunk(struct nbd_backend *nb, struct nbd_conn *c, struct backend_io *io,
			enum backend_cmd cmd, uint64_t at, uint64_t len)
{
	struct nbd_chunk *ch = calloc(1, sizeof(*ch));
	if (!ch) {
		if (!io->result)
			io->result = -ENOMEM;
		return;
	}
	ch->io = io;
	ch->conn = c;
	ch->sent_ns = clock_now_ns();
	ch->older = c->newest;
	*(c->newest ? &c->newest->newer : &c->oldest) = ch;
	c->newest = ch;
	io->stage++;
	if (cmd_writes(cmd))
		c->wrote = true;
	nbd_completion_callback cb = {
	    .callback = chunk_complete, .user_data = ch, .free = chunk_free};
	uint32_t fua = (io->flags & BACKEND_FUA) && nb->can_fua ? LIBNBD_CMD_FLAG_FUA : 0;
	uint64_t offset = io->offset + at;
	int64_t cookie = -1;
	switch (cmd) {
	case BACKEND_READ:
		cookie = nbd_aio_pread(c->h, (char *)io->buf + at, len, offset, cb, 0);
		break;
	case BACKEND_WRITE:
		cookie = nbd_aio_pwrite(c->h, (char *)io->buf + at, len, offset, cb, fua);
		break;
	case BACKEND_ZERO:
		if (!nb->base.can_zero) { /* emulated: zeros written */
			cookie = nbd_aio_pwrite(c->h, zero_chunk, len, offset, cb, fua);
			break;
		}
		cookie = nbd_aio_zero(
		    c->h, len, offset, cb,
		    fua | (io->flags & BACKEND_NO_HOLE ? LIBNBD_CMD_FLAG_NO_HOLE : 0) |
			(io->flags & BACKEND_FAST_ONLY ? LIBNBD_CMD_FLAG_FAST_ZERO : 0));
		break;
	case BACKEND_TRIM:
		cookie = nbd_aio_trim(c->h, len, offset, cb, fua);
		break;
	case BACKEND_FLUSH:
		cookie = nbd_aio_flush(c->h, cb, 0);
		break;
	case BACKEND_CACHE:
		cookie = nbd_aio_cache(c->h, len, offset, cb, 0);
		break;
	case BACKEND_BLOCK_STATUS: {
		nbd_extent_callback ecb = {.callback = extent_callback, .user_data = ch};
		cookie = nbd_aio_block_status(c->h, len, offset, ecb, cb, 0);
		break;
	}
	}
	/* ch is libnbd's now: it may be freed already. */
	if (cookie < 0) {
		int e = nbd_get_errno();
		char why[256];
		last_error(why, sizeof(why), "command refused");
		if (nbd_aio_is_dead(c->h) || nbd_aio_is_closed(c->h) || connection_error(e)) {
			conn_fail(c, why, false);
			return;
		}
		/* libnbd refused the command itself (bounds, flags, size). */
		log_debug("backend %s: %s", nb->name, why);
		if (!io->result)
			io->result = -(e ? e : EIO);
	}
	if (conn_settle(c))
		tick_arm(nb);
}

/* ---- requests ---- */

static void io_done_task(struct worker_task *task)
{
	struct backend_io *io =
	    (struct backend_io *)((char *)task - offsetof(struct backend_io, task));
	io->done(io, io->result);
}

/* Hand the finished request back to its worker; io is not ours any more. */
static void io_finish(struct backend_io *io, int result)
{
	io->result = result;
	io->task.run = io_done_task;
	worker_post(io->worker, &io->task);
}

static void wait_for_connection(struct nbd_backend *nb, struct backend_io *io)
{
	io->state |= IO_WAITING;
	io->queue_next = NULL;
	if (nb->waiting_tail)
		nb->waiting_tail->queue_next = io;
	else
		nb->waiting = io;
	nb->waiting_tail = io;
	tick_arm(nb);
}

/* Largest chunk of this command the server takes. */
static uint64_t chunk_limit(struct nbd_backend *nb, enum backend_cmd cmd)
{
	switch (cmd) {
	case BACKEND_READ:
	case BACKEND_WRITE:
		return nb->max_block;
	case BACKEND_ZERO:
		return nb->base.can_zero ? NBD_COMPACT_MAX : NBD_ZERO_CHUNK;
	default:
		return NBD_COMPACT_MAX;
	}
}

/* What the current phase sends in all: bytes, or one command. */
static uint64_t phase_length(const struct backend_io *io)
{
	enum backend_cmd cmd = io_phase_cmd(io);
	return cmd == BACKEND_FLUSH || cmd == BACKEND_BLOCK_STATUS ? 1 : io->length;
}

/* A flush on every ready connection, or on one if each covers them all. */
static void issue_flush(struct nbd_backend *nb, struct backend_io *io)
{
	bool one = true;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++)
		if (nb->conns[i].state == CONN_READY && !nb->conns[i].multi_conn)
			one = false;
	if (one) {
		issue_chunk(nb, pick_conn(nb), io, BACKEND_FLUSH, 0, 0);
		return;
	}
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++)
		if (nb->conns[i].state == CONN_READY)
			issue_chunk(nb, &nb->conns[i], io, BACKEND_FLUSH, 0, 0);
}

/* Send what the window allows of the current phase. Never finishes io. */
static void pump(struct nbd_backend *nb, struct backend_io *io)
{
	enum backend_cmd cmd = io_phase_cmd(io);
	uint64_t length = phase_length(io), limit = chunk_limit(nb, cmd);
	while (io->stage < NBD_WINDOW && io->progress < length && io->result == 0 &&
	       !(io->state & IO_RESTART) && nb->nready > 0) {
		uint64_t at = io->progress;
		if (cmd == BACKEND_FLUSH) {
			io->progress = 1;
			issue_flush(nb, io);
		} else if (cmd == BACKEND_BLOCK_STATUS) {
			io->progress = 1;
			issue_chunk(nb, pick_conn(nb), io, cmd, 0, io->length);
		} else {
			uint64_t n = length - at < limit ? length - at : limit;
			io->progress = at + n;
			issue_chunk(nb, pick_conn(nb), io, cmd, at, n);
		}
	}
}

/* Send the request from its start. */
static void io_reset(struct nbd_backend *nb, struct backend_io *io)
{
	io->state &= ~(IO_RESTART | IO_FLUSHING);
	io->progress = 0;
	io->result = 0;
	io->n_extents = 0;
	io->loss_seq_seen = atomic_load(&nb->base.loss_seq);
}

static bool needs_flush_after(struct nbd_backend *nb, const struct backend_io *io)
{
	return (io->flags & BACKEND_FUA) && !nb->can_fua && nb->can_flush && cmd_writes(io->cmd);
}

/*
 * Move io along, outside libnbd: the one place that finishes, restarts or
 * continues a request. Each pass sends, waits, finishes or changes phase.
 */
static void io_advance(struct nbd_backend *nb, struct backend_io *io)
{
	for (unsigned pass = 0; pass < NBD_ADVANCE_PASSES; pass++) {
		if (io->state & (IO_DEFERRED | IO_WAITING))
			return; /* process_deferred() or a connection brings it back */
		if (io->stage > 0) {
			pump(nb, io);
			return; /* its chunks come back through chunk_free() */
		}
		if (io->result) {
			io_finish(io, io->result);
			return;
		}
		if (io->state & IO_RESTART) {
			if (clock_now_ns() >= io->deadline_ns) {
				io_finish(io, -EIO);
				return;
			}
			io_reset(nb, io);
		}
		if (io->progress < phase_length(io)) {
			if (nb->nready == 0 && nb->silent) {
				io_finish(io, -EIO); /* it would only wait as long again */
				return;
			}
			if (nb->nready == 0) {
				wait_for_connection(nb, io);
				return;
			}
			pump(nb, io);
			continue;
		}
		if (!(io->state & IO_FLUSHING) && needs_flush_after(nb, io)) {
			io->state |= IO_FLUSHING;
			io->progress = 0;
			continue;
		}
		if ((io->state & IO_FLUSHING) &&
		    atomic_load(&nb->base.loss_seq) != io->loss_seq_seen) {
			io->state |= IO_RESTART; /* the write may be gone with a connection */
			continue;
		}
		io_finish(io, 0);
		return;
	}
	/* Cannot happen: every pass above returns or changes something. */
	log_error("backend %s: a request made no progress in %u passes", nb->name,
		  NBD_ADVANCE_PASSES);
	if (io->stage == 0 && !(io->state & (IO_DEFERRED | IO_WAITING)))
		io_finish(io, -EIO);
}

/* Outside libnbd: move every request a callback touched along. */
static void process_deferred(struct nbd_backend *nb)
{
	while (nb->deferred) {
		struct backend_io *io = nb->deferred;
		nb->deferred = io->deferred_next;
		io->state &= ~IO_DEFERRED;
		io_advance(nb, io);
	}
}

/* A connection is ready: the requests that waited for one go. */
static void issue_waiting(struct nbd_backend *nb)
{
	struct backend_io *io = nb->waiting;
	nb->waiting = nb->waiting_tail = NULL;
	while (io) {
		struct backend_io *next = io->queue_next;
		io->state &= ~IO_WAITING;
		io_advance(nb, io);
		io = next;
	}
}

/* Answer at once what the server does not do; else start the request. */
static void start_request(struct nbd_backend *nb, struct backend_io *io)
{
	io->stage = 0;
	io->state = 0;
	io->n_extents = 0;
	switch (io->cmd) {
	case BACKEND_READ:
	case BACKEND_WRITE:
		if (io->length == 0) {
			io_finish(io, 0);
			return;
		}
		break;
	case BACKEND_FLUSH:
		if (!nb->can_flush) {
			io_finish(io, 0);
			return;
		}
		break;
	case BACKEND_TRIM:
		if (!nb->base.can_trim || io->length == 0) {
			io_finish(io, 0);
			return;
		}
		break;
	case BACKEND_CACHE:
		if (!nb->can_cache || io->length == 0) {
			io_finish(io, 0);
			return;
		}
		break;
	case BACKEND_ZERO:
		if ((io->flags & BACKEND_FAST_ONLY) && !nb->can_fast_zero) {
			io_finish(io, -ENOTSUP);
			return;
		}
		if (io->length == 0) {
			io_finish(io, 0);
			return;
		}
		break;
	case BACKEND_BLOCK_STATUS:
		if (!nb->can_block_status) {
			io->extents[0] = (struct nbd_extent){.length = io->length, .flags = 0};
			io->n_extents = 1;
			io_finish(io, 0);
			return;
		}
		if (io->length > NBD_COMPACT_MAX)
			io->length = NBD_COMPACT_MAX;
		break;
	default:
		io_finish(io, -EINVAL);
		return;
	}
	io->deadline_ns = clock_now_ns() + nb->timeout_ns;
	io_reset(nb, io);
	io_advance(nb, io);
}

/* ---- deadlines ---- */

static bool tick_needed(struct nbd_backend *nb)
{
	if (nb->waiting)
		return true;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++)
		if (nb->conns[i].oldest)
			return true;
	return false;
}

static void tick_arm(struct nbd_backend *nb)
{
	if (evtimer_pending(nb->tick, NULL))
		return;
	struct timeval tv = {0, NBD_TICK_MS * 1000};
	if (evtimer_add(nb->tick, &tv) < 0)
		log_error("backend %s: cannot arm the deadline timer", nb->name);
}

/*
 * A connection whose oldest command has had no reply for --backend-timeout
 * is dead; if no connection had any reply meanwhile, the server is silent
 * and every connection is closed. Their requests are sent again while
 * their time lasts. Until a handshake succeeds again, requests that find
 * no connection fail at once (they would only wait as long again); others
 * fail with EIO once they have waited --backend-timeout for a connection.
 */
static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	uint64_t now = clock_now_ns();
	char why[64];
	snprintf(why, sizeof(why), "no reply within %u s", nb->timeout_s);
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		struct nbd_conn *c = &nb->conns[i];
		if (c->state != CONN_READY || !c->oldest ||
		    now - c->oldest->sent_ns < nb->timeout_ns)
			continue;
		if (nb->last_reply_ns < c->oldest->sent_ns) {
			log_warn("backend %s: %s on any connection; closing them", nb->name, why);
			nb->silent = true;
			for (unsigned k = 0; k < NBD_MAX_CONNS; k++)
				if (nb->conns[k].state == CONN_READY)
					conn_fail(&nb->conns[k], why, true);
			break;
		}
		log_warn("backend %s: connection %u: %s; closing it", nb->name, i + 1, why);
		conn_fail(c, why, true);
	}
	struct backend_io **p = &nb->waiting, *last = NULL;
	while (*p) {
		struct backend_io *io = *p;
		if (now >= io->deadline_ns || (nb->silent && nb->nready == 0)) {
			*p = io->queue_next;
			io->state &= ~IO_WAITING;
			io_finish(io, -EIO);
		} else {
			last = io;
			p = &io->queue_next;
		}
	}
	nb->waiting_tail = last;
	process_deferred(nb);
	if (tick_needed(nb))
		tick_arm(nb);
}

/* ---- the thread ---- */

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	pthread_mutex_lock(&nb->lock);
	struct backend_io *io = nb->queue_head;
	nb->queue_head = nb->queue_tail = NULL;
	bool stop = nb->stop;
	pthread_mutex_unlock(&nb->lock);
	while (io) {
		struct backend_io *next = io->queue_next;
		start_request(nb, io);
		io = next;
	}
	process_deferred(nb);
	if (stop)
		event_base_loopexit(nb->loop, NULL);
}

static void nbd_submit(struct backend *be, struct backend_io *io)
{
	struct nbd_backend *nb = to_nbd(be);
	io->queue_next = NULL;
	pthread_mutex_lock(&nb->lock);
	if (nb->queue_tail)
		nb->queue_tail->queue_next = io;
	else
		nb->queue_head = io;
	nb->queue_tail = io;
	pthread_mutex_unlock(&nb->lock);
	event_active(nb->wake, EV_READ, 0);
}

static void *backend_thread(void *arg)
{
	struct nbd_backend *nb = arg;
	struct nbd_conn *first = &nb->conns[0];
	if (conn_settle(first))
		conn_set_want(nb, first->multi_conn ? nb->max_conns : 1);
	event_base_loop(nb->loop, EVLOOP_NO_EXIT_ON_EMPTY);
	return NULL;
}

static int nbd_start(struct backend *be)
{
	struct nbd_backend *nb = to_nbd(be);
	nb->loop = event_base_new();
	if (!nb->loop)
		return -ENOMEM;
	nb->wake = event_new(nb->loop, -1, 0, on_wake, nb);
	nb->tick = evtimer_new(nb->loop, on_tick, nb);
	if (!nb->wake || !nb->tick)
		return -ENOMEM;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		nb->conns[i].timer = evtimer_new(nb->loop, conn_on_timer, &nb->conns[i]);
		if (!nb->conns[i].timer)
			return -ENOMEM;
	}
	int rc = -pthread_create(&nb->thread, NULL, backend_thread, nb);
	if (rc == 0)
		nb->started = true;
	return rc;
}

static void free_backend(struct nbd_backend *nb)
{
	if (nb->argv)
		for (char **a = nb->argv; *a; a++)
			free(*a);
	free(nb->argv);
	free(nb->uri);
	free(nb->name);
	pthread_mutex_destroy(&nb->lock);
	free(nb);
}

/*
 * After the thread: every request must have come back by now (the workers
 * wait for theirs). Any left cannot be answered (their workers are gone);
 * say so. Closing a handle frees what libnbd still holds (chunk_free).
 */
static void nbd_backend_close(struct backend *be)
{
	struct nbd_backend *nb = to_nbd(be);
	if (nb->started) {
		pthread_mutex_lock(&nb->lock);
		nb->stop = true;
		pthread_mutex_unlock(&nb->lock);
		event_active(nb->wake, EV_READ, 0);
		pthread_join(nb->thread, NULL);
	}
	bool left = nb->waiting || nb->queue_head || nb->deferred;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		struct nbd_conn *c = &nb->conns[i];
		left = left || c->oldest;
		if (c->ev)
			event_free(c->ev);
		c->ev = NULL;
		if (c->h) {
			if (c->state == CONN_READY && !c->oldest)
				nbd_aio_disconnect(c->h, 0);
			nbd_close(c->h); /* stops an nbdkit we started */
			c->h = NULL;
		}
		if (c->timer)
			event_free(c->timer);
	}
	while (nb->drains)
		drain_end(nb->drains);
	if (left)
		log_error("backend %s: closed with requests unanswered", nb->name);
	if (nb->wake)
		event_free(nb->wake);
	if (nb->tick)
		event_free(nb->tick);
	if (nb->loop)
		event_base_free(nb->loop);
	free_backend(nb);
}

static const struct backend_ops nbd_ops = {
    .kind = "nbd",
    .submit = nbd_submit,
    .start = nbd_start,
    .close = nbd_backend_close,
};

bool backend_nbd_handles(const char *spec)
{
	static const char *const prefixes[] = {"nbd://",       "nbds://",      "nbd+unix://",
					       "nbds+unix://", "nbd+vsock://", "nbds+vsock://",
					       "nbdkit:"};
	for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++)
		if (strncmp(spec, prefixes[i], strlen(prefixes[i])) == 0)
			return true;
	return false;
}

/* "nbdkit:PLUGIN ARG..." -> {"nbdkit", "-f", "--exit-with-parent", PLUGIN, ARG..., NULL} */
static char **nbdkit_argv(const char *spec)
{
	const char *p = spec + strlen("nbdkit:");
	size_t n = 4;
	for (const char *q = p; *q; q++)
		if (*q == ' ')
			n++;
	char **argv = calloc(n + 1, sizeof(*argv));
	if (!argv)
		return NULL;
	size_t k = 0;
	argv[k++] = strdup("nbdkit");
	argv[k++] = strdup("-f");
	argv[k++] = strdup("--exit-with-parent");
	while (*p) {
		while (*p == ' ')
			p++;
		const char *e = p;
		while (*e && *e != ' ')
			e++;
		if (e > p)
			argv[k++] = strndup(p, (size_t)(e - p));
		p = e;
	}
	for (size_t i = 0; i < k; i++)
		if (!argv[i])
			goto err;
	if (k < 4)
		goto err; /* no plugin */
	return argv;
err:
	for (size_t i = 0; i < k; i++)
		free(argv[i]);
	free(argv);
	return NULL;
}

int backend_nbd_open(const char *spec, bool readonly, unsigned timeout_seconds,
		     struct backend **out)
{
	struct nbd_backend *nb = calloc(1, sizeof(*nb));
	if (!nb)
		return -ENOMEM;
	pthread_mutex_init(&nb->lock, NULL);
	nb->base.ops = &nbd_ops;
	atomic_init(&nb->base.loss_seq, 0);
	nb->name = strdup(spec);
	nb->timeout_s = timeout_seconds;
	nb->timeout_ns = (uint64_t)timeout_seconds * 1000000000u;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		nb->conns[i].nb = nb;
		nb->conns[i].index = i;
		nb->conns[i].fd = -1;
		nb->conns[i].backoff_ms = NBD_BACKOFF_MIN_MS;
	}
	int rc = -ENOMEM;
	if (!nb->name)
		goto err;
	if (strncmp(spec, "nbdkit:", 7) == 0) {
		nb->argv = nbdkit_argv(spec);
		if (!nb->argv) {
			rc = -EINVAL;
			log_error("backend %s: expected nbdkit:PLUGIN [ARG...]", spec);
			goto err;
		}
	} else {
		nb->uri = strdup(spec);
		if (!nb->uri)
			goto err;
	}
	char err[256];
	struct nbd_handle *h = connect_first(nb, err, sizeof(err));
	if (!h) {
		log_error("backend %s: %s", spec, err);
		rc = -EIO;
		goto err;
	}
	int64_t size = nbd_get_size(h);
	nb->base.size = size > 0 ? (uint64_t)size : 0;
	nb->base.readonly = readonly || nbd_is_read_only(h) == 1;
	nb->base.can_trim = nbd_can_trim(h) == 1;
	nb->base.can_zero = nbd_can_zero(h) == 1;
	nb->can_flush = nbd_can_flush(h) == 1;
	nb->can_fua = nbd_can_fua(h) == 1;
	nb->can_fast_zero = nbd_can_fast_zero(h) == 1;
	nb->can_cache = nbd_can_cache(h) == 1;
	nb->can_block_status = nbd_can_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION) == 1;
	int64_t minimum = nbd_get_block_size(h, LIBNBD_SIZE_MINIMUM);
	int64_t maximum = nbd_get_block_size(h, LIBNBD_SIZE_MAXIMUM);
	nb->base.min_block = minimum > 1 ? (uint32_t)minimum : 1;
	nb->max_block = maximum > 0 && maximum < (32 << 20) ? (uint32_t)maximum : (32u << 20);
	struct nbd_conn *first = &nb->conns[0];
	first->h = h;
	first->state = CONN_READY;
	first->ever_ready = true;
	first->multi_conn = nb->uri && nbd_can_multi_conn(h) == 1;
	nb->max_conns = first->multi_conn ? NBD_MAX_CONNS : 1;
	nb->want_conns = 1; /* the others connect once the thread runs */
	nb->nready = 1;
	log_info("backend %s: %llu bytes, %u connection(s)%s%s%s%s%s", spec,
		 (unsigned long long)nb->base.size, nb->max_conns,
		 nb->base.readonly ? ", read-only" : "", nb->base.can_trim ? ", trim" : "",
		 nb->base.can_zero ? ", zero" : ", zero emulated",
		 nb->can_fua ? ", fua" : ", fua emulated",
		 nb->can_block_status ? ", base:allocation" : "");
	*out = &nb->base;
	return 0;
err:
	free_backend(nb);
	return rc;
}
