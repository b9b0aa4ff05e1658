/*
 * tests/faultfs/undo.c: the undo log of one file (see undo.h).
 *
 * A capture walks the sorted range list once, saving only the gaps between
 * ranges already saved, in pieces of at most UNDO_PIECE bytes so that an
 * all-zero piece (a hole, usually) can be kept as "was zero" without a
 * buffer even when its neighbours hold data.
 */
#include "tests/faultfs/undo.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define UNDO_PIECE (64u << 10)

struct undo_range {
	uint64_t offset;
	uint64_t length;
	unsigned char *old; /* NULL: the range read as zeros */
	struct undo_range *next;
};

static atomic_uint_fast64_t total_bytes;

uint64_t undo_total_bytes(void)
{
	return (uint64_t)atomic_load(&total_bytes);
}

static bool all_zero(const unsigned char *p, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		if (p[i])
			return false;
	return true;
}

/* ---- the target of a file descriptor ---- */

static int fd_of(struct undo_target *t)
{
	return ((struct undo_fd_target *)t)->fd;
}

static int fd_pread(struct undo_target *t, void *buf, uint64_t n, uint64_t offset)
{
	uint64_t done = 0;
	while (done < n) {
		ssize_t r =
		    pread(fd_of(t), (char *)buf + done, (size_t)(n - done), (off_t)(offset + done));
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0) {
			memset((char *)buf + done, 0, (size_t)(n - done));
			return 0;
		}
		done += (uint64_t)r;
	}
	return 0;
}

static int fd_pwrite(struct undo_target *t, const void *buf, uint64_t n, uint64_t offset)
{
	uint64_t done = 0;
	while (done < n) {
		ssize_t r = pwrite(fd_of(t), (const char *)buf + done, (size_t)(n - done),
				   (off_t)(offset + done));
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return -EIO;
		done += (uint64_t)r;
	}
	return 0;
}

static int fd_zero(struct undo_target *t, uint64_t n, uint64_t offset)
{
	if (fallocate(fd_of(t), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset,
		      (off_t)n) == 0)
		return 0;
	return -errno;
}

static int fd_get_size(struct undo_target *t, uint64_t *size)
{
	struct stat st;
	if (fstat(fd_of(t), &st) < 0)
		return -errno;
	*size = (uint64_t)st.st_size;
	return 0;
}

static int fd_set_size(struct undo_target *t, uint64_t size)
{
	return ftruncate(fd_of(t), (off_t)size) < 0 ? -errno : 0;
}

struct undo_target *undo_fd_target(struct undo_fd_target *t, int fd)
{
	t->ops.pread = fd_pread;
	t->ops.pwrite = fd_pwrite;
	t->ops.zero = fd_zero;
	t->ops.get_size = fd_get_size;
	t->ops.set_size = fd_set_size;
	t->fd = fd;
	return &t->ops;
}

/* ---- the log ---- */

static int start(struct undo_log *log, struct undo_target *t)
{
	if (log->active)
		return 0;
	int rc = t->get_size(t, &log->size_at_sync);
	if (rc < 0)
		return rc;
	log->active = true;
	return 0;
}

/* Save [offset, offset + n) as a new range inserted at *link; *link is
 * advanced past it. */
static int save_piece(struct undo_log *log, struct undo_target *t, uint64_t offset, uint64_t n,
		      struct undo_range ***link)
{
	if (log->count >= UNDO_LIMIT_RANGES || undo_total_bytes() + n > UNDO_LIMIT_BYTES) {
		log->overflow = true;
		return 0;
	}
	struct undo_range *r = calloc(1, sizeof(*r));
	unsigned char *buf = malloc((size_t)n);
	int rc = -ENOMEM;
	if (!r || !buf)
		goto err;
	rc = t->pread(t, buf, n, offset);
	if (rc < 0)
		goto err;
	if (all_zero(buf, n)) {
		free(buf);
		buf = NULL;
	} else {
		atomic_fetch_add(&total_bytes, n);
	}
	r->offset = offset;
	r->length = n;
	r->old = buf;
	r->next = **link;
	**link = r;
	*link = &r->next;
	log->bytes += n;
	log->count++;
	return 0;
err:
	free(buf);
	free(r);
	return rc;
}

int undo_capture(struct undo_log *log, struct undo_target *t, uint64_t offset, uint64_t length)
{
	int rc = start(log, t);
	if (rc < 0)
		return rc;
	/* Bytes past the synced size vanish with the truncate of a restore. */
	uint64_t end = offset + length;
	if (end > log->size_at_sync || end < offset)
		end = log->size_at_sync;
	uint64_t pos = offset;
	struct undo_range **link = &log->ranges;
	while (pos < end && !log->overflow) {
		while (*link && (*link)->offset + (*link)->length <= pos)
			link = &(*link)->next;
		struct undo_range *next = *link;
		if (next && next->offset <= pos) {
			pos = next->offset + next->length;
			continue;
		}
		uint64_t gap_end = next && next->offset < end ? next->offset : end;
		while (pos < gap_end && !log->overflow) {
			uint64_t n = UNDO_PIECE - pos % UNDO_PIECE;
			if (n > gap_end - pos)
				n = gap_end - pos;
			rc = save_piece(log, t, pos, n, &link);
			if (rc < 0)
				return rc;
			pos += n;
		}
	}
	return 0;
}

int undo_capture_truncate(struct undo_log *log, struct undo_target *t, uint64_t new_size)
{
	uint64_t size;
	int rc = t->get_size(t, &size);
	if (rc < 0)
		return rc;
	if (size <= new_size)
		return start(log, t);
	return undo_capture(log, t, new_size, size - new_size);
}

/* Make [offset, offset + n) read as zeros again. */
static int restore_zero(struct undo_target *t, uint64_t offset, uint64_t n)
{
	if (t->zero) {
		int rc = t->zero(t, n, offset);
		if (rc != -EOPNOTSUPP && rc != -ENOTSUP)
			return rc;
	}
	unsigned char *zeros = calloc(1, (size_t)n);
	if (!zeros)
		return -ENOMEM;
	int rc = t->pwrite(t, zeros, n, offset);
	free(zeros);
	return rc;
}

int undo_restore(struct undo_log *log, struct undo_target *t)
{
	int rc = 0;
	if (!log->active)
		return 0;
	for (struct undo_range *r = log->ranges; r; r = r->next) {
		int e = r->old ? t->pwrite(t, r->old, r->length, r->offset)
			       : restore_zero(t, r->offset, r->length);
		if (e < 0 && rc == 0)
			rc = e;
	}
	uint64_t size;
	if (t->set_size && t->get_size(t, &size) == 0 && size != log->size_at_sync) {
		int e = t->set_size(t, log->size_at_sync);
		if (e < 0 && rc == 0)
			rc = e;
	}
	if (rc == 0 && log->overflow)
		rc = -EFBIG;
	undo_clear(log);
	return rc;
}

void undo_clear(struct undo_log *log)
{
	struct undo_range *r = log->ranges;
	while (r) {
		struct undo_range *next = r->next;
		if (r->old)
			atomic_fetch_sub(&total_bytes, r->length);
		free(r->old);
		free(r);
		r = next;
	}
	log->ranges = NULL;
	log->active = false;
	log->overflow = false;
	log->bytes = 0;
	log->count = 0;
	log->size_at_sync = 0;
}
