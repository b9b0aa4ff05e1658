/*
 * daemon/cache/direct.c: direct operations and their ordering (the
 * operations layer, ops.h).
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
 *
 * In mode none nothing is cached, so there is nothing to order against or
 * to apply: passthrough_start() sends every command but FLUSH to the
 * backend as it is, a READ into a buffer the op owns, and a write that
 * succeeded (FUA aside) is only counted as not durable yet.
 */
#include <errno.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"
#include "daemon/log.h"

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

static void find_writeback(struct cache_entry *e, void *arg)
{
	if (cache_entry_writeback(e))
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
	struct cache_map uptodate = cache_uptodate_map(e), dirty = cache_dirty_map(e),
			 busy = cache_busy_map(e);
	uint8_t *mem = arena_address(&ce->cache->arena, e->frame);
	bool populate = ok && op->cmd == BACKEND_WRITE && ce->mode == CACHE_MODE_WRITETHROUGH;
	/* A cached copy of what was written stays unstable until a flush
	 * covers it (below), which takes a side record: without memory for
	 * one it is forgotten instead, and the backend's bytes are the ones. */
	if (ok && (op->write_seq || op->maybe_lost) && cache_entry_ext_reserve(ce, e) < 0) {
		for (uint32_t blk = first; blk <= last; blk++)
			if (!map_test(dirty, blk))
				map_clear(uptodate, blk);
		e->invalidations++;
		return;
	}
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
			if (map_test(uptodate, blk) && !map_test(dirty, blk)) {
				if (cache_entry_on_unstable_list(e))
					cache_mark_dirty(e, blk, 1);
				else
					map_clear(uptodate, blk);
			}
			continue;
		}
		if (op->cmd == BACKEND_TRIM && full) {
			/* The backend decides what a trimmed block reads as. */
			cache_clear_dirty(e, blk, 1);
			map_clear(uptodate, blk);
			continue;
		}
		bool up = map_test(uptodate, blk);
		if (!up && !(populate && full && !map_test(busy, blk)))
			continue;
		if (x < y) {
			if (op->cmd == BACKEND_WRITE)
				memcpy(mem + (x - base), op->payload + (x - op->offset), y - x);
			else
				memset(mem + (x - base), 0, y - x);
			touched++;
		}
		if (full) {
			map_set(uptodate, blk);
			cache_clear_dirty(e, blk, 1);
		}
		if (op->maybe_lost && x < y && map_test(uptodate, blk))
			cache_mark_dirty(e, blk, 1); /* written again: see direct_done */
	}
	e->invalidations++;
	if (ok)
		cache_entry_set_may_hold_zeros(e);
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

void direct_step(struct cache_op *op)
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
		int rc = op->length ? cache_for_each_entry(ce, op->offset, op->length, find_writeback,
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
			} else if (cache_for_each_entry(ce, op->offset, op->length, direct_apply, op) < 0) {
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

static void passthrough_done(struct backend_io *io, int result)
{
	struct cache_op *op = (struct cache_op *)((char *)io - offsetof(struct cache_op, io));
	op->n_extents = io->n_extents;
	if (result >= 0 && !(io->flags & BACKEND_FUA) &&
	    (io->cmd == BACKEND_WRITE || io->cmd == BACKEND_TRIM || io->cmd == BACKEND_ZERO))
		cache_export_note_direct_write(op->ce);
	op_finish(op, result);
}

void passthrough_start(struct cache_op *op)
{
	if (op->cmd == BACKEND_READ) {
		op->own_data = malloc(op->length ? (size_t)op->length : 1);
		if (!op->own_data) {
			op_finish(op, -ENOMEM);
			return;
		}
	}
	struct backend_io *io = &op->io;
	io->cmd = op->cmd;
	io->flags = op->flags;
	io->offset = op->offset;
	io->length = op->length;
	io->buf = op->cmd == BACKEND_READ ? op->own_data : (void *)op->payload;
	io->extents = op->extents;
	io->max_extents = op->max_extents;
	io->n_extents = 0;
	io->done = passthrough_done;
	backend_submit(op->ce->backend, op->worker, io);
}
