/*
 * tests/unit/test_histogram.c: the latency histogram (daemon/histogram.h):
 * every value lands in the bucket whose bounds hold it, bounds are
 * contiguous and exact "le" values, recorders merge by adding, and
 * quantiles never under-state and over-state by at most one sub-bucket.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/histogram.h"

/* Bucket i holds (upper(i - 1), upper(i)]. */
static void assert_in_bucket(uint64_t ns)
{
	unsigned b = histogram_bucket(ns);
	assert_true(b < HISTOGRAM_BUCKETS);
	assert_true(ns <= histogram_bucket_upper(b));
	if (b > 0)
		assert_true(ns > histogram_bucket_upper(b - 1));
}

static void test_bucket_mapping(void **state)
{
	(void)state;
	assert_int_equal(histogram_bucket(0), 0);
	assert_int_equal(histogram_bucket(1), 0);
	assert_int_equal(histogram_bucket(1024), 0);
	assert_int_equal(histogram_bucket(1025), 1);
	assert_int_equal(histogram_bucket(1152), 1);
	assert_int_equal(histogram_bucket(1153), 2);
	assert_int_equal(histogram_bucket(2048), HISTOGRAM_SUB);
	assert_int_equal(histogram_bucket(2049), HISTOGRAM_SUB + 1);
	assert_int_equal(histogram_bucket(UINT64_C(1) << 37), HISTOGRAM_BUCKETS - 2);
	assert_int_equal(histogram_bucket((UINT64_C(1) << 37) + 1), HISTOGRAM_BUCKETS - 1);
	assert_int_equal(histogram_bucket(UINT64_MAX), HISTOGRAM_BUCKETS - 1);
	assert_true(histogram_bucket_upper(HISTOGRAM_BUCKETS - 1) == UINT64_MAX);
	/* Bounds grow, each sub-bucket at most 1/8 of its lower bound. */
	for (unsigned i = 1; i < HISTOGRAM_BUCKETS - 1; i++) {
		uint64_t lo = histogram_bucket_upper(i - 1), hi = histogram_bucket_upper(i);
		assert_true(hi > lo);
		assert_true((hi - lo) * HISTOGRAM_SUB <= lo);
		assert_int_equal(histogram_bucket(lo + 1), i);
		assert_int_equal(histogram_bucket(hi), i);
	}
	/* Every bound and its neighbours, and a sweep of odd values. */
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS - 1; i++) {
		uint64_t u = histogram_bucket_upper(i);
		assert_in_bucket(u - 1);
		assert_in_bucket(u);
		assert_in_bucket(u + 1);
	}
	for (uint64_t v = 1; v < (UINT64_C(1) << 40); v = v * 3 + 7)
		assert_in_bucket(v);
	/* 5 ms and 10 ms are far apart. */
	assert_true(histogram_bucket(10000000) > histogram_bucket(5000000) + HISTOGRAM_SUB - 1);
}

static void test_record_merge(void **state)
{
	(void)state;
	struct histogram_recorder *r1 = calloc(1, sizeof(*r1)), *r2 = calloc(1, sizeof(*r2));
	assert_non_null(r1);
	assert_non_null(r2);
	for (unsigned i = 0; i < 100; i++)
		histogram_record(r1, 5000000);
	for (unsigned i = 0; i < 50; i++)
		histogram_record(r2, 20000);
	histogram_record(r2, 5000000);
	struct histogram h;
	memset(&h, 0, sizeof(h));
	histogram_add_recorder(&h, r1);
	assert_int_equal(histogram_count(&h), 100);
	assert_int_equal(h.counts[histogram_bucket(5000000)], 100);
	histogram_add_recorder(&h, r2);
	assert_int_equal(histogram_count(&h), 151);
	assert_int_equal(h.counts[histogram_bucket(5000000)], 101);
	assert_int_equal(h.counts[histogram_bucket(20000)], 50);
	assert_true(h.sum_ns == 101 * UINT64_C(5000000) + 50 * UINT64_C(20000));
	struct histogram twice = h;
	histogram_merge(&twice, &h);
	assert_int_equal(histogram_count(&twice), 302);
	assert_true(twice.sum_ns == 2 * h.sum_ns);
	free(r1);
	free(r2);
}

static void test_quantiles(void **state)
{
	(void)state;
	struct histogram h;
	memset(&h, 0, sizeof(h));
	assert_int_equal(histogram_quantile(&h, 0.5), 0);
	/* One value: every quantile is its bucket's upper bound, never below
	 * it, at most 12.5% above. */
	for (uint64_t v = 1500; v < (UINT64_C(1) << 36); v = v * 5 / 3) {
		memset(&h, 0, sizeof(h));
		h.counts[histogram_bucket(v)] = 7;
		uint64_t q = histogram_quantile(&h, 0.5);
		assert_true(q >= v);
		assert_true(q - v <= v / HISTOGRAM_SUB);
		assert_true(histogram_quantile(&h, 0.999) == q);
	}
	/* 90 fast (20 us) and 10 slow (5 ms): p50 fast, p99 and p999 slow;
	 * p90 is the 90th value, still fast. */
	memset(&h, 0, sizeof(h));
	h.counts[histogram_bucket(20000)] = 90;
	h.counts[histogram_bucket(5000000)] = 10;
	uint64_t p50 = histogram_quantile(&h, 0.5), p90 = histogram_quantile(&h, 0.9);
	uint64_t p99 = histogram_quantile(&h, 0.99), p999 = histogram_quantile(&h, 0.999);
	assert_true(p50 >= 20000 && p50 <= 22500);
	assert_true(p90 == p50);
	assert_true(p99 >= 5000000 && p99 <= 5625000);
	assert_true(p999 == p99);
	assert_true(histogram_quantile(&h, 0.91) == p99);
	/* Beyond the last bound: the last bound. */
	memset(&h, 0, sizeof(h));
	h.counts[HISTOGRAM_BUCKETS - 1] = 1;
	assert_true(histogram_quantile(&h, 0.5) == UINT64_C(1) << HISTOGRAM_MAX_SHIFT);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_bucket_mapping),
	    cmocka_unit_test(test_record_merge),
	    cmocka_unit_test(test_quantiles),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
