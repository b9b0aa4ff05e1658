/*
 * daemon/cache/dirty.c: per-block dirty state, and the export's dirty and
 * unstable lists that follow it (the index layer, internal.h; the
 * durability model: cache.h). Every function here but cache_list_pin runs
 * under the entry's shard lock and takes the export lock for the lists.
 */
#include <errno.h>
#include <stdlib.h>

#include "daemon/cache/internal.h"

void cache_mark_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_export *ce = e->ce;
	uint64_t *dirty = cache_dirty_map(e);
	uint32_t added = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (!bit_test(dirty, b)) {
			bit_set(dirty, b);
			added++;
		}
	}
	e->ndirty += added;
	cache_dirty_bytes_add(ce, (uint64_t)added << ce->block_shift);
	if (e->on_dirty_list)
		return;
	pthread_mutex_lock(&ce->lock);
	e->dirty_next = NULL;
	e->dirty_prev = ce->dirty_tail;
	if (ce->dirty_tail)
		ce->dirty_tail->dirty_next = e;
	else
		ce->dirty_head = e;
	ce->dirty_tail = e;
	e->on_dirty_list = true;
	e->dirty_since = cache_now_ns();
	pthread_mutex_unlock(&ce->lock);
}

void cache_clear_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_export *ce = e->ce;
	uint64_t *dirty = cache_dirty_map(e);
	uint32_t removed = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (bit_test(dirty, b)) {
			bit_clear(dirty, b);
			removed++;
		}
	}
	e->ndirty -= removed;
	cache_dirty_bytes_sub(ce, (uint64_t)removed << ce->block_shift);
}

void cache_dirty_list_remove(struct cache_export *ce, struct cache_entry *e)
{
	if (e->dirty_prev)
		e->dirty_prev->dirty_next = e->dirty_next;
	else
		ce->dirty_head = e->dirty_next;
	if (e->dirty_next)
		e->dirty_next->dirty_prev = e->dirty_prev;
	else
		ce->dirty_tail = e->dirty_prev;
	e->on_dirty_list = false;
}

void cache_dirty_list_update(struct cache_entry *e)
{
	if (!e->on_dirty_list || e->ndirty || e->writeback)
		return;
	struct cache_export *ce = e->ce;
	pthread_mutex_lock(&ce->lock);
	cache_dirty_list_remove(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* ---- unstable state: written back, not yet flushed ---- */

/* Export lock held, e on the unstable list. */
static void unstable_list_unlink(struct cache_export *ce, struct cache_entry *e)
{
	if (e->unstable_prev)
		e->unstable_prev->unstable_next = e->unstable_next;
	else
		ce->unstable_head = e->unstable_next;
	if (e->unstable_next)
		e->unstable_next->unstable_prev = e->unstable_prev;
	else
		ce->unstable_tail = e->unstable_prev;
	e->unstable_prev = e->unstable_next = NULL;
	e->on_unstable_list = false;
}

void cache_mark_unstable(struct cache_entry *e, uint32_t blocks, uint64_t seq)
{
	struct cache_export *ce = e->ce;
	uint32_t room = e->nblocks - e->nunstable;
	uint32_t added = blocks < room ? blocks : room;
	e->nunstable += added;
	atomic_fetch_add(&ce->counters.unstable_bytes, (uint64_t)added << ce->block_shift);
	pthread_mutex_lock(&ce->lock);
	if (e->on_unstable_list) /* to the tail: the list stays in write order */
		unstable_list_unlink(ce, e);
	e->unstable_next = NULL;
	e->unstable_prev = ce->unstable_tail;
	if (!ce->unstable_head)
		ce->unstable_since = cache_now_ns();
	if (ce->unstable_tail)
		ce->unstable_tail->unstable_next = e;
	else
		ce->unstable_head = e;
	ce->unstable_tail = e;
	e->on_unstable_list = true;
	if (seq > e->unstable_seq)
		e->unstable_seq = seq;
	pthread_mutex_unlock(&ce->lock);
}

void cache_unstable_settle(struct cache_entry *e, bool redirty)
{
	struct cache_export *ce = e->ce;
	if (!e->on_unstable_list)
		return;
	if (redirty) {
		const uint64_t *uptodate = cache_uptodate_map(e);
		for (uint32_t b = 0; b < e->nblocks; b++)
			if (bit_test(uptodate, b))
				cache_mark_dirty(e, b, 1);
	}
	atomic_fetch_sub(&ce->counters.unstable_bytes, (uint64_t)e->nunstable << ce->block_shift);
	e->nunstable = 0;
	e->unstable_seq = 0;
	pthread_mutex_lock(&ce->lock);
	unstable_list_unlink(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* The entry after e on the dirty or the unstable list. */
static struct cache_entry *list_next(const struct cache_entry *e, enum cache_list list)
{
	return list == CACHE_LIST_DIRTY ? e->dirty_next : e->unstable_next;
}

int cache_list_pin(struct cache_export *ce, enum cache_list list, uint64_t seq,
		   struct cache_entry ***out, size_t *count)
{
	pthread_mutex_lock(&ce->lock);
	struct cache_entry *head = list == CACHE_LIST_DIRTY ? ce->dirty_head : ce->unstable_head;
	size_t n = 0;
	for (struct cache_entry *e = head; e; e = list_next(e, list))
		if (list == CACHE_LIST_DIRTY || e->unstable_seq <= seq)
			n++;
	struct cache_entry **v = malloc((n ? n : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	size_t i = 0;
	for (struct cache_entry *e = head; e && i < n; e = list_next(e, list)) {
		if (list == CACHE_LIST_DIRTY || e->unstable_seq <= seq) {
			/* On the list: it cannot be evicted (see cache.h). */
			cache_entry_pin(e);
			v[i++] = e;
		}
	}
	pthread_mutex_unlock(&ce->lock);
	*out = v;
	*count = i;
	return 0;
}
