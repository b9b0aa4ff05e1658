/*
 * daemon/cache/arena.c: see arena.h.
 *
 * A buddy allocator: a block's buddy is frame ^ (1 << order); two free
 * buddies of one order merge into one block of the next. Its tables are
 * kept per 2 MiB chunk, because with large entries most chunks are one
 * block and need no more than a record, and per frame only inside chunks
 * that are split:
 *
 *   chunks[c] (24 bytes on 64-bit, 20 on i386; the short tail has one too)
 *     state  FREE   one free 2 MiB block, on the order-9 list (next, prev)
 *            WHOLE  one allocated 2 MiB block (owner), or one held back
 *            SPLIT  smaller blocks: split -> its tables
 *     used   allocated frames (compaction's emptiest-first order)
 *
 *   split table (malloc'd, 2.4 KiB: 4.7 bytes a frame of a split chunk)
 *     owner[512]        the owner of the allocated block starting there
 *     free_map, used_map  one bit per aligned block position of each order
 *                       0..8 (512 + 256 + ... + 2 bits each): set where a
 *                       free / an allocated (or held) block of that order
 *                       starts; every frame of the chunk is in exactly one
 *                       block, so the maps also tell a block's order
 *     next[o], prev[o]  links of the order-o list, on which the chunk is
 *     nfree[o]          while it has a free block of order o (nfree[o] > 0)
 *
 * Free lists are lists of chunks: allocating order o takes the first chunk
 * on list o and the lowest free block of order o in it (a bit scan of at
 * most 8 words). Why not lists of frames: their links would be either in
 * the arena (writing into free memory faults it in, and would let a stray
 * write into freed memory corrupt the allocator) or a per-frame table for
 * every frame (8 bytes a frame, the cost this layout removes).
 *
 * A chunk gets its split table when its free 2 MiB block is first split;
 * if that allocation fails, arena_alloc fails with -ENOMEM as if the
 * arena were full. The table goes back when the chunk's blocks all merge
 * into a free 2 MiB block. The short tail chunk (an arena whose size is
 * not a multiple of 2 MiB) is split from the start and stays so: its
 * positions past the end are never free, so nothing merges across them.
 *
 * An isolated chunk (compaction) keeps its free blocks off the free lists:
 * they look allocated (used_map, or WHOLE) and are listed in iso_frame /
 * iso_order, with every block freed in the chunk meanwhile. They do not
 * count in free_frames until un-isolated.
 */
#include "daemon/cache/arena.h"

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/log.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004u
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21u << 26)
#endif

enum chunk_state { CHUNK_FREE, CHUNK_WHOLE, CHUNK_SPLIT };

/* Bits of one map: 512 >> o for each order o below 9 (1022), in words. */
#define MAP_WORDS 16
_Static_assert(MAP_WORDS * 64 >= 2 * ARENA_CHUNK_FRAMES - 2, "a map holds every order below 9");

struct arena_split {
	uint32_t owner[ARENA_CHUNK_FRAMES];
	uint64_t free_map[MAP_WORDS];
	uint64_t used_map[MAP_WORDS];
	uint32_t next[ARENA_MAX_ORDER], prev[ARENA_MAX_ORDER];
	uint16_t nfree[ARENA_MAX_ORDER];
};

struct arena_chunk {
	struct arena_split *split; /* SPLIT only */
	uint32_t next, prev;	   /* FREE: the order-9 list */
	uint32_t owner;		   /* WHOLE */
	uint16_t used;		   /* allocated frames */
	uint8_t state;		   /* enum chunk_state */
};
_Static_assert(sizeof(struct arena_chunk) <= 24, "a chunk's record stays small");

const char *arena_kind_name(enum arena_kind kind)
{
	switch (kind) {
	case ARENA_HUGETLB:
		return "hugetlb";
	case ARENA_THP:
		return "thp";
	case ARENA_PLAIN:
		return "plain";
	}
	return "?";
}

/* ---- the maps of a split chunk ---- */

/* The bit of the block of order o (< 9) at position pos in the chunk. */
static unsigned map_bit(unsigned order, uint32_t pos)
{
	return (2 * ARENA_CHUNK_FRAMES - (2 * ARENA_CHUNK_FRAMES >> order)) + (pos >> order);
}

static bool map_test(const uint64_t *map, unsigned order, uint32_t pos)
{
	unsigned b = map_bit(order, pos);
	return (map[b / 64] >> (b % 64)) & 1;
}

static void map_set(uint64_t *map, unsigned order, uint32_t pos)
{
	unsigned b = map_bit(order, pos);
	map[b / 64] |= 1ull << (b % 64);
}

static void map_clear(uint64_t *map, unsigned order, uint32_t pos)
{
	unsigned b = map_bit(order, pos);
	map[b / 64] &= ~(1ull << (b % 64));
}

/* The position of the lowest block of order o set in map, or ARENA_NONE. */
static uint32_t map_first(const uint64_t *map, unsigned order)
{
	unsigned first = map_bit(order, 0), end = first + (ARENA_CHUNK_FRAMES >> order);
	for (unsigned w = first / 64; w * 64 < end; w++) {
		uint64_t bits = map[w];
		if (w * 64 < first)
			bits &= ~0ull << (first % 64);
		if ((w + 1) * 64 > end)
			bits &= ~(~0ull << (end % 64));
		if (bits) {
			unsigned bit = w * 64 + (unsigned)__builtin_ctzll(bits);
			return (uint32_t)(bit - first) << order;
		}
	}
	return ARENA_NONE;
}

/* ---- the free lists ---- */

/* The links of chunk c on the list of order o: in its record for order 9,
 * in its split table below. */
static uint32_t *link_next(struct arena *a, unsigned order, uint32_t c)
{
	return order == ARENA_MAX_ORDER ? &a->chunks[c].next : &a->chunks[c].split->next[order];
}

static uint32_t *link_prev(struct arena *a, unsigned order, uint32_t c)
{
	return order == ARENA_MAX_ORDER ? &a->chunks[c].prev : &a->chunks[c].split->prev[order];
}

static void list_push(struct arena *a, unsigned order, uint32_t c)
{
	uint32_t head = a->free_head[order];
	*link_next(a, order, c) = head;
	*link_prev(a, order, c) = ARENA_NONE;
	if (head != ARENA_NONE)
		*link_prev(a, order, head) = c;
	a->free_head[order] = c;
}

static void list_remove(struct arena *a, unsigned order, uint32_t c)
{
	uint32_t next = *link_next(a, order, c), prev = *link_prev(a, order, c);
	if (prev != ARENA_NONE)
		*link_next(a, order, prev) = next;
	else
		a->free_head[order] = next;
	if (next != ARENA_NONE)
		*link_prev(a, order, next) = prev;
}

/* Make the block of order o at pos in chunk c free (not counting its
 * frames: the callers do). A 2 MiB block makes the chunk FREE. */
static void add_free(struct arena *a, uint32_t c, unsigned order, uint32_t pos)
{
	struct arena_chunk *ch = &a->chunks[c];
	a->free_blocks[order]++;
	if (order == ARENA_MAX_ORDER) {
		ch->state = CHUNK_FREE;
		list_push(a, order, c);
		return;
	}
	map_set(ch->split->free_map, order, pos);
	if (ch->split->nfree[order]++ == 0)
		list_push(a, order, c);
}

static void remove_free(struct arena *a, uint32_t c, unsigned order, uint32_t pos)
{
	struct arena_chunk *ch = &a->chunks[c];
	a->free_blocks[order]--;
	if (order == ARENA_MAX_ORDER) {
		list_remove(a, order, c);
		return;
	}
	map_clear(ch->split->free_map, order, pos);
	if (--ch->split->nfree[order] == 0)
		list_remove(a, order, c);
}

/* ---- split tables ---- */

size_t arena_heap_bytes(void *p)
{
	return p ? malloc_usable_size(p) + sizeof(size_t) : 0;
}

/* Give chunk c, one free 2 MiB block about to be split, a table with no
 * block in it; -ENOMEM leaves the chunk as it was. */
static int split_begin(struct arena *a, uint32_t c)
{
	struct arena_split *s = malloc(sizeof(*s));
	if (!s)
		return -ENOMEM;
	memset(s->owner, 0xff, sizeof(s->owner)); /* ARENA_NONE */
	memset(s->free_map, 0, sizeof(s->free_map));
	memset(s->used_map, 0, sizeof(s->used_map));
	memset(s->nfree, 0, sizeof(s->nfree));
	a->chunks[c].split = s;
	a->chunks[c].state = CHUNK_SPLIT;
	a->metadata_bytes += arena_heap_bytes(s);
	return 0;
}

/* Chunk c is one free block again: its table goes. */
static void split_end(struct arena *a, uint32_t c)
{
	struct arena_chunk *ch = &a->chunks[c];
	a->metadata_bytes -= arena_heap_bytes(ch->split);
	free(ch->split);
	ch->split = NULL;
}

/* ---- the mapping ---- */

/* A hugetlb memfd with every page reserved now, or -errno. */
static int map_hugetlb(struct arena *a, size_t size)
{
	size_t map_size = (size + ARENA_CHUNK_SIZE - 1) & ~(ARENA_CHUNK_SIZE - 1);
	int fd = memfd_create("nbdcached-arena", MFD_CLOEXEC | MFD_HUGETLB | MFD_HUGE_2MB);
	if (fd < 0)
		return -errno;
	int rc;
	if (ftruncate(fd, (off_t)map_size) < 0 || fallocate(fd, 0, 0, (off_t)map_size) < 0) {
		rc = -errno;
		close(fd);
		return rc;
	}
	void *p = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		rc = -errno;
		close(fd);
		return rc;
	}
	a->base = p;
	a->map_size = map_size;
	a->memfd = fd;
	a->kind = ARENA_HUGETLB;
	return 0;
}

static bool thp_enabled(void)
{
	char buf[128] = "";
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "re");
	if (!f)
		return false;
	if (!fgets(buf, sizeof(buf), f))
		buf[0] = '\0';
	fclose(f);
	return strstr(buf, "[never]") == NULL && buf[0] != '\0';
}

/* Anonymous memory aligned to 2 MiB; THP when the kernel allows it. */
static int map_anonymous(struct arena *a, size_t size, bool want_thp)
{
	size_t map_size = size + ARENA_CHUNK_SIZE;
	uint8_t *p = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS |
			  MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return -errno;
	uintptr_t aligned = ((uintptr_t)p + ARENA_CHUNK_SIZE - 1) & ~(uintptr_t)(ARENA_CHUNK_SIZE - 1);
	size_t head = aligned - (uintptr_t)p;
	if (head)
		munmap(p, head);
	size_t tail = map_size - head - size;
	if (tail)
		munmap((uint8_t *)aligned + size, tail);
	a->base = (uint8_t *)aligned;
	a->map_size = size;
	a->kind = ARENA_PLAIN;
	if (want_thp && thp_enabled() && madvise(a->base, size, MADV_HUGEPAGE) == 0)
		a->kind = ARENA_THP;
	return 0;
}

/* ---- life ---- */

static uint32_t chunk_records(const struct arena *a)
{
	return (a->nframes + ARENA_CHUNK_FRAMES - 1) >> ARENA_MAX_ORDER;
}

/* Free the bookkeeping and leave the arena empty (no mapping). */
static void free_tables(struct arena *a)
{
	if (a->chunks)
		for (uint32_t c = 0; c < chunk_records(a); c++)
			free(a->chunks[c].split);
	free(a->chunks);
	memset(a, 0, sizeof(*a));
	a->memfd = -1;
}

/* Every block free: the whole chunks on the order-9 list (chunk 0 first
 * out), the short tail split into the largest aligned blocks that fit. */
static int fill_free_lists(struct arena *a)
{
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		a->free_head[o] = ARENA_NONE;
	for (uint32_t c = a->nchunks; c-- > 0;)
		add_free(a, c, ARENA_MAX_ORDER, 0);
	uint32_t tail = a->nframes - (a->nchunks << ARENA_MAX_ORDER);
	if (tail) {
		int rc = split_begin(a, a->nchunks);
		if (rc < 0)
			return rc;
		for (uint32_t pos = 0; pos < tail;) {
			unsigned o = ARENA_MAX_ORDER - 1;
			while (o > 0 && ((pos & ((1u << o) - 1)) || pos + (1u << o) > tail))
				o--;
			add_free(a, a->nchunks, o, pos);
			pos += 1u << o;
		}
	}
	a->free_frames = a->nframes;
	return 0;
}

int arena_init(struct arena *a, size_t size, enum hugepages_policy policy)
{
	memset(a, 0, sizeof(*a));
	a->memfd = -1;
	size &= ~(size_t)(ARENA_FRAME_SIZE - 1);
	if (size < ARENA_FRAME_SIZE || size / ARENA_FRAME_SIZE >= ARENA_NONE)
		return -EINVAL;
	a->nframes = (uint32_t)(size / ARENA_FRAME_SIZE);
	a->size = size;
	a->nchunks = a->nframes >> ARENA_MAX_ORDER;
	a->iso_chunk = ARENA_NONE;
	int rc = -ENOMEM;
	a->chunks = calloc(chunk_records(a), sizeof(*a->chunks));
	if (!a->chunks)
		goto err;
	a->metadata_bytes = (uint64_t)chunk_records(a) * sizeof(*a->chunks);
	if ((rc = fill_free_lists(a)) < 0)
		goto err;
	rc = policy == HUGEPAGES_OFF ? -EPERM : map_hugetlb(a, size);
	if (rc < 0 && policy == HUGEPAGES_REQUIRE) {
		log_error("cache: %zu bytes of hugetlb pages are not available: %s "
			  "(reserve them in /proc/sys/vm/nr_hugepages)",
			  size, strerror(-rc));
		goto err;
	}
	if (rc < 0)
		rc = map_anonymous(a, size, policy != HUGEPAGES_OFF);
	if (rc < 0)
		goto err;
	pthread_mutex_init(&a->lock, NULL);
	return 0;
err:
	free_tables(a);
	return rc;
}

void arena_destroy(struct arena *a)
{
	if (!a->base)
		return;
	munmap(a->base, a->map_size);
	if (a->memfd >= 0)
		close(a->memfd);
	pthread_mutex_destroy(&a->lock);
	free_tables(a);
}

/* ---- allocating and freeing ---- */

int64_t arena_alloc(struct arena *a, unsigned order)
{
	return arena_alloc_max(a, order, ARENA_MAX_ORDER);
}

int64_t arena_alloc_max(struct arena *a, unsigned order, unsigned max_split)
{
	if (order > ARENA_MAX_ORDER)
		return -EINVAL;
	if (max_split > ARENA_MAX_ORDER)
		max_split = ARENA_MAX_ORDER;
	int64_t rc = -ENOMEM;
	pthread_mutex_lock(&a->lock);
	unsigned o = order;
	while (o <= max_split && a->free_head[o] == ARENA_NONE)
		o++;
	if (o > max_split)
		goto out;
	uint32_t c = a->free_head[o];
	struct arena_chunk *ch = &a->chunks[c];
	uint32_t pos = 0;
	if (o == ARENA_MAX_ORDER) {
		/* Its tables first: without them the chunk stays as it was. */
		if (order < ARENA_MAX_ORDER && split_begin(a, c) < 0)
			goto out;
		remove_free(a, c, o, 0);
		if (order == ARENA_MAX_ORDER) {
			ch->state = CHUNK_WHOLE;
			ch->owner = ARENA_NONE;
			goto done;
		}
	} else {
		pos = map_first(ch->split->free_map, o);
		remove_free(a, c, o, pos);
	}
	/* Split: keep the low half, free the high halves. */
	while (o > order) {
		o--;
		add_free(a, c, o, pos + (1u << o));
	}
	map_set(ch->split->used_map, order, pos);
	ch->split->owner[pos] = ARENA_NONE;
done:
	a->free_frames -= 1u << order;
	ch->used += (uint16_t)(1u << order);
	rc = ((int64_t)c << ARENA_MAX_ORDER) + pos;
out:
	pthread_mutex_unlock(&a->lock);
	return rc;
}

/* Put a block back on the free lists, merging buddies. Lock held. */
static void free_locked(struct arena *a, uint32_t frame, unsigned order)
{
	uint32_t c = frame >> ARENA_MAX_ORDER, pos = frame & (ARENA_CHUNK_FRAMES - 1);
	struct arena_chunk *ch = &a->chunks[c];
	a->free_frames += 1u << order;
	if (order < ARENA_MAX_ORDER) {
		map_clear(ch->split->used_map, order, pos);
		/* A buddy past the end of a short tail is never free. */
		while (order < ARENA_MAX_ORDER &&
		       map_test(ch->split->free_map, order, pos ^ (1u << order))) {
			remove_free(a, c, order, pos ^ (1u << order));
			pos &= ~(1u << order);
			order++;
		}
		if (order == ARENA_MAX_ORDER)
			split_end(a, c);
	}
	add_free(a, c, order, pos);
}

void arena_free(struct arena *a, uint32_t frame, unsigned order)
{
	uint32_t c = frame >> ARENA_MAX_ORDER;
	pthread_mutex_lock(&a->lock);
	struct arena_chunk *ch = &a->chunks[c];
	if (ch->state == CHUNK_SPLIT)
		ch->split->owner[frame & (ARENA_CHUNK_FRAMES - 1)] = ARENA_NONE;
	else
		ch->owner = ARENA_NONE;
	ch->used -= (uint16_t)(1u << order);
	if (c == a->iso_chunk) {
		a->iso_frame[a->iso_n] = frame;
		a->iso_order[a->iso_n] = (uint8_t)order;
		a->iso_n++;
	} else {
		free_locked(a, frame, order);
	}
	pthread_mutex_unlock(&a->lock);
}

int arena_split_block(struct arena *a, uint32_t frame, unsigned order)
{
	if (order == 0 || order > ARENA_MAX_ORDER)
		return -EINVAL;
	uint32_t c = frame >> ARENA_MAX_ORDER, pos = frame & (ARENA_CHUNK_FRAMES - 1);
	uint32_t half = 1u << (order - 1);
	int rc = 0;
	pthread_mutex_lock(&a->lock);
	struct arena_chunk *ch = &a->chunks[c];
	if (c == a->iso_chunk) {
		rc = -EBUSY; /* its blocks are being moved out by the list taken */
	} else if (order == ARENA_MAX_ORDER) {
		uint32_t owner = ch->owner;
		if (split_begin(a, c) < 0) {
			rc = -ENOMEM; /* the chunk stays one block */
		} else {
			ch->split->owner[0] = owner;
			map_set(ch->split->used_map, order - 1, 0);
			map_set(ch->split->used_map, order - 1, half);
		}
	} else {
		map_clear(ch->split->used_map, order, pos);
		map_set(ch->split->used_map, order - 1, pos);
		map_set(ch->split->used_map, order - 1, pos + half);
		ch->split->owner[pos + half] = ARENA_NONE;
	}
	pthread_mutex_unlock(&a->lock);
	return rc;
}

void arena_set_owner(struct arena *a, uint32_t frame, uint32_t owner)
{
	pthread_mutex_lock(&a->lock);
	struct arena_chunk *ch = &a->chunks[frame >> ARENA_MAX_ORDER];
	if (ch->state == CHUNK_SPLIT)
		ch->split->owner[frame & (ARENA_CHUNK_FRAMES - 1)] = owner;
	else
		ch->owner = owner;
	pthread_mutex_unlock(&a->lock);
}

uint32_t arena_owner_locked(const struct arena *a, uint32_t frame)
{
	const struct arena_chunk *ch = &a->chunks[frame >> ARENA_MAX_ORDER];
	switch (ch->state) {
	case CHUNK_SPLIT:
		return ch->split->owner[frame & (ARENA_CHUNK_FRAMES - 1)];
	case CHUNK_WHOLE:
		return (frame & (ARENA_CHUNK_FRAMES - 1)) == 0 ? ch->owner : ARENA_NONE;
	}
	return ARENA_NONE;
}

/* ---- what is free ---- */

void arena_free_by_order(struct arena *a, uint64_t out[ARENA_ORDERS])
{
	pthread_mutex_lock(&a->lock);
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		out[o] = a->free_blocks[o] << o;
	pthread_mutex_unlock(&a->lock);
}

uint64_t arena_free_frames_at_least(struct arena *a, unsigned order)
{
	uint64_t n = 0;
	pthread_mutex_lock(&a->lock);
	for (unsigned o = order; o < ARENA_ORDERS; o++)
		n += a->free_blocks[o] << o;
	pthread_mutex_unlock(&a->lock);
	return n;
}

/* ---- compaction ---- */

size_t arena_sparse_chunks(struct arena *a, uint32_t *out, size_t max)
{
	/* A counting sort by used frames: O(chunks), not O(chunks * 512). */
	uint32_t start[ARENA_CHUNK_FRAMES + 1] = {0};
	size_t n = 0;
	pthread_mutex_lock(&a->lock);
	for (uint32_t c = 0; c < a->nchunks; c++)
		start[a->chunks[c].used]++;
	uint32_t at = 0;
	for (uint32_t used = 1; used < ARENA_CHUNK_FRAMES; used++) {
		uint32_t count = start[used];
		start[used] = at;
		at += count;
	}
	for (uint32_t c = 0; c < a->nchunks; c++) {
		uint16_t used = a->chunks[c].used;
		if (used == 0 || used >= ARENA_CHUNK_FRAMES || start[used] >= max)
			continue;
		out[start[used]++] = c;
		n++;
	}
	pthread_mutex_unlock(&a->lock);
	return n;
}

/* Hold back the free block of order o at frame: off the lists, looking
 * allocated, listed for arena_unisolate. Lock held. */
static void hold_free_block(struct arena *a, uint32_t frame, unsigned order)
{
	uint32_t c = frame >> ARENA_MAX_ORDER, pos = frame & (ARENA_CHUNK_FRAMES - 1);
	struct arena_chunk *ch = &a->chunks[c];
	remove_free(a, c, order, pos);
	if (order == ARENA_MAX_ORDER) {
		ch->state = CHUNK_WHOLE;
		ch->owner = ARENA_NONE;
	} else {
		map_set(ch->split->used_map, order, pos);
	}
	a->free_frames -= 1u << order;
	a->iso_frame[a->iso_n] = frame;
	a->iso_order[a->iso_n] = (uint8_t)order;
	a->iso_n++;
}

/* The block starting at pos of split chunk s: its order, and whether it
 * is free. Every frame is in exactly one block (see the top of the file). */
static unsigned block_at(const struct arena_split *s, uint32_t pos, bool *is_free)
{
	for (unsigned o = 0; o < ARENA_MAX_ORDER && (pos & ((1u << o) - 1)) == 0; o++) {
		*is_free = map_test(s->free_map, o, pos);
		if (*is_free || map_test(s->used_map, o, pos))
			return o;
	}
	log_error("arena: position %u of a split chunk is in no block", (unsigned)pos);
	abort();
}

int arena_isolate_chunk(struct arena *a, uint32_t chunk, struct arena_block *out, size_t *n)
{
	*n = 0;
	pthread_mutex_lock(&a->lock);
	if (a->iso_chunk != ARENA_NONE) {
		pthread_mutex_unlock(&a->lock);
		return -EBUSY;
	}
	if (chunk >= a->nchunks) {
		pthread_mutex_unlock(&a->lock);
		return -EINVAL;
	}
	a->iso_chunk = chunk;
	a->iso_n = 0;
	struct arena_chunk *ch = &a->chunks[chunk];
	uint32_t first = chunk << ARENA_MAX_ORDER;
	switch (ch->state) {
	case CHUNK_FREE:
		hold_free_block(a, first, ARENA_MAX_ORDER);
		break;
	case CHUNK_WHOLE:
		out[(*n)++] = (struct arena_block){first, ARENA_MAX_ORDER, ch->owner};
		break;
	case CHUNK_SPLIT:
		for (uint32_t pos = 0; pos < ARENA_CHUNK_FRAMES;) {
			bool is_free;
			unsigned order = block_at(ch->split, pos, &is_free);
			if (is_free)
				hold_free_block(a, first + pos, order);
			else
				out[(*n)++] = (struct arena_block){first + pos, (uint8_t)order,
								   ch->split->owner[pos]};
			pos += 1u << order;
		}
		break;
	}
	pthread_mutex_unlock(&a->lock);
	return 0;
}

bool arena_unisolate(struct arena *a)
{
	pthread_mutex_lock(&a->lock);
	uint32_t chunk = a->iso_chunk;
	a->iso_chunk = ARENA_NONE;
	for (uint32_t i = 0; i < a->iso_n; i++)
		free_locked(a, a->iso_frame[i], a->iso_order[i]);
	a->iso_n = 0;
	bool whole = chunk != ARENA_NONE && a->chunks[chunk].state == CHUNK_FREE;
	pthread_mutex_unlock(&a->lock);
	return whole;
}
