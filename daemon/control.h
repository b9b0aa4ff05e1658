/*
 * daemon/control.h: the control thread: the control socket
 * (include/nbdcached/control.h is its protocol), config reloads, and
 * closing what removed exports leave behind.
 *
 * Owns: one thread (a struct worker with no NBD connection) and everything
 * that runs on it: control clients, the once-a-second rate sampler and
 * reaper, and reloads. Reloads from SIGHUP and from the control socket both
 * run here, one at a time. Blocking work (a compaction pass, opening a new
 * backend at reload) blocks only this thread, never an NBD worker.
 *
 * Called from the main thread: control_start() after the workers started,
 * control_reload() from the SIGHUP handler, control_stop() after the NBD
 * workers have stopped and before the cache writes everything back.
 *
 * Files: control.c (the socket and dispatch), control_stats.c,
 * control_cache.c, control_reload.c; control_internal.h is what they share.
 */
#ifndef NBDCACHED_DAEMON_CONTROL_H
#define NBDCACHED_DAEMON_CONTROL_H

#include <stddef.h>

#include "daemon/cache/cache.h"
#include "daemon/export.h"
#include "daemon/options.h"

struct control;
struct upgrade_server;

struct control_config {
	struct export_table *exports;
	struct cache *cache;
	const struct options *opts; /* as started; outlives the control thread */
	int argc;		    /* the command line, re-read at each reload */
	char **argv;
	unsigned threads;      /* NBD worker threads */
	const int *listen_fds; /* NBD listening sockets, for "status" */
	size_t listen_count;
	int control_fd;		  /* a bound, listening Unix socket; -1: none */
	const char *control_path; /* to unlink at stop */
	struct upgrade_server *upgrade; /* live upgrades (upgrade.h); NULL: none */
};

/* Bind the control socket: 0 and *fd, or -errno (logged). path NULL: the
 * default, where failing is only a warning (*fd = -1). */
int control_listen(const char *path, int *fd);
int control_start(const struct control_config *cfg, struct control **out);
/* Thread-safe: re-read the config file soon (SIGHUP). */
void control_reload(struct control *ctl);
/* The control thread's worker (a live upgrade's flushes complete there). */
struct worker *control_worker(struct control *ctl);
/* Finish pending requests, close clients, end the thread, unlink the socket. */
void control_stop(struct control *ctl);

#endif
