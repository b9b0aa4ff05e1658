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
 * Requests (rbd_io.c). Every command is one rbd_aio_* call from the
 * submitting worker (librbd's image handle is thread-safe): READ, WRITE
 * (gathered from the caller's iovec), FLUSH, TRIM and WRITE_ZEROES (both
 * write_zeroes, thick with NO_HOLE: it frees whole objects and zeroes
 * parts of others, where rbd_aio_discard skips whatever is not aligned to
 * the image's discard granularity, so a trimmed range would read back as
 * zeros from the cache and as the old bytes once evicted). FUA is a write
 * then a flush. CACHE does nothing. librbd's own cache is off: we are the
 * cache, and a write librbd acknowledged is on the OSDs. BLOCK_STATUS is
 * rbd_diff_iterate2() over whole objects (the object map answers it
 * without I/O), run on the completion thread since it blocks.
 *
 * Completions come back through librbd's eventfd notification
 * (rbd_set_image_notification): the backend's completion thread polls that
 * fd, takes the finished completions with rbd_poll_io_events() and posts
 * each to the worker that submitted it. No thread per request: two per
 * image (completions; the guard, below).
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
 * Deadlines. A request to an OSD that does not answer fails within
 * --backend-timeout: one that writes (librbd copied its data) is answered
 * EIO at its deadline and its completion, when it comes, only frees its
 * ticket (rbd_internal.h); a READ ends with librados's op timeout, set a
 * second below --backend-timeout with its objecter ticking each second.
 * The cache keeps what failed dirty and writes it again: RADOS applies one
 * client's writes to an object in order, so a late one never lands after
 * what replaced it.
 *
 * Durability: a completed write is on the OSDs (no client cache), a flush
 * orders nothing more, loss_seq never moves.
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
#include <unistd.h>
#include <sys/eventfd.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "daemon/backend/rbd_internal.h"
#include "daemon/clock.h"
#include "daemon/log.h"
#include "daemon/stop_signals.h"

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
	rb->opened = rb->connected = false;
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
	/* librados checks its op timeouts on each tick of its objecter (every
	 * 5 s by default): ticking each second and timing out a second early
	 * makes a request to a silent OSD fail within --backend-timeout. */
	char t[16], op_t[16];
	snprintf(t, sizeof(t), "%u", rb->timeout_s);
	snprintf(op_t, sizeof(op_t), "%u", rb->timeout_s > 1 ? rb->timeout_s - 1 : 1);
	if ((s->keyring[0] && (rc = conf_set(rb, "keyring", s->keyring)) < 0) ||
	    (rc = conf_set(rb, "rbd_cache", "false")) < 0 ||
	    (rc = conf_set(rb, "admin_socket", "")) < 0 ||
	    (rc = conf_set(rb, "log_file", "")) < 0 ||
	    (rc = conf_set(rb, "err_to_stderr", "false")) < 0 ||
	    (rc = conf_set(rb, "objecter_tick_interval", "1")) < 0 ||
	    (rc = conf_set(rb, "rados_osd_op_timeout", op_t)) < 0 ||
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

/* "ADDR[, ADDR...]" of the lock's owners (only those still watching the
 * image with live_only), or "an unknown client"; how many were listed. */
static size_t lock_owners(struct rbd_backend *rb, bool live_only, char *out, size_t outlen)
{
	char *owners[8];
	size_t n = 8, listed = 0, k = 0;
	rbd_lock_mode_t mode;
	snprintf(out, outlen, "an unknown client");
	if (rbd_lock_get_owners(rb->image, &mode, owners, &n) < 0 || n == 0)
		return 0;
	for (size_t i = 0; i < n && k < outlen; i++) {
		if (live_only && !owner_alive(rb, owners[i]))
			continue;
		int w = snprintf(out + k, outlen - k, "%s%s", listed ? ", " : "", owners[i]);
		if (w < 0)
			break;
		k += (size_t)w;
		listed++;
	}
	rbd_lock_get_owners_cleanup(owners, n);
	return listed;
}

/* The refusal at start (rbd-takeover = refuse), naming the owners. */
static void say_refused(struct rbd_backend *rb, const char *owners)
{
	log_error("backend %s: the image's exclusive lock is held by %s (another nbdcached node "
		  "or client); refusing to serve it (rbd-takeover = refuse; with wait, this "
		  "daemon waits until that owner stops or dies)",
		  rb->name, owners);
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
			if (logged)
				log_info("backend %s: took the image's exclusive lock after %.1f s",
					 rb->name, (double)(clock_now_ns() - t0) / 1e9);
			return 0;
		}
		char owners[512];
		lock_owners(rb, false, owners, sizeof(owners));
		if ((rc != -EROFS && rc != -EBUSY) || !rb->takeover_wait) {
			if (rc == -EROFS || rc == -EBUSY)
				say_refused(rb, owners);
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
		/* In slices: a stop asked meanwhile (stop_signals.h) ends the
		 * wait, and with it the start. */
		for (unsigned i = 0; i < RBD_TAKEOVER_RETRY_S * 10u; i++) {
			if (stop_signal_pending()) {
				log_info("backend %s: no longer waiting for the image's exclusive "
					 "lock: the daemon is stopping",
					 rb->name);
				return -EINTR;
			}
			usleep(100000);
		}
	}
}

/* ---- fencing ---- */

void rbd_fence(struct rbd_backend *rb, const char *why)
{
	if (!atomic_exchange(&rb->base.fenced, true))
		log_error("backend %s: fenced: %s, so this daemon no longer owns the image; every "
			  "request to it fails with EIO from now on, dirty data it held is not "
			  "written, and it never writes to the image again (restart it to serve "
			  "the image once more, once it may)",
			  rb->name, why);
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
		rbd_fence(rb, "the cluster has blocklisted this daemon");
	} else if (rc == 0 && n > 0) {
		if (!rb->addrs || !strstr(rb->addrs, owners[0])) {
			char why[300];
			snprintf(why, sizeof(why), "the image's exclusive lock is held by %s now",
				 owners[0]);
			rbd_fence(rb, why);
		}
		rbd_lock_get_owners_cleanup(owners, n);
	} else if (rc == -ENOENT || (rc == 0 && n == 0)) {
		rbd_fence(rb, "the image's exclusive lock is no longer held");
	}
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
		queue_wake(&rb->slow);
		pthread_join(rb->thread, NULL);
		if (rb->guarded)
			pthread_join(rb->guard, NULL);
		/* Nothing of the cache's is in flight now; abandoned requests
		 * may be: their completions free their tickets (librados times
		 * them out; not waited for past twice --backend-timeout). */
		uint64_t until = clock_now_ns() + 2ull * rb->timeout_s * 1000000000u;
		while (atomic_load(&rb->outstanding) && clock_now_ns() < until) {
			struct pollfd p = {.fd = rb->efd, .events = POLLIN};
			if (poll(&p, 1, RBD_SWEEP_MS) > 0)
				rbd_take_completions(rb);
		}
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
	rc = -pthread_create(&rb->thread, NULL, rbd_io_thread, rb);
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

/* rbd_resize2 calls its progress callback while it removes objects: it
 * must be a function (NULL crashed the daemon on the first shrink). */
static int resize_progress(uint64_t done, uint64_t total, void *arg)
{
	(void)done;
	(void)total;
	(void)arg;
	return 0;
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
	int rc = rbd_resize2(rb->image, size, true, resize_progress, NULL);
	if (rc < 0) {
		log_warn("backend %s: cannot resize the image to %" PRIu64 ": %s", rb->name, size,
			 strerror(-rc));
		rc = rbd_map_error(rb, rc);
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
	atomic_init(&rb->outstanding, 0);
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
	queue_init_eventfd(&rb->slow, &rb->lock, rb->wake);
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
		/* Said now, before the daemon detaches; taken for good at start.
		 * An owner no longer watching died: its lock is broken at start
		 * (and it is blocklisted). */
		char owners[512];
		if (lock_owners(rb, true, owners, sizeof(owners)) > 0) {
			say_refused(rb, owners);
			rc = -EBUSY;
			goto fail_open;
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
	rb->base.shared = true;
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
