/*
 * daemon/backend/rbd.c: an export whose bytes live in a Ceph RBD image,
 * reached through librbd directly (the backend string is daemon/rbd_spec.h's
 * rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][?conf=&id=&keyring=]).
 *
 * Two openings. librados starts threads when it connects, and the daemon
 * may fork to detach after its backends are opened, so backend_rbd_open()
 * (before the fork) only checks: it connects, opens the image, learns its
 * size and features, sees whether another client owns its exclusive lock,
 * and disconnects again. rbd_start() (after the fork, or at once on a
 * reload) connects for good, opens the image and takes its lock.
 *
 * Requests. Every command is one rbd_aio_* call from the submitting worker
 * (librbd's image handle is thread-safe): READ, WRITE (gathered from the
 * caller's iovec), FLUSH, TRIM and WRITE_ZEROES (both write_zeroes, thick
 * with NO_HOLE: it frees whole objects and zeroes parts of others, where
 * rbd_aio_discard skips whatever is not aligned to the image's discard
 * granularity, so a trimmed range would read back as zeros from the cache
 * and as the old bytes once evicted). FUA is a write then a flush. CACHE
 * does nothing. librbd's
 * own cache is off: we are the cache, and a write librbd acknowledged is
 * on the OSDs. BLOCK_STATUS is rbd_diff_iterate2() over whole objects (the
 * object map answers it without I/O), run on the backend thread since it
 * blocks.
 *
 * Completions come back through librbd's eventfd notification
 * (rbd_set_image_notification): the backend's one thread polls that fd,
 * takes the finished completions with rbd_poll_io_events() and posts each
 * to the worker that submitted it. No thread per request.
 *
 * One owner per image. A writable export takes the image's exclusive lock
 * with rbd_lock_acquire() and keeps it: librbd then refuses to hand it to
 * a peer that asks. A second daemon (another node) finds it held and is
 * refused at start with the owner's address, or, with rbd-takeover = wait,
 * tries again every RBD_TAKEOVER_RETRY_S seconds. It gets the lock only
 * once the owner released it (a clean stop) or died: librbd breaks the
 * lock of an owner whose watch has expired and has Ceph blocklist it
 * first, so an owner that was only paused can never write again.
 *
 * Fencing. A daemon whose lock is gone sets base.fenced: from then on
 * every request fails with EIO at once, the cache answers nothing from RAM
 * either (what it holds may be stale), and the log and `nbdcachectl
 * exports` say so. It never writes again. It learns it from a request
 * answered ESHUTDOWN (blocklisted), or from its guard thread, which asks
 * the cluster once a second who owns the lock (librbd's own idea lags: a
 * process paused past its watch's expiry and resumed still believes it
 * owns the image until a request fails). Between a resume and that
 * answer (one OSD round trip) a WRITE may still be taken into the cache:
 * it is never written to the image (the OSDs refuse a blocklisted
 * client), and no FLUSH succeeds for it, so what is lost is only what no
 * FLUSH ever acknowledged.
 *
 * Durability: a completed write is on the OSDs (no client cache), a flush
 * orders nothing more. A request that fails (an OSD silent for
 * --backend-timeout: librados's op timeout) fails with EIO, and the cache
 * keeps its data dirty; loss_seq never moves.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <rados/librados.h>
#include <rbd/librbd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "daemon/backend/backend.h"
#include "daemon/clock.h"
#include "daemon/log.h"
#include "daemon/rbd_spec.h"

#define RBD_MAX_RANGE (1ull << 30) /* one TRIM / WRITE_ZEROES request */
#define RBD_POLL_BATCH 64
#define RBD_LOCK_CHECK_MS 1000
#define RBD_TAKEOVER_RETRY_S 2
#define RBD_TAKEOVER_LOG_S 30
#define RBD_ERRNO_BLOCKLISTED ESHUTDOWN /* librados's EBLOCKLISTED */

/* backend_io.stage */
#define STAGE_MAIN 0
#define STAGE_FUA_FLUSH 1

struct rbd_backend {
	struct backend base;
	char *name; /* the backend string, for messages */
	struct rbd_spec spec;
	unsigned timeout_s;
	bool takeover_wait;
	rados_t cluster;
	rados_ioctx_t ioctx;
	rbd_image_t image;
	bool connected, opened, owner;
	int efd;     /* librbd's completion eventfd */
	int wake;    /* eventfd: block status queued, or stop */
	char *addrs; /* this client's address (rados_getaddrs), as lock owner */
	pthread_t thread, guard;
	bool started, guarded;
	pthread_mutex_t lock; /* guards slow_head/tail and stop */
	pthread_cond_t cond;  /* the guard's sleep; signalled on stop */
	struct backend_io *slow_head, *slow_tail;
	bool stop;
	atomic_bool fence_logged;
};

static struct rbd_backend *to_rbd(struct backend *be)
{
	return (struct rbd_backend *)be;
}

/* ---- connecting ---- */

static int conf_set(struct rbd_backend *rb, const char *key, const char *value)
{
	int rc = rados_conf_set(rb->cluster, key, value);
	if (rc < 0)
		log_error("backend %s: cannot set %s = %s: %s", rb->name, key, value,
			  strerror(-rc));
	return rc;
}

static void disconnect(struct rbd_backend *rb)
{
	if (rb->opened)
		rbd_close(rb->image);
	if (rb->connected) {
		rados_ioctx_destroy(rb->ioctx);
		rados_shutdown(rb->cluster);
	}
	rb->opened = rb->connected = rb->owner = false;
	free(rb->addrs);
	rb->addrs = NULL;
}

/* Connect to the cluster and open the image (read-only when ro). */
static int connect_open(struct rbd_backend *rb, bool ro)
{
	const struct rbd_spec *s = &rb->spec;
	char user[RBD_SPEC_NAME_MAX + 8];
	snprintf(user, sizeof(user), "client.%s", s->id[0] ? s->id : "admin");
	int rc = rados_create2(&rb->cluster, "ceph", user, 0);
	if (rc < 0) {
		log_error("backend %s: cannot create a cluster handle: %s", rb->name,
			  strerror(-rc));
		return rc;
	}
	rc = rados_conf_read_file(rb->cluster, s->conf[0] ? s->conf : NULL);
	if (rc < 0) {
		log_error("backend %s: cannot read %s: %s", rb->name,
			  s->conf[0] ? s->conf : "a ceph.conf ($CEPH_CONF, /etc/ceph/ceph.conf)",
			  strerror(-rc));
		rados_shutdown(rb->cluster);
		return rc;
	}
	char t[16];
	snprintf(t, sizeof(t), "%u", rb->timeout_s);
	if ((s->keyring[0] && (rc = conf_set(rb, "keyring", s->keyring)) < 0) ||
	    (rc = conf_set(rb, "rbd_cache", "false")) < 0 ||
	    (rc = conf_set(rb, "admin_socket", "")) < 0 ||
	    (rc = conf_set(rb, "log_file", "")) < 0 ||
	    (rc = conf_set(rb, "err_to_stderr", "false")) < 0 ||
	    (rc = conf_set(rb, "rados_osd_op_timeout", t)) < 0 ||
	    (rc = conf_set(rb, "rados_mon_op_timeout", t)) < 0 ||
	    (rc = conf_set(rb, "client_mount_timeout", t)) < 0) {
		rados_shutdown(rb->cluster);
		return rc;
	}
	rc = rados_connect(rb->cluster);
	if (rc < 0) {
		log_error("backend %s: cannot connect to the cluster as %s: %s", rb->name, user,
			  strerror(-rc));
		rados_shutdown(rb->cluster);
		return rc;
	}
	rc = rados_ioctx_create(rb->cluster, s->pool, &rb->ioctx);
	if (rc < 0) {
		log_error("backend %s: no pool '%s': %s", rb->name, s->pool, strerror(-rc));
		rados_shutdown(rb->cluster);
		return rc;
	}
	rb->connected = true;
	rados_ioctx_set_namespace(rb->ioctx, s->ns);
	rc = ro ? rbd_open_read_only(rb->ioctx, s->image, &rb->image, s->snap[0] ? s->snap : NULL)
		: rbd_open(rb->ioctx, s->image, &rb->image, NULL);
	if (rc < 0) {
		log_error("backend %s: cannot open image '%s'%s%s: %s", rb->name, s->image,
			  s->snap[0] ? " at snapshot " : "", s->snap, strerror(-rc));
		disconnect(rb);
		return rc;
	}
	rb->opened = true;
	return 0;
}

/* "ADDR[, ADDR...]" of the lock's owners, or "an unknown client". */
static void lock_owners(struct rbd_backend *rb, char *out, size_t outlen)
{
	char *owners[8];
	size_t n = 8;
	rbd_lock_mode_t mode;
	snprintf(out, outlen, "an unknown client");
	if (rbd_lock_get_owners(rb->image, &mode, owners, &n) < 0 || n == 0)
		return;
	size_t k = 0;
	for (size_t i = 0; i < n && k < outlen; i++) {
		int w = snprintf(out + k, outlen - k, "%s%s", i ? ", " : "", owners[i]);
		if (w < 0)
			break;
		k += (size_t)w;
	}
	rbd_lock_get_owners_cleanup(owners, n);
}

/* Does the owner (its address) still watch the image? One that died
 * stops watching once its watch times out; librbd then breaks its lock
 * (and has it blocklisted) for the next rbd_lock_acquire. */
static bool owner_alive(struct rbd_backend *rb, const char *owner)
{
	rbd_image_watcher_t w[32];
	size_t n = 32;
	if (rbd_watchers_list(rb->image, w, &n) < 0)
		return true;
	bool alive = false;
	for (size_t i = 0; i < n; i++)
		if (strcmp(w[i].addr, owner) == 0)
			alive = true;
	rbd_watchers_list_cleanup(w, n);
	return alive;
}

/*
 * Take the image's exclusive lock: once (refuse) or until it is ours
 * (wait). librbd answers EROFS or EBUSY while a live owner keeps it.
 */
static int take_lock(struct rbd_backend *rb)
{
	uint64_t t0 = clock_now_ns(), logged = 0;
	for (;;) {
		int rc = rbd_lock_acquire(rb->image, RBD_LOCK_MODE_EXCLUSIVE);
		if (rc == 0) {
			rb->owner = true;
			if (logged)
				log_info("backend %s: took the image's exclusive lock after %.1f s",
					 rb->name, (double)(clock_now_ns() - t0) / 1e9);
			return 0;
		}
		char owners[512];
		lock_owners(rb, owners, sizeof(owners));
		if ((rc != -EROFS && rc != -EBUSY) || !rb->takeover_wait) {
			if (rc == -EROFS || rc == -EBUSY)
				log_error(
				    "backend %s: the image's exclusive lock is held by %s "
				    "(another nbdcached node or client); refusing to serve it "
				    "(rbd-takeover = refuse; with wait, this daemon waits until "
				    "that owner stops or dies)",
				    rb->name, owners);
			else
				log_error("backend %s: cannot take the image's exclusive lock: %s",
					  rb->name, strerror(-rc));
			return rc == -EROFS ? -EBUSY : rc;
		}
		uint64_t now = clock_now_ns();
		if (!logged || now - logged >= (uint64_t)RBD_TAKEOVER_LOG_S * 1000000000u) {
			log_warn("backend %s: waiting for the image's exclusive lock, held by %s "
				 "(rbd-takeover = wait; %.0f s so far)",
				 rb->name, owners, (double)(now - t0) / 1e9);
			logged = now;
		}
		sd_notifyf(0,
			   "STATUS=waiting for the exclusive lock of %s, held by %s\n"
			   "EXTEND_TIMEOUT_USEC=%u",
			   rb->name, owners, (RBD_TAKEOVER_RETRY_S + 10) * 1000000u);
		sleep(RBD_TAKEOVER_RETRY_S);
	}
}

/* ---- fencing ---- */

static void fence(struct rbd_backend *rb, const char *why)
{
	atomic_store(&rb->base.fenced, true);
	if (!atomic_exchange(&rb->fence_logged, true))
		log_error("backend %s: fenced: %s, so this daemon no longer owns the image; every "
			  "request to it fails with EIO from now on, dirty data it held is not "
			  "written, and it never writes to the image again (restart it to serve "
			  "the image once more, once it may)",
			  rb->name, why);
}

/* ---- requests ---- */

static void done_task(struct worker_task *task)
{
	struct backend_io *io =
	    (struct backend_io *)((char *)task - offsetof(struct backend_io, task));
	io->done(io, io->result);
}

static void finish(struct backend_io *io, int result)
{
	io->result = result;
	io->task.run = done_task;
	worker_post(io->worker, &io->task);
}

/* What the caller sees of a librbd error. */
static int map_error(struct rbd_backend *rb, enum backend_cmd cmd, int r)
{
	if (r == -RBD_ERRNO_BLOCKLISTED)
		fence(rb, "the cluster answered a request with 'blocklisted'");
	else if (r == -EROFS && cmd != BACKEND_READ && cmd != BACKEND_BLOCK_STATUS && rb->owner)
		fence(rb, "a write was refused for want of the exclusive lock");
	return r == -ENOSPC || r == -EDQUOT ? -ENOSPC : -EIO;
}

/* One rbd_aio_* call for io's current stage; < 0: not started. */
static int start_aio(struct rbd_backend *rb, struct backend_io *io)
{
	rbd_completion_t c;
	int rc = rbd_aio_create_completion(io, NULL, &c);
	if (rc < 0)
		return rc;
	enum backend_cmd cmd = io->stage == STAGE_FUA_FLUSH ? BACKEND_FLUSH : io->cmd;
	switch (cmd) {
	case BACKEND_READ:
		rc = rbd_aio_read(rb->image, io->offset, (size_t)io->length, io->buf, c);
		break;
	case BACKEND_WRITE:
		rc = io->iovcnt
			 ? rbd_aio_writev(rb->image, io->iov, (int)io->iovcnt, io->offset, c)
			 : rbd_aio_write(rb->image, io->offset, (size_t)io->length, io->buf, c);
		break;
	case BACKEND_FLUSH:
		rc = rbd_aio_flush(rb->image, c);
		break;
	case BACKEND_TRIM:
	case BACKEND_ZERO:
		rc = rbd_aio_write_zeroes(
		    rb->image, io->offset, (size_t)io->length, c,
		    (io->flags & BACKEND_NO_HOLE) ? RBD_WRITE_ZEROES_FLAG_THICK_PROVISION : 0, 0);
		break;
	default:
		rc = -EINVAL;
		break;
	}
	if (rc < 0)
		rbd_aio_release(c);
	return rc;
}

/* A completion the thread took from librbd: the next stage, or the end. */
static void completed(struct rbd_backend *rb, struct backend_io *io, ssize_t r)
{
	if (r < 0) {
		finish(io, map_error(rb, io->stage == STAGE_FUA_FLUSH ? BACKEND_FLUSH : io->cmd,
				     (int)r));
		return;
	}
	if (io->cmd == BACKEND_READ && (uint64_t)r != io->length) {
		log_warn("backend %s: a read of %" PRIu64 " bytes at %" PRIu64 " returned %zd",
			 rb->name, io->length, io->offset, r);
		finish(io, -EIO);
		return;
	}
	if (io->cmd == BACKEND_WRITE && (io->flags & BACKEND_FUA) && io->stage == STAGE_MAIN) {
		io->stage = STAGE_FUA_FLUSH;
		int rc = start_aio(rb, io);
		if (rc < 0)
			finish(io, map_error(rb, BACKEND_FLUSH, rc));
		return;
	}
	finish(io, 0);
}

/* rbd_diff_iterate2's callback: [off, off + len) exists (or not). */
struct extents_walk {
	struct backend_io *io;
	uint64_t pos, end;
};

static bool add_extent(struct backend_io *io, uint64_t length, uint32_t flags)
{
	if (!length)
		return true;
	if (io->n_extents && io->extents[io->n_extents - 1].flags == flags) {
		io->extents[io->n_extents - 1].length += length;
		return true;
	}
	if (io->n_extents == io->max_extents)
		return false;
	io->extents[io->n_extents].length = length;
	io->extents[io->n_extents].flags = flags;
	io->n_extents++;
	return true;
}

#define WALK_FULL 1 /* returned by the callback: no room for more extents */

static int walk_extent(uint64_t off, size_t len, int exists, void *arg)
{
	struct extents_walk *w = arg;
	uint64_t start = off < w->pos ? w->pos : off;
	uint64_t end = off + len > w->end ? w->end : off + len;
	if (start >= end)
		return 0;
	if (start > w->pos && !add_extent(w->io, start - w->pos, NBD_STATE_HOLE | NBD_STATE_ZERO))
		return -WALK_FULL;
	w->pos = start;
	if (!add_extent(w->io, end - start, exists ? 0 : NBD_STATE_HOLE | NBD_STATE_ZERO))
		return -WALK_FULL;
	w->pos = end;
	return 0;
}

static int block_status(struct rbd_backend *rb, struct backend_io *io)
{
	uint64_t size = atomic_load(&rb->base.size);
	uint64_t end = io->offset + io->length;
	struct extents_walk w = {io, io->offset, end > size ? size : end};
	io->n_extents = 0;
	if (w.pos >= w.end)
		return 0;
	int rc = rbd_diff_iterate2(rb->image, NULL, w.pos, w.end - w.pos, 1, 1, walk_extent, &w);
	if (rc == -WALK_FULL)
		return io->n_extents ? 0 : -EIO;
	if (rc < 0)
		return map_error(rb, BACKEND_BLOCK_STATUS, rc);
	if (w.pos < w.end && !add_extent(io, w.end - w.pos, NBD_STATE_HOLE | NBD_STATE_ZERO) &&
	    !io->n_extents)
		return -EIO;
	return 0;
}

static void wake_thread(struct rbd_backend *rb)
{
	uint64_t one = 1;
	ssize_t n = write(rb->wake, &one, sizeof(one));
	(void)n; /* a full counter wakes it as well */
}

static void rbd_submit(struct backend *be, struct backend_io *io)
{
	struct rbd_backend *rb = to_rbd(be);
	io->result = 0;
	if (atomic_load(&be->fenced)) {
		io->done(io, -EIO);
		return;
	}
	switch (io->cmd) {
	case BACKEND_CACHE:
		io->done(io, 0);
		return;
	case BACKEND_BLOCK_STATUS:
		io->queue_next = NULL;
		pthread_mutex_lock(&rb->lock);
		if (rb->slow_tail)
			rb->slow_tail->queue_next = io;
		else
			rb->slow_head = io;
		rb->slow_tail = io;
		pthread_mutex_unlock(&rb->lock);
		wake_thread(rb);
		return;
	case BACKEND_ZERO:
		if (io->flags & BACKEND_FAST_ONLY) {
			io->done(io, -ENOTSUP); /* write_zeroes may write zeros */
			return;
		}
		break;
	default:
		break;
	}
	int rc = start_aio(rb, io);
	if (rc < 0)
		io->done(io, map_error(rb, io->cmd, rc));
}

/* ---- the thread ---- */

static void take_completions(struct rbd_backend *rb)
{
	uint64_t v;
	ssize_t n = read(rb->efd, &v, sizeof(v));
	(void)n;
	rbd_completion_t comps[RBD_POLL_BATCH];
	int got;
	while ((got = rbd_poll_io_events(rb->image, comps, RBD_POLL_BATCH)) > 0) {
		for (int i = 0; i < got; i++) {
			struct backend_io *io = rbd_aio_get_arg(comps[i]);
			ssize_t r = rbd_aio_get_return_value(comps[i]);
			rbd_aio_release(comps[i]);
			completed(rb, io, r);
		}
	}
}

static void run_slow(struct rbd_backend *rb)
{
	uint64_t v;
	ssize_t n = read(rb->wake, &v, sizeof(v));
	(void)n;
	pthread_mutex_lock(&rb->lock);
	struct backend_io *io = rb->slow_head;
	rb->slow_head = rb->slow_tail = NULL;
	pthread_mutex_unlock(&rb->lock);
	while (io) {
		struct backend_io *next = io->queue_next;
		finish(io, atomic_load(&rb->base.fenced) ? -EIO : block_status(rb, io));
		io = next;
	}
}

/*
 * Are we still the owner? Asked of the cluster (the lock's record on the
 * image header), not of librbd's own idea, which a paused process keeps
 * until some request fails: blocklisted, another owner, or no owner at all
 * fences; other errors (an OSD down: a timeout) prove nothing.
 */
static void check_owner(struct rbd_backend *rb)
{
	char *owners[8];
	size_t n = 8;
	rbd_lock_mode_t mode;
	int rc = rbd_lock_get_owners(rb->image, &mode, owners, &n);
	if (rc == -RBD_ERRNO_BLOCKLISTED) {
		fence(rb, "the cluster has blocklisted this daemon");
	} else if (rc == 0 && n > 0) {
		if (!rb->addrs || !strstr(rb->addrs, owners[0])) {
			char why[300];
			snprintf(why, sizeof(why), "the image's exclusive lock is held by %s now",
				 owners[0]);
			fence(rb, why);
		}
		rbd_lock_get_owners_cleanup(owners, n);
	} else if (rc == -ENOENT || (rc == 0 && n == 0)) {
		fence(rb, "the image's exclusive lock is no longer held");
	}
	int owner = 1;
	if (rbd_is_exclusive_lock_owner(rb->image, &owner) == 0 && !owner)
		fence(rb, "librbd no longer holds the image's exclusive lock");
}

/* The guard thread of an owner: check_owner() every RBD_LOCK_CHECK_MS, on
 * a thread of its own, since the question waits for an OSD (up to
 * --backend-timeout while one is down) and completions must not. */
static void *guard_thread(void *arg)
{
	struct rbd_backend *rb = arg;
	pthread_mutex_lock(&rb->lock);
	while (!rb->stop && !atomic_load(&rb->base.fenced)) {
		struct timespec until;
		clock_gettime(CLOCK_REALTIME, &until);
		until.tv_nsec += (long)RBD_LOCK_CHECK_MS * 1000000L;
		until.tv_sec += until.tv_nsec / 1000000000L;
		until.tv_nsec %= 1000000000L;
		pthread_cond_timedwait(&rb->cond, &rb->lock, &until);
		if (rb->stop)
			break;
		pthread_mutex_unlock(&rb->lock);
		check_owner(rb);
		pthread_mutex_lock(&rb->lock);
	}
	pthread_mutex_unlock(&rb->lock);
	return NULL;
}

static void *rbd_thread(void *arg)
{
	struct rbd_backend *rb = arg;
	for (;;) {
		pthread_mutex_lock(&rb->lock);
		bool stop = rb->stop;
		pthread_mutex_unlock(&rb->lock);
		if (stop)
			break;
		struct pollfd p[2] = {{.fd = rb->efd, .events = POLLIN},
				      {.fd = rb->wake, .events = POLLIN}};
		if (poll(p, 2, -1) < 0 && errno != EINTR)
			break;
		if (p[0].revents & POLLIN)
			take_completions(rb);
		if (p[1].revents & POLLIN)
			run_slow(rb);
	}
	return NULL;
}

/* ---- the backend's life ---- */

static void rbd_free(struct rbd_backend *rb)
{
	if (rb->efd >= 0)
		close(rb->efd);
	if (rb->wake >= 0)
		close(rb->wake);
	pthread_mutex_destroy(&rb->lock);
	pthread_cond_destroy(&rb->cond);
	free(rb->name);
	free(rb);
}

static void rbd_close_backend(struct backend *be)
{
	struct rbd_backend *rb = to_rbd(be);
	if (rb->started) {
		pthread_mutex_lock(&rb->lock);
		rb->stop = true;
		pthread_cond_signal(&rb->cond);
		pthread_mutex_unlock(&rb->lock);
		wake_thread(rb);
		pthread_join(rb->thread, NULL);
		if (rb->guarded)
			pthread_join(rb->guard, NULL);
	}
	/* rbd_close waits for requests in flight and releases the lock (a
	 * clean hand-over: the next owner needs no blocklisting). */
	disconnect(rb);
	rbd_free(rb);
}

static int rbd_start(struct backend *be)
{
	struct rbd_backend *rb = to_rbd(be);
	bool ro = be->readonly;
	int rc = connect_open(rb, ro);
	if (rc < 0)
		return rc;
	if (!ro && (rc = take_lock(rb)) < 0)
		goto fail;
	uint64_t size;
	if ((rc = rbd_get_size(rb->image, &size)) < 0)
		goto fail;
	if (size != atomic_load(&be->size))
		log_warn("backend %s: the image has %" PRIu64 " bytes now (%" PRIu64
			 " when the config was read); `nbdcachectl resize` serves the new size",
			 rb->name, size, (uint64_t)atomic_load(&be->size));
	rc = rbd_set_image_notification(rb->image, rb->efd, EVENT_TYPE_EVENTFD);
	if (rc < 0) {
		log_error("backend %s: cannot have completions notified: %s", rb->name,
			  strerror(-rc));
		goto fail;
	}
	rc = -pthread_create(&rb->thread, NULL, rbd_thread, rb);
	if (rc < 0)
		goto fail;
	rb->started = true;
	if (!ro) {
		if (rados_getaddrs(rb->cluster, &rb->addrs) < 0)
			rb->addrs = NULL;
		rb->guarded = pthread_create(&rb->guard, NULL, guard_thread, rb) == 0;
		if (!rb->guarded)
			log_warn("backend %s: no thread to watch the image's lock: a lost lock is "
				 "noticed only when a request fails",
				 rb->name);
	}
	log_info("backend %s: serving the image%s", rb->name,
		 ro ? " read-only" : ", its exclusive lock held");
	return 0;
fail:
	disconnect(rb);
	return rc;
}

static int rbd_probe_size(struct backend *be, uint64_t *size)
{
	struct rbd_backend *rb = to_rbd(be);
	if (!rb->opened)
		return -ENOTSUP;
	int rc = rbd_get_size(rb->image, size);
	return rc < 0 ? -EIO : 0;
}

/* The image is grown or cut (rbd_resize2): as a file is. */
static int rbd_set_size(struct backend *be, uint64_t size, uint64_t *have)
{
	struct rbd_backend *rb = to_rbd(be);
	if (!rb->opened)
		return -ENOTSUP;
	if (be->readonly)
		return -EROFS;
	if (atomic_load(&be->fenced))
		return -EIO;
	int rc = rbd_resize2(rb->image, size, true, NULL, NULL);
	if (rc < 0) {
		log_warn("backend %s: cannot resize the image to %" PRIu64 ": %s", rb->name, size,
			 strerror(-rc));
		rc = map_error(rb, BACKEND_WRITE, rc);
	}
	uint64_t now;
	if (rbd_get_size(rb->image, &now) == 0)
		*have = now;
	return rc;
}

static const struct backend_ops rbd_backend_ops = {
    .kind = "rbd",
    .submit = rbd_submit,
    .start = rbd_start,
    .close = rbd_close_backend,
    .probe_size = rbd_probe_size,
    .set_size = rbd_set_size,
};

bool backend_rbd_handles(const char *spec)
{
	return rbd_spec_handles(spec);
}

int backend_rbd_open(const char *spec, bool readonly, unsigned timeout_seconds, bool takeover_wait,
		     struct backend **out)
{
	struct rbd_backend *rb = calloc(1, sizeof(*rb));
	if (!rb)
		return -ENOMEM;
	rb->efd = rb->wake = -1;
	pthread_mutex_init(&rb->lock, NULL);
	pthread_cond_init(&rb->cond, NULL);
	rb->base.ops = &rbd_backend_ops;
	atomic_init(&rb->base.loss_seq, 0);
	atomic_init(&rb->base.fenced, false);
	atomic_init(&rb->fence_logged, false);
	rb->timeout_s = timeout_seconds;
	rb->takeover_wait = takeover_wait;
	rb->name = strdup(spec);
	char err[512];
	int rc = -ENOMEM;
	if (!rb->name)
		goto fail;
	rc = rbd_spec_parse(spec, &rb->spec, err, sizeof(err));
	if (rc < 0) {
		log_error("backend %s", err);
		goto fail;
	}
	rb->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	rb->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (rb->efd < 0 || rb->wake < 0) {
		rc = -errno;
		goto fail;
	}
	bool ro = readonly || rb->spec.snap[0];
	if ((rc = connect_open(rb, ro)) < 0)
		goto fail;
	uint64_t size = 0, features = 0;
	if ((rc = rbd_get_size(rb->image, &size)) < 0 ||
	    (rc = rbd_get_features(rb->image, &features)) < 0) {
		log_error("backend %s: cannot read the image's size and features: %s", rb->name,
			  strerror(-rc));
		goto fail_open;
	}
	if (!ro && !(features & RBD_FEATURE_EXCLUSIVE_LOCK)) {
		log_error("backend %s: the image lacks the exclusive-lock feature, so nothing "
			  "keeps a second writer away: enable it (rbd feature enable %s/%s%s%s "
			  "exclusive-lock) or serve the image readonly",
			  rb->name, rb->spec.pool, rb->spec.ns, rb->spec.ns[0] ? "/" : "",
			  rb->spec.image);
		rc = -EINVAL;
		goto fail_open;
	}
	if (!ro && !takeover_wait) {
		/* Said now, before the daemon detaches; taken for good at start. */
		char *owners[8];
		size_t n = 8;
		rbd_lock_mode_t mode;
		if (rbd_lock_get_owners(rb->image, &mode, owners, &n) == 0 && n > 0) {
			/* An owner no longer watching died: its lock is broken at
			 * start (and it is blocklisted). */
			bool alive = owner_alive(rb, owners[0]);
			if (alive)
				log_error(
				    "backend %s: the image's exclusive lock is held by %s "
				    "(another nbdcached node or client); refusing to serve it "
				    "(rbd-takeover = refuse; with wait, this daemon waits "
				    "until that owner stops or dies)",
				    rb->name, owners[0]);
			rbd_lock_get_owners_cleanup(owners, n);
			if (alive) {
				rc = -EBUSY;
				goto fail_open;
			}
		}
	}
	disconnect(rb);
	atomic_init(&rb->base.size, size);
	rb->base.readonly = ro;
	rb->base.can_trim = true;
	rb->base.can_zero = true;
	rb->base.min_block = 512;
	rb->base.takes_iovec = true;
	rb->base.max_range = RBD_MAX_RANGE;
	log_info("backend %s: %" PRIu64 " bytes%s, features 0x%" PRIx64 "%s", spec, size,
		 ro ? ", read-only" : "", features,
		 (features & RBD_FEATURE_FAST_DIFF) ? ", fast-diff (block status)" : "");
	*out = &rb->base;
	return 0;
fail_open:
	disconnect(rb);
fail:
	rbd_free(rb);
	return rc;
}
