/*
 * daemon/cache/internal.h: the index layer of the cache, what every module
 * of daemon/cache/ above the arena builds on: the structs (cache, export,
 * range, entry), the index, per-block state, eviction, the waitq and the
 * background threads' wake-ups. Nothing outside daemon/cache/ includes
 * this.
 *
 * Layers, low to high; arrows run one way: a file calls into its own
 * layer and the ones below, never up, and includes only the headers
 * listed for it (cache.h, the public interface, is open to every file):
 *
 *   layer       files                        may include
 *   lifecycle   lifecycle.c                  every header below
 *   threads     writeback.c flush.c          writeback.h, ops.h,
 *                                            internal.h, arena.h
 *               compact.c                    compact.h, ops.h,
 *                                            internal.h, arena.h
 *   operations  op.c cached.c direct.c       ops.h, internal.h, arena.h
 *               block_status.c throttle.c
 *   index       cache.c dirty.c exports.c    internal.h, arena.h
 *               stats.c wake.c
 *   arena       arena.c                      arena.h
 *
 * Headers follow the same order: ops.h includes internal.h, which
 * includes arena.h; writeback.h includes internal.h; compact.h nothing of
 * the cache's. The two threads do not know each other.
 *
 * The threads wait for the index without the index knowing them: it rings
 * struct cache_kick (writeback) and struct cache_nudge (compactor), which
 * the threads set up. Only lifecycle.c starts and stops threads, and
 * cache_submit, there, hands a FLUSH to the writeback thread.
 *
 * The index: a hash of (export, 2 MiB device range) to a range node, which
 * lists the entries inside that range sorted by device frame. Memory follows
 * what is cached, never the device size.
 *
 *   shard[hash % CACHE_SHARDS]
 *     bucket -> range(export 1, index 7) -> range(...) -> NULL
 *                 entries: [e@frame 3584 order 0][e@3600 order 4] ...
 *
 *   entry (the handle)
 *     frame, order, pins  -> arena_address(frame)
 *     bits: uptodate[words] dirty[words] busy[words], one bit per block
 */
#ifndef NBDCACHED_DAEMON_CACHE_INTERNAL_H
#define NBDCACHED_DAEMON_CACHE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "daemon/cache/arena.h"
#include "daemon/cache/cache.h"

struct flush_job;

#define CACHE_SHARDS 64
#define CACHE_RANGE_SHIFT 21 /* 2 MiB device ranges */
#define CACHE_NOT_QUEUED 0
#define CACHE_SMALL 1
#define CACHE_MAIN 2

struct cache_entry {
	uint64_t first_frame; /* device offset >> 12 of the first byte cached */
	struct cache_export *ce;
	struct cache_range *range;
	uint32_t frame;	     /* arena location */
	uint32_t invalidations; /* bumped to discard fills in flight */
	uint32_t nblocks, ndirty;
	atomic_uint pins;
	atomic_uchar freq; /* S3-FIFO access counter, 0..3 */
	uint8_t order;
	uint8_t queue; /* CACHE_SMALL, CACHE_MAIN or CACHE_NOT_QUEUED */
	bool writeback; /* a writeback of this entry is in flight */
	/* A hint for sparse reads: false while no 4 KiB block of the entry
	 * can be all zeros (fills found none, nothing was written since), so
	 * a hit sends it as data without reading it first. */
	bool may_hold_zeros;
	bool on_dirty_list;
	bool on_unstable_list; /* written back, no backend flush since: see cache.h */
	uint32_t nunstable;    /* blocks written back since the last flush (<= nblocks) */
	uint64_t dirty_since; /* monotonic ns, when it joined the dirty list */
	/* backend_writes_done after its latest write back: a backend flush sent
	 * once that many writes were done makes the entry clean. */
	uint64_t unstable_seq;
	struct cache_entry *fifo_prev, *fifo_next;
	struct cache_entry *dirty_prev, *dirty_next;
	struct cache_entry *unstable_prev, *unstable_next;
	uint64_t bits[]; /* uptodate, dirty, busy: words_per_map each */
};

struct cache_range {
	struct cache_range *hash_next;
	struct cache_range *export_prev, *export_next;
	struct cache_export *ce;
	uint64_t index; /* device offset >> CACHE_RANGE_SHIFT */
	uint32_t count, cap;
	struct cache_entry **entries; /* sorted by first_frame */
};

struct cache_shard {
	pthread_mutex_t lock;
	struct cache_range **buckets;
	size_t nbuckets, count;
} __attribute__((aligned(64)));

struct cache_fifo {
	struct cache_entry *head, *tail;
	uint64_t frames;
};

/*
 * Counters. Each export counts its own traffic (struct cache_export); the
 * cache's totals are their sums (plus what removed exports counted), so the
 * hot path touches one counter, not two. dirty_bytes is kept in both: the
 * cache-wide figure drives the watermarks. entries, metadata_bytes and the
 * compaction counters are the cache's only; cached_bytes the export's only.
 */
struct cache_counters {
	atomic_uint_fast64_t hits, misses, partial_hits;
	atomic_uint_fast64_t backend_reads, backend_read_bytes;
	atomic_uint_fast64_t backend_writes, backend_write_bytes, writeback_bytes;
	atomic_uint_fast64_t evictions, writeback_errors, bypass_reads, direct_writes;
	atomic_uint_fast64_t writes_in_place; /* WRITEs received into the arena */
	atomic_uint_fast64_t throttled_writes; /* WRITEs that waited at the high watermark */
	atomic_uint_fast64_t dirty_bytes, entries, metadata_bytes, cached_bytes;
	atomic_uint_fast64_t unstable_bytes, backend_flushes, backend_flush_errors, losses;
	/* Client requests by command (enum backend_cmd), and those with FUA. */
	atomic_uint_fast64_t commands[CACHE_COMMANDS], fua_commands;
	/* The cache's only (compact.c): */
	atomic_uint_fast64_t entry_bytes, large_bytes; /* bytes in entries, in order-9 ones */
	atomic_uint_fast64_t alloc_2m_attempts, alloc_2m_ok, alloc_failures;
	atomic_uint_fast64_t compact_moves, compact_skipped_pinned, compact_collapses;
	atomic_uint_fast64_t compact_chunks_freed, compact_passes, compact_ns;
};

struct cache_export {
	struct cache *cache;
	unsigned id;
	struct backend *backend;
	uint64_t size;
	uint32_t block_size;
	unsigned block_shift;
	unsigned min_order;   /* an entry holds at least one block */
	_Atomic enum cache_mode mode; /* changed live (cache_export_set_mode) */
	atomic_uint_fast64_t seq_cutoff;
	/* The export's own watermarks in bytes (the cache-wide ones when not
	 * set for it); draining: writeback thread only. */
	atomic_uint_fast64_t dirty_high, dirty_low;
	bool draining;

	pthread_mutex_t lock; /* the export lock, see cache.h */
	struct cache_entry *dirty_head, *dirty_tail; /* oldest first */
	/* Written back, waiting for a backend flush; oldest write first. */
	struct cache_entry *unstable_head, *unstable_tail;
	struct cache_range *ranges;
	uint64_t range_count;
	struct cache_op *direct; /* direct operations in flight */
	/* Moves when acknowledged data the cache does not hold (a direct write
	 * no flush covered yet) may be lost: each connection's next FLUSH
	 * reports EIO once (cache.h, "Durability"). */
	uint64_t error_seq;
	bool writeback_failing;
	int last_error;
	uint64_t retry_at; /* monotonic ns: background writeback waits till then */
	/* The log of writeback failures (writeback.c, writeback_note_failure_locked). */
	uint64_t failure_log_ns, recovery_log_ns, failures_unlogged;
	bool failure_logged;
	/* Writes the backend acknowledged (writeback and direct), and how many
	 * of them the last successful backend flush covered: equal means
	 * nothing to flush. direct_*: the direct writes (not FUA) among them,
	 * which the cache cannot write again. */
	atomic_uint_fast64_t backend_writes_done, backend_writes_flushed;
	atomic_uint_fast64_t direct_writes_done, direct_writes_flushed;
	/* Writeback thread only: the backend's loss_seq already acted on, the
	 * flush round running (flush.c) and the FLUSHes waiting for the
	 * next one. */
	uint64_t loss_seen;
	struct flush_job *round;
	struct cache_op *flush_waiting_head, *flush_waiting_tail;
	bool shutdown_waiting; /* the next round is the shutdown's */
	uint64_t unstable_since; /* monotonic ns: the unstable list became non-empty */
	struct cache_counters counters;
	/* Set once its export is gone and it holds nothing (cache_export_retire):
	 * it stays on the list, skipped, so no thread walking it is surprised,
	 * and is freed by cache_destroy. Not sooner: the writeback thread, the
	 * compactor and the shutdown walk the list without the exports lock
	 * (it only ever grows at its head), and the cache's totals still sum
	 * what it counted (struct cache_counters). */
	atomic_bool retired;
	struct cache_export *next;
};

struct cache_waitq {
	pthread_mutex_t lock;
	atomic_uint_fast64_t seq;
	atomic_uint waiters;
	struct cache_waiter *head;
};

/*
 * Wake-ups of the background threads, rung by the index and the operations
 * without knowing the threads: arrows run one way, the threads use the
 * index and never the reverse.
 *
 *   kick   the writeback thread's: a task posted to its event loop, at most
 *          once until it runs (writeback.c sets the task and the worker)
 *   nudge  the compactor's: a flag, and the condition variable the
 *          compactor thread sleeps on (compact.c waits, and stops, on it)
 */
struct cache_kick {
	struct worker *worker;	 /* the writeback thread while it runs, else NULL */
	struct worker_task task; /* task.run: set by writeback.c */
	atomic_bool pending;
};

struct cache_nudge {
	pthread_mutex_t lock; /* a leaf (taken under a shard lock by a nudge) */
	pthread_cond_t cond;  /* on CLOCK_MONOTONIC */
	atomic_bool nudged;
};

struct writeback;
struct compactor;

struct cache {
	struct arena arena;
	struct cache_shard shards[CACHE_SHARDS];
	pthread_mutex_t evict_lock;
	struct cache_fifo small, main;
	uint64_t *ghost;	/* fingerprints of recently evicted entries */
	uint32_t ghost_mask;	/* table size - 1 */
	uint64_t *ghost_ring;	/* insertion order, for forgetting the oldest */
	uint32_t ghost_ring_size, ghost_ring_pos, ghost_count;
	struct cache_waitq waitq;
	struct cache_counters counters;
	pthread_mutex_t exports_lock;
	struct cache_export *exports;
	unsigned export_count;
	atomic_uint_fast64_t dirty_high, dirty_low; /* bytes; changed by a reload */
	atomic_uint_fast64_t dirty_expire_ns;
	struct cache_kick kick;
	struct cache_nudge nudge;
	/* The write throttle (throttle.c): writeback groups completed without
	 * error (the progress throttled writes watch; writeback.c counts) and
	 * the writes waiting now (the writeback tick wakes them). */
	atomic_uint_fast64_t writebacks_done;
	atomic_uint throttled;
	struct writeback *writeback;
	struct compactor *compactor;
};

/* cache.c: index, entries, eviction */
struct cache_shard *cache_shard_for(struct cache *c, const struct cache_export *ce,
				    uint64_t range_index);
/* The range node of that index, or NULL. Shard lock held. */
struct cache_range *cache_range_get(struct cache_shard *sh, const struct cache_export *ce,
				    uint64_t range_index);
/* The entry holding the device frame, or NULL. Shard lock held. */
struct cache_entry *cache_lookup(struct cache_export *ce, struct cache_shard *sh,
				 uint64_t device_frame);
/*
 * A new entry holding device_frame, of the largest order <= want_order that
 * fits among the existing entries; NULL if the arena has no room even after
 * evicting. Shard lock held; the entry comes back unpinned, nothing cached.
 */
struct cache_entry *cache_entry_create(struct cache_export *ce, struct cache_shard *sh,
				       uint64_t device_frame, unsigned want_order);
/* Range indexes of the export's range nodes in [first, last]. Takes the
 * export lock. *out is malloc'd. */
int cache_ranges_between(struct cache_export *ce, uint64_t first, uint64_t last,
			 uint64_t **out, size_t *count);
/* Call fn on every cached entry overlapping [offset, offset+length), with
 * its shard lock held. No lock held; 0 or -ENOMEM. */
int cache_for_each_entry(struct cache_export *ce, uint64_t offset, uint64_t length,
			 void (*fn)(struct cache_entry *e, void *arg), void *arg);
/* Size of an entry (handle) with nblocks blocks. */
size_t cache_entry_struct_size(uint32_t nblocks);
/* Collapse: the new entry ne takes the place of old[0..n) in the S3-FIFO
 * queues (main if any of them was there). Takes the evict lock. */
void cache_queue_replace(struct cache *c, struct cache_entry *const *old, size_t n,
			 struct cache_entry *ne);
/* Evict clean entries until at least free_frames frames are free or none
 * can go; a few at a time, so the I/O path is never kept waiting long.
 * No lock held. Returns the entries evicted. */
uint64_t cache_evict_until(struct cache *c, uint64_t free_frames);
/* Evict e now if it is clean, idle and was not hit since it was queued
 * (compaction: cheaper than moving it when room is needed anyway). Shard
 * lock held; takes the evict lock. */
bool cache_entry_evict_cold(struct cache *c, struct cache_shard *sh, struct cache_entry *e);
void cache_entry_pin(struct cache_entry *e);
void cache_entry_unpin(struct cache_entry *e);
void cache_entry_touch(struct cache_entry *e);

/* Per-block state; shard lock held. */
uint64_t *cache_uptodate_map(struct cache_entry *e);
uint64_t *cache_dirty_map(struct cache_entry *e);
uint64_t *cache_busy_map(struct cache_entry *e);

/* dirty.c: dirty and unstable state, and the export's lists */
/* Mark blocks [first, first+count) dirty; keeps the dirty list and counts.
 * Shard lock held (takes the export lock). */
void cache_mark_dirty(struct cache_entry *e, uint32_t first, uint32_t count);
/* Clear dirty bits of [first, first+count). Shard lock held. */
void cache_clear_dirty(struct cache_entry *e, uint32_t first, uint32_t count);
/* Leave the dirty list if nothing is dirty or being written. Shard lock. */
void cache_dirty_list_update(struct cache_entry *e);
/* Unlink e from its export's dirty list (export lock held, e on it). */
void cache_dirty_list_remove(struct cache_export *ce, struct cache_entry *e);
/* Blocks of e were written back by the write numbered seq (backend_writes_done
 * after it): e stays unevictable until a backend flush covers it. Shard lock. */
void cache_mark_unstable(struct cache_entry *e, uint32_t blocks, uint64_t seq);
/* A backend flush covered e: it is clean (shard lock held, takes the
 * export lock). redirty: the flush failed or the backend lost writes, so
 * every uptodate block of e is dirty again (written again) instead. */
void cache_unstable_settle(struct cache_entry *e, bool redirty);
/* Pin and collect the entries of the export's dirty list, or of its
 * unstable list those whose unstable_seq is at most seq (all of them:
 * UINT64_MAX); *out malloc'd. Takes the export lock. */
enum cache_list { CACHE_LIST_DIRTY, CACHE_LIST_UNSTABLE };
int cache_list_pin(struct cache_export *ce, enum cache_list list, uint64_t seq,
		   struct cache_entry ***out, size_t *count);

static inline uint64_t cache_entry_offset(const struct cache_entry *e)
{
	return e->first_frame << ARENA_FRAME_SHIFT;
}
static inline uint64_t cache_entry_bytes(const struct cache_entry *e)
{
	return (uint64_t)ARENA_FRAME_SIZE << e->order;
}

/* Dirty bytes move in the export's count and the cache's together. */
static inline void cache_dirty_bytes_add(struct cache_export *ce, uint64_t bytes)
{
	atomic_fetch_add(&ce->counters.dirty_bytes, bytes);
	atomic_fetch_add(&ce->cache->counters.dirty_bytes, bytes);
}

static inline void cache_dirty_bytes_sub(struct cache_export *ce, uint64_t bytes)
{
	atomic_fetch_sub(&ce->counters.dirty_bytes, bytes);
	atomic_fetch_sub(&ce->cache->counters.dirty_bytes, bytes);
}

/* Bit helpers over uint64_t words. */
static inline bool bit_test(const uint64_t *map, uint32_t i)
{
	return (map[i >> 6] >> (i & 63)) & 1;
}
static inline void bit_set(uint64_t *map, uint32_t i)
{
	map[i >> 6] |= 1ull << (i & 63);
}
static inline void bit_clear(uint64_t *map, uint32_t i)
{
	map[i >> 6] &= ~(1ull << (i & 63));
}

/* exports.c */
/* Mode none: a WRITE, TRIM or WRITE_ZEROES (not FUA) went to the backend
 * as it is (direct.c, passthrough_start) and succeeded; it is not durable
 * until a backend flush (FLUSH goes through the writeback thread's rounds
 * in every mode, flush.c). */
void cache_export_note_direct_write(struct cache_export *ce);

/* wake.c: the waitq, wait for "something changed" without lost wake-ups. */
uint64_t cache_waitq_seq(struct cache *c);
/* Queue w to run (w->task on w->worker) after the next wake; false (do not
 * wait, retry now) if a wake happened since seq was read. */
bool cache_waitq_wait(struct cache *c, struct cache_waiter *w, uint64_t seq);
void cache_waitq_wake(struct cache *c);
/* Ask the writeback thread for a background pass soon (dirty data above a
 * watermark, a changed policy). Any thread; nothing if it is not running. */
void cache_kick_writeback(struct cache *c);
/* A large allocation fell back to a smaller order: ask the compactor for a
 * pass. Cheap, any thread, any lock held. */
void cache_nudge_compactor(struct cache *c);

/* cache.c */
uint64_t cache_now_ns(void);
/* The index's part of cache_create (the arena, the ghost table, the locks,
 * the writeback policy; 0 or -errno, nothing to undo on failure) and of
 * cache_destroy (every range, entry and export, then the rest). */
int cache_index_init(struct cache *c, const struct options *opts);
void cache_index_destroy(struct cache *c);

#endif
