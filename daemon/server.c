/*
 * daemon/server.c: see server.h.
 *
 * Start-up order matters: exports are opened and sockets bound first, so a
 * mistake fails before the daemon detaches; the process forks (unless
 * --foreground) before any event base or thread exists, because neither
 * survives fork(); the pidfile is written last, when the daemon is ready.
 *
 * A stop may come at any moment of that: the signals are blocked from
 * main()'s first line (stop_signals.h), the start asks for a pending
 * SIGTERM or SIGINT after each step that can take long (stopped_at()) and
 * ends there as a clean stop (exit 0, what it made removed, "stopped"),
 * and the main thread takes the signals once the loop's handlers are in.
 */
#include "daemon/server.h"

#include <errno.h>
#include <fcntl.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <netdb.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/budget.h"
#include "daemon/cache/cache.h"
#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/control.h"
#include "daemon/export.h"
#include "daemon/host.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/tls.h"
#include "daemon/server_internal.h"
#include "daemon/stop_signals.h"
#include "daemon/upgrade.h"
#include "include/nbdcached/control.h"

/* The lines a client's connects cause, each kind under its rate limit
 * (log.h): a flood of connects must not flood the log. */
LOG_LIMIT(refused_access_log, "connections refused at accept by the access rules");
LOG_LIMIT(refused_per_client_log, "connections refused at accept by --max-connections-per-client");
LOG_LIMIT(max_clients_log, "--max-clients refusals begun and ended");
LOG_LIMIT(accept_error_log, "accept errors");

/*
 * The access rules and the per-client limit at accept (main thread): a
 * client the global rules refuse is closed at once, and so is one over its
 * connection count, each with a line (rate-limited). false: fd is closed
 * (and peer released).
 */
static bool accept_allowed(int fd, struct access_peer *peer)
{
	struct access_policy *p = access_policy_get();
	char why[160] = "";
	bool ok = !p || access_rules_allow(&p->global, peer, why, sizeof(why));
	unsigned limit = p ? p->max_per_client : 0;
	access_policy_put(p);
	if (!ok) {
		log_limited(&refused_access_log, LOG_WARN,
			    "refused %s: %s (global access rules); closed at accept", peer->text,
			    why);
		budget_count_refused_access();
	} else if (budget_peer_add(peer, limit)) {
		return true;
	} else {
		log_limited(&refused_per_client_log, LOG_WARN,
			    "refused %s: it has %u connections (--max-connections-per-client); "
			    "closed at accept",
			    peer->text, limit);
	}
	access_peer_release(peer);
	evutil_closesocket(fd);
	return false;
}

/* A listening TCP socket on spec (HOST:PORT, the first address it names
 * that binds), in *out; what: the option, for the log. 0 or -errno. */
static int tcp_socket(const char *what, const char *spec, int *out)
{
	char host[256], port[16];
	if (options_split_host_port(spec, host, sizeof(host), port, sizeof(port)) < 0)
		return -EINVAL;
	struct addrinfo hints = {.ai_family = AF_UNSPEC,
				 .ai_socktype = SOCK_STREAM,
				 .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
	struct addrinfo *res, *ai;
	int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
	if (gai != 0) {
		log_error("%s %s: %s", what, spec, gai_strerror(gai));
		return -EINVAL;
	}
	int rc = -EADDRNOTAVAIL;
	for (ai = res; ai; ai = ai->ai_next) {
		int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
		if (fd < 0)
			continue;
		int one = 1;
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (ai->ai_family == AF_INET6)
			setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
		if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
			rc = -errno;
			close(fd);
			continue;
		}
		*out = fd;
		rc = 0;
		break; /* one address per --listen */
	}
	freeaddrinfo(res);
	if (rc < 0)
		log_error("%s %s: %s", what, spec, strerror(-rc));
	return rc;
}

static int listen_tcp(struct server *s, const char *spec)
{
	char *copy = strdup(spec);
	if (!copy)
		return -ENOMEM;
	int fd = s->taken ? upgrade_take_listener(s->taken, UPGRADE_LISTEN_TCP, spec) : -1;
	if (fd >= 0) {
		log_info("listening on %s (handed over)", spec);
	} else {
		int rc = tcp_socket("--listen", spec, &fd);
		if (rc < 0) {
			free(copy);
			return rc;
		}
		log_info("listening on %s", spec);
	}
	s->listeners[s->listener_count++] =
	    (struct listener){.fd = fd, .kind = UPGRADE_LISTEN_TCP, .spec = copy};
	return 0;
}

/*
 * A --unix socket: PATH[,mode=OCTAL][,group=GROUP] (option_values.h).
 * With a mode or a group the socket is bound under umask 0777 (nobody may
 * connect yet), then given its group and mode: no moment when it is open
 * to more than asked.
 */
static int listen_unix(struct server *s, const char *spec)
{
	struct unix_listen u;
	char why[300];
	int rc = options_parse_unix(spec, &u, why, sizeof(why));
	if (rc < 0) {
		log_error("--unix %s: %s", spec, why);
		return rc;
	}
	const char *path = u.path;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	int taken = s->taken ? upgrade_take_listener(s->taken, UPGRADE_LISTEN_UNIX, spec) : -1;
	if (taken >= 0) {
		char *p = strdup(path), *sp = strdup(spec);
		if (!p || !sp) {
			free(p);
			free(sp);
			close(taken);
			return -ENOMEM;
		}
		s->listeners[s->listener_count++] = (struct listener){
		    .fd = taken, .unix_path = p, .kind = UPGRADE_LISTEN_UNIX, .spec = sp};
		log_info("listening on unix socket %s (handed over)", path);
		return 0;
	}
	strcpy(sa.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	struct stat st;
	if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
		unlink(path); /* a stale socket from an earlier run */
	bool restrict_first = u.has_mode || u.has_group;
	mode_t old = restrict_first ? umask(0777) : 0;
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		rc = -errno;
	if (restrict_first)
		umask(old);
	if (rc == 0 && u.has_group && chown(path, (uid_t)-1, (gid_t)u.gid) < 0)
		rc = -errno;
	if (rc == 0 && restrict_first &&
	    chmod(path, u.has_mode ? (mode_t)u.mode : (0777 & ~old)) < 0)
		rc = -errno;
	if (rc == 0 && listen(fd, 128) < 0)
		rc = -errno;
	if (rc < 0) {
		close(fd);
		log_error("--unix %s: %s", spec, strerror(-rc));
		return rc;
	}
	char *copy = strdup(path), *spec_copy = strdup(spec);
	if (!copy || !spec_copy) {
		free(copy);
		free(spec_copy);
		close(fd);
		unlink(path);
		return -ENOMEM;
	}
	s->listeners[s->listener_count++] = (struct listener){
	    .fd = fd, .unix_path = copy, .kind = UPGRADE_LISTEN_UNIX, .spec = spec_copy};
	if (restrict_first)
		log_info("listening on unix socket %s (mode %04o, group %u)", path,
			 u.has_mode ? u.mode : (unsigned)(0777 & ~old),
			 u.has_group ? u.gid : (unsigned)getegid());
	else
		log_info("listening on unix socket %s", path);
	return 0;
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len,
		      void *arg)
{
	(void)l;
	struct server *s = arg;
	struct access_peer peer;
	access_peer_from_socket(&peer, fd, sa, len > 0 ? (size_t)len : 0);
	if (!accept_allowed(fd, &peer))
		return;
	/* Accept and close, not leave in the backlog: the client learns at
	 * once, and the listener does not fire again and again. */
	if (!budget_client_add()) {
		budget_peer_remove(&peer);
		access_peer_release(&peer);
		if (!s->refusing)
			log_limited(&max_clients_log, LOG_WARN,
				    "%u clients connected (--max-clients): refusing new "
				    "connections until one closes",
				    s->max_clients);
		s->refusing = true;
		evutil_closesocket(fd);
		return;
	}
	if (s->refusing) {
		struct budget_stats st;
		budget_get_stats(&st);
		log_limited(&max_clients_log, LOG_INFO,
			    "accepting connections again (%llu refused in all)",
			    (unsigned long long)st.refused_clients);
		s->refusing = false;
	}
	struct host *h = &s->workers[s->next_worker++ % s->worker_count];
	host_hand_off(h, fd, ++s->next_conn_id, &peer);
}

/*
 * EMFILE and friends: the pending connection stays in the backlog, so a
 * listener left enabled would fire again at once, forever. Pause every
 * listener for a second instead; clients wait in the backlog meanwhile.
 */
static void on_accept_error(struct evconnlistener *l, void *arg)
{
	(void)l;
	struct server *s = arg;
	log_limited(&accept_error_log, LOG_WARN, "accept: %s; pausing new connections for 1 s",
		    strerror(EVUTIL_SOCKET_ERROR()));
	for (size_t i = 0; i < s->listener_count; i++)
		if (s->listeners[i].ev)
			evconnlistener_disable(s->listeners[i].ev);
	struct timeval tv = {1, 0};
	evtimer_add(s->accept_resume, &tv);
}

static void on_accept_resume(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct server *s = arg;
	for (size_t i = 0; i < s->listener_count; i++)
		if (s->listeners[i].ev)
			evconnlistener_enable(s->listeners[i].ev);
}

static void close_listeners(struct server *s)
{
	for (size_t i = 0; i < s->listener_count; i++) {
		struct listener *l = &s->listeners[i];
		if (l->ev)
			evconnlistener_free(l->ev); /* closes the fd */
		else if (l->fd >= 0)
			close(l->fd);
		if (l->unix_path) {
			unlink(l->unix_path);
			free(l->unix_path);
		}
		free(l->spec);
	}
	s->listener_count = 0;
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
	(void)what;
	struct server *s = arg;
	log_info("signal %d: shutting down", (int)sig);
	sd_notify(0, "STOPPING=1\nSTATUS=stopping: finishing requests, writing dirty data back");
	event_base_loopexit(s->base, NULL);
}

/*
 * Stopping with data still to write back (about once a second): each
 * second in which some of it became durable extends systemd's stop
 * timeout (TimeoutStopSec=) by STOP_EXTEND_SECONDS, so a slow backend is
 * not cut off by SIGKILL while it makes progress; one that takes nothing
 * for that long is (nbdcached(8), "SIGNALS").
 */
#define STOP_EXTEND_SECONDS 30

static void on_stop_progress(uint64_t remaining, void *arg)
{
	uint64_t *last = arg;
	if (remaining < *last) {
		sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%llu\nSTATUS=stopping: %llu bytes to write back",
			   (unsigned long long)STOP_EXTEND_SECONDS * 1000000u,
			   (unsigned long long)remaining);
	}
	*last = remaining;
}

/* Tell systemd we are alive (WatchdogSec=), at half its interval. */
static void on_watchdog(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	sd_notify(0, "WATCHDOG=1");
}

/*
 * Listening sockets passed by systemd (socket activation, LISTEN_FDS), or
 * by systemd-socket-activate. Returns how many were adopted, or -errno.
 */
static int adopt_systemd_sockets(struct server *s, int n)
{
	for (int i = 0; i < n; i++) {
		int fd = SD_LISTEN_FDS_START + i;
		if (sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1) <= 0) {
			log_error("socket activation: fd %d is not a listening stream socket", fd);
			return -EINVAL;
		}
		s->listeners[s->listener_count++] =
		    (struct listener){.fd = fd, .kind = UPGRADE_LISTEN_ACTIVATED};
		log_info("listening on fd %d (socket activation)", fd);
	}
	return n;
}

/* A live upgrade's new daemon: the sockets its predecessor had from
 * socket activation (its own environment names none). */
static int adopt_activated(struct server *s)
{
	int n = 0, fd;
	while ((fd = upgrade_take_listener(s->taken, UPGRADE_LISTEN_ACTIVATED, "")) >= 0) {
		s->listeners[s->listener_count++] =
		    (struct listener){.fd = fd, .kind = UPGRADE_LISTEN_ACTIVATED};
		log_info("listening on fd %d (socket activation, handed over)", fd);
		n++;
	}
	return n;
}

static void on_reload_signal(evutil_socket_t sig, short what, void *arg)
{
	(void)sig;
	(void)what;
	struct server *s = arg;
	log_info("SIGHUP: reloading the configuration");
	control_reload(s->control);
}

/*
 * --user / --group: give up root once everything that needs it is done
 * (hugepages reserved, sockets bound, backends opened). Supplementary
 * groups are the user's.
 */
static int drop_privileges(const struct options *opts)
{
	if (!opts->user && !opts->group)
		return 0;
	gid_t gid = getgid();
	uid_t uid = getuid();
	if (opts->group) {
		struct group *g = getgrnam(opts->group);
		if (!g) {
			log_error("--group %s: no such group", opts->group);
			return -EINVAL;
		}
		gid = g->gr_gid;
	}
	if (opts->user) {
		struct passwd *pw = getpwnam(opts->user);
		if (!pw) {
			log_error("--user %s: no such user", opts->user);
			return -EINVAL;
		}
		uid = pw->pw_uid;
		if (!opts->group)
			gid = pw->pw_gid;
	}
	/* Already so (a live upgrade's new daemon, started by one that had
	 * dropped them): nothing to give up, and no right to change groups. */
	if (geteuid() != 0 && getuid() == uid && geteuid() == uid && getgid() == gid &&
	    getegid() == gid) {
		log_info("running as uid %d gid %d", (int)uid, (int)gid);
		return 0;
	}
	if (opts->user) {
		if (initgroups(opts->user, gid) < 0) {
			log_error("--user %s: initgroups: %s", opts->user, strerror(errno));
			return -errno;
		}
	} else if (setgroups(0, NULL) < 0) {
		log_error("--group %s: setgroups: %s", opts->group, strerror(errno));
		return -errno;
	}
	if (setgid(gid) < 0 || (opts->user && setuid(uid) < 0)) {
		log_error("cannot drop privileges: %s", strerror(errno));
		return -errno;
	}
	log_info("running as uid %d gid %d", (int)getuid(), (int)getgid());
	return 0;
}

static void on_stats_signal(evutil_socket_t sig, short what, void *arg)
{
	(void)sig;
	(void)what;
	struct server *s = arg;
	cache_log_stats(s->cache);
}

/*
 * A SIGTERM or SIGINT sent during the start (blocked until the loop takes
 * it: stop_signals.h), asked for after step: the start stops there, as a
 * clean stop before serving (true, *status 0; said and taken). The main
 * thread takes signals from then on: a second one is absorbed, or, while
 * the cache writes back, gives up as it does in any stop.
 */
static bool stopped_at(const char *step, int *status)
{
	int sig = stop_signal_take();
	if (!sig)
		return false;
	*status = 0;
	log_info("signal %d during the start (%s): stopping before serving", sig, step);
	sd_notify(0, "STOPPING=1\nSTATUS=stopping: a signal came during the start");
	stop_signals_unblock();
	return true;
}

/*
 * daemon(3), except that the process that was started (the one a shell or
 * a service manager knows) stays until its child serves, and passes on
 * every signal sent to it meanwhile (stop_signals_relay()): a SIGTERM to
 * it stops the start wherever it is, never lost with a parent that has
 * gone. It exits 0 once the child serves, else with the child's status.
 * In the child: 0, *ready_fd the pipe to write one byte to when it
 * serves; -errno when it cannot detach.
 */
static int detach(int *ready_fd)
{
	int ready[2];
	if (pipe2(ready, O_CLOEXEC) < 0)
		return -errno;
	stop_signals_keep_in_child(true);
	pid_t pid = fork();
	stop_signals_keep_in_child(false);
	if (pid < 0) {
		int rc = -errno;
		close(ready[0]);
		close(ready[1]);
		return rc;
	}
	if (pid > 0) {
		close(ready[1]);
		_exit(stop_signals_relay(pid, ready[0]));
	}
	close(ready[0]);
	*ready_fd = ready[1];
	if (setsid() < 0)
		return -errno;
	int fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	for (int i = 0; i < 3; i++)
		if (fd != i && dup2(fd, i) < 0)
			return -errno;
	if (fd > 2)
		close(fd);
	return 0;
}

/* The pidfile is opened before privileges are dropped and written (through
 * the open descriptor) when the daemon is ready. */
static int write_pidfile(int fd)
{
	char text[32];
	int n = snprintf(text, sizeof(text), "%d\n", (int)getpid());
	if (ftruncate(fd, 0) < 0 || pwrite(fd, text, (size_t)n, 0) != n)
		return errno ? -errno : -EIO;
	return 0;
}

int server_run(const struct options *opts, int argc, char **argv, int *upgrade_fd)
{
	struct server s = {0};
	struct upgrade_taken taken = {0};
	static struct upgrade_server up; /* the upgrade thread may outlive a return */
	memset(&up, 0, sizeof(up));
	bool committed = false; /* a new daemon's hand-over is done */
	struct event *sigterm = NULL, *sigint = NULL, *sigusr1 = NULL, *sighup = NULL,
		     *sigusr2 = NULL, *watchdog = NULL;
	bool upgrading = *upgrade_fd >= 0;
	int control_fd = -1, pidfile_fd = -1, metrics_fd = -1;
	/* What this start made, to remove when it ends before serving: the
	 * pidfile (not one that was there) and the control socket it bound. */
	bool pidfile_made = false, pidfile_written = false, control_bound = false;
	bool stopped = false; /* a signal during the start (stopped_at()) */
	int ready_fd = -1;    /* detached: the parent waits for a byte (detach()) */
	int *listen_fds = NULL;
	struct worker **loops = NULL; /* the budget's view of the workers */
	int status = 1;
	unsigned threads = opts->threads;
	if (threads == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);
		threads = n > 0 ? (unsigned)n : 1;
	}
	signal(SIGPIPE, SIG_IGN);
	/* TLS credentials first: a broken file is refused before anything
	 * is opened (daemon/tls.h). */
	struct tls_creds *creds;
	char tls_err[1024];
	if (tls_creds_load(opts, &creds, tls_err, sizeof(tls_err)) < 0) {
		log_error("%s", tls_err);
		return 1;
	}
	if (creds) {
		tls_creds_describe(creds, tls_err, sizeof(tls_err));
		log_info("%s", tls_err);
	}
	tls_creds_install(creds);
	/* A live upgrade with a cache device: the old daemon releases the
	 * device at its pause, once told HELLO; the cache waits for it (the
	 * old daemon ends this one if it does not come). */
	bool hello_sent = false;
	unsigned device_wait_ms = 0;
	if (upgrading && opts->cache_device) {
		char why[600];
		if (upgrade_child_hello(*upgrade_fd, why, sizeof(why)) < 0) {
			log_error("%s", why);
			tls_creds_uninstall();
			return 1;
		}
		hello_sent = true;
		device_wait_ms = UPGRADE_DEVICE_WAIT_MS;
	}
	int rc = cache_create(opts, threads, device_wait_ms, &s.cache);
	if (rc < 0) { /* said (lifecycle.c) */
		tls_creds_uninstall();
		return 1;
	}
	if ((stopped = stopped_at("setting up the cache", &status)))
		goto out_cache;
	/* -EINTR: a backend gave up waiting for a stop (its first
	 * connection), closed again. */
	rc = export_table_open(&s.exports, opts, s.cache);
	if (rc == 0 || rc == -EINTR)
		stopped = stopped_at("opening the exports", &status);
	if (rc < 0) /* the table closed itself */
		goto out_cache;
	if (stopped)
		goto out_exports;
	if (*upgrade_fd >= 0) {
		/* A live upgrade: everything this daemon needs is open; take the
		 * old one's sockets (it parks its connections meanwhile). */
		char why[600];
		if (upgrade_child_receive(*upgrade_fd, hello_sent, &taken, why, sizeof(why)) < 0) {
			log_error("%s", why);
			goto out_exports;
		}
		s.taken = &taken;
		log_info("upgrade: handed %zu listener(s) and %zu connection(s)",
			 taken.listener_count, taken.conn_count);
	}
	int activated = sd_listen_fds(1);
	if (activated < 0)
		activated = 0;
	s.listeners =
	    calloc(opts->listen_count + opts->unix_count + (size_t)activated + taken.listener_count,
		   sizeof(*s.listeners));
	if (!s.listeners)
		goto out_exports;
	if (adopt_systemd_sockets(&s, activated) < 0)
		goto out_listeners;
	if (s.taken)
		activated += adopt_activated(&s);
	/* Sockets from systemd replace the default address and the config
	 * file's, not --listen / --unix. */
	bool replaced = activated && (opts->listen_default || opts->listen_from_config);
	for (size_t i = 0; i < opts->listen_count && !replaced; i++)
		if (listen_tcp(&s, opts->listen[i]) < 0)
			goto out_listeners;
	for (size_t i = 0; i < opts->unix_count && !replaced; i++)
		if (listen_unix(&s, opts->unix_paths[i]) < 0)
			goto out_listeners;
	/* Bound before privileges are dropped, served once the workers run. */
	if (opts->metrics && s.taken)
		metrics_fd = upgrade_take_listener(s.taken, UPGRADE_LISTEN_METRICS, opts->metrics);
	if (opts->metrics && metrics_fd < 0 &&
	    tcp_socket("--metrics", opts->metrics, &metrics_fd) < 0)
		goto out_listeners;
	bool no_control = opts->control_path && strcmp(opts->control_path, "none") == 0;
	const char *control_path =
	    opts->control_path ? opts->control_path : NBDCACHED_CONTROL_DEFAULT;
	if (!no_control && s.taken)
		control_fd = upgrade_take_listener(s.taken, UPGRADE_LISTEN_CONTROL, control_path);
	if (!no_control && control_fd < 0) {
		if (control_listen(opts->control_path, &control_fd) < 0)
			goto out_listeners;
		control_bound = control_fd >= 0;
	}
	if (opts->pidfile) {
		pidfile_fd = open(opts->pidfile, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
		pidfile_made = pidfile_fd >= 0;
		if (pidfile_fd < 0 && errno == EEXIST)
			pidfile_fd = open(opts->pidfile, O_WRONLY | O_CLOEXEC);
		if (pidfile_fd < 0) {
			log_error("--pidfile %s: %s", opts->pidfile, strerror(errno));
			goto out_listeners;
		}
	}
	if (drop_privileges(opts) < 0)
		goto out_listeners;
	if ((stopped = stopped_at("binding its sockets", &status)))
		goto out_listeners;

	/* A new daemon of a live upgrade stays the child its predecessor
	 * started (whose PID it tells systemd). */
	if (!opts->foreground && !s.taken && (rc = detach(&ready_fd)) < 0) {
		log_error("detaching: %s", strerror(-rc));
		goto out_listeners;
	}
	if (evthread_use_pthreads() < 0) {
		log_error("libevent: no pthreads support");
		goto out_listeners;
	}
	s.base = event_base_new();
	if (!s.base)
		goto out_listeners;
	s.accept_resume = evtimer_new(s.base, on_accept_resume, &s);
	if (!s.accept_resume)
		goto out_base;
	/* -EINTR: a backend gave up waiting for a stop (an RBD image's lock). */
	rc = export_table_start(&s.exports);
	if (rc == 0 || rc == -EINTR)
		stopped = stopped_at("starting the backends", &status);
	if (rc < 0 || stopped)
		goto out_base;
	rc = cache_start(s.cache);
	if (rc < 0) {
		log_error("cache: not started (%s): nothing is served", strerror(-rc));
		goto out_base;
	}
	/* Started: a stop from here writes back what the cache holds. */
	if ((stopped = stopped_at("starting the cache", &status)))
		goto out_workers;
	conn_set_stall_timeout(opts->stall_timeout);
	conn_set_negotiation_timeout(opts->negotiation_timeout);
	{
		struct access_policy *policy;
		char err[512];
		if (access_policy_build(opts, &policy, err, sizeof(err)) < 0) {
			log_error("access rules: %s", err);
			goto out_base;
		}
		access_policy_set(policy); /* replaced at each reload */
	}
	s.workers = calloc(threads, sizeof(*s.workers));
	if (!s.workers)
		goto out_base;
	for (unsigned i = 0; i < threads; i++) {
		rc = host_start(&s.workers[i], i, &s.exports);
		if (rc < 0) {
			log_error("worker %u: %s", i, strerror(-rc));
			goto out_workers;
		}
		s.worker_count++;
	}
	s.max_clients = opts->max_clients;
	loops = calloc(s.worker_count, sizeof(*loops));
	if (!loops)
		goto out_workers;
	for (unsigned i = 0; i < s.worker_count; i++)
		loops[i] = &s.workers[i].loop;
	if (budget_start(opts, loops, s.worker_count, host_budget_wake) < 0)
		goto out_workers;
	if (s.taken) {
		/* Everything is ready: confirm, and serve once the old daemon
		 * says it is gone (before that, nothing here accepts or reads:
		 * the old one may still roll back). */
		rc = commit_upgrade(&s, *upgrade_fd);
		*upgrade_fd = -1;
		if (rc < 0) {
			log_error("upgrade: not committed (%s); the old daemon serves on",
				  strerror(-rc));
			goto out_workers;
		}
		committed = true;
		adopt_connections(&s);
		upgrade_taken_free(&taken);
		s.taken = NULL;
	}
	listen_fds = calloc(s.listener_count ? s.listener_count : 1, sizeof(*listen_fds));
	if (!listen_fds)
		goto out_workers;
	for (size_t i = 0; i < s.listener_count; i++)
		listen_fds[i] = s.listeners[i].fd;
	struct control_config ccfg = {
	    .exports = &s.exports,
	    .cache = s.cache,
	    .opts = opts,
	    .argc = argc,
	    .argv = argv,
	    .threads = s.worker_count,
	    .listen_fds = listen_fds,
	    .listen_count = s.listener_count,
	    .control_fd = control_fd,
	    .control_path = control_fd >= 0 ? (opts->control_path ? opts->control_path
								  : NBDCACHED_CONTROL_DEFAULT)
					    : NULL,
	    .upgrade = &up,
	};
	rc = control_start(&ccfg, &s.control);
	if (rc < 0) {
		log_error("control thread: %s", strerror(-rc));
		goto out_workers;
	}
	int control_listen_fd = control_fd, metrics_listen_fd = metrics_fd; /* for an upgrade */
	control_fd = -1; /* the control thread's now */
	if (metrics_fd >= 0) {
		rc = metrics_start(metrics_fd, s.cache, &s.exports, &s.metrics);
		metrics_fd = -1; /* metrics_start() took it */
		if (rc < 0) {
			log_error("--metrics %s: cannot serve: %s", opts->metrics, strerror(-rc));
			goto out_workers;
		}
		log_info("metrics on http://%s/metrics", opts->metrics);
	}
	for (size_t i = 0; i < s.listener_count; i++) {
		struct listener *l = &s.listeners[i];
		evutil_make_socket_nonblocking(l->fd);
		/* Accepted sockets close on exec: an nbdkit a backend starts
		 * (again, while clients are connected) must not hold one. */
		l->ev = evconnlistener_new(
		    s.base, on_accept, &s,
		    LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_THREADSAFE, -1, l->fd);
		if (!l->ev)
			goto out_workers;
		evconnlistener_set_error_cb(l->ev, on_accept_error);
	}
	if (upgrade_setup(&up, &s, argv, control_listen_fd, control_path, metrics_listen_fd,
			  opts->metrics) < 0)
		goto out_workers;
	sigterm = evsignal_new(s.base, SIGTERM, on_signal, &s);
	sigint = evsignal_new(s.base, SIGINT, on_signal, &s);
	sigusr1 = evsignal_new(s.base, SIGUSR1, on_stats_signal, &s);
	sighup = evsignal_new(s.base, SIGHUP, on_reload_signal, &s);
	sigusr2 = evsignal_new(s.base, SIGUSR2, on_upgrade_signal, &up);
	if (!sigterm || !sigint || !sigusr1 || !sighup || !sigusr2 ||
	    evsignal_add(sigterm, NULL) < 0 || evsignal_add(sigint, NULL) < 0 ||
	    evsignal_add(sigusr1, NULL) < 0 || evsignal_add(sighup, NULL) < 0 ||
	    evsignal_add(sigusr2, NULL) < 0) {
		log_error("cannot install signal handlers");
		goto out_signals;
	}
	/* The last moment before serving; then the loop takes the signals. */
	if ((stopped = stopped_at("installing its signal handlers", &status)))
		goto out_signals;
	stop_signals_unblock();
	if (opts->pidfile) {
		rc = write_pidfile(pidfile_fd);
		if (rc < 0) {
			log_error("--pidfile %s: %s", opts->pidfile, strerror(-rc));
			goto out_signals;
		}
		pidfile_written = true;
	}
	log_info("ready: %zu export(s), %u worker thread(s)", s.exports.count, s.worker_count);
	if (ready_fd >= 0) {
		/* The parent exits 0 now; if it cannot be told, it learns our
		 * status when we exit. */
		if (write(ready_fd, "r", 1) != 1)
			log_debug("detaching: cannot tell the parent: %s", strerror(errno));
		close(ready_fd);
		ready_fd = -1;
	}
	sd_notifyf(0, "READY=1\nMAINPID=%d\nSTATUS=serving %zu export(s)", (int)getpid(),
		   s.exports.count);
	uint64_t watchdog_usec = 0;
	if (sd_watchdog_enabled(0, &watchdog_usec) > 0 && watchdog_usec) {
		watchdog = event_new(s.base, -1, EV_PERSIST, on_watchdog, NULL);
		struct timeval tv = {(time_t)(watchdog_usec / 2 / 1000000),
				     (suseconds_t)(watchdog_usec / 2 % 1000000)};
		if (watchdog)
			event_add(watchdog, &tv);
	}
	event_base_dispatch(s.base);
	status = 0;
out_signals:
out_workers:
	/* An upgrade in progress holds the workers and listeners: it ends
	 * within its timeouts (and ends the process if it commits). */
	atomic_store(&up.ready, false);
	while (atomic_load(&up.running))
		usleep(10000);
	if (upgrading && !committed)
		forget_unix_paths(&s);
	metrics_stop(s.metrics); /* first: it reads what the rest stops */
	s.metrics = NULL;
	close_listeners(&s);
	for (unsigned i = 0; i < s.worker_count; i++)
		host_request_stop(&s.workers[i]);
	/* Closing connections read nothing more: no budget wake-ups to post. */
	budget_stop();
	/* The signal events stay installed meanwhile: a second SIGTERM is absorbed. */
	for (unsigned i = 0; i < s.worker_count; i++)
		host_join(&s.workers[i]);
	budget_free();
	free(loops);
	free(s.workers);
	/* After the workers (no connection is left to flush for), before the
	 * cache writes everything back. */
	control_stop(s.control);
	access_policy_set(NULL); /* no connection, no reload any more */
	free(listen_fds);
	listen_fds = NULL;
	/* Connections are gone: write every dirty block back before exit. */
	if (watchdog)
		event_free(watchdog);
	if (sigusr1)
		event_free(sigusr1);
	if (sigusr2)
		event_free(sigusr2);
	if (sighup)
		event_free(sighup);
	if (sigterm)
		event_free(sigterm);
	if (sigint)
		event_free(sigint);
	uint64_t stop_left = UINT64_MAX;
	if (cache_stop(s.cache, on_stop_progress, &stop_left) < 0)
		status = 1;
	if (pidfile_written && status == 0 && unlink(opts->pidfile) < 0)
		log_debug("--pidfile %s: cannot remove it: %s", opts->pidfile, strerror(errno));
out_base:
	if (s.accept_resume)
		event_free(s.accept_resume);
	event_base_free(s.base);
out_listeners:
	if (pidfile_fd >= 0) {
		close(pidfile_fd);
		if (pidfile_made && !pidfile_written)
			unlink(opts->pidfile);
	}
	if (upgrading && !committed)
		forget_unix_paths(&s);
	close_listeners(&s);
	upgrade_taken_free(&taken);
	free(up.listeners);
	up.listeners = NULL;
	free(s.listeners);
	free(listen_fds);
	if (control_fd >= 0) {
		close(control_fd); /* not the control thread's yet */
		if (control_bound)
			unlink(control_path);
	}
	if (metrics_fd >= 0)
		close(metrics_fd);
out_exports:
	cache_stop(s.cache, NULL, NULL); /* no-op unless started */
	export_table_close(&s.exports);
out_cache:
	cache_destroy(s.cache);
	if (ready_fd >= 0)
		close(ready_fd); /* the parent waits for our exit status */
	if (stopped && *upgrade_fd >= 0) {
		/* A new daemon of a live upgrade: the old one serves on. */
		upgrade_child_fail(*upgrade_fd, "stopped by a signal during its start");
		*upgrade_fd = -1;
	}
	if (status == 0)
		log_info("stopped");
	tls_creds_uninstall();
	return status;
}
