/*
 * daemon/cache/entry.h: what an entry is, below the index that finds it:
 * the pools its records live in (addressed by 32-bit handles), its 28
 * bytes and its tail byte, its side record, the range node that holds it,
 * its per-block maps, and the accessors that need nothing but the entry
 * (the ones that need the cache or its export are in internal.h). The
 * layout decisions and their bounds are here; their use is in slots.c
 * (pools, maps, side records), cache.c (the index) and evict.c (queues).
 */
#ifndef NBDCACHED_DAEMON_CACHE_ENTRY_H
#define NBDCACHED_DAEMON_CACHE_ENTRY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define CACHE_RANGE_SHIFT 21 /* 2 MiB device ranges */

struct cache;
struct cache_export;

/*
 * A pool of fixed-size slots addressed by 32-bit index (0: none): chunks
 * of 2^shift slots (at most 16 KiB, aligned to 16 KiB), allocated as the
 * pool grows and kept, so a slot never moves (entries are handled by
 * pointer) and a pointer finds its chunk by alignment. Slot 0 of every
 * chunk is its header (the cache, the chunk's number), never handed out.
 * A pool may give each slot tail_size more bytes in the chunk's tail, after
 * its 2^shift slots: the entries' pos_low (cache_entry_tail). Freed slots
 * go on a free list and are used again first; a pool whose
 * slots are only reached through their owners (side records) gives its
 * chunks back when none is in use. The lock is a leaf; the directory is
 * sized for the most the pool can hold.
 */
#define CACHE_POOL_CHUNK_BYTES 16384u
struct cache_pool {
	struct cache *cache;
	uint32_t slot_size, tail_size, shift; /* 2^shift slots per chunk */
	uint32_t max_chunks, nchunks;
	uint8_t **chunks; /* the directory */
	pthread_mutex_t lock;
	uint32_t free_head, high; /* high: the next never used index */
	uint64_t used;
	bool release_when_empty; /* free the chunks when no slot is in use */
};

struct cache_pool_header {
	struct cache *cache;
	uint32_t chunk;
};

/*
 * An entry: 28 bytes on every ABI, and one more byte, pos_low, in its pool
 * chunk's tail (the chunk: 512 slots of 28 bytes, then 512 bytes, one per
 * slot). A lookup's binary search reads the tail bytes of the entries it
 * probes (as it read their pos before); everything else the hit path reads
 * is in the 28 bytes (frame, and in one atomic word the pins, the
 * frequency and the order; the one-block maps); the range node gives the
 * export and the device offset (first frame = range index * 512 + pos).
 * State that only dirty or unstable entries need, and the maps of entries
 * of more than one block, is in a side record (ext).
 *
 * pos (0..511, set at creation, never changed) is split: its low 8 bits
 * in the chunk's tail, its top bit (pos_high) beside the range index. The
 * range node's array keeps a copy of pos_high in each index it holds, so
 * a binary search by pos reads the tail byte alone (cache.c).
 */
struct cache_entry {
	uint32_t range : 30;   /* range node (ranges pool index); never changed */
	uint32_t pos_high : 1; /* pos >> 8; never changed */
	uint32_t : 1;
	uint32_t frame;	    /* arena location */
	uint32_t fifo_prev; /* evict lock: entries pool index | queue << 30 */
	uint32_t fifo_next; /* evict lock: entries pool index */
	/* Shard lock and export lock to change, either to read: the side
	 * record (ext pool index), 0 for a clean one-block entry. */
	uint32_t ext;
	union { /* shard lock */
		uint32_t state;
		struct {
			/* uptodate, dirty, busy of a one-block entry (bits 0..2) */
			uint32_t inline_maps : 3;
			/* A fill put bytes in it while a direct write of its
			 * export was on the backend unflushed (cache_fill_unproven):
			 * its clean blocks may hold bytes the backend can still
			 * lose, so they never go to the level-2 cache, and a
			 * backend flush settling it logs them as DATA, not CLEAN
			 * (flush_log.c). For its life. */
			uint32_t unproven : 1;
			/* bumped to discard fills in flight (28 bits, wraps) */
			uint32_t invalidations : 28;
		};
	};
	/*
	 * One atomic word, read and changed without a lock:
	 *   bits  0..24  pins (fetch_add / fetch_sub), at most 2^25 - 1: a live
	 *                request pins an entry once (one piece each), a
	 *                connection has at most 128 live (conn.h) and
	 *                --max-clients is at most 65536, so 2^23 and the
	 *                background threads' few; unlimited clients would need
	 *                262144 connections on one entry. A pin past the
	 *                bound aborts rather than carry (cache_entry_pin)
	 *   bit   25     may_hold_zeros, changed under the shard lock: a hint
	 *                for sparse reads, clear while no 4 KiB block of the
	 *                entry can be all zeros (fills found none, nothing was
	 *                written since), so a hit sends it as data without
	 *                reading it first
	 *   bits 26..27  S3-FIFO access counter, 0..3 (cache_entry_touch, evict.c)
	 *   bits 28..31  order, set at creation, never changed
	 */
	atomic_uint hot;
};

_Static_assert(sizeof(struct cache_entry) == 28, "an entry is 28 bytes on every ABI");

#define CACHE_PINS_MASK ((1u << 25) - 1)
#define CACHE_ZEROS_BIT (1u << 25)
#define CACHE_FREQ_SHIFT 26
#define CACHE_FREQ_ONE (1u << CACHE_FREQ_SHIFT)
#define CACHE_FREQ_MASK (3u << CACHE_FREQ_SHIFT)
#define CACHE_ORDER_SHIFT 28
/* The entries pool: 2^9 slots a chunk, each with a tail byte (pos_low). */
#define CACHE_ENTRY_SHIFT 9
#define CACHE_ENTRY_TAIL 1
_Static_assert((sizeof(struct cache_entry) + CACHE_ENTRY_TAIL) << CACHE_ENTRY_SHIFT <=
		       CACHE_POOL_CHUNK_BYTES &&
		   (sizeof(struct cache_entry) + CACHE_ENTRY_TAIL) << (CACHE_ENTRY_SHIFT + 1) >
		       CACHE_POOL_CHUNK_BYTES,
	       "an entries pool chunk is 2^CACHE_ENTRY_SHIFT slots and their tails");

/* An entry's place on one of its export's lists (dirty.c): the pool
 * indexes of its neighbours, 0 for none. */
struct cache_link {
	uint32_t prev, next;
};

/*
 * The side record of an entry that is dirty, unstable or under writeback,
 * or of more than one block (it holds their maps). Lists link entries by
 * pool index; the export lock guards the links and the list flags, the
 * shard lock the rest.
 */
struct cache_entry_ext {
	uint64_t dirty_since; /* monotonic ns, when it joined the dirty list */
	/* backend_writes_done after its latest write back: a backend flush sent
	 * once that many writes were done makes the entry clean. */
	uint64_t unstable_seq;
	uint32_t *maps; /* more than one block: uptodate, dirty, busy (words each) */
	struct cache_link dirty_link, unstable_link, unlogged_link;
	uint32_t ndirty, nunstable; /* nunstable: written back since the last flush */
	bool on_dirty_list;
	bool on_unstable_list; /* written back, no backend flush since: see cache.h */
	bool writeback;	       /* a writeback of this entry is in flight */
	/* A cache device's log round copied it, and no block of it was
	 * dirtied since (cache_mark_dirty): the next round need not copy it
	 * again (flush_log.c, log_entry). */
	bool logged;
	/* On its export's unlogged list: not logged, and not durable on the
	 * backend (dirty, unstable or being written back). Changed under
	 * both the shard lock and the export lock, so either reads it. */
	bool on_unlogged_list;
};

/* Range nodes: a slot of the ranges pool. The entries (pool indexes,
 * sorted by pos; bit 31 a copy of the entry's pos_high) are in the node
 * while there are at most CACHE_RANGE_INLINE (cap is then
 * CACHE_RANGE_INLINE), in an array malloc'd at cap after:
 * cache_range_entries(). */
#define CACHE_RANGE_INLINE 2
struct cache_range {
	struct cache_export *ce;
	uint64_t index; /* device offset >> CACHE_RANGE_SHIFT */
	union {
		uint32_t *array;
		uint32_t inline_entries[CACHE_RANGE_INLINE];
	};
	uint32_t hash_next; /* ranges pool index */
	uint32_t export_prev, export_next;
	uint16_t count, cap;
};

static inline uint32_t *cache_range_entries(struct cache_range *r)
{
	return r->cap > CACHE_RANGE_INLINE ? r->array : r->inline_entries;
}

/* fifo_prev: an entries pool index, and the queue it is on above it. */
#define CACHE_QUEUE_SHIFT 30
#define CACHE_INDEX_MASK ((1u << CACHE_QUEUE_SHIFT) - 1)

/* An entry's per-block bits: uptodate, dirty, busy (slots.c). */
struct cache_map {
	uint32_t *w;
	uint32_t shift;
};

/* ---- from a handle to the pools ---- */

static inline void *cache_pool_slot(const struct cache_pool *p, uint32_t i)
{
	return p->chunks[i >> p->shift] + (size_t)(i & ((1u << p->shift) - 1)) * p->slot_size;
}

static inline const struct cache_pool_header *cache_pool_header_of(const void *slot)
{
	return (const struct cache_pool_header *)((uintptr_t)slot &
						  ~(uintptr_t)(CACHE_POOL_CHUNK_BYTES - 1));
}

static inline struct cache *cache_of_entry(const struct cache_entry *e)
{
	return cache_pool_header_of(e)->cache;
}

static inline uint32_t cache_entry_index(const struct cache_entry *e)
{
	const struct cache_pool_header *h = cache_pool_header_of(e);
	uint32_t slot = (uint32_t)((const struct cache_entry *)e - (const struct cache_entry *)h);
	return h->chunk << CACHE_ENTRY_SHIFT | slot;
}

/* The entry's byte in its chunk's tail (pos_low). */
static inline uint8_t *cache_entry_tail(const struct cache_entry *e)
{
	const struct cache_pool_header *h = cache_pool_header_of(e);
	size_t slot = (size_t)((const struct cache_entry *)e - (const struct cache_entry *)h);
	return (uint8_t *)h + (sizeof(struct cache_entry) << CACHE_ENTRY_SHIFT) + slot;
}

/* First frame - range index * 512; set at creation (cache_entry_set_place). */
static inline uint32_t cache_entry_pos(const struct cache_entry *e)
{
	return (uint32_t)e->pos_high << 8 | *cache_entry_tail(e);
}

/* A new entry's place, before anything else can reach it: its range node,
 * pos and order. */
static inline void cache_entry_set_place(struct cache_entry *e, uint32_t range, uint32_t pos,
					 unsigned order)
{
	e->range = range & CACHE_INDEX_MASK;
	e->pos_high = (pos >> 8) & 1;
	*cache_entry_tail(e) = (uint8_t)pos;
	atomic_store_explicit(&e->hot, (unsigned)order << CACHE_ORDER_SHIFT, memory_order_relaxed);
}

/* The word of pins, frequency, order and the zeros hint (struct cache_entry). */
static inline unsigned cache_entry_order(const struct cache_entry *e)
{
	return atomic_load_explicit(&e->hot, memory_order_relaxed) >> CACHE_ORDER_SHIFT;
}
/* Pinned: acquire, so that what the last unpinner did is seen. */
static inline bool cache_entry_pinned(const struct cache_entry *e)
{
	return (atomic_load_explicit(&e->hot, memory_order_acquire) & CACHE_PINS_MASK) != 0;
}
static inline unsigned cache_entry_freq(const struct cache_entry *e)
{
	return (atomic_load_explicit(&e->hot, memory_order_relaxed) & CACHE_FREQ_MASK) >>
	       CACHE_FREQ_SHIFT;
}
static inline bool cache_entry_may_hold_zeros(const struct cache_entry *e)
{
	return atomic_load_explicit(&e->hot, memory_order_relaxed) & CACHE_ZEROS_BIT;
}
/* Shard lock held (the hint's writers hold it; readers need not). */
static inline void cache_entry_set_may_hold_zeros(struct cache_entry *e)
{
	atomic_fetch_or_explicit(&e->hot, CACHE_ZEROS_BIT, memory_order_relaxed);
}

/* Bits of a map (struct cache_map). */
static inline bool map_test(struct cache_map m, uint32_t i)
{
	i += m.shift;
	return (m.w[i >> 5] >> (i & 31)) & 1;
}
static inline void map_set(struct cache_map m, uint32_t i)
{
	i += m.shift;
	m.w[i >> 5] |= 1u << (i & 31);
}
static inline void map_clear(struct cache_map m, uint32_t i)
{
	i += m.shift;
	m.w[i >> 5] &= ~(1u << (i & 31));
}
/* Any bit set among the first n. */
static inline bool map_any(struct cache_map m, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		if (map_test(m, i))
			return true;
	return false;
}

/* Set bit to + i of dst for each bit from + i of src set, i < n; returns
 * how many were set in src. */
static inline uint32_t map_copy(struct cache_map dst, uint32_t to, struct cache_map src,
				uint32_t from, uint32_t n)
{
	uint32_t set = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (map_test(src, from + i)) {
			map_set(dst, to + i);
			set++;
		}
	}
	return set;
}

/* A 64-bit mix of every input bit into every output bit: range nodes'
 * hash (cache.c) and the ghost table's fingerprints (evict.c). */
static inline uint64_t cache_mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

/* Bit helpers over uint64_t words. */
static inline bool bit_test(const uint64_t *map, uint32_t i)
{
	return (map[i >> 6] >> (i & 63)) & 1;
}
static inline void bit_set(uint64_t *map, uint32_t i)
{
	map[i >> 6] |= 1ull << (i & 63);
}
static inline void bit_clear(uint64_t *map, uint32_t i)
{
	map[i >> 6] &= ~(1ull << (i & 63));
}

#endif
