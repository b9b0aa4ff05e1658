/*
 * daemon/cache/arena.h: the memory that holds cached data.
 *
 * Owns: one mapping of the cache size, in 2 MiB chunks, and a buddy
 * allocator of 4 KiB frames over it, orders 0 (4 KiB) to 9 (2 MiB, one
 * hugepage). The mapping is, in order of preference, a hugetlb memfd whose
 * pages are reserved up front (fallocate), so a shortage fails at start and
 * never as SIGBUS later; anonymous memory with MADV_HUGEPAGE (THP); plain
 * pages. Which one was chosen is arena->kind.
 *
 *   base                                                   base + size
 *   | chunk 0 (2 MiB) | chunk 1 | ...                     | last (maybe short)
 *   |f0|f1|f2|...|f511|
 *
 * The allocator's tables never live in the arena (nothing is written there
 * until data is cached, so start-up faults none of it in) and cost little
 * per cached byte: one record per chunk (24 bytes on 64-bit, 20 on i386)
 * while the chunk is one block, free or allocated, and per-frame tables
 * only for a chunk split into smaller blocks, allocated when it splits and
 * given back when it merges into one free 2 MiB block again (arena.c has
 * the picture). arena->metadata_bytes is what they hold now.
 *
 * Callers hold frame numbers, never addresses: arena_address() turns a
 * frame into a pointer only while the entry that owns it is pinned (see
 * cache.h), so a later compactor may move unpinned entries.
 *
 * Compaction support (compact.c): each allocated block has an owner, a
 * 32-bit value the caller chooses (the cache: its entry's slot index; set
 * by the cache, ARENA_NONE until then and once the block is freed), each
 * chunk a count of its allocated frames, and one chunk at a time may be
 * isolated: its free blocks leave the free lists and blocks freed inside
 * it while it is isolated are held back, so nothing is allocated there
 * while its entries move out. Un-isolating frees the held blocks at once;
 * a chunk whose entries all moved out comes back as one 2 MiB block.
 *
 * Locking: arena->lock guards the free lists, the chunk records and split
 * tables (owners among them), the counts and the isolated chunk; it is
 * innermost (cache.h). Dependency-free (pthread and mmap only), so it is
 * unit tested on i386 too.
 */
#ifndef NBDCACHED_DAEMON_CACHE_ARENA_H
#define NBDCACHED_DAEMON_CACHE_ARENA_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/options.h"

#define ARENA_FRAME_SHIFT 12
#define ARENA_FRAME_SIZE (1u << ARENA_FRAME_SHIFT)
#define ARENA_MAX_ORDER 9 /* 2 MiB */
#define ARENA_ORDERS (ARENA_MAX_ORDER + 1)
#define ARENA_CHUNK_SIZE ((size_t)ARENA_FRAME_SIZE << ARENA_MAX_ORDER)
#define ARENA_CHUNK_FRAMES (1u << ARENA_MAX_ORDER)
#define ARENA_NONE UINT32_MAX /* no frame, no chunk, no owner */

enum arena_kind { ARENA_HUGETLB, ARENA_THP, ARENA_PLAIN };

struct arena_chunk; /* arena.c */

struct arena {
	uint8_t *base;
	size_t size; /* usable bytes: nframes * 4 KiB */
	size_t map_size;
	uint32_t nframes;
	enum arena_kind kind;
	int memfd; /* hugetlb only; -1 otherwise */

	pthread_mutex_t lock;
	/* Free lists: chunk numbers (ARENA_NONE: empty). Order 9 lists whole
	 * free chunks, orders 0..8 the split chunks with a free block of that
	 * order (arena.c). */
	uint32_t free_head[ARENA_ORDERS];
	uint64_t free_frames;
	uint64_t free_blocks[ARENA_ORDERS];
	uint64_t metadata_bytes; /* the chunk records and split tables, now */

	struct arena_chunk *chunks; /* one per chunk, the short tail included */
	uint32_t nchunks;	    /* whole 2 MiB chunks (a short tail is not one) */
	uint32_t iso_chunk;	    /* the isolated chunk, or ARENA_NONE */
	uint32_t iso_n;		    /* blocks held back in it */
	uint32_t iso_frame[ARENA_CHUNK_FRAMES];
	uint8_t iso_order[ARENA_CHUNK_FRAMES];
};

/* An allocated block of an isolated chunk (arena_isolate_chunk). */
struct arena_block {
	uint32_t frame;
	uint8_t order;
	uint32_t owner;
};

/* What malloc holds for an allocation, its header included (0 for NULL):
 * how the arena's tables and the cache's index count their memory. */
size_t arena_heap_bytes(void *p);
/* Map size bytes (rounded down to 4 KiB) as policy allows. 0 or -errno. */
int arena_init(struct arena *a, size_t size, enum hugepages_policy policy);
void arena_destroy(struct arena *a);
/*
 * A free block of 2^order frames; its first frame number, or -ENOMEM: no
 * free block of that order or above, or no memory for the tables of a
 * chunk it would split (the caller treats both as a full arena).
 */
int64_t arena_alloc(struct arena *a, unsigned order);
void arena_free(struct arena *a, uint32_t frame, unsigned order);
const char *arena_kind_name(enum arena_kind kind);
/* Free frames in blocks of at least 2^order frames (for stats and tests). */
uint64_t arena_free_frames_at_least(struct arena *a, unsigned order);
/* Free frames in free blocks of each order (a snapshot under the lock). */
void arena_free_by_order(struct arena *a, uint64_t out[ARENA_ORDERS]);

/*
 * Like arena_alloc, but never splits a block larger than 2^max_split
 * frames: the compactor must not break a free 2 MiB block to empty another.
 */
int64_t arena_alloc_max(struct arena *a, unsigned order, unsigned max_split);
/*
 * Make the allocated block of 2^order frames at frame two allocated blocks
 * of half its size (order >= 1): the low one keeps the owner, the high one
 * has none (ARENA_NONE) until set. Each is freed on its own after. 0,
 * -ENOMEM (no memory for the table of the chunk a 2 MiB block splits),
 * -EBUSY (the chunk is isolated) or -EINVAL; on failure nothing changed.
 */
int arena_split_block(struct arena *a, uint32_t frame, unsigned order);
/* Record the owner of the allocated block starting at frame (any value but
 * ARENA_NONE, which clears it). */
void arena_set_owner(struct arena *a, uint32_t frame, uint32_t owner);
/* The owner of the allocated block starting at frame, or ARENA_NONE.
 * arena->lock held: the answer holds only as long as the lock. */
uint32_t arena_owner_locked(const struct arena *a, uint32_t frame);
/*
 * Up to max whole chunks that hold allocated frames but are not full, the
 * emptiest first (ties by chunk number). Returns how many were written.
 */
size_t arena_sparse_chunks(struct arena *a, uint32_t *out, size_t max);
/*
 * Isolate chunk: take its free blocks off the free lists and hold back
 * whatever is freed in it from now on. Its allocated blocks are written to
 * out (at most ARENA_CHUNK_FRAMES), their count to *n. -EBUSY if another
 * chunk is isolated, -EINVAL if chunk is not a whole chunk.
 */
int arena_isolate_chunk(struct arena *a, uint32_t chunk, struct arena_block *out, size_t *n);
/* End the isolation: free every held block. True if the chunk is now one
 * free 2 MiB block. */
bool arena_unisolate(struct arena *a);

/*
 * The fragmentation index of free memory described by arena_free_by_order()
 * (frames per order), per mille: 1000 * (1 - free frames in free 2 MiB
 * blocks / all free frames); 0 when nothing is free.
 */
static inline unsigned arena_fragmentation(const uint64_t free_by_order[ARENA_ORDERS])
{
	uint64_t all = 0;
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		all += free_by_order[o];
	return all ? (unsigned)(1000 - free_by_order[ARENA_MAX_ORDER] * 1000 / all) : 0;
}

static inline uint8_t *arena_address(const struct arena *a, uint32_t frame)
{
	return a->base + ((size_t)frame << ARENA_FRAME_SHIFT);
}

#endif
