/*
 * daemon/upgrade.c: see upgrade.h.
 *
 * The old daemon's side runs on its own thread (upgrade_main) and blocks
 * as it likes: the workers go on serving until they are parked, the
 * control thread stays free (the cache's flushes complete there), and the
 * main thread only pauses its listeners when asked. Every wait for the
 * new daemon is bounded by the timeout; a new daemon that overstays it is
 * killed by its PID before anything resumes, so that two daemons never
 * read one socket.
 */
#include "daemon/upgrade.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cache/cache.h"
#include "daemon/clock.h"
#include "daemon/export.h"
#include "daemon/host.h"
#include "daemon/log.h"

#define UPGRADE_ENV "NBDCACHED_UPGRADE_FD"
#define UPGRADE_SNDBUF (4u << 20)

extern char **environ;

/* ---- Messages ---- */

/* Send one record with at most one descriptor (fd < 0: none). */
static int send_record(int sock, const uint8_t *buf, size_t len, int fd)
{
	struct iovec iov = {(void *)buf, len};
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(sizeof(int))];
	} u;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	if (fd >= 0) {
		memset(&u, 0, sizeof(u));
		msg.msg_control = u.space;
		msg.msg_controllen = sizeof(u.space);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	for (;;) {
		ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
		if (n == (ssize_t)len)
			return 0;
		if (n < 0 && errno == EINTR)
			continue;
		return n < 0 ? -errno : -EMSGSIZE;
	}
}

/*
 * Receive one record within timeout_ms (-1: no limit) into buf (at least
 * UPGRADE_RECORD_MAX bytes) and decode it; its descriptor, if any, in
 * *fd. -ETIMEDOUT, -EPIPE (the other side is gone) or -EPROTO (why set).
 */
static int recv_record(int sock, uint8_t *buf, int timeout_ms, struct upgrade_record *r, int *fd,
		       char *why, size_t why_len)
{
	*fd = -1;
	struct pollfd p = {sock, POLLIN, 0};
	int rc;
	do
		rc = poll(&p, 1, timeout_ms);
	while (rc < 0 && errno == EINTR);
	if (rc == 0)
		return -ETIMEDOUT;
	if (rc < 0)
		return -errno;
	struct iovec iov = {buf, UPGRADE_RECORD_MAX};
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(4 * sizeof(int))];
	} u;
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.space,
			     .msg_controllen = sizeof(u.space)};
	ssize_t n;
	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	int fds[4];
	unsigned nfds = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k && nfds < 4; i++)
			memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	if (n == 0 && nfds == 0)
		return -EPIPE;
	if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		snprintf(why, why_len,
			 "a state record longer than %u bytes, or with more "
			 "descriptors than it may have",
			 (unsigned)UPGRADE_RECORD_MAX);
		return -EPROTO;
	}
	rc = upgrade_record_decode(buf, (size_t)n, nfds, r, why, why_len);
	if (rc < 0 || nfds == 0) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		return rc;
	}
	*fd = fds[0];
	return 0;
}

/* ---- The old daemon ---- */

struct upgrade_run {
	struct upgrade_server *u;
	char binary[4096];
	unsigned timeout_s;
	void (*done)(const struct upgrade_result *r, void *arg);
	void *arg;
	struct upgrade_result r;
	int sock;
	pid_t pid;
	uint8_t *buf;
	/* The flushes (flush_worker's thread). */
	pthread_mutex_t lock;
	pthread_cond_t cond;
	unsigned flushes_left;
	int flush_error;
	struct worker_task flush_task;
};

static void fail(struct upgrade_run *run, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void fail(struct upgrade_run *run, const char *fmt, ...)
{
	if (run->r.why[0])
		return; /* the first reason stands */
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(run->r.why, sizeof(run->r.why), fmt, ap);
	va_end(ap);
}

const char *upgrade_refusal(struct export_table *exports, char *buf, size_t len)
{
	struct export **list;
	size_t count;
	if (export_list(exports, &list, &count) < 0)
		return "out of memory";
	const char *why = NULL;
	for (size_t i = 0; i < count && !why; i++) {
		struct export *e = list[i];
		const char *spec = e->backing->spec;
		if (strncmp(spec, "nbdkit:", 7) == 0) {
			snprintf(buf, len,
				 "export '%s' is served by an nbdkit this daemon started, which "
				 "holds its data: restart instead",
				 e->name);
			why = buf;
		} else if (strncmp(spec, "rbd:", 4) == 0 && !e->readonly) {
			snprintf(buf, len,
				 "export '%s' holds the exclusive lock of its RBD image, which a "
				 "new daemon cannot take meanwhile: restart instead",
				 e->name);
			why = buf;
		}
	}
	for (size_t i = 0; i < count; i++)
		export_put(list[i]);
	free(list);
	return why;
}

/* Start the new daemon with our command line and its end of the pair. */
static int spawn(struct upgrade_run *run, int child_end)
{
	char **argv = run->u->argv;
	size_t argc = 0;
	while (argv[argc])
		argc++;
	char **args = calloc(argc + 1, sizeof(*args));
	size_t envc = 0;
	while (environ[envc])
		envc++;
	char **envp = calloc(envc + 3, sizeof(*envp));
	char fdvar[64], wdvar[64];
	if (!args || !envp) {
		free(args);
		free(envp);
		return -ENOMEM;
	}
	args[0] = run->binary;
	for (size_t i = 1; i < argc; i++)
		args[i] = argv[i];
	snprintf(fdvar, sizeof(fdvar), UPGRADE_ENV "=%d", child_end);
	size_t k = 0;
	bool watchdog = false;
	for (size_t i = 0; i < envc; i++) {
		if (strncmp(environ[i], UPGRADE_ENV "=", sizeof(UPGRADE_ENV)) == 0)
			continue;
		if (strncmp(environ[i], "WATCHDOG_PID=", 13) == 0) {
			watchdog = true; /* set to the child's own below */
			continue;
		}
		envp[k++] = environ[i];
	}
	envp[k++] = fdvar;
	size_t wd_at = k;
	if (watchdog)
		envp[k++] = wdvar;
	envp[k] = NULL;
	pid_t pid = fork();
	if (pid == 0) {
		/* Only async-signal-safe calls from here to exec. */
		if (watchdog) {
			/* "WATCHDOG_PID=" and the child's pid, by hand. */
			char digits[16];
			int n = 0;
			for (pid_t p = getpid(); p > 0 && n < 15; p /= 10)
				digits[n++] = (char)('0' + p % 10);
			memcpy(wdvar, "WATCHDOG_PID=", 13);
			for (int i = 0; i < n; i++)
				wdvar[13 + i] = digits[n - 1 - i];
			wdvar[13 + n] = '\0';
			envp[wd_at] = wdvar;
		}
		sigset_t none;
		sigemptyset(&none);
		pthread_sigmask(SIG_SETMASK, &none, NULL);
		fcntl(child_end, F_SETFD, 0); /* the one descriptor it inherits on purpose */
		execve(run->binary, args, envp);
		_exit(127);
	}
	int err = errno;
	free(args);
	free(envp);
	if (pid < 0)
		return -err;
	run->pid = pid;
	return 0;
}

/* The new daemon has ended (or is ended now): its status, in words. */
static void reap(struct upgrade_run *run, bool kill_it, char *out, size_t len)
{
	if (run->pid <= 0)
		return;
	if (kill_it)
		kill(run->pid, SIGKILL);
	int status = 0;
	pid_t w;
	do
		w = waitpid(run->pid, &status, 0);
	while (w < 0 && errno == EINTR);
	run->pid = 0;
	if (!out)
		return;
	if (w < 0)
		snprintf(out, len, "waitpid: %s", strerror(errno));
	else if (WIFEXITED(status))
		snprintf(out, len, "exited with status %d", WEXITSTATUS(status));
	else if (WIFSIGNALED(status))
		snprintf(out, len, "was killed by signal %d", WTERMSIG(status));
}

/* The new daemon's answer to the step just taken: a record of type want
 * within the timeout, else the run fails (saying what happened). */
static bool expect_record(struct upgrade_run *run, enum upgrade_record_type want,
			  struct upgrade_record *r, const char *step)
{
	char why[512] = "";
	int fd;
	int rc =
	    recv_record(run->sock, run->buf, (int)run->timeout_s * 1000, r, &fd, why, sizeof(why));
	if (fd >= 0)
		close(fd);
	if (rc == 0 && r->type == want)
		return true;
	if (rc == 0 && r->type == UPGRADE_ERROR) {
		char st[128] = "";
		reap(run, false, st, sizeof(st));
		fail(run, "the new daemon %s: %s", st[0] ? st : "failed", r->text);
	} else if (rc == -ETIMEDOUT) {
		reap(run, true, NULL, 0);
		fail(run, "the new daemon did not %s within %u s (killed)", step, run->timeout_s);
	} else if (rc == -EPIPE) {
		char st[128] = "";
		reap(run, false, st, sizeof(st));
		fail(run, "the new daemon %s before it could %s", st, step);
	} else {
		fail(run, "the new daemon's answer (%s): %s", step,
		     rc == -EPROTO ? why : strerror(-rc));
	}
	return false;
}

/* ... the cache's flushes, on the flush worker's thread. */
struct upgrade_flush {
	struct cache_op op;
	uint64_t seen_error;
	struct upgrade_run *run;
};

static void flush_done(struct cache_op *op, int result)
{
	struct upgrade_flush *f = (struct upgrade_flush *)op;
	struct upgrade_run *run = f->run;
	cache_op_release(op);
	free(f);
	pthread_mutex_lock(&run->lock);
	if (result < 0 && !run->flush_error)
		run->flush_error = result;
	if (--run->flushes_left == 0)
		pthread_cond_signal(&run->cond);
	pthread_mutex_unlock(&run->lock);
}

static void flush_start(struct worker_task *task)
{
	struct upgrade_run *run =
	    (struct upgrade_run *)((char *)task - offsetof(struct upgrade_run, flush_task));
	struct export **list;
	size_t count = 0;
	if (export_list(run->u->exports, &list, &count) < 0)
		count = 0;
	/* One FLUSH per cache export (a split export's windows share one). */
	unsigned submitted = 0;
	for (size_t i = 0; i < count; i++) {
		bool seen = false;
		for (size_t j = 0; j < i && !seen; j++)
			seen = list[j]->cache == list[i]->cache;
		struct upgrade_flush *f = seen ? NULL : calloc(1, sizeof(*f));
		if (!seen && !f) {
			pthread_mutex_lock(&run->lock);
			run->flush_error = -ENOMEM;
			pthread_mutex_unlock(&run->lock);
		}
		if (!f)
			continue;
		f->run = run;
		f->seen_error = 0;
		f->op = (struct cache_op){.ce = list[i]->cache,
					  .worker = run->u->flush_worker,
					  .cmd = BACKEND_FLUSH,
					  .seen_error = &f->seen_error,
					  .done = flush_done};
		pthread_mutex_lock(&run->lock);
		run->flushes_left++;
		pthread_mutex_unlock(&run->lock);
		submitted++;
		cache_submit(&f->op);
	}
	for (size_t i = 0; i < count; i++)
		export_put(list[i]);
	free(list);
	pthread_mutex_lock(&run->lock);
	if (--run->flushes_left == 0) /* the start's own count */
		pthread_cond_signal(&run->cond);
	pthread_mutex_unlock(&run->lock);
	(void)submitted;
}

/* Write every dirty block back and flush every backend; 0 or -errno. */
static int flush_all(struct upgrade_run *run)
{
	pthread_mutex_lock(&run->lock);
	run->flushes_left = 1; /* flush_start's own, until it has submitted all */
	run->flush_error = 0;
	pthread_mutex_unlock(&run->lock);
	run->flush_task.run = flush_start;
	worker_post(run->u->flush_worker, &run->flush_task);
	pthread_mutex_lock(&run->lock);
	while (run->flushes_left)
		pthread_cond_wait(&run->cond, &run->lock);
	int rc = run->flush_error;
	pthread_mutex_unlock(&run->lock);
	return rc;
}

static void sleep_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* Every host has counted its busy connections at 0, or the time is up. */
static unsigned wait_parked(struct upgrade_server *u, unsigned timeout_s)
{
	uint64_t end = clock_now_ns() + (uint64_t)timeout_s * 1000000000u;
	for (;;) {
		unsigned busy = 0;
		for (unsigned i = 0; i < u->host_count; i++) {
			unsigned b = host_busy(&u->hosts[i]);
			busy = b > UINT32_MAX - busy ? UINT32_MAX : busy + b;
		}
		if (busy == 0 || clock_now_ns() > end)
			return busy;
		sleep_ms(5);
	}
}

static void wait_flag(struct upgrade_server *u, size_t offset)
{
	for (unsigned i = 0; i < u->host_count; i++) {
		atomic_bool *flag = (atomic_bool *)((char *)&u->hosts[i] + offset);
		while (!atomic_load(flag))
			sleep_ms(1);
	}
}

/* Why a send to the new daemon failed, in words. */
static const char *send_error(struct upgrade_run *run, int rc, char *buf, size_t len)
{
	if (rc == -EAGAIN || rc == -EWOULDBLOCK)
		snprintf(buf, len, "the new daemon took nothing for %u s", run->timeout_s);
	else
		snprintf(buf, len, "%s", strerror(-rc));
	return buf;
}

/* Hand the listeners and the parked connections over; false on failure. */
static bool hand_over(struct upgrade_run *run)
{
	char err[128];
	struct upgrade_server *u = run->u;
	for (size_t i = 0; i < u->listener_count; i++) {
		struct upgrade_listener *l = &u->listeners[i];
		size_t n = upgrade_record_listener(run->buf, l->kind, l->spec);
		int rc = n ? send_record(run->sock, run->buf, n, l->fd) : -ENAMETOOLONG;
		if (rc < 0) {
			fail(run, "sending listener '%s': %s", l->spec,
			     send_error(run, rc, err, sizeof(err)));
			return false;
		}
	}
	unsigned conns = 0;
	for (unsigned i = 0; i < u->host_count; i++) {
		struct host *h = &u->hosts[i];
		for (size_t j = 0; j < h->moved_count; j++) {
			size_t n = upgrade_record_connection(run->buf, &h->moved[j].state);
			int rc = n ? send_record(run->sock, run->buf, n, h->moved[j].fd) : -EINVAL;
			if (rc < 0) {
				fail(run, "sending connection %llu: %s",
				     (unsigned long long)h->moved[j].state.id,
				     send_error(run, rc, err, sizeof(err)));
				return false;
			}
			conns++;
		}
		run->r.closed += h->closed_count;
	}
	size_t n = upgrade_record_end(run->buf, conns, (uint32_t)u->listener_count);
	int rc = send_record(run->sock, run->buf, n, -1);
	if (rc < 0) {
		fail(run, "sending END: %s", send_error(run, rc, err, sizeof(err)));
		return false;
	}
	run->r.moved = conns;
	return true;
}

static void *upgrade_main(void *arg)
{
	struct upgrade_run *run = arg;
	struct upgrade_server *u = run->u;
	struct upgrade_record rec;
	bool paused = false, parked = false, collected = false;
	uint64_t pause_start = 0;
	log_info("upgrade: starting %s", run->binary);
	sd_notify(0, "RELOADING=1\nSTATUS=upgrading: starting the new daemon");
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
		fail(run, "socketpair: %s", strerror(errno));
		goto out;
	}
	/* Records of up to UPGRADE_RECORD_MAX bytes go in one message. */
	int size = (int)UPGRADE_SNDBUF;
	if (setsockopt(sv[0], SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof(size)) < 0)
		setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
	setsockopt(sv[1], SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof(size));
	/* A new daemon that stops reading must not hold this thread forever:
	 * a send blocked for the timeout fails (EAGAIN), and the run with it. */
	struct timeval sndtimeo = {(time_t)run->timeout_s, 0};
	setsockopt(sv[0], SOL_SOCKET, SO_SNDTIMEO, &sndtimeo, sizeof(sndtimeo));
	run->sock = sv[0];
	int rc = spawn(run, sv[1]);
	close(sv[1]);
	if (rc < 0) {
		fail(run, "cannot start %s: %s", run->binary, strerror(-rc));
		goto out;
	}
	run->r.pid = run->pid;
	if (!expect_record(run, UPGRADE_HELLO, &rec, "start"))
		goto out;
	/* Write back while serving: the pause then flushes only what comes
	 * in meanwhile. */
	rc = flush_all(run);
	if (rc < 0) {
		fail(run, "writing the cache back failed: %s (the data stays dirty here)",
		     strerror(-rc));
		goto out;
	}
	u->accepting(u->arg, false);
	paused = true;
	pause_start = clock_now_ns();
	for (unsigned i = 0; i < u->host_count; i++)
		host_park(&u->hosts[i], true);
	parked = true;
	unsigned busy = wait_parked(u, run->timeout_s);
	if (busy)
		log_warn("upgrade: %u connection(s) not at a request boundary after %u s: they "
			 "will be closed",
			 busy, run->timeout_s);
	rc = flush_all(run);
	if (rc < 0) {
		fail(run, "writing the cache back failed: %s (the data stays dirty here)",
		     strerror(-rc));
		goto out;
	}
	for (unsigned i = 0; i < u->host_count; i++)
		host_collect(&u->hosts[i]);
	wait_flag(u, offsetof(struct host, collected));
	collected = true;
	if (!hand_over(run))
		goto out;
	if (!expect_record(run, UPGRADE_TAKEN, &rec, "take the connections"))
		goto out;
	rc = send_record(run->sock, run->buf, upgrade_record_commit(run->buf), -1);
	if (rc < 0) {
		fail(run, "sending COMMIT: %s", strerror(-rc));
		goto out;
	}
	/* From here on the connections are the new daemon's. */
	run->r.committed = true;
	sd_notifyf(0, "MAINPID=%d\nSTATUS=handed over to pid %d", (int)run->pid, (int)run->pid);
	for (unsigned i = 0; i < u->host_count; i++)
		host_finish_upgrade(&u->hosts[i]);
	wait_flag(u, offsetof(struct host, finished));
	run->r.pause_ms = (clock_now_ns() - pause_start) / 1000000u;
	log_info("upgrade: handed over to pid %d: %u connection(s) moved, %u closed, clients "
		 "paused %llu ms",
		 (int)run->pid, run->r.moved, run->r.closed, (unsigned long long)run->r.pause_ms);
out:
	if (!run->r.committed) {
		if (run->pid > 0)
			reap(run, true, NULL, 0);
		if (parked)
			for (unsigned i = 0; i < u->host_count; i++)
				host_park(&u->hosts[i], false);
		if (paused)
			u->accepting(u->arg, true);
		log_error("upgrade to %s failed: %s; this daemon serves on", run->binary,
			  run->r.why);
		sd_notify(0, "READY=1\nSTATUS=serving (an upgrade failed)");
	}
	if (collected)
		for (unsigned i = 0; i < u->host_count; i++)
			host_collected_free(&u->hosts[i]);
	if (run->sock >= 0)
		close(run->sock);
	run->done(&run->r, run->arg); /* ends the process when committed */
	atomic_store(&u->running, false);
	pthread_mutex_destroy(&run->lock);
	pthread_cond_destroy(&run->cond);
	free(run->buf);
	free(run);
	return NULL;
}

int upgrade_begin(struct upgrade_server *u, const char *binary, unsigned timeout_s,
		  void (*done)(const struct upgrade_result *r, void *arg), void *arg)
{
	if (!atomic_load(&u->ready) || atomic_exchange(&u->running, true))
		return -EBUSY;
	struct upgrade_run *run = calloc(1, sizeof(*run));
	uint8_t *buf = malloc(UPGRADE_RECORD_MAX);
	if (!run || !buf) {
		free(run);
		free(buf);
		atomic_store(&u->running, false);
		return -ENOMEM;
	}
	run->u = u;
	run->buf = buf;
	run->sock = -1;
	snprintf(run->binary, sizeof(run->binary), "%s", binary && *binary ? binary : u->self);
	run->timeout_s = timeout_s ? timeout_s : UPGRADE_TIMEOUT_DEFAULT;
	run->done = done;
	run->arg = arg;
	pthread_mutex_init(&run->lock, NULL);
	pthread_cond_init(&run->cond, NULL);
	pthread_t t;
	int rc = -pthread_create(&t, NULL, upgrade_main, run);
	if (rc < 0) {
		pthread_mutex_destroy(&run->lock);
		pthread_cond_destroy(&run->cond);
		free(buf);
		free(run);
		atomic_store(&u->running, false);
		return rc;
	}
	pthread_detach(t);
	return 0;
}

/* ---- The new daemon ---- */

int upgrade_child_fd(void)
{
	const char *v = getenv(UPGRADE_ENV);
	if (!v)
		return -1;
	char *end;
	long fd = strtol(v, &end, 10);
	unsetenv(UPGRADE_ENV);
	if (*end || fd < 3 || fd > 1 << 20 || fcntl((int)fd, F_GETFD) < 0)
		return -1;
	fcntl((int)fd, F_SETFD, FD_CLOEXEC);
	return (int)fd;
}

void upgrade_child_fail(int fd, const char *why)
{
	uint8_t buf[UPGRADE_RECORD_HEADER + UPGRADE_MAX_TEXT];
	size_t n = upgrade_record_error(buf, why && *why ? why : "it could not start");
	send_record(fd, buf, n, -1);
}

/* array (*cap elements of size bytes) with room for one more after count:
 * itself, or a larger copy; NULL when out of memory (array unchanged). */
static void *grow(void *array, size_t *cap, size_t count, size_t size)
{
	if (count < *cap)
		return array;
	size_t n = *cap ? *cap * 2 : 16;
	void *p = realloc(array, n * size);
	if (p)
		*cap = n;
	return p;
}

int upgrade_child_receive(int fd, struct upgrade_taken *t, char *why, size_t why_len)
{
	memset(t, 0, sizeof(*t));
	uint8_t *buf = malloc(UPGRADE_RECORD_MAX);
	if (!buf) {
		snprintf(why, why_len, "out of memory");
		return -ENOMEM;
	}
	size_t n = upgrade_record_hello(buf, (uint32_t)getpid());
	int rc = send_record(fd, buf, n, -1);
	if (rc < 0) {
		snprintf(why, why_len, "upgrade: the old daemon is gone: %s", strerror(-rc));
		free(buf);
		return rc;
	}
	size_t lcap = 0, ccap = 0;
	for (;;) {
		struct upgrade_record r;
		int rfd;
		char err[512] = "";
		rc = recv_record(fd, buf, -1, &r, &rfd, err, sizeof(err));
		if (rc < 0) {
			snprintf(why, why_len, "upgrade: the state record: %s",
				 rc == -EPROTO	? err
				 : rc == -EPIPE ? "the old daemon went away"
						: strerror(-rc));
			break;
		}
		if (r.type == UPGRADE_END) {
			if (r.connections != t->conn_count || r.listeners != t->listener_count) {
				snprintf(why, why_len,
					 "upgrade: END says %u connections and %u listeners, %zu "
					 "and %zu came",
					 r.connections, r.listeners, t->conn_count,
					 t->listener_count);
				rc = -EPROTO;
			}
			break;
		}
		if (r.type == UPGRADE_LISTENER) {
			void *more =
			    grow(t->listeners, &lcap, t->listener_count, sizeof(*t->listeners));
			if (!more) {
				close(rfd);
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
			t->listeners = more;
			char *spec = strdup(r.spec);
			t->listeners[t->listener_count++] =
			    (struct upgrade_listener){.fd = rfd, .kind = r.kind, .spec = spec};
			if (!spec) {
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
		} else if (r.type == UPGRADE_CONNECTION) {
			void *more = grow(t->conns, &ccap, t->conn_count, sizeof(*t->conns));
			if (!more) {
				close(rfd);
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
			t->conns = more;
			struct upgrade_taken_conn *c = &t->conns[t->conn_count++];
			c->fd = rfd;
			c->st = r.conn;
			c->st.pending = NULL;
			if (r.conn.pending_len) {
				uint8_t *p = malloc(r.conn.pending_len);
				if (!p) {
					c->st.pending_len = 0;
					rc = -ENOMEM;
					snprintf(why, why_len, "upgrade: out of memory");
					break;
				}
				memcpy(p, r.conn.pending, r.conn.pending_len);
				c->st.pending = p;
			}
		} else {
			if (rfd >= 0)
				close(rfd);
			snprintf(why, why_len, "upgrade: a state record of type %u out of place",
				 (unsigned)r.type);
			rc = -EPROTO;
			break;
		}
	}
	free(buf);
	if (rc < 0)
		upgrade_taken_free(t);
	return rc;
}

int upgrade_take_listener(struct upgrade_taken *t, enum upgrade_listener_kind kind,
			  const char *spec)
{
	for (size_t i = 0; i < t->listener_count; i++) {
		struct upgrade_listener *l = &t->listeners[i];
		if (l->fd >= 0 && l->kind == kind && strcmp(l->spec, spec) == 0) {
			int fd = l->fd;
			l->fd = -1;
			return fd;
		}
	}
	return -1;
}

int upgrade_child_commit(int fd, unsigned conns)
{
	uint8_t buf[UPGRADE_RECORD_HEADER + 8];
	int rc = send_record(fd, buf, upgrade_record_taken(buf, conns), -1);
	if (rc == 0) {
		uint8_t *in = malloc(UPGRADE_RECORD_MAX);
		struct upgrade_record r;
		int rfd;
		char why[512];
		rc = in ? recv_record(fd, in, -1, &r, &rfd, why, sizeof(why)) : -ENOMEM;
		if (rc == 0 && rfd >= 0)
			close(rfd);
		if (rc == 0 && r.type != UPGRADE_COMMIT)
			rc = -EPROTO;
		/* The old daemon gone before it said so: it cannot serve on, so
		 * this one does (it only rolls back after killing this one). */
		if (rc == -EPIPE || rc == -ECONNRESET)
			rc = 0;
		free(in);
	}
	close(fd);
	return rc;
}

void upgrade_taken_free(struct upgrade_taken *t)
{
	for (size_t i = 0; i < t->listener_count; i++) {
		if (t->listeners[i].fd >= 0)
			close(t->listeners[i].fd);
		free(t->listeners[i].spec);
	}
	free(t->listeners);
	for (size_t i = 0; i < t->conn_count; i++) {
		if (t->conns[i].fd >= 0)
			close(t->conns[i].fd);
		free((void *)t->conns[i].st.pending);
	}
	free(t->conns);
	memset(t, 0, sizeof(*t));
}
