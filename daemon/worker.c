/*
 * daemon/worker.c: see worker.h.
 *
 * One wake event carries both the tasks and the stop request (the queue's,
 * daemon/queue.h): its callback takes the whole task queue and the stop
 * request under the lock, runs the tasks, and then, once, the stop
 * callback if a stop was asked for, so that a task posted before
 * worker_request_stop() always runs before the stop.
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
	bool stop;
	struct queue_link *l = queue_take(&w->tasks, &stop);
	while (l) {
		struct worker_task *task = QUEUE_ENTRY(l, struct worker_task, link);
		l = l->next;
		task->run(task);
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
	queue_init_event(&w->tasks, &w->lock, w->wake);
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

void worker_post(struct worker *w, struct worker_task *task)
{
	queue_post(&w->tasks, &task->link);
}

bool worker_post_if_running(struct worker *w, struct worker_task *task)
{
	return queue_post_unless_stopped(&w->tasks, &task->link);
}

void worker_request_stop(struct worker *w)
{
	queue_stop(&w->tasks);
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
