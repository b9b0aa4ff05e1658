/*
 * daemon/cache/device_l2_map.c: the level-2 cache's map on the device
 * (device_l2.c has the cache itself; device_format.h the map's layout):
 * which export block each page of the area holds, kept true while the
 * daemon runs so that a start, after a clean stop or a crash, finds the
 * cache warm.
 *
 * What the map claims is always true of the device and of the backends:
 *
 * - a page enters it only after its bytes are durable (the level-2
 *   thread's mark_written: a device flush, then the map);
 * - it leaves it durably before the ring writes over it (clear_ahead) and
 *   before any backend write that could change the bytes it holds: a
 *   removal (a write, zero, trim, resize or retired slot over a claimed
 *   page) counts, and every backend write first calls
 *   cache_device_l2_before_write(), which writes the map while a removal
 *   is not in it (group commit: one write covers every removal so far);
 * - a replay's records leave it before the log is emptied (the replay
 *   removes their ranges, then writes the map);
 * - when the table is cleared (the cache turned off, a detach), the map
 *   is given up: the superblock's map generation moves on, and map blocks
 *   of another generation claim nothing.
 *
 * At start, the map's claims are used only for exports whose recorded
 * identity is the configured one, and, for a backend file, whose stamp
 * (its modification and change times, backend_stamp: never one recorded
 * within the file system's timestamp granularity of a change) is the one
 * the map's header recorded when it was last written (cache-device-warm
 * files; a backend that is not a regular file only with cache-device-warm
 * all, the export's or the global one). Claims not used are removed from
 * the map before anything else writes a backend.
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "daemon/log.h"

static uint64_t ts_ns(const struct timespec *t)
{
	return (uint64_t)t->tv_sec * 1000000000ull + (uint64_t)t->tv_nsec;
}

/*
 * A backend file's stamp (device_format.h): what the level-2 map trusts to
 * tell that nobody changed the file while the daemon was down. Its
 * modification time alone is not enough: touch -d, rsync -t and cp -p put
 * an old one back after rewriting a file; its change time cannot be set
 * so (only by the clock), and both are folded in. And neither proves
 * anything within the file system's timestamp granularity of the moment
 * it is recorded (git's "racily clean" rule): a change in the same tick
 * leaves both as they are. A file system with whole-second times (ext4
 * with 128-byte inodes, ext3, FAT with its 2 s, many NFS servers) shows no
 * nanoseconds: 2 s then, else 20 ms (a few clock ticks). Such a stamp is
 * DEVFMT_L2M_STAMP_RACY, which no start trusts; 0: not a regular file.
 */
#define STAMP_GRAIN_COARSE_NS 2000000000ull
#define STAMP_GRAIN_FINE_NS 20000000ull
static uint64_t backend_stamp(const struct devfmt_identity *id)
{
	struct stat st;
	if (id->kind != DEVFMT_BACKEND_FILE || stat(id->backend, &st) < 0 || !S_ISREG(st.st_mode))
		return 0;
	uint64_t m = ts_ns(&st.st_mtim), c = ts_ns(&st.st_ctim);
	uint64_t grain = st.st_mtim.tv_nsec == 0 && st.st_ctim.tv_nsec == 0 ? STAMP_GRAIN_COARSE_NS
									    : STAMP_GRAIN_FINE_NS;
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	if (ts_ns(&now) < (m > c ? m : c) + grain)
		return DEVFMT_L2M_STAMP_RACY;
	uint64_t h = m * 0x9e3779b97f4a7c15ull ^ (c << 29 | c >> 35) ^ c * 0xc2b2ae3d27d4eb4full;
	return h > DEVFMT_L2M_STAMP_RACY ? h : h + 2;
}

/* The header written last has a racy stamp for a slot in use. */
static bool header_racy(const struct dev_l2 *l)
{
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		if (l->stamp[i] == DEVFMT_L2M_STAMP_RACY)
			return true;
	return false;
}

void dev_l2_map_void(struct cache_device *d, bool sb_write)
{
	struct dev_l2 *l = &d->l2;
	pthread_mutex_lock(&d->sb_lock);
	d->sb.l2_map_gen++;
	int rc = sb_write ? dev_sb_update(d, false) : 0;
	pthread_mutex_unlock(&d->sb_lock);
	if (rc < 0 && l->map_offset) {
		/* A second chance: the map's header zeroed claims nothing. */
		uint8_t *z = dev_aligned(DEVFMT_BLOCK);
		int zrc = z ? 0 : -ENOMEM;
		if (z) {
			memset(z, 0, DEVFMT_BLOCK);
			zrc = dev_pwrite_all(d->fd, z, DEVFMT_BLOCK, l->map_offset);
			if (zrc == 0)
				zrc = dev_sync(d);
			free(z);
		}
		if (zrc == 0)
			rc = 0;
	}
	atomic_store(&l->map_live, false);
	atomic_store(&l->void_due, false);
	l->header_ok = false;
	if (rc < 0)
		log_error("cache device %s: giving up its level-2 map: writing its superblock "
			  "and zeroing the map's header failed: %s; the map may claim pages whose "
			  "backend bytes change from now on (as its log may hold records older "
			  "than the backends' bytes): do not use it again as it is (zero its "
			  "first 128 KiB to have it formatted)",
			  d->path, strerror(-rc));
}

/* Map block b rendered from the table into buf (lock held). */
static void render(struct cache_device *d, uint32_t b, uint8_t *buf)
{
	struct dev_l2 *l = &d->l2;
	uint64_t keys[DEVFMT_L2M_PER_BLOCK];
	uint32_t crcs[DEVFMT_L2M_PER_BLOCK];
	uint32_t first = b * DEVFMT_L2M_PER_BLOCK, n = DEVFMT_L2M_PER_BLOCK;
	if (n > l->pages - first)
		n = l->pages - first;
	for (uint32_t i = 0; i < n; i++) {
		keys[i] = (l->pstate[first + i] & L2P_MAPPED) ? l->owner[first + i] : 0;
		crcs[i] = keys[i] ? l->crc[first + i] : 0;
	}
	devfmt_l2m_block_encode(b, d->sb.l2_map_gen, d->sb.uuid, keys, crcs, n, buf);
}

/* The map's header as it is now (map_lock held): true if the device's
 * one says otherwise. */
static bool header_now(struct cache_device *d, struct devfmt_l2m_header *h)
{
	struct dev_l2 *l = &d->l2;
	memset(h, 0, sizeof(*h));
	h->gen = d->sb.l2_map_gen;
	struct devfmt_identity ids[DEVFMT_MAX_EXPORTS];
	bool used[DEVFMT_MAX_EXPORTS];
	pthread_mutex_lock(&d->lock);
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		used[i] = d->slots[i].used && d->slots[i].backend;
		if (used[i])
			ids[i] = d->slots[i].cfg;
	}
	pthread_mutex_unlock(&d->lock);
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		h->stamp[i] = used[i] ? backend_stamp(&ids[i]) : 0;
	return !l->header_ok || memcmp(h->stamp, l->stamp, sizeof(l->stamp)) != 0;
}

/* Write the dirty map blocks, then the header if it changed, then flush
 * (map_lock held). */
static int write_locked(struct cache_device *d, bool all)
{
	struct dev_l2 *l = &d->l2;
	if (atomic_load(&l->void_due)) {
		dev_l2_map_void(d, true);
		return -EIO;
	}
	uint8_t *buf = l->mbuf;
	/* Live before the first block is written: a backend write waits for
	 * this map from now on. */
	atomic_store(&l->map_live, true);
	uint64_t t0 = clock_now_ns(), removals = 0, blocks = 0;
	int rc = 0;
	bool first = true;
	for (uint32_t next = 0; rc == 0;) {
		uint32_t idx[DEV_L2_MAP_CHUNK], n = 0;
		pthread_mutex_lock(&l->lock);
		if (first) {
			/* Every removal so far is in a block dirty now. */
			removals = atomic_load(&l->removals);
			if (all)
				for (uint32_t p = 0; p < l->pages; p++)
					if (l->owner[p] && !(l->pstate[p] & L2P_MAPPED)) {
						l->pstate[p] = L2P_MAPPED;
						dev_l2_map_dirty(l, p);
					}
			first = false;
		}
		for (; next < l->mblocks && n < DEV_L2_MAP_CHUNK; next++)
			if (l->mdirty[next]) {
				l->mdirty[next] = 0;
				render(d, next, buf + (size_t)n * DEVFMT_BLOCK);
				idx[n++] = next;
			}
		pthread_mutex_unlock(&l->lock);
		if (!n)
			break;
		for (uint32_t i = 0; i < n && rc == 0;) {
			uint32_t j = i + 1;
			while (j < n && idx[j] == idx[j - 1] + 1)
				j++;
			rc = dev_pwrite_all(d->fd, buf + (size_t)i * DEVFMT_BLOCK,
					    (size_t)(j - i) * DEVFMT_BLOCK,
					    l->map_offset + (1 + (uint64_t)idx[i]) * DEVFMT_BLOCK);
			i = j;
		}
		blocks += n;
	}
	struct devfmt_l2m_header h;
	bool header = rc == 0 && header_now(d, &h);
	if (header) {
		devfmt_l2m_header_encode(&h, d->sb.uuid, buf);
		rc = dev_pwrite_all(d->fd, buf, DEVFMT_BLOCK, l->map_offset);
	}
	if (rc == 0 && (blocks || header))
		rc = dev_sync(d);
	if (rc < 0) {
		pthread_mutex_lock(&l->lock);
		dev_l2_off_locked(d, rc);
		pthread_mutex_unlock(&l->lock);
		dev_l2_map_void(d, true);
		return rc;
	}
	if (header) {
		memcpy(l->stamp, h.stamp, sizeof(l->stamp));
		l->header_ok = true;
	}
	if (removals > atomic_load(&l->persisted))
		atomic_store(&l->persisted, removals);
	pthread_mutex_lock(&l->lock);
	l->st.l2_map_writes += blocks || header;
	l->st.l2_map_ns += clock_now_ns() - t0;
	pthread_mutex_unlock(&l->lock);
	return 0;
}

int dev_l2_map_write(struct cache_device *d, bool all)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited || !l->map_offset || !l->pages)
		return 0;
	pthread_mutex_lock(&l->map_lock);
	int rc = write_locked(d, all);
	pthread_mutex_unlock(&l->map_lock);
	return rc;
}

/* Which slots' claims hold: configured with the identity recorded, and a
 * backend file nobody modified since the map was last written. */
static void slots_ok(struct cache_device *d, const struct devfmt_l2m_header *h, bool *ok)
{
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		const struct dev_slot *s = &d->slots[i];
		char diff[300];
		ok[i] = s->used && s->backend && s->configured &&
			dev_identity_differs(&s->id, &s->cfg, true, diff, sizeof(diff)) == NULL;
		if (ok[i] && s->backend->shared) {
			log_info(
			    "cache device %s: export \"%s\": another node may have written its "
			    "backend (%s) since this daemon last had it: its level-2 pages are "
			    "not used after a restart",
			    d->path, s->cfg.name, s->cfg.backend);
			ok[i] = false;
		} else if (ok[i] && h->stamp[i] == DEVFMT_L2M_STAMP_RACY) {
			log_info(
			    "cache device %s: export \"%s\": its backend file was changed within "
			    "its timestamp granularity of the level-2 map's last write (a later "
			    "change could not be told): its level-2 pages are not used",
			    d->path, s->cfg.name);
			ok[i] = false;
		} else if (ok[i] && h->stamp[i] && backend_stamp(&s->cfg) != h->stamp[i]) {
			log_warn(
			    "cache device %s: export \"%s\": its backend file was changed (its "
			    "modification or change time) since the level-2 map was last "
			    "written; its level-2 pages are not used",
			    d->path, s->cfg.name);
			ok[i] = false;
		} else if (ok[i] && !h->stamp[i] && !s->warm_all) {
			log_info(
			    "cache device %s: export \"%s\": a write made to its backend while "
			    "the daemon was down could not be told (not a regular file): its "
			    "level-2 pages are not used (cache-device-warm = all in its section, "
			    "or for every export, keeps them where nothing else writes it)",
			    d->path, s->cfg.name);
			ok[i] = false;
		}
	}
}

/* The claims of map blocks [b0, b0 + n) in buf entered (lock held);
 * returns the pages entered, counts what did not decode or add up. */
static uint64_t enter_blocks(struct cache_device *d, const uint8_t *buf, uint32_t b0, uint32_t n,
			     const bool *ok, uint64_t *bad_blocks, uint64_t *bad_keys)
{
	struct dev_l2 *l = &d->l2;
	uint64_t loaded = 0;
	for (uint32_t k = 0; k < n; k++) {
		uint32_t b = b0 + k;
		uint64_t keys[DEVFMT_L2M_PER_BLOCK];
		uint32_t crcs[DEVFMT_L2M_PER_BLOCK];
		char why[200];
		const uint8_t *blk = buf + (size_t)k * DEVFMT_BLOCK;
		if (blk[0] == 0 && memcmp(blk, blk + 1, DEVFMT_BLOCK - 1) == 0)
			continue; /* never written since the format: claims nothing */
		if (devfmt_l2m_block_decode(blk, b, d->sb.l2_map_gen, d->sb.uuid, keys, crcs, why,
					    sizeof(why)) < 0) {
			/* Claims nothing; written again before the ring reaches it. */
			if (!*bad_blocks)
				log_info("cache device %s: level-2 map: %s (claims nothing)",
					 d->path, why);
			(*bad_blocks)++;
			l->mdirty[b] = 1;
			continue;
		}
		for (uint32_t i = 0; i < DEVFMT_L2M_PER_BLOCK; i++) {
			uint64_t key = keys[i], p = (uint64_t)b * DEVFMT_L2M_PER_BLOCK + i;
			if (!key)
				continue;
			uint32_t old;
			if (p >= l->pages || dev_l2_table_get(l, key, &old)) {
				(*bad_keys)++;
				l->mdirty[b] = 1;
				continue;
			}
			if (!ok[dev_l2_key_slot(key)]) {
				l->mdirty[b] = 1; /* removed from the map below */
				continue;
			}
			dev_l2_table_put(l, key, (uint32_t)p);
			l->owner[p] = key;
			l->crc[p] = crcs[i];
			l->pstate[p] = L2P_MAPPED;
			loaded++;
		}
	}
	return loaded;
}

void dev_l2_load(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->pages || !l->map_offset)
		return;
	uint64_t t0 = clock_now_ns();
	size_t chunk = (size_t)DEV_L2_MAP_CHUNK * 4 * DEVFMT_BLOCK;
	uint8_t *buf = dev_aligned(chunk);
	if (!buf) {
		dev_l2_map_void(d, false);
		return;
	}
	char why[200] = "";
	struct devfmt_l2m_header h;
	int rc = dev_pread_all(d->fd, buf, DEVFMT_BLOCK, l->map_offset);
	if (rc < 0)
		snprintf(why, sizeof(why), "reading it: %s", strerror(-rc));
	else if (devfmt_l2m_header_decode(buf, d->sb.uuid, d->sb.l2_map_gen, &h, why, sizeof(why)) <
		 0)
		rc = -EINVAL;
	if (rc < 0) {
		/* Its blocks may still claim pages under this generation: a new
		 * one (the start writes the superblock before any backend). */
		log_info("cache device %s: level-2 cache cold: %s", d->path, why);
		free(buf);
		dev_l2_map_void(d, false);
		return;
	}
	bool ok[DEVFMT_MAX_EXPORTS];
	slots_ok(d, &h, ok);
	uint64_t loaded = 0, bad_blocks = 0, bad_keys = 0;
	uint32_t per = (uint32_t)(chunk / DEVFMT_BLOCK);
	for (uint32_t b = 0; b < l->mblocks && rc == 0; b += per) {
		uint32_t n = l->mblocks - b < per ? l->mblocks - b : per;
		rc = dev_pread_all(d->fd, buf, (size_t)n * DEVFMT_BLOCK,
				   l->map_offset + (1 + (uint64_t)b) * DEVFMT_BLOCK);
		if (rc < 0)
			break;
		pthread_mutex_lock(&l->lock);
		loaded += enter_blocks(d, buf, b, n, ok, &bad_blocks, &bad_keys);
		pthread_mutex_unlock(&l->lock);
	}
	free(buf);
	pthread_mutex_lock(&l->lock);
	if (rc < 0) {
		log_warn("cache device %s: reading its level-2 map: %s; the level-2 cache starts "
			 "cold",
			 d->path, strerror(-rc));
		memset(l->owner, 0, (size_t)l->pages * sizeof(*l->owner));
		memset(l->hkeys, 0, (l->hmask + 1) * sizeof(*l->hkeys));
		memset(l->pstate, 0, l->pages);
		l->valid = 0;
		atomic_store_explicit(&l->valid_hint, 0, memory_order_relaxed);
		loaded = 0;
	}
	/* The ring goes on after the highest page in use. */
	l->head = 0;
	for (uint32_t p = l->pages; p-- > 0;)
		if (l->owner[p]) {
			l->head = p + 1 == l->pages ? 0 : p + 1;
			break;
		}
	l->mark_from = l->head;
	l->clear_hi = 0;
	l->st.l2_loaded_bytes = loaded * DEVFMT_BLOCK;
	pthread_mutex_unlock(&l->lock);
	if (rc < 0) {
		dev_l2_map_void(d, false);
		return;
	}
	memcpy(l->stamp, h.stamp, sizeof(l->stamp));
	l->header_ok = true;
	atomic_store(&l->map_live, true);
	/* The claims not used leave the map before anything writes a backend
	 * (the replay included). */
	rc = dev_l2_map_write(d, false);
	l->st.l2_load_ns = clock_now_ns() - t0;
	if (rc < 0)
		log_warn("cache device %s: writing its level-2 map: %s; the level-2 cache is off",
			 d->path, strerror(-rc));
	else if (loaded)
		log_info("cache device %s: level-2 cache warm: %llu MiB in %llu ms%s", d->path,
			 (unsigned long long)(loaded * DEVFMT_BLOCK >> 20),
			 (unsigned long long)(l->st.l2_load_ns / 1000000),
			 bad_blocks || bad_keys
			     ? " (some of its map did not decode or add up and was left out)"
			     : "");
	else
		log_info("cache device %s: level-2 map read, none of its pages used: the level-2 "
			 "cache starts cold",
			 d->path);
}

void dev_l2_map_close(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited || !l->map_offset || !l->pages)
		return;
	if (atomic_load(&l->void_due)) {
		dev_l2_map_void(d, false);
		return;
	}
	if (!cache_device_l2_on(d))
		return;
	int rc = dev_sync(d);
	if (rc == 0)
		rc = dev_l2_map_write(d, true);
	/* A backend file written within its timestamp granularity of now
	 * (this stop's own writeback, most often) has a stamp that proves
	 * nothing: wait that long (2 s at most, on a file system of whole
	 * seconds) and write the header again, so that the next start is
	 * warm. */
	for (unsigned i = 0; rc == 0 && i < 25 && header_racy(l); i++) {
		struct timespec ts = {0, 100000000};
		nanosleep(&ts, NULL);
		rc = dev_l2_map_write(d, false);
	}
	if (rc < 0)
		log_error("cache device %s: writing its level-2 map: %s; the next start begins "
			  "with it cold",
			  d->path, strerror(-rc));
	else
		log_info("cache device %s: level-2 map of %llu pages (%llu MiB) kept for the next "
			 "start",
			 d->path, (unsigned long long)l->valid,
			 (unsigned long long)(l->valid * DEVFMT_BLOCK >> 20));
}

bool dev_l2_map_kept(struct cache_device *d)
{
	if (!d->sb.l2_bytes || !d->sb.l2_map_offset)
		return false;
	uint8_t *buf = dev_aligned(DEVFMT_BLOCK);
	if (!buf)
		return false;
	struct devfmt_l2m_header h;
	char why[200];
	bool kept =
	    dev_pread_all(d->fd, buf, DEVFMT_BLOCK, d->sb.l2_map_offset) == 0 &&
	    devfmt_l2m_header_decode(buf, d->sb.uuid, d->sb.l2_map_gen, &h, why, sizeof(why)) == 0;
	free(buf);
	return kept;
}
