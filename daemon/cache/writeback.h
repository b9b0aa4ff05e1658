/*
 * daemon/cache/writeback.h: what writeback.c (writing dirty data back) and
 * flush.c (FLUSH rounds and the final flush at shutdown) share. Both run
 * on the writeback thread only, so nothing here takes a lock of its own;
 * cache.h has the durability model. The thread's life is lifecycle.c's
 * (writeback_create .. writeback_destroy), and FLUSH comes from its
 * cache_submit (writeback_flush); the index wakes the thread through
 * struct cache_kick (internal.h), never through this header. Nothing
 * outside daemon/cache/ includes this.
 */
#ifndef NBDCACHED_DAEMON_CACHE_WRITEBACK_H
#define NBDCACHED_DAEMON_CACHE_WRITEBACK_H

#include "daemon/cache/internal.h"

#define WB_RETRY_NS 1000000000ull /* a failing export is retried after this */

struct writeback {
	struct cache *cache;
	struct worker thread;
	bool started;
	struct event *tick;
	struct flush_job *jobs;
	unsigned inflight;
	uint64_t inflight_bytes; /* device bytes of the groups in flight (wb_op.bytes) */
	bool draining;
	bool in_pass, pass_again; /* background_pass is re-entered by inline completions */
	uint64_t jobs_ended;

	/* shutdown */
	struct worker_task stop_task;
	struct event *retry;
	unsigned shutdown_jobs;
	int shutdown_error;
	bool shutdown_drain_said; /* "waits for the log found at start", said once */
	uint64_t shutdown_lost; /* direct writes lost while stopping (no client to tell) */
	bool stopping;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stopped;
};


/* writeback.c: the thread's life (lifecycle.c) */
int writeback_create(struct cache *c);
int writeback_start(struct cache *c);
/* Write everything back and flush; blocks, calling progress about once a
 * second. 0, or -EIO when writes that went to a backend directly were lost. */
int writeback_stop(struct cache *c, void (*progress)(uint64_t remaining, void *arg), void *arg);
/* From now on a SIGTERM / SIGINT ends writeback_stop's retries (exit 1). */
void writeback_catch_second_signal(void);
void writeback_destroy(struct cache *c);

/* writeback.c */
/*
 * Start writing e back for job (NULL: background), with the dirty entries
 * right after it. Returns 1 if started, 0 if there is nothing to write,
 * -EBUSY if it must wait, or -ENOMEM. The job's inflight count follows
 * its writebacks (flush_write_done when each ends).
 */
int writeback_entry(struct writeback *wb, struct cache_entry *e, struct flush_job *job);
/* A backend write or flush of ce failed / worked: the log and the retry
 * backoff (at most one line per 10 s). Export lock held for the first. */
void writeback_note_failure_locked(struct cache_export *ce, int error, const char *what);
void writeback_note_success(struct cache_export *ce);
/* The head of the cache's export list (new exports are put in front). */
struct cache_export *writeback_exports(struct cache *c);
/* Bytes not durable yet: dirty, being written back, or unstable. */
uint64_t writeback_not_durable_bytes(struct cache *c);

/* flush.c */
/* FLUSH joins the export's next round on the writeback thread; op->done
 * runs on op->worker (cache_submit). */
void writeback_flush(struct cache_op *op);
/* A writeback of job started / ended (error: 0 or -errno). */
void flush_write_started(struct flush_job *job);
void flush_write_done(struct flush_job *job, int error);
/* Advance every round that is not waiting to be woken. */
void flush_advance_all(struct writeback *wb);
/* Start ce's next round (none may be running): it answers every FLUSH
 * waiting; background: only a backend flush of what is unstable. */
void flush_round_start(struct writeback *wb, struct cache_export *ce, bool background);
/* Is a round of ce running? */
bool flush_round_running(const struct cache_export *ce);
/* Shutdown: write back and flush every export, retrying while refused. */
void flush_shutdown_start(struct writeback *wb);

#endif
