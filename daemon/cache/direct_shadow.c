/*
 * daemon/cache/direct_shadow.c: what a direct write put on the backend,
 * kept until a backend flush covers it, and written again after a loss
 * (ops.h, "direct shadow"; the operations layer).
 *
 * A direct write (TRIM, WRITE_ZEROES, a write around the cache or with no
 * room in it) reaches the backend first; for bytes the cache does not
 * hold, the backend's copy is the only one outside the cache device's log.
 * An NBD server that loses its connection, or a file whose fdatasync fails,
 * may drop it before a backend flush covers it; without a cache device the
 * daemon can only say so (every connection's next FLUSH gets EIO once, and
 * later FLUSHes claim nothing it could not keep). With one, the write was
 * acknowledged and logged: a later FLUSH promises it. So an export on a
 * cache device (not a shared backend) keeps each direct step, in the order
 * the steps changed the backend, until a successful backend flush sent
 * after it covers it (cache_shadow_trim); after a loss every step kept is
 * written again, in that order, before the round that acts on the loss
 * sends its flush (cache_shadow_redo, cache_shadow_busy):
 *
 *   pass   the first step to write again; wait until no direct operation
 *          is registered over its range and no writeback is in flight
 *          there; register the range (writeback and direct operations
 *          leave it alone meanwhile); write, zero or trim it; unregister;
 *          every later step over that range is written again too (so the
 *          newest lands last); the next
 *
 * What RAM holds over those ranges is newer or the same: a loss makes it
 * dirty again (lost_unflushed), and its writeback waits for the
 * registration, so it lands after. The steps live a tick or so: a
 * background round flushes direct writes not yet flushed within one
 * (writeback.c), and a FLUSH answered from the log flushes them beside
 * its commit (flush_side_start). Writeback thread, but for the appends
 * (any worker, the export lock).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/ops.h"
#include "daemon/log.h"

struct direct_shadow {
	struct direct_shadow *next;
	uint64_t seq; /* backend_writes_done after its latest write */
	uint64_t offset, length;
	enum backend_cmd cmd; /* BACKEND_WRITE, _WRITE_ZEROES, _TRIM */
	uint32_t flags;	      /* as sent, less FUA */
	bool redo;	      /* to be written again */
	uint8_t data[];	      /* WRITE: length bytes */
};

/* The pass that writes steps again (one per export, on the writeback
 * thread). */
struct shadow_pass {
	struct cache_export *ce;
	struct worker *worker;
	struct backend_io io;
	struct cache_waiter waiter;
	struct cache_op reg; /* its range registered as a direct step */
	struct direct_shadow *cur;
	bool running, registered;
	int error; /* the last pass failed: its round fails too */
};

bool cache_shadow_kept(const struct cache_export *ce)
{
	return ce->cache->device && ce->device_slot >= 0 && !ce->backend->shared;
}

static bool overlaps(const struct direct_shadow *s, uint64_t offset, uint64_t length)
{
	return s->offset < offset + length && offset < s->offset + s->length;
}

void cache_shadow_add(struct cache_export *ce, enum backend_cmd cmd, uint32_t flags,
		      uint64_t offset, uint64_t length, const void *data, uint64_t seq,
		      bool maybe_lost)
{
	size_t extra = cmd == BACKEND_WRITE ? (size_t)length : 0;
	struct direct_shadow *s = malloc(sizeof(*s) + extra);
	if (!s) {
		/* Not kept: its loss can only be reported (lost_unflushed). */
		cache_note_unshadowed(ce, seq);
		return;
	}
	s->next = NULL;
	s->seq = seq;
	s->offset = offset;
	s->length = length;
	s->cmd = cmd;
	s->flags = flags & ~(uint32_t)BACKEND_FUA;
	if (extra)
		memcpy(s->data, data, extra);
	pthread_mutex_lock(&ce->lock);
	/* A loss since it was sent: the backend may not have it (and a
	 * pass may have gone over the steps before it already). */
	s->redo = maybe_lost;
	if (ce->shadow_tail)
		ce->shadow_tail->next = s;
	else
		ce->shadow_head = s;
	ce->shadow_tail = s;
	ce->shadow_bytes += extra;
	if (maybe_lost)
		ce->shadow_redo = true;
	pthread_mutex_unlock(&ce->lock);
}

void cache_shadow_trim(struct cache_export *ce, uint64_t covered)
{
	struct direct_shadow *gone = NULL;
	pthread_mutex_lock(&ce->lock);
	struct shadow_pass *p = ce->shadow_pass;
	struct direct_shadow **pp = &ce->shadow_head, *last = NULL;
	while (*pp) {
		struct direct_shadow *s = *pp;
		if (s->seq <= covered && !s->redo && !(p && p->cur == s)) {
			*pp = s->next;
			ce->shadow_bytes -= s->cmd == BACKEND_WRITE ? s->length : 0;
			s->next = gone;
			gone = s;
		} else {
			last = s;
			pp = &s->next;
		}
	}
	ce->shadow_tail = last;
	pthread_mutex_unlock(&ce->lock);
	while (gone) {
		struct direct_shadow *next = gone->next;
		free(gone);
		gone = next;
	}
}

bool cache_shadow_redo(struct cache_export *ce)
{
	pthread_mutex_lock(&ce->lock);
	bool any = ce->shadow_head != NULL;
	for (struct direct_shadow *s = ce->shadow_head; s; s = s->next)
		s->redo = true;
	if (any)
		ce->shadow_redo = true;
	pthread_mutex_unlock(&ce->lock);
	return any;
}

static void pass_advance(struct shadow_pass *p);

static void pass_waiter_task(struct worker_task *task)
{
	struct shadow_pass *p =
	    (struct shadow_pass *)((char *)task - offsetof(struct shadow_pass, waiter.task));
	pass_advance(p);
}

static void unregister(struct shadow_pass *p)
{
	if (!p->registered)
		return;
	cache_direct_unlink(p->ce, &p->reg);
	p->registered = false;
}

static void pass_end(struct shadow_pass *p, int error)
{
	struct cache_export *ce = p->ce;
	pthread_mutex_lock(&ce->lock);
	p->running = false;
	p->cur = NULL;
	p->error = error;
	/* Steps still to write again (the pass failed, or a step added
	 * meanwhile): the next round's pass. */
	for (struct direct_shadow *s = ce->shadow_head; s; s = s->next)
		if (s->redo)
			ce->shadow_redo = true;
	pthread_mutex_unlock(&ce->lock);
	cache_waitq_wake(ce->cache);
}

/* What the cache holds over a step written again is newer, or the same
 * (a write over it was applied there): written back after it, since it
 * may have reached the backend before (shard lock held). */
struct redirty_arg {
	const struct direct_shadow *s;
	bool failed; /* no memory for a side record: the step is written again later */
};

static void redirty(struct cache_entry *e, void *arg)
{
	struct redirty_arg *a = arg;
	const struct direct_shadow *s = a->s;
	/* (the part of the step within e) */
	uint64_t base = cache_entry_offset(e), from = s->offset > base ? s->offset : base;
	uint64_t to = s->offset + s->length, end = base + cache_entry_bytes(e);
	if (to > end)
		to = end;
	if (from >= to)
		return;
	uint32_t first, last;
	piece_blocks(e, from, to - from, &first, &last);
	struct cache_map uptodate = cache_uptodate_map(e), dirty = cache_dirty_map(e);
	bool any = false;
	for (uint32_t b = first; b <= last; b++)
		if (map_test(uptodate, b) && !map_test(dirty, b)) {
			if (!any && cache_entry_ext_reserve(cache_entry_export(e), e) < 0) {
				a->failed = true;
				return;
			}
			cache_mark_dirty(e, b, 1);
			any = true;
		}
	if (any)
		cache_dirty_list_update(e);
}

static void pass_done(struct backend_io *io, int result)
{
	struct shadow_pass *p = (struct shadow_pass *)((char *)io - offsetof(struct shadow_pass, io));
	struct cache_export *ce = p->ce;
	cache_backend_timed(ce, io);
	struct direct_shadow *s = p->cur;
	if (result < 0) {
		unregister(p);
		log_error("cache: writing again what a direct write had put on the backend before "
			  "it lost it (%llu bytes at %llu): %s; FLUSH fails until it is done",
			  (unsigned long long)s->length, (unsigned long long)s->offset,
			  strerror(-result));
		pass_end(p, result);
		return;
	}
	uint64_t seq = atomic_fetch_add(&ce->backend_writes_done, 1) + 1;
	cache_note_direct_seq(ce, seq);
	/* (no memory to walk the range: the next round's pass goes over it
	 * again, and this one fails) */
	struct redirty_arg ra = {s, false};
	if (cache_for_each_entry(ce, s->offset, s->length, redirty, &ra) < 0 || ra.failed) {
		unregister(p);
		pass_end(p, -ENOMEM); /* s stays to be written again */
		return;
	}
	pthread_mutex_lock(&ce->lock);
	s->seq = seq;
	s->redo = false;
	/* The newest over its range must land last: those after it again. */
	for (struct direct_shadow *t = s->next; t; t = t->next)
		if (overlaps(t, s->offset, s->length))
			t->redo = true;
	ce->shadow_rewritten++;
	pthread_mutex_unlock(&ce->lock);
	unregister(p); /* (wakes the waiters) */
	pass_advance(p);
}

static void pass_advance(struct shadow_pass *p)
{
	struct cache_export *ce = p->ce;
	struct cache *c = ce->cache;
	for (;;) {
		uint64_t wseq = cache_waitq_seq(c);
		pthread_mutex_lock(&ce->lock);
		struct direct_shadow *s = ce->shadow_head;
		while (s && !s->redo)
			s = s->next;
		p->cur = s;
		if (!s) {
			pthread_mutex_unlock(&ce->lock);
			pass_end(p, 0);
			return;
		}
		/* A shrink since cut it off (a resize refuses only dirty and
		 * unstable blocks past the end): nothing of it past the end is
		 * written again, which would grow a file back. */
		uint64_t size = atomic_load(&ce->size);
		if (s->offset >= size) {
			s->redo = false;
			pthread_mutex_unlock(&ce->lock);
			continue;
		}
		if (s->length > size - s->offset) {
			if (s->cmd == BACKEND_WRITE)
				ce->shadow_bytes -= s->length - (size - s->offset);
			s->length = size - s->offset;
		}
		/* A direct step over it in flight: its own step is newer, and
		 * is written again after this one (pass_done). */
		if (cache_direct_overlaps(ce, s->offset, s->length)) {
			pthread_mutex_unlock(&ce->lock);
			if (cache_waitq_wait(c, &p->waiter, wseq))
				return;
			continue;
		}
		p->reg.step_offset = s->offset;
		p->reg.step_length = s->length;
		p->reg.direct_next = ce->direct;
		ce->direct = &p->reg;
		p->registered = true;
		pthread_mutex_unlock(&ce->lock);
		bool writing;
		if (cache_range_writing(ce, s->offset, s->length, &writing) < 0)
			writing = true; /* (no memory to look: again in a while) */
		if (writing) {
			unregister(p);
			if (cache_waitq_wait(c, &p->waiter, wseq))
				return;
			continue;
		}
		memset(&p->io, 0, sizeof(p->io));
		p->io.cmd = s->cmd;
		p->io.flags = s->flags;
		p->io.offset = s->offset;
		p->io.length = s->length;
		p->io.buf = s->cmd == BACKEND_WRITE ? s->data : NULL;
		p->io.done = pass_done;
		atomic_fetch_add(&ce->counters.backend_writes, s->cmd == BACKEND_WRITE);
		cache_backend_submit(ce, p->worker, &p->io);
		uring_submit(&p->worker->ring);
		return;
	}
}

int cache_shadow_busy(struct cache_export *ce, struct worker *w)
{
	pthread_mutex_lock(&ce->lock);
	struct shadow_pass *p = ce->shadow_pass;
	if (!p && ce->shadow_redo) {
		p = calloc(1, sizeof(*p));
		if (!p) {
			pthread_mutex_unlock(&ce->lock);
			return -ENOMEM;
		}
		p->ce = ce;
		ce->shadow_pass = p;
	}
	if (p && p->running) {
		pthread_mutex_unlock(&ce->lock);
		return 1;
	}
	if (p && p->error) {
		/* This round fails; the next tries again (shadow_redo). */
		int e = p->error;
		p->error = 0;
		pthread_mutex_unlock(&ce->lock);
		return e;
	}
	if (!ce->shadow_redo) {
		pthread_mutex_unlock(&ce->lock);
		return 0;
	}
	ce->shadow_redo = false;
	p->running = true;
	p->worker = w;
	p->waiter.worker = w;
	p->waiter.task.run = pass_waiter_task;
	pthread_mutex_unlock(&ce->lock);
	log_warn("cache: export %u: its backend may have lost direct writes no flush covered; "
		 "writing them again",
		 ce->id);
	pass_advance(p);
	pthread_mutex_lock(&ce->lock);
	bool running = p->running;
	int e = running ? 0 : p->error;
	if (!running)
		p->error = 0;
	pthread_mutex_unlock(&ce->lock);
	return running ? 1 : e;
}

bool cache_shadow_pending(struct cache_export *ce)
{
	pthread_mutex_lock(&ce->lock);
	bool r = ce->shadow_redo || (ce->shadow_pass && ce->shadow_pass->running);
	pthread_mutex_unlock(&ce->lock);
	return r;
}

void cache_shadow_free(struct cache_export *ce)
{
	struct direct_shadow *s = ce->shadow_head;
	while (s) {
		struct direct_shadow *next = s->next;
		free(s);
		s = next;
	}
	ce->shadow_head = ce->shadow_tail = NULL;
	ce->shadow_bytes = 0;
	free(ce->shadow_pass);
	ce->shadow_pass = NULL;
}
