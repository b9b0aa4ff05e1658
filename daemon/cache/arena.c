/*
 * daemon/cache/arena.c: see arena.h.
 *
 * The buddy allocator keeps one free list per order. Per-frame state:
 *
 *   state[f] = ARENA_FREE | order   f starts a free block of that order
 *   state[f] = order                f starts an allocated block
 *   state[f] = ARENA_INSIDE         f is inside a block that starts lower
 *
 * A block's buddy is frame ^ (1 << order); two free buddies of one order
 * merge into one block of the next. The arena may end in a short chunk
 * (a 1 MiB cache has no order-9 block), so a buddy past the end is never
 * free. Metadata costs 9 bytes a frame (0.2%), outside the arena, so the
 * arena itself is only touched when data is cached in it; the owners
 * (32-bit entry slot indexes, not pointers) add 4 bytes a frame, the chunk
 * counts 2 bytes a chunk.
 *
 * An isolated chunk (compaction) keeps its free blocks off the free lists:
 * they look allocated (state = order) and are listed in iso_frame /
 * iso_order, with every block freed in the chunk meanwhile. They do not
 * count in free_frames until un-isolated.
 */
#include "daemon/cache/arena.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/log.h"

#define ARENA_FREE 0x80u
#define ARENA_INSIDE 0x7fu

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004u
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21u << 26)
#endif

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

static void list_push(struct arena *a, unsigned order, uint32_t f)
{
	a->next[f] = a->free_head[order];
	a->prev[f] = ARENA_NONE;
	if (a->free_head[order] != ARENA_NONE)
		a->prev[a->free_head[order]] = f;
	a->free_head[order] = f;
	a->state[f] = (uint8_t)(ARENA_FREE | order);
	a->free_blocks[order]++;
}

static void list_remove(struct arena *a, unsigned order, uint32_t f)
{
	if (a->prev[f] != ARENA_NONE)
		a->next[a->prev[f]] = a->next[f];
	else
		a->free_head[order] = a->next[f];
	if (a->next[f] != ARENA_NONE)
		a->prev[a->next[f]] = a->prev[f];
	a->free_blocks[order]--;
}

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

/* Free the bookkeeping arrays and leave the arena empty (no mapping). */
static void free_tables(struct arena *a)
{
	free(a->next);
	free(a->prev);
	free(a->state);
	free(a->owner);
	free(a->chunk_used);
	memset(a, 0, sizeof(*a));
	a->memfd = -1;
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
	int rc = -ENOMEM;
	a->next = malloc(a->nframes * sizeof(*a->next));
	a->prev = malloc(a->nframes * sizeof(*a->prev));
	a->state = malloc(a->nframes);
	a->owner = malloc(a->nframes * sizeof(*a->owner));
	a->nchunks = a->nframes >> ARENA_MAX_ORDER;
	a->chunk_used = calloc(a->nchunks ? a->nchunks : 1, sizeof(*a->chunk_used));
	a->iso_chunk = ARENA_NONE;
	if (!a->next || !a->prev || !a->state || !a->owner || !a->chunk_used)
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
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		a->free_head[o] = ARENA_NONE;
	memset(a->state, ARENA_INSIDE, a->nframes);
	memset(a->owner, 0xff, a->nframes * sizeof(*a->owner)); /* ARENA_NONE */
	/* Cover the frames with the largest aligned blocks that fit. */
	uint32_t f = 0;
	while (f < a->nframes) {
		unsigned o = ARENA_MAX_ORDER;
		while (o > 0 && ((f & ((1u << o) - 1)) || f + (1u << o) > a->nframes))
			o--;
		list_push(a, o, f);
		f += 1u << o;
	}
	a->free_frames = a->nframes;
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
	pthread_mutex_lock(&a->lock);
	unsigned o = order;
	while (o <= max_split && a->free_head[o] == ARENA_NONE)
		o++;
	if (o > max_split) {
		pthread_mutex_unlock(&a->lock);
		return -ENOMEM;
	}
	uint32_t f = a->free_head[o];
	list_remove(a, o, f);
	/* Split: keep the low half, free the high halves. */
	while (o > order) {
		o--;
		list_push(a, o, f + (1u << o));
	}
	a->state[f] = (uint8_t)order;
	a->free_frames -= 1u << order;
	a->owner[f] = ARENA_NONE;
	if ((f >> ARENA_MAX_ORDER) < a->nchunks)
		a->chunk_used[f >> ARENA_MAX_ORDER] += (uint16_t)(1u << order);
	pthread_mutex_unlock(&a->lock);
	return f;
}

/* Put a block back on the free lists, merging buddies. Lock held. */
static void free_locked(struct arena *a, uint32_t frame, unsigned order)
{
	a->free_frames += 1u << order;
	while (order < ARENA_MAX_ORDER) {
		uint32_t buddy = frame ^ (1u << order);
		if (buddy >= a->nframes || a->state[buddy] != (ARENA_FREE | order))
			break;
		list_remove(a, order, buddy);
		a->state[buddy] = ARENA_INSIDE;
		a->state[frame] = ARENA_INSIDE;
		frame &= ~(1u << order);
		order++;
	}
	list_push(a, order, frame);
}

void arena_free(struct arena *a, uint32_t frame, unsigned order)
{
	pthread_mutex_lock(&a->lock);
	a->owner[frame] = ARENA_NONE;
	uint32_t chunk = frame >> ARENA_MAX_ORDER;
	if (chunk < a->nchunks)
		a->chunk_used[chunk] -= (uint16_t)(1u << order);
	if (chunk == a->iso_chunk) {
		a->iso_frame[a->iso_n] = frame;
		a->iso_order[a->iso_n] = (uint8_t)order;
		a->iso_n++;
	} else {
		free_locked(a, frame, order);
	}
	pthread_mutex_unlock(&a->lock);
}

void arena_set_owner(struct arena *a, uint32_t frame, uint32_t owner)
{
	pthread_mutex_lock(&a->lock);
	a->owner[frame] = owner;
	pthread_mutex_unlock(&a->lock);
}

uint32_t arena_owner_locked(const struct arena *a, uint32_t frame)
{
	return a->owner[frame];
}

void arena_free_by_order(struct arena *a, uint64_t out[ARENA_ORDERS])
{
	pthread_mutex_lock(&a->lock);
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		out[o] = a->free_blocks[o] << o;
	pthread_mutex_unlock(&a->lock);
}

size_t arena_sparse_chunks(struct arena *a, uint32_t *out, size_t max)
{
	/* A counting sort by used frames: O(chunks), not O(chunks * 512). */
	uint32_t start[ARENA_CHUNK_FRAMES + 1] = {0};
	size_t n = 0;
	pthread_mutex_lock(&a->lock);
	for (uint32_t c = 0; c < a->nchunks; c++)
		start[a->chunk_used[c]]++;
	uint32_t at = 0;
	for (uint32_t used = 1; used < ARENA_CHUNK_FRAMES; used++) {
		uint32_t count = start[used];
		start[used] = at;
		at += count;
	}
	for (uint32_t c = 0; c < a->nchunks; c++) {
		uint16_t used = a->chunk_used[c];
		if (used == 0 || used >= ARENA_CHUNK_FRAMES || start[used] >= max)
			continue;
		out[start[used]++] = c;
		n++;
	}
	pthread_mutex_unlock(&a->lock);
	return n;
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
	uint32_t f = chunk << ARENA_MAX_ORDER, end = f + ARENA_CHUNK_FRAMES;
	while (f < end) {
		uint8_t st = a->state[f];
		unsigned order = st & ~ARENA_FREE;
		if (st & ARENA_FREE) {
			list_remove(a, order, f);
			a->state[f] = (uint8_t)order;
			a->free_frames -= 1u << order;
			a->iso_frame[a->iso_n] = f;
			a->iso_order[a->iso_n] = (uint8_t)order;
			a->iso_n++;
		} else {
			out[*n] = (struct arena_block){f, (uint8_t)order, a->owner[f]};
			(*n)++;
		}
		f += 1u << order;
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
	bool whole = chunk != ARENA_NONE &&
		     a->state[chunk << ARENA_MAX_ORDER] == (ARENA_FREE | ARENA_MAX_ORDER);
	pthread_mutex_unlock(&a->lock);
	return whole;
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
