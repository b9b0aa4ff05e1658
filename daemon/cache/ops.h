/*
 * daemon/cache/ops.h: the operations layer: NBD commands carried out on
 * the index (internal.h), every one but FLUSH, which cache_submit
 * (lifecycle.c) hands to the writeback thread's rounds (flush.c).
 *
 *   op.c            the state machine driver: op_run() steps an op until
 *                   it finishes, on its worker; waiting and finishing
 *   cached.c        READ, CACHE and cached WRITE: pieces, fills, commit
 *   cached_receive.c  a cached WRITE received straight into the arena
 *   direct.c        direct operations (TRIM, WRITE_ZEROES, FUA writes,
 *                   writes that go around the cache) and their ordering
 *                   against each other and against writeback; mode
 *                   none's pass-through
 *   block_status.c  BLOCK_STATUS: the backend's extents, dirty data as data
 *   throttle.c      the write throttle: cached WRITEs wait at the high
 *                   watermark for writeback to keep up
 *
 * What the layers above use of it: cache_direct_overlaps (writeback.c
 * leaves registered direct ranges alone), op_reset and op_submit
 * (cache_submit). Everything else here is shared by the files above only.
 * An op is touched by its worker thread only; the locks are the index's
 * (cache.h). Nothing outside daemon/cache/ includes this.
 */
#ifndef NBDCACHED_DAEMON_CACHE_OPS_H
#define NBDCACHED_DAEMON_CACHE_OPS_H

#include "daemon/cache/internal.h"

/* ---- for the layers above ---- */

/* Reset the cache's private fields of op (every command, FLUSH too). */
void op_reset(struct cache_op *op);
/* Start op (any command but FLUSH): done() runs on op->worker, maybe
 * before this returns. */
void op_submit(struct cache_op *op);
/* direct.c: is a direct operation in flight over [offset, offset+length)?
 * Export lock held. */
bool cache_direct_overlaps(struct cache_export *ce, uint64_t offset, uint64_t length);
/* direct.c, for flush_log.c: the registered step over the range starting
 * first whose record is in the cache device's log, or about to be
 * (step_log), or NULL. Export lock held. */
const struct cache_op *cache_direct_logged_first(struct cache_export *ce, uint64_t offset,
						  uint64_t length);
/* direct.c, for direct_shadow.c: is a writeback in flight over the range
 * (-ENOMEM: no memory to look)? op (a registered range) leaves the export's
 * list, and the waiters are woken. */
int cache_range_writing(struct cache_export *ce, uint64_t offset, uint64_t length, bool *writing);
void cache_direct_unlink(struct cache_export *ce, struct cache_op *op);
/* direct_shadow.c (below), for the flush rounds. */

/* ---- direct_shadow.c: direct steps kept until a backend flush covers
 * them, written again after a loss (with a cache device) ---- */

struct direct_shadow;
struct shadow_pass;
/* Are ce's direct steps kept (an export on a cache device, not a shared
 * backend)? */
bool cache_shadow_kept(const struct cache_export *ce);
/* A direct step done on the backend (seq: its write_seq; maybe_lost: a
 * loss since it was sent), kept; not kept without memory (then
 * cache_note_unshadowed). Any worker. */
void cache_shadow_add(struct cache_export *ce, enum backend_cmd cmd, uint32_t flags,
		      uint64_t offset, uint64_t length, const void *data, uint64_t seq,
		      bool maybe_lost);
/* A backend flush covered every write up to covered: those steps go. */
void cache_shadow_trim(struct cache_export *ce, uint64_t covered);
/* A loss: every step kept is to be written again; false when none is. */
bool cache_shadow_redo(struct cache_export *ce);
/* Before a round sends its flush (writeback thread w): 0 nothing to
 * write again, 1 a pass is writing steps again (wait on the waitq),
 * -errno it failed (the round fails; the next tries again). */
int cache_shadow_busy(struct cache_export *ce, struct worker *w);
/* Steps to write again, or a pass at it (a log round waits: full round). */
bool cache_shadow_pending(struct cache_export *ce);
void cache_shadow_free(struct cache_export *ce);

/* ---- op.c ---- */

/* Run op's steps until it waits or finishes; re-entrant (a completion may
 * run inside a step: the step is then run again). */
void op_run(struct cache_op *op);
/* op is done; done() may free the op: inside op_run it is deferred to
 * op_run's end. */
void op_finish(struct cache_op *op, int result);
/* Run op again once the cache changes after seq (cache_waitq_seq). */
void op_wait(struct cache_op *op, uint64_t seq);

/* ---- cached.c ---- */

/* One entry's part of a READ or cached WRITE (cached.c and cached_receive.c). */
struct cache_piece {
	uint64_t offset;
	uint32_t length;
	struct cache_entry *entry; /* pinned; NULL for a bypass piece */
	uint8_t *buf;		   /* bypass data */
	bool ready;
	bool issued; /* bypass read submitted */
	/* cache_write_begin over dirty blocks: the payload goes into these
	 * frames (allocated, no owner yet), which replace the entry's at the
	 * end (cache_write_end) */
	bool swap;
	uint32_t fresh;
};

/* Shared by cached.c and cached_receive.c: */
/* Split op into pieces, one per entry it touches, pinned (allocate: make
 * entries where none are; need_all: -ENOSPC unless every piece has one). */
int pieces_build(struct cache_op *op, bool allocate, bool need_all);
/* Give back the side records of pieces [0, n) not needed after all. */
void pieces_unreserve(struct cache_op *op, size_t n);
/* The blocks of piece p's entry it covers, and its shard, locked. */
struct cache_shard *piece_lock(struct cache_export *ce, const struct cache_piece *p,
			       uint32_t *first, uint32_t *last);
/* A WRITE's piece whose payload is in its entry's frames (its blocks
 * [first, last] busy, shard sh locked): uptodate and dirty, the lock
 * dropped, waiters woken, the entry unpinned. */
void piece_commit(struct cache_export *ce, struct cache_shard *sh, struct cache_piece *p,
		  uint32_t first, uint32_t last);
/* Dirty data above a high watermark: get writeback going. */
void kick_if_above_high(struct cache_export *ce);
/* A resize cut the export below this WRITE's end since it was admitted
 * (asked once its pieces hold their entries, before a byte lands). */
bool write_past_end(const struct cache_op *op);


/* READ, CACHE, WRITE: pin the pieces (a WRITE with no room, or not in
 * writeback mode, stays a direct operation). 0 or -errno. */
int cached_prepare(struct cache_op *op);
/* One step of a READ, CACHE or cached WRITE. */
void cached_step(struct cache_op *op);
/* A WRITE in writeback mode (admitted by the throttle): pin room for every
 * piece (stage -1, a cached write), or, with no room, stay a direct write
 * and kick writeback. 0 or -errno. */
int cached_write_room(struct cache_op *op);
/* Unpin and free op's pieces. */
void pieces_release(struct cache_op *op);

/* ---- cached_receive.c ---- */

/* op->stage of a WRITE whose payload came whole (cache_write_end): its
 * pieces are committed, fresh frames swapped in, by cached_received_step. */
#define OP_STAGE_RECEIVED (-3)
/* One step of such a WRITE: waits while a fill or writeback is on an
 * entry's old frames. */
void cached_received_step(struct cache_op *op);

/* ---- throttle.c ---- */

/* op->stage of a WRITE waiting for writeback to bring dirty data down. */
#define OP_STAGE_THROTTLED (-2)
/* A WRITE in writeback mode (no FUA), before it takes room: should it wait
 * (dirty data above a high watermark)? true: it is OP_STAGE_THROTTLED and
 * op_run steps it with throttle_step. */
bool throttle_write(struct cache_op *op);
/* Is dirty data above the high watermark, ce's or the cache's (not counting
 * exports whose writeback is failing)? Where a WRITE would wait. */
bool throttle_over_high(struct cache_export *ce);
/* One step of a throttled WRITE: wait, or admit it (cached_write_room). */
void throttle_step(struct cache_op *op);
/* The writeback thread's tick: wake throttled writes so they look again
 * (their patience runs out even when nothing completes). */
void throttle_tick(struct cache *c);

/* ---- direct.c ---- */

/* One step of a direct operation. */
void direct_step(struct cache_op *op);
/* Mode none: send op (any command but FLUSH) to the backend as it is; a
 * READ into op->own_data. Finishes op. */
void passthrough_start(struct cache_op *op);

/* ---- block_status.c ---- */

/* The dirty ranges, then the backend's extents, overlaid; finishes op. */
void block_status_start(struct cache_op *op);

/* ---- entry geometry ---- */

static inline struct cache_shard *shard_of(struct cache_export *ce, uint64_t offset)
{
	return cache_shard_for(ce->cache, ce, offset >> CACHE_RANGE_SHIFT);
}

/* The largest order whose entry fits in length bytes (at most 2 MiB). */
static inline unsigned order_for_length(uint64_t length)
{
	unsigned o = 0;
	while (o < ARENA_MAX_ORDER && ((uint64_t)ARENA_FRAME_SIZE << (o + 1)) <= length)
		o++;
	return o;
}

/* First and last block of e that [offset, offset+length) touches. */
static inline void piece_blocks(const struct cache_entry *e, uint64_t offset, uint64_t length,
				uint32_t *first, uint32_t *last)
{
	unsigned shift = cache_entry_export(e)->block_shift;
	uint64_t base = cache_entry_offset(e);
	*first = (uint32_t)((offset - base) >> shift);
	*last = (uint32_t)((offset + length - 1 - base) >> shift);
}

/* Device range of block b of e, clipped to the export. */
static inline void block_range(const struct cache_entry *e, uint32_t b, uint64_t *start,
			       uint64_t *end)
{
	const struct cache_export *ce = cache_entry_export(e);
	*start = cache_entry_offset(e) + ((uint64_t)b << ce->block_shift);
	*end = *start + ce->block_size;
	if (*end > ce->size)
		*end = ce->size;
}

#endif
