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
 * arena itself is only touched when data is cached in it.
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

#define ARENA_NONE UINT32_MAX
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
	if (!a->next || !a->prev || !a->state)
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
	free(a->next);
	free(a->prev);
	free(a->state);
	memset(a, 0, sizeof(*a));
	a->memfd = -1;
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
	free(a->next);
	free(a->prev);
	free(a->state);
	memset(a, 0, sizeof(*a));
	a->memfd = -1;
}

int64_t arena_alloc(struct arena *a, unsigned order)
{
	if (order > ARENA_MAX_ORDER)
		return -EINVAL;
	pthread_mutex_lock(&a->lock);
	unsigned o = order;
	while (o < ARENA_ORDERS && a->free_head[o] == ARENA_NONE)
		o++;
	if (o == ARENA_ORDERS) {
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
	pthread_mutex_unlock(&a->lock);
	return f;
}

void arena_free(struct arena *a, uint32_t frame, unsigned order)
{
	pthread_mutex_lock(&a->lock);
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
