/*
 * daemon/export_resize.c: online resize (see export.h).
 *
 * A resize is about a backing, not one export: every export over the
 * backend sees its new end. The order of the steps keeps every byte a
 * client can reach backed by the cache's and the backend's size:
 *
 *   grow:    backend (ftruncate) -> cache size -> backend size published
 *            (be->size) -> new versions (new connections see them)
 *   shrink:  be->size first (requests past the new end refused from now
 *            on) -> cache size, dropping what it holds past the end (or
 *            -EBUSY: dirty, unstable or in use; both sizes move back) ->
 *            backend (ftruncate) -> new versions
 *
 * Connections keep the version they negotiated, and so their size; after
 * a shrink their requests past the new end are refused with ENOSPC (what
 * the resize extension asks for requests between the new and the old
 * end; export_past_end, checked by the transmission phase).
 *
 * Everything here runs on the control thread, one resize at a time:
 * export_resize() for the control socket, export_table_refresh() for a
 * reload, and NBD_CMD_RESIZE posted there by export_resize_post(). The
 * control socket finds its export by name; NBD_CMD_RESIZE never does: it
 * resizes the current version of the export its connection negotiated
 * (export_current), under that version's rights, or nothing.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/export_internal.h"
#include "daemon/log.h"

static int fail(struct export_resize_result *out, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(struct export_resize_result *out, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(out->message, sizeof(out->message), fmt, ap);
	va_end(ap);
	return rc;
}

/* Can the backing's exports have a backend of end bytes? Not when a window
 * made by hand would be cut, an export would start past the end, or a
 * split export would have too many windows (-EBUSY, -EINVAL, said why). */
static int check_versions(struct export **v, size_t n, const struct export_backing *b, uint64_t end,
			  struct export_resize_result *out)
{
	for (size_t i = 0; i < n; i++) {
		const struct export *e = v[i];
		if (e->backing != b || e->window_of)
			continue;
		if (!e->to_end && (e->offset > end || e->size > end - e->offset))
			return fail(out, -EBUSY,
				    "window '%s' (bytes %llu to %llu, offset= and size= in the "
				    "config) would run past the new end at %llu",
				    e->name, (unsigned long long)e->offset,
				    (unsigned long long)(e->offset + e->size - 1),
				    (unsigned long long)end);
		if (e->to_end && e->offset >= end)
			return fail(out, -EINVAL,
				    "export '%s' starts at byte %llu, past the new end", e->name,
				    (unsigned long long)e->offset);
		if (e->to_end && window_count(end - e->offset, e->split) > EXPORT_MAX_WINDOWS)
			return fail(out, -EINVAL,
				    "export '%s' would have more than %u split windows", e->name,
				    (unsigned)EXPORT_MAX_WINDOWS);
	}
	return 0;
}

/* New versions of the exports over b that run to its end (their split
 * windows regenerated after each), published in place of the old ones. */
static int republish(struct export_table *t, struct export_backing *b, struct export_reload *r)
{
	struct export **v;
	size_t n;
	int rc = export_list(t, &v, &n);
	if (rc < 0)
		return rc;
	struct version_vec x = {0};
	const char *remade = NULL; /* the split export whose windows are skipped */
	for (size_t i = 0; i < n && rc == 0; i++) {
		struct export *e = v[i];
		if (remade && e->window_of && strcmp(e->window_of, remade) == 0)
			continue; /* regenerated below its new version */
		remade = NULL;
		if (e->backing != b || !e->to_end) {
			export_ref(e);
			if ((rc = vec_push(&x, e)) < 0)
				export_put(e);
			continue;
		}
		struct version_place at = {.name = e->name,
					   .description = e->description,
					   .offset = e->offset,
					   .size = 0,
					   .split = e->split};
		struct export *ne;
		if ((rc = version_make(e, b, &at, e->counter, &ne)) < 0)
			break;
		if ((rc = vec_push(&x, ne)) < 0) {
			export_put(ne);
			break;
		}
		log_export(ne, " resized");
		if (r && (rc = options_push_string(&r->resized, &r->resized_count, e->name)) < 0)
			break;
		rc = windows_push(t, ne, &x, NULL);
		remade = e->name;
	}
	if (rc == 0) {
		pthread_mutex_lock(&t->lock);
		struct export **old = t->exports;
		size_t old_count = t->count;
		t->exports = x.v;
		t->count = x.n;
		pthread_mutex_unlock(&t->lock);
		for (size_t i = 0; i < old_count; i++)
			export_put(old[i]);
		free(old);
	} else {
		for (size_t i = 0; i < x.n; i++)
			export_put(x.v[i]);
		free(x.v);
	}
	for (size_t i = 0; i < n; i++)
		export_put(v[i]);
	free(v);
	return rc;
}

/* Undo a backend's new size after a later step failed (best effort). */
static void backend_size_back(struct export_backing *b, uint64_t old_end)
{
	uint64_t have;
	int rc = backend_set_size(b->backend, old_end, &have);
	if (rc < 0)
		log_error("backend %s: cannot set its size back to %llu bytes: %s", b->spec,
			  (unsigned long long)old_end, strerror(-rc));
}

/*
 * Give backing b a backend of end bytes (set: make the backend so; else it
 * is so already) and publish its exports' new versions. On failure nothing
 * changed but, when !set, the backend itself. *have: what the backend has
 * after set (backend_set_size(); also when the size was already end), else 0.
 */
static int backing_resize(struct export_table *t, struct export_backing *b, uint64_t end, bool set,
			  uint64_t *have, struct export_reload *r, struct export_resize_result *out)
{
	struct backend *be = b->backend;
	uint64_t old_end = atomic_load(&be->size);
	*have = 0;
	if (end == old_end) {
		if (set) /* nothing to do; what the backend has, for the caller */
			backend_set_size(be, end, have);
		return 0;
	}
	if (end > NBD_MAX_OFFSET)
		return fail(out, -EFBIG, "%llu bytes is more than NBD can address",
			    (unsigned long long)end);
	struct export **v;
	size_t n;
	int rc = export_list(t, &v, &n);
	if (rc < 0)
		return rc;
	rc = check_versions(v, n, b, end, out);
	for (size_t i = 0; i < n; i++)
		export_put(v[i]);
	free(v);
	if (rc < 0)
		return rc;
	uint64_t dirty = 0;
	if (end < old_end) {
		atomic_store(&be->size, end); /* requests past the new end are refused */
		rc = cache_export_resize(b->cache, end, &dirty);
		if (rc == 0 && set && (rc = backend_set_size(be, end, have)) < 0) {
			uint64_t ignored;
			cache_export_resize(b->cache, old_end, &ignored);
		}
		if (rc < 0)
			atomic_store(&be->size, old_end);
	} else {
		if (set && (rc = backend_set_size(be, end, have)) < 0) {
			if (rc == -ENOSPC)
				return fail(
				    out, rc, "backend %s: cannot grow to %llu bytes: it has %llu",
				    b->spec, (unsigned long long)end, (unsigned long long)*have);
			return fail(out, rc, "backend %s: cannot grow to %llu bytes: %s", b->spec,
				    (unsigned long long)end, strerror(-rc));
		}
		rc = cache_export_resize(b->cache, end, &dirty);
		if (rc < 0 && set)
			backend_size_back(b, old_end);
		if (rc == 0)
			atomic_store(&be->size, end);
	}
	out->dirty_past = dirty;
	if (rc == -EAGAIN)
		return fail(out, rc,
			    "the cache device's log found at start still holds bytes of it that "
			    "are not on the backend yet: resize again once they are "
			    "(nbdcachectl cache-device status)");
	if (rc == -EBUSY)
		return fail(out, rc,
			    "%llu dirty bytes past the new end at %llu, or blocks there unstable "
			    "or in use: flush the export, then resize again",
			    (unsigned long long)dirty, (unsigned long long)end);
	if (rc < 0)
		return fail(out, rc, "backend %s: cannot resize to %llu bytes: %s", b->spec,
			    (unsigned long long)end, strerror(-rc));
	log_info("backend %s: resized from %llu to %llu bytes", b->spec,
		 (unsigned long long)old_end, (unsigned long long)end);
	rc = republish(t, b, r);
	if (rc < 0)
		return fail(out, rc, "backend %s resized, but its exports' new versions: %s",
			    b->spec, strerror(-rc));
	return 0;
}

/* export_resize() of published version e (referenced by the caller). */
static int resize_version(struct export_table *t, struct export *e, bool has_size, uint64_t size,
			  struct export_resize_result *out)
{
	memset(out, 0, sizeof(*out));
	int rc;
	struct export_backing *b = e->backing;
	out->old_size = out->new_size = e->size;
	if (e->window_of) {
		rc = fail(out, -EINVAL, "'%s' is a window of split export '%s': resize '%s'",
			  e->name, e->window_of, e->window_of);
		goto out;
	}
	if (!e->to_end) {
		rc = fail(out, -EINVAL,
			  "'%s' is a window of fixed size (offset=, size= in the config): "
			  "change size= and reload",
			  e->name);
		goto out;
	}
	uint64_t end;
	if (has_size) {
		if (size == 0 || size % b->block_size) {
			rc = fail(out, -EINVAL,
				  "%llu bytes: the size must be a non-zero multiple of the "
				  "export's block size (%u)",
				  (unsigned long long)size, b->block_size);
			goto out;
		}
		if (size > NBD_MAX_OFFSET - e->offset) {
			rc = fail(out, -EFBIG, "%llu bytes is more than NBD can address",
				  (unsigned long long)size);
			goto out;
		}
		end = e->offset + size;
		if (!b->backend->ops->set_size) {
			rc = fail(out, -ENOTSUP,
				  "backend %s (%s) cannot be resized while it is connected",
				  b->spec, b->backend->ops->kind);
			goto out;
		}
	} else if ((rc = backend_probe_size(b->backend, &end)) < 0) {
		if (rc == -ENOTSUP)
			fail(out, rc,
			     "backend %s (%s) cannot report a new size while it is connected",
			     b->spec, b->backend->ops->kind);
		else
			fail(out, rc, "backend %s: cannot read its size: %s", b->spec,
			     strerror(-rc));
		goto out;
	}
	uint64_t have;
	rc = backing_resize(t, b, end, has_size, &have, NULL, out);
	if (rc == 0) {
		/* A backend that kept more than the size set (not cut) would
		 * bring it back at the next reload: the size stays as set. */
		b->pinned_end = has_size && have > end ? end : 0;
		struct export *now = export_current(t, e);
		out->new_size = now ? now->size : end - e->offset;
		export_put(now);
	}
out:
	return rc;
}

int export_resize(struct export_table *t, const char *name, bool has_size, uint64_t size,
		  struct export_resize_result *out)
{
	struct export *e = name[0] ? export_get(t, name, strlen(name)) : NULL;
	if (!e) {
		memset(out, 0, sizeof(*out));
		return fail(out, -ENOENT, "no such export '%s'", name);
	}
	int rc = resize_version(t, e, has_size, size, out);
	export_put(e);
	return rc;
}

int export_table_refresh(struct export_table *t, struct export_reload *r)
{
	/* The backings' list changes only on this thread: walk it unlocked. */
	for (struct export_backing *b = t->backings; b; b = b->next) {
		uint64_t end;
		if (b->removed || b->closed || backend_probe_size(b->backend, &end) < 0 ||
		    end == atomic_load(&b->backend->size))
			continue;
		if (b->pinned_end && end >= b->pinned_end) {
			log_info("reload: backend %s has %llu bytes; its exports keep the %llu "
				 "set by resize (resize without a size follows the backend)",
				 b->spec, (unsigned long long)end,
				 (unsigned long long)b->pinned_end);
			continue;
		}
		b->pinned_end = 0;
		struct export_resize_result res;
		memset(&res, 0, sizeof(res));
		uint64_t have;
		int rc = backing_resize(t, b, end, false, &have, r, &res);
		if (rc == -ENOMEM)
			return rc;
		if (rc < 0)
			log_warn("reload: backend %s is %llu bytes now; its exports keep %llu: %s",
				 b->spec, (unsigned long long)end,
				 (unsigned long long)atomic_load(&b->backend->size), res.message);
	}
	return 0;
}

/* ---- NBD_CMD_RESIZE: on the control thread, answered on the worker ---- */

static void resize_answer_task(struct worker_task *task)
{
	struct export_resize_job *job =
	    (struct export_resize_job *)((char *)task - offsetof(struct export_resize_job, task));
	job->done(job);
}

static void resize_run_task(struct worker_task *task)
{
	struct export_resize_job *job =
	    (struct export_resize_job *)((char *)task - offsetof(struct export_resize_job, task));
	struct export *e = job->export;
	memset(&job->res, 0, sizeof(job->res));
	job->res.old_size = e->size;
	/* The export the connection negotiated, as it is now: its version
	 * may have changed (a reload, a resize), but never into another
	 * export that took its name after a reload removed it. Its rights are
	 * the current version's. */
	struct export *now = export_current(job->table, e);
	if (!now)
		job->result = fail(&job->res, -ESHUTDOWN,
				   "a reload removed the export this connection negotiated "
				   "(an export of that name now is another one)");
	else if (!export_client_may_resize(now))
		job->result = fail(&job->res, -EPERM,
				   "clients may not resize the export now (allow-resize off, "
				   "read-only, or a backend that cannot be resized)");
	else if (job->size < now->size && atomic_load(&now->backing->connections) > 1)
		job->result = fail(&job->res, -EPERM,
				   "other connections use the export: a smaller size is refused");
	else
		job->result = resize_version(job->table, now, true, job->size, &job->res);
	export_put(now);
	if (job->result < 0)
		log_warn("export '%s': NBD_CMD_RESIZE to %llu bytes refused: %s", e->name,
			 (unsigned long long)job->size, job->res.message);
	job->task.run = resize_answer_task;
	worker_post(job->reply_to, &job->task);
}

void export_resize_post(struct export_resize_job *job)
{
	struct worker *w = atomic_load(&job->table->resize_worker);
	job->task.run = resize_run_task;
	if (!w || !worker_post_if_running(w, &job->task)) {
		memset(&job->res, 0, sizeof(job->res));
		job->result = fail(&job->res, -ESHUTDOWN, "the server is shutting down");
		job->done(job);
	}
}
