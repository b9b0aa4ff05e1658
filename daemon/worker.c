/*
 * daemon/worker.c: see worker.h.
 *
 * One wake event carries both the tasks and the stop request: its
 * callback takes the whole task queue under the lock, runs it, and then,
 * once, the stop callback if a stop was asked for, so that a task posted
 * before worker_request_stop() always runs before the stop.
 */
#include "daemon/worker.h"

#include <errno.h>
#include <event2/event.h>
#include <string.h>

#define WORKER_RING_ENTRIES 256

static void worker_on_wake(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct worker *w = arg;
	pthread_mutex_lock(&w->lock);
	struct worker_task *task = w->tasks;
	w->tasks = w->tasks_tail = NULL;
	bool stop = w->stop_requested;
	pthread_mutex_unlock(&w->lock);
	while (task) {
		struct worker_task *next = task->next;
		task->run(task);
		task = next;
	}
	if (stop && !w->stop_seen) {
		w->stop_seen = true;
		if (w->on_stop)
			w->on_stop(w);
		else
			worker_exit(w);
	}
	uring_submit(&w->ring);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	event_base_loop(w->base, EVLOOP_NO_EXIT_ON_EMPTY);
	return NULL;
}

int worker_start(struct worker *w, unsigned index, void (*on_stop)(struct worker *w))
{
	memset(w, 0, sizeof(*w));
	w->index = index;
	w->on_stop = on_stop;
	pthread_mutex_init(&w->lock, NULL);
	int rc = -ENOMEM;
	/*
	 * epoll changes are applied in one go before each wait, and an add and
	 * a delete of the same event in one turn of the loop cost nothing: a
	 * connection's write event is enabled whenever replies are queued and
	 * disabled when they are sent, which would be two epoll_ctl calls per
	 * batch of replies. (The descriptors are never dup'ed, which is what
	 * the change list cannot cope with.)
	 */
	struct event_config *cfg = event_config_new();
	if (!cfg)
		goto err;
	event_config_set_flag(cfg, EVENT_BASE_FLAG_EPOLL_USE_CHANGELIST);
	w->base = event_base_new_with_config(cfg);
	event_config_free(cfg);
	if (!w->base)
		goto err;
	rc = uring_init(&w->ring, w->base, WORKER_RING_ENTRIES);
	if (rc < 0)
		goto err_base;
	w->wake = event_new(w->base, -1, 0, worker_on_wake, w);
	if (!w->wake) {
		rc = -ENOMEM;
		goto err_ring;
	}
	rc = -pthread_create(&w->thread, NULL, worker_main, w);
	if (rc < 0)
		goto err_wake;
	return 0;
err_wake:
	event_free(w->wake);
err_ring:
	uring_close(&w->ring);
err_base:
	event_base_free(w->base);
err:
	pthread_mutex_destroy(&w->lock);
	return rc;
}

/* Queue task on w unless only_running and w was asked to stop. */
static bool post(struct worker *w, struct worker_task *task, bool only_running)
{
	task->next = NULL;
	pthread_mutex_lock(&w->lock);
	bool queued = !only_running || !w->stop_requested;
	if (queued) {
		if (w->tasks_tail)
			w->tasks_tail->next = task;
		else
			w->tasks = task;
		w->tasks_tail = task;
	}
	pthread_mutex_unlock(&w->lock);
	if (queued)
		event_active(w->wake, EV_READ, 0);
	return queued;
}

void worker_post(struct worker *w, struct worker_task *task)
{
	post(w, task, false);
}

bool worker_post_if_running(struct worker *w, struct worker_task *task)
{
	return post(w, task, true);
}

void worker_request_stop(struct worker *w)
{
	pthread_mutex_lock(&w->lock);
	w->stop_requested = true;
	pthread_mutex_unlock(&w->lock);
	event_active(w->wake, EV_READ, 0);
}

void worker_exit(struct worker *w)
{
	event_base_loopexit(w->base, NULL);
}

void worker_join(struct worker *w)
{
	pthread_join(w->thread, NULL);
	event_free(w->wake);
	uring_close(&w->ring);
	event_base_free(w->base);
	pthread_mutex_destroy(&w->lock);
}
