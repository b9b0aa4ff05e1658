/*
 * daemon/export.c: see export.h.
 *
 * Transmission flags are derived here, in one place, from what the backend
 * can really do, so that every flag the daemon advertises is honest:
 * CAN_MULTI_CONN holds because every connection reaches the same backend
 * through the same shared cache, and FLUSH/FUA are real.
 *
 * A reload compares each configured export with the published version of
 * the same name. What the cache or the backend already depends on (the
 * backend itself, the block size the cache works in, a backend opened
 * read-only, the cache being bypassed or not) cannot change under live
 * connections: such a change is refused and logged, and the export keeps
 * its old version whole. Everything else is a new version.
 */
#include "daemon/export.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/clock.h"
#include "daemon/log.h"

static void backing_free(struct export_backing *b)
{
	free(b->spec);
	free(b);
}

/* The cache works in blocks the backend accepts: the configured size,
 * doubled up to the backend's minimum. */
static uint32_t fitted_block_size(uint32_t block_size, const struct backend *be)
{
	while (block_size < be->min_block && block_size < 65536)
		block_size *= 2;
	return block_size;
}

/* Open a backend for spec and give it its place in the cache. */
static int backing_open(struct export_table *t, const struct export_spec *spec,
			struct export_backing **out)
{
	struct export_backing *b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	b->spec = strdup(spec->backend);
	if (!b->spec) {
		free(b);
		return -ENOMEM;
	}
	int rc =
	    backend_nbd_handles(spec->backend)
		? backend_nbd_open(spec->backend, spec->readonly, t->backend_timeout, &b->backend)
		: backend_file_open(spec->backend, spec->readonly, &b->backend);
	if (rc < 0) {
		log_error("export '%s': cannot open %s: %s", spec->name, spec->backend,
			  strerror(-rc));
		backing_free(b);
		return rc;
	}
	struct export_spec fitted = *spec;
	fitted.block_size = fitted_block_size(spec->block_size, b->backend);
	b->block_size = fitted.block_size;
	if (t->started && (rc = backend_start(b->backend)) < 0) {
		log_error("export '%s': cannot start its backend: %s", spec->name, strerror(-rc));
		goto fail;
	}
	rc = cache_export_add(t->cache, b->backend, &fitted, &b->cache);
	if (rc < 0)
		goto fail;
	*out = b;
	return 0;
fail:
	backend_close(b->backend);
	backing_free(b);
	return rc;
}

/* A version of an export on backing b, with one reference (the table's). */
static struct export *version_new(const struct export_spec *spec, struct export_backing *b)
{
	struct export *e = calloc(1, sizeof(*e));
	if (!e)
		return NULL;
	e->name = strdup(spec->name);
	e->description = spec->description ? strdup(spec->description) : NULL;
	if (!e->name || (spec->description && !e->description)) {
		free(e->name);
		free(e->description);
		free(e);
		return NULL;
	}
	atomic_init(&e->refs, 1);
	e->readonly = spec->readonly || b->backend->readonly;
	e->block_size = b->block_size;
	e->max_payload = NBD_DEFAULT_MAX_PAYLOAD;
	e->max_connections = spec->max_connections;
	e->dirty_high = spec->dirty_high;
	e->dirty_low = spec->dirty_low;
	e->seq_cutoff = spec->seq_cutoff;
	e->backend = b->backend;
	e->cache = b->cache;
	e->backing = b;
	atomic_fetch_add(&b->versions, 1);
	return e;
}

static void log_export(const struct export *e, const char *what)
{
	log_info("export '%s'%s: %s backend %s, %llu bytes%s, cache %s, block size %u", e->name,
		 what, e->backend->ops->kind, e->backing->spec,
		 (unsigned long long)e->backend->size, e->readonly ? ", read-only" : "",
		 options_cache_mode_name(cache_export_mode(e->cache)), e->block_size);
}

int export_table_open(struct export_table *t, const struct options *opts, struct cache *cache)
{
	memset(t, 0, sizeof(*t));
	pthread_mutex_init(&t->lock, NULL);
	t->cache = cache;
	t->backend_timeout = opts->backend_timeout;
	t->exports = calloc(opts->export_count ? opts->export_count : 1, sizeof(*t->exports));
	if (!t->exports)
		return -ENOMEM;
	size_t first, second;
	if (options_shared_backend(opts, &first, &second))
		log_warn("exports '%s' and '%s' share the backend %s: each caches it apart from "
			 "the other, so neither sees the other's unflushed writes",
			 opts->exports[first].name, opts->exports[second].name,
			 opts->exports[second].backend);
	for (size_t i = 0; i < opts->export_count; i++) {
		struct export_backing *b;
		int rc = backing_open(t, &opts->exports[i], &b);
		if (rc < 0) {
			export_table_close(t);
			return rc;
		}
		b->next = t->backings;
		t->backings = b;
		struct export *e = version_new(&opts->exports[i], b);
		if (!e) {
			export_table_close(t);
			return -ENOMEM;
		}
		t->exports[t->count++] = e;
		log_export(e, "");
	}
	return 0;
}

int export_table_start(struct export_table *t)
{
	for (struct export_backing *b = t->backings; b; b = b->next) {
		int rc = backend_start(b->backend);
		if (rc < 0) {
			log_error("backend %s: cannot start: %s", b->spec, strerror(-rc));
			return rc;
		}
	}
	t->started = true;
	return 0;
}

void export_table_close(struct export_table *t)
{
	for (size_t i = 0; i < t->count; i++)
		export_put(t->exports[i]);
	free(t->exports);
	t->exports = NULL;
	t->count = 0;
	while (t->backings) {
		struct export_backing *b = t->backings;
		t->backings = b->next;
		backend_close(b->backend);
		backing_free(b);
	}
	pthread_mutex_destroy(&t->lock);
}

void export_ref(struct export *e)
{
	atomic_fetch_add(&e->refs, 1);
}

void export_put(struct export *e)
{
	if (!e || atomic_fetch_sub(&e->refs, 1) != 1)
		return;
	atomic_fetch_sub(&e->backing->versions, 1);
	free(e->name);
	free(e->description);
	free(e);
}

struct export *export_get(struct export_table *t, const char *name, size_t len)
{
	struct export *found = NULL;
	pthread_mutex_lock(&t->lock);
	if (len == 0) {
		found = t->count ? t->exports[0] : NULL;
	} else {
		for (size_t i = 0; i < t->count && !found; i++) {
			struct export *e = t->exports[i];
			if (strlen(e->name) == len && memcmp(e->name, name, len) == 0)
				found = e;
		}
	}
	if (found)
		export_ref(found);
	pthread_mutex_unlock(&t->lock);
	return found;
}

int export_list(struct export_table *t, struct export ***out, size_t *count)
{
	pthread_mutex_lock(&t->lock);
	struct export **v = malloc((t->count ? t->count : 1) * sizeof(*v));
	if (!v) {
		pthread_mutex_unlock(&t->lock);
		return -ENOMEM;
	}
	for (size_t i = 0; i < t->count; i++) {
		v[i] = t->exports[i];
		export_ref(v[i]);
	}
	*count = t->count;
	pthread_mutex_unlock(&t->lock);
	*out = v;
	return 0;
}

bool export_attach(struct export *e)
{
	unsigned n = atomic_load(&e->backing->connections);
	do {
		if (e->max_connections && n >= e->max_connections)
			return false;
	} while (!atomic_compare_exchange_weak(&e->backing->connections, &n, n + 1));
	return true;
}

void export_detach(struct export *e)
{
	atomic_fetch_sub(&e->backing->connections, 1);
}

/* ---- reload ---- */

static int push_name(char ***v, size_t *n, const char *name)
{
	return options_push_string(v, n, name);
}

void export_reload_free(struct export_reload *r)
{
	char **lists[] = {r->added, r->changed, r->removed, r->refused};
	size_t counts[] = {r->added_count, r->changed_count, r->removed_count, r->refused_count};
	for (size_t l = 0; l < 4; l++) {
		for (size_t i = 0; i < counts[l]; i++)
			free(lists[l][i]);
		free(lists[l]);
	}
	memset(r, 0, sizeof(*r));
}

static bool same_string(const char *a, const char *b)
{
	return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

/* Why spec cannot replace the live version old, or NULL when it can. */
static const char *refusal(const struct export *old, const struct export_spec *spec,
			   uint32_t fitted_block_size)
{
	if (strcmp(old->backing->spec, spec->backend) != 0)
		return "its backend changed (remove the export and add it under a new name, or "
		       "restart)";
	if (fitted_block_size != old->block_size)
		return "its block size changed (the cache holds blocks of the old size)";
	if (!spec->readonly && old->backend->readonly)
		return "it was opened read-only (restart to make it writable)";
	enum cache_mode mode = cache_export_mode(old->cache);
	if ((mode == CACHE_MODE_NONE) != (spec->cache_mode == CACHE_MODE_NONE))
		return "cache mode none bypasses the cache: switching to or from it needs a "
		       "restart";
	return NULL;
}

static bool version_differs(const struct export *old, const struct export_spec *spec)
{
	return !same_string(old->description, spec->description) ||
	       old->readonly != (spec->readonly || old->backend->readonly) ||
	       old->max_connections != spec->max_connections ||
	       old->dirty_high != spec->dirty_high || old->dirty_low != spec->dirty_low ||
	       old->seq_cutoff != spec->seq_cutoff ||
	       cache_export_mode(old->cache) != spec->cache_mode;
}

/* Two cache exports over one backend would each believe their own blocks. */
static bool backing_in_use(struct export_table *t, const char *spec)
{
	if (strncmp(spec, "nbdkit:", 7) == 0)
		return false; /* each one starts an nbdkit of its own */
	pthread_mutex_lock(&t->lock);
	bool used = false;
	for (struct export_backing *b = t->backings; b && !used; b = b->next)
		used = strcmp(b->spec, spec) == 0;
	pthread_mutex_unlock(&t->lock);
	return used;
}

int export_table_reload(struct export_table *t, const struct options *opts, struct export_reload *r)
{
	memset(r, 0, sizeof(*r));
	struct export **next = calloc(opts->export_count ? opts->export_count : 1, sizeof(*next));
	if (!next)
		return -ENOMEM;
	size_t n = 0;
	int rc = 0;
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *spec = &opts->exports[i];
		struct export *old = export_get(t, spec->name, strlen(spec->name));
		if (!old) {
			struct export_backing *b;
			if (backing_in_use(t, spec->backend)) {
				log_warn(
				    "reload: export '%s' not added: backend %s is still open for "
				    "another export (a removed one is closed once its "
				    "connections end; reload again then)",
				    spec->name, spec->backend);
				rc = push_name(&r->refused, &r->refused_count, spec->name);
				if (rc < 0)
					break;
				continue;
			}
			if (backing_open(t, spec, &b) < 0) {
				rc = push_name(&r->refused, &r->refused_count, spec->name);
				if (rc < 0)
					break;
				continue;
			}
			struct export *e = version_new(spec, b);
			pthread_mutex_lock(&t->lock);
			b->next = t->backings;
			t->backings = b;
			pthread_mutex_unlock(&t->lock);
			if (!e) {
				b->removed = true; /* reaped like a removed export */
				rc = -ENOMEM;
				break;
			}
			next[n++] = e;
			log_export(e, " added");
			if ((rc = push_name(&r->added, &r->added_count, spec->name)) < 0)
				break;
			continue;
		}
		const char *why =
		    refusal(old, spec, fitted_block_size(spec->block_size, old->backend));
		if (why) {
			log_warn("reload: export '%s' keeps its old settings: %s", spec->name, why);
			next[n++] = old; /* the reference export_get took is the table's now */
			if ((rc = push_name(&r->refused, &r->refused_count, spec->name)) < 0)
				break;
			continue;
		}
		if (!version_differs(old, spec)) {
			next[n++] = old;
			continue;
		}
		struct export *e = version_new(spec, old->backing);
		if (!e) {
			next[n++] = old;
			rc = -ENOMEM;
			break;
		}
		export_put(old);
		if (cache_export_mode(e->cache) != spec->cache_mode)
			cache_export_set_mode(e->cache, spec->cache_mode);
		cache_export_set_watermarks(e->cache, spec->dirty_high, spec->dirty_low);
		next[n++] = e;
		log_export(e, " changed");
		if ((rc = push_name(&r->changed, &r->changed_count, spec->name)) < 0)
			break;
	}
	if (rc < 0) {
		/* Keep the old table; backings opened for the new one are reaped. */
		pthread_mutex_lock(&t->lock);
		for (size_t i = 0; i < n; i++) {
			bool published = false;
			for (size_t j = 0; j < t->count && !published; j++)
				published = t->exports[j]->backing == next[i]->backing;
			if (!published)
				next[i]->backing->removed = true;
		}
		pthread_mutex_unlock(&t->lock);
		for (size_t i = 0; i < n; i++)
			export_put(next[i]);
		free(next);
		return rc;
	}
	/* Publish; what is no longer configured is removed. */
	pthread_mutex_lock(&t->lock);
	struct export **old_table = t->exports;
	size_t old_count = t->count;
	t->exports = next;
	t->count = n;
	for (size_t i = 0; i < old_count; i++) {
		bool kept = false;
		for (size_t j = 0; j < n && !kept; j++)
			kept = next[j]->backing == old_table[i]->backing;
		if (!kept)
			old_table[i]->backing->removed = true;
	}
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < old_count; i++) {
		struct export *e = old_table[i];
		if (e->backing->removed) {
			log_info(
			    "export '%s' removed: new connections are refused; %u connection(s) "
			    "finish first",
			    e->name, atomic_load(&e->backing->connections));
			if (push_name(&r->removed, &r->removed_count, e->name) < 0)
				rc = -ENOMEM;
		}
		export_put(e);
	}
	free(old_table);
	return rc;
}

/* ---- reaping removed exports ---- */

#define EXPORT_REAP_RETRY_NS (5 * 1000000000ull)

void export_reap_flushed(struct export_backing *b, int result)
{
	b->flushing = false;
	if (result < 0) {
		/* Said once per failing spell; retried every few seconds. */
		if (!b->reap_failing)
			log_error("removed backend %s: writing its dirty data back failed: %s; the "
				  "data stays in the cache and is retried every %llu s",
				  b->spec, strerror(-result),
				  (unsigned long long)(EXPORT_REAP_RETRY_NS / 1000000000u));
		b->reap_failing = true;
		b->reap_retry_ns = clock_now_ns() + EXPORT_REAP_RETRY_NS;
	} else if (b->reap_failing) {
		b->reap_failing = false;
		log_info("removed backend %s: its dirty data is written back", b->spec);
	}
}

void export_table_reap(struct export_table *t,
		       void (*start_flush)(struct export_backing *b, void *arg), void *arg)
{
	pthread_mutex_lock(&t->lock);
	struct export_backing **p = &t->backings;
	while (*p) {
		struct export_backing *b = *p;
		if (!b->removed || b->flushing || atomic_load(&b->versions) ||
		    atomic_load(&b->connections) ||
		    (b->reap_failing && clock_now_ns() < b->reap_retry_ns)) {
			p = &b->next;
			continue;
		}
		/* Dirty, unstable, or written since the last backend flush: a
		 * flush round first (the backend is closed only once durable). */
		if (cache_export_unflushed(b->cache)) {
			b->flushing = true;
			pthread_mutex_unlock(&t->lock);
			start_flush(b, arg); /* may complete at once */
			pthread_mutex_lock(&t->lock);
			p = &t->backings; /* the list may have changed meanwhile */
			continue;
		}
		if (cache_export_retire(b->cache) < 0) {
			p = &b->next;
			continue;
		}
		*p = b->next;
		pthread_mutex_unlock(&t->lock);
		backend_close(b->backend);
		log_info("removed backend %s: written back and closed", b->spec);
		backing_free(b);
		pthread_mutex_lock(&t->lock);
		p = &t->backings;
	}
	pthread_mutex_unlock(&t->lock);
}

uint16_t export_eflags(const struct export *e, bool structured)
{
	/* FUA is accepted on every command (writes to a read-only export get EPERM). */
	uint16_t f = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA |
		     NBD_FLAG_CAN_MULTI_CONN | NBD_FLAG_SEND_CACHE;
	if (structured)
		f |= NBD_FLAG_SEND_DF;
	if (e->readonly) {
		f |= NBD_FLAG_READ_ONLY;
	} else {
		f |= NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;
		if (e->backend->can_trim)
			f |= NBD_FLAG_SEND_TRIM;
	}
	return f;
}
