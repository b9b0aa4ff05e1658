/*
 * tests/unit/test_arena.c: the buddy allocator of daemon/cache/arena.c.
 *
 * Blocks handed out never overlap and stay inside the arena, whatever the
 * arena's size (1 MiB has no 2 MiB block; odd sizes end in a short chunk);
 * freeing everything merges the frames back into the largest blocks the
 * size allows and gives back every split chunk's tables. A random
 * alloc/free/isolate sequence is checked against a model: one block per
 * frame at most, the owners set read back, an isolated chunk lists exactly
 * the model's blocks in it, hands out nothing and comes back whole exactly
 * when the model has nothing left in it, the free counts add up. Chunks
 * are listed emptiest first; arena_alloc_max never splits a larger block
 * than allowed. The tables' cost: a record per chunk while it is whole,
 * per-frame tables only while it is split; when those cannot be allocated
 * (malloc failing, injected through the linker's --wrap=malloc, see the
 * Makefile), arena_alloc fails with -ENOMEM and the arena is unchanged.
 * The arena's memory itself is never written by the allocator (mincore).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/cache/arena.h"

/* ---- malloc failure injection (-Wl,--wrap=malloc) ---- */

void *__real_malloc(size_t size);
void *__wrap_malloc(size_t size);

static bool fail_malloc;

void *__wrap_malloc(size_t size)
{
	return fail_malloc ? NULL : __real_malloc(size);
}

/* How many blocks cover n frames when each is as large as alignment allows. */
static uint64_t blocks_in_max_blocks(uint32_t n)
{
	uint64_t total = 0;
	uint32_t f = 0;
	while (f < n) {
		unsigned o = ARENA_MAX_ORDER;
		while (o > 0 && ((f & ((1u << o) - 1)) || f + (1u << o) > n))
			o--;
		f += 1u << o;
		total++;
	}
	return total; /* number of blocks */
}

static uint32_t owner_of(struct arena *a, uint32_t frame)
{
	pthread_mutex_lock(&a->lock);
	uint32_t owner = arena_owner_locked(a, frame);
	pthread_mutex_unlock(&a->lock);
	return owner;
}

static void test_one_mib_has_no_2m_block(void **state)
{
	(void)state;
	struct arena a;
	assert_int_equal(arena_init(&a, 1u << 20, HUGEPAGES_OFF), 0);
	assert_int_equal(a.kind, ARENA_PLAIN);
	assert_int_equal(a.nframes, 256);
	assert_int_equal(arena_alloc(&a, 9), -ENOMEM);
	int64_t f = arena_alloc(&a, 8);
	assert_int_equal(f, 0);
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM);
	arena_free(&a, 0, 8);
	for (int i = 0; i < 256; i++)
		assert_true(arena_alloc(&a, 0) >= 0);
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM);
	for (uint32_t i = 0; i < 256; i++)
		arena_free(&a, i, 0);
	assert_int_equal(arena_free_frames_at_least(&a, 8), 256);
	/* The memory is really there. */
	memset(arena_address(&a, 255), 0xab, ARENA_FRAME_SIZE);
	arena_destroy(&a);
}

/* The model of check_random: per frame, the live block holding it. */
struct model {
	uint32_t n;
	int32_t *block; /* per frame: index in live[], or -1 */
	struct live {
		uint32_t frame, owner;
		unsigned order;
	} *live;
	size_t nlive;
	uint64_t used;
};

static void model_add(struct model *m, uint32_t frame, unsigned order, uint32_t owner)
{
	for (uint32_t i = 0; i < (1u << order); i++) {
		assert_int_equal(m->block[frame + i], -1);
		m->block[frame + i] = (int32_t)m->nlive;
	}
	m->live[m->nlive++] = (struct live){frame, owner, order};
	m->used += 1u << order;
}

static void model_remove(struct model *m, size_t k)
{
	struct live *l = &m->live[k];
	for (uint32_t i = 0; i < (1u << l->order); i++)
		m->block[l->frame + i] = -1;
	m->used -= 1u << l->order;
	m->live[k] = m->live[--m->nlive];
	struct live *moved = &m->live[k];
	if (k < m->nlive)
		for (uint32_t i = 0; i < (1u << moved->order); i++)
			m->block[moved->frame + i] = (int32_t)k;
}

/* The arena's counts agree with the model and with each other. */
static void check_counts(struct arena *a, const struct model *m)
{
	uint64_t by_order[ARENA_ORDERS], sum = 0;
	arena_free_by_order(a, by_order);
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		sum += by_order[o];
	assert_int_equal(a->free_frames, m->n - m->used);
	assert_int_equal(sum, a->free_frames);
}

/* Isolate chunk c: the blocks listed are the model's, owners included;
 * nothing is allocated from c meanwhile; half of its blocks are freed
 * (held back); un-isolating says whole exactly when none is left. */
static void check_isolation(struct arena *a, struct model *m, uint32_t c)
{
	static struct arena_block blocks[ARENA_CHUNK_FRAMES];
	size_t n;
	uint32_t first = c << ARENA_MAX_ORDER;
	assert_int_equal(arena_isolate_chunk(a, c, blocks, &n), 0);
	size_t expect = 0;
	for (uint32_t f = first; f < first + ARENA_CHUNK_FRAMES; f++)
		if (m->block[f] >= 0 && m->live[m->block[f]].frame == f)
			expect++;
	assert_int_equal(n, expect);
	for (size_t i = 0; i < n; i++) {
		assert_true(blocks[i].frame >= first &&
			    blocks[i].frame < first + ARENA_CHUNK_FRAMES);
		int32_t k = m->block[blocks[i].frame];
		assert_true(k >= 0);
		assert_int_equal(m->live[k].frame, blocks[i].frame);
		assert_int_equal(m->live[k].order, blocks[i].order);
		assert_int_equal(m->live[k].owner, blocks[i].owner);
	}
	/* Its blocks are being moved out by the list just taken: none splits. */
	for (size_t i = 0; i < n; i++)
		if (blocks[i].order > 0)
			assert_int_equal(arena_split_block(a, blocks[i].frame, blocks[i].order),
					 -EBUSY);
	uint64_t free_before = a->free_frames;
	/* Whatever is asked for comes from elsewhere, or not at all. */
	for (unsigned o = 0; o < ARENA_ORDERS; o++) {
		int64_t f = arena_alloc(a, o);
		if (f >= 0) {
			assert_int_not_equal((uint32_t)f >> ARENA_MAX_ORDER, c);
			arena_free(a, (uint32_t)f, o);
		}
	}
	for (size_t i = 0; i < n; i += 2) {
		int32_t k = m->block[blocks[i].frame];
		arena_free(a, blocks[i].frame, blocks[i].order);
		model_remove(m, (size_t)k);
	}
	assert_int_equal(a->free_frames, free_before); /* held back */
	bool empty = true;
	for (uint32_t f = first; f < first + ARENA_CHUNK_FRAMES; f++)
		empty &= m->block[f] < 0;
	assert_int_equal(arena_unisolate(a), empty);
	check_counts(a, m);
}

static void check_random(size_t size, unsigned seed)
{
	struct arena a;
	assert_int_equal(arena_init(&a, size, HUGEPAGES_OFF), 0);
	uint64_t idle_metadata = a.metadata_bytes;
	struct model m = {.n = a.nframes};
	m.block = malloc(m.n * sizeof(*m.block));
	m.live = malloc(m.n * sizeof(*m.live));
	assert_non_null(m.block);
	assert_non_null(m.live);
	for (uint32_t i = 0; i < m.n; i++)
		m.block[i] = -1;
	srand(seed);
	for (int step = 0; step < 20000; step++) {
		int what = rand() % 1000;
		if (what < 5 && a.nchunks) {
			check_isolation(&a, &m, (uint32_t)rand() % a.nchunks);
			continue;
		}
		if (what < 10 && m.nlive) {
			/* Owners read back, and a new one replaces the old. */
			for (size_t k = 0; k < m.nlive; k++)
				assert_int_equal(owner_of(&a, m.live[k].frame), m.live[k].owner);
			size_t k = (size_t)rand() % m.nlive;
			m.live[k].owner = (uint32_t)rand();
			arena_set_owner(&a, m.live[k].frame, m.live[k].owner);
			continue;
		}
		if (m.nlive && what < 60) {
			/* A block splits in two halves: the low keeps the owner. */
			size_t k = (size_t)rand() % m.nlive;
			struct live l = m.live[k];
			if (l.order == 0) {
				assert_int_equal(arena_split_block(&a, l.frame, 0), -EINVAL);
				continue;
			}
			assert_int_equal(arena_split_block(&a, l.frame, l.order), 0);
			model_remove(&m, k);
			uint32_t half = 1u << (l.order - 1);
			model_add(&m, l.frame, l.order - 1, l.owner);
			model_add(&m, l.frame + half, l.order - 1, ARENA_NONE);
			assert_int_equal(owner_of(&a, l.frame), l.owner);
			assert_int_equal(owner_of(&a, l.frame + half), ARENA_NONE);
			check_counts(&a, &m);
			continue;
		}
		if (m.nlive && what < 460) {
			size_t k = (size_t)rand() % m.nlive;
			arena_free(&a, m.live[k].frame, m.live[k].order);
			assert_int_equal(owner_of(&a, m.live[k].frame), ARENA_NONE);
			model_remove(&m, k);
			check_counts(&a, &m);
			continue;
		}
		unsigned order = (unsigned)(rand() % 10 < 7 ? rand() % 3 : rand() % 10);
		int64_t f = arena_alloc(&a, order);
		if (f < 0) {
			assert_int_equal(f, -ENOMEM);
			/* Only when no free block of that order or above exists. */
			assert_int_equal(arena_free_frames_at_least(&a, order), 0);
			continue;
		}
		assert_true((uint64_t)f + (1u << order) <= m.n);
		assert_int_equal((uint32_t)f & ((1u << order) - 1), 0);
		assert_int_equal(owner_of(&a, (uint32_t)f), ARENA_NONE);
		/* Most blocks get an owner, as the cache's do; some never. */
		uint32_t owner = ARENA_NONE;
		if (rand() % 8) {
			owner = (uint32_t)rand() % 1000000;
			arena_set_owner(&a, (uint32_t)f, owner);
		}
		model_add(&m, (uint32_t)f, order, owner);
		check_counts(&a, &m);
	}
	for (size_t k = 0; k < m.nlive; k++)
		arena_free(&a, m.live[k].frame, m.live[k].order);
	assert_int_equal(a.free_frames, m.n);
	/* Everything merged back: as few blocks as the size allows, every
	 * whole chunk one free 2 MiB block, its tables given back. */
	uint64_t blocks = 0;
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		blocks += a.free_blocks[o];
	assert_int_equal(blocks, blocks_in_max_blocks(m.n));
	assert_int_equal(a.free_blocks[ARENA_MAX_ORDER], a.nchunks);
	assert_int_equal(a.metadata_bytes, idle_metadata);
	free(m.block);
	free(m.live);
	arena_destroy(&a);
}

static void test_random_8m(void **state)
{
	(void)state;
	check_random(8u << 20, 1);
}

static void test_random_odd_size(void **state)
{
	(void)state;
	check_random((5u << 20) + 12 * 4096, 2); /* ends in a short chunk */
}

static void test_random_small(void **state)
{
	(void)state;
	check_random(1u << 20, 3);
}

static void test_random_seeds(void **state)
{
	(void)state;
	for (unsigned seed = 10; seed < 16; seed++)
		check_random((3u << 20) + (seed - 10) * 4096 * 37, seed);
}

/* Empty a chunk the way compact.c does: isolate, move its blocks elsewhere
 * (arena_alloc_max below order 9), free them, un-isolate. */
static void test_isolate_and_empty_a_chunk(void **state)
{
	(void)state;
	struct arena a;
	assert_int_equal(arena_init(&a, 8u << 20, HUGEPAGES_OFF), 0); /* 4 chunks */
	assert_int_equal(a.nchunks, 4);
	/* Fill everything with 4 KiB blocks, owner = frame + 1. */
	for (uint32_t i = 0; i < a.nframes; i++) {
		int64_t f = arena_alloc(&a, 0);
		assert_true(f >= 0);
		arena_set_owner(&a, (uint32_t)f, (uint32_t)f + 1);
	}
	/* Chunk 1 keeps 10 blocks, chunk 2 keeps 300, chunks 0 and 3 stay full
	 * except for 400 frames freed in chunk 3. */
	for (uint32_t i = 0; i < 512; i++) {
		if (i >= 10)
			arena_free(&a, 512 + i, 0);
		if (i >= 300)
			arena_free(&a, 1024 + i, 0);
		if (i < 400)
			arena_free(&a, 1536 + i, 0);
	}
	uint32_t cand[8];
	size_t n = arena_sparse_chunks(&a, cand, 8);
	assert_int_equal(n, 3);
	assert_int_equal(cand[0], 1);
	assert_int_equal(cand[1], 3);
	assert_int_equal(cand[2], 2);
	assert_int_equal(arena_sparse_chunks(&a, cand, 1), 1);
	assert_int_equal(cand[0], 1);

	struct arena_block blocks[ARENA_CHUNK_FRAMES];
	assert_int_equal(arena_isolate_chunk(&a, 1, blocks, &n), 0);
	assert_int_equal(n, 10);
	size_t none;
	struct arena_block other[ARENA_CHUNK_FRAMES];
	assert_int_equal(arena_isolate_chunk(&a, 2, other, &none), -EBUSY);
	for (size_t i = 0; i < n; i++) {
		assert_int_equal(blocks[i].frame, 512 + i);
		assert_int_equal(blocks[i].order, 0);
		assert_int_equal(blocks[i].owner, 512 + i + 1);
	}
	/* Nothing comes from the isolated chunk, even when asked for order 8. */
	int64_t f8 = arena_alloc_max(&a, 8, 8);
	assert_true(f8 >= 0 && ((uint32_t)f8 >> ARENA_MAX_ORDER) == 3);
	arena_free(&a, (uint32_t)f8, 8);
	for (size_t i = 0; i < n; i++) {
		int64_t f = arena_alloc_max(&a, 0, ARENA_MAX_ORDER - 1);
		assert_true(f >= 0);
		assert_int_not_equal((uint32_t)f >> ARENA_MAX_ORDER, 1);
		arena_free(&a, blocks[i].frame, 0); /* held back */
		assert_int_equal(arena_free_frames_at_least(&a, ARENA_MAX_ORDER), 0);
	}
	assert_true(arena_unisolate(&a));
	assert_int_equal(arena_free_frames_at_least(&a, ARENA_MAX_ORDER), 512);
	uint64_t by_order[ARENA_ORDERS];
	arena_free_by_order(&a, by_order);
	assert_int_equal(by_order[ARENA_MAX_ORDER], 512);
	/* A chunk that cannot be emptied comes back as it was. */
	uint64_t before = a.free_frames;
	assert_int_equal(arena_isolate_chunk(&a, 2, blocks, &n), 0);
	assert_true(n >= 300); /* and what moved in from chunk 1 */
	assert_false(arena_unisolate(&a));
	assert_int_equal(a.free_frames, before);
	assert_int_equal(arena_isolate_chunk(&a, 4, blocks, &n), -EINVAL);
	arena_destroy(&a);
}

/* Whole chunks, free or allocated, isolate as one block. */
static void test_isolate_whole_chunks(void **state)
{
	(void)state;
	struct arena a;
	struct arena_block blocks[ARENA_CHUNK_FRAMES];
	size_t n;
	assert_int_equal(arena_init(&a, 4u << 20, HUGEPAGES_OFF), 0);
	int64_t f = arena_alloc(&a, ARENA_MAX_ORDER);
	assert_int_equal(f, 0);
	arena_set_owner(&a, 0, 77);
	assert_int_equal(arena_isolate_chunk(&a, 0, blocks, &n), 0);
	assert_int_equal(n, 1);
	assert_int_equal(blocks[0].frame, 0);
	assert_int_equal(blocks[0].order, ARENA_MAX_ORDER);
	assert_int_equal(blocks[0].owner, 77);
	arena_free(&a, 0, ARENA_MAX_ORDER); /* held back */
	assert_int_equal(owner_of(&a, 0), ARENA_NONE);
	assert_int_equal(a.free_frames, 512);
	assert_true(arena_unisolate(&a));
	assert_int_equal(a.free_frames, 1024);
	/* A free chunk: nothing listed, nothing handed out from it. */
	assert_int_equal(arena_isolate_chunk(&a, 1, blocks, &n), 0);
	assert_int_equal(n, 0);
	assert_int_equal(a.free_frames, 512);
	assert_int_equal(arena_alloc(&a, ARENA_MAX_ORDER), 0);
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM);
	assert_true(arena_unisolate(&a));
	assert_int_equal(arena_alloc(&a, 0), 512);
	arena_destroy(&a);
}

/* What the tables cost: a record per chunk; a split chunk's tables on top,
 * given back when it is one free block again. */
static void test_tables_follow_splits(void **state)
{
	(void)state;
	struct arena a;
	assert_int_equal(arena_init(&a, 64u << 20, HUGEPAGES_OFF), 0); /* 32 chunks */
	uint64_t idle = a.metadata_bytes;
	assert_true(idle <= 32 * 24);
	/* 2 MiB blocks need nothing more. */
	int64_t big[32];
	for (int i = 0; i < 32; i++) {
		big[i] = arena_alloc(&a, ARENA_MAX_ORDER);
		assert_true(big[i] >= 0);
	}
	assert_int_equal(a.metadata_bytes, idle);
	for (int i = 0; i < 32; i++)
		arena_free(&a, (uint32_t)big[i], ARENA_MAX_ORDER);
	/* One split chunk: a few KiB, under 6 bytes a frame of it. */
	int64_t f = arena_alloc(&a, 0);
	assert_true(f >= 0);
	uint64_t split = a.metadata_bytes - idle;
	assert_true(split >= ARENA_CHUNK_FRAMES * sizeof(uint32_t));
	assert_true(split <= 6 * ARENA_CHUNK_FRAMES);
	/* More blocks in the same chunk cost nothing more. */
	int64_t g = arena_alloc(&a, 3);
	assert_int_equal((uint64_t)g >> ARENA_MAX_ORDER, (uint64_t)f >> ARENA_MAX_ORDER);
	assert_int_equal(a.metadata_bytes, idle + split);
	arena_free(&a, (uint32_t)f, 0);
	assert_int_equal(a.metadata_bytes, idle + split);
	arena_free(&a, (uint32_t)g, 3);
	assert_int_equal(a.metadata_bytes, idle);
	assert_int_equal(a.free_blocks[ARENA_MAX_ORDER], 32);
	arena_destroy(&a);
}

/* No memory for a split chunk's tables: -ENOMEM, nothing changed; what
 * needs no new table still works. */
static void test_table_allocation_fails(void **state)
{
	(void)state;
	struct arena a;
	assert_int_equal(arena_init(&a, 4u << 20, HUGEPAGES_OFF), 0);
	uint64_t idle = a.metadata_bytes;
	fail_malloc = true;
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM);
	assert_int_equal(arena_alloc_max(&a, 4, ARENA_MAX_ORDER), -ENOMEM);
	fail_malloc = false;
	assert_int_equal(a.free_frames, 1024);
	assert_int_equal(a.free_blocks[ARENA_MAX_ORDER], 2);
	assert_int_equal(a.metadata_bytes, idle);
	/* A 2 MiB block needs no table. */
	fail_malloc = true;
	int64_t big = arena_alloc(&a, ARENA_MAX_ORDER);
	assert_true(big >= 0);
	/* Splitting it would: refused, and it stays one block. */
	assert_int_equal(arena_split_block(&a, (uint32_t)big, ARENA_MAX_ORDER), -ENOMEM);
	fail_malloc = false;
	assert_int_equal(a.metadata_bytes, idle);
	assert_int_equal(arena_owner_locked(&a, (uint32_t)big + 256), ARENA_NONE);
	/* Once the other chunk is split, its free blocks need none either. */
	int64_t f = arena_alloc(&a, 0);
	assert_true(f >= 0);
	fail_malloc = true;
	int64_t more[511];
	for (int i = 0; i < 511; i++) {
		more[i] = arena_alloc(&a, 0);
		assert_true(more[i] >= 0);
	}
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM); /* really full */
	arena_free(&a, (uint32_t)big, ARENA_MAX_ORDER);
	assert_int_equal(arena_alloc(&a, 0), -ENOMEM); /* would split it */
	fail_malloc = false;
	for (int i = 0; i < 511; i++)
		arena_free(&a, (uint32_t)more[i], 0);
	arena_free(&a, (uint32_t)f, 0);
	assert_int_equal(a.free_blocks[ARENA_MAX_ORDER], 2);
	assert_int_equal(a.metadata_bytes, idle);
	arena_destroy(&a);
	/* The short tail's table is allocated at start: failing is -ENOMEM. */
	fail_malloc = true;
	int rc = arena_init(&a, (4u << 20) + 4096, HUGEPAGES_OFF);
	fail_malloc = false;
	assert_int_equal(rc, -ENOMEM);
}

/* The allocator writes nothing into the arena: a fresh arena, split and
 * merged, has no page of it resident. */
static void test_arena_memory_untouched(void **state)
{
	(void)state;
	struct arena a;
	assert_int_equal(arena_init(&a, 256u << 20, HUGEPAGES_OFF), 0);
	int64_t f[100];
	for (int i = 0; i < 100; i++) {
		f[i] = arena_alloc(&a, (unsigned)i % 10);
		assert_true(f[i] >= 0);
	}
	for (int i = 0; i < 100; i++)
		arena_free(&a, (uint32_t)f[i], (unsigned)i % 10);
	size_t pages = a.size / (size_t)sysconf(_SC_PAGESIZE);
	unsigned char *vec = malloc(pages);
	assert_non_null(vec);
	assert_int_equal(mincore(a.base, a.size, vec), 0);
	size_t resident = 0;
	for (size_t i = 0; i < pages; i++)
		resident += vec[i] & 1;
	assert_int_equal(resident, 0);
	free(vec);
	arena_destroy(&a);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_one_mib_has_no_2m_block),
		cmocka_unit_test(test_random_8m),
		cmocka_unit_test(test_random_odd_size),
		cmocka_unit_test(test_random_small),
		cmocka_unit_test(test_random_seeds),
		cmocka_unit_test(test_isolate_and_empty_a_chunk),
		cmocka_unit_test(test_isolate_whole_chunks),
		cmocka_unit_test(test_tables_follow_splits),
		cmocka_unit_test(test_table_allocation_fails),
		cmocka_unit_test(test_arena_memory_untouched),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
