/*
 * daemon/uring.h: one io_uring per worker thread, wired into that worker's
 * libevent loop.
 *
 * Owns: the ring and an eventfd registered with it. Completions make the
 * eventfd readable; the worker's event loop then reaps every CQE and calls
 * the completion function of the struct uring_op whose address is the SQE's
 * user_data. Submission is batched: callers prepare SQEs with
 * uring_get_sqe() and the worker calls uring_submit() once per batch (after a
 * read callback has parsed every complete request, and after reaping).
 *
 * Locking: none. A ring belongs to one worker thread; only that thread may
 * touch it.
 */
#ifndef NBDCACHED_DAEMON_URING_H
#define NBDCACHED_DAEMON_URING_H

#include <liburing.h>
#include <stdbool.h>

struct event_base;
struct event;

struct uring_op {
	/* res: the CQE result (>= 0, or -errno). */
	void (*complete)(struct uring_op *op, int res);
	/* Private: an op the ring could not take, completed from the loop. */
	struct uring_op *failed_next;
	int failed_res;
};

struct uring {
	struct io_uring ring;
	int eventfd;
	struct event *event;
	struct event *retry; /* resubmits after a refused io_uring_enter */
	unsigned unsubmitted;
	unsigned inflight;
	/* Ops refused for good (the submission queue stayed full): each is
	 * prepared into scratch, never submitted, and completed with its
	 * error from the event loop (uring_get_sqe). */
	struct io_uring_sqe scratch;
	struct uring_op *failed_head, *failed_tail;
};

int uring_init(struct uring *u, struct event_base *base, unsigned entries);
void uring_close(struct uring *u);
/*
 * An SQE whose user_data is set to op. Never NULL: when the submission
 * queue is full, the queued SQEs are submitted first; if the kernel keeps
 * refusing them, op completes with that error from the event loop (soon,
 * never inside this call) and the SQE returned is a scratch one.
 */
struct io_uring_sqe *uring_get_sqe(struct uring *u, struct uring_op *op);
/* Submit what was prepared. Returns 0 or -errno. */
int uring_submit(struct uring *u);
/* Reap and dispatch every available completion (also called by the event). */
void uring_reap(struct uring *u);

#endif
