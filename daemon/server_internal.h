/*
 * daemon/server_internal.h: what server.c and server_upgrade.c share: the
 * process's listeners and its state. Not for anything else.
 */
#ifndef NBDCACHED_DAEMON_SERVER_INTERNAL_H
#define NBDCACHED_DAEMON_SERVER_INTERNAL_H

#include <event2/util.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/export.h"
#include "daemon/upgrade_record.h"

struct cache;
struct control;
struct event;
struct event_base;
struct evconnlistener;
struct host;
struct metrics;
struct upgrade_server;
struct upgrade_taken;

struct listener {
	int fd;
	char *unix_path; /* to unlink at exit; NULL for TCP */
	struct evconnlistener *ev;
	enum upgrade_listener_kind kind; /* for a live upgrade */
	char *spec;			 /* ... the option it was bound from */
};

struct server {
	struct event_base *base;
	struct event *accept_resume; /* re-enables listeners after EMFILE */
	struct export_table exports;
	struct cache *cache;
	struct host *workers;
	unsigned worker_count;
	unsigned next_worker;
	uint64_t next_conn_id;
	struct listener *listeners;
	size_t listener_count;
	struct control *control;
	struct metrics *metrics; /* NULL: no --metrics */
	unsigned max_clients;
	bool refusing;		     /* at --max-clients: said so once for this spell */
	struct upgrade_taken *taken; /* a live upgrade's new daemon: what it was handed */
};

/* server_upgrade.c, called from server_run(): */
/* What this daemon hands over if it is upgraded; 0 or -ENOMEM. */
int upgrade_setup(struct upgrade_server *up, struct server *s, char **argv, int control_fd,
		  const char *control_path, int metrics_fd, const char *metrics);
/* SIGUSR2: arg is the struct upgrade_server. */
void on_upgrade_signal(evutil_socket_t sig, short what, void *arg);
/* The new daemon, ready: which connections handed over it will serve,
 * then TAKEN and the wait for COMMIT: 0 (serve), or -errno. Closes fd. */
int commit_upgrade(struct server *s, int fd);
/* The new daemon, committed: serve every connection it was handed (but
 * those commit_upgrade() refused: closed, saying why). */
void adopt_connections(struct server *s);
/* A new daemon that did not take over leaves the Unix socket paths. */
void forget_unix_paths(struct server *s);

#endif
