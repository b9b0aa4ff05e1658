/*
 * daemon/backend/nbd_io.c: requests of the NBD backend, as libnbd commands.
 *
 * A request is cut into chunks the server accepts (its maximum block size;
 * 32-bit lengths for TRIM, WRITE_ZEROES and BLOCK_STATUS), at most
 * NBD_WINDOW in flight, spread over the ready connections. What the server
 * lacks is emulated or answered honestly: no WRITE_ZEROES -> zeros are
 * written; no FUA -> a flush after the write; no FAST_ZERO -> ENOTSUP; no
 * TRIM or CACHE -> nothing to do; no base:allocation -> all data.
 *
 * A FLUSH covers every write completed before it was sent: one flush when
 * every ready connection advertises multi-conn, else one on each.
 *
 * A chunk lost with its connection sends the whole request again, on
 * another connection or once one is back, while the request is younger
 * than --backend-timeout; after that it fails with EIO, as does a request
 * that waited that long for a connection (nbd_io_expire_waiting). While
 * the server is silent (nbd_pool.c) a request that finds no connection
 * fails at once. An error the server returns is the request's error; a
 * connection error (ESHUTDOWN) also closes the connection. An emulated
 * FUA write whose flush completes after loss_seq moved is sent again.
 *
 * libnbd ownership (libnbd(3) "Callback lifetimes", lib/rw.c): every
 * nbd_aio_* command's free callback runs exactly once. When the call
 * returns -1 it has already run; otherwise the command was queued, and the
 * callbacks run when it retires: when the reply comes, when the connection
 * dies (even inside the very nbd_aio_* call that queued it), or in
 * nbd_close(). So a chunk belongs to libnbd from the call on, and only
 * chunk_free() accounts for it; it only marks the request (deferred), and
 * io_advance(), outside libnbd, moves it along.
 *
 * Finished requests are posted back to their worker (worker_post).
 * Backend thread only (nbd_internal.h).
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/nbd_internal.h"
#include "daemon/clock.h"
#include "daemon/log.h"
#include "daemon/worker.h"

static const uint8_t zero_chunk[NBD_ZERO_CHUNK];

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
 * but marks: nbd_io_process_deferred() moves the request along.
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
			nbd_pool_fail(c, why, false);
			return;
		}
		/* libnbd refused the command itself (bounds, flags, size). */
		log_debug("backend %s: %s", nb->name, why);
		if (!io->result)
			io->result = -(e ? e : EIO);
	}
	if (nbd_pool_settle(c))
		nbd_pool_tick_arm(nb);
}

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
	nbd_pool_tick_arm(nb);
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
			return; /* nbd_io_process_deferred() or a connection brings it back */
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

void nbd_io_process_deferred(struct nbd_backend *nb)
{
	while (nb->deferred) {
		struct backend_io *io = nb->deferred;
		nb->deferred = io->deferred_next;
		io->state &= ~IO_DEFERRED;
		io_advance(nb, io);
	}
}

void nbd_io_issue_waiting(struct nbd_backend *nb)
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

void nbd_io_start(struct nbd_backend *nb, struct backend_io *io)
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

void nbd_io_expire_waiting(struct nbd_backend *nb, uint64_t now)
{
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
}
