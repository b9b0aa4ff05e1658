/*
 * daemon/host.h: the connection host: the client connections each worker
 * thread serves.
 *
 * Owns: per worker thread, the thread itself (daemon/worker.h: a loop and
 * a ring, which knows nothing of connections) and its set of connections
 * (struct conn_set, daemon/conn.h). The listener (server.c) hands accepted
 * sockets over with host_hand_off(), a task posted to the thread that
 * starts the connection's session there (session.h). Stopping closes the
 * connections still in negotiation, asks the others to finish their
 * in-flight requests, and cuts off after HOST_STOP_GRACE_SECONDS those
 * whose clients never read their replies; the thread ends when its last
 * connection is freed, which happens only after its last backend I/O has
 * completed, so no io_uring operation outlives the ring.
 *
 * Layers: worker.h is below the backends and the cache (they post their
 * completions to worker threads); this module is above the connections
 * and the phases, the one that calls up into session.c.
 */
#ifndef NBDCACHED_DAEMON_HOST_H
#define NBDCACHED_DAEMON_HOST_H

#include <stdint.h>

#include "daemon/conn.h"
#include "daemon/worker.h"

struct access_peer;
struct export_table;

#define HOST_STOP_GRACE_SECONDS 10

struct host {
	struct worker loop; /* first: host_of() */
	struct conn_set set;
	struct event *stop_timer;
};

/* Main thread: start worker thread index with its (empty) set. */
int host_start(struct host *h, unsigned index, struct export_table *exports);
/* Thread-safe: give an accepted socket to this host's thread. Takes
 * ownership of fd and of peer's references (budget counts included). */
void host_hand_off(struct host *h, int fd, uint64_t id, const struct access_peer *peer);
/* Thread-safe: finish in-flight requests, close connections, end the thread. */
void host_request_stop(struct host *h);
void host_join(struct host *h);
/* The budget's wake-up (budget_start), on w's thread: w is a host's loop. */
void host_budget_wake(struct worker *w);

#endif
