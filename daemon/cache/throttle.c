/*
 * daemon/cache/throttle.c: the write throttle (the operations layer, ops.h).
 *
 * A client that writes faster than the backend takes fills the cache with
 * dirty data. Without a throttle the cache fills up to the last frame, and
 * then every write finds no room and goes to the backend directly, one
 * synchronous request at a time beside the writeback thread's: the writer
 * drops to that rate with long pauses, while the cache holds nothing clean.
 * With it, a cached WRITE (writeback mode, no FUA) that arrives while dirty
 * data is above the high watermark, the cache's (--dirty-high) or its
 * export's, waits before it takes any room:
 *
 *   cached_prepare  dirty above high?  no -> on as before (pieces, commit)
 *                                      yes -> stage OP_STAGE_THROTTLED
 *   throttle_step   dirty at or below high again -> admitted: pieces, on
 *                   else wait on the cache's waitq; every writeback that
 *                   completes wakes it (writeback.c), and so does the
 *                   writeback thread's tick while writes wait
 *
 * The writeback thread drains from --dirty-high down to --dirty-low at full
 * speed, so with the throttle dirty data hovers at the high watermark and
 * the writer goes at the backend's pace: each completed writeback group
 * (up to 8 MiB) lets a few waiting writes in. The admission test is the
 * same for all waiters, so after a completion they go in together; dirty
 * data may overshoot the mark by what they carry (bounded by the clients'
 * request budgets), which the room above the mark absorbs.
 *
 * A throttled write must never wait for ever, nor keep writeback or FLUSH
 * from running. It holds no pin and no lock while it waits (writeback and
 * flush rounds run on their own thread and need nothing from it), and it
 * stops waiting and goes on as an unthrottled write would (into the cache
 * while there is room, else to the backend directly, where a failure is its
 * own error) when:
 *   - the writeback thread is not running (start-up, shutdown);
 *   - its export's writeback is failing (backing off after an error): the
 *     dirty data would not go down, and a direct write reports the error;
 *     the dirty data of other exports whose writeback is failing does not
 *     count against the cache's watermark either;
 *   - no writeback of the cache has completed for THROTTLE_PATIENCE_NS:
 *     a backend that stopped answering is not waited for here.
 */
#include "daemon/cache/ops.h"

/* A throttled write waits at most this long without any writeback completing. */
#define THROTTLE_PATIENCE_NS 2000000000ull

/*
 * Is dirty data above the high watermark, of ce or of the cache? In the
 * cache's count, the dirty data of exports whose writeback is failing
 * does not hold the others back: waiting would not bring it down.
 */
bool throttle_over_high(struct cache_export *ce)
{
	struct cache *c = ce->cache;
	if (atomic_load(&ce->counters.dirty_bytes) > atomic_load(&ce->dirty_high))
		return true;
	uint64_t dirty = atomic_load(&c->counters.dirty_bytes), high = atomic_load(&c->dirty_high);
	if (dirty <= high)
		return false;
	/* The list only grows at its head: walked without the lock. */
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *x = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	for (; x && dirty > high; x = x->next) {
		if (x->writeback_failing) { /* a racy peek: a hint */
			uint64_t d = atomic_load(&x->counters.dirty_bytes);
			dirty -= d < dirty ? d : dirty;
		}
	}
	return dirty > high;
}

/* Should op go on without waiting (or without waiting any longer)? */
static bool may_pass(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	struct cache *c = ce->cache;
	if (!throttle_over_high(ce) || !c->kick.worker || ce->writeback_failing) /* racy peeks: hints */
		return true;
	uint64_t done = atomic_load(&c->writebacks_done), now = clock_now_ns();
	if (done != op->throttle_seen) {
		op->throttle_seen = done;
		op->throttle_seen_ns = now;
	}
	return now - op->throttle_seen_ns >= THROTTLE_PATIENCE_NS;
}

bool throttle_write(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	if (!throttle_over_high(ce) || !ce->cache->kick.worker || ce->writeback_failing)
		return false;
	op->throttle_seen = atomic_load(&ce->cache->writebacks_done);
	op->throttle_seen_ns = clock_now_ns();
	op->stage = OP_STAGE_THROTTLED;
	atomic_fetch_add(&ce->cache->throttled, 1);
	atomic_fetch_add(&ce->counters.throttled_writes, 1);
	cache_kick_writeback(ce->cache);
	return true;
}

void throttle_step(struct cache_op *op)
{
	struct cache *c = op->ce->cache;
	uint64_t seq = cache_waitq_seq(c);
	if (!may_pass(op)) {
		op_wait(op, seq);
		return;
	}
	atomic_fetch_sub(&c->throttled, 1);
	op->stage = 0;
	int rc = cached_write_room(op);
	if (rc < 0) {
		pieces_release(op);
		op_finish(op, rc);
		return;
	}
	op->rerun = true; /* op_run steps it again: as a cached or a direct write */
}

void throttle_tick(struct cache *c)
{
	if (atomic_load(&c->throttled))
		cache_waitq_wake(c);
}
