/*
 * daemon/cache/device_drain.c: the live log a start found on a cache
 * device, written to the exports' backends in the background while they
 * are served (device.h, device_internal.h).
 *
 * dev_plan (device_replay.c) leaves the pieces: for every byte the live
 * log holds, the newest record over it. Until a piece is on its backend
 * its bytes are dirty, held in the log: the backend does not have them.
 * So every backend request of the cache that touches one waits
 * (cache_device_gate, from cache_backend_submit): a fill reads the bytes
 * only after they are there, and a newer write of them reaches the
 * backend after the older one. A backend FLUSH of an export waits for all
 * of its pieces, so that whatever a flush promises (a full round, a
 * retire, a detach, a clean stop) covers them too.
 *
 * The drain thread writes batch by batch, in log order, taking first a
 * batch a waiting request needs; each batch's data is read whole and
 * checked against its CRC (bind read only the headers of the committed
 * ones), its pieces written through a window of requests on the drain's
 * own worker, and marked done once every write completed. A batch whose
 * data no longer checks is never written: the requests that need it fail
 * with EIO, the log keeps it, and an error says so. A backend that fails
 * a write fails the requests waiting for that batch; it is tried again a
 * second later. When every piece is done, the backends are flushed, the
 * level-2 map is brought up to date, and the batch holding the live log
 * in the ring is released to the next checkpoint.
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"

/* Requests the drain has in flight at most. */
#define DRAIN_WINDOW 16
/* A batch whose write failed is tried again after this long. */
#define DRAIN_RETRY_NS 1000000000ull

/* ---- the drain's backend requests ---- */

struct window {
	struct worker *w;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	unsigned inflight;
	int error;
};

struct rio {
	struct backend_io io;
	struct worker_task task;
	struct window *win;
	struct backend *be;
};

static void rio_done(struct backend_io *io, int result)
{
	struct rio *r = (struct rio *)((char *)io - offsetof(struct rio, io));
	struct window *win = r->win;
	pthread_mutex_lock(&win->lock);
	if (result < 0 && !win->error)
		win->error = result;
	win->inflight--;
	pthread_cond_broadcast(&win->cond);
	pthread_mutex_unlock(&win->lock);
	free(r);
}

static void rio_task(struct worker_task *task)
{
	struct rio *r = (struct rio *)((char *)task - offsetof(struct rio, task));
	/* r may be gone once submitted: a backend may complete inline. */
	struct worker *w = r->win->w;
	backend_submit(r->be, w, &r->io);
	uring_submit(&w->ring);
}

/* Send one request; waits for room. */
static int rio_send(struct window *win, struct backend *be, enum backend_cmd cmd, uint64_t offset,
		    uint64_t length, uint8_t *buf)
{
	struct rio *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	pthread_mutex_lock(&win->lock);
	while (win->inflight >= DRAIN_WINDOW)
		pthread_cond_wait(&win->cond, &win->lock);
	int error = win->error;
	if (!error)
		win->inflight++;
	pthread_mutex_unlock(&win->lock);
	if (error) {
		free(r);
		return error;
	}
	r->win = win;
	r->be = be;
	r->io.cmd = cmd;
	r->io.offset = offset;
	r->io.length = length;
	r->io.buf = buf;
	r->io.done = rio_done;
	r->task.run = rio_task;
	worker_post(win->w, &r->task);
	return 0;
}

/* Every request sent is done: the first error (then cleared), or 0. */
static int window_drain(struct window *win)
{
	pthread_mutex_lock(&win->lock);
	while (win->inflight)
		pthread_cond_wait(&win->cond, &win->lock);
	int error = win->error;
	win->error = 0;
	pthread_mutex_unlock(&win->lock);
	return error;
}

/* Piece p onto its backend (data: its bytes, for DATA). */
static int send_piece(struct cache_device *d, struct window *win, const struct dev_piece *p,
		      uint8_t *data)
{
	struct backend *be = d->slots[p->slot].ce->backend;
	if (p->type == DEVFMT_EXTENT_DATA) {
		for (uint64_t done = 0; done < p->length;) {
			uint64_t n =
			    p->length - done < DEV_EXTENT_MAX ? p->length - done : DEV_EXTENT_MAX;
			int rc = rio_send(win, be, BACKEND_WRITE, p->offset + done, n, data + done);
			if (rc < 0)
				return rc;
			done += n;
		}
		return 0;
	}
	/* ZERO and TRIM: zeros (a trimmed range reads as anything, zeros too). */
	enum backend_cmd cmd =
	    p->type == DEVFMT_EXTENT_TRIM && be->can_trim ? BACKEND_TRIM : BACKEND_ZERO;
	uint64_t step = be->max_range ? be->max_range : p->length;
	for (uint64_t done = 0; done < p->length;) {
		uint64_t n = p->length - done < step ? p->length - done : step;
		int rc = rio_send(win, be, cmd, p->offset + done, n, NULL);
		if (rc < 0)
			return rc;
		done += n;
	}
	return 0;
}

/* ---- waiting requests ---- */

/* Must io of slot s wait (1), fail (-EIO: it needs a batch that no
 * longer checks), or go (0)? mark: the batches it needs are wanted first
 * (else the answer is all that is asked). g->lock held. */
static int blocked_locked(struct dev_drain *g, unsigned s, const struct backend_io *io, bool mark)
{
	if (io->cmd == BACKEND_FLUSH)
		return !g->undone[s] ? 0 : g->undone[s] > g->bad[s] ? 1 : -EIO;
	uint64_t a = io->offset, b = io->offset + (io->length ? io->length : 1);
	/* The first piece ending after a (they never overlap: sorted by
	 * their ends too). */
	size_t lo = 0, hi = g->nby_offset[s];
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		const struct dev_piece *p = &g->pieces[g->by_offset[s][mid]];
		if (p->offset + p->length <= a)
			lo = mid + 1;
		else
			hi = mid;
	}
	int r = 0;
	for (size_t i = lo; i < g->nby_offset[s]; i++) {
		const struct dev_piece *p = &g->pieces[g->by_offset[s][i]];
		if (p->offset >= b)
			break;
		if (p->done)
			continue;
		struct dev_drain_batch *bt = &g->batches[p->batch];
		if (bt->state == DEV_DRAIN_BAD)
			return -EIO;
		if (!mark)
			return 1;
		if (bt->state == DEV_DRAIN_TODO) {
			bt->state = DEV_DRAIN_WANTED;
			g->wanted++;
		}
		r = 1;
	}
	return r;
}

static unsigned slot_of(struct cache_device *d, const struct cache_export *ce)
{
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++)
		if (d->slots[s].ce == ce)
			return s;
	return DEVFMT_MAX_EXPORTS;
}

static void parked_run(struct worker_task *task)
{
	struct dev_parked *p =
	    (struct dev_parked *)((char *)task - offsetof(struct dev_parked, task));
	struct backend_io *io = p->io;
	struct worker *w = p->worker;
	struct cache_export *ce = p->ce;
	int result = p->result;
	free(p);
	if (result < 0) {
		io->done(io, result);
		return;
	}
	backend_submit(ce->backend, w, io);
	uring_submit(&w->ring);
}

bool cache_device_gate(struct cache_device *d, struct cache_export *ce, struct worker *w,
		       struct backend_io *io)
{
	struct dev_drain *g = d ? d->drain : NULL;
	unsigned s = g ? slot_of(d, ce) : DEVFMT_MAX_EXPORTS;
	if (s == DEVFMT_MAX_EXPORTS)
		return false;
	pthread_mutex_lock(&g->lock);
	int r = blocked_locked(g, s, io, true);
	if (r == 0) {
		pthread_mutex_unlock(&g->lock);
		return false;
	}
	struct dev_parked *p = calloc(1, sizeof(*p));
	if (!p) {
		/* Not sent, never lost: it fails here. */
		pthread_mutex_unlock(&g->lock);
		io->done(io, -ENOMEM);
		return true;
	}
	*p = (struct dev_parked){.io = io, .worker = w, .ce = ce, .result = r < 0 ? r : 0};
	p->task.run = parked_run;
	if (r < 0) {
		pthread_mutex_unlock(&g->lock);
		worker_post(w, &p->task);
		return true;
	}
	p->next = g->parked;
	g->parked = p;
	g->waits++;
	pthread_cond_signal(&g->cond);
	pthread_mutex_unlock(&g->lock);
	return true;
}

/* Send on every parked request that may go now; fail those of the slots
 * in fail (a write of the batch they wait for failed) with error. g->lock
 * held. */
static void release_locked(struct cache_device *d, struct dev_drain *g, const bool *fail, int error)
{
	struct dev_parked **pp = &g->parked;
	while (*pp) {
		struct dev_parked *p = *pp;
		unsigned s = slot_of(d, p->ce);
		int r = s == DEVFMT_MAX_EXPORTS ? 0 : blocked_locked(g, s, p->io, false);
		if (r > 0 && fail && s < DEVFMT_MAX_EXPORTS && fail[s])
			r = error;
		if (r > 0) {
			pp = &p->next;
			continue;
		}
		*pp = p->next;
		p->result = r;
		worker_post(p->worker, &p->task);
	}
}

/* ---- the drain thread ---- */

/* The next batch to write: one a request waits for, else the next in log
 * order; SIZE_MAX: none. g->lock held. */
static size_t pick_locked(struct cache_device *d, struct dev_drain *g)
{
	if (g->wanted)
		for (size_t k = 0; k < d->nlive; k++)
			if (g->batches[k].state == DEV_DRAIN_WANTED)
				return k;
	while (g->next < d->nlive && g->batches[g->next].state != DEV_DRAIN_TODO)
		g->next++;
	return g->next < d->nlive ? g->next : SIZE_MAX;
}

/* Batch k onto the backends: 0, 1 (its data no longer checks), -errno. */
static int drain_batch(struct cache_device *d, struct dev_drain *g, struct window *win, size_t k,
		       uint8_t *hdr)
{
	struct walk b = {.off = d->live[k].off, .seq = d->live[k].seq};
	int rc = dev_walk_next(d, &b, hdr);
	if (rc == 0) {
		/* Its header read well at bind, and a later batch says it was
		 * committed (or bind checked its data): the device corrupted
		 * it. */
		log_error("cache device %s: batch %llu of its log (at offset %llu) was committed, "
			  "but now %s: the device corrupted it. Its records are not written back; "
			  "requests that need them fail with EIO, and the log keeps them. Start "
			  "with cache-device-discard-dirty naming the exports on the device to "
			  "throw them away",
			  d->path, (unsigned long long)d->live[k].seq,
			  (unsigned long long)d->live[k].off, b.why);
		free(b.data);
		return 1;
	}
	if (rc < 0) {
		free(b.data);
		return rc;
	}
	pthread_mutex_lock(&g->lock);
	size_t first = g->batches[k].first, count = g->batches[k].count;
	pthread_mutex_unlock(&g->lock);
	rc = 0;
	for (size_t i = first; i < first + count && rc == 0; i++) {
		/* (pieces are written by this thread alone: read unlocked) */
		const struct dev_piece *p = &g->pieces[i];
		rc = send_piece(d, win, p, b.data ? b.data + p->data : NULL);
	}
	int werr = window_drain(win);
	free(b.data);
	return rc < 0 ? rc : werr;
}

/* Every backend the drain wrote to, flushed: 0 or -errno. */
static int flush_touched(struct cache_device *d, struct dev_drain *g, struct window *win)
{
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++) {
		if (!g->touched[s])
			continue;
		int rc = rio_send(win, d->slots[s].ce->backend, BACKEND_FLUSH, 0, 0, NULL);
		int werr = window_drain(win);
		if (rc == 0)
			rc = werr;
		if (rc < 0) {
			log_error("cache device %s: flushing export \"%s\" after writing back its "
				  "log: %s; tried again in a second",
				  d->path, d->slots[s].id.name, strerror(-rc));
			return rc;
		}
	}
	return 0;
}

static void wait_until_locked(struct dev_drain *g, uint64_t until_ns)
{
	uint64_t now = clock_now_ns();
	if (until_ns <= now)
		return;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t ns = (uint64_t)ts.tv_nsec + (until_ns - now);
	ts.tv_sec += (time_t)(ns / 1000000000ull);
	ts.tv_nsec = (long)(ns % 1000000000ull);
	pthread_cond_timedwait(&g->cond, &g->lock, &ts);
}

static void *drain_thread(void *arg)
{
	struct cache_device *d = arg;
	struct dev_drain *g = d->drain;
	struct window win = {.w = &g->worker};
	pthread_mutex_init(&win.lock, NULL);
	pthread_cond_init(&win.cond, NULL);
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	bool bad_said = false;
	pthread_mutex_lock(&g->lock);
	while (!g->stop && hdr) {
		if (g->retry_ns > clock_now_ns()) {
			wait_until_locked(g, g->retry_ns);
			continue;
		}
		size_t k = pick_locked(d, g);
		if (k == SIZE_MAX) {
			bool bad = false;
			for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++)
				bad |= g->undone[s] > 0;
			if (bad) {
				/* Only batches that no longer check are left: the
				 * log keeps them (said for each). */
				if (g->closing)
					break;
				if (!bad_said)
					log_error(
					    "cache device %s: its log is kept as it is: some of "
					    "what it held at start could not be written back",
					    d->path);
				bad_said = true;
				pthread_cond_wait(&g->cond, &g->lock);
				continue;
			}
			pthread_mutex_unlock(&g->lock);
			int rc = flush_touched(d, g, &win);
			pthread_mutex_lock(&g->lock);
			if (rc < 0) {
				g->retry_ns = clock_now_ns() + DRAIN_RETRY_NS;
				continue;
			}
			g->finished = true;
			g->drain_ns = clock_now_ns() - g->t0_ns;
			break;
		}
		pthread_mutex_unlock(&g->lock);
		int rc = drain_batch(d, g, &win, k, hdr);
		pthread_mutex_lock(&g->lock);
		struct dev_drain_batch *bt = &g->batches[k];
		if (bt->state == DEV_DRAIN_WANTED)
			g->wanted--;
		if (rc < 0) {
			log_error("cache device %s: writing back batch %llu of its log: %s; the "
				  "requests waiting for it fail, and it is tried again in a second",
				  d->path, (unsigned long long)d->live[k].seq, strerror(-rc));
			bool fail[DEVFMT_MAX_EXPORTS] = {false};
			for (size_t i = bt->first; i < bt->first + bt->count; i++)
				fail[g->pieces[i].slot] = true;
			bt->state = DEV_DRAIN_TODO;
			g->retry_ns = clock_now_ns() + DRAIN_RETRY_NS;
			release_locked(d, g, fail, rc);
			continue;
		}
		bt->state = rc > 0 ? DEV_DRAIN_BAD : DEV_DRAIN_DONE;
		for (size_t i = bt->first; i < bt->first + bt->count && rc > 0; i++)
			g->bad[g->pieces[i].slot]++;
		for (size_t i = bt->first; i < bt->first + bt->count && rc == 0; i++) {
			struct dev_piece *p = &g->pieces[i];
			p->done = true;
			g->touched[p->slot] = true;
			g->pending_bytes -= p->length;
			g->drained_bytes += p->length;
			if (--g->undone[p->slot] == 0)
				atomic_store(&d->slots[p->slot].ce->replay_gate, false);
		}
		release_locked(d, g, NULL, 0);
	}
	pthread_mutex_unlock(&g->lock);
	pthread_mutex_destroy(&win.lock);
	pthread_cond_destroy(&win.cond);
	free(hdr);
	if (!g->finished)
		return NULL;
	/* The replayed ranges out of the level-2 map before the log that names
	 * them is let go. */
	cache_device_l2_before_write(d);
	pthread_mutex_lock(&d->lock);
	d->held_release = true;
	d->checkpoint_due = true;
	pthread_cond_signal(&d->cond);
	pthread_mutex_unlock(&d->lock);
	log_info("cache device %s: the live log found at start is on the backends: %zu "
		 "batch(es), %llu bytes written back in %.3f s while served (%llu requests "
		 "waited for it)",
		 d->path, d->nlive, (unsigned long long)g->drained_bytes, (double)g->drain_ns / 1e9,
		 (unsigned long long)g->waits);
	return NULL;
}

int dev_drain_start(struct cache_device *d)
{
	struct dev_drain *g = d->drain;
	pthread_mutex_init(&g->lock, NULL);
	pthread_cond_init(&g->cond, NULL);
	g->inited = true;
	for (size_t i = 0; i < g->npieces; i++)
		g->pending_bytes += g->pieces[i].length;
	int rc = worker_start(&g->worker, UINT32_MAX - 1, NULL);
	if (rc < 0)
		return rc;
	g->worker_started = true;
	/* Before anything is served. */
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++)
		if (g->undone[s])
			atomic_store(&d->slots[s].ce->replay_gate, true);
	g->t0_ns = clock_now_ns();
	rc = pthread_create(&g->thread, NULL, drain_thread, d);
	if (rc)
		return -rc;
	g->running = true;
	return 0;
}

void dev_drain_stop(struct cache_device *d, bool wait)
{
	struct dev_drain *g = d->drain;
	if (!g || !g->inited)
		return;
	if (g->running) {
		pthread_mutex_lock(&g->lock);
		if (!wait)
			g->stop = true;
		g->closing = true;
		pthread_cond_signal(&g->cond);
		pthread_mutex_unlock(&g->lock);
		pthread_join(g->thread, NULL);
		g->running = false;
	}
	/* Nothing is sent any more: what still waits fails. */
	pthread_mutex_lock(&g->lock);
	struct dev_parked *p = g->parked;
	g->parked = NULL;
	pthread_mutex_unlock(&g->lock);
	while (p) {
		struct dev_parked *next = p->next;
		p->result = -EIO;
		if (!worker_post_if_running(p->worker, &p->task))
			free(p);
		p = next;
	}
	if (g->worker_started) {
		worker_request_stop(&g->worker);
		worker_join(&g->worker);
		g->worker_started = false;
	}
}

void dev_drain_free(struct cache_device *d)
{
	struct dev_drain *g = d->drain;
	if (!g)
		return;
	dev_drain_stop(d, false);
	if (g->inited) {
		pthread_mutex_destroy(&g->lock);
		pthread_cond_destroy(&g->cond);
	}
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++)
		free(g->by_offset[s]);
	free(g->pieces);
	free(g->batches);
	free(g);
	d->drain = NULL;
}

void dev_drain_stats(struct cache_device *d, struct cache_device_stats *out)
{
	struct dev_drain *g = d->drain;
	if (!g || !g->inited)
		return;
	pthread_mutex_lock(&g->lock);
	out->replay_pending_bytes = g->pending_bytes;
	out->replay_drained_bytes = g->drained_bytes;
	out->replay_drain_ns = g->drain_ns;
	out->replay_waits = g->waits;
	pthread_mutex_unlock(&g->lock);
}
