/*
 * daemon/cache/flush.c: FLUSH rounds, the backend flushes that make data
 * durable, and the final flush at shutdown (the durability model: cache.h).
 *
 * A round belongs to one export and runs on the writeback thread:
 *
 *   FLUSH --post--> flush_arrive_task: join ce's waiting list
 *                   no round running? flush_round_start
 *   round  stage 0  write back every entry of the dirty list as it was at
 *                   the start (writeback_entry, at most WB_FLUSH_WINDOW
 *                   groups in flight; entries that must wait are visited
 *                   again when the cache changes)
 *          stage 1  the backend's loss_seq moved? every unstable entry is
 *                   dirty again: write again (a few times) or fail. Else
 *                   flush the backend, unless every write is covered
 *                   already; success makes clean the unstable entries
 *                   written before it was sent, failure makes them dirty
 *          stage 2  answer the round's FLUSHes; start the next round for
 *                   those that came meanwhile (group commit)
 *
 * A background round (stage 1 only) keeps unstable data short-lived; the
 * shutdown runs one round per export and retries every few seconds while
 * a backend refuses.
 */
#include <errno.h>
#include <event2/event.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cache/flush_internal.h"
#include "daemon/cache/ops.h"
#include "daemon/log.h"

#define WB_SHUTDOWN_RETRY_SECONDS 5
#define WB_FLUSH_WINDOW 64 /* writeback groups one round keeps in flight */
#define WB_LOSS_RETRIES 3  /* a round writes again after a loss this often */

static void shutdown_pass(struct writeback *wb);

/*
 * Advance every job not already waiting to be woken. A job may end (and be
 * freed) inside another's advance (completions can run inline), so the
 * walk starts over whenever one ends.
 */
void flush_advance_all(struct writeback *wb)
{
restart:;
	uint64_t ended = wb->jobs_ended;
	for (struct flush_job *job = wb->jobs; job;) {
		struct flush_job *next = job->next;
		if (!job->waiting)
			flush_advance(job);
		if (wb->jobs_ended != ended)
			goto restart;
		job = next;
	}
}

/* ---- FLUSH rounds ---- */

static void flush_reply_task(struct worker_task *task)
{
	struct cache_op *op = (struct cache_op *)((char *)task - offsetof(struct cache_op, waiter.task));
	int result = op->error < 0 ? -EIO : 0;
	if (op->seen_error) {
		/* Data the cache does not hold was lost since this connection
		 * last heard of it: said once per connection. */
		uint64_t seq = cache_export_error_seq(op->ce);
		if (*op->seen_error != seq) {
			*op->seen_error = seq;
			result = -EIO;
		}
	}
	op->done(op, result);
}

/* Answer every FLUSH of the list (op->flush_next) on its own worker. */
static void answer(struct cache_op *members, int error)
{
	for (struct cache_op *op = members, *next; op; op = next) {
		next = op->flush_next;
		op->error = error;
		op->waiter.task.run = flush_reply_task;
		worker_post(op->worker, &op->waiter.task);
	}
}

/*
 * Every unstable entry of ce (or those written before the flush that
 * covered seq) becomes clean, or, with redirty, dirty again. Writeback
 * thread; takes shard and export locks.
 */
static void unstable_settle_all(struct cache_export *ce, uint64_t seq, bool redirty)
{
	struct cache_entry **v;
	size_t n;
	if (cache_list_pin(ce, CACHE_LIST_UNSTABLE, seq, &v, &n) < 0) {
		/* Out of memory: one at a time from the head, no allocation. */
		for (unsigned guard = 0; guard < 1u << 30; guard++) {
			pthread_mutex_lock(&ce->lock);
			struct cache_entry *e = ce->unstable_head;
			if (e && cache_entry_unstable_seq(e) > seq)
				e = NULL;
			if (e)
				cache_entry_pin(e);
			pthread_mutex_unlock(&ce->lock);
			if (!e)
				return;
			struct cache_shard *sh = cache_shard_for(ce->cache, ce,
								 cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
			pthread_mutex_lock(&sh->lock);
			/* Written again (a direct write applied) since the export
			 * lock was dropped: not covered, as below. */
			if (redirty || cache_entry_unstable_seq(e) <= seq) {
				if (!redirty)
					flush_log_clean(ce, e);
				cache_unstable_settle(e, redirty);
			}
			pthread_mutex_unlock(&sh->lock);
			cache_entry_unpin(e);
		}
		return;
	}
	for (size_t i = 0; i < n; i++) {
		struct cache_entry *e = v[i];
		struct cache_shard *sh =
			cache_shard_for(ce->cache, ce, cache_entry_offset(e) >> CACHE_RANGE_SHIFT);
		pthread_mutex_lock(&sh->lock);
		/* Written back again since it was collected: not covered. */
		if (cache_entry_on_unstable_list(e) &&
		    (redirty || cache_entry_unstable_seq(e) <= seq)) {
			if (!redirty)
				flush_log_clean(ce, e);
			cache_unstable_settle(e, redirty);
		}
		pthread_mutex_unlock(&sh->lock);
		cache_entry_unpin(e);
	}
	free(v);
	if (redirty)
		cache_waitq_wake(ce->cache);
}

/*
 * The backend may have lost writes no successful flush covered (a failed
 * flush, a lost connection): what the cache holds is written again; direct
 * writes it does not hold are lost for good, which every connection's
 * next FLUSH reports (error_seq).
 */
static void lost_unflushed(struct writeback *wb, struct cache_export *ce)
{
	atomic_fetch_add(&ce->counters.losses, 1);
	unstable_settle_all(ce, UINT64_MAX, true);
	uint64_t direct = atomic_load(&ce->direct_writes_done);
	/* With a cache device the direct steps are kept: written again
	 * before the next flush (direct_shadow.c), not lost. */
	bool kept = cache_shadow_kept(ce) &&
		    atomic_load(&ce->unshadowed_seq) <= atomic_load(&ce->backend_writes_flushed);
	if (kept)
		cache_shadow_redo(ce);
	if (!kept && direct != atomic_load(&ce->direct_writes_flushed)) {
		atomic_store(&ce->direct_writes_flushed, direct);
		pthread_mutex_lock(&ce->lock);
		ce->error_seq++;
		pthread_mutex_unlock(&ce->lock);
		if (wb->stopping)
			wb->shutdown_lost++;
		log_error("cache: the backend may have lost writes that went to it directly (not "
			  "through the cache) before a flush covered them; every connection's next "
			  "FLUSH reports EIO");
	}
}

/* Take every entry on the dirty list, pinned. */
int round_snapshot(struct flush_job *job)
{
	struct cache_entry **v;
	size_t n;
	int rc = cache_list_pin(job->ce, CACHE_LIST_DIRTY, 0, &v, &n);
	if (rc < 0)
		return rc;
	free(job->entries);
	job->entries = v;
	job->n = n;
	job->cursor = job->nbusy = 0;
	return 0;
}

void round_unpin(struct flush_job *job)
{
	for (size_t i = 0; i < job->nbusy; i++)
		cache_entry_unpin(job->entries[i]);
	for (size_t i = job->cursor; i < job->n; i++)
		cache_entry_unpin(job->entries[i]);
	job->n = job->cursor = job->nbusy = 0;
}

static void device_round_done(struct worker_task *task);

void flush_job_end(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	struct cache_export *ce = job->ce;
	struct cache_device *dev = wb->cache->device;
	if (job->side_pending) {
		/* Ended by the side flush's completion (flush_side_done). */
		job->end_due = true;
		job->waiting = true; /* see below: left alone meanwhile */
		return;
	}
	if (dev && ce->device_slot >= 0 && !job->logged && !job->background && !job->error &&
	    !job->device_done && !ce->backend->shared && job->device_rec < cache_device_last(dev) &&
	    cache_device_voiding(dev) && !job->device_again) {
		/* The device failed while the round ran: records appended
		 * after it began are not covered by it, and the log can only
		 * be emptied (voided, which its FLUSHes wait for) once they
		 * are. None is appended any more: one more round covers all. */
		job->device_again = true;
		job->device_rec = cache_device_last(dev);
		round_unpin(job);
		if (round_snapshot(job) == 0) {
			job->stage = 0;
			flush_advance(job);
			return;
		}
		job->error = -ENOMEM;
	}
	if (dev && ce->device_slot >= 0 && !job->logged && !job->background && !job->error &&
	    !job->device_done && !ce->backend->shared) {
		/* (A shared backend has no records to keep from a replay.)
		 * Everything appended before the round began is on the backend
		 * now; a replay must not put any of it back over what came
		 * later: the FLUSHes are answered once the log holds, or a
		 * checkpoint dropped, every record up to there. */
		job->device_done = true;
		cache_device_covered(dev, ce->device_slot, job->device_rec);
		if (job->members) {
			round_unpin(job);
			job->dwait.rec = job->device_rec;
			job->dwait.fallback = false;
			job->dwait.checkpoint = true;
			job->dwait.worker = &wb->thread;
			job->dwait.task.run = device_round_done;
			/* flush_advance_all() must leave it alone meanwhile: it
			 * would end it again, with the wait still registered. */
			job->waiting = true;
			cache_device_wait(dev, &job->dwait);
			return;
		}
	}
	struct flush_job **pp = &wb->jobs;
	while (*pp != job)
		pp = &(*pp)->next;
	*pp = job->next;
	wb->jobs_ended++;
	ce->round = NULL;
	round_unpin(job);
	free(job->entries);
	answer(job->members, job->error);
	bool shutdown = job->shutdown;
	if (shutdown && job->error && !wb->shutdown_error)
		wb->shutdown_error = job->error;
	free(job);
	/* FLUSHes (or the shutdown) that came meanwhile: the next round. */
	if (ce->flush_waiting_head || ce->shutdown_waiting)
		flush_round_start(wb, ce, false);
	if (shutdown && --wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

static void device_round_done(struct worker_task *task)
{
	struct flush_job *job =
	    (struct flush_job *)((char *)task - offsetof(struct flush_job, dwait.task));
	/* An error: the device failed and could not be emptied (voided), so
	 * a start may replay records older than what the backend holds now:
	 * the FLUSH is not answered as a success. */
	job->waiting = false;
	if (job->dwait.result < 0 && !job->error)
		job->error = job->dwait.result;
	flush_job_end(job);
}

/*
 * A backend flush of ce came back with result: sent once `covered`
 * writes (`direct` of them direct) were done, while loss_seq was
 * loss_at_send. True: it made them durable (unstable entries clean,
 * direct steps let go). False: it failed, or a connection was lost
 * meanwhile: what no flush covered is written again (lost_unflushed).
 */
static bool flush_settled(struct writeback *wb, struct cache_export *ce, int result,
			  uint64_t loss_at_send, uint64_t covered, uint64_t direct)
{
	uint64_t loss = atomic_load(&ce->backend->loss_seq);
	if (result >= 0 && loss == loss_at_send) {
		if (covered > atomic_load(&ce->backend_writes_flushed))
			atomic_store(&ce->backend_writes_flushed, covered);
		if (direct > atomic_load(&ce->direct_writes_flushed))
			atomic_store(&ce->direct_writes_flushed, direct);
		unstable_settle_all(ce, covered, false);
		cache_shadow_trim(ce, covered);
		writeback_note_success(ce);
		return true;
	}
	if (result < 0) {
		atomic_fetch_add(&ce->counters.backend_flush_errors, 1);
		pthread_mutex_lock(&ce->lock);
		writeback_note_failure_locked(ce, result, "a backend flush");
		pthread_mutex_unlock(&ce->lock);
	}
	ce->loss_seen = loss;
	lost_unflushed(wb, ce);
	return false;
}

static void flush_side_done(struct backend_io *io, int result)
{
	struct flush_job *job = (struct flush_job *)((char *)io - offsetof(struct flush_job, side_io));
	struct cache_export *ce = job->ce;
	cache_backend_timed(ce, io);
	if (!flush_settled(job->wb, ce, result, job->side_loss, job->side_covered,
			   job->side_direct) &&
	    !job->error)
		/* The direct writes the FLUSHes cover may be gone from the
		 * backend: written again (or reported) before the next flush
		 * (lost_unflushed); these FLUSHes fail. */
		job->error = result < 0 ? result : -EIO;
	job->side_pending = false;
	if (job->end_due) {
		job->end_due = false;
		job->waiting = false;
		flush_job_end(job);
	}
}

/*
 * A log round's FLUSHes promise every write acknowledged before them,
 * direct writes too: those went to the backend, and the log's record of
 * one may be the only other copy. A backend flush beside the commit makes
 * them durable there before the FLUSHes are answered, so that no later
 * loss (a connection, an fdatasync) can take what a FLUSH acknowledged:
 * only rounds with direct writes not yet flushed pay for it.
 */
void flush_side_start(struct flush_job *job)
{
	struct cache_export *ce = job->ce;
	uint64_t direct = atomic_load(&ce->direct_writes_done);
	if (direct == atomic_load(&ce->direct_writes_flushed))
		return;
	job->side_covered = atomic_load(&ce->backend_writes_done);
	job->side_direct = direct;
	job->side_loss = atomic_load(&ce->backend->loss_seq);
	job->side_pending = true;
	atomic_fetch_add(&ce->counters.backend_flushes, 1);
	memset(&job->side_io, 0, sizeof(job->side_io));
	job->side_io.cmd = BACKEND_FLUSH;
	job->side_io.done = flush_side_done;
	cache_backend_submit(ce, &job->wb->thread, &job->side_io);
	uring_submit(&job->wb->thread.ring);
}

/* Go back to writing: a loss turned unstable data dirty again. */
static bool round_retry(struct flush_job *job)
{
	if (job->background || job->loss_retries++ >= WB_LOSS_RETRIES)
		return false;
	round_unpin(job);
	if (round_snapshot(job) < 0)
		return false;
	job->stage = 0;
	job->again = true;
	return true;
}

static void flush_backend_done(struct backend_io *io, int result)
{
	struct flush_job *job = (struct flush_job *)((char *)io - offsetof(struct flush_job, flush_io));
	struct cache_export *ce = job->ce;
	cache_backend_timed(ce, io);
	job->stage = 2;
	if (!flush_settled(job->wb, ce, result, job->loss_at_send, job->writes_covered,
			   job->direct_covered) &&
	    (result < 0 || !round_retry(job)))
		job->error = result < 0 ? result : -EIO;
	if (!job->advancing) {
		if (job->stage == 2)
			flush_job_end(job);
		else
			flush_advance(job);
	}
}

/* Stage 1: everything is written; flush the backend if anything needs it. */
static void round_flush(struct flush_job *job)
{
	struct cache_export *ce = job->ce;
	uint64_t loss = atomic_load(&ce->backend->loss_seq);
	if (loss != ce->loss_seen) {
		ce->loss_seen = loss;
		lost_unflushed(job->wb, ce);
		if (!round_retry(job)) {
			job->error = job->background ? 0 : -EIO;
			job->stage = 2;
		}
		return;
	}
	/* Direct steps the backend may have lost are written again first,
	 * so that this flush covers them (direct_shadow.c). */
	uint64_t wseq = cache_waitq_seq(job->wb->cache);
	int busy = cache_shadow_busy(ce, &job->wb->thread);
	if (busy > 0) {
		if (cache_waitq_wait(job->wb->cache, &job->waiter, wseq))
			job->waiting = true;
		else
			job->again = true;
		return;
	}
	if (busy < 0) {
		job->error = job->background ? 0 : busy;
		job->stage = 2;
		return;
	}
	/* A pass wrote steps again meanwhile and made what the cache holds
	 * over them dirty again (newer, or the same): the FLUSHes covered
	 * that data, so it is written back before the flush. */
	pthread_mutex_lock(&ce->lock);
	uint64_t rewritten = ce->shadow_rewritten;
	pthread_mutex_unlock(&ce->lock);
	if (rewritten != job->shadow_seen && !job->background) {
		job->shadow_seen = rewritten;
		round_unpin(job);
		if (round_snapshot(job) < 0) {
			job->error = -ENOMEM;
			job->stage = 2;
			return;
		}
		job->again = true;
		return;
	}
	job->stage = 1;
	job->writes_covered = atomic_load(&ce->backend_writes_done);
	job->direct_covered = atomic_load(&ce->direct_writes_done);
	job->loss_at_send = loss;
	if (job->writes_covered == atomic_load(&ce->backend_writes_flushed)) {
		/* Everything acknowledged is covered by a flush already. An
		 * entry may still be unstable: a direct write counted before
		 * that flush was sent and applied to the cache (marked
		 * unstable) after it settled. The flush covered it. */
		unstable_settle_all(ce, job->writes_covered, false);
		cache_shadow_trim(ce, job->writes_covered);
		job->stage = 2;
		return;
	}
	atomic_fetch_add(&ce->counters.backend_flushes, 1);
	memset(&job->flush_io, 0, sizeof(job->flush_io));
	job->flush_io.cmd = BACKEND_FLUSH;
	job->flush_io.done = flush_backend_done;
	cache_backend_submit(ce, &job->wb->thread, &job->flush_io);
	uring_submit(&job->wb->thread.ring);
}

static void flush_waiter_task(struct worker_task *task)
{
	struct flush_job *job =
		(struct flush_job *)((char *)task - offsetof(struct flush_job, waiter.task));
	job->waiting = false;
	flush_advance(job);
}

static void flush_advance_once(struct flush_job *job);

/* Re-entrant: a writeback may complete inside entry_writeback (tmpfs). */
void flush_advance(struct flush_job *job)
{
	if (job->advancing) {
		job->again = true;
		return;
	}
	job->advancing = true;
	do {
		job->again = false;
		flush_advance_once(job);
	} while (job->again && job->stage == 0);
	job->advancing = false;
	if (job->stage == 2)
		flush_job_end(job);
}

/* Write back one entry for the round: false if it has to wait (-EBUSY). */
static bool flush_entry(struct flush_job *job, struct cache_entry *e)
{
	int rc = writeback_entry(job->wb, e, job);
	if (rc == -EBUSY)
		return false;
	if (rc < 0 && !job->error)
		job->error = rc;
	cache_entry_unpin(e);
	return true;
}

/*
 * Visit each entry once, keeping at most WB_FLUSH_WINDOW writebacks in
 * flight, and come back only to those that had to wait: the cost follows
 * the dirty data, whatever the number of completions.
 */
static void flush_advance_once(struct flush_job *job)
{
	struct writeback *wb = job->wb;
	if (job->logged) {
		if (job->stage == 0)
			flush_log_advance(job);
		return;
	}
	for (;;) {
		if (job->stage != 0)
			return;
		/* Any writeback of the export failed since the round began (a
		 * background one over an entry the round waits for, say): the
		 * backend is failing, and the round with it. */
		if (!job->error &&
		    atomic_load(&job->ce->counters.writeback_errors) != job->errors_at_start)
			job->error = -EIO;
		if (job->error) {
			/* The round fails whatever comes next: its FLUSHes get
			 * EIO as soon as what is in flight is back, not after
			 * every other entry has been tried too (a backend that
			 * times out would make that minutes). */
			round_unpin(job);
			if (job->inflight == 0)
				job->stage = 2;
			return;
		}
		uint64_t seq = cache_waitq_seq(wb->cache);
		size_t keep = 0, i;
		for (i = 0; i < job->nbusy && job->inflight < WB_FLUSH_WINDOW; i++)
			if (!flush_entry(job, job->entries[i]))
				job->entries[keep++] = job->entries[i];
		for (; i < job->nbusy; i++)
			job->entries[keep++] = job->entries[i];
		job->nbusy = keep;
		while (job->cursor < job->n && job->inflight < WB_FLUSH_WINDOW) {
			struct cache_entry *e = job->entries[job->cursor++];
			if (!flush_entry(job, e))
				job->entries[job->nbusy++] = e; /* nbusy < cursor: a free slot */
		}
		if (job->inflight)
			return; /* advanced again when they complete */
		if (job->nbusy == 0 && job->cursor == job->n) {
			round_flush(job);
			return;
		}
		if (job->again)
			return; /* flush_advance loops */
		if (cache_waitq_wait(wb->cache, &job->waiter, seq)) {
			job->waiting = true;
			return;
		}
	}
}

/*
 * Start ce's next round (none may be running): it answers every FLUSH
 * waiting now. A background round only flushes what is unstable.
 */
void flush_round_start(struct writeback *wb, struct cache_export *ce, bool background)
{
	struct flush_job *job = calloc(1, sizeof(*job));
	struct cache_op *members = ce->flush_waiting_head;
	bool shutdown = ce->shutdown_waiting;
	if (!job) {
		if (!members && !shutdown)
			return; /* a background round: the next pass tries again */
		/* Cannot even track a round: answer EIO (the data stays). */
		ce->flush_waiting_head = ce->flush_waiting_tail = NULL;
		ce->shutdown_waiting = false;
		answer(members, -ENOMEM);
		if (shutdown) {
			wb->shutdown_error = -ENOMEM;
			if (--wb->shutdown_jobs == 0)
				shutdown_pass(wb);
		}
		return;
	}
	job->wb = wb;
	job->ce = ce;
	job->members = members;
	job->shutdown = shutdown;
	job->background = background && !members && !shutdown;
	ce->flush_waiting_head = ce->flush_waiting_tail = NULL;
	ce->shutdown_waiting = false;
	bool writeback_only = members && ce->flush_writeback;
	if (members)
		ce->flush_writeback = false;
	job->waiter.worker = &wb->thread;
	job->waiter.task.run = flush_waiter_task;
	job->errors_at_start = atomic_load(&ce->counters.writeback_errors);
	pthread_mutex_lock(&ce->lock);
	job->shadow_seen = ce->shadow_rewritten;
	pthread_mutex_unlock(&ce->lock);
	ce->round = job;
	job->next = wb->jobs;
	wb->jobs = job;
	if (wb->cache->device && ce->device_slot >= 0 && !job->background) {
		/* Before the snapshot: every record up to here is covered. */
		job->device_rec = cache_device_last(wb->cache->device);
		if (!writeback_only && flush_log_possible(job)) {
			job->logged = true;
			atomic_store(&ce->log_unlogged_bytes, 0);
			if (flush_log_snapshot(job) < 0) {
				job->error = -ENOMEM;
				job->stage = 2;
				flush_job_end(job);
				return;
			}
			flush_side_start(job);
			flush_advance(job);
			return;
		}
	}
	if (!job->background && round_snapshot(job) < 0) {
		job->error = -ENOMEM;
		job->stage = 2;
		flush_job_end(job);
		return;
	}
	flush_advance(job);
}

/* On the writeback thread: the FLUSH joins the export's next round. */
static void flush_arrive_task(struct worker_task *task)
{
	struct cache_op *op = (struct cache_op *)((char *)task - offsetof(struct cache_op, waiter.task));
	struct cache_export *ce = op->ce;
	op->flush_next = NULL;
	if (op->flags & CACHE_FLUSH_WRITEBACK)
		ce->flush_writeback = true;
	if (ce->flush_waiting_tail)
		ce->flush_waiting_tail->flush_next = op;
	else
		ce->flush_waiting_head = op;
	ce->flush_waiting_tail = op;
	if (!ce->round)
		flush_round_start(ce->cache->writeback, ce, false);
}

void writeback_flush(struct cache_op *op)
{
	struct writeback *wb = op->ce->cache->writeback;
	op->error = 0;
	op->waiter.worker = op->worker;
	op->waiter.task.run = flush_arrive_task;
	worker_post(&wb->thread, &op->waiter.task);
}

bool flush_round_running(const struct cache_export *ce)
{
	return ce->round != NULL;
}

void flush_write_started(struct flush_job *job)
{
	job->inflight++;
}

void flush_write_done(struct flush_job *job, int error)
{
	job->inflight--;
	if (error && !job->error)
		job->error = error;
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	flush_shutdown_start(arg);
}

void flush_shutdown_start(struct writeback *wb)
{
	wb->shutdown_error = 0;
	wb->shutdown_jobs = 1; /* held while the rounds are started */
	for (struct cache_export *ce = writeback_exports(wb->cache); ce; ce = ce->next) {
		/* A retired export's backend is closed: it holds nothing. */
		if (atomic_load(&ce->retired))
			continue;
		/* A fenced one (another node owns its backend) takes nothing:
		 * what it held is given up, said once here. */
		if (atomic_load(&ce->backend->fenced)) {
			if (cache_export_unflushed(ce))
				log_error(
				    "cache: %llu dirty bytes are lost at exit: their "
				    "backend is fenced (another node owns it; its error "
				    "above names it)",
				    (unsigned long long)atomic_load(&ce->counters.dirty_bytes));
			continue;
		}
		wb->shutdown_jobs++;
		ce->shutdown_waiting = true;
		if (!ce->round)
			flush_round_start(wb, ce, false);
	}
	if (--wb->shutdown_jobs == 0)
		shutdown_pass(wb);
}

static bool anything_unflushed(struct cache *c)
{
	for (struct cache_export *ce = writeback_exports(c); ce; ce = ce->next)
		if (!atomic_load(&ce->retired) && !atomic_load(&ce->backend->fenced) &&
		    cache_export_unflushed(ce))
			return true;
	return false;
}

/*
 * Is all that is left the cache device's live log found at start, which
 * its drain writes to the backends (replay_gate)? Its pieces are written
 * by the drain's thread, not by these rounds: nothing else is dirty,
 * unstable or unflushed.
 */
static bool only_start_log_left(struct cache *c)
{
	if (!c->device)
		return false;
	bool gated = false;
	for (struct cache_export *ce = writeback_exports(c); ce; ce = ce->next) {
		if (atomic_load(&ce->retired) || atomic_load(&ce->backend->fenced) ||
		    !cache_export_unflushed(ce))
			continue;
		if (!atomic_load(&ce->replay_gate) || atomic_load(&ce->counters.dirty_bytes) ||
		    atomic_load(&ce->counters.unstable_bytes) ||
		    atomic_load(&ce->backend_writes_done) !=
			atomic_load(&ce->backend_writes_flushed))
			return false;
		gated = true;
	}
	return gated;
}

/* The shutdown rounds again in ms milliseconds (on_retry). */
static void shutdown_retry(struct writeback *wb, unsigned ms)
{
	if (!wb->retry)
		wb->retry = evtimer_new(wb->thread.base, on_retry, wb);
	struct timeval tv = {(time_t)(ms / 1000u), (suseconds_t)(ms % 1000u) * 1000};
	if (wb->retry)
		evtimer_add(wb->retry, &tv);
}

/* Every shutdown round has ended: done, or say so and try again later. */
static void shutdown_pass(struct writeback *wb)
{
	struct cache *c = wb->cache;
	bool start_log = !wb->shutdown_error && only_start_log_left(c);
	if (start_log && !cache_device_drain_progressing(c->device)) {
		/* Its drain fails (said above) or gave up: nothing is lost, the
		 * log stays on the device for the next start. */
		log_error("cache: the live log found at start is not on the backends yet: writing "
			  "it back fails (see above); retrying every %d s; send SIGTERM again to "
			  "exit: it stays on the cache device, and the next start writes it back",
			  WB_SHUTDOWN_RETRY_SECONDS);
		shutdown_retry(wb, WB_SHUTDOWN_RETRY_SECONDS * 1000u);
		return;
	}
	if (start_log) {
		/* Looked at again shortly: a round after the drain flushes. */
		if (!wb->shutdown_drain_said)
			log_info("cache: the live log found at start is still being written to "
				 "the backends; the stop waits for it");
		wb->shutdown_drain_said = true;
		shutdown_retry(wb, 100);
		return;
	}
	if (!anything_unflushed(c)) {
		log_info("cache: every dirty block is written back and flushed");
		event_free(wb->tick);
		wb->tick = NULL;
		if (wb->retry) {
			event_free(wb->retry);
			wb->retry = NULL;
		}
		pthread_mutex_lock(&wb->lock);
		wb->stopped = true;
		pthread_cond_signal(&wb->cond);
		pthread_mutex_unlock(&wb->lock);
		return;
	}
	log_error("cache: %llu bytes are not durable yet (%s); keeping them and retrying every "
		  "%d s; send SIGTERM again to exit without them",
		  (unsigned long long)writeback_not_durable_bytes(c),
		  wb->shutdown_error ? strerror(-wb->shutdown_error) : "written again meanwhile",
		  WB_SHUTDOWN_RETRY_SECONDS);
	shutdown_retry(wb, WB_SHUTDOWN_RETRY_SECONDS * 1000u);
}

