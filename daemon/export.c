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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/clock.h"
#include "daemon/export_internal.h"
#include "daemon/log.h"

#define WINDOWS_TEXT_(n) #n
#define WINDOWS_TEXT(n) WINDOWS_TEXT_(n)

static void counter_put(struct export_counter *k)
{
	if (k && atomic_fetch_sub(&k->refs, 1) == 1) {
		qos_limiter_free(k->qos);
		free(k);
	}
}

/* A new counter, with its limiter (no limits yet). NULL: out of memory. */
static struct export_counter *counter_new(void)
{
	struct export_counter *k = calloc(1, sizeof(*k));
	if (k && !(k->qos = qos_limiter_new())) {
		free(k);
		k = NULL;
	}
	return k;
}

/* The limits of spec, in place on e's limiter (shared with its windows
 * and its other versions): they change live, never refused. */
static void limits_apply(struct export *e, const struct export_spec *spec)
{
	struct qos_stats now;
	qos_limiter_get(e->counter->qos, &now);
	if (memcmp(&now.limits, &spec->qos, sizeof(spec->qos)) == 0)
		return;
	qos_limiter_set(e->counter->qos, &spec->qos, clock_now_ns());
	char limits[512];
	qos_limits_describe(&spec->qos, limits, sizeof(limits));
	log_info("export '%s': limits %s", e->name, limits);
}

int vec_push(struct version_vec *x, struct export *e)
{
	if (x->n == x->cap) {
		size_t cap = x->cap ? 2 * x->cap : 16;
		struct export **v = realloc(x->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		x->v = v;
		x->cap = cap;
	}
	x->v[x->n++] = e;
	return 0;
}

/* What a version does with its bytes, from its configuration. */
static void policy_of_spec(struct export *p, const struct export_spec *spec,
			   const struct export_backing *b)
{
	memset(p, 0, sizeof(*p));
	p->readonly = spec->readonly || b->backend->readonly;
	p->max_connections = spec->max_connections;
	p->dirty_high = spec->dirty_high;
	p->dirty_low = spec->dirty_low;
	p->seq_cutoff = spec->seq_cutoff;
	p->tls_require = spec->tls_require;
	p->allow_resize = spec->allow_resize;
}

static bool same_policy(const struct export *a, const struct export *b)
{
	return a->readonly == b->readonly && a->max_connections == b->max_connections &&
	       a->dirty_high == b->dirty_high && a->dirty_low == b->dirty_low &&
	       a->seq_cutoff == b->seq_cutoff && a->tls_require == b->tls_require &&
	       a->allow_resize == b->allow_resize;
}

/* A window's size on a backend of end bytes: as given, or (0) to its end. */
static uint64_t window_size(uint64_t offset, uint64_t size, uint64_t end)
{
	return size ? size : (offset < end ? end - offset : 0);
}

uint64_t window_count(uint64_t size, uint64_t split)
{
	return split ? size / split + (size % split != 0) : 0;
}

/* The window's size once resolved against backing b, or 0 (with why set)
 * when it cannot be served. */
static uint64_t place_size(const struct version_place *at, const struct export_backing *b,
			   const char **why)
{
	uint64_t end = b->backend->size;
	uint64_t size = window_size(at->offset, at->size, end);
	if (at->offset >= end || size > end - at->offset)
		*why = "the window runs past the end of its backend";
	else if (at->offset % b->block_size || at->split % b->block_size ||
		 (size % b->block_size && at->offset + size != end))
		*why = "offset, size and split must be multiples of the backend's block size "
		       "(a window may end where the backend ends)";
	else if (window_count(size, at->split) > EXPORT_MAX_WINDOWS)
		*why = "split makes more than " WINDOWS_TEXT(EXPORT_MAX_WINDOWS) " windows";
	else
		return size;
	return 0;
}

/*
 * A version of an export on backing b, with one reference (the table's):
 * policy's settings, at's place, and counter (NULL: a new one). -EINVAL,
 * logged, when the place does not fit the backend.
 */
int version_make(const struct export *policy, struct export_backing *b,
		 const struct version_place *at, struct export_counter *counter,
		 struct export **out)
{
	const char *why = NULL;
	uint64_t size = place_size(at, b, &why);
	if (!size) {
		uint64_t last = at->size ? at->offset + at->size - 1 : b->backend->size - 1;
		log_error("export '%s': bytes %llu to %llu of %s (%llu bytes): %s", at->name,
			  (unsigned long long)at->offset, (unsigned long long)last, b->spec,
			  (unsigned long long)b->backend->size, why);
		return -EINVAL;
	}
	struct export *e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->name = strdup(at->name);
	e->description = at->description ? strdup(at->description) : NULL;
	e->window_of = at->window_of ? strdup(at->window_of) : NULL;
	e->counter = counter ? counter : counter_new();
	if (!e->name || (at->description && !e->description) || (at->window_of && !e->window_of) ||
	    !e->counter) {
		if (!counter && e->counter) {
			qos_limiter_free(e->counter->qos);
			free(e->counter);
		}
		free(e->name);
		free(e->description);
		free(e->window_of);
		free(e);
		return -ENOMEM;
	}
	atomic_fetch_add(&e->counter->refs, 1);
	atomic_init(&e->refs, 1);
	e->readonly = policy->readonly || b->backend->readonly;
	e->block_size = b->block_size;
	e->max_payload = NBD_DEFAULT_MAX_PAYLOAD;
	e->max_connections = policy->max_connections;
	e->dirty_high = policy->dirty_high;
	e->dirty_low = policy->dirty_low;
	e->seq_cutoff = policy->seq_cutoff;
	e->tls_require = policy->tls_require;
	e->allow_resize = policy->allow_resize;
	e->to_end = at->size == 0;
	e->offset = at->offset;
	e->size = size;
	e->split = at->split;
	e->backend = b->backend;
	e->cache = b->cache;
	e->backing = b;
	atomic_fetch_add(&b->versions, 1);
	*out = e;
	return 0;
}

void log_export(const struct export *e, const char *what)
{
	char window[96] = "";
	if (e->offset || e->size != e->backend->size)
		snprintf(window, sizeof(window), ", bytes %llu to %llu of it",
			 (unsigned long long)e->offset,
			 (unsigned long long)(e->offset + e->size - 1));
	char split[96] = "";
	if (e->split)
		snprintf(split, sizeof(split), ", split into %llu windows of %llu bytes",
			 (unsigned long long)window_count(e->size, e->split),
			 (unsigned long long)e->split);
	log_info("export '%s'%s: %s backend %s%s, %llu bytes%s, cache %s, block size %u%s", e->name,
		 what, e->backend->ops->kind, e->backing->spec, window, (unsigned long long)e->size,
		 e->readonly ? ", read-only" : "",
		 options_cache_mode_name(cache_export_mode(e->cache)), e->block_size, split);
}

static void version_place_of_spec(struct version_place *at, const struct export_spec *spec)
{
	*at = (struct version_place){.name = spec->name,
				     .description = spec->description,
				     .offset = spec->offset,
				     .size = spec->size,
				     .split = spec->split};
}

/*
 * Append split export p's windows to x, in order. On reload (r set) a
 * published window that still matches (and counts its connections with
 * p's) is kept, others are new versions (named in r's added or changed).
 */
int windows_push(struct export_table *t, const struct export *p, struct version_vec *x,
		 struct export_reload *r)
{
	uint64_t n = window_count(p->size, p->split);
	char name[4200], description[4300];
	for (uint64_t k = 0; k < n; k++) {
		uint64_t start = k * p->split;
		uint64_t size = p->size - start < p->split ? p->size - start : p->split;
		snprintf(name, sizeof(name), "%s/%llu", p->name, (unsigned long long)k);
		snprintf(description, sizeof(description), "bytes %llu to %llu of export '%s'",
			 (unsigned long long)start, (unsigned long long)(start + size - 1),
			 p->name);
		struct version_place at = {.name = name,
					   .description = description,
					   .window_of = p->name,
					   .offset = p->offset + start,
					   .size = size};
		struct export *old = r ? export_get(t, name, strlen(name)) : NULL;
		if (old && old->backing == p->backing && old->offset == at.offset &&
		    old->size == size && old->window_of && strcmp(old->window_of, p->name) == 0 &&
		    old->counter == p->counter && same_policy(old, p)) {
			if (vec_push(x, old) < 0) {
				export_put(old);
				return -ENOMEM;
			}
			continue;
		}
		/* The export's counter: max_connections counts it and its
		 * windows together. */
		struct export *e;
		int rc = version_make(p, p->backing, &at, p->counter, &e);
		bool existed = old != NULL;
		export_put(old);
		if (rc < 0)
			return rc;
		if (vec_push(x, e) < 0) {
			export_put(e);
			return -ENOMEM;
		}
		if (r)
			log_export(e, existed ? " changed" : " added");
		else if (log_get_level() >= LOG_DEBUG)
			log_export(e, ""); /* the split export's line says how many */
		if (r && (rc = options_push_string(existed ? &r->changed : &r->added,
						   existed ? &r->changed_count : &r->added_count,
						   name)) < 0)
			return rc;
	}
	return 0;
}

/* Is every export over spec i's backend read-only (then it is opened so)? */
static bool backend_readonly(const struct options *opts, size_t i)
{
	if (!options_backend_shared(opts->exports[i].backend))
		return opts->exports[i].readonly;
	for (size_t j = 0; j < opts->export_count; j++)
		if (!opts->exports[j].readonly &&
		    options_same_backend(&opts->exports[j], &opts->exports[i]))
			return false;
	return true;
}

/* The line that says spec names backing b's file by another path (of
 * export first): one backing, one cache. Nothing when it names it alike. */
static void log_same_file(const struct export_spec *spec, const struct export_backing *b,
			  const char *first)
{
	if (strcmp(spec->backend, b->spec) != 0)
		log_info("export '%s': %s is the same file as %s (export '%s'): one backend, one "
			 "cache",
			 spec->name, spec->backend, b->spec, first);
}

int export_table_open(struct export_table *t, const struct options *opts, struct cache *cache)
{
	memset(t, 0, sizeof(*t));
	pthread_mutex_init(&t->lock, NULL);
	t->cache = cache;
	t->backend_timeout = opts->backend_timeout;
	t->rbd_takeover_wait = opts->rbd_takeover_wait;
	struct export_backing **by_spec =
	    calloc(opts->export_count ? opts->export_count : 1, sizeof(*by_spec));
	if (!by_spec)
		return -ENOMEM;
	struct version_vec x = {0};
	int rc = 0;
	for (size_t i = 0; i < opts->export_count && rc == 0; i++) {
		const struct export_spec *spec = &opts->exports[i];
		size_t first = options_backend_first(opts, i);
		if (first == i) {
			struct export_spec opened = *spec;
			opened.readonly = backend_readonly(opts, i);
			if ((rc = backing_open(t, &opened, &by_spec[i])) < 0)
				break;
			by_spec[i]->next = t->backings;
			t->backings = by_spec[i];
		} else {
			by_spec[i] = by_spec[first];
			log_same_file(spec, by_spec[i], opts->exports[first].name);
		}
		struct export policy;
		struct version_place at;
		struct export *e;
		policy_of_spec(&policy, spec, by_spec[i]);
		version_place_of_spec(&at, spec);
		if ((rc = version_make(&policy, by_spec[i], &at, NULL, &e)) < 0)
			break;
		if ((rc = vec_push(&x, e)) < 0) {
			export_put(e);
			break;
		}
		limits_apply(e, spec);
		log_export(e, "");
		rc = windows_push(t, e, &x, NULL);
	}
	free(by_spec);
	t->exports = x.v;
	t->count = x.n;
	if (rc < 0)
		export_table_close(t);
	return rc;
}

int export_table_start(struct export_table *t)
{
	for (struct export_backing *b = t->backings; b; b = b->next) {
		int rc = backend_start(b->backend);
		if (rc < 0) {
			if (rc != -EINTR) /* -EINTR: a stop during the start (its line said) */
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
	counter_put(e->counter);
	free(e->name);
	free(e->description);
	free(e->window_of);
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

struct export *export_current(struct export_table *t, const struct export *e)
{
	struct export *found = NULL;
	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < t->count && !found; i++) {
		struct export *x = t->exports[i];
		if (x->counter == e->counter && x->backing == e->backing &&
		    strcmp(x->name, e->name) == 0)
			found = x;
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
	unsigned n = atomic_load(&e->counter->connections);
	do {
		if (e->max_connections && n >= e->max_connections)
			return false;
	} while (!atomic_compare_exchange_weak(&e->counter->connections, &n, n + 1));
	atomic_fetch_add(&e->backing->connections, 1);
	return true;
}

void export_detach(struct export *e)
{
	atomic_fetch_sub(&e->counter->connections, 1);
	atomic_fetch_sub(&e->backing->connections, 1);
}

/* ---- reload ---- */

static int push_name(char ***v, size_t *n, const char *name)
{
	return options_push_string(v, n, name);
}

void export_reload_free(struct export_reload *r)
{
	char **lists[] = {r->added, r->changed, r->removed, r->refused, r->resized};
	size_t counts[] = {r->added_count, r->changed_count, r->removed_count, r->refused_count,
			   r->resized_count};
	for (size_t l = 0; l < 5; l++) {
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
static const char *refusal(const struct export *old, const struct export_spec *spec)
{
	if (!backing_is(old->backing, spec))
		return "its backend changed (remove the export and add it under a new name, or "
		       "restart)";
	return backing_refusal(old->backing, spec);
}

static bool version_differs(const struct export *old, const struct export_spec *spec)
{
	uint64_t size = window_size(spec->offset, spec->size, old->backend->size);
	return !same_string(old->description, spec->description) ||
	       old->readonly != (spec->readonly || old->backend->readonly) ||
	       old->max_connections != spec->max_connections ||
	       old->dirty_high != spec->dirty_high || old->dirty_low != spec->dirty_low ||
	       old->seq_cutoff != spec->seq_cutoff || old->tls_require != spec->tls_require ||
	       old->allow_resize != spec->allow_resize ||
	       cache_export_mode(old->cache) != spec->cache_mode || old->offset != spec->offset ||
	       old->size != size || old->split != spec->split;
}

/* A new export on reload: on the live backing of its backend, or a new one.
 * NULL (logged) when it cannot be added; *rc set on a hard error. */
static struct export *reload_add(struct export_table *t, const struct options *opts, size_t i,
				 int *rc)
{
	const struct export_spec *spec = &opts->exports[i];
	struct export_backing *b = backing_find(t, spec);
	bool opened = false;
	if (b && b->removed) {
		log_warn("reload: export '%s' not added: backend %s is still open for a removed "
			 "export (it is closed once its connections end; reload again then)",
			 spec->name, spec->backend);
		return NULL;
	}
	if (b) {
		const char *why = backing_refusal(b, spec);
		bool renamed = strcmp(b->spec, spec->backend) != 0;
		if (why) {
			log_warn("reload: export '%s' not added: backend %s is open for other "
				 "exports%s%s%s, and %s",
				 spec->name, spec->backend, renamed ? " (as " : "",
				 renamed ? b->spec : "", renamed ? ": the same file)" : "", why);
			return NULL;
		}
		/* Another path of its file: the log names the export on it. */
		char first[256] = "?";
		pthread_mutex_lock(&t->lock);
		for (size_t k = 0; k < t->count && renamed; k++)
			if (t->exports[k]->backing == b && !t->exports[k]->window_of) {
				snprintf(first, sizeof(first), "%s", t->exports[k]->name);
				break;
			}
		pthread_mutex_unlock(&t->lock);
		log_same_file(spec, b, first);
	} else {
		struct export_spec opening = *spec;
		opening.readonly = backend_readonly(opts, i);
		if (backing_open(t, &opening, &b) < 0)
			return NULL;
		pthread_mutex_lock(&t->lock);
		b->next = t->backings;
		t->backings = b;
		pthread_mutex_unlock(&t->lock);
		opened = true;
	}
	struct export policy, *e = NULL;
	struct version_place at;
	policy_of_spec(&policy, spec, b);
	version_place_of_spec(&at, spec);
	int made = version_make(&policy, b, &at, NULL, &e);
	if (made == -ENOMEM)
		*rc = made;
	if (made < 0 && opened)
		b->removed = true; /* reaped like a removed export */
	return made < 0 ? NULL : e;
}

int export_table_reload(struct export_table *t, const struct options *opts, struct export_reload *r)
{
	memset(r, 0, sizeof(*r));
	struct version_vec x = {0};
	/* A backend grown (or cut) since: its exports follow first, so the
	 * comparisons below see the size it has now. */
	int rc = export_table_refresh(t, r);
	for (size_t i = 0; i < opts->export_count && rc == 0; i++) {
		const struct export_spec *spec = &opts->exports[i];
		struct export *old = export_get(t, spec->name, strlen(spec->name));
		struct export *e = NULL;
		const char *why = old ? refusal(old, spec) : NULL;
		bool kept_old = false; /* refused: its old settings, limits too */
		if (!old) {
			e = reload_add(t, opts, i, &rc);
			if (!e) {
				if (rc == 0)
					rc = push_name(&r->refused, &r->refused_count, spec->name);
				continue;
			}
			log_export(e, " added");
			rc = push_name(&r->added, &r->added_count, spec->name);
		} else if (why) {
			log_warn("reload: export '%s' keeps its old settings: %s", spec->name, why);
			e = old; /* the reference export_get took is the table's now */
			kept_old = true;
			rc = push_name(&r->refused, &r->refused_count, spec->name);
		} else if (!version_differs(old, spec)) {
			e = old;
		} else {
			struct export policy;
			struct version_place at;
			policy_of_spec(&policy, spec, old->backing);
			version_place_of_spec(&at, spec);
			rc = version_make(&policy, old->backing, &at, old->counter, &e);
			if (rc == -EINVAL) {
				log_warn("reload: export '%s' keeps its old settings", spec->name);
				e = old;
				kept_old = true;
				rc = push_name(&r->refused, &r->refused_count, spec->name);
			} else if (rc == 0) {
				export_put(old);
				if (cache_export_mode(e->cache) != spec->cache_mode)
					cache_export_set_mode(e->cache, spec->cache_mode);
				cache_export_set_watermarks(e->cache, spec->dirty_high,
							    spec->dirty_low);
				log_export(e, " changed");
				rc = push_name(&r->changed, &r->changed_count, spec->name);
			} else {
				e = old;
			}
		}
		if (vec_push(&x, e) < 0) {
			export_put(e);
			rc = -ENOMEM;
			break;
		}
		if (rc == 0 && !kept_old)
			limits_apply(e, spec);
		if (rc == 0)
			rc = windows_push(t, e, &x, r);
	}
	if (rc < 0) {
		/* Keep the old table; backings opened for the new one are reaped. */
		pthread_mutex_lock(&t->lock);
		for (size_t i = 0; i < x.n; i++) {
			bool published = false;
			for (size_t j = 0; j < t->count && !published; j++)
				published = t->exports[j]->backing == x.v[i]->backing;
			if (!published)
				x.v[i]->backing->removed = true;
		}
		pthread_mutex_unlock(&t->lock);
		for (size_t i = 0; i < x.n; i++)
			export_put(x.v[i]);
		free(x.v);
		return rc;
	}
	/* Publish; what is no longer configured is removed. */
	pthread_mutex_lock(&t->lock);
	struct export **old_table = t->exports;
	size_t old_count = t->count;
	t->exports = x.v;
	t->count = x.n;
	for (size_t i = 0; i < old_count; i++) {
		bool kept = false;
		for (size_t j = 0; j < x.n && !kept; j++)
			kept = x.v[j]->backing == old_table[i]->backing;
		if (!kept)
			old_table[i]->backing->removed = true;
	}
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < old_count; i++) {
		struct export *e = old_table[i];
		bool kept = false;
		for (size_t j = 0; j < x.n && !kept; j++)
			kept = strcmp(x.v[j]->name, e->name) == 0;
		if (!kept) {
			log_info(
			    "export '%s' removed: new connections are refused; %u connection(s) "
			    "finish first",
			    e->name, atomic_load(&e->counter->connections));
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
		if (export_client_may_resize(e))
			f |= NBD_FLAG_SEND_RESIZE;
	}
	return f;
}
