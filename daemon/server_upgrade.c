/*
 * daemon/server_upgrade.c: the process's part in a live upgrade
 * (daemon/upgrade.h): what it hands over (upgrade_setup), SIGUSR2, pausing
 * its listeners for the upgrade thread, and, in the new daemon, which of
 * the connections it was handed it serves (commit_upgrade) and those
 * dealt to its workers (adopt_connections).
 */
#include <errno.h>
#include <event2/listener.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/budget.h"
#include "daemon/control.h"
#include "daemon/handshake.h"
#include "daemon/host.h"
#include "daemon/log.h"
#include "daemon/server_internal.h"
#include "daemon/upgrade.h"

/* The upgrade thread pauses and resumes accepting (the listeners are
 * thread-safe: LEV_OPT_THREADSAFE). */
static void on_accepting(void *arg, bool on)
{
	struct server *s = arg;
	for (size_t i = 0; i < s->listener_count; i++) {
		if (!s->listeners[i].ev)
			continue;
		if (on)
			evconnlistener_enable(s->listeners[i].ev);
		else
			evconnlistener_disable(s->listeners[i].ev);
	}
}

/* What this daemon hands over if it is upgraded: its listeners, its
 * control and metrics sockets, its workers; the binary it runs. */
int upgrade_setup(struct upgrade_server *up, struct server *s, char **argv, int control_fd,
		  const char *control_path, int metrics_fd, const char *metrics)
{
	size_t n = s->listener_count + 2;
	up->listeners = calloc(n, sizeof(*up->listeners));
	if (!up->listeners)
		return -ENOMEM;
	for (size_t i = 0; i < s->listener_count; i++)
		up->listeners[up->listener_count++] = (struct upgrade_listener){
		    .fd = s->listeners[i].fd,
		    .kind = s->listeners[i].kind,
		    .spec = s->listeners[i].spec ? s->listeners[i].spec : (char *)""};
	if (control_fd >= 0)
		up->listeners[up->listener_count++] = (struct upgrade_listener){
		    .fd = control_fd, .kind = UPGRADE_LISTEN_CONTROL, .spec = (char *)control_path};
	if (metrics_fd >= 0)
		up->listeners[up->listener_count++] = (struct upgrade_listener){
		    .fd = metrics_fd, .kind = UPGRADE_LISTEN_METRICS, .spec = (char *)metrics};
	up->hosts = s->workers;
	up->host_count = s->worker_count;
	up->exports = &s->exports;
	up->flush_worker = control_worker(s->control);
	up->accepting = on_accepting;
	up->arg = s;
	up->argv = argv;
	ssize_t len = readlink("/proc/self/exe", up->self, sizeof(up->self) - 1);
	up->self[len > 0 ? (size_t)len : 0] = '\0';
	if (len <= 0)
		snprintf(up->self, sizeof(up->self), "%s", argv[0]);
	atomic_store(&up->ready, true); /* upgrades may start now */
	return 0;
}

static void on_upgrade_done(const struct upgrade_result *r, void *arg)
{
	(void)arg;
	if (r->committed) {
		log_info("upgrade: pid %d serves from here on; exiting", (int)r->pid);
		_exit(0);
	}
}

/* SIGUSR2: upgrade to the binary this daemon runs (its path now). */
void on_upgrade_signal(evutil_socket_t sig, short what, void *arg)
{
	(void)sig;
	(void)what;
	struct upgrade_server *up = arg;
	char buf[512];
	const char *why = upgrade_refusal(up->exports, buf, sizeof(buf));
	if (why) {
		log_error("SIGUSR2: upgrade refused: %s", why);
		return;
	}
	log_info("SIGUSR2: upgrading");
	int rc = upgrade_begin(up, NULL, 0, on_upgrade_done, NULL);
	if (rc < 0)
		log_error("SIGUSR2: %s",
			  rc == -EBUSY ? "an upgrade is in progress already" : strerror(-rc));
}

/* Who a connection handed over comes from: its socket's peer. */
static void taken_peer(int fd, struct access_peer *peer)
{
	struct sockaddr_storage sa;
	socklen_t len = sizeof(sa);
	if (getpeername(fd, (struct sockaddr *)&sa, &len) < 0)
		len = 0;
	access_peer_from_socket(peer, fd, &sa, len);
}

/*
 * The new daemon of a live upgrade, everything open and its threads
 * started: which of the connections handed over will it serve? Those
 * that resume on the object they were on, for a client the access rules
 * in force admit (handshake_resume_export()); the others are marked with
 * the reason, which TAKEN tells the old daemon (its reply says it) and
 * adopt_connections() logs as it closes them. Nothing is done to their
 * sockets before COMMIT: the old daemon may still roll back and resume
 * them. Then TAKEN and the wait for COMMIT (upgrade_child_commit()).
 */
int commit_upgrade(struct server *s, int fd)
{
	struct upgrade_taken *t = s->taken;
	for (size_t i = 0; i < t->conn_count; i++) {
		struct upgrade_taken_conn *c = &t->conns[i];
		struct access_peer peer;
		taken_peer(c->fd, &peer);
		char why[1024];
		struct export *e =
		    handshake_resume_export(&s->exports, &c->st, &peer, why, sizeof(why));
		access_peer_release(&peer);
		if (e) {
			export_put(e);
			continue;
		}
		c->refused = strdup(why);
		if (!c->refused) {
			close(fd); /* the old daemon rolls back */
			return -ENOMEM;
		}
	}
	return upgrade_child_commit(fd, t);
}

/* The new daemon of a live upgrade, committed: serve every connection
 * handed over, dealt round robin to the workers like accepted ones, but
 * those commit_upgrade() refused, which are closed there. */
void adopt_connections(struct server *s)
{
	for (size_t i = 0; i < s->taken->conn_count; i++) {
		struct upgrade_taken_conn *t = &s->taken->conns[i];
		struct host *h = &s->workers[s->next_worker++ % s->worker_count];
		if (t->st.id > s->next_conn_id)
			s->next_conn_id = t->st.id;
		if (t->refused) {
			log_warn("conn %llu: closed by the new daemon: %s",
				 (unsigned long long)t->st.id, t->refused);
			host_close_refused(h, t->fd, t->st.id);
			t->fd = -1;
			continue;
		}
		struct access_peer peer;
		taken_peer(t->fd, &peer);
		if (!budget_client_add()) {
			log_warn("conn %llu: over --max-clients after the upgrade; closed",
				 (unsigned long long)t->st.id);
			access_peer_release(&peer);
			continue;
		}
		budget_peer_add(&peer, 0); /* counted; the limit was checked at accept */
		host_adopt(h, t->fd, &peer, &t->st);
		t->fd = -1;
	}
}

/* A new daemon that did not take over: the Unix socket paths it was
 * handed are still the old daemon's, not to be removed. */
void forget_unix_paths(struct server *s)
{
	for (size_t i = 0; i < s->listener_count; i++) {
		free(s->listeners[i].unix_path);
		s->listeners[i].unix_path = NULL;
	}
}
