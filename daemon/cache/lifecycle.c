/*
 * daemon/cache/lifecycle.c: the cache assembled, the top of the layers
 * listed in internal.h: the index (and its arena) first, then the
 * background threads that use it, the writeback thread (writeback.h) and
 * the compactor (compact.h); torn down in the reverse order. Only this
 * file knows every part; the parts below it never start or stop a thread.
 * cache_submit is here too: a FLUSH goes to the writeback thread.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/compact.h"
#include "daemon/cache/device.h"
#include "daemon/cache/internal.h"
#include "daemon/cache/ops.h"
#include "daemon/cache/writeback.h"
#include "daemon/log.h"

int cache_create(const struct options *opts, unsigned workers, unsigned device_wait_ms,
		 struct cache **out)
{
	struct cache *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->latency_slots = workers + 2; /* and the control and writeback threads */
	int rc = cache_index_init(c, opts);
	if (rc < 0) {
		log_error("cache: cannot set up %llu bytes: %s", (unsigned long long)opts->cache_size,
			  strerror(-rc));
		free(c);
		return rc;
	}
	if (opts->cache_device) {
		char err[1024];
		rc = cache_device_open(opts->cache_device, opts->cache_device_use, device_wait_ms,
				       &c->device, err, sizeof(err));
		if (rc == 0 &&
		    (rc = cache_device_discard(c->device, opts->cache_device_discard)) < 0)
			snprintf(err, sizeof(err), "cache device: out of memory");
		if (rc < 0) {
			log_error("%s", err);
			cache_destroy(c);
			return rc;
		}
	}
	rc = writeback_create(c);
	if (rc == 0)
		rc = compactor_create(c, opts);
	if (rc < 0) {
		log_error("cache: cannot start its threads: %s", strerror(-rc));
		cache_destroy(c);
		return rc;
	}
	log_info("cache: %zu bytes in %s memory", c->arena.size, arena_kind_name(c->arena.kind));
	*out = c;
	return 0;
}

bool cache_device_attached(const struct cache *c)
{
	return c && c->device;
}

struct cache_device *cache_get_device(struct cache *c)
{
	return c ? c->device : NULL;
}

bool cache_get_device_stats(struct cache *c, struct cache_device_stats *out)
{
	if (!c || !c->device)
		return false;
	cache_device_get_stats(c->device, out);
	return true;
}

int cache_start(struct cache *c)
{
	int rc = 0;
	if (c->device) {
		/* Before anything is served, and before the writeback thread
		 * (a start refused here has written nothing back, and says
		 * nothing of the kind): the log is checked against the exports
		 * and its write-back planned (it drains meanwhile). */
		char err[1024];
		rc = cache_device_bind(c->device, err, sizeof(err));
		if (rc == 0)
			rc = cache_device_start(c->device, err, sizeof(err));
		if (rc < 0) {
			log_error("%s", err);
			return rc;
		}
	}
	rc = writeback_start(c);
	if (rc == 0)
		rc = compactor_start(c);
	return rc;
}

int cache_stop(struct cache *c, void (*progress)(uint64_t remaining, void *arg), void *arg)
{
	/* A second signal must not take the default action while the
	 * compactor stops: it gives up the retries, with exit status 1. */
	writeback_catch_second_signal();
	compactor_stop(c);
	int rc = writeback_stop(c, progress, arg);
	if (c->device && rc == 0 && cache_device_l2_on(c->device)) {
		/* Everything is clean: what RAM holds goes to the level-2 area
		 * too, so that the next start finds it there. Evicted 16 MiB
		 * at a time, each written before the next (staging is bounded). */
		const uint64_t step = (16u << 20) >> ARENA_FRAME_SHIFT;
		uint64_t n;
		do {
			pthread_mutex_lock(&c->arena.lock);
			uint64_t want = c->arena.free_frames + step;
			pthread_mutex_unlock(&c->arena.lock);
			n = cache_evict_until(c, want);
			cache_device_l2_drain(c->device);
		} while (n > 0);
	}
	if (c->device) {
		cache_device_close(c->device, rc == 0);
		c->device = NULL;
	}
	return rc;
}

void cache_destroy(struct cache *c)
{
	if (!c)
		return;
	compactor_destroy(c);
	writeback_destroy(c);
	cache_device_close(c->device, false);
	for (struct cache_export *ce = c->exports; ce; ce = ce->next)
		cache_shadow_free(ce);
	cache_index_destroy(c);
	free(c);
}

/* The one entry point that needs both the operations and a thread: a FLUSH
 * is answered by the writeback thread's rounds (flush.c), every other
 * command by the operations (ops.h). A fenced backend (backend.h: another
 * node owns it now) gets nothing and gives nothing: every command fails
 * with EIO, not even a read is answered from what the cache holds. */
void cache_submit(struct cache_op *op)
{
	op_reset(op);
	if (atomic_load(&op->ce->backend->fenced))
		op_finish(op, -EIO);
	else if (op->cmd == BACKEND_FLUSH)
		writeback_flush(op);
	else
		op_submit(op);
}
