/*
 * daemon/cache/slots.c: the index's memory (entry.h's picture): the
 * pools of fixed-size slots that hold entries, side records and range
 * nodes, the per-block maps of an entry (in it for one block, in its side
 * record for more), and the side records' life: allocated when a one-block
 * entry becomes dirty or unstable, freed once it is clean and idle. Every
 * byte allocated here is counted in metadata_bytes.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

/* Bytes of a chunk: its slots, then their tails. */
static size_t chunk_bytes(const struct cache_pool *p)
{
	return (size_t)(p->slot_size + p->tail_size) << p->shift;
}

int cache_pool_init(struct cache_pool *p, struct cache *c, uint32_t slot_size, uint32_t tail_size,
		    uint64_t max)
{
	uint32_t shift = 0;
	while (((size_t)(slot_size + tail_size) << (shift + 1)) <= CACHE_POOL_CHUNK_BYTES)
		shift++;
	uint64_t chunks = max / ((1u << shift) - 1) + 2;
	if (chunks << shift > (1ull << CACHE_QUEUE_SHIFT))
		return -E2BIG;
	memset(p, 0, sizeof(*p));
	p->cache = c;
	p->slot_size = slot_size;
	p->tail_size = tail_size;
	p->shift = shift;
	p->max_chunks = (uint32_t)chunks;
	p->chunks = calloc(chunks, sizeof(*p->chunks));
	if (!p->chunks)
		return -ENOMEM;
	pthread_mutex_init(&p->lock, NULL);
	atomic_fetch_add(&c->counters.metadata_bytes, chunks * sizeof(*p->chunks));
	return 0;
}

void cache_pool_destroy(struct cache_pool *p)
{
	for (uint32_t i = 0; i < p->nchunks; i++)
		free(p->chunks[i]);
	free(p->chunks);
	if (p->cache)
		pthread_mutex_destroy(&p->lock);
}

/* A zeroed slot's index, or 0 if out of memory. */
uint32_t cache_pool_alloc(struct cache_pool *p)
{
	pthread_mutex_lock(&p->lock);
	uint32_t i = p->free_head;
	if (i) {
		p->free_head = *(uint32_t *)cache_pool_slot(p, i);
	} else {
		uint32_t mask = (1u << p->shift) - 1;
		if ((p->high & mask) == 0) {
			/* A new chunk; its slot 0 is the header. */
			uint32_t chunk = p->high >> p->shift;
			size_t bytes = chunk_bytes(p);
			void *mem = NULL;
			if (chunk >= p->max_chunks ||
			    posix_memalign(&mem, CACHE_POOL_CHUNK_BYTES, bytes) != 0) {
				pthread_mutex_unlock(&p->lock);
				return 0;
			}
			struct cache_pool_header *h = mem;
			h->cache = p->cache;
			h->chunk = chunk;
			p->chunks[chunk] = mem;
			p->nchunks = chunk + 1;
			p->high++;
			atomic_fetch_add(&p->cache->counters.metadata_bytes, bytes);
		}
		i = p->high++;
	}
	p->used++;
	pthread_mutex_unlock(&p->lock);
	memset(cache_pool_slot(p, i), 0, p->slot_size);
	if (p->tail_size)
		memset(p->chunks[i >> p->shift] + ((size_t)p->slot_size << p->shift) +
			   (size_t)(i & ((1u << p->shift) - 1)) * p->tail_size,
		       0, p->tail_size);
	return i;
}

void cache_pool_free(struct cache_pool *p, uint32_t i)
{
	pthread_mutex_lock(&p->lock);
	*(uint32_t *)cache_pool_slot(p, i) = p->free_head;
	p->free_head = i;
	if (--p->used == 0 && p->release_when_empty) {
		/* Nothing refers to any slot: the memory goes back. */
		for (uint32_t k = 0; k < p->nchunks; k++) {
			free(p->chunks[k]);
			p->chunks[k] = NULL;
		}
		atomic_fetch_sub(&p->cache->counters.metadata_bytes,
				 (uint64_t)p->nchunks * chunk_bytes(p));
		p->nchunks = p->high = p->free_head = 0;
	}
	pthread_mutex_unlock(&p->lock);
}

/* ---- per-block state ---- */

static uint32_t map_words(uint32_t nblocks)
{
	return (nblocks + 31) / 32;
}

static struct cache_map entry_map(struct cache_entry *e, unsigned which)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (x && x->maps)
		return (struct cache_map){x->maps + which * map_words(cache_entry_nblocks(e)), 0};
	return (struct cache_map){&e->state, which};
}

struct cache_map cache_uptodate_map(struct cache_entry *e)
{
	return entry_map(e, 0);
}

struct cache_map cache_dirty_map(struct cache_entry *e)
{
	return entry_map(e, 1);
}

struct cache_map cache_busy_map(struct cache_entry *e)
{
	return entry_map(e, 2);
}

/* e's side record, new (with the maps of a multi-block entry, copied from
 * nowhere: nothing is cached yet), or NULL if out of memory. */
struct cache_entry_ext *cache_entry_ext_new(struct cache *c, struct cache_entry *e,
					     uint32_t nblocks)
{
	uint32_t i = cache_pool_alloc(&c->ext);
	if (!i)
		return NULL;
	struct cache_entry_ext *x = cache_pool_slot(&c->ext, i);
	if (nblocks > 1) {
		x->maps = calloc(3 * map_words(nblocks), sizeof(uint32_t));
		if (!x->maps) {
			cache_pool_free(&c->ext, i);
			return NULL;
		}
		atomic_fetch_add(&c->counters.metadata_bytes, arena_heap_bytes(x->maps));
	}
	e->ext = i;
	return x;
}

void cache_entry_ext_free(struct cache *c, struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x)
		return;
	if (x->on_unlogged_list) {
		/* It would stay linked from its neighbours: a bug. */
		log_error("cache: an entry still on its export's unlogged list was freed");
		abort();
	}
	if (x->maps) {
		atomic_fetch_sub(&c->counters.metadata_bytes, arena_heap_bytes(x->maps));
		free(x->maps);
	}
	cache_pool_free(&c->ext, e->ext);
	e->ext = 0;
}

int cache_entry_ext_reserve(struct cache_export *ce, struct cache_entry *e)
{
	if (cache_entry_ext(e))
		return 0;
	pthread_mutex_lock(&ce->lock);
	bool ok = cache_entry_ext(e) || cache_entry_ext_new(ce->cache, e, 1);
	pthread_mutex_unlock(&ce->lock);
	return ok ? 0 : -ENOMEM;
}

void cache_entry_ext_unreserve(struct cache_export *ce, struct cache_entry *e)
{
	pthread_mutex_lock(&ce->lock);
	cache_entry_ext_trim(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

struct cache_entry_ext *cache_entry_ext_get(struct cache_export *ce, struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (x)
		return x;
	x = cache_entry_ext_new(ce->cache, e, 1);
	if (!x) {
		/* A caller that did not reserve (cache_entry_ext_reserve): a
		 * bug. Going on would lose track of acknowledged data. */
		log_error("cache: no memory for the state of a dirty entry, and none was reserved");
		abort();
	}
	return x;
}

void cache_entry_ext_trim(struct cache_export *ce, struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x || x->on_dirty_list || x->on_unstable_list || x->writeback || x->ndirty ||
	    x->nunstable)
		return;
	/* Durable on the backend: no log round need copy it (and an entry
	 * on that list must never be evictable, see cache_list_pin). */
	cache_unlogged_remove(ce, e);
	if (!x->maps)
		cache_entry_ext_free(ce->cache, e);
}

/* The pool index of a slot of p. */
uint32_t cache_pool_index_of(const struct cache_pool *p, const void *slot)
{
	const struct cache_pool_header *h = cache_pool_header_of(slot);
	return h->chunk << p->shift |
	       (uint32_t)(((const uint8_t *)slot - (const uint8_t *)h) / p->slot_size);
}

