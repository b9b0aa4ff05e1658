/*
 * daemon/backend/nbd_thread.c: the NBD backend's thread, with its own
 * libevent loop, and the backend_ops the daemon calls.
 *
 *   worker --submit--> queue --wake--> backend thread --aio--> server
 *   worker <--post---- done  <-------- free callback  <------- reply
 *
 * backend_submit() may be called from any worker: nbd_submit() queues the
 * request (daemon/queue.h, under nb->lock) and wakes the thread, which
 * starts it (nbd_io.c). The loop's handlers (the wake-up, each slot's
 * timer and socket, the deadline tick) are all here, so what runs on the
 * thread is seen in one place: each asks nbd_pool.c to react, then
 * nbd_io.c to move the requests along.
 */
#include <errno.h>
#include <event2/event.h>
#include <libnbd.h>
#include <pthread.h>
#include <stdlib.h>

#include "daemon/backend/nbd_internal.h"
#include "daemon/clock.h"
#include "daemon/log.h"

/*
 * The event handlers: each lets nbd_pool.c react to its event, sends the
 * requests that waited for a connection when one became ready, and then
 * moves along every request a libnbd callback touched meanwhile.
 */
static void on_conn_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_conn *c = arg;
	if (nbd_pool_on_timer(c))
		nbd_io_issue_waiting(c->nb);
	nbd_io_process_deferred(c->nb);
}

static void on_conn_event(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	struct nbd_conn *c = arg;
	if (c->state != CONN_CONNECTING && c->state != CONN_READY && c->state != CONN_RETIRING)
		return;
	if (nbd_pool_on_event(c, what))
		nbd_io_issue_waiting(c->nb);
	nbd_io_process_deferred(c->nb);
}

/*
 * A connection whose oldest command has had no reply for --backend-timeout
 * is dead; if no connection had any reply meanwhile, the server is silent
 * and every connection is closed. Their requests are sent again while
 * their time lasts. Until a handshake succeeds again, requests that find
 * no connection fail at once (they would only wait as long again); others
 * fail with EIO once they have waited --backend-timeout for a connection.
 */
static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	uint64_t now = clock_now_ns();
	nbd_pool_expire(nb, now);
	nbd_io_expire_waiting(nb, now);
	nbd_io_process_deferred(nb);
	if (nbd_pool_tick_needed(nb))
		nbd_pool_tick_arm(nb);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct nbd_backend *nb = arg;
	bool stop;
	pthread_mutex_lock(&nb->lock);
	struct queue_link *l = queue_take_locked(&nb->submitted, &stop);
	uint64_t renew = nb->renew_size;
	nb->renew_size = 0;
	pthread_mutex_unlock(&nb->lock);
	/* Before the requests queued with it: one past the old end may be among them. */
	if (renew)
		nbd_pool_renew(nb, renew);
	while (l) {
		struct backend_io *io = QUEUE_ENTRY(l, struct backend_io, posted);
		l = l->next;
		nbd_io_start(nb, io);
	}
	nbd_io_process_deferred(nb);
	if (stop)
		event_base_loopexit(nb->loop, NULL);
}

static void nbd_submit(struct backend *be, struct backend_io *io)
{
	queue_post(&to_nbd(be)->submitted, &io->posted);
}

void nbd_renew(struct nbd_backend *nb, uint64_t size)
{
	pthread_mutex_lock(&nb->lock);
	nb->renew_size = size;
	pthread_mutex_unlock(&nb->lock);
	queue_wake(&nb->submitted);
}

static void *backend_thread(void *arg)
{
	struct nbd_backend *nb = arg;
	struct nbd_conn *first = &nb->conns[0];
	if (nbd_pool_settle(first))
		nbd_pool_set_want(nb, first->multi_conn ? nb->max_conns : 1);
	event_base_loop(nb->loop, EVLOOP_NO_EXIT_ON_EMPTY);
	return NULL;
}

static int nbd_start(struct backend *be)
{
	struct nbd_backend *nb = to_nbd(be);
	nb->loop = event_base_new();
	if (!nb->loop)
		return -ENOMEM;
	nb->wake = event_new(nb->loop, -1, 0, on_wake, nb);
	nb->tick = evtimer_new(nb->loop, on_tick, nb);
	nb->on_conn_event = on_conn_event;
	if (!nb->wake || !nb->tick)
		return -ENOMEM;
	queue_init_event(&nb->submitted, &nb->lock, nb->wake);
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		nb->conns[i].timer = evtimer_new(nb->loop, on_conn_timer, &nb->conns[i]);
		if (!nb->conns[i].timer)
			return -ENOMEM;
	}
	int rc = -pthread_create(&nb->thread, NULL, backend_thread, nb);
	if (rc == 0)
		nb->started = true;
	return rc;
}

void nbd_backend_free(struct nbd_backend *nb)
{
	if (nb->argv)
		for (char **a = nb->argv; *a; a++)
			free(*a);
	free(nb->argv);
	free(nb->uri);
	free(nb->name);
	pthread_mutex_destroy(&nb->lock);
	free(nb);
}

/*
 * After the thread: every request must have come back by now (the workers
 * wait for theirs). Any left cannot be answered (their workers are gone);
 * say so. Closing a handle frees what libnbd still holds (chunk_free).
 */
static void nbd_backend_close(struct backend *be)
{
	struct nbd_backend *nb = to_nbd(be);
	if (nb->started) {
		queue_stop(&nb->submitted);
		pthread_join(nb->thread, NULL);
	}
	bool left = nb->waiting || nb->submitted.head || nb->deferred;
	if (nbd_pool_teardown(nb))
		left = true;
	while (nb->drains)
		nbd_drain_end(nb->drains);
	if (left)
		log_error("backend %s: closed with requests unanswered", nb->name);
	if (nb->wake)
		event_free(nb->wake);
	if (nb->tick)
		event_free(nb->tick);
	if (nb->loop)
		event_base_free(nb->loop);
	nbd_backend_free(nb);
}

const struct backend_ops nbd_backend_ops = {
    .kind = "nbd",
    .submit = nbd_submit,
    .start = nbd_start,
    .close = nbd_backend_close,
    .probe_size = nbd_probe_size,
    .set_size = nbd_set_size,
};
