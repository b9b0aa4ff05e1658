/*
 * daemon/cache/compact.c: see compact.h.
 *
 * A pass:
 *
 *   compaction  arena_sparse_chunks() lists whole chunks that are neither
 *               empty nor full, emptiest first. For each, while the
 *               fragmentation index is above the pass's target:
 *
 *                 isolate the chunk        its free blocks leave the free
 *                                          lists, frees into it are held
 *                 for each block in it     lock its entry's shard, check the
 *                                          entry still owns it and is not
 *                                          pinned, copy it to a hole that is
 *                                          not a free 2 MiB block, update the
 *                                          handle, free the old block (held)
 *                 un-isolate               the held blocks merge; if every
 *                                          entry left, one free 2 MiB block
 *
 *               A pinned entry ends the chunk's turn (the blocks already
 *               moved stay moved); so does a block whose owner is not set
 *               yet (an entry being created) and an entry that finds no
 *               hole of its size. In a pass that a nudge started (room is
 *               wanted: the arena is full), a clean entry not hit since it
 *               was queued is evicted rather than moved.
 *   collapse    every range node of every export whose entries are all
 *               smaller than 2 MiB and together cover its 2 MiB, none pinned,
 *               gets one order-9 entry: the data copied in, the bits merged,
 *               the old entries' places in the dirty list and the S3-FIFO
 *               queues taken over.
 *
 * Why a move is safe (cache.h): an arena address is used only while the
 * entry is pinned, or under its shard lock. A pin is taken under the shard
 * lock, or under the export lock for an entry on the dirty list; the latter
 * kind of pinner takes the shard lock before it reads the location. So a
 * move done under the shard lock, after seeing no pin, cannot be seen half
 * done. A collapse frees the old handles, so it also re-checks their pins
 * under the export lock and unlinks them from the dirty list in the same
 * hold: nobody can find them after that.
 *
 * Finding an entry from a block: the arena keeps each block's owner, its
 * entry's slot index (set under the arena lock once the entry is in the
 * index, cleared when the block is freed, which is before its slot is
 * freed). The compactor reads the owner's export and device frame under
 * the arena lock, takes that shard's lock, and checks the owner again:
 * then the entry is alive and in that shard.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cache/compact.h"
#include "daemon/cache/internal.h"
#include "daemon/log.h"

#define SPARSE_BATCH 64
/* A background pass stops compacting at this index (per mille). */
#define BACKGROUND_TARGET 50
/* After a nudge (a large allocation fell back), keep this share of the
 * arena free (1/RESERVE_DIVISOR), at least RESERVE_MIN_FRAMES (enough holes
 * to empty a few chunks into) and at most RESERVE_MAX_FRAMES or a quarter
 * of the arena, so that there is something to gather: a sequential stream
 * eats a free 2 MiB block per 2 MiB it reads. */
#define RESERVE_DIVISOR 16
#define RESERVE_MIN_FRAMES (4 * ARENA_CHUNK_FRAMES)
#define RESERVE_MAX_FRAMES (128 * ARENA_CHUNK_FRAMES)

struct compactor {
	struct cache *cache;
	bool enabled;
	uint64_t interval_ns;
	unsigned threshold;

	pthread_mutex_t pass_lock; /* one pass at a time */
	struct arena_block blocks[ARENA_CHUNK_FRAMES]; /* under pass_lock */

	/* Under the cache's nudge lock (struct cache_nudge, internal.h), on
	 * whose condition variable the thread sleeps: */
	bool started, stopping;
	pthread_t thread;
};

static uint64_t elapsed_since(uint64_t t0)
{
	return clock_now_ns() - t0;
}

unsigned cache_fragmentation(struct cache *c)
{
	uint64_t by_order[ARENA_ORDERS];
	arena_free_by_order(&c->arena, by_order);
	return arena_fragmentation(by_order);
}

/* Free frames not in free 2 MiB blocks: what compaction can gather. */
static uint64_t scattered_free_frames(struct cache *c)
{
	uint64_t by_order[ARENA_ORDERS], n = 0;
	arena_free_by_order(&c->arena, by_order);
	for (unsigned o = 0; o < ARENA_MAX_ORDER; o++)
		n += by_order[o];
	return n;
}

/* Can a chunk be made whole? Moving needs as many free frames elsewhere as
 * it holds; evicting (a nudged pass) needs only some free memory at all. */
static bool worth_trying(struct cache *c, bool evict)
{
	uint64_t scattered = scattered_free_frames(c);
	return evict ? scattered > 0 : scattered >= ARENA_CHUNK_FRAMES;
}

static bool entry_movable(struct cache_entry *e)
{
	if (cache_entry_pinned(e) || cache_entry_writeback(e))
		return false;
	if (map_any(cache_busy_map(e), cache_entry_nblocks(e)))
		return false; /* cannot be without a pin; survivable */
	return true;
}

enum move_result { MOVE_DONE, MOVE_EVICTED, MOVE_GONE, MOVE_PINNED, MOVE_NO_ROOM, MOVE_UNOWNED };

/* Move the entry owning block b of the isolated chunk elsewhere; with
 * evict, a cold clean entry is evicted instead (room is wanted anyway). */
static enum move_result move_block(struct cache *c, const struct arena_block *b, bool evict)
{
	struct arena *a = &c->arena;
	if (b->owner == ARENA_NONE)
		return MOVE_UNOWNED;
	/* The slot stays an entry's slot (pools keep their chunks); whose, the
	 * owner read under the arena lock says. */
	struct cache_entry *e = cache_entry_at(c, b->owner);
	pthread_mutex_lock(&a->lock);
	if (arena_owner_locked(a, b->frame) != b->owner) {
		pthread_mutex_unlock(&a->lock);
		return MOVE_GONE; /* freed since: held back in the chunk */
	}
	struct cache_export *ce = cache_entry_export(e);
	uint64_t first_frame = cache_entry_first_frame(e);
	pthread_mutex_unlock(&a->lock);

	struct cache_shard *sh =
		cache_shard_for(c, ce, first_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
	pthread_mutex_lock(&sh->lock);
	pthread_mutex_lock(&a->lock);
	bool same = arena_owner_locked(a, b->frame) == b->owner && cache_entry_export(e) == ce &&
		    cache_entry_first_frame(e) == first_frame && e->frame == b->frame;
	pthread_mutex_unlock(&a->lock);
	enum move_result result = MOVE_GONE;
	if (!same)
		goto out;
	result = MOVE_PINNED;
	if (!entry_movable(e))
		goto out;
	result = MOVE_EVICTED;
	if (evict && cache_entry_evict_cold(c, sh, e))
		goto out;
	/* Never break a free 2 MiB block to empty another chunk. */
	unsigned order = cache_entry_order(e);
	int64_t to = arena_alloc_max(a, order, ARENA_MAX_ORDER - 1);
	result = MOVE_NO_ROOM;
	if (to < 0)
		goto out;
	memcpy(arena_address(a, (uint32_t)to), arena_address(a, e->frame),
	       (size_t)cache_entry_bytes(e));
	uint32_t from = e->frame;
	e->frame = (uint32_t)to;
	arena_set_owner(a, (uint32_t)to, b->owner);
	arena_free(a, from, order); /* held back: the chunk is isolated */
	result = MOVE_DONE;
out:
	pthread_mutex_unlock(&sh->lock);
	return result;
}

/*
 * Empty one chunk. Returns 1 if it came back whole, 0 if not, -ENOSPC if
 * an entry found no hole of its size (the chunk's turn ends there).
 */
static int evacuate(struct compactor *k, uint32_t chunk, bool evict,
		    struct cache_compact_result *res)
{
	struct cache *c = k->cache;
	size_t n;
	if (arena_isolate_chunk(&c->arena, chunk, k->blocks, &n) < 0)
		return 0;
	int rc = 0;
	for (size_t i = 0; i < n && rc == 0; i++) {
		switch (move_block(c, &k->blocks[i], evict)) {
		case MOVE_DONE:
			res->moved++;
			break;
		case MOVE_EVICTED:
		case MOVE_GONE:
			break;
		case MOVE_PINNED:
			res->skipped_pinned++;
			rc = 1; /* the chunk's turn is over */
			break;
		case MOVE_UNOWNED:
			rc = 1;
			break;
		case MOVE_NO_ROOM:
			rc = -ENOSPC;
			break;
		}
	}
	bool whole = arena_unisolate(&c->arena);
	if (whole)
		res->freed_2m_chunks++;
	return rc == -ENOSPC ? rc : whole;
}

/*
 * Compact until the index is at most target or nothing more can be done:
 * a batch of candidates that yields no whole chunk, or NO_ROOM_LIMIT chunks
 * in a row whose entries found no hole of their size.
 */
#define NO_ROOM_LIMIT 8
static void compact_chunks(struct compactor *k, unsigned target, bool evict,
			   struct cache_compact_result *res)
{
	struct cache *c = k->cache;
	uint32_t cand[SPARSE_BATCH];
	uint32_t rounds = c->arena.nchunks + 1;
	unsigned no_room = 0;
	while (rounds--) {
		if (cache_fragmentation(c) <= target || !worth_trying(c, evict))
			return;
		size_t n = arena_sparse_chunks(&c->arena, cand, SPARSE_BATCH);
		bool progress = false;
		for (size_t i = 0; i < n; i++) {
			if (cache_fragmentation(c) <= target || !worth_trying(c, evict))
				return;
			int rc = evacuate(k, cand[i], evict, res);
			if (rc < 0 && ++no_room >= NO_ROOM_LIMIT)
				return;
			if (rc >= 0)
				no_room = 0;
			if (rc > 0)
				progress = true;
		}
		if (!progress)
			return;
	}
}

/* Merge the bits of small entry e into the order-9 entry ne. */
static void merge_bits(struct cache_entry *ne, struct cache_entry *e, uint64_t base_frame)
{
	unsigned shift = cache_entry_export(e)->block_shift;
	uint32_t at = (uint32_t)(((cache_entry_first_frame(e) - base_frame) << ARENA_FRAME_SHIFT) >>
				 shift);
	uint32_t n = cache_entry_nblocks(e);
	map_copy(cache_uptodate_map(ne), at, cache_uptodate_map(e), 0, n);
	map_copy(cache_dirty_map(ne), at, cache_dirty_map(e), 0, n);
	cache_entry_ext(ne)->ndirty += cache_entry_ndirty(e);
	if (cache_entry_may_hold_zeros(e))
		cache_entry_set_may_hold_zeros(ne);
	if (e->unproven)
		ne->unproven = 1;
}

/*
 * Give ne the dirty-list place of the oldest of old[] and unlink them all.
 * Export lock held.
 */
static void dirty_list_take_over(struct cache_export *ce, struct cache_entry **old, size_t n,
				 struct cache_entry *ne)
{
	struct cache *c = ce->cache;
	struct cache_entry *oldest = NULL;
	for (size_t i = 0; i < n; i++)
		if (cache_entry_on_dirty_list(old[i]) &&
		    (!oldest || cache_entry_dirty_since(old[i]) < cache_entry_dirty_since(oldest)))
			oldest = old[i];
	if (!oldest)
		return;
	/* ne goes in just before the oldest, then the old ones leave. */
	struct cache_entry_ext *nx = cache_entry_ext(ne), *ox = cache_entry_ext(oldest);
	uint32_t ni = cache_entry_index(ne);
	nx->dirty_since = ox->dirty_since;
	nx->on_dirty_list = true;
	nx->dirty_link.next = cache_entry_index(oldest);
	nx->dirty_link.prev = ox->dirty_link.prev;
	if (ox->dirty_link.prev)
		cache_entry_ext(cache_entry_at(c, ox->dirty_link.prev))->dirty_link.next = ni;
	else
		ce->dirty_head = ne;
	ox->dirty_link.prev = ni;
	for (size_t i = 0; i < n; i++)
		if (cache_entry_on_dirty_list(old[i]))
			cache_dirty_list_remove(ce, old[i]);
}

/*
 * ne takes over the unlogged-list places of old[] (none is unstable or
 * being written: only dirty blocks count): the next log round copies it
 * if it would have copied any of them. Shard and export locks held.
 */
static void unlogged_take_over(struct cache_export *ce, struct cache_entry **old, size_t n,
			       struct cache_entry *ne)
{
	bool unlogged = false;
	for (size_t i = 0; i < n; i++) {
		struct cache_entry_ext *x = cache_entry_ext(old[i]);
		if (x && x->on_unlogged_list) {
			unlogged = true;
			cache_unlogged_remove(ce, old[i]);
		}
	}
	if (unlogged)
		cache_unlogged_add(ce, ne);
	else
		cache_entry_ext(ne)->logged = true;
}

/* Collapse the range node of index if it qualifies: 1 done, 0 not,
 * -ENOSPC no free 2 MiB block, -ENOMEM. */
static int collapse_range(struct cache *c, struct cache_export *ce, uint64_t index,
			  struct cache_compact_result *res)
{
	struct arena *a = &c->arena;
	struct cache_shard *sh = cache_shard_for(c, ce, index);
	struct cache_entry **old = NULL;
	struct cache_entry *ne = NULL;
	int64_t frame = -1;
	int rc = 0;
	pthread_mutex_lock(&sh->lock);
	struct cache_range *r = cache_range_get(sh, ce, index);
	if (!r || r->count < 2)
		goto out;
	uint64_t frames = 0;
	for (uint32_t i = 0; i < r->count; i++) {
		struct cache_entry *e = cache_range_entry(r, i);
		if (cache_entry_order(e) >= ARENA_MAX_ORDER)
			goto out;
		frames += 1ull << cache_entry_order(e);
	}
	if (frames != ARENA_CHUNK_FRAMES)
		goto out; /* entries never overlap: this is full coverage */
	for (uint32_t i = 0; i < r->count; i++) {
		if (!entry_movable(cache_range_entry(r, i))) {
			res->skipped_pinned++;
			goto out;
		}
		/* Waiting for a backend flush: the flush settles it by handle. */
		if (cache_entry_on_unstable_list(cache_range_entry(r, i)))
			goto out;
	}
	frame = arena_alloc(a, ARENA_MAX_ORDER);
	if (frame < 0) {
		rc = -ENOSPC;
		goto out;
	}
	size_t count = r->count;
	ne = cache_entry_new_large(ce, r, (uint32_t)frame);
	old = malloc(count * sizeof(*old));
	if (!ne || !old) {
		rc = -ENOMEM;
		goto out;
	}
	uint64_t base = index << (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT);
	uint8_t *dst = arena_address(a, (uint32_t)frame);
	for (size_t i = 0; i < count; i++) {
		struct cache_entry *e = cache_range_entry(r, i);
		old[i] = e;
		memcpy(dst + ((cache_entry_first_frame(e) - base) << ARENA_FRAME_SHIFT),
		       arena_address(a, e->frame), (size_t)cache_entry_bytes(e));
		merge_bits(ne, e, base);
	}
	/* Dirty-list pinners pin under the export lock alone: look again. */
	pthread_mutex_lock(&ce->lock);
	for (size_t i = 0; i < count; i++) {
		if (cache_entry_pinned(old[i])) {
			pthread_mutex_unlock(&ce->lock);
			res->skipped_pinned++;
			goto out;
		}
	}
	dirty_list_take_over(ce, old, count, ne);
	unlogged_take_over(ce, old, count, ne);
	pthread_mutex_unlock(&ce->lock);

	cache_range_set_one(r, ne);
	cache_queue_replace(c, old, count, ne);
	arena_set_owner(a, ne->frame, cache_entry_index(ne));
	struct cache_counters *k = &c->counters;
	for (size_t i = 0; i < count; i++) {
		struct cache_entry *e = old[i];
		atomic_fetch_sub(&ce->counters.cached_bytes, cache_entry_bytes(e));
		arena_free(a, e->frame, cache_entry_order(e)); /* clears the owner first */
		pthread_mutex_lock(&ce->lock); /* the side record goes: see internal.h */
		cache_entry_release(c, e);
		pthread_mutex_unlock(&ce->lock);
	}
	atomic_fetch_sub(&k->entries, count - 1);
	atomic_fetch_add(&k->large_bytes, ARENA_CHUNK_SIZE);
	atomic_fetch_add(&ce->counters.cached_bytes, ARENA_CHUNK_SIZE);
	res->collapsed++;
	ne = NULL;
	frame = -1;
	rc = 1;
out:
	pthread_mutex_unlock(&sh->lock);
	if (frame >= 0)
		arena_free(a, (uint32_t)frame, ARENA_MAX_ORDER);
	if (ne)
		cache_entry_release(c, ne);
	free(old);
	return rc;
}

static void collapse_all(struct cache *c, struct cache_compact_result *res)
{
	pthread_mutex_lock(&c->exports_lock);
	struct cache_export *ce = c->exports;
	pthread_mutex_unlock(&c->exports_lock);
	for (; ce; ce = ce->next) {
		uint64_t *idx;
		size_t n;
		if (cache_ranges_between(ce, 0, UINT64_MAX, &idx, &n) < 0)
			continue;
		int rc = 0;
		for (size_t i = 0; i < n && rc >= 0; i++)
			rc = collapse_range(c, ce, idx[i], res);
		free(idx);
		if (rc == -ENOSPC)
			return;
	}
}

/* One pass under pass_lock; counters updated. */
static void run_pass(struct compactor *k, unsigned target, bool evict,
		     struct cache_compact_result *res)
{
	struct cache *c = k->cache;
	memset(res, 0, sizeof(*res));
	pthread_mutex_lock(&k->pass_lock);
	uint64_t t0 = clock_now_ns();
	res->fragmentation_before = cache_fragmentation(c);
	if (evict) {
		uint64_t reserve = c->arena.nframes / RESERVE_DIVISOR;
		if (reserve < RESERVE_MIN_FRAMES)
			reserve = RESERVE_MIN_FRAMES;
		if (reserve > RESERVE_MAX_FRAMES)
			reserve = RESERVE_MAX_FRAMES;
		if (reserve > c->arena.nframes / 4)
			reserve = c->arena.nframes / 4;
		cache_evict_until(c, reserve);
	}
	compact_chunks(k, target, evict, res);
	uint64_t collapsed = res->collapsed;
	collapse_all(c, res);
	if (res->collapsed != collapsed)
		compact_chunks(k, target, evict, res);
	res->fragmentation_after = cache_fragmentation(c);
	res->time_ns = elapsed_since(t0);
	pthread_mutex_unlock(&k->pass_lock);
	struct cache_counters *cn = &c->counters;
	atomic_fetch_add(&cn->compact_moves, res->moved);
	atomic_fetch_add(&cn->compact_skipped_pinned, res->skipped_pinned);
	atomic_fetch_add(&cn->compact_collapses, res->collapsed);
	atomic_fetch_add(&cn->compact_chunks_freed, res->freed_2m_chunks);
	atomic_fetch_add(&cn->compact_passes, 1);
	atomic_fetch_add(&cn->compact_ns, res->time_ns);
}

int cache_compact(struct cache *c, struct cache_compact_result *out)
{
	struct cache_compact_result res;
	run_pass(c->compactor, 0, false, &res);
	log_debug("cache: compaction pass: %llu moved, %llu pinned, %llu collapsed, %llu chunks "
		  "freed, fragmentation %u -> %u per mille in %llu us",
		  (unsigned long long)res.moved, (unsigned long long)res.skipped_pinned,
		  (unsigned long long)res.collapsed, (unsigned long long)res.freed_2m_chunks,
		  res.fragmentation_before, res.fragmentation_after,
		  (unsigned long long)(res.time_ns / 1000));
	if (out)
		*out = res;
	return 0;
}

static void *compactor_main(void *arg)
{
	struct compactor *k = arg;
	struct cache *c = k->cache;
	struct cache_nudge *n = &c->nudge;
	pthread_mutex_lock(&n->lock);
	while (!k->stopping) {
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		uint64_t at = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec + k->interval_ns;
		ts.tv_sec = (time_t)(at / 1000000000u);
		ts.tv_nsec = (long)(at % 1000000000u);
		if (!atomic_load(&n->nudged))
			pthread_cond_timedwait(&n->cond, &n->lock, &ts);
		if (k->stopping)
			break;
		pthread_mutex_unlock(&n->lock);
		bool nudged = atomic_exchange(&n->nudged, false);
		unsigned frag = cache_fragmentation(c);
		if (nudged || frag > k->threshold || k->threshold == 0) {
			struct cache_compact_result res;
			/* A nudge wants every free 2 MiB block it can get. */
			unsigned target = nudged || k->threshold < BACKGROUND_TARGET
						  ? 0
						  : BACKGROUND_TARGET;
			run_pass(k, target, nudged, &res);
		}
		pthread_mutex_lock(&n->lock);
	}
	pthread_mutex_unlock(&n->lock);
	return NULL;
}

int compactor_create(struct cache *c, const struct options *opts)
{
	struct compactor *k = calloc(1, sizeof(*k));
	if (!k)
		return -ENOMEM;
	k->cache = c;
	k->enabled = opts->compact;
	k->interval_ns = (uint64_t)opts->compact_interval_ms * 1000000u;
	k->threshold = opts->compact_threshold;
	pthread_mutex_init(&k->pass_lock, NULL);
	c->compactor = k;
	return 0;
}

int compactor_start(struct cache *c)
{
	struct compactor *k = c->compactor;
	if (!k->enabled)
		return 0;
	int rc = pthread_create(&k->thread, NULL, compactor_main, k);
	if (rc != 0)
		return -rc;
	k->started = true;
	return 0;
}

void compactor_stop(struct cache *c)
{
	struct compactor *k = c->compactor;
	if (!k || !k->started)
		return;
	struct cache_nudge *n = &c->nudge;
	pthread_mutex_lock(&n->lock);
	k->stopping = true;
	pthread_cond_signal(&n->cond);
	pthread_mutex_unlock(&n->lock);
	pthread_join(k->thread, NULL);
	k->started = false;
}

void compactor_destroy(struct cache *c)
{
	struct compactor *k = c->compactor;
	if (!k)
		return;
	compactor_stop(c);
	pthread_mutex_destroy(&k->pass_lock);
	free(k);
	c->compactor = NULL;
}
