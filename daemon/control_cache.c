/*
 * daemon/control_cache.c: the control socket's commands that act on the
 * cache: flush and set-mode, which wait for it, drop-clean and compact,
 * which do not; the flush a reap of a removed export needs
 * (control_reload.c); and cache-device flush and detach, which write
 * back every export on the cache device, one after another.
 *
 * A waiting request is a struct control_wait holding a cache op. While it
 * is in flight its client is not read (cl->wait), so replies stay in
 * request order; the cache calls wait_done_task() on this thread, which
 * replies and resumes the client. A client that leaves meanwhile leaves
 * the wait behind (client NULL): set-mode still finishes what it asked.
 *
 *   control_cmd_flush --control_flush_start--> cache op
 *        ... cache ... --wait_done_task--> control_send, control_client_resume
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <event2/bufferevent.h>
#include <event2/event.h>

#include "daemon/check.h"
#include "daemon/clock.h"
#include "daemon/control_internal.h"
#include "daemon/log.h"

static struct export *find_export(struct control_client *cl, json_object *req)
{
	json_object *v;
	if (!json_object_object_get_ex(req, "export", &v) ||
	    !json_object_is_type(v, json_type_string)) {
		control_send_error(cl, EINVAL, "this command needs \"export\": NAME");
		return NULL;
	}
	const char *name = json_object_get_string(v);
	size_t len = strlen(name);
	struct export *e = len ? export_get(cl->ctl->cfg.exports, name, len) : NULL;
	if (!e)
		control_send_error(cl, ENOENT, "no such export '%s'", name);
	return e;
}

static void wait_done_task(struct cache_op *op, int result);

/* Flush one export through the cache, as an NBD FLUSH would. */
void control_flush_start(struct control *ctl, struct control_wait *w, struct cache_export *ce)
{
	struct cache_export_stats s;
	cache_export_get_stats(ce, &s);
	w->ctl = ctl;
	w->dirty_at_start = s.dirty_bytes;
	w->started_ns = clock_now_ns();
	w->seen_error = cache_export_error_seq(ce);
	/* Written back, with a cache device too: each caller (flush, a
	 * mode change, a removed export's reaping) promises the backend
	 * has the data, which a round answered from the log would not. */
	w->op = (struct cache_op){
	    .ce = ce,
	    .worker = &ctl->worker,
	    .cmd = BACKEND_FLUSH,
	    .flags = CACHE_FLUSH_WRITEBACK,
	    .seen_error = &w->seen_error,
	    .done = wait_done_task,
	};
	ctl->pending++;
	cache_submit(&w->op);
}

void control_stop_when_idle(struct control *ctl)
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
			control_send_error(
			    cl, -result,
			    "%s: writing back '%s' failed: %s; the data stays dirty in the cache",
			    w->is_set_mode ? "set-mode" : "flush", w->export->name,
			    strerror(-result));
		} else if (w->is_set_mode) {
			cache_export_set_mode(w->export->cache, w->set_mode);
			log_info("export '%s': cache mode %s (was %s), set from the control socket",
				 w->export->name, options_cache_mode_name(w->set_mode),
				 options_cache_mode_name(w->previous));
			json_object *o = control_reply_ok();
			control_add_string(o, "export", w->export->name);
			control_add_string(o, "mode", options_cache_mode_name(w->set_mode));
			control_add_string(o, "previous", options_cache_mode_name(w->previous));
			control_send(cl, o);
		} else {
			json_object *o = control_reply_ok();
			control_add_string(o, "export", w->export->name);
			control_add_u64(o, "flushed_bytes", w->dirty_at_start);
			control_add_u64(o, "time_ms", (clock_now_ns() - w->started_ns) / 1000000u);
			control_send(cl, o);
		}
		control_client_resume(cl);
	} else if (w->is_set_mode) { /* the client left: finish what it asked */
		cache_export_set_mode(w->export->cache, result == 0 ? w->set_mode : w->previous);
	}
	export_put(w->export);
	free(w);
	control_stop_when_idle(ctl);
}

void control_cmd_flush(struct control_client *cl, json_object *req, bool set_mode)
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
			control_send_error(
			    cl, EINVAL,
			    "set-mode needs \"mode\": writeback, writethrough, writearound or "
			    "none");
			export_put(e);
			return;
		}
		if ((mode == CACHE_MODE_NONE) != (previous == CACHE_MODE_NONE)) {
			control_send_error(
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
			json_object *o = control_reply_ok();
			control_add_string(o, "export", e->name);
			control_add_string(o, "mode", options_cache_mode_name(mode));
			control_add_string(o, "previous", options_cache_mode_name(previous));
			control_send(cl, o);
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
		control_send_error(cl, ENOMEM, "out of memory");
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
	control_flush_start(cl->ctl, w, e->cache);
}

/* ---- cache-device flush and detach ---- */

static void device_next(struct control_wait *w);

static void device_step_done(struct cache_op *op, int result)
{
	struct control_wait *w =
	    (struct control_wait *)((char *)op - offsetof(struct control_wait, op));
	cache_op_release(op);
	w->ctl->pending--;
	if (result < 0 && !w->dev_error)
		w->dev_error = result;
	w->dev_next++;
	device_next(w);
}

/* The next export's FLUSH, written back rather than answered from the
 * log (a full round, answered once a checkpoint covers it); after the
 * last one, detach, reply, and resume the client. */
static void device_next(struct control_wait *w)
{
	struct control *ctl = w->ctl;
	if (ctl->stopping && !w->dev_error)
		w->dev_error = -ESHUTDOWN;
	if (w->dev_next < w->dev_n && !w->dev_error) {
		struct cache_export *ce = w->dev_list[w->dev_next]->cache;
		w->seen_error = cache_export_error_seq(ce);
		w->op = (struct cache_op){
		    .ce = ce,
		    .worker = &ctl->worker,
		    .cmd = BACKEND_FLUSH,
		    .flags = CACHE_FLUSH_WRITEBACK,
		    .seen_error = &w->seen_error,
		    .done = device_step_done,
		};
		ctl->pending++;
		cache_submit(&w->op);
		return;
	}
	const char *action = w->dev_detach ? "detach" : "flush";
	struct cache_device *dev = cache_get_device(ctl->cfg.cache);
	int rc = w->dev_error;
	if (rc == 0 && w->dev_detach) {
		rc = cache_device_detach_end(dev);
		/* Records came meanwhile (direct writes, CLEAN records): the
		 * log is emptied again, a few times at most. */
		if (rc == -EBUSY && ++w->dev_passes < 4) {
			w->dev_next = 0;
			device_next(w);
			return;
		}
	}
	uint64_t ms = (clock_now_ns() - w->started_ns) / 1000000u;
	if (rc < 0)
		log_error("cache device: %s (control socket) failed after %llu ms: %s", action,
			  (unsigned long long)ms, strerror(-rc));
	else
		log_info("cache device: %s (control socket): %zu export(s) written back and "
			 "flushed in %llu ms",
			 action, w->dev_n, (unsigned long long)ms);
	struct control_client *cl = w->client;
	if (cl) {
		cl->wait = NULL;
		if (rc < 0) {
			control_send_error(
			    cl, -rc, "cache-device %s: %s; %s", action,
			    rc == -EBUSY ? "records kept coming into the log; it could not be "
					   "emptied"
			    : rc == -ESHUTDOWN ? "the daemon is stopping"
					       : strerror(-rc),
			    w->dev_detach
				? "the device stays detaching (no new records, no level-2 "
				  "cache): try again"
				: "the data stays dirty in the cache");
		} else {
			json_object *o = control_reply_ok();
			control_add_string(o, "action", action);
			control_add_u64(o, "exports", w->dev_n);
			control_add_u64(o, "time_ms", ms);
			control_add_string(o, "path", ctl->cfg.opts->cache_device);
			json_object *d = control_device_object(ctl->cfg.cache);
			if (d)
				json_object_object_add(o, "cache_device", d);
			control_send(cl, o);
		}
		control_client_resume(cl);
	}
	for (size_t i = 0; i < w->dev_n; i++)
		export_put(w->dev_list[i]);
	free(w->dev_list);
	free(w);
	control_stop_when_idle(ctl);
}

void control_device_flush(struct control_client *cl, bool detach)
{
	struct control *ctl = cl->ctl;
	struct cache_device *dev = cache_get_device(ctl->cfg.cache);
	struct export **list;
	size_t n;
	if (export_list(ctl->cfg.exports, &list, &n) < 0) {
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	/* Each cache export once (windows share theirs), only those on the
	 * device. */
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		bool keep = cache_export_on_device(list[i]->cache);
		for (size_t j = 0; j < k && keep; j++)
			keep = list[j]->cache != list[i]->cache;
		if (keep)
			list[k++] = list[i];
		else
			export_put(list[i]);
	}
	struct control_wait *w = calloc(1, sizeof(*w));
	int rc = w ? 0 : -ENOMEM;
	if (rc == 0 && detach) {
		rc = cache_device_detach_begin(dev);
		if (rc == -EALREADY || rc == -EIO)
			control_send_error(cl, -rc, "cache-device detach: %s",
					   rc == -EALREADY ? "the device is detached already"
							   : "the device failed: it is not used");
	} else if (rc < 0) {
		control_send_error(cl, ENOMEM, "out of memory");
	}
	if (rc < 0) {
		free(w);
		for (size_t i = 0; i < k; i++)
			export_put(list[i]);
		free(list);
		return;
	}
	log_info("cache device: %s (control socket): writing back %zu export(s)",
		 detach ? "detach" : "flush", k);
	w->ctl = ctl;
	w->client = cl;
	w->dev_list = list;
	w->dev_n = k;
	w->dev_detach = detach;
	w->started_ns = clock_now_ns();
	cl->wait = w;
	bufferevent_disable(cl->bev, EV_READ); /* replies in order */
	device_next(w);
}

void control_cmd_drop_clean(struct control_client *cl, json_object *req)
{
	struct export *e = find_export(cl, req);
	if (!e)
		return;
	uint64_t dropped, kept;
	int rc = cache_export_drop_clean(e->cache, &dropped, &kept);
	if (rc < 0) {
		control_send_error(cl, -rc, "drop-clean '%s': %s", e->name, strerror(-rc));
	} else {
		log_info("export '%s': dropped %llu clean bytes from the cache (control socket)",
			 e->name, (unsigned long long)dropped);
		json_object *o = control_reply_ok();
		control_add_string(o, "export", e->name);
		control_add_u64(o, "dropped_bytes", dropped);
		control_add_u64(o, "kept_bytes", kept);
		control_send(cl, o);
	}
	export_put(e);
}

bool control_debug_hooks(void)
{
	static int on = -1; /* read once (the control thread) */
	if (on < 0) {
		const char *v = getenv("NBDCACHED_DEBUG_HOOKS");
		on = v && strcmp(v, "1") == 0;
	}
	return on;
}

void control_cmd_debug_unpin(struct control_client *cl, json_object *req)
{
	struct export *e = find_export(cl, req);
	if (!e)
		return;
	json_object *v;
	uint64_t offset = 0;
	if (json_object_object_get_ex(req, "offset", &v))
		offset = (uint64_t)json_object_get_int64(v);
	bool unpinned = offset < e->backend->size && cache_debug_unpin(e->cache, offset);
	log_warn("export '%s': debug-unpin at %llu (control socket, a debug hook): %s", e->name,
		 (unsigned long long)offset, unpinned ? "done" : "no idle entry there");
	json_object *o = control_reply_ok();
	json_object_object_add(o, "unpinned", json_object_new_boolean(unpinned));
	control_add_u64(o, "invariant_violations", check_violations());
	control_send(cl, o);
	export_put(e);
}

/* Blocks this thread for the pass (about 1 s per GiB at worst), never an
 * NBD worker. */
void control_cmd_compact(struct control_client *cl)
{
	struct cache_compact_result r;
	cache_compact(cl->ctl->cfg.cache, &r);
	log_info("cache: compaction pass (control socket): %llu moved, %llu pinned, %llu "
		 "collapsed, %llu chunks freed, fragmentation %u -> %u per mille in %llu us",
		 (unsigned long long)r.moved, (unsigned long long)r.skipped_pinned,
		 (unsigned long long)r.collapsed, (unsigned long long)r.freed_2m_chunks,
		 r.fragmentation_before, r.fragmentation_after,
		 (unsigned long long)(r.time_ns / 1000u));
	json_object *o = control_reply_ok();
	control_add_u64(o, "moved", r.moved);
	control_add_u64(o, "skipped_pinned", r.skipped_pinned);
	control_add_u64(o, "collapsed", r.collapsed);
	control_add_u64(o, "freed_2m_chunks", r.freed_2m_chunks);
	control_add_u64(o, "time_ns", r.time_ns);
	json_object_object_add(o, "fragmentation_before",
			       json_object_new_double((double)r.fragmentation_before / 1000.0));
	json_object_object_add(o, "fragmentation_after",
			       json_object_new_double((double)r.fragmentation_after / 1000.0));
	control_send(cl, o);
}
