/*
 * daemon/cache/exports.c: the cache's exports (the index layer,
 * internal.h): adding one, its policy (mode, watermarks) changed live,
 * retiring it once it is gone, and what the rest of the daemon asks of its
 * durability. An export stays on the cache's list until cache_destroy
 * (struct cache_export, retired).
 */
#include <errno.h>
#include <stdlib.h>

#include "daemon/cache/internal.h"

int cache_export_add(struct cache *c, struct backend *be, const struct export_spec *spec,
		     struct cache_export **out)
{
	struct cache_export *ce = calloc(1, sizeof(*ce));
	if (!ce)
		return -ENOMEM;
	ce->latency = calloc(c->latency_slots, sizeof(*ce->latency));
	if (!ce->latency) {
		free(ce);
		return -ENOMEM;
	}
	ce->cache = c;
	ce->backend = be;
	ce->size = be->size;
	ce->block_size = spec->block_size;
	ce->block_shift = (unsigned)__builtin_ctz(spec->block_size);
	ce->min_order = ce->block_shift > ARENA_FRAME_SHIFT ? ce->block_shift - ARENA_FRAME_SHIFT : 0;
	ce->mode = spec->cache_mode;
	ce->seq_cutoff = spec->seq_cutoff;
	ce->l2_policy = spec->cache_device_l2;
	ce->device_slot = -1;
	/* Mode none caches nothing and logs nothing (it never leaves it). */
	if (c->device && spec->cache_mode != CACHE_MODE_NONE) {
		struct cache_device_member m = {
		    .name = spec->name,
		    .backend_spec = spec->backend,
		    .backend = ce->backend,
		    .size = atomic_load(&ce->size),
		    .block_size = ce->block_size,
		    .warm_all = spec->cache_device_warm_all,
		    .replay_gate = &ce->replay_gate,
		};
		int rc = cache_device_add_export(c->device, &m, &ce->device_slot);
		if (rc < 0) {
			free(ce->latency);
			free(ce);
			return rc;
		}
	}
	cache_export_set_watermarks(ce, spec->dirty_high, spec->dirty_low);
	pthread_mutex_init(&ce->lock, NULL);
	pthread_mutex_lock(&c->exports_lock);
	ce->id = ++c->export_count;
	ce->next = c->exports;
	c->exports = ce;
	pthread_mutex_unlock(&c->exports_lock);
	*out = ce;
	return 0;
}

enum cache_mode cache_export_mode(const struct cache_export *ce)
{
	return atomic_load(&ce->mode);
}

void cache_export_set_mode(struct cache_export *ce, enum cache_mode mode)
{
	atomic_store(&ce->mode, mode);
	cache_kick_writeback(ce->cache); /* dirty data left by writeback mode goes sooner */
}

void cache_export_set_watermarks(struct cache_export *ce, unsigned high_pct, unsigned low_pct)
{
	uint64_t unit = ce->cache->arena.size / 100;
	atomic_store(&ce->dirty_high, unit * high_pct);
	atomic_store(&ce->dirty_low, unit * low_pct);
}

void cache_set_writeback_policy(struct cache *c, unsigned high_pct, unsigned low_pct,
				unsigned expire_seconds)
{
	atomic_store(&c->dirty_high, c->arena.size / 100 * high_pct);
	atomic_store(&c->dirty_low, c->arena.size / 100 * low_pct);
	atomic_store(&c->dirty_expire_ns, (uint64_t)expire_seconds * 1000000000u);
	cache_kick_writeback(c);
}

/*
 * Blocks whose bytes move across the change: from the old or new end,
 * whichever comes first, rounded down to a block (a partial last block
 * cached at the old end holds fewer bytes than the block). The size moves
 * first so fills started meanwhile stop at the new end; what is cached
 * past it is dropped; if any of it cannot go, the size moves back.
 */
int cache_export_resize(struct cache_export *ce, uint64_t size, uint64_t *dirty_past)
{
	/* Bytes the cache device's log found at start holds for it are not
	 * all on the backend yet (the drain writes them where they were). */
	if (atomic_load(&ce->replay_gate))
		return -EAGAIN;
	uint64_t old = atomic_load(&ce->size);
	uint64_t from = (old < size ? old : size) & ~(uint64_t)(ce->block_size - 1);
	/* The level-2 cache's pages from there on, before the size moves (a
	 * fill past the old end must not find the zeros kept there) and
	 * after (below). */
	if (ce->cache->device)
		cache_device_l2_remove(ce->cache->device, ce->device_slot, from, UINT64_MAX - from);
	atomic_store(&ce->size, size);
	uint64_t dropped, busy;
	int rc = cache_export_drop_from(ce, from, &dropped, &busy, dirty_past);
	if (rc == 0 && busy)
		rc = -EBUSY;
	if (rc == 0 && ce->cache->device) {
		/* the level-2 cache's pages past the end */
		cache_device_l2_remove(ce->cache->device, ce->device_slot, from, UINT64_MAX - from);
		/* the size the device records for it, durably, before the
		 * resize is answered */
		rc = cache_device_resize(ce->cache->device, ce->device_slot, old, size);
	}
	if (rc < 0)
		atomic_store(&ce->size, old);
	return rc;
}

int cache_export_retire(struct cache_export *ce)
{
	uint64_t dropped, kept;
	int rc = cache_export_drop_clean(ce, &dropped, &kept);
	if (rc < 0)
		return rc;
	if (kept || cache_export_unflushed(ce))
		return -EBUSY;
	if (ce->cache->device) {
		rc = cache_device_retire(ce->cache->device, ce->device_slot, &ce->retire_rec);
		if (rc != 0)
			return rc > 0 ? -EBUSY : rc;
	}
	atomic_store(&ce->retired, true);
	if (ce->cache->device) /* its level-2 pages: its slot may be another's */
		cache_device_l2_remove(ce->cache->device, ce->device_slot, 0, UINT64_MAX);
	return 0;
}

bool cache_export_on_device(const struct cache_export *ce)
{
	return ce->device_slot >= 0;
}

void cache_export_note_direct_write(struct cache_export *ce)
{
	uint64_t seq = atomic_fetch_add(&ce->backend_writes_done, 1) + 1;
	cache_note_direct_seq(ce, seq);
	cache_note_unshadowed(ce, seq); /* (mode none's: no copy kept) */
	atomic_fetch_add(&ce->direct_writes_done, 1);
}

bool cache_export_unflushed(struct cache_export *ce)
{
	/* (the cache device's live log found at start holds bytes of it not
	 * on the backend yet: a backend FLUSH waits for them) */
	return atomic_load(&ce->replay_gate) || atomic_load(&ce->counters.dirty_bytes) ||
	       atomic_load(&ce->counters.unstable_bytes) ||
	       atomic_load(&ce->backend_writes_done) != atomic_load(&ce->backend_writes_flushed);
}

uint64_t cache_export_error_seq(struct cache_export *ce)
{
	pthread_mutex_lock(&ce->lock);
	uint64_t seq = ce->error_seq;
	pthread_mutex_unlock(&ce->lock);
	return seq;
}
