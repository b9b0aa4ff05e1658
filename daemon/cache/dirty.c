/*
 * daemon/cache/dirty.c: per-block dirty state, and the export's dirty,
 * unstable and unlogged lists that follow it (the index layer, internal.h; the
 * durability model: cache.h). Every function here but cache_list_pin runs
 * under the entry's shard lock and takes the export lock for the lists.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#include "daemon/cache/internal.h"

/* The ext of an entry on a list (export lock held). */
static struct cache_entry_ext *ext_of(const struct cache *c, uint32_t i)
{
	return cache_entry_ext(cache_entry_at(c, i));
}

/* The three lists, each through one link of the side records: the link
 * at off (LINK) in that of pool index i. Export lock held throughout. */
#define LINK(field) offsetof(struct cache_entry_ext, field)
static struct cache_link *link_of(const struct cache *c, uint32_t i, size_t off)
{
	return (struct cache_link *)((char *)ext_of(c, i) + off);
}

/* e to the tail of the list *head .. *tail linked at off. */
static void list_append(struct cache *c, struct cache_entry **head, struct cache_entry **tail,
			struct cache_entry *e, size_t off)
{
	uint32_t i = cache_entry_index(e);
	struct cache_link *l = link_of(c, i, off);
	l->next = 0;
	l->prev = *tail ? cache_entry_index(*tail) : 0;
	if (*tail)
		link_of(c, l->prev, off)->next = i;
	else
		*head = e;
	*tail = e;
}

/* e, on the list *head .. *tail linked at off, off it. */
static void list_unlink(struct cache *c, struct cache_entry **head, struct cache_entry **tail,
			struct cache_entry *e, size_t off)
{
	struct cache_link *l = link_of(c, cache_entry_index(e), off);
	if (l->prev)
		link_of(c, l->prev, off)->next = l->next;
	else
		*head = cache_entry_at(c, l->next);
	if (l->next)
		link_of(c, l->next, off)->prev = l->prev;
	else
		*tail = cache_entry_at(c, l->prev);
	l->prev = l->next = 0;
}

void cache_mark_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_export *ce = cache_entry_export(e);
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x) {
		pthread_mutex_lock(&ce->lock);
		x = cache_entry_ext_get(ce, e);
		pthread_mutex_unlock(&ce->lock);
	}
	x->logged = false; /* written: a log round copies it again */
	if (ce->cache->device)
		cache_device_l2_invalidate(ce->cache->device, ce->device_slot,
					   cache_entry_offset(e) +
					       ((uint64_t)first << ce->block_shift),
					   (uint64_t)count << ce->block_shift);
	if (ce->device_slot >= 0)
		atomic_fetch_add_explicit(&ce->log_unlogged_bytes,
					  (uint64_t)count << ce->block_shift, memory_order_relaxed);
	struct cache_map dirty = cache_dirty_map(e);
	uint32_t added = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (!map_test(dirty, b)) {
			map_set(dirty, b);
			added++;
		}
	}
	x->ndirty += added;
	cache_dirty_bytes_add(ce, (uint64_t)added << ce->block_shift);
	/* The next log round must copy it: it joins the unlogged list. */
	bool unlogged = ce->device_slot >= 0 && !x->on_unlogged_list;
	if (x->on_dirty_list && !unlogged)
		return;
	pthread_mutex_lock(&ce->lock);
	if (unlogged)
		cache_unlogged_add(ce, e);
	if (x->on_dirty_list) {
		pthread_mutex_unlock(&ce->lock);
		return;
	}
	list_append(ce->cache, &ce->dirty_head, &ce->dirty_tail, e, LINK(dirty_link));
	x->on_dirty_list = true;
	x->dirty_since = clock_now_ns();
	pthread_mutex_unlock(&ce->lock);
}

void cache_clear_dirty(struct cache_entry *e, uint32_t first, uint32_t count)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x || x->ndirty == 0)
		return;
	struct cache_export *ce = cache_entry_export(e);
	struct cache_map dirty = cache_dirty_map(e);
	uint32_t removed = 0;
	for (uint32_t b = first; b < first + count; b++) {
		if (map_test(dirty, b)) {
			map_clear(dirty, b);
			removed++;
		}
	}
	x->ndirty -= removed;
	cache_dirty_bytes_sub(ce, (uint64_t)removed << ce->block_shift);
}

void cache_dirty_list_remove(struct cache_export *ce, struct cache_entry *e)
{
	list_unlink(ce->cache, &ce->dirty_head, &ce->dirty_tail, e, LINK(dirty_link));
	cache_entry_ext(e)->on_dirty_list = false;
}

void cache_dirty_list_insert_after(struct cache_export *ce, struct cache_entry *e,
				   struct cache_entry *n)
{
	struct cache *c = ce->cache;
	struct cache_entry_ext *x = cache_entry_ext(e), *nx = cache_entry_ext(n);
	uint32_t ni = cache_entry_index(n);
	nx->dirty_link.prev = cache_entry_index(e);
	nx->dirty_link.next = x->dirty_link.next;
	if (x->dirty_link.next)
		ext_of(c, x->dirty_link.next)->dirty_link.prev = ni;
	else
		ce->dirty_tail = n;
	x->dirty_link.next = ni;
	nx->on_dirty_list = true;
	nx->dirty_since = x->dirty_since;
}

void cache_dirty_list_update(struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x || x->ndirty || x->writeback)
		return;
	struct cache_export *ce = cache_entry_export(e);
	pthread_mutex_lock(&ce->lock);
	if (x->on_dirty_list)
		cache_dirty_list_remove(ce, e);
	cache_entry_ext_trim(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* ---- the unlogged list: what the next log round copies ---- */

void cache_unlogged_add(struct cache_export *ce, struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (x->on_unlogged_list)
		return;
	list_append(ce->cache, &ce->unlogged_head, &ce->unlogged_tail, e, LINK(unlogged_link));
	x->on_unlogged_list = true;
}

void cache_unlogged_remove(struct cache_export *ce, struct cache_entry *e)
{
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x || !x->on_unlogged_list)
		return;
	list_unlink(ce->cache, &ce->unlogged_head, &ce->unlogged_tail, e, LINK(unlogged_link));
	x->on_unlogged_list = false;
}

/* ---- unstable state: written back, not yet flushed ---- */

/* Export lock held, e on the unstable list. */
static void unstable_list_unlink(struct cache_export *ce, struct cache_entry *e)
{
	list_unlink(ce->cache, &ce->unstable_head, &ce->unstable_tail, e, LINK(unstable_link));
	cache_entry_ext(e)->on_unstable_list = false;
}

void cache_mark_unstable(struct cache_entry *e, uint32_t blocks, uint64_t seq)
{
	struct cache_export *ce = cache_entry_export(e);
	pthread_mutex_lock(&ce->lock);
	struct cache_entry_ext *x = cache_entry_ext_get(ce, e);
	uint32_t room = cache_entry_nblocks(e) - x->nunstable;
	uint32_t added = blocks < room ? blocks : room;
	x->nunstable += added;
	atomic_fetch_add(&ce->counters.unstable_bytes, (uint64_t)added << ce->block_shift);
	if (x->on_unstable_list) /* to the tail: the list stays in write order */
		unstable_list_unlink(ce, e);
	if (!ce->unstable_head)
		ce->unstable_since = clock_now_ns();
	list_append(ce->cache, &ce->unstable_head, &ce->unstable_tail, e, LINK(unstable_link));
	x->on_unstable_list = true;
	if (seq > x->unstable_seq)
		x->unstable_seq = seq;
	/* Not durable on the backend yet: a log round copies it unless one
	 * did since it was written (a direct write applied to it, say). */
	if (ce->device_slot >= 0 && !x->logged)
		cache_unlogged_add(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

void cache_unstable_settle(struct cache_entry *e, bool redirty)
{
	struct cache_export *ce = cache_entry_export(e);
	struct cache_entry_ext *x = cache_entry_ext(e);
	if (!x || !x->on_unstable_list)
		return;
	if (redirty) {
		struct cache_map uptodate = cache_uptodate_map(e);
		uint32_t nblocks = cache_entry_nblocks(e);
		for (uint32_t b = 0; b < nblocks; b++)
			if (map_test(uptodate, b))
				cache_mark_dirty(e, b, 1);
	}
	atomic_fetch_sub(&ce->counters.unstable_bytes, (uint64_t)x->nunstable << ce->block_shift);
	x->nunstable = 0;
	x->unstable_seq = 0;
	pthread_mutex_lock(&ce->lock);
	unstable_list_unlink(ce, e);
	cache_entry_ext_trim(ce, e);
	pthread_mutex_unlock(&ce->lock);
}

/* The entry after e on the dirty or the unstable list. */
static struct cache_entry *list_next(const struct cache *c, const struct cache_entry *e,
				     enum cache_list list)
{
	const struct cache_entry_ext *x = cache_entry_ext(e);
	switch (list) {
	case CACHE_LIST_DIRTY:
		return cache_entry_at(c, x->dirty_link.next);
	case CACHE_LIST_UNLOGGED:
		return cache_entry_at(c, x->unlogged_link.next);
	default:
		return cache_entry_at(c, x->unstable_link.next);
	}
}

/* Does e of list count (its unstable_seq at most seq on the unstable list)? */
static bool list_takes(const struct cache_entry *e, enum cache_list list, uint64_t seq)
{
	return list != CACHE_LIST_UNSTABLE || cache_entry_unstable_seq(e) <= seq;
}

int cache_list_pin(struct cache_export *ce, enum cache_list list, uint64_t seq,
		   struct cache_entry ***out, size_t *count)
{
	struct cache *c = ce->cache;
	pthread_mutex_lock(&ce->lock);
	struct cache_entry *head = list == CACHE_LIST_DIRTY	 ? ce->dirty_head
				   : list == CACHE_LIST_UNLOGGED ? ce->unlogged_head
								 : ce->unstable_head;
	size_t n = 0;
	for (struct cache_entry *e = head; e; e = list_next(c, e, list))
		if (list_takes(e, list, seq))
			n++;
	struct cache_entry **v = malloc((n ? n : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&ce->lock);
		return -ENOMEM;
	}
	size_t i = 0;
	for (struct cache_entry *e = head; e && i < n; e = list_next(c, e, list)) {
		if (list_takes(e, list, seq)) {
			/* On the list: it cannot be evicted (see cache.h; an
			 * unlogged entry is dirty, unstable or being written). */
			cache_entry_pin(e);
			v[i++] = e;
		}
	}
	pthread_mutex_unlock(&ce->lock);
	*out = v;
	*count = i;
	return 0;
}
