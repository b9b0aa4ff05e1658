/*
 * daemon/cache/flush_internal.h: a FLUSH round, shared by flush.c (rounds
 * that write back and flush the backend) and flush_log.c (rounds that
 * commit to a cache device's intent log). Writeback thread only.
 */
#ifndef NBDCACHED_DAEMON_CACHE_FLUSH_INTERNAL_H
#define NBDCACHED_DAEMON_CACHE_FLUSH_INTERNAL_H

#include "daemon/cache/writeback.h"

/*
 * A flush round of one export: writes back the dirty list as it was when
 * the round started, then flushes the backend, and answers every FLUSH
 * that joined it. A background round (background) only flushes; a
 * shutdown round has no FLUSH to answer.
 */
struct flush_job {
	struct writeback *wb;
	struct cache_export *ce;
	struct cache_op *members; /* FLUSHes answered when it ends (op->flush_next) */
	bool shutdown, background;
	/*
	 * Every entry on the dirty list when the round started, pinned:
	 * [0, nbusy) had to wait (a writeback or direct operation in flight
	 * over them), [nbusy, cursor) are done, [cursor, n) are still to visit.
	 */
	struct cache_entry **entries;
	size_t n, cursor, nbusy;
	unsigned inflight;
	int error;
	int stage;	       /* 0 writing, 1 flushing the backend, 2 done */
	bool advancing, again; /* completions may run inside flush_advance */
	bool waiting;	       /* on the waitq, or its waiter task posted */
	unsigned loss_retries;
	uint64_t errors_at_start; /* the export's writeback_errors when it started */
	uint64_t writes_covered;  /* backend_writes_done when the flush was sent */
	uint64_t direct_covered;  /* direct_writes_done then */
	uint64_t loss_at_send;	  /* the backend's loss_seq then */
	struct backend_io flush_io;
	struct cache_waiter waiter;
	/*
	 * A cache device (device.h): a log round (logged) copies the dirty
	 * and unstable blocks into the log instead of writing them back,
	 * and is answered once they are durable there (stage 1: waiting for
	 * the commit). A full round of an export on the device notes the
	 * last record appended before it began (device_rec): once it has
	 * succeeded those are on the backend, and its FLUSHes are answered
	 * only once they are durable or checkpointed (device_done).
	 */
	bool logged, device_done;
	bool device_again; /* a second full round: the device failed during the first */
	/*
	 * A log round whose FLUSHes cover direct writes (they went to the
	 * backend, not through the cache: often the only copy outside the
	 * log is the backend's, which a lost connection or a failed
	 * fdatasync can take) flushes the backend too, beside its commit
	 * (side_io): the round ends once both have (end_due: it was due
	 * while the flush was out).
	 */
	bool side_pending, end_due;
	uint64_t shadow_seen; /* the export's shadow_rewritten when it last looked */
	uint64_t side_covered, side_direct, side_loss;
	struct backend_io side_io;
	uint64_t device_rec;
	struct cache_device_waiter dwait;
	struct flush_job *next;
};

/* flush.c */
/* Every entry on the dirty list, pinned, as the round's to visit. */
int round_snapshot(struct flush_job *job);
void round_unpin(struct flush_job *job);
/* Re-entrant: runs the round as far as it goes now. */
void flush_advance(struct flush_job *job);
/* The round is over: answer its FLUSHes, start the next. */
void flush_job_end(struct flush_job *job);

/* Send the side flush of a log round (flush_internal.h, side_io). */
void flush_side_start(struct flush_job *job);

/* flush_log.c */
/* e's blocks a backend flush just made durable: a CLEAN record (shard
 * lock held). */
void flush_log_clean(struct cache_export *ce, struct cache_entry *e);
/* Can this round go to the log? Its entries, pinned. Its stage 0. */
bool flush_log_possible(struct flush_job *job);
int flush_log_snapshot(struct flush_job *job);
void flush_log_advance(struct flush_job *job);

#endif
