/*
 * daemon/host.c: see host.h.
 */
#include "daemon/host.h"

#include <errno.h>
#include <event2/event.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/budget.h"
#include "daemon/log.h"
#include "daemon/session.h"

static struct host *host_of(struct worker *w)
{
	return (struct host *)((char *)w - offsetof(struct host, loop));
}

/* The host's events go before the loop ends (worker_join frees the
 * base they belong to), on the worker thread. */
static void host_finish(struct host *h)
{
	if (h->stop_timer)
		event_free(h->stop_timer);
	h->stop_timer = NULL;
	conn_set_free(&h->set);
	worker_exit(&h->loop);
}

static void host_on_empty(struct conn_set *set)
{
	host_finish(host_of(set->worker));
}

static void host_on_stop_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct host *h = arg;
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		if (c->bev)
			conn_kill(c, "shutdown grace period over");
		c = next;
	}
}

/* The loop's stop callback: on the worker thread, after every task
 * posted before the request (hand-offs among them). */
static void host_on_stop(struct worker *w)
{
	struct host *h = host_of(w);
	h->set.stopping = true;
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		conn_shutdown(c);
		c = next;
	}
	struct timeval tv = {HOST_STOP_GRACE_SECONDS, 0};
	h->stop_timer = evtimer_new(w->base, host_on_stop_timer, h);
	if (h->stop_timer)
		evtimer_add(h->stop_timer, &tv);
	if (h->set.count == 0)
		host_finish(h);
}

int host_start(struct host *h, unsigned index, struct export_table *exports)
{
	memset(h, 0, sizeof(*h));
	int rc = worker_start(&h->loop, index, host_on_stop);
	if (rc < 0)
		return rc;
	/* The set's timer belongs to the loop's base: made here, before any
	 * connection (nothing runs on the thread yet but the loop). */
	rc = conn_set_init(&h->set, &h->loop, exports, host_on_empty);
	if (rc < 0) {
		worker_request_stop(&h->loop); /* host_on_stop: no connection */
		worker_join(&h->loop);
	}
	return rc;
}

/* An accepted socket on its way to its thread. */
struct hand_off {
	struct worker_task task;
	struct host *host;
	int fd;
	uint64_t id;
	struct access_peer peer;
};

/* A connection that could not start (out of memory): one per connect. */
LOG_LIMIT(start_failed_log, "connections that could not start");

static void hand_off_run(struct worker_task *task)
{
	struct hand_off *o = (struct hand_off *)task;
	struct host *h = o->host;
	if (h->set.stopping) {
		/* Posted before the stop request, run after it: ended too. */
		close(o->fd);
		budget_peer_remove(&o->peer);
		access_peer_release(&o->peer);
		budget_client_remove();
	} else {
		int rc = session_start(&h->set, o->fd, o->id, &o->peer);
		if (rc < 0)
			log_limited(&start_failed_log, LOG_WARN, "conn %llu: cannot start: %s",
				    (unsigned long long)o->id, strerror(-rc));
	}
	free(o);
}

void host_hand_off(struct host *h, int fd, uint64_t id, const struct access_peer *peer)
{
	struct hand_off *o = malloc(sizeof(*o));
	if (o) {
		*o = (struct hand_off){
		    .task.run = hand_off_run, .host = h, .fd = fd, .id = id, .peer = *peer};
		if (worker_post_if_running(&h->loop, &o->task))
			return;
		free(o);
	} else {
		log_limited(&start_failed_log, LOG_ERROR, "conn %llu: out of memory handing off",
			    (unsigned long long)id);
	}
	close(fd);
	budget_peer_remove(peer);
	access_peer_release(peer);
	budget_client_remove();
}

void host_request_stop(struct host *h)
{
	worker_request_stop(&h->loop);
}

void host_join(struct host *h)
{
	worker_join(&h->loop);
}

void host_budget_wake(struct worker *w)
{
	conn_budget_wake(&host_of(w)->set);
}
