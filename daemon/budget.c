/*
 * daemon/budget.c: see budget.h.
 *
 * The counts are plain atomics; a reservation is a compare-and-swap loop so
 * that two workers cannot both take the last room. Waiting connections are
 * counted per worker; a release that finds waiters posts one wake task to
 * each worker that has some (never twice while one is pending), and the
 * worker retries its waiting connections on its own thread.
 *
 *   release --waiting > 0?--> for each worker with waiters:
 *                               posted? no --> worker_post(wake task)
 *   wake task (worker thread): posted = false; wake(w)
 *
 * A connection registers (budget_wait) before it asks again, and a release
 * subtracts before it looks for waiters: with sequentially consistent
 * atomics one of the two sees the other, so no wake-up is lost.
 */
#include "daemon/budget.h"

#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/worker.h"

struct budget_slot {
	struct worker *worker;
	struct worker_task task;
	atomic_uint waiting;	     /* connections of this worker that wait */
	atomic_uint_least64_t least; /* the smallest cost one of them waits for */
	atomic_bool posted;	     /* the task is posted and has not started */
};

static struct {
	unsigned max_clients;
	uint64_t max_reply_bytes, max_pinned_bytes;
	atomic_uint clients;
	atomic_uint_least64_t refused, reply_bytes, pinned_bytes;
	atomic_uint_least64_t copied_replies, copied_bytes, waits;
	atomic_uint_least64_t refused_per_client, refused_access;
	atomic_uint waiting; /* all workers' waiting connections */
	struct budget_slot *slots;
	unsigned slot_count;
	void (*wake)(struct worker *w);
	pthread_mutex_t post_lock; /* posting against budget_stop */
	bool stopped;
} budget = {.post_lock = PTHREAD_MUTEX_INITIALIZER};

static void wake_task(struct worker_task *task)
{
	struct budget_slot *s =
	    (struct budget_slot *)((char *)task - offsetof(struct budget_slot, task));
	atomic_store(&s->posted, false);
	/* The connections still refused say again what they wait for. */
	atomic_store(&s->least, UINT64_MAX);
	budget.wake(s->worker);
}

int budget_start(const struct options *opts, struct worker *const *workers, unsigned count,
		 void (*wake)(struct worker *w))
{
	budget.slots = calloc(count ? count : 1, sizeof(*budget.slots));
	if (!budget.slots)
		return -ENOMEM;
	budget.slot_count = count;
	budget.max_clients = opts->max_clients;
	budget.max_reply_bytes = opts->max_reply_memory;
	budget.max_pinned_bytes = options_pinned_replies(opts);
	budget.wake = wake;
	for (unsigned i = 0; i < count; i++) {
		budget.slots[i].worker = workers[i];
		budget.slots[i].task.run = wake_task;
		atomic_store(&budget.slots[i].least, UINT64_MAX);
	}
	return 0;
}

void budget_stop(void)
{
	pthread_mutex_lock(&budget.post_lock);
	budget.stopped = true;
	pthread_mutex_unlock(&budget.post_lock);
}

void budget_free(void)
{
	free(budget.slots);
	budget.slots = NULL;
	budget.slot_count = 0;
}

bool budget_client_add(void)
{
	unsigned n = atomic_load(&budget.clients);
	do {
		if (budget.max_clients && n >= budget.max_clients) {
			atomic_fetch_add(&budget.refused, 1);
			return false;
		}
	} while (!atomic_compare_exchange_weak(&budget.clients, &n, n + 1));
	return true;
}

void budget_client_remove(void)
{
	atomic_fetch_sub(&budget.clients, 1);
}

/*
 * Connections per client: a hash table of counts under one mutex, taken
 * twice per connection (accept and free). An entry goes when its count
 * reaches 0, so the table holds at most one entry per connection.
 */
#define PEER_BUCKETS 1024

struct peer_count {
	uint8_t key[17]; /* 16 address bytes, or 'u' and the uid */
	unsigned count;
	struct peer_count *next;
};

static struct {
	pthread_mutex_t lock;
	struct peer_count *buckets[PEER_BUCKETS];
} peers = {.lock = PTHREAD_MUTEX_INITIALIZER};

static unsigned peer_key(const struct access_peer *p, uint8_t key[17])
{
	memset(key, 0, 17);
	if (p->is_unix) {
		key[0] = 'u';
		memcpy(key + 1, &p->uid, sizeof(p->uid));
		key[16] = 1;
	} else {
		memcpy(key, p->addr, 16);
	}
	uint32_t h = 2166136261u; /* FNV-1a */
	for (int i = 0; i < 17; i++)
		h = (h ^ key[i]) * 16777619u;
	return h % PEER_BUCKETS;
}

bool budget_peer_add(const struct access_peer *p, unsigned limit)
{
	uint8_t key[17];
	unsigned b = peer_key(p, key);
	bool ok = true;
	pthread_mutex_lock(&peers.lock);
	struct peer_count *e = peers.buckets[b];
	while (e && memcmp(e->key, key, sizeof(key)) != 0)
		e = e->next;
	if (e && limit && e->count >= limit) {
		atomic_fetch_add(&budget.refused_per_client, 1);
		ok = false;
	} else if (e) {
		e->count++;
	} else {
		e = calloc(1, sizeof(*e));
		if (e) {
			memcpy(e->key, key, sizeof(key));
			e->count = 1;
			e->next = peers.buckets[b];
			peers.buckets[b] = e;
		} else {
			ok = false;
		}
	}
	pthread_mutex_unlock(&peers.lock);
	return ok;
}

void budget_count_refused_access(void)
{
	atomic_fetch_add(&budget.refused_access, 1);
}

void budget_peer_remove(const struct access_peer *p)
{
	uint8_t key[17];
	unsigned b = peer_key(p, key);
	pthread_mutex_lock(&peers.lock);
	struct peer_count **link = &peers.buckets[b];
	while (*link && memcmp((*link)->key, key, sizeof(key)) != 0)
		link = &(*link)->next;
	struct peer_count *e = *link;
	if (e && --e->count == 0) {
		*link = e->next;
		free(e);
	}
	pthread_mutex_unlock(&peers.lock);
}

bool budget_reserve(uint64_t cost, uint64_t held)
{
	if (held + cost <= BUDGET_CONN_RESERVE) {
		atomic_fetch_add(&budget.reply_bytes, cost);
		return true;
	}
	uint64_t used = atomic_load(&budget.reply_bytes);
	do {
		if (used + cost > budget.max_reply_bytes)
			return false;
	} while (!atomic_compare_exchange_weak(&budget.reply_bytes, &used, used + cost));
	return true;
}

void budget_add(uint64_t bytes)
{
	atomic_fetch_add(&budget.reply_bytes, bytes);
}

bool budget_has_room(void)
{
	return atomic_load(&budget.reply_bytes) < budget.max_reply_bytes;
}

/*
 * Wake the workers whose waiting connections may fit now. Only those: a
 * well-behaved client's every reply gives bytes back, and retrying 32
 * refused 32 MiB requests after each of its 4 KiB reads would cost it most
 * of its speed.
 */
static void wake_waiters(void)
{
	if (atomic_load(&budget.waiting) == 0)
		return;
	uint64_t used = atomic_load(&budget.reply_bytes);
	for (unsigned i = 0; i < budget.slot_count; i++) {
		struct budget_slot *s = &budget.slots[i];
		uint64_t least = atomic_load(&s->least);
		if (!atomic_load(&s->waiting) ||
		    used + (least ? least : 1) > budget.max_reply_bytes ||
		    atomic_exchange(&s->posted, true))
			continue;
		/* The lock only orders posting against budget_stop(). */
		pthread_mutex_lock(&budget.post_lock);
		if (!budget.stopped)
			worker_post(s->worker, &s->task);
		pthread_mutex_unlock(&budget.post_lock);
	}
}

void budget_release(uint64_t bytes)
{
	if (!bytes)
		return;
	atomic_fetch_sub(&budget.reply_bytes, bytes);
	wake_waiters();
}

void budget_wait_more(struct worker *w, uint64_t cost)
{
	if (w->index >= budget.slot_count)
		return;
	atomic_uint_least64_t *least = &budget.slots[w->index].least;
	uint64_t now = atomic_load(least);
	while (cost < now && !atomic_compare_exchange_weak(least, &now, cost))
		;
}

void budget_wait(struct worker *w, uint64_t cost)
{
	atomic_fetch_add(&budget.waits, 1);
	budget_wait_more(w, cost);
	if (w->index < budget.slot_count)
		atomic_fetch_add(&budget.slots[w->index].waiting, 1);
	atomic_fetch_add(&budget.waiting, 1);
}

bool budget_fits(uint64_t cost, uint64_t held)
{
	if (held + cost <= BUDGET_CONN_RESERVE)
		return true;
	if (cost == 0)
		return budget_has_room();
	return atomic_load(&budget.reply_bytes) + cost <= budget.max_reply_bytes;
}

void budget_wait_done(struct worker *w)
{
	if (w->index < budget.slot_count)
		atomic_fetch_sub(&budget.slots[w->index].waiting, 1);
	atomic_fetch_sub(&budget.waiting, 1);
}

bool budget_pin(uint64_t bytes, bool force)
{
	uint64_t pinned = atomic_load(&budget.pinned_bytes);
	do {
		if (!force && pinned + bytes > budget.max_pinned_bytes)
			return false;
	} while (!atomic_compare_exchange_weak(&budget.pinned_bytes, &pinned, pinned + bytes));
	return true;
}

void budget_unpin(uint64_t bytes)
{
	atomic_fetch_sub(&budget.pinned_bytes, bytes);
}

void budget_count_copy(uint64_t bytes)
{
	atomic_fetch_add(&budget.copied_replies, 1);
	atomic_fetch_add(&budget.copied_bytes, bytes);
}

bool budget_trim_tick(void)
{
	static uint64_t high; /* the control thread's only */
	uint64_t now = atomic_load(&budget.reply_bytes);
	if (now > high)
		high = now;
	if (high - now < BUDGET_TRIM_BYTES)
		return false;
	high = now;
	malloc_trim(0);
	return true;
}

void budget_get_stats(struct budget_stats *out)
{
	*out = (struct budget_stats){
	    .clients = atomic_load(&budget.clients),
	    .max_clients = budget.max_clients,
	    .refused_clients = atomic_load(&budget.refused),
	    .reply_bytes = atomic_load(&budget.reply_bytes),
	    .max_reply_bytes = budget.max_reply_bytes,
	    .pinned_reply_bytes = atomic_load(&budget.pinned_bytes),
	    .max_pinned_reply_bytes = budget.max_pinned_bytes,
	    .copied_replies = atomic_load(&budget.copied_replies),
	    .copied_reply_bytes = atomic_load(&budget.copied_bytes),
	    .budget_waits = atomic_load(&budget.waits),
	    .refused_per_client = atomic_load(&budget.refused_per_client),
	    .refused_access = atomic_load(&budget.refused_access),
	};
}
