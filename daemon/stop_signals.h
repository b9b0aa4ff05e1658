/*
 * daemon/stop_signals.h: the signals that stop or steer the daemon, from
 * main()'s first line until its event loop takes them.
 *
 * SIGTERM and SIGINT stop it; SIGHUP, SIGUSR1 and SIGUSR2 steer it (reload,
 * statistics, live upgrade). Until a handler is installed, each of them
 * would end the process by its default action, sockets and pidfile left
 * behind. stop_signals_block() blocks the five before anything is created,
 * so every thread started later inherits the mask, and a signal sent
 * during the start stays pending instead:
 *
 *   main()      start steps (server.c)               the event loop
 *   block ----> stop_signal_take() between steps --> unblock (main thread:
 *               stop_signal_pending() in a backend's  libevent's handlers)
 *               waits: -EINTR, the start stops
 *               cleanly (exit 0)
 *
 * Once server_run() has installed the loop's handlers,
 * stop_signals_unblock() lets the main thread take them; the other
 * threads keep them blocked, so each one lands on the loop. Under
 * libevent's handlers stands one that does nothing (libevent puts it back
 * when it lets go of a signal), so a signal during the shutdown, after the
 * loop's handlers are gone, is absorbed (or counted by the cache's
 * writeback, which installs its own) rather than fatal. A child forked
 * and exec'd (nbdkit, through libnbd, from any thread) starts with the
 * mask main() began with, never with these blocked. Without --foreground
 * the process that was started stays until its child serves, and relays
 * them (stop_signals_relay()): a stop sent to the PID a shell knows is
 * never lost across the fork.
 *
 * stop_signal_pending() is for any thread; the rest is the main thread's.
 */
#ifndef NBDCACHED_DAEMON_STOP_SIGNALS_H
#define NBDCACHED_DAEMON_STOP_SIGNALS_H

#include <stdbool.h>
#include <sys/types.h>

/* Block the five in the calling (only) thread and stand the absorbing
 * handler under them. First thing in main(). */
void stop_signals_block(void);
/* Put back the mask and handlers main() found (--check-config, --help:
 * what runs without a start to stop). */
void stop_signals_restore(void);
/* SIGTERM or SIGINT pending, not taken: its number, else 0. */
int stop_signal_pending(void);
/* The same, and taken (every pending SIGTERM and SIGINT): the start acts
 * on it once. */
int stop_signal_take(void);
/* The main thread takes the five from now on (the loop's handlers, or the
 * absorbing one). */
void stop_signals_unblock(void);
/* Detaching: the daemon's own fork keeps them blocked in its child (which
 * goes on starting). */
void stop_signals_keep_in_child(bool keep);
/*
 * The parent of a detaching daemon (the process a shell or a service
 * manager knows): every one of the five sent to it, before or while it
 * waits, is passed on to child, until child writes a byte to ready (it
 * serves: 0) or ends first (its exit status: a start that failed, or a
 * stop before serving). What the parent exits with.
 */
int stop_signals_relay(pid_t child, int ready);

#endif
