/*
 * daemon/handshake.h: fixed newstyle negotiation, server side (handshake.c),
 * from the greeting to GO / EXPORT_NAME.
 *
 * Owns: the connection's negotiation fields (struct conn, "Negotiation").
 * On success it enters transmission by setting c->phase and c->session;
 * it never calls into transmission (session.c dispatches by phase). Uses
 * the connection's primitives (conn.h) only. Worker thread only.
 */
#ifndef NBDCACHED_DAEMON_HANDSHAKE_H
#define NBDCACHED_DAEMON_HANDSHAKE_H

#include <stdbool.h>

struct conn;

/* Queue the server's greeting: the first thing a new connection sends. */
void handshake_send_greeting(struct conn *c);
/* One step of negotiation: 1 if it consumed a message, 0 if it needs more
 * bytes, -1 if the connection was closed (or is closing). */
int handshake_step(struct conn *c);

struct upgrade_conn_state;
/*
 * A live upgrade's new daemon: put c, just started on a socket handed
 * over, in transmission as the old daemon had negotiated it (st): the same
 * export, size, transmission flags and block sizes, structured replies,
 * extended headers, meta context. false (c killed, the reason in its end
 * line) when the new configuration no longer has that export, or gives it
 * another size, other flags or other block sizes, or it is at its
 * connection limit.
 */
bool handshake_resume(struct conn *c, const struct upgrade_conn_state *st);

#endif
