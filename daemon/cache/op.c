/*
 * daemon/cache/op.c: the driver of an operation (the operations layer,
 * ops.h). An op runs on its worker thread only: op_run() calls its step
 * (cached.c for READ, CACHE and a cached WRITE, direct.c for the rest)
 * until it finishes or waits; backend completions, a wake of the cache's
 * waitq and retries come back on the same worker and run it again. A
 * completion may run inline, inside a step: op_run then loops instead of
 * recursing, and done() is called last, after the last touch of op.
 * In mode none an op but TRIM and WRITE_ZEROES has no steps: op_submit()
 * passes it to the backend as it is (direct.c, passthrough_start).
 */
#include <errno.h>

#include "daemon/cache/ops.h"

/* done() may free the op: inside op_run it is deferred to op_run's end. */
void op_finish(struct cache_op *op, int result)
{
	op->finished = true;
	op->result = result;
	if (!op->running)
		op->done(op, result);
}

void op_wait(struct cache_op *op, uint64_t seq)
{
	if (op->rerun)
		return; /* a completion ran inline: look again before waiting */
	if (!cache_waitq_wait(op->ce->cache, &op->waiter, seq))
		op->rerun = true;
}

static void op_step(struct cache_op *op)
{
	if (op->cmd == BACKEND_WRITE && op->stage == OP_STAGE_THROTTLED)
		throttle_step(op);
	else if (op->cmd == BACKEND_WRITE && op->stage == OP_STAGE_RECEIVED)
		cached_received_step(op);
	else if (op->cmd == BACKEND_READ || op->cmd == BACKEND_CACHE ||
	    (op->cmd == BACKEND_WRITE && op->stage == -1))
		cached_step(op);
	else
		direct_step(op);
}

void op_run(struct cache_op *op)
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

void op_reset(struct cache_op *op)
{
	op->pieces = NULL;
	op->npieces = op->pieces_cap = 0;
	op->pending = 0;
	op->error = 0;
	op->stage = 0;
	op->registered = op->counted = op->running = op->rerun = op->finished = false;
	op->some_cached = false;
	op->swapped = false;
	op->spans = NULL;
	op->nspans = 0;
	op->write_seq = 0;
	op->device_rec = 0;
	op->maybe_lost = false;
	op->step_bytes = 0; /* direct_step: no step yet */
	op->waiter.worker = op->worker;
	op->waiter.task.run = op_task;
	op->readahead = false;
	op->read_missed = false;
	op->own_data = NULL;
}

void op_submit(struct cache_op *op)
{
	int rc = 0;
	/* Past an end a resize moved since the connection checked the request
	 * (export_resize.c moves the size before it drops what is cached past
	 * it): the resize extension's ENOSPC, and nothing cached out there. */
	uint64_t size = op->ce->size;
	if (op->offset > size || op->length > size - op->offset) {
		op_finish(op, -ENOSPC);
		return;
	}
	/* TRIM and WRITE_ZEROES go in steps in every mode (direct.c): one of
	 * 2^63 bytes must be stoppable in mode none too. */
	if (cache_export_mode(op->ce) == CACHE_MODE_NONE && op->cmd != BACKEND_TRIM &&
	    op->cmd != BACKEND_ZERO) {
		passthrough_start(op);
		return;
	}
	switch (op->cmd) {
	case BACKEND_READ:
	case BACKEND_CACHE:
	case BACKEND_WRITE:
		rc = cached_prepare(op);
		break;
	case BACKEND_BLOCK_STATUS:
		block_status_start(op);
		return;
	case BACKEND_FLUSH:
		/* Never here: cache_submit hands it to the writeback thread. */
		op_finish(op, -EINVAL);
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
