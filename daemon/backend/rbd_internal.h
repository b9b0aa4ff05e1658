/*
 * daemon/backend/rbd_internal.h: what the files of the rbd backend share.
 * Nothing outside daemon/backend/rbd*.c includes it; the rest of the
 * daemon knows the backend only through backend.h.
 *
 * Owns: struct rbd_backend (one per image) and struct rbd_ticket (one per
 * librbd request in flight).
 *
 * Locking: rb->lock guards the block-status queue, the ticket list, stop
 * and late_logged; base.fenced and outstanding are atomics; the rest is
 * set before the threads start and read after.
 *
 * The files:
 *
 *   rbd.c      connecting, the exclusive lock (taking it, the guard thread
 *              that checks it, fencing), the backend's life: open, start,
 *              close, size
 *   rbd_io.c   requests: rbd_aio_* calls, their tickets and deadlines, the
 *              completion thread, block status
 *
 * rbd.c's opening comment tells the whole story.
 */
#ifndef NBDCACHED_DAEMON_BACKEND_RBD_INTERNAL_H
#define NBDCACHED_DAEMON_BACKEND_RBD_INTERNAL_H

#include <pthread.h>
#include <rados/librados.h>
#include <rbd/librbd.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/queue.h"
#include "daemon/rbd_spec.h"

#define RBD_MAX_RANGE (1ull << 30) /* one TRIM / WRITE_ZEROES request */
#define RBD_POLL_BATCH 64
#define RBD_LOCK_CHECK_MS 1000
#define RBD_SWEEP_MS 100 /* how often deadlines are looked at */
#define RBD_TAKEOVER_RETRY_S 2
#define RBD_TAKEOVER_LOG_S 30
#define RBD_ERRNO_BLOCKLISTED ESHUTDOWN /* librados's EBLOCKLISTED */

/* backend_io.stage */
#define STAGE_MAIN 0
#define STAGE_FUA_FLUSH 1

struct rbd_backend {
	struct backend base;
	char *name; /* the backend string, for messages */
	struct rbd_spec spec;
	unsigned timeout_s;
	bool takeover_wait;
	rados_t cluster;
	rados_ioctx_t ioctx;
	rbd_image_t image;
	bool connected, opened;
	int efd;     /* librbd's completion eventfd */
	int wake;    /* eventfd, slow's wake-up: block status queued, or stop */
	char *addrs; /* this client's address (rados_getaddrs), as lock owner */
	pthread_t thread, guard;
	bool started, guarded;
	pthread_mutex_t lock; /* guards slow, stop and the tickets */
	pthread_cond_t cond;  /* the guard's sleep; signalled on stop */
	struct queue slow;    /* backend_io.posted: block status, run on the thread */
	/* Every librbd request in flight, oldest first (deadlines in order). */
	struct rbd_ticket *tickets_head, *tickets_tail;
	bool late_logged;	 /* since the last request that was answered */
	atomic_uint outstanding; /* tickets librbd holds, abandoned ones too */
	bool stop;
};

/*
 * One librbd request in flight: the completion's argument. A request that
 * writes (WRITE, FLUSH, TRIM, WRITE_ZEROES: librbd copied what it writes)
 * and has no answer by its deadline is answered EIO and abandoned (io
 * NULL): its completion, whenever it comes, only frees the ticket. RADOS
 * applies one client's requests to an object in the order sent, so an
 * abandoned write that lands late lands before anything the cache writes
 * there afterwards. A READ is never abandoned (librbd fills its buffer);
 * librados's own op timeout ends it.
 */
struct rbd_ticket {
	struct backend_io *io;
	uint64_t deadline_ns;
	bool abandonable;
	struct rbd_ticket *prev, *next;
};

static inline struct rbd_backend *to_rbd(struct backend *be)
{
	return (struct rbd_backend *)be;
}

/* rbd.c: from now on every request fails with EIO (said once, with why). */
void rbd_fence(struct rbd_backend *rb, const char *why);

/* rbd_io.c */
/* What the caller sees of a librbd error (-EIO, or -ENOSPC); fences on
 * "blocklisted". */
int rbd_map_error(struct rbd_backend *rb, int r);
void rbd_submit(struct backend *be, struct backend_io *io);
/* The completion thread: librbd's eventfd, block status, deadlines. */
void *rbd_io_thread(void *arg);
/* Completions librbd has ready, each to its worker (or its ticket freed). */
void rbd_take_completions(struct rbd_backend *rb);

#endif
