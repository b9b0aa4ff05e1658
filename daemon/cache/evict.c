/*
 * daemon/cache/evict.c: the S3-FIFO queues over entries, the ghost table
 * and eviction (internal.h).
 *
 * A new entry enters the small FIFO (a tenth of the arena) unless the
 * ghost table remembers it as recently evicted, in which case it enters
 * the main FIFO. At the head of the small FIFO an entry that was hit since
 * insertion moves to main, others are evicted (and remembered in the ghost
 * table); at the head of main an entry that was hit gets another round
 * with its counter decremented. A hit costs a relaxed load of the entry's
 * atomic word, and a compare-and-swap while the counter is below 3 (the
 * word holds the pins too), and no lock (cache_entry_touch); the evictor
 * lowers the counter by an atomic and or subtract. Entries that are
 * pinned, dirty or being written back are passed over: a dirty block is
 * never dropped, the writeback thread cleans it first. Once an eviction
 * has passed over a whole queue's frames, it takes from the other queue
 * only, even one below its share: a write stream fills the small queue
 * with dirty entries while main holds the clean ones (scanning small
 * alone, half of a stream larger than the cache went to the backend
 * directly).
 *
 * Locking: the evict lock guards both queues, every entry's queue links
 * (fifo_prev, fifo_next) and the ghost table. It is taken under a shard
 * lock, never under an export lock. An evictor holding it only try-locks
 * the shard of the entry it would evict (evict_one); taking the entry out
 * of the index (cache_entry_destroy, cache.c) takes the export and arena
 * locks under it.
 *
 * Callers: cache.c (allocating a new entry's frames, queueing it, taking
 * an entry out, drop-clean) and compact.c (a collapse's queue place, cold
 * entries, the reserve). Index layer: it uses the index, nothing above.
 */
#include "daemon/cache/internal.h"

#define EVICT_SCAN_LIMIT 4096

/* The queue (CACHE_SMALL, CACHE_MAIN, CACHE_NOT_QUEUED) lives in the top
 * bits of fifo_prev. Evict lock held. */
static unsigned entry_queue(const struct cache_entry *e)
{
	return e->fifo_prev >> CACHE_QUEUE_SHIFT;
}

static uint32_t fifo_prev(const struct cache_entry *e)
{
	return e->fifo_prev & CACHE_INDEX_MASK;
}

static void fifo_append(struct cache *c, unsigned queue, struct cache_entry *e)
{
	struct cache_fifo *q = queue == CACHE_MAIN ? &c->main : &c->small;
	uint32_t i = cache_entry_index(e);
	e->fifo_next = 0;
	e->fifo_prev = q->tail | (uint32_t)queue << CACHE_QUEUE_SHIFT;
	if (q->tail)
		cache_entry_at(c, q->tail)->fifo_next = i;
	else
		q->head = i;
	q->tail = i;
	q->frames += 1ull << cache_entry_order(e);
}

/* Out of its queue (if any); it is CACHE_NOT_QUEUED after. */
void cache_queue_remove(struct cache *c, struct cache_entry *e)
{
	unsigned queue = entry_queue(e);
	if (queue == CACHE_NOT_QUEUED)
		return;
	struct cache_fifo *q = queue == CACHE_MAIN ? &c->main : &c->small;
	uint32_t prev = fifo_prev(e);
	if (prev)
		cache_entry_at(c, prev)->fifo_next = e->fifo_next;
	else
		q->head = e->fifo_next;
	if (e->fifo_next) {
		struct cache_entry *n = cache_entry_at(c, e->fifo_next);
		n->fifo_prev = prev | (n->fifo_prev & ~CACHE_INDEX_MASK);
	} else {
		q->tail = prev;
	}
	q->frames -= 1ull << cache_entry_order(e);
	e->fifo_prev = e->fifo_next = 0;
}

static uint64_t entry_fingerprint(const struct cache_entry *e)
{
	return cache_mix64(cache_entry_first_frame(e) ^
			   ((uint64_t)cache_entry_export(e)->id << 56));
}

/* The ghost table keeps 16 bits of a fingerprint in the slot its low bits
 * name (never 0: 0 is an empty slot). */
static uint16_t ghost_tag(uint64_t fp)
{
	return (uint16_t)(fp >> 48) | 1;
}

static void ghost_remember(struct cache *c, const struct cache_entry *e)
{
	uint64_t fp = entry_fingerprint(e);
	c->ghost[fp & c->ghost_mask] = ghost_tag(fp);
}

/* A new entry joins the queues: main if the ghost table remembers it
 * (evicted from small lately, and wanted again), else small. Takes the
 * evict lock. */
void cache_queue_insert(struct cache *c, struct cache_entry *e)
{
	pthread_mutex_lock(&c->evict_lock);
	uint64_t fp = entry_fingerprint(e);
	if (c->ghost[fp & c->ghost_mask] == ghost_tag(fp)) {
		c->ghost[fp & c->ghost_mask] = 0;
		fifo_append(c, CACHE_MAIN, e);
	} else {
		fifo_append(c, CACHE_SMALL, e);
	}
	pthread_mutex_unlock(&c->evict_lock);
}

void cache_queue_replace(struct cache *c, struct cache_entry *const *old, size_t n,
			 struct cache_entry *ne)
{
	bool main = false;
	unsigned freq = 0;
	pthread_mutex_lock(&c->evict_lock);
	for (size_t i = 0; i < n; i++) {
		struct cache_entry *e = old[i];
		unsigned f = cache_entry_freq(e);
		if (f > freq)
			freq = f;
		if (entry_queue(e) == CACHE_MAIN)
			main = true;
		cache_queue_remove(c, e);
	}
	/* Raise ne's counter to freq: its word holds the pins too. */
	unsigned v = atomic_load_explicit(&ne->hot, memory_order_relaxed);
	while ((v & CACHE_FREQ_MASK) >> CACHE_FREQ_SHIFT < freq &&
	       !atomic_compare_exchange_weak_explicit(
		   &ne->hot, &v, (v & ~CACHE_FREQ_MASK) | freq << CACHE_FREQ_SHIFT,
		   memory_order_relaxed, memory_order_relaxed))
		;
	fifo_append(c, main ? CACHE_MAIN : CACHE_SMALL, ne);
	pthread_mutex_unlock(&c->evict_lock);
}

void cache_queue_split(struct cache *c, struct cache_entry *e, struct cache_entry *n)
{
	unsigned queue = entry_queue(e);
	if (queue == CACHE_NOT_QUEUED)
		return;
	struct cache_fifo *q = queue == CACHE_MAIN ? &c->main : &c->small;
	uint32_t ei = cache_entry_index(e), ni = cache_entry_index(n);
	n->fifo_prev = ei | (uint32_t)queue << CACHE_QUEUE_SHIFT;
	n->fifo_next = e->fifo_next;
	if (e->fifo_next) {
		struct cache_entry *after = cache_entry_at(c, e->fifo_next);
		after->fifo_prev = ni | (after->fifo_prev & ~CACHE_INDEX_MASK);
	} else {
		q->tail = ni;
	}
	e->fifo_next = ni; /* q->frames stay: e gave n its frames */
}

/*
 * A clean entry leaves RAM: its uptodate pages go to the cache device's
 * level-2 cache (device.h), copied now, written later. Shard lock held.
 */
static void offer_level2(struct cache *c, struct cache_export *ce, struct cache_entry *e)
{
	if (!c->device || ce->device_slot < 0 || ce->l2_policy == CACHE_L2_OFF ||
	    !cache_device_l2_on(c->device))
		return;
	/* Bytes the backend may still lose: never claimed by the level-2 map. */
	if (e->unproven)
		return;
	struct cache_map up = cache_uptodate_map(e);
	uint64_t bytes = cache_entry_bytes(e), offset = cache_entry_offset(e);
	uint64_t size = atomic_load(&ce->size);
	const uint8_t *mem = arena_address(&c->arena, e->frame);
	/* Page by page: a page goes if every block over it is uptodate. */
	uint64_t run = 0, pages = bytes / ARENA_FRAME_SIZE;
	for (uint64_t p = 0; p <= pages; p++) {
		bool ok = p < pages && offset + p * ARENA_FRAME_SIZE < size;
		if (ok) {
			uint64_t from = p * ARENA_FRAME_SIZE, to = from + ARENA_FRAME_SIZE - 1;
			for (uint64_t b = from >> ce->block_shift; ok && b <= to >> ce->block_shift;
			     b++)
				ok = map_test(up, (uint32_t)b);
		}
		if (ok) {
			run++;
			continue;
		}
		if (run)
			cache_device_l2_store(
			    c->device, ce->device_slot, offset + (p - run) * ARENA_FRAME_SIZE,
			    mem + (p - run) * ARENA_FRAME_SIZE, run * ARENA_FRAME_SIZE);
		run = 0;
	}
}

bool cache_entry_evictable(struct cache_entry *e)
{
	if (cache_entry_pinned(e))
		return false;
	const struct cache_entry_ext *x = cache_entry_ext(e);
	return !x || (!x->on_dirty_list && !x->writeback && x->ndirty == 0 &&
		      !x->on_unstable_list);
}

/*
 * Evict one entry if any can go. Evict lock held; held_shard is the shard
 * lock the caller holds (its entries are passed over: try-lock would fail).
 */
static bool evict_one(struct cache *c, struct cache_shard *held_shard)
{
	uint64_t small_target = c->arena.nframes / 10;
	/* Frames of each queue passed over as not evictable in this call: once
	 * a whole queue was, only the other one can give an entry. */
	uint64_t seen[3] = {0, 0, 0};
	for (unsigned scan = 0; scan < EVICT_SCAN_LIMIT; scan++) {
		bool small_left = c->small.head && seen[CACHE_SMALL] < c->small.frames;
		bool main_left = c->main.head && seen[CACHE_MAIN] < c->main.frames;
		unsigned queue;
		if (small_left && (c->small.frames > small_target || !main_left))
			queue = CACHE_SMALL;
		else if (main_left)
			queue = CACHE_MAIN;
		else
			return false;
		struct cache_entry *e =
			cache_entry_at(c, queue == CACHE_MAIN ? c->main.head : c->small.head);
		cache_queue_remove(c, e);
		/* Hits only raise the counter meanwhile (cache_entry_touch):
		 * lowering it is an atomic and or subtract on the word. */
		unsigned freq = cache_entry_freq(e);
		if (queue == CACHE_SMALL && freq > 0) {
			atomic_fetch_and_explicit(&e->hot, ~CACHE_FREQ_MASK, memory_order_relaxed);
			fifo_append(c, CACHE_MAIN, e);
			continue;
		}
		if (queue == CACHE_MAIN && freq > 0) {
			atomic_fetch_sub_explicit(&e->hot, CACHE_FREQ_ONE, memory_order_relaxed);
			fifo_append(c, queue, e);
			continue;
		}
		/* The range node and its export do not change while the entry
		 * is queued (the evict lock is held): they may be read here. */
		struct cache_range *r = cache_entry_range(e);
		struct cache_shard *sh = cache_shard_for(c, r->ce, r->index);
		if (sh == held_shard || pthread_mutex_trylock(&sh->lock) != 0) {
			seen[queue] += 1ull << cache_entry_order(e);
			fifo_append(c, queue, e);
			continue;
		}
		if (!cache_entry_evictable(e)) {
			pthread_mutex_unlock(&sh->lock);
			seen[queue] += 1ull << cache_entry_order(e);
			fifo_append(c, queue, e);
			continue;
		}
		if (queue == CACHE_SMALL)
			ghost_remember(c, e);
		struct cache_export *ce = r->ce;
		offer_level2(c, ce, e);
		cache_entry_destroy(c, sh, e);
		pthread_mutex_unlock(&sh->lock);
		atomic_fetch_add(&ce->counters.evictions, 1);
		return true;
	}
	return false;
}

bool cache_entry_evict_cold(struct cache *c, struct cache_shard *sh, struct cache_entry *e)
{
	if (!cache_entry_evictable(e) || cache_entry_freq(e) != 0)
		return false;
	pthread_mutex_lock(&c->evict_lock);
	if (entry_queue(e) == CACHE_SMALL)
		ghost_remember(c, e);
	struct cache_export *ce = cache_entry_export(e);
	offer_level2(c, ce, e);
	cache_entry_destroy(c, sh, e);
	pthread_mutex_unlock(&c->evict_lock);
	atomic_fetch_add(&ce->counters.evictions, 1);
	return true;
}

uint64_t cache_evict_until(struct cache *c, uint64_t free_frames)
{
	uint64_t evicted = 0;
	for (;;) {
		pthread_mutex_lock(&c->arena.lock);
		uint64_t now = c->arena.free_frames;
		pthread_mutex_unlock(&c->arena.lock);
		if (now >= free_frames)
			return evicted;
		unsigned batch = 0;
		pthread_mutex_lock(&c->evict_lock);
		while (batch < 16 && evict_one(c, NULL))
			batch++;
		pthread_mutex_unlock(&c->evict_lock);
		evicted += batch;
		if (batch < 16)
			return evicted;
	}
}

/* Frames of the given order, evicting up to max_evictions entries. */
int64_t cache_alloc_evicting(struct cache *c, struct cache_shard *sh, unsigned order,
			     unsigned max_evictions)
{
	int64_t f = arena_alloc(&c->arena, order);
	if (f >= 0 || max_evictions == 0)
		return f;
	pthread_mutex_lock(&c->evict_lock);
	for (unsigned i = 0; i < max_evictions && f < 0; i++) {
		if (!evict_one(c, sh))
			break;
		f = arena_alloc(&c->arena, order);
	}
	pthread_mutex_unlock(&c->evict_lock);
	return f;
}
