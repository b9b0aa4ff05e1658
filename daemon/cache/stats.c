/*
 * daemon/cache/stats.c: the statistics (the index layer, internal.h):
 * each export's counters, the cache's totals summed over them
 * (struct cache_counters), and the SIGUSR1 log line.
 */
#include <stdio.h>
#include <string.h>

#include "daemon/cache/internal.h"
#include "daemon/log.h"

static void counters_load(const struct cache_counters *k, struct cache_export_stats *s)
{
	s->hits = atomic_load(&k->hits);
	s->misses = atomic_load(&k->misses);
	s->partial_hits = atomic_load(&k->partial_hits);
	s->backend_reads = atomic_load(&k->backend_reads);
	s->backend_read_bytes = atomic_load(&k->backend_read_bytes);
	s->backend_writes = atomic_load(&k->backend_writes);
	s->backend_write_bytes = atomic_load(&k->backend_write_bytes);
	s->writeback_bytes = atomic_load(&k->writeback_bytes);
	s->evictions = atomic_load(&k->evictions);
	s->writeback_errors = atomic_load(&k->writeback_errors);
	s->bypass_reads = atomic_load(&k->bypass_reads);
	s->direct_writes = atomic_load(&k->direct_writes);
	s->writes_in_place = atomic_load(&k->writes_in_place);
	s->writes_swapped = atomic_load(&k->writes_swapped);
	s->throttled_writes = atomic_load(&k->throttled_writes);
	s->dirty_bytes = atomic_load(&k->dirty_bytes);
	s->cached_bytes = atomic_load(&k->cached_bytes);
	s->unstable_bytes = atomic_load(&k->unstable_bytes);
	s->backend_flushes = atomic_load(&k->backend_flushes);
	s->backend_flush_errors = atomic_load(&k->backend_flush_errors);
	s->losses = atomic_load(&k->losses);
	for (unsigned i = 0; i < CACHE_COMMANDS; i++)
		s->commands[i] = atomic_load(&k->commands[i]);
	s->fua_commands = atomic_load(&k->fua_commands);
}

static void counters_sum(struct cache_export_stats *sum, const struct cache_export_stats *s)
{
	sum->hits += s->hits;
	sum->misses += s->misses;
	sum->partial_hits += s->partial_hits;
	sum->backend_reads += s->backend_reads;
	sum->backend_read_bytes += s->backend_read_bytes;
	sum->backend_writes += s->backend_writes;
	sum->backend_write_bytes += s->backend_write_bytes;
	sum->writeback_bytes += s->writeback_bytes;
	sum->evictions += s->evictions;
	sum->writeback_errors += s->writeback_errors;
	sum->bypass_reads += s->bypass_reads;
	sum->direct_writes += s->direct_writes;
	sum->writes_in_place += s->writes_in_place;
	sum->writes_swapped += s->writes_swapped;
	sum->throttled_writes += s->throttled_writes;
	sum->unstable_bytes += s->unstable_bytes;
	sum->backend_flushes += s->backend_flushes;
	sum->backend_flush_errors += s->backend_flush_errors;
	sum->losses += s->losses;
	for (unsigned i = 0; i < CACHE_COMMANDS; i++)
		sum->commands[i] += s->commands[i];
	sum->fua_commands += s->fua_commands;
}

void cache_export_count_command(struct cache_export *ce, enum backend_cmd cmd, uint32_t flags)
{
	atomic_fetch_add_explicit(&ce->counters.commands[cmd], 1, memory_order_relaxed);
	if (flags & BACKEND_FUA)
		atomic_fetch_add_explicit(&ce->counters.fua_commands, 1, memory_order_relaxed);
}

void cache_export_get_stats(struct cache_export *ce, struct cache_export_stats *out)
{
	memset(out, 0, sizeof(*out));
	counters_load(&ce->counters, out);
}

void cache_get_stats(struct cache *c, struct cache_stats *s)
{
	struct cache_counters *k = &c->counters;
	memset(s, 0, sizeof(*s));
	s->arena = arena_kind_name(c->arena.kind);
	s->cache_bytes = c->arena.size;
	pthread_mutex_lock(&c->arena.lock);
	s->used_bytes = (uint64_t)(c->arena.nframes - c->arena.free_frames) << ARENA_FRAME_SHIFT;
	s->arena_metadata_bytes = c->arena.metadata_bytes;
	pthread_mutex_unlock(&c->arena.lock);
	s->entries = atomic_load(&k->entries);
	s->metadata_bytes = atomic_load(&k->metadata_bytes);
	struct cache_export_stats one;
	pthread_mutex_lock(&c->exports_lock);
	for (struct cache_export *ce = c->exports; ce; ce = ce->next) {
		counters_load(&ce->counters, &one);
		counters_sum(&s->traffic, &one);
	}
	pthread_mutex_unlock(&c->exports_lock);
	s->traffic.dirty_bytes = atomic_load(&k->dirty_bytes);
	s->traffic.cached_bytes = atomic_load(&k->entry_bytes);
	arena_free_by_order(&c->arena, s->free_bytes_by_order);
	s->fragmentation = arena_fragmentation(s->free_bytes_by_order);
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		s->free_bytes_by_order[o] <<= ARENA_FRAME_SHIFT;
	s->free_2m_bytes = s->free_bytes_by_order[ARENA_MAX_ORDER];
	s->large_bytes = atomic_load(&k->large_bytes);
	s->large_share = s->traffic.cached_bytes ? s->large_bytes * 1000 / s->traffic.cached_bytes : 0;
	s->alloc_2m_attempts = atomic_load(&k->alloc_2m_attempts);
	s->alloc_2m_ok = atomic_load(&k->alloc_2m_ok);
	s->alloc_failures = atomic_load(&k->alloc_failures);
	s->compact_moves = atomic_load(&k->compact_moves);
	s->compact_skipped_pinned = atomic_load(&k->compact_skipped_pinned);
	s->compact_collapses = atomic_load(&k->compact_collapses);
	s->entry_splits = atomic_load(&k->entry_splits);
	s->compact_chunks_freed = atomic_load(&k->compact_chunks_freed);
	s->compact_passes = atomic_load(&k->compact_passes);
	s->compact_ns = atomic_load(&k->compact_ns);
}

void cache_log_stats(struct cache *c)
{
	struct cache_stats s;
	cache_get_stats(c, &s);
	char by_order[ARENA_ORDERS * 24] = "";
	size_t at = 0;
	for (unsigned o = 0; o < ARENA_ORDERS; o++)
		at += (size_t)snprintf(by_order + at, sizeof(by_order) - at, "%s%llu", o ? "," : "",
				       (unsigned long long)s.free_bytes_by_order[o]);
	/* With a cache device, its figures end the line. */
	char dev[1024] = "";
	if (c->device) {
		struct cache_device_stats d;
		cache_device_get_stats(c->device, &d);
		snprintf(dev, sizeof(dev),
			 " device_failed=%d device_log_bytes=%llu device_log_used_bytes=%llu "
			 "device_pending_bytes=%llu device_commits=%llu device_commit_ns=%llu "
			 "device_commit_max_ns=%llu device_records=%llu device_bytes_logged=%llu "
			 "device_log_rounds=%llu device_log_round_entries=%llu "
			 "device_checkpoints=%llu device_full_log_fallbacks=%llu "
			 "device_replay_batches=%llu device_replay_records=%llu "
			 "device_replay_bytes=%llu device_replay_ns=%llu "
			 "device_replay_pending_bytes=%llu device_replay_drained_bytes=%llu "
			 "device_replay_lost_bytes=%llu device_replay_drain_ns=%llu "
			 "device_replay_waits=%llu",
			 d.failed ? 1 : 0, (unsigned long long)d.log_bytes,
			 (unsigned long long)d.log_used, (unsigned long long)d.pending_bytes,
			 (unsigned long long)d.commits, (unsigned long long)d.commit_ns,
			 (unsigned long long)d.commit_max_ns, (unsigned long long)d.records,
			 (unsigned long long)d.bytes_logged, (unsigned long long)d.log_rounds,
			 (unsigned long long)d.log_round_entries, (unsigned long long)d.checkpoints,
			 (unsigned long long)d.fallbacks, (unsigned long long)d.replay_batches,
			 (unsigned long long)d.replay_records, (unsigned long long)d.replay_bytes,
			 (unsigned long long)d.replay_ns,
			 (unsigned long long)d.replay_pending_bytes,
			 (unsigned long long)d.replay_drained_bytes,
			 (unsigned long long)d.replay_lost_bytes,
			 (unsigned long long)d.replay_drain_ns, (unsigned long long)d.replay_waits);
		size_t n = strlen(dev);
		snprintf(
		    dev + n, sizeof(dev) - n,
		    " device_l2_bytes=%llu device_l2_used_bytes=%llu device_l2_hits=%llu "
		    "device_l2_hit_bytes=%llu device_l2_misses=%llu device_l2_stale_reads=%llu "
		    "device_l2_checksum_errors=%llu device_l2_stored_bytes=%llu "
		    "device_l2_dropped_bytes=%llu device_l2_loaded_bytes=%llu",
		    (unsigned long long)d.l2_bytes, (unsigned long long)d.l2_used,
		    (unsigned long long)d.l2_hits, (unsigned long long)d.l2_hit_bytes,
		    (unsigned long long)d.l2_misses, (unsigned long long)d.l2_stale,
		    (unsigned long long)d.l2_checksum_errors,
		    (unsigned long long)d.l2_stored_bytes, (unsigned long long)d.l2_dropped_bytes,
		    (unsigned long long)d.l2_loaded_bytes);
	}
	log_info(
	    "stats: arena=%s cache_bytes=%llu used_bytes=%llu entries=%llu hits=%llu "
	    "misses=%llu partial_hits=%llu backend_reads=%llu backend_read_bytes=%llu "
	    "backend_writes=%llu backend_write_bytes=%llu dirty_bytes=%llu evictions=%llu "
	    "writeback_errors=%llu bypass_reads=%llu direct_writes=%llu writes_in_place=%llu "
	    "writes_swapped=%llu throttled_writes=%llu "
	    "metadata_bytes=%llu arena_metadata_bytes=%llu free_2m_bytes=%llu "
	    "fragmentation=%llu "
	    "free_bytes_by_order=%s large_bytes=%llu large_share=%llu alloc_2m_attempts=%llu "
	    "alloc_2m_ok=%llu alloc_failures=%llu compact_moves=%llu compact_skipped_pinned=%llu "
	    "compact_collapses=%llu entry_splits=%llu compact_chunks_freed=%llu "
	    "compact_passes=%llu "
	    "compact_ns=%llu unstable_bytes=%llu backend_flushes=%llu "
	    "backend_flush_errors=%llu losses=%llu%s",
	    s.arena, (unsigned long long)s.cache_bytes, (unsigned long long)s.used_bytes,
	    (unsigned long long)s.entries, (unsigned long long)s.traffic.hits,
	    (unsigned long long)s.traffic.misses, (unsigned long long)s.traffic.partial_hits,
	    (unsigned long long)s.traffic.backend_reads,
	    (unsigned long long)s.traffic.backend_read_bytes,
	    (unsigned long long)s.traffic.backend_writes,
	    (unsigned long long)s.traffic.backend_write_bytes,
	    (unsigned long long)s.traffic.dirty_bytes, (unsigned long long)s.traffic.evictions,
	    (unsigned long long)s.traffic.writeback_errors,
	    (unsigned long long)s.traffic.bypass_reads, (unsigned long long)s.traffic.direct_writes,
	    (unsigned long long)s.traffic.writes_in_place,
	    (unsigned long long)s.traffic.writes_swapped,
	    (unsigned long long)s.traffic.throttled_writes, (unsigned long long)s.metadata_bytes,
	    (unsigned long long)s.arena_metadata_bytes, (unsigned long long)s.free_2m_bytes,
	    (unsigned long long)s.fragmentation, by_order, (unsigned long long)s.large_bytes,
	    (unsigned long long)s.large_share, (unsigned long long)s.alloc_2m_attempts,
	    (unsigned long long)s.alloc_2m_ok, (unsigned long long)s.alloc_failures,
	    (unsigned long long)s.compact_moves, (unsigned long long)s.compact_skipped_pinned,
	    (unsigned long long)s.compact_collapses, (unsigned long long)s.entry_splits,
	    (unsigned long long)s.compact_chunks_freed, (unsigned long long)s.compact_passes,
	    (unsigned long long)s.compact_ns, (unsigned long long)s.traffic.unstable_bytes,
	    (unsigned long long)s.traffic.backend_flushes,
	    (unsigned long long)s.traffic.backend_flush_errors,
	    (unsigned long long)s.traffic.losses, dev);
}

/* ---- latency histograms ---- */

/* Thread w's slot: a worker's index, the control thread's (workers),
 * and any other thread, which is the writeback thread, the last. */
static struct histogram_recorder *latency_of(struct cache_export *ce, const struct worker *w,
					     enum cache_latency kind)
{
	unsigned last = ce->cache->latency_slots - 1;
	unsigned slot = w->index < last ? w->index : last;
	return &ce->latency[slot].kinds[kind];
}

/* A counter only its thread writes: a relaxed load and store. */
static void slot_add(atomic_uint_fast64_t *k, uint64_t n)
{
	atomic_store_explicit(k, atomic_load_explicit(k, memory_order_relaxed) + n,
			      memory_order_relaxed);
}

void cache_export_record_reply(struct cache_export *ce, const struct worker *w,
			       const struct cache_reply *r)
{
	unsigned last = ce->cache->latency_slots - 1;
	struct cache_latency_slot *s = &ce->latency[w->index < last ? w->index : last];
	if (r->kind < CACHE_LATENCIES)
		histogram_record(&s->kinds[r->kind], r->ns);
	if (r->read_bytes)
		slot_add(&s->read_bytes, r->read_bytes);
	if (r->written_bytes)
		slot_add(&s->written_bytes, r->written_bytes);
	if (r->failed)
		slot_add(&s->errors, 1);
}

void cache_export_get_reply_stats(struct cache_export *ce, struct cache_reply_stats *out)
{
	memset(out, 0, sizeof(*out));
	for (unsigned i = 0; i < ce->cache->latency_slots; i++) {
		const struct cache_latency_slot *s = &ce->latency[i];
		out->read_bytes += atomic_load_explicit(&s->read_bytes, memory_order_relaxed);
		out->written_bytes += atomic_load_explicit(&s->written_bytes, memory_order_relaxed);
		out->errors += atomic_load_explicit(&s->errors, memory_order_relaxed);
	}
}

void cache_backend_timed(struct cache_export *ce, const struct backend_io *io)
{
	if (!io->worker)
		return; /* never sent (a resize left it nothing to do) */
	histogram_record(latency_of(ce, io->worker, CACHE_LATENCY_BACKEND),
			 clock_now_ns() - io->submit_ns);
}

const char *cache_latency_name(enum cache_latency kind)
{
	static const char *const names[CACHE_LATENCIES] = {
	    [CACHE_LATENCY_READ_HIT] = "read_hit", [CACHE_LATENCY_READ_MISS] = "read_miss",
	    [CACHE_LATENCY_WRITE] = "write",	   [CACHE_LATENCY_FLUSH] = "flush",
	    [CACHE_LATENCY_BACKEND] = "backend",
	};
	return names[kind];
}

void cache_export_get_latency(struct cache_export *ce, enum cache_latency kind,
			      struct histogram *out)
{
	memset(out, 0, sizeof(*out));
	for (unsigned i = 0; i < ce->cache->latency_slots; i++)
		histogram_add_recorder(out, &ce->latency[i].kinds[kind]);
}
