/*
 * daemon/histogram.c: latency histograms (histogram.h): bucket bounds,
 * merging, quantiles. Recording is inline in the header (the hot path).
 *
 * Quantiles are a bucket's upper bound, not a value interpolated inside the
 * bucket: latencies bunch up just above a floor (a backend that takes 5 ms
 * answers in 5.0 to 5.3 ms), where linear interpolation, which assumes the
 * values spread evenly over the bucket, would report less than any value
 * seen. The upper bound never under-states (HdrHistogram reports its
 * "highest equivalent value" for the same reason) and over-states by less
 * than one sub-bucket, 12.5%.
 */
#include "daemon/histogram.h"

uint64_t histogram_bucket_upper(unsigned i)
{
	if (i == 0)
		return UINT64_C(1) << HISTOGRAM_MIN_SHIFT;
	if (i >= HISTOGRAM_BUCKETS - 1)
		return UINT64_MAX;
	unsigned shift = HISTOGRAM_MIN_SHIFT + (i - 1) / HISTOGRAM_SUB;
	uint64_t sub = (i - 1) % HISTOGRAM_SUB + 1;
	return (UINT64_C(1) << shift) + (sub << (shift - HISTOGRAM_SUB_BITS));
}

void histogram_add_recorder(struct histogram *h, const struct histogram_recorder *r)
{
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS; i++)
		h->counts[i] += atomic_load_explicit(&r->counts[i], memory_order_relaxed);
	h->sum_ns += atomic_load_explicit(&r->sum_ns, memory_order_relaxed);
}

void histogram_merge(struct histogram *dst, const struct histogram *src)
{
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS; i++)
		dst->counts[i] += src->counts[i];
	dst->sum_ns += src->sum_ns;
}

uint64_t histogram_count(const struct histogram *h)
{
	uint64_t n = 0;
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS; i++)
		n += h->counts[i];
	return n;
}

uint64_t histogram_quantile(const struct histogram *h, double q)
{
	uint64_t count = histogram_count(h);
	if (count == 0)
		return 0;
	if (q > 1.0)
		q = 1.0;
	double exact = q * (double)count;
	uint64_t rank = (uint64_t)exact;
	if ((double)rank < exact || rank == 0)
		rank++;
	if (rank > count)
		rank = count;
	uint64_t seen = 0;
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS - 1; i++) {
		seen += h->counts[i];
		if (seen >= rank)
			return histogram_bucket_upper(i);
	}
	return UINT64_C(1) << HISTOGRAM_MAX_SHIFT;
}
