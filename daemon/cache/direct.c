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
 * A TRIM or WRITE_ZEROES may name up to 2^63 bytes (extended headers),
 * which a backend can take hours or forever over (an NBD server takes 4
 * GiB at a time: 2^31 requests). So a direct operation goes in steps, the
 * four stages above once per step, each step a range of its own:
 *
 *   [ done: zeros in the backend and the cache | step | not yet touched ]
 *     offset                          step_offset  +step_length      end
 *
 * Only the step in flight is registered: writeback and FLUSH rounds wait
 * for one step at most, never for the whole operation, and dirty blocks
 * ahead of it are written back meanwhile (the step that reaches them
 * waits for that writeback, then zeroes). A step ends on a 2 MiB boundary
 * (no entry is cut between two steps) and aims at DIRECT_STEP_TARGET_NS
 * of backend time: its length doubles after a quicker step and halves
 * after a slower one, between DIRECT_STEP_MIN and step_max(), and the
 * export's next operation starts at the length its last step settled on
 * (ce->direct_step_bytes). Each step is applied before the next is sent,
 * and the next is started from the event loop (a backend that completes
 * inline cannot keep the worker). When nobody waits for the reply any
 * more (op->cancel: the client has gone, the server stops) the operation
 * ends before its next step, or before its first, with -ESHUTDOWN
 * (step_cancelled): it was never acknowledged, and
 * the protocol leaves the range of a failed TRIM or WRITE_ZEROES
 * unspecified. A WRITE is one step (its payload is bounded by the maximum
 * payload).
 *
 * Durability, per step: each step is a backend write of its own
 * (backend_writes_done, so a flush sent after it covers it, and the
 * cached blocks it touched are unstable with its sequence); the operation
 * counts as one direct write (direct_writes_done) only when it succeeds,
 * just before it is acknowledged, and if the backend's loss_seq moved at
 * any time since its first step, the export's error_seq moves then too
 * (a step done before a lost connection may be gone).
 *
 * In mode none nothing is cached, so there is nothing to order against or
 * to apply: passthrough_start() sends READ, WRITE, CACHE and BLOCK_STATUS
 * to the backend as they are, a READ into a buffer the op owns, and a
 * write that succeeded (FUA aside) is only counted as not durable yet;
 * TRIM and WRITE_ZEROES go in steps as in the other modes.
 */
#include <errno.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"
#include "daemon/log.h"

/* A step's length: it never cuts an index range (2 MiB), so no entry. */
#define DIRECT_STEP_MIN (1ull << CACHE_RANGE_SHIFT)
#define DIRECT_STEP_FIRST (64ull << 20)
/* The largest step: an NBD backend's whole window of its largest chunks
 * (16 of 4 GiB); a backend that takes any range in one request (a file's
 * fallocate, instant where nothing is allocated) up to 2^62, so that a
 * WRITE_ZEROES of 2^63 bytes over a sparse file takes a few dozen steps,
 * not 2^27. A step doubles only after one under half the target, so a
 * backend whose time grows with the range stays near the target. */
#define DIRECT_STEP_MAX_CHUNKS 16
#define DIRECT_STEP_MAX_ANY (1ull << 62)

static uint64_t step_max(const struct cache_export *ce)
{
	uint64_t r = ce->backend->max_range;
	return r && r <= DIRECT_STEP_MAX_ANY / DIRECT_STEP_MAX_CHUNKS ? r * DIRECT_STEP_MAX_CHUNKS
								      : DIRECT_STEP_MAX_ANY;
}
/* What a step aims at: how long a stop (a client gone, SIGTERM) may wait. */
#define DIRECT_STEP_TARGET_NS 100000000ull

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
		if (d->step_offset < offset + length && offset < d->step_offset + d->step_length)
			return true;
	return false;
}

const struct cache_op *cache_direct_logged_first(struct cache_export *ce, uint64_t offset,
						  uint64_t length)
{
	const struct cache_op *first = NULL;
	for (const struct cache_op *d = ce->direct; d; d = d->direct_next)
		if (d->step_logged && d->step_offset < offset + length &&
		    offset < d->step_offset + d->step_length &&
		    (!first || d->step_offset < first->step_offset))
			first = d;
	return first;
}

static void find_writeback(struct cache_entry *e, void *arg)
{
	if (cache_entry_writeback(e))
		*(bool *)arg = true;
}

int cache_range_writing(struct cache_export *ce, uint64_t offset, uint64_t length, bool *writing)
{
	*writing = false;
	return length ? cache_for_each_entry(ce, offset, length, find_writeback, writing) : 0;
}

void cache_direct_unlink(struct cache_export *ce, struct cache_op *op)
{
	pthread_mutex_lock(&ce->lock);
	struct cache_op **pp = &ce->direct;
	while (*pp != op)
		pp = &(*pp)->direct_next;
	*pp = op->direct_next;
	pthread_mutex_unlock(&ce->lock);
	cache_waitq_wake(ce->cache);
}

/* Apply a finished step of a direct operation to one entry (shard lock
 * held). */
static void direct_apply(struct cache_entry *e, void *arg)
{
	struct cache_op *op = arg;
	struct cache_export *ce = op->ce;
	bool ok = !op->error;
	uint64_t base = cache_entry_offset(e);
	uint64_t a = op->step_offset > base ? op->step_offset : base;
	uint64_t b = op->step_offset + op->step_length;
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
	uint64_t pos = op->step_offset, end = op->step_offset + op->step_length;
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
	cache_direct_unlink(op->ce, op);
	op->registered = false;
}

static void direct_done(struct backend_io *io, int result)
{
	struct cache_op *op = (struct cache_op *)((char *)io - offsetof(struct cache_op, io));
	struct cache_export *ce = op->ce;
	cache_backend_timed(ce, io);
	op->write_seq = 0;
	op->maybe_lost = false;
	if (result < 0) {
		op->error = result;
	} else if (!(op->flags & BACKEND_FUA)) {
		/* Done on the backend, not durable until a backend flush
		 * (cache.h). */
		op->write_seq = atomic_fetch_add(&ce->backend_writes_done, 1) + 1;
		cache_note_direct_seq(ce, op->write_seq);
		/* A connection was lost meanwhile: the server may have lost
		 * this step, and a flush round may have acted on the loss
		 * before it was counted. What the cache holds of it is written
		 * again (direct_apply); the rest is reported when the
		 * operation is acknowledged (direct_end). */
		op->maybe_lost = atomic_load(&ce->backend->loss_seq) != op->loss_at_submit;
	}
	op->stage = 3;
	op->pending--;
	op_run(op);
}

/*
 * With a cache device: the step joins the intent log (device.h) before
 * it is applied and while its range is registered, so that the log has
 * it in the order the cache changed: a FLUSH round copies the blocks it
 * touched only once it is applied (it waits for a registered range), a
 * record of them copied before is older than this one. Until it is
 * applied the cache holds the bytes from before it there: step_logged
 * (set first) keeps a flush's records of them (flush_log_clean) from
 * landing after this one, where a replay would put them back over it.
 */
static void step_log(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	struct cache_device *d = ce->cache->device;
	if (!d || ce->device_slot < 0)
		return;
	pthread_mutex_lock(&ce->lock);
	op->step_logged = true;
	pthread_mutex_unlock(&ce->lock);
	unsigned type = op->cmd == BACKEND_WRITE  ? DEVFMT_EXTENT_DATA
			: op->cmd == BACKEND_TRIM ? DEVFMT_EXTENT_TRIM
						  : DEVFMT_EXTENT_ZERO;
	const void *data =
	    op->cmd == BACKEND_WRITE ? op->payload + (op->step_offset - op->offset) : NULL;
	uint64_t rec =
	    cache_device_append(d, ce->device_slot, type, op->step_offset, op->step_length, data);
	if (rec)
		op->device_rec = rec;
}

static void device_wait_done(struct worker_task *task)
{
	struct cache_op *op =
	    (struct cache_op *)((char *)task - offsetof(struct cache_op, device_wait.task));
	/* An error: the device failed and could not be emptied (voided): a
	 * start may replay older records over what this wrote. */
	op_finish(op, op->device_wait.result < 0 ? op->device_wait.result : op->error);
}

/*
 * The operation succeeded or failed as a whole, and is answered now. A
 * success (FUA aside) is one direct write not durable yet, and its loss,
 * if the backend may have lost writes since its first step, is reported
 * to every connection's next FLUSH.
 */
static void direct_end(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	if (!op->error && !(op->flags & BACKEND_FUA)) {
		atomic_fetch_add(&ce->direct_writes_done, 1);
		/* (kept steps are written again instead: direct_shadow.c) */
		if (atomic_load(&ce->backend->loss_seq) != op->loss_at_start &&
		    !cache_shadow_kept(ce)) {
			pthread_mutex_lock(&ce->lock);
			ce->error_seq++;
			pthread_mutex_unlock(&ce->lock);
		}
	}
	/* FUA: durable on the backend, and its records on the cache device
	 * (a replay must not put older data back over it); with no record
	 * (the device failed), once the log is emptied on the device. */
	if (!op->error && (op->flags & BACKEND_FUA) && ce->cache->device &&
	    ce->device_slot >= 0 && !ce->backend->shared) {
		op->device_wait.rec = op->device_rec;
		op->device_wait.fallback = false;
		op->device_wait.checkpoint = false;
		op->device_wait.worker = op->worker;
		op->device_wait.task.run = device_wait_done;
		cache_device_wait(ce->cache->device, &op->device_wait);
		return;
	}
	op_finish(op, op->error);
}

/* The step starting at op->step_offset: at most step_bytes, ending on an
 * index range boundary unless it ends the operation. */
static void step_choose(struct cache_op *op)
{
	uint64_t n = op->offset + op->length - op->step_offset;
	if (op->cmd != BACKEND_WRITE && n > op->step_bytes) {
		uint64_t stop = (op->step_offset + op->step_bytes) & ~(DIRECT_STEP_MIN - 1);
		n = stop - op->step_offset; /* > 0: step_bytes >= DIRECT_STEP_MIN */
	}
	op->step_length = n;
}

/* The step is applied and unregistered: the next one, or the end. */
static void step_next(struct cache_op *op)
{
	uint64_t took = clock_now_ns() - op->step_sent_ns;
	if (op->cmd != BACKEND_WRITE && op->step_length == op->step_bytes) {
		/* A whole step: what it took says what the next may cover. */
		if (took < DIRECT_STEP_TARGET_NS / 2 && op->step_bytes < step_max(op->ce))
			op->step_bytes *= 2;
		else if (took > DIRECT_STEP_TARGET_NS && op->step_bytes > DIRECT_STEP_MIN)
			op->step_bytes /= 2;
		atomic_store_explicit(&op->ce->direct_step_bytes, op->step_bytes,
				      memory_order_relaxed);
	}
	op->step_offset += op->step_length;
	if (op->error || op->step_offset == op->offset + op->length) {
		direct_end(op);
		return;
	}
	op->stage = 0;
	worker_post(op->worker, &op->waiter.task); /* runs op_task: op_run */
}

/* A TRIM or WRITE_ZEROES nobody waits for any more: it ends before its
 * next step (the first one too) with -ESHUTDOWN. A WRITE is one step. */
static bool step_cancelled(struct cache_op *op)
{
	if (op->cmd == BACKEND_WRITE || !op->cancel || !*op->cancel)
		return false;
	log_debug("cache: %s of %llu bytes at %llu stopped after %llu bytes: nobody waits for "
		  "its reply",
		  op->cmd == BACKEND_TRIM ? "TRIM" : "WRITE_ZEROES", (unsigned long long)op->length,
		  (unsigned long long)op->offset,
		  (unsigned long long)(op->step_bytes ? op->step_offset - op->offset : 0));
	op_finish(op, -ESHUTDOWN);
	return true;
}

void direct_step(struct cache_op *op)
{
	struct cache_export *ce = op->ce;
	struct cache *c = ce->cache;
	if (op->pending)
		return;
	uint64_t seq = cache_waitq_seq(c);
	switch (op->stage) {
	case 0: /* register the step's range (the first step: the op's start) */
		if (step_cancelled(op))
			return;
		if (!op->step_bytes) {
			uint64_t learned =
			    atomic_load_explicit(&ce->direct_step_bytes, memory_order_relaxed);
			op->step_offset = op->offset;
			op->step_bytes = learned ? learned : DIRECT_STEP_FIRST;
			op->loss_at_start = atomic_load(&ce->backend->loss_seq);
		}
		step_choose(op);
		pthread_mutex_lock(&ce->lock);
		if (cache_direct_overlaps(ce, op->step_offset, op->step_length)) {
			pthread_mutex_unlock(&ce->lock);
			op_wait(op, seq);
			return;
		}
		op->step_logged = false;
		op->direct_next = ce->direct;
		ce->direct = op;
		pthread_mutex_unlock(&ce->lock);
		op->registered = true;
		op->stage = 1;
		/* fall through */
	case 1: { /* no writeback in flight over the step */
		bool writing;
		int rc = cache_range_writing(ce, op->step_offset, op->step_length, &writing);
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
		op->io.offset = op->step_offset;
		op->io.length = op->step_length;
		op->io.buf = (void *)op->payload; /* a WRITE is one step */
		op->io.done = direct_done;
		op->io.cmd = op->cmd;
		op->io.flags = op->flags;
		op->pending = 1;
		op->loss_at_submit = atomic_load(&ce->backend->loss_seq);
		op->step_sent_ns = clock_now_ns();
		if (op->cmd == BACKEND_WRITE) {
			atomic_fetch_add(&ce->counters.backend_writes, 1);
			atomic_fetch_add(&ce->counters.backend_write_bytes, op->length);
			atomic_fetch_add(&ce->counters.direct_writes, 1);
		}
		/* The range leaves the level-2 cache and its map on the device
		 * before the backend's bytes change (ended in stage 3). */
		if (op->step_length && c->device)
			cache_device_l2_direct_begin(c->device, ce->device_slot, op->step_offset,
						     op->step_length);
		cache_backend_submit(ce, op->worker, &op->io);
		return;
	}
	case 3: /* apply the step to the cache */
		if (op->step_length && !op->error)
			step_log(op);
		/* Kept until a backend flush covers it, written again after a
		 * loss (direct_shadow.c); before it is applied and unregistered,
		 * so that steps over one range are kept in the order they
		 * changed the backend. */
		if (op->step_length && !op->error && op->write_seq && cache_shadow_kept(ce))
			cache_shadow_add(ce, op->cmd, op->flags, op->step_offset, op->step_length,
					 op->cmd == BACKEND_WRITE
					     ? op->payload + (op->step_offset - op->offset)
					     : NULL,
					 op->write_seq,
					 atomic_load(&ce->backend->loss_seq) != op->loss_at_submit);
		/* The level-2 cache's copies (and those an eviction staged while
		 * the backend wrote) are older than the backend's bytes now. */
		if (op->step_length && c->device)
			cache_device_l2_invalidate(c->device, ce->device_slot, op->step_offset,
						   op->step_length);
		if (op->step_length) {
			if (!op->error && op->cmd == BACKEND_WRITE &&
			    ce->mode == CACHE_MODE_WRITETHROUGH) {
				direct_populate(op);
			} else if (cache_for_each_entry(ce, op->step_offset, op->step_length,
							direct_apply, op) < 0) {
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
			/* Again: an entry evicted before the walk reached it was
			 * staged with the bytes from before. */
			if (c->device)
				cache_device_l2_direct_end(c->device, ce->device_slot,
							   op->step_offset, op->step_length);
		}
		direct_unregister(op);
		step_next(op);
		return;
	}
}

static void passthrough_done(struct backend_io *io, int result)
{
	struct cache_op *op = (struct cache_op *)((char *)io - offsetof(struct cache_op, io));
	cache_backend_timed(op->ce, io);
	op->n_extents = io->n_extents;
	if (result >= 0 && !(io->flags & BACKEND_FUA) && io->cmd == BACKEND_WRITE)
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
	if (op->cmd == BACKEND_READ)
		op->read_missed = true;
	/* Mode none caches nothing, but the level-2 cache may hold pages from
	 * before a reload set it. */
	struct cache_device *d = op->ce->cache->device;
	if (d && op->cmd == BACKEND_WRITE)
		cache_device_l2_remove(d, op->ce->device_slot, op->offset, op->length);
	cache_backend_submit(op->ce, op->worker, io);
}
