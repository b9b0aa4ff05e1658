/*
 * daemon/cache/cache.c: the index, the entries (handles), eviction and the
 * index's part of the cache's life (see cache.h and internal.h; per-block
 * dirty state: dirty.c, the exports: exports.c, statistics: stats.c,
 * wake-ups: wake.c).
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
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cache/internal.h"

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

/* ---- dropping an export's clean entries ---- */

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
