/*
 * daemon/handshake.h: fixed newstyle negotiation, server side (handshake.c),
 * from the greeting to GO / EXPORT_NAME.
 *
 * Owns: the connection's negotiation fields (struct conn, "Negotiation").
 * On success it enters transmission by setting c->phase and c->session;
 * it never calls into transmission (session.c dispatches by phase). Uses
 * the connection's primitives (conn.h) only. Worker thread only, but for
 * handshake_resume_export().
 */
#ifndef NBDCACHED_DAEMON_HANDSHAKE_H
#define NBDCACHED_DAEMON_HANDSHAKE_H

#include <stdbool.h>
#include <stddef.h>

struct conn;

/* Queue the server's greeting: the first thing a new connection sends. */
void handshake_send_greeting(struct conn *c);
/* One step of negotiation: 1 if it consumed a message, 0 if it needs more
 * bytes, -1 if the connection was closed (or is closing). */
int handshake_step(struct conn *c);

struct access_peer;
struct export;
struct export_table;
struct upgrade_conn_state;
/*
 * A live upgrade's new daemon: may the connection st, handed over from
 * client peer, resume on the export of its name in table t? It may when
 * that export is the object it was on (the same backend, a file or block
 * device by its device and inode, at the same offset: st's identity,
 * upgrade_record.h), the access rules in force admit the client to it as
 * they would at GO (a plaintext client: an export that now requires TLS
 * refuses it), and it keeps the size, transmission flags and block sizes
 * the client was told. The export (a reference), or NULL with why: not
 * in the configuration, handed over without an identity (an older
 * daemon), another backend or window, not admitted, changed. Any thread:
 * the new daemon asks it before it confirms the hand-over
 * (adopt_connections closes those refused), and handshake_resume again.
 */
struct export *handshake_resume_export(struct export_table *t, const struct upgrade_conn_state *st,
				       const struct access_peer *peer, char *why, size_t len);
/*
 * Put c, just started on a socket handed over, in transmission as the old
 * daemon had negotiated it (st): the same export, size, transmission
 * flags and block sizes, structured replies, extended headers, meta
 * context. false (c killed, the reason in its end line) when
 * handshake_resume_export() refuses it, or the export is at its
 * connection limit.
 */
bool handshake_resume(struct conn *c, const struct upgrade_conn_state *st);

#endif
