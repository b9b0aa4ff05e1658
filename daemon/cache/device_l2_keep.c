/*
 * daemon/cache/device_l2_keep.c: the level-2 cache's table across a clean
 * restart (device_l2.c has the cache itself): written into the emptied
 * log by a clean close, read back at the next start for the exports whose
 * identity, and backend file, did not change (device_format.h has the
 * table's layout).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/log.h"

/* A backend file's modification time (0: not a regular file). */
static uint64_t backend_mtime(const struct devfmt_identity *id)
{
	struct stat st;
	if (id->kind != DEVFMT_BACKEND_FILE || stat(id->backend, &st) < 0 || !S_ISREG(st.st_mode))
		return 0;
	return (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
}

int dev_l2_save(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	d->sb.l2_table_bytes = 0;
	d->sb.l2_table_crc = 0;
	if (!l->pages || !cache_device_l2_on(d))
		return 0;
	uint64_t bytes = DEVFMT_BLOCK + (uint64_t)l->valid * DEVFMT_L2T_ENTRY;
	uint64_t alloc = (bytes + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK * DEVFMT_BLOCK;
	if (bytes > d->sb.log_bytes)
		return 0;
	uint8_t *buf = dev_aligned((size_t)alloc);
	if (!buf)
		return -ENOMEM;
	memset(buf, 0, (size_t)alloc);
	struct devfmt_l2t_header h = {.entries = 0};
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		if (d->slots[i].used && d->slots[i].ce)
			h.mtime_ns[i] = backend_mtime(&d->slots[i].id);
	uint8_t *p = buf + DEVFMT_BLOCK;
	for (uint32_t pg = 0; pg < l->pages; pg++) {
		uint64_t k = l->owner[pg];
		if (!k)
			continue;
		struct devfmt_l2t_entry e = {
		    .slot = (uint16_t)dev_l2_key_slot(k), .page = pg, .block = dev_l2_key_block(k)};
		devfmt_l2t_entry_encode(&e, p);
		p += DEVFMT_L2T_ENTRY;
		h.entries++;
	}
	devfmt_l2t_header_encode(&h, d->sb.uuid, buf);
	bytes = DEVFMT_BLOCK + h.entries * DEVFMT_L2T_ENTRY;
	int rc = dev_pwrite_all(d->fd, buf, (size_t)alloc, d->sb.log_offset);
	if (rc == 0)
		rc = dev_sync(d);
	if (rc == 0) {
		d->sb.l2_table_bytes = bytes;
		d->sb.l2_table_crc = devfmt_crc32c(0, buf, (size_t)bytes);
		log_info(
		    "cache device %s: level-2 table of %llu pages (%llu MiB) kept for the next "
		    "start",
		    d->path, (unsigned long long)h.entries,
		    (unsigned long long)(h.entries * DEVFMT_BLOCK >> 20));
	}
	free(buf);
	return rc;
}

void dev_l2_load(struct cache_device *d)
{
	struct dev_l2 *l = &d->l2;
	uint64_t bytes = d->sb.l2_table_bytes;
	if (!bytes)
		return;
	if (!(d->sb.flags & DEVFMT_SB_CLEAN) || !l->pages) {
		log_info("cache device %s: level-2 table not used (%s)", d->path,
			 l->pages ? "not closed clean" : "the level-2 cache is not in use");
		return;
	}
	uint64_t alloc = (bytes + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK * DEVFMT_BLOCK;
	uint8_t *buf = dev_aligned((size_t)alloc);
	if (!buf)
		return;
	uint64_t t0 = cache_now_ns();
	char why[200] = "";
	struct devfmt_l2t_header h;
	int rc = dev_pread_all(d->fd, buf, (size_t)alloc, d->sb.log_offset);
	if (rc < 0)
		snprintf(why, sizeof(why), "reading it: %s", strerror(-rc));
	else if (devfmt_crc32c(0, buf, (size_t)bytes) != d->sb.l2_table_crc)
		snprintf(why, sizeof(why), "its CRC32C does not match the superblock's");
	else if (devfmt_l2t_header_decode(buf, d->sb.uuid,
					  (bytes - DEVFMT_BLOCK) / DEVFMT_L2T_ENTRY, &h, why,
					  sizeof(why)) < 0)
		rc = -EINVAL;
	if (rc < 0 || why[0]) {
		log_warn("cache device %s: level-2 table not used: %s", d->path, why);
		free(buf);
		return;
	}
	/* Which slots' pages hold: configured with the identity recorded, and a
	 * backend file nobody modified since the close. */
	bool ok[DEVFMT_MAX_EXPORTS];
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		const struct dev_slot *s = &d->slots[i];
		char diff[300];
		ok[i] = s->used && s->ce && s->configured &&
			dev_identity_differs(&s->id, &s->cfg, diff, sizeof(diff)) == NULL;
		if (ok[i] && h.mtime_ns[i] && backend_mtime(&s->cfg) != h.mtime_ns[i]) {
			log_warn("cache device %s: export \"%s\": its backend file was modified "
				 "since the last close; its level-2 pages are not used",
				 d->path, s->cfg.name);
			ok[i] = false;
		} else if (ok[i] && !h.mtime_ns[i] && !d->warm_all) {
			log_info(
			    "cache device %s: export \"%s\": a write made to its backend while "
			    "the daemon was down could not be told (not a regular file): its "
			    "level-2 pages are not used (cache-device-warm all keeps them)",
			    d->path, s->cfg.name);
			ok[i] = false;
		}
	}
	uint64_t loaded = 0, bad = 0;
	pthread_mutex_lock(&l->lock);
	for (uint64_t i = 0; i < h.entries; i++) {
		struct devfmt_l2t_entry e;
		if (devfmt_l2t_entry_decode(buf + DEVFMT_BLOCK + i * DEVFMT_L2T_ENTRY, l->pages,
					    &e) < 0 ||
		    e.block >= (1ull << DEV_L2_BLOCK_BITS) || l->owner[e.page]) {
			bad++;
			continue;
		}
		if (!ok[e.slot])
			continue;
		uint64_t key = dev_l2_key(e.slot, e.block);
		uint32_t old;
		if (dev_l2_table_get(l, key, &old)) {
			bad++;
			continue;
		}
		dev_l2_table_put(l, key, e.page);
		l->owner[e.page] = key;
		loaded++;
	}
	/* The ring goes on after the highest page in use. */
	l->head = 0;
	for (uint32_t p = l->pages; p-- > 0;)
		if (l->owner[p]) {
			l->head = p + 1 == l->pages ? 0 : p + 1;
			break;
		}
	l->st.l2_loaded_bytes = loaded * DEVFMT_BLOCK;
	l->st.l2_load_ns = cache_now_ns() - t0;
	pthread_mutex_unlock(&l->lock);
	free(buf);
	if (loaded)
		log_info("cache device %s: level-2 cache warm: %llu MiB in %llu ms%s", d->path,
			 (unsigned long long)(loaded * DEVFMT_BLOCK >> 20),
			 (unsigned long long)(l->st.l2_load_ns / 1000000),
			 bad ? " (some entries of the table did not add up and were left out)"
			     : "");
	else
		log_info("cache device %s: level-2 table read, none of its %llu pages used: the "
			 "level-2 cache starts cold",
			 d->path, (unsigned long long)h.entries);
}
