/*
 * daemon/worker.c: see worker.h.
 *
 * Stopping is cooperative: the stop request closes connections still in
 * negotiation, asks the others to finish their in-flight requests, and arms
 * a timer after which stragglers (clients that never read their replies)
 * are cut off. The loop ends when the last connection is freed, which
 * happens only after its last backend I/O has completed, so no io_uring
 * operation outlives the ring.
 */
#include "daemon/worker.h"

#include <errno.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/budget.h"
#include "daemon/conn.h"
#include "daemon/log.h"
#include "daemon/session.h"

#define WORKER_RING_ENTRIES 256
#define WORKER_STOP_GRACE_SECONDS 10

static void worker_maybe_exit(struct worker *w)
{
	if (w->stopping && w->conn_count == 0)
		event_base_loopexit(w->base, NULL);
}

static void worker_on_stop_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct worker *w = arg;
	struct conn *c = w->conns;
	while (c) {
		struct conn *next = c->next;
		if (c->bev)
			conn_kill(c, "shutdown grace period over");
		c = next;
	}
}

static void worker_begin_stop(struct worker *w)
{
	if (w->stopping)
		return;
	w->stopping = true;
	struct conn *c = w->conns;
	while (c) {
		struct conn *next = c->next;
		conn_shutdown(c);
		c = next;
	}
	struct timeval tv = {WORKER_STOP_GRACE_SECONDS, 0};
	w->stop_timer = evtimer_new(w->base, worker_on_stop_timer, w);
	if (w->stop_timer)
		evtimer_add(w->stop_timer, &tv);
	worker_maybe_exit(w);
}

/* A connection that could not start (out of memory): one per connect. */
LOG_LIMIT(start_failed_log, "connections that could not start");

static void worker_on_wake(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct worker *w = arg;
	pthread_mutex_lock(&w->lock);
	struct worker_task *task = w->tasks;
	w->tasks = w->tasks_tail = NULL;
	pthread_mutex_unlock(&w->lock);
	while (task) {
		struct worker_task *next = task->next;
		task->run(task);
		task = next;
	}
	for (;;) {
		struct worker_handoff h;
		bool have = false, stop;
		pthread_mutex_lock(&w->lock);
		if (w->pending_count) {
			h = w->pending[0];
			memmove(w->pending, w->pending + 1, --w->pending_count * sizeof(h));
			have = true;
		}
		stop = w->stop_requested;
		pthread_mutex_unlock(&w->lock);
		if (!have) {
			if (stop)
				worker_begin_stop(w);
			break;
		}
		if (w->stopping || stop) {
			close(h.fd);
			access_peer_release(&h.peer);
			continue;
		}
		int rc = session_start(w, h.fd, h.id, &h.peer);
		if (rc < 0)
			log_limited(&start_failed_log, LOG_WARN, "conn %llu: cannot start: %s",
				    (unsigned long long)h.id, strerror(-rc));
	}
	uring_submit(&w->ring);
}

static void worker_on_resume(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct worker *w = arg;
	conn_resume_next(w);
	uring_submit(&w->ring);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	event_base_loop(w->base, EVLOOP_NO_EXIT_ON_EMPTY);
	return NULL;
}

int worker_start(struct worker *w, unsigned index, struct export_table *exports)
{
	memset(w, 0, sizeof(*w));
	w->index = index;
	w->exports = exports;
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
	w->resume = evtimer_new(w->base, worker_on_resume, w);
	if (!w->resume) {
		rc = -ENOMEM;
		goto err_wake;
	}
	rc = -pthread_create(&w->thread, NULL, worker_main, w);
	if (rc < 0)
		goto err_resume;
	return 0;
err_resume:
	event_free(w->resume);
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

void worker_hand_off(struct worker *w, int fd, uint64_t id, const struct access_peer *peer)
{
	pthread_mutex_lock(&w->lock);
	if (w->pending_count == w->pending_cap) {
		size_t cap = w->pending_cap ? w->pending_cap * 2 : 16;
		struct worker_handoff *p = realloc(w->pending, cap * sizeof(*p));
		if (!p) {
			pthread_mutex_unlock(&w->lock);
			log_limited(&start_failed_log, LOG_ERROR,
				    "conn %llu: out of memory handing off", (unsigned long long)id);
			close(fd);
			budget_peer_remove(peer);
			access_peer_release(peer);
			budget_client_remove();
			return;
		}
		w->pending = p;
		w->pending_cap = cap;
	}
	w->pending[w->pending_count++] = (struct worker_handoff){fd, id, *peer};
	pthread_mutex_unlock(&w->lock);
	event_active(w->wake, EV_READ, 0);
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

void worker_join(struct worker *w)
{
	pthread_join(w->thread, NULL);
	for (size_t i = 0; i < w->pending_count; i++)
		close(w->pending[i].fd);
	free(w->pending);
	if (w->stop_timer)
		event_free(w->stop_timer);
	event_free(w->resume);
	event_free(w->wake);
	uring_close(&w->ring);
	event_base_free(w->base);
	pthread_mutex_destroy(&w->lock);
}

void worker_conn_added(struct worker *w, struct conn *c)
{
	c->prev = NULL;
	c->next = w->conns;
	if (w->conns)
		w->conns->prev = c;
	w->conns = c;
	w->conn_count++;
}

void worker_conn_removed(struct worker *w, struct conn *c)
{
	if (c->prev)
		c->prev->next = c->next;
	else
		w->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	w->conn_count--;
	worker_maybe_exit(w);
}
