/*
 * daemon/upgrade.c: see upgrade.h. The old daemon's side.
 *
 * It runs on its own thread (upgrade_main) and blocks as it likes: the
 * workers go on serving until they are parked, the control thread stays
 * free (the cache's flushes complete there), and the main thread only
 * pauses its listeners when asked. Every wait for the new daemon is
 * bounded by the timeout; a new daemon that overstays it is killed by its
 * PID before anything resumes, so that two daemons never read one socket.
 * The messages and the new daemon's side are upgrade_child.c's.
 */
#include "daemon/upgrade.h"

#include <errno.h>
#include <fcntl.h>
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
#include "daemon/upgrade_internal.h"

#define UPGRADE_SNDBUF (4u << 20)

extern char **environ;

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
	uint32_t flush_flags; /* of the FLUSHes flush_all sends */
	struct worker_task flush_task;
	/* The cache device was detached and released for the new daemon:
	 * this one serves on without it if the upgrade fails. */
	bool device, device_released;
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
	struct cache_device_stats ds;
	/* A cache device is handed over detached (device_hand_over); one
	 * that failed holds a log that only a start empties. */
	if (cache_get_device_stats(exports->cache, &ds) && ds.failed) {
		snprintf(buf, len,
			 "the cache device failed; its log is emptied by a start, not handed "
			 "over: restart instead");
		why = buf;
	}
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
	int rc = upgrade_recv_record(run->sock, run->buf, (int)run->timeout_s * 1000, r, &fd, why,
				     sizeof(why));
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
					  .flags = run->flush_flags,
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

/* Write every dirty block back and flush every backend (flags: a FLUSH's
 * CACHE_FLUSH_WRITEBACK, a full round even with a cache device's log);
 * 0 or -errno. */
static int flush_all(struct upgrade_run *run, uint32_t flags)
{
	pthread_mutex_lock(&run->lock);
	run->flush_flags = flags;
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

/*
 * The cache device goes to the new daemon detached. Once the new daemon
 * said HELLO (it waits for the device before it creates its cache), the
 * log takes no more records: FLUSH goes to the backends, in full rounds,
 * and the level-2 cache is off (its map is given up, as clients write on
 * until the pause). At the pause, with no request in flight, the log is
 * emptied (device_release): every export on it written back and flushed,
 * the device marked clean, closed and its lock dropped; the new daemon
 * opens it as a start does, with nothing to replay. 0, or -errno with
 * why said (the device then stays detached here: FLUSH goes to the
 * backends until a restart).
 */
static int device_detach(struct upgrade_run *run)
{
	struct cache_device *d = cache_get_device(run->u->exports->cache);
	if (!d)
		return 0;
	run->device = true;
	int rc = cache_device_detach_begin(d);
	if (rc == -EALREADY) /* detached before (nbdcachectl cache-device detach) */
		return 0;
	if (rc < 0) {
		fail(run, "detaching the cache device: %s", strerror(-rc));
		return rc;
	}
	log_info("upgrade: the cache device goes to the new daemon: it takes no more records "
		 "(FLUSH goes to the backends until the hand-over)");
	return 0;
}

static int device_release(struct upgrade_run *run)
{
	struct cache_device *d = cache_get_device(run->u->exports->cache);
	if (!d)
		return 0;
	/* Records that came meanwhile (CLEAN records of a round): the log is
	 * emptied again, a few times at most. */
	int rc = cache_device_detach_end(d);
	for (unsigned pass = 0; rc == -EBUSY && pass < 3; pass++) {
		rc = flush_all(run, CACHE_FLUSH_WRITEBACK);
		if (rc == 0)
			rc = cache_device_detach_end(d);
	}
	if (rc == -EALREADY)
		rc = 0;
	if (rc == 0)
		rc = cache_device_release(d);
	if (rc < 0) {
		fail(run, "handing the cache device over: %s (it stays detached here: FLUSH goes "
			  "to the backends until a restart)",
		     rc == -EBUSY ? "records kept coming into its log" : strerror(-rc));
		return rc;
	}
	run->device_released = true;
	return 0;
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
	/* It ended (with a cache device it says HELLO before its cache is
	 * made, so it can fail while we send): its own reason, if it sent
	 * one, comes first. */
	struct upgrade_record r;
	int fd;
	char why[64];
	if (rc == -EPIPE &&
	    upgrade_recv_record(run->sock, run->buf, 1000, &r, &fd, why, sizeof(why)) == 0) {
		if (fd >= 0)
			close(fd);
		if (r.type == UPGRADE_ERROR) {
			char st[128] = "";
			reap(run, false, st, sizeof(st));
			fail(run, "the new daemon %s: %s", st[0] ? st : "failed", r.text);
		}
	}
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
		int rc = n ? upgrade_send_record(run->sock, run->buf, n, l->fd) : -ENAMETOOLONG;
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
			int rc = n ? upgrade_send_record(run->sock, run->buf, n, h->moved[j].fd)
				   : -EINVAL;
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
	int rc = upgrade_send_record(run->sock, run->buf, n, -1);
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
	bool paused = false, parked = false, collected = false, announced = false;
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
	if (device_detach(run) < 0)
		goto out;
	/* Write back while serving: the pause then flushes only what comes
	 * in meanwhile. */
	uint32_t flush_flags = run->device ? CACHE_FLUSH_WRITEBACK : 0;
	rc = flush_all(run, flush_flags);
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
	log_info("upgrade: listeners paused, connections parking at a request boundary (one "
		 "still negotiating has %u ms to finish)",
		 HOST_NEGOTIATION_GRACE_MS);
	unsigned busy = wait_parked(u, run->timeout_s);
	if (busy)
		log_warn("upgrade: %u connection(s) not at a request boundary after %u s: they "
			 "will be closed",
			 busy, run->timeout_s);
	rc = flush_all(run, flush_flags);
	if (rc < 0) {
		fail(run, "writing the cache back failed: %s (the data stays dirty here)",
		     strerror(-rc));
		goto out;
	}
	if (device_release(run) < 0)
		goto out;
	for (unsigned i = 0; i < u->host_count; i++)
		host_collect(&u->hosts[i]);
	wait_flag(u, offsetof(struct host, collected));
	collected = true;
	if (!hand_over(run))
		goto out;
	if (!expect_record(run, UPGRADE_TAKEN, &rec, "take the connections"))
		goto out;
	/* Those it will close rather than serve (another object, the access
	 * rules): closed, not moved, with its reasons. */
	if (rec.closed > run->r.moved || rec.connections != run->r.moved) {
		fail(run,
		     "the new daemon says it took %u connection(s) and closes %u of them, "
		     "%u were sent",
		     rec.connections, rec.closed, run->r.moved);
		goto out;
	}
	run->r.refused = rec.closed;
	run->r.moved -= rec.closed;
	run->r.closed += rec.closed;
	snprintf(run->r.refused_why, sizeof(run->r.refused_why), "%s", rec.text);
	/* systemd learns the new main PID before COMMIT is sent: the new
	 * daemon says READY=1 as soon as it has COMMIT, and a READY=1 from a
	 * process that is not the main one yet would come first whenever this
	 * thread is slow (on a busy machine one upgrade in five did so). */
	sd_notifyf(0, "MAINPID=%d\nSTATUS=handing over to pid %d", (int)run->pid, (int)run->pid);
	announced = true;
	rc = upgrade_send_record(run->sock, run->buf, upgrade_record_commit(run->buf), -1);
	if (rc < 0) {
		fail(run, "sending COMMIT: %s", strerror(-rc));
		goto out;
	}
	/* From here on the connections are the new daemon's. */
	run->r.committed = true;
	sd_notifyf(0, "STATUS=handed over to pid %d", (int)run->pid);
	for (unsigned i = 0; i < u->host_count; i++)
		host_finish_upgrade(&u->hosts[i]);
	wait_flag(u, offsetof(struct host, finished));
	run->r.pause_ms = (clock_now_ns() - pause_start) / 1000000u;
	log_info("upgrade: handed over to pid %d: %u connection(s) moved, %u closed, clients "
		 "paused %llu ms",
		 (int)run->pid, run->r.moved, run->r.closed, (unsigned long long)run->r.pause_ms);
	if (run->r.refused)
		log_warn("upgrade: pid %d closes %u of the connections handed over: %s",
			 (int)run->pid, run->r.refused, run->r.refused_why);
out:
	if (!run->r.committed) {
		/* The main PID back before the new daemon is ended (systemd must
		 * not see its main process exit); a process of the service's
		 * cgroup may name it. */
		if (announced) {
			sd_notifyf(0, "MAINPID=%d", (int)getpid());
			sd_notify_barrier(0, 1000000);
		}
		if (run->pid > 0)
			reap(run, true, NULL, 0);
		if (parked)
			for (unsigned i = 0; i < u->host_count; i++)
				host_park(&u->hosts[i], false);
		if (paused)
			u->accepting(u->arg, true);
		log_error("upgrade to %s failed: %s; this daemon serves on%s", run->binary,
			  run->r.why,
			  run->device_released ? " without its cache device (released for the new "
						 "daemon: FLUSH goes to the backends until a restart)"
			  : run->device	       ? " with its cache device detached (FLUSH goes to the "
						 "backends until a restart)"
					       : "");
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
