/*
 * daemon/cache/device_l2_read.c: fills read back from the level-2 cache
 * (device_l2.c has the cache itself): every page of a fill in the table,
 * each page's epoch and checksum snapshotted, read through the worker's
 * io_uring (contiguous pages in one read), then the epochs and owners
 * checked again: a page rewritten meanwhile makes the fill fall back to
 * the backend (-ESTALE); and each page's bytes against its checksum: a
 * page that does not match is forgotten and the fill falls back to the
 * backend too (-EBADMSG), so that its bytes are never served nor merged
 * into a write. And what a small read from the area costs, for the
 * weighing of small fills (cached.c, level2_worth).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"

/* ---- reading ---- */

struct l2_extent {
	struct uring_op op;
	struct l2_read *r;
	uint8_t *buf;
	uint64_t at; /* device offset */
	uint32_t len, done;
};

struct l2_read {
	struct cache_device *d;
	uint64_t t0;
	struct backend_io *io;
	struct worker *worker;
	unsigned slot;
	uint64_t block;
	uint32_t pages, pending;
	int error;
	uint32_t *page, *epoch, *crc; /* per page: where, its epoch and checksum then */
	unsigned nextents;
	struct l2_extent ext[];
};

static void extent_prep(struct l2_extent *x)
{
	struct io_uring_sqe *sqe = uring_get_sqe(&x->r->worker->ring, &x->op);
	io_uring_prep_read(sqe, x->r->d->fd, x->buf + x->done, x->len - x->done, x->at + x->done);
}

LOG_LIMIT(checksum_limit, "level-2 pages that did not match their checksum");

static void read_finish(struct l2_read *r)
{
	struct cache_device *d = r->d;
	struct dev_l2 *l = &d->l2;
	int result = r->error;
	/* Each page's bytes against the checksum they were written with: the
	 * first that does not match, and how many (0 if none). */
	uint32_t bad = 0, first_bad = 0, found = 0;
	const uint8_t *buf = r->io->buf;
	for (uint32_t i = 0; result == 0 && i < r->pages; i++) {
		uint32_t c = devfmt_crc32c(0, buf + (size_t)i * DEVFMT_BLOCK, DEVFMT_BLOCK);
		if (c != r->crc[i] && !bad++) {
			first_bad = i;
			found = c;
		}
	}
	pthread_mutex_lock(&l->lock);
	if (result == 0)
		for (uint32_t i = 0; i < r->pages; i++)
			if (l->epoch[r->page[i]] != r->epoch[i] ||
			    l->owner[r->page[i]] != dev_l2_key(r->slot, r->block + i)) {
				result = -ESTALE;
				break;
			}
	if (result == 0 && bad) {
		/* Not rewritten meanwhile: the bytes the device gave are not the
		 * ones written. Every such page is forgotten (and leaves the
		 * map); the fill reads the backend. */
		result = -EBADMSG;
		l->st.l2_checksum_errors += bad;
		for (uint32_t i = 0; i < r->pages; i++)
			if (devfmt_crc32c(0, buf + (size_t)i * DEVFMT_BLOCK, DEVFMT_BLOCK) !=
			    r->crc[i])
				dev_l2_page_forget_locked(l, r->page[i]);
	}
	if (result == 0) {
		if ((uint64_t)r->pages * DEVFMT_BLOCK <= CACHE_DEVICE_SMALL_READ)
			cache_device_cost_note(&l->small_read_ns, clock_now_ns() - r->t0);
		l->st.l2_hits++;
		l->st.l2_hit_bytes += (uint64_t)r->pages * DEVFMT_BLOCK;
	} else if (result == -ESTALE) {
		l->st.l2_stale++;
	} else {
		l->st.l2_read_errors++;
	}
	pthread_mutex_unlock(&l->lock);
	if (result == -EBADMSG)
		log_limited(&checksum_limit, LOG_WARN,
			    "cache device %s: level-2 page %u (export slot %u, offset %llu) does "
			    "not match its checksum (CRC32C 0x%08x, written with 0x%08x)%s: not "
			    "served, forgotten; read from the backend",
			    d->path, r->page[first_bad], r->slot,
			    (unsigned long long)((r->block + first_bad) * DEVFMT_BLOCK), found,
			    r->crc[first_bad], bad > 1 ? ", and more pages of the same read" : "");
	else if (result < 0 && result != -ESTALE)
		log_warn("cache device %s: reading its level-2 area: %s; read from the backend",
			 d->path, strerror(-result));
	struct backend_io *io = r->io;
	free(r);
	io->done(io, result);
}

static void extent_complete(struct uring_op *op, int res)
{
	struct l2_extent *x = (struct l2_extent *)op;
	struct l2_read *r = x->r;
	if (res == -EINTR || res == -EAGAIN) {
		extent_prep(x);
		return;
	}
	if (res > 0) {
		x->done += (uint32_t)res;
		if (x->done < x->len) {
			extent_prep(x);
			return;
		}
	} else if (!r->error) {
		r->error = res < 0 ? res : -EIO;
	}
	if (--r->pending == 0)
		read_finish(r);
}

bool cache_device_l2_read(struct cache_device *d, int slot, struct worker *w, struct backend_io *io)
{
	struct dev_l2 *l = &d->l2;
	if (slot < 0 || !cache_device_l2_on(d) || io->offset % DEVFMT_BLOCK ||
	    io->length % DEVFMT_BLOCK || !io->length ||
	    (io->offset + io->length) / DEVFMT_BLOCK >= (1ull << DEV_L2_BLOCK_BITS))
		return false;
	if (!atomic_load_explicit(&l->valid_hint, memory_order_relaxed)) {
		atomic_fetch_add_explicit(&l->misses, 1, memory_order_relaxed);
		return false;
	}
	uint32_t pages = (uint32_t)(io->length / DEVFMT_BLOCK);
	uint64_t block = io->offset / DEVFMT_BLOCK;
	/* At most one extent per page. */
	struct l2_read *r = malloc(sizeof(*r) + (size_t)pages * sizeof(struct l2_extent) +
				   (size_t)pages * 3 * sizeof(uint32_t));
	if (!r)
		return false;
	r->page = (uint32_t *)((char *)r + sizeof(*r) + (size_t)pages * sizeof(struct l2_extent));
	r->epoch = r->page + pages;
	r->crc = r->epoch + pages;
	pthread_mutex_lock(&l->lock);
	for (uint32_t i = 0; i < pages; i++) {
		if (!dev_l2_table_get(l, dev_l2_key((unsigned)slot, block + i), &r->page[i])) {
			atomic_fetch_add_explicit(&l->misses, 1, memory_order_relaxed);
			pthread_mutex_unlock(&l->lock);
			free(r);
			return false;
		}
		r->epoch[i] = l->epoch[r->page[i]];
		r->crc[i] = l->crc[r->page[i]];
	}
	pthread_mutex_unlock(&l->lock);
	r->d = d;
	r->t0 = clock_now_ns();
	r->io = io;
	r->worker = w;
	r->slot = (unsigned)slot;
	r->block = block;
	r->pages = pages;
	r->error = 0;
	r->nextents = 0;
	for (uint32_t i = 0; i < pages; i++) {
		struct l2_extent *x = r->nextents ? &r->ext[r->nextents - 1] : NULL;
		uint64_t at = l->offset + (uint64_t)r->page[i] * DEVFMT_BLOCK;
		if (x && x->at + x->len == at) {
			x->len += DEVFMT_BLOCK;
			continue;
		}
		x = &r->ext[r->nextents++];
		x->op.complete = extent_complete;
		x->r = r;
		x->buf = (uint8_t *)io->buf + (size_t)i * DEVFMT_BLOCK;
		x->at = at;
		x->len = DEVFMT_BLOCK;
		x->done = 0;
	}
	r->pending = r->nextents;
	for (unsigned k = 0; k < r->nextents; k++)
		extent_prep(&r->ext[k]);
	return true;
}

void cache_device_cost_note(atomic_uint_fast64_t *avg, uint64_t ns)
{
	uint64_t per = ns;
	uint64_t old = atomic_load_explicit(avg, memory_order_relaxed);
	/* Racing updates may lose one: it is an estimate. */
	atomic_store_explicit(avg, old ? old - old / 32 + per / 32 : per, memory_order_relaxed);
}

uint64_t cache_device_l2_small_read_ns(struct cache_device *d)
{
	return atomic_load_explicit(&d->l2.small_read_ns, memory_order_relaxed);
}

void cache_device_l2_skipped(struct cache_device *d)
{
	atomic_fetch_add_explicit(&d->l2.skipped, 1, memory_order_relaxed);
}
