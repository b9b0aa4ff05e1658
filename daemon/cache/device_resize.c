/*
 * daemon/cache/device_resize.c: a cache device's part in an export's
 * resize (device.h, cache_device_resize; cache_export_resize calls it
 * before the resize is answered): a shrink's CLEAN record from the new
 * end on, durable before the backend is cut, and the size the superblock
 * records for the export.
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"

/* Wait (blocking, bounded) until rec is durable: 0, or -errno. */
static int wait_durable(struct cache_device *d, uint64_t rec)
{
	for (unsigned ms = 0; ms < 60000; ms++) {
		pthread_mutex_lock(&d->lock);
		int rc = d->detached || rec <= d->durable ? 0 : d->failed ? -EIO : 1;
		if (rc > 0 && rec > d->want) {
			d->want = rec;
			pthread_cond_signal(&d->cond);
		}
		pthread_mutex_unlock(&d->lock);
		if (rc <= 0)
			return rc;
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	return -ETIMEDOUT;
}

int cache_device_resize(struct cache_device *d, int slot, uint64_t old, uint64_t size)
{
	pthread_mutex_lock(&d->lock);
	bool released = d->released; /* not this daemon's any more */
	pthread_mutex_unlock(&d->lock);
	if (slot < 0 || released)
		return 0;
	if (size < old && (d->use & CACHE_DEVICE_USE_LOG)) {
		/* Nothing past the new end is dirty or unstable (the resize
		 * refuses that): its bytes are the backend's, and none of its
		 * older records may come back there, even after the export
		 * grows again. */
		uint64_t rec = cache_device_append(d, slot, DEVFMT_EXTENT_CLEAN, size,
						   DEV_RETIRED_LENGTH - size, NULL);
		int rc = rec ? wait_durable(d, rec) : 0;
		if (rc < 0) {
			log_error("cache device %s: export \"%s\": the record of its new end could "
				  "not be made durable: %s; the resize is refused",
				  d->path, d->slots[slot].cfg.name, strerror(-rc));
			return rc;
		}
	}
	pthread_mutex_lock(&d->lock);
	struct dev_slot *s = &d->slots[slot];
	bool own = s->backend && !s->retired;
	if (own)
		s->id.size = s->cfg.size = size;
	pthread_mutex_unlock(&d->lock);
	if (!own)
		return 0;
	/* Recorded before the resize is answered: a start after a crash
	 * finds the size the backend has (a crash before this: a size that
	 * differs is replayed all the same, device_replay.c). */
	pthread_mutex_lock(&d->sb_lock);
	int rc = dev_sb_update(d, false);
	pthread_mutex_unlock(&d->sb_lock);
	if (rc < 0)
		log_error("cache device %s: export \"%s\": recording its new size: %s", d->path,
			  s->cfg.name, strerror(-rc));
	return rc;
}
