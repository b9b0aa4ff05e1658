/*
 * daemon/cache/writeback.c: dirty data back to the backend, and the
 * backend flushes that make it durable (the durability model: cache.h).
 *
 * One writeback thread, an event loop with its own io_uring (it is a
 * struct worker without connections). It writes back:
 *
 *   - in the background, oldest first: entries dirty for longer than
 *     --dirty-expire, and everything while dirty data is above
 *     --dirty-high, until it is below --dirty-low; and it sends its own
 *     backend flushes so written-back data does not stay unstable long;
 *   - for FLUSH, in rounds: a round writes back every entry on the
 *     export's dirty list when it starts (which holds every block dirtied
 *     by a write completed before it, on any connection), then flushes
 *     the backend. One round runs per export at a time; FLUSHes that
 *     arrive meanwhile wait for the next round and share it (group
 *     commit), so 128 concurrent FLUSHes cost at most two rounds, and a
 *     round costs what is dirty, not the export size;
 *   - at shutdown: everything, retrying while the backend refuses.
 *
 * Writing back an entry: under its shard lock, take the dirty blocks no
 * write is copying into (busy), clear their dirty bits and mark them busy
 * (a write to them waits, so the backend never gets a torn block), set
 * entry->writeback (it stays on the dirty list, pinned); each run of
 * adjacent taken blocks is one backend write straight from the arena.
 * When the writes complete the blocks are unstable (success) or dirty
 * again (failure): nothing is dropped.
 *
 * A backend flush makes clean the unstable entries written before it was
 * sent, unless the backend's loss_seq moved (a connection was lost) or
 * the flush failed: then every unstable entry is dirty again and written
 * again, and a round retries (a few times) or reports EIO.
 */
#include <errno.h>
#include <event2/event.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

#define WB_MAX_INFLIGHT 64
#define WB_TICK_MS 250
#define WB_RETRY_NS 1000000000ull
#define WB_SHUTDOWN_RETRY_SECONDS 5
#define WB_GROUP_MAX 512	     /* entries in one writeback group */
#define WB_GROUP_MAX_BYTES (8u << 20) /* device bytes one group may span */
#define WB_FLUSH_WINDOW 64	      /* writeback groups one round keeps in flight */
#define WB_UNSTABLE_NS 100000000ull   /* background flush once unstable this long */
#define WB_LOSS_RETRIES 3	      /* a round writes again after a loss this often */
#define WB_LOG_INTERVAL_NS 10000000000ull /* writeback failures: one line per 10 s */

/* One entry of a writeback group: the blocks taken when the write began. */
struct wb_member {
	struct cache_entry *e;
	uint8_t *mem; /* stable: the entry is pinned */
	uint64_t *bits;
	uint32_t blocks; /* taken */
	uint64_t bytes;	 /* dirty bytes taken: still counted dirty until written */
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
	uint64_t seq; /* backend_writes_done after the last of its writes */
	unsigned cap;
	struct wb_member *m; /* grown as the group grows: most groups are one entry */
};

struct wb_io {
	struct backend_io io;
	struct wb_op *op;
	uint8_t *bounce; /* a run across entries, gathered; freed when done */
};

/*
 * A flush round of one export: writes back the dirty list as it was when
 * the round started, then flushes the backend, and answers every FLUSH
 * that joined it. A background round (background) only flushes; a
 * shutdown round has no FLUSH to answer.
 */
struct flush_job {
	struct writeback *wb;
	struct cache_export *ce;
	struct cache_op *members; /* FLUSHes answered when it ends (op->flush_next) */
	bool shutdown, background;
	/*
	 * Every entry on the dirty list when the round started, pinned:
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
	unsigned loss_retries;
	uint64_t writes_covered; /* backend_writes_done when the flush was sent */
	uint64_t direct_covered; /* direct_writes_done then */
	uint64_t loss_at_send;	 /* the backend's loss_seq then */
	struct backend_io flush_io;
	struct cache_waiter waiter;
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
	uint64_t shutdown_lost; /* direct writes lost while stopping (no client to tell) */
	bool stopping;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stopped;
};

static void flush_advance(struct flush_job *job);
static void shutdown_pass(struct writeback *wb);
static void round_start(struct writeback *wb, struct cache_export *ce, bool background);

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

/*
 * A writeback or backend flush of ce failed: say so, at most once per
 * WB_LOG_INTERVAL_NS with the count of failures in between, and the end
 * of a failing spell at most as often (a backend that fails every other
 * request must not flood the log). Export lock held.
 */
static void note_failure_locked(struct cache_export *ce, int error, const char *what)
{
	uint64_t now = cache_now_ns();
	ce->writeback_failing = true;
	ce->last_error = error;
	ce->retry_at = now + WB_RETRY_NS;
	if (ce->failure_log_ns && now - ce->failure_log_ns < WB_LOG_INTERVAL_NS) {
		ce->failures_unlogged++;
		return;
	}
	uint64_t more = ce->failures_unlogged;
	ce->failures_unlogged = 0;
	ce->failure_log_ns = now;
	ce->failure_logged = true;
	if (more)
		log_error("cache: %s failed: %s (and %llu more failures in the last %llu s); the "
			  "data stays in the cache, is written again, and FLUSH reports EIO until "
			  "it is durable",
			  what, strerror(-error), (unsigned long long)more,
			  (unsigned long long)(WB_LOG_INTERVAL_NS / 1000000000u));
	else
		log_error("cache: %s failed: %s; the data stays in the cache, is written again, "
			  "and FLUSH reports EIO until it is durable",
			  what, strerror(-error));
}

/* A backend write or flush of ce succeeded: the failing spell is over. */
static void note_success(struct cache_export *ce)
{
	uint64_t now = cache_now_ns();
	pthread_mutex_lock(&ce->lock);
	bool say = ce->writeback_failing && ce->failure_logged &&
		   (!ce->recovery_log_ns || now - ce->recovery_log_ns >= WB_LOG_INTERVAL_NS);
	ce->writeback_failing = false;
	if (say) {
		ce->failure_logged = false;
		ce->recovery_log_ns = now;
	}
	pthread_mutex_unlock(&ce->lock);
	if (say)
		log_info("cache: writing to the backend works again");
}

/* Drop one reference to op; the last one finishes the writeback. */
static void wb_op_put(struct wb_op *op)
{
	if (--op->pending)
		return;
	struct writeback *wb = op->wb;
	struct cache *c = wb->cache;
	struct cache_export *ce = op->m[0].e->ce;
	for (unsigned i = 0; i < op->n; i++) {
		struct wb_member *m = &op->m[i];
		struct cache_entry *e = m->e;
		struct cache_shard *sh =
			cache_shard_for(c, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
		size_t words = (e->nblocks + 63) / 64;
		pthread_mutex_lock(&sh->lock);
		cache_dirty_bytes_sub(ce, m->bytes);
		uint64_t *busy = cache_busy_map(e);
		for (size_t w = 0; w < words; w++)
			busy[w] &= ~m->bits[w];
		if (op->error) {
			for (uint32_t b = 0; b < e->nblocks; b++)
				if (bit_test(m->bits, b))
					cache_mark_dirty(e, b, 1);
		} else {
			cache_mark_unstable(e, m->blocks, op->seq);
		}
		e->writeback = false;
		cache_dirty_list_update(e);
		pthread_mutex_unlock(&sh->lock);
		cache_entry_unpin(e);
		free(m->bits);
	}
	if (op->error) {
		pthread_mutex_lock(&ce->lock);
		note_failure_locked(ce, op->error, "writeback to the backend");
		pthread_mutex_unlock(&ce->lock);
		atomic_fetch_add(&ce->counters.writeback_errors, 1);
	} else if (ce->writeback_failing) { /* a racy peek; note_success locks */
		note_success(ce);
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
		uint64_t seq = atomic_fetch_add(&ce->backend_writes_done, 1) + 1;
		if (seq > op->seq)
			op->seq = seq;
		atomic_fetch_add(&ce->counters.writeback_bytes, length); /* written, not tried */
	}
	wb_op_put(op);
}

/*
 * Take e into the group (shard lock held): its dirty blocks that no write
 * is copying into (busy) are taken, their dirty bits cleared and marked
 * busy; e is marked under writeback and pinned. 1 if taken, 0 if nothing
 * is dirty, -EBUSY if it must wait (a writeback or a direct operation in
 * flight over it, or every dirty block being written into), -ENOMEM.
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
	uint64_t *dirty = cache_dirty_map(e), *busy = cache_busy_map(e);
	uint32_t taken = 0;
	for (size_t w = 0; w < words; w++) {
		bits[w] = dirty[w] & ~busy[w];
		taken += (uint32_t)__builtin_popcountll(bits[w]);
	}
	if (taken == 0) {
		free(bits);
		return -EBUSY;
	}
	for (size_t w = 0; w < words; w++) {
		dirty[w] &= ~bits[w];
		busy[w] |= bits[w];
	}
	/* The data is not on the backend yet: it stays in dirty_bytes (the
	 * watermarks and the stats) until the write completes. */
	e->ndirty -= taken;
	uint64_t bytes = (uint64_t)taken << ce->block_shift;
	e->writeback = true;
	cache_entry_pin(e);
	op->m[op->n++] = (struct wb_member){e, arena_address(&ce->cache->arena, e->frame), bits,
					    taken, bytes};
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
		    bit_test(cache_dirty_map(e), 0) && !bit_test(cache_busy_map(e), 0))
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
		bool flush_due = ce->unstable_head && !ce->round &&
				 (drain || now - ce->unstable_since >= WB_UNSTABLE_NS) &&
				 (!ce->writeback_failing || now >= ce->retry_at);
		pthread_mutex_unlock(&ce->lock);
		for (size_t i = 0; i < n; i++) {
			entry_writeback(wb, batch[i], NULL);
			cache_entry_unpin(batch[i]);
		}
		if (flush_due)
			round_start(wb, ce, true);
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

/* ---- FLUSH rounds ---- */

static void flush_reply_task(struct worker_task *task)
{
	struct cache_op *op = (struct cache_op *)((char *)task - offsetof(struct cache_op, waiter.task));
	int result = op->error < 0 ? -EIO : 0;
	if (op->seen_error) {
		/* Data the cache does not hold was lost since this connection
		 * last heard of it: said once per connection. */
		uint64_t seq = cache_export_error_seq(op->ce);
		if (*op->seen_error != seq) {
			*op->seen_error = seq;
			result = -EIO;
		}
	}
	op->done(op, result);
}

/*
 * Every unstable entry of ce (or those written before the flush that
 * covered seq) becomes clean, or, with redirty, dirty again. Writeback
 * thread; takes shard and export locks.
 */
static void unstable_settle_all(struct cache_export *ce, uint64_t seq, bool redirty)
{
	struct cache_entry **v;
	size_t n;
	if (cache_unstable_collect(ce, seq, &v, &n) < 0) {
		/* Out of memory: one at a time from the head, no allocation. */
		for (unsigned guard = 0; guard < 1u << 30; guard++) {
			pthread_mutex_lock(&ce->lock);
			struct cache_entry *e = ce->unstable_head;
			if (e && e->unstable_seq > seq)
				e = NULL;
			if (e)
				cache_entry_pin(e);
			pthread_mutex_unlock(&ce->lock);
			if (!e)
				return;
			struct cache_shard *sh = cache_shard_for(ce->cache, ce,
								 cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
			pthread_mutex_lock(&sh->lock);
			cache_unstable_settle(e, redirty);
			pthread_mutex_unlock(&sh->lock);
			cache_entry_unpin(e);
		}
		return;
	}
	for (size_t i = 0; i < n; i++) {
		struct cache_entry *e = v[i];
		struct cache_shard *sh =
			cache_shard_for(ce->cache, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
		pthread_mutex_lock(&sh->lock);
		/* Written back again since it was collected: not covered. */
		if (e->on_unstable_list && (redirty || e->unstable_seq <= seq))
			cache_unstable_settle(e, redirty);
		pthread_mutex_unlock(&sh->lock);
		cache_entry_unpin(e);
	}
	free(v);
	if (redirty)
		cache_waitq_wake(ce->cache);
}

/*
 * The backend may have lost writes no successful flush covered (a failed
 * flush, a lost connection): what the cache holds is written again; direct
 * writes it does not hold are lost for good, which every connection's
 * next FLUSH reports (error_seq).
 */
static void lost_unflushed(struct writeback *wb, struct cache_export *ce)
{
	atomic_fetch_add(&ce->counters.losses, 1);
	unstable_settle_all(ce, UINT64_MAX, true);
	uint64_t direct = atomic_load(&ce->direct_writes_done);
	if (direct != atomic_load(&ce->direct_writes_flushed)) {
		atomic_store(&ce->direct_writes_flushed, direct);
		pthread_mutex_lock(&ce->lock);
		ce->error_seq++;
		pthread_mutex_unlock(&ce->lock);
		if (wb->stopping)
			wb->shutdown_lost++;
		log_error("cache: the backend may have lost writes that went to it directly (not "
			  "through the cache) before a flush covered them; every connection's next "
			  "FLUSH reports EIO");
	}
}

/* Take every entry on the dirty list, pinned. */
static int round_snapshot(struct flush_job *job)
{
	struct cache_export *ce = job->ce;
	pthread_mutex_lock(&ce->lock);
	size_t n = 0;
	for (struct cache_entry *e = ce->dirty_head; e; e = e->dirty_next)
		n++;
	struct cache_entry **v = malloc((n ? n : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	size_t i = 0;
	for (struct cache_entry *e = ce->dirty_head; e; e = e->dirty_next) {
		cache_entry_pin(e); /* on the dirty list: see cache.h */
		v[i++] = e;
	}
	pthread_mutex_unlock(&ce->lock);
	free(job->entries);
	job->entries = v;
	job->n = i;
	job->cursor = job->nbusy = 0;
	return 0;
}

static void round_unpin(struct flush_job *job)
{
	for (size_t i = 0; i < job->nbusy; i++)
		cache_entry_unpin(job->entries[i]);
	for (size_t i = job->cursor; i < job->n; i++)
		cache_entry_unpin(job->entries[i]);
	job->n = job->cursor = job->nbusy = 0;
}

static void flush_job_end(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	struct cache_export *ce = job->ce;
	struct flush_job **pp = &wb->jobs;
	while (*pp != job)
		pp = &(*pp)->next;
	*pp = job->next;
	wb->jobs_ended++;
	ce->round = NULL;
	round_unpin(job);
	free(job->entries);
	for (struct cache_op *op = job->members, *next; op; op = next) {
		next = op->flush_next;
		op->error = job->error;
		op->waiter.task.run = flush_reply_task;
		worker_post(op->worker, &op->waiter.task);
	}
	bool shutdown = job->shutdown;
	if (shutdown && job->error && !wb->shutdown_error)
		wb->shutdown_error = job->error;
	free(job);
	/* FLUSHes (or the shutdown) that came meanwhile: the next round. */
	if (ce->flush_waiting_head || ce->shutdown_waiting)
		round_start(wb, ce, false);
	if (shutdown && --wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

/* Go back to writing: a loss turned unstable data dirty again. */
static bool round_retry(struct flush_job *job)
{
	if (job->background || job->loss_retries++ >= WB_LOSS_RETRIES)
		return false;
	round_unpin(job);
	if (round_snapshot(job) < 0)
		return false;
	job->stage = 0;
	job->again = true;
	return true;
}

static void flush_backend_done(struct backend_io *io, int result)
{
	struct flush_job *job = (struct flush_job *)((char *)io - offsetof(struct flush_job, flush_io));
	struct cache_export *ce = job->ce;
	uint64_t loss = atomic_load(&ce->backend->loss_seq);
	job->stage = 2;
	if (result >= 0 && loss == job->loss_at_send) {
		uint64_t flushed = atomic_load(&ce->backend_writes_flushed);
		if (job->writes_covered > flushed)
			atomic_store(&ce->backend_writes_flushed, job->writes_covered);
		if (job->direct_covered > atomic_load(&ce->direct_writes_flushed))
			atomic_store(&ce->direct_writes_flushed, job->direct_covered);
		unstable_settle_all(ce, job->writes_covered, false);
		note_success(ce);
	} else {
		if (result < 0) {
			atomic_fetch_add(&ce->counters.backend_flush_errors, 1);
			pthread_mutex_lock(&ce->lock);
			note_failure_locked(ce, result, "a backend flush");
			pthread_mutex_unlock(&ce->lock);
		}
		ce->loss_seen = loss;
		lost_unflushed(job->wb, ce);
		if (result < 0 || !round_retry(job))
			job->error = result < 0 ? result : -EIO;
	}
	if (!job->advancing) {
		if (job->stage == 2)
			flush_job_end(job);
		else
			flush_advance(job);
	}
}

/* Stage 1: everything is written; flush the backend if anything needs it. */
static void round_flush(struct flush_job *job)
{
	struct cache_export *ce = job->ce;
	uint64_t loss = atomic_load(&ce->backend->loss_seq);
	if (loss != ce->loss_seen) {
		ce->loss_seen = loss;
		lost_unflushed(job->wb, ce);
		if (!round_retry(job)) {
			job->error = job->background ? 0 : -EIO;
			job->stage = 2;
		}
		return;
	}
	job->stage = 1;
	job->writes_covered = atomic_load(&ce->backend_writes_done);
	job->direct_covered = atomic_load(&ce->direct_writes_done);
	job->loss_at_send = loss;
	if (job->writes_covered == atomic_load(&ce->backend_writes_flushed)) {
		/* Everything acknowledged is covered by a flush already. */
		job->stage = 2;
		return;
	}
	atomic_fetch_add(&ce->counters.backend_flushes, 1);
	memset(&job->flush_io, 0, sizeof(job->flush_io));
	job->flush_io.cmd = BACKEND_FLUSH;
	job->flush_io.done = flush_backend_done;
	backend_submit(ce->backend, &job->wb->thread, &job->flush_io);
	uring_submit(&job->wb->thread.ring);
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

/* Write back one entry for the round: false if it has to wait (-EBUSY). */
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
		if (job->error) {
			/* The round fails whatever comes next: its FLUSHes get
			 * EIO as soon as what is in flight is back, not after
			 * every other entry has been tried too (a backend that
			 * times out would make that minutes). */
			round_unpin(job);
			if (job->inflight == 0)
				job->stage = 2;
			return;
		}
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
			round_flush(job);
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

/*
 * Start ce's next round (none may be running): it answers every FLUSH
 * waiting now. A background round only flushes what is unstable.
 */
static void round_start(struct writeback *wb, struct cache_export *ce, bool background)
{
	struct flush_job *job = calloc(1, sizeof(*job));
	struct cache_op *members = ce->flush_waiting_head;
	bool shutdown = ce->shutdown_waiting;
	if (!job) {
		if (!members && !shutdown)
			return; /* a background round: the next pass tries again */
		/* Cannot even track a round: answer EIO (the data stays). */
		ce->flush_waiting_head = ce->flush_waiting_tail = NULL;
		ce->shutdown_waiting = false;
		for (struct cache_op *op = members, *next; op; op = next) {
			next = op->flush_next;
			op->error = -ENOMEM;
			op->waiter.task.run = flush_reply_task;
			worker_post(op->worker, &op->waiter.task);
		}
		if (shutdown) {
			wb->shutdown_error = -ENOMEM;
			if (--wb->shutdown_jobs == 0)
				shutdown_pass(wb);
		}
		return;
	}
	job->wb = wb;
	job->ce = ce;
	job->members = members;
	job->shutdown = shutdown;
	job->background = background && !members && !shutdown;
	ce->flush_waiting_head = ce->flush_waiting_tail = NULL;
	ce->shutdown_waiting = false;
	job->waiter.worker = &wb->thread;
	job->waiter.task.run = flush_waiter_task;
	ce->round = job;
	job->next = wb->jobs;
	wb->jobs = job;
	if (!job->background && round_snapshot(job) < 0) {
		job->error = -ENOMEM;
		job->stage = 2;
		flush_job_end(job);
		return;
	}
	flush_advance(job);
}

/* On the writeback thread: the FLUSH joins the export's next round. */
static void flush_arrive_task(struct worker_task *task)
{
	struct cache_op *op = (struct cache_op *)((char *)task - offsetof(struct cache_op, waiter.task));
	struct cache_export *ce = op->ce;
	op->flush_next = NULL;
	if (ce->flush_waiting_tail)
		ce->flush_waiting_tail->flush_next = op;
	else
		ce->flush_waiting_head = op;
	ce->flush_waiting_tail = op;
	if (!ce->round)
		round_start(ce->cache->writeback, ce, false);
}

void writeback_flush(struct cache_op *op)
{
	struct writeback *wb = op->ce->cache->writeback;
	op->error = 0;
	op->waiter.worker = op->worker;
	op->waiter.task.run = flush_arrive_task;
	worker_post(&wb->thread, &op->waiter.task);
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

/* Bytes not durable yet: dirty, being written, or unstable. */
static struct cache_export *exports_head(struct cache *c)
{
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *ce = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	return ce;
}

static uint64_t not_durable_bytes(struct cache *c)
{
	uint64_t n = atomic_load(&c->counters.dirty_bytes);
	for (struct cache_export *ce = exports_head(c); ce; ce = ce->next)
		if (!atomic_load(&ce->retired))
			n += atomic_load(&ce->counters.unstable_bytes);
	return n;
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct writeback *wb = arg;
	wb->shutdown_error = 0;
	wb->shutdown_jobs = 1; /* held while the rounds are started */
	for (struct cache_export *ce = exports_head(wb->cache); ce; ce = ce->next) {
		/* A retired export's backend is closed: it holds nothing. */
		if (atomic_load(&ce->retired))
			continue;
		wb->shutdown_jobs++;
		ce->shutdown_waiting = true;
		if (!ce->round)
			round_start(wb, ce, false);
	}
	if (--wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

static bool anything_unflushed(struct cache *c)
{
	for (struct cache_export *ce = exports_head(c); ce; ce = ce->next)
		if (!atomic_load(&ce->retired) && cache_export_unflushed(ce))
			return true;
	return false;
}

/* Every shutdown round has ended: done, or say so and try again later. */
static void shutdown_pass(struct writeback *wb)
{
	struct cache *c = wb->cache;
	if (!anything_unflushed(c)) {
		log_info("cache: every dirty block is written back and flushed");
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
	log_error("cache: %llu bytes are not durable yet (%s); keeping them and retrying every "
		  "%d s; send SIGTERM again to exit without them",
		  (unsigned long long)not_durable_bytes(c),
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
	wb->stopping = true;
	on_retry(-1, 0, wb);
}

static volatile sig_atomic_t stop_abandoned;

static void on_second_signal(int sig)
{
	(void)sig;
	stop_abandoned = 1;
}

int writeback_stop(struct cache *c, void (*progress)(uint64_t remaining, void *arg), void *arg)
{
	struct writeback *wb = c->writeback;
	if (!wb || !wb->started)
		return 0;
	uint64_t left = not_durable_bytes(c);
	if (left)
		log_info("cache: writing back %llu bytes before exit", (unsigned long long)left);
	/* A second SIGTERM / SIGINT now gives up, as promised above. */
	stop_abandoned = 0;
	signal(SIGTERM, on_second_signal);
	signal(SIGINT, on_second_signal);
	wb->stop_task.run = stop_task;
	worker_post(&wb->thread, &wb->stop_task);
	pthread_mutex_lock(&wb->lock);
	while (!wb->stopped) {
		struct timespec until;
		clock_gettime(CLOCK_REALTIME, &until);
		until.tv_sec += 1;
		pthread_cond_timedwait(&wb->cond, &wb->lock, &until);
		if (wb->stopped)
			break;
		if (stop_abandoned) {
			pthread_mutex_unlock(&wb->lock);
			log_error("cache: exiting on a second signal with %llu bytes not durable: "
				  "they are lost",
				  (unsigned long long)not_durable_bytes(c));
			_exit(1);
		}
		if (progress)
			progress(not_durable_bytes(c), arg);
	}
	pthread_mutex_unlock(&wb->lock);
	worker_request_stop(&wb->thread);
	worker_join(&wb->thread);
	wb->started = false;
	if (wb->shutdown_lost) {
		log_error("cache: writes that went to a backend directly were lost at exit");
		return -EIO;
	}
	return 0;
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
