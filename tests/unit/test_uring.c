/*
 * tests/unit/test_uring.c: daemon/uring.c when the kernel refuses
 * submissions.
 *
 * A ring whose submission queue is full and whose io_uring_enter fails
 * with an error other than EAGAIN / EBUSY (here: the ring's descriptor
 * made into /dev/null, so every enter fails with EOPNOTSUPP) must not make
 * uring_get_sqe() spin: it returns at once, and the op completes with the
 * error from the event loop, never inside the call. The same ring then
 * works again once the kernel takes submissions (the descriptor back).
 * A watchdog alarm fails the test instead of hanging where it would spin.
 */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/uring.h"

#define ENTRIES 4

struct test_op {
	struct uring_op op;
	int calls;
	int res;
};

static void test_op_complete(struct uring_op *op, int res)
{
	struct test_op *t = (struct test_op *)op;
	t->calls++;
	t->res = res;
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "test_uring: uring_get_sqe did not return within 5 s\n";
	ssize_t n = write(2, msg, sizeof(msg) - 1);
	(void)n;
	_exit(1);
}

static void refused_submission_fails_the_op(void **state)
{
	(void)state;
	struct event_base *base = event_base_new();
	assert_non_null(base);
	struct uring u;
	assert_int_equal(uring_init(&u, base, ENTRIES), 0);

	/* Fill the submission queue with nops nobody submits yet. */
	struct test_op fill[ENTRIES];
	memset(fill, 0, sizeof(fill));
	unsigned queued = 0;
	for (; queued < ENTRIES; queued++) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(&u.ring);
		if (!sqe)
			break;
		fill[queued].op.complete = test_op_complete;
		io_uring_prep_nop(sqe);
		io_uring_sqe_set_data(sqe, &fill[queued].op);
		u.unsubmitted++;
		u.inflight++;
	}
	assert_true(queued > 0);

	/* Every io_uring_enter now fails with a hard error. */
	int saved = dup(u.ring.ring_fd);
	assert_true(saved >= 0);
	int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	assert_true(null_fd >= 0);
	assert_true(dup2(null_fd, u.ring.ring_fd) >= 0);

	struct test_op t = {.op.complete = test_op_complete};
	signal(SIGALRM, on_alarm);
	alarm(5);
	struct io_uring_sqe *sqe = uring_get_sqe(&u, &t.op);
	alarm(0);
	assert_non_null(sqe);
	io_uring_prep_nop(sqe); /* the caller prepares it as usual */
	assert_int_equal(t.calls, 0); /* never inside the call */

	event_base_loop(base, EVLOOP_NONBLOCK);
	event_base_loop(base, EVLOOP_NONBLOCK);
	assert_int_equal(t.calls, 1);
	assert_true(t.res < 0);

	/* The kernel takes submissions again: the queued nops go through. */
	assert_true(dup2(saved, u.ring.ring_fd) >= 0);
	assert_int_equal(uring_submit(&u), 0);
	for (unsigned spin = 0; spin < 1000; spin++) {
		uring_reap(&u);
		unsigned done = 0;
		for (unsigned i = 0; i < queued; i++)
			done += fill[i].calls;
		if (done == queued)
			break;
		usleep(1000);
	}
	for (unsigned i = 0; i < queued; i++) {
		assert_int_equal(fill[i].calls, 1);
		assert_int_equal(fill[i].res, 0);
	}
	close(saved);
	close(null_fd);
	uring_close(&u);
	event_base_free(base);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(refused_submission_fails_the_op),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
