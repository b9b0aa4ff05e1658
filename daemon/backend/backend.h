/*
 * daemon/backend/backend.h: where an export's bytes really live.
 *
 * Owns: the asynchronous backend interface. A caller fills a struct
 * backend_io (command, offset, length, buffer, flags, done callback) and
 * calls backend_submit() from a worker thread (a struct worker: a
 * connection worker or the writeback thread), passing that worker. The
 * done callback runs later on the same thread with 0 or -errno; it may
 * also run before backend_submit() returns (a backend that can answer at
 * once, such as block status from lseek), so callers must not touch the
 * backend_io after submitting it except from the callback.
 *
 * Lengths and offsets are uint64_t: a TRIM, WRITE_ZEROES, CACHE or
 * BLOCK_STATUS may cover far more than 4 GiB. READ and WRITE lengths are
 * bounded by the maximum payload the server advertises.
 *
 * Locking: a backend is shared by every worker; its operations are
 * thread-safe (they use the caller's ring and positional I/O only).
 *
 * Implementations: file.c (regular file or block device, io_uring on the
 * worker's ring), nbd.c (another NBD server through libnbd, on the
 * backend's own thread; completions are posted back to the worker; its
 * other files are nbd_*.c, sharing nbd_internal.h), rbd.c (a Ceph RBD
 * image through librbd; completions through librbd's eventfd to the
 * backend's thread, posted back to the worker; rbd_io.c has the requests,
 * rbd_internal.h what the two share).
 *
 * Files in daemon/backend/ include only the headers of daemon/backend/,
 * daemon/log.h, daemon/clock.h, daemon/uring.h, daemon/worker.h,
 * daemon/queue.h, daemon/options.h, daemon/rbd_spec.h and proto/: a
 * backend knows nothing of the cache or the connections.
 */
#ifndef NBDCACHED_DAEMON_BACKEND_H
#define NBDCACHED_DAEMON_BACKEND_H

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "daemon/queue.h"
#include "daemon/uring.h"
#include "daemon/worker.h"
#include "proto/nbd.h"

enum backend_cmd {
	BACKEND_READ,
	BACKEND_WRITE,
	BACKEND_FLUSH,
	BACKEND_TRIM,
	BACKEND_ZERO,
	BACKEND_CACHE,
	BACKEND_BLOCK_STATUS,
};

/* backend_io.flags */
#define BACKEND_FUA (1u << 0)	    /* persist before completing */
#define BACKEND_NO_HOLE (1u << 1)   /* ZERO: keep the range allocated */
#define BACKEND_FAST_ONLY (1u << 2) /* ZERO: fail with -ENOTSUP unless cheap */

struct backend;

struct backend_io {
	enum backend_cmd cmd;
	uint32_t flags;
	uint64_t offset;
	uint64_t length;
	void *buf; /* READ / WRITE */
	/*
	 * WRITE, in place of buf when iovcnt > 0 (only to a backend with
	 * takes_iovec): the data is gathered from iov[0..iovcnt), at most
	 * IOV_MAX of them, together length bytes. The array must stay valid
	 * until done runs; the backend may advance it in place (iov moves
	 * past what a short write consumed), so keep the pointer to free.
	 */
	struct iovec *iov;
	unsigned iovcnt;
	/* BLOCK_STATUS: room for max_extents; n_extents filled on success. */
	struct nbd_extent *extents;
	size_t max_extents;
	size_t n_extents;
	void (*done)(struct backend_io *io, int result);
	uint64_t submit_ns; /* the caller's: when it was sent (latency) */

	/* Private to the backend. */
	struct backend *backend;
	struct worker *worker;
	struct uring *ring;
	struct uring_op op;
	struct worker_task task;
	int result;
	uint32_t state; /* backend-specific flags */
	uint64_t deadline_ns;
	uint64_t loss_seq_seen; /* nbd: backend loss_seq when the request (re)started */
	/* A request is on one list of the backend's at a time: first its
	 * thread's queue (posted: nbd, rbd block status), then, once the
	 * thread took it, one of the backend's own (queue_next: nbd waiting,
	 * rbd late). */
	union {
		struct queue_link posted;
		struct backend_io *queue_next;
	};
	struct backend_io *deferred_next;
	uint64_t progress;
	int stage;
};

struct backend_ops {
	const char *kind;
	void (*submit)(struct backend *be, struct backend_io *io);
	/* Optional: start threads (after the daemon has detached). */
	int (*start)(struct backend *be);
	void (*close)(struct backend *be);
	/* Optional (online resize, control thread): the size the backend has
	 * now (a file grown or cut by someone else, a block device resized). */
	int (*probe_size)(struct backend *be, uint64_t *size);
	/* Optional: make the backend size bytes long (a file: ftruncate; a
	 * block device or NBD server: only up to what it has, -ENOSPC past
	 * it). *have: the size the backend has afterwards (on -ENOSPC, what it
	 * has), so the caller need not ask again; 0 when unknown. Does not
	 * change be->size: the export table publishes the new size when the
	 * cache follows. */
	int (*set_size)(struct backend *be, uint64_t size, uint64_t *have);
};

struct backend {
	const struct backend_ops *ops;
	/* Bytes; an online resize (export_resize.c) moves it, so any thread
	 * reads it atomically. */
	atomic_uint_fast64_t size;
	bool readonly;	   /* the backend itself cannot be written */
	bool can_trim;	   /* TRIM does something */
	bool can_zero;	   /* WRITE_ZEROES is native (fast) */
	uint32_t min_block; /* smallest aligned unit for efficient I/O */
	bool takes_iovec;   /* WRITE accepts iov / iovcnt (else buf only) */
	/* The largest range one request to it covers: a longer TRIM or
	 * WRITE_ZEROES is cut into requests (an NBD server: 4 GiB each); 0:
	 * any range is one request (a file: one fallocate). */
	uint64_t max_range;
	/*
	 * Moves whenever writes the backend acknowledged may have been lost
	 * before a backend flush covered them (a connection to a remote
	 * server lost or declared dead). The cache samples it around each
	 * backend flush: a flush only makes durable what was written before
	 * it on connections that were not lost meanwhile, so when it moved,
	 * the cache writes its unstable data again (cache.h). A file backend
	 * never moves it: its failures come back as the FLUSH's own error.
	 */
	atomic_uint_fast64_t loss_seq;
	/*
	 * Set for good when the backend may no longer be written: an rbd
	 * image whose exclusive lock this daemon lost (another node owns it
	 * now). Every request fails with EIO, and the cache answers nothing
	 * from RAM either, since what it holds may be stale (cache.h).
	 */
	atomic_bool fenced;
	/* A file's or block device's identity (st_dev and st_ino; a block
	 * device's st_rdev and 0), which a cache device records with the
	 * dirty data it holds; ident_file is false for the other backends. */
	bool ident_file;
	uint64_t ident_dev, ident_ino;
	/*
	 * Another node may take the backend over (an rbd: image, one owner at
	 * a time): what a FLUSH or FUA acknowledges must be on the backend
	 * itself, where that node finds it, never only in a local cache
	 * device's log; and a local copy of its blocks (the level-2 cache)
	 * is not trusted after a restart, since another node may have
	 * written it meanwhile (device.h).
	 */
	bool shared;
};

/* Open a regular file or block device. readonly opens it O_RDONLY. */
int backend_file_open(const char *path, bool readonly, struct backend **out);
/* Is spec an NBD URI or "nbdkit:PLUGIN ..." (nbd.c)? */
bool backend_nbd_handles(const char *spec);
/* Connect to an NBD server (or start nbdkit) now; requests wait up to
 * timeout_seconds for a lost connection to come back. */
int backend_nbd_open(const char *spec, bool readonly, unsigned timeout_seconds,
		     struct backend **out);

/* Is spec "rbd:..." (rbd.c, daemon/rbd_spec.h)? */
bool backend_rbd_handles(const char *spec);
/* Check that the image can be served (cluster, pool, image, features; the
 * exclusive lock free, unless takeover_wait); backend_start() connects
 * for good and takes the lock, waiting for it with takeover_wait. */
int backend_rbd_open(const char *spec, bool readonly, unsigned timeout_seconds, bool takeover_wait,
		     struct backend **out);

static inline int backend_start(struct backend *be)
{
	return be->ops->start ? be->ops->start(be) : 0;
}

static inline void backend_submit(struct backend *be, struct worker *w, struct backend_io *io)
{
	io->backend = be;
	io->worker = w;
	io->ring = &w->ring;
	io->progress = 0;
	io->stage = 0;
	be->ops->submit(be, io);
}

/* -ENOTSUP when the backend cannot (an NBD server: libnbd learns the size
 * once per connection). */
static inline int backend_probe_size(struct backend *be, uint64_t *size)
{
	return be->ops->probe_size ? be->ops->probe_size(be, size) : -ENOTSUP;
}

static inline int backend_set_size(struct backend *be, uint64_t size, uint64_t *have)
{
	*have = 0;
	return be->ops->set_size ? be->ops->set_size(be, size, have) : -ENOTSUP;
}

static inline void backend_close(struct backend *be)
{
	if (be)
		be->ops->close(be);
}

#endif
