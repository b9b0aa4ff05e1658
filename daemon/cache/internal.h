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
 *   index       cache.c evict.c slots.c      internal.h, arena.h,
 *               dirty.c exports.c stats.c    device.h
 *               wake.c
 *   arena       arena.c                      arena.h
 *   device      device.c device_*.c          device.h, device_internal.h
 *
 * Headers follow the same order: ops.h includes internal.h, which
 * includes arena.h, device.h and entry.h (what an entry is, and its
 * accessors that need nothing else); writeback.h includes internal.h;
 * compact.h nothing of the cache's. The two threads do not know each
 * other. The cache device (device.h, the port to the tiers below the
 * index) knows nothing of the index: an export is its slot there
 * (cache_export.device_slot).
 *
 * The threads wait for the index without the index knowing them: it rings
 * struct cache_kick (writeback) and struct cache_nudge (compactor), which
 * the threads set up. Only lifecycle.c starts and stops threads, and
 * cache_submit, there, hands a FLUSH to the writeback thread.
 *
 * The index: a hash of (export, 2 MiB device range) to a range node, which
 * lists the entries inside that range sorted by position. Memory follows
 * what is cached, never the device size. Entries, side records and range
 * nodes are slots of three pools, named by 32-bit index (0: none); every
 * link below is one.
 *
 *   shard[hash % CACHE_SHARDS]
 *     buckets[] -> range(export 1, index 7) -hash_next-> range(...) -> 0
 *                    entries: [3584 order 0][3600 order 4] ...  (indexes,
 *                    sorted by pos, each with a copy of its entry's
 *                    pos_high in bit 31; two in the node, then an array
 *                    that grows by a quarter)
 *
 *   entry (28 bytes and a tail byte; the handle is a pointer into its
 *          pool's chunk)
 *     range|pos_high  frame  fifo_prev|queue  fifo_next  ext  state
 *     hot = pins (25 bits) | may_hold_zeros | freq (2 bits) | order (4 bits)
 *     tail byte in the chunk: pos_low
 *       first frame = range->index * 512 + pos; export = range->ce
 *       state = invalidations (29 bits) | the three map bits of a one-block
 *               entry (uptodate, dirty, busy)
 *       ext -> side record (56 bytes on 64-bit, 48 on i386), only while
 *              dirty, unstable or under writeback, or for an entry of more
 *              than one block: dirty_since, unstable_seq, maps (uptodate,
 *              dirty, busy words, malloc'd), dirty and unstable list links,
 *              ndirty, nunstable, on_dirty_list, on_unstable_list, writeback
 *
 *   pool: directory[chunk] -> chunk of at most 16 KiB aligned to 16 KiB,
 *         slot 0 = header {cache, chunk number}, then slots 1..2^shift-1,
 *         then (entries only) a tail byte per slot:
 *         [hdr][e1][e2]...[e511][t0 t1 t2 ... t511]   512 * 28 + 512 bytes
 *
 * metadata_bytes counts all of it (pool chunks, range arrays and buckets at
 * capacity, large entries' maps, the ghost table, the directories); the
 * arena's own tables are arena->metadata_bytes (stats: arena_metadata_bytes).
 */
#ifndef NBDCACHED_DAEMON_CACHE_INTERNAL_H
#define NBDCACHED_DAEMON_CACHE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "daemon/cache/arena.h"
#include "daemon/check.h"
#include "daemon/clock.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/device.h"
#include "daemon/cache/entry.h"

struct flush_job;

#define CACHE_SHARDS 64
#define CACHE_NOT_QUEUED 0
#define CACHE_SMALL 1
#define CACHE_MAIN 2



struct cache_shard {
	pthread_mutex_t lock;
	uint32_t *buckets; /* ranges pool indexes */
	size_t nbuckets, count;
} __attribute__((aligned(64)));

struct cache_fifo {
	uint32_t head, tail; /* entries pool indexes */
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
	atomic_uint_fast64_t writes_swapped;  /* ... into fresh frames, swapped in */
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
	atomic_uint_fast64_t entry_splits; /* cache_entry_split */
};

struct cache_export {
	struct cache *cache;
	unsigned id;
	struct backend *backend;
	/* Bytes; cache_export_resize() moves it, any thread reads it. */
	atomic_uint_fast64_t size;
	uint32_t block_size;
	unsigned block_shift;
	unsigned min_order;   /* an entry holds at least one block */
	_Atomic enum cache_mode mode; /* changed live (cache_export_set_mode) */
	atomic_uint_fast64_t seq_cutoff;
	enum cache_l2_policy l2_policy; /* cache-device-l2, set when added */
	/* The export's own watermarks in bytes (the cache-wide ones when not
	 * set for it); draining: writeback thread only. */
	atomic_uint_fast64_t dirty_high, dirty_low;
	bool draining;

	pthread_mutex_t lock; /* the export lock, see cache.h */
	struct cache_entry *dirty_head, *dirty_tail; /* oldest first */
	/* Written back, waiting for a backend flush; oldest write first. */
	struct cache_entry *unstable_head, *unstable_tail;
	/* With a cache device slot: the entries a log round must copy (not
	 * logged since they were last written), in no particular order. A
	 * round visits these alone, not every dirty and unstable entry. */
	struct cache_entry *unlogged_head, *unlogged_tail;
	uint32_t ranges; /* ranges pool index of the first range node */
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
	/* backend_writes_done after the latest write that went to the
	 * backend directly (a direct step, a passthrough write): while it is
	 * past backend_writes_flushed, a fill may read bytes the backend can
	 * still lose (cache_fill_unproven). */
	atomic_uint_fast64_t direct_write_seq;
	/* The same, of direct writes not kept (ops.h, direct_shadow.c): a
	 * loss can only report them. */
	atomic_uint_fast64_t unshadowed_seq;
	/* direct_shadow.c: the direct steps kept until a flush covers them,
	 * oldest first, and the pass writing them again (export lock). */
	struct direct_shadow *shadow_head, *shadow_tail;
	uint64_t shadow_bytes, shadow_rewritten;
	bool shadow_redo;
	struct shadow_pass *shadow_pass;
	/* direct.c: the step length the export's last TRIM or WRITE_ZEROES
	 * step settled on, where the next one starts (0: none yet). */
	atomic_uint_fast64_t direct_step_bytes;
	/* Writeback thread only: the backend's loss_seq already acted on, the
	 * flush round running (flush.c) and the FLUSHes waiting for the
	 * next one. */
	uint64_t loss_seen;
	struct flush_job *round;
	struct cache_op *flush_waiting_head, *flush_waiting_tail;
	bool flush_writeback;  /* one of them has CACHE_FLUSH_WRITEBACK */
	bool shutdown_waiting; /* the next round is the shutdown's */
	uint64_t unstable_since; /* monotonic ns: the unstable list became non-empty */
	struct cache_counters counters;
	/* Latency histograms, cache->latency_slots of them (stats.c). */
	struct cache_latency_slot *latency;
	/* Its slot on the cache device (device.h), -1: not logged (no
	 * device, or mode none); bytes written into the cache since its
	 * last log round began (what the next one may copy, at most). */
	int device_slot;
	atomic_uint_fast64_t log_unlogged_bytes;
	/* Bytes of the cache device's live log found at start are not all on
	 * its backend yet: backend requests go through cache_device_gate. */
	atomic_bool replay_gate;
	/* cache_export_retire: the CLEAN record over all of it (device.h,
	 * cache_device_retire); the reaper's thread only. */
	uint64_t retire_rec;
	/* What a small fill from the backend has cost lately, ns (a moving
	 * average; 0: none yet), against which one from the level-2 cache is
	 * weighed (cached.c), and the small fills that weighed them. */
	atomic_uint_fast64_t small_fill_ns;
	atomic_uint level2_weighed;
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
	struct cache_pool entries, ext, ranges;
	struct cache_shard shards[CACHE_SHARDS];
	pthread_mutex_t evict_lock;
	struct cache_fifo small, main;
	/* Fingerprints of recently evicted entries, 16 bits kept: the slot
	 * number is the rest of it. */
	uint16_t *ghost;
	uint32_t ghost_mask; /* table size - 1 */
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
	/* --cache-device's intent log (device.h), NULL: none. */
	struct cache_device *device;
	/* Threads that record latencies (enum cache_latency): the workers,
	 * the control thread, the writeback thread last. */
	unsigned latency_slots;
};

/* One thread's latency histograms of an export and its counts of client
 * replies (cache_export_record_reply), written by that thread alone. */
struct cache_latency_slot {
	struct histogram_recorder kinds[CACHE_LATENCIES];
	atomic_uint_fast64_t read_bytes, written_bytes, errors;
};

/*
 * Send io to the export's backend from thread w, timed: its done callback
 * calls cache_backend_timed() (the latency of CACHE_LATENCY_BACKEND, on
 * the thread the callback runs on, w). While bytes of the cache device's
 * live log found at start are not all on the backend, an io touching
 * them is sent once they are (cache_device_gate).
 */
static inline void cache_backend_submit(struct cache_export *ce, struct worker *w,
					struct backend_io *io)
{
	io->submit_ns = clock_now_ns();
	if (atomic_load_explicit(&ce->replay_gate, memory_order_acquire) &&
	    cache_device_gate(ce->cache->device, ce->device_slot, w, io))
		return;
	backend_submit(ce->backend, w, io);
}
/* (An io never sent, worker NULL, is not timed.) */
void cache_backend_timed(struct cache_export *ce, const struct backend_io *io);

/* slots.c: the pools, the maps, the side records */
/* A pool of slot_size slots (and tail_size bytes each in the chunk's
 * tail), for at most max of them: 0 or -errno. */
int cache_pool_init(struct cache_pool *p, struct cache *c, uint32_t slot_size, uint32_t tail_size,
		    uint64_t max);
void cache_pool_destroy(struct cache_pool *p);
/* A zeroed slot's index (its tail zeroed too), or 0 if out of memory.
 * Any lock held. */
uint32_t cache_pool_alloc(struct cache_pool *p);
void cache_pool_free(struct cache_pool *p, uint32_t i);
/* The pool index of a slot of p. */
uint32_t cache_pool_index_of(const struct cache_pool *p, const void *slot);
/* A new side record for e (with the maps of a multi-block entry, all
 * clear), or NULL if out of memory. Shard lock and export lock held, or e
 * not in the index yet. */
struct cache_entry_ext *cache_entry_ext_new(struct cache *c, struct cache_entry *e,
					    uint32_t nblocks);
/* Free e's side record if it has one (same locks). */
void cache_entry_ext_free(struct cache *c, struct cache_entry *e);

/* cache.c: index, entries */
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
/* An entry of ne's shape (order 9) for the collapse of range r: a slot,
 * its side record with the maps, nothing cached, in no queue and not in
 * the range. Shard lock held; NULL if out of memory. */
struct cache_entry *cache_entry_new_large(struct cache_export *ce, struct cache_range *r,
					  uint32_t frame);
/*
 * Split e in two entries of half its size (a WRITE over dirty data fitting
 * its entries, cached.c): e keeps its first half, its handle, state and
 * places; a new entry takes the second half, its blocks' bits, a dirty-list
 * place right after e's and a queue place right after e's. Only an entry
 * of more than 2 blocks a half that no one pins, with no block busy, not
 * under writeback and not waiting for a backend flush. Shard lock held;
 * takes the evict, arena and export locks. 0, -EBUSY (it does not
 * qualify now), -EINVAL (too small) or -ENOMEM; nothing changes on error.
 */
int cache_entry_split(struct cache_export *ce, struct cache_entry *e);
/* Give back the slot (and side record) of an entry no longer in the index
 * nor a queue, its frames freed. Shard lock held. */
void cache_entry_release(struct cache *c, struct cache_entry *e);
/* e is clean and idle: it leaves the unlogged list, and its side record
 * is freed if nothing needs it any more (one block). Shard lock and
 * export lock held. */
void cache_entry_ext_trim(struct cache_export *ce, struct cache_entry *e);
/*
 * Make sure e has a side record, so that marking it dirty or unstable later
 * cannot fail: every path that will is given one here first, where an
 * error can still be reported or gone around (a WRITE writes through,
 * a direct write forgets its cached copy). Shard lock held; takes the
 * export lock. 0 or -ENOMEM. cache_entry_ext_unreserve() gives it back if
 * it turned out not to be needed (it stays while e is dirty or unstable).
 */
int cache_entry_ext_reserve(struct cache_export *ce, struct cache_entry *e);
void cache_entry_ext_unreserve(struct cache_export *ce, struct cache_entry *e);
/* e's side record, allocated if it has none. Shard lock and export lock
 * held. Callers reserved it (cache_entry_ext_reserve) or e is dirty,
 * unstable or under writeback, which keep it: if the memory for it still
 * cannot be had, that is a bug, and the daemon aborts. */
struct cache_entry_ext *cache_entry_ext_get(struct cache_export *ce, struct cache_entry *e);
/* The range node's entry i. */
struct cache_entry *cache_range_entry(const struct cache_range *r, uint32_t i);
/* e becomes the range node's only entry (a collapse); its array, if any,
 * goes. Shard lock held. */
void cache_range_set_one(struct cache_range *r, struct cache_entry *e);
/* Remove an unpinned, clean, idle entry from everything (its range, the
 * range node if it was the last, its queue) and free it. Shard lock and
 * evict lock held. */
void cache_entry_destroy(struct cache *c, struct cache_shard *sh, struct cache_entry *e);
void cache_entry_pin(struct cache_entry *e);
void cache_entry_unpin(struct cache_entry *e);
void cache_entry_touch(struct cache_entry *e);

/* evict.c: the S3-FIFO queues, the ghost table, eviction */
/* A new entry joins the main queue if the ghost table remembers it, else
 * the small one. Takes the evict lock. */
void cache_queue_insert(struct cache *c, struct cache_entry *e);
/* Out of its queue (if any); it is CACHE_NOT_QUEUED after. Evict lock
 * held. */
void cache_queue_remove(struct cache *c, struct cache_entry *e);
/* Collapse: the new entry ne takes the place of old[0..n) in the S3-FIFO
 * queues (main if any of them was there). Takes the evict lock. */
void cache_queue_replace(struct cache *c, struct cache_entry *const *old, size_t n,
			 struct cache_entry *ne);
/* A split: n, e's second half, takes the queue place right after e, with
 * its frames (e's order is halved already); if e is in no queue, neither
 * is n. Evict lock held. */
void cache_queue_split(struct cache *c, struct cache_entry *e, struct cache_entry *n);
/* No pin, nothing dirty, not on the dirty or unstable list, not being
 * written back: e may go. Shard lock held. */
bool cache_entry_evictable(struct cache_entry *e);
/* Frames of the given order, evicting up to max_evictions entries. Shard
 * lock sh held (its entries are passed over); takes the evict lock. */
int64_t cache_alloc_evicting(struct cache *c, struct cache_shard *sh, unsigned order,
			     unsigned max_evictions);
/* Evict clean entries until at least free_frames frames are free or none
 * can go; a few at a time, so the I/O path is never kept waiting long.
 * No lock held. Returns the entries evicted. */
uint64_t cache_evict_until(struct cache *c, uint64_t free_frames);
/* Evict e now if it is clean, idle and was not hit since it was queued
 * (compaction: cheaper than moving it when room is needed anyway). Shard
 * lock held; takes the evict lock. */
bool cache_entry_evict_cold(struct cache *c, struct cache_shard *sh, struct cache_entry *e);

/*
 * Per-block state; shard lock held. A map is bits of 32-bit words from a
 * bit offset: a one-block entry keeps its three bits in the entry
 * (inline_maps), a larger one in its side record. map_test/set/clear.
 */
struct cache_map cache_uptodate_map(struct cache_entry *e);
struct cache_map cache_dirty_map(struct cache_entry *e);
struct cache_map cache_busy_map(struct cache_entry *e);

/* dirty.c: dirty and unstable state, and the export's lists */
/* Mark blocks [first, first+count) dirty; keeps the dirty list and counts.
 * Shard lock held (takes the export lock). */
void cache_mark_dirty(struct cache_entry *e, uint32_t first, uint32_t count);
/* Clear dirty bits of [first, first+count). Shard lock held. */
void cache_clear_dirty(struct cache_entry *e, uint32_t first, uint32_t count);
/* n joins the dirty list right after e, which is on it, with e's age
 * (a split: n holds half of what e did). Export lock held. */
void cache_dirty_list_insert_after(struct cache_export *ce, struct cache_entry *e,
				   struct cache_entry *n);
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
/* e joins its export's unlogged list unless it is on it; leaves it.
 * Shard lock and export lock held. */
void cache_unlogged_add(struct cache_export *ce, struct cache_entry *e);
void cache_unlogged_remove(struct cache_export *ce, struct cache_entry *e);
/* Pin and collect the entries of the export's dirty list, of its unlogged
 * list, or of its unstable list those whose unstable_seq is at most seq
 * (all of them: UINT64_MAX); *out malloc'd. Takes the export lock. */
enum cache_list { CACHE_LIST_DIRTY, CACHE_LIST_UNSTABLE, CACHE_LIST_UNLOGGED };
int cache_list_pin(struct cache_export *ce, enum cache_list list, uint64_t seq,
		   struct cache_entry ***out, size_t *count);

/* ---- accessors that need the cache or the export (the entry's own:
 * entry.h) ---- */

/* May a fill sent now read bytes that a direct write put on the backend
 * and no backend flush has covered yet (struct cache_entry: unproven)? */
static inline bool cache_fill_unproven(struct cache_export *ce)
{
	return atomic_load(&ce->direct_write_seq) > atomic_load(&ce->backend_writes_flushed);
}

/* *a = max(*a, v), without a lock. */
static inline void cache_atomic_max(atomic_uint_fast64_t *a, uint64_t v)
{
	uint64_t cur = atomic_load(a);
	while (cur < v && !atomic_compare_exchange_weak(a, &cur, v))
		;
}

/* A direct write the cache does not keep a copy of (direct_shadow.c). */
static inline void cache_note_unshadowed(struct cache_export *ce, uint64_t seq)
{
	cache_atomic_max(&ce->unshadowed_seq, seq);
}

/* A write went to the backend directly: backend_writes_done was seq
 * after it (cache_fill_unproven). */
static inline void cache_note_direct_seq(struct cache_export *ce, uint64_t seq)
{
	cache_atomic_max(&ce->direct_write_seq, seq);
}

static inline struct cache_entry *cache_entry_at(const struct cache *c, uint32_t i)
{
	return i ? (struct cache_entry *)cache_pool_slot(&c->entries, i) : NULL;
}

static inline struct cache_range *cache_range_at(const struct cache *c, uint32_t i)
{
	return i ? (struct cache_range *)cache_pool_slot(&c->ranges, i) : NULL;
}

static inline struct cache_range *cache_entry_range(const struct cache_entry *e)
{
	return cache_range_at(cache_of_entry(e), e->range);
}

static inline struct cache_export *cache_entry_export(const struct cache_entry *e)
{
	return cache_entry_range(e)->ce;
}

/* Device frame of the entry's first byte. */
static inline uint64_t cache_entry_first_frame(const struct cache_entry *e)
{
	return cache_entry_range(e)->index << (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT) |
	       cache_entry_pos(e);
}

static inline uint32_t cache_entry_nblocks(const struct cache_entry *e)
{
	return (uint32_t)(((uint64_t)ARENA_FRAME_SIZE << cache_entry_order(e)) >>
			  cache_entry_export(e)->block_shift);
}

/* The side record, or NULL (clean one-block entry). Shard lock or export
 * lock held. */
static inline struct cache_entry_ext *cache_entry_ext(const struct cache_entry *e)
{
	return e->ext ? (struct cache_entry_ext *)cache_pool_slot(&cache_of_entry(e)->ext, e->ext)
		      : NULL;
}

/* The dirty-only state, read through the side record. */
static inline uint32_t cache_entry_ndirty(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x ? x->ndirty : 0;
}
static inline bool cache_entry_writeback(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x && x->writeback;
}
static inline bool cache_entry_on_dirty_list(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x && x->on_dirty_list;
}
static inline bool cache_entry_on_unstable_list(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x && x->on_unstable_list;
}
/* Unstable: the write-back sequence number; 0 when not. Export lock. */
static inline uint64_t cache_entry_unstable_seq(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x ? x->unstable_seq : 0;
}
static inline uint64_t cache_entry_dirty_since(const struct cache_entry *e)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return x ? x->dirty_since : 0;
}
/* The next entry on the export's dirty list. Export lock held. */
static inline struct cache_entry *cache_dirty_next(const struct cache_entry *e)
{
	return cache_entry_at(cache_of_entry(e), cache_entry_ext(e)->dirty_link.next);
}

static inline uint64_t cache_entry_offset(const struct cache_entry *e)
{
	return cache_entry_first_frame(e) << ARENA_FRAME_SHIFT;
}
static inline uint64_t cache_entry_bytes(const struct cache_entry *e)
{
	return (uint64_t)ARENA_FRAME_SIZE << cache_entry_order(e);
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


/* exports.c */
/* Mode none: a WRITE (not FUA) went to the backend as it is (direct.c,
 * passthrough_start) and succeeded; it is not durable
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
/* The index's part of cache_create (the arena, the ghost table, the locks,
 * the writeback policy; 0 or -errno, nothing to undo on failure) and of
 * cache_destroy (every range, entry and export, then the rest). */
int cache_index_init(struct cache *c, const struct options *opts);
void cache_index_destroy(struct cache *c);

#endif
