/*
 * daemon/backend/rbd_io.c: the requests of the rbd backend (rbd.c tells the
 * story; rbd_internal.h draws the map): one rbd_aio_* call per request
 * from the submitting worker, a ticket for each with its deadline, the
 * completion thread that takes librbd's completions from its eventfd and
 * posts each to its worker, answers what is late, and runs block status.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <rados/librados.h>
#include <rbd/librbd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/backend/rbd_internal.h"
#include "daemon/clock.h"
#include "daemon/log.h"

/* ---- requests ---- */

static void done_task(struct worker_task *task)
{
	struct backend_io *io =
	    (struct backend_io *)((char *)task - offsetof(struct backend_io, task));
	io->done(io, io->result);
}

static void finish(struct backend_io *io, int result)
{
	io->result = result;
	io->task.run = done_task;
	worker_post(io->worker, &io->task);
}

/* What the caller sees of a librbd error. */
int rbd_map_error(struct rbd_backend *rb, int r)
{
	if (r == -RBD_ERRNO_BLOCKLISTED)
		rbd_fence(rb, "the cluster answered a request with 'blocklisted'");
	return r == -ENOSPC || r == -EDQUOT ? -ENOSPC : -EIO;
}

/* Off the list of requests in flight (rb->lock held). */
static void ticket_unlink(struct rbd_backend *rb, struct rbd_ticket *t)
{
	if (t->prev)
		t->prev->next = t->next;
	else
		rb->tickets_head = t->next;
	if (t->next)
		t->next->prev = t->prev;
	else
		rb->tickets_tail = t->prev;
	t->prev = t->next = NULL;
}

/* One rbd_aio_* call for io's current stage; < 0: not started. */
static int start_aio(struct rbd_backend *rb, struct backend_io *io)
{
	enum backend_cmd cmd = io->stage == STAGE_FUA_FLUSH ? BACKEND_FLUSH : io->cmd;
	struct rbd_ticket *t = malloc(sizeof(*t));
	if (!t)
		return -ENOMEM;
	t->io = io;
	t->deadline_ns = clock_now_ns() + (uint64_t)rb->timeout_s * 1000000000u;
	t->abandonable = cmd != BACKEND_READ;
	rbd_completion_t c;
	int rc = rbd_aio_create_completion(t, NULL, &c);
	if (rc < 0) {
		free(t);
		return rc;
	}
	atomic_fetch_add(&rb->outstanding, 1);
	/* Listed before librbd has it: its completion may come at once. */
	pthread_mutex_lock(&rb->lock);
	t->next = NULL;
	t->prev = rb->tickets_tail;
	if (rb->tickets_tail)
		rb->tickets_tail->next = t;
	else
		rb->tickets_head = t;
	rb->tickets_tail = t;
	pthread_mutex_unlock(&rb->lock);
	switch (cmd) {
	case BACKEND_READ:
		rc = rbd_aio_read(rb->image, io->offset, (size_t)io->length, io->buf, c);
		break;
	case BACKEND_WRITE:
		rc = io->iovcnt
			 ? rbd_aio_writev(rb->image, io->iov, (int)io->iovcnt, io->offset, c)
			 : rbd_aio_write(rb->image, io->offset, (size_t)io->length, io->buf, c);
		break;
	case BACKEND_FLUSH:
		rc = rbd_aio_flush(rb->image, c);
		break;
	case BACKEND_TRIM:
	case BACKEND_ZERO:
		rc = rbd_aio_write_zeroes(
		    rb->image, io->offset, (size_t)io->length, c,
		    (io->flags & BACKEND_NO_HOLE) ? RBD_WRITE_ZEROES_FLAG_THICK_PROVISION : 0, 0);
		break;
	default:
		rc = -EINVAL;
		break;
	}
	if (rc < 0) {
		rbd_aio_release(c);
		pthread_mutex_lock(&rb->lock);
		ticket_unlink(rb, t);
		pthread_mutex_unlock(&rb->lock);
		free(t);
		atomic_fetch_sub(&rb->outstanding, 1);
	}
	return rc;
}

/* A completion the thread took from librbd: the next stage, or the end. */
static void completed(struct rbd_backend *rb, struct backend_io *io, ssize_t r)
{
	if (r < 0) {
		finish(io, rbd_map_error(rb, (int)r));
		return;
	}
	if (io->cmd == BACKEND_READ && (uint64_t)r != io->length) {
		log_warn("backend %s: a read of %" PRIu64 " bytes at %" PRIu64 " returned %zd",
			 rb->name, io->length, io->offset, r);
		finish(io, -EIO);
		return;
	}
	if (io->cmd == BACKEND_WRITE && (io->flags & BACKEND_FUA) && io->stage == STAGE_MAIN) {
		io->stage = STAGE_FUA_FLUSH;
		int rc = start_aio(rb, io);
		if (rc < 0)
			finish(io, rbd_map_error(rb, rc));
		return;
	}
	finish(io, 0);
}

/* rbd_diff_iterate2's callback: [off, off + len) exists (or not). */
struct extents_walk {
	struct backend_io *io;
	uint64_t pos, end;
};

static bool add_extent(struct backend_io *io, uint64_t length, uint32_t flags)
{
	if (!length)
		return true;
	if (io->n_extents && io->extents[io->n_extents - 1].flags == flags) {
		io->extents[io->n_extents - 1].length += length;
		return true;
	}
	if (io->n_extents == io->max_extents)
		return false;
	io->extents[io->n_extents].length = length;
	io->extents[io->n_extents].flags = flags;
	io->n_extents++;
	return true;
}

#define WALK_FULL 1 /* returned by the callback: no room for more extents */

static int walk_extent(uint64_t off, size_t len, int exists, void *arg)
{
	struct extents_walk *w = arg;
	uint64_t start = off < w->pos ? w->pos : off;
	uint64_t end = off + len > w->end ? w->end : off + len;
	if (start >= end)
		return 0;
	if (start > w->pos && !add_extent(w->io, start - w->pos, NBD_STATE_HOLE | NBD_STATE_ZERO))
		return -WALK_FULL;
	w->pos = start;
	if (!add_extent(w->io, end - start, exists ? 0 : NBD_STATE_HOLE | NBD_STATE_ZERO))
		return -WALK_FULL;
	w->pos = end;
	return 0;
}

static int block_status(struct rbd_backend *rb, struct backend_io *io)
{
	uint64_t size = atomic_load(&rb->base.size);
	uint64_t end = io->offset + io->length;
	struct extents_walk w = {io, io->offset, end > size ? size : end};
	io->n_extents = 0;
	if (w.pos >= w.end)
		return 0;
	int rc = rbd_diff_iterate2(rb->image, NULL, w.pos, w.end - w.pos, 1, 1, walk_extent, &w);
	if (rc == -WALK_FULL)
		return io->n_extents ? 0 : -EIO;
	if (rc < 0)
		return rbd_map_error(rb, rc);
	if (w.pos < w.end && !add_extent(io, w.end - w.pos, NBD_STATE_HOLE | NBD_STATE_ZERO) &&
	    !io->n_extents)
		return -EIO;
	return 0;
}

void rbd_submit(struct backend *be, struct backend_io *io)
{
	struct rbd_backend *rb = to_rbd(be);
	io->result = 0;
	if (atomic_load(&be->fenced)) {
		io->done(io, -EIO);
		return;
	}
	switch (io->cmd) {
	case BACKEND_CACHE:
		io->done(io, 0);
		return;
	case BACKEND_BLOCK_STATUS:
		queue_post(&rb->slow, &io->posted);
		return;
	case BACKEND_ZERO:
		if (io->flags & BACKEND_FAST_ONLY) {
			io->done(io, -ENOTSUP); /* write_zeroes may write zeros */
			return;
		}
		break;
	default:
		break;
	}
	int rc = start_aio(rb, io);
	if (rc < 0)
		io->done(io, rbd_map_error(rb, rc));
}

/* ---- the thread ---- */

void rbd_take_completions(struct rbd_backend *rb)
{
	uint64_t v;
	ssize_t n = read(rb->efd, &v, sizeof(v));
	(void)n;
	rbd_completion_t comps[RBD_POLL_BATCH];
	int got;
	while ((got = rbd_poll_io_events(rb->image, comps, RBD_POLL_BATCH)) > 0) {
		for (int i = 0; i < got; i++) {
			struct rbd_ticket *t = rbd_aio_get_arg(comps[i]);
			ssize_t r = rbd_aio_get_return_value(comps[i]);
			rbd_aio_release(comps[i]);
			pthread_mutex_lock(&rb->lock);
			struct backend_io *io = t->io;
			if (io) {
				ticket_unlink(rb, t);
				if (r >= 0)
					rb->late_logged = false;
			}
			pthread_mutex_unlock(&rb->lock);
			free(t);
			atomic_fetch_sub(&rb->outstanding, 1);
			if (io)
				completed(rb, io, r);
		}
	}
}

/* Requests that write and are past their deadline: answered EIO, their
 * tickets kept for the completion that may still come. */
static void sweep_late(struct rbd_backend *rb)
{
	uint64_t now = clock_now_ns();
	struct backend_io *late = NULL;
	unsigned n = 0;
	pthread_mutex_lock(&rb->lock);
	struct rbd_ticket *t = rb->tickets_head;
	while (t && t->deadline_ns <= now) {
		struct rbd_ticket *next = t->next;
		if (t->abandonable) {
			ticket_unlink(rb, t);
			t->io->queue_next = late;
			late = t->io;
			t->io = NULL;
			n++;
		}
		t = next;
	}
	bool say = n && !rb->late_logged;
	if (say)
		rb->late_logged = true;
	pthread_mutex_unlock(&rb->lock);
	if (say)
		log_warn("backend %s: %u request(s) that write had no answer within "
			 "--backend-timeout (%u s): answered EIO (the cache keeps the data dirty "
			 "and writes it again)",
			 rb->name, n, rb->timeout_s);
	while (late) {
		struct backend_io *io = late;
		late = io->queue_next;
		finish(io, -EIO);
	}
}

static void run_slow(struct rbd_backend *rb)
{
	uint64_t v;
	ssize_t n = read(rb->wake, &v, sizeof(v));
	(void)n;
	struct queue_link *l = queue_take(&rb->slow, NULL);
	while (l) {
		struct backend_io *io = QUEUE_ENTRY(l, struct backend_io, posted);
		l = l->next;
		finish(io, atomic_load(&rb->base.fenced) ? -EIO : block_status(rb, io));
	}
}

void *rbd_io_thread(void *arg)
{
	struct rbd_backend *rb = arg;
	for (;;) {
		pthread_mutex_lock(&rb->lock);
		bool stop = rb->stop;
		pthread_mutex_unlock(&rb->lock);
		if (stop)
			break;
		struct pollfd p[2] = {{.fd = rb->efd, .events = POLLIN},
				      {.fd = rb->wake, .events = POLLIN}};
		if (poll(p, 2, RBD_SWEEP_MS) < 0 && errno != EINTR)
			break;
		if (p[0].revents & POLLIN)
			rbd_take_completions(rb);
		if (p[1].revents & POLLIN)
			run_slow(rb);
		sweep_late(rb);
	}
	return NULL;
}
