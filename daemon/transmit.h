/*
 * daemon/transmit.h: the transmission phase, server side (transmit.c; a
 * WRITE's payload: transmit_receive.c).
 *
 * Owns: the connection's requests and their replies (struct conn,
 * "Transmission"), and those the export's QoS limits hold back
 * (transmit_throttle.c). Called by session.c once the handshake set
 * CONN_TRANSMISSION; uses the connection's primitives (conn.h), the cache
 * and the backend, never the handshake. Worker thread only.
 */
#ifndef NBDCACHED_DAEMON_TRANSMIT_H
#define NBDCACHED_DAEMON_TRANSMIT_H

struct conn;

/* One request off the input buffer: 1 if it consumed one, 0 if it needs
 * more bytes, -1 if the connection was closed (or is closing). */
int transmit_step(struct conn *c);

#endif
