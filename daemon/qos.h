/*
 * daemon/qos.h: QoS limits: token buckets for requests and bytes a second,
 * per export (all its clients together) and per client of an export.
 *
 * Owns: the token bucket (pure arithmetic on a clock the caller passes),
 * the limits' keys and their syntax (iops-limit, bytes-limit, ... shared
 * by --export, the config file and the control socket's limit), and the
 * limiter of one export: its two buckets, its clients' buckets, and the
 * counters of time spent throttled.
 *
 *   struct export_counter (export.h; shared by an export's versions and
 *   its split windows, so it survives reloads)
 *        |
 *        v
 *   struct qos_limiter  active (atomic: the hot path's one test)
 *     lock ----------->  limits, iops + bytes buckets,
 *                        clients: [key "tls:NAME" | "uid:N" | "ip:ADDR"]
 *                                  refs, iops + bytes buckets  -> ...
 *                        idle_clients: how many of them have refs 0
 *
 * A client's buckets outlive its connections: when its last one goes
 * (refs 0, idle) they are kept until they would be full again, as a new
 * client's are, so that reconnecting gives nothing back; they are freed
 * then, by the next qos_client_get(), qos_client_put() or
 * qos_limiter_set() of the limiter (no timer). At most
 * QOS_IDLE_CLIENTS_MAX are kept; past that the one that will be full
 * soonest goes first (it has the least left to refill).
 *
 * Locking: the limiter's mutex guards its limits, its list of clients and
 * the setting of buckets; admitting a request takes no lock (the buckets
 * are atomics, see struct qos_bucket), and costs nothing but one relaxed
 * load when no limit is set (qos_limiter_active). Nothing is called under
 * the mutex. The counters are atomics. Any thread:
 * the connections' workers admit, the control thread sets limits (reload,
 * the limit command) and reads the counters.
 *
 * Dependency-free (libc and pthreads only): unit tested on i386 too.
 */
#ifndef NBDCACHED_DAEMON_QOS_H
#define NBDCACHED_DAEMON_QOS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct access_peer;

/* One rate: tokens a second (0: unlimited) and the most a bucket holds
 * (0: one second's worth). */
struct qos_rate {
	uint64_t rate, burst;
};

/* An export's limits, as configured (export_spec) or set live. */
struct qos_limits {
	struct qos_rate iops, bytes;		   /* the export, all clients together */
	struct qos_rate client_iops, client_bytes; /* each client of it */
};

/* The highest rate or burst accepted (2^50 a second: far above any disk). */
#define QOS_MAX_RATE (UINT64_C(1) << 50)

/*
 * key=value of a limit: iops-limit, iops-burst, bytes-limit, bytes-burst,
 * client-iops-limit, client-iops-burst, client-bytes-limit,
 * client-bytes-burst. Values are a number with an optional K, M, G or T
 * suffix (binary, as sizes), or "off" (0, unlimited; for a burst: one
 * second's worth). 1: set; 0: key is not a limit's; -EINVAL: a bad value,
 * the reason in err (naming key and value).
 */
int qos_limits_set(struct qos_limits *l, const char *key, const char *value, char *err,
		   size_t errlen);
/* Is key one of the limits' keys? */
bool qos_is_key(const char *key);
/* Its index among them (0..QOS_KEYS-1), or -1: a key given twice is
 * found so. */
#define QOS_KEYS 8
int qos_key_index(const char *key);
/* Is any limit set? */
bool qos_limits_any(const struct qos_limits *l);
/* The limits set, in words for the log and --check-config ("iops 500
 * (burst 500), client bytes 4194304/s (burst 4194304)"; "none"). */
void qos_limits_describe(const struct qos_limits *l, char *buf, size_t len);

/* ---- the token bucket (pure: the caller passes the clock) ---- */

/*
 * A bucket is kept as its theoretical arrival time (GCRA): tat, the time
 * at which it would be full again, each token taken pushing it 1/rate s
 * further. It holds burst - (tat - now) x rate tokens (burst when tat is
 * past). Three atomics, so that admitting is lock-free: two threads taking
 * its last token at once can both have it (the bucket goes one request
 * into debt, paid back by the next ones: the rate holds on average).
 */
struct qos_bucket {
	_Atomic uint64_t rate;	/* tokens a second; 0: unlimited (takes nothing, never waits) */
	_Atomic uint64_t burst; /* the most it holds */
	_Atomic uint64_t tat;	/* a double's bits: ns (the clock's) when it is full */
};

/*
 * Set the rate and burst (0: one second's worth) at now. A bucket that was
 * unlimited starts full; otherwise it keeps what it earned at the old rate,
 * down to the new burst (and a debt stays a debt). Under the limiter's
 * lock: one setter at a time.
 */
void qos_bucket_set(struct qos_bucket *b, uint64_t rate, uint64_t burst, uint64_t now_ns);
/*
 * Nanoseconds until cost tokens may be taken (0: now). A cost above the
 * burst may be taken once the bucket is full (it goes into debt), so no
 * request waits for ever; a cost of 0 never waits.
 */
uint64_t qos_bucket_wait(struct qos_bucket *b, uint64_t cost, uint64_t now_ns);
/* Take cost tokens at now (after qos_bucket_wait said 0). */
void qos_bucket_take(struct qos_bucket *b, uint64_t cost, uint64_t now_ns);
/* The tokens it holds at now (negative: a debt); its burst when unlimited. */
double qos_bucket_tokens(struct qos_bucket *b, uint64_t now_ns);

/* ---- one export's limiter ---- */

struct qos_client {
	struct qos_client *next;
	unsigned refs; /* connections using it (the limiter's lock); 0: idle */
	struct qos_bucket iops, bytes;
	char key[288]; /* "tls:IDENTITY", "uid:N" or "ip:ADDRESS" */
};

struct qos_limiter {
	atomic_bool active; /* a limit is set: requests are counted */
	pthread_mutex_t lock;
	struct qos_limits limits;
	struct qos_bucket iops, bytes;
	struct qos_client *clients;
	unsigned idle_clients;		     /* of clients, those with refs 0 */
	_Atomic uint64_t throttled_requests; /* requests that had to wait */
	_Atomic uint64_t throttled_ns;	     /* the time they waited, summed */
};

/* What the limiter reports (control socket, metrics). */
struct qos_stats {
	struct qos_limits limits;
	uint64_t throttled_requests, throttled_ns;
	uint64_t clients;      /* client buckets kept, idle ones too */
	uint64_t idle_clients; /* of them, those of clients with no connection */
};

/*
 * The most idle clients' buckets one limiter keeps: each is a struct
 * qos_client (some 350 bytes), so at most about 1.5 MiB an export. Only a
 * client that emptied its buckets and left within the last burst / rate
 * seconds (one, by default) is still idle, so the cap is reached only by
 * thousands of distinct clients an export a second; a client that has
 * that many identities gets new buckets from new identities anyway.
 */
#define QOS_IDLE_CLIENTS_MAX 4096

/* NULL when out of memory. */
struct qos_limiter *qos_limiter_new(void);
void qos_limiter_free(struct qos_limiter *q);
/* Replace the limits, in place: buckets and clients are kept. */
void qos_limiter_set(struct qos_limiter *q, const struct qos_limits *l, uint64_t now_ns);
void qos_limiter_get(struct qos_limiter *q, struct qos_stats *out);

/* The hot path's test: false (no limit) costs one relaxed load. */
static inline bool qos_limiter_active(struct qos_limiter *q)
{
	return atomic_load_explicit(&q->active, memory_order_relaxed);
}

/* The client key of a peer: its TLS identity, else its Unix uid, else its
 * IP address (not its port). */
void qos_client_key(const struct access_peer *p, char *buf, size_t len);
/* The bucket of client key, shared by its connections (referenced): the
 * one its last connection left, if it is not full yet; NULL when out of
 * memory (then only the export's limits apply to it). */
struct qos_client *qos_client_get(struct qos_limiter *q, const char *key, uint64_t now_ns);
/* Give back a reference at now_ns; after the last one the client's
 * buckets are kept, idle, until they would be full again. */
void qos_client_put(struct qos_limiter *q, struct qos_client *cl, uint64_t now_ns);

/*
 * Admit a request of ios requests and bytes bytes for client cl (NULL:
 * only the export's limits): 0 when every bucket allows it, and then its
 * tokens are taken; else the nanoseconds until they may (nothing taken).
 */
uint64_t qos_admit(struct qos_limiter *q, struct qos_client *cl, uint64_t ios, uint64_t bytes,
		   uint64_t now_ns);
/* A request had to wait: counted once when it starts waiting (ns 0, new
 * true), and its waiting time when it ends. */
void qos_count_throttled(struct qos_limiter *q, bool new_request, uint64_t ns);

#endif
