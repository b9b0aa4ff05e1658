/*
 * daemon/histogram.h: latency histograms in nanoseconds, fixed
 * log-linear buckets, recorded without locks.
 *
 * Owns: the bucket layout (the same for every histogram, so two merge by
 * adding counts), recording, merging and quantiles. Dependency-free (libc
 * and stdatomic only): unit tested on i386 too.
 *
 * Buckets: one for (0, 1024] ns, then every power of two from 2^10 to 2^37
 * ns (1 us to 137 s) cut into HISTOGRAM_SUB equal sub-buckets, then one for
 * everything above 2^37 ns. A bucket holds the values v with
 * lower < v <= upper, Prometheus' "le" meaning, so a bucket's upper bound
 * is an exact "le" label:
 *
 *     0   1024  1152 1280 ... 1920  2048  2304 ...      2^37
 *     |----|-----|----|---...--|-----|-----|---- ... ----|------->
 *      b0    b1    b2            b8    b9                  last (+Inf)
 *
 * A sub-bucket is 1/8 of its power of two wide, so a quantile read from the
 * buckets is within 12.5% of the value it stands for.
 *
 * Threads: a struct histogram_recorder has one writer, the thread that owns
 * it (a worker): histogram_record() is a relaxed load and a relaxed store of
 * one count and of the sum, no read-modify-write, no lock. Any thread may
 * read it (histogram_add_recorder) while it is written: it sees each count
 * whole (64-bit atomics, i386 too), the counts not all of one instant. A
 * struct histogram is a plain copy for the reader.
 */
#ifndef NBDCACHED_DAEMON_HISTOGRAM_H
#define NBDCACHED_DAEMON_HISTOGRAM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define HISTOGRAM_SUB_BITS 3
#define HISTOGRAM_SUB (1u << HISTOGRAM_SUB_BITS)
#define HISTOGRAM_MIN_SHIFT 10 /* the first power of two cut up: 1024 ns */
#define HISTOGRAM_MAX_SHIFT 37 /* past 2^37 ns: the last bucket */
#define HISTOGRAM_BUCKETS (1u + (HISTOGRAM_MAX_SHIFT - HISTOGRAM_MIN_SHIFT) * HISTOGRAM_SUB + 1u)

struct histogram {
	uint64_t counts[HISTOGRAM_BUCKETS];
	uint64_t sum_ns;
};

struct histogram_recorder {
	atomic_uint_fast64_t counts[HISTOGRAM_BUCKETS];
	atomic_uint_fast64_t sum_ns;
};

/* The bucket that holds ns. */
static inline unsigned histogram_bucket(uint64_t ns)
{
	if (ns <= (UINT64_C(1) << HISTOGRAM_MIN_SHIFT))
		return 0;
	uint64_t v = ns - 1; /* buckets are (lower, upper] */
	unsigned shift = 63u - (unsigned)__builtin_clzll(v);
	if (shift >= HISTOGRAM_MAX_SHIFT)
		return HISTOGRAM_BUCKETS - 1;
	unsigned sub = (unsigned)(v >> (shift - HISTOGRAM_SUB_BITS)) & (HISTOGRAM_SUB - 1);
	return 1u + (shift - HISTOGRAM_MIN_SHIFT) * HISTOGRAM_SUB + sub;
}

/* Owner thread only: count one value. */
static inline void histogram_record(struct histogram_recorder *h, uint64_t ns)
{
	atomic_uint_fast64_t *c = &h->counts[histogram_bucket(ns)];
	atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1,
			      memory_order_relaxed);
	atomic_store_explicit(&h->sum_ns,
			      atomic_load_explicit(&h->sum_ns, memory_order_relaxed) + ns,
			      memory_order_relaxed);
}

/* Bucket i's upper bound in ns (UINT64_MAX for the last, unbounded one). */
uint64_t histogram_bucket_upper(unsigned i);
/* Add what a recorder holds to h (any thread). */
void histogram_add_recorder(struct histogram *h, const struct histogram_recorder *r);
/* Add src's counts to dst. */
void histogram_merge(struct histogram *dst, const struct histogram *src);
/* How many values h holds. */
uint64_t histogram_count(const struct histogram *h);
/*
 * The q-quantile (0 < q <= 1) in ns: the upper bound of the bucket that
 * holds the value of rank ceil(q * count), so at least a fraction q of the
 * values are at most the answer, which is at most 12.5% above that value
 * (above 2^37 ns: 2^37). 0 when h is empty.
 */
uint64_t histogram_quantile(const struct histogram *h, double q);

#endif
