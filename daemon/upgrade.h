/*
 * daemon/upgrade.h: a live upgrade: the running daemon starts a new one
 * (another build, or the same) and hands it its listening sockets, its
 * control socket and every NBD connection in transmission, so that no
 * client is dropped.
 *
 * Owns: the hand-over on both sides. The old daemon runs it on a thread
 * of its own (upgrade_begin), the new one inside its start-up
 * (upgrade_child_*). They talk over a Unix SOCK_SEQPACKET pair, one state
 * record per message (daemon/upgrade_record.h), the socket's end passed
 * to the new daemon in NBDCACHED_UPGRADE_FD.
 *
 *   old                                   new
 *   spawn (same command line)  ------->   reads its config, opens its
 *                                         exports (nothing served yet)
 *                              <-------   HELLO (or ERROR, or it exits)
 *   dirty data written back while
 *   serving; accepting paused; every
 *   connection parked at a request
 *   boundary (host_park); the rest
 *   written back and flushed
 *   LISTENER x n, CONNECTION x m, END -->  binds what it was not given,
 *                                         starts its threads, checks each
 *                                         connection (its export's object,
 *                                         the access rules)
 *                              <-------   TAKEN (and how many it will
 *                                         close, and why)
 *   COMMIT, MAINPID= to systemd -->       serves every connection it
 *   closes what was not moved (still      admitted from its next request;
 *   negotiating, TLS), exits              closes the others
 *
 * Any failure before COMMIT rolls back: the new daemon is killed (by its
 * PID), every connection resumes, accepting resumes, and the reason is
 * the result's. Nothing a client sent is lost either way: a parked
 * connection has no request in flight, and the input read but not parsed
 * travels in its record (or stays, on a roll-back).
 *
 * A connection resumes on the object it was on, not on whatever the new
 * configuration gives its export's name: the record carries its backend's
 * identity, and the new daemon closes it (handshake_resume_export() says
 * why) if that export is now another file, device, server or window, if
 * the access rules no longer admit the client, or if the record has no
 * identity (an older daemon). Its replies were all sent by the old daemon
 * (it was parked), and the close waits for them to reach the client
 * (host_close_refused()); what it sent after them is never executed.
 *
 * Not handed over (and refused up front, since the new daemon cannot
 * open them while this one holds them): exports on an nbdkit: backend
 * (the nbdkit this daemon started holds their data; a new one would not)
 * and writable rbd: exports (this daemon holds the image's lock).
 */
#ifndef NBDCACHED_DAEMON_UPGRADE_H
#define NBDCACHED_DAEMON_UPGRADE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/upgrade_record.h"

struct host;
struct export_table;
struct worker;

/* Seconds the new daemon has to confirm each step, by default. */
#define UPGRADE_TIMEOUT_DEFAULT 30

struct upgrade_listener {
	int fd;
	enum upgrade_listener_kind kind;
	char *spec; /* the option's text (malloc'd); "" for socket activation */
};

/* What the old daemon hands over and how it pauses (server.c fills it). */
struct upgrade_server {
	struct host *hosts;
	unsigned host_count;
	struct export_table *exports;
	struct worker *flush_worker; /* the cache's flushes complete there */
	struct upgrade_listener *listeners;
	size_t listener_count;
	void (*accepting)(void *arg, bool on); /* pause, resume the listeners */
	void *arg;
	char **argv;	     /* the command line the daemon was started with */
	char self[4096];     /* its binary, resolved at start */
	atomic_bool ready;   /* filled in: upgrades may start */
	atomic_bool running; /* one is in progress */
};

struct upgrade_result {
	bool committed; /* the new daemon serves: the caller must exit now */
	pid_t pid;	/* the new daemon's */
	/* Connections the new daemon serves; closed: by this daemon (not
	 * parked, negotiating, TLS) and by the new one; refused: of those
	 * closed, by the new one (another object, the access rules), and why. */
	unsigned moved, closed, refused;
	char refused_why[UPGRADE_MAX_TEXT + 1];
	uint64_t pause_ms; /* from parking to COMMIT */
	char why[1100];	   /* failed: why (the new daemon's own error if it said one) */
};

/*
 * Start an upgrade to binary (NULL: u->self) on a thread of its own; each
 * step waits at most timeout_s seconds for the new daemon. done(r, arg)
 * runs on that thread at the end; if r->committed, it must end the
 * process (_exit) once it has said so: the connections are the new
 * daemon's. -EBUSY: one is in progress; -errno: it could not start.
 */
int upgrade_begin(struct upgrade_server *u, const char *binary, unsigned timeout_s,
		  void (*done)(const struct upgrade_result *r, void *arg), void *arg);
/* Why this daemon cannot be upgraded live, or NULL: it can. */
const char *upgrade_refusal(struct export_table *exports, char *buf, size_t len);

/* ---- The new daemon ---- */

struct upgrade_taken_conn {
	int fd;
	struct upgrade_conn_state st; /* st.pending: malloc'd */
	/* Set before upgrade_child_commit(): why this daemon will close it
	 * rather than serve it (malloc'd), or NULL. */
	char *refused;
};

/* What the old daemon handed over. */
struct upgrade_taken {
	struct upgrade_listener *listeners; /* fd -1 once taken */
	size_t listener_count;
	struct upgrade_taken_conn *conns;
	size_t conn_count;
};

/* The hand-over's socket from NBDCACHED_UPGRADE_FD (removed from the
 * environment), or -1: this daemon was started normally. Call first. */
int upgrade_child_fd(void);
/* How long a new daemon waits for the old one to release the cache
 * device (the old one's --timeout ends it sooner). */
#define UPGRADE_DEVICE_WAIT_MS 120000u
/* Say HELLO: the old daemon starts to hand over (with a cache device, it
 * releases the device at its pause; said before the cache is created,
 * which waits for it). 0 or -errno (why set). */
int upgrade_child_hello(int fd, char *why, size_t why_len);
/* Say HELLO unless hello_sent, and receive everything up to END (blocks).
 * 0 or -errno (why set; the old daemon rolls back). */
int upgrade_child_receive(int fd, bool hello_sent, struct upgrade_taken *t, char *why,
			  size_t why_len);
/* The listener handed over for (kind, spec), now the caller's, or -1. */
int upgrade_take_listener(struct upgrade_taken *t, enum upgrade_listener_kind kind,
			  const char *spec);
/* Say TAKEN (with how many of t's connections are refused, and why, to
 * an old daemon that reads it) and wait for COMMIT: 0 (serve), or -errno
 * (exit: the old daemon serves on). Closes fd. */
int upgrade_child_commit(int fd, const struct upgrade_taken *t);
/* Tell the old daemon why this one cannot take over (ERROR). */
void upgrade_child_fail(int fd, const char *why);
/* Close the listeners not taken, free the rest. */
void upgrade_taken_free(struct upgrade_taken *t);

#endif
