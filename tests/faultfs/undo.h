/*
 * tests/faultfs/undo.h: the undo log of one file or disk, the model of a
 * power cut in faultfs and in the nbdkit fault filter.
 *
 * Owns: the bytes a file held at its last successful fsync, for every
 * range written, punched or truncated away since then. Each byte range is
 * saved the first time it is touched after the fsync; later writes to it
 * save nothing more. Restoring writes the saved bytes back and truncates
 * the file to its size at the fsync: the file is then exactly what a power
 * cut would leave of it.
 *
 *   file:   |....AAAA......BBBBBBBB......|      size_at_sync
 *   ranges:      [old]       [old ][0]          sorted by offset, disjoint
 *                                   ^ saved as "was zero": no buffer
 *
 * Ranges that were all zero (holes, mostly) keep no buffer and are
 * restored by punching a hole. Saved bytes are bounded in total over every
 * log (UNDO_LIMIT_BYTES) and so is the number of ranges (UNDO_LIMIT_RANGES):
 * past either bound the log is marked overflowed, stops saving, and a
 * restore reports -EFBIG after restoring what it has.
 *
 * The log reaches its file through a struct undo_target: faultfs passes a
 * file descriptor's, the nbdkit filter the next layer's.
 *
 * Locking: none inside; the caller holds the file's lock around capture,
 * the modification it precedes, restore and clear. The global byte count
 * is atomic.
 */
#ifndef FAULTFS_UNDO_H
#define FAULTFS_UNDO_H

#include <stdbool.h>
#include <stdint.h>

#define UNDO_LIMIT_BYTES (256ull << 20)
#define UNDO_LIMIT_RANGES (1u << 20)

struct undo_range;

/* Where the bytes are. Each function returns 0 or -errno; pread gives
 * zeros past the end. */
struct undo_target {
	int (*pread)(struct undo_target *t, void *buf, uint64_t n, uint64_t offset);
	int (*pwrite)(struct undo_target *t, const void *buf, uint64_t n, uint64_t offset);
	/* Make the range read as zeros (a hole where possible); NULL: write
	 * zeros. */
	int (*zero)(struct undo_target *t, uint64_t n, uint64_t offset);
	int (*get_size)(struct undo_target *t, uint64_t *size);
	/* NULL: the size never changes. */
	int (*set_size)(struct undo_target *t, uint64_t size);
};

/* The target of a file descriptor, to be filled by undo_fd_target(). */
struct undo_fd_target {
	struct undo_target ops;
	int fd;
};

struct undo_target *undo_fd_target(struct undo_fd_target *t, int fd);

struct undo_log {
	bool active;		   /* something was saved since the last sync */
	bool overflow;		   /* a bound was hit: the log is incomplete */
	uint64_t size_at_sync;	   /* the file's size when the log started */
	struct undo_range *ranges; /* sorted by offset, disjoint */
	uint64_t bytes;		   /* bytes covered by ranges (zero ones too) */
	uint64_t count;		   /* number of ranges */
};

/* Save the bytes of [offset, offset + length) not saved yet; call
 * before modifying them. 0 or -errno (a failed read of the old bytes). */
int undo_capture(struct undo_log *log, struct undo_target *t, uint64_t offset, uint64_t length);

/* Save what truncating to new_size would drop. 0 or -errno. */
int undo_capture_truncate(struct undo_log *log, struct undo_target *t, uint64_t new_size);

/* Write every saved range back, truncate to size_at_sync, clear the log.
 * 0, -EFBIG when the log had overflowed (what it held is restored), or
 * -errno of a failed write. */
int undo_restore(struct undo_log *log, struct undo_target *t);

/* Forget the log: the file's current content is the synced one. */
void undo_clear(struct undo_log *log);

/* Buffered bytes of every log together (zero ranges not counted). */
uint64_t undo_total_bytes(void);

#endif
