/*
 * daemon/export_backing.c: an export table's backings, one per backend
 * (export_internal.h): opening a backend (file, NBD, RBD) and giving it its
 * place in the cache, finding the live one a new export shares, and what a
 * reload cannot change about it.
 *
 * One backend is one backend string, or one file or block device whatever
 * the path that names it (options_same_backend(): its device and inode).
 * Two backings over one file would be two caches, each serving what it
 * holds after the other changed the file: backing_open() refuses to open
 * a file that a backing holds already.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/export_internal.h"
#include "daemon/log.h"

void backing_free(struct export_backing *b)
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

/* Is the backend ident (a file backend's identity, backend.h) the file of
 * backing b? */
static bool same_file(const struct export_backing *b, const struct backend *ident)
{
	return ident->ident_file && b->backend->ident_file &&
	       b->backend->ident_dev == ident->ident_dev && b->backend->ident_ino == ident->ident_ino;
}

/* A backing of t that holds the file that be opened, or NULL. */
static struct export_backing *backing_of_file(struct export_table *t, const struct backend *be)
{
	pthread_mutex_lock(&t->lock);
	struct export_backing *b = t->backings;
	while (b && !same_file(b, be))
		b = b->next;
	pthread_mutex_unlock(&t->lock);
	return b;
}

/* Open a backend for spec and give it its place in the cache. */
int backing_open(struct export_table *t, const struct export_spec *spec,
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
	int rc;
	if (backend_nbd_handles(spec->backend))
		rc = backend_nbd_open(spec->backend, spec->readonly, t->backend_timeout,
				      &b->backend);
	else if (backend_rbd_handles(spec->backend))
		/* A reload never waits for another node's lock: it would hold
		 * the control thread (and every later reload) until then. */
		rc = backend_rbd_open(spec->backend, spec->readonly, t->backend_timeout,
				      t->rbd_takeover_wait && !t->started, &b->backend);
	else
		rc = backend_file_open(spec->backend, spec->readonly, &b->backend);
	if (rc < 0) {
		if (rc == -EINTR) /* a stop asked during the start (stop_signals.h) */
			log_info("export '%s': not opened: the daemon is stopping", spec->name);
		else
			log_error("export '%s': cannot open %s: %s", spec->name, spec->backend,
				  strerror(-rc));
		backing_free(b);
		return rc;
	}
	/* The configuration was read with the file's identity then: a path
	 * renamed or replaced since could name a file open already. */
	struct export_backing *twin = backing_of_file(t, b->backend);
	if (twin) {
		log_error("export '%s': %s is the same file as %s, which is open already (it "
			  "changed since the configuration was read): not opened twice",
			  spec->name, spec->backend, twin->spec);
		rc = -EEXIST;
		goto fail;
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

/* Why spec cannot be served on the live backing b, or NULL when it can. */
const char *backing_refusal(const struct export_backing *b, const struct export_spec *spec)
{
	if (fitted_block_size(spec->block_size, b->backend) != b->block_size)
		return "its block size changed (the cache holds blocks of the old size)";
	if (!spec->readonly && b->backend->readonly)
		return "it was opened read-only (restart to make it writable)";
	enum cache_mode mode = cache_export_mode(b->cache);
	if ((mode == CACHE_MODE_NONE) != (spec->cache_mode == CACHE_MODE_NONE))
		return "cache mode none bypasses the cache: switching to or from it needs a "
		       "restart";
	return NULL;
}

bool backing_is(const struct export_backing *b, const struct export_spec *spec)
{
	if (strcmp(b->spec, spec->backend) == 0)
		return true;
	return spec->has_file_id && b->backend->ident_file &&
	       b->backend->ident_dev == spec->file_dev && b->backend->ident_ino == spec->file_ino;
}

/* The backing open for spec's backend, or NULL. Exports over one backend
 * share it (and its cache). */
struct export_backing *backing_find(struct export_table *t, const struct export_spec *spec)
{
	if (!options_backend_shared(spec->backend))
		return NULL;
	pthread_mutex_lock(&t->lock);
	struct export_backing *b = t->backings;
	while (b && !backing_is(b, spec))
		b = b->next;
	pthread_mutex_unlock(&t->lock);
	return b;
}
