/*
 * daemon/backend/nbd.c: an export whose bytes live on another NBD server,
 * reached through libnbd: nbd://, nbds://, nbd+unix:// URIs, or
 * "nbdkit:PLUGIN ARG..." for any nbdkit plugin, which the daemon starts
 * itself through libnbd's systemd socket activation (nbdkit exits with us).
 *
 * The backend owns one thread with its own libevent loop; it drives every
 * libnbd connection of the backend (one, or several when the server
 * advertises multi-conn) through nbd_aio_* calls, with each handle's socket
 * watched in the direction libnbd asks for. backend_submit() may be called
 * from any worker: it queues the request and wakes the backend thread;
 * the completion is posted back to the submitting worker (worker_post).
 *
 *   worker --submit--> queue --wake--> backend thread --aio--> server
 *   worker <--post---- done  <-------- free callback  <------- reply
 *
 * A request is cut into chunks the server accepts (its maximum block size;
 * 32-bit lengths for TRIM, WRITE_ZEROES and BLOCK_STATUS), at most
 * NBD_WINDOW in flight. What the server lacks is emulated or answered
 * honestly: no WRITE_ZEROES -> zeros are written; no FUA -> a flush after
 * the write; no FAST_ZERO -> ENOTSUP; no TRIM or CACHE -> nothing to do;
 * no base:allocation -> everything is data.
 *
 * A lost connection is reconnected with backoff (0.1 s doubling to 5 s).
 * Requests in flight when it broke are sent again, requests wait up to
 * --backend-timeout seconds and then fail with EIO. Writes the old
 * connection acknowledged but never flushed may be lost with the server:
 * the next FLUSH says so, once, with EIO. Each change of state is logged
 * once.
 */
#include <errno.h>
#include <event2/event.h>
#include <libnbd.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/backend/backend.h"
#include "daemon/clock.h"
#include "daemon/log.h"

#define NBD_MAX_CONNS 4
#define NBD_WINDOW 16 /* chunks of one request in flight */
#define NBD_ZERO_CHUNK (1u << 20)
#define NBD_COMPACT_MAX (0xffffffffu & ~(uint32_t)((1u << 20) - 1)) /* 32-bit lengths */
#define NBD_BACKOFF_MIN_MS 100
#define NBD_BACKOFF_MAX_MS 5000
#define NBD_CONNECT_TIMEOUT_MS 10000 /* the first connection, and reconnecting */
#define NBD_EXTRA_CONNECT_TIMEOUT_MS 2000 /* more connections for multi-conn */

static const uint8_t zero_chunk[NBD_ZERO_CHUNK];

/* backend_io.state */
#define IO_DEFERRED (1u << 0) /* on nb->deferred */
#define IO_RESTART (1u << 1)  /* a chunk was lost with its connection */
#define IO_FLUSHING (1u << 2) /* FUA emulated: the write is done, flush now */
#define IO_ISSUING (1u << 3)  /* inside an nbd_aio_* call */

struct nbd_backend;

struct nbd_conn {
	struct nbd_backend *nb;
	struct nbd_handle *h;
	struct event *ev;
	unsigned dir; /* the direction ev waits for */
	bool live;
};

struct nbd_backend {
	struct backend base;
	char *name;  /* for logs: the URI or the nbdkit command */
	char *uri;   /* NULL for nbdkit */
	char **argv; /* nbdkit command line, NULL-terminated */
	uint64_t timeout_ns;
	bool can_flush, can_fua, can_fast_zero, can_cache, can_block_status, multi_conn;
	uint32_t max_block;

	pthread_t thread;
	bool started;
	struct event_base *loop;
	struct event *wake, *retry, *tick;

	pthread_mutex_t lock; /* guards the submit queue and stop */
	struct backend_io *queue_head, *queue_tail;
	bool stop;

	/* Backend thread only. */
	struct nbd_conn conns[NBD_MAX_CONNS];
	unsigned nconns, next_conn;
	bool connected;
	unsigned backoff_ms;
	struct backend_io *waiting; /* for a connection, in arrival order */
	struct backend_io *deferred; /* touched by libnbd callbacks: look again */
	uint64_t unflushed;	    /* writes acknowledged since the last flush */
	bool lost_writes;	    /* a lost connection took some of those */
};

/* One libnbd command: a chunk of a request. */
struct nbd_chunk {
	struct backend_io *io;
	struct nbd_conn *conn;
	int error;	  /* from the completion callback */
	bool completed;	  /* the completion callback ran */
	uint64_t offset;  /* BLOCK_STATUS: where the extents start */
};

static struct nbd_backend *to_nbd(struct backend *be)
{
	return (struct nbd_backend *)be;
}

/* ---- connections ---- */

/*
 * A connected handle, or NULL with the reason in err. Asynchronous under
 * the hood, so a server that accepts but never answers (or serves fewer
 * connections than it advertises) costs NBD_CONNECT_TIMEOUT_MS, not the
 * backend thread.
 */
static struct nbd_handle *connect_handle(struct nbd_backend *nb, unsigned timeout_ms, char *err,
				       size_t errlen)
{
	struct nbd_handle *h = nbd_create();
	if (!h) {
		snprintf(err, errlen, "%s", nbd_get_error());
		return NULL;
	}
	nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION);
	int rc = nb->uri ? nbd_aio_connect_uri(h, nb->uri)
			 : nbd_aio_connect_systemd_socket_activation(h, nb->argv);
	uint64_t deadline = clock_now_ns() + (uint64_t)timeout_ms * 1000000u;
	while (rc == 0 && !nbd_aio_is_ready(h)) {
		if (nbd_aio_is_dead(h) || nbd_aio_is_closed(h)) {
			rc = -1;
			break;
		}
		uint64_t now = clock_now_ns();
		if (now >= deadline) {
			snprintf(err, errlen, "no answer within %u ms", timeout_ms);
			nbd_close(h);
			return NULL;
		}
		unsigned dir = nbd_aio_get_direction(h);
		struct pollfd pfd = {.fd = nbd_aio_get_fd(h),
				     .events = (short)((dir & LIBNBD_AIO_DIRECTION_READ ? POLLIN : 0) |
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
		snprintf(err, errlen, "%s", nbd_get_error() ? nbd_get_error() : "connection failed");
		nbd_close(h);
		return NULL;
	}
	return h;
}

static void conn_watch(struct nbd_conn *c);
static void process_deferred(struct nbd_backend *nb);

static void conn_on_event(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	struct nbd_conn *c = arg;
	if (what & EV_READ)
		nbd_aio_notify_read(c->h);
	if ((what & EV_WRITE) && c->live)
		nbd_aio_notify_write(c->h);
	conn_watch(c);
	process_deferred(c->nb);
}

static void conn_lost(struct nbd_conn *c);

/* Wait for what libnbd wants next on this connection. */
static void conn_watch(struct nbd_conn *c)
{
	if (!c->live)
		return;
	if (nbd_aio_is_dead(c->h) || nbd_aio_is_closed(c->h)) {
		conn_lost(c);
		return;
	}
	unsigned dir = nbd_aio_get_direction(c->h);
	short what = (dir & LIBNBD_AIO_DIRECTION_READ ? EV_READ : 0) |
		     (dir & LIBNBD_AIO_DIRECTION_WRITE ? EV_WRITE : 0);
	if (c->ev && c->dir == dir)
		return;
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	c->dir = dir;
	c->ev = event_new(c->nb->loop, nbd_aio_get_fd(c->h), what | EV_PERSIST, conn_on_event, c);
	if (c->ev)
		event_add(c->ev, NULL);
}

static void conn_open(struct nbd_conn *c, struct nbd_handle *h)
{
	c->h = h;
	c->live = true;
	c->dir = ~0u;
	conn_watch(c);
}

static void issue_waiting(struct nbd_backend *nb);
static void schedule_reconnect(struct nbd_backend *nb);
static void process_deferred(struct nbd_backend *nb);

/*
 * The server went away. Closing the handle retires every command still in
 * flight (their free callbacks run and put the requests back in the
 * waiting list); then the connection is tried again.
 */
static void conn_lost(struct nbd_conn *c)
{
	struct nbd_backend *nb = c->nb;
	if (!c->live)
		return;
	c->live = false;
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	const char *why = nbd_get_error();
	bool first = nb->connected;
	nb->connected = false;
	for (unsigned i = 0; i < nb->nconns; i++)
		if (nb->conns[i].live && &nb->conns[i] != c)
			nb->connected = true;
	if (nb->unflushed)
		nb->lost_writes = true;
	atomic_fetch_add(&nb->base.loss_seq, 1); /* the cache writes its unstable data again */
	if (first && !nb->connected)
		log_error("backend %s: backend connection lost (%s); reconnecting", nb->name,
			  why ? why : "closed");
	struct nbd_handle *h = c->h;
	c->h = NULL;
	nbd_close(h);
	if (!nb->connected)
		schedule_reconnect(nb);
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	char err[256];
	unsigned want = nb->multi_conn ? nb->nconns : 1;
	unsigned opened = 0;
	for (unsigned i = 0; i < want; i++) {
		if (nb->conns[i].live) {
			opened++;
			continue;
		}
		struct nbd_handle *h = connect_handle(
			nb, i == 0 ? NBD_CONNECT_TIMEOUT_MS : NBD_EXTRA_CONNECT_TIMEOUT_MS, err,
			sizeof(err));
		if (!h)
			break;
		if ((uint64_t)nbd_get_size(h) != nb->base.size)
			log_warn("backend %s: size changed to %lld after reconnecting", nb->name,
				 (long long)nbd_get_size(h));
		conn_open(&nb->conns[i], h);
		opened++;
	}
	if (opened == 0) {
		log_debug("backend %s: reconnect failed: %s", nb->name, err);
		nb->backoff_ms = nb->backoff_ms * 2 > NBD_BACKOFF_MAX_MS ? NBD_BACKOFF_MAX_MS
								       : nb->backoff_ms * 2;
		schedule_reconnect(nb);
		return;
	}
	nb->connected = true;
	nb->backoff_ms = NBD_BACKOFF_MIN_MS;
	log_info("backend %s: backend reconnected", nb->name);
	issue_waiting(nb);
}

static void schedule_reconnect(struct nbd_backend *nb)
{
	if (nb->stop || evtimer_pending(nb->retry, NULL))
		return;
	struct timeval tv = {nb->backoff_ms / 1000, (nb->backoff_ms % 1000) * 1000};
	evtimer_add(nb->retry, &tv);
}

static struct nbd_conn *pick_conn(struct nbd_backend *nb)
{
	for (unsigned k = 0; k < nb->nconns; k++) {
		struct nbd_conn *c = &nb->conns[nb->next_conn++ % nb->nconns];
		if (c->live)
			return c;
	}
	return NULL;
}

/* ---- requests ---- */

static void io_done_task(struct worker_task *task)
{
	struct backend_io *io = (struct backend_io *)((char *)task - offsetof(struct backend_io, task));
	io->done(io, io->result);
}

/* Hand the finished request back to the worker that submitted it. */
static void io_finish(struct backend_io *io, int result)
{
	io->result = result;
	io->task.run = io_done_task;
	worker_post(io->worker, &io->task);
}

static void pump(struct nbd_backend *nb, struct backend_io *io);

static void wait_for_connection(struct nbd_backend *nb, struct backend_io *io)
{
	io->queue_next = NULL;
	struct backend_io **p = &nb->waiting;
	while (*p)
		p = &(*p)->queue_next;
	*p = io;
	if (!evtimer_pending(nb->tick, NULL)) {
		struct timeval tv = {0, 200000};
		evtimer_add(nb->tick, &tv);
	}
}

/* Errors that say the connection broke, not that the server refused. */
static bool connection_error(int e)
{
	return e == ENOTCONN || e == ESHUTDOWN || e == ECONNRESET || e == EPIPE ||
	       e == ECONNABORTED || e == ETIMEDOUT;
}

static int chunk_complete(void *user_data, int *error)
{
	struct nbd_chunk *ch = user_data;
	ch->completed = true;
	ch->error = *error;
	return 1; /* retire the command */
}

static int extent_callback(void *user_data, const char *metacontext, uint64_t offset,
			   uint32_t *entries, size_t nr_entries, int *error)
{
	(void)error;
	struct nbd_chunk *ch = user_data;
	struct backend_io *io = ch->io;
	if (strcmp(metacontext, LIBNBD_CONTEXT_BASE_ALLOCATION) != 0 || io->n_extents)
		return 0;
	(void)offset;
	for (size_t i = 0; i + 1 < nr_entries && io->n_extents < io->max_extents; i += 2)
		io->extents[io->n_extents++] =
			(struct nbd_extent){.length = entries[i], .flags = entries[i + 1]};
	return 0;
}

/*
 * The command is gone from libnbd (answered, or its connection closed):
 * account for it. A chunk that never completed, or failed because the
 * connection died, sends the whole request again after reconnecting.
 * libnbd may call this inside its own calls, so the request is only
 * marked here and looked at again by process_deferred().
 */
static void chunk_free(void *user_data)
{
	struct nbd_chunk *ch = user_data;
	struct backend_io *io = ch->io;
	struct nbd_backend *nb = to_nbd(io->backend);
	/* No nbd_* call here: libnbd holds the handle's lock (libnbd(3)). */
	bool lost = !(io->state & IO_ISSUING) &&
		    (!ch->completed || !ch->conn->live || connection_error(ch->error));
	if (lost)
		io->state |= IO_RESTART;
	else if (ch->error && !io->result)
		io->result = -ch->error;
	free(ch);
	io->stage--;
	if (!(io->state & IO_DEFERRED)) {
		io->state |= IO_DEFERRED;
		io->deferred_next = nb->deferred;
		nb->deferred = io;
	}
}

/* Outside libnbd: move every request a callback touched along. */
static void process_deferred(struct nbd_backend *nb)
{
	while (nb->deferred) {
		struct backend_io *io = nb->deferred;
		nb->deferred = io->deferred_next;
		io->state &= ~IO_DEFERRED;
		if (io->stage > 0)
			continue; /* its other chunks will bring it back */
		if (io->state & IO_RESTART) {
			io->state = 0;
			io->progress = 0;
			io->result = 0;
			io->n_extents = 0;
			if (nb->connected)
				pump(nb, io);
			else
				wait_for_connection(nb, io);
			continue;
		}
		pump(nb, io);
	}
}

/* Issue one command for io on c: [offset, offset+len) of the request. */
static int issue_chunk(struct nbd_backend *nb, struct nbd_conn *c, struct backend_io *io,
		       uint64_t at, uint64_t len)
{
	struct nbd_chunk *ch = calloc(1, sizeof(*ch));
	if (!ch)
		return -ENOMEM;
	ch->io = io;
	ch->conn = c;
	ch->offset = io->offset + at;
	nbd_completion_callback cb = {.callback = chunk_complete, .user_data = ch, .free = chunk_free};
	uint32_t fua = (io->flags & BACKEND_FUA) && nb->can_fua ? LIBNBD_CMD_FLAG_FUA : 0;
	int64_t cookie = -1;
	io->stage++;
	io->state |= IO_ISSUING; /* a failing call frees the closure at once */
	switch (io->state & IO_FLUSHING ? BACKEND_FLUSH : io->cmd) {
	case BACKEND_READ:
		cookie = nbd_aio_pread(c->h, (char *)io->buf + at, len, io->offset + at, cb, 0);
		break;
	case BACKEND_WRITE:
		cookie = nbd_aio_pwrite(c->h, (char *)io->buf + at, len, io->offset + at, cb, fua);
		break;
	case BACKEND_ZERO:
		if (!nb->base.can_zero) { /* emulated: zeros written */
			cookie = nbd_aio_pwrite(c->h, zero_chunk, len, io->offset + at, cb, fua);
			break;
		}
		cookie = nbd_aio_zero(c->h, len, io->offset + at, cb,
				      fua | (io->flags & BACKEND_NO_HOLE ? LIBNBD_CMD_FLAG_NO_HOLE : 0) |
					      (io->flags & BACKEND_FAST_ONLY ? LIBNBD_CMD_FLAG_FAST_ZERO
									    : 0));
		break;
	case BACKEND_TRIM:
		cookie = nbd_aio_trim(c->h, len, io->offset + at, cb, fua);
		break;
	case BACKEND_FLUSH:
		cookie = nbd_aio_flush(c->h, cb, 0);
		break;
	case BACKEND_CACHE:
		cookie = nbd_aio_cache(c->h, len, io->offset + at, cb, 0);
		break;
	case BACKEND_BLOCK_STATUS: {
		nbd_extent_callback ecb = {.callback = extent_callback, .user_data = ch};
		cookie = nbd_aio_block_status(c->h, len, io->offset + at, ecb, cb, 0);
		break;
	}
	}
	io->state &= ~IO_ISSUING;
	if (cookie < 0) {
		/* libnbd freed the closure (chunk_free ran) already. */
		int e = nbd_get_errno();
		if (connection_error(e) || nbd_aio_is_dead(c->h) || nbd_aio_is_closed(c->h)) {
			io->state |= IO_RESTART; /* send it again on a new connection */
			conn_lost(c);
			return 0;
		}
		return -(e ? e : EIO);
	}
	return 0;
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
	case BACKEND_FLUSH:
		return UINT64_MAX;
	default:
		return NBD_COMPACT_MAX;
	}
}

/* The request is complete: maybe with a flush for FUA, then back to its worker. */
static void request_complete(struct nbd_backend *nb, struct backend_io *io)
{
	int result = io->result;
	bool flushed = io->cmd == BACKEND_FLUSH || (io->state & IO_FLUSHING);
	if (result == 0 && !flushed &&
	    (io->cmd == BACKEND_WRITE || io->cmd == BACKEND_ZERO || io->cmd == BACKEND_TRIM))
		nb->unflushed++;
	if (flushed && result == 0) {
		if (nb->lost_writes) {
			nb->lost_writes = false;
			result = -EIO;
			log_warn("backend %s: writes acknowledged before the connection was lost "
				 "may be gone; this FLUSH reports EIO",
				 nb->name);
		}
		nb->unflushed = 0;
	}
	io_finish(io, result);
}

/* Issue what the window allows; finish the request when nothing is left. */
static void pump(struct nbd_backend *nb, struct backend_io *io)
{
	bool flushing = io->state & IO_FLUSHING;
	enum backend_cmd cmd = flushing ? BACKEND_FLUSH : io->cmd;
	uint64_t length = flushing ? 0 : io->length;
	uint64_t limit = chunk_limit(nb, cmd);
	while (io->stage < NBD_WINDOW && io->result == 0 && !(io->state & IO_RESTART) &&
	       (io->progress < length || (io->progress == 0 && length == 0))) {
		struct nbd_conn *c = pick_conn(nb);
		if (!c) {
			if (io->stage == 0)
				wait_for_connection(nb, io);
			return;
		}
		uint64_t n = length - io->progress < limit ? length - io->progress : limit;
		uint64_t at = io->progress;
		/* One command answers a FLUSH or a BLOCK_STATUS. */
		io->progress = cmd == BACKEND_FLUSH || cmd == BACKEND_BLOCK_STATUS ? UINT64_MAX - 1
										   : at + n;
		int rc = issue_chunk(nb, c, io, at, n);
		if (rc < 0 && !io->result)
			io->result = rc;
		conn_watch(c);
	}
	if (io->stage > 0 || (io->state & IO_RESTART))
		return; /* chunk_free / process_deferred bring it back */
	if (io->result == 0 && !flushing && (io->flags & BACKEND_FUA) && !nb->can_fua &&
	    nb->can_flush && (cmd == BACKEND_WRITE || cmd == BACKEND_ZERO || cmd == BACKEND_TRIM)) {
		/* FUA emulated: once the write is done, flush. */
		nb->unflushed++;
		io->state |= IO_FLUSHING;
		io->progress = 0;
		pump(nb, io);
		return;
	}
	request_complete(nb, io);
}

/* Answer at once what the server does not do; else start the request. */
static void start_request(struct nbd_backend *nb, struct backend_io *io)
{
	io->stage = 0;
	io->progress = 0;
	io->result = 0;
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
			request_complete(nb, io);
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
		break;
	}
	io->deadline_ns = clock_now_ns() + nb->timeout_ns;
	if (!nb->connected) {
		wait_for_connection(nb, io);
		return;
	}
	pump(nb, io);
}

static void issue_waiting(struct nbd_backend *nb)
{
	struct backend_io *io = nb->waiting;
	nb->waiting = NULL;
	while (io) {
		struct backend_io *next = io->queue_next;
		io->stage = 0;
		io->progress = 0;
		io->result = 0;
		io->state &= IO_FLUSHING;
		pump(nb, io);
		io = next;
	}
	process_deferred(nb);
}

/* Requests that waited too long for a connection fail with EIO. */
static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	uint64_t now = clock_now_ns();
	struct backend_io **p = &nb->waiting;
	while (*p) {
		struct backend_io *io = *p;
		if (now >= io->deadline_ns) {
			*p = io->queue_next;
			io_finish(io, -EIO);
		} else {
			p = &io->queue_next;
		}
	}
	if (nb->waiting) {
		struct timeval tv = {0, 200000};
		evtimer_add(nb->tick, &tv);
	}
}

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
	for (unsigned i = 0; i < nb->nconns; i++)
		if (nb->conns[i].h)
			conn_open(&nb->conns[i], nb->conns[i].h);
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
	nb->retry = evtimer_new(nb->loop, on_retry, nb);
	nb->tick = evtimer_new(nb->loop, on_tick, nb);
	if (!nb->wake || !nb->retry || !nb->tick)
		return -ENOMEM;
	int rc = -pthread_create(&nb->thread, NULL, backend_thread, nb);
	if (rc == 0)
		nb->started = true;
	return rc;
}

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
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		if (nb->conns[i].ev)
			event_free(nb->conns[i].ev);
		if (nb->conns[i].h)
			nbd_close(nb->conns[i].h); /* stops an nbdkit we started */
	}
	if (nb->wake)
		event_free(nb->wake);
	if (nb->retry)
		event_free(nb->retry);
	if (nb->tick)
		event_free(nb->tick);
	if (nb->loop)
		event_base_free(nb->loop);
	if (nb->argv)
		for (char **a = nb->argv; *a; a++)
			free(*a);
	free(nb->argv);
	free(nb->uri);
	free(nb->name);
	pthread_mutex_destroy(&nb->lock);
	free(nb);
}

static const struct backend_ops nbd_ops = {
	.kind = "nbd",
	.submit = nbd_submit,
	.start = nbd_start,
	.close = nbd_backend_close,
};

bool backend_nbd_handles(const char *spec)
{
	static const char *const prefixes[] = {"nbd://", "nbds://", "nbd+unix://", "nbds+unix://",
					      "nbd+vsock://", "nbds+vsock://", "nbdkit:"};
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
	nb->name = strdup(spec);
	nb->timeout_ns = (uint64_t)timeout_seconds * 1000000000u;
	nb->backoff_ms = NBD_BACKOFF_MIN_MS;
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
	struct nbd_handle *h = connect_handle(nb, NBD_CONNECT_TIMEOUT_MS, err, sizeof(err));
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
	nb->multi_conn = nbd_can_multi_conn(h) == 1 && nb->uri;
	int64_t minimum = nbd_get_block_size(h, LIBNBD_SIZE_MINIMUM);
	int64_t maximum = nbd_get_block_size(h, LIBNBD_SIZE_MAXIMUM);
	nb->base.min_block = minimum > 1 ? (uint32_t)minimum : 1;
	nb->max_block = maximum > 0 && maximum < (32 << 20) ? (uint32_t)maximum : (32u << 20);
	nb->conns[0].nb = nb;
	nb->conns[0].h = h;
	nb->nconns = 1;
	nb->connected = true;
	if (nb->multi_conn) {
		for (unsigned i = 1; i < NBD_MAX_CONNS; i++) {
			nb->conns[i].nb = nb;
			nb->conns[i].h =
				connect_handle(nb, NBD_EXTRA_CONNECT_TIMEOUT_MS, err, sizeof(err));
			if (!nb->conns[i].h) {
				log_info("backend %s: connection %u: %s; using %u", spec, i + 1, err,
					 i);
				break;
			}
			nb->nconns++;
		}
	}
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++)
		nb->conns[i].nb = nb;
	log_info("backend %s: %llu bytes, %u connection(s)%s%s%s%s%s", spec,
		 (unsigned long long)nb->base.size, nb->nconns, nb->base.readonly ? ", read-only" : "",
		 nb->base.can_trim ? ", trim" : "", nb->base.can_zero ? ", zero" : ", zero emulated",
		 nb->can_fua ? ", fua" : ", fua emulated",
		 nb->can_block_status ? ", base:allocation" : "");
	*out = &nb->base;
	return 0;
err:
	free(nb->name);
	free(nb->uri);
	free(nb);
	return rc;
}
