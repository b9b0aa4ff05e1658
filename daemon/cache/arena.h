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
 * Callers hold frame numbers, never addresses: arena_address() turns a
 * frame into a pointer only while the entry that owns it is pinned (see
 * cache.h), so a later compactor may move unpinned entries.
 *
 * Locking: arena->lock guards the free lists; it is innermost (cache.h).
 * Dependency-free (pthread and mmap only), so it is unit tested on i386 too.
 */
#ifndef NBDCACHED_DAEMON_CACHE_ARENA_H
#define NBDCACHED_DAEMON_CACHE_ARENA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/options.h"

#define ARENA_FRAME_SHIFT 12
#define ARENA_FRAME_SIZE (1u << ARENA_FRAME_SHIFT)
#define ARENA_MAX_ORDER 9 /* 2 MiB */
#define ARENA_ORDERS (ARENA_MAX_ORDER + 1)
#define ARENA_CHUNK_SIZE ((size_t)ARENA_FRAME_SIZE << ARENA_MAX_ORDER)

enum arena_kind { ARENA_HUGETLB, ARENA_THP, ARENA_PLAIN };

struct arena {
	uint8_t *base;
	size_t size; /* usable bytes: nframes * 4 KiB */
	size_t map_size;
	uint32_t nframes;
	enum arena_kind kind;
	int memfd; /* hugetlb only; -1 otherwise */

	pthread_mutex_t lock;
	uint32_t free_head[ARENA_ORDERS];
	uint32_t *next, *prev; /* free-list links, valid at a free block's first frame */
	uint8_t *state;	       /* per frame, see arena.c */
	uint64_t free_frames;
	uint64_t free_blocks[ARENA_ORDERS];
};

/* Map size bytes (rounded down to 4 KiB) as policy allows. 0 or -errno. */
int arena_init(struct arena *a, size_t size, enum hugepages_policy policy);
void arena_destroy(struct arena *a);
/* A free block of 2^order frames; its first frame number, or -ENOMEM. */
int64_t arena_alloc(struct arena *a, unsigned order);
void arena_free(struct arena *a, uint32_t frame, unsigned order);
const char *arena_kind_name(enum arena_kind kind);
/* Free frames in blocks of at least 2^order frames (for stats and tests). */
uint64_t arena_free_frames_at_least(struct arena *a, unsigned order);

static inline uint8_t *arena_address(const struct arena *a, uint32_t frame)
{
	return a->base + ((size_t)frame << ARENA_FRAME_SHIFT);
}

#endif
