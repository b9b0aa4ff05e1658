/*
 * daemon/export.h: an export is a name, a backend and its policy.
 *
 * Owns: the table of exports built from the command line, and what each
 * export advertises (size, transmission flags, block sizes). The table is
 * built before the workers start and is read-only afterwards, so every
 * thread may read it without a lock.
 */
#ifndef NBDCACHED_DAEMON_EXPORT_H
#define NBDCACHED_DAEMON_EXPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/cache/cache.h"
#include "daemon/options.h"

struct export {
	char *name;
	char *description; /* NULL when none */
	bool readonly;
	uint32_t block_size; /* preferred block size advertised */
	uint32_t max_payload;
	struct backend *backend;
	struct cache_export *cache; /* how requests reach the backend */
	enum cache_mode cache_mode;
	uint64_t seq_cutoff; /* sequential reads beyond this bypass the cache */
};

struct export_table {
	struct export *exports;
	size_t count;
};

/* Open every export's backend and attach it to the cache. On error logs
 * which export failed. */
int export_table_open(struct export_table *table, const struct options *opts,
		      struct cache *cache);
/* Start the backends' threads, if they have any (after detaching). */
int export_table_start(struct export_table *table);
void export_table_close(struct export_table *table);
/* The export of that name; "" is the first export (the default). */
const struct export *export_find(const struct export_table *table, const char *name, size_t len);
/* Transmission flags for an export, given what the client negotiated. */
uint16_t export_eflags(const struct export *e, bool structured);
static inline uint64_t export_size(const struct export *e)
{
	return e->backend->size;
}

#endif
