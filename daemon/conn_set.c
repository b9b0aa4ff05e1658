/*
 * daemon/conn_set.c: the connections of one worker thread (struct
 * conn_set, conn.h): the set itself, kept as a list as connections start
 * and are freed, and its queue of yielded connections with the resume
 * timer that gives them their turns (conn_yield).
 */
#include <errno.h>
#include <event2/event.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/conn_internal.h"
#include "daemon/worker.h"

/*
 * The worker's yielded connections wait in a queue (with a reference
 * each), and its resume timer, due at once, gives the first of them its
 * next share: one per turn of the loop, so that a turn costs at most one
 * connection's share whatever the number that flood the worker. A timer,
 * not event_active(): an event made active from a callback runs in the
 * same pass over the active events, before the loop polls again; a timer
 * due now runs after the next poll, with everything that poll found.
 */
static const struct timeval next_turn = {0, 0};

void conn_yield(struct conn *c)
{
	struct conn_set *w = c->set;
	if (c->yielded || !c->bev)
		return;
	c->yielded = true;
	/* The plaintext reader stays in epoll (conn_on_readable reads nothing
	 * meanwhile): taking it out and back costs two epoll_ctl a yield. The
	 * TLS filter is told to stop reading. */
	if (!c->reader)
		conn_read_set(c, false);
	conn_ref(c);
	c->yield_next = NULL;
	if (w->yielded_tail)
		w->yielded_tail->yield_next = c;
	else
		w->yielded_head = c;
	w->yielded_tail = c;
	if (!evtimer_pending(w->resume, NULL))
		evtimer_add(w->resume, &next_turn);
}

/* The resume timer: the first of the yielded connections gets its next
 * share; the timer is armed again while others wait. */
static void conn_resume_next(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct conn_set *w = arg;
	struct conn *c = w->yielded_head;
	if (!c)
		return;
	w->yielded_head = c->yield_next;
	if (!w->yielded_head)
		w->yielded_tail = NULL;
	else
		evtimer_add(w->resume, &next_turn); /* the next one, next turn */
	c->yielded = false;
	if (c->bev && (c->reading || c->sink.left))
		conn_reading_on(c);
	conn_unref(c);
	uring_submit(&w->worker->ring);
}

int conn_set_init(struct conn_set *set, struct worker *w, struct export_table *exports,
		  void (*on_empty)(struct conn_set *set))
{
	memset(set, 0, sizeof(*set));
	set->worker = w;
	set->exports = exports;
	set->on_empty = on_empty;
	set->resume = evtimer_new(w->base, conn_resume_next, set);
	return set->resume ? 0 : -ENOMEM;
}

void conn_set_free(struct conn_set *set)
{
	if (set->resume)
		event_free(set->resume);
	set->resume = NULL;
}

void conn_set_add(struct conn_set *set, struct conn *c)
{
	c->prev = NULL;
	c->next = set->conns;
	if (set->conns)
		set->conns->prev = c;
	set->conns = c;
	set->count++;
}

void conn_set_remove(struct conn_set *set, struct conn *c)
{
	if (c->prev)
		c->prev->next = c->next;
	else
		set->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	set->count--;
	if (set->stopping && set->count == 0 && set->on_empty)
		set->on_empty(set);
}
