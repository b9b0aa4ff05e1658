/*
 * daemon/conn.h: one client connection, from greeting to close.
 *
 * Owns: the connection's socket (a libevent bufferevent), its negotiation
 * state and its in-flight requests. A connection lives on exactly one worker
 * thread and is only ever touched from that thread: no locks.
 *
 * Phases:  FLAGS -> OPTIONS -> TRANSMISSION        (handshake.c, transmit.c)
 *
 *   greeting sent --client flags--> option haggling --GO/EXPORT_NAME-->
 *   requests parsed from the input buffer, each submitted to the backend;
 *   replies are queued on the output buffer as completions arrive, in any
 *   order.
 *
 * Layers: this module is the connection's primitives (the bufferevent,
 * output, timers, kill, budget bookkeeping, the stall deadline); it knows
 * nothing of the phases' code. handshake.c (handshake.h) and transmit.c
 * (transmit.h) use it, and neither knows the other. session.c (session.h)
 * starts a connection and is the one place that calls down into them, by
 * phase. It gets the input through the on_input function it gives to
 * conn_start(): conn.c calls nothing above it by name.
 *
 *   host.c --> session.c --+--> handshake.c --+
 *                          +--> transmit.c  --+--> conn.c
 *                          +------------------------^
 *
 * (host.c and server.c use conn.c's primitives as well: kill, shutdown,
 * the deadlines, the budget's wake-up.)
 *
 * Where: every connection runs on one worker thread (daemon/worker.h,
 * the loop and its ring) and belongs to that thread's struct conn_set
 * (below), which the connection host (daemon/host.h) keeps beside it.
 *
 * TLS (tls.h) is a primitive beside this one: after STARTTLS, c->bev is a
 * filter bufferevent over the socket's (conn_set_filter), and what conn.c
 * counts as output, drains and watches for stalls includes the ciphertext
 * waiting under it.
 *
 * Lifetime: conn->refs counts the socket (until conn_kill) plus every
 * request still alive (its backend I/O in flight, or its data still
 * referenced by the output buffer). The struct is freed when refs drops to
 * zero, never earlier: the kernel may still be writing into a request's
 * buffer after the client has gone.
 *
 * Bounds: at most CONN_MAX_INFLIGHT requests and CONN_MAX_INFLIGHT_BYTES of
 * requests alive (each costs what it may hold: itself, its data, its block
 * status room; CACHE and FLUSH too) per connection; beyond that the
 * connection stops reading until replies drain, so a client cannot make
 * the daemon allocate without limit. All connections together are bounded
 * by daemon/budget.h: each request is admitted (budget_reserve) before it
 * is read, every output buffer is counted as it grows and drains, and a
 * connection the budget refuses stops reading until conn_budget_wake().
 *
 * Reading: a plaintext connection reads its socket itself, CONN_READ_CHUNK
 * at a time, and a payload with a sink (conn_sink_start) straight into the
 * sink's segments; under TLS the filter bufferevent reads and sinks are
 * filled from its input buffer.
 *
 * Stall: replies that do not move for --stall-timeout seconds (less than
 * CONN_STALL_PROGRESS of the output buffer taken by the socket) end the
 * connection, however many replies are queued meanwhile; so does an
 * admitted request's payload that does not come (it holds reply memory).
 */
#ifndef NBDCACHED_DAEMON_CONN_H
#define NBDCACHED_DAEMON_CONN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/access.h"
#include "proto/nbd.h"

struct worker;
struct export;
struct export_table;
struct bufferevent;
struct event;
struct evbuffer;
struct evbuffer_cb_entry;
struct tls_conn;
struct tls_creds;
struct iovec;
struct conn;
struct request;
struct qos_client;

#define CONN_MAX_INFLIGHT 128
#define CONN_MAX_INFLIGHT_BYTES (96u << 20)
#define CONN_MAX_OUTPUT (64u << 20)
#define CONN_MAX_OPTION_LENGTH (64u << 10)
#define CONN_META_CONTEXT_ID 1u
/* Seconds a closing connection (DISC, ABORT, shutdown) may take to drain. */
#define CONN_CLOSE_TIMEOUT 10
/* Pending replies may go --stall-timeout seconds (conn_set_stall_timeout)
 * without the client reading any of them, and the clock moves only once the
 * client took this much of them (or all): a kernel that takes a few bytes
 * now and then is not a reader. */
#define CONN_STALL_PROGRESS (64u << 10)
/* A payload must come at this rate at least (bytes a second), averaged from
 * its first byte, after a grace of --stall-timeout: a client that sends
 * 64 KiB per deadline would otherwise hold its request (and its budget) for
 * hours. 2 MiB takes at most the grace plus 2 s at this rate. */
#define CONN_PAYLOAD_FLOOR (1u << 20)
/* Negotiation stops reading while this much of its output is unread. */
#define CONN_MAX_NEGOTIATION_OUTPUT (1u << 20)
/* Block status replies describe at most this many extents. */
#define CONN_MAX_EXTENTS 512
/* Structured reads send all-zero, aligned blocks of this size as holes. */
#define CONN_HOLE_GRANULE 4096u
/* A plaintext connection reads its socket itself, this much at a time (an
 * evbuffer chain of 256 KiB with its header): libevent's own reads are
 * 4 KiB each, with an ioctl(FIONREAD) before every one. */
#define CONN_READ_CHUNK ((256u << 10) - 256u)
/* ... or less: a read that fills what it asked for doubles the next, from
 * 16 KiB up to CONN_READ_CHUNK; one that fills less than a quarter halves
 * it (small requests one at a time do not allocate 256 KiB per read). */
#define CONN_READ_MIN_SHIFT 2 /* 16 KiB (4 KiB << 2) */
#define CONN_READ_MAX_SHIFT 6 /* 256 KiB */
#define CONN_READ_SIZE(shift) ((4096u << (shift)) - 256u)
/* A sink of at least this much is a large payload: the read after it takes
 * only the next header and the start of its payload (conn_on_readable). */
#define CONN_SINK_LARGE (64u << 10)
/* At most this many segments of a sink in one readv. */
#define CONN_SINK_IOV 64
/*
 * What one connection gets of its worker per turn of the event loop: at
 * most this many messages (requests, options), and requests of at most
 * this many bytes of work (request_cost: the data to read, write or copy,
 * whatever the reply's size; the request that crosses it is still taken).
 * Then it yields (conn_yield): the rest of its input waits in the
 * worker's queue of yielded connections, which gives one of them its next
 * share per turn, after every other connection's events, the worker's
 * tasks (a stop among them) and the ring. Replies of holes are a few bytes
 * each: the socket never fills, and without this a pipeline of 32 MiB
 * READs held the worker for as long as it was.
 */
#define CONN_TURN_MESSAGES 16
#define CONN_TURN_BYTES (4u << 20)
/*
 * What a reference from the output (conn_add_ref) holds beside its bytes,
 * counted with them: libevent's chain for it (1 KiB, its smallest), the
 * chain of 1 KiB the next small addition gets after it (conn_add), and
 * its owner's records (a request, its pieces: under 1 KiB). Uncounted, 8
 * clients asking for 4 KiB and never reading the replies held twice the
 * reply memory limit.
 */
#define CONN_REF_OVERHEAD 3072u

/*
 * A payload received straight into its destination (conn_sink_start): the
 * bytes the input buffer already holds are moved there, the rest is read
 * from the socket into it (plaintext), or moved from the input buffer as
 * it fills (TLS). The segments are the caller's and must stay valid until
 * done() is called, with the bytes received: all of them, or fewer if the
 * connection ended first.
 */
struct conn_sink {
	const struct iovec *iov;
	size_t niov, at;  /* at: the first segment not yet full */
	size_t at_filled; /* bytes already in iov[at] */
	uint64_t left;	  /* bytes still to come; 0: no sink */
	uint64_t filled;
	void (*done)(struct conn *c, void *arg, uint64_t received);
	void *arg;
};

enum conn_phase { CONN_FLAGS, CONN_OPTIONS, CONN_TRANSMISSION };

/*
 * The connections one worker thread serves, and what they are served from
 * (the host's, daemon/host.h; only that thread touches it). When it is
 * stopping and its last connection is freed, on_empty(set) runs.
 */
struct conn_set {
	struct worker *worker;
	struct export_table *exports;
	struct conn *conns;
	unsigned count;
	bool stopping;
	void (*on_empty)(struct conn_set *set);
	/* Connections that had their share of a turn (conn_yield), first
	 * resumed first, one per turn by the resume timer. */
	struct conn *yielded_head, *yielded_tail;
	struct event *resume;
};

/* Worker thread's set, before any connection: 0 or -ENOMEM. */
int conn_set_init(struct conn_set *set, struct worker *w, struct export_table *exports,
		  void (*on_empty)(struct conn_set *set));
/* Once the worker's loop has ended (no connection left). */
void conn_set_free(struct conn_set *set);

struct conn {
	uint64_t id;
	struct worker *worker; /* set->worker */
	struct conn_set *set;
	struct bufferevent *bev; /* NULL once killed */
	struct event *timer;	 /* negotiation, then stall, then close deadline */
	struct conn *prev, *next;
	/* Atomic: conn_list() reads it from the control thread (so are the
	 * fields it reports: inflight, requests, bytes_read, bytes_written,
	 * payload_copied, export_name; only this connection's worker writes them). */
	_Atomic enum conn_phase phase;
	unsigned refs;
	/* Reads whatever complete messages the input buffer holds (session.c):
	 * on each read event, and when reading resumes. */
	void (*on_input)(struct conn *c);

	/* Negotiation (handshake.c). */
	bool no_zeroes;
	bool abort_requested; /* NBD_OPT_ABORT acknowledged */
	bool structured;
	bool extended;
	bool meta_selected; /* base:allocation selected for meta_export */
	struct export *meta_export; /* the export SET_META_CONTEXT named (a reference) */
	struct export *export;	    /* a reference, and an attachment (export_attach) */
	struct nbd_session session;
	struct access_peer peer;	   /* who it comes from (set at accept, never changed) */
	bool access_logged;		   /* a refusal by the access rules was logged */
	_Atomic(const char *) export_name; /* c->export's name once in transmission */

	/* Transmission (transmit.c). */
	_Atomic unsigned inflight; /* requests without a reply yet */
	uint64_t inflight_bytes; /* what live requests cost (request_cost) */
	uint64_t discard;	 /* payload bytes still to drop */
	struct nbd_request discard_req;
	uint32_t discard_error;
	uint64_t seen_error; /* the export's writeback error sequence last reported */
	uint64_t seq_next, seq_run; /* sequential read detection (readahead, --seq-cutoff) */
	bool closing; /* no more reading; close once drained */
	/* A live upgrade (daemon/upgrade.h) waits for a request boundary:
	 * no new request is parsed, and reading stops once a payload being
	 * received is in (conn_park). */
	bool parking;
	/* Parking, and still negotiating: the negotiation may go on, so that
	 * a client that connected just before the upgrade is handed over in
	 * transmission rather than closed (conn_park_negotiation_end). */
	bool park_negotiation;
	/* QoS (transmit_throttle.c): requests the export's limits hold back,
	 * in arrival order, not started (no cache op, nothing pinned); they
	 * count in inflight and inflight_bytes. The timer is due when the
	 * first may go. The client's buckets: qos_client_get(), once a limit
	 * was first set (NULL before, or out of memory). */
	struct request *throttle_head, *throttle_tail;
	struct event *throttle_timer;
	struct qos_client *qos_client;
	/* Set by the phase: requests it holds that have not started must end
	 * now (conn_kill: no reply; conn_shutdown: ESHUTDOWN). */
	void (*on_cancel)(struct conn *c);
	/* Nobody waits for the replies of the requests in flight any more
	 * (killed, or the server stops): a long one (a TRIM or WRITE_ZEROES
	 * going in steps) ends before its next step (cache_op.cancel). */
	bool cancel_requests;
	bool reading; /* EV_READ enabled */
	/* This turn of the loop (CONN_TURN_*): the work taken so far (the
	 * phase adds a request's cost, session.c counts the messages); once
	 * yielded, reading and input wait in the worker's queue of yielded
	 * connections (yield_next) for its resume timer. */
	uint64_t turn_work;
	bool yielded;
	struct conn *yield_next;
	/* Plaintext: the socket is read by conn.c (reader, CONN_READ_CHUNK at a
	 * time, sinks by readv), not by the bufferevent, which only writes. */
	struct event *reader;
	bool reader_on;
	/* ... and written by it (conn_on_writable, made active when replies
	 * are queued); the bufferevent writes only what the socket would not
	 * take then. NULL under TLS. */
	struct event *writer;
	bool write_queued;
	struct conn_sink sink;
	unsigned read_shift; /* the reader's next read: CONN_READ_SIZE(read_shift) */
	/* The last sink was CONN_SINK_LARGE or more, and no read without a sink
	 * came after it. */
	bool after_large_payload;

	/* The daemon-wide budget (budget.h). */
	uint64_t reserved; /* reply bytes reserved for requests not answered yet */
	uint64_t admitted; /* ... of which for the request whose payload is arriving */
	size_t payload_seen;	   /* input bytes when that payload last moved */
	uint64_t payload_moved_ns; /* ... and when */
	uint64_t payload_start_ns; /* when the payload arriving now began */
	bool budget_waiting; /* refused; reading again at conn_budget_wake() */
	struct event *hangup; /* while waiting: the client closing (not read otherwise) */
	uint64_t budget_cost; /* ... what it waits for (0: any room) */
	struct evbuffer_cb_entry *output_cb; /* counts the output buffer */
	/* Bytes the output references (whole, until freed), with
	 * CONN_REF_OVERHEAD each; is its last chain a reference? */
	uint64_t output_refs;
	bool output_after_ref;
	uint64_t output_counted; /* what the output counts in the budget now */
	uint64_t output_moved_ns;    /* the output was last empty, or last drained */
	uint64_t output_moved_bytes; /* drained since then */

	/* TLS (daemon/tls.h): the credentials and mode in force when the
	 * connection began (a reference, until conn_kill), the session once
	 * STARTTLS was acknowledged, and what its handshake agreed (empty
	 * strings until then; kept for the log after the session is gone). */
	struct tls_creds *tls_creds;
	struct tls_conn *tls;
	char tls_version[16];
	char tls_cipher[64];
	/* (the client's identity is its peer's: peer.identity) */
	bool tls_listed; /* registry lock: the tls_* strings are final (conn_list) */

	/* For the line the log gets when the connection ends (conn_unref). */
	uint64_t started_ns;
	_Atomic uint64_t requests, bytes_read, bytes_written; /* answered; READ / WRITE data */
	/* WRITE payload bytes a sink took from the input buffer (copied), not
	 * straight from the socket. */
	_Atomic uint64_t payload_copied;
	char end_why[96]; /* why it ended: the first reason given */
	struct conn *reg_prev, *reg_next; /* the registry of conn_list (its lock) */
	atomic_bool disconnect_asked;	  /* conn_disconnect() was called */
	_Atomic uint32_t upgrades;	  /* times handed over to a new daemon (set at adoption) */
};

/*
 * The counters conn_list() reads from the control thread: only the
 * connection's worker writes them, so a relaxed load and store (plain
 * moves, no locked instruction on the request path) are enough.
 */
static inline void conn_counter_add(_Atomic uint64_t *v, uint64_t n)
{
	atomic_store_explicit(v, atomic_load_explicit(v, memory_order_relaxed) + n,
			      memory_order_relaxed);
}

static inline void conn_inflight_add(struct conn *c, int delta)
{
	atomic_store_explicit(&c->inflight,
			      atomic_load_explicit(&c->inflight, memory_order_relaxed) +
				  (unsigned)delta,
			      memory_order_relaxed);
}

/* One connection as conn_list() saw it. */
struct conn_info {
	uint64_t id;
	struct access_peer peer;
	bool transmitting; /* else negotiating */
	char export[4097]; /* "" while negotiating */
	uint64_t bytes_read, bytes_written, requests, payload_copied;
	unsigned inflight;
	uint64_t age_ms;
	unsigned worker;
	bool closing; /* a disconnect was asked for */
	unsigned upgrades; /* times it was handed over to a new daemon */
	bool tls;     /* its TLS handshake is done; then (identity: peer's): */
	char tls_version[16], tls_cipher[64];
};

/*
 * Any thread: a snapshot of every connection, in accept order (*out
 * malloc'd, *count entries). 0 or -ENOMEM.
 */
int conn_list(struct conn_info **out, size_t *count);
/*
 * Any thread: ask connection id's worker to close it: no more requests
 * are read, the replies of those in flight go out, then it is closed
 * (conn_begin_close, why in its end line); one still negotiating is
 * closed at once. 0, or -ENOENT when no connection has that id.
 */
int conn_disconnect(uint64_t id, const char *why);
/*
 * Worker: c's TLS handshake is done and its tls_* strings are filled in:
 * identity (certificate DN or PSK username, "" for none) becomes part of
 * its peer (for the access rules' allow-identities) and conn_list() shows
 * them (under the registry lock, the control thread's reads cannot race
 * the worker's writes).
 */
void conn_tls_established(struct conn *c, const char *identity);

/* Main thread, once, before any worker starts: the stall deadline in
 * seconds (--stall-timeout). */
void conn_set_stall_timeout(unsigned seconds);
/* Likewise: the seconds a client may take from connecting to GO /
 * EXPORT_NAME (--negotiation-timeout). */
void conn_set_negotiation_timeout(unsigned seconds);
/*
 * Adopt an accepted socket on the current worker thread: the connection
 * reads, and on_input(c) takes what arrives. *out is the connection (one
 * reference, the socket's). On failure fd is closed and -errno returned.
 */
int conn_start(struct conn_set *set, int fd, uint64_t id, const struct access_peer *peer,
	       void (*on_input)(struct conn *c), struct conn **out);
/* Stop reading and close once in-flight requests have replied (a long
 * one stops at its next step, with ESHUTDOWN: cancel_requests). */
void conn_shutdown(struct conn *c);
/* Stop reading; close when drained, or after CONN_CLOSE_TIMEOUT seconds.
 * why is what the log's line at the end of the connection says, unless
 * it is then killed for another reason (conn_kill). */
void conn_begin_close(struct conn *c, const char *why);
/* GO / EXPORT_NAME succeeded: the negotiation deadline no longer applies. */
void conn_negotiation_done(struct conn *c);
/* Close the socket now; the struct lives on until the last request is done. */
void conn_kill(struct conn *c, const char *why);
void conn_ref(struct conn *c);
void conn_unref(struct conn *c);
struct evbuffer *conn_output(struct conn *c);
struct evbuffer *conn_input(struct conn *c);
/*
 * Queue n bytes of a reply or option reply on the output. If the memory
 * for them cannot be had, the connection ends: a reply silently missing
 * would leave its client waiting for it for good. Nothing once killed.
 */
void conn_add(struct conn *c, const void *data, size_t n);
/*
 * Queue len bytes at data by reference, no copy: done(data, len, arg) once
 * the output has sent them or is freed (the connection killed), which the
 * owner follows with conn_ref_released(). Counted in the budget, whole
 * and with CONN_REF_OVERHEAD, until then. False (the connection ended, as
 * conn_add) when out of memory, or once killed: done() is not called.
 */
bool conn_add_ref(struct conn *c, const void *data, size_t len,
		  void (*done)(const void *data, size_t len, void *arg), void *arg);
/* A reference of len bytes is released (from its done callback). */
void conn_ref_released(struct conn *c, size_t len);
/* Re-evaluate whether to read more (after a reply or a drained output). */
void conn_update_reading(struct conn *c);
/*
 * c had its share of this turn of the loop (CONN_TURN_*): nothing more is
 * read from it and its input waits until its next turn, when it is handed
 * to c->on_input again (and reading resumes if it should).
 */
void conn_yield(struct conn *c);
/* Reserve cost reply bytes for the next request (budget_reserve); false:
 * refused, the connection stopped reading until conn_budget_wake(). */
bool conn_admit(struct conn *c, uint64_t cost);
/* The output buffer or its references changed: count it in the budget. */
void conn_output_sync(struct conn *c);
/* An admitted request waits for its payload, avail bytes of input so far
 * (started: it was just admitted). The stall deadline applies to it too:
 * --stall-timeout without CONN_STALL_PROGRESS more bytes ends it. */
void conn_payload_progress(struct conn *c, size_t avail, bool started);
/*
 * Receive the next len bytes of input into iov[0..niov) (see struct
 * conn_sink). true: they were all in the input buffer already and are
 * there now (done() is not called); false: the sink is set, and done()
 * will be called. Transmission only, one sink at a time.
 */
bool conn_sink_start(struct conn *c, const struct iovec *iov, size_t niov, uint64_t len,
		     void (*done)(struct conn *c, void *arg, uint64_t received), void *arg);
/* End the sink: done(c, arg, bytes received) once it is cleared (conn.c
 * calls it when the sink is full, or when the connection ends first). */
void conn_sink_end(struct conn *c);
/* Give back reply bytes reserved by conn_admit(). */
void conn_unreserve(struct conn *c, uint64_t bytes);
/*
 * TLS (daemon/tls.c) puts a filter bufferevent over the socket's: c->bev
 * becomes filter, with the connection's callbacks, watermarks and output
 * accounting moved to it; the socket's bufferevent is its underlying one
 * (freed with it). Its unsent ciphertext counts as output too (budget,
 * stall, drained). -ENOMEM: nothing changed.
 */
int conn_set_filter(struct conn *c, struct bufferevent *filter);
/* The socket took n bytes (TLS: of its ciphertext): the stall clock. */
void conn_output_moved(struct conn *c, size_t n);
/* The socket's descriptor (under a filter too); -1 once killed. */
int conn_fd(struct conn *c);
/*
 * A live upgrade: park c at a request boundary (on: no new request is
 * parsed; a payload being received is received, its request answered),
 * or resume it (off: reading again, and whatever input it holds parsed).
 * A connection still negotiating goes on negotiating, and parks once in
 * transmission, until conn_park_negotiation_end(c) stops it where it is.
 */
void conn_park(struct conn *c, bool on);
void conn_park_negotiation_end(struct conn *c);
/* Is c parked: no request in flight or half received, nothing unsent,
 * and not negotiating on? */
bool conn_parked(struct conn *c);
/* A live upgrade's new daemon: the input the old daemon had read from the
 * client and not parsed, put before anything read here. 0 or -ENOMEM. */
int conn_add_input(struct conn *c, const void *data, size_t len);
/* set's worker thread: budget came back; retry its waiting connections. */
void conn_budget_wake(struct conn_set *set);

#endif
