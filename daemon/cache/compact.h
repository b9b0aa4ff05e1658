/*
 * daemon/cache/compact.h: defragmentation of the arena (docs/architecture.md,
 * "Defragmentation"). Internal to daemon/cache/.
 *
 * Owns: the compactor thread and its settings, the compaction and collapse
 * passes, and their counters (in struct cache_counters).
 *
 *   compaction  the emptiest 2 MiB chunks of the arena are isolated (arena.h)
 *               one at a time; each entry in one is moved through its handle
 *               (copy, new location) to a hole elsewhere, and
 *               the chunk comes back as one free 2 MiB block. A pinned entry
 *               (I/O in flight, a reply not yet sent, a writeback) is never
 *               moved: the chunk is given up for this pass and it is counted.
 *   collapse    an aligned 2 MiB device range covered by smaller unpinned
 *               entries becomes one order-9 entry; uptodate and dirty bits
 *               are carried over block for block.
 *   eviction    when a large allocation has fallen back (a nudge) and the
 *               arena is almost full, clean entries are evicted until a small
 *               reserve is free, so there is something to gather.
 *
 * Locking: a move holds the entry's shard lock (and the arena lock inside
 * it, briefly) for one entry copy; a collapse holds the range's shard lock
 * for the copy of one 2 MiB range, the export lock only to re-check pins and
 * relink the dirty list, then the evict lock (never the export and evict
 * locks together, see cache.h). The nudge lock it sleeps on (struct
 * cache_nudge, internal.h) is a leaf. One pass runs at a time (pass_lock),
 * whichever thread asked for it, outside every other lock.
 *
 * Threads: the compactor thread (plain pthread: the work is CPU and memory,
 * no I/O) runs a background pass every interval when the fragmentation
 * index is above the threshold or the index nudged it (a large allocation
 * fell back: cache_nudge_compactor); cache_compact() runs a pass on the
 * caller's thread (never a worker: it may block ~1 s per GiB).
 */
#ifndef NBDCACHED_DAEMON_CACHE_COMPACT_H
#define NBDCACHED_DAEMON_CACHE_COMPACT_H

#include <stdint.h>

struct cache;
struct options;

int compactor_create(struct cache *c, const struct options *opts);
int compactor_start(struct cache *c);
void compactor_stop(struct cache *c);
void compactor_destroy(struct cache *c);

/* The fragmentation index, per mille (see struct cache_stats). */
unsigned cache_fragmentation(struct cache *c);

#endif
