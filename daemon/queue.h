/*
 * daemon/queue.h: work posted from any thread to one thread: a FIFO of
 * intrusive links, the stop request that goes with it, and the wake-up of
 * the thread that takes them.
 *
 *   posters (any thread)       the queue (under *lock)        its thread
 *   queue_post() -------> head -> ... -> tail    --wake-->  queue_take():
 *   queue_stop() -------> stopping                          all of it, oldest
 *                                                           first, and stopping
 *
 * Used by the worker threads (daemon/worker.c: tasks, the loop woken with
 * event_active()), the NBD backend's thread (requests to start, the same)
 * and the rbd backend's completion thread (block status, its poll() woken
 * through an eventfd; its stop is the backend's own, shared with the guard
 * thread, not the queue's).
 *
 * Owns: the links of what is queued and the stopping flag. Not the lock:
 * that is the owner's mutex, which may guard more of the owner's state
 * (the rbd backend's tickets). An owner that takes some of that state
 * together with the queue, in one locked section (the NBD backend's renew
 * size), holds the lock itself and calls queue_take_locked(), and calls
 * queue_wake() when it has changed that state. Not the wake-up either: the
 * owner creates and frees its event or eventfd (and reads the eventfd once
 * woken); the queue only fires it.
 *
 * Locking: head, tail and stopping are guarded by *lock. queue_post(),
 * queue_post_unless_stopped(), queue_stop() and queue_take() take it; the
 * wake-up is fired after it is dropped, once per call, never per item
 * taken. Posting never allocates.
 *
 * Order: the thread takes everything at once, oldest first, with the stop
 * request read under the same lock: whatever was posted before
 * queue_stop() returned is taken with the stop or before it.
 */
#ifndef NBDCACHED_DAEMON_QUEUE_H
#define NBDCACHED_DAEMON_QUEUE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

struct event;

/* Embedded in what is posted; linked only while it is queued. */
struct queue_link {
	struct queue_link *next;
};

/* The struct a link is embedded in: QUEUE_ENTRY(l, struct worker_task, link). */
#define QUEUE_ENTRY(l, type, member) ((type *)((char *)(l) - offsetof(type, member)))

struct queue {
	pthread_mutex_t *lock; /* the owner's */
	struct queue_link *head, *tail;
	struct event *wake_event; /* event_active() on it, or (NULL) ... */
	int wake_fd;		  /* ... a write to this eventfd */
	bool stopping;
};

/* Empty, guarded by lock, waking its thread with event_active(wake) (an
 * event of the thread's loop) or by a write to the eventfd wake_fd. */
void queue_init_event(struct queue *q, pthread_mutex_t *lock, struct event *wake);
void queue_init_eventfd(struct queue *q, pthread_mutex_t *lock, int wake_fd);

/* Any thread: queue link and wake the thread. */
void queue_post(struct queue *q, struct queue_link *link);
/* Any thread: queue_post() unless queue_stop() was called (false: not
 * queued, no wake-up). */
bool queue_post_unless_stopped(struct queue *q, struct queue_link *link);
/* Any thread: ask the thread to stop, and wake it. */
void queue_stop(struct queue *q);
/* Any thread, *lock not held: wake the thread (the owner changed some
 * other state under *lock that the thread takes with the queue). */
void queue_wake(struct queue *q);

/* The thread: everything queued, oldest first (follow ->next; read it
 * before handing an item on, which may post it again), the queue left
 * empty; *stop (if not NULL): queue_stop() was called. */
struct queue_link *queue_take(struct queue *q, bool *stop);
/* The same, *lock held by the caller. */
struct queue_link *queue_take_locked(struct queue *q, bool *stop);

#endif
