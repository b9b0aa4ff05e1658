/*
 * daemon/backend/nbd_internal.h: what the files of the NBD backend share.
 * Nothing outside daemon/backend/nbd*.c includes it; the rest of the
 * daemon knows the backend only through backend.h.
 *
 * Owns: struct nbd_backend (one per backend), its connection slots
 * (struct nbd_conn), the commands libnbd holds (struct nbd_chunk) and the
 * sockets of given-up connections still read (struct nbd_drain).
 *
 * Locking: nb->lock guards the submit queue (with its stop request) and
 * renew_size, and nothing else.
 * Everything else is touched only from the backend's own thread (or by
 * backend_nbd_open before that thread exists, and by the close after it
 * has ended).
 *
 * The files, each calling only those below it (a callback libnbd or
 * libevent runs is registered by the file it belongs to):
 *
 *   nbd.c          spec parsing (URI / nbdkit:), the first connection, the
 *                  export's size and capabilities: backend_nbd_open()
 *   nbd_thread.c   the backend thread: submit queue, the event handlers,
 *                  start and close
 *   nbd_io.c       requests: chunks and libnbd commands, their completion
 *                  (the libnbd ownership rule), flush fan-out, FUA emulation
 *   nbd_pool.c     the connection slots: async connects, reconnect with
 *                  backoff, deadlines, declaring a connection dead
 *   nbd_drain.c    a dead connection's socket read until the server is done
 *
 * nbd.c's opening comment tells the whole story.
 */
#ifndef NBDCACHED_DAEMON_BACKEND_NBD_INTERNAL_H
#define NBDCACHED_DAEMON_BACKEND_NBD_INTERNAL_H

#include <event2/event.h>
#include <libnbd.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "daemon/backend/backend.h"
#include "daemon/queue.h"

#define NBD_MAX_CONNS 4
#define NBD_WINDOW 16 /* chunks of one request in flight */
#define NBD_ZERO_CHUNK (1u << 20)
#define NBD_COMPACT_MAX (0xffffffffu & ~(uint32_t)((1u << 20) - 1)) /* 32-bit lengths */
#define NBD_BACKOFF_MIN_MS 100
#define NBD_BACKOFF_MAX_MS 5000
#define NBD_CONNECT_TIMEOUT_MS 10000
#define NBD_PROBE_TIMEOUT_MS 5000 /* a resize asking the server its size (control thread) */
#define NBD_EXTRA_ATTEMPTS 3 /* an extra slot that never worked is given up after these */
#define NBD_TICK_MS 100	     /* how often deadlines are looked at, while any is set */
#define NBD_ADVANCE_PASSES 8
#define NBD_DRAIN_MAX 16	/* given-up sockets read at once */
#define NBD_DRAIN_QUIET_MS 1000 /* a half-sent request: closed after this quiet */
#define NBD_DRAIN_MAX_MS 60000	/* longest a given-up socket is read */

/* backend_io.state */
#define IO_DEFERRED (1u << 0) /* on nb->deferred */
#define IO_WAITING (1u << 1)  /* on nb->waiting, for a connection */
#define IO_RESTART (1u << 2)  /* a chunk was lost with its connection */
#define IO_FLUSHING (1u << 3) /* FUA emulated: the write is done, flush now */

enum conn_state {
	CONN_OFF,	 /* not wanted, or given up */
	CONN_IDLE,	 /* the timer starts the next attempt */
	CONN_CONNECTING, /* the timer is the handshake's deadline */
	CONN_READY,
	CONN_RETIRING, /* a resize: no new command; closed and connected again once
			* its commands are answered (a new handshake, the new size) */
};

struct nbd_backend;
struct nbd_chunk;

/* The socket of a given-up connection, read until the server is done with it. */
struct nbd_drain {
	struct nbd_backend *nb;
	struct nbd_drain *next;
	struct event *ev; /* readable, or NBD_DRAIN_QUIET_MS without data */
	int fd;
	bool half_sent; /* a request was half sent: the write side stays open */
	bool answered;	/* the server sent something since */
	uint64_t deadline_ns;
};

struct nbd_conn {
	struct nbd_backend *nb;
	unsigned index;
	enum conn_state state;
	struct nbd_handle *h; /* CONNECTING, READY */
	struct event *ev;     /* h's socket, in direction dir */
	int fd;
	unsigned dir;
	struct event *timer;
	unsigned backoff_ms; /* before the next attempt */
	bool ever_ready;
	bool given_up;
	unsigned failures; /* failed attempts before it ever worked */
	bool multi_conn;   /* this handle's server advertises it */
	bool wrote;	   /* a command that writes was sent on this handle */
	int broken;	   /* errno of a command that failed with a connection error */
	struct nbd_chunk *oldest, *newest; /* what libnbd holds, by age */
};

struct nbd_backend {
	struct backend base;
	char *name;  /* for logs: the URI or the nbdkit command */
	char *uri;   /* NULL for nbdkit */
	char **argv; /* nbdkit command line, NULL-terminated */
	uint64_t timeout_ns;
	unsigned timeout_s;
	bool can_flush, can_fua, can_fast_zero, can_cache, can_block_status;
	uint32_t max_block;
	unsigned max_conns; /* slots: NBD_MAX_CONNS with multi-conn, else 1 */

	pthread_t thread;
	bool started;
	struct event_base *loop;
	struct event *wake, *tick;
	event_callback_fn on_conn_event; /* a connection's socket (nbd_thread.c) */

	pthread_mutex_t lock;	/* guards submitted (its stop too) and renew_size */
	struct queue submitted; /* backend_io.posted: to start; wakes the thread */
	uint64_t renew_size;	/* the server grew to this: renew the connections (0: no) */
	/* Control thread (and the open): the size the connections were last
	 * opened or renewed for; a probe renews them only past it. */
	uint64_t renewed_size;

	/* Backend thread only. */
	struct nbd_conn conns[NBD_MAX_CONNS];
	unsigned want_conns; /* max_conns, or 1 while slot 0's server lacks multi-conn */
	unsigned nready, next_conn;
	uint64_t expect_size; /* the size a handshake should report (the last one probed) */
	bool down;   /* the loss of the last ready connection was logged */
	bool silent; /* no reply on any connection for --backend-timeout, no handshake since */
	uint64_t last_reply_ns;
	struct backend_io *waiting, *waiting_tail; /* for a connection, in arrival order */
	struct backend_io *deferred;		   /* touched by libnbd callbacks: look again */
	struct nbd_drain *drains;
	unsigned ndrains;
};

/* One libnbd command: a chunk of a request. */
struct nbd_chunk {
	struct backend_io *io;
	struct nbd_conn *conn;
	struct nbd_chunk *older, *newer; /* conn's list */
	uint64_t sent_ns;
	int error;	/* from the completion callback */
	bool completed; /* the completion callback ran */
};

static inline struct nbd_backend *to_nbd(struct backend *be)
{
	return (struct nbd_backend *)be;
}

/* The error libnbd gave for the last failed call, copied (later calls change it). */
static inline void last_error(char *buf, size_t len, const char *fallback)
{
	const char *e = nbd_get_error();
	snprintf(buf, len, "%s", e && *e ? e : fallback);
}

/* ---- nbd.c ---- */

/* Online resize (control thread): the server's size now, from a handshake
 * of its own; when it grew, the connections are renewed (nbd_renew). */
int nbd_probe_size(struct backend *be, uint64_t *size);
/* Like a block device: any size up to the server's (-ENOSPC past it). */
int nbd_set_size(struct backend *be, uint64_t size, uint64_t *have);

/* ---- nbd_thread.c ---- */

/* Any thread: the backend thread renews every connection, since the
 * server now has size bytes (nbd_pool_renew). */
void nbd_renew(struct nbd_backend *nb, uint64_t size);

extern const struct backend_ops nbd_backend_ops;
/* Free nb and the strings it owns (after close, or a failed open). */
void nbd_backend_free(struct nbd_backend *nb);

/* ---- nbd_io.c: requests ---- */

/* Answer at once what the server does not do; else start the request. */
void nbd_io_start(struct nbd_backend *nb, struct backend_io *io);
/* Outside libnbd: move every request a callback touched along. */
void nbd_io_process_deferred(struct nbd_backend *nb);
/* A connection is ready: the requests that waited for one go. */
void nbd_io_issue_waiting(struct nbd_backend *nb);
/* Fail the requests that waited for a connection past their deadline (or
 * all of them, while the server is silent and no connection is ready). */
void nbd_io_expire_waiting(struct nbd_backend *nb, uint64_t now);

/* ---- nbd_pool.c: connections and deadlines ---- */

/* A new handle with its connection started, or NULL with the reason in err. */
struct nbd_handle *nbd_pool_handle_begin(struct nbd_backend *nb, char *err, size_t errlen);
/* c failed: close it and try again later (never calls into the requests). */
void nbd_pool_fail(struct nbd_conn *c, const char *why, bool kill);
/* After a libnbd call on c: close it if it died, else watch it. False if it failed. */
bool nbd_pool_settle(struct nbd_conn *c);
/* Slots [0, want) are kept connected; the others are left as they are. */
void nbd_pool_set_want(struct nbd_backend *nb, unsigned want);
/* c's timer: start an attempt, or give up a handshake. True if c became ready. */
bool nbd_pool_on_timer(struct nbd_conn *c);
/* c's socket (CONNECTING or READY): drive libnbd. True if c became ready. */
bool nbd_pool_on_event(struct nbd_conn *c, short what);
/* The server grew to size: every ready connection retires (no new
 * command; reconnected once its commands are answered), a handshake under
 * way starts again, so requests past the old end find the new size. */
void nbd_pool_renew(struct nbd_backend *nb, uint64_t size);
/* Close the connections whose oldest command is older than
 * --backend-timeout; reconnect the retired ones that hold no command. */
void nbd_pool_expire(struct nbd_backend *nb, uint64_t now);
/* Is there a deadline to look at (a request waiting, a command in flight)? */
bool nbd_pool_tick_needed(struct nbd_backend *nb);
/* Look at the deadlines in NBD_TICK_MS, unless already due to. */
void nbd_pool_tick_arm(struct nbd_backend *nb);
/* After the thread: free every slot; true if one still held commands. */
bool nbd_pool_teardown(struct nbd_backend *nb);

/* ---- nbd_drain.c ---- */

/* Keep h's socket open and read after nbd_close(h). False if it cannot be. */
bool nbd_drain_start(struct nbd_backend *nb, struct nbd_handle *h);
void nbd_drain_end(struct nbd_drain *d);

#endif
