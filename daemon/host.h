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

#include <stdatomic.h>
#include <stdint.h>

#include "daemon/conn.h"
#include "daemon/upgrade_record.h"
#include "daemon/worker.h"

struct access_peer;
struct export_table;
struct refused_close;

#define HOST_STOP_GRACE_SECONDS 10

/* A connection a live upgrade hands over (host_collect): its state and a
 * duplicate of its socket, which the collector owns. */
struct host_moved {
	int fd;
	struct upgrade_conn_state state; /* state.pending: malloc'd */
};

struct host {
	struct worker loop; /* first: host_of() */
	struct conn_set set;
	struct event *stop_timer;

	/* A live upgrade (daemon/upgrade.h). */
	struct event *park_timer; /* while parked: counts busy connections */
	atomic_uint busy;	  /* connections not at a request boundary yet; UINT32_MAX
				   * until counted since the park began */
	struct host_moved *moved; /* host_collect()'s, until host_collected_free() */
	size_t moved_count;
	unsigned closed_count; /* to be closed: negotiating, TLS, over limits */
	atomic_bool collected; /* host_collect() is done */
	atomic_bool finished;  /* host_finish_upgrade() is done */
	bool park_on;	       /* host_park's argument, for its task */
	bool parking;	       /* worker thread: connections are being parked */
	bool negotiation_ended; /* worker thread: negotiating ones stopped too */
	uint64_t park_ns;	/* worker thread: when the park began */
	struct worker_task park_task, collect_task, finish_task;
	/* The new daemon: connections handed over that it closes
	 * (host_close_refused), until their clients have their replies. */
	struct refused_close *refused;
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

/*
 * A live upgrade, from the thread that runs it (daemon/upgrade.c):
 *
 *   host_park(h, true)     every connection stops at its next request
 *                          boundary (conn_park); host_busy() counts those
 *                          not there yet, every 10 ms; one still
 *                          negotiating gets HOST_NEGOTIATION_GRACE_MS to
 *                          reach transmission, then stops where it is
 *   host_collect(h)        the parked ones that can be handed over
 *                          (plaintext, in transmission) into h->moved;
 *                          h->collected once done
 *   host_finish_upgrade(h) committed: the others are closed (negotiating,
 *                          TLS: they cannot be handed over); none is read
 *                          again; h->finished once done
 *   host_park(h, false)    rolled back: every connection resumes
 */
#define HOST_NEGOTIATION_GRACE_MS 500
void host_park(struct host *h, bool on);
/* Connections not parked yet (UINT_MAX until first counted). */
unsigned host_busy(struct host *h);
void host_collect(struct host *h);
void host_finish_upgrade(struct host *h);
/* Free what host_collect() made (closing the duplicates not sent). */
void host_collected_free(struct host *h);
/*
 * The new daemon: serve a connection handed over in transmission (the
 * budget already counts it, peer is its own): posted to h's thread, where
 * session_adopt() resumes it. Takes fd, peer and a copy of st.
 */
void host_adopt(struct host *h, int fd, const struct access_peer *peer,
		const struct upgrade_conn_state *st);
/*
 * The new daemon: close connection id, handed over and not resumed
 * (handshake_resume_export() refused it), on h's thread, without losing
 * the replies the old daemon sent it: the socket is shut for writing (its
 * FIN goes after them), what the client sends is read and dropped, never
 * executed, and it is closed once the client closes its end, or after
 * CONN_CLOSE_TIMEOUT seconds (reset then, as a stalled connection is),
 * or at the host's end. A close() with input unread would reset it at
 * once, and a reset drops what the socket has not delivered yet. Takes fd.
 */
void host_close_refused(struct host *h, int fd, uint64_t id);

#endif
