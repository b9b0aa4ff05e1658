/*
 * daemon/worker.h: a worker thread: its own libevent event_base, its own
 * io_uring and a queue of tasks other threads post to it.
 *
 * Owns: the thread, its event loop, its ring and its task queue; nothing
 * of what runs on it. The connection host (daemon/host.h) runs the client
 * connections on worker threads; the cache's writeback and the control
 * socket each run one of their own; the backends and the budget post
 * their completions and wake-ups to them (worker_post). The cross-thread
 * entries (worker_post, worker_post_if_running, worker_request_stop) go
 * through its queue (daemon/queue.h: under the worker's mutex, its loop
 * woken with event_active()); everything else runs on the worker's own
 * thread without locks.
 *
 * Stopping: worker_request_stop() makes the thread run, after the tasks
 * posted before it, the on_stop callback given to worker_start(): whoever
 * runs things on the thread ends them there and then calls worker_exit()
 * (at once, or once they are done). Without a callback the loop ends at
 * once. worker_join() waits for the thread.
 */
#ifndef NBDCACHED_DAEMON_WORKER_H
#define NBDCACHED_DAEMON_WORKER_H

#include <pthread.h>
#include <stdbool.h>

#include "daemon/queue.h"
#include "daemon/uring.h"

/*
 * Work for a worker thread, posted from any thread (worker_post): a callback
 * the worker runs on its own thread. Intrusive, so posting never allocates;
 * a task may be posted again once its callback has started.
 */
struct worker_task {
	void (*run)(struct worker_task *task);
	struct queue_link link;
};

struct worker {
	unsigned index;
	pthread_t thread;
	struct event_base *base;
	struct uring ring;
	struct event *wake;
	void (*on_stop)(struct worker *w); /* worker_start's; NULL: exit at once */

	pthread_mutex_t lock; /* guards tasks */
	struct queue tasks;   /* worker_task.link; its stop is worker_request_stop's */

	bool stop_seen; /* worker thread: on_stop has run */
};

/* Start the thread. on_stop: see above (NULL: the loop ends on a stop
 * request). 0 or -errno. */
int worker_start(struct worker *w, unsigned index, void (*on_stop)(struct worker *w));
/* Thread-safe: run task->run(task) on the worker's thread soon. */
void worker_post(struct worker *w, struct worker_task *task);
/* Thread-safe: worker_post() unless the worker was asked to stop (false:
 * not posted). A task posted before the stop request still runs. */
bool worker_post_if_running(struct worker *w, struct worker_task *task);
/* Thread-safe: run on_stop on the worker's thread (or end the loop). */
void worker_request_stop(struct worker *w);
/* Worker thread: end the loop (after the callback that calls it). */
void worker_exit(struct worker *w);
/* Wait for the thread, then free the loop and the ring. */
void worker_join(struct worker *w);

#endif
