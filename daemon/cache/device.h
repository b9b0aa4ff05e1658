/*
 * daemon/cache/device.h: a cache device (--cache-device PATH), a file or
 * block device holding the intent log: a FLUSH or a FUA write is answered
 * once every write it covers is durable there, not on the backend (the
 * on-device format: device_format.h).
 *
 * The log is a redo log of what the cache acknowledged since the last
 * checkpoint, in the order the cache's state changed:
 *
 *   DATA  a FLUSH's round copies every dirty or unstable block of its
 *         export (flush.c, under the block's shard lock), a direct WRITE
 *         its payload (direct.c, while its range is registered)
 *   ZERO, TRIM  a direct WRITE_ZEROES or TRIM step (direct.c, likewise)
 *
 * Each record gets a number (its rec) as it is appended; the log thread
 * commits what was appended in batches (group commit: one write and one
 * device flush for every FLUSH that came meanwhile) and raises `durable`,
 * the rec up to which every record is durable. A waiter (FLUSH, a FUA
 * direct operation) waits for durable >= its rec.
 *
 * A checkpoint moves the log's tail: after a full flush round of an export
 * (every dirty block written back, the backend flushed) the records
 * appended before the round began are covered by the backend
 * (cache_device_covered); once every export is, the batches holding only
 * such records are no longer needed, the superblock says where replay
 * starts now, and records not yet committed are dropped. `durable` rises
 * to what the checkpoint covers, so a waiter is answered by a commit or by
 * a checkpoint, whichever comes first.
 *
 * At start (cache_device_bind, before anything is served): the live log
 * (from the checkpoint to its first bad batch) is found from the batch
 * headers, reading the data only of the batches after the last committed
 * mark (those a crash may have torn); every export it holds records for
 * must be configured with the same backend identity (not its size: a
 * resize is replayed up to the end the backend has now), or the start is
 * refused with the export and the bytes. cache_device_start then plans,
 * from the headers alone, the newest record over every byte (the pieces),
 * and serves at once: those bytes are dirty, held in the log, and a
 * drain thread writes them to the backends in the background, in log
 * order. Until a piece is on its backend, every backend request of the
 * cache that touches it waits (cache_device_gate; the drain takes its
 * batch first), and a backend FLUSH of its export waits for all of the
 * export's. The live log stays in the ring until the drain is done (no
 * checkpoint covers anything meanwhile: a checkpoint waiter waits for
 * the drain); new batches follow it, the first marked as an epoch, with
 * sequence numbers past any stale batch on the device.
 *
 * Failures: a write or flush of the device that fails answers the log
 * rounds' waiters -EIO and turns the log off for good
 * (cache_device_usable false: FLUSH goes to the backend again); every
 * other waiter (a full round's, a FUA operation's) waits until the log
 * is emptied on the device (voided: full rounds of every export, then a
 * checkpoint past every batch a failed commit attempted), or gets -EIO
 * while that superblock cannot be written. A log without room answers waiters
 * that can go another way -ENOSPC (a FLUSH round writes back instead) and
 * asks for a checkpoint (cache_device_wants_checkpoint).
 *
 * Locks: the device lock is a leaf, taken under a shard lock (append) or
 * an export lock; the log thread takes nothing else while holding it.
 */
#ifndef NBDCACHED_DAEMON_CACHE_DEVICE_H
#define NBDCACHED_DAEMON_CACHE_DEVICE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/cache/device_format.h"
#include "daemon/worker.h"

struct backend;
struct cache_device;

/* Someone waiting for records to be durable (cache_device_wait). */
struct cache_device_waiter {
	uint64_t rec;  /* durable >= rec */
	bool fallback; /* -ENOSPC rather than wait when there is no room */
	/* Wait for a checkpoint that covers rec, not for a commit: a full
	 * round's FLUSH (no record up to rec may be replayed any more). */
	bool checkpoint;
	int result;	       /* 0, -EIO (device failed), -ENOSPC (fallback only) */
	/* A failed device: the attempts to empty its log begun before this
	 * waiter came (their failure does not answer it; device_log.c). */
	uint64_t void_after;
	struct worker *worker; /* task posted there with the result */
	struct worker_task task;
	struct cache_device_waiter *next;
};

/* What the device is used for (cache-device-use). */
#define CACHE_DEVICE_USE_LOG 1u
#define CACHE_DEVICE_USE_L2 2u

struct cache_device_stats {
	bool attached, failed, detaching, detached;
	unsigned use;
	/* The level-2 cache: its area, pages in use and staged, fills it
	 * served (hits) and could not (misses), reads that found a page
	 * rewritten meanwhile (stale) or failed, pages written, left out
	 * (staging full), written over by clients, read back at start. */
	bool l2_on, l2_failed;
	uint64_t l2_bytes, l2_used, l2_staged;
	uint64_t l2_hits, l2_hit_bytes, l2_misses, l2_stale, l2_read_errors, l2_checksum_errors;
	/* Fills sent to the backend as it answers faster; the average cost of
	 * a small read from the area, ns. */
	uint64_t l2_skipped, l2_small_read_ns;
	uint64_t l2_stored_bytes, l2_dropped_bytes, l2_invalidated_bytes;
	uint64_t l2_loaded_bytes, l2_load_ns, l2_write_ns;
	/* Writes of its map on the device (each ends with a device flush) and
	 * their time, ns. */
	uint64_t l2_map_writes, l2_map_ns;
	/* Bytes the ring wrote that the map does not claim yet. */
	uint64_t l2_map_pending;
	uint64_t device_bytes, log_bytes, log_used;
	uint64_t commits, commit_ns, commit_max_ns, records, bytes_logged;
	/* FLUSH rounds that went to the log, and the entries they visited
	 * (those written since the round before). */
	uint64_t log_rounds, log_round_entries;
	uint64_t checkpoints, fallbacks;
	/* The live log found at start: its batches, records and bytes of
	 * data, the time to find and plan it (before serving); then the bytes
	 * (data, zeros, trims) not yet written back, those written back,
	 * those lost (a committed batch whose data no longer checks), the
	 * time that took (0 until done) and the requests that waited for it. */
	uint64_t replay_batches, replay_records, replay_bytes, replay_ns;
	uint64_t replay_pending_bytes, replay_drained_bytes, replay_lost_bytes, replay_drain_ns;
	uint64_t replay_waits;
	uint64_t pending_bytes;
	int64_t last_commit_unix_ms;
};

/*
 * Open path (a file or block device of at least DEVFMT_MIN_DEVICE bytes),
 * used for use (CACHE_DEVICE_USE_*: without the log, FLUSH goes to the
 * backend; without the level-2 cache, evictions are dropped; a device
 * formatted without a level-2 area has none, said at start):
 * its superblock, the newer valid copy; a device whose two copies are all
 * zeros is formatted. 0, or -errno with err saying why (not a cache
 * device, another version, both copies corrupt, another geometry).
 * wait_ms: a device this process's parent holds is waited for that long
 * (a live upgrade's new daemon, until the old one releases it), not
 * refused; any other holder is.
 */
int cache_device_open(const char *path, unsigned use, unsigned wait_ms,
		      struct cache_device **out, char *err, size_t len);
/* Exports (names, commas between) whose records are thrown away at bind,
 * logged, rather than refused (cache-device-discard-dirty); NULL: none. */
int cache_device_discard(struct cache_device *d, const char *names);
/*
 * --check-config: what a start with this device and these options would
 * do, without writing it or opening a backend (a file's identity is
 * stat()ed; another backend's size is not compared). 0 and text saying
 * what would be replayed (or formatted), or -errno and text saying why
 * the start would be refused.
 */
struct options;
int cache_device_check(const char *path, const struct options *opts, char *text, size_t len);
/*
 * An export as the device knows it. The device never sees the cache
 * index: an export is the slot cache_device_add_export gives it, and what
 * the device needs of it is given here, once.
 */
struct cache_device_member {
	const char *name, *backend_spec;
	struct backend *backend; /* the drain writes the live log through it */
	uint64_t size;
	uint32_t block_size;
	/* Its cache-device-warm all: a start may use its level-2 pages though
	 * no timestamp can prove its backend unchanged (a backend that is not
	 * a regular file), else only a regular file's, proven by its stamp
	 * (device_l2_map.c). */
	bool warm_all;
	/* Set by the device while bytes of the live log found at start are
	 * not all on this export's backend (its backend requests then go
	 * through cache_device_gate), cleared once they are. */
	atomic_bool *replay_gate;
};
/* The export joins the device (cache_export_add): *slot, its slot, or -1
 * (not logged: its name's earlier backend is still being written back,
 * said). 0, or -ENOSPC (every slot taken, said). The slot names it in
 * every call below; -1 there does nothing. */
int cache_device_add_export(struct cache_device *d, const struct cache_device_member *m, int *slot);
/*
 * After every export is added, before anything is served: the live log
 * against the exports. 0, or -EINVAL with err naming the export and its
 * dirty bytes (not configured any more, another backend identity).
 */
int cache_device_bind(struct cache_device *d, char *err, size_t len);
/* Plan the live log's write-back and start the drain (it goes on while
 * the exports are served), then the log thread. */
int cache_device_start(struct cache_device *d, char *err, size_t len);
/* Send io for slot's export from thread w now (false), or later (true: it
 * touches bytes of the live log found at start not yet on the backend; it
 * is sent from w once they are, or completed there with -EIO if they
 * cannot be). Called by cache_backend_submit while its replay_gate is set. */
struct backend_io;
bool cache_device_gate(struct cache_device *d, int slot, struct worker *w, struct backend_io *io);
/* Stop the log thread; clean: everything was written back and flushed
 * (the log is checkpointed empty and the superblock says so). */
void cache_device_close(struct cache_device *d, bool clean);
/*
 * Detaching, live (nbdcachectl cache-device detach). begin: the log takes
 * no more records (FLUSH goes to the backends, in full rounds) and the
 * level-2 cache is off; 0, again while detaching (a detach that failed may
 * be tried again), -EALREADY once detached, -EIO when the device failed.
 * The caller then runs a full round on every export on the device, each
 * answered once a checkpoint covers it. end: the log is empty; its thread
 * stops, the superblock is marked clean, and the device is not used again
 * until a restart; -EBUSY while records remain (a round failed).
 */
int cache_device_detach_begin(struct cache_device *d);
int cache_device_detach_end(struct cache_device *d);
/*
 * Once detached: close the device and drop its lock, so that another
 * daemon (a live upgrade's new one) may open it. Nothing of this daemon
 * reaches it afterwards. 0 (also again), -EBUSY when not detached, or
 * -errno.
 */
int cache_device_release(struct cache_device *d);

/* Can the log take records now (attached, started, not failed)? */
bool cache_device_usable(struct cache_device *d);
/* Is the drain of the live log found at start still at work, and not
 * failing (its last group's writes did not fail within a retry interval,
 * its thread did not give up)? False when there is none. */
bool cache_device_drain_progressing(struct cache_device *d);
/* Failed, and its log not yet emptied on the device (voided): until it
 * is, nothing is answered through the backends (cache_device_wait), and
 * full rounds of every export on it put its records there. */
bool cache_device_voiding(struct cache_device *d);
/* Append a record for slot's export (DEVFMT_EXTENT_*; data: length bytes
 * of DATA), copying the data. Its rec, or 0 when the log is off. */
uint64_t cache_device_append(struct cache_device *d, int slot, unsigned type, uint64_t offset,
			     uint64_t length, const void *data);
/* The rec of the last record appended (0: none). */
uint64_t cache_device_last(struct cache_device *d);
/* Bytes appended and not yet committed. */
uint64_t cache_device_pending(struct cache_device *d);
/* Free bytes in the log (before the pending ones are committed). */
uint64_t cache_device_room(struct cache_device *d);
/* Post w->task to w->worker once durable >= w->rec (at once if so). */
void cache_device_wait(struct cache_device *d, struct cache_device_waiter *w);
/* slot's export is being retired: everything of it is on its backend,
 * flushed. A CLEAN record over its whole range, once durable, keeps a
 * replay from putting any older record of it back over what the backend
 * gets later (from other writers while it is not configured, or from
 * another export given its slot). *rec: 0 the first time (the record's
 * number is kept there). 0 done or nothing to do, 1 not durable yet (call
 * again later). */
int cache_device_retire(struct cache_device *d, int slot, uint64_t *rec);
/*
 * slot's export's size moves from old to size (cache_export_resize,
 * before the resize is answered; a shrink before its backend is cut): a shrink
 * logs a CLEAN record from the new end on and waits until it is durable
 * (no record past the end can come back, even once it grows again); the
 * size recorded for it is written to the superblock. 0 or -errno.
 */
int cache_device_resize(struct cache_device *d, int slot, uint64_t old, uint64_t size);
/* A full flush round of slot's export succeeded: the records appended up
 * to rec are on its backend. Moves the tail once every export is covered. */
void cache_device_covered(struct cache_device *d, int slot, uint64_t rec);
/* The log is short of room: full rounds would let a checkpoint free it. */
bool cache_device_wants_checkpoint(struct cache_device *d);
void cache_device_get_stats(struct cache_device *d, struct cache_device_stats *out);
/* A log round began, to visit entries entries (the stats). */
void cache_device_count_round(struct cache_device *d, uint64_t entries);

/*
 * The level-2 cache (device_l2.c): clean pages evicted from RAM, read back
 * on a RAM miss. Only whole DEVFMT_BLOCK pages, aligned, are kept.
 */
struct backend_io;
bool cache_device_l2_on(struct cache_device *d);
/* An evicted clean range of slot's export (shard lock held): copied and
 * queued for the area, or left out when staging is full; never waits. */
void cache_device_l2_store(struct cache_device *d, int slot, uint64_t offset, const void *data,
			   uint64_t length);
/* A range of slot's export is written, zeroed or trimmed: its pages are
 * gone, staged copies cancelled. Under the shard lock of a cached write,
 * or after a direct step dropped the range from RAM. */
void cache_device_l2_invalidate(struct cache_device *d, int slot, uint64_t offset, uint64_t length);
/*
 * Before any write to a backend (a writeback, a direct step, a
 * passthrough write): the device's level-2 map no longer claims a page
 * removed so far (written to the device first when it does; blocks the
 * caller for that write). A direct step brackets its backend write with
 * _direct_begin (its range removed, then this) and _direct_end (removed
 * again: evictions meanwhile staged the bytes from before, and the map
 * never claims what was stored in between).
 */
void cache_device_l2_before_write(struct cache_device *d);
/* A range of slot's export leaves the level-2 cache (invalidate), and the
 * map on the device no longer claims it (before_write): before the backend
 * changes. */
void cache_device_l2_remove(struct cache_device *d, int slot, uint64_t offset, uint64_t length);
void cache_device_l2_direct_begin(struct cache_device *d, int slot, uint64_t offset,
				  uint64_t length);
void cache_device_l2_direct_end(struct cache_device *d, int slot, uint64_t offset, uint64_t length);
/* Wait until what is staged is written (a clean stop keeping RAM's
 * pages, cache_stop). */
void cache_device_l2_drain(struct cache_device *d);
/* A fill of io->length bytes at slot's export's io->offset into io->buf:
 * false if the area does not hold every page; else read through w's ring,
 * and io->done(io, 0) runs on w, or io->done(io, -errno) when the area
 * could not give it (a page rewritten meanwhile: -ESTALE; the caller then
 * reads the backend). */
bool cache_device_l2_read(struct cache_device *d, int slot, struct worker *w,
			  struct backend_io *io);
/* Small reads (up to CACHE_DEVICE_SMALL_READ bytes: what random reads
 * fill) are where the device and the backend are weighed against each
 * other: what one from the area has cost lately, ns (a moving average;
 * 0: none yet). */
#define CACHE_DEVICE_SMALL_READ (64u << 10)
uint64_t cache_device_l2_small_read_ns(struct cache_device *d);
/* A fill went to the backend though the area might hold it: the backend
 * answers faster (counted). */
void cache_device_l2_skipped(struct cache_device *d);
/* Fold ns into a moving average (of 32: a few slow reads, a device
 * flush ahead of them, do not swing it). */
void cache_device_cost_note(atomic_uint_fast64_t *avg, uint64_t ns);

#endif
