/*
 * daemon/server.h: the process: listeners, workers, signals, pidfile.
 *
 * Owns: the listening sockets (TCP and Unix), the worker threads and the
 * main thread's event loop, which only accepts connections and handles
 * signals. Accepted sockets are dealt round robin to the workers.
 *
 * SIGHUP re-reads the config file (control.h does it, on its thread).
 * Shutdown (SIGTERM, SIGINT): stop accepting, let every worker finish its
 * in-flight requests, remove Unix sockets and the pidfile, exit 0.
 */
#ifndef NBDCACHED_DAEMON_SERVER_H
#define NBDCACHED_DAEMON_SERVER_H

#include "daemon/options.h"

/* Run until a shutdown signal. Returns the process exit status. */
/* upgrade_fd: a live upgrade's hand-over socket (upgrade_child_fd), or -1;
 * set to -1 once used. */
int server_run(const struct options *opts, int argc, char **argv, int *upgrade_fd);

#endif
