/*
 * daemon/qos.c: token buckets and an export's limiter (see qos.h).
 *
 * A bucket earns rate tokens a second up to its burst; a request takes its
 * cost. A cost above the burst could never be had whole, so a full bucket
 * gives it anyway and goes into debt: the next requests wait until the
 * debt is paid, and the rate holds on average. A bucket is its
 * theoretical arrival time (qos.h), a double of nanoseconds: exact to the
 * nanosecond for 2^53 ns (104 days) of the monotonic clock, to a few ns
 * after, far finer than one token's time at any rate worth limiting to;
 * on every ABI the same arithmetic (no 128-bit products).
 *
 * A request is admitted when all four of its buckets allow it (the
 * export's requests and bytes, its client's requests and bytes): either it
 * takes from all of them, or from none and is told how long the slowest
 * needs. Without a lock: two workers that find the last tokens at once
 * both take them, and the buckets carry the difference as a debt.
 *
 * A client's buckets are not its connection's: a client that empties them,
 * disconnects and connects again must find them as it left them, or a
 * limit of 50 a second gives thousands to a loop of connect, burst,
 * disconnect. So the last connection's put leaves the client idle on the
 * list, and it is freed only once its buckets would be full again (their
 * tat is past), when it is the same as a new one. The list is swept at
 * each get, put and set of limits, under the lock it already takes.
 */
#include "daemon/qos.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/access.h"
#include "daemon/option_values.h"

#define NS_PER_S 1000000000.0

/* ---- keys and values ---- */

static struct qos_rate *rate_of(struct qos_limits *l, const char *key, bool *burst, bool *bytes,
				int *index)
{
	static const struct {
		const char *name;
		size_t offset;
		bool burst, bytes;
	} keys[] = {
	    {"iops-limit", offsetof(struct qos_limits, iops), false, false},
	    {"iops-burst", offsetof(struct qos_limits, iops), true, false},
	    {"bytes-limit", offsetof(struct qos_limits, bytes), false, true},
	    {"bytes-burst", offsetof(struct qos_limits, bytes), true, true},
	    {"client-iops-limit", offsetof(struct qos_limits, client_iops), false, false},
	    {"client-iops-burst", offsetof(struct qos_limits, client_iops), true, false},
	    {"client-bytes-limit", offsetof(struct qos_limits, client_bytes), false, true},
	    {"client-bytes-burst", offsetof(struct qos_limits, client_bytes), true, true},
	};
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		if (strcmp(key, keys[i].name) == 0) {
			*index = (int)i;
			*burst = keys[i].burst;
			*bytes = keys[i].bytes;
			return (struct qos_rate *)((char *)l + keys[i].offset);
		}
	}
	return NULL;
}

int qos_key_index(const char *key)
{
	struct qos_limits l;
	bool burst, bytes;
	int index = -1;
	rate_of(&l, key, &burst, &bytes, &index);
	return index;
}

bool qos_is_key(const char *key)
{
	return qos_key_index(key) >= 0;
}

int qos_limits_set(struct qos_limits *l, const char *key, const char *value, char *err,
		   size_t errlen)
{
	bool burst, bytes;
	int index;
	struct qos_rate *r = rate_of(l, key, &burst, &bytes, &index);
	if (!r)
		return 0;
	uint64_t v = 0;
	if (strcmp(value, "off") != 0 && (options_parse_size(value, &v) < 0 || v > QOS_MAX_RATE))
		return options_fail(err, errlen, -EINVAL,
				    "%s %s: expected %s (K, M, G, T: binary multiples), or 0 or "
				    "off for %s",
				    key, value,
				    bytes ? (burst ? "a number of bytes" : "bytes a second")
					  : (burst ? "a number of requests" : "requests a second"),
				    burst ? "one second's worth" : "no limit");
	*(burst ? &r->burst : &r->rate) = v;
	return 1;
}

bool qos_limits_any(const struct qos_limits *l)
{
	return l->iops.rate || l->bytes.rate || l->client_iops.rate || l->client_bytes.rate;
}

void qos_limits_describe(const struct qos_limits *l, char *buf, size_t len)
{
	const struct {
		const char *name, *unit;
		const struct qos_rate *r;
	} rates[] = {{"iops", "", &l->iops},
		     {"bytes", "/s", &l->bytes},
		     {"client iops", "", &l->client_iops},
		     {"client bytes", "/s", &l->client_bytes}};
	size_t at = 0;
	buf[0] = '\0';
	for (size_t i = 0; i < sizeof(rates) / sizeof(rates[0]); i++) {
		const struct qos_rate *r = rates[i].r;
		if (!r->rate || at >= len)
			continue;
		int n = snprintf(buf + at, len - at, "%s%s %llu%s (burst %llu)", at ? ", " : "",
				 rates[i].name, (unsigned long long)r->rate, rates[i].unit,
				 (unsigned long long)(r->burst ? r->burst : r->rate));
		at += n > 0 ? (size_t)n : 0;
	}
	if (!buf[0])
		snprintf(buf, len, "none");
}

/* ---- the bucket ---- */

static double tat_of(struct qos_bucket *b)
{
	uint64_t bits = atomic_load_explicit(&b->tat, memory_order_relaxed);
	double d;
	memcpy(&d, &bits, sizeof(d));
	return d;
}

static uint64_t bits_of(double d)
{
	uint64_t bits;
	memcpy(&bits, &d, sizeof(bits));
	return bits;
}

double qos_bucket_tokens(struct qos_bucket *b, uint64_t now)
{
	uint64_t rate = atomic_load_explicit(&b->rate, memory_order_relaxed);
	uint64_t burst = atomic_load_explicit(&b->burst, memory_order_relaxed);
	if (!rate)
		return (double)burst;
	double ahead = tat_of(b) - (double)now;
	return (double)burst - (ahead > 0 ? ahead * (double)rate / NS_PER_S : 0);
}

void qos_bucket_set(struct qos_bucket *b, uint64_t rate, uint64_t burst, uint64_t now)
{
	if (!burst)
		burst = rate;
	/* From unlimited: full; else what it holds now, at most the new burst. */
	double tokens = atomic_load(&b->rate) ? qos_bucket_tokens(b, now) : (double)burst;
	if (tokens > (double)burst)
		tokens = (double)burst;
	double tat = (double)now;
	if (rate)
		tat += ((double)burst - tokens) * NS_PER_S / (double)rate;
	atomic_store(&b->tat, bits_of(tat));
	atomic_store(&b->burst, burst);
	atomic_store(&b->rate, rate);
}

uint64_t qos_bucket_wait(struct qos_bucket *b, uint64_t cost, uint64_t now)
{
	uint64_t rate = atomic_load_explicit(&b->rate, memory_order_relaxed);
	if (!rate || !cost)
		return 0;
	uint64_t burst = atomic_load_explicit(&b->burst, memory_order_relaxed);
	uint64_t need = cost < burst ? cost : burst;
	/* It holds need once tat - now <= (burst - need) / rate s. */
	double ns = tat_of(b) - (double)now - (double)(burst - need) * NS_PER_S / (double)rate;
	if (ns <= 0)
		return 0;
	return ns < 1.0 ? 1 : (uint64_t)ns + 1;
}

void qos_bucket_take(struct qos_bucket *b, uint64_t cost, uint64_t now)
{
	uint64_t rate = atomic_load_explicit(&b->rate, memory_order_relaxed);
	if (!rate || !cost)
		return;
	double step = (double)cost * NS_PER_S / (double)rate;
	uint64_t old = atomic_load_explicit(&b->tat, memory_order_relaxed);
	for (;;) {
		double tat;
		memcpy(&tat, &old, sizeof(tat));
		if (tat < (double)now)
			tat = (double)now;
		if (atomic_compare_exchange_weak_explicit(&b->tat, &old, bits_of(tat + step),
							  memory_order_relaxed,
							  memory_order_relaxed))
			return;
	}
}

/* ---- the limiter ---- */

struct qos_limiter *qos_limiter_new(void)
{
	struct qos_limiter *q = calloc(1, sizeof(*q));
	if (!q)
		return NULL;
	if (pthread_mutex_init(&q->lock, NULL) != 0) {
		free(q);
		return NULL;
	}
	atomic_init(&q->active, false);
	atomic_init(&q->throttled_requests, 0);
	atomic_init(&q->throttled_ns, 0);
	return q;
}

void qos_limiter_free(struct qos_limiter *q)
{
	if (!q)
		return;
	/* Connections hold the limiter's export counter, so the clients left
	 * are idle ones (any other is a leak of a reference). */
	while (q->clients) {
		struct qos_client *cl = q->clients;
		q->clients = cl->next;
		free(cl);
	}
	pthread_mutex_destroy(&q->lock);
	free(q);
}

static void client_set(struct qos_client *cl, const struct qos_limits *l, uint64_t now)
{
	qos_bucket_set(&cl->iops, l->client_iops.rate, l->client_iops.burst, now);
	qos_bucket_set(&cl->bytes, l->client_bytes.rate, l->client_bytes.burst, now);
}

/* When both of cl's buckets are full again (ns of the clock): from then
 * on it holds what a new client's would. */
static double client_full_at(struct qos_client *cl)
{
	double iops = tat_of(&cl->iops), bytes = tat_of(&cl->bytes);
	return iops > bytes ? iops : bytes;
}

/* Unlink and free the idle client *link points to. Under the lock. */
static void client_drop(struct qos_limiter *q, struct qos_client **link)
{
	struct qos_client *cl = *link;
	*link = cl->next;
	q->idle_clients--;
	free(cl);
}

/*
 * Free the idle clients whose buckets are full at now; then, while more
 * than QOS_IDLE_CLIENTS_MAX are left (one more than that at most: a put
 * adds one), the one that will be full soonest. Under the lock; one walk
 * of the list, which a get walks anyway.
 */
static void clients_sweep(struct qos_limiter *q, uint64_t now)
{
	if (!q->idle_clients)
		return;
	for (struct qos_client **p = &q->clients; *p;) {
		if (!(*p)->refs && client_full_at(*p) <= (double)now)
			client_drop(q, p);
		else
			p = &(*p)->next;
	}
	while (q->idle_clients > QOS_IDLE_CLIENTS_MAX) {
		struct qos_client **soonest = NULL;
		for (struct qos_client **p = &q->clients; *p; p = &(*p)->next)
			if (!(*p)->refs &&
			    (!soonest || client_full_at(*p) < client_full_at(*soonest)))
				soonest = p;
		client_drop(q, soonest);
	}
}

void qos_limiter_set(struct qos_limiter *q, const struct qos_limits *l, uint64_t now)
{
	pthread_mutex_lock(&q->lock);
	q->limits = *l;
	qos_bucket_set(&q->iops, l->iops.rate, l->iops.burst, now);
	qos_bucket_set(&q->bytes, l->bytes.rate, l->bytes.burst, now);
	for (struct qos_client *cl = q->clients; cl; cl = cl->next)
		client_set(cl, l, now);
	clients_sweep(q, now); /* a limit removed: its idle buckets are full */
	atomic_store(&q->active, qos_limits_any(l));
	pthread_mutex_unlock(&q->lock);
}

void qos_limiter_get(struct qos_limiter *q, struct qos_stats *out)
{
	memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&q->lock);
	out->limits = q->limits;
	for (struct qos_client *cl = q->clients; cl; cl = cl->next)
		out->clients++;
	out->idle_clients = q->idle_clients;
	pthread_mutex_unlock(&q->lock);
	out->throttled_requests = atomic_load(&q->throttled_requests);
	out->throttled_ns = atomic_load(&q->throttled_ns);
}

void qos_client_key(const struct access_peer *p, char *buf, size_t len)
{
	if (p->has_identity) {
		snprintf(buf, len, "tls:%s", p->identity);
	} else if (p->is_unix) {
		if (p->has_cred)
			snprintf(buf, len, "uid:%u", (unsigned)p->uid);
		else
			snprintf(buf, len, "unix"); /* no credentials: one client */
	} else {
		char host[64] = "";
		static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
		if (memcmp(p->addr, mapped, sizeof(mapped)) == 0)
			inet_ntop(AF_INET, p->addr + 12, host, sizeof(host));
		else
			inet_ntop(AF_INET6, p->addr, host, sizeof(host));
		snprintf(buf, len, "ip:%s", host);
	}
}

struct qos_client *qos_client_get(struct qos_limiter *q, const char *key, uint64_t now)
{
	pthread_mutex_lock(&q->lock);
	clients_sweep(q, now);
	struct qos_client *cl = q->clients;
	while (cl && strcmp(cl->key, key) != 0)
		cl = cl->next;
	if (cl && cl->refs == 0)
		q->idle_clients--; /* back, to its buckets as it left them */
	if (!cl && (cl = calloc(1, sizeof(*cl)))) {
		snprintf(cl->key, sizeof(cl->key), "%s", key);
		client_set(cl, &q->limits, now);
		cl->next = q->clients;
		q->clients = cl;
	}
	if (cl)
		cl->refs++;
	pthread_mutex_unlock(&q->lock);
	return cl;
}

void qos_client_put(struct qos_limiter *q, struct qos_client *cl, uint64_t now)
{
	if (!cl)
		return;
	pthread_mutex_lock(&q->lock);
	if (--cl->refs == 0)
		q->idle_clients++; /* kept until full (freed at once if it is) */
	clients_sweep(q, now);
	pthread_mutex_unlock(&q->lock);
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
	return a > b ? a : b;
}

uint64_t qos_admit(struct qos_limiter *q, struct qos_client *cl, uint64_t ios, uint64_t bytes,
		   uint64_t now)
{
	/* No lock: cl is referenced by the caller's connection, the buckets
	 * are atomics (a race for the last tokens is a small debt). */
	uint64_t wait =
	    max_u64(qos_bucket_wait(&q->iops, ios, now), qos_bucket_wait(&q->bytes, bytes, now));
	if (cl)
		wait = max_u64(wait, max_u64(qos_bucket_wait(&cl->iops, ios, now),
					     qos_bucket_wait(&cl->bytes, bytes, now)));
	if (wait)
		return wait;
	qos_bucket_take(&q->iops, ios, now);
	qos_bucket_take(&q->bytes, bytes, now);
	if (cl) {
		qos_bucket_take(&cl->iops, ios, now);
		qos_bucket_take(&cl->bytes, bytes, now);
	}
	return 0;
}

void qos_count_throttled(struct qos_limiter *q, bool new_request, uint64_t ns)
{
	if (new_request)
		atomic_fetch_add_explicit(&q->throttled_requests, 1, memory_order_relaxed);
	if (ns)
		atomic_fetch_add_explicit(&q->throttled_ns, ns, memory_order_relaxed);
}
