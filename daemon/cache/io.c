/*
 * daemon/cache/io.c: NBD commands as cache operations (cache_submit).
 *
 * READ and cached WRITE split the request into pieces, one per entry it
 * touches (or a bypass piece where nothing may be cached), pin each entry,
 * and then drive a small state machine, op_run(), until every piece is
 * ready:
 *
 *   examine  under the shard lock, find blocks that are not uptodate (for
 *            a WRITE, only partly covered ones), mark them busy and read
 *            each run of them from the backend in one request (a fill);
 *            blocks another operation is filling make the op wait
 *   fills    complete on the same worker; a fill whose entry was
 *            invalidated meanwhile (a direct write landed) is discarded
 *            and examined again
 *   commit   WRITE: copy the payload into the arena, set uptodate+dirty
 *
 * Hits touch neither the backend nor any lock but the shard's, and the
 * reply is sent straight from the arena (the pins last until it is sent).
 *
 * Readahead: a READ that continues its connection's previous one (the
 * caller sets op->sequential) asks for aligned 2 MiB entries, a hint the
 * arena may not honour (cache.c falls back and nudges the compactor), and
 * fills each entry from the piece on to its end in the same backend
 * requests. A fill that fails is retried without reading ahead.
 *
 * Direct operations (TRIM, WRITE_ZEROES, FUA writes, writes in
 * writethrough / writearound mode, and writes the cache has no room for)
 * go to the backend first and are then applied to whatever is cached:
 *
 *   register  the range in the export's list; overlapping direct
 *             operations run one after the other, and writeback leaves
 *             registered ranges alone
 *   drain     wait until no entry in the range is being written back, so
 *             old data cannot land on the backend after the new
 *   backend   the operation itself
 *   apply     success: update uptodate bytes, clean fully covered blocks,
 *             bump invalidations so fills in flight are discarded;
 *             failure: forget clean blocks (the backend is now unknown),
 *             dirty ones stay
 */
#include <errno.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

#define CACHE_PREFETCH_MAX (32u << 20)

struct cache_piece {
	uint64_t offset;
	uint32_t length;
	struct cache_entry *entry; /* pinned; NULL for a bypass piece */
	uint8_t *buf;		   /* bypass data */
	bool ready;
	bool issued; /* bypass read submitted */
};

struct cache_fill {
	struct backend_io io;
	struct cache_op *op;
	struct cache_piece *piece;
	uint32_t first, count;
	uint32_t invalidations;
	bool ahead; /* reads ahead of the request: a failure retries without */
};

static void op_run(struct cache_op *op);

/* done() may free the op: inside op_run it is deferred to op_run's end. */
static void op_finish(struct cache_op *op, int result)
{
	op->finished = true;
	op->result = result;
	if (!op->running)
		op->done(op, result);
}

static struct cache_shard *shard_of(struct cache_export *ce, uint64_t offset)
{
	return cache_shard_for(ce->cache, ce, offset >> CACHE_RANGE_SHIFT);
}

static unsigned order_for_length(uint64_t length)
{
	unsigned o = 0;
	while (o < ARENA_MAX_ORDER && ((uint64_t)ARENA_FRAME_SIZE << (o + 1)) <= length)
		o++;
	return o;
}

static struct cache_piece *piece_add(struct cache_op *op)
{
	if (op->npieces == op->pieces_cap) {
		size_t cap = op->pieces_cap ? op->pieces_cap * 2 : 4;
		struct cache_piece *v = realloc(op->pieces, cap * sizeof(*v));
		if (!v)
			return NULL;
		op->pieces = v;
		op->pieces_cap = cap;
	}
	struct cache_piece *p = &op->pieces[op->npieces++];
	memset(p, 0, sizeof(*p));
	return p;
}

/*
 * Split [offset, offset+length) into pieces, pinning the entries. New
 * entries are made unless allocate is false; where none can be had the
 * piece is a bypass piece, and so is the rest of the range that is not
 * cached already: a failed allocation scanned the eviction queues and
 * found every entry pinned, dirty or unflushed, and a 4 KiB frame at a
 * time that scan would hold the worker for seconds. Returns 0, -ENOMEM, or -ENOSPC when a WRITE
 * could not get room for every piece (the caller goes direct).
 */
static bool range_uptodate(struct cache_entry *e, uint64_t offset, uint64_t length);

static int pieces_build(struct cache_op *op, bool allocate, bool need_all)
{
	struct cache_export *ce = op->ce;
	uint64_t pos = op->offset, end = op->offset + op->length;
	while (pos < end) {
		uint64_t frame = pos >> ARENA_FRAME_SHIFT;
		struct cache_shard *sh = shard_of(ce, pos);
		pthread_mutex_lock(&sh->lock);
		struct cache_entry *e = cache_lookup(ce, sh, frame);
		if (!e && allocate) {
			e = cache_entry_create(ce, sh, frame,
					       op->readahead ? ARENA_MAX_ORDER
							     : order_for_length(end - pos));
			allocate = e != NULL;
		}
		uint64_t piece_end = e ? cache_entry_offset(e) + cache_entry_bytes(e)
				       : (frame + 1) << ARENA_FRAME_SHIFT;
		if (piece_end > end)
			piece_end = end;
		/* A read hit is settled here, under the lock already held. */
		bool hit = false;
		if (e) {
			cache_entry_pin(e);
			hit = op->cmd != BACKEND_WRITE && range_uptodate(e, pos, piece_end - pos);
		}
		pthread_mutex_unlock(&sh->lock);
		if (!e && need_all)
			return -ENOSPC;
		struct cache_piece *last = op->npieces ? &op->pieces[op->npieces - 1] : NULL;
		if (!e && last && !last->entry && last->offset + last->length == pos &&
		    last->length + (piece_end - pos) <= UINT32_MAX) {
			last->length += (uint32_t)(piece_end - pos);
		} else {
			struct cache_piece *p = piece_add(op);
			if (!p) {
				if (e)
					cache_entry_unpin(e);
				return -ENOMEM;
			}
			p->offset = pos;
			p->length = (uint32_t)(piece_end - pos);
			p->entry = e;
			p->ready = hit;
			op->some_cached |= hit;
		}
		pos = piece_end;
	}
	return 0;
}

static void pieces_release(struct cache_op *op)
{
	for (size_t i = 0; i < op->npieces; i++) {
		if (op->pieces[i].entry)
			cache_entry_unpin(op->pieces[i].entry);
		free(op->pieces[i].buf);
	}
	free(op->pieces);
	op->pieces = NULL;
	op->npieces = op->pieces_cap = 0;
}

/* First and last block of e that [offset, offset+length) touches. */
static void piece_blocks(const struct cache_entry *e, uint64_t offset, uint64_t length,
			 uint32_t *first, uint32_t *last)
{
	unsigned shift = e->ce->block_shift;
	uint64_t base = cache_entry_offset(e);
	*first = (uint32_t)((offset - base) >> shift);
	*last = (uint32_t)((offset + length - 1 - base) >> shift);
}

/* Is every block of e that [offset, offset+length) touches uptodate?
 * Shard lock held. */
static bool range_uptodate(struct cache_entry *e, uint64_t offset, uint64_t length)
{
	uint32_t first, last;
	piece_blocks(e, offset, length, &first, &last);
	const uint64_t *uptodate = cache_uptodate_map(e);
	for (uint32_t b = first; b <= last; b++)
		if (!bit_test(uptodate, b))
			return false;
	return true;
}

/* Device range of block b of e, clipped to the export. */
static void block_range(const struct cache_entry *e, uint32_t b, uint64_t *start, uint64_t *end)
{
	*start = cache_entry_offset(e) + ((uint64_t)b << e->ce->block_shift);
	*end = *start + e->ce->block_size;
	if (*end > e->ce->size)
		*end = e->ce->size;
}

static void fill_done(struct backend_io *io, int result)
{
	struct cache_fill *f = (struct cache_fill *)io;
	struct cache_op *op = f->op;
	struct cache_entry *e = f->piece->entry;
	struct cache_export *ce = op->ce;
	struct cache_shard *sh = shard_of(ce, cache_entry_offset(e));
	if (result >= 0) {
		/* Bytes past the end of the export read as zeros. */
		uint64_t start, end;
		block_range(e, f->first, &start, &end);
		uint64_t want = (uint64_t)f->count << ce->block_shift;
		uint64_t got = io->length;
		if (got < want)
			memset((uint8_t *)io->buf + got, 0, want - got);
	}
	/* Once per fill, not per hit: does it hold an all-zero 4 KiB block? */
	bool zeros = false;
	if (result >= 0) {
		uint64_t want = (uint64_t)f->count << ce->block_shift;
		const uint8_t *p = io->buf;
		for (uint64_t at = 0; at < want && !zeros; at += ARENA_FRAME_SIZE)
			zeros = cache_all_zero(p + at, want - at < ARENA_FRAME_SIZE ? want - at
										    : ARENA_FRAME_SIZE);
	}
	pthread_mutex_lock(&sh->lock);
	uint64_t *busy = cache_busy_map(e), *uptodate = cache_uptodate_map(e);
	bool keep = result >= 0 && e->invalidations == f->invalidations;
	if (keep && zeros)
		e->may_hold_zeros = true;
	for (uint32_t b = f->first; b < f->first + f->count; b++) {
		bit_clear(busy, b);
		if (keep)
			bit_set(uptodate, b);
	}
	pthread_mutex_unlock(&sh->lock);
	cache_waitq_wake(ce->cache);
	if (result < 0 && f->ahead) {
		/* The blocks asked for are examined again, without readahead:
		 * an error past them is not this request's. */
		op->readahead = false;
	} else if (result < 0 && !op->error) {
		op->error = result;
	}
	free(f);
	if (--op->pending == 0)
		op_run(op);
}

static void bypass_done(struct backend_io *io, int result)
{
	struct cache_fill *f = (struct cache_fill *)io;
	struct cache_op *op = f->op;
	if (result < 0) {
		if (!op->error)
			op->error = result;
	} else {
		f->piece->ready = true;
	}
	free(f);
	if (--op->pending == 0)
		op_run(op);
}

static int submit_read(struct cache_op *op, struct cache_piece *p, uint64_t offset,
		       uint64_t length, void *buf, uint32_t first, uint32_t count,
		       uint32_t invalidations, bool ahead, void (*done)(struct backend_io *, int))
{
	struct cache_fill *f = calloc(1, sizeof(*f));
	if (!f)
		return -ENOMEM;
	struct cache_export *ce = op->ce;
	if (offset + length > ce->size)
		length = ce->size - offset;
	f->op = op;
	f->piece = p;
	f->first = first;
	f->count = count;
	f->invalidations = invalidations;
	f->ahead = ahead;
	f->io.cmd = BACKEND_READ;
	f->io.offset = offset;
	f->io.length = length;
	f->io.buf = buf;
	f->io.done = done;
	op->pending++;
	atomic_fetch_add(&ce->counters.backend_reads, 1);
	atomic_fetch_add(&ce->counters.backend_read_bytes, length);
	backend_submit(ce->backend, op->worker, &f->io);
	return 0;
}

/*
 * Examine one piece under its shard lock: mark the blocks this op will
 * fill busy and collect them as runs. Returns true if the piece must wait
 * for another operation's fill. Fills are submitted after unlocking. A
 * readahead READ also fills the rest of the entry after the piece (blocks
 * that are neither uptodate nor busy), in the same backend requests: the
 * next reads of a sequential stream find it there.
 */
struct run {
	uint32_t first, count;
	bool ahead; /* holds readahead blocks */
};

/* Block b joins the last run if it follows it, else starts a new one. */
static void run_append(struct run *runs, size_t *nruns, uint32_t b)
{
	if (*nruns && runs[*nruns - 1].first + runs[*nruns - 1].count == b)
		runs[*nruns - 1].count++;
	else
		runs[(*nruns)++] = (struct run){b, 1, false};
}

static bool piece_examine(struct cache_op *op, struct cache_piece *p, struct run *runs,
			  size_t *nruns, bool *any_cached)
{
	struct cache_entry *e = p->entry;
	uint32_t first, last;
	piece_blocks(e, p->offset, p->length, &first, &last);
	uint64_t *uptodate = cache_uptodate_map(e), *busy = cache_busy_map(e);
	bool blocked = false, missing = false;
	uint32_t fill_last = op->readahead && op->cmd == BACKEND_READ ? e->nblocks - 1 : last;
	uint64_t end_block = (e->ce->size - cache_entry_offset(e) + e->ce->block_size - 1) >>
			     e->ce->block_shift;
	if (fill_last >= end_block)
		fill_last = last > end_block - 1 ? last : (uint32_t)(end_block - 1);
	*nruns = 0;
	for (uint32_t b = first; b <= fill_last; b++) {
		if (b > last) { /* readahead: never waits, never counts as missing */
			if (bit_test(uptodate, b) || bit_test(busy, b)) {
				continue;
			}
			bit_set(busy, b);
			run_append(runs, nruns, b);
			runs[*nruns - 1].ahead = true;
			continue;
		}
		if (bit_test(uptodate, b)) {
			*any_cached = true;
			continue;
		}
		if (op->cmd == BACKEND_WRITE) {
			uint64_t bs, be;
			block_range(e, b, &bs, &be);
			if (p->offset <= bs && p->offset + p->length >= be)
				continue; /* fully overwritten: never read */
		}
		missing = true;
		if (bit_test(busy, b)) {
			blocked = true;
			continue;
		}
		bit_set(busy, b);
		run_append(runs, nruns, b);
	}
	if (!missing)
		p->ready = true;
	return blocked;
}

static int op_examine(struct cache_op *op, bool *blocked)
{
	struct cache_export *ce = op->ce;
	bool any_cached = op->some_cached, all_ready = true;
	*blocked = false;
	for (size_t i = 0; i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		if (p->ready)
			continue;
		if (!p->entry) {
			all_ready = false;
			if (p->issued)
				continue;
			p->buf = malloc(p->length ? p->length : 1);
			if (!p->buf)
				return -ENOMEM;
			p->issued = true;
			atomic_fetch_add(&ce->counters.bypass_reads, 1);
			int rc = submit_read(op, p, p->offset, p->length, p->buf, 0, 0, 0, false,
					     bypass_done);
			if (rc < 0)
				return rc;
			continue;
		}
		struct cache_entry *e = p->entry;
		uint32_t nblocks_max = e->nblocks;
		struct run stack_runs[8];
		struct run *runs = stack_runs;
		if (nblocks_max > 8) {
			runs = malloc(((nblocks_max + 1) / 2 + 1) * sizeof(*runs));
			if (!runs)
				return -ENOMEM;
		}
		size_t nruns = 0;
		struct cache_shard *sh = shard_of(ce, p->offset);
		pthread_mutex_lock(&sh->lock);
		if (piece_examine(op, p, runs, &nruns, &any_cached))
			*blocked = true;
		uint32_t frame = e->frame; /* stable: the entry is pinned */
		uint32_t invalidations = e->invalidations;
		pthread_mutex_unlock(&sh->lock);
		if (!p->ready)
			all_ready = false;
		int rc = 0;
		size_t k;
		for (k = 0; k < nruns && rc == 0; k++) {
			uint64_t off = cache_entry_offset(e) + ((uint64_t)runs[k].first << ce->block_shift);
			uint8_t *buf = arena_address(&ce->cache->arena, frame) +
				       ((size_t)runs[k].first << ce->block_shift);
			rc = submit_read(op, p, off, (uint64_t)runs[k].count << ce->block_shift, buf,
					 runs[k].first, runs[k].count, invalidations, runs[k].ahead,
					 fill_done);
		}
		if (rc < 0) {
			/* The runs not submitted must not stay busy: nobody would clear them. */
			pthread_mutex_lock(&sh->lock);
			for (k = k - 1; k < nruns; k++)
				for (uint32_t b = runs[k].first; b < runs[k].first + runs[k].count; b++)
					bit_clear(cache_busy_map(e), b);
			pthread_mutex_unlock(&sh->lock);
			cache_waitq_wake(ce->cache);
		}
		if (runs != stack_runs)
			free(runs);
		if (rc < 0)
			return rc;
	}
	if (!op->counted && op->cmd == BACKEND_READ) {
		op->counted = true;
		struct cache_counters *k = &ce->counters;
		if (all_ready && op->npieces)
			atomic_fetch_add(&k->hits, 1);
		else if (any_cached)
			atomic_fetch_add(&k->partial_hits, 1);
		else
			atomic_fetch_add(&k->misses, 1);
	}
	return 0;
}

/*
 * WRITE: copy the payload into every piece and mark it dirty. The blocks
 * are marked busy while the copy runs without the lock, so no fill can
 * start under it. Returns false if some piece must wait or be examined
 * again (a partial block lost its uptodate bit, or another op is busy).
 */
static bool write_commit(struct cache_op *op, bool *blocked)
{
	struct cache_export *ce = op->ce;
	*blocked = false;
	for (size_t i = 0; i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		if (!p->ready)
			continue; /* committed already (ready cleared) or not yet examined */
		struct cache_entry *e = p->entry;
		uint32_t first, last;
		piece_blocks(e, p->offset, p->length, &first, &last);
		struct cache_shard *sh = shard_of(ce, p->offset);
		pthread_mutex_lock(&sh->lock);
		uint64_t *uptodate = cache_uptodate_map(e), *busy = cache_busy_map(e);
		bool ok = true;
		for (uint32_t b = first; b <= last && ok; b++) {
			uint64_t bs, be;
			block_range(e, b, &bs, &be);
			bool full = p->offset <= bs && p->offset + p->length >= be;
			if (bit_test(busy, b)) {
				ok = false;
				*blocked = true;
			} else if (!full && !bit_test(uptodate, b)) {
				ok = false;
				p->ready = false; /* examine again: fill it */
			}
		}
		if (!ok) {
			pthread_mutex_unlock(&sh->lock);
			continue;
		}
		for (uint32_t b = first; b <= last; b++)
			bit_set(busy, b);
		uint8_t *dst = arena_address(&ce->cache->arena, e->frame) +
			       (size_t)(p->offset - cache_entry_offset(e));
		pthread_mutex_unlock(&sh->lock);
		memcpy(dst, op->payload + (p->offset - op->offset), p->length);
		pthread_mutex_lock(&sh->lock);
		for (uint32_t b = first; b <= last; b++) {
			bit_clear(busy, b);
			bit_set(uptodate, b);
		}
		cache_mark_dirty(e, first, last - first + 1);
		e->may_hold_zeros = true; /* not worth scanning the payload */
		pthread_mutex_unlock(&sh->lock);
		cache_waitq_wake(ce->cache);
		cache_entry_unpin(e);
		p->entry = NULL;
		p->ready = false;
		p->issued = true; /* done: a NULL entry that is issued is committed */
	}
	for (size_t i = 0; i < op->npieces; i++)
		if (op->pieces[i].entry)
			return false;
	return true;
}

static void op_wait(struct cache_op *op, uint64_t seq)
{
	if (op->rerun)
		return; /* a completion ran inline: look again before waiting */
	if (!cache_waitq_wait(op->ce->cache, &op->waiter, seq))
		op->rerun = true;
}

/* One step of a READ, CACHE or cached WRITE. */
static void cached_step(struct cache_op *op)
{
	if (op->pending)
		return;
	if (op->error) {
		op_finish(op, op->error);
		return;
	}
	uint64_t seq = cache_waitq_seq(op->ce->cache);
	bool blocked;
	int rc = op_examine(op, &blocked);
	if (rc < 0) {
		op->error = rc;
		if (!op->pending)
			op_finish(op, rc);
		return;
	}
	if (op->pending)
		return;
	for (size_t i = 0; i < op->npieces; i++) {
		if (!op->pieces[i].ready && !(op->cmd == BACKEND_WRITE && op->pieces[i].issued)) {
			op_wait(op, seq);
			return;
		}
	}
	if (op->cmd == BACKEND_WRITE) {
		if (!write_commit(op, &blocked)) {
			if (blocked)
				op_wait(op, seq);
			else
				op->rerun = true;
			return;
		}
		struct cache *c = op->ce->cache;
		if (atomic_load(&c->counters.dirty_bytes) > c->dirty_high ||
		    atomic_load(&op->ce->counters.dirty_bytes) > atomic_load(&op->ce->dirty_high))
			cache_kick_writeback(c);
		pieces_release(op);
		op_finish(op, 0);
		return;
	}
	for (size_t i = 0; i < op->npieces; i++)
		if (op->pieces[i].entry)
			cache_entry_touch(op->pieces[i].entry);
	if (op->cmd == BACKEND_CACHE)
		pieces_release(op);
	op_finish(op, 0);
}

/* ---- direct operations ---- */

static void op_retry_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	op_run(arg);
}

/*
 * Run op again in a while, from the worker's event loop: a step that
 * cannot progress now (out of memory) must neither spin on the worker nor
 * keep its other connections waiting.
 */
static void op_retry_later(struct cache_op *op)
{
	struct timeval tv = {0, 10000};
	if (event_base_once(op->worker->base, -1, EV_TIMEOUT, op_retry_timer, op, &tv) < 0)
		worker_post(op->worker, &op->waiter.task); /* runs op_task: op_run */
}

bool cache_direct_overlaps(struct cache_export *ce, uint64_t offset, uint64_t length)
{
	for (struct cache_op *d = ce->direct; d; d = d->direct_next)
		if (d->offset < offset + length && offset < d->offset + d->length)
			return true;
	return false;
}

/*
 * Call fn on every cached entry overlapping [offset, offset+length), with
 * its shard lock held. Walks the range nodes by index when that is short,
 * else the export's list of range nodes (a TRIM of many TiB).
 */
static int for_each_entry(struct cache_export *ce, uint64_t offset, uint64_t length,
			  void (*fn)(struct cache_entry *e, void *arg), void *arg)
{
	uint64_t first = offset >> CACHE_RANGE_SHIFT;
	uint64_t last = (offset + length - 1) >> CACHE_RANGE_SHIFT;
	uint64_t *list = NULL;
	size_t n = 0;
	pthread_mutex_lock(&ce->lock);
	uint64_t nodes = ce->range_count;
	pthread_mutex_unlock(&ce->lock);
	bool by_list = last - first >= 2 * nodes + 16;
	if (by_list) {
		int rc = cache_ranges_between(ce, first, last, &list, &n);
		/* Out of memory: walking by index needs none, if not too long. */
		if (rc < 0 && last - first >= (1u << 20))
			return rc;
		by_list = rc == 0;
	}
	for (uint64_t k = 0; by_list ? k < n : first + k <= last; k++) {
		uint64_t index = by_list ? list[k] : first + k;
		struct cache_shard *sh = cache_shard_for(ce->cache, ce, index);
		pthread_mutex_lock(&sh->lock);
		struct cache_range *r = cache_range_get(sh, ce, index);
		for (uint32_t i = 0; r && i < r->count; i++) {
			struct cache_entry *e = r->entries[i];
			uint64_t eo = cache_entry_offset(e);
			if (eo < offset + length && offset < eo + cache_entry_bytes(e))
				fn(e, arg);
		}
		pthread_mutex_unlock(&sh->lock);
		if (first + k == UINT64_MAX)
			break;
	}
	free(list);
	return 0;
}

static void find_writeback(struct cache_entry *e, void *arg)
{
	if (e->writeback)
		*(bool *)arg = true;
}

/* Apply a finished direct operation to one entry (shard lock held). */
static void direct_apply(struct cache_entry *e, void *arg)
{
	struct cache_op *op = arg;
	struct cache_export *ce = op->ce;
	bool ok = !op->error;
	uint64_t base = cache_entry_offset(e);
	uint64_t a = op->offset > base ? op->offset : base;
	uint64_t b = op->offset + op->length;
	if (b > base + cache_entry_bytes(e))
		b = base + cache_entry_bytes(e);
	uint32_t first, last;
	piece_blocks(e, a, b - a, &first, &last);
	uint64_t *uptodate = cache_uptodate_map(e), *dirty = cache_dirty_map(e),
		 *busy = cache_busy_map(e);
	uint8_t *mem = arena_address(&ce->cache->arena, e->frame);
	bool populate = ok && op->cmd == BACKEND_WRITE && ce->mode == CACHE_MODE_WRITETHROUGH;
	uint32_t touched = 0;
	for (uint32_t blk = first; blk <= last; blk++) {
		uint64_t bs, be;
		block_range(e, blk, &bs, &be);
		uint64_t x = bs > a ? bs : a, y = be < b ? be : b;
		bool full = x == bs && y == be;
		if (!ok) {
			/* The backend's bytes are unknown now. A clean copy is
			 * forgotten; one of an unstable entry may be the only
			 * copy of acknowledged data not yet flushed: it is
			 * written again instead. */
			if (bit_test(uptodate, blk) && !bit_test(dirty, blk)) {
				if (e->on_unstable_list)
					cache_mark_dirty(e, blk, 1);
				else
					bit_clear(uptodate, blk);
			}
			continue;
		}
		if (op->cmd == BACKEND_TRIM && full) {
			/* The backend decides what a trimmed block reads as. */
			cache_clear_dirty(e, blk, 1);
			bit_clear(uptodate, blk);
			continue;
		}
		bool up = bit_test(uptodate, blk);
		if (!up && !(populate && full && !bit_test(busy, blk)))
			continue;
		if (x < y) {
			if (op->cmd == BACKEND_WRITE)
				memcpy(mem + (x - base), op->payload + (x - op->offset), y - x);
			else
				memset(mem + (x - base), 0, y - x);
			touched++;
		}
		if (full) {
			bit_set(uptodate, blk);
			cache_clear_dirty(e, blk, 1);
		}
		if (op->maybe_lost && x < y && bit_test(uptodate, blk))
			cache_mark_dirty(e, blk, 1); /* written again: see direct_done */
	}
	e->invalidations++;
	if (ok)
		e->may_hold_zeros = true;
	/* The cached copy is the one to write again if the backend loses
	 * the write before a flush: it stays until one covers it. */
	if (touched && op->write_seq)
		cache_mark_unstable(e, touched, op->write_seq);
	cache_dirty_list_update(e);
}

/*
 * writethrough: cache what was just written, where room can be found (up
 * to the first frame where none can: see pieces_build).
 */
static void direct_populate(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	uint64_t pos = op->offset, end = op->offset + op->length;
	bool allocate = true;
	while (pos < end) {
		struct cache_shard *sh = shard_of(ce, pos);
		pthread_mutex_lock(&sh->lock);
		uint64_t frame = pos >> ARENA_FRAME_SHIFT;
		struct cache_entry *e = cache_lookup(ce, sh, frame);
		if (!e && allocate) {
			e = cache_entry_create(ce, sh, frame, order_for_length(end - pos));
			allocate = e != NULL;
		}
		if (!e) {
			pthread_mutex_unlock(&sh->lock);
			pos = (frame + 1) << ARENA_FRAME_SHIFT;
			continue;
		}
		uint64_t next = cache_entry_offset(e) + cache_entry_bytes(e);
		direct_apply(e, op);
		pthread_mutex_unlock(&sh->lock);
		pos = next;
	}
}

static void direct_unregister(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	pthread_mutex_lock(&ce->lock);
	struct cache_op **pp = &ce->direct;
	while (*pp != op)
		pp = &(*pp)->direct_next;
	*pp = op->direct_next;
	pthread_mutex_unlock(&ce->lock);
	op->registered = false;
	cache_waitq_wake(ce->cache);
}

static void direct_done(struct backend_io *io, int result)
{
	struct cache_op *op = (struct cache_op *)((char *)io - offsetof(struct cache_op, io));
	struct cache_export *ce = op->ce;
	if (result < 0) {
		op->error = result;
	} else if (!(op->flags & BACKEND_FUA)) {
		/* Acknowledged, not durable until a backend flush (cache.h). */
		op->write_seq = atomic_fetch_add(&ce->backend_writes_done, 1) + 1;
		atomic_fetch_add(&ce->direct_writes_done, 1);
		if (atomic_load(&ce->backend->loss_seq) != op->loss_at_submit) {
			/* A connection was lost meanwhile: the server may have
			 * lost this write, and a flush round may have acted on
			 * the loss before it was counted. What the cache holds
			 * of it is written again (direct_apply); the rest is
			 * reported to every connection's next FLUSH. */
			op->maybe_lost = true;
			pthread_mutex_lock(&ce->lock);
			ce->error_seq++;
			pthread_mutex_unlock(&ce->lock);
		}
	}
	op->stage = 3;
	op->pending--;
	op_run(op);
}

static void direct_step(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	struct cache *c = ce->cache;
	if (op->pending)
		return;
	uint64_t seq = cache_waitq_seq(c);
	switch (op->stage) {
	case 0: /* register the range */
		pthread_mutex_lock(&ce->lock);
		if (cache_direct_overlaps(ce, op->offset, op->length)) {
			pthread_mutex_unlock(&ce->lock);
			op_wait(op, seq);
			return;
		}
		op->direct_next = ce->direct;
		ce->direct = op;
		pthread_mutex_unlock(&ce->lock);
		op->registered = true;
		op->stage = 1;
		/* fall through */
	case 1: { /* no writeback in flight over the range */
		bool writing = false;
		int rc = op->length ? for_each_entry(ce, op->offset, op->length, find_writeback,
						     &writing)
				    : 0;
		if (rc < 0) {
			direct_unregister(op);
			op_finish(op, rc);
			return;
		}
		if (writing) {
			op_wait(op, seq);
			return;
		}
		op->stage = 2;
		op->io.offset = op->offset;
		op->io.length = op->length;
		op->io.buf = (void *)op->payload;
		op->io.done = direct_done;
		op->io.cmd = op->cmd;
		op->io.flags = op->flags;
		op->pending = 1;
		op->loss_at_submit = atomic_load(&ce->backend->loss_seq);
		if (op->cmd == BACKEND_WRITE) {
			atomic_fetch_add(&ce->counters.backend_writes, 1);
			atomic_fetch_add(&ce->counters.backend_write_bytes, op->length);
			atomic_fetch_add(&ce->counters.direct_writes, 1);
		}
		backend_submit(ce->backend, op->worker, &op->io);
		return;
	}
	case 3: /* apply to the cache */
		if (op->length) {
			if (!op->error && op->cmd == BACKEND_WRITE &&
			    ce->mode == CACHE_MODE_WRITETHROUGH) {
				direct_populate(op);
			} else if (for_each_entry(ce, op->offset, op->length, direct_apply, op) < 0) {
				/*
				 * The backend has changed: the cache must follow or
				 * serve stale data. Only memory can be missing here;
				 * try again (the range stays registered meanwhile).
				 */
				log_warn("cache: out of memory applying a write to the cache; "
					 "retrying");
				op_retry_later(op);
				return;
			}
		}
		direct_unregister(op);
		op_finish(op, op->error);
		return;
	}
}

/* ---- block status ---- */

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
	if (e->writeback) {
		w->rc = span_add(&w->spans, &w->n, &w->cap, cache_entry_offset(e),
				 cache_entry_offset(e) + cache_entry_bytes(e));
		return;
	}
	if (e->ndirty == 0)
		return;
	const uint64_t *dirty = cache_dirty_map(e);
	for (uint32_t b = 0; b < e->nblocks && w->rc == 0; b++) {
		if (!bit_test(dirty, b))
			continue;
		uint32_t r = b;
		while (r < e->nblocks && bit_test(dirty, r))
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
	int rc = op->length ? for_each_entry(op->ce, op->offset, op->length, span_collect, &w) : 0;
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
	backend_submit(op->ce->backend, op->worker, &op->io);
}

/* ---- entry points ---- */

static void op_step(struct cache_op *op)
{
	if (op->cmd == BACKEND_READ || op->cmd == BACKEND_CACHE ||
	    (op->cmd == BACKEND_WRITE && op->stage == -1))
		cached_step(op);
	else
		direct_step(op);
}

static void op_run(struct cache_op *op)
{
	if (op->running) {
		op->rerun = true;
		return;
	}
	op->running = true;
	do {
		op->rerun = false;
		op_step(op);
	} while (op->rerun && !op->finished);
	op->running = false;
	if (op->finished)
		op->done(op, op->result); /* the last touch of op */
}

static void op_task(struct worker_task *task)
{
	struct cache_op *op =
		(struct cache_op *)((char *)task - offsetof(struct cache_op, waiter.task));
	op_run(op);
}

void cache_submit(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	op->pieces = NULL;
	op->npieces = op->pieces_cap = 0;
	op->pending = 0;
	op->error = 0;
	op->stage = 0;
	op->registered = op->counted = op->running = op->rerun = op->finished = false;
	op->some_cached = false;
	op->spans = NULL;
	op->nspans = 0;
	op->write_seq = 0;
	op->maybe_lost = false;
	op->waiter.worker = op->worker;
	op->waiter.task.run = op_task;
	int rc = 0;
	op->readahead = false;
	switch (op->cmd) {
	case BACKEND_READ:
		op->readahead = op->sequential && !op->no_allocate;
		rc = pieces_build(op, !op->no_allocate, false);
		break;
	case BACKEND_CACHE:
		if (op->length > CACHE_PREFETCH_MAX)
			op->length = CACHE_PREFETCH_MAX;
		if (op->length > ce->cache->arena.size / 4)
			op->length = ce->cache->arena.size / 4;
		rc = pieces_build(op, true, false);
		/* Nothing to read where nothing can be cached. */
		for (size_t i = 0; i < op->npieces; i++)
			if (!op->pieces[i].entry)
				op->pieces[i].ready = true;
		break;
	case BACKEND_WRITE:
		if (ce->mode == CACHE_MODE_WRITEBACK && !(op->flags & BACKEND_FUA)) {
			rc = pieces_build(op, true, true);
			if (rc == -ENOSPC) {
				/* No room: write through, and get writeback going. */
				pieces_release(op);
				cache_kick_writeback(ce->cache);
				rc = 0;
			} else if (rc == 0) {
				op->stage = -1;
			}
		}
		break;
	case BACKEND_FLUSH:
		writeback_flush(op);
		return;
	case BACKEND_BLOCK_STATUS:
		rc = collect_dirty_spans(op);
		if (rc < 0) {
			op_finish(op, rc);
			return;
		}
		passthrough(op);
		return;
	case BACKEND_TRIM:
	case BACKEND_ZERO:
		break;
	}
	if (rc < 0) {
		pieces_release(op);
		op_finish(op, rc);
		return;
	}
	op_run(op);
}

bool cache_op_segment(const struct cache_op *op, size_t i, const uint8_t **data, size_t *len,
		      bool *may_hold_zeros)
{
	if (i >= op->npieces)
		return false;
	const struct cache_piece *p = &op->pieces[i];
	if (p->entry) {
		*data = arena_address(&op->ce->cache->arena, p->entry->frame) +
			(size_t)(p->offset - cache_entry_offset(p->entry));
		*may_hold_zeros = p->entry->may_hold_zeros;
	} else {
		*data = p->buf;
		*may_hold_zeros = true;
	}
	*len = p->length;
	return true;
}

void cache_op_release(struct cache_op *op)
{
	pieces_release(op);
}
