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
 * The drain thread writes in log order, taking first a batch a waiting
 * request needs, in groups of at most DRAIN_GROUP_BYTES: each batch's
 * data read whole and checked against its CRC (bind read only the
 * headers of the committed ones), its pieces written through a window of
 * requests on the drain's own worker while the next batch is read, then
 * the group's backends that may lose completed writes (NBD servers)
 * flushed; its pieces are done only then, and only if no such backend
 * lost its connection meanwhile (else written again). File and block
 * device backends are flushed once, when every piece is done, before the
 * log is let go. A
 * batch whose data no longer checks is never written: an error names
 * what it held, which is lost. A backend that fails a write fails the
 * requests waiting for that export; the group is tried again a second
 * later. When every piece is done, the level-2 map is brought up to date
 * and the batch holding the live log in the ring is released to the next
 * checkpoint (until then no checkpoint covers anything: device_log.c).
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

/* Piece p onto its backend be (data: its bytes, for DATA). */
static int send_piece(struct window *win, struct backend *be, const struct dev_piece *p,
		      uint8_t *data)
{
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

/* Batch k goes first (queued): false when out of memory (it then comes
 * in log order). g->lock held. */
static bool want_push(struct dev_drain *g, size_t k)
{
	if (g->want_head == g->nwant)
		g->want_head = g->nwant = 0;
	if (g->nwant == g->capwant) {
		size_t cap = g->capwant ? g->capwant * 2 : 64;
		size_t *w = realloc(g->want, cap * sizeof(*w));
		if (!w)
			return false;
		g->want = w;
		g->capwant = cap;
	}
	g->want[g->nwant++] = k;
	return true;
}

/* Must io of slot s wait (true) or go? mark: the batches it needs are
 * wanted first (else the answer is all that is asked). g->lock held. */
static bool blocked_locked(struct dev_drain *g, unsigned s, const struct backend_io *io, bool mark)
{
	if (io->cmd == BACKEND_FLUSH)
		return g->undone[s] > 0;
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
	bool r = false;
	for (size_t i = lo; i < g->nby_offset[s]; i++) {
		const struct dev_piece *p = &g->pieces[g->by_offset[s][i]];
		if (p->offset >= b)
			break;
		if (p->done)
			continue;
		if (!mark)
			return true;
		struct dev_drain_batch *bt = &g->batches[p->batch];
		if (bt->state == DEV_DRAIN_PENDING && want_push(g, p->batch))
			bt->state = DEV_DRAIN_WANTED;
		r = true;
	}
	return r;
}

/* slot, if the drain planned pieces for it, else DEVFMT_MAX_EXPORTS. */
static unsigned planned(const struct dev_drain *g, int slot)
{
	if (slot < 0 || slot >= (int)DEVFMT_MAX_EXPORTS || !g->backend[slot])
		return DEVFMT_MAX_EXPORTS;
	return (unsigned)slot;
}

static void parked_run(struct worker_task *task)
{
	struct dev_parked *p =
	    (struct dev_parked *)((char *)task - offsetof(struct dev_parked, task));
	struct backend_io *io = p->io;
	struct worker *w = p->worker;
	struct backend *b = p->backend;
	int result = p->result;
	free(p);
	if (result < 0) {
		io->done(io, result);
		return;
	}
	backend_submit(b, w, io);
	uring_submit(&w->ring);
}

bool cache_device_gate(struct cache_device *d, int slot, struct worker *w, struct backend_io *io)
{
	struct dev_drain *g = d ? d->drain : NULL;
	unsigned s = g ? planned(g, slot) : DEVFMT_MAX_EXPORTS;
	if (s == DEVFMT_MAX_EXPORTS)
		return false;
	pthread_mutex_lock(&g->lock);
	if (!blocked_locked(g, s, io, true)) {
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
	*p = (struct dev_parked){.io = io, .worker = w, .slot = s, .backend = g->backend[s]};
	p->task.run = parked_run;
	p->next = g->parked;
	g->parked = p;
	g->waits++;
	pthread_cond_signal(&g->cond);
	pthread_mutex_unlock(&g->lock);
	return true;
}

/* Send on every parked request that may go now; fail those of the slots
 * in fail (a write of a batch they may wait for failed) with error.
 * g->lock held. */
static void release_locked(struct dev_drain *g, const bool *fail, int error)
{
	struct dev_parked **pp = &g->parked;
	while (*pp) {
		struct dev_parked *p = *pp;
		unsigned s = p->slot;
		int r = s < DEVFMT_MAX_EXPORTS && blocked_locked(g, s, p->io, false) ? 1 : 0;
		if (r > 0 && fail && fail[s])
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

/* The most a group of batches writes before its backends are flushed
 * (sooner when a request waits): reads of the next batch overlap the
 * writes of the last, and a request that comes meanwhile waits for at
 * most this much before its batch. */
#define DRAIN_GROUP_BYTES (8ull << 20)
/* A group of file and block device backends only: they never lose a
 * write they completed (loss_seq), so they are flushed once, at the end,
 * and a group ends only to let a waiting request in. */
#define DRAIN_GROUP_BYTES_FILE (64ull << 20)

/* The next batch to write: one a request waits for, else the next in log
 * order; SIZE_MAX: none. g->lock held. */
static size_t pick_locked(struct cache_device *d, struct dev_drain *g)
{
	while (g->want_head < g->nwant) {
		size_t k = g->want[g->want_head++];
		if (g->batches[k].state == DEV_DRAIN_WANTED)
			return k;
	}
	while (g->next < d->nlive && g->batches[g->next].state != DEV_DRAIN_PENDING)
		g->next++;
	return g->next < d->nlive ? g->next : SIZE_MAX;
}

/* Batch k's data no longer checks: its pieces are lost, said. g->lock
 * held. */
static void lose_batch_locked(struct cache_device *d, struct dev_drain *g, size_t k,
			      const char *why)
{
	struct dev_drain_batch *bt = &g->batches[k];
	bt->state = DEV_DRAIN_BAD;
	for (size_t i = bt->first; i < bt->first + bt->count; i++) {
		struct dev_piece *p = &g->pieces[i];
		log_error(
		    "cache device %s: batch %llu of its log (at offset %llu) was committed, "
		    "but now %s: the device corrupted it. %llu bytes of export \"%s\" at %llu "
		    "that it held are lost: the backend keeps what it had there",
		    d->path, (unsigned long long)d->live[k].seq, (unsigned long long)d->live[k].off,
		    why, (unsigned long long)p->length, d->slots[p->slot].id.name,
		    (unsigned long long)p->offset);
		p->done = true;
		g->pending_bytes -= p->length;
		g->lost_bytes += p->length;
		if (--g->undone[p->slot] == 0)
			atomic_store(g->gate[p->slot], false);
	}
}

/* A group of batches being written: their data until the writes are
 * done, the slots they touch and those backends' loss_seq before. */
struct group {
	size_t *k;
	uint8_t **data;
	size_t n;
	uint64_t bytes;
	bool slot[DEVFMT_MAX_EXPORTS];
	uint64_t loss[DEVFMT_MAX_EXPORTS];
	bool may_lose; /* a backend of it may lose completed writes */
};

/* A backend that may lose writes it completed before a flush covered
 * them (an NBD server's connection lost): flushed with each group. */
static bool may_lose(const struct backend *be)
{
	return !be->ident_file;
}

/* Batch k read, checked and its pieces sent (not waited for): 0, 1 (its
 * data no longer checks: why says why), -errno. */
static int send_batch(struct cache_device *d, struct dev_drain *g, struct window *win,
		      struct group *grp, size_t k, uint8_t *hdr, char *why, size_t why_len)
{
	struct walk b;
	int rc = dev_live_read(d, k, false, &b, hdr);
	if (rc <= 0) {
		snprintf(why, why_len, "%s", b.why);
		free(b.data);
		return rc < 0 ? rc : 1;
	}
	/* (pieces are written by this thread alone, and only done changes:
	 * read unlocked) */
	size_t first = g->batches[k].first, count = g->batches[k].count;
	for (size_t i = first; i < first + count; i++) {
		const struct dev_piece *p = &g->pieces[i];
		if (!grp->slot[p->slot]) {
			grp->slot[p->slot] = true;
			grp->loss[p->slot] = atomic_load(&g->backend[p->slot]->loss_seq);
			grp->may_lose |= may_lose(g->backend[p->slot]);
		}
	}
	grp->k[grp->n] = k;
	grp->data[grp->n++] = b.data;
	for (size_t i = first; i < first + count && rc >= 0; i++) {
		const struct dev_piece *p = &g->pieces[i];
		rc = send_piece(win, g->backend[p->slot], p, b.data ? b.data + p->data : NULL);
		grp->bytes += p->length;
	}
	return rc < 0 ? rc : 0;
}

/* The group's writes done; those of its backends that may lose them
 * flushed, none of which lost a connection meanwhile (the others are
 * flushed once, at the end: flush_rest): 0, 1 (one lost some: write the
 * group again), -errno. */
static int settle_group(struct dev_drain *g, struct window *win, struct group *grp)
{
	int rc = window_drain(win);
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS && rc == 0; s++) {
		if (!grp->slot[s] || !may_lose(g->backend[s]))
			continue;
		rc = rio_send(win, g->backend[s], BACKEND_FLUSH, 0, 0, NULL);
		int werr = window_drain(win);
		if (rc == 0)
			rc = werr;
		if (rc == 0 && atomic_load(&g->backend[s]->loss_seq) != grp->loss[s])
			rc = 1;
	}
	return rc;
}

/* Every backend written and not flushed since (touched), flushed: 0 or
 * -errno. */
static int flush_rest(struct cache_device *d, struct dev_drain *g, struct window *win)
{
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++) {
		if (!g->touched[s])
			continue;
		int rc = rio_send(win, g->backend[s], BACKEND_FLUSH, 0, 0, NULL);
		int werr = window_drain(win);
		if (rc == 0)
			rc = werr;
		if (rc < 0) {
			log_error("cache device %s: flushing export \"%s\" after writing back its "
				  "log: %s; tried again in a second",
				  d->path, d->slots[s].id.name, strerror(-rc));
			return rc;
		}
		g->touched[s] = false;
	}
	return 0;
}

static void *drain_thread(void *arg)
{
	struct cache_device *d = arg;
	struct dev_drain *g = d->drain;
	struct window win = {.w = &g->worker};
	pthread_mutex_init(&win.lock, NULL);
	pthread_cond_init(&win.cond, NULL);
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	struct group grp = {0};
	grp.k = calloc(d->nlive ? d->nlive : 1, sizeof(*grp.k));
	grp.data = calloc(d->nlive ? d->nlive : 1, sizeof(*grp.data));
	char why[200];
	pthread_mutex_lock(&g->lock);
	while (!g->stop && hdr && grp.k && grp.data) {
		if (g->retry_ns > clock_now_ns()) {
			if (g->closing)
				break;
			wait_until_locked(g, g->retry_ns);
			continue;
		}
		/* A group: batches read and written until enough is, or a
		 * request waits; then the backends flushed. */
		int rc = 0;
		size_t k;
		while (rc == 0 &&
		       grp.bytes < (grp.may_lose ? DRAIN_GROUP_BYTES : DRAIN_GROUP_BYTES_FILE) &&
		       (!g->parked || !grp.n) && (k = pick_locked(d, g)) != SIZE_MAX) {
			g->batches[k].state = DEV_DRAIN_WRITING;
			pthread_mutex_unlock(&g->lock);
			rc = send_batch(d, g, &win, &grp, k, hdr, why, sizeof(why));
			pthread_mutex_lock(&g->lock);
			if (rc > 0) {
				lose_batch_locked(d, g, k, why);
				release_locked(g, NULL, 0);
				rc = 0;
			}
			if (rc < 0 && (!grp.n || grp.k[grp.n - 1] != k))
				g->batches[k].state = DEV_DRAIN_PENDING; /* not read */
		}
		if (!grp.n && rc == 0) {
			/* Nothing left: every piece is on the backends; the
			 * backends not flushed with their groups now. */
			pthread_mutex_unlock(&g->lock);
			rc = flush_rest(d, g, &win);
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
		int src = settle_group(g, &win, &grp);
		if (rc == 0)
			rc = src;
		else
			(void)window_drain(&win);
		pthread_mutex_lock(&g->lock);
		bool fail[DEVFMT_MAX_EXPORTS] = {false};
		for (size_t j = 0; j < grp.n; j++) {
			struct dev_drain_batch *bt = &g->batches[grp.k[j]];
			for (size_t i = bt->first; i < bt->first + bt->count; i++) {
				struct dev_piece *p = &g->pieces[i];
				fail[p->slot] = true;
				if (rc != 0)
					continue;
				p->done = true;
				g->touched[p->slot] |= !may_lose(g->backend[p->slot]);
				g->pending_bytes -= p->length;
				g->drained_bytes += p->length;
				if (--g->undone[p->slot] == 0)
					atomic_store(g->gate[p->slot], false);
			}
			/* Written again later (in log order, or first once a
			 * request waits for it again). */
			bt->state = rc == 0 ? DEV_DRAIN_DONE : DEV_DRAIN_PENDING;
			if (rc != 0 && grp.k[j] < g->next)
				g->next = grp.k[j];
			free(grp.data[j]);
		}
		if (rc < 0) {
			log_error(
			    "cache device %s: writing back its log: %s; the requests waiting "
			    "for what it holds of the exports concerned fail, and it is tried "
			    "again in a second",
			    d->path, strerror(-rc));
			if (!grp.n)
				memset(fail, 1, sizeof(fail));
			g->retry_ns = clock_now_ns() + DRAIN_RETRY_NS;
			release_locked(g, fail, rc);
		} else if (rc > 0) {
			log_warn(
			    "cache device %s: a backend lost its connection while %zu batch(es) "
			    "of the log were written back to it: written again",
			    d->path, grp.n);
		} else {
			release_locked(g, NULL, 0);
		}
		memset(grp.slot, 0, sizeof(grp.slot));
		grp.n = 0;
		grp.bytes = 0;
		grp.may_lose = false;
	}
	bool gave_up = !g->finished && !g->stop && !g->closing;
	g->ended = true;
	pthread_mutex_unlock(&g->lock);
	pthread_mutex_destroy(&win.lock);
	pthread_cond_destroy(&win.cond);
	free(hdr);
	free(grp.k);
	free(grp.data);
	if (gave_up)
		log_error("cache device %s: the drain of the live log found at start ended "
			  "without it: out of memory; its bytes stay held in the log (FLUSH and a "
			  "stop wait for them; a restart drains them)",
			  d->path);
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
		 "waited for it)%s",
		 d->path, d->nlive, (unsigned long long)g->drained_bytes, (double)g->drain_ns / 1e9,
		 (unsigned long long)g->waits, g->lost_bytes ? "; some were lost (see above)" : "");
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
			atomic_store(g->gate[s], true);
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
	free(g->want);
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
	out->replay_lost_bytes = g->lost_bytes;
	out->replay_drain_ns = g->drain_ns;
	out->replay_waits = g->waits;
	pthread_mutex_unlock(&g->lock);
}

bool cache_device_drain_progressing(struct cache_device *d)
{
	struct dev_drain *g = d->drain;
	if (!g || !g->inited)
		return false;
	pthread_mutex_lock(&g->lock);
	bool ok = g->running && !g->ended && !g->finished && g->retry_ns <= clock_now_ns();
	pthread_mutex_unlock(&g->lock);
	return ok;
}
