/*
 * daemon/cache/flush_log.c: FLUSH rounds with a cache device (device.h):
 * log rounds, which copy what is not durable on the backend into the
 * intent log instead of writing it back, and the CLEAN records of what a
 * backend flush made durable (flush_internal.h has the round; flush.c
 * runs it).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/flush_internal.h"
#include "daemon/cache/ops.h"
#include "daemon/log.h"

/*
 * Append a record of [offset, +length) (data: the cache's bytes there, or
 * NULL for CLEAN) but for the bytes under a direct step whose record is
 * in the log already (cache_direct_logged_first): until the step is
 * applied, the cache holds the bytes from before it there, and a record
 * of them appended after the step's would put them back over what the
 * step wrote at a replay (a FUA write's, acknowledged). The step's record
 * covers those bytes. Export lock held, across the appends: a step not
 * logged yet when they are checked logs after them.
 */
static void append_outside_steps(struct cache_device *dev, struct cache_export *ce, uint64_t offset,
				 uint64_t length, const uint8_t *data)
{
	uint64_t end = offset + length;
	while (offset < end) {
		const struct cache_op *s = cache_direct_logged_first(ce, offset, end - offset);
		uint64_t stop = s && s->step_offset > offset ? s->step_offset : s ? offset : end;
		if (stop > offset)
			cache_device_append(dev, ce->device_slot,
					    data ? DEVFMT_EXTENT_DATA : DEVFMT_EXTENT_CLEAN, offset,
					    stop - offset, data);
		if (data)
			data += (s ? s->step_offset + s->step_length : end) - offset;
		offset = s ? s->step_offset + s->step_length : end;
	}
}

/*
 * With a cache device: e's blocks that a backend flush just made durable
 * (up to date, neither dirty nor being written) are on the backend as the
 * cache holds them, and a record of them in the log, older than this, must
 * not be replayed over them: a CLEAN record says so (device.h). Shard
 * lock held, so that a later write of them is logged after it; the
 * export lock taken for the appends (append_outside_steps).
 */
void flush_log_clean(struct cache_export *ce, struct cache_entry *e)
{
	struct cache_device *dev = ce->cache->device;
	if (!dev || ce->device_slot < 0)
		return;
	struct cache_map uptodate = cache_uptodate_map(e), dirty = cache_dirty_map(e),
			 busy = cache_busy_map(e);
	uint64_t base = cache_entry_offset(e);
	uint32_t nblocks = cache_entry_nblocks(e), run = UINT32_MAX;
	/* A fill put bytes in it that a direct write had put on the backend
	 * after this flush was sent, maybe (struct cache_entry: unproven):
	 * the flush does not cover them, so a CLEAN could let the backend's
	 * loss of them stand over the log's record of that write. Their
	 * bytes as the cache holds them go into the log instead. */
	bool data = e->unproven;
	const uint8_t *mem = data ? arena_address(&ce->cache->arena, e->frame) : NULL;
	pthread_mutex_lock(&ce->lock);
	for (uint32_t b = 0; b <= nblocks; b++) {
		bool take = b < nblocks && map_test(uptodate, b) && !map_test(dirty, b) &&
			    !map_test(busy, b);
		if (take && run == UINT32_MAX)
			run = b;
		if (!take && run != UINT32_MAX) {
			uint64_t off = (uint64_t)run << ce->block_shift;
			append_outside_steps(dev, ce, base + off, (uint64_t)(b - run) << ce->block_shift,
					     data ? mem + off : NULL);
			run = UINT32_MAX;
		}
	}
	pthread_mutex_unlock(&ce->lock);
}

/* The most a log round copies: more goes to the backend as before. */
#define WB_LOG_ROUND_MAX (64ull << 20)

/*
 * Copy e's blocks that are not durable on the backend (dirty, being
 * written back, or of an unstable entry) into the log: 1, or 0 when a
 * direct operation's step is registered over it (it must be applied
 * first, see direct.c: step_log).
 */
static int log_entry(struct flush_job *job, struct cache_entry *e)
{
	struct cache_export *ce = job->ce;
	struct cache_device *dev = ce->cache->device;
	struct cache_shard *sh =
	    cache_shard_for(ce->cache, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
	pthread_mutex_lock(&sh->lock);
	uint64_t base = cache_entry_offset(e);
	pthread_mutex_lock(&ce->lock);
	bool registered = cache_direct_overlaps(ce, base, cache_entry_bytes(e));
	/* Copied now, with every write before this: a later one puts it
	 * back on the list (cache_mark_dirty). */
	if (!registered)
		cache_unlogged_remove(ce, e);
	pthread_mutex_unlock(&ce->lock);
	if (registered) {
		pthread_mutex_unlock(&sh->lock);
		return 0;
	}
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (x && x->logged) {
		pthread_mutex_unlock(&sh->lock);
		return 1; /* copied by an earlier round, not written since */
	}
	struct cache_map uptodate = cache_uptodate_map(e), dirty = cache_dirty_map(e),
			 busy = cache_busy_map(e);
	bool unstable = cache_entry_on_unstable_list(e);
	const uint8_t *mem = arena_address(&ce->cache->arena, e->frame);
	uint32_t nblocks = cache_entry_nblocks(e), run = UINT32_MAX;
	for (uint32_t b = 0; b <= nblocks; b++) {
		bool take =
		    b < nblocks && (map_test(dirty, b) ||
				    (map_test(uptodate, b) && (map_test(busy, b) || unstable)));
		if (take && run == UINT32_MAX)
			run = b;
		if (!take && run != UINT32_MAX) {
			uint64_t off = (uint64_t)run << ce->block_shift;
			uint64_t len = (uint64_t)(b - run) << ce->block_shift;
			cache_device_append(dev, ce->device_slot, DEVFMT_EXTENT_DATA, base + off,
					    len, mem + off);
			run = UINT32_MAX;
		}
	}
	if (x)
		x->logged = true;
	pthread_mutex_unlock(&sh->lock);
	return 1;
}

static void log_commit_done(struct worker_task *task);

/* Stage 0 of a log round: copy every entry, coming back to those under a
 * direct step when the cache changes; then wait for the commit. */
void flush_log_advance(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	for (;;) {
		uint64_t seq = cache_waitq_seq(wb->cache);
		size_t keep = 0;
		for (size_t i = 0; i < job->nbusy; i++) {
			if (log_entry(job, job->entries[i]))
				cache_entry_unpin(job->entries[i]);
			else
				job->entries[keep++] = job->entries[i];
		}
		job->nbusy = keep;
		while (job->cursor < job->n) {
			struct cache_entry *e = job->entries[job->cursor++];
			if (log_entry(job, e))
				cache_entry_unpin(e);
			else
				job->entries[job->nbusy++] = e;
		}
		if (job->nbusy == 0)
			break;
		if (cache_waitq_wait(wb->cache, &job->waiter, seq)) {
			job->waiting = true;
			return;
		}
	}
	job->stage = 1;
	struct cache_device *dev = wb->cache->device;
	job->dwait.rec = cache_device_last(dev);
	job->dwait.fallback = true;
	job->dwait.checkpoint = false;
	job->dwait.worker = &wb->thread;
	job->dwait.task.run = log_commit_done;
	job->waiting = true; /* see flush_job_end */
	cache_device_wait(dev, &job->dwait);
}

/*
 * Every entry on the unlogged list, pinned: those written since a round
 * last copied them (cache_mark_dirty puts them there, log_entry takes
 * them off). An entry a round copied and no one wrote since is durable
 * in the log already, however long it stays dirty or unstable: a round
 * costs what was written since the last one, not everything the backend
 * has yet to flush.
 */
int flush_log_snapshot(struct flush_job *job)
{
	struct cache_entry **v;
	size_t n;
	if (cache_list_pin(job->ce, CACHE_LIST_UNLOGGED, 0, &v, &n) < 0)
		return -ENOMEM;
	free(job->entries);
	job->entries = v;
	job->n = n;
	job->cursor = job->nbusy = 0;
	cache_device_count_round(job->ce->cache->device, n);
	return 0;
}

/* Can this FLUSH round go to the log? */
bool flush_log_possible(struct flush_job *job)
{
	struct cache_export *ce = job->ce;
	struct cache_device *dev = ce->cache->device;
	/* (a backend another node may take over: its FLUSHes go to it, where
	 * that node finds what they acknowledge; backend.h, shared) */
	if (!dev || ce->device_slot < 0 || !job->members || job->shutdown ||
	    ce->backend->shared || !cache_device_usable(dev))
		return false;
	/* A loss is acted on by a round that writes back (round_flush), and
	 * so are direct steps to write again (direct_shadow.c). */
	if (atomic_load(&ce->backend->loss_seq) != ce->loss_seen || cache_shadow_pending(ce))
		return false;
	/* Entries copied by an earlier round and not written since are not
	 * copied again: what was written since is what it copies. */
	uint64_t copy = atomic_load(&ce->log_unlogged_bytes) + cache_device_pending(dev);
	uint64_t room = cache_device_room(dev);
	return copy <= WB_LOG_ROUND_MAX && copy <= room / 2;
}

/* The log round's records are durable, or cannot be. */
static void log_commit_done(struct worker_task *task)
{
	struct flush_job *job =
	    (struct flush_job *)((char *)task - offsetof(struct flush_job, dwait.task));
	struct writeback *wb = job->wb;
	job->waiting = false;
	switch (job->dwait.result) {
	case 0:
		job->stage = 2;
		flush_job_end(job);
		return;
	case -ENOSPC:
		/* The log is full: this round writes back instead. */
		job->logged = false;
		job->device_rec = cache_device_last(wb->cache->device);
		if (round_snapshot(job) < 0) {
			job->error = -ENOMEM;
			job->stage = 2;
			flush_job_end(job);
			return;
		}
		job->stage = 0;
		flush_advance(job);
		return;
	default: {
		/* The device failed: what this round covers is durable nowhere
		 * it can promise. Its FLUSHes get EIO; the exports go
		 * writethrough, and FLUSH to the backend from now on. */
		job->error = -EIO;
		job->stage = 2;
		for (struct cache_export *ce = writeback_exports(wb->cache); ce; ce = ce->next)
			if (ce->device_slot >= 0 && !atomic_load(&ce->retired) &&
			    cache_export_mode(ce) == CACHE_MODE_WRITEBACK) {
				log_error("cache: export %u: writethrough from now on: its cache "
					  "device failed",
					  ce->id);
				cache_export_set_mode(ce, CACHE_MODE_WRITETHROUGH);
			}
		flush_job_end(job);
		return;
	}
	}
}
