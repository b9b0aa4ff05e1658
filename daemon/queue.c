/*
 * daemon/queue.c: see queue.h.
 *
 * The wake-up comes after the unlock, as it always did in each owner: the
 * thread, woken, takes the lock at once, and finds the item there.
 */
#include "daemon/queue.h"

#include <event2/event.h>
#include <stdint.h>
#include <unistd.h>

static void init(struct queue *q, pthread_mutex_t *lock, struct event *wake_event, int wake_fd)
{
	q->lock = lock;
	q->head = q->tail = NULL;
	q->stopping = false;
	q->wake_event = wake_event;
	q->wake_fd = wake_fd;
}

void queue_init_event(struct queue *q, pthread_mutex_t *lock, struct event *wake)
{
	init(q, lock, wake, -1);
}

void queue_init_eventfd(struct queue *q, pthread_mutex_t *lock, int wake_fd)
{
	init(q, lock, NULL, wake_fd);
}

void queue_wake(struct queue *q)
{
	if (q->wake_event) {
		event_active(q->wake_event, EV_READ, 0);
	} else {
		uint64_t one = 1;
		ssize_t n = write(q->wake_fd, &one, sizeof(one));
		(void)n; /* a full counter wakes it as well */
	}
}

/* Queue link unless only_running and the thread was asked to stop. */
static bool post(struct queue *q, struct queue_link *link, bool only_running)
{
	link->next = NULL;
	pthread_mutex_lock(q->lock);
	bool queued = !only_running || !q->stopping;
	if (queued) {
		if (q->tail)
			q->tail->next = link;
		else
			q->head = link;
		q->tail = link;
	}
	pthread_mutex_unlock(q->lock);
	if (queued)
		queue_wake(q);
	return queued;
}

void queue_post(struct queue *q, struct queue_link *link)
{
	post(q, link, false);
}

bool queue_post_unless_stopped(struct queue *q, struct queue_link *link)
{
	return post(q, link, true);
}

void queue_stop(struct queue *q)
{
	pthread_mutex_lock(q->lock);
	q->stopping = true;
	pthread_mutex_unlock(q->lock);
	queue_wake(q);
}

struct queue_link *queue_take_locked(struct queue *q, bool *stop)
{
	struct queue_link *all = q->head;
	q->head = q->tail = NULL;
	if (stop)
		*stop = q->stopping;
	return all;
}

struct queue_link *queue_take(struct queue *q, bool *stop)
{
	pthread_mutex_lock(q->lock);
	struct queue_link *all = queue_take_locked(q, stop);
	pthread_mutex_unlock(q->lock);
	return all;
}
