/*
 * daemon/cache/cache.c: the index, the entries (handles), per-block state,
 * eviction and statistics (see cache.h and internal.h).
 *
 * Eviction is S3-FIFO over entries: a new entry enters the small FIFO (a
 * tenth of the arena) unless the ghost table remembers it as recently
 * evicted, in which case it enters the main FIFO. At the head of the small
 * FIFO an entry that was hit since insertion moves to main, others are
 * evicted (and remembered in the ghost table); at the head of main an
 * entry that was hit gets another round with its counter decremented. A
 * hit costs one relaxed atomic increment and no lock. Entries that are
 * pinned, dirty or being written back are passed over: a dirty block is
 * never dropped, the writeback thread cleans it first.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

#define EVICT_SCAN_LIMIT 4096

uint64_t cache_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

bool cache_all_zero(const uint8_t *p, size_t n)
{
	static const uint8_t zero16[16];
	return memcmp(p, zero16, 16) == 0 && memcmp(p, p + 16, n - 16) == 0;
}

static uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

static uint64_t range_hash(const struct cache_export *ce, uint64_t range_index)
{
	return mix64(range_index * 0x9e3779b97f4a7c15ull + ce->id);
}

struct cache_shard *cache_shard_for(struct cache *c, const struct cache_export *ce,
				    uint64_t range_index)
{
	return &c->shards[range_hash(ce, range_index) % CACHE_SHARDS];
}

static size_t words_per_map(const struct cache_entry *e)
{
	return (e->nblocks + 63) / 64;
}

uint64_t *cache_uptodate_map(struct cache_entry *e)
{
	return e->bits;
}

uint64_t *cache_dirty_map(struct cache_entry *e)
{
	return e->bits + words_per_map(e);
}

uint64_t *cache_busy_map(struct cache_entry *e)
{
	return e->bits + 2 * words_per_map(e);
}

/* ---- index ---- */

static struct cache_range *range_find(struct cache_shard *sh, const struct cache_export *ce,
				      uint64_t index)
{
	if (!sh->nbuckets)
		return NULL;
	struct cache_range *r = sh->buckets[range_hash(ce, index) / CACHE_SHARDS & (sh->nbuckets - 1)];
	while (r && (r->ce != ce || r->index != index))
		r = r->hash_next;
	return r;
}

static int shard_grow(struct cache_shard *sh)
{
	size_t n = sh->nbuckets ? sh->nbuckets * 2 : 64;
	struct cache_range **b = calloc(n, sizeof(*b));
	if (!b)
		return -ENOMEM;
	for (size_t i = 0; i < sh->nbuckets; i++) {
		struct cache_range *r = sh->buckets[i];
		while (r) {
			struct cache_range *next = r->hash_next;
			size_t slot = range_hash(r->ce, r->index) / CACHE_SHARDS & (n - 1);
			r->hash_next = b[slot];
			b[slot] = r;
			r = next;
		}
	}
	free(sh->buckets);
	sh->buckets = b;
	sh->nbuckets = n;
	return 0;
}

static struct cache_range *range_create(struct cache_shard *sh, struct cache_export *ce,
					uint64_t index)
{
	if (sh->count >= sh->nbuckets && shard_grow(sh) < 0 && !sh->nbuckets)
		return NULL;
	struct cache_range *r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	r->ce = ce;
	r->index = index;
	size_t slot = range_hash(ce, index) / CACHE_SHARDS & (sh->nbuckets - 1);
	r->hash_next = sh->buckets[slot];
	sh->buckets[slot] = r;
	sh->count++;
	pthread_mutex_lock(&ce->lock);
	r->export_next = ce->ranges;
	if (ce->ranges)
		ce->ranges->export_prev = r;
	ce->ranges = r;
	ce->range_count++;
	pthread_mutex_unlock(&ce->lock);
	atomic_fetch_add(&ce->cache->counters.metadata_bytes, sizeof(*r));
	return r;
}

static void range_destroy(struct cache_shard *sh, struct cache_range *r)
{
	struct cache_export *ce = r->ce;
	struct cache_range **p = &sh->buckets[range_hash(ce, r->index) / CACHE_SHARDS & (sh->nbuckets - 1)];
	while (*p != r)
		p = &(*p)->hash_next;
	*p = r->hash_next;
	sh->count--;
	pthread_mutex_lock(&ce->lock);
	if (r->export_prev)
		r->export_prev->export_next = r->export_next;
	else
		ce->ranges = r->export_next;
	if (r->export_next)
		r->export_next->export_prev = r->export_prev;
	ce->range_count--;
	pthread_mutex_unlock(&ce->lock);
	atomic_fetch_sub(&ce->cache->counters.metadata_bytes,
			 sizeof(*r) + r->cap * sizeof(*r->entries));
	free(r->entries);
	free(r);
}

struct cache_range *cache_range_get(struct cache_shard *sh, const struct cache_export *ce,
				    uint64_t range_index)
{
	return range_find(sh, ce, range_index);
}

/* Index of the first entry whose first_frame is >= frame. */
static uint32_t range_search(const struct cache_range *r, uint64_t frame)
{
	uint32_t lo = 0, hi = r->count;
	while (lo < hi) {
		uint32_t mid = (lo + hi) / 2;
		if (r->entries[mid]->first_frame < frame)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

struct cache_entry *cache_lookup(struct cache_export *ce, struct cache_shard *sh,
				 uint64_t device_frame)
{
	struct cache_range *r =
		range_find(sh, ce, device_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
	if (!r)
		return NULL;
	uint32_t i = range_search(r, device_frame + 1);
	if (i == 0)
		return NULL;
	struct cache_entry *e = r->entries[i - 1];
	if (device_frame < e->first_frame + (1ull << e->order))
		return e;
	return NULL;
}

int cache_ranges_between(struct cache_export *ce, uint64_t first, uint64_t last,
			 uint64_t **out, size_t *count)
{
	pthread_mutex_lock(&ce->lock);
	size_t n = 0, cap = ce->range_count;
	uint64_t *v = malloc((cap ? cap : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	for (struct cache_range *r = ce->ranges; r; r = r->export_next)
		if (r->index >= first && r->index <= last)
			v[n++] = r->index;
	pthread_mutex_unlock(&ce->lock);
	*out = v;
	*count = n;
	return 0;
}

/*
 * Call fn on every cached entry overlapping [offset, offset+length), with
 * its shard lock held. Walks the range nodes by index when that is short,
 * else the export's list of range nodes (a TRIM of many TiB).
 */
int cache_for_each_entry(struct cache_export *ce, uint64_t offset, uint64_t length,
			 void (*fn)(struct cache_entry *e, void *arg), void *arg)
{
	uint64_t first = offset >> CACHE_RANGE_SHIFT;
	uint64_t last = (offset + length - 1) >> CACHE_RANGE_SHIFT;
	uint64_t *list = NULL;
	size_t n = 0;
	pthread_mutex_lock(&ce->lock);
	uint64_t nodes = ce->range_count;
	pthread_mutex_unlock(&ce->lock);
	bool by_list = last - first >= 2 * nodes + 16;
	if (by_list) {
		int rc = cache_ranges_between(ce, first, last, &list, &n);
		/* Out of memory: walking by index needs none, if not too long. */
		if (rc < 0 && last - first >= (1u << 20))
			return rc;
		by_list = rc == 0;
	}
	for (uint64_t k = 0; by_list ? k < n : first + k <= last; k++) {
		uint64_t index = by_list ? list[k] : first + k;
		struct cache_shard *sh = cache_shard_for(ce->cache, ce, index);
		pthread_mutex_lock(&sh->lock);
		struct cache_range *r = cache_range_get(sh, ce, index);
		for (uint32_t i = 0; r && i < r->count; i++) {
			struct cache_entry *e = r->entries[i];
			uint64_t eo = cache_entry_offset(e);
			if (eo < offset + length && offset < eo + cache_entry_bytes(e))
				fn(e, arg);
		}
		pthread_mutex_unlock(&sh->lock);
		if (first + k == UINT64_MAX)
			break;
	}
	free(list);
	return 0;
}

/* ---- entries ---- */

void cache_entry_pin(struct cache_entry *e)
{
	atomic_fetch_add_explicit(&e->pins, 1, memory_order_relaxed);
}

void cache_entry_unpin(struct cache_entry *e)
{
	atomic_fetch_sub_explicit(&e->pins, 1, memory_order_release);
}

void cache_entry_touch(struct cache_entry *e)
{
	unsigned char f = atomic_load_explicit(&e->freq, memory_order_relaxed);
	if (f < 3)
		atomic_store_explicit(&e->freq, (unsigned char)(f + 1), memory_order_relaxed);
}

static void fifo_append(struct cache_fifo *q, struct cache_entry *e)
{
	e->fifo_next = NULL;
	e->fifo_prev = q->tail;
	if (q->tail)
		q->tail->fifo_next = e;
	else
		q->head = e;
	q->tail = e;
	q->frames += 1ull << e->order;
}

static void fifo_remove(struct cache_fifo *q, struct cache_entry *e)
{
	if (e->fifo_prev)
		e->fifo_prev->fifo_next = e->fifo_next;
	else
		q->head = e->fifo_next;
	if (e->fifo_next)
		e->fifo_next->fifo_prev = e->fifo_prev;
	else
		q->tail = e->fifo_prev;
	q->frames -= 1ull << e->order;
}

static uint64_t entry_fingerprint(const struct cache_entry *e)
{
	return mix64(e->first_frame ^ ((uint64_t)e->ce->id << 56)) | 1;
}

static size_t entry_size(uint32_t nblocks)
{
	return sizeof(struct cache_entry) + 3 * ((nblocks + 63) / 64) * sizeof(uint64_t);
}

size_t cache_entry_struct_size(uint32_t nblocks)
{
	return entry_size(nblocks);
}

void cache_queue_replace(struct cache *c, struct cache_entry *const *old, size_t n,
			 struct cache_entry *ne)
{
	bool main = false;
	unsigned char freq = 0;
	pthread_mutex_lock(&c->evict_lock);
	for (size_t i = 0; i < n; i++) {
		struct cache_entry *e = old[i];
		unsigned char f = atomic_load_explicit(&e->freq, memory_order_relaxed);
		if (f > freq)
			freq = f;
		if (e->queue == CACHE_SMALL) {
			fifo_remove(&c->small, e);
		} else if (e->queue == CACHE_MAIN) {
			fifo_remove(&c->main, e);
			main = true;
		}
		e->queue = CACHE_NOT_QUEUED;
	}
	atomic_store_explicit(&ne->freq, freq, memory_order_relaxed);
	ne->queue = main ? CACHE_MAIN : CACHE_SMALL;
	fifo_append(main ? &c->main : &c->small, ne);
	pthread_mutex_unlock(&c->evict_lock);
}

/* Remove an unpinned, clean, idle entry from everything and free it.
 * Shard lock and evict lock held. */
static void entry_destroy(struct cache *c, struct cache_shard *sh, struct cache_entry *e)
{
	struct cache_range *r = e->range;
	uint32_t i = range_search(r, e->first_frame);
	memmove(&r->entries[i], &r->entries[i + 1], (r->count - i - 1) * sizeof(*r->entries));
	r->count--;
	if (r->count == 0)
		range_destroy(sh, r);
	if (e->queue == CACHE_SMALL)
		fifo_remove(&c->small, e);
	else if (e->queue == CACHE_MAIN)
		fifo_remove(&c->main, e);
	arena_free(&c->arena, e->frame, e->order);
	atomic_fetch_sub(&c->counters.entries, 1);
	atomic_fetch_sub(&c->counters.entry_bytes, cache_entry_bytes(e));
	if (e->order == ARENA_MAX_ORDER)
		atomic_fetch_sub(&c->counters.large_bytes, cache_entry_bytes(e));
	atomic_fetch_sub(&c->counters.metadata_bytes, entry_size(e->nblocks));
	atomic_fetch_sub(&e->ce->counters.cached_bytes, (uint64_t)ARENA_FRAME_SIZE << e->order);
	free(e);
}

static bool entry_evictable(struct cache_entry *e)
{
	return atomic_load_explicit(&e->pins, memory_order_acquire) == 0 && !e->on_dirty_list &&
	       !e->writeback && e->ndirty == 0 && !e->on_unstable_list;
}

/*
 * Evict one entry if any can go. Evict lock held; held_shard is the shard
 * lock the caller holds (its entries are passed over: try-lock would fail).
 */
static bool evict_one(struct cache *c, struct cache_shard *held_shard)
{
	uint64_t small_target = c->arena.nframes / 10;
	for (unsigned scan = 0; scan < EVICT_SCAN_LIMIT; scan++) {
		struct cache_fifo *q;
		if (c->small.head && (c->small.frames > small_target || !c->main.head))
			q = &c->small;
		else if (c->main.head)
			q = &c->main;
		else
			return false;
		struct cache_entry *e = q->head;
		fifo_remove(q, e);
		unsigned char freq = atomic_load_explicit(&e->freq, memory_order_relaxed);
		if (q == &c->small && freq > 0) {
			atomic_store_explicit(&e->freq, 0, memory_order_relaxed);
			e->queue = CACHE_MAIN;
			fifo_append(&c->main, e);
			continue;
		}
		if (q == &c->main && freq > 0) {
			atomic_store_explicit(&e->freq, (unsigned char)(freq - 1),
					      memory_order_relaxed);
			fifo_append(q, e);
			continue;
		}
		struct cache_shard *sh =
			cache_shard_for(c, e->ce, e->first_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
		if (sh == held_shard || pthread_mutex_trylock(&sh->lock) != 0) {
			fifo_append(q, e);
			continue;
		}
		if (!entry_evictable(e)) {
			pthread_mutex_unlock(&sh->lock);
			fifo_append(q, e);
			continue;
		}
		e->queue = CACHE_NOT_QUEUED;
		if (q == &c->small)
			c->ghost[entry_fingerprint(e) & c->ghost_mask] = entry_fingerprint(e);
		struct cache_export *ce = e->ce;
		entry_destroy(c, sh, e);
		pthread_mutex_unlock(&sh->lock);
		atomic_fetch_add(&ce->counters.evictions, 1);
		return true;
	}
	return false;
}

bool cache_entry_evict_cold(struct cache *c, struct cache_shard *sh, struct cache_entry *e)
{
	if (!entry_evictable(e) || atomic_load_explicit(&e->freq, memory_order_relaxed) != 0)
		return false;
	pthread_mutex_lock(&c->evict_lock);
	if (e->queue == CACHE_SMALL)
		c->ghost[entry_fingerprint(e) & c->ghost_mask] = entry_fingerprint(e);
	struct cache_export *ce = e->ce;
	entry_destroy(c, sh, e);
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
static int64_t alloc_evicting(struct cache *c, struct cache_shard *sh, unsigned order,
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

/* Largest order <= want whose aligned slot around frame is free in r. */
static unsigned fit_order(const struct cache_export *ce, const struct cache_range *r,
			  uint64_t frame, unsigned want)
{
	uint64_t end_frame = (ce->size + ARENA_FRAME_SIZE - 1) >> ARENA_FRAME_SHIFT;
	for (unsigned o = want; o > ce->min_order; o--) {
		uint64_t start = frame & ~((1ull << o) - 1);
		if (start + (1ull << o) > end_frame)
			continue;
		if (!r)
			return o;
		uint32_t i = range_search(r, start);
		if (i > 0) {
			const struct cache_entry *prev = r->entries[i - 1];
			if (prev->first_frame + (1ull << prev->order) > start)
				continue;
		}
		if (i < r->count && r->entries[i]->first_frame < start + (1ull << o))
			continue;
		return o;
	}
	return ce->min_order;
}

struct cache_entry *cache_entry_create(struct cache_export *ce, struct cache_shard *sh,
				       uint64_t device_frame, unsigned want_order)
{
	struct cache *c = ce->cache;
	uint64_t index = device_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT);
	struct cache_range *r = range_find(sh, ce, index);
	if (want_order < ce->min_order)
		want_order = ce->min_order;
	unsigned order = fit_order(ce, r, device_frame, want_order);
	unsigned fit = order;
	/* Large entries are a hint: fall back to smaller orders, then evict. */
	int64_t frame = alloc_evicting(c, sh, order, 32);
	while (frame < 0 && order > ce->min_order)
		frame = arena_alloc(&c->arena, --order);
	if (frame < 0)
		frame = alloc_evicting(c, sh, order, 256);
	if (fit == ARENA_MAX_ORDER) {
		atomic_fetch_add(&c->counters.alloc_2m_attempts, 1);
		if (frame >= 0 && order == fit)
			atomic_fetch_add(&c->counters.alloc_2m_ok, 1);
	}
	if (order < fit && fit > ce->min_order + 2)
		cache_nudge_compactor(c); /* it was not fragmentation alone if it fails */
	if (frame < 0) {
		atomic_fetch_add(&c->counters.alloc_failures, 1);
		return NULL;
	}
	uint32_t nblocks = (uint32_t)(((uint64_t)ARENA_FRAME_SIZE << order) >> ce->block_shift);
	struct cache_entry *e = calloc(1, entry_size(nblocks));
	if (!e)
		goto err_frame;
	if (!r)
		r = range_create(sh, ce, index);
	if (!r)
		goto err_entry;
	if (r->count == r->cap) {
		uint32_t cap = r->cap ? r->cap * 2 : 4;
		struct cache_entry **v = realloc(r->entries, cap * sizeof(*v));
		if (!v) {
			if (r->count == 0)
				range_destroy(sh, r);
			goto err_entry;
		}
		atomic_fetch_add(&c->counters.metadata_bytes, (cap - r->cap) * sizeof(*v));
		r->entries = v;
		r->cap = cap;
	}
	e->first_frame = device_frame & ~((1ull << order) - 1);
	e->ce = ce;
	e->range = r;
	e->frame = (uint32_t)frame;
	e->order = (uint8_t)order;
	e->nblocks = nblocks;
	uint32_t i = range_search(r, e->first_frame);
	memmove(&r->entries[i + 1], &r->entries[i], (r->count - i) * sizeof(*r->entries));
	r->entries[i] = e;
	r->count++;
	arena_set_owner(&c->arena, e->frame, e);
	atomic_fetch_add(&c->counters.entries, 1);
	atomic_fetch_add(&c->counters.entry_bytes, cache_entry_bytes(e));
	if (order == ARENA_MAX_ORDER)
		atomic_fetch_add(&c->counters.large_bytes, cache_entry_bytes(e));
	atomic_fetch_add(&c->counters.metadata_bytes, entry_size(nblocks));
	atomic_fetch_add(&ce->counters.cached_bytes, (uint64_t)ARENA_FRAME_SIZE << order);

	pthread_mutex_lock(&c->evict_lock);
	uint64_t fp = entry_fingerprint(e);
	if (c->ghost[fp & c->ghost_mask] == fp) {
		c->ghost[fp & c->ghost_mask] = 0;
		e->queue = CACHE_MAIN;
		fifo_append(&c->main, e);
	} else {
		e->queue = CACHE_SMALL;
		fifo_append(&c->small, e);
	}
	pthread_mutex_unlock(&c->evict_lock);
	return e;
err_entry:
	free(e);
err_frame:
	arena_free(&c->arena, (uint32_t)frame, order);
	return NULL;
}

/* ---- dirty state ---- */

void cache_mark_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_export *ce = e->ce;
	uint64_t *dirty = cache_dirty_map(e);
	uint32_t added = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (!bit_test(dirty, b)) {
			bit_set(dirty, b);
			added++;
		}
	}
	e->ndirty += added;
	cache_dirty_bytes_add(ce, (uint64_t)added << ce->block_shift);
	if (e->on_dirty_list)
		return;
	pthread_mutex_lock(&ce->lock);
	e->dirty_next = NULL;
	e->dirty_prev = ce->dirty_tail;
	if (ce->dirty_tail)
		ce->dirty_tail->dirty_next = e;
	else
		ce->dirty_head = e;
	ce->dirty_tail = e;
	e->on_dirty_list = true;
	e->dirty_since = cache_now_ns();
	pthread_mutex_unlock(&ce->lock);
}

void cache_clear_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_export *ce = e->ce;
	uint64_t *dirty = cache_dirty_map(e);
	uint32_t removed = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (bit_test(dirty, b)) {
			bit_clear(dirty, b);
			removed++;
		}
	}
	e->ndirty -= removed;
	cache_dirty_bytes_sub(ce, (uint64_t)removed << ce->block_shift);
}

void cache_dirty_list_remove(struct cache_export *ce, struct cache_entry *e)
{
	if (e->dirty_prev)
		e->dirty_prev->dirty_next = e->dirty_next;
	else
		ce->dirty_head = e->dirty_next;
	if (e->dirty_next)
		e->dirty_next->dirty_prev = e->dirty_prev;
	else
		ce->dirty_tail = e->dirty_prev;
	e->on_dirty_list = false;
}

void cache_dirty_list_update(struct cache_entry *e)
{
	if (!e->on_dirty_list || e->ndirty || e->writeback)
		return;
	struct cache_export *ce = e->ce;
	pthread_mutex_lock(&ce->lock);
	cache_dirty_list_remove(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* ---- unstable state: written back, not yet flushed ---- */

/* Export lock held, e on the unstable list. */
static void unstable_list_unlink(struct cache_export *ce, struct cache_entry *e)
{
	if (e->unstable_prev)
		e->unstable_prev->unstable_next = e->unstable_next;
	else
		ce->unstable_head = e->unstable_next;
	if (e->unstable_next)
		e->unstable_next->unstable_prev = e->unstable_prev;
	else
		ce->unstable_tail = e->unstable_prev;
	e->unstable_prev = e->unstable_next = NULL;
	e->on_unstable_list = false;
}

void cache_mark_unstable(struct cache_entry *e, uint32_t blocks, uint64_t seq)
{
	struct cache_export *ce = e->ce;
	uint32_t room = e->nblocks - e->nunstable;
	uint32_t added = blocks < room ? blocks : room;
	e->nunstable += added;
	atomic_fetch_add(&ce->counters.unstable_bytes, (uint64_t)added << ce->block_shift);
	pthread_mutex_lock(&ce->lock);
	if (e->on_unstable_list) /* to the tail: the list stays in write order */
		unstable_list_unlink(ce, e);
	e->unstable_next = NULL;
	e->unstable_prev = ce->unstable_tail;
	if (!ce->unstable_head)
		ce->unstable_since = cache_now_ns();
	if (ce->unstable_tail)
		ce->unstable_tail->unstable_next = e;
	else
		ce->unstable_head = e;
	ce->unstable_tail = e;
	e->on_unstable_list = true;
	if (seq > e->unstable_seq)
		e->unstable_seq = seq;
	pthread_mutex_unlock(&ce->lock);
}

void cache_unstable_settle(struct cache_entry *e, bool redirty)
{
	struct cache_export *ce = e->ce;
	if (!e->on_unstable_list)
		return;
	if (redirty) {
		const uint64_t *uptodate = cache_uptodate_map(e);
		for (uint32_t b = 0; b < e->nblocks; b++)
			if (bit_test(uptodate, b))
				cache_mark_dirty(e, b, 1);
	}
	atomic_fetch_sub(&ce->counters.unstable_bytes, (uint64_t)e->nunstable << ce->block_shift);
	e->nunstable = 0;
	e->unstable_seq = 0;
	pthread_mutex_lock(&ce->lock);
	unstable_list_unlink(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* The entry after e on the dirty or the unstable list. */
static struct cache_entry *list_next(const struct cache_entry *e, enum cache_list list)
{
	return list == CACHE_LIST_DIRTY ? e->dirty_next : e->unstable_next;
}

int cache_list_pin(struct cache_export *ce, enum cache_list list, uint64_t seq,
		   struct cache_entry ***out, size_t *count)
{
	pthread_mutex_lock(&ce->lock);
	struct cache_entry *head = list == CACHE_LIST_DIRTY ? ce->dirty_head : ce->unstable_head;
	size_t n = 0;
	for (struct cache_entry *e = head; e; e = list_next(e, list))
		if (list == CACHE_LIST_DIRTY || e->unstable_seq <= seq)
			n++;
	struct cache_entry **v = malloc((n ? n : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	size_t i = 0;
	for (struct cache_entry *e = head; e && i < n; e = list_next(e, list)) {
		if (list == CACHE_LIST_DIRTY || e->unstable_seq <= seq) {
			/* On the list: it cannot be evicted (see cache.h). */
			cache_entry_pin(e);
			v[i++] = e;
		}
	}
	pthread_mutex_unlock(&ce->lock);
	*out = v;
	*count = i;
	return 0;
}

/* ---- waiting ---- */

uint64_t cache_waitq_seq(struct cache *c)
{
	return atomic_load(&c->waitq.seq);
}

bool cache_waitq_wait(struct cache *c, struct cache_waiter *w, uint64_t seq)
{
	struct cache_waitq *q = &c->waitq;
	pthread_mutex_lock(&q->lock);
	atomic_fetch_add(&q->waiters, 1);
	if (atomic_load(&q->seq) != seq) {
		atomic_fetch_sub(&q->waiters, 1);
		pthread_mutex_unlock(&q->lock);
		return false;
	}
	w->next = q->head;
	q->head = w;
	pthread_mutex_unlock(&q->lock);
	return true;
}

void cache_waitq_wake(struct cache *c)
{
	struct cache_waitq *q = &c->waitq;
	atomic_fetch_add(&q->seq, 1);
	if (atomic_load(&q->waiters) == 0)
		return;
	pthread_mutex_lock(&q->lock);
	struct cache_waiter *w = q->head;
	q->head = NULL;
	atomic_store(&q->waiters, 0);
	pthread_mutex_unlock(&q->lock);
	while (w) {
		struct cache_waiter *next = w->next;
		worker_post(w->worker, &w->task);
		w = next;
	}
}

void cache_kick_writeback(struct cache *c)
{
	struct cache_kick *k = &c->kick;
	if (!k->worker || atomic_exchange(&k->pending, true))
		return;
	worker_post(k->worker, &k->task);
}

void cache_nudge_compactor(struct cache *c)
{
	struct cache_nudge *n = &c->nudge;
	if (atomic_exchange(&n->nudged, true))
		return;
	pthread_mutex_lock(&n->lock);
	pthread_cond_signal(&n->cond);
	pthread_mutex_unlock(&n->lock);
}

/* ---- the index's part of the cache's life (lifecycle.c) ---- */

int cache_index_init(struct cache *c, const struct options *opts)
{
	int rc = arena_init(&c->arena, (size_t)opts->cache_size, opts->hugepages);
	if (rc < 0)
		return rc;
	uint32_t ghost = 1024;
	while (ghost < c->arena.nframes / 2)
		ghost *= 2;
	c->ghost = calloc(ghost, sizeof(*c->ghost));
	if (!c->ghost) {
		arena_destroy(&c->arena);
		return -ENOMEM;
	}
	c->ghost_mask = ghost - 1;
	for (unsigned i = 0; i < CACHE_SHARDS; i++)
		pthread_mutex_init(&c->shards[i].lock, NULL);
	pthread_mutex_init(&c->evict_lock, NULL);
	pthread_mutex_init(&c->waitq.lock, NULL);
	pthread_mutex_init(&c->exports_lock, NULL);
	pthread_mutex_init(&c->nudge.lock, NULL);
	pthread_condattr_t attr;
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&c->nudge.cond, &attr);
	pthread_condattr_destroy(&attr);
	c->dirty_high = c->arena.size / 100 * opts->dirty_high;
	c->dirty_low = c->arena.size / 100 * opts->dirty_low;
	c->dirty_expire_ns = (uint64_t)opts->dirty_expire * 1000000000u;
	atomic_store(&c->counters.metadata_bytes,
		     (uint64_t)c->arena.nframes * 9 + (uint64_t)ghost * sizeof(*c->ghost));
	return 0;
}

void cache_index_destroy(struct cache *c)
{
	for (unsigned i = 0; i < CACHE_SHARDS; i++) {
		struct cache_shard *sh = &c->shards[i];
		for (size_t b = 0; b < sh->nbuckets; b++) {
			struct cache_range *r = sh->buckets[b];
			while (r) {
				struct cache_range *next = r->hash_next;
				for (uint32_t k = 0; k < r->count; k++)
					free(r->entries[k]);
				free(r->entries);
				free(r);
				r = next;
			}
		}
		free(sh->buckets);
		pthread_mutex_destroy(&sh->lock);
	}
	/* Retired exports too: they stay on the list until now (struct
	 * cache_export, retired). */
	struct cache_export *ce = c->exports;
	while (ce) {
		struct cache_export *next = ce->next;
		pthread_mutex_destroy(&ce->lock);
		free(ce);
		ce = next;
	}
	free(c->ghost);
	arena_destroy(&c->arena);
	pthread_mutex_destroy(&c->evict_lock);
	pthread_mutex_destroy(&c->waitq.lock);
	pthread_mutex_destroy(&c->exports_lock);
	pthread_mutex_destroy(&c->nudge.lock);
	pthread_cond_destroy(&c->nudge.cond);
}

int cache_export_add(struct cache *c, struct backend *be, const struct export_spec *spec,
		     struct cache_export **out)
{
	struct cache_export *ce = calloc(1, sizeof(*ce));
	if (!ce)
		return -ENOMEM;
	ce->cache = c;
	ce->backend = be;
	ce->size = be->size;
	ce->block_size = spec->block_size;
	ce->block_shift = (unsigned)__builtin_ctz(spec->block_size);
	ce->min_order = ce->block_shift > ARENA_FRAME_SHIFT ? ce->block_shift - ARENA_FRAME_SHIFT : 0;
	ce->mode = spec->cache_mode;
	ce->seq_cutoff = spec->seq_cutoff;
	cache_export_set_watermarks(ce, spec->dirty_high, spec->dirty_low);
	pthread_mutex_init(&ce->lock, NULL);
	pthread_mutex_lock(&c->exports_lock);
	ce->id = ++c->export_count;
	ce->next = c->exports;
	c->exports = ce;
	pthread_mutex_unlock(&c->exports_lock);
	*out = ce;
	return 0;
}

enum cache_mode cache_export_mode(const struct cache_export *ce)
{
	return atomic_load(&ce->mode);
}

void cache_export_set_mode(struct cache_export *ce, enum cache_mode mode)
{
	atomic_store(&ce->mode, mode);
	cache_kick_writeback(ce->cache); /* dirty data left by writeback mode goes sooner */
}

void cache_export_set_watermarks(struct cache_export *ce, unsigned high_pct, unsigned low_pct)
{
	uint64_t unit = ce->cache->arena.size / 100;
	atomic_store(&ce->dirty_high, unit * high_pct);
	atomic_store(&ce->dirty_low, unit * low_pct);
}

void cache_set_writeback_policy(struct cache *c, unsigned high_pct, unsigned low_pct,
				unsigned expire_seconds)
{
	atomic_store(&c->dirty_high, c->arena.size / 100 * high_pct);
	atomic_store(&c->dirty_low, c->arena.size / 100 * low_pct);
	atomic_store(&c->dirty_expire_ns, (uint64_t)expire_seconds * 1000000000u);
	cache_kick_writeback(c);
}

/*
 * Evict every clean, idle entry of the export. The export's range list is
 * copied under its lock first (the lock order puts shard locks before the
 * export lock), then each range is looked up again under its shard lock.
 */
int cache_export_drop_clean(struct cache_export *ce, uint64_t *dropped, uint64_t *kept)
{
	struct cache *c = ce->cache;
	*dropped = 0;
	pthread_mutex_lock(&ce->lock);
	size_t n = ce->range_count, i = 0;
	uint64_t *indexes = malloc((n ? n : 1) * sizeof(*indexes));
	if (!indexes) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	for (struct cache_range *r = ce->ranges; r && i < n; r = r->export_next)
		indexes[i++] = r->index;
	pthread_mutex_unlock(&ce->lock);
	for (size_t k = 0; k < i; k++) {
		struct cache_shard *sh = cache_shard_for(c, ce, indexes[k]);
		pthread_mutex_lock(&sh->lock);
		pthread_mutex_lock(&c->evict_lock);
		struct cache_range *r = range_find(sh, ce, indexes[k]);
		for (uint32_t j = r ? r->count : 0; r && j-- > 0;) {
			struct cache_entry *e = r->entries[j];
			if (!entry_evictable(e))
				continue;
			*dropped += cache_entry_bytes(e);
			bool last = r->count == 1;
			entry_destroy(c, sh, e);
			if (last)
				break; /* the range went with its last entry */
		}
		pthread_mutex_unlock(&c->evict_lock);
		pthread_mutex_unlock(&sh->lock);
	}
	free(indexes);
	*kept = atomic_load(&ce->counters.cached_bytes);
	cache_waitq_wake(c); /* room for waiting allocations */
	return 0;
}

int cache_export_retire(struct cache_export *ce)
{
	uint64_t dropped, kept;
	int rc = cache_export_drop_clean(ce, &dropped, &kept);
	if (rc < 0)
		return rc;
	if (kept || cache_export_unflushed(ce))
		return -EBUSY;
	atomic_store(&ce->retired, true);
	return 0;
}

void cache_export_note_direct_write(struct cache_export *ce)
{
	atomic_fetch_add(&ce->backend_writes_done, 1);
	atomic_fetch_add(&ce->direct_writes_done, 1);
}

bool cache_export_unflushed(struct cache_export *ce)
{
	return atomic_load(&ce->counters.dirty_bytes) ||
	       atomic_load(&ce->counters.unstable_bytes) ||
	       atomic_load(&ce->backend_writes_done) != atomic_load(&ce->backend_writes_flushed);
}

uint64_t cache_export_error_seq(struct cache_export *ce)
{
	pthread_mutex_lock(&ce->lock);
	uint64_t seq = ce->error_seq;
	pthread_mutex_unlock(&ce->lock);
	return seq;
}

static void counters_load(const struct cache_counters *k, struct cache_export_stats *s)
{
	s->hits = atomic_load(&k->hits);
	s->misses = atomic_load(&k->misses);
	s->partial_hits = atomic_load(&k->partial_hits);
	s->backend_reads = atomic_load(&k->backend_reads);
	s->backend_read_bytes = atomic_load(&k->backend_read_bytes);
	s->backend_writes = atomic_load(&k->backend_writes);
	s->backend_write_bytes = atomic_load(&k->backend_write_bytes);
	s->writeback_bytes = atomic_load(&k->writeback_bytes);
	s->evictions = atomic_load(&k->evictions);
	s->writeback_errors = atomic_load(&k->writeback_errors);
	s->bypass_reads = atomic_load(&k->bypass_reads);
	s->direct_writes = atomic_load(&k->direct_writes);
	s->dirty_bytes = atomic_load(&k->dirty_bytes);
	s->cached_bytes = atomic_load(&k->cached_bytes);
	s->unstable_bytes = atomic_load(&k->unstable_bytes);
	s->backend_flushes = atomic_load(&k->backend_flushes);
	s->backend_flush_errors = atomic_load(&k->backend_flush_errors);
	s->losses = atomic_load(&k->losses);
}

static void counters_sum(struct cache_export_stats *sum, const struct cache_export_stats *s)
{
	sum->hits += s->hits;
	sum->misses += s->misses;
	sum->partial_hits += s->partial_hits;
	sum->backend_reads += s->backend_reads;
	sum->backend_read_bytes += s->backend_read_bytes;
	sum->backend_writes += s->backend_writes;
	sum->backend_write_bytes += s->backend_write_bytes;
	sum->writeback_bytes += s->writeback_bytes;
	sum->evictions += s->evictions;
	sum->writeback_errors += s->writeback_errors;
	sum->bypass_reads += s->bypass_reads;
	sum->direct_writes += s->direct_writes;
	sum->unstable_bytes += s->unstable_bytes;
	sum->backend_flushes += s->backend_flushes;
	sum->backend_flush_errors += s->backend_flush_errors;
	sum->losses += s->losses;
}

void cache_export_get_stats(struct cache_export *ce, struct cache_export_stats *out)
{
	memset(out, 0, sizeof(*out));
	counters_load(&ce->counters, out);
}

void cache_get_stats(struct cache *c, struct cache_stats *s)
{
	struct cache_counters *k = &c->counters;
	memset(s, 0, sizeof(*s));
	s->arena = arena_kind_name(c->arena.kind);
	s->cache_bytes = c->arena.size;
	pthread_mutex_lock(&c->arena.lock);
	s->used_bytes = (uint64_t)(c->arena.nframes - c->arena.free_frames) << ARENA_FRAME_SHIFT;
	pthread_mutex_unlock(&c->arena.lock);
	s->entries = atomic_load(&k->entries);
	s->metadata_bytes = atomic_load(&k->metadata_bytes);
	struct cache_export_stats one;
	pthread_mutex_lock(&c->exports_lock);
	for (struct cache_export *ce = c->exports; ce; ce = ce->next) {
		counters_load(&ce->counters, &one);
		counters_sum(&s->traffic, &one);
	}
	pthread_mutex_unlock(&c->exports_lock);
	s->traffic.dirty_bytes = atomic_load(&k->dirty_bytes);
	s->traffic.cached_bytes = atomic_load(&k->entry_bytes);
	arena_free_by_order(&c->arena, s->free_bytes_by_order);
	s->fragmentation = arena_fragmentation(s->free_bytes_by_order);
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		s->free_bytes_by_order[o] <<= ARENA_FRAME_SHIFT;
	s->free_2m_bytes = s->free_bytes_by_order[ARENA_MAX_ORDER];
	s->large_bytes = atomic_load(&k->large_bytes);
	s->large_share = s->traffic.cached_bytes ? s->large_bytes * 1000 / s->traffic.cached_bytes : 0;
	s->alloc_2m_attempts = atomic_load(&k->alloc_2m_attempts);
	s->alloc_2m_ok = atomic_load(&k->alloc_2m_ok);
	s->alloc_failures = atomic_load(&k->alloc_failures);
	s->compact_moves = atomic_load(&k->compact_moves);
	s->compact_skipped_pinned = atomic_load(&k->compact_skipped_pinned);
	s->compact_collapses = atomic_load(&k->compact_collapses);
	s->compact_chunks_freed = atomic_load(&k->compact_chunks_freed);
	s->compact_passes = atomic_load(&k->compact_passes);
	s->compact_ns = atomic_load(&k->compact_ns);
}

void cache_log_stats(struct cache *c)
{
	struct cache_stats s;
	cache_get_stats(c, &s);
	char by_order[ARENA_ORDERS * 24] = "";
	size_t at = 0;
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		at += (size_t)snprintf(by_order + at, sizeof(by_order) - at, "%s%llu", o ? "," : "",
				       (unsigned long long)s.free_bytes_by_order[o]);
	log_info("stats: arena=%s cache_bytes=%llu used_bytes=%llu entries=%llu hits=%llu "
		 "misses=%llu partial_hits=%llu backend_reads=%llu backend_read_bytes=%llu "
		 "backend_writes=%llu backend_write_bytes=%llu dirty_bytes=%llu evictions=%llu "
		 "writeback_errors=%llu bypass_reads=%llu direct_writes=%llu "
		 "metadata_bytes=%llu free_2m_bytes=%llu fragmentation=%llu "
		 "free_bytes_by_order=%s large_bytes=%llu large_share=%llu alloc_2m_attempts=%llu "
		 "alloc_2m_ok=%llu alloc_failures=%llu compact_moves=%llu compact_skipped_pinned=%llu "
		 "compact_collapses=%llu compact_chunks_freed=%llu compact_passes=%llu "
		 "compact_ns=%llu unstable_bytes=%llu backend_flushes=%llu "
		 "backend_flush_errors=%llu losses=%llu",
		 s.arena, (unsigned long long)s.cache_bytes, (unsigned long long)s.used_bytes,
		 (unsigned long long)s.entries, (unsigned long long)s.traffic.hits,
		 (unsigned long long)s.traffic.misses, (unsigned long long)s.traffic.partial_hits,
		 (unsigned long long)s.traffic.backend_reads, (unsigned long long)s.traffic.backend_read_bytes,
		 (unsigned long long)s.traffic.backend_writes, (unsigned long long)s.traffic.backend_write_bytes,
		 (unsigned long long)s.traffic.dirty_bytes, (unsigned long long)s.traffic.evictions,
		 (unsigned long long)s.traffic.writeback_errors, (unsigned long long)s.traffic.bypass_reads,
		 (unsigned long long)s.traffic.direct_writes, (unsigned long long)s.metadata_bytes,
		 (unsigned long long)s.free_2m_bytes, (unsigned long long)s.fragmentation, by_order,
		 (unsigned long long)s.large_bytes, (unsigned long long)s.large_share,
		 (unsigned long long)s.alloc_2m_attempts, (unsigned long long)s.alloc_2m_ok,
		 (unsigned long long)s.alloc_failures, (unsigned long long)s.compact_moves, (unsigned long long)s.compact_skipped_pinned,
		 (unsigned long long)s.compact_collapses,
		 (unsigned long long)s.compact_chunks_freed, (unsigned long long)s.compact_passes,
		 (unsigned long long)s.compact_ns, (unsigned long long)s.traffic.unstable_bytes,
		 (unsigned long long)s.traffic.backend_flushes,
		 (unsigned long long)s.traffic.backend_flush_errors,
		 (unsigned long long)s.traffic.losses);
}
