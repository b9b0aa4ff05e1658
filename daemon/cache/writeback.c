/*
 * daemon/cache/writeback.c: dirty data back to the backend (the
 * durability model: cache.h; FLUSH rounds and shutdown: flush.c).
 *
 * One writeback thread, an event loop with its own io_uring (it is a
 * struct worker without connections). It writes back in the background,
 * oldest first: entries dirty for longer than --dirty-expire, and
 * everything while dirty data is above --dirty-high, until it is below
 * --dirty-low; and it starts background flush rounds so written-back
 * data does not stay unstable long. FLUSH rounds (flush.c) write their
 * entries through writeback_entry() too.
 *
 * Writing back an entry: under its shard lock, take the dirty blocks no
 * write is copying into (busy), clear their dirty bits and mark them busy
 * (a write to them waits, so the backend never gets a torn block), set
 * entry->writeback (it stays on the dirty list, pinned); each run of
 * adjacent taken blocks is one backend write straight from the arena, and
 * adjacent entries whose dirty runs meet are written together: a run
 * across entries is one vectored write whose pieces point into the arena
 * (entries are pinned while it is in flight; pieces that happen to be
 * adjacent in the arena are merged), so a group of up to WB_GROUP_MAX_BYTES
 * reaches the backend as one large write without a copy. A backend that
 * takes no iovec (NBD) gets the run gathered into one buffer, as libnbd
 * wants one. The file backend sends these writes O_DIRECT when aligned
 * (daemon/backend/file.c), so the data is copied neither here nor into
 * the page cache. When the writes complete
 * the blocks are unstable (success) or dirty again (failure): nothing is
 * dropped. Failures are logged at most once per 10 s.
 */
#include <errno.h>
#include <event2/event.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cache/ops.h"
#include "daemon/cache/writeback.h"
#include "daemon/log.h"

#define WB_MAX_INFLIGHT 64
/*
 * Background writeback keeps at most this many bytes in flight (FLUSH
 * rounds have their own window, flush.c). Enough to keep a disk busy (a
 * few large writes), few enough that groups complete one after another:
 * a write throttled at the high watermark waits for one group, not for
 * hundreds of megabytes submitted together that the disk finishes at
 * about the same time.
 */
#define WB_MAX_INFLIGHT_BYTES (64u << 20)
#define WB_TICK_MS 250
#define WB_GROUP_MAX 512	     /* entries in one writeback group */
#define WB_GROUP_MAX_BYTES (8u << 20) /* device bytes one group may span */
_Static_assert(WB_GROUP_MAX <= IOV_MAX, "a run across a whole group is one vectored write");
#define WB_UNSTABLE_NS 100000000ull   /* background flush once unstable this long */
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
	uint64_t loss_at_submit; /* the backend's loss_seq before the writes went */
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
	uint8_t *bounce;   /* a run across entries, gathered (no iovec backend) */
	struct iovec *iov; /* a run across entries, in place; the backend may
			      advance io.iov, this is what to free */
};

static void background_pass(struct writeback *wb);

/*
 * A writeback or backend flush of ce failed: say so, at most once per
 * WB_LOG_INTERVAL_NS with the count of failures in between, and the end
 * of a failing spell at most as often (a backend that fails every other
 * request must not flood the log). Export lock held.
 */
void writeback_note_failure_locked(struct cache_export *ce, int error, const char *what)
{
	uint64_t now = clock_now_ns();
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
void writeback_note_success(struct cache_export *ce)
{
	uint64_t now = clock_now_ns();
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
	if (NEVER(op->pending == 0))
		return; /* put once too often: it is freed, or its last put is to come */
	if (--op->pending)
		return;
	struct writeback *wb = op->wb;
	struct cache *c = wb->cache;
	struct cache_export *ce = cache_entry_export(op->m[0].e);
	/* A connection was lost since the writes went: the server may have
	 * acknowledged them and lost them, and a loss the flush rounds acted
	 * on already may not have seen these blocks yet. Written again. */
	bool maybe_lost = atomic_load(&ce->backend->loss_seq) != op->loss_at_submit;
	for (unsigned i = 0; i < op->n; i++) {
		struct wb_member *m = &op->m[i];
		struct cache_entry *e = m->e;
		struct cache_shard *sh =
			cache_shard_for(c, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
		pthread_mutex_lock(&sh->lock);
		uint32_t nblocks = cache_entry_nblocks(e);
		cache_dirty_bytes_sub(ce, m->bytes);
		struct cache_map busy = cache_busy_map(e);
		for (uint32_t b = 0; b < nblocks; b++)
			if (bit_test(m->bits, b))
				map_clear(busy, b);
		if (op->error || maybe_lost) {
			for (uint32_t b = 0; b < nblocks; b++)
				if (bit_test(m->bits, b))
					cache_mark_dirty(e, b, 1);
		} else {
			cache_mark_unstable(e, m->blocks, op->seq);
		}
		cache_entry_ext(e)->writeback = false;
		cache_dirty_list_update(e);
		pthread_mutex_unlock(&sh->lock);
		cache_entry_unpin(e);
		free(m->bits);
	}
	if (op->error) {
		pthread_mutex_lock(&ce->lock);
		writeback_note_failure_locked(ce, op->error, "writeback to the backend");
		pthread_mutex_unlock(&ce->lock);
		atomic_fetch_add(&ce->counters.writeback_errors, 1);
	} else {
		atomic_fetch_add(&c->writebacks_done, 1); /* progress, for the throttle */
		if (ce->writeback_failing) /* a racy peek; note_success locks */
			writeback_note_success(ce);
	}
	cache_waitq_wake(c);
	struct flush_job *job = op->job;
	int error = op->error;
	wb->inflight--;
	wb->inflight_bytes -= op->bytes;
	free(op->m);
	free(op);
	if (job)
		flush_write_done(job, error);
	flush_advance_all(wb);
	if (wb->draining)
		background_pass(wb);
}

static void wb_io_done(struct backend_io *io, int result)
{
	struct wb_io *w = (struct wb_io *)io;
	struct wb_op *op = w->op;
	uint64_t length = io->length;
	cache_backend_timed(cache_entry_export(op->m[0].e), io);
	free(w->bounce);
	free(w->iov);
	free(w);
	if (result < 0 && !op->error)
		op->error = result;
	if (result >= 0) {
		struct cache_export *ce = cache_entry_export(op->m[0].e);
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
	struct cache_export *ce = cache_entry_export(e);
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (x && x->writeback)
		return -EBUSY;
	if (!x || x->ndirty == 0)
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
	uint32_t nblocks = cache_entry_nblocks(e);
	uint64_t *bits = calloc((nblocks + 63) / 64, sizeof(uint64_t));
	if (!bits)
		return -ENOMEM;
	struct cache_map dirty = cache_dirty_map(e), busy = cache_busy_map(e);
	uint32_t taken = 0;
	for (uint32_t b = 0; b < nblocks; b++) {
		if (map_test(dirty, b) && !map_test(busy, b)) {
			bit_set(bits, b);
			map_clear(dirty, b);
			map_set(busy, b);
			taken++;
		}
	}
	if (taken == 0) {
		free(bits);
		return -EBUSY;
	}
	/* The data is not on the backend yet: it stays in dirty_bytes (the
	 * watermarks and the stats) until the write completes. */
	x->ndirty -= taken;
	uint64_t bytes = (uint64_t)taken << ce->block_shift;
	x->writeback = true;
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
		struct cache_export *ce = cache_entry_export(last->e);
		if (!bit_test(last->bits, cache_entry_nblocks(last->e) - 1))
			return;
		uint64_t next = cache_entry_first_frame(last->e) + (1ull << cache_entry_order(last->e));
		if (next << ARENA_FRAME_SHIFT >= ce->size)
			return;
		struct cache_shard *sh =
			cache_shard_for(c, ce, next >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
		pthread_mutex_lock(&sh->lock);
		struct cache_entry *e = cache_lookup(ce, sh, next);
		int rc = 0;
		if (e && cache_entry_first_frame(e) == next && !cache_entry_writeback(e) &&
		    cache_entry_ndirty(e) && map_test(cache_dirty_map(e), 0) &&
		    !map_test(cache_busy_map(e), 0))
			rc = claim_locked(op, e);
		pthread_mutex_unlock(&sh->lock);
		if (rc <= 0)
			return;
	}
}
/* Write the run from (i0, b0) up to (i1, b1) exclusive: one backend write. */
static int submit_run(struct wb_op *op, unsigned i0, uint32_t b0, unsigned i1, uint32_t b1)
{
	struct cache_export *ce = cache_entry_export(op->m[0].e);
	unsigned shift = ce->block_shift;
	if (b1 == 0 && i1 > i0) { /* ends at an entry boundary */
		i1--;
		b1 = cache_entry_nblocks(op->m[i1].e);
	}
	uint64_t off = cache_entry_offset(op->m[i0].e) + ((uint64_t)b0 << shift);
	uint64_t end = cache_entry_offset(op->m[i1].e) + ((uint64_t)b1 << shift);
	uint64_t size = ce->size; /* once: a resize may move it */
	if (end > size)
		end = size > off ? size : off; /* past a new end: nothing to write */
	struct wb_io *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	if (i0 == i1) {
		w->io.buf = op->m[i0].mem + ((size_t)b0 << shift);
	} else {
		/* One piece per entry (at most WB_GROUP_MAX <= IOV_MAX), fewer
		 * where neighbours are neighbours in the arena too. */
		struct iovec *iov = malloc((i1 - i0 + 1) * sizeof(*iov));
		if (!iov) {
			free(w);
			return -ENOMEM;
		}
		size_t at = 0;
		unsigned k = 0;
		for (unsigned i = i0; i <= i1; i++) {
			struct wb_member *m = &op->m[i];
			uint32_t from = i == i0 ? b0 : 0,
				 to = i == i1 ? b1 : cache_entry_nblocks(m->e);
			size_t n = (size_t)(to - from) << shift;
			if (at + n > end - off)
				n = (size_t)(end - off) - at;
			uint8_t *p = m->mem + ((size_t)from << shift);
			if (k && (uint8_t *)iov[k - 1].iov_base + iov[k - 1].iov_len == p)
				iov[k - 1].iov_len += n;
			else
				iov[k++] = (struct iovec){p, n};
			at += n;
		}
		if (ce->backend->takes_iovec) {
			w->iov = w->io.iov = iov;
			w->io.iovcnt = k;
		} else {
			/* Gathered for a backend that wants one buffer. */
			w->bounce = malloc(at);
			if (!w->bounce) {
				free(iov);
				free(w);
				return -ENOMEM;
			}
			size_t pos = 0;
			for (unsigned j = 0; j < k; j++) {
				memcpy(w->bounce + pos, iov[j].iov_base, iov[j].iov_len);
				pos += iov[j].iov_len;
			}
			free(iov);
			w->io.buf = w->bounce;
		}
	}
	w->op = op;
	w->io.cmd = BACKEND_WRITE;
	w->io.offset = off;
	w->io.length = end - off;
	w->io.done = wb_io_done;
	op->pending++;
	if (end == off) {
		/* Wholly past an end a resize moved meanwhile (a write admitted
		 * just before): nothing is left to write, nothing timed. */
		w->io.worker = NULL;
		wb_io_done(&w->io, 0);
		return 0;
	}
	atomic_fetch_add(&ce->counters.backend_writes, 1);
	atomic_fetch_add(&ce->counters.backend_write_bytes, end - off);
	cache_backend_submit(ce, &op->wb->thread, &w->io);
	return 0;
}

/*
 * Start writing e back, with the dirty entries right after it. Returns 1
 * if started, 0 if there is nothing to write (and nothing in flight),
 * -EBUSY if it must wait, or -ENOMEM.
 */
int writeback_entry(struct writeback *wb, struct cache_entry *e, struct flush_job *job)
{
	struct cache *c = wb->cache;
	struct cache_export *ce = cache_entry_export(e);
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
	op->loss_at_submit = atomic_load(&ce->backend->loss_seq);
	op->pending = 1; /* held until every run is submitted */
	wb->inflight++;
	wb->inflight_bytes += op->bytes;
	if (job)
		flush_write_started(job);
	/* The level-2 map no longer claims pages these bytes replace (once
	 * for the group, before any of its writes). */
	if (wb->cache->device)
		cache_device_l2_before_write(wb->cache->device);
	/* Runs of dirty blocks over the group, as one block sequence. */
	bool in_run = false;
	unsigned ri = 0;
	uint32_t rb = 0;
	for (unsigned i = 0; i < op->n && !op->error; i++) {
		struct wb_member *m = &op->m[i];
		for (uint32_t b = 0, nb = cache_entry_nblocks(m->e); b < nb; b++) {
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
		if (submit_run(op, ri, rb, last, cache_entry_nblocks(op->m[last].e)) < 0)
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
	uint64_t now = clock_now_ns();
	/* The cache device's log is short of room: full rounds (no FLUSH to
	 * answer) let a checkpoint free it (device.h). */
	bool checkpoint = c->device && cache_device_wants_checkpoint(c->device);
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *ce = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	for (; ce && wb->inflight < WB_MAX_INFLIGHT && wb->inflight_bytes < WB_MAX_INFLIGHT_BYTES;
	     ce = ce->next) {
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
			     e && n < WB_MAX_INFLIGHT - wb->inflight; e = cache_dirty_next(e)) {
				if (!drain && now - cache_entry_dirty_since(e) < c->dirty_expire_ns)
					break; /* the list is oldest first */
				if (cache_entry_writeback(e))
					continue;
				cache_entry_pin(e); /* on the dirty list: see cache.h */
				batch[n++] = e;
			}
		}
		/* With a cache device, direct writes not flushed yet keep what a
		 * fill reads out of the level-2 cache (cache_fill_unproven): a
		 * background flush covers them soon, as unstable data. */
		bool direct_due = c->device && ce->device_slot >= 0 && cache_fill_unproven(ce);
		bool flush_due = (ce->unstable_head || direct_due) && !flush_round_running(ce) &&
				 (drain || direct_due || now - ce->unstable_since >= WB_UNSTABLE_NS) &&
				 (!ce->writeback_failing || now >= ce->retry_at);
		pthread_mutex_unlock(&ce->lock);
		for (size_t i = 0; i < n; i++) {
			if (wb->inflight_bytes < WB_MAX_INFLIGHT_BYTES)
				writeback_entry(wb, batch[i], NULL);
			cache_entry_unpin(batch[i]);
		}
		if (checkpoint && ce->device_slot >= 0 && !flush_round_running(ce) &&
		    (!ce->writeback_failing || now >= ce->retry_at))
			flush_round_start(wb, ce, false);
		else if (flush_due)
			flush_round_start(wb, ce, true);
	}
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct writeback *wb = arg;
	background_pass(wb);
	throttle_tick(wb->cache);
}

/* cache_kick_writeback() (internal.h) posted this to the thread. */
static void kick_task(struct worker_task *task)
{
	struct cache *c = (struct cache *)((char *)task - offsetof(struct cache, kick.task));
	atomic_store(&c->kick.pending, false);
	background_pass(c->writeback);
}

/* ---- life cycle ---- */

int writeback_create(struct cache *c)
{
	struct writeback *wb = calloc(1, sizeof(*wb));
	if (!wb)
		return -ENOMEM;
	wb->cache = c;
	c->kick.task.run = kick_task;
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
	c->kick.worker = &wb->thread;
	return 0;
}

/* Bytes not durable yet: dirty, being written, or unstable. */
struct cache_export *writeback_exports(struct cache *c)
{
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *ce = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	return ce;
}

uint64_t writeback_not_durable_bytes(struct cache *c)
{
	uint64_t n = atomic_load(&c->counters.dirty_bytes);
	for (struct cache_export *ce = writeback_exports(c); ce; ce = ce->next)
		if (!atomic_load(&ce->retired))
			n += atomic_load(&ce->counters.unstable_bytes);
	return n;
}

static void stop_task(struct worker_task *task)
{
	struct writeback *wb = (struct writeback *)((char *)task - offsetof(struct writeback, stop_task));
	if (wb->tick)
		event_del(wb->tick);
	wb->stopping = true;
	flush_shutdown_start(wb);
}

static volatile sig_atomic_t stop_abandoned;

static void on_second_signal(int sig)
{
	(void)sig;
	stop_abandoned = 1;
}

void writeback_catch_second_signal(void)
{
	stop_abandoned = 0;
	signal(SIGTERM, on_second_signal);
	signal(SIGINT, on_second_signal);
}

int writeback_stop(struct cache *c, void (*progress)(uint64_t remaining, void *arg), void *arg)
{
	struct writeback *wb = c->writeback;
	if (!wb || !wb->started)
		return 0;
	uint64_t left = writeback_not_durable_bytes(c);
	if (left)
		log_info("cache: writing back %llu bytes before exit", (unsigned long long)left);
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
			uint64_t lost = writeback_not_durable_bytes(c);
			if (lost)
				log_error("cache: exiting on a second signal with %llu bytes not "
					  "durable: they are lost",
					  (unsigned long long)lost);
			else
				log_error("cache: exiting on a second signal; what the cache "
					  "device's log still holds stays there, and the next start "
					  "writes it back");
			_exit(1);
		}
		if (progress)
			progress(writeback_not_durable_bytes(c), arg);
	}
	pthread_mutex_unlock(&wb->lock);
	worker_request_stop(&wb->thread);
	worker_join(&wb->thread);
	wb->started = false;
	c->kick.worker = NULL;
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
