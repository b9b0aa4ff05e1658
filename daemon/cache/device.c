/*
 * daemon/cache/device.c: a cache device opened (its superblock read, or
 * the device formatted, an older format's level-2 area laid out again),
 * its exports' slots and identities, started and closed, and
 * --check-config's look at it (device.h; the ring: device_internal.h;
 * binding the live log to the exports and planning its replay:
 * device_replay.c).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/log.h"
#include "daemon/options.h"
#include "proto/nbd.h"

int dev_fail(char *err, size_t len, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, len, fmt, ap);
	va_end(ap);
	return rc;
}

uint8_t *dev_aligned(size_t n)
{
	void *p = NULL;
	if (posix_memalign(&p, DEVFMT_BLOCK, n ? n : DEVFMT_BLOCK) != 0)
		return NULL;
	return p;
}

int dev_pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
	const uint8_t *p = buf;
	while (n) {
		ssize_t w = pwrite(fd, p, n, (off_t)off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return w < 0 ? -errno : -EIO;
		p += w;
		n -= (size_t)w;
		off += (uint64_t)w;
	}
	return 0;
}

int dev_pread_all(int fd, void *buf, size_t n, uint64_t off)
{
	uint8_t *p = buf;
	while (n) {
		ssize_t r = pread(fd, p, n, (off_t)off);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return -EIO; /* past the end: a truncated device */
		p += r;
		n -= (size_t)r;
		off += (uint64_t)r;
	}
	return 0;
}

int dev_sync(struct cache_device *d)
{
	return fdatasync(d->fd) < 0 ? -errno : 0;
}

/* Write the superblock (d->sb) to the copy not holding the newest, and
 * flush: a torn write leaves the other. sb_lock held. */
int dev_sb_write_locked(struct cache_device *d)
{
	uint8_t *buf = dev_aligned(DEVFMT_SB_BYTES);
	if (!buf)
		return -ENOMEM;
	d->sb.generation++;
	int rc = devfmt_sb_encode(&d->sb, buf);
	unsigned copy = d->sb_newest ^ 1u;
	if (rc == 0)
		rc = dev_pwrite_all(d->fd, buf, DEVFMT_SB_BYTES, (uint64_t)copy * DEVFMT_SB_BYTES);
	if (rc == 0)
		rc = dev_sync(d);
	if (rc == 0)
		d->sb_newest = copy;
	free(buf);
	return rc;
}

static uint64_t device_size(int fd, const struct stat *st)
{
	if (S_ISBLK(st->st_mode)) {
		uint64_t size = 0;
		return ioctl(fd, BLKGETSIZE64, &size) < 0 ? 0 : size;
	}
	return (uint64_t)st->st_size;
}

static bool all_zero(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i])
			return false;
	return true;
}

static int format(struct cache_device *d, char *err, size_t len)
{
	memset(&d->sb, 0, sizeof(d->sb));
	if (getrandom(d->sb.uuid, sizeof(d->sb.uuid), 0) != (ssize_t)sizeof(d->sb.uuid))
		return dev_fail(err, len, -EIO, "%s: no random bytes for its UUID", d->path);
	d->sb.device_bytes = d->device_bytes;
	d->sb.log_offset = DEVFMT_LOG_OFFSET;
	uint64_t avail = (d->device_bytes - DEVFMT_LOG_OFFSET) / DEVFMT_BLOCK * DEVFMT_BLOCK;
	d->sb.log_bytes = avail;
	if ((d->use & CACHE_DEVICE_USE_L2) && avail >= DEV_L2_MIN_DEVICE) {
		/* An eighth for the log (16 MiB to 1 GiB); the rest is the
		 * level-2 map and the area it describes. */
		uint64_t log = avail / 8;
		log = log < (16u << 20) ? (16u << 20) : log > (1ull << 30) ? (1ull << 30) : log;
		log = (log + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
		uint64_t pages = devfmt_l2_pages_fit(avail - log);
		if (pages > UINT32_MAX)
			pages = UINT32_MAX;
		d->sb.log_bytes = log;
		d->sb.l2_map_offset = DEVFMT_LOG_OFFSET + log;
		d->sb.l2_offset = d->sb.l2_map_offset + devfmt_l2m_bytes(pages, DEVFMT_VERSION);
		d->sb.l2_bytes = pages * DEVFMT_BLOCK;
	}
	d->sb.checkpoint_offset = 0;
	d->sb.checkpoint_seq = 1;
	/* Both copies: the second write makes the first the older one. */
	d->sb_newest = 1;
	pthread_mutex_lock(&d->sb_lock);
	int rc = dev_sb_write_locked(d);
	if (rc == 0)
		rc = dev_sb_write_locked(d);
	pthread_mutex_unlock(&d->sb_lock);
	if (rc < 0)
		return dev_fail(err, len, rc, "%s: formatting: %s", d->path, strerror(-rc));
	log_info("cache device %s: formatted: %llu bytes of log, %llu of level-2 area", d->path,
		 (unsigned long long)d->sb.log_bytes, (unsigned long long)d->sb.l2_bytes);
	return 0;
}

/*
 * A superblock of a version before the level-2 map's page checksums: its
 * map (keys alone) cannot prove a page's bytes, and a map of checksums
 * takes twice its room. The map and the area are laid out again in the
 * same bytes (devfmt_sb_l2_relayout): the level-2 cache starts cold,
 * once. The log is left as it is. Written as this version with the
 * superblock at start, before the level-2 thread writes a page.
 */
static void l2_relayout(struct cache_device *d)
{
	uint32_t version = d->sb.version;
	uint64_t was = d->sb.l2_bytes / DEVFMT_BLOCK;
	if (devfmt_sb_l2_relayout(&d->sb))
		log_info("cache device %s: format %u: its level-2 map has no page checksums; the "
			 "map and area are laid out again for them (%llu pages, were %llu) and "
			 "the level-2 cache starts cold",
			 d->path, version, (unsigned long long)(d->sb.l2_bytes / DEVFMT_BLOCK),
			 (unsigned long long)was);
}

/*
 * The superblock copies of an earlier format not read any more (version
 * 1, before the level-2 area; version 2, before its map; their headers are what this
 * one's begins with): 1 when the newest copy with a good CRC is such a one
 * and says closed clean (the device holds nothing: it may be formatted
 * again), 0 when it does not say so, -1 when neither copy is one; *version
 * the newest copy's.
 */
static int earlier_format_clean(const uint8_t *buf, uint32_t *version)
{
	int best = -1;
	uint64_t gen = 0;
	for (unsigned i = 0; i < DEVFMT_SB_COPIES; i++) {
		const uint8_t *p = buf + (size_t)i * DEVFMT_SB_BYTES;
		uint32_t v = nbd_get32(p + 8);
		if (nbd_get64(p) != DEVFMT_SB_MAGIC || v == 0 || v >= DEVFMT_VERSION_OLDEST ||
		    devfmt_crc32c(0, p, DEVFMT_SB_BYTES - 4) != nbd_get32(p + DEVFMT_SB_BYTES - 4))
			continue;
		if (best < 0 || nbd_get64(p + 32) > gen) {
			gen = nbd_get64(p + 32);
			best = (nbd_get32(p + 12) & DEVFMT_SB_CLEAN) ? 1 : 0;
			*version = v;
		}
	}
	return best;
}

/* Open path and read its superblock (*fresh: both copies all zeros, no
 * superblock read); readonly for --check-config. */
static int load(const char *path, unsigned use, bool readonly, struct cache_device **out,
		bool *fresh, char *err, size_t len)
{
	*fresh = false;
	struct cache_device *d = calloc(1, sizeof(*d));
	if (!d || !(d->path = strdup(path))) {
		free(d);
		return dev_fail(err, len, -ENOMEM, "cache device %s: out of memory", path);
	}
	d->use = use;
	d->rfd = -1;
	pthread_mutex_init(&d->lock, NULL);
	pthread_mutex_init(&d->sb_lock, NULL);
	pthread_cond_init(&d->cond, NULL);
	int rc;
	d->odirect = true;
	int flags = dev_open_flags(path, readonly);
	d->fd = open(path, flags | O_DIRECT);
	if (d->fd < 0 && errno == EINVAL) {
		d->odirect = false; /* tmpfs, some FUSE file systems */
		d->fd = open(path, flags);
	}
	if (d->fd < 0 && errno == EBUSY) {
		rc = dev_fail(err, len, -EBUSY,
			      "cache device %s: in use (mounted, or opened exclusively by another "
			      "program or daemon): refused",
			      path);
		goto out;
	}
	if (d->fd < 0) {
		rc = dev_fail(err, len, -errno, "cache device %s: %s", path, strerror(errno));
		goto out;
	}
	/* The start reads the live log twice, forward to find its end, then
	 * backward to replay it: through the page cache, the second read
	 * mostly finds what the first left (dropped after the replay). */
	d->rfd = open(path, O_RDONLY | O_CLOEXEC);
	struct stat st;
	if (fstat(d->fd, &st) < 0 || !(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
		rc = dev_fail(err, len, -EINVAL, "cache device %s: not a file or block device",
			      path);
		goto out;
	}
	/* Its mode, and one daemon's at a time (device_claim.c). */
	rc = dev_claim(d, &st, readonly, err, len);
	if (rc < 0)
		goto out;
	d->device_bytes = device_size(d->fd, &st);
	if (d->device_bytes < DEVFMT_MIN_DEVICE) {
		rc = dev_fail(
		    err, len, -EINVAL,
		    "cache device %s: %llu bytes; a cache device needs at least %llu (a file: "
		    "make it that large first, e.g. with fallocate)",
		    path, (unsigned long long)d->device_bytes,
		    (unsigned long long)DEVFMT_MIN_DEVICE);
		goto out;
	}
	uint8_t *buf = dev_aligned(2 * DEVFMT_SB_BYTES);
	if (!buf) {
		rc = dev_fail(err, len, -ENOMEM, "cache device %s: out of memory", path);
		goto out;
	}
	rc = dev_pread_all(d->fd, buf, 2 * DEVFMT_SB_BYTES, 0);
	if (rc < 0) {
		free(buf);
		rc = dev_fail(err, len, rc, "cache device %s: reading its superblocks: %s", path,
			      strerror(-rc));
		goto out;
	}
	static struct devfmt_sb copy[2];
	char why[2][200];
	bool ok[2];
	for (unsigned i = 0; i < 2; i++)
		ok[i] = devfmt_sb_decode(buf + (size_t)i * DEVFMT_SB_BYTES, &copy[i], why[i],
					 sizeof(why[i])) == 0;
	bool zero = all_zero(buf, 2 * DEVFMT_SB_BYTES);
	uint32_t version = 0;
	int older = earlier_format_clean(buf, &version);
	free(buf);
	if (!ok[0] && !ok[1]) {
		if (zero || older == 1) {
			if (older == 1)
				log_info(
				    "cache device %s: written by an earlier version (format %u) "
				    "and closed clean: it holds nothing; formatted again",
				    path, version);
			*fresh = true;
		} else if (older == 0) {
			rc = dev_fail(err, len, -EINVAL,
				      "cache device %s: written by an earlier version (format %u) "
				      "and not closed clean: its log may hold data the backends "
				      "lack; start that version on it once and stop it (SIGTERM), "
				      "then this one",
				      path, version);
			goto out;
		} else {
			rc = dev_fail(
			    err, len, -EINVAL,
			    "cache device %s: no usable superblock (copy A: %s; copy B: %s); "
			    "if it holds nothing of nbdcached's, zero its first %u bytes to "
			    "have it formatted",
			    path, why[0], why[1], 2 * DEVFMT_SB_BYTES);
			goto out;
		}
	} else {
		unsigned n = ok[0] && (!ok[1] || copy[0].generation >= copy[1].generation) ? 0 : 1;
		if (!ok[n ^ 1u])
			log_warn("cache device %s: superblock copy %c is bad (%s); using copy %c",
				 path, "AB"[n ^ 1u], why[n ^ 1u], "AB"[n]);
		d->sb = copy[n];
		d->sb_newest = n;
		if (d->sb.device_bytes != d->device_bytes) {
			rc = dev_fail(err, len, -EINVAL,
				      "cache device %s: formatted for %llu bytes, it has %llu now "
				      "(another geometry): refused, its log may hold dirty data",
				      path, (unsigned long long)d->sb.device_bytes,
				      (unsigned long long)d->device_bytes);
			goto out;
		}
		l2_relayout(d);
	}
	for (uint32_t i = 0; i < d->sb.export_count; i++) {
		const struct devfmt_identity *id = &d->sb.exports[i];
		if (id->slot >= DEVFMT_MAX_EXPORTS) {
			rc =
			    dev_fail(err, len, -EINVAL, "cache device %s: export \"%s\" in slot %u",
				     path, id->name, id->slot);
			goto out;
		}
		d->slots[id->slot].used = true;
		d->slots[id->slot].id = *id;
	}
	d->tail = d->head = d->sb.checkpoint_offset;
	d->tail_seq = d->head_seq = d->sb.checkpoint_seq;
	d->tail_skip = d->sb.checkpoint_skip;
	*out = d;
	return 0;
out:
	if (d->fd >= 0)
		close(d->fd);
	if (d->rfd >= 0)
		close(d->rfd);
	free(d->path);
	free(d);
	return rc;
}

int cache_device_open(const char *path, unsigned use, unsigned wait_ms,
		      struct cache_device **out, char *err, size_t len)
{
	bool fresh;
	uint64_t until = clock_now_ns() + (uint64_t)wait_ms * 1000000u;
	int rc;
	bool said = false;
	/* Only the daemon that started this one (a live upgrade's old one)
	 * is waited for: any other holder is refused at once, naming it. */
	while ((rc = load(path, use, false, out, &fresh, err, len)) == -EBUSY && wait_ms &&
	       clock_now_ns() < until && !dev_held_by_other(path, getppid())) {
		if (!said)
			log_info("cache device %s: held by the daemon this one upgrades (PID %d): "
				 "waiting up to %u s for it to let go",
				 path, (int)getppid(), wait_ms / 1000);
		said = true;
		struct timespec ts = {0, 20 * 1000000L};
		nanosleep(&ts, NULL);
	}
	if (rc == 0 && fresh) {
		struct cache_device *d = *out;
		rc = format(d, err, len);
		if (rc < 0) {
			cache_device_close(d, false);
			return rc;
		}
		d->tail = d->head = d->sb.checkpoint_offset;
		d->tail_seq = d->head_seq = d->sb.checkpoint_seq;
	}
	return rc;
}

static void identity_of(struct devfmt_identity *id, const struct cache_device_member *m)
{
	memset(id, 0, sizeof(*id));
	snprintf(id->name, sizeof(id->name), "%s", m->name);
	snprintf(id->backend, sizeof(id->backend), "%s", m->backend_spec);
	id->block_size = m->block_size;
	id->size = m->size;
	id->kind = m->backend->ident_file ? DEVFMT_BACKEND_FILE : DEVFMT_BACKEND_OTHER;
	id->dev = m->backend->ident_dev;
	id->ino = m->backend->ident_ino;
}

/* Why two identities differ, or NULL. */
const char *dev_identity_differs(const struct devfmt_identity *a, const struct devfmt_identity *b,
				 bool size, char *buf, size_t len)
{
	if (strcmp(a->backend, b->backend) != 0)
		snprintf(buf, len, "backend %s, recorded %s", b->backend, a->backend);
	else if (size && a->size != b->size)
		snprintf(buf, len, "size %llu, recorded %llu", (unsigned long long)b->size,
			 (unsigned long long)a->size);
	else if (a->block_size != b->block_size)
		snprintf(buf, len, "block size %u, recorded %u", b->block_size, a->block_size);
	else if (a->kind != b->kind || a->dev != b->dev || a->ino != b->ino)
		snprintf(buf, len,
			 "another file (device %llu inode %llu, recorded device %llu inode %llu)",
			 (unsigned long long)b->dev, (unsigned long long)b->ino,
			 (unsigned long long)a->dev, (unsigned long long)a->ino);
	else
		return NULL;
	return buf;
}

int cache_device_discard(struct cache_device *d, const char *names)
{
	free(d->discard);
	d->discard = names ? strdup(names) : NULL;
	return names && !d->discard ? -ENOMEM : 0;
}

int cache_device_add_export(struct cache_device *d, const struct cache_device_member *m,
			    int *slot_out)
{
	const char *name = m->name;
	struct devfmt_identity id;
	*slot_out = -1;
	if (strlen(name) > DEVFMT_MAX_NAME || strlen(m->backend_spec) > DEVFMT_MAX_BACKEND) {
		log_error("cache device %s: export \"%s\": name or backend string too long to "
			  "record (at most %u and %u bytes)",
			  d->path, name, DEVFMT_MAX_NAME, DEVFMT_MAX_BACKEND);
		return -ENAMETOOLONG;
	}
	identity_of(&id, m);
	pthread_mutex_lock(&d->lock);
	int slot = -1;
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS && slot < 0; i++)
		if (d->slots[i].used && strcmp(d->slots[i].id.name, name) == 0)
			slot = (int)i;
	/* A retired export (removed by a reload, written back) gives its
	 * slot to the one a later reload adds under its name. */
	if (slot >= 0 && d->slots[slot].backend && !d->slots[slot].retired) {
		pthread_mutex_unlock(&d->lock);
		/* A reload gave the name another backend while the old one's
		 * data is still being written back: the slot's records are the
		 * old backend's, so this one is not logged (its FLUSHes go to
		 * its backend) until a restart. */
		log_warn("cache device %s: export \"%s\": its earlier backend is still being "
			 "written back; until a restart its FLUSHes go to the backend, not the "
			 "log",
			 d->path, name);
		return 0;
	}
	bool replace = slot >= 0 && d->started;
	if (slot < 0)
		for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS && slot < 0; i++)
			if (!d->slots[i].used)
				slot = (int)i;
	if (slot < 0) {
		pthread_mutex_unlock(&d->lock);
		log_error("cache device %s: export \"%s\": every one of its %u slots is taken",
			  d->path, name, (unsigned)DEVFMT_MAX_EXPORTS);
		return -ENOSPC;
	}
	struct dev_slot *s = &d->slots[slot];
	bool known = s->used;
	s->backend = m->backend;
	atomic_store_explicit(&s->shared, m->backend->shared, memory_order_relaxed);
	s->replay_gate = m->replay_gate;
	s->retired = false;
	s->configured = true;
	s->warm_all = m->warm_all;
	*slot_out = slot;
	id.slot = (uint16_t)slot;
	s->cfg = id;
	if (!known || replace)
		s->id = id;
	s->used = true;
	s->covered = d->appended;
	bool started = d->started;
	pthread_mutex_unlock(&d->lock);
	if (replace) /* the slot's level-2 pages are another backend's */
		cache_device_l2_invalidate(d, slot, 0, UINT64_MAX);
	if (!started)
		return 0; /* the table is written once the log is replayed */
	/* Added by a reload: in the table before any record of it can be. */
	pthread_mutex_lock(&d->sb_lock);
	int rc = dev_sb_update(d, false);
	pthread_mutex_unlock(&d->sb_lock);
	if (rc < 0)
		log_error("cache device %s: recording export \"%s\": %s", d->path, name,
			  strerror(-rc));
	return rc;
}

/* The superblock's checkpoint and exports as they are now. sb_lock held. */
int dev_sb_update(struct cache_device *d, bool clean)
{
	pthread_mutex_lock(&d->lock);
	d->sb.checkpoint_offset = d->tail;
	d->sb.checkpoint_seq = d->tail_seq;
	d->sb.checkpoint_skip = d->tail_skip;
	d->sb.flags = clean ? DEVFMT_SB_CLEAN : 0;
	if (d->sb.seq_floor < d->floor_due)
		d->sb.seq_floor = d->floor_due;
	d->sb.export_count = 0;
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		if (d->slots[i].used)
			d->sb.exports[d->sb.export_count++] = d->slots[i].id;
	pthread_mutex_unlock(&d->lock);
	return dev_sb_write_locked(d);
}

int cache_device_start(struct cache_device *d, char *err, size_t len)
{
	int rc = dev_l2_init(d);
	if (rc < 0)
		return dev_fail(err, len, rc, "cache device %s: its level-2 cache: %s", d->path,
				strerror(-rc));
	if ((d->use & CACHE_DEVICE_USE_L2) && !d->sb.l2_bytes)
		log_warn("cache device %s: formatted without a level-2 area (too small, or "
			 "cache-device-use was log then): no level-2 cache; zero its first 128 KiB "
			 "with nothing dirty on it to have it formatted again",
			 d->path);
	/* Before the replay and before the table of exports is rewritten: the
	 * level-2 map is read against the identities recorded. */
	dev_l2_load(d);
	rc = dev_plan(d, err, len);
	if (rc < 0)
		return rc;
	/* The table now: what is configured (slots only on the device held
	 * nothing: bind refused otherwise). */
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		struct dev_slot *s = &d->slots[i];
		if (s->backend)
			s->id = s->cfg;
		else
			s->used = false;
	}
	/* Every sequence number from here on is past any batch on the device
	 * (the floor: past those of a start that crashed before its first
	 * batch was durable, though the live log ends before them). */
	uint64_t floor = d->live_end_seq > d->sb.seq_floor ? d->live_end_seq : d->sb.seq_floor;
	d->head = d->live_end;
	d->head_seq = floor + DEV_SEQ_JUMP;
	d->sb.seq_floor = d->head_seq;
	struct dev_drain *g = d->drain;
	if (g->npieces) {
		/* The live log stays until the drain has put it on the
		 * backends: one batch held, from the checkpoint to its end;
		 * the first batch written after it says where it jumps from. */
		d->tail = d->sb.checkpoint_offset;
		d->tail_seq = d->sb.checkpoint_seq;
		d->tail_skip = d->sb.checkpoint_skip;
		d->batches = calloc(64, sizeof(*d->batches));
		if (!d->batches)
			return dev_fail(err, len, -ENOMEM, "cache device %s: out of memory",
					d->path);
		d->capbatches = 64;
		d->nbatches = 1;
		d->batches[0] = (struct dev_batch){.offset = d->tail,
						   .bytes = d->live_bytes,
						   .seq = d->tail_seq,
						   .last_rec = DEV_HELD_REC};
		d->used = d->live_bytes;
		d->epoch_due = true;
		d->epoch_prev = d->live_end_seq;
	} else {
		/* Nothing to write back: empty from here. */
		d->tail = d->head;
		d->tail_seq = d->head_seq;
		d->tail_skip = 0;
		if (d->nlive)
			cache_device_l2_before_write(d);
	}
	/* The superblock (and with it, the device flushed: every batch of the
	 * live log is durable before a later one's committed mark says so). */
	pthread_mutex_lock(&d->sb_lock);
	rc = dev_sb_update(d, false);
	pthread_mutex_unlock(&d->sb_lock);
	if (rc < 0)
		return dev_fail(err, len, rc, "cache device %s: writing its superblock: %s",
				d->path, strerror(-rc));
	if (d->nlive)
		log_info("cache device %s: %zu batch(es), %llu record(s), %llu bytes of data to "
			 "write back, planned in %.3f s (served meanwhile); the log ended at "
			 "offset %llu, batch %llu: %s",
			 d->path, d->nlive, (unsigned long long)d->st.replay_records,
			 (unsigned long long)d->st.replay_bytes, (double)d->st.replay_ns / 1e9,
			 (unsigned long long)d->live_end, (unsigned long long)d->live_end_seq,
			 d->live_why);
	if (g->npieces) {
		rc = dev_drain_start(d);
		if (rc < 0)
			return dev_fail(err, len, rc, "cache device %s: its drain: %s", d->path,
					strerror(-rc));
	} else {
		dev_drain_free(d);
	}
	d->running = true;
	rc = pthread_create(&d->thread, NULL, dev_log_thread, d);
	if (rc) {
		d->running = false;
		return dev_fail(err, len, -rc, "cache device %s: its thread: %s", d->path,
				strerror(rc));
	}
	rc = dev_l2_start(d);
	if (rc < 0)
		return dev_fail(err, len, rc, "cache device %s: its level-2 thread: %s", d->path,
				strerror(-rc));
	pthread_mutex_lock(&d->lock);
	d->started = true;
	pthread_mutex_unlock(&d->lock);
	log_info("cache device %s: intent log of %llu bytes%s, level-2 cache of %llu bytes%s%s",
		 d->path, (unsigned long long)d->sb.log_bytes,
		 d->use & CACHE_DEVICE_USE_LOG ? "" : " (not used: cache-device-use)",
		 (unsigned long long)(d->l2.pages ? d->sb.l2_bytes : 0),
		 d->use & CACHE_DEVICE_USE_L2 ? "" : " (not used: cache-device-use)",
		 d->odirect ? ", O_DIRECT" : "");
	return 0;
}

void cache_device_close(struct cache_device *d, bool clean)
{
	if (!d)
		return;
	/* Clean: everything was written back, so the drain ends (it flushes
	 * the backends and lets the live log go); else it stops where it is
	 * and the log keeps what it had not written back. */
	dev_drain_stop(d, clean);
	if (d->running) {
		pthread_mutex_lock(&d->lock);
		if (clean) {
			/* Everything is on the backends: the log is empty. */
			for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
				if (d->slots[i].backend)
					d->slots[i].covered = d->appended;
			d->checkpoint_due = true;
		}
		d->stop = true;
		pthread_cond_signal(&d->cond);
		pthread_mutex_unlock(&d->lock);
		pthread_join(d->thread, NULL);
		d->running = false;
		dev_l2_stop(d);
		int rc = -EIO;
		if (clean && d->nbatches == 0) {
			/* Every page held into the level-2 map, then the
			 * superblock. */
			dev_l2_map_close(d);
			pthread_mutex_lock(&d->sb_lock);
			rc = dev_sb_update(d, true);
			pthread_mutex_unlock(&d->sb_lock);
			if (rc == 0)
				log_info("cache device %s: closed clean", d->path);
		}
		/* Records the device holds that are older than what the
		 * backends hold now (it failed: some were never written) must
		 * not be replayed: said loudly. */
		if (rc < 0 && d->failed)
			log_error("cache device %s: its log could not be emptied after it failed; "
				  "it may hold records older than what the backends hold now: do "
				  "not use it again as it is (zero its first 128 KiB to have it "
				  "formatted)",
				  d->path);
		else if (rc < 0 && clean)
			log_error("cache device %s: marking it clean: %s", d->path, strerror(-rc));
	}
	dev_l2_free(d);
	dev_drain_free(d);
	dev_walk_done(d);
	close(d->fd);
	free(d->pend);
	free(d->pdata);
	free(d->batches);
	free(d->live);
	free(d->discard);
	free(d->path);
	pthread_mutex_destroy(&d->lock);
	pthread_mutex_destroy(&d->sb_lock);
	pthread_cond_destroy(&d->cond);
	free(d);
}

/* --check-config: a configured export's identity, from its spec alone
 * (no backend opened): a file's or block device's size, device and inode;
 * for the others the size is not known here (0: not compared). */
static void identity_of_spec(struct devfmt_identity *id, const struct export_spec *e)
{
	memset(id, 0, sizeof(*id));
	snprintf(id->name, sizeof(id->name), "%s", e->name);
	snprintf(id->backend, sizeof(id->backend), "%s", e->backend);
	id->block_size = e->block_size;
	id->kind = DEVFMT_BACKEND_OTHER;
	struct stat st;
	if (strstr(e->backend, "://") || strncmp(e->backend, "nbdkit:", 7) == 0 ||
	    strncmp(e->backend, "rbd:", 4) == 0 || stat(e->backend, &st) < 0)
		return;
	id->kind = DEVFMT_BACKEND_FILE;
	id->dev = S_ISBLK(st.st_mode) ? (uint64_t)st.st_rdev : (uint64_t)st.st_dev;
	id->ino = S_ISBLK(st.st_mode) ? 0 : (uint64_t)st.st_ino;
	id->size = (uint64_t)st.st_size;
	if (S_ISBLK(st.st_mode)) {
		int fd = open(e->backend, O_RDONLY | O_CLOEXEC);
		if (fd >= 0) {
			id->size = device_size(fd, &st);
			close(fd);
		}
	}
}

int cache_device_check(const char *path, const struct options *opts, char *text, size_t len)
{
	struct cache_device *d;
	bool fresh;
	int rc = load(path, opts->cache_device_use, true, &d, &fresh, text, len);
	if (rc < 0)
		return rc;
	if (fresh) {
		snprintf(text, len,
			 "cache device %s: %llu bytes, all zeros at its start: it would "
			 "be formatted",
			 path, (unsigned long long)d->device_bytes);
		cache_device_close(d, false);
		return 0;
	}
	if (cache_device_discard(d, opts->cache_device_discard) < 0) {
		snprintf(text, len, "cache device %s: out of memory", path);
		cache_device_close(d, false);
		return -ENOMEM;
	}
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *e = &opts->exports[i];
		if (options_backend_first(opts, i) != i || e->cache_mode == CACHE_MODE_NONE)
			continue;
		for (unsigned k = 0; k < DEVFMT_MAX_EXPORTS; k++) {
			struct dev_slot *s = &d->slots[k];
			if (!s->used || strcmp(s->id.name, e->name) != 0)
				continue;
			identity_of_spec(&s->cfg, e);
			if (s->cfg.kind != DEVFMT_BACKEND_FILE) {
				/* Not opened here: what cannot be known is not compared. */
				s->cfg.kind = s->id.kind;
				s->cfg.size = s->id.size;
			}
			s->configured = true;
		}
	}
	rc = cache_device_bind(d, text, len);
	if (rc == 0)
		rc = dev_check_data(d, text, len);
	if (rc == 0) {
		size_t at = (size_t)snprintf(text, len,
					     "cache device %s: %llu bytes of log, %zu "
					     "batch(es) to replay",
					     path, (unsigned long long)d->sb.log_bytes, d->nlive);
		for (unsigned k = 0; k < DEVFMT_MAX_EXPORTS && at < len; k++)
			if (d->slots[k].live_records)
				at += (size_t)snprintf(
				    text + at, len - at,
				    "; export \"%s\": %llu bytes in %llu record(s)%s",
				    d->slots[k].id.name, (unsigned long long)d->slots[k].live_bytes,
				    (unsigned long long)d->slots[k].live_records,
				    d->slots[k].discard
					? ", thrown away (cache-device-discard-dirty)"
					: "");
		if (at < len)
			snprintf(text + at, len - at, "; %llu bytes of level-2 area%s",
				 (unsigned long long)d->sb.l2_bytes,
				 !(d->use & CACHE_DEVICE_USE_L2) ? " (not used: cache-device-use)"
				 : dev_l2_map_kept(d)		 ? ", warm: its map is kept"
								 : ", cold: no map kept");
	}
	cache_device_close(d, false);
	return rc;
}
