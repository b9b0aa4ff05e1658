/*
 * tests/faultfs/faultfs.c: a passthrough FUSE file system that injects
 * storage faults, for tests.
 *
 *   faultfs SRCDIR MOUNTPOINT [FUSE options: -f, -d, -o ...]
 *
 * Every file and directory of SRCDIR shows at MOUNTPOINT. Data files are
 * opened with direct_io and without the kernel's writeback cache, so every
 * read, write, fsync and fallocate reaches faultfs and can be failed,
 * stalled or delayed (faults.h lists the modes). Writes are also logged
 * for undo since each file's last successful fsync (undo.h), so that
 * "power-loss" can put every file back where a power cut would leave it.
 *
 * The control file MOUNTPOINT/.faultfs (not listed by readdir) takes
 * commands, one per line, in one write:
 *
 *   ok | fail-read | fail-write | fail-fsync | fail-fsync-once |
 *   fail-all | stall            the fault mode (ok also sets delay-ms 0)
 *   delay-ms N                  every data operation sleeps N ms first
 *   fail-write-after N          the next N writes pass, then fail-write
 *   lose-on-fsync-error on|off  a failed fsync rolls the file back to its
 *                               last successful fsync (default on)
 *   power-loss                  roll every file back to its last
 *                               successful fsync (EFBIG: a log overflowed)
 *   reset-counters
 *
 * A command not understood fails the write with EINVAL. Reading the
 * control file gives one JSON object: the mode and settings, the counters
 * (reads, writes, bytes_written, fallocates, fsyncs_ok, fsyncs_failed,
 * ops_failed, rollbacks, power_losses, stalled, stall_timeouts) and what
 * the undo logs hold. The text is taken when the file is opened and after
 * each write to it, so reopen to see new values.
 *
 * Files: one struct data_file per source inode, found by (st_dev,
 * st_ino), holding one O_RDWR descriptor that every open of the file
 * shares (all I/O is positional) and the file's undo log. It outlives its
 * opens, so that a power-loss after the program under test has closed the
 * file still rolls it back; it is dropped when the file is unlinked.
 *
 * Locking: files_lock guards the list; each file's lock guards its undo
 * log together with the modification that follows a capture, and an
 * fsync with the clearing of the log. Order: files_lock, then a file's
 * lock. Stalls and delays happen in fault_gate(), before any lock.
 */
#define FUSE_USE_VERSION 35

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "tests/faultfs/faults.h"
#include "tests/faultfs/undo.h"

#define CONTROL_PATH "/.faultfs"
#define STATUS_MAX 2048

struct data_file {
	dev_t dev;
	ino_t ino;
	int fd;			      /* O_RDWR on the source file, shared by every open */
	struct undo_fd_target target; /* fd, for the undo log */
	unsigned opens;		      /* guarded by files_lock */
	bool detached;		      /* unlinked: no longer in the list */
	pthread_mutex_t lock;
	struct undo_log undo;
	struct data_file *next;
};

/* What fi->fh points to. */
struct handle {
	struct data_file *file; /* NULL: the control file */
	size_t len;		/* control file: the status text */
	char text[STATUS_MAX];
};

static int src_dirfd = -1;
static pthread_mutex_t files_lock = PTHREAD_MUTEX_INITIALIZER;
static struct data_file *files;

/* The path relative to SRCDIR. */
static const char *rel(const char *path)
{
	while (*path == '/')
		path++;
	return *path ? path : ".";
}

static bool is_control(const char *path)
{
	return path && strcmp(path, CONTROL_PATH) == 0;
}

static struct handle *handle_of(struct fuse_file_info *fi)
{
	return (struct handle *)(uintptr_t)fi->fh;
}

/* ---- data files ---- */

static void file_free(struct data_file *f)
{
	undo_clear(&f->undo);
	close(f->fd);
	pthread_mutex_destroy(&f->lock);
	free(f);
}

/* The data_file of the inode `fd` is open on, made when new; takes `fd`
 * (closed when the inode has one already). Counts an open. */
static int file_get(int fd, struct data_file **out)
{
	struct stat st;
	if (fstat(fd, &st) < 0) {
		int rc = -errno;
		close(fd);
		return rc;
	}
	pthread_mutex_lock(&files_lock);
	struct data_file *f = files;
	while (f && (f->dev != st.st_dev || f->ino != st.st_ino))
		f = f->next;
	if (f) {
		close(fd);
	} else {
		f = calloc(1, sizeof(*f));
		if (!f) {
			pthread_mutex_unlock(&files_lock);
			close(fd);
			return -ENOMEM;
		}
		f->dev = st.st_dev;
		f->ino = st.st_ino;
		f->fd = fd;
		undo_fd_target(&f->target, fd);
		pthread_mutex_init(&f->lock, NULL);
		f->next = files;
		files = f;
	}
	f->opens++;
	pthread_mutex_unlock(&files_lock);
	*out = f;
	return 0;
}

static void file_put(struct data_file *f)
{
	pthread_mutex_lock(&files_lock);
	bool gone = --f->opens == 0 && f->detached;
	pthread_mutex_unlock(&files_lock);
	if (gone)
		file_free(f);
}

/* The path is about to lose its last name: its inode number may be
 * reused, so the data_file leaves the list (freed with its last open). */
static void file_detach(const char *path)
{
	struct stat st;
	if (fstatat(src_dirfd, rel(path), &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode) ||
	    st.st_nlink > 1)
		return;
	pthread_mutex_lock(&files_lock);
	struct data_file *free_now = NULL;
	for (struct data_file **p = &files; *p; p = &(*p)->next) {
		struct data_file *f = *p;
		if (f->dev == st.st_dev && f->ino == st.st_ino) {
			*p = f->next;
			f->detached = true;
			if (f->opens == 0)
				free_now = f;
			break;
		}
	}
	pthread_mutex_unlock(&files_lock);
	if (free_now)
		file_free(free_now);
}

/* Every file back to its last successful fsync. 0 or the first error. */
static int power_loss_all(void)
{
	int rc = 0;
	pthread_mutex_lock(&files_lock);
	for (struct data_file *f = files; f; f = f->next) {
		pthread_mutex_lock(&f->lock);
		int e = undo_restore(&f->undo, &f->target.ops);
		pthread_mutex_unlock(&f->lock);
		if (e < 0 && rc == 0)
			rc = e;
	}
	pthread_mutex_unlock(&files_lock);
	fault_count(FAULT_POWER_LOSSES, 1);
	return rc;
}

static void status_text(struct handle *h)
{
	struct fault_undo_summary s = {0};
	pthread_mutex_lock(&files_lock);
	for (struct data_file *f = files; f; f = f->next) {
		pthread_mutex_lock(&f->lock);
		s.files += f->undo.active;
		s.bytes += f->undo.bytes;
		s.ranges += f->undo.count;
		s.overflow |= f->undo.overflow;
		pthread_mutex_unlock(&f->lock);
	}
	pthread_mutex_unlock(&files_lock);
	s.buffered_bytes = undo_total_bytes();
	h->len = fault_status(h->text, sizeof(h->text), &s);
}

/* Truncate a data file, its dropped tail saved for undo. */
static int file_truncate(struct data_file *f, off_t size)
{
	int rc = fault_gate(FAULT_OP_WRITE);
	if (rc < 0)
		return rc;
	pthread_mutex_lock(&f->lock);
	rc = undo_capture_truncate(&f->undo, &f->target.ops, (uint64_t)size);
	if (rc == 0 && ftruncate(f->fd, size) < 0)
		rc = -errno;
	pthread_mutex_unlock(&f->lock);
	return rc;
}

/* ---- FUSE operations ---- */

static void *ffs_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
	/* Every write must reach us: no page cache, no writeback cache. */
	conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
	cfg->direct_io = 1;
	cfg->kernel_cache = 0;
	cfg->auto_cache = 0;
	cfg->attr_timeout = 0;
	cfg->entry_timeout = 0;
	cfg->negative_timeout = 0;
	cfg->hard_remove = 1; /* I/O goes through the handle, never the path */
	cfg->use_ino = 1;
	return NULL;
}

static int ffs_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
	if (is_control(path)) {
		memset(st, 0, sizeof(*st));
		st->st_mode = S_IFREG | 0600;
		st->st_nlink = 1;
		st->st_uid = getuid();
		st->st_gid = getgid();
		st->st_size = 0;
		return 0;
	}
	if (fi && fi->fh && handle_of(fi)->file)
		return fstat(handle_of(fi)->file->fd, st) < 0 ? -errno : 0;
	if (!path)
		return -ESTALE;
	return fstatat(src_dirfd, rel(path), st, AT_SYMLINK_NOFOLLOW) < 0 ? -errno : 0;
}

static int ffs_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
		       struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	(void)offset;
	(void)fi;
	(void)flags;
	int fd = openat(src_dirfd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	DIR *d = fdopendir(fd);
	if (!d) {
		int rc = -errno;
		close(fd);
		return rc;
	}
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (filler(buf, e->d_name, NULL, 0, 0))
			break;
	}
	closedir(d);
	return 0;
}

static int ffs_mkdir(const char *path, mode_t mode)
{
	return mkdirat(src_dirfd, rel(path), mode) < 0 ? -errno : 0;
}

static int ffs_rmdir(const char *path)
{
	return unlinkat(src_dirfd, rel(path), AT_REMOVEDIR) < 0 ? -errno : 0;
}

static int ffs_unlink(const char *path)
{
	if (is_control(path))
		return -EPERM;
	file_detach(path);
	return unlinkat(src_dirfd, rel(path), 0) < 0 ? -errno : 0;
}

static int ffs_rename(const char *from, const char *to, unsigned int flags)
{
	if (is_control(from) || is_control(to))
		return -EPERM;
	if (flags)
		return -EINVAL;
	file_detach(to);
	return renameat(src_dirfd, rel(from), src_dirfd, rel(to)) < 0 ? -errno : 0;
}

static int ffs_chmod(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	(void)fi;
	if (is_control(path))
		return 0;
	return fchmodat(src_dirfd, rel(path), mode, 0) < 0 ? -errno : 0;
}

static int ffs_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi)
{
	(void)fi;
	if (is_control(path))
		return 0;
	return fchownat(src_dirfd, rel(path), uid, gid, AT_SYMLINK_NOFOLLOW) < 0 ? -errno : 0;
}

static int ffs_utimens(const char *path, const struct timespec tv[2], struct fuse_file_info *fi)
{
	(void)fi;
	if (is_control(path))
		return 0;
	return utimensat(src_dirfd, rel(path), tv, AT_SYMLINK_NOFOLLOW) < 0 ? -errno : 0;
}

static int ffs_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
	if (is_control(path))
		return 0;
	if (fi && fi->fh && handle_of(fi)->file)
		return file_truncate(handle_of(fi)->file, size);
	int fd = openat(src_dirfd, rel(path), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return -errno;
	struct data_file *f;
	int rc = file_get(fd, &f);
	if (rc < 0)
		return rc;
	rc = file_truncate(f, size);
	file_put(f);
	return rc;
}

/* A handle for the data file `fd` is open on (taken), or the error. */
static int open_data(int fd, struct fuse_file_info *fi)
{
	struct handle *h = calloc(1, offsetof(struct handle, text));
	if (!h) {
		close(fd);
		return -ENOMEM;
	}
	int rc = file_get(fd, &h->file);
	if (rc < 0) {
		free(h);
		return rc;
	}
	fi->fh = (uintptr_t)h;
	fi->direct_io = 1;
	fi->keep_cache = 0;
	return 0;
}

static int ffs_open(const char *path, struct fuse_file_info *fi)
{
	if (is_control(path)) {
		struct handle *h = calloc(1, sizeof(*h));
		if (!h)
			return -ENOMEM;
		status_text(h);
		fi->fh = (uintptr_t)h;
		fi->direct_io = 1;
		return 0;
	}
	int fd = openat(src_dirfd, rel(path), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0 && errno == EACCES && (fi->flags & O_ACCMODE) == O_RDONLY)
		fd = openat(src_dirfd, rel(path), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return -errno;
	int rc = open_data(fd, fi);
	if (rc == 0 && (fi->flags & O_TRUNC)) {
		rc = file_truncate(handle_of(fi)->file, 0);
		if (rc < 0) {
			file_put(handle_of(fi)->file);
			free(handle_of(fi));
		}
	}
	return rc;
}

static int ffs_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	if (is_control(path))
		return ffs_open(path, fi);
	int fd = openat(src_dirfd, rel(path),
			O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (fi->flags & O_EXCL), mode);
	if (fd < 0)
		return -errno;
	int rc = open_data(fd, fi);
	if (rc == 0 && (fi->flags & O_TRUNC)) {
		rc = file_truncate(handle_of(fi)->file, 0);
		if (rc < 0) {
			file_put(handle_of(fi)->file);
			free(handle_of(fi));
		}
	}
	return rc;
}

/*
 * An fsync of the file: fails as the mode says, and then (with
 * lose-on-fsync-error) rolls the file back as a kernel that drops its
 * dirty pages after a writeback error would leave it; else syncs the
 * source file and forgets the undo log.
 */
static int file_sync(struct data_file *f, bool datasync)
{
	int rc = fault_gate(FAULT_OP_FSYNC);
	if (rc < 0) {
		fault_count(FAULT_FSYNCS_FAILED, 1);
		if (fault_lose_on_fsync_error()) {
			pthread_mutex_lock(&f->lock);
			bool had = f->undo.active;
			undo_restore(&f->undo, &f->target.ops);
			pthread_mutex_unlock(&f->lock);
			if (had)
				fault_count(FAULT_ROLLBACKS, 1);
		}
		return rc;
	}
	pthread_mutex_lock(&f->lock);
	if ((datasync ? fdatasync(f->fd) : fsync(f->fd)) < 0)
		rc = -errno;
	else
		undo_clear(&f->undo);
	pthread_mutex_unlock(&f->lock);
	fault_count(rc < 0 ? FAULT_FSYNCS_FAILED : FAULT_FSYNCS_OK, 1);
	return rc;
}

static int ffs_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (!h->file)
		return 0;
	return file_sync(h->file, datasync);
}

static int ffs_read(const char *path, char *buf, size_t size, off_t offset,
		    struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (!h->file) {
		if ((uint64_t)offset >= h->len)
			return 0;
		size_t n = h->len - (size_t)offset < size ? h->len - (size_t)offset : size;
		memcpy(buf, h->text + offset, n);
		return (int)n;
	}
	int rc = fault_gate(FAULT_OP_READ);
	if (rc < 0)
		return rc;
	size_t done = 0;
	while (done < size) {
		ssize_t n = pread(h->file->fd, buf + done, size - done, offset + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			break;
		done += (size_t)n;
	}
	fault_count(FAULT_READS, 1);
	return (int)done;
}

static int ffs_write(const char *path, const char *buf, size_t size, off_t offset,
		     struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (!h->file) {
		bool power_loss = false;
		int rc = fault_command(buf, size, &power_loss);
		if (rc == 0 && power_loss)
			rc = power_loss_all();
		status_text(h);
		return rc < 0 ? rc : (int)size;
	}
	int rc = fault_gate(FAULT_OP_WRITE);
	if (rc < 0)
		return rc;
	struct data_file *f = h->file;
	pthread_mutex_lock(&f->lock);
	rc = undo_capture(&f->undo, &f->target.ops, (uint64_t)offset, size);
	size_t done = 0;
	while (rc == 0 && done < size) {
		ssize_t n = pwrite(f->fd, buf + done, size - done, offset + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			rc = n < 0 ? -errno : -EIO;
		else
			done += (size_t)n;
	}
	pthread_mutex_unlock(&f->lock);
	if (done == 0 && rc < 0)
		return rc;
	fault_count(FAULT_WRITES, 1);
	fault_count(FAULT_BYTES_WRITTEN, done);
	/* A direct write with O_DSYNC / RWF_DSYNC (FUA) brings no separate
	 * fsync: it is one here. Syncing the whole file is more than asked,
	 * which a disk may always do. */
	if (fi->flags & O_DSYNC) {
		rc = file_sync(f, (fi->flags & O_SYNC) != O_SYNC);
		if (rc < 0)
			return rc;
	}
	return (int)done;
}

static int ffs_fallocate(const char *path, int mode, off_t offset, off_t length,
			 struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (!h->file)
		return -EOPNOTSUPP;
	int rc = fault_gate(FAULT_OP_WRITE);
	if (rc < 0)
		return rc;
	struct data_file *f = h->file;
	pthread_mutex_lock(&f->lock);
	rc = undo_capture(&f->undo, &f->target.ops, (uint64_t)offset, (uint64_t)length);
	if (rc == 0 && fallocate(f->fd, mode, offset, length) < 0)
		rc = -errno;
	pthread_mutex_unlock(&f->lock);
	if (rc == 0)
		fault_count(FAULT_FALLOCATES, 1);
	return rc;
}

static off_t ffs_lseek(const char *path, off_t off, int whence, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (!h->file)
		return -ESPIPE;
	off_t r = lseek(h->file->fd, off, whence);
	return r < 0 ? -errno : r;
}

static int ffs_flush(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	(void)fi;
	return 0;
}

static int ffs_release(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = handle_of(fi);
	if (h->file)
		file_put(h->file);
	free(h);
	return 0;
}

static int ffs_statfs(const char *path, struct statvfs *st)
{
	(void)path;
	return fstatvfs(src_dirfd, st) < 0 ? -errno : 0;
}

static void ffs_destroy(void *data)
{
	(void)data;
	pthread_mutex_lock(&files_lock);
	struct data_file *f = files;
	files = NULL;
	pthread_mutex_unlock(&files_lock);
	while (f) {
		struct data_file *next = f->next;
		file_free(f);
		f = next;
	}
}

static const struct fuse_operations ffs_ops = {
    .init = ffs_init,
    .destroy = ffs_destroy,
    .getattr = ffs_getattr,
    .readdir = ffs_readdir,
    .mkdir = ffs_mkdir,
    .rmdir = ffs_rmdir,
    .unlink = ffs_unlink,
    .rename = ffs_rename,
    .chmod = ffs_chmod,
    .chown = ffs_chown,
    .utimens = ffs_utimens,
    .truncate = ffs_truncate,
    .open = ffs_open,
    .create = ffs_create,
    .read = ffs_read,
    .write = ffs_write,
    .fsync = ffs_fsync,
    .fallocate = ffs_fallocate,
    .lseek = ffs_lseek,
    .flush = ffs_flush,
    .release = ffs_release,
    .statfs = ffs_statfs,
};

int main(int argc, char **argv)
{
	if (argc < 3 || argv[1][0] == '-') {
		fprintf(stderr, "usage: %s SRCDIR MOUNTPOINT [FUSE options]\n", argv[0]);
		return 2;
	}
	src_dirfd = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (src_dirfd < 0) {
		fprintf(stderr, "faultfs: %s: %s\n", argv[1], strerror(errno));
		return 1;
	}
	/*
	 * Stalled operations each hold a FUSE thread: allow plenty, so that
	 * the write to the control file that ends a stall finds one.
	 */
	char **fargv = calloc((size_t)argc + 3, sizeof(*fargv));
	if (!fargv)
		return 1;
	int n = 0;
	fargv[n++] = argv[0];
	fargv[n++] = argv[2];
	fargv[n++] = "-o";
	fargv[n++] = "fsname=faultfs,subtype=faultfs,max_threads=256,max_idle_threads=16";
	for (int i = 3; i < argc; i++)
		fargv[n++] = argv[i];
	int rc = fuse_main(n, fargv, &ffs_ops, NULL);
	free(fargv);
	close(src_dirfd);
	return rc;
}
