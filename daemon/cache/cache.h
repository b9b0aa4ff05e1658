/*
 * daemon/cache/cache.h: the block cache shared by every connection of
 * every export (docs/architecture.md, "daemon/cache").
 *
 * Owns: the arena (arena.h), the index from (export, device range) to cache
 * entries, each entry's per-block state, eviction (S3-FIFO), writeback
 * (writeback.c, flush.c) and the statistics. transmit.c turns each NBD
 * command into one struct cache_op and calls cache_submit(); everything
 * else here is internal (internal.h, which lists the cache's layers).
 *
 * An entry caches an aligned device range of 2^order 4 KiB frames (order 0
 * to 9) in as many arena frames. It is reached only through its handle,
 * struct cache_entry, which holds the arena location, the pin count and
 * two bits per block: uptodate and dirty (plus busy while a backend read
 * fills the block). Nothing keeps an arena address across an
 * unlock unless it holds a pin: a pinned entry is never moved or evicted.
 *
 * Lock order (take left before right, never the reverse):
 *
 *   compaction pass lock -> shard lock -> evict lock -> export lock
 *                                      -> export lock
 *                                      -> arena lock
 *   evict lock  ->  export lock   (cache_entry_destroy -> range_destroy:
 *                                  an eviction unlinks the entry's last
 *                                  range from the export's range list)
 *   evict lock  ->  arena lock    (cache_alloc_evicting,
 *                                  cache_entry_destroy)
 *   evict lock  ->  another shard's lock: try-lock only (evict_one)
 *   export lock ->  cache device lock (flush_log_clean appends its
 *                   records under the export lock: device.h)
 *
 *   Never the reverse: the evict lock is not taken under an export lock,
 *   nor a shard lock under an export or evict lock (but by try-lock); the
 *   arena lock is innermost and never held with an export lock. The
 *   compaction pass lock is outermost (one pass at a time, compact.c). The
 *   exports lock, the waitq lock and the compactor's nudge lock are leaves
 *   (the last is taken under a shard lock: a nudge); the writeback
 *   thread's stop lock has only the exports lock under it (writeback_stop
 *   counts the bytes left while it waits).
 *
 *   shard lock   index of its device ranges, and every field of their
 *                entries except their atomic word (pins, frequency)
 *   export lock  the export's dirty and unstable lists, its range list,
 *                its direct (write to backend) operations in flight and
 *                its error sequence;
 *                an entry on the dirty list may be pinned under this lock
 *                alone, because it cannot be evicted without leaving that
 *                list first
 *   evict lock   the S3-FIFO queues and the ghost table
 *
 * Durability (one model per export, kept here, in writeback.c and flush.c):
 *
 *   dirty     written by a client into the cache only; not evictable
 *   unstable  written back: the backend acknowledged it, no backend flush
 *             sent after that write has succeeded yet (as NFS's unstable
 *             writes before COMMIT); still not evictable
 *   clean     a backend flush sent after its write succeeded, and the
 *             backend's loss_seq did not move meanwhile
 *
 *   A backend flush that fails, or a move of the backend's loss_seq (a
 *   connection to a remote server lost), turns every unstable entry dirty
 *   again: the cache writes it again, so no acknowledged byte depends on
 *   a flush that did not happen. FLUSH runs in rounds (flush.c): a
 *   round writes back the dirty list as it was when the round started,
 *   then flushes the backend; FLUSHes that arrive meanwhile share the
 *   next round. A FLUSH fails with EIO when its round could not write or
 *   flush (the data stays, and the next FLUSH tries again). Direct writes
 *   (FUA aside) are unstable on the backend too, and where the cache does
 *   not hold them they cannot be written again: their loss moves the
 *   export's error sequence, and every connection's next FLUSH reports it
 *   once. Shutdown writes everything back and flushes; what it cannot make
 *   durable it keeps retrying, and says how many bytes.
 *
 *   What a FLUSH waits for: the writes acknowledged before it, and nothing
 *   else. Its round writes back the entries dirty when it starts (an
 *   entry waits only for a writeback already in flight over it, or for
 *   the one step of a direct operation in flight over it), then flushes
 *   the backend, which covers every backend write completed by then. A
 *   TRIM or WRITE_ZEROES not yet acknowledged is not covered and not
 *   waited for: it goes in steps (direct.c), holds only the range of the
 *   step in flight, and a step completed before the backend flush is
 *   covered by it anyway. Dirty blocks ahead of its steps keep their
 *   data and are written back as usual (the step over them waits for
 *   that writeback, then zeroes); blocks its steps passed are zeros in
 *   the cache and on the backend, clean or unstable, never dirty with
 *   old data. An operation that stops half way (an error, its client
 *   gone, the server stopping) leaves its range as the steps done left
 *   it, which the protocol allows for a request not acknowledged.
 *
 * Threads: cache_submit() runs on a worker thread and uses that worker's
 * ring; completions and retries come back to the same worker. Writeback and
 * FLUSH run on the cache's own writeback thread, background compaction on
 * the compactor thread (compact.h).
 */
#ifndef NBDCACHED_DAEMON_CACHE_H
#define NBDCACHED_DAEMON_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/cache/device.h"
#include "daemon/histogram.h"
#include "daemon/options.h"
#include "daemon/worker.h"

struct cache;
struct cache_export;
struct cache_entry;
struct cache_piece;
struct cache_span;

/* Someone waiting for the cache to change (a fill or writeback to finish). */
struct cache_waiter {
	struct worker *worker;	 /* where task runs when woken */
	struct worker_task task; /* task.run set by the waiter */
	struct cache_waiter *next;
};

/*
 * One NBD command on its way through the cache. The caller fills the first
 * block of fields and calls cache_submit(), in every cache mode; done()
 * runs on the same worker thread, possibly before cache_submit() returns
 * (a hit completes at once). A READ's data is then described by
 * cache_op_segment(); the caller releases the op with cache_op_release()
 * once nothing references its data any more (after the reply has been
 * sent), which unpins the entries it read from. In mode none the cache is
 * a pass-through: every command but FLUSH goes to the backend as it is,
 * and a READ's data is in a buffer the op owns, not in the arena
 * (cache_op_pins_arena).
 */
struct cache_op {
	struct cache_export *ce;
	struct worker *worker;
	enum backend_cmd cmd;
	/* BACKEND_FUA, BACKEND_NO_HOLE, BACKEND_FAST_ONLY; CACHE_FLUSH_WRITEBACK */
	uint32_t flags;
	uint64_t offset, length;
	const uint8_t *payload;	    /* WRITE */
	bool no_allocate;	    /* READ: use cached data, cache nothing new */
	bool sequential;	    /* READ: continues the connection's last read */
	struct nbd_extent *extents; /* BLOCK_STATUS: room for max_extents */
	size_t max_extents, n_extents;
	uint64_t *seen_error; /* FLUSH: the connection's error sequence */
	/* TRIM, WRITE_ZEROES: set true (on op->worker) once nobody waits for
	 * the reply any more (the client has gone, the server stops): the
	 * op, which goes in steps, ends before its next one with
	 * -ESHUTDOWN. NULL: never. */
	const bool *cancel;
	void (*done)(struct cache_op *op, int result);

	/* Private to the cache. */
	struct cache_piece *pieces;
	size_t npieces;
	unsigned pending; /* backend I/O in flight */
	int error;
	int result;
	int stage;
	size_t pieces_cap;
	bool registered; /* direct op: its range is in the export's list */
	/* Direct step, export lock: its record is in the cache device's
	 * log, or about to be (direct.c: step_log). */
	bool step_logged;
	bool counted;	 /* hit / miss already counted */
	bool some_cached; /* a piece was all uptodate when it was pinned */
	bool swapped;	  /* cache_write_end: fresh frames became an entry's */
	bool readahead;	  /* sequential READ: 2 MiB entries, filled whole */
	bool read_missed; /* READ: needed a backend read (cache_op_read_missed) */
	bool running, rerun, finished;
	struct cache_waiter waiter;
	struct cache_span *spans; /* BLOCK_STATUS: dirty ranges, sorted */
	size_t nspans;
	struct backend_io io; /* direct operations, mode none */
	uint8_t *own_data;    /* mode none READ: the backend read into this */
	struct cache_op *direct_next;
	struct cache_op *flush_next; /* FLUSH: waiting for or in a flush round */
	uint64_t write_seq;	     /* direct step: backend_writes_done after it */
	uint64_t loss_at_submit;     /* direct step: the backend's loss_seq when sent */
	uint64_t loss_at_start;	     /* direct: ... when its first step was sent */
	bool maybe_lost;	     /* direct step: a connection was lost meanwhile */
	/* Direct: the step in flight (the range registered), the length the
	 * next step may take, and when the step was sent (direct.c). */
	uint64_t step_offset, step_length, step_bytes, step_sent_ns;
	uint64_t throttle_seen;	   /* throttled WRITE: the cache's writebacks done */
	uint64_t throttle_seen_ns; /* ... when that count last moved */
	/* Direct, with a cache device: the record of its last step, and a
	 * FUA operation's wait for it to be durable there (direct.c). */
	uint64_t device_rec;
	struct cache_device_waiter device_wait;
};

/*
 * Traffic: one export's (cache_export_get_stats), or the whole cache's in
 * struct cache_stats, where every counter is the sum over the exports and
 * dirty_bytes and cached_bytes are the cache's own.
 */
/* A FLUSH's flag (struct cache_op): written back and flushed on the
 * backend, not answered from the cache device's log (cache-device flush). */
#define CACHE_FLUSH_WRITEBACK (1u << 16)
#define CACHE_COMMANDS (BACKEND_BLOCK_STATUS + 1)

struct cache_export_stats {
	uint64_t hits, misses, partial_hits;
	uint64_t backend_reads, backend_read_bytes, backend_writes, backend_write_bytes;
	uint64_t writeback_bytes, evictions, writeback_errors, bypass_reads, direct_writes;
	uint64_t writes_in_place; /* WRITEs received straight into the arena */
	/* ... of them, over dirty blocks: into fresh frames that then took the
	 * old ones' place (cached.c) */
	uint64_t writes_swapped;
	uint64_t throttled_writes; /* WRITEs that waited for writeback (throttle) */
	uint64_t dirty_bytes;  /* dirty, or being written back */
	uint64_t cached_bytes; /* arena bytes its entries hold */
	uint64_t unstable_bytes; /* written back, waiting for a backend flush */
	uint64_t backend_flushes, backend_flush_errors;
	uint64_t losses; /* times the backend may have lost unflushed writes */
	/* Client requests by command (index: enum backend_cmd), and how many
	 * of them carried FUA (cache_export_count_command). */
	uint64_t commands[CACHE_COMMANDS], fua_commands;
};

struct cache_stats {
	uint64_t cache_bytes, used_bytes, entries;
	struct cache_export_stats traffic;
	/* The index's memory: entries, side records, range nodes and their
	 * arrays, hash buckets, the ghost table (all of it, at capacity). */
	uint64_t metadata_bytes;
	/* The arena's tables (chunk records, the split chunks' per-frame
	 * tables with the block owners): they follow how split the arena is. */
	uint64_t arena_metadata_bytes;
	uint64_t free_2m_bytes;
	const char *arena;

	/* Defragmentation (compact.h). */
	uint64_t free_bytes_by_order[10]; /* free bytes in free blocks of order 0..9 */
	/*
	 * Fragmentation index, per mille: 1000 * (1 - free bytes in free 2 MiB
	 * blocks / all free bytes); 0 when nothing is free. 0 means every free
	 * byte can hold a 2 MiB entry, 1000 that none can.
	 */
	uint64_t fragmentation;
	uint64_t large_bytes;	     /* cached in 2 MiB (order-9) entries */
	uint64_t large_share;	     /* large_bytes per mille of the bytes in entries */
	uint64_t alloc_2m_attempts; /* entries created that asked for order 9 */
	uint64_t alloc_2m_ok;	     /* ... and got it */
	uint64_t alloc_failures;     /* entries not made: no room even after evicting */
	uint64_t compact_moves;	     /* entries moved */
	uint64_t compact_skipped_pinned; /* entries left in place: pinned */
	uint64_t compact_collapses;	 /* 2 MiB ranges collapsed into one entry */
	uint64_t entry_splits;		 /* entries split in two for a WRITE (cached.c) */
	uint64_t compact_chunks_freed;	 /* 2 MiB chunks emptied by compaction */
	uint64_t compact_passes;	 /* passes, background and on demand */
	uint64_t compact_ns;		 /* time spent in passes */
};

/* One on-demand compaction pass (cache_compact). */
struct cache_compact_result {
	uint64_t moved;		 /* entries moved */
	uint64_t skipped_pinned; /* entries not moved: pinned */
	uint64_t collapsed;	 /* 2 MiB device ranges collapsed */
	uint64_t freed_2m_chunks; /* 2 MiB chunks made whole */
	uint64_t time_ns;	  /* time the pass took */
	unsigned fragmentation_before, fragmentation_after; /* per mille, see cache_stats */
};

/*
 * Latency histograms, per export (its cache export: exports over one
 * backing share them, as they share the counters above). A slot of them
 * per thread that records: the NBD workers (struct worker index 0 to
 * workers - 1), the control thread (index workers) and the writeback
 * thread, each written by its own thread only (histogram.h), summed when
 * read. The client requests' kinds are recorded by the transmission phase,
 * from a request's arrival to its reply queued; CACHE_LATENCY_BACKEND by
 * the cache, each backend request from its submission to its completion.
 */
enum cache_latency {
	CACHE_LATENCY_READ_HIT,	 /* READ that needed no backend read */
	CACHE_LATENCY_READ_MISS, /* READ that did (a partial hit too) */
	CACHE_LATENCY_WRITE,
	CACHE_LATENCY_FLUSH,
	CACHE_LATENCY_BACKEND,
	CACHE_LATENCIES
};

/* Map the arena (before the daemon detaches: a shortage fails at start);
 * workers: the NBD worker threads that will record latencies;
 * device_wait_ms: how long a cache device another daemon holds is waited
 * for (a live upgrade's new daemon; 0: refused at once, device.h). */
int cache_create(const struct options *opts, unsigned workers, unsigned device_wait_ms,
		 struct cache **out);
/* Start the writeback thread (after fork). */
int cache_start(struct cache *c);
/*
 * Write back everything and flush the backends, then stop the writeback
 * thread. Blocks, calling progress(bytes not durable yet) about once a
 * second. When a backend refuses the data it says so and retries every
 * few seconds, keeping the data: a second SIGTERM/SIGINT then ends the
 * process with exit status 1, saying how many bytes are lost. Returns 0,
 * or -EIO when writes that went to a backend directly (not through the
 * cache) may have been lost at exit.
 */
int cache_stop(struct cache *c, void (*progress)(uint64_t remaining, void *arg), void *arg);
void cache_destroy(struct cache *c);
/* Is a cache device (--cache-device, device.h) in use? */
bool cache_device_attached(const struct cache *c);
/* The device (NULL: none), for the control socket's cache-device command. */
struct cache_device *cache_get_device(struct cache *c);
/* Is ce's data logged on the cache device (it has a slot there)? */
bool cache_export_on_device(const struct cache_export *ce);
/* Its figures; false when there is none. */
/* A debug hook (control.c, only with NBDCACHED_DEBUG_HOOKS set at start):
 * the idle entry holding ce's byte at offset is unpinned without a pin, so
 * that the pin invariant's NEVER fires (counted, logged, undone). True if
 * there was such an entry. */
bool cache_debug_unpin(struct cache_export *ce, uint64_t offset);
bool cache_get_device_stats(struct cache *c, struct cache_device_stats *out);

int cache_export_add(struct cache *c, struct backend *be, const struct export_spec *spec,
		     struct cache_export **out);
enum cache_mode cache_export_mode(const struct cache_export *ce);
/* Live policy changes (any thread): they apply to requests that start
 * afterwards. Switching to or from CACHE_MODE_NONE is the caller's to refuse
 * (that mode bypasses the cache, which would then hold stale data). */
void cache_export_set_mode(struct cache_export *ce, enum cache_mode mode);
void cache_export_set_watermarks(struct cache_export *ce, unsigned high_pct, unsigned low_pct);
void cache_set_writeback_policy(struct cache *c, unsigned high_pct, unsigned low_pct,
				unsigned expire_seconds);
/* Evict the export's clean entries that nothing uses; *kept: the bytes its
 * entries still hold (dirty, being written back, or pinned). Any thread. */
int cache_export_drop_clean(struct cache_export *ce, uint64_t *dropped, uint64_t *kept);
/* Evict the export's clean, unused entries that end past device offset
 * from; *busy: how many past it cannot go (dirty, unstable, under
 * writeback, pinned), *dirty_past: their dirty bytes past from. */
int cache_export_drop_from(struct cache_export *ce, uint64_t from, uint64_t *dropped,
			   uint64_t *busy, uint64_t *dirty_past);
/*
 * The export's backend is size bytes now (online resize): fills, readahead
 * and writeback stop at the new end, and what the cache holds past it (or
 * in a partial block at the old end) is dropped. -EBUSY when some of that
 * is dirty, unstable or in use (*dirty_past: its dirty bytes); the size is
 * then unchanged: flush and try again. The caller refuses requests past
 * a smaller end first, and serialises resizes. Any thread.
 */
int cache_export_resize(struct cache_export *ce, uint64_t size, uint64_t *dirty_past);
/* The export is gone and has no connection left: drop what it caches. Once
 * it holds nothing (0) its backend may be closed; -EBUSY while dirty or
 * pinned data remains (write it back first, then call again), or while a
 * cache device's record that all of it is on the backend is not durable
 * yet (call again). */
int cache_export_retire(struct cache_export *ce);
/* Is anything of the export not durable yet: dirty, unstable, or a
 * backend write no backend flush covered? (The reaper flushes until not.) */
bool cache_export_unflushed(struct cache_export *ce);
/* The export's error sequence (see "Durability" above): a connection
 * samples it when it starts, and FLUSH reports EIO once whenever it has
 * moved since. */
uint64_t cache_export_error_seq(struct cache_export *ce);

void cache_submit(struct cache_op *op);
/*
 * A WRITE received straight into the arena, instead of cache_submit(): op
 * filled as for it, payload NULL. 0: room is reserved (entries pinned)
 * and cache_op_segment() gives the arena segments the payload goes to, in
 * order; the caller must then call cache_write_end().
 * payload_here: the caller holds the whole payload already (it cannot be
 * cut short): it is copied into the entries at once, their blocks busy
 * meanwhile. Otherwise the payload goes into fresh frames, one whole
 * entry's for each piece, that replace the entries' at the end: nothing
 * is busy while it arrives, so a READ, writeback and a FLUSH go on as if
 * the WRITE had not been sent yet, however slowly its payload comes.
 * -EAGAIN: not possible now (not writeback mode, FUA, not whole blocks,
 * dirty data above a watermark, a piece not a whole entry once the
 * edges are split, no room at once, a block busy with payload_here):
 * nothing was done, cache_submit() it with its payload as usual. Never
 * waits.
 */
int cache_write_begin(struct cache_op *op, bool payload_here);
/* received bytes of the payload are in the segments: all of them (the
 * blocks become uptodate and dirty, once fills and writeback on the old
 * frames have ended), or fewer if the connection ended (nothing changes).
 * Finishes op, done() as after cache_submit() (maybe later): 0, or
 * -ECONNRESET. */
void cache_write_end(struct cache_op *op, uint64_t received);
/* READ result: segment i of the reply, in order; false past the last.
 * *may_hold_zeros false: no 4 KiB block in it is all zeros (skip looking). */
bool cache_op_segment(const struct cache_op *op, size_t i, const uint8_t **data, size_t *len,
		      bool *may_hold_zeros);
void cache_op_release(struct cache_op *op);
/* READ result: is its data in the arena, pinned until cache_op_release()
 * (the reply must count it, budget_pin)? False in mode none. */
static inline bool cache_op_pins_arena(const struct cache_op *op)
{
	return !op->own_data;
}

/* Is [p, p + n) all zero bytes? (n >= 16) */
bool cache_all_zero(const uint8_t *p, size_t n);

void cache_get_stats(struct cache *c, struct cache_stats *out);
void cache_export_get_stats(struct cache_export *ce, struct cache_export_stats *out);
/*
 * One client request answered, on worker w (its own slot: no lock, no
 * read-modify-write): its latency in the histogram of kind (none when
 * CACHE_LATENCIES), the bytes a successful READ or WRITE moved, whether
 * it failed (an error reply).
 */
struct cache_reply {
	enum cache_latency kind;
	uint64_t ns;
	uint64_t read_bytes, written_bytes;
	bool failed;
};
void cache_export_record_reply(struct cache_export *ce, const struct worker *w,
			       const struct cache_reply *r);
/* What the workers counted of ce's replies (cache_export_record_reply). */
struct cache_reply_stats {
	uint64_t read_bytes, written_bytes, errors;
};
void cache_export_get_reply_stats(struct cache_export *ce, struct cache_reply_stats *out);
/* The histogram of one kind, summed over the threads (any thread). */
void cache_export_get_latency(struct cache_export *ce, enum cache_latency kind,
			      struct histogram *out);
/* "read_hit", "read_miss", "write", "flush", "backend" (stats, /metrics). */
const char *cache_latency_name(enum cache_latency kind);
/* A finished READ: did it need a backend read (else it was a hit)? */
static inline bool cache_op_read_missed(const struct cache_op *op)
{
	return op->read_missed;
}
/* Count one client request (statistics only: what clients asked for, not
 * what reached the backend). Any thread. */
void cache_export_count_command(struct cache_export *ce, enum backend_cmd cmd, uint32_t flags);
/*
 * Run one full compaction pass now: compaction of the sparsest chunks as
 * far as free memory allows, collapse of every 2 MiB device range covered
 * by small unpinned entries, and compaction again. Fills *out (may be
 * NULL). Blocks the calling thread, which must not be a worker (about 1 s
 * per GiB of arena at worst); waits for a background pass to end first.
 * Runs whether or not background compaction is on. Returns 0.
 */
int cache_compact(struct cache *c, struct cache_compact_result *out);
/* Log the statistics (SIGUSR1). */
void cache_log_stats(struct cache *c);

#endif
