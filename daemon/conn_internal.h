/*
 * daemon/conn_internal.h: what conn.c, conn_socket.c and conn_registry.c
 * share. Not for anything outside those files.
 *
 *   conn.c          lifetime, the bufferevent, output accounting, timers,
 *                   reading on and off (conn_update_reading), the budget
 *   conn_socket.c   the plaintext socket's own reader and writer, sinks
 *   conn_registry.c every connection, for conn_list() and conn_disconnect()
 *   conn_set.c      a worker's connections, its yielded ones and their turns
 *
 * All of it runs on the connection's worker thread, but the registry,
 * which has its own lock.
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
/* The registry (conn_registry.c): from conn_start() to the free. */
void conn_registry_add(struct conn *c);
void conn_registry_remove(struct conn *c);
/* Replies drained (conn.c): the budget's wait, or reading again. */
void conn_output_drained(struct conn *c);
/* Reading on, and whatever input is buffered to the phase (conn.c). */
void conn_reading_on(struct conn *c);
/* The set (conn_set.c): from conn_start() to the free; the last one out
 * of a stopping set runs its on_empty. */
struct conn_set;
void conn_set_add(struct conn_set *set, struct conn *c);
void conn_set_remove(struct conn_set *set, struct conn *c);

#endif
