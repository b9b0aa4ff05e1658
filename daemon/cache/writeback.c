/*
 * daemon/cache/writeback.c: dirty data back to the backend.
 *
 * One writeback thread, an event loop with its own io_uring (it is a
 * struct worker without connections). It writes back:
 *
 *   - in the background, oldest first: entries dirty for longer than
 *     --dirty-expire, and everything while dirty data is above
 *     --dirty-high, until it is below --dirty-low;
 *   - for FLUSH: every entry on the export's dirty list when the FLUSH
 *     arrived (which holds every block dirtied by a write completed
 *     before it, on any connection), then the backend is flushed. The
 *     cost follows the dirty data, not the export size;
 *   - at shutdown: everything, retrying while the backend refuses.
 *
 * Writing back an entry: under its shard lock, copy its dirty bits, clear
 * them and set entry->writeback (it stays on the dirty list and pinned);
 * each run of adjacent dirty blocks is one backend write straight from the
 * arena. A write that lands again meanwhile just sets the bits again. If a
 * backend write fails the copied bits are set dirty again: nothing is
 * dropped, and the export's error sequence moves once per failing spell,
 * so each connection's next FLUSH reports it once.
 */
#include <errno.h>
#include <event2/event.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

#define WB_MAX_INFLIGHT 64
#define WB_TICK_MS 250
#define WB_RETRY_NS 1000000000ull
#define WB_SHUTDOWN_RETRY_SECONDS 5
#define WB_GROUP_MAX 512	     /* entries in one writeback group */
#define WB_GROUP_MAX_BYTES (8u << 20) /* device bytes one group may span */
#define WB_FLUSH_WINDOW 64	      /* writeback groups one FLUSH keeps in flight */

struct flush_job;

/* One entry of a writeback group: its dirty bits when the write began. */
struct wb_member {
	struct cache_entry *e;
	uint8_t *mem; /* stable: the entry is pinned */
	uint64_t *bits;
	uint64_t bytes; /* dirty bytes taken: still counted dirty until written */
};

/* Adjacent entries written back together: a run of dirty blocks may
 * cross from one entry into the next and is still one backend write. */
struct wb_op {
	struct writeback *wb;
	struct flush_job *job;
	unsigned pending;
	int error;
	unsigned n;
	uint64_t bytes;
	unsigned cap;
	struct wb_member *m; /* grown as the group grows: most groups are one entry */
};

struct wb_io {
	struct backend_io io;
	struct wb_op *op;
	uint8_t *bounce; /* a run across entries, gathered; freed when done */
};

struct flush_job {
	struct writeback *wb;
	struct cache_op *op; /* NULL: shutdown */
	struct cache_export *ce;
	/*
	 * Every entry on the dirty list when the FLUSH came, pinned:
	 * [0, nbusy) had to wait (a writeback or direct operation in flight
	 * over them), [nbusy, cursor) are done, [cursor, n) are still to visit.
	 */
	struct cache_entry **entries;
	size_t n, cursor, nbusy;
	unsigned inflight;
	int error;
	int stage; /* 0 writing, 1 flushing the backend, 2 done */
	bool advancing, again; /* completions may run inside flush_advance */
	bool waiting; /* on the waitq, or its waiter task posted */
	uint64_t writes_covered; /* backend_writes_done when the flush was sent */
	struct backend_io flush_io;
	struct cache_waiter waiter;
	struct worker_task start, reply;
	struct flush_job *next;
};

struct writeback {
	struct cache *cache;
	struct worker thread;
	bool started;
	struct event *tick;
	struct worker_task kick_task;
	atomic_bool kick_pending;
	struct flush_job *jobs;
	unsigned inflight;
	bool draining;
	bool in_pass, pass_again; /* background_pass is re-entered by inline completions */
	uint64_t jobs_ended;

	/* shutdown */
	struct worker_task stop_task;
	struct event *retry;
	unsigned shutdown_jobs;
	int shutdown_error;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stopped;
};

static void flush_advance(struct flush_job *job);
static void shutdown_pass(struct writeback *wb);

/*
 * Advance every job not already waiting to be woken. A job may end (and be
 * freed) inside another's advance (completions can run inline), so the
 * walk starts over whenever one ends.
 */
static void advance_all(struct writeback *wb)
{
restart:;
	uint64_t ended = wb->jobs_ended;
	for (struct flush_job *job = wb->jobs; job;) {
		struct flush_job *next = job->next;
		if (!job->waiting)
			flush_advance(job);
		if (wb->jobs_ended != ended)
			goto restart;
		job = next;
	}
}

static void background_pass(struct writeback *wb);

/* Drop one reference to op; the last one finishes the writeback. */
static void wb_op_put(struct wb_op *op)
{
	if (--op->pending)
		return;
	struct writeback *wb = op->wb;
	struct cache *c = wb->cache;
	struct cache_export *ce = op->m[0].e->ce;
	for (unsigned i = 0; i < op->n; i++) {
		struct cache_entry *e = op->m[i].e;
		struct cache_shard *sh =
			cache_shard_for(c, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
		pthread_mutex_lock(&sh->lock);
		cache_dirty_bytes_sub(ce, op->m[i].bytes);
		if (op->error) {
			for (uint32_t b = 0; b < e->nblocks; b++)
				if (bit_test(op->m[i].bits, b))
					cache_mark_dirty(e, b, 1);
		}
		e->writeback = false;
		cache_dirty_list_update(e);
		pthread_mutex_unlock(&sh->lock);
		cache_entry_unpin(e);
		free(op->m[i].bits);
	}
	pthread_mutex_lock(&ce->lock);
	bool was_failing = ce->writeback_failing;
	if (op->error) {
		if (!was_failing) {
			ce->writeback_failing = true;
			ce->error_seq++;
		}
		ce->last_error = op->error;
		ce->retry_at = cache_now_ns() + WB_RETRY_NS;
	} else {
		ce->writeback_failing = false;
	}
	pthread_mutex_unlock(&ce->lock);
	if (op->error) {
		atomic_fetch_add(&ce->counters.writeback_errors, 1);
		if (!was_failing)
			log_error("cache: writeback to the backend failed: %s; the data stays dirty "
				  "in the cache and FLUSH reports EIO until it is written",
				  strerror(-op->error));
	} else if (was_failing) {
		log_info("cache: writeback to the backend works again");
	}
	cache_waitq_wake(c);
	if (op->job) {
		op->job->inflight--;
		if (op->error && !op->job->error)
			op->job->error = op->error;
	}
	wb->inflight--;
	free(op->m);
	free(op);
	advance_all(wb);
	if (wb->draining)
		background_pass(wb);
}

static void wb_io_done(struct backend_io *io, int result)
{
	struct wb_io *w = (struct wb_io *)io;
	struct wb_op *op = w->op;
	uint64_t length = io->length;
	free(w->bounce);
	free(w);
	if (result < 0 && !op->error)
		op->error = result;
	if (result >= 0) {
		struct cache_export *ce = op->m[0].e->ce;
		atomic_fetch_add(&ce->backend_writes_done, 1);
		atomic_fetch_add(&ce->counters.writeback_bytes, length); /* written, not tried */
	}
	wb_op_put(op);
}

/*
 * Take e into the group (shard lock held): copy and clear its dirty bits,
 * mark it under writeback, pin it. 1 if taken, 0 if nothing is dirty,
 * -EBUSY if it must wait (a writeback or a direct operation in flight
 * over it), -ENOMEM.
 */
static int claim_locked(struct wb_op *op, struct cache_entry *e)
{
	struct cache_export *ce = e->ce;
	if (e->writeback)
		return -EBUSY;
	if (e->ndirty == 0)
		return 0;
	pthread_mutex_lock(&ce->lock);
	bool locked = cache_direct_overlaps(ce, cache_entry_offset(e), cache_entry_bytes(e));
	pthread_mutex_unlock(&ce->lock);
	if (locked)
		return -EBUSY;
	if (op->n == op->cap) {
		unsigned cap = op->cap ? op->cap * 4 : 1;
		struct wb_member *m = realloc(op->m, cap * sizeof(*m));
		if (!m)
			return -ENOMEM;
		op->m = m;
		op->cap = cap;
	}
	size_t words = (e->nblocks + 63) / 64;
	uint64_t *bits = malloc(words * sizeof(uint64_t));
	if (!bits)
		return -ENOMEM;
	memcpy(bits, cache_dirty_map(e), words * sizeof(uint64_t));
	uint64_t bytes = (uint64_t)e->ndirty << ce->block_shift;
	cache_clear_dirty(e, 0, e->nblocks);
	/* The data is not on the backend yet: it stays in dirty_bytes (the
	 * watermarks and the stats) until the write completes. */
	cache_dirty_bytes_add(ce, bytes);
	e->writeback = true;
	cache_entry_pin(e);
	op->m[op->n++] =
		(struct wb_member){e, arena_address(&ce->cache->arena, e->frame), bits, bytes};
	op->bytes += cache_entry_bytes(e);
	return 1;
}

/*
 * Grow the group with the entries that follow it in device space, while
 * the dirty run goes on across the boundary (so the growth saves backend
 * requests) and the group stays within its limits.
 */
static void group_extend(struct wb_op *op)
{
	struct cache *c = op->wb->cache;
	while (op->n < WB_GROUP_MAX && op->bytes < WB_GROUP_MAX_BYTES) {
		struct wb_member *last = &op->m[op->n - 1];
		struct cache_export *ce = last->e->ce;
		if (!bit_test(last->bits, last->e->nblocks - 1))
			return;
		uint64_t next = last->e->first_frame + (1ull << last->e->order);
		if (next << ARENA_FRAME_SHIFT >= ce->size)
			return;
		struct cache_shard *sh =
			cache_shard_for(c, ce, next >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
		pthread_mutex_lock(&sh->lock);
		struct cache_entry *e = cache_lookup(ce, sh, next);
		int rc = 0;
		if (e && e->first_frame == next && !e->writeback && e->ndirty &&
		    bit_test(cache_dirty_map(e), 0))
			rc = claim_locked(op, e);
		pthread_mutex_unlock(&sh->lock);
		if (rc <= 0)
			return;
	}
}

/* Write the run from (i0, b0) up to (i1, b1) exclusive: one backend write. */
static int submit_run(struct wb_op *op, unsigned i0, uint32_t b0, unsigned i1, uint32_t b1)
{
	struct cache_export *ce = op->m[0].e->ce;
	unsigned shift = ce->block_shift;
	if (b1 == 0 && i1 > i0) { /* ends at an entry boundary */
		i1--;
		b1 = op->m[i1].e->nblocks;
	}
	uint64_t off = cache_entry_offset(op->m[i0].e) + ((uint64_t)b0 << shift);
	uint64_t end = cache_entry_offset(op->m[i1].e) + ((uint64_t)b1 << shift);
	if (end > ce->size)
		end = ce->size;
	struct wb_io *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	if (i0 == i1) {
		w->io.buf = op->m[i0].mem + ((size_t)b0 << shift);
	} else {
		w->bounce = malloc((size_t)(end - off));
		if (!w->bounce) {
			free(w);
			return -ENOMEM;
		}
		size_t at = 0;
		for (unsigned i = i0; i <= i1; i++) {
			struct wb_member *m = &op->m[i];
			uint32_t from = i == i0 ? b0 : 0, to = i == i1 ? b1 : m->e->nblocks;
			size_t n = (size_t)(to - from) << shift;
			if (at + n > end - off)
				n = (size_t)(end - off) - at;
			memcpy(w->bounce + at, m->mem + ((size_t)from << shift), n);
			at += n;
		}
		w->io.buf = w->bounce;
	}
	w->op = op;
	w->io.cmd = BACKEND_WRITE;
	w->io.offset = off;
	w->io.length = end - off;
	w->io.done = wb_io_done;
	op->pending++;
	atomic_fetch_add(&ce->counters.backend_writes, 1);
	atomic_fetch_add(&ce->counters.backend_write_bytes, end - off);
	backend_submit(ce->backend, &op->wb->thread, &w->io);
	return 0;
}

/*
 * Start writing e back, with the dirty entries right after it. Returns 1
 * if started, 0 if there is nothing to write (and nothing in flight),
 * -EBUSY if it must wait, or -ENOMEM.
 */
static int entry_writeback(struct writeback *wb, struct cache_entry *e, struct flush_job *job)
{
	struct cache *c = wb->cache;
	struct cache_export *ce = e->ce;
	struct wb_op *op = calloc(1, sizeof(*op));
	if (!op)
		return -ENOMEM;
	op->wb = wb;
	op->job = job;
	struct cache_shard *sh = cache_shard_for(c, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
	pthread_mutex_lock(&sh->lock);
	int rc = claim_locked(op, e);
	pthread_mutex_unlock(&sh->lock);
	if (rc <= 0) {
		free(op->m);
		free(op);
		return rc;
	}
	group_extend(op);
	op->pending = 1; /* held until every run is submitted */
	wb->inflight++;
	if (job)
		job->inflight++;
	/* Runs of dirty blocks over the group, as one block sequence. */
	bool in_run = false;
	unsigned ri = 0;
	uint32_t rb = 0;
	for (unsigned i = 0; i < op->n && !op->error; i++) {
		struct wb_member *m = &op->m[i];
		for (uint32_t b = 0; b < m->e->nblocks; b++) {
			bool dirty = bit_test(m->bits, b);
			if (dirty && !in_run) {
				in_run = true;
				ri = i;
				rb = b;
			} else if (!dirty && in_run) {
				in_run = false;
				if (submit_run(op, ri, rb, i, b) < 0) {
					op->error = -ENOMEM;
					break;
				}
			}
		}
	}
	if (in_run && !op->error) {
		unsigned last = op->n - 1;
		if (submit_run(op, ri, rb, last, op->m[last].e->nblocks) < 0)
			op->error = -ENOMEM;
	}
	uring_submit(&wb->thread.ring);
	wb_op_put(op); /* the hold: completes now if every write already has */
	return 1;
}

static void background_pass_once(struct writeback *wb);

static void background_pass(struct writeback *wb)
{
	if (wb->in_pass) {
		wb->pass_again = true;
		return;
	}
	wb->in_pass = true;
	unsigned rounds = 0;
	do {
		wb->pass_again = false;
		background_pass_once(wb);
	} while (wb->pass_again && ++rounds < 1024);
	wb->in_pass = false;
}

static void background_pass_once(struct writeback *wb)
{
	struct cache *c = wb->cache;
	uint64_t dirty = atomic_load(&c->counters.dirty_bytes);
	if (dirty > c->dirty_high)
		wb->draining = true;
	if (dirty <= c->dirty_low)
		wb->draining = false;
	uint64_t now = cache_now_ns();
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *ce = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	for (; ce && wb->inflight < WB_MAX_INFLIGHT; ce = ce->next) {
		struct cache_entry *batch[WB_MAX_INFLIGHT];
		size_t n = 0;
		if (atomic_load(&ce->retired))
			continue;
		uint64_t ce_dirty = atomic_load(&ce->counters.dirty_bytes);
		if (ce_dirty > atomic_load(&ce->dirty_high))
			ce->draining = true;
		if (ce_dirty <= atomic_load(&ce->dirty_low))
			ce->draining = false;
		bool drain = wb->draining || ce->draining;
		pthread_mutex_lock(&ce->lock);
		if (!ce->writeback_failing || now >= ce->retry_at) {
			for (struct cache_entry *e = ce->dirty_head;
			     e && n < WB_MAX_INFLIGHT - wb->inflight; e = e->dirty_next) {
				if (!drain && now - e->dirty_since < c->dirty_expire_ns)
					break; /* the list is oldest first */
				if (e->writeback)
					continue;
				cache_entry_pin(e); /* on the dirty list: see cache.h */
				batch[n++] = e;
			}
		}
		pthread_mutex_unlock(&ce->lock);
		for (size_t i = 0; i < n; i++) {
			entry_writeback(wb, batch[i], NULL);
			cache_entry_unpin(batch[i]);
		}
	}
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	background_pass(arg);
}

static void kick_task(struct worker_task *task)
{
	struct writeback *wb = (struct writeback *)((char *)task - offsetof(struct writeback, kick_task));
	atomic_store(&wb->kick_pending, false);
	background_pass(wb);
}

void writeback_kick(struct cache *c)
{
	struct writeback *wb = c->writeback;
	if (!wb->started || atomic_exchange(&wb->kick_pending, true))
		return;
	worker_post(&wb->thread, &wb->kick_task);
}

/* ---- FLUSH ---- */

static void flush_reply_task(struct worker_task *task)
{
	struct flush_job *job = (struct flush_job *)((char *)task - offsetof(struct flush_job, reply));
	struct cache_op *op = job->op;
	int result = job->error;
	free(job);
	if (result < 0) {
		result = -EIO;
	} else if (op->seen_error) {
		uint64_t seq = cache_export_error_seq(op->ce);
		if (*op->seen_error != seq) {
			*op->seen_error = seq;
			result = -EIO;
		}
	}
	if (result < 0 && op->seen_error)
		*op->seen_error = cache_export_error_seq(op->ce);
	op->done(op, result);
}

static void flush_job_end(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	struct flush_job **pp = &wb->jobs;
	while (*pp != job)
		pp = &(*pp)->next;
	*pp = job->next;
	wb->jobs_ended++;
	for (size_t i = 0; i < job->nbusy; i++)
		cache_entry_unpin(job->entries[i]);
	for (size_t i = job->cursor; i < job->n; i++)
		cache_entry_unpin(job->entries[i]);
	free(job->entries);
	job->entries = NULL;
	if (job->op) {
		worker_post(job->op->worker, &job->reply);
		return;
	}
	if (job->error && !wb->shutdown_error)
		wb->shutdown_error = job->error;
	free(job);
	if (--wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

static void flush_backend_done(struct backend_io *io, int result)
{
	struct flush_job *job = (struct flush_job *)((char *)io - offsetof(struct flush_job, flush_io));
	if (result < 0 && !job->error)
		job->error = result;
	if (result >= 0)
		atomic_store(&job->ce->backend_writes_flushed, job->writes_covered);
	job->stage = 2;
	if (!job->advancing)
		flush_job_end(job);
}

static void flush_waiter_task(struct worker_task *task)
{
	struct flush_job *job =
		(struct flush_job *)((char *)task - offsetof(struct flush_job, waiter.task));
	job->waiting = false;
	flush_advance(job);
}

static void flush_advance_once(struct flush_job *job);

/* Re-entrant: a writeback may complete inside entry_writeback (tmpfs). */
static void flush_advance(struct flush_job *job)
{
	if (job->advancing) {
		job->again = true;
		return;
	}
	job->advancing = true;
	do {
		job->again = false;
		flush_advance_once(job);
	} while (job->again && job->stage == 0);
	job->advancing = false;
	if (job->stage == 2)
		flush_job_end(job);
}

/* Write back one entry for the job: false if it has to wait (-EBUSY). */
static bool flush_entry(struct flush_job *job, struct cache_entry *e)
{
	int rc = entry_writeback(job->wb, e, job);
	if (rc == -EBUSY)
		return false;
	if (rc < 0 && !job->error)
		job->error = rc;
	cache_entry_unpin(e);
	return true;
}

/*
 * Visit each entry once, keeping at most WB_FLUSH_WINDOW writebacks in
 * flight, and come back only to those that had to wait: the cost follows
 * the dirty data, whatever the number of completions.
 */
static void flush_advance_once(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	for (;;) {
		if (job->stage != 0)
			return;
		uint64_t seq = cache_waitq_seq(wb->cache);
		size_t keep = 0, i;
		for (i = 0; i < job->nbusy && job->inflight < WB_FLUSH_WINDOW; i++)
			if (!flush_entry(job, job->entries[i]))
				job->entries[keep++] = job->entries[i];
		for (; i < job->nbusy; i++)
			job->entries[keep++] = job->entries[i];
		job->nbusy = keep;
		while (job->cursor < job->n && job->inflight < WB_FLUSH_WINDOW) {
			struct cache_entry *e = job->entries[job->cursor++];
			if (!flush_entry(job, e))
				job->entries[job->nbusy++] = e; /* nbusy < cursor: a free slot */
		}
		if (job->inflight)
			return; /* advanced again when they complete */
		if (job->nbusy == 0 && job->cursor == job->n) {
			job->stage = 1;
			job->writes_covered = atomic_load(&job->ce->backend_writes_done);
			if (!job->op && job->writes_covered ==
					       atomic_load(&job->ce->backend_writes_flushed)) {
				/* Shutdown, nothing written since the last flush:
				 * no need to wait for a backend that may be gone. */
				job->stage = 2;
				return;
			}
			memset(&job->flush_io, 0, sizeof(job->flush_io));
			job->flush_io.cmd = BACKEND_FLUSH;
			job->flush_io.done = flush_backend_done;
			backend_submit(job->ce->backend, &wb->thread, &job->flush_io);
			uring_submit(&wb->thread.ring);
			return;
		}
		if (job->again)
			return; /* flush_advance loops */
		if (cache_waitq_wait(wb->cache, &job->waiter, seq)) {
			job->waiting = true;
			return;
		}
	}
}

static void flush_start_task(struct worker_task *task)
{
	struct flush_job *job = (struct flush_job *)((char *)task - offsetof(struct flush_job, start));
	struct cache_export *ce = job->ce;
	pthread_mutex_lock(&ce->lock);
	size_t n = 0;
	for (struct cache_entry *e = ce->dirty_head; e; e = e->dirty_next)
		n++;
	job->entries = calloc(n ? n : 1, sizeof(*job->entries));
	if (job->entries) {
		for (struct cache_entry *e = ce->dirty_head; e; e = e->dirty_next) {
			cache_entry_pin(e); /* on the dirty list: see cache.h */
			job->entries[job->n++] = e;
		}
	}
	pthread_mutex_unlock(&ce->lock);
	job->next = job->wb->jobs;
	job->wb->jobs = job;
	if (!job->entries) {
		job->error = -ENOMEM;
		job->stage = 2;
		flush_job_end(job);
		return;
	}
	flush_advance(job);
}

static struct flush_job *flush_job_new(struct writeback *wb, struct cache_export *ce,
				       struct cache_op *op)
{
	struct flush_job *job = calloc(1, sizeof(*job));
	if (!job)
		return NULL;
	job->wb = wb;
	job->ce = ce;
	job->op = op;
	job->start.run = flush_start_task;
	job->reply.run = flush_reply_task;
	job->waiter.worker = &wb->thread;
	job->waiter.task.run = flush_waiter_task;
	return job;
}

void writeback_flush(struct cache_op *op)
{
	struct writeback *wb = op->ce->cache->writeback;
	struct flush_job *job = flush_job_new(wb, op->ce, op);
	if (!job) {
		op->done(op, -ENOMEM);
		return;
	}
	worker_post(&wb->thread, &job->start);
}

/* ---- life cycle ---- */

int writeback_create(struct cache *c)
{
	struct writeback *wb = calloc(1, sizeof(*wb));
	if (!wb)
		return -ENOMEM;
	wb->cache = c;
	wb->kick_task.run = kick_task;
	pthread_mutex_init(&wb->lock, NULL);
	pthread_cond_init(&wb->cond, NULL);
	c->writeback = wb;
	return 0;
}

int writeback_start(struct cache *c)
{
	struct writeback *wb = c->writeback;
	int rc = worker_start(&wb->thread, UINT32_MAX, NULL);
	if (rc < 0)
		return rc;
	wb->tick = event_new(wb->thread.base, -1, EV_PERSIST, on_tick, wb);
	if (!wb->tick) {
		worker_request_stop(&wb->thread);
		worker_join(&wb->thread);
		return -ENOMEM;
	}
	struct timeval tv = {0, WB_TICK_MS * 1000};
	event_add(wb->tick, &tv);
	wb->started = true;
	return 0;
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct writeback *wb = arg;
	wb->shutdown_error = 0;
	wb->shutdown_jobs = 1; /* held while the jobs are started */
	for (struct cache_export *ce = wb->cache->exports; ce; ce = ce->next) {
		struct flush_job *job = flush_job_new(wb, ce, NULL);
		if (!job) {
			wb->shutdown_error = -ENOMEM;
			continue;
		}
		wb->shutdown_jobs++;
		flush_start_task(&job->start);
	}
	if (--wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

/* Every shutdown job has ended: done, or say so and try again later. */
static void shutdown_pass(struct writeback *wb)
{
	uint64_t dirty = atomic_load(&wb->cache->counters.dirty_bytes);
	if (dirty == 0) {
		/* Nothing is kept: a backend that cannot flush now is its own
		 * business (its data was acknowledged before). */
		if (wb->shutdown_error)
			log_warn("cache: the backend flush at exit failed: %s",
				 strerror(-wb->shutdown_error));
		log_info("cache: every dirty block is written back");
		event_free(wb->tick);
		wb->tick = NULL;
		if (wb->retry) {
			event_free(wb->retry);
			wb->retry = NULL;
		}
		pthread_mutex_lock(&wb->lock);
		wb->stopped = true;
		pthread_cond_signal(&wb->cond);
		pthread_mutex_unlock(&wb->lock);
		return;
	}
	log_error("cache: %llu dirty bytes cannot be written back (%s); keeping them and "
		  "retrying every %d s; send SIGTERM again to exit without them",
		  (unsigned long long)dirty,
		  wb->shutdown_error ? strerror(-wb->shutdown_error) : "written again meanwhile",
		  WB_SHUTDOWN_RETRY_SECONDS);
	if (!wb->retry)
		wb->retry = evtimer_new(wb->thread.base, on_retry, wb);
	struct timeval tv = {WB_SHUTDOWN_RETRY_SECONDS, 0};
	if (wb->retry)
		evtimer_add(wb->retry, &tv);
}

static void stop_task(struct worker_task *task)
{
	struct writeback *wb = (struct writeback *)((char *)task - offsetof(struct writeback, stop_task));
	if (wb->tick)
		event_del(wb->tick);
	on_retry(-1, 0, wb);
}

void writeback_stop(struct cache *c)
{
	struct writeback *wb = c->writeback;
	if (!wb || !wb->started)
		return;
	uint64_t dirty = atomic_load(&c->counters.dirty_bytes);
	if (dirty)
		log_info("cache: writing back %llu dirty bytes before exit",
			 (unsigned long long)dirty);
	/* A second SIGTERM / SIGINT now ends the process, as promised above. */
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	wb->stop_task.run = stop_task;
	worker_post(&wb->thread, &wb->stop_task);
	pthread_mutex_lock(&wb->lock);
	while (!wb->stopped)
		pthread_cond_wait(&wb->cond, &wb->lock);
	pthread_mutex_unlock(&wb->lock);
	worker_request_stop(&wb->thread);
	worker_join(&wb->thread);
	wb->started = false;
}

void writeback_destroy(struct cache *c)
{
	struct writeback *wb = c->writeback;
	if (!wb)
		return;
	pthread_mutex_destroy(&wb->lock);
	pthread_cond_destroy(&wb->cond);
	free(wb);
	c->writeback = NULL;
}
