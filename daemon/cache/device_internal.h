/*
 * daemon/cache/device_internal.h: what the cache device's files share
 * (device.h is the interface): device.c opens, starts and closes it
 * (device_claim.c: its lock and mode; device_resize.c: its part in a
 * resize),
 * device_replay.c reads its live log, binds it to the exports and plans
 * its write-back at start, device_drain.c writes it back while the
 * exports are served, device_log.c appends, commits and checkpoints;
 * device_l2.c, device_l2_map.c and device_l2_read.c keep the level-2
 * cache, its map on the device and its reads.
 *
 * The log is a ring of batches in [log_offset, log_offset + log_bytes):
 *
 *   tail (checkpoint)            head (next batch)
 *   v                            v
 *   [batch s][batch s+1][wrap]...[free ...................]
 *
 * Committed batches are remembered (offset, bytes, seq, their records)
 * until a checkpoint pops them; `used` is their bytes, including the end
 * of the ring a wrap skipped. The live log a start found stays in the
 * ring, as one batch held (DEV_HELD_REC) until the drain has written it
 * to the backends and flushed them (device_drain.c). Only the log thread writes the ring and the
 * superblock's checkpoint; records are appended under the device lock by
 * any thread.
 */
#ifndef NBDCACHED_DAEMON_CACHE_DEVICE_INTERNAL_H
#define NBDCACHED_DAEMON_CACHE_DEVICE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "daemon/backend/backend.h"
#include "daemon/cache/device.h"
#include "daemon/check.h"
#include "daemon/clock.h"

/* A DATA record carries at most this much (longer ones are cut). */
#define DEV_EXTENT_MAX (1u << 20)
/* A batch carries at most this much data. */
#define DEV_BATCH_DATA (4u << 20)
/* The smallest device given a level-2 area when formatted. */
#define DEV_L2_MIN_DEVICE (64u << 20)
/* Sequence numbers jump this far at each start: a batch left from before
 * (a commit torn by a crash, past the replay's end) never fits in. */
#define DEV_SEQ_JUMP (1ull << 32)

struct dev_slot {
	bool used;			   /* an identity in the table */
	struct devfmt_identity id;	   /* as the superblock has it */
	struct devfmt_identity cfg;	   /* as configured now (backend set) */
	/* Its export configured now (cache_device_add_export; NULL: only on
	 * the device): its backend and replay gate. */
	struct backend *backend;
	atomic_bool *replay_gate;
	/* Its backend may be taken over by another node (backend.h: shared):
	 * appends skip it without the device lock. Set with backend. */
	atomic_bool shared;
	bool retired;			   /* cache_device_retire said it is all on its backend */
	uint64_t covered;		   /* records up to this are on the backend */
	uint64_t last;			   /* its last record appended */
	uint64_t live_bytes, live_records; /* in the live log at start */
	bool discard; /* its records are thrown away (cache-device-discard-dirty) */
	bool configured; /* an export configured now has it (cfg set) */
	bool warm_all;	 /* its cache-device-warm is all (cache_device_add_export) */
};

struct dev_rec {
	uint64_t rec;
	uint8_t type;
	uint16_t slot;
	uint64_t offset, length;
	size_t data; /* DATA: where its bytes are in pdata */
};

/* A committed batch: its records are first_rec .. first_rec + extents - 1
 * (a wrap marker: none, first_rec is the next one's). */
struct dev_pos {
	uint64_t off, seq;
	uint64_t expect; /* the number the walk expected there (an epoch
			  * batch's differs: it jumps from this one) */
};

struct dev_batch {
	uint64_t offset, bytes, seq, first_rec, last_rec;
	uint32_t extents;
};
/* The last_rec of the batch standing for the live log a start found,
 * while it is not all on the backends: no checkpoint covers it. */
#define DEV_HELD_REC UINT64_MAX

/*
 * What the live log a start found still has to put on the backends
 * (device_replay.c plans it, device_drain.c writes it): for every byte,
 * the newest record over it, as pieces. A piece lies in one batch of the
 * live log (d->live[batch]); a batch's pieces are contiguous in the
 * array. Until a piece is on its backend, every backend request of the
 * cache that touches its bytes waits (cache_device_gate).
 */
struct dev_piece {
	uint64_t offset, length;
	uint64_t data;	/* DATA: where its bytes are in its batch's data */
	uint32_t batch; /* index into d->live */
	uint16_t slot;
	uint8_t type; /* DEVFMT_EXTENT_DATA, _ZERO, _TRIM */
	bool done;    /* on its backend (written, not yet flushed) */
};

/* A batch of the live log as the drain sees it. */
#define DEV_DRAIN_PENDING 0u
#define DEV_DRAIN_WANTED 1u /* a request waits for it: first */
#define DEV_DRAIN_DONE 2u
#define DEV_DRAIN_WRITING 4u /* in the group being written */
#define DEV_DRAIN_BAD 3u     /* its data no longer checks: never written (lost) */
struct dev_drain_batch {
	size_t first, count; /* its pieces */
	uint8_t state;
};

/* A backend request waiting for pieces (cache_device_gate). */
struct dev_parked {
	struct worker_task task;
	struct backend_io *io;
	struct worker *worker;
	unsigned slot;
	struct backend *backend; /* slot's, as planned */
	int result; /* when posted: 0 send it, else complete it with this */
	struct dev_parked *next;
};

struct dev_drain {
	pthread_mutex_t lock; /* a leaf: everything below */
	pthread_cond_t cond;
	pthread_t thread;
	bool inited, running, stop, finished;
	bool ended; /* its thread returned (finished or not) */
	bool closing;	      /* dev_drain_stop(wait): end once nothing can be done */
	struct worker worker; /* the drain's backend requests */
	bool worker_started;
	struct dev_piece *pieces;
	size_t npieces, cappieces;
	/* Per slot: its pieces' indices by offset (they never overlap),
	 * those not done, and whether the drain wrote to its backend. */
	uint32_t *by_offset[DEVFMT_MAX_EXPORTS];
	size_t nby_offset[DEVFMT_MAX_EXPORTS];
	uint64_t undone[DEVFMT_MAX_EXPORTS];
	bool touched[DEVFMT_MAX_EXPORTS]; /* written, flushed only at the end */
	/* Each slot's export as planned, its backend and replay gate (a slot
	 * is given to another export only once its pieces are all done: the
	 * gate keeps the export from being retired before). */
	struct backend *backend[DEVFMT_MAX_EXPORTS];
	atomic_bool *gate[DEVFMT_MAX_EXPORTS];
	struct dev_drain_batch *batches; /* d->nlive of them */
	size_t next;			 /* the next batch in log order */
	/* Batches made DEV_DRAIN_WANTED, in that order (some may be done
	 * since): [want_head, nwant). */
	size_t *want, nwant, capwant, want_head;
	struct dev_parked *parked;
	uint64_t retry_ns; /* a batch failed: not before then again */
	uint64_t t0_ns;
	/* The figures: bytes (data, zeros, trims) not on the backends yet,
	 * written, lost (a batch that no longer checks), the time it took (0
	 * until done), requests that waited. */
	uint64_t pending_bytes, drained_bytes, lost_bytes, drain_ns, waits;
};

/* A clean range staged for the level-2 area (device_l2.c). */
struct dev_l2_item {
	uint16_t slot;
	uint64_t block; /* its first page: the export's offset / DEVFMT_BLOCK */
	uint32_t pages;
	bool cancelled; /* written over meanwhile: not entered */
	bool unmapped;	/* stored while a direct write to its export was being
			 * made: never claimed by the map */
	uint8_t *data;	/* pages * DEVFMT_BLOCK, aligned */
	struct dev_l2_item *next;
	uint32_t crc[]; /* per page: CRC32C of its bytes (taken as it is written) */
};

/* Map blocks rendered and written at a time (device_l2_map.c). */
#define DEV_L2_MAP_CHUNK 64u
/* A page's state for the level-2 map (dev_l2.pstate). */
#define L2P_MAPPED 1u	/* the map claims it (or will, at its next write) */
#define L2P_UNMAPPED 2u /* never claimed (dev_l2_item.unmapped) */

/* The level-2 cache (device_l2.c; its map on the device:
 * device_l2_map.c): its own lock, a leaf. */
struct dev_l2 {
	bool inited, running, stop, st_failed;
	atomic_bool on;
	uint64_t offset; /* of the area on the device */
	uint32_t pages;	 /* in the area; 0: no level-2 cache */
	uint32_t head;	 /* the next page the ring writes */
	pthread_mutex_t lock;
	pthread_cond_t cond, idle; /* idle: nothing staged or being written */
	pthread_t thread;
	uint64_t *owner; /* per page: its key, 0 free */
	uint32_t *epoch; /* per page: bumped when it is rewritten */
	uint32_t *crc;	 /* per page: CRC32C of its bytes, checked on every read */
	uint64_t *hkeys; /* key -> page: 0 empty */
	uint32_t *hpages;
	size_t hmask;
	uint64_t valid;			 /* keys in the table */
	atomic_uint_fast64_t valid_hint; /* valid, read without the lock */
	atomic_uint_fast64_t held;	 /* items staged or being written */
	atomic_uint_fast64_t misses;	 /* fills it could not serve */
	atomic_uint_fast64_t skipped;	 /* fills sent to a faster backend */
	atomic_uint_fast64_t small_read_ns; /* a small read's cost, averaged */
	struct dev_l2_item *staged, *staged_tail, *writing;
	uint64_t staged_bytes;
	/* The map on the device (device_l2_map.c). Lock order: map_lock,
	 * then sb_lock, then lock. */
	pthread_mutex_t map_lock;	/* writing the map */
	uint64_t map_offset;		/* its header block; 0: no map */
	uint32_t mblocks;		/* its map blocks */
	uint8_t *pstate;		/* per page: L2P_* */
	uint8_t *mdirty;		/* per map block: to be written */
	uint8_t *mbuf;			/* DEV_L2_MAP_CHUNK blocks rendered (map_lock) */
	uint32_t clear_hi;		/* pages [head, clear_hi) are claimed by no map block */
	uint32_t mark_from;		/* the head when the map last took new pages */
	uint64_t since_mark;		/* bytes written to the ring since */
	atomic_uint_fast64_t removals;	/* claimed pages removed */
	atomic_uint_fast64_t persisted; /* removals the device's map has */
	atomic_bool map_live;		/* the device's map may claim pages */
	atomic_bool void_due;		/* the table was cleared: the map must go */
	uint64_t mark_due;		/* when the map takes new pages, idle or not */
	atomic_uint direct[DEVFMT_MAX_EXPORTS]; /* direct writes being made */
	uint64_t stamp[DEVFMT_MAX_EXPORTS];	/* as the map's header has them */
	bool header_ok;				/* that header is on the device */
	struct {
		uint64_t l2_hits, l2_hit_bytes, l2_stale, l2_read_errors, l2_checksum_errors;
		uint64_t l2_stored_bytes, l2_dropped_bytes, l2_invalidated_bytes;
		uint64_t l2_loaded_bytes, l2_load_ns, l2_write_ns;
		uint64_t l2_map_writes, l2_map_ns, l2_map_waits;
	} st;
};

struct cache_device {
	char *path;
	unsigned use;  /* CACHE_DEVICE_USE_* */
	int fd;
	int rfd; /* the log's walks at start: buffered, read twice (-1: none) */
	bool odirect;
	uint64_t device_bytes;
	struct devfmt_sb sb;
	unsigned sb_newest;	 /* the copy holding the newest superblock */
	pthread_mutex_t sb_lock; /* encoding and writing the superblock */
	struct dev_slot slots[DEVFMT_MAX_EXPORTS];
	char *discard; /* cache-device-discard-dirty, or NULL */

	pthread_mutex_t lock; /* the device lock: everything below */
	pthread_cond_t cond;
	pthread_t thread;
	bool running, stop, started, failed, no_room, checkpoint_due;
	bool detaching, detached; /* cache_device_detach_begin, _end */
	bool released;		  /* cache_device_release: closed, its lock dropped */
	/* After a failure: the log was emptied on the device (a checkpoint
	 * past every batch, its sequence numbers past every batch a commit
	 * attempted), so nothing on it can be replayed over what the backends
	 * got since; or why that superblock could not be written (-errno). A
	 * FLUSH or FUA answered through the backend after the failure waits
	 * for it (device_log.c, ready_locked). */
	bool voided, void_said;
	int void_error;
	/* A floor for the superblock's seq_floor (device lock), that its next
	 * write takes (dev_sb_update, under the superblock's lock). */
	uint64_t floor_due;
	/* Attempts to write the superblock of a failed device begun, and the
	 * one whose failure void_error is (a waiter is answered only by one
	 * begun after it came: cache_device_waiter.void_after). */
	uint64_t void_attempts, void_error_at;
	bool committing;	  /* the log thread writes records taken from pend */
	struct dev_rec *pend;
	size_t npend, cappend;
	uint8_t *pdata;
	size_t pdata_len, pdata_cap;
	uint64_t appended, durable, want;
	struct cache_device_waiter *waiters;
	/* The ring: log thread, read under the lock for the stats. */
	uint64_t head, head_seq, tail, tail_seq, used;
	uint32_t tail_skip;    /* extents of the batch at the tail already covered */
	bool sb_stale;	       /* the last checkpoint's superblock write failed */
	/* The live log as cache_device_bind() read it, for the replay: each
	 * batch's place and sequence number, and where and why it ended. */
	struct dev_pos *live;
	size_t nlive, caplive;
	uint64_t live_end, live_end_seq;
	uint64_t live_bytes; /* of the ring, from the checkpoint to live_end */
	bool live_torn;	     /* it ended at a torn or corrupt batch */
	char live_why[200];
	/* The live log found at start, kept until drained (device_drain.c). */
	struct dev_drain *drain;
	bool held_release; /* the drain is done: the next checkpoint pops it */
	/* The first batch written after the start carries DEVFMT_BATCH_EPOCH
	 * and epoch_prev (the sequence number the live log ended at). */
	bool epoch_due;
	uint64_t epoch_prev;
	uint64_t checkpointed; /* the rec the last checkpoint covered */
	unsigned checkpoint_waiters;
	struct dev_batch *batches;
	size_t nbatches, capbatches;
	struct cache_device_stats st;
	struct dev_l2 l2;
};

/* The CLEAN record a retired export leaves (cache_device_retire): over
 * all of it, so that none of its older records is replayed (bind counts
 * its records from there on). Written and recognized by this shape. */
#define DEV_RETIRED_LENGTH UINT64_MAX
static inline bool dev_extent_retired(const struct devfmt_extent *x)
{
	return x->type == DEVFMT_EXTENT_CLEAN && x->offset == 0 && x->length == DEV_RETIRED_LENGTH;
}

/* One batch of the live log: its header, data read and checked (unless
 * headers_only). committed: the highest committed mark of the headers
 * read (devfmt_batch): no batch up to it can be torn. */
struct walk {
	uint64_t off, seq;
	struct devfmt_batch b;
	uint8_t *data; /* data_blocks blocks */
	char why[200];
	uint64_t batches, bytes;
	bool headers_only;
	uint64_t committed;
	uint64_t expected; /* the number expected where the batch read is */
	/* The walk ended at the batch it expected, torn or corrupt (its
	 * header's magic, UUID and sequence number right, a CRC wrong), not
	 * at an older lap or unwritten space. */
	bool torn;
};

/* device_claim.c: the flags a device is opened with (O_EXCL for a block
 * device); then its mode checked and its lock taken, for as long as it is
 * open: 0, or -errno with err saying why (naming the holder). */
struct stat;
int dev_open_flags(const char *path, bool readonly);
/* Has a process other than this one and parent path's file open (from
 * /proc; true when that cannot be read)? Its lock may outlive the last
 * descriptor briefly (I/O still referring to the file), so the parent's
 * hold is told by nobody else having it. */
bool dev_held_by_other(const char *path, pid_t parent);
int dev_claim(struct cache_device *d, const struct stat *st, bool readonly, char *err,
	      size_t len);
int dev_fail(char *err, size_t len, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A buffer of n bytes aligned for O_DIRECT (free() it). */
uint8_t *dev_aligned(size_t n);
int dev_pwrite_all(int fd, const void *buf, size_t n, uint64_t off);
int dev_pread_all(int fd, void *buf, size_t n, uint64_t off);
int dev_sync(struct cache_device *d);
/* Write d->sb to the copy not holding the newest, and flush (sb_lock held). */
int dev_sb_write_locked(struct cache_device *d);
/* The superblock's checkpoint and exports as they are now (sb_lock held). */
int dev_sb_update(struct cache_device *d, bool clean);
/* The next batch of the live log at w->off (following wraps): 1, 0 at its
 * end (w->why says why), or -errno. hdr: a DEVFMT_BLOCK buffer. */
int dev_walk_next(struct cache_device *d, struct walk *w, uint8_t *hdr);
void dev_walk_advance(struct cache_device *d, struct walk *w);
/* Batch k of the live log read again (data checked unless headers_only):
 * 1, 0 when it no longer reads as it did (w->why), or -errno. */
int dev_live_read(struct cache_device *d, size_t k, bool headers_only, struct walk *w,
		  uint8_t *hdr);
/* No more walks: the log's pages dropped from the page cache, rfd closed. */
void dev_walk_done(struct cache_device *d);
/* device_replay.c: the pieces of the live log (d->drain), its ranges out
 * of the level-2 cache. 0 or -errno. */
int dev_plan(struct cache_device *d, char *err, size_t len);
/* device_drain.c: the drain started (d->drain planned), stopped (wait:
 * until it is done), freed. */
int dev_drain_start(struct cache_device *d);
void dev_drain_stop(struct cache_device *d, bool wait);
void dev_drain_free(struct cache_device *d);
void dev_drain_stats(struct cache_device *d, struct cache_device_stats *out);
/* --check-config: the data of every batch of the live log read and
 * checked (a start checks the committed ones as it writes them back). */
int dev_check_data(struct cache_device *d, char *err, size_t len);
/* Keys: the export slot + 1 above a block number of 48 bits (an export of
 * up to 2^60 bytes); 0 is a free page. */
#define DEV_L2_BLOCK_BITS 48

static inline uint64_t dev_l2_key(unsigned slot, uint64_t block)
{
	return ((uint64_t)slot + 1) << DEV_L2_BLOCK_BITS | block;
}

static inline unsigned dev_l2_key_slot(uint64_t key)
{
	return (unsigned)(key >> DEV_L2_BLOCK_BITS) - 1;
}

static inline uint64_t dev_l2_key_block(uint64_t key)
{
	return key & ((1ull << DEV_L2_BLOCK_BITS) - 1);
}

/* The level-2 table (device_l2.c): key -> page (lock held). */
bool dev_l2_table_get(const struct dev_l2 *l, uint64_t key, uint32_t *page);
void dev_l2_table_put(struct dev_l2 *l, uint64_t key, uint32_t page);
/* Page p does not hold what was written there: it leaves the table and
 * the map (device_l2_read.c, lock held). */
void dev_l2_page_forget_locked(struct dev_l2 *l, uint32_t p);
/* Page p's map block is to be written (lock held). */
static inline void dev_l2_map_dirty(struct dev_l2 *l, uint32_t p)
{
	l->mdirty[p / DEVFMT_L2M_PER_BLOCK] = 1;
}
/* The pages of slot's bytes [offset, offset + length) leave the table
 * (lock not held). */
void dev_l2_forget(struct cache_device *d, unsigned slot, uint64_t offset, uint64_t length);

/* Why two identities differ (buf), or NULL; their sizes compared too
 * when size (the level-2 cache: a page past the end must not come back),
 * not for the log (a resize is no other backend: device_replay.c). */
const char *dev_identity_differs(const struct devfmt_identity *a, const struct devfmt_identity *b,
				 bool size, char *buf, size_t len);
/* device_l2.c: set up (before the map is read), the thread started,
 * stopped, everything freed. */
int dev_l2_init(struct cache_device *d);
int dev_l2_start(struct cache_device *d);
void dev_l2_stop(struct cache_device *d);
void dev_l2_free(struct cache_device *d);
/* device_l2_map.c: the map read at start (before the replay; the pages it
 * claims enter the table); written: the removals and new pages the table
 * has now (all: every page held, a clean close), 0 or -errno (then the
 * map is given up, dev_l2_map_void); given up: a new generation in d->sb
 * (written by the caller when sb_write is false). */
void dev_l2_load(struct cache_device *d);
int dev_l2_map_write(struct cache_device *d, bool all);
void dev_l2_map_void(struct cache_device *d, bool sb_write);
/* A clean close (the level-2 thread stopped, everything on the backends):
 * every page held into the map, their bytes made durable first; or the
 * map given up if the table was cleared (the caller writes d->sb). */
void dev_l2_map_close(struct cache_device *d);
/* --check-config: the device's map header is there, of its generation. */
bool dev_l2_map_kept(struct cache_device *d);
void dev_l2_stats(struct cache_device *d, struct cache_device_stats *out);
/* Off for good (a write to the area or its map failed): every page
 * forgotten, said (lock held). */
void dev_l2_off_locked(struct cache_device *d, int error);
/* Off for good, quietly (a detach): every page forgotten, the thread stopped. */
void dev_l2_detach(struct cache_device *d);
/* device_log.c */
void *dev_log_thread(void *arg);
/* The log cannot hold every record any more: off for good (lock held). */
void dev_fail_locked(struct cache_device *d, int error, const char *what);

#endif
