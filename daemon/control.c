/*
 * daemon/control.c: see control.h; the protocol is include/nbdcached/control.h.
 *
 * Each client is a bufferevent on the control thread. A request line is
 * parsed with json-c and answered by one handler. Handlers that wait for the
 * cache (flush, set-mode leaving writeback) stop reading from their client
 * until they reply, so replies stay in request order; other clients go on
 * being served meanwhile (nbdcachectl flush polls stats on a second
 * connection while its flush runs).
 *
 *   client --line--> dispatch --> reply now
 *                             \-> cache op (FLUSH) --done on this thread--> reply
 *
 * Once a second a timer samples the writeback counters (for writeback_rate)
 * and reaps removed exports (export_table_reap).
 */
#include "daemon/control.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <json-c/json.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "daemon/budget.h"
#include "daemon/clock.h"
#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/worker.h"
#include "include/nbdcached/control.h"

#ifndef NBDCACHED_VERSION
#define NBDCACHED_VERSION "0.1"
#endif

#define CONTROL_MAX_RATES 1024
/*
 * A client whose unread replies reach CONTROL_MAX_OUTPUT is not read (and
 * its requests not answered) until they drain below half of it; at most
 * CONTROL_MAX_CLIENTS clients at a time. So all of them together hold at
 * most CONTROL_MAX_CLIENTS x (CONTROL_MAX_OUTPUT + one reply + one
 * request line).
 */
#define CONTROL_MAX_OUTPUT (1u << 20)
#define CONTROL_MAX_CLIENTS 64

struct control_client;

/* A request that waits for the cache: one per client at most. */
struct control_wait {
	struct cache_op op;
	struct control_client *client; /* NULL: the client left meanwhile */
	struct export *export;
	struct export_backing *reap; /* a reap flush: no client */
	uint64_t seen_error;
	uint64_t started_ns, dirty_at_start;
	enum cache_mode set_mode; /* set-mode: the mode to set after the flush */
	enum cache_mode previous;
	bool is_set_mode;
	struct control *ctl;
};

struct control_client {
	struct control *ctl;
	struct bufferevent *bev;
	struct control_wait *wait; /* a request in progress */
	bool eof;		   /* the client shut its side: answer what was read */
	bool closing;		   /* nothing more to answer: close once the output drained */
	struct control_client *prev, *next;
};

/* Writeback bytes one second ago, per cache export, for the rates. */
struct control_rate {
	struct cache_export *ce;
	uint64_t last_bytes, rate;
	bool seen;
};

struct control {
	struct control_config cfg;
	struct worker worker;
	struct evconnlistener *listener;
	struct event *tick;
	struct control_client *clients;
	unsigned client_count;
	bool refusing; /* at CONTROL_MAX_CLIENTS: refusal logged for this spell */
	unsigned pending; /* cache ops in flight */
	bool stopping;
	uint64_t started_ns;
	struct worker_task reload_task, start_task, stop_task;
	pthread_mutex_t reload_lock; /* a reload already posted and not yet run */
	bool reload_posted;
	struct control_rate rates[CONTROL_MAX_RATES];
	size_t rate_count;
	uint64_t cache_last_bytes, cache_rate;
};

static const char *errno_name(int e)
{
	switch (e) {
	case ENOENT:
		return "ENOENT";
	case EINVAL:
		return "EINVAL";
	case EIO:
		return "EIO";
	case EBUSY:
		return "EBUSY";
	case ENOTSUP:
		return "ENOTSUP";
	case ENOMEM:
		return "ENOMEM";
	case ENOSPC:
		return "ENOSPC";
	default:
		return "EIO";
	}
}

/* ---- replies ---- */

static void client_send(struct control_client *cl, json_object *reply)
{
	if (cl->bev) {
		const char *text = json_object_to_json_string_ext(reply, JSON_C_TO_STRING_PLAIN);
		struct evbuffer *out = bufferevent_get_output(cl->bev);
		evbuffer_add(out, text, strlen(text));
		evbuffer_add(out, "\n", 1);
	}
	json_object_put(reply);
}

static json_object *reply_ok(void)
{
	json_object *o = json_object_new_object();
	json_object_object_add(o, "ok", json_object_new_boolean(1));
	return o;
}

static void send_error(struct control_client *cl, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void send_error(struct control_client *cl, int err, const char *fmt, ...)
{
	char text[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	json_object *o = json_object_new_object();
	json_object_object_add(o, "ok", json_object_new_boolean(0));
	json_object_object_add(o, "error", json_object_new_string(text));
	json_object_object_add(o, "errno", json_object_new_string(errno_name(err)));
	client_send(cl, o);
}

static void add_u64(json_object *o, const char *key, uint64_t v)
{
	json_object_object_add(o, key, json_object_new_int64((int64_t)v));
}

static void add_string(json_object *o, const char *key, const char *v)
{
	json_object_object_add(o, key, v ? json_object_new_string(v) : NULL);
}

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

static void sample_rates(struct control *ctl)
{
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

/* ---- commands ---- */

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
			add_string(o, "type", "unix");
			add_string(o, "path", su->sun_path);
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
			add_string(o, "type", "tcp");
			add_string(o, "address", host);
			add_u64(o, "port", port);
		}
		json_object_array_add(a, o);
	}
	return a;
}

static void cmd_status(struct control_client *cl)
{
	struct control *ctl = cl->ctl;
	struct cache_stats s;
	cache_get_stats(ctl->cfg.cache, &s);
	json_object *o = reply_ok();
	add_string(o, "version", NBDCACHED_VERSION);
	add_u64(o, "pid", (uint64_t)getpid());
	add_u64(o, "uptime_ms", (clock_now_ns() - ctl->started_ns) / 1000000u);
	add_string(o, "config", ctl->cfg.opts->config_path);
	struct export_table *t = ctl->cfg.exports;
	pthread_mutex_lock(&t->lock);
	size_t count = t->count;
	pthread_mutex_unlock(&t->lock);
	add_u64(o, "exports", count);
	unsigned removed;
	add_u64(o, "connections", connection_count(ctl, &removed));
	add_u64(o, "threads", ctl->cfg.threads);
	add_string(o, "arena", s.arena);
	add_u64(o, "cache_bytes", s.cache_bytes);
	add_u64(o, "used_bytes", s.used_bytes);
	add_u64(o, "dirty_bytes", s.traffic.dirty_bytes);
	add_u64(o, "removed_backends", removed);
	json_object_object_add(o, "listen", listen_array(&ctl->cfg));
	client_send(cl, o);
}

static void cmd_exports(struct control_client *cl)
{
	struct export **list;
	size_t n;
	if (export_list(cl->ctl->cfg.exports, &list, &n) < 0) {
		send_error(cl, ENOMEM, "out of memory");
		return;
	}
	json_object *o = reply_ok();
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++) {
		struct export *e = list[i];
		json_object *x = json_object_new_object();
		add_string(x, "name", e->name);
		add_string(x, "description", e->description);
		add_string(x, "backend", e->backing->spec);
		add_string(x, "kind", e->backend->ops->kind);
		add_u64(x, "size", export_size(e));
		json_object_object_add(x, "readonly", json_object_new_boolean(e->readonly));
		add_u64(x, "block_size", e->block_size);
		add_string(x, "cache_mode", options_cache_mode_name(cache_export_mode(e->cache)));
		add_u64(x, "seq_cutoff", e->seq_cutoff);
		add_u64(x, "max_connections", e->max_connections);
		add_u64(x, "connections", atomic_load(&e->backing->connections));
		add_u64(x, "dirty_high", e->dirty_high);
		add_u64(x, "dirty_low", e->dirty_low);
		json_object_array_add(a, x);
		export_put(e);
	}
	free(list);
	json_object_object_add(o, "exports", a);
	client_send(cl, o);
}

static void traffic_fields(json_object *x, const struct cache_export_stats *s)
{
	add_u64(x, "hits", s->hits);
	add_u64(x, "misses", s->misses);
	add_u64(x, "partial_hits", s->partial_hits);
	json_object_object_add(
	    x, "hit_ratio",
	    json_object_new_double(ratio(s->hits, s->hits + s->misses + s->partial_hits)));
	add_u64(x, "dirty_bytes", s->dirty_bytes);
	add_u64(x, "backend_reads", s->backend_reads);
	add_u64(x, "backend_read_bytes", s->backend_read_bytes);
	add_u64(x, "backend_writes", s->backend_writes);
	add_u64(x, "backend_write_bytes", s->backend_write_bytes);
	add_u64(x, "writeback_bytes", s->writeback_bytes);
	add_u64(x, "evictions", s->evictions);
	add_u64(x, "writeback_errors", s->writeback_errors);
	add_u64(x, "unstable_bytes", s->unstable_bytes);
	add_u64(x, "backend_flushes", s->backend_flushes);
	add_u64(x, "backend_flush_errors", s->backend_flush_errors);
	add_u64(x, "losses", s->losses);
}

static void cmd_stats(struct control_client *cl, const char *only)
{
	struct control *ctl = cl->ctl;
	struct export **list;
	size_t n;
	if (export_list(ctl->cfg.exports, &list, &n) < 0) {
		send_error(cl, ENOMEM, "out of memory");
		return;
	}
	bool found = !only;
	for (size_t i = 0; i < n && !found; i++)
		found = strcmp(list[i]->name, only) == 0;
	if (!found) {
		send_error(cl, ENOENT, "no such export '%s'", only);
		goto out;
	}
	struct cache_stats s;
	cache_get_stats(ctl->cfg.cache, &s);
	json_object *o = reply_ok();
	add_u64(o, "time_ms", clock_now_ns() / 1000000u);
	json_object *c = json_object_new_object();
	add_u64(c, "cache_bytes", s.cache_bytes);
	add_u64(c, "used_bytes", s.used_bytes);
	add_u64(c, "entries", s.entries);
	traffic_fields(c, &s.traffic);
	add_u64(c, "writeback_rate", ctl->cache_rate);
	add_u64(c, "bypass_reads", s.traffic.bypass_reads);
	add_u64(c, "direct_writes", s.traffic.direct_writes);
	add_u64(c, "metadata_bytes", s.metadata_bytes);
	json_object *arena = json_object_new_object();
	uint64_t free_bytes = 0;
	json_object *orders = json_object_new_array();
	for (unsigned k = 0; k < NBDCACHED_ARENA_ORDERS; k++) {
		free_bytes += s.free_bytes_by_order[k];
		json_object_array_add(orders,
				      json_object_new_int64((int64_t)s.free_bytes_by_order[k]));
	}
	add_string(arena, "kind", s.arena);
	add_u64(arena, "free_bytes", free_bytes);
	json_object_object_add(arena, "free_bytes_by_order", orders);
	json_object_object_add(arena, "fragmentation",
			       json_object_new_double((double)s.fragmentation / 1000.0));
	add_u64(arena, "large_bytes", s.large_bytes);
	json_object_object_add(arena, "large_share",
			       json_object_new_double((double)s.large_share / 1000.0));
	add_u64(arena, "alloc_2m_attempts", s.alloc_2m_attempts);
	add_u64(arena, "alloc_2m_ok", s.alloc_2m_ok);
	add_u64(arena, "alloc_failures", s.alloc_failures);
	add_u64(arena, "compact_moves", s.compact_moves);
	add_u64(arena, "compact_skipped_pinned", s.compact_skipped_pinned);
	add_u64(arena, "compact_collapses", s.compact_collapses);
	add_u64(arena, "compact_chunks_freed", s.compact_chunks_freed);
	add_u64(arena, "compact_passes", s.compact_passes);
	add_u64(arena, "compact_ns", s.compact_ns);
	json_object_object_add(c, "arena", arena);
	json_object_object_add(o, "cache", c);
	struct budget_stats b;
	budget_get_stats(&b);
	json_object *clients = json_object_new_object();
	add_u64(clients, "connections", b.clients);
	add_u64(clients, "max_clients", b.max_clients);
	add_u64(clients, "refused", b.refused_clients);
	add_u64(clients, "reply_bytes", b.reply_bytes);
	add_u64(clients, "max_reply_bytes", b.max_reply_bytes);
	add_u64(clients, "pinned_reply_bytes", b.pinned_reply_bytes);
	add_u64(clients, "max_pinned_reply_bytes", b.max_pinned_reply_bytes);
	add_u64(clients, "copied_replies", b.copied_replies);
	add_u64(clients, "copied_reply_bytes", b.copied_reply_bytes);
	add_u64(clients, "budget_waits", b.budget_waits);
	json_object_object_add(o, "clients", clients);
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++) {
		struct export *e = list[i];
		if (only && strcmp(e->name, only) != 0)
			continue;
		struct cache_export_stats es;
		cache_export_get_stats(e->cache, &es);
		json_object *x = json_object_new_object();
		add_string(x, "name", e->name);
		add_u64(x, "connections", atomic_load(&e->backing->connections));
		traffic_fields(x, &es);
		struct control_rate *r = rate_for(ctl, e->cache);
		add_u64(x, "writeback_rate", r ? r->rate : 0);
		add_u64(x, "cached_bytes", es.cached_bytes);
		json_object_array_add(a, x);
	}
	json_object_object_add(o, "exports", a);
	client_send(cl, o);
out:
	for (size_t i = 0; i < n; i++)
		export_put(list[i]);
	free(list);
}

static struct export *find_export(struct control_client *cl, json_object *req)
{
	json_object *v;
	if (!json_object_object_get_ex(req, "export", &v) ||
	    !json_object_is_type(v, json_type_string)) {
		send_error(cl, EINVAL, "this command needs \"export\": NAME");
		return NULL;
	}
	const char *name = json_object_get_string(v);
	size_t len = strlen(name);
	struct export *e = len ? export_get(cl->ctl->cfg.exports, name, len) : NULL;
	if (!e)
		send_error(cl, ENOENT, "no such export '%s'", name);
	return e;
}

static void client_resume(struct control_client *cl);

static void wait_done_task(struct cache_op *op, int result);

/* Flush one export through the cache, as an NBD FLUSH would. */
static int start_flush(struct control *ctl, struct control_wait *w, struct cache_export *ce)
{
	struct cache_export_stats s;
	cache_export_get_stats(ce, &s);
	w->ctl = ctl;
	w->dirty_at_start = s.dirty_bytes;
	w->started_ns = clock_now_ns();
	w->seen_error = cache_export_error_seq(ce);
	w->op = (struct cache_op){
	    .ce = ce,
	    .worker = &ctl->worker,
	    .cmd = BACKEND_FLUSH,
	    .seen_error = &w->seen_error,
	    .done = wait_done_task,
	};
	ctl->pending++;
	cache_submit(&w->op);
	return 0;
}

static void maybe_finish_stop(struct control *ctl)
{
	if (ctl->stopping && ctl->pending == 0)
		worker_request_stop(&ctl->worker);
}

static void wait_done_task(struct cache_op *op, int result)
{
	struct control_wait *w =
	    (struct control_wait *)((char *)op - offsetof(struct control_wait, op));
	struct control *ctl = w->ctl;
	cache_op_release(op);
	ctl->pending--;
	struct control_client *cl = w->client;
	if (w->reap) {
		export_reap_flushed(w->reap, result);
	} else if (cl) {
		cl->wait = NULL;
		if (result < 0) {
			if (w->is_set_mode) /* "on failure the mode is unchanged" */
				cache_export_set_mode(w->export->cache, w->previous);
			send_error(
			    cl, -result,
			    "%s: writing back '%s' failed: %s; the data stays dirty in the cache",
			    w->is_set_mode ? "set-mode" : "flush", w->export->name,
			    strerror(-result));
		} else if (w->is_set_mode) {
			cache_export_set_mode(w->export->cache, w->set_mode);
			log_info("export '%s': cache mode %s (was %s), set from the control socket",
				 w->export->name, options_cache_mode_name(w->set_mode),
				 options_cache_mode_name(w->previous));
			json_object *o = reply_ok();
			add_string(o, "export", w->export->name);
			add_string(o, "mode", options_cache_mode_name(w->set_mode));
			add_string(o, "previous", options_cache_mode_name(w->previous));
			client_send(cl, o);
		} else {
			json_object *o = reply_ok();
			add_string(o, "export", w->export->name);
			add_u64(o, "flushed_bytes", w->dirty_at_start);
			add_u64(o, "time_ms", (clock_now_ns() - w->started_ns) / 1000000u);
			client_send(cl, o);
		}
		client_resume(cl);
	} else if (w->is_set_mode) { /* the client left: finish what it asked */
		cache_export_set_mode(w->export->cache, result == 0 ? w->set_mode : w->previous);
	}
	export_put(w->export);
	free(w);
	maybe_finish_stop(ctl);
}

static void cmd_flush(struct control_client *cl, json_object *req, bool set_mode)
{
	struct export *e = find_export(cl, req);
	if (!e)
		return;
	enum cache_mode mode = CACHE_MODE_DEFAULT, previous = cache_export_mode(e->cache);
	if (set_mode) {
		json_object *v;
		if (!json_object_object_get_ex(req, "mode", &v) ||
		    !json_object_is_type(v, json_type_string) ||
		    options_parse_cache_mode(json_object_get_string(v), &mode) < 0) {
			send_error(
			    cl, EINVAL,
			    "set-mode needs \"mode\": writeback, writethrough, writearound or "
			    "none");
			export_put(e);
			return;
		}
		if ((mode == CACHE_MODE_NONE) != (previous == CACHE_MODE_NONE)) {
			send_error(
			    cl, ENOTSUP,
			    "mode none bypasses the cache: switching '%s' to or from it needs "
			    "a restart (set it in the config)",
			    e->name);
			export_put(e);
			return;
		}
		if (previous != CACHE_MODE_WRITEBACK || mode == CACHE_MODE_WRITEBACK) {
			/* Nothing to write back first. */
			cache_export_set_mode(e->cache, mode);
			log_info("export '%s': cache mode %s (was %s), set from the control socket",
				 e->name, options_cache_mode_name(mode),
				 options_cache_mode_name(previous));
			json_object *o = reply_ok();
			add_string(o, "export", e->name);
			add_string(o, "mode", options_cache_mode_name(mode));
			add_string(o, "previous", options_cache_mode_name(previous));
			client_send(cl, o);
			export_put(e);
			return;
		}
		/* New writes go through from now on; then the old dirty data. */
		cache_export_set_mode(e->cache, CACHE_MODE_WRITETHROUGH);
	}
	struct control_wait *w = calloc(1, sizeof(*w));
	if (!w) {
		if (set_mode)
			cache_export_set_mode(e->cache, previous);
		send_error(cl, ENOMEM, "out of memory");
		export_put(e);
		return;
	}
	w->client = cl;
	w->export = e;
	w->is_set_mode = set_mode;
	w->set_mode = mode;
	w->previous = previous;
	cl->wait = w;
	bufferevent_disable(cl->bev, EV_READ); /* replies in order */
	start_flush(cl->ctl, w, e->cache);
}

static void cmd_drop_clean(struct control_client *cl, json_object *req)
{
	struct export *e = find_export(cl, req);
	if (!e)
		return;
	uint64_t dropped, kept;
	int rc = cache_export_drop_clean(e->cache, &dropped, &kept);
	if (rc < 0) {
		send_error(cl, -rc, "drop-clean '%s': %s", e->name, strerror(-rc));
	} else {
		log_info("export '%s': dropped %llu clean bytes from the cache (control socket)",
			 e->name, (unsigned long long)dropped);
		json_object *o = reply_ok();
		add_string(o, "export", e->name);
		add_u64(o, "dropped_bytes", dropped);
		add_u64(o, "kept_bytes", kept);
		client_send(cl, o);
	}
	export_put(e);
}

/* Blocks this thread for the pass (about 1 s per GiB at worst), never an
 * NBD worker. */
static void cmd_compact(struct control_client *cl)
{
	struct cache_compact_result r;
	cache_compact(cl->ctl->cfg.cache, &r);
	log_info("cache: compaction pass (control socket): %llu moved, %llu pinned, %llu "
		 "collapsed, %llu chunks freed, fragmentation %u -> %u per mille in %llu us",
		 (unsigned long long)r.moved, (unsigned long long)r.skipped_pinned,
		 (unsigned long long)r.collapsed, (unsigned long long)r.freed_2m_chunks,
		 r.fragmentation_before, r.fragmentation_after,
		 (unsigned long long)(r.time_ns / 1000u));
	json_object *o = reply_ok();
	add_u64(o, "moved", r.moved);
	add_u64(o, "skipped_pinned", r.skipped_pinned);
	add_u64(o, "collapsed", r.collapsed);
	add_u64(o, "freed_2m_chunks", r.freed_2m_chunks);
	add_u64(o, "time_ns", r.time_ns);
	json_object_object_add(o, "fragmentation_before",
			       json_object_new_double((double)r.fragmentation_before / 1000.0));
	json_object_object_add(o, "fragmentation_after",
			       json_object_new_double((double)r.fragmentation_after / 1000.0));
	client_send(cl, o);
}

static void reload_now(struct control *ctl, struct control_client *cl);

/* Keys in the text: strings followed by a colon (strict JSON: only '"' quotes). */
static size_t keys_in_text(const char *text, size_t len)
{
	size_t keys = 0;
	for (size_t i = 0; i < len; i++) {
		if (text[i] != '"')
			continue;
		for (i++; i < len && text[i] != '"'; i++)
			if (text[i] == '\\')
				i++;
		size_t j = i + 1;
		while (j < len && strchr(" \t\r\n", text[j]))
			j++;
		if (j < len && text[j] == ':')
			keys++;
	}
	return keys;
}

/* Keys json-c kept, at every depth (its tokener bounds the depth). */
static size_t keys_in_tree(json_object *o)
{
	size_t keys = 0;
	if (json_object_is_type(o, json_type_object)) {
		json_object_object_foreach(o, key, value)
		{
			(void)key;
			keys += 1 + keys_in_tree(value);
		}
	} else if (json_object_is_type(o, json_type_array)) {
		for (size_t i = 0; i < json_object_array_length(o); i++)
			keys += keys_in_tree(json_object_array_get_idx(o, i));
	}
	return keys;
}

/*
 * One request: strict JSON, one object, nothing but white space after it,
 * no key twice in any object. json-c keeps the last of duplicate keys
 * without a word, so {"command":"status","command":"reload"} would reload:
 * a duplicate shows as fewer keys in the tree than in the text (each one
 * drops at least itself). NULL, with *why set, when refused.
 */
static json_object *parse_request(const char *line, size_t len, const char **why)
{
	*why = "expected one JSON object per line with \"command\": NAME";
	json_tokener *tok = json_tokener_new();
	if (!tok)
		return NULL;
	json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
	json_object *req = json_tokener_parse_ex(tok, line, (int)len);
	bool complete = json_tokener_get_error(tok) == json_tokener_success;
	size_t end = json_tokener_get_parse_end(tok);
	json_tokener_free(tok);
	if (!req || !complete || !json_object_is_type(req, json_type_object))
		goto refuse;
	for (size_t i = end; i < len; i++) {
		if (!strchr(" \t\r", line[i])) {
			*why = "text after the JSON object (one object per line)";
			goto refuse;
		}
	}
	if (keys_in_tree(req) != keys_in_text(line, end)) {
		*why = "a key given twice in one object";
		goto refuse;
	}
	return req;
refuse:
	json_object_put(req);
	return NULL;
}

static void dispatch(struct control_client *cl, const char *line, size_t len)
{
	const char *why;
	json_object *req = parse_request(line, len, &why);
	json_object *v;
	if (!req || !json_object_object_get_ex(req, "command", &v) ||
	    !json_object_is_type(v, json_type_string)) {
		send_error(cl, EINVAL, "%s", req ? "expected \"command\": NAME" : why);
		json_object_put(req);
		return;
	}
	const char *cmd = json_object_get_string(v);
	if (strcmp(cmd, "status") == 0)
		cmd_status(cl);
	else if (strcmp(cmd, "exports") == 0)
		cmd_exports(cl);
	else if (strcmp(cmd, "stats") == 0) {
		json_object *e;
		const char *only = NULL;
		if (json_object_object_get_ex(req, "export", &e)) {
			if (!json_object_is_type(e, json_type_string)) {
				send_error(cl, EINVAL, "\"export\" must be a string");
				json_object_put(req);
				return;
			}
			only = json_object_get_string(e);
		}
		cmd_stats(cl, only);
	} else if (strcmp(cmd, "flush") == 0)
		cmd_flush(cl, req, false);
	else if (strcmp(cmd, "set-mode") == 0)
		cmd_flush(cl, req, true);
	else if (strcmp(cmd, "drop-clean") == 0)
		cmd_drop_clean(cl, req);
	else if (strcmp(cmd, "compact") == 0)
		cmd_compact(cl);
	else if (strcmp(cmd, "reload") == 0)
		reload_now(cl->ctl, cl);
	else
		send_error(cl, EINVAL,
			   "unknown command '%s' (status, exports, stats, flush, drop-clean, "
			   "compact, set-mode, reload)",
			   cmd);
	json_object_put(req);
}

/* ---- clients ---- */

static void client_free(struct control_client *cl)
{
	if (cl->wait)
		cl->wait->client = NULL; /* its completion finds no one to answer */
	if (cl->prev)
		cl->prev->next = cl->next;
	else
		cl->ctl->clients = cl->next;
	if (cl->next)
		cl->next->prev = cl->prev;
	if (cl->bev)
		bufferevent_free(cl->bev);
	cl->ctl->client_count--;
	free(cl);
}

static size_t client_unread(struct control_client *cl)
{
	return evbuffer_get_length(bufferevent_get_output(cl->bev));
}

/*
 * Answer the complete lines read so far, while no request waits and fewer
 * than CONTROL_MAX_OUTPUT bytes of replies are unread; then read more only
 * if that still holds. False when the client was freed.
 */
static bool client_process(struct control_client *cl)
{
	struct evbuffer *in = bufferevent_get_input(cl->bev);
	while (!cl->wait && !cl->closing && client_unread(cl) < CONTROL_MAX_OUTPUT) {
		size_t len;
		char *line = evbuffer_readln(in, &len, EVBUFFER_EOL_LF);
		if (!line) {
			if (evbuffer_get_length(in) > NBDCACHED_CONTROL_MAX_REQUEST) {
				log_warn(
				    "control: request longer than %d bytes; closing the client",
				    NBDCACHED_CONTROL_MAX_REQUEST);
				client_free(cl);
				return false;
			}
			if (cl->eof) {
				/* Everything it sent is answered: close once it is read. */
				if (client_unread(cl) == 0) {
					client_free(cl);
					return false;
				}
				cl->closing = true;
			}
			break;
		}
		if (len)
			dispatch(cl, line, len);
		free(line);
	}
	if (!cl->wait && !cl->eof && !cl->closing && client_unread(cl) < CONTROL_MAX_OUTPUT)
		bufferevent_enable(cl->bev, EV_READ);
	else
		bufferevent_disable(cl->bev, EV_READ);
	return true;
}

static void client_resume(struct control_client *cl)
{
	if (!cl->bev)
		return;
	client_process(cl);
}

static void on_client_read(struct bufferevent *bev, void *arg)
{
	(void)bev;
	client_process(arg);
}

/* The output drained below the low watermark (half of CONTROL_MAX_OUTPUT). */
static void on_client_write(struct bufferevent *bev, void *arg)
{
	(void)bev;
	struct control_client *cl = arg;
	if (cl->closing) {
		if (client_unread(cl) == 0)
			client_free(cl);
		return;
	}
	client_process(cl);
}

static void on_client_event(struct bufferevent *bev, short what, void *arg)
{
	(void)bev;
	struct control_client *cl = arg;
	if (what & BEV_EVENT_EOF) {
		/* Answer what was already read before going: a client may send
		 * requests and shut down its side. */
		cl->eof = true;
		if (!cl->wait)
			client_process(cl);
		return; /* else answered when the request completes */
	}
	if (what & BEV_EVENT_ERROR) {
		if (cl->wait) {
			cl->closing = true; /* answered (to no one) when it completes */
			return;
		}
		client_free(cl);
	}
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len,
		      void *arg)
{
	(void)l;
	(void)sa;
	(void)len;
	struct control *ctl = arg;
	if (ctl->client_count >= CONTROL_MAX_CLIENTS) {
		if (!ctl->refusing)
			log_warn("control: %d clients connected; refusing more until one leaves",
				 CONTROL_MAX_CLIENTS);
		ctl->refusing = true;
		close(fd);
		return;
	}
	ctl->refusing = false;
	struct control_client *cl = calloc(1, sizeof(*cl));
	if (!cl) {
		close(fd);
		return;
	}
	cl->ctl = ctl;
	cl->bev = bufferevent_socket_new(ctl->worker.base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (!cl->bev) {
		close(fd);
		free(cl);
		return;
	}
	cl->next = ctl->clients;
	if (ctl->clients)
		ctl->clients->prev = cl;
	ctl->clients = cl;
	ctl->client_count++;
	bufferevent_setcb(cl->bev, on_client_read, on_client_write, on_client_event, cl);
	bufferevent_setwatermark(cl->bev, EV_WRITE, CONTROL_MAX_OUTPUT / 2, 0);
	bufferevent_enable(cl->bev, EV_READ | EV_WRITE);
}

/* ---- reload ---- */

static bool same_strings(char **a, size_t an, char **b, size_t bn)
{
	if (an != bn)
		return false;
	for (size_t i = 0; i < an; i++)
		if (strcmp(a[i], b[i]) != 0)
			return false;
	return true;
}

static bool same_opt_string(const char *a, const char *b)
{
	return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

/* Settings fixed at start; a reload that changes them is told so. */
static void refused_globals(const struct options *was, const struct options *now, json_object *out)
{
	struct {
		bool changed;
		const char *name;
	} const checks[] = {
	    {was->cache_size != now->cache_size, "cache-size"},
	    {was->hugepages != now->hugepages, "hugepages"},
	    {was->threads != now->threads, "threads"},
	    {!same_strings(was->listen, was->listen_count, now->listen, now->listen_count) ||
		 !same_strings(was->unix_paths, was->unix_count, now->unix_paths, now->unix_count),
	     "listen"},
	    {!same_opt_string(was->control_path, now->control_path), "control"},
	    {!same_opt_string(was->user, now->user), "user"},
	    {!same_opt_string(was->group, now->group), "group"},
	    {!same_opt_string(was->pidfile, now->pidfile), "pidfile"},
	    {was->backend_timeout != now->backend_timeout, "backend-timeout"},
	    {was->compact != now->compact, "compact"},
	    {was->compact_interval_ms != now->compact_interval_ms, "compact-interval-ms"},
	    {was->compact_threshold != now->compact_threshold, "compact-threshold"},
	    {was->max_clients != now->max_clients, "max-clients"},
	    {was->max_reply_memory != now->max_reply_memory, "max-reply-memory"},
	    {was->max_pinned_replies != now->max_pinned_replies, "max-pinned-replies"},
	    {was->stall_timeout != now->stall_timeout, "stall-timeout"},
	    {was->negotiation_timeout != now->negotiation_timeout, "negotiation-timeout"},
	};
	for (size_t i = 0; i < sizeof(checks) / sizeof(checks[0]); i++) {
		if (!checks[i].changed)
			continue;
		log_warn("reload: %s cannot change while running; restart to apply it",
			 checks[i].name);
		json_object_array_add(out, json_object_new_string(checks[i].name));
	}
}

static json_object *names_array(char **v, size_t n)
{
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++)
		json_object_array_add(a, json_object_new_string(v[i]));
	return a;
}

static void reload_now(struct control *ctl, struct control_client *cl)
{
	sd_notify(0, "RELOADING=1\nSTATUS=reloading the configuration");
	struct options opts;
	char err[1024];
	int rc = config_options(ctl->cfg.argc, ctl->cfg.argv, &opts, err, sizeof(err));
	if (rc < 0) {
		log_error("reload: %s; the running configuration stays", err);
		sd_notify(0, "READY=1\nSTATUS=reload failed; serving the previous configuration");
		if (cl)
			send_error(cl, EINVAL, "%s", err);
		return;
	}
	log_set_level(opts.log_level);
	cache_set_writeback_policy(ctl->cfg.cache, opts.dirty_high, opts.dirty_low,
				   opts.dirty_expire);
	json_object *refused = json_object_new_array();
	refused_globals(ctl->cfg.opts, &opts, refused);
	struct export_reload r;
	rc = export_table_reload(ctl->cfg.exports, &opts, &r);
	options_free(&opts);
	log_info("reload: %zu export(s) added, %zu changed, %zu removed, %zu refused%s",
		 r.added_count, r.changed_count, r.removed_count, r.refused_count,
		 rc < 0 ? " (stopped early: out of memory)" : "");
	struct export_table *t = ctl->cfg.exports;
	pthread_mutex_lock(&t->lock);
	size_t count = t->count;
	pthread_mutex_unlock(&t->lock);
	sd_notifyf(0, "READY=1\nSTATUS=serving %zu export(s)", count);
	if (cl) {
		if (rc < 0) {
			send_error(cl, -rc, "reload stopped early: %s", strerror(-rc));
			json_object_put(refused);
		} else {
			json_object *o = reply_ok();
			json_object_object_add(o, "added", names_array(r.added, r.added_count));
			json_object_object_add(o, "changed",
					       names_array(r.changed, r.changed_count));
			json_object_object_add(o, "removed",
					       names_array(r.removed, r.removed_count));
			json_object_object_add(o, "refused",
					       names_array(r.refused, r.refused_count));
			json_object_object_add(o, "refused_settings", refused);
			client_send(cl, o);
		}
	} else {
		json_object_put(refused);
	}
	export_reload_free(&r);
}

static void reload_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, reload_task));
	pthread_mutex_lock(&ctl->reload_lock);
	ctl->reload_posted = false;
	pthread_mutex_unlock(&ctl->reload_lock);
	if (!ctl->stopping)
		reload_now(ctl, NULL);
}

void control_reload(struct control *ctl)
{
	pthread_mutex_lock(&ctl->reload_lock);
	bool post = !ctl->reload_posted;
	ctl->reload_posted = true;
	pthread_mutex_unlock(&ctl->reload_lock);
	if (post)
		worker_post(&ctl->worker, &ctl->reload_task);
}

/* ---- the once-a-second tick: rates and reaping ---- */

static void reap_flush(struct export_backing *b, void *arg)
{
	struct control *ctl = arg;
	struct control_wait *w = calloc(1, sizeof(*w));
	if (!w) {
		export_reap_flushed(b, -ENOMEM);
		return;
	}
	w->reap = b;
	start_flush(ctl, w, b->cache);
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct control *ctl = arg;
	sample_rates(ctl);
	if (!ctl->stopping)
		export_table_reap(ctl->cfg.exports, reap_flush, ctl);
}

/* ---- life cycle ---- */

int control_listen(const char *path, int *fd)
{
	bool is_default = path == NULL;
	if (is_default)
		path = NBDCACHED_CONTROL_DEFAULT;
	*fd = -1;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	if (is_default)
		mkdir("/run/nbdcached", 0755); /* systemd's RuntimeDirectory= may have made it */
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	/* A live daemon answers on it; a stale socket refuses. */
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		close(s);
		if (is_default) {
			log_warn(
			    "control socket %s is in use by another nbdcached; running without "
			    "one (give --control PATH)",
			    path);
			return 0;
		}
		log_error("--control %s: in use by another running daemon", path);
		return -EADDRINUSE;
	}
	close(s);
	s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	struct stat st;
	if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
		unlink(path);
	mode_t old = umask(0077); /* root only (the owner) until the operator says otherwise */
	int rc = 0;
	if (bind(s, (struct sockaddr *)&sa, sizeof(sa)) < 0 || chmod(path, 0600) < 0 ||
	    listen(s, 16) < 0)
		rc = -errno;
	umask(old);
	if (rc < 0) {
		close(s);
		if (is_default) {
			log_warn("control socket %s: %s; running without one", path, strerror(-rc));
			return 0;
		}
		log_error("--control %s: %s", path, strerror(-rc));
		return rc;
	}
	log_info("control socket %s", path);
	*fd = s;
	return 0;
}

static void start_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, start_task));
	ctl->tick = event_new(ctl->worker.base, -1, EV_PERSIST, on_tick, ctl);
	struct timeval tv = {1, 0};
	if (ctl->tick)
		event_add(ctl->tick, &tv);
	if (ctl->cfg.control_fd >= 0) {
		evutil_make_socket_nonblocking(ctl->cfg.control_fd);
		ctl->listener = evconnlistener_new(ctl->worker.base, on_accept, ctl,
						   LEV_OPT_CLOSE_ON_FREE, -1, ctl->cfg.control_fd);
		if (!ctl->listener) {
			log_error("control socket: cannot listen");
			close(ctl->cfg.control_fd);
		}
		ctl->cfg.control_fd = -1;
	}
}

static void stop_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, stop_task));
	ctl->stopping = true;
	if (ctl->listener)
		evconnlistener_free(ctl->listener);
	ctl->listener = NULL;
	if (ctl->tick)
		event_free(ctl->tick);
	ctl->tick = NULL;
	while (ctl->clients)
		client_free(ctl->clients);
	maybe_finish_stop(ctl);
}

int control_start(const struct control_config *cfg, struct control **out)
{
	struct control *ctl = calloc(1, sizeof(*ctl));
	if (!ctl)
		return -ENOMEM;
	ctl->cfg = *cfg;
	ctl->started_ns = clock_now_ns();
	pthread_mutex_init(&ctl->reload_lock, NULL);
	ctl->reload_task.run = reload_task;
	ctl->start_task.run = start_task;
	ctl->stop_task.run = stop_task;
	int rc = worker_start(&ctl->worker, cfg->threads, cfg->exports);
	if (rc < 0) {
		pthread_mutex_destroy(&ctl->reload_lock);
		free(ctl);
		return rc;
	}
	worker_post(&ctl->worker, &ctl->start_task);
	*out = ctl;
	return 0;
}

void control_stop(struct control *ctl)
{
	if (!ctl)
		return;
	worker_post(&ctl->worker, &ctl->stop_task);
	worker_join(&ctl->worker);
	if (ctl->cfg.control_path)
		unlink(ctl->cfg.control_path);
	pthread_mutex_destroy(&ctl->reload_lock);
	free(ctl);
}
