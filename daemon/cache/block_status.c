/*
 * daemon/cache/block_status.c: BLOCK_STATUS (the operations layer, ops.h).
 * The backend answers; the cache overlays what it holds dirty (or is
 * writing back) as data, since the backend may still have a hole there.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"

struct cache_span {
	uint64_t start, end;
};

static int cmp_span(const void *a, const void *b)
{
	const struct cache_span *x = a, *y = b;
	return x->start < y->start ? -1 : x->start > y->start;
}

static void emit_extent(struct cache_op *op, struct nbd_extent *out, size_t *n, uint64_t len,
			uint32_t flags, bool *full)
{
	if (*full)
		return;
	if (*n && out[*n - 1].flags == flags) {
		out[*n - 1].length += len;
		return;
	}
	if (*n == op->max_extents) {
		*full = true;
		return;
	}
	out[(*n)++] = (struct nbd_extent){.length = len, .flags = flags};
}

static int span_add(struct cache_span **spans, size_t *n, size_t *cap, uint64_t start,
		    uint64_t end)
{
	if (*n == *cap) {
		size_t c = *cap ? *cap * 2 : 16;
		struct cache_span *v = realloc(*spans, c * sizeof(*v));
		if (!v)
			return -ENOMEM;
		*spans = v;
		*cap = c;
	}
	(*spans)[(*n)++] = (struct cache_span){start, end};
	return 0;
}

struct span_walk {
	struct cache_span *spans;
	size_t n, cap;
	int rc;
};

/* Shard lock held: the dirty runs of e (all of e while written back). */
static void span_collect(struct cache_entry *e, void *arg)
{
	struct span_walk *w = arg;
	if (w->rc < 0)
		return;
	if (cache_entry_writeback(e)) {
		w->rc = span_add(&w->spans, &w->n, &w->cap, cache_entry_offset(e),
				 cache_entry_offset(e) + cache_entry_bytes(e));
		return;
	}
	if (cache_entry_ndirty(e) == 0)
		return;
	struct cache_map dirty = cache_dirty_map(e);
	uint32_t nblocks = cache_entry_nblocks(e);
	for (uint32_t b = 0; b < nblocks && w->rc == 0; b++) {
		if (!map_test(dirty, b))
			continue;
		uint32_t r = b;
		while (r < nblocks && map_test(dirty, r))
			r++;
		uint64_t bs, be, rs, re;
		block_range(e, b, &bs, &be);
		block_range(e, r - 1, &rs, &re);
		w->rc = span_add(&w->spans, &w->n, &w->cap, bs, re);
		b = r;
	}
}

/*
 * The dirty runs in the range asked, from the index (for_each_entry): the
 * cost follows what is cached there, not the export's dirty data. An
 * entry being written back counts as dirty as a whole.
 */
static int collect_dirty_spans(struct cache_op *op)
{
	struct span_walk w = {0};
	int rc = op->length ? cache_for_each_entry(op->ce, op->offset, op->length, span_collect, &w) : 0;
	if (rc == 0)
		rc = w.rc;
	if (rc < 0) {
		free(w.spans);
		return rc;
	}
	if (w.n)
		qsort(w.spans, w.n, sizeof(*w.spans), cmp_span);
	op->spans = w.spans;
	op->nspans = w.n;
	return 0;
}

/*
 * The backend's extents, with every dirty block reported as data (the
 * backend may still have a hole there). The dirty spans were collected
 * before the backend was asked (collect_dirty_spans), so data written back
 * in between is seen by one or the other.
 */
static int block_status_overlay(struct cache_op *op)
{
	uint64_t start = op->offset;
	struct cache_span *spans = op->spans;
	size_t n = op->nspans;
	if (n == 0)
		return 0;
	struct nbd_extent *out = calloc(op->max_extents, sizeof(*out));
	if (!out)
		return -ENOMEM;
	size_t nout = 0, s = 0;
	bool full = false;
	uint64_t pos = start;
	for (size_t i = 0; i < op->n_extents; i++) {
		uint64_t xend = pos + op->extents[i].length;
		uint32_t flags = op->extents[i].flags;
		while (pos < xend) {
			while (s < n && spans[s].end <= pos)
				s++;
			if (flags == 0 || s == n || spans[s].start >= xend) {
				emit_extent(op, out, &nout, xend - pos, flags, &full);
				pos = xend;
			} else if (spans[s].start > pos) {
				emit_extent(op, out, &nout, spans[s].start - pos, flags, &full);
				pos = spans[s].start;
			} else {
				uint64_t stop = spans[s].end < xend ? spans[s].end : xend;
				emit_extent(op, out, &nout, stop - pos, 0, &full);
				pos = stop;
			}
		}
	}
	memcpy(op->extents, out, nout * sizeof(*out));
	op->n_extents = nout;
	free(out);
	return 0;
}

static void passthrough_done(struct backend_io *io, int result)
{
	struct cache_op *op = (struct cache_op *)((char *)io - offsetof(struct cache_op, io));
	cache_backend_timed(op->ce, io);
	if (result >= 0 && op->cmd == BACKEND_BLOCK_STATUS) {
		op->n_extents = io->n_extents;
		result = block_status_overlay(op);
	}
	free(op->spans);
	op->spans = NULL;
	op_finish(op, result);
}

static void passthrough(struct cache_op *op)
{
	op->io.cmd = op->cmd;
	op->io.flags = op->flags;
	op->io.offset = op->offset;
	op->io.length = op->length;
	op->io.extents = op->extents;
	op->io.max_extents = op->max_extents;
	op->io.done = passthrough_done;
	cache_backend_submit(op->ce, op->worker, &op->io);
}

void block_status_start(struct cache_op *op)
{
	int rc = collect_dirty_spans(op);
	if (rc < 0) {
		op_finish(op, rc);
		return;
	}
	passthrough(op);
}
