/*
 * daemon/backend/file.c: a regular file or a block device, through io_uring.
 *
 * Every data operation is positional and goes through the calling worker's
 * ring, so one open file descriptor serves every thread. Short reads and
 * writes are continued from where they stopped. Block status and CACHE are
 * answered at once (lseek SEEK_DATA/SEEK_HOLE, posix_fadvise), which is why
 * backend_io completions may run inline.
 *
 * WRITE_ZEROES is a little ladder, each rung tried only if the one above
 * is not supported by the file system or device:
 *
 *   may trim:  punch hole -> zero range -> write zeroes
 *   NO_HOLE:   zero range -> punch hole + allocate -> write zeroes
 *
 * With FAST_ZERO the last rung is refused with -ENOTSUP instead, as the
 * protocol asks. FUA on TRIM and WRITE_ZEROES adds an fdatasync at the end;
 * FUA on WRITE uses RWF_DSYNC.
 *
 * Two inline fast paths skip the ring where it can only add latency:
 *  - a READ is first tried with preadv2(RWF_NOWAIT), which succeeds only
 *    from the page cache; whatever it could not serve goes to io_uring;
 *  - a file on tmpfs/ramfs has no RWF_NOWAIT, and io_uring hands each of
 *    its reads and writes to a kernel worker thread (measured: 1 MiB
 *    reads at a third of nbdkit's rate). Its data is memory, so READ and
 *    WRITE are plain pread/pwrite on the calling thread there.
 *
 * Aligned writes bypass the page cache. The writeback thread writes
 * megabytes the cache already holds; through the page cache they would be
 * copied a second time and written out later by the kernel's flusher, at
 * a CPU cost that caps sustained writeback well below the disk. So the
 * file is opened twice:
 *
 *   fd         buffered: every READ, unaligned WRITEs, FLUSH (fdatasync),
 *              TRIM / WRITE_ZEROES (fallocate), block status, CACHE
 *   direct_fd  O_DIRECT: a WRITE whose file offset, length and memory are
 *              aligned (below); -1 when the file system refuses O_DIRECT
 *              (probed at open: the open fails, or the first direct write
 *              fails with EINVAL) or the file is memory (tmpfs, ramfs:
 *              there a "direct" write is the same copy into memory)
 *
 * Alignment: offset and length multiples of dio_align, every buffer
 * address a multiple of mem_align. A block device: its logical block size
 * (BLKSSZGET) for both. A regular file: statx's STATX_DIOALIGN, with the
 * offset rounded up to the file system block (st_blksize: ext4 serialises
 * direct writes that are not), and 4096 for both when statx does not say.
 * A single-buffer WRITE sends its aligned prefix direct and the rest (the
 * tail of an export whose size is not a multiple) buffered; a vectored
 * WRITE goes direct only when every piece is aligned. The cache's buffers
 * are arena frames (4 KiB aligned), so writeback of 4 KiB cache blocks
 * always qualifies.
 *
 * Coherency between the two descriptors is the kernel's: a direct write
 * first writes back and then invalidates the page cache over its range
 * (filemap_write_and_wait_range, invalidate_inode_pages2_range), so a
 * buffered READ afterwards reads what the direct write put there, and a
 * buffered write completed before a direct one reaches the disk first.
 * Writes still in flight over the same bytes are never mixed: the cache
 * sends one write per block at a time (busy bits, direct ranges).
 *
 * Durability does not change: FLUSH stays an fdatasync of fd. fdatasync
 * is about the file (the inode), not the descriptor: it writes the dirty
 * pages, commits the metadata needed to read the data back (ext4, XFS:
 * the journal transaction that converted the extents a direct write
 * allocated or extended; that conversion is logged at the direct write's
 * completion) and sends the device a cache flush, which covers direct
 * writes that sit in a volatile write cache. A completed O_DIRECT write
 * by itself is not durable, so writeback data stays unstable until the
 * next FLUSH exactly as before. FUA writes add RWF_DSYNC on either
 * descriptor.
 */
#include "daemon/backend/backend.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include "daemon/log.h"

struct file_backend {
	struct backend base;
	int fd;
	int direct_fd;		/* O_DIRECT, or -1 */
	atomic_bool direct_ok;	/* cleared when the file system refuses a direct write */
	uint32_t dio_align;	/* direct_fd: offset and length alignment */
	uint32_t mem_align;	/* direct_fd: buffer address alignment */
	bool is_block_device;
	bool memory_backed; /* tmpfs / ramfs: synchronous I/O never waits for a disk */
	bool nowait;	    /* preadv2(RWF_NOWAIT) is supported */
};

/* Source for the write-zeroes fallback; never written. */
#define ZERO_CHUNK (1u << 20)
static char zero_chunk[ZERO_CHUNK];

/* backend_io.state: the SQE in flight went to direct_fd. */
#define FILE_IO_DIRECT 1u

enum zero_stage {
	ZERO_PUNCH,
	ZERO_RANGE,
	ZERO_PUNCH_THEN_ALLOC,
	ZERO_ALLOC,
	ZERO_WRITE,
	ZERO_SYNC,
};

static struct file_backend *to_file(struct backend *be)
{
	return (struct file_backend *)be;
}

static void file_op_complete(struct uring_op *op, int res);

static struct io_uring_sqe *sqe_for(struct backend_io *io)
{
	io->op.complete = file_op_complete;
	return uring_get_sqe(io->ring, &io->op);
}

static bool aligned(uint64_t v, uint32_t align)
{
	return (v & (align - 1)) == 0;
}

/*
 * How many bytes of a single-buffer write at (p, at, n) may go direct: the
 * whole of it, its aligned prefix, or 0.
 */
static unsigned direct_length(struct file_backend *fb, const char *p, uint64_t at, unsigned n)
{
	if (fb->direct_fd < 0 || !atomic_load_explicit(&fb->direct_ok, memory_order_relaxed) ||
	    !aligned(at, fb->dio_align) || !aligned((uintptr_t)p, fb->mem_align))
		return 0;
	return n & ~(fb->dio_align - 1);
}

/* May the vectored write at `at` go direct: is every piece aligned? */
static bool direct_vector(struct file_backend *fb, const struct iovec *iov, unsigned n,
			  uint64_t at)
{
	if (fb->direct_fd < 0 || !atomic_load_explicit(&fb->direct_ok, memory_order_relaxed) ||
	    !aligned(at, fb->dio_align))
		return false;
	for (unsigned i = 0; i < n; i++)
		if (!aligned((uintptr_t)iov[i].iov_base, fb->mem_align) ||
		    !aligned(iov[i].iov_len, fb->dio_align))
			return false;
	return true;
}

/* A short vectored write consumed n bytes: move io->iov past them. */
static void iov_advance(struct backend_io *io, uint64_t n)
{
	while (n && io->iovcnt) {
		if (n >= io->iov->iov_len) {
			n -= io->iov->iov_len;
			io->iov++;
			io->iovcnt--;
		} else {
			io->iov->iov_base = (char *)io->iov->iov_base + n;
			io->iov->iov_len -= (size_t)n;
			n = 0;
		}
	}
}

static void prep_rw(struct backend_io *io)
{
	struct file_backend *fb = to_file(io->backend);
	uint64_t left = io->length - io->progress;
	uint64_t at = io->offset + io->progress;
	unsigned n = left > (1u << 30) ? (1u << 30) : (unsigned)left;
	char *p = (char *)io->buf + io->progress;
	struct io_uring_sqe *sqe = sqe_for(io);
	io->state &= ~FILE_IO_DIRECT;
	if (io->cmd == BACKEND_READ) {
		io_uring_prep_read(sqe, fb->fd, p, n, at);
		return;
	}
	if (io->iovcnt) {
		bool direct = direct_vector(fb, io->iov, io->iovcnt, at);
		io_uring_prep_writev(sqe, direct ? fb->direct_fd : fb->fd, io->iov, io->iovcnt, at);
		if (direct)
			io->state |= FILE_IO_DIRECT;
	} else {
		unsigned dn = direct_length(fb, p, at, n);
		io_uring_prep_write(sqe, dn ? fb->direct_fd : fb->fd, p, dn ? dn : n, at);
		if (dn)
			io->state |= FILE_IO_DIRECT;
	}
	if (io->flags & BACKEND_FUA)
		sqe->rw_flags = RWF_DSYNC;
}

/*
 * A direct write failed with EINVAL: a file system that opened with
 * O_DIRECT but will not do it (or wants another alignment than it said).
 * Every later write goes through the page cache; this one is sent again
 * there. Said once.
 */
static void direct_refused(struct file_backend *fb)
{
	if (atomic_exchange(&fb->direct_ok, false))
		log_warn("file backend: the file system refused an O_DIRECT write (EINVAL); "
			 "writes go through the page cache from now on");
}

static void prep_fsync(struct backend_io *io)
{
	io_uring_prep_fsync(sqe_for(io), to_file(io->backend)->fd, IORING_FSYNC_DATASYNC);
}

static void prep_fallocate(struct backend_io *io, int mode)
{
	io_uring_prep_fallocate(sqe_for(io), to_file(io->backend)->fd, mode, (off_t)io->offset,
				(off_t)io->length);
}

static void prep_zero_write(struct backend_io *io)
{
	uint64_t left = io->length - io->progress;
	unsigned n = left > ZERO_CHUNK ? ZERO_CHUNK : (unsigned)left;
	io_uring_prep_write(sqe_for(io), to_file(io->backend)->fd, zero_chunk, n,
			    io->offset + io->progress);
}

static void zero_step(struct backend_io *io)
{
	switch (io->stage) {
	case ZERO_PUNCH:
	case ZERO_PUNCH_THEN_ALLOC:
		prep_fallocate(io, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE);
		break;
	case ZERO_RANGE:
		prep_fallocate(io, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE);
		break;
	case ZERO_ALLOC:
		prep_fallocate(io, FALLOC_FL_KEEP_SIZE);
		break;
	case ZERO_WRITE:
		prep_zero_write(io);
		break;
	case ZERO_SYNC:
		prep_fsync(io);
		break;
	}
}

static bool unsupported(int res)
{
	return res == -EOPNOTSUPP || res == -ENOTTY || res == -ENODEV || res == -EINVAL;
}

/* Decide the next rung of the WRITE_ZEROES ladder after a completion. */
static void zero_complete(struct backend_io *io, int res)
{
	bool fua = io->flags & BACKEND_FUA;
	switch (io->stage) {
	case ZERO_PUNCH:
		if (res == 0)
			goto finished;
		if (!unsupported(res))
			goto failed;
		io->stage = ZERO_RANGE;
		break;
	case ZERO_RANGE:
		if (res == 0)
			goto finished;
		if (!unsupported(res))
			goto failed;
		io->stage = (io->flags & BACKEND_NO_HOLE) ? ZERO_PUNCH_THEN_ALLOC : ZERO_WRITE;
		break;
	case ZERO_PUNCH_THEN_ALLOC:
		if (res == 0) {
			io->stage = ZERO_ALLOC;
			break;
		}
		if (!unsupported(res))
			goto failed;
		io->stage = ZERO_WRITE;
		break;
	case ZERO_ALLOC:
		if (res == 0)
			goto finished;
		/* The range reads as zeroes already; it just is not provisioned. */
		if (!unsupported(res))
			goto failed;
		goto finished;
	case ZERO_WRITE:
		if (res < 0)
			goto failed;
		if (res == 0) {
			res = -EIO;
			goto failed;
		}
		io->progress += (uint64_t)res;
		if (io->progress < io->length)
			break;
		goto finished;
	case ZERO_SYNC:
		io->done(io, res < 0 ? res : 0);
		return;
	}
	/*
	 * On a block device only the punch is known to be fast (the kernel
	 * zeroes without falling back to writes); its zero range may write
	 * zero pages by hand.
	 */
	bool slow = io->stage == ZERO_WRITE ||
		    (to_file(io->backend)->is_block_device && io->stage != ZERO_SYNC);
	if (slow && (io->flags & BACKEND_FAST_ONLY)) {
		io->done(io, -ENOTSUP);
		return;
	}
	zero_step(io);
	return;
finished:
	if (fua) {
		io->stage = ZERO_SYNC;
		zero_step(io);
		return;
	}
	io->done(io, 0);
	return;
failed:
	io->done(io, res);
}

static void file_op_complete(struct uring_op *op, int res)
{
	struct backend_io *io = (struct backend_io *)((char *)op - offsetof(struct backend_io, op));
	switch (io->cmd) {
	case BACKEND_READ:
	case BACKEND_WRITE:
		if (res == -EINTR || res == -EAGAIN) {
			prep_rw(io);
			return;
		}
		if (res == -EINVAL && (io->state & FILE_IO_DIRECT)) {
			direct_refused(to_file(io->backend));
			prep_rw(io);
			return;
		}
		if (res < 0) {
			io->done(io, res);
			return;
		}
		if (res == 0) {
			/* The file shrank under us, or the device refuses: not our data. */
			io->done(io, -EIO);
			return;
		}
		io->progress += (uint64_t)res;
		if (io->iovcnt)
			iov_advance(io, (uint64_t)res);
		if (io->progress < io->length) {
			prep_rw(io);
			return;
		}
		io->done(io, 0);
		return;
	case BACKEND_FLUSH:
		io->done(io, res < 0 ? res : 0);
		return;
	case BACKEND_TRIM:
		if (io->stage == 0) {
			/* TRIM is advisory: a file system without hole punching is fine. */
			if (res < 0 && !unsupported(res)) {
				io->done(io, res);
				return;
			}
			if (io->flags & BACKEND_FUA) {
				io->stage = 1;
				prep_fsync(io);
				return;
			}
			io->done(io, 0);
			return;
		}
		io->done(io, res < 0 ? res : 0);
		return;
	case BACKEND_ZERO:
		zero_complete(io, res);
		return;
	case BACKEND_CACHE:
	case BACKEND_BLOCK_STATUS:
		break;
	}
	io->done(io, -EIO);
}

/*
 * Extents from SEEK_DATA / SEEK_HOLE. The last extent may run past the
 * requested range (up to the end of the file), which the protocol allows and
 * the caller clips where it must.
 */
static int file_extents(struct file_backend *fb, struct backend_io *io)
{
	uint64_t size = fb->base.size;
	uint64_t pos = io->offset;
	uint64_t end = io->offset + io->length;
	if (end > size)
		end = size;
	io->n_extents = 0;
	while (pos < end && io->n_extents < io->max_extents) {
		struct nbd_extent *e = &io->extents[io->n_extents];
		off_t data = lseek(fb->fd, (off_t)pos, SEEK_DATA);
		if (data < 0) {
			if (errno != ENXIO) {
				/* No hole information: everything is data. */
				e->length = end - pos;
				e->flags = 0;
				io->n_extents++;
				break;
			}
			data = (off_t)size;
		}
		if ((uint64_t)data > pos) {
			e->length = ((uint64_t)data > size ? size : (uint64_t)data) - pos;
			e->flags = NBD_STATE_HOLE | NBD_STATE_ZERO;
			pos += e->length;
			io->n_extents++;
			continue;
		}
		off_t hole = lseek(fb->fd, (off_t)pos, SEEK_HOLE);
		if (hole < 0 || (uint64_t)hole > size)
			hole = (off_t)size;
		if ((uint64_t)hole <= pos)
			hole = (off_t)end;
		e->length = (uint64_t)hole - pos;
		e->flags = 0;
		pos = (uint64_t)hole;
		io->n_extents++;
	}
	return io->n_extents ? 0 : -EIO;
}

/*
 * Serve as much of a READ or WRITE as can be done without waiting: all of it
 * on a memory-backed file, the page-cached part of a READ elsewhere.
 * Returns 1 when the request is complete (or failed: io->done was called),
 * 0 when the rest must go to io_uring.
 */
static int file_rw_inline(struct file_backend *fb, struct backend_io *io)
{
	bool write = io->cmd == BACKEND_WRITE;
	if (!fb->memory_backed && (write || !fb->nowait))
		return 0;
	while (io->progress < io->length) {
		struct iovec iov = {(char *)io->buf + io->progress,
				    (size_t)(io->length - io->progress)};
		off_t at = (off_t)(io->offset + io->progress);
		ssize_t n;
		if (write && io->iovcnt)
			n = pwritev2(fb->fd, io->iov, (int)io->iovcnt, at, 0);
		else if (write)
			n = pwritev2(fb->fd, &iov, 1, at, 0);
		else
			n = preadv2(fb->fd, &iov, 1, at, fb->memory_backed ? 0 : RWF_NOWAIT);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EOPNOTSUPP) && !fb->memory_backed)
			return 0;
		if (n <= 0) {
			io->done(io, n < 0 ? -errno : -EIO);
			return 1;
		}
		io->progress += (uint64_t)n;
		if (write && io->iovcnt)
			iov_advance(io, (uint64_t)n);
		if (!fb->memory_backed && io->progress < io->length)
			return 0; /* partly cached: the ring reads the rest */
	}
	if (write && (io->flags & BACKEND_FUA) && fdatasync(fb->fd) < 0) {
		io->done(io, -errno);
		return 1;
	}
	io->done(io, 0);
	return 1;
}

static void file_submit(struct backend *be, struct backend_io *io)
{
	struct file_backend *fb = to_file(be);
	switch (io->cmd) {
	case BACKEND_READ:
	case BACKEND_WRITE:
		if (io->length == 0) {
			io->done(io, 0);
			return;
		}
		if (file_rw_inline(fb, io))
			return;
		prep_rw(io);
		return;
	case BACKEND_FLUSH:
		prep_fsync(io);
		return;
	case BACKEND_TRIM:
		if (io->length == 0 || !be->can_trim) {
			io->done(io, 0);
			return;
		}
		prep_fallocate(io, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE);
		return;
	case BACKEND_ZERO:
		if (io->length == 0) {
			io->done(io, 0);
			return;
		}
		io->stage = (io->flags & BACKEND_NO_HOLE) ? ZERO_RANGE : ZERO_PUNCH;
		if (fb->is_block_device && io->stage == ZERO_RANGE &&
		    (io->flags & BACKEND_FAST_ONLY)) {
			io->done(io, -ENOTSUP);
			return;
		}
		zero_step(io);
		return;
	case BACKEND_CACHE: {
		/* Advisory: start readahead of a bounded prefix, answer at once. */
		if (io->length == 0) { /* fadvise would take 0 as "to the end" */
			io->done(io, 0);
			return;
		}
		uint64_t n = io->length > (64u << 20) ? (64u << 20) : io->length;
		int rc = posix_fadvise(fb->fd, (off_t)io->offset, (off_t)n, POSIX_FADV_WILLNEED);
		io->done(io, -rc);
		return;
	}
	case BACKEND_BLOCK_STATUS:
		io->done(io, file_extents(fb, io));
		return;
	}
	io->done(io, -EINVAL);
}

static void file_close(struct backend *be)
{
	struct file_backend *fb = to_file(be);
	if (fb->direct_fd >= 0)
		close(fb->direct_fd);
	close(fb->fd);
	free(fb);
}

/* The file's or device's size now: st_size, or BLKGETSIZE64. */
static int file_probe_size(struct backend *be, uint64_t *size)
{
	struct file_backend *fb = to_file(be);
	if (fb->is_block_device)
		return ioctl(fb->fd, BLKGETSIZE64, size) < 0 ? -errno : 0;
	struct stat st;
	if (fstat(fb->fd, &st) < 0)
		return -errno;
	*size = (uint64_t)st.st_size;
	return 0;
}

/*
 * A regular file is cut or extended (the new bytes read as zeros); a block
 * device cannot be: it takes any size up to what it has (the export ends
 * earlier), and -ENOSPC past that.
 */
static int file_set_size(struct backend *be, uint64_t size, uint64_t *have)
{
	struct file_backend *fb = to_file(be);
	if (size > NBD_MAX_OFFSET)
		return -EFBIG;
	if (fb->is_block_device) {
		int rc = file_probe_size(be, have);
		return rc < 0 ? rc : size > *have ? -ENOSPC : 0;
	}
	if (be->readonly)
		return -EROFS;
	if (ftruncate(fb->fd, (off_t)size) < 0)
		return -errno;
	*have = size;
	return 0;
}

static const struct backend_ops file_ops = {
	.kind = "file",
	.submit = file_submit,
	.close = file_close,
	.probe_size = file_probe_size,
	.set_size = file_set_size,
};

/*
 * Open the O_DIRECT descriptor of a writable backend and learn its
 * alignment; leaves direct_fd at -1 (writes buffered, said once in the
 * log) when the file is memory or the file system refuses O_DIRECT.
 */
static void direct_open(struct file_backend *fb, const char *path, const struct stat *st)
{
	fb->direct_fd = -1;
	if (fb->memory_backed) {
		log_info("file backend %s: memory-backed file (tmpfs / ramfs): writes stay buffered, "
			 "no O_DIRECT",
			 path);
		return;
	}
	int fd = open(path, O_WRONLY | O_DIRECT | O_CLOEXEC);
	if (fd < 0) {
		log_info("file backend %s: O_DIRECT refused (%s): writes go through the page cache",
			 path, strerror(errno));
		return;
	}
	/* The same file, not one renamed into its place meanwhile. */
	struct stat dst;
	if (fstat(fd, &dst) < 0 || dst.st_dev != st->st_dev || dst.st_ino != st->st_ino ||
	    dst.st_rdev != st->st_rdev) {
		log_info("file backend %s: changed while opened: writes go through the page cache",
			 path);
		close(fd);
		return;
	}
	uint32_t dio = 0, mem = 0;
	if (fb->is_block_device) {
		int lbs = 0;
		if (ioctl(fd, BLKSSZGET, &lbs) == 0 && lbs > 0)
			dio = mem = (uint32_t)lbs;
	} else {
#ifdef STATX_DIOALIGN
		struct statx sx;
		if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
		    (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align) {
			dio = sx.stx_dio_offset_align;
			mem = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : dio;
			/* A direct write inside a file system block makes ext4 zero
			 * around it and serialise: keep to whole blocks. */
			if (st->st_blksize > 0 && (uint32_t)st->st_blksize > dio &&
			    st->st_blksize <= 65536)
				dio = (uint32_t)st->st_blksize;
		}
#endif
		if (dio == 0)
			dio = mem = 4096; /* safe for every file system that takes O_DIRECT */
	}
	/* Only powers of two up to 64 KiB make sense (the masks depend on it). */
	if (dio == 0 || (dio & (dio - 1)) || dio > 65536 || mem == 0 || (mem & (mem - 1)) ||
	    mem > 65536) {
		log_info("file backend %s: unusable O_DIRECT alignment %u / %u: writes go through "
			 "the page cache",
			 path, dio, mem);
		close(fd);
		return;
	}
	fb->direct_fd = fd;
	fb->dio_align = dio;
	fb->mem_align = mem;
	atomic_store(&fb->direct_ok, true);
	log_debug("file backend %s: aligned writes O_DIRECT (offset and length %u, memory %u)",
		  path, dio, mem);
}

int backend_file_open(const char *path, bool readonly, struct backend **out)
{
	int fd = open(path, (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	struct stat st;
	int rc;
	if (fstat(fd, &st) < 0) {
		rc = -errno;
		goto err;
	}
	struct file_backend *fb = calloc(1, sizeof(*fb));
	if (!fb) {
		rc = -ENOMEM;
		goto err;
	}
	fb->fd = fd;
	fb->base.ops = &file_ops;
	fb->base.readonly = readonly;
	fb->base.can_trim = true;
	fb->base.can_zero = true;
	fb->base.min_block = 1;
	/* Who it is, for a cache device's binding (daemon/cache/device.h). */
	fb->base.ident_dev = S_ISBLK(st.st_mode) ? (uint64_t)st.st_rdev : (uint64_t)st.st_dev;
	fb->base.ident_ino = S_ISBLK(st.st_mode) ? 0 : (uint64_t)st.st_ino;
	fb->base.ident_file = true;
	if (S_ISBLK(st.st_mode)) {
		uint64_t size;
		if (ioctl(fd, BLKGETSIZE64, &size) < 0) {
			rc = -errno;
			free(fb);
			goto err;
		}
		fb->base.size = size;
		fb->is_block_device = true;
	} else if (S_ISREG(st.st_mode)) {
		fb->base.size = (uint64_t)st.st_size;
		struct statfs sfs;
		/* f_type is an int on i386 and a long on amd64: compare 32 bits. */
		if (fstatfs(fd, &sfs) == 0 && ((uint32_t)sfs.f_type == TMPFS_MAGIC ||
					       (uint32_t)sfs.f_type == RAMFS_MAGIC))
			fb->memory_backed = true;
	} else {
		rc = -EINVAL;
		free(fb);
		goto err;
	}
	if (fb->base.size > NBD_MAX_OFFSET) {
		rc = -EFBIG;
		free(fb);
		goto err;
	}
	fb->base.takes_iovec = true;
	if (readonly)
		fb->direct_fd = -1;
	else
		direct_open(fb, path, &st);
	if (!fb->memory_backed) {
		/* Probe RWF_NOWAIT once: unsupported file systems say EOPNOTSUPP. */
		char probe;
		struct iovec iov = {&probe, 1};
		fb->nowait = preadv2(fd, &iov, 1, 0, RWF_NOWAIT) >= 0 || errno == EAGAIN;
	}
	*out = &fb->base;
	return 0;
err:
	close(fd);
	return rc;
}
