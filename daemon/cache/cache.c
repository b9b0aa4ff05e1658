/*
 * daemon/cache/cache.c: the index, the entries (handles) and the index's
 * part of the cache's life (see cache.h and internal.h; the S3-FIFO queues
 * and eviction: evict.c; the pools, maps and side records: slots.c;
 * per-block dirty state: dirty.c, the exports: exports.c, statistics:
 * stats.c, wake-ups: wake.c).
 *
 * A new entry gets its frames here, through evict.c when the arena is full
 * (cache_alloc_evicting), and joins its queue there (cache_queue_insert);
 * an evicted entry leaves the index here (cache_entry_destroy).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

bool cache_all_zero(const uint8_t *p, size_t n)
{
	static const uint8_t zero16[16];
	return memcmp(p, zero16, 16) == 0 && memcmp(p, p + 16, n - 16) == 0;
}

static uint64_t range_hash(const struct cache_export *ce, uint64_t range_index)
{
	return cache_mix64(range_index * 0x9e3779b97f4a7c15ull + ce->id);
}

struct cache_shard *cache_shard_for(struct cache *c, const struct cache_export *ce,
				    uint64_t range_index)
{
	return &c->shards[range_hash(ce, range_index) % CACHE_SHARDS];
}

/* ---- index ---- */

static uint32_t bucket_of(const struct cache_shard *sh, const struct cache_export *ce,
			  uint64_t index)
{
	return (uint32_t)(range_hash(ce, index) / CACHE_SHARDS & (sh->nbuckets - 1));
}

static struct cache_range *range_find(struct cache *c, struct cache_shard *sh,
				      const struct cache_export *ce, uint64_t index)
{
	if (!sh->nbuckets)
		return NULL;
	struct cache_range *r = cache_range_at(c, sh->buckets[bucket_of(sh, ce, index)]);
	while (r && (r->ce != ce || r->index != index))
		r = cache_range_at(c, r->hash_next);
	return r;
}

static int shard_grow(struct cache *c, struct cache_shard *sh)
{
	size_t n = sh->nbuckets ? sh->nbuckets * 2 : 64;
	uint32_t *b = calloc(n, sizeof(*b));
	if (!b)
		return -ENOMEM;
	size_t old = sh->nbuckets;
	uint32_t *ob = sh->buckets;
	sh->buckets = b;
	sh->nbuckets = n;
	for (size_t i = 0; i < old; i++) {
		uint32_t ri = ob[i];
		while (ri) {
			struct cache_range *r = cache_range_at(c, ri);
			uint32_t next = r->hash_next;
			uint32_t slot = bucket_of(sh, r->ce, r->index);
			r->hash_next = b[slot];
			b[slot] = ri;
			ri = next;
		}
	}
	free(ob);
	atomic_fetch_add(&c->counters.metadata_bytes, (n - old) * sizeof(*b));
	return 0;
}

static struct cache_range *range_create(struct cache_shard *sh, struct cache_export *ce,
					uint64_t index)
{
	struct cache *c = ce->cache;
	if (sh->count >= sh->nbuckets && shard_grow(c, sh) < 0 && !sh->nbuckets)
		return NULL;
	uint32_t ri = cache_pool_alloc(&c->ranges);
	if (!ri)
		return NULL;
	struct cache_range *r = cache_range_at(c, ri);
	r->ce = ce;
	r->index = index;
	r->cap = CACHE_RANGE_INLINE;
	uint32_t slot = bucket_of(sh, ce, index);
	r->hash_next = sh->buckets[slot];
	sh->buckets[slot] = ri;
	sh->count++;
	pthread_mutex_lock(&ce->lock);
	r->export_next = ce->ranges;
	if (ce->ranges)
		cache_range_at(c, ce->ranges)->export_prev = ri;
	ce->ranges = ri;
	ce->range_count++;
	pthread_mutex_unlock(&ce->lock);
	return r;
}

static void range_destroy(struct cache_shard *sh, struct cache_range *r)
{
	struct cache_export *ce = r->ce;
	struct cache *c = ce->cache;
	pthread_mutex_lock(&ce->lock);
	uint32_t ri = cache_pool_index_of(&c->ranges, r);
	if (r->export_prev)
		cache_range_at(c, r->export_prev)->export_next = r->export_next;
	else
		ce->ranges = r->export_next;
	if (r->export_next)
		cache_range_at(c, r->export_next)->export_prev = r->export_prev;
	ce->range_count--;
	pthread_mutex_unlock(&ce->lock);
	uint32_t *p = &sh->buckets[bucket_of(sh, ce, r->index)];
	while (*p != ri)
		p = &cache_range_at(c, *p)->hash_next;
	*p = r->hash_next;
	sh->count--;
	if (r->cap > CACHE_RANGE_INLINE) {
		atomic_fetch_sub(&c->counters.metadata_bytes, arena_heap_bytes(r->array));
		free(r->array);
	}
	cache_pool_free(&c->ranges, ri);
}

struct cache_range *cache_range_get(struct cache_shard *sh, const struct cache_export *ce,
				    uint64_t range_index)
{
	return range_find(ce->cache, sh, ce, range_index);
}

/*
 * An element of a range node's array: the entry's pool index, and a copy of
 * its pos_high in bit 31 (indexes have 30 bits). With it the binary search
 * by pos reads the entry's tail byte and nothing else of it.
 */
#define ELEMENT_POS_HIGH 31
static uint32_t range_element(const struct cache_entry *e)
{
	return cache_entry_index(e) | (uint32_t)e->pos_high << ELEMENT_POS_HIGH;
}

static struct cache_entry *element_entry(const struct cache *c, uint32_t v)
{
	return cache_entry_at(c, v & CACHE_INDEX_MASK);
}

/* The pos of element v, whose entry is e (element_entry). */
static uint32_t element_pos(uint32_t v, const struct cache_entry *e)
{
	return (v >> ELEMENT_POS_HIGH) << 8 | *cache_entry_tail(e);
}

struct cache_entry *cache_range_entry(const struct cache_range *r, uint32_t i)
{
	const uint32_t *v = r->cap > CACHE_RANGE_INLINE ? r->array : r->inline_entries;
	return element_entry(r->ce->cache, v[i]);
}

void cache_range_set_one(struct cache_range *r, struct cache_entry *e)
{
	struct cache *c = r->ce->cache;
	if (r->cap > CACHE_RANGE_INLINE) {
		atomic_fetch_sub(&c->counters.metadata_bytes, arena_heap_bytes(r->array));
		free(r->array);
		r->cap = CACHE_RANGE_INLINE;
	}
	r->inline_entries[0] = range_element(e);
	r->count = 1;
}

/* Index of the first entry whose pos is >= pos. */
static uint32_t range_search(const struct cache *c, struct cache_range *r, uint32_t pos)
{
	const uint32_t *v = cache_range_entries(r);
	uint32_t lo = 0, hi = r->count;
	while (lo < hi) {
		uint32_t mid = (lo + hi) / 2;
		if (element_pos(v[mid], element_entry(c, v[mid])) < pos)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

#define RANGE_FRAMES (1u << (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT))

struct cache_entry *cache_lookup(struct cache_export *ce, struct cache_shard *sh,
				 uint64_t device_frame)
{
	struct cache *c = ce->cache;
	struct cache_range *r =
		range_find(c, sh, ce, device_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT));
	if (!r)
		return NULL;
	uint32_t pos = (uint32_t)(device_frame & (RANGE_FRAMES - 1));
	uint32_t i = range_search(c, r, pos + 1);
	if (i == 0)
		return NULL;
	uint32_t v = cache_range_entries(r)[i - 1];
	struct cache_entry *e = element_entry(c, v);
	if (pos < element_pos(v, e) + (1u << cache_entry_order(e)))
		return e;
	return NULL;
}

int cache_ranges_between(struct cache_export *ce, uint64_t first, uint64_t last,
			 uint64_t **out, size_t *count)
{
	struct cache *c = ce->cache;
	pthread_mutex_lock(&ce->lock);
	size_t n = 0, cap = ce->range_count;
	uint64_t *v = malloc((cap ? cap : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	for (struct cache_range *r = cache_range_at(c, ce->ranges); r;
	     r = cache_range_at(c, r->export_next))
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
			struct cache_entry *e = cache_range_entry(r, i);
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
	unsigned old = atomic_fetch_add_explicit(&e->hot, 1, memory_order_relaxed);
	if ((old & CACHE_PINS_MASK) == CACHE_PINS_MASK) {
		/* Cannot be (struct cache_entry: the bound); a carry would
		 * corrupt the frequency and the order. */
		log_error("cache: an entry's pin count overflowed");
		abort();
	}
}

void cache_entry_unpin(struct cache_entry *e)
{
	unsigned old = atomic_fetch_sub_explicit(&e->hot, 1, memory_order_release);
	/* An unpin with no pin: it borrowed from the frequency bits (put
	 * back), and whoever holds the entry now is not protected by it. */
	if (NEVER((old & CACHE_PINS_MASK) == 0))
		atomic_fetch_add_explicit(&e->hot, 1, memory_order_relaxed);
}

bool cache_debug_unpin(struct cache_export *ce, uint64_t offset)
{
	struct cache_shard *sh = cache_shard_for(ce->cache, ce, offset >> CACHE_RANGE_SHIFT);
	pthread_mutex_lock(&sh->lock);
	struct cache_entry *e = cache_lookup(ce, sh, offset >> ARENA_FRAME_SHIFT);
	bool idle = e && !cache_entry_pinned(e);
	if (idle)
		cache_entry_unpin(e);
	pthread_mutex_unlock(&sh->lock);
	return idle;
}

/* Count a hit, up to 3. The word also holds the pins, which other threads
 * move meanwhile: a compare-and-swap, not a store. */
void cache_entry_touch(struct cache_entry *e)
{
	unsigned v = atomic_load_explicit(&e->hot, memory_order_relaxed);
	while ((v & CACHE_FREQ_MASK) != CACHE_FREQ_MASK &&
	       !atomic_compare_exchange_weak_explicit(&e->hot, &v, v + CACHE_FREQ_ONE,
						      memory_order_relaxed, memory_order_relaxed))
		;
}

void cache_entry_release(struct cache *c, struct cache_entry *e)
{
	cache_entry_ext_free(c, e);
	cache_pool_free(&c->entries, cache_entry_index(e));
}

/* Remove an unpinned, clean, idle entry from everything and free it.
 * Shard lock and evict lock held. */
void cache_entry_destroy(struct cache *c, struct cache_shard *sh, struct cache_entry *e)
{
	struct cache_range *r = cache_entry_range(e);
	struct cache_export *ce = r->ce;
	uint32_t i = range_search(c, r, cache_entry_pos(e));
	uint32_t *v = cache_range_entries(r);
	memmove(&v[i], &v[i + 1], (r->count - i - 1) * sizeof(*v));
	r->count--;
	cache_queue_remove(c, e);
	unsigned order = cache_entry_order(e);
	arena_free(&c->arena, e->frame, order);
	atomic_fetch_sub(&c->counters.entries, 1);
	atomic_fetch_sub(&c->counters.entry_bytes, cache_entry_bytes(e));
	if (order == ARENA_MAX_ORDER)
		atomic_fetch_sub(&c->counters.large_bytes, cache_entry_bytes(e));
	atomic_fetch_sub(&ce->counters.cached_bytes, (uint64_t)ARENA_FRAME_SIZE << order);
	cache_entry_release(c, e);
	if (r->count == 0)
		range_destroy(sh, r);
}

/* Largest order <= want whose aligned slot around frame is free in r. */
static unsigned fit_order(const struct cache_export *ce, struct cache_range *r,
			  uint64_t frame, unsigned want)
{
	const struct cache *c = ce->cache;
	uint64_t end_frame = (ce->size + ARENA_FRAME_SIZE - 1) >> ARENA_FRAME_SHIFT;
	for (unsigned o = want; o > ce->min_order; o--) {
		uint64_t start = frame & ~((1ull << o) - 1);
		if (start + (1ull << o) > end_frame)
			continue;
		if (!r)
			return o;
		uint32_t pos = (uint32_t)(start & (RANGE_FRAMES - 1));
		uint32_t i = range_search(c, r, pos);
		if (i > 0) {
			uint32_t prev = cache_range_entries(r)[i - 1];
			const struct cache_entry *pe = element_entry(c, prev);
			if (element_pos(prev, pe) + (1u << cache_entry_order(pe)) > pos)
				continue;
		}
		if (i < r->count) {
			uint32_t next = cache_range_entries(r)[i];
			if (element_pos(next, element_entry(c, next)) < pos + (1u << o))
				continue;
		}
		return o;
	}
	return ce->min_order;
}

/* Room for one more entry in r's array: grown by a quarter, so the slack
 * stays small (the array is most of the index's memory per entry). */
static int range_reserve(struct cache *c, struct cache_range *r)
{
	if (r->count < r->cap)
		return 0;
	uint32_t cap = r->cap + r->cap / 4 + 2;
	if (cap > RANGE_FRAMES)
		cap = RANGE_FRAMES;
	bool in_node = r->cap <= CACHE_RANGE_INLINE;
	size_t before = in_node ? 0 : arena_heap_bytes(r->array);
	uint32_t *v = realloc(in_node ? NULL : r->array, cap * sizeof(*v));
	if (!v)
		return -ENOMEM;
	if (in_node)
		memcpy(v, r->inline_entries, r->count * sizeof(*v));
	r->array = v;
	r->cap = (uint16_t)cap;
	atomic_fetch_add(&c->counters.metadata_bytes, arena_heap_bytes(v) - before);
	return 0;
}

struct cache_entry *cache_entry_new_large(struct cache_export *ce, struct cache_range *r,
					  uint32_t frame)
{
	struct cache *c = ce->cache;
	uint32_t ei = cache_pool_alloc(&c->entries);
	if (!ei)
		return NULL;
	struct cache_entry *e = cache_entry_at(c, ei);
	cache_entry_set_place(e, cache_pool_index_of(&c->ranges, r), 0, ARENA_MAX_ORDER);
	e->frame = frame;
	uint32_t nblocks = (uint32_t)(ARENA_CHUNK_SIZE >> ce->block_shift);
	if (!cache_entry_ext_new(c, e, nblocks)) {
		cache_pool_free(&c->entries, ei);
		return NULL;
	}
	return e;
}

struct cache_entry *cache_entry_create(struct cache_export *ce, struct cache_shard *sh,
				       uint64_t device_frame, unsigned want_order)
{
	struct cache *c = ce->cache;
	uint64_t index = device_frame >> (CACHE_RANGE_SHIFT - ARENA_FRAME_SHIFT);
	struct cache_range *r = range_find(c, sh, ce, index);
	if (want_order < ce->min_order)
		want_order = ce->min_order;
	unsigned order = fit_order(ce, r, device_frame, want_order);
	unsigned fit = order;
	/* Large entries are a hint: fall back to smaller orders, then evict. */
	int64_t frame = cache_alloc_evicting(c, sh, order, 32);
	while (frame < 0 && order > ce->min_order)
		frame = arena_alloc(&c->arena, --order);
	if (frame < 0)
		frame = cache_alloc_evicting(c, sh, order, 256);
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
	/* Evicting may have taken the range node away. */
	r = range_find(c, sh, ce, index);
	uint32_t ei = cache_pool_alloc(&c->entries);
	if (!ei)
		goto err_frame;
	struct cache_entry *e = cache_entry_at(c, ei);
	if (nblocks > 1 && !cache_entry_ext_new(c, e, nblocks))
		goto err_entry;
	if (!r)
		r = range_create(sh, ce, index);
	if (!r)
		goto err_entry;
	if (range_reserve(c, r) < 0) {
		if (r->count == 0)
			range_destroy(sh, r);
		goto err_entry;
	}
	uint32_t pos = (uint32_t)((device_frame & ~((1ull << order) - 1)) & (RANGE_FRAMES - 1));
	cache_entry_set_place(e, cache_pool_index_of(&c->ranges, r), pos, order);
	e->frame = (uint32_t)frame;
	uint32_t i = range_search(c, r, pos);
	uint32_t *v = cache_range_entries(r);
	memmove(&v[i + 1], &v[i], (r->count - i) * sizeof(*v));
	v[i] = range_element(e);
	r->count++;
	arena_set_owner(&c->arena, e->frame, ei);
	atomic_fetch_add(&c->counters.entries, 1);
	atomic_fetch_add(&c->counters.entry_bytes, cache_entry_bytes(e));
	if (order == ARENA_MAX_ORDER)
		atomic_fetch_add(&c->counters.large_bytes, cache_entry_bytes(e));
	atomic_fetch_add(&ce->counters.cached_bytes, (uint64_t)ARENA_FRAME_SIZE << order);

	cache_queue_insert(c, e);
	return e;
err_entry:
	cache_entry_release(c, e);
err_frame:
	arena_free(&c->arena, (uint32_t)frame, order);
	return NULL;
}

/* ---- splitting an entry ---- */

/* Copy the bits [from, from+n) of each of the three maps of old (words
 * per map: old_words) to [0, n) of the maps at to (words per map: words).
 * Returns how many dirty bits were copied. */
static uint32_t copy_maps(uint32_t *old, uint32_t old_words, uint32_t from, uint32_t n,
			  uint32_t *to, uint32_t words)
{
	uint32_t dirty = 0;
	for (unsigned which = 0; which < 3; which++) {
		uint32_t set = map_copy((struct cache_map){to + which * words, 0}, 0,
					(struct cache_map){old + which * old_words, 0}, from, n);
		if (which == 1)
			dirty = set;
	}
	return dirty;
}

int cache_entry_split(struct cache_export *ce, struct cache_entry *e)
{
	struct cache *c = ce->cache;
	unsigned order = cache_entry_order(e);
	uint32_t nblocks = cache_entry_nblocks(e), half = nblocks / 2;
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (order == 0 || half < 2 || !x || !x->maps)
		return -EINVAL;
	if (cache_entry_pinned(e) || x->writeback || x->on_unstable_list ||
	    map_any(cache_busy_map(e), nblocks))
		return -EBUSY;
	struct cache_range *r = cache_entry_range(e);
	if (range_reserve(c, r) < 0)
		return -ENOMEM;
	uint32_t ni = cache_pool_alloc(&c->entries);
	if (!ni)
		return -ENOMEM;
	struct cache_entry *n = cache_entry_at(c, ni);
	uint32_t words = (half + 31) / 32, old_words = (nblocks + 31) / 32;
	uint32_t *maps = calloc(3 * words, sizeof(*maps));
	struct cache_entry_ext *nx = maps ? cache_entry_ext_new(c, n, half) : NULL;
	if (!nx) {
		free(maps);
		cache_pool_free(&c->entries, ni);
		return -ENOMEM;
	}
	uint32_t half_frames = 1u << (order - 1);
	pthread_mutex_lock(&c->evict_lock);
	/* The export lock from here to the lists: a flush round pins the
	 * entries of the export's lists under it alone (cache_list_pin), and
	 * one that pinned e must not find half of it gone to an n it never
	 * saw (it would copy or write back half of e's dirty blocks and
	 * answer its FLUSHes). Looked at again now that no one can pin. */
	pthread_mutex_lock(&ce->lock);
	int rc = cache_entry_pinned(e) ? -EBUSY : arena_split_block(&c->arena, e->frame, order);
	if (rc < 0) {
		pthread_mutex_unlock(&ce->lock);
		pthread_mutex_unlock(&c->evict_lock);
		cache_entry_release(c, n);
		free(maps);
		return rc;
	}
	cache_entry_set_place(n, e->range, cache_entry_pos(e) + half_frames, order - 1);
	n->frame = e->frame + half_frames;
	n->unproven = e->unproven;
	atomic_fetch_or(&n->hot, atomic_load(&e->hot) & (CACHE_FREQ_MASK | CACHE_ZEROS_BIT));
	/* The order is in the word with the pins: no one pins e meanwhile
	 * (shard and export locks), but a subtraction leaves any count alone
	 * anyway. */
	atomic_fetch_sub(&e->hot, 1u << CACHE_ORDER_SHIFT);
	cache_queue_split(c, e, n);
	pthread_mutex_unlock(&c->evict_lock);
	arena_set_owner(&c->arena, n->frame, ni);

	uint32_t e_dirty = copy_maps(x->maps, old_words, 0, half, maps, words);
	uint32_t n_dirty = copy_maps(x->maps, old_words, half, half, nx->maps, words);
	atomic_fetch_add(&c->counters.metadata_bytes, arena_heap_bytes(maps));
	atomic_fetch_sub(&c->counters.metadata_bytes, arena_heap_bytes(x->maps));
	free(x->maps);
	x->maps = maps;
	x->ndirty = e_dirty;
	nx->ndirty = n_dirty;

	uint32_t i = range_search(c, r, cache_entry_pos(e)) + 1;
	uint32_t *v = cache_range_entries(r);
	memmove(&v[i + 1], &v[i], (r->count - i) * sizeof(*v));
	v[i] = range_element(n);
	r->count++;

	if (x->on_dirty_list) {
		if (n_dirty)
			cache_dirty_list_insert_after(ce, e, n);
		if (!e_dirty)
			cache_dirty_list_remove(ce, e);
	}
	/* The next log round copies what it would have of e (neither half is
	 * unstable or being written: only their dirty blocks). */
	nx->logged = x->logged;
	if (n_dirty && x->on_unlogged_list)
		cache_unlogged_add(ce, n);
	if (!e_dirty)
		cache_unlogged_remove(ce, e);
	pthread_mutex_unlock(&ce->lock);
	atomic_fetch_add(&c->counters.entries, 1);
	atomic_fetch_add(&c->counters.entry_splits, 1);
	if (order == ARENA_MAX_ORDER)
		atomic_fetch_sub(&c->counters.large_bytes, ARENA_CHUNK_SIZE);
	return 0;
}

/* ---- the index's part of the cache's life (lifecycle.c) ---- */

/* The entry's layout is what map_test reads: a one-block entry's maps are
 * bits 0..2 of state. Bit-field order is the ABI's: checked once. */
static bool layout_ok(void)
{
	struct cache_entry e;
	memset(&e, 0, sizeof(e));
	e.inline_maps = 1;
	return e.state == 1;
}

int cache_index_init(struct cache *c, const struct options *opts)
{
	if (!layout_ok())
		return -ENOTSUP;
	int rc = arena_init(&c->arena, (size_t)opts->cache_size, opts->hugepages);
	if (rc < 0)
		return rc;
	/* Entries: at most one per frame, and a collapse's new one. Range
	 * nodes and side records: at most one per entry. */
	uint64_t most = (uint64_t)c->arena.nframes + 2;
	if ((rc = cache_pool_init(&c->entries, c, sizeof(struct cache_entry), CACHE_ENTRY_TAIL,
				  most)) < 0 ||
	    (rc = cache_pool_init(&c->ext, c, sizeof(struct cache_entry_ext), 0, most)) < 0 ||
	    (rc = cache_pool_init(&c->ranges, c, sizeof(struct cache_range), 0, most)) < 0)
		goto err;
	if (c->entries.shift != CACHE_ENTRY_SHIFT) { /* cache_entry_tail() counts on it */
		rc = -ENOTSUP;
		goto err;
	}
	/* Side records are only reached through an entry that has one: once
	 * none has, the pool's chunks can go (a cache written, then clean). */
	c->ext.release_when_empty = true;
	uint32_t ghost = 1024;
	while (ghost < c->arena.nframes / 2)
		ghost *= 2;
	c->ghost = calloc(ghost, sizeof(*c->ghost));
	if (!c->ghost) {
		rc = -ENOMEM;
		goto err;
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
	atomic_fetch_add(&c->counters.metadata_bytes, (uint64_t)ghost * sizeof(*c->ghost));
	return 0;
err:
	cache_pool_destroy(&c->entries);
	cache_pool_destroy(&c->ext);
	cache_pool_destroy(&c->ranges);
	arena_destroy(&c->arena);
	return rc;
}

void cache_index_destroy(struct cache *c)
{
	for (unsigned i = 0; i < CACHE_SHARDS; i++) {
		struct cache_shard *sh = &c->shards[i];
		for (size_t b = 0; b < sh->nbuckets; b++) {
			struct cache_range *r = cache_range_at(c, sh->buckets[b]);
			while (r) {
				for (uint32_t k = 0; k < r->count; k++) {
					struct cache_entry_ext *x =
						cache_entry_ext(cache_range_entry(r, k));
					if (x)
						free(x->maps);
				}
				if (r->cap > CACHE_RANGE_INLINE)
					free(r->array);
				r = cache_range_at(c, r->hash_next);
			}
		}
		free(sh->buckets);
		pthread_mutex_destroy(&sh->lock);
	}
	cache_pool_destroy(&c->entries);
	cache_pool_destroy(&c->ext);
	cache_pool_destroy(&c->ranges);
	/* Retired exports too: they stay on the list until now (struct
	 * cache_export, retired). */
	struct cache_export *ce = c->exports;
	while (ce) {
		struct cache_export *next = ce->next;
		pthread_mutex_destroy(&ce->lock);
		free(ce->latency);
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

/* The bytes of e's dirty blocks at or past device offset from. */
static uint64_t dirty_bytes_from(struct cache_entry *e, uint64_t from)
{
	if (!cache_entry_ndirty(e))
		return 0;
	const struct cache_export *ce = cache_entry_export(e);
	struct cache_map dirty = cache_dirty_map(e);
	uint64_t base = cache_entry_offset(e), n = 0;
	for (uint32_t b = 0; b < cache_entry_nblocks(e); b++)
		if (base + ((uint64_t)(b + 1) << ce->block_shift) > from && map_test(dirty, b))
			n += ce->block_size;
	return n;
}

/*
 * Evict every clean, idle entry of the export that ends past device offset
 * from (0: all of them); *busy counts those that cannot go (dirty, unstable,
 * under writeback or pinned), *dirty_past their dirty bytes past from. The
 * export's range list is copied under its lock first (the lock order puts
 * shard locks before the export lock), then each range is looked up again
 * under its shard lock.
 */
int cache_export_drop_from(struct cache_export *ce, uint64_t from, uint64_t *dropped,
			   uint64_t *busy, uint64_t *dirty_past)
{
	struct cache *c = ce->cache;
	*dropped = *busy = *dirty_past = 0;
	pthread_mutex_lock(&ce->lock);
	size_t n = ce->range_count, i = 0;
	uint64_t *indexes = malloc((n ? n : 1) * sizeof(*indexes));
	if (!indexes) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	for (struct cache_range *r = cache_range_at(c, ce->ranges); r && i < n;
	     r = cache_range_at(c, r->export_next))
		if (((r->index + 1) << CACHE_RANGE_SHIFT) > from)
			indexes[i++] = r->index;
	pthread_mutex_unlock(&ce->lock);
	for (size_t k = 0; k < i; k++) {
		struct cache_shard *sh = cache_shard_for(c, ce, indexes[k]);
		pthread_mutex_lock(&sh->lock);
		pthread_mutex_lock(&c->evict_lock);
		struct cache_range *r = range_find(c, sh, ce, indexes[k]);
		for (uint32_t j = r ? r->count : 0; r && j-- > 0;) {
			struct cache_entry *e = cache_range_entry(r, j);
			if (cache_entry_offset(e) + cache_entry_bytes(e) <= from)
				continue;
			if (!cache_entry_evictable(e)) {
				*busy += 1;
				*dirty_past += dirty_bytes_from(e, from);
				continue;
			}
			*dropped += cache_entry_bytes(e);
			bool last = r->count == 1;
			cache_entry_destroy(c, sh, e);
			if (last)
				break; /* the range went with its last entry */
		}
		pthread_mutex_unlock(&c->evict_lock);
		pthread_mutex_unlock(&sh->lock);
	}
	free(indexes);
	cache_waitq_wake(c); /* room for waiting allocations */
	return 0;
}

int cache_export_drop_clean(struct cache_export *ce, uint64_t *dropped, uint64_t *kept)
{
	uint64_t busy, dirty;
	int rc = cache_export_drop_from(ce, 0, dropped, &busy, &dirty);
	*kept = atomic_load(&ce->counters.cached_bytes);
	return rc;
}
