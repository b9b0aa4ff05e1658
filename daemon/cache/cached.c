/*
 * daemon/cache/cached.c: READ, CACHE and cached WRITE (the operations
 * layer, ops.h).
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
 * A WRITE that finds no room for every piece, and every WRITE not in
 * writeback mode or with FUA, is a direct operation instead (direct.c).
 *
 * Received into the arena: cached_receive.c.
 *
 * Any other WRITE is read into a buffer of its own and committed as above.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"
#include "daemon/log.h"

#define CACHE_PREFETCH_MAX (32u << 20)

struct cache_fill {
	struct backend_io io;
	struct cache_op *op;
	struct cache_piece *piece;
	uint32_t first, count;
	uint32_t invalidations;
	bool ahead; /* reads ahead of the request: a failure retries without */
	bool level2; /* read from the cache device's level-2 cache, not the backend */
	bool unproven; /* sent while cache_fill_unproven (struct cache_entry) */
};

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
 * time that scan would hold the worker for seconds. A WRITE's entries get
 * their side records reserved on the way. Returns 0, -ENOMEM, or -ENOSPC
 * when a WRITE could not get room, or memory for a side record, for every
 * piece (the caller goes direct).
 */
static bool range_uptodate(struct cache_entry *e, uint64_t offset, uint64_t length);

int pieces_build(struct cache_op *op, bool allocate, bool need_all)
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
		/* A WRITE's blocks get their side records now, before any byte
		 * lands (cache_entry_ext_reserve): marking them dirty must not
		 * fail later. Without memory for one there is no room either. */
		if (e && op->cmd == BACKEND_WRITE && cache_entry_ext_reserve(ce, e) < 0) {
			pthread_mutex_unlock(&sh->lock);
			static _Atomic uint64_t logged_ns;
			if (log_due(&logged_ns, 1000000000u))
				log_error("cache: no memory for the state of dirty blocks: "
					  "writes go to the backend directly meanwhile");
			return -ENOSPC;
		}
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

void pieces_release(struct cache_op *op)
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

/* Dirty data above a high watermark (the export's or the cache's): get
 * writeback going. */
void kick_if_above_high(struct cache_export *ce)
{
	struct cache *c = ce->cache;
	if (atomic_load(&c->counters.dirty_bytes) > c->dirty_high ||
	    atomic_load(&ce->counters.dirty_bytes) > atomic_load(&ce->dirty_high))
		cache_kick_writeback(c);
}

/* The blocks of piece p's entry it covers, and its shard, locked. */
struct cache_shard *piece_lock(struct cache_export *ce, const struct cache_piece *p,
				      uint32_t *first, uint32_t *last)
{
	piece_blocks(p->entry, p->offset, p->length, first, last);
	struct cache_shard *sh = shard_of(ce, p->offset);
	pthread_mutex_lock(&sh->lock);
	return sh;
}

/* Give back the side records pieces_build() reserved for a WRITE's pieces
 * [0, n) that turned out not to be needed (they stay where blocks are
 * dirty or unstable). */
void pieces_unreserve(struct cache_op *op, size_t n)
{
	struct cache_export *ce = op->ce;
	for (size_t i = 0; i < n; i++) {
		struct cache_piece *p = &op->pieces[i];
		if (!p->entry)
			continue;
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		cache_entry_ext_unreserve(ce, p->entry);
		pthread_mutex_unlock(&sh->lock);
	}
}

/* Is every block of e that [offset, offset+length) touches uptodate?
 * Shard lock held. */
static bool range_uptodate(struct cache_entry *e, uint64_t offset, uint64_t length)
{
	uint32_t first, last;
	piece_blocks(e, offset, length, &first, &last);
	struct cache_map uptodate = cache_uptodate_map(e);
	for (uint32_t b = first; b <= last; b++)
		if (!map_test(uptodate, b))
			return false;
	return true;
}

/* A fill's whole 4 KiB pages inside the export, to the level-2 cache
 * (shard lock held). */
static void offer_fill(struct cache_export *ce, struct cache_entry *e, uint32_t first,
		       uint32_t count, const void *buf)
{
	uint64_t start, end;
	block_range(e, first, &start, &end);
	uint64_t length = (uint64_t)count << ce->block_shift;
	uint64_t size = atomic_load(&ce->size);
	if (start % ARENA_FRAME_SIZE || length % ARENA_FRAME_SIZE || start >= size)
		return;
	if (length > size - start)
		length = (size - start) / ARENA_FRAME_SIZE * ARENA_FRAME_SIZE;
	if (length && ce->l2_policy != CACHE_L2_OFF && cache_device_l2_on(ce->cache->device))
		cache_device_l2_store(ce->cache->device, ce->device_slot, start, buf, length);
}

static void fill_done(struct backend_io *io, int result)
{
	struct cache_fill *f = (struct cache_fill *)io;
	struct cache_op *op = f->op;
	struct cache_entry *e = f->piece->entry;
	struct cache_export *ce = op->ce;
	struct cache_shard *sh = shard_of(ce, cache_entry_offset(e));
	if (!f->level2 && io->worker) {
		cache_backend_timed(ce, io);
		if (result >= 0 && ce->cache->device && io->length <= CACHE_DEVICE_SMALL_READ)
			cache_device_cost_note(&ce->small_fill_ns, clock_now_ns() - io->submit_ns);
	}
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
	struct cache_map busy = cache_busy_map(e), uptodate = cache_uptodate_map(e);
	bool keep = result >= 0 && e->invalidations == f->invalidations;
	if (keep && zeros)
		cache_entry_set_may_hold_zeros(e);
	if (keep && f->unproven)
		e->unproven = 1;
	for (uint32_t b = f->first; b < f->first + f->count; b++) {
		map_clear(busy, b);
		if (keep)
			map_set(uptodate, b);
	}
	/* What the backend gave goes to the level-2 cache now, not only when
	 * evicted: a crash loses RAM, not the device (under the shard lock, so
	 * a write's invalidation comes after it). */
	if (keep && !f->level2 && !f->unproven && ce->cache->device)
		offer_fill(ce, e, f->first, f->count, io->buf);
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
	DCHECK(op->pending > 0);
	if (--op->pending == 0)
		op_run(op);
}

/*
 * A direct step registered over the range (direct.c): between its backend
 * write and its last removal of the range from the level-2 cache, the
 * area may hold the bytes from before it (an entry evicted meanwhile), so
 * a fill there reads the backend.
 */
static bool direct_over(struct cache_export *ce, uint64_t offset, uint64_t length)
{
	pthread_mutex_lock(&ce->lock);
	bool over = cache_direct_overlaps(ce, offset, length);
	pthread_mutex_unlock(&ce->lock);
	return over;
}

/*
 * Is the level-2 cache worth asking for this fill? Not for a small one
 * while the backend answers small fills more than twice as fast as the
 * device (a file in the page cache, a fast array; the margin and the
 * averages of 32 keep a device's passing stall, a flush ahead of its
 * reads, from sending fills to a slow backend). Either way a few go the
 * other way, so that both figures stay current: one in 32 to the device
 * while the backend is faster, one in 256 to the backend while it is not
 * (or either has not been timed yet).
 */
static bool level2_worth(struct cache_export *ce, struct cache_device *d, uint64_t length)
{
	if (ce->l2_policy != CACHE_L2_AUTO)
		return ce->l2_policy == CACHE_L2_ON;
	if (length > CACHE_DEVICE_SMALL_READ)
		return true;
	uint64_t backend = atomic_load_explicit(&ce->small_fill_ns, memory_order_relaxed);
	uint64_t device = cache_device_l2_small_read_ns(d);
	unsigned n = atomic_fetch_add_explicit(&ce->level2_weighed, 1, memory_order_relaxed);
	bool backend_faster = backend && device && device / 2 > backend;
	bool worth = backend_faster ? n % 32 == 0 : n % 256 != 0;
	if (!worth)
		cache_device_l2_skipped(d);
	return worth;
}

/* A fill from the level-2 cache: a failure (a page rewritten meanwhile,
 * the device's error) reads the backend instead. */
static void level2_done(struct backend_io *io, int result)
{
	struct cache_fill *f = (struct cache_fill *)io;
	if (result < 0) {
		struct cache_export *ce = f->op->ce;
		f->level2 = false;
		f->io.done = fill_done;
		f->unproven = cache_fill_unproven(ce);
		atomic_fetch_add(&ce->counters.backend_reads, 1);
		atomic_fetch_add(&ce->counters.backend_read_bytes, f->io.length);
		cache_backend_submit(ce, f->op->worker, &f->io);
		return;
	}
	fill_done(io, result);
}

static void bypass_done(struct backend_io *io, int result)
{
	struct cache_fill *f = (struct cache_fill *)io;
	struct cache_op *op = f->op;
	cache_backend_timed(op->ce, io);
	if (result < 0) {
		if (!op->error)
			op->error = result;
	} else {
		f->piece->ready = true;
	}
	free(f);
	DCHECK(op->pending > 0);
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
	uint64_t size = ce->size; /* once: a resize may move it */
	if (offset >= size)
		length = 0;
	else if (offset + length > size)
		length = size - offset;
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
	op->read_missed = true;
	if (!length) {
		/* Wholly past an end a resize moved meanwhile: zeros, no I/O
		 * (a backend read of nothing is an error), nothing timed. */
		f->io.worker = NULL;
		done(&f->io, 0);
		return 0;
	}
	struct cache_device *d = ce->cache->device;
	if (done == fill_done && d && cache_device_l2_on(d) && !direct_over(ce, offset, length) &&
	    level2_worth(ce, d, length)) {
		f->level2 = true;
		f->io.done = level2_done;
		f->io.worker = op->worker;
		if (cache_device_l2_read(d, ce->device_slot, op->worker, &f->io))
			return 0;
		f->level2 = false;
		f->io.done = done;
	}
	f->unproven = cache_fill_unproven(ce);
	atomic_fetch_add(&ce->counters.backend_reads, 1);
	atomic_fetch_add(&ce->counters.backend_read_bytes, length);
	cache_backend_submit(ce, op->worker, &f->io);
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
	struct cache_map uptodate = cache_uptodate_map(e), busy = cache_busy_map(e);
	bool blocked = false, missing = false;
	uint32_t fill_last =
		op->readahead && op->cmd == BACKEND_READ ? cache_entry_nblocks(e) - 1 : last;
	const struct cache_export *ece = cache_entry_export(e);
	uint64_t size = ece->size, at = cache_entry_offset(e); /* once: a resize moves it */
	uint64_t end_block = size > at ? (size - at + ece->block_size - 1) >> ece->block_shift : 0;
	if (fill_last >= end_block)
		fill_last =
		    end_block == 0 || last > end_block - 1 ? last : (uint32_t)(end_block - 1);
	*nruns = 0;
	for (uint32_t b = first; b <= fill_last; b++) {
		if (b > last) { /* readahead: never waits, never counts as missing */
			if (map_test(uptodate, b) || map_test(busy, b)) {
				continue;
			}
			map_set(busy, b);
			run_append(runs, nruns, b);
			runs[*nruns - 1].ahead = true;
			continue;
		}
		if (map_test(uptodate, b)) {
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
		if (map_test(busy, b)) {
			blocked = true;
			continue;
		}
		map_set(busy, b);
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
		uint32_t nblocks_max = cache_entry_nblocks(e);
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
					map_clear(cache_busy_map(e), b);
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
		if (all_ready && op->npieces) {
			atomic_fetch_add(&k->hits, 1);
		} else {
			op->read_missed = true; /* waited for a fill, maybe another op's */
			if (any_cached)
				atomic_fetch_add(&k->partial_hits, 1);
			else
				atomic_fetch_add(&k->misses, 1);
		}
	}
	return 0;
}

void piece_commit(struct cache_export *ce, struct cache_shard *sh, struct cache_piece *p,
		  uint32_t first, uint32_t last)
{
	struct cache_entry *e = p->entry;
	struct cache_map uptodate = cache_uptodate_map(e), busy = cache_busy_map(e);
	for (uint32_t b = first; b <= last; b++) {
		map_clear(busy, b);
		map_set(uptodate, b);
	}
	cache_mark_dirty(e, first, last - first + 1);
	cache_entry_set_may_hold_zeros(e); /* not worth scanning the payload */
	pthread_mutex_unlock(&sh->lock);
	cache_waitq_wake(ce->cache);
	cache_entry_unpin(e);
	p->entry = NULL;
}

/*
 * A resize cut the export below this WRITE's end after it was admitted
 * (op_submit, cache_write_begin checked the old size). Asked once its
 * pieces hold their entries, and before the first byte lands: the resize
 * moves the size before it drops what is cached past the new end, under
 * the shard locks, so either it met these entries pinned (and was refused,
 * the size moved back) or they were made after it passed, and the size
 * read here, after making them, is the new one. So no dirty byte lands
 * past an end. The WRITE gets the resize extension's ENOSPC (also when
 * the cut was refused meanwhile: it raced one).
 */
bool write_past_end(const struct cache_op *op)
{
	uint64_t size = atomic_load(&op->ce->size);
	return op->offset > size || op->length > size - op->offset;
}

/*
 * WRITE: copy the payload into every piece and mark it dirty. The blocks
 * are marked busy while the copy runs without the lock, so no fill can
 * start under it. Returns false if some piece must wait or be examined
 * again (a partial block lost its uptodate bit, or another op is busy), or
 * if a piece's side record cannot be had (*nomem: the WRITE fails).
 */
static bool write_commit(struct cache_op *op, bool *blocked, bool *nomem)
{
	struct cache_export *ce = op->ce;
	*blocked = false;
	*nomem = false;
	for (size_t i = 0; i < op->npieces; i++) {
		struct cache_piece *p = &op->pieces[i];
		if (!p->ready)
			continue; /* committed already (ready cleared) or not yet examined */
		struct cache_entry *e = p->entry;
		uint32_t first, last;
		struct cache_shard *sh = piece_lock(ce, p, &first, &last);
		struct cache_map uptodate = cache_uptodate_map(e), busy = cache_busy_map(e);
		/* Reserved by cached_write_room(); a piece examined again since
		 * may have a new entry. Without one the WRITE fails here, before
		 * this piece's bytes land. */
		if (cache_entry_ext_reserve(ce, e) < 0) {
			pthread_mutex_unlock(&sh->lock);
			*nomem = true;
			return false;
		}
		bool ok = true;
		for (uint32_t b = first; b <= last && ok; b++) {
			uint64_t bs, be;
			block_range(e, b, &bs, &be);
			bool full = p->offset <= bs && p->offset + p->length >= be;
			if (map_test(busy, b)) {
				ok = false;
				*blocked = true;
			} else if (!full && !map_test(uptodate, b)) {
				ok = false;
				p->ready = false; /* examine again: fill it */
			}
		}
		if (!ok) {
			pthread_mutex_unlock(&sh->lock);
			continue;
		}
		for (uint32_t b = first; b <= last; b++)
			map_set(busy, b);
		uint8_t *dst = arena_address(&ce->cache->arena, e->frame) +
			       (size_t)(p->offset - cache_entry_offset(e));
		pthread_mutex_unlock(&sh->lock);
		memcpy(dst, op->payload + (p->offset - op->offset), p->length);
		pthread_mutex_lock(&sh->lock);
		piece_commit(ce, sh, p, first, last);
		p->ready = false;
		p->issued = true; /* done: a NULL entry that is issued is committed */
	}
	for (size_t i = 0; i < op->npieces; i++)
		if (op->pieces[i].entry)
			return false;
	return true;
}

/* One step of a READ, CACHE or cached WRITE. */
void cached_step(struct cache_op *op)
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
		bool nomem;
		if (write_past_end(op)) {
			pieces_unreserve(op, op->npieces);
			pieces_release(op);
			op_finish(op, -ENOSPC);
			return;
		}
		if (!write_commit(op, &blocked, &nomem)) {
			if (nomem) {
				pieces_release(op);
				op_finish(op, -ENOMEM);
			} else if (blocked)
				op_wait(op, seq);
			else
				op->rerun = true;
			return;
		}
		kick_if_above_high(op->ce);
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

int cached_write_room(struct cache_op *op)
{
	int rc = pieces_build(op, true, true);
	if (rc == -ENOSPC) {
		/* No room: write through, and get writeback going. */
		pieces_unreserve(op, op->npieces);
		pieces_release(op);
		cache_kick_writeback(op->ce->cache);
		rc = 0;
	} else if (rc == 0) {
		op->stage = -1;
	}
	return rc;
}

int cached_prepare(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	int rc = 0;
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
		/* Above the high watermark it waits for writeback first (throttle.c). */
		if (ce->mode == CACHE_MODE_WRITEBACK && !(op->flags & BACKEND_FUA) &&
		    !throttle_write(op))
			rc = cached_write_room(op);
		break;
	default:
		break;
	}
	return rc;
}

bool cache_op_segment(const struct cache_op *op, size_t i, const uint8_t **data, size_t *len,
		      bool *may_hold_zeros)
{
	if (i >= op->npieces) {
		if (i > 0 || !op->own_data)
			return false;
		/* Mode none: no pieces, the backend read into the op's buffer. */
		*data = op->own_data;
		*len = (size_t)op->length;
		*may_hold_zeros = true;
		return true;
	}
	const struct cache_piece *p = &op->pieces[i];
	if (p->swap) { /* a whole entry's payload, into fresh frames */
		*data = arena_address(&op->ce->cache->arena, p->fresh);
		*may_hold_zeros = true;
	} else if (p->entry) {
		*data = arena_address(&op->ce->cache->arena, p->entry->frame) +
			(size_t)(p->offset - cache_entry_offset(p->entry));
		*may_hold_zeros = cache_entry_may_hold_zeros(p->entry);
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
	if (op->own_data) {
		free(op->own_data);
		op->own_data = NULL;
	}
}
