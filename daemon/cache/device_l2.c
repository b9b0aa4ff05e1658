/*
 * daemon/cache/device_l2.c: a cache device's level-2 cache (device.h): clean
 * pages evicted from RAM, kept in the device's level-2 area and read back
 * on a RAM miss instead of from the backend.
 *
 * The area is a ring of DEVFMT_BLOCK pages written in order (as OpenZFS's
 * L2ARC): what is written next overwrites the oldest, which is its
 * eviction. In memory: the owner of each page (its key: export slot and
 * block, 0 when free), a counter per page bumped whenever it is rewritten
 * (its epoch), and a hash table from key to page. On the device, the
 * level-2 map says which pages hold what (device_l2_map.c): a page enters
 * it once its bytes are durable, and leaves it durably before it is
 * written over or the backend's bytes there change, so a start after a
 * crash finds the cache warm.
 *
 * Storing: an evicted entry's uptodate pages are copied (under its shard
 * lock, cache_device_l2_store) into a staged item, and the level-2 thread
 * writes staged items to the ring, then enters their pages. Staging is
 * bounded (L2_STAGE_MAX bytes): past it a page is not stored, never waited
 * for.
 *
 * Never stale: every write, zero or trim of an export's range (as it
 * enters the cache under a shard lock, or goes direct) removes the pages
 * it covers from the table and cancels staged and in-flight items over
 * them before a later fill could see them (cache_device_l2_invalidate). A
 * read from the area snapshots each page's epoch and owner, and once its
 * data is in checks both again: a page rewritten meanwhile makes the read
 * fall back to the backend.
 *
 * Never corrupt: each page's CRC32C is taken from the bytes written (in
 * memory, and in the map on the device), and checked on every read: a
 * page whose bytes do not match (the device flipped them, or something
 * wrote the area) is a miss, counted, said (rate-limited) and forgotten;
 * the fill reads the backend, so the bytes are never served nor merged
 * into a write.
 *
 * Lock: l2.lock, a leaf (taken under a shard lock and the evict lock).
 * Reading pages back on a miss: device_l2_read.c.
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "daemon/log.h"

/* Staged bytes at most (copies waiting for the level-2 thread). */
#define L2_STAGE_MAX (32u << 20)
/* The map takes the pages written since it last did after this many
 * bytes (or an eighth of the area), or once the ring has been idle this
 * long. */
#define L2_MARK_BYTES (64u << 20)
#define L2_MARK_NS 200000000ull
static size_t key_hash(const struct dev_l2 *l, uint64_t key)
{
	key ^= key >> 33;
	key *= 0xff51afd7ed558ccdull;
	key ^= key >> 33;
	return (size_t)key & l->hmask;
}

/* ---- the table: key -> page, open addressing, linear probing ---- */

bool dev_l2_table_get(const struct dev_l2 *l, uint64_t key, uint32_t *page)
{
	for (size_t i = key_hash(l, key);; i = (i + 1) & l->hmask) {
		if (l->hkeys[i] == 0)
			return false;
		if (l->hkeys[i] == key) {
			*page = l->hpages[i];
			return true;
		}
	}
}

void dev_l2_table_put(struct dev_l2 *l, uint64_t key, uint32_t page)
{
	size_t i = key_hash(l, key);
	while (l->hkeys[i] != 0 && l->hkeys[i] != key)
		i = (i + 1) & l->hmask;
	if (l->hkeys[i] == 0)
		atomic_store_explicit(&l->valid_hint, ++l->valid, memory_order_relaxed);
	l->hkeys[i] = key;
	l->hpages[i] = page;
}

/* Remove key (backward shift: no tombstones). */
static void table_remove(struct dev_l2 *l, uint64_t key)
{
	size_t i = key_hash(l, key);
	while (l->hkeys[i] != key) {
		if (l->hkeys[i] == 0)
			return;
		i = (i + 1) & l->hmask;
	}
	atomic_store_explicit(&l->valid_hint, --l->valid, memory_order_relaxed);
	for (size_t j = (i + 1) & l->hmask;; j = (j + 1) & l->hmask) {
		if (l->hkeys[j] == 0)
			break;
		size_t home = key_hash(l, l->hkeys[j]);
		/* j's entry may move to i if its home is not in (i, j]. */
		bool between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
		if (between)
			continue;
		l->hkeys[i] = l->hkeys[j];
		l->hpages[i] = l->hpages[j];
		i = j;
	}
	l->hkeys[i] = 0;
}

/* The map stops claiming page p (lock held): a removal a backend write
 * waits for (cache_device_l2_before_write). */
static void page_unmap(struct dev_l2 *l, uint32_t p)
{
	if (l->pstate && (l->pstate[p] & L2P_MAPPED)) {
		dev_l2_map_dirty(l, p);
		atomic_fetch_add(&l->removals, 1);
		l->pstate[p] &= (uint8_t)~L2P_MAPPED; /* L2P_UNMAPPED stays */
	}
}

/* Page p no longer holds what its owner says (lock held). */
static void page_free(struct dev_l2 *l, uint32_t p)
{
	page_unmap(l, p);
	l->pstate[p] = 0;
	if (l->owner[p]) {
		table_remove(l, l->owner[p]);
		l->owner[p] = 0;
	}
}

void dev_l2_page_forget_locked(struct dev_l2 *l, uint32_t p)
{
	page_free(l, p);
}

/* ---- set up and tear down ---- */

static void table_free(struct dev_l2 *l)
{
	free(l->owner);
	free(l->epoch);
	free(l->crc);
	free(l->hkeys);
	free(l->hpages);
	free(l->pstate);
	free(l->mdirty);
	free(l->mbuf);
	l->mbuf = NULL;
	l->owner = l->hkeys = NULL;
	l->epoch = l->hpages = l->crc = NULL;
	l->pstate = l->mdirty = NULL;
}

/* Every page forgotten, the cache off (lock held): the device's map must
 * be given up before a backend write (cache_device_l2_before_write). */
static void table_clear_locked(struct dev_l2 *l)
{
	atomic_store(&l->on, false);
	if (l->pages) {
		memset(l->owner, 0, (size_t)l->pages * sizeof(*l->owner));
		memset(l->hkeys, 0, (l->hmask + 1) * sizeof(*l->hkeys));
		memset(l->pstate, 0, l->pages);
	}
	atomic_store(&l->void_due, true);
	l->valid = 0;
	atomic_store_explicit(&l->valid_hint, 0, memory_order_relaxed);
}

bool cache_device_l2_on(struct cache_device *d)
{
	return atomic_load_explicit(&d->l2.on, memory_order_acquire);
}

int dev_l2_init(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	pthread_mutex_init(&l->lock, NULL);
	pthread_cond_init(&l->cond, NULL);
	pthread_cond_init(&l->idle, NULL);
	pthread_mutex_init(&l->map_lock, NULL);
	l->inited = true;
	if (!(d->use & CACHE_DEVICE_USE_L2) || !d->sb.l2_bytes) {
		/* Not kept true from now on: a later start must not use it. */
		if (d->sb.l2_bytes)
			dev_l2_map_void(d, false);
		return 0;
	}
	/* Its table in memory: about 40 bytes per page. Where it cannot be
	 * had (a huge area on a 32-bit machine), no level-2 cache, said. */
	uint64_t pages = d->sb.l2_bytes / DEVFMT_BLOCK, slots = 1;
	while (slots < pages * 2)
		slots <<= 1;
	if (slots > SIZE_MAX / sizeof(uint64_t) / 2 || pages > SIZE_MAX / sizeof(uint64_t)) {
		log_warn("cache device %s: a level-2 area of %llu pages needs more memory than "
			 "this process can address; no level-2 cache",
			 d->path, (unsigned long long)pages);
		dev_l2_map_void(d, false);
		return 0;
	}
	uint64_t mblocks = (pages + DEVFMT_L2M_PER_BLOCK - 1) / DEVFMT_L2M_PER_BLOCK;
	l->owner = calloc((size_t)pages, sizeof(*l->owner));
	l->epoch = calloc((size_t)pages, sizeof(*l->epoch));
	l->crc = calloc((size_t)pages, sizeof(*l->crc));
	l->hkeys = calloc((size_t)slots, sizeof(*l->hkeys));
	l->hpages = calloc((size_t)slots, sizeof(*l->hpages));
	l->pstate = calloc((size_t)pages, 1);
	l->mdirty = calloc((size_t)mblocks, 1);
	l->mbuf = dev_aligned(DEV_L2_MAP_CHUNK * DEVFMT_BLOCK);
	if (!l->owner || !l->epoch || !l->crc || !l->hkeys || !l->hpages || !l->pstate ||
	    !l->mdirty || !l->mbuf) {
		log_warn("cache device %s: no memory for the table of a level-2 area of %llu "
			 "pages (%llu MiB); no level-2 cache",
			 d->path, (unsigned long long)pages,
			 (unsigned long long)((pages * 17 + slots * 12) >> 20));
		table_free(l);
		dev_l2_map_void(d, false);
		return 0;
	}
	l->offset = d->sb.l2_offset;
	l->pages = (uint32_t)pages;
	l->hmask = (size_t)slots - 1;
	l->map_offset = d->sb.l2_map_offset;
	l->mblocks = (uint32_t)mblocks;
	return 0;
}

static void *l2_thread(void *arg);

int dev_l2_start(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->pages || l->st_failed)
		return 0;
	l->running = true;
	int rc = pthread_create(&l->thread, NULL, l2_thread, d);
	if (rc) {
		l->running = false;
		return -rc;
	}
	atomic_store_explicit(&l->on, true, memory_order_release);
	return 0;
}

static void items_free(struct dev_l2_item *it)
{
	while (it) {
		struct dev_l2_item *next = it->next;
		free(it->data);
		free(it);
		it = next;
	}
}

void dev_l2_stop(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited || !l->running)
		return;
	pthread_mutex_lock(&l->lock);
	l->stop = true;
	pthread_cond_signal(&l->cond);
	pthread_mutex_unlock(&l->lock);
	pthread_join(l->thread, NULL);
	l->running = false;
}

void dev_l2_free(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited)
		return;
	dev_l2_stop(d);
	items_free(l->staged);
	table_free(l);
	pthread_mutex_destroy(&l->lock);
	pthread_mutex_destroy(&l->map_lock);
	pthread_cond_destroy(&l->cond);
	pthread_cond_destroy(&l->idle);
}

void dev_l2_off_locked(struct cache_device *d, int error)
{
	struct dev_l2 *l = &d->l2;
	if (l->st_failed)
		return;
	table_clear_locked(l);
	l->st_failed = true;
	log_error("cache device %s: writing its level-2 area: %s; the level-2 cache is off from "
		  "now on (misses read from the backends)",
		  d->path, strerror(-error));
}

void cache_device_l2_drain(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->running)
		return;
	pthread_mutex_lock(&l->lock);
	while (l->staged && cache_device_l2_on(d))
		pthread_cond_wait(&l->idle, &l->lock);
	pthread_mutex_unlock(&l->lock);
}

void dev_l2_detach(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited)
		return;
	pthread_mutex_lock(&l->lock);
	table_clear_locked(l);
	pthread_mutex_unlock(&l->lock);
	dev_l2_stop(d);
	/* What was staged is never written now. */
	pthread_mutex_lock(&l->lock);
	struct dev_l2_item *staged = l->staged;
	l->staged = l->staged_tail = NULL;
	l->staged_bytes = 0;
	atomic_store(&l->held, 0);
	pthread_mutex_unlock(&l->lock);
	items_free(staged);
	/* Nothing keeps the map true from now on. */
	pthread_mutex_lock(&l->map_lock);
	if (atomic_load(&l->map_live))
		dev_l2_map_void(d, true);
	pthread_mutex_unlock(&l->map_lock);
}

/* ---- storing ---- */

void cache_device_l2_store(struct cache_device *d, int slot, uint64_t offset, const void *data,
			   uint64_t length)
{
	struct dev_l2 *l = &d->l2;
	if (slot < 0 || !cache_device_l2_on(d) || offset % DEVFMT_BLOCK || length % DEVFMT_BLOCK ||
	    !length || (offset + length) / DEVFMT_BLOCK >= (1ull << DEV_L2_BLOCK_BITS))
		return;
	uint64_t block = offset / DEVFMT_BLOCK;
	uint32_t pages = (uint32_t)(length / DEVFMT_BLOCK);
	pthread_mutex_lock(&l->lock);
	/* Pages the area holds already (read from it, evicted again): the same
	 * bytes, nothing to write. Only a whole item is left out. */
	uint32_t held = 0, p;
	for (uint32_t i = 0; i < pages; i++)
		held += dev_l2_table_get(l, dev_l2_key((unsigned)slot, block + i), &p);
	bool full = l->staged_bytes + length > L2_STAGE_MAX || pages > l->pages / 4;
	if (held == pages || full) {
		if (full)
			l->st.l2_dropped_bytes += length;
		pthread_mutex_unlock(&l->lock);
		return;
	}
	l->staged_bytes += length;
	/* Counted as held from here, before direct[] is read below: a direct
	 * write's direct_begin either sees it (and takes the lock to cancel
	 * it) or counted itself before this store reads direct[]. */
	atomic_fetch_add(&l->held, 1);
	pthread_mutex_unlock(&l->lock);
	struct dev_l2_item *it = calloc(1, sizeof(*it) + (size_t)pages * sizeof(it->crc[0]));
	uint8_t *buf = it ? dev_aligned(length) : NULL;
	pthread_mutex_lock(&l->lock);
	if (!buf || !cache_device_l2_on(d)) {
		l->staged_bytes -= length;
		l->st.l2_dropped_bytes += buf ? 0 : length;
		atomic_fetch_sub(&l->held, 1);
		if (!l->staged)
			pthread_cond_broadcast(&l->idle);
		pthread_mutex_unlock(&l->lock);
		free(buf);
		free(it);
		return;
	}
	/* Copied and queued under the level-2 lock: from the moment its bytes
	 * are taken, an invalidation of the range finds the item. */
	memcpy(buf, data, length);
	/* A direct write to this export being made may have read these bytes
	 * before it wrote (it removes them when it is done, from the table,
	 * not from what the device's map could claim meanwhile). */
	it->unmapped = atomic_load(&l->direct[slot]) != 0;
	it->slot = (uint16_t)slot;
	it->block = block;
	it->pages = pages;
	it->data = buf;
	it->next = NULL;
	if (l->staged_tail)
		l->staged_tail->next = it;
	else
		l->staged = it;
	l->staged_tail = it;
	pthread_cond_signal(&l->cond);
	pthread_mutex_unlock(&l->lock);
}

static void mark_written(struct cache_device *d);

/*
 * Before the ring writes over [start, start + pages): the map stops
 * claiming them, durably (and the pages after them, a 64th of the area
 * or the item: one map write per stretch; a crash then loses at most that
 * much of what the area holds). Lock held, dropped meanwhile; false if
 * the level-2 cache went off.
 */
static bool clear_ahead(struct cache_device *d, uint32_t start, uint32_t pages)
{
	struct dev_l2 *l = &d->l2;
	if (!l->map_offset || (uint64_t)start + pages <= l->clear_hi)
		return true;
	uint64_t hi = (uint64_t)start + (pages > l->pages / 64 ? pages : l->pages / 64);
	if (hi > l->pages)
		hi = l->pages;
	for (uint32_t p = start; p < hi; p++)
		page_unmap(l, p);
	pthread_mutex_unlock(&l->lock);
	int rc = dev_l2_map_write(d, false);
	pthread_mutex_lock(&l->lock);
	if (rc < 0 || !cache_device_l2_on(d))
		return false;
	l->clear_hi = (uint32_t)hi;
	return true;
}

/* Write one item to the ring and enter its pages (the level-2 thread; lock
 * held on entry and exit, dropped for the writes). */
static void write_item(struct cache_device *d, struct dev_l2_item *it)
{
	struct dev_l2 *l = &d->l2;
	l->writing = it;
	if ((uint64_t)l->head + it->pages > l->pages) {
		/* The map takes what was written up to here first: what it takes
		 * never spans the wrap, nor the pages past the head it skips,
		 * which stay as they are for a lap. */
		if (l->since_mark)
			mark_written(d);
		l->head = 0;
		l->mark_from = 0;
		l->clear_hi = 0;
	}
	uint32_t start = l->head;
	if (!clear_ahead(d, start, it->pages) || it->cancelled) {
		l->writing = NULL;
		return;
	}
	for (uint32_t i = 0; i < it->pages; i++) {
		page_free(l, start + i);
		l->epoch[start + i]++;
	}
	l->head = (uint64_t)start + it->pages == l->pages ? 0 : start + it->pages;
	pthread_mutex_unlock(&l->lock);
	for (uint32_t i = 0; i < it->pages; i++)
		it->crc[i] = devfmt_crc32c(0, it->data + (size_t)i * DEVFMT_BLOCK, DEVFMT_BLOCK);
	uint64_t t0 = clock_now_ns();
	int rc = dev_pwrite_all(d->fd, it->data, (size_t)it->pages * DEVFMT_BLOCK,
				l->offset + (uint64_t)start * DEVFMT_BLOCK);
	uint64_t t1 = clock_now_ns();
	pthread_mutex_lock(&l->lock);
	l->writing = NULL;
	if (rc < 0) {
		dev_l2_off_locked(d, rc);
		return;
	}
	l->st.l2_write_ns += t1 - t0;
	if (l->since_mark == 0)
		l->mark_due = t1 + L2_MARK_NS;
	l->since_mark += (uint64_t)it->pages * DEVFMT_BLOCK;
	if (it->cancelled || !cache_device_l2_on(d))
		return; /* written over meanwhile, or the level-2 cache went off */
	for (uint32_t i = 0; i < it->pages; i++) {
		uint64_t key = dev_l2_key(it->slot, it->block + i);
		uint32_t old;
		if (dev_l2_table_get(l, key, &old)) {
			page_unmap(l, old);
			l->pstate[old] = 0;
			l->owner[old] = 0;
		}
		dev_l2_table_put(l, key, start + i);
		l->owner[start + i] = key;
		l->crc[start + i] = it->crc[i];
		l->pstate[start + i] = it->unmapped ? L2P_UNMAPPED : 0;
	}
	l->st.l2_stored_bytes += (uint64_t)it->pages * DEVFMT_BLOCK;
}

/*
 * The map takes the pages the ring wrote since it last did: their bytes
 * made durable first, then claimed. Lock held, dropped meanwhile.
 */
static void mark_written(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	uint32_t from = l->mark_from, to = l->head;
	if (!l->map_offset) {
		l->since_mark = 0;
		return;
	}
	pthread_mutex_unlock(&l->lock);
	int rc = dev_sync(d);
	pthread_mutex_lock(&l->lock);
	if (rc < 0 || !cache_device_l2_on(d)) {
		if (rc < 0)
			dev_l2_off_locked(d, rc);
		l->since_mark = 0;
		return;
	}
	for (uint32_t p = from, n = 0; p != to && n < l->pages;
	     p = p + 1 == l->pages ? 0 : p + 1, n++)
		if (l->owner[p] && !(l->pstate[p] & (L2P_MAPPED | L2P_UNMAPPED))) {
			l->pstate[p] |= L2P_MAPPED;
			dev_l2_map_dirty(l, p);
		}
	l->mark_from = to;
	pthread_mutex_unlock(&l->lock);
	dev_l2_map_write(d, false);
	pthread_mutex_lock(&l->lock);
	/* Only now: what it wrote is in the map on the device (the stats'
	 * map_pending_bytes). */
	l->since_mark = 0;
}

static void *l2_thread(void *arg)
{
	struct cache_device *d = arg;
	struct dev_l2 *l = &d->l2;
	uint64_t mark_bytes = (uint64_t)l->pages * DEVFMT_BLOCK / 8;
	if (mark_bytes > L2_MARK_BYTES)
		mark_bytes = L2_MARK_BYTES;
	pthread_mutex_lock(&l->lock);
	while (!l->stop) {
		struct dev_l2_item *it = l->staged;
		if (l->since_mark && cache_device_l2_on(d) &&
		    (l->since_mark >= mark_bytes || clock_now_ns() >= l->mark_due)) {
			mark_written(d);
			continue;
		}
		if (!it) {
			if (l->since_mark) {
				struct timespec ts;
				clock_gettime(CLOCK_REALTIME, &ts);
				ts.tv_nsec += (long)(L2_MARK_NS / 4);
				if (ts.tv_nsec >= 1000000000L) {
					ts.tv_sec++;
					ts.tv_nsec -= 1000000000L;
				}
				pthread_cond_timedwait(&l->cond, &l->lock, &ts);
			} else {
				pthread_cond_wait(&l->cond, &l->lock);
			}
			continue;
		}
		l->staged = it->next;
		if (!l->staged)
			l->staged_tail = NULL;
		if (!it->cancelled && cache_device_l2_on(d))
			write_item(d, it);
		l->staged_bytes -= (uint64_t)it->pages * DEVFMT_BLOCK;
		atomic_fetch_sub(&l->held, 1);
		if (!l->staged)
			pthread_cond_broadcast(&l->idle);
		pthread_mutex_unlock(&l->lock);
		free(it->data);
		free(it);
		pthread_mutex_lock(&l->lock);
	}
	pthread_mutex_unlock(&l->lock);
	return NULL;
}

/* ---- invalidating ---- */

static bool item_overlaps(const struct dev_l2_item *it, unsigned slot, uint64_t first,
			  uint64_t last)
{
	return it->slot == slot && it->block <= last && it->block + it->pages - 1 >= first;
}

void dev_l2_forget(struct cache_device *d, unsigned slot, uint64_t offset, uint64_t length)
{
	struct dev_l2 *l = &d->l2;
	if (!length || !l->pages)
		return;
	if (!atomic_load(&l->held) && !atomic_load_explicit(&l->valid_hint, memory_order_relaxed))
		return; /* nothing staged, written or held (also once it is off) */
	uint64_t first = offset / DEVFMT_BLOCK;
	uint64_t end = offset + length < offset ? UINT64_MAX : offset + length;
	uint64_t last = (end - 1) / DEVFMT_BLOCK;
	pthread_mutex_lock(&l->lock);
	for (struct dev_l2_item *it = l->staged; it; it = it->next)
		if (item_overlaps(it, slot, first, last))
			it->cancelled = true;
	if (l->writing && item_overlaps(l->writing, slot, first, last))
		l->writing->cancelled = true;
	uint64_t gone = 0;
	if (last - first < l->pages) {
		for (uint64_t b = first; b <= last && b < (1ull << DEV_L2_BLOCK_BITS); b++) {
			uint32_t p;
			if (dev_l2_table_get(l, dev_l2_key(slot, b), &p)) {
				page_free(l, p);
				gone++;
			}
		}
	} else {
		/* A range wider than what the area holds: walk the area. */
		for (uint32_t p = 0; p < l->pages; p++) {
			uint64_t k = l->owner[p];
			if (k && dev_l2_key_slot(k) == slot && dev_l2_key_block(k) >= first &&
			    dev_l2_key_block(k) <= last) {
				page_free(l, p);
				gone++;
			}
		}
	}
	l->st.l2_invalidated_bytes += gone * DEVFMT_BLOCK;
	pthread_mutex_unlock(&l->lock);
}

void cache_device_l2_invalidate(struct cache_device *d, int slot, uint64_t offset, uint64_t length)
{
	if (slot >= 0)
		dev_l2_forget(d, (unsigned)slot, offset, length);
}

void cache_device_l2_before_write(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited || !atomic_load(&l->map_live))
		return;
	if (!atomic_load(&l->void_due) && atomic_load(&l->removals) == atomic_load(&l->persisted))
		return;
	dev_l2_map_write(d, false);
}

void cache_device_l2_remove(struct cache_device *d, int slot, uint64_t offset, uint64_t length)
{
	cache_device_l2_invalidate(d, slot, offset, length);
	cache_device_l2_before_write(d);
}

void cache_device_l2_direct_begin(struct cache_device *d, int slot, uint64_t offset,
				  uint64_t length)
{
	if (slot < 0 || !d->l2.pages)
		return;
	atomic_fetch_add(&d->l2.direct[slot], 1);
	cache_device_l2_remove(d, slot, offset, length);
}

void cache_device_l2_direct_end(struct cache_device *d, int slot, uint64_t offset, uint64_t length)
{
	if (slot < 0 || !d->l2.pages)
		return;
	/* Entries evicted while the backend wrote were staged with the bytes
	 * from before. */
	cache_device_l2_invalidate(d, slot, offset, length);
	atomic_fetch_sub(&d->l2.direct[slot], 1);
}

void dev_l2_stats(struct cache_device *d, struct cache_device_stats *out)
{
	struct dev_l2 *l = &d->l2;
	if (!l->inited)
		return;
	pthread_mutex_lock(&l->lock);
	out->l2_bytes = (uint64_t)l->pages * DEVFMT_BLOCK;
	out->l2_used = l->valid * DEVFMT_BLOCK;
	out->l2_staged = l->staged_bytes;
	out->l2_on = cache_device_l2_on(d);
	out->l2_failed = l->st_failed;
	out->l2_hits = l->st.l2_hits;
	out->l2_hit_bytes = l->st.l2_hit_bytes;
	out->l2_misses = atomic_load_explicit(&l->misses, memory_order_relaxed);
	out->l2_skipped = atomic_load_explicit(&l->skipped, memory_order_relaxed);
	out->l2_small_read_ns = atomic_load_explicit(&l->small_read_ns, memory_order_relaxed);
	out->l2_stale = l->st.l2_stale;
	out->l2_read_errors = l->st.l2_read_errors;
	out->l2_checksum_errors = l->st.l2_checksum_errors;
	out->l2_stored_bytes = l->st.l2_stored_bytes;
	out->l2_dropped_bytes = l->st.l2_dropped_bytes;
	out->l2_invalidated_bytes = l->st.l2_invalidated_bytes;
	out->l2_loaded_bytes = l->st.l2_loaded_bytes;
	out->l2_load_ns = l->st.l2_load_ns;
	out->l2_write_ns = l->st.l2_write_ns;
	out->l2_map_writes = l->st.l2_map_writes;
	out->l2_map_ns = l->st.l2_map_ns;
	out->l2_map_pending = l->since_mark;
	pthread_mutex_unlock(&l->lock);
}
