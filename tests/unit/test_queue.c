/*
 * tests/unit/test_queue.c: the queue other threads post to
 * (daemon/queue.h).
 *
 * What its three owners rely on: items come out oldest first, all at once;
 * the stop request is taken with everything posted before it, and
 * queue_post_unless_stopped() refuses after it (without a wake-up); every
 * post and stop fires the wake-up once, an eventfd's or a libevent event's;
 * and with several threads posting at once and the taker woken through
 * either, nothing is lost, nothing comes twice, each poster's items keep
 * their order and all of them come before the stop.
 */
#include <event2/event.h>
#include <event2/thread.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/queue.h"

#define POSTERS 4
#define PER_POSTER 20000

struct item {
	unsigned poster, seq;
	struct queue_link link;
};

static struct item *item_of(struct queue_link *l)
{
	return QUEUE_ENTRY(l, struct item, link);
}

/* What the eventfd counts now (0 if not readable); resets it. */
static uint64_t wakes(int fd)
{
	uint64_t v = 0;
	if (read(fd, &v, sizeof(v)) != sizeof(v))
		return 0;
	return v;
}

/* One thread, woken through an eventfd. */
struct single {
	pthread_mutex_t lock;
	int fd;
	struct queue q;
};

static int single_setup(void **state)
{
	struct single *t = calloc(1, sizeof(*t));
	if (!t)
		return -1;
	pthread_mutex_init(&t->lock, NULL);
	t->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (t->fd < 0) {
		free(t);
		return -1;
	}
	queue_init_eventfd(&t->q, &t->lock, t->fd);
	*state = t;
	return 0;
}

static int single_teardown(void **state)
{
	struct single *t = *state;
	close(t->fd);
	pthread_mutex_destroy(&t->lock);
	free(t);
	return 0;
}

static void oldest_first_all_at_once(void **state)
{
	struct single *t = *state;
	struct item it[3] = {{.seq = 0}, {.seq = 1}, {.seq = 2}};
	for (unsigned i = 0; i < 3; i++)
		queue_post(&t->q, &it[i].link);
	assert_int_equal(wakes(t->fd), 3);

	bool stop = true;
	struct queue_link *l = queue_take(&t->q, &stop);
	assert_false(stop);
	for (unsigned i = 0; i < 3; i++) {
		assert_non_null(l);
		assert_int_equal(item_of(l)->seq, i);
		l = l->next;
	}
	assert_null(l);
	assert_null(queue_take(&t->q, NULL));

	/* Taken, an item may be posted again (and the queue starts afresh). */
	queue_post(&t->q, &it[1].link);
	pthread_mutex_lock(&t->lock);
	l = queue_take_locked(&t->q, &stop);
	pthread_mutex_unlock(&t->lock);
	assert_ptr_equal(l, &it[1].link);
	assert_null(l->next);
}

static void stop_comes_with_what_was_posted_before(void **state)
{
	struct single *t = *state;
	struct item a = {.seq = 0}, b = {.seq = 1}, c = {.seq = 2};
	assert_true(queue_post_unless_stopped(&t->q, &a.link));
	queue_stop(&t->q);
	assert_int_equal(wakes(t->fd), 2);
	assert_false(queue_post_unless_stopped(&t->q, &b.link));
	assert_int_equal(wakes(t->fd), 0); /* refused: no wake-up */
	queue_post(&t->q, &c.link);	   /* queue_post() takes it still */
	assert_int_equal(wakes(t->fd), 1);

	bool stop = false;
	struct queue_link *l = queue_take(&t->q, &stop);
	assert_true(stop);
	assert_ptr_equal(l, &a.link);
	assert_ptr_equal(l->next, &c.link);
	assert_null(l->next->next);
	/* The stop stays asked for. */
	assert_null(queue_take(&t->q, &stop));
	assert_true(stop);
}

/* ---- an event's wake-up, one thread ---- */

struct event_taker {
	struct queue q;
	unsigned calls, taken;
};

static void on_wake_count(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct event_taker *t = arg;
	t->calls++;
	for (struct queue_link *l = queue_take(&t->q, NULL); l; l = l->next)
		t->taken++;
}

static void event_wake_runs_the_taker(void **state)
{
	(void)state;
	pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
	struct event_base *base = event_base_new();
	assert_non_null(base);
	struct event_taker t = {.calls = 0};
	struct event *wake = event_new(base, -1, 0, on_wake_count, &t);
	assert_non_null(wake);
	queue_init_event(&t.q, &lock, wake);
	struct item it[2];
	queue_post(&t.q, &it[0].link);
	queue_post(&t.q, &it[1].link);
	event_base_loop(base, EVLOOP_NONBLOCK);
	/* Two activations of one event before the loop ran: one callback. */
	assert_int_equal(t.calls, 1);
	assert_int_equal(t.taken, 2);
	event_base_loop(base, EVLOOP_NONBLOCK);
	assert_int_equal(t.calls, 1);
	event_free(wake);
	event_base_free(base);
}

/* ---- several posting threads, one taking ---- */

struct shared {
	pthread_mutex_t lock;
	struct queue q;
	struct item items[POSTERS][PER_POSTER];
	unsigned next_seq[POSTERS];
	unsigned taken;
	bool stop_seen, stop_early;
	unsigned order_errors;
	struct event_base *base; /* the event taker's */
	int fd;			 /* the eventfd taker's */
};

struct poster {
	struct shared *s;
	unsigned index;
};

static void *post_all(void *arg)
{
	struct poster *p = arg;
	for (unsigned i = 0; i < PER_POSTER; i++) {
		struct item *it = &p->s->items[p->index][i];
		it->poster = p->index;
		it->seq = i;
		queue_post(&p->s->q, &it->link);
	}
	return NULL;
}

/* The taker's thread: what it took, checked. */
static void take_and_check(struct shared *s)
{
	bool stop;
	struct queue_link *l = queue_take(&s->q, &stop);
	while (l) {
		struct item *it = item_of(l);
		l = l->next;
		if (it->seq != s->next_seq[it->poster])
			s->order_errors++;
		s->next_seq[it->poster] = it->seq + 1;
		s->taken++;
	}
	if (stop) {
		if (s->taken != POSTERS * PER_POSTER)
			s->stop_early = true;
		s->stop_seen = true;
	}
}

/* Posters run; the stop after they are done; the taker must see all first. */
static void run_posters_then_stop(struct shared *s)
{
	pthread_t threads[POSTERS];
	struct poster posters[POSTERS];
	for (unsigned i = 0; i < POSTERS; i++) {
		posters[i] = (struct poster){s, i};
		assert_int_equal(pthread_create(&threads[i], NULL, post_all, &posters[i]), 0);
	}
	for (unsigned i = 0; i < POSTERS; i++)
		pthread_join(threads[i], NULL);
	queue_stop(&s->q);
}

static void check_shared(struct shared *s)
{
	assert_true(s->stop_seen);
	assert_false(s->stop_early);
	assert_int_equal(s->order_errors, 0);
	assert_int_equal(s->taken, POSTERS * PER_POSTER);
	for (unsigned i = 0; i < POSTERS; i++)
		assert_int_equal(s->next_seq[i], PER_POSTER);
}

static void on_wake_check(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct shared *s = arg;
	take_and_check(s);
	if (s->stop_seen)
		event_base_loopexit(s->base, NULL);
}

static void *event_taker_main(void *arg)
{
	struct shared *s = arg;
	event_base_loop(s->base, EVLOOP_NO_EXIT_ON_EMPTY);
	return NULL;
}

static void *eventfd_taker_main(void *arg)
{
	struct shared *s = arg;
	while (!s->stop_seen) {
		struct pollfd p = {.fd = s->fd, .events = POLLIN};
		if (poll(&p, 1, 10000) <= 0)
			break; /* check_shared() says what is missing */
		(void)wakes(s->fd);
		take_and_check(s);
	}
	return NULL;
}

static struct shared *shared_new(void)
{
	struct shared *s = calloc(1, sizeof(*s));
	assert_non_null(s);
	pthread_mutex_init(&s->lock, NULL);
	s->fd = -1;
	return s;
}

static void threads_through_an_event(void **state)
{
	(void)state;
	struct shared *s = shared_new();
	s->base = event_base_new();
	assert_non_null(s->base);
	struct event *wake = event_new(s->base, -1, 0, on_wake_check, s);
	assert_non_null(wake);
	queue_init_event(&s->q, &s->lock, wake);
	pthread_t taker;
	assert_int_equal(pthread_create(&taker, NULL, event_taker_main, s), 0);
	run_posters_then_stop(s);
	pthread_join(taker, NULL);
	check_shared(s);
	event_free(wake);
	event_base_free(s->base);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

static void threads_through_an_eventfd(void **state)
{
	(void)state;
	struct shared *s = shared_new();
	s->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	assert_true(s->fd >= 0);
	queue_init_eventfd(&s->q, &s->lock, s->fd);
	pthread_t taker;
	assert_int_equal(pthread_create(&taker, NULL, eventfd_taker_main, s), 0);
	run_posters_then_stop(s);
	pthread_join(taker, NULL);
	check_shared(s);
	close(s->fd);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

int main(void)
{
	evthread_use_pthreads(); /* as the daemon: event_active() from other threads */
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test_setup_teardown(oldest_first_all_at_once, single_setup,
					    single_teardown),
	    cmocka_unit_test_setup_teardown(stop_comes_with_what_was_posted_before, single_setup,
					    single_teardown),
	    cmocka_unit_test(event_wake_runs_the_taker),
	    cmocka_unit_test(threads_through_an_event),
	    cmocka_unit_test(threads_through_an_eventfd),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
