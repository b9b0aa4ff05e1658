/*
 * daemon/export.c: see export.h.
 *
 * Transmission flags are derived here, in one place, from what the backend
 * can really do, so that every flag the daemon advertises is honest:
 * CAN_MULTI_CONN holds because every connection reaches the same backend
 * (and, later, the same shared cache), and FLUSH/FUA are real fdatasync /
 * RWF_DSYNC.
 */
#include "daemon/export.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"

int export_table_open(struct export_table *table, const struct options *opts,
		      struct cache *cache)
{
	memset(table, 0, sizeof(*table));
	table->exports = calloc(opts->export_count, sizeof(*table->exports));
	if (!table->exports)
		return -ENOMEM;
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *spec = &opts->exports[i];
		struct export *e = &table->exports[i];
		int rc = backend_nbd_handles(spec->backend)
				 ? backend_nbd_open(spec->backend, spec->readonly,
						    opts->backend_timeout, &e->backend)
				 : backend_file_open(spec->backend, spec->readonly, &e->backend);
		if (rc < 0) {
			log_error("export '%s': cannot open %s: %s", spec->name, spec->backend,
				  strerror(-rc));
			export_table_close(table);
			return rc;
		}
		table->count = i + 1;
		e->name = strdup(spec->name);
		e->description = spec->description ? strdup(spec->description) : NULL;
		if (!e->name || (spec->description && !e->description)) {
			export_table_close(table);
			return -ENOMEM;
		}
		e->readonly = spec->readonly || e->backend->readonly;
		/* The cache works in blocks the backend accepts. */
		struct export_spec fitted = *spec;
		while (fitted.block_size < e->backend->min_block && fitted.block_size < 65536)
			fitted.block_size *= 2;
		spec = &fitted;
		e->block_size = spec->block_size;
		e->max_payload = NBD_DEFAULT_MAX_PAYLOAD;
		e->cache_mode = spec->cache_mode;
		e->seq_cutoff = spec->seq_cutoff;
		rc = cache_export_add(cache, e->backend, spec, &e->cache);
		if (rc < 0) {
			export_table_close(table);
			return rc;
		}
		log_info("export '%s': %s backend %s, %llu bytes%s, cache %s, block size %u",
			 e->name, e->backend->ops->kind, spec->backend,
			 (unsigned long long)e->backend->size, e->readonly ? ", read-only" : "",
			 options_cache_mode_name(e->cache_mode), e->block_size);
	}
	return 0;
}

int export_table_start(struct export_table *table)
{
	for (size_t i = 0; i < table->count; i++) {
		int rc = backend_start(table->exports[i].backend);
		if (rc < 0) {
			log_error("export '%s': cannot start its backend: %s", table->exports[i].name,
				  strerror(-rc));
			return rc;
		}
	}
	return 0;
}

void export_table_close(struct export_table *table)
{
	for (size_t i = 0; i < table->count; i++) {
		backend_close(table->exports[i].backend);
		free(table->exports[i].name);
		free(table->exports[i].description);
	}
	free(table->exports);
	memset(table, 0, sizeof(*table));
}

const struct export *export_find(const struct export_table *table, const char *name, size_t len)
{
	if (len == 0)
		return table->count ? &table->exports[0] : NULL;
	for (size_t i = 0; i < table->count; i++) {
		const struct export *e = &table->exports[i];
		if (strlen(e->name) == len && memcmp(e->name, name, len) == 0)
			return e;
	}
	return NULL;
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
