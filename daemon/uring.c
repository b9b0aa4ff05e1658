/*
 * daemon/uring.c: see uring.h.
 *
 * The eventfd is the bridge between io_uring and libevent: the kernel bumps
 * it on every CQE, libevent sees it readable, and uring_on_eventfd() drains
 * the counter and then the completion queue. Draining the counter before the
 * queue means a completion that lands while we reap re-arms the event, so
 * none is ever left waiting.
 */
#include "daemon/uring.h"

#include <errno.h>
#include <event2/event.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/log.h"

#define URING_SUBMIT_TRIES 64

static void uring_on_eventfd(evutil_socket_t fd, short what, void *arg)
{
	(void)what;
	struct uring *u = arg;
	uint64_t count;
	ssize_t r = read(fd, &count, sizeof(count));
	(void)r;
	uring_reap(u);
	uring_submit(u);
}

/* A submission the kernel refused for now (EAGAIN, EBUSY, ENOMEM): try again. */
static void uring_on_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct uring *u = arg;
	struct uring_op *op = u->failed_head;
	u->failed_head = u->failed_tail = NULL;
	while (op) {
		struct uring_op *next = op->failed_next;
		op->complete(op, op->failed_res);
		op = next;
	}
	uring_reap(u);
	uring_submit(u);
}

int uring_init(struct uring *u, struct event_base *base, unsigned entries)
{
	memset(u, 0, sizeof(*u));
	u->eventfd = -1;
	int rc = io_uring_queue_init(entries, &u->ring, 0);
	if (rc < 0)
		return rc;
	u->eventfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (u->eventfd < 0) {
		rc = -errno;
		goto err_ring;
	}
	rc = io_uring_register_eventfd(&u->ring, u->eventfd);
	if (rc < 0)
		goto err_fd;
	u->event = event_new(base, u->eventfd, EV_READ | EV_PERSIST, uring_on_eventfd, u);
	if (!u->event) {
		rc = -ENOMEM;
		goto err_fd;
	}
	if (event_add(u->event, NULL) < 0) {
		rc = -EIO;
		goto err_event;
	}
	u->retry = evtimer_new(base, uring_on_retry, u);
	if (!u->retry) {
		rc = -ENOMEM;
		goto err_event;
	}
	return 0;
err_event:
	event_free(u->event);
	u->event = NULL;
err_fd:
	close(u->eventfd);
	u->eventfd = -1;
err_ring:
	io_uring_queue_exit(&u->ring);
	return rc;
}

void uring_close(struct uring *u)
{
	if (u->retry)
		event_free(u->retry);
	if (u->event)
		event_free(u->event);
	if (u->eventfd >= 0)
		close(u->eventfd);
	io_uring_queue_exit(&u->ring);
	memset(u, 0, sizeof(*u));
	u->eventfd = -1;
}

struct io_uring_sqe *uring_get_sqe(struct uring *u, struct uring_op *op)
{
	struct io_uring_sqe *sqe;
	int rc = 0;
	/* Bounded: a kernel that keeps refusing must not spin the worker. */
	for (unsigned tries = 0; !(sqe = io_uring_get_sqe(&u->ring)); tries++) {
		if (tries == URING_SUBMIT_TRIES) {
			log_error("io_uring submit: %s; failing the request",
				  strerror(rc < 0 ? -rc : EAGAIN));
			op->failed_res = rc < 0 ? rc : -EAGAIN;
			op->failed_next = NULL;
			if (u->failed_tail)
				u->failed_tail->failed_next = op;
			else
				u->failed_head = op;
			u->failed_tail = op;
			struct timeval now = {0, 0};
			evtimer_add(u->retry, &now);
			memset(&u->scratch, 0, sizeof(u->scratch));
			return &u->scratch;
		}
		rc = uring_submit(u);
		if (rc == -EAGAIN || rc == -EBUSY || rc == -EINTR)
			uring_reap(u);
	}
	io_uring_sqe_set_data(sqe, op);
	u->unsubmitted++;
	u->inflight++;
	return sqe;
}

int uring_submit(struct uring *u)
{
	if (u->unsubmitted == 0)
		return 0;
	int rc = io_uring_submit(&u->ring);
	if (rc < 0) {
		/* The SQEs stay queued; nothing else may come along to submit them. */
		struct timeval tv = {0, 1000};
		evtimer_add(u->retry, &tv);
		return rc;
	}
	u->unsubmitted -= (unsigned)rc > u->unsubmitted ? u->unsubmitted : (unsigned)rc;
	return 0;
}

void uring_reap(struct uring *u)
{
	struct io_uring_cqe *cqe;
	/* Bounded by what is in the queue now; new completions re-arm the eventfd. */
	unsigned budget = u->inflight + 1;
	while (budget-- && io_uring_peek_cqe(&u->ring, &cqe) == 0) {
		struct uring_op *op = io_uring_cqe_get_data(cqe);
		int res = cqe->res;
		io_uring_cqe_seen(&u->ring, cqe);
		u->inflight--;
		if (op)
			op->complete(op, res);
	}
}
