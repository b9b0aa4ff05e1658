/*
 * tests/unit/test_arena.c: the buddy allocator of daemon/cache/arena.c.
 *
 * Blocks handed out never overlap and stay inside the arena, whatever the
 * arena's size (1 MiB has no 2 MiB block; odd sizes end in a short chunk);
 * freeing everything merges the frames back into the largest blocks the
 * size allows; a random alloc/free sequence is checked against a model
 * (one owner per frame). Compaction support: chunks are listed emptiest
 * first; an isolated chunk hands out nothing, holds back what is freed in
 * it, and comes back as one 2 MiB block once its blocks are all freed;
 * arena_alloc_max never splits a larger block than allowed.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/cache/arena.h"

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

static void check_random(size_t size, unsigned seed)
{
	struct arena a;
	assert_int_equal(arena_init(&a, size, HUGEPAGES_OFF), 0);
	uint32_t n = a.nframes;
	int32_t *owner = malloc(n * sizeof(*owner));
	struct {
		uint32_t frame;
		unsigned order;
	} *live = malloc(n * sizeof(*live));
	assert_non_null(owner);
	assert_non_null(live);
	for (uint32_t i = 0; i < n; i++)
		owner[i] = -1;
	size_t nlive = 0;
	uint64_t used = 0;
	srand(seed);
	for (int step = 0; step < 20000; step++) {
		if (nlive && rand() % 100 < 45) {
			size_t k = (size_t)rand() % nlive;
			for (uint32_t i = 0; i < (1u << live[k].order); i++)
				owner[live[k].frame + i] = -1;
			arena_free(&a, live[k].frame, live[k].order);
			used -= 1u << live[k].order;
			live[k] = live[--nlive];
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
		assert_true((uint64_t)f + (1u << order) <= n);
		assert_int_equal((uint32_t)f & ((1u << order) - 1), 0);
		for (uint32_t i = 0; i < (1u << order); i++) {
			assert_int_equal(owner[f + i], -1);
			owner[f + i] = (int32_t)nlive;
		}
		live[nlive].frame = (uint32_t)f;
		live[nlive].order = order;
		nlive++;
		used += 1u << order;
		assert_int_equal(a.free_frames, n - used);
	}
	while (nlive) {
		nlive--;
		arena_free(&a, live[nlive].frame, live[nlive].order);
	}
	assert_int_equal(a.free_frames, n);
	/* Everything merged back: as few blocks as the size allows. */
	uint64_t blocks = 0;
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		blocks += a.free_blocks[o];
	assert_int_equal(blocks, blocks_in_max_blocks(n));
	free(owner);
	free(live);
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

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_one_mib_has_no_2m_block),
		cmocka_unit_test(test_random_8m),
		cmocka_unit_test(test_random_odd_size),
		cmocka_unit_test(test_random_small),
		cmocka_unit_test(test_isolate_and_empty_a_chunk),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
