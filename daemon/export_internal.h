/*
 * daemon/export_internal.h: what the export table's files share. Not for
 * anything outside daemon/export*.c.
 *
 *   export.c          the table: opening, versions, windows, reload, reap
 *   export_backing.c  backings: a backend opened and placed in the cache,
 *                     shared by exports over one backend (one backend
 *                     string, or one file under any of its paths)
 *   export_resize.c   online resize: a backing's new size, new versions
 *
 * export_resize.c builds versions with export.c's functions below; the
 * table's array is changed only on the control thread (reload, resize),
 * under the table lock, so building outside the lock is safe there.
 */
#ifndef NBDCACHED_DAEMON_EXPORT_INTERNAL_H
#define NBDCACHED_DAEMON_EXPORT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/export.h"

/* The versions being put together for the table, in order. */
struct version_vec {
	struct export **v;
	size_t n, cap;
};

/* Where a version's bytes are and what it is called. */
struct version_place {
	const char *name, *description, *window_of;
	uint64_t offset, size; /* size 0: to the backend's end */
	uint64_t split;
};

int vec_push(struct version_vec *x, struct export *e);
uint64_t window_count(uint64_t size, uint64_t split);
/*
 * A version of an export on backing b, with one reference (the table's):
 * policy's settings, at's place, and counter (NULL: a new one). -EINVAL,
 * logged, when the place does not fit the backend.
 */
int version_make(const struct export *policy, struct export_backing *b,
		 const struct version_place *at, struct export_counter *counter,
		 struct export **out);
/* Append split export p's windows to x (r: on reload, see export.c). */
int windows_push(struct export_table *t, const struct export *p, struct version_vec *x,
		 struct export_reload *r);
/* The export's log line ("export 'NAME'WHAT: ..."). */
void log_export(const struct export *e, const char *what);

/* export_backing.c */
/* Open a backend for spec and give it its place in the cache. */
int backing_open(struct export_table *t, const struct export_spec *spec,
		 struct export_backing **out);
void backing_free(struct export_backing *b);
/* Why spec cannot be served on the live backing b, or NULL when it can. */
const char *backing_refusal(const struct export_backing *b, const struct export_spec *spec);
/* Is b the backend spec names: its backend string, or the same file or
 * block device under another path (options_same_backend())? */
bool backing_is(const struct export_backing *b, const struct export_spec *spec);
/* The backing open for spec's backend, or NULL (table lock taken). */
struct export_backing *backing_find(struct export_table *t, const struct export_spec *spec);

#endif
