/*
 * daemon/conn_internal.h: what conn.c and conn_socket.c share. Not for
 * anything outside those two files.
 *
 *   conn.c          lifetime, the bufferevent, output accounting, timers,
 *                   reading on and off (conn_update_reading), the budget
 *   conn_socket.c   the plaintext socket's own reader and writer, sinks
 *
 * All of it runs on the connection's worker thread.
 */
#ifndef NBDCACHED_DAEMON_CONN_INTERNAL_H
#define NBDCACHED_DAEMON_CONN_INTERNAL_H

#include <event2/util.h>
#include <stdbool.h>

struct conn;

/* Reading on or off: the connection's own reader, or the bufferevent's. */
void conn_read_set(struct conn *c, bool on);
/* The input buffer got bytes: a sink takes its own, then the phase. */
void conn_input_ready(struct conn *c);
/* The reader's and the writer's events (conn_start). */
void conn_on_readable(evutil_socket_t fd, short what, void *arg);
void conn_on_writable(evutil_socket_t fd, short what, void *arg);
/* Replies drained (conn.c): the budget's wait, or reading again. */
void conn_output_drained(struct conn *c);

#endif
