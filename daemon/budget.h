/*
 * daemon/budget.h: what all clients together may make the daemon hold.
 *
 * Owns three daemon-wide counts, each an atomic that any thread may
 * change, and their limits (set once, before the first connection):
 *
 *   clients       connections accepted and not yet freed     --max-clients
 *   reply bytes   requests being served (WRITE payloads,     --max-reply-memory
 *                 READ and CACHE lengths, block status room)
 *                 plus every byte of every output buffer:
 *                 replies not yet sent, zero-copy ones too
 *   pinned bytes  arena bytes that unsent READ replies hold  --max-pinned-replies
 *                 pinned (a subset of the reply bytes)
 *
 *   conn --budget_reserve(cost)--> admitted: read the request
 *        \--refused--> budget_wait(): reading stops; woken on its worker
 *                      (budget_start's callback) when bytes come back
 *   reply queued: reservation given back, the output buffer counts it
 *   READ reply from the arena: budget_pin() or, past the limit, a copy
 *
 * Reply bytes are reserved before a request is read, so the daemon never
 * takes on what the budget cannot hold. A connection that holds less than
 * BUDGET_CONN_RESERVE is admitted whatever the others hold: clients that
 * never read cannot starve one that does, and the total can pass the limit
 * by at most that much per connection.
 *
 * Threads: budget_start() on the main thread before any connection;
 * budget_client_add() on the accepting thread; everything else on any
 * thread. The wake callback runs on the waiting connection's worker.
 */
#ifndef NBDCACHED_DAEMON_BUDGET_H
#define NBDCACHED_DAEMON_BUDGET_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/access.h"
#include "daemon/options.h"

struct worker;

/* Every connection may hold this much, whatever the others hold. */
#define BUDGET_CONN_RESERVE (1u << 20)

struct budget_stats {
	uint64_t clients, max_clients, refused_clients;
	uint64_t reply_bytes, max_reply_bytes;
	uint64_t pinned_reply_bytes, max_pinned_reply_bytes;
	uint64_t copied_replies, copied_reply_bytes; /* READ replies copied out of the arena */
	uint64_t budget_waits;			     /* times a connection waited for room */
	uint64_t refused_per_client; /* closed at accept by --max-connections-per-client */
	uint64_t refused_access;     /* closed at accept by the global access rules */
};

/*
 * Set the limits from opts and learn the workers whose connections may
 * wait: wake(w) runs on w's thread after bytes came back, for it to retry
 * its waiting connections. 0 or -ENOMEM.
 */
int budget_start(const struct options *opts, struct worker *const *workers, unsigned count,
		 void (*wake)(struct worker *w));

/* A new connection: false (and counted as refused) at --max-clients. */
bool budget_client_add(void);
void budget_client_remove(void);

/*
 * Connections per client (--max-connections-per-client): a TCP client is
 * its address, a Unix one its uid. Every accepted connection is counted
 * from accept to free, negotiating ones too. budget_peer_add() is false
 * (and counts nothing) when the client has limit connections already
 * (limit 0: no limit). Any thread.
 */
bool budget_peer_add(const struct access_peer *p, unsigned limit);
void budget_peer_remove(const struct access_peer *p);
/* A connection the global access rules closed at accept: counted. */
void budget_count_refused_access(void);

/*
 * Reserve cost reply bytes for a connection that holds `held` now: true
 * when held + cost fits BUDGET_CONN_RESERVE or the total stays within
 * --max-reply-memory. budget_release() gives bytes back, budget_add() and
 * budget_release() also follow output buffers (budget_add never refuses).
 */
bool budget_reserve(uint64_t cost, uint64_t held);
void budget_add(uint64_t bytes);
void budget_release(uint64_t bytes);
/* Is there room for more replies at all (any connection over its reserve)? */
bool budget_has_room(void);

/* Would budget_reserve(cost, held) succeed now (cost 0: budget_has_room)? */
bool budget_fits(uint64_t cost, uint64_t held);

/*
 * Worker thread w: one of its connections was refused and waits for cost
 * bytes (0: for any room); from now on a release that leaves room for the
 * smallest such cost wakes w (the callback of budget_start) until the wait
 * is over: budget_wait_done(), once per budget_wait(). The wake-up forgets
 * the costs: a connection still refused then says again what it waits for
 * (budget_wait_more). To miss no release, a caller asks again after
 * registering, before it stops reading.
 */
void budget_wait(struct worker *w, uint64_t cost);
void budget_wait_more(struct worker *w, uint64_t cost);
void budget_wait_done(struct worker *w);
/* Main thread, when the workers stop: no more wake-ups from now on; then,
 * once they are joined, budget_free(). */
void budget_stop(void);
void budget_free(void);

/* Pin bytes for an unsent reply: false past --max-pinned-replies, unless
 * force (there is no memory to copy the reply into). */
bool budget_pin(uint64_t bytes, bool force);
void budget_unpin(uint64_t bytes);
void budget_count_copy(uint64_t bytes);

void budget_get_stats(struct budget_stats *out);

/*
 * Control thread, once a second: when the reply bytes have fallen by
 * BUDGET_TRIM_BYTES or more from the highest the tick saw since it last
 * trimmed (a flood of replies ended), what the threads freed is given back
 * to the system (malloc_trim): glibc keeps it in each thread's arena, and
 * after 8 clients' unread 4 KiB replies that was 110 MiB of RSS for
 * nothing. True when it trimmed.
 */
#define BUDGET_TRIM_BYTES (32u << 20)
bool budget_trim_tick(void);

#endif
