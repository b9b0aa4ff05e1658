/*
 * daemon/cache/cached_receive.c: a cached WRITE received straight into the
 * arena (the operations layer, ops.h; the pieces are cached.c's).
 *
 * Received into the arena (cache_write_begin): a WRITE of whole blocks
 * whose entries exist or can be made at once may take room before its
 * payload is read, and the connection then reads the payload from the
 * socket straight into the arena, with no buffer of the request's.
 *
 *   a payload still to come goes into fresh frames, one whole entry's for
 *   each piece (fit_edge splits the entries at the WRITE's two edges to
 *   make it so; pieces of FIT_MIN_BYTES or more), and nothing is marked
 *   busy meanwhile: a READ sends the old data or fills the old frames,
 *   writeback writes the old dirty data and a FLUSH completes, however
 *   slowly the payload comes (a FLUSH covers only acknowledged writes).
 *   Once the payload is whole, cached_received_step() waits for any fill
 *   or writeback on the old frames to end, then makes the fresh frames the
 *   entry's and frees the old (piece_swap), or, if someone else pins the
 *   entry, copies them over the old. A payload cut short only frees the
 *   fresh frames: nothing changed.
 *   a payload already received whole (it came with its header) cannot be
 *   cut short: it is copied into the entries at once, their blocks busy
 *   for that moment.
 *
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"

/* A piece at least this large is worth splitting the entries at a WRITE's
 * edges for, so that it covers an entry whole and can be received into
 * fresh frames (below); a smaller piece in a larger entry is copied from a
 * buffer of its own, which costs little. */
#define FIT_MIN_BYTES (64u << 10)

/*
 * The entry holding the device byte at, if it reaches out of [offset,
 * end): split it (cache_entry_split) until the part inside is an entry of
 * its own, or is smaller than FIT_MIN_BYTES, or the entry cannot be split
 * now (pinned, busy, under writeback or unstable).
 */
static void fit_edge(struct cache_export *ce, uint64_t at, uint64_t offset, uint64_t end)
{
	struct cache_shard *sh = shard_of(ce, at);
	pthread_mutex_lock(&sh->lock);
	for (;;) {
		struct cache_entry *e = cache_lookup(ce, sh, at >> ARENA_FRAME_SHIFT);
		if (!e)
			break;
		uint64_t base = cache_entry_offset(e), stop = base + cache_entry_bytes(e);
		uint64_t lo = base > offset ? base : offset, hi = stop < end ? stop : end;
		if ((base >= offset && stop <= end) || hi - lo < FIT_MIN_BYTES ||
		    cache_entry_split(ce, e) < 0)
			break;
	}
	pthread_mutex_unlock(&sh->lock);
}

/*
 * Does a large piece of op lie in an entry reaching out of it, and could
 * the WRITE be received once it is split? Not if an entry that reaches
 * out is busy, under writeback or unstable (cache_entry_split would refuse
 * it).
 */
static bool piece_whole(const struct cache_piece *p)
{
	return p->offset == cache_entry_offset(p->entry) &&
	       p->length == cache_entry_bytes(p->entry);
}

static bool pieces_need_fitting(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	/* Without a lock first: most WRITEs have no large piece reaching out
	 * (a pinned entry's extent does not change). */
	bool need = false;
	for (size_t i = 0; i < op->npieces && !need; i++)
		need = op->pieces[i].length >= FIT_MIN_BYTES && !piece_whole(&op->pieces[i]);
	if (!need)
		return false;
	for (size_t i = 0; i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		struct cache_entry *e = p->entry;
		if (piece_whole(p))
			continue;
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		bool hopeless = map_any(cache_busy_map(e), cache_entry_nblocks(e)) ||
				cache_entry_writeback(e) || cache_entry_on_unstable_list(e);
		pthread_mutex_unlock(&sh->lock);
		if (hopeless)
			return false;
	}
	return true;
}

/* Undo cache_write_begin() for pieces [0, n), before any byte of the
 * payload landed in the entries: fresh frames freed, busy blocks cleared
 * (their state is as it was). */
static void pieces_unmark(struct cache_op *op, size_t n)
{
	struct cache_export *ce = op->ce;
	for (size_t i = 0; i < n; i++) {
		struct cache_piece *p = &op->pieces[i];
		if (p->swap) {
			arena_free(&ce->cache->arena, p->fresh, cache_entry_order(p->entry));
			p->swap = false;
			continue;
		}
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		for (uint32_t b = first; b <= last; b++)
			map_clear(cache_busy_map(p->entry), b);
		pthread_mutex_unlock(&sh->lock);
	}
	if (n)
		cache_waitq_wake(ce->cache);
}

int cache_write_begin(struct cache_op *op, bool payload_here)
{
	struct cache_export *ce = op->ce;
	op_reset(op);
	uint64_t end = op->offset + op->length;
	if (end > ce->size) /* a resize cut the export since: cache_submit() refuses it */
		return -EAGAIN;
	if (atomic_load(&ce->backend->fenced)) /* cache_submit() fails it */
		return -EAGAIN;
	if (cache_export_mode(ce) != CACHE_MODE_WRITEBACK || (op->flags & BACKEND_FUA) ||
	    op->cmd != BACKEND_WRITE || !op->length || (op->offset & (ce->block_size - 1)) ||
	    ((end & (ce->block_size - 1)) && end != ce->size))
		return -EAGAIN;
	/* Above the high watermark, writes take the path that waits for writeback. */
	if (throttle_over_high(ce))
		return -EAGAIN;
	int rc = pieces_build(op, true, true);
	/* A payload still to come goes into whole entries only (below): split
	 * the two at the edges (the only ones that can reach out), build
	 * again. Only for edges at multiples of FIT_MIN_BYTES: other edges
	 * would end in a smaller piece, which goes the buffer path anyway. */
	if (rc == 0 && !payload_here && op->offset % FIT_MIN_BYTES == 0 &&
	    end % FIT_MIN_BYTES == 0 && pieces_need_fitting(op)) {
		pieces_unreserve(op, op->npieces);
		pieces_release(op);
		fit_edge(ce, op->offset, op->offset, end);
		fit_edge(ce, end - 1, op->offset, end);
		rc = pieces_build(op, true, true);
	}
	size_t marked = 0; /* pieces [0, marked) are busy or have fresh frames */
	for (size_t i = 0; rc == 0 && i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		struct cache_entry *e = p->entry;
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		if (payload_here) {
			/* Copied at once (conn_sink_start), like any payload
			 * already received: the blocks are busy for a moment. */
			struct cache_map busy = cache_busy_map(e);
			for (uint32_t b = first; b <= last && rc == 0; b++)
				if (map_test(busy, b))
					rc = -EAGAIN; /* a fill, writeback or write is on it */
			for (uint32_t b = first; b <= last && rc == 0; b++)
				map_set(busy, b);
		} else {
			/* Whole entries only, into fresh frames. */
			int64_t fresh = -1;
			if (!piece_whole(p))
				rc = -EAGAIN;
			else
				fresh =
				    cache_alloc_evicting(ce->cache, sh, cache_entry_order(e), 32);
			if (rc == 0 && fresh < 0)
				rc = -EAGAIN; /* no room: the buffer and copy path */
			p->swap = fresh >= 0;
			p->fresh = fresh >= 0 ? (uint32_t)fresh : 0;
		}
		if (rc == 0)
			marked++;
		pthread_mutex_unlock(&sh->lock);
	}
	if (rc < 0) {
		pieces_unmark(op, marked);
		pieces_unreserve(op, op->npieces);
		pieces_release(op);
		return -EAGAIN;
	}
	return 0;
}

/*
 * The payload of swap piece p is in its fresh frames, whole: they become
 * the entry's, and the old ones go. Unless someone else pins the entry (a
 * READ sending from it, writeback about to read it): then the payload is
 * copied over the old frames, as any WRITE's is. Shard lock held; the
 * blocks are busy. True if swapped.
 */
static bool piece_swap(struct cache_export *ce, struct cache_shard *sh, struct cache_piece *p)
{
	struct cache_entry *e = p->entry;
	struct arena *a = &ce->cache->arena;
	unsigned order = cache_entry_order(e);
	uint32_t old = e->frame;
	bool alone = (atomic_load_explicit(&e->hot, memory_order_acquire) & CACHE_PINS_MASK) == 1;
	if (alone) {
		e->frame = p->fresh;
		arena_set_owner(a, p->fresh, cache_entry_index(e));
	} else {
		/* Pinned and busy, the entry stays where it is meanwhile. */
		pthread_mutex_unlock(&sh->lock);
		memcpy(arena_address(a, old), arena_address(a, p->fresh), p->length);
		pthread_mutex_lock(&sh->lock);
	}
	arena_free(a, alone ? old : p->fresh, order);
	p->swap = false;
	return alone;
}

void cache_write_end(struct cache_op *op, uint64_t received)
{
	if (received == op->length) {
		op->stage = OP_STAGE_RECEIVED;
		op_run(op);
		return;
	}
	/* Cut short. A swap piece's entry was never touched: its fresh
	 * frames go. A piece received in place had its payload here whole
	 * (it cannot be cut short): only a failure before any byte moved
	 * (received 0) ends here, and its blocks are as they were. */
	pieces_unmark(op, op->npieces);
	pieces_release(op);
	op_finish(op, -ECONNRESET);
}

void cached_received_step(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	uint64_t seq = cache_waitq_seq(ce->cache);
	/* Before the first piece is committed (later ones are covered: a
	 * committed piece is dirty, the others pinned, a cut is refused). */
	bool untouched = true;
	for (size_t i = 0; i < op->npieces && untouched; i++)
		untouched = op->pieces[i].entry != NULL;
	if (untouched && write_past_end(op)) {
		pieces_unmark(op, op->npieces);
		pieces_release(op);
		op_finish(op, -ENOSPC);
		return;
	}
	for (size_t i = 0; i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		struct cache_entry *e = p->entry;
		if (!e)
			continue; /* committed already */
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		struct cache_map busy = cache_busy_map(e);
		if (p->swap) {
			/* A fill or writeback on the old frames ends first. */
			if (map_any(busy, cache_entry_nblocks(e))) {
				pthread_mutex_unlock(&sh->lock);
				op_wait(op, seq);
				return;
			}
			for (uint32_t b = first; b <= last; b++)
				map_set(busy, b);
			op->swapped |= piece_swap(ce, sh, p);
		}
		piece_commit(ce, sh, p, first, last);
	}
	pieces_release(op);
	kick_if_above_high(ce);
	atomic_fetch_add(&ce->counters.writes_in_place, 1);
	if (op->swapped)
		atomic_fetch_add(&ce->counters.writes_swapped, 1);
	op_finish(op, 0);
}
