/*
 * daemon/cache/wake.c: waking whoever waits for the cache to change (the
 * index layer, internal.h): the waitq, on which operations and flush
 * rounds wait for a fill, a writeback or a direct operation to end, and
 * the wake-ups of the background threads (struct cache_kick, struct
 * cache_nudge), rung without knowing the threads.
 */
#include "daemon/cache/internal.h"

uint64_t cache_waitq_seq(struct cache *c)
{
	return atomic_load(&c->waitq.seq);
}

bool cache_waitq_wait(struct cache *c, struct cache_waiter *w, uint64_t seq)
{
	struct cache_waitq *q = &c->waitq;
	pthread_mutex_lock(&q->lock);
	atomic_fetch_add(&q->waiters, 1);
	if (atomic_load(&q->seq) != seq) {
		atomic_fetch_sub(&q->waiters, 1);
		pthread_mutex_unlock(&q->lock);
		return false;
	}
	w->next = q->head;
	q->head = w;
	pthread_mutex_unlock(&q->lock);
	return true;
}

void cache_waitq_wake(struct cache *c)
{
	struct cache_waitq *q = &c->waitq;
	atomic_fetch_add(&q->seq, 1);
	if (atomic_load(&q->waiters) == 0)
		return;
	pthread_mutex_lock(&q->lock);
	struct cache_waiter *w = q->head;
	q->head = NULL;
	atomic_store(&q->waiters, 0);
	pthread_mutex_unlock(&q->lock);
	while (w) {
		struct cache_waiter *next = w->next;
		worker_post(w->worker, &w->task);
		w = next;
	}
}

void cache_kick_writeback(struct cache *c)
{
	struct cache_kick *k = &c->kick;
	if (!k->worker || atomic_exchange(&k->pending, true))
		return;
	worker_post(k->worker, &k->task);
}

void cache_nudge_compactor(struct cache *c)
{
	struct cache_nudge *n = &c->nudge;
	if (atomic_exchange(&n->nudged, true))
		return;
	pthread_mutex_lock(&n->lock);
	pthread_cond_signal(&n->cond);
	pthread_mutex_unlock(&n->lock);
}
