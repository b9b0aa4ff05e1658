/*
 * tests/nbdkit-fault/fault-filter.c: an nbdkit filter that fails or
 * stalls NBD commands while a file says so, for tests.
 *
 *   nbdkit --filter=.../nbdkit-fault-filter.so PLUGIN ... fault-file=PATH
 *          [drop-unflushed=true]
 *
 * Before every command the filter reads PATH (at most 256 bytes; a
 * missing file means no faults). Its words, separated by spaces, commas
 * or newlines:
 *
 *   read write flush trim zero extents cache   fail that command with EIO
 *   all                                        fail every command
 *   stall                                      hold every command until
 *                                              the file no longer says so
 *                                              (polled every 10 ms; EIO
 *                                              after 120 s)
 *
 * A write, trim or zero with FUA also fails while "flush" is set: it
 * could not be made durable. nbdkit 1.32's own error filter cannot fail
 * FLUSH, hence this filter. An unknown word fails every command (and is
 * logged), so that a typo cannot pass for "no faults".
 *
 * drop-unflushed=true keeps an undo log (tests/faultfs/undo.h) of every
 * write, trim and zero since the last successful flush, and a flush that
 * this filter fails first writes the old bytes back: what the backend had
 * acknowledged but not flushed is lost, as after a power cut, and a client
 * that wrongly believes it durable finds out. A successful flush clears
 * the log; so does a successful FUA write (the filter flushes everything
 * after it, which a disk may always do). Writes are serialized with the
 * log's lock while drop-unflushed is on.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nbdkit-filter.h>

#include "tests/faultfs/undo.h"

#define STALL_SECONDS 120
#define STALL_POLL_NS (10 * 1000 * 1000L)
#define CHUNK (32u << 20) /* bytes per request of the undo log's own I/O */

enum fault_bits {
	F_READ = 1 << 0,
	F_WRITE = 1 << 1,
	F_FLUSH = 1 << 2,
	F_TRIM = 1 << 3,
	F_ZERO = 1 << 4,
	F_EXTENTS = 1 << 5,
	F_CACHE = 1 << 6,
	F_ALL = (1 << 7) - 1,
	F_STALL = 1 << 7,
};

static const struct {
	const char *word;
	unsigned bits;
} words[] = {
    {"read", F_READ},	{"write", F_WRITE}, {"flush", F_FLUSH},
    {"trim", F_TRIM},	{"zero", F_ZERO},   {"extents", F_EXTENTS},
    {"cache", F_CACHE}, {"all", F_ALL},	    {"stall", F_STALL},
};

static char *fault_file;
static bool drop_unflushed;

/* The undo log of the whole disk, shared by every connection. */
static pthread_mutex_t undo_lock = PTHREAD_MUTEX_INITIALIZER;
static struct undo_log undo;

/* The faults the file asks for now. */
static unsigned current_faults(void)
{
	char buf[257];
	int fd = open(fault_file, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	unsigned bits = 0;
	char *save = NULL;
	for (char *w = strtok_r(buf, " ,\t\r\n", &save); w; w = strtok_r(NULL, " ,\t\r\n", &save)) {
		size_t i = 0;
		while (i < sizeof(words) / sizeof(words[0]) && strcmp(w, words[i].word) != 0)
			i++;
		if (i == sizeof(words) / sizeof(words[0])) {
			nbdkit_error("fault filter: unknown word '%s' in %s: failing everything", w,
				     fault_file);
			bits |= F_ALL;
		} else {
			bits |= words[i].bits;
		}
	}
	return bits;
}

/* Wait out a stall, then 0 to go ahead or -1 with *err = EIO. `bit` is
 * the command's; fua: the command carries NBDKIT_FLAG_FUA. */
static int gate(unsigned bit, uint32_t flags, const char *what, int *err)
{
	unsigned f = current_faults();
	struct timespec start, now;
	clock_gettime(CLOCK_MONOTONIC, &start);
	for (long polls = 0; (f & F_STALL) && polls < STALL_SECONDS * 200L; polls++) {
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec - start.tv_sec >= STALL_SECONDS)
			break;
		struct timespec ts = {0, STALL_POLL_NS};
		nanosleep(&ts, NULL);
		f = current_faults();
	}
	bool fua = (flags & NBDKIT_FLAG_FUA) && (f & F_FLUSH);
	if ((f & F_STALL) || (f & bit) || fua) {
		nbdkit_debug("fault filter: %s fails with EIO%s", what,
			     (f & F_STALL) ? " (stalled too long)" : "");
		*err = EIO;
		return -1;
	}
	return 0;
}

/* ---- the undo log's view of the next layer ---- */

struct next_target {
	struct undo_target ops;
	nbdkit_next *next;
};

static nbdkit_next *next_of(struct undo_target *t)
{
	return ((struct next_target *)t)->next;
}

static int next_pread(struct undo_target *t, void *buf, uint64_t n, uint64_t offset)
{
	int err = 0;
	for (uint64_t done = 0; done < n;) {
		uint32_t c = n - done > CHUNK ? CHUNK : (uint32_t)(n - done);
		if (next_of(t)->pread(next_of(t), (char *)buf + done, c, offset + done, 0, &err) <
		    0)
			return -(err ? err : EIO);
		done += c;
	}
	return 0;
}

static int next_pwrite(struct undo_target *t, const void *buf, uint64_t n, uint64_t offset)
{
	int err = 0;
	for (uint64_t done = 0; done < n;) {
		uint32_t c = n - done > CHUNK ? CHUNK : (uint32_t)(n - done);
		if (next_of(t)->pwrite(next_of(t), (const char *)buf + done, c, offset + done, 0,
				       &err) < 0)
			return -(err ? err : EIO);
		done += c;
	}
	return 0;
}

static int next_zero(struct undo_target *t, uint64_t n, uint64_t offset)
{
	int err = 0;
	if (next_of(t)->can_zero(next_of(t)) <= NBDKIT_ZERO_NONE)
		return -EOPNOTSUPP;
	for (uint64_t done = 0; done < n;) {
		uint32_t c = n - done > CHUNK ? CHUNK : (uint32_t)(n - done);
		if (next_of(t)->zero(next_of(t), c, offset + done, NBDKIT_FLAG_MAY_TRIM, &err) < 0)
			return -(err ? err : EIO);
		done += c;
	}
	return 0;
}

static int next_get_size(struct undo_target *t, uint64_t *size)
{
	int64_t s = next_of(t)->get_size(next_of(t));
	if (s < 0)
		return -EIO;
	*size = (uint64_t)s;
	return 0;
}

static struct undo_target *target_of(struct next_target *t, nbdkit_next *next)
{
	t->ops.pread = next_pread;
	t->ops.pwrite = next_pwrite;
	t->ops.zero = next_zero;
	t->ops.get_size = next_get_size;
	t->ops.set_size = NULL;
	t->next = next;
	return &t->ops;
}

/* Save the old bytes of a range about to change. Lock held. */
static int capture(nbdkit_next *next, uint32_t count, uint64_t offset, int *err)
{
	struct next_target t;
	int rc = undo_capture(&undo, target_of(&t, next), offset, count);
	if (rc < 0) {
		nbdkit_error("fault filter: saving old bytes for undo: %s", strerror(-rc));
		*err = -rc;
		return -1;
	}
	return 0;
}

/* After a successful FUA command: everything becomes durable. Lock held. */
static int flush_all(nbdkit_next *next, int *err)
{
	if (next->flush(next, 0, err) < 0)
		return -1;
	undo_clear(&undo);
	return 0;
}

/* ---- configuration ---- */

static int fault_config(nbdkit_next_config *next, nbdkit_backend *nxdata, const char *key,
			const char *value)
{
	if (strcmp(key, "fault-file") == 0) {
		free(fault_file);
		fault_file = nbdkit_absolute_path(value);
		return fault_file ? 0 : -1;
	}
	if (strcmp(key, "drop-unflushed") == 0) {
		int b = nbdkit_parse_bool(value);
		if (b < 0)
			return -1;
		drop_unflushed = b;
		return 0;
	}
	return next(nxdata, key, value);
}

static int fault_config_complete(nbdkit_next_config_complete *next, nbdkit_backend *nxdata)
{
	if (!fault_file) {
		nbdkit_error("fault filter: fault-file=PATH is required");
		return -1;
	}
	return next(nxdata);
}

static void fault_unload(void)
{
	undo_clear(&undo);
	free(fault_file);
}

/* ---- commands ---- */

static int fault_pread(nbdkit_next *next, void *handle, void *buf, uint32_t count, uint64_t offset,
		       uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_READ, flags, "read", err) < 0)
		return -1;
	return next->pread(next, buf, count, offset, flags, err);
}

/* A write, trim or zero: through the undo log when drop-unflushed is on. */
static int modify(nbdkit_next *next, uint32_t count, uint64_t offset, uint32_t flags, int *err,
		  int (*op)(nbdkit_next *, const void *, uint32_t, uint64_t, uint32_t, int *),
		  const void *buf)
{
	if (!drop_unflushed)
		return op(next, buf, count, offset, flags, err);
	pthread_mutex_lock(&undo_lock);
	int rc = capture(next, count, offset, err);
	if (rc == 0)
		rc = op(next, buf, count, offset, flags & ~NBDKIT_FLAG_FUA, err);
	if (rc == 0 && (flags & NBDKIT_FLAG_FUA))
		rc = flush_all(next, err);
	pthread_mutex_unlock(&undo_lock);
	return rc;
}

static int do_pwrite(nbdkit_next *next, const void *buf, uint32_t count, uint64_t offset,
		     uint32_t flags, int *err)
{
	return next->pwrite(next, buf, count, offset, flags, err);
}

static int do_trim(nbdkit_next *next, const void *buf, uint32_t count, uint64_t offset,
		   uint32_t flags, int *err)
{
	(void)buf;
	return next->trim(next, count, offset, flags, err);
}

static int do_zero(nbdkit_next *next, const void *buf, uint32_t count, uint64_t offset,
		   uint32_t flags, int *err)
{
	(void)buf;
	return next->zero(next, count, offset, flags, err);
}

static int fault_pwrite(nbdkit_next *next, void *handle, const void *buf, uint32_t count,
			uint64_t offset, uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_WRITE, flags, "write", err) < 0)
		return -1;
	return modify(next, count, offset, flags, err, do_pwrite, buf);
}

static int fault_trim(nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
		      uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_TRIM, flags, "trim", err) < 0)
		return -1;
	return modify(next, count, offset, flags, err, do_trim, NULL);
}

static int fault_zero(nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
		      uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_ZERO, flags, "zero", err) < 0)
		return -1;
	return modify(next, count, offset, flags, err, do_zero, NULL);
}

static int fault_flush(nbdkit_next *next, void *handle, uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_FLUSH, flags, "flush", err) < 0) {
		if (drop_unflushed) {
			struct next_target t;
			pthread_mutex_lock(&undo_lock);
			int rc = undo_restore(&undo, target_of(&t, next));
			pthread_mutex_unlock(&undo_lock);
			if (rc < 0)
				nbdkit_error("fault filter: dropping unflushed data: %s",
					     strerror(-rc));
		}
		return -1;
	}
	if (!drop_unflushed)
		return next->flush(next, flags, err);
	pthread_mutex_lock(&undo_lock);
	int rc = flush_all(next, err);
	pthread_mutex_unlock(&undo_lock);
	return rc;
}

static int fault_extents(nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
			 uint32_t flags, struct nbdkit_extents *extents, int *err)
{
	(void)handle;
	if (gate(F_EXTENTS, flags, "extents", err) < 0)
		return -1;
	return next->extents(next, count, offset, flags, extents, err);
}

static int fault_cache(nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
		       uint32_t flags, int *err)
{
	(void)handle;
	if (gate(F_CACHE, flags, "cache", err) < 0)
		return -1;
	return next->cache(next, count, offset, flags, err);
}

static struct nbdkit_filter filter = {
    .name = "fault",
    .longname = "nbdcached test fault filter",
    .config = fault_config,
    .config_complete = fault_config_complete,
    .config_help = "fault-file=PATH       File naming the commands to fail (or stall).\n"
		   "drop-unflushed=BOOL  A failed flush loses unflushed writes.",
    .unload = fault_unload,
    .pread = fault_pread,
    .pwrite = fault_pwrite,
    .flush = fault_flush,
    .trim = fault_trim,
    .zero = fault_zero,
    .extents = fault_extents,
    .cache = fault_cache,
};

/* nbdkit's macro defines filter_init without a prototype (clang's
 * -Wmissing-prototypes): declare it. */
struct nbdkit_filter *filter_init(void);
NBDKIT_REGISTER_FILTER(filter)
