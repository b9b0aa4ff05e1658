/*
 * daemon/session.h: a client connection from accept to close, as the
 * protocol sees it.
 *
 * Owns: nothing of its own; it is the one place that calls down into the
 * phases' code by the connection's phase (handshake.c before GO /
 * EXPORT_NAME, transmit.c after), the dispatch conn.h draws. The handshake
 * hands over to transmission only by setting the phase, which the
 * dispatch reads before each step.
 *
 * Worker thread only, like the connection (conn.h).
 */
#ifndef NBDCACHED_DAEMON_SESSION_H
#define NBDCACHED_DAEMON_SESSION_H

#include <stdint.h>

struct access_peer;
struct conn_set;

/* Adopt an accepted socket on the current worker thread (set's) and greet
 * the client. On failure fd is closed and -errno returned. */
int session_start(struct conn_set *set, int fd, uint64_t id, const struct access_peer *peer);

struct upgrade_conn_state;
/*
 * A live upgrade's new daemon: adopt a socket handed over in transmission
 * (st: what the old daemon had negotiated on it, its counters, the input
 * it had read and not parsed) and serve it on from its next request. On
 * failure fd is closed and -errno returned; a connection the new
 * configuration cannot serve as negotiated is closed, with its reason in
 * its end line (handshake_resume), and 0 returned.
 */
int session_adopt(struct conn_set *set, int fd, const struct access_peer *peer,
		  const struct upgrade_conn_state *st);

#endif
