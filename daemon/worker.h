/*
 * daemon/worker.h: worker threads, each with its own libevent event_base and
 * its own io_uring.
 *
 * Owns: the thread, its event loop, its ring and the connections it serves.
 * The listener thread hands accepted sockets over with worker_hand_off()
 * (the only cross-thread entry, with worker_request_stop(); both take the
 * worker's mutex and wake its loop with event_active()). Everything else in
 * a worker runs on its own thread without locks.
 */
#ifndef NBDCACHED_DAEMON_WORKER_H
#define NBDCACHED_DAEMON_WORKER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/access.h"
#include "daemon/uring.h"

struct conn;
struct export_table;

struct worker_handoff {
	int fd;
	uint64_t id;
	struct access_peer peer;
};

/*
 * Work for a worker thread, posted from any thread (worker_post): a callback
 * the worker runs on its own thread. Intrusive, so posting never allocates;
 * a task may be posted again once its callback has started.
 */
struct worker_task {
	void (*run)(struct worker_task *task);
	struct worker_task *next;
};

struct worker {
	unsigned index;
	pthread_t thread;
	struct event_base *base;
	struct uring ring;
	struct event *wake;
	struct event *stop_timer;
	struct export_table *exports;

	pthread_mutex_t lock; /* guards pending, tasks and stop_requested */
	struct worker_task *tasks, *tasks_tail;
	struct worker_handoff *pending;
	size_t pending_count, pending_cap;
	bool stop_requested;

	bool stopping; /* worker-thread copy of stop_requested */
	struct conn *conns;
	unsigned conn_count;
	/* Connections that had their share of a turn (conn_yield), first
	 * resumed first, one per turn by the resume timer. */
	struct conn *yielded_head, *yielded_tail;
	struct event *resume;
};

int worker_start(struct worker *w, unsigned index, struct export_table *exports);
/* Thread-safe: give an accepted socket to this worker. Takes ownership of fd. */
void worker_hand_off(struct worker *w, int fd, uint64_t id, const struct access_peer *peer);
/* Thread-safe: run task->run(task) on the worker's thread soon. */
void worker_post(struct worker *w, struct worker_task *task);
/* Thread-safe: worker_post() unless the worker was asked to stop (false:
 * not posted). A task posted before the stop request still runs. */
bool worker_post_if_running(struct worker *w, struct worker_task *task);
/* Thread-safe: finish in-flight requests, close connections, end the thread. */
void worker_request_stop(struct worker *w);
void worker_join(struct worker *w);

/* Worker thread only: connection bookkeeping (conn.c). */
void worker_conn_added(struct worker *w, struct conn *c);
void worker_conn_removed(struct worker *w, struct conn *c);

#endif
