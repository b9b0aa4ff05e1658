/*
 * daemon/control_stats.c: the control socket's read-only commands (status,
 * exports, stats): the daemon's state as JSON, in the shapes
 * include/nbdcached/control.h documents.
 *
 * Also the writeback rates: once a second the tick samples each export's
 * writeback_bytes into a rate slot, so stats can report bytes/s over the
 * last whole second without keeping history. There is a slot per export
 * served, at most CONTROL_MAX_RATES; a removed export's slot is freed at
 * the next tick.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/check.h"
#include "daemon/budget.h"
#include "daemon/clock.h"
#include "daemon/control_internal.h"
#include "include/nbdcached/control.h"

static double ratio(uint64_t hits, uint64_t all)
{
	return all ? (double)hits / (double)all : 0.0;
}

/* ---- rates ---- */

static struct control_rate *rate_for(struct control *ctl, struct cache_export *ce)
{
	for (size_t i = 0; i < ctl->rate_count; i++)
		if (ctl->rates[i].ce == ce)
			return &ctl->rates[i];
	if (ctl->rate_count == CONTROL_MAX_RATES)
		return NULL;
	struct control_rate *r = &ctl->rates[ctl->rate_count++];
	*r = (struct control_rate){.ce = ce};
	return r;
}

/*
 * Rate slots follow the exports served: a slot whose cache export no
 * longer belongs to a served backing (a reload removed its export) is freed
 * here. They used to stay for good, so reloads that added and removed
 * exports filled the table (past CONTROL_MAX_RATES no new export got a
 * rate), and a new cache export at a freed one's address took over its
 * stale count. The tick samples before it reaps (control.c, on_tick), so a
 * slot is gone before its cache export can be freed. Allocates nothing:
 * it cannot fail, whatever export_list() does.
 */
static void rates_forget_removed(struct control *ctl)
{
	struct export_table *t = ctl->cfg.exports;
	size_t kept = 0;
	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < ctl->rate_count; i++) {
		bool served = false;
		for (struct export_backing *b = t->backings; b && !served; b = b->next)
			served = b->cache == ctl->rates[i].ce && !b->removed;
		if (served)
			ctl->rates[kept++] = ctl->rates[i];
	}
	pthread_mutex_unlock(&t->lock);
	ctl->rate_count = kept;
}

void control_sample_rates(struct control *ctl)
{
	rates_forget_removed(ctl);
	struct export **list;
	size_t n;
	if (export_list(ctl->cfg.exports, &list, &n) < 0)
		return;
	for (size_t i = 0; i < n; i++) {
		struct cache_export_stats s;
		cache_export_get_stats(list[i]->cache, &s);
		struct control_rate *r = rate_for(ctl, list[i]->cache);
		if (r) {
			r->rate = r->seen ? s.writeback_bytes - r->last_bytes : 0;
			r->last_bytes = s.writeback_bytes;
			r->seen = true;
		}
		export_put(list[i]);
	}
	free(list);
	struct cache_stats cs;
	cache_get_stats(ctl->cfg.cache, &cs);
	ctl->cache_rate = cs.traffic.writeback_bytes - ctl->cache_last_bytes;
	ctl->cache_last_bytes = cs.traffic.writeback_bytes;
}

static unsigned connection_count(struct control *ctl, unsigned *removed)
{
	struct export_table *t = ctl->cfg.exports;
	unsigned n = 0;
	*removed = 0;
	pthread_mutex_lock(&t->lock);
	for (struct export_backing *b = t->backings; b; b = b->next) {
		n += atomic_load(&b->connections);
		*removed += b->removed;
	}
	pthread_mutex_unlock(&t->lock);
	return n;
}

static json_object *listen_array(const struct control_config *cfg)
{
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < cfg->listen_count; i++) {
		struct sockaddr_storage ss;
		socklen_t len = sizeof(ss);
		if (getsockname(cfg->listen_fds[i], (struct sockaddr *)&ss, &len) < 0)
			continue;
		json_object *o = json_object_new_object();
		if (ss.ss_family == AF_UNIX) {
			struct sockaddr_un *su = (struct sockaddr_un *)&ss;
			control_add_string(o, "type", "unix");
			control_add_string(o, "path", su->sun_path);
		} else {
			char host[INET6_ADDRSTRLEN] = "";
			unsigned port;
			if (ss.ss_family == AF_INET6) {
				struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
				inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
				port = ntohs(s6->sin6_port);
			} else {
				struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
				inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
				port = ntohs(s4->sin_port);
			}
			control_add_string(o, "type", "tcp");
			control_add_string(o, "address", host);
			control_add_u64(o, "port", port);
		}
		json_object_array_add(a, o);
	}
	return a;
}

void control_cmd_status(struct control_client *cl)
{
	struct control *ctl = cl->ctl;
	struct cache_stats s;
	cache_get_stats(ctl->cfg.cache, &s);
	json_object *o = control_reply_ok();
	control_add_string(o, "version", NBDCACHED_VERSION);
	control_add_u64(o, "pid", (uint64_t)getpid());
	control_add_u64(o, "uptime_ms", (clock_now_ns() - ctl->started_ns) / 1000000u);
	control_add_string(o, "config", ctl->cfg.opts->config_path);
	struct export_table *t = ctl->cfg.exports;
	pthread_mutex_lock(&t->lock);
	size_t count = t->count;
	pthread_mutex_unlock(&t->lock);
	control_add_u64(o, "exports", count);
	unsigned removed;
	control_add_u64(o, "connections", connection_count(ctl, &removed));
	control_add_u64(o, "threads", ctl->cfg.threads);
	control_add_string(o, "arena", s.arena);
	control_add_u64(o, "cache_bytes", s.cache_bytes);
	control_add_u64(o, "used_bytes", s.used_bytes);
	control_add_u64(o, "dirty_bytes", s.traffic.dirty_bytes);
	control_add_u64(o, "removed_backends", removed);
	control_add_u64(o, "rate_slots", ctl->rate_count);
	json_object_object_add(o, "listen", listen_array(&ctl->cfg));
	control_send(cl, o);
}

void control_cmd_exports(struct control_client *cl)
{
	struct export **list;
	size_t n;
	if (export_list(cl->ctl->cfg.exports, &list, &n) < 0) {
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	json_object *o = control_reply_ok();
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++) {
		struct export *e = list[i];
		json_object *x = json_object_new_object();
		control_add_string(x, "name", e->name);
		control_add_string(x, "description", e->description);
		control_add_string(x, "backend", e->backing->spec);
		control_add_string(x, "kind", e->backend->ops->kind);
		control_add_u64(x, "size", export_size(e));
		control_add_u64(x, "offset", e->offset);
		control_add_u64(x, "split", e->split);
		control_add_string(x, "window_of", e->window_of);
		json_object_object_add(x, "readonly", json_object_new_boolean(e->readonly));
		json_object_object_add(x, "fenced",
				       json_object_new_boolean(atomic_load(&e->backend->fenced)));
		control_add_u64(x, "block_size", e->block_size);
		control_add_string(x, "cache_mode",
				   options_cache_mode_name(cache_export_mode(e->cache)));
		control_add_u64(x, "seq_cutoff", e->seq_cutoff);
		control_add_u64(x, "max_connections", e->max_connections);
		control_add_u64(x, "connections", atomic_load(&e->counter->connections));
		control_add_u64(x, "dirty_high", e->dirty_high);
		control_add_u64(x, "dirty_low", e->dirty_low);
		struct qos_stats q;
		qos_limiter_get(e->counter->qos, &q);
		json_object_object_add(x, "limits", control_limits_object(&q.limits));
		json_object_array_add(a, x);
		export_put(e);
	}
	free(list);
	json_object_object_add(o, "exports", a);
	control_send(cl, o);
}

static void traffic_fields(json_object *x, const struct cache_export_stats *s)
{
	control_add_u64(x, "hits", s->hits);
	control_add_u64(x, "misses", s->misses);
	control_add_u64(x, "partial_hits", s->partial_hits);
	json_object_object_add(
	    x, "hit_ratio",
	    json_object_new_double(ratio(s->hits, s->hits + s->misses + s->partial_hits)));
	control_add_u64(x, "dirty_bytes", s->dirty_bytes);
	control_add_u64(x, "backend_reads", s->backend_reads);
	control_add_u64(x, "backend_read_bytes", s->backend_read_bytes);
	control_add_u64(x, "backend_writes", s->backend_writes);
	control_add_u64(x, "backend_write_bytes", s->backend_write_bytes);
	control_add_u64(x, "writeback_bytes", s->writeback_bytes);
	control_add_u64(x, "evictions", s->evictions);
	control_add_u64(x, "writeback_errors", s->writeback_errors);
	control_add_u64(x, "unstable_bytes", s->unstable_bytes);
	control_add_u64(x, "backend_flushes", s->backend_flushes);
	control_add_u64(x, "backend_flush_errors", s->backend_flush_errors);
	control_add_u64(x, "losses", s->losses);
	/* What clients asked for, by command (enum backend_cmd order). */
	static const char *const names[CACHE_COMMANDS] = {
	    [BACKEND_READ] = "read",	   [BACKEND_WRITE] = "write",
	    [BACKEND_FLUSH] = "flush",	   [BACKEND_TRIM] = "trim",
	    [BACKEND_ZERO] = "write_zeroes", [BACKEND_CACHE] = "cache",
	    [BACKEND_BLOCK_STATUS] = "block_status"};
	json_object *cmds = json_object_new_object();
	for (unsigned i = 0; i < CACHE_COMMANDS; i++)
		control_add_u64(cmds, names[i], s->commands[i]);
	control_add_u64(cmds, "fua", s->fua_commands);
	json_object_object_add(x, "commands", cmds);
}

static json_object *latency_fields(struct cache_export *ce)
{
	json_object *o = json_object_new_object();
	struct histogram *h = malloc(sizeof(*h));
	if (!h)
		return o;
	for (unsigned k = 0; k < CACHE_LATENCIES; k++) {
		cache_export_get_latency(ce, k, h);
		json_object *x = json_object_new_object();
		control_add_u64(x, "count", histogram_count(h));
		control_add_u64(x, "sum_ns", h->sum_ns);
		control_add_u64(x, "p50_ns", histogram_quantile(h, 0.5));
		control_add_u64(x, "p99_ns", histogram_quantile(h, 0.99));
		control_add_u64(x, "p999_ns", histogram_quantile(h, 0.999));
		json_object_object_add(o, cache_latency_name(k), x);
	}
	free(h);
	return o;
}

/* The intent log's figures (--cache-device), or NULL when there is none. */
json_object *control_device_object(struct cache *cache)
{
	struct cache_device_stats ds;
	if (!cache_get_device_stats(cache, &ds))
		return NULL;
	json_object *dev = json_object_new_object();
	json_object_object_add(dev, "failed", json_object_new_boolean(ds.failed));
	json_object_object_add(dev, "detaching", json_object_new_boolean(ds.detaching));
	json_object_object_add(dev, "detached", json_object_new_boolean(ds.detached));
	control_add_u64(dev, "device_bytes", ds.device_bytes);
	control_add_u64(dev, "log_bytes", ds.log_bytes);
	control_add_u64(dev, "log_used_bytes", ds.log_used);
	control_add_u64(dev, "pending_bytes", ds.pending_bytes);
	control_add_u64(dev, "commits", ds.commits);
	control_add_u64(dev, "commit_ns", ds.commit_ns);
	control_add_u64(dev, "commit_max_ns", ds.commit_max_ns);
	control_add_u64(dev, "records", ds.records);
	control_add_u64(dev, "bytes_logged", ds.bytes_logged);
	control_add_u64(dev, "log_rounds", ds.log_rounds);
	control_add_u64(dev, "log_round_entries", ds.log_round_entries);
	control_add_u64(dev, "checkpoints", ds.checkpoints);
	control_add_u64(dev, "full_log_fallbacks", ds.fallbacks);
	control_add_u64(dev, "replay_batches", ds.replay_batches);
	control_add_u64(dev, "replay_records", ds.replay_records);
	control_add_u64(dev, "replay_bytes", ds.replay_bytes);
	control_add_u64(dev, "replay_ns", ds.replay_ns);
	control_add_u64(dev, "replay_pending_bytes", ds.replay_pending_bytes);
	control_add_u64(dev, "replay_drained_bytes", ds.replay_drained_bytes);
	control_add_u64(dev, "replay_lost_bytes", ds.replay_lost_bytes);
	control_add_u64(dev, "replay_drain_ns", ds.replay_drain_ns);
	control_add_u64(dev, "replay_waits", ds.replay_waits);
	json_object_object_add(dev, "last_commit_unix_ms",
			       json_object_new_int64(ds.last_commit_unix_ms));
	static const char *const uses[] = {"none", "log", "l2", "both"};
	json_object_object_add(dev, "use", json_object_new_string(uses[ds.use & 3]));
	json_object *l2 = json_object_new_object();
	json_object_object_add(l2, "on", json_object_new_boolean(ds.l2_on));
	json_object_object_add(l2, "failed", json_object_new_boolean(ds.l2_failed));
	control_add_u64(l2, "bytes", ds.l2_bytes);
	control_add_u64(l2, "used_bytes", ds.l2_used);
	control_add_u64(l2, "staged_bytes", ds.l2_staged);
	control_add_u64(l2, "hits", ds.l2_hits);
	control_add_u64(l2, "hit_bytes", ds.l2_hit_bytes);
	control_add_u64(l2, "misses", ds.l2_misses);
	control_add_u64(l2, "skipped", ds.l2_skipped);
	control_add_u64(l2, "small_read_ns", ds.l2_small_read_ns);
	control_add_u64(l2, "stale_reads", ds.l2_stale);
	control_add_u64(l2, "read_errors", ds.l2_read_errors);
	control_add_u64(l2, "checksum_errors", ds.l2_checksum_errors);
	control_add_u64(l2, "stored_bytes", ds.l2_stored_bytes);
	control_add_u64(l2, "dropped_bytes", ds.l2_dropped_bytes);
	control_add_u64(l2, "invalidated_bytes", ds.l2_invalidated_bytes);
	control_add_u64(l2, "loaded_bytes", ds.l2_loaded_bytes);
	control_add_u64(l2, "load_ns", ds.l2_load_ns);
	control_add_u64(l2, "write_ns", ds.l2_write_ns);
	control_add_u64(l2, "map_writes", ds.l2_map_writes);
	control_add_u64(l2, "map_ns", ds.l2_map_ns);
	control_add_u64(l2, "map_pending_bytes", ds.l2_map_pending);
	json_object_object_add(dev, "l2", l2);
	return dev;
}

void control_cmd_cache_device(struct control_client *cl, json_object *req)
{
	json_object *v;
	const char *action = "status";
	if (json_object_object_get_ex(req, "action", &v)) {
		if (!json_object_is_type(v, json_type_string)) {
			control_send_error(cl, EINVAL, "cache-device: \"action\" is a string");
			return;
		}
		action = json_object_get_string(v);
	}
	bool flush = strcmp(action, "flush") == 0, detach = strcmp(action, "detach") == 0;
	if (!flush && !detach && strcmp(action, "status") != 0) {
		control_send_error(cl, EINVAL,
				   "cache-device: action '%s' (status, flush or detach)", action);
		return;
	}
	if (!cache_device_attached(cl->ctl->cfg.cache)) {
		control_send_error(cl, ENODEV, "no cache device (--cache-device)");
		return;
	}
	if (flush || detach) {
		control_device_flush(cl, detach);
		return;
	}
	json_object *dev = control_device_object(cl->ctl->cfg.cache);
	if (!dev) {
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	json_object *o = control_reply_ok();
	control_add_string(o, "path", cl->ctl->cfg.opts->cache_device);
	json_object_object_add(o, "cache_device", dev);
	control_send(cl, o);
}

void control_cmd_stats(struct control_client *cl, const char *only)
{
	struct control *ctl = cl->ctl;
	struct export **list;
	size_t n;
	if (export_list(ctl->cfg.exports, &list, &n) < 0) {
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	bool found = !only;
	for (size_t i = 0; i < n && !found; i++)
		found = strcmp(list[i]->name, only) == 0;
	if (!found) {
		control_send_error(cl, ENOENT, "no such export '%s'", only);
		goto out;
	}
	struct cache_stats s;
	cache_get_stats(ctl->cfg.cache, &s);
	json_object *o = control_reply_ok();
	control_add_u64(o, "time_ms", clock_now_ns() / 1000000u);
	control_add_u64(o, "invariant_violations", check_violations());
	json_object *c = json_object_new_object();
	control_add_u64(c, "cache_bytes", s.cache_bytes);
	control_add_u64(c, "used_bytes", s.used_bytes);
	control_add_u64(c, "entries", s.entries);
	traffic_fields(c, &s.traffic);
	control_add_u64(c, "writeback_rate", ctl->cache_rate);
	control_add_u64(c, "bypass_reads", s.traffic.bypass_reads);
	control_add_u64(c, "direct_writes", s.traffic.direct_writes);
	control_add_u64(c, "writes_in_place", s.traffic.writes_in_place);
	control_add_u64(c, "writes_swapped", s.traffic.writes_swapped);
	control_add_u64(c, "throttled_writes", s.traffic.throttled_writes);
	control_add_u64(c, "metadata_bytes", s.metadata_bytes);
	control_add_u64(c, "arena_metadata_bytes", s.arena_metadata_bytes);
	json_object *arena = json_object_new_object();
	uint64_t free_bytes = 0;
	json_object *orders = json_object_new_array();
	for (unsigned k = 0; k < NBDCACHED_ARENA_ORDERS; k++) {
		free_bytes += s.free_bytes_by_order[k];
		json_object_array_add(orders,
				      json_object_new_int64((int64_t)s.free_bytes_by_order[k]));
	}
	control_add_string(arena, "kind", s.arena);
	control_add_u64(arena, "free_bytes", free_bytes);
	json_object_object_add(arena, "free_bytes_by_order", orders);
	json_object_object_add(arena, "fragmentation",
			       json_object_new_double((double)s.fragmentation / 1000.0));
	control_add_u64(arena, "large_bytes", s.large_bytes);
	json_object_object_add(arena, "large_share",
			       json_object_new_double((double)s.large_share / 1000.0));
	control_add_u64(arena, "alloc_2m_attempts", s.alloc_2m_attempts);
	control_add_u64(arena, "alloc_2m_ok", s.alloc_2m_ok);
	control_add_u64(arena, "alloc_failures", s.alloc_failures);
	control_add_u64(arena, "compact_moves", s.compact_moves);
	control_add_u64(arena, "compact_skipped_pinned", s.compact_skipped_pinned);
	control_add_u64(arena, "compact_collapses", s.compact_collapses);
	control_add_u64(arena, "entry_splits", s.entry_splits);
	control_add_u64(arena, "compact_chunks_freed", s.compact_chunks_freed);
	control_add_u64(arena, "compact_passes", s.compact_passes);
	control_add_u64(arena, "compact_ns", s.compact_ns);
	json_object_object_add(c, "arena", arena);
	json_object *dev = control_device_object(ctl->cfg.cache);
	if (dev)
		json_object_object_add(c, "cache_device", dev);
	json_object_object_add(o, "cache", c);
	struct budget_stats b;
	budget_get_stats(&b);
	json_object *clients = json_object_new_object();
	control_add_u64(clients, "connections", b.clients);
	control_add_u64(clients, "max_clients", b.max_clients);
	control_add_u64(clients, "refused", b.refused_clients);
	control_add_u64(clients, "refused_per_client", b.refused_per_client);
	control_add_u64(clients, "refused_access", b.refused_access);
	control_add_u64(clients, "reply_bytes", b.reply_bytes);
	control_add_u64(clients, "max_reply_bytes", b.max_reply_bytes);
	control_add_u64(clients, "pinned_reply_bytes", b.pinned_reply_bytes);
	control_add_u64(clients, "max_pinned_reply_bytes", b.max_pinned_reply_bytes);
	control_add_u64(clients, "copied_replies", b.copied_replies);
	control_add_u64(clients, "copied_reply_bytes", b.copied_reply_bytes);
	control_add_u64(clients, "budget_waits", b.budget_waits);
	json_object_object_add(o, "clients", clients);
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++) {
		struct export *e = list[i];
		if (only && strcmp(e->name, only) != 0)
			continue;
		struct cache_export_stats es;
		cache_export_get_stats(e->cache, &es);
		json_object *x = json_object_new_object();
		control_add_string(x, "name", e->name);
		control_add_u64(x, "connections", atomic_load(&e->counter->connections));
		traffic_fields(x, &es);
		struct control_rate *r = rate_for(ctl, e->cache);
		control_add_u64(x, "writeback_rate", r ? r->rate : 0);
		control_add_u64(x, "cached_bytes", es.cached_bytes);
		json_object_object_add(x, "latency", latency_fields(e->cache));
		struct qos_stats q;
		qos_limiter_get(e->counter->qos, &q);
		control_add_u64(x, "throttled_requests", q.throttled_requests);
		control_add_u64(x, "throttled_ns", q.throttled_ns);
		control_add_u64(x, "qos_clients", q.clients);
		control_add_u64(x, "qos_idle_clients", q.idle_clients);
		json_object_array_add(a, x);
	}
	json_object_object_add(o, "exports", a);
	control_send(cl, o);
out:
	for (size_t i = 0; i < n; i++)
		export_put(list[i]);
	free(list);
}
