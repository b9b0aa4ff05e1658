/*
 * daemon/cache/device_replay.c: a cache device's live log read (batch by
 * batch, checked: for cache_device_bind, --check-config and the drain)
 * and planned at start, before anything is served: for every byte, the
 * newest record over it, as the pieces the drain then writes to the
 * exports' backends (device_drain.c, device_internal.h).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"

/* ---- reading the live log ---- */

/* The next batch at w->off (following wraps): 1, 0 at the log's end
 * (w->why says why), or -errno (reading the device failed). Its data is
 * read and checked unless w->headers_only; w->seq becomes the batch's
 * (an epoch batch's jumps). */
int dev_walk_next(struct cache_device *d, struct walk *w, uint8_t *hdr)
{
	for (int wraps = 0; wraps < 2; wraps++) {
		if (w->off >= d->sb.log_bytes)
			w->off = 0;
		if (w->bytes >= d->sb.log_bytes) {
			snprintf(w->why, sizeof(w->why), "the whole log was read");
			return 0;
		}
		int fd = d->rfd >= 0 ? d->rfd : d->fd;
		int rc = dev_pread_all(fd, hdr, DEVFMT_BLOCK, d->sb.log_offset + w->off);
		if (rc < 0)
			return rc;
		if (devfmt_batch_decode(hdr, d->sb.uuid, w->seq, &w->b, w->why, sizeof(w->why)) <
		    0) {
			w->torn = devfmt_batch_claims(hdr, d->sb.uuid, w->seq);
			return 0;
		}
		w->seq = w->b.seq;
		if (w->b.committed > w->committed)
			w->committed = w->b.committed;
		if (w->b.flags & DEVFMT_BATCH_WRAP) {
			w->bytes += d->sb.log_bytes - w->off;
			w->off = 0;
			w->seq++;
			continue;
		}
		uint64_t size = ((uint64_t)w->b.data_blocks + 1) * DEVFMT_BLOCK;
		if (w->off + size > d->sb.log_bytes) {
			snprintf(w->why, sizeof(w->why), "batch %llu runs past the log's end",
				 (unsigned long long)w->seq);
			return 0;
		}
		free(w->data);
		w->data = NULL;
		if (w->headers_only)
			return 1;
		w->data = dev_aligned((size_t)w->b.data_blocks * DEVFMT_BLOCK);
		if (!w->data)
			return -ENOMEM;
		if (w->b.data_blocks) {
			rc = dev_pread_all(fd, w->data, (size_t)w->b.data_blocks * DEVFMT_BLOCK,
					   d->sb.log_offset + w->off + DEVFMT_BLOCK);
			if (rc < 0)
				return rc;
		}
		uint32_t crc = devfmt_crc32c(0, w->data, (size_t)w->b.data_blocks * DEVFMT_BLOCK);
		if (crc != w->b.data_crc) {
			w->torn = true;
			snprintf(
			    w->why, sizeof(w->why),
			    "batch %llu: data CRC32C 0x%08x, computed 0x%08x (torn or corrupt)",
			    (unsigned long long)w->seq, w->b.data_crc, crc);
			return 0;
		}
		return 1;
	}
	snprintf(w->why, sizeof(w->why), "two wrap markers in a row");
	return 0;
}

void dev_walk_advance(struct cache_device *d, struct walk *w)
{
	uint64_t size = ((uint64_t)w->b.data_blocks + 1) * DEVFMT_BLOCK;
	(void)d;
	w->off += size;
	w->bytes += size;
	w->seq++;
	w->batches++;
}

void dev_walk_done(struct cache_device *d)
{
	if (d->rfd < 0)
		return;
	posix_fadvise(d->rfd, (off_t)d->sb.log_offset, (off_t)d->sb.log_bytes, POSIX_FADV_DONTNEED);
	close(d->rfd);
	d->rfd = -1;
}

/* ---- the plan: the newest record over each byte ---- */

/* Byte ranges [start, end) of one export already decided by a later
 * record (the replay goes backwards): sorted, disjoint. */
struct ranges {
	uint64_t (*r)[2];
	size_t n, cap;
};

/* The first range ending after a. */
static size_t ranges_find(const struct ranges *s, uint64_t a)
{
	size_t lo = 0, hi = s->n;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (s->r[mid][1] <= a)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int ranges_add(struct ranges *s, uint64_t a, uint64_t b)
{
	size_t i = ranges_find(s, a);
	size_t j = i;
	while (j < s->n && s->r[j][0] <= b) {
		if (s->r[j][0] < a)
			a = s->r[j][0];
		if (s->r[j][1] > b)
			b = s->r[j][1];
		j++;
	}
	/* [i, j) merge into one */
	if (i == j) {
		if (s->n == s->cap) {
			size_t cap = s->cap ? s->cap * 2 : 64;
			uint64_t(*r)[2] = realloc(s->r, cap * sizeof(*r));
			if (!r)
				return -ENOMEM;
			s->r = r;
			s->cap = cap;
		}
		memmove(s->r + i + 1, s->r + i, (s->n - i) * sizeof(*s->r));
		s->n++;
	} else if (j > i + 1) {
		memmove(s->r + i + 1, s->r + j, (s->n - j) * sizeof(*s->r));
		s->n -= j - i - 1;
	}
	s->r[i][0] = a;
	s->r[i][1] = b;
	return 0;
}

static int add_piece(struct dev_drain *g, const struct devfmt_extent *x, uint64_t offset,
		     uint64_t length, uint64_t data, uint32_t batch)
{
	if (g->npieces == g->cappieces) {
		size_t cap = g->cappieces ? g->cappieces * 2 : 256;
		struct dev_piece *p = realloc(g->pieces, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		g->pieces = p;
		g->cappieces = cap;
	}
	g->pieces[g->npieces++] = (struct dev_piece){.offset = offset,
						     .length = length,
						     .data = data,
						     .batch = batch,
						     .slot = x->slot,
						     .type = x->type};
	g->undone[x->slot]++;
	return 0;
}

/* The parts of x no later record decided become pieces (x's data at data
 * in its batch's); x's range is decided from here back. */
static int plan_extent(struct cache_device *d, struct dev_drain *g, struct ranges *done,
		       const struct devfmt_extent *x, uint64_t data, uint32_t batch)
{
	uint64_t a = x->offset, end = x->offset + x->length;
	size_t i = ranges_find(done, a);
	int rc = 0;
	while (a < end && rc == 0) {
		uint64_t b = i < done->n && done->r[i][0] < end ? done->r[i][0] : end;
		if (b > a && x->type != DEVFMT_EXTENT_CLEAN) {
			rc = add_piece(g, x, a, b - a, data + (a - x->offset), batch);
			d->st.replay_bytes += x->type == DEVFMT_EXTENT_DATA ? b - a : 0;
		}
		if (i < done->n && done->r[i][0] < end)
			a = done->r[i++][1];
		else
			a = end;
	}
	return rc < 0 ? rc : ranges_add(done, x->offset, end);
}

struct keyed {
	uint64_t offset;
	uint32_t piece;
};

static int keyed_cmp(const void *a, const void *b)
{
	uint64_t x = ((const struct keyed *)a)->offset, y = ((const struct keyed *)b)->offset;
	return x < y ? -1 : x > y;
}

/* Each slot's pieces by offset. */
static int index_pieces(struct dev_drain *g)
{
	struct keyed *k = malloc((g->npieces ? g->npieces : 1) * sizeof(*k));
	if (!k)
		return -ENOMEM;
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++) {
		size_t n = 0;
		if (!g->undone[s])
			continue;
		for (size_t i = 0; i < g->npieces; i++)
			if (g->pieces[i].slot == s)
				k[n++] = (struct keyed){g->pieces[i].offset, (uint32_t)i};
		if (!n)
			continue;
		qsort(k, n, sizeof(*k), keyed_cmp);
		g->by_offset[s] = malloc(n * sizeof(uint32_t));
		if (!g->by_offset[s]) {
			free(k);
			return -ENOMEM;
		}
		for (size_t i = 0; i < n; i++)
			g->by_offset[s][i] = k[i].piece;
		g->nby_offset[s] = n;
	}
	free(k);
	return 0;
}

/*
 * Backward over the live log's headers (each batch's extents last to
 * first): the parts of each record no later one decided become pieces; a
 * CLEAN record's parts leave the backend's bytes. Every range a record
 * names leaves the level-2 cache (its map is written before the log that
 * names them is emptied: device_drain.c).
 */
int dev_plan(struct cache_device *d, char *err, size_t len)
{
	uint64_t t0 = clock_now_ns();
	struct dev_drain *g = calloc(1, sizeof(*g));
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	struct ranges done[DEVFMT_MAX_EXPORTS] = {{0}};
	int rc = g && hdr ? 0 : -ENOMEM;
	if (g) {
		g->batches = calloc(d->nlive ? d->nlive : 1, sizeof(*g->batches));
		if (!g->batches)
			rc = -ENOMEM;
	}
	for (size_t k = d->nlive; k-- > 0 && rc >= 0;) {
		struct walk b = {
		    .off = d->live[k].off, .seq = d->live[k].seq, .headers_only = true};
		rc = dev_walk_next(d, &b, hdr);
		if (rc == 0)
			rc = -EIO; /* it read well a moment ago */
		if (rc < 0)
			break;
		g->batches[k].first = g->npieces;
		uint64_t at[DEVFMT_MAX_EXTENTS], p = 0;
		for (uint32_t i = 0; i < b.b.extent_count; i++) {
			at[i] = p;
			if (b.b.extents[i].type == DEVFMT_EXTENT_DATA)
				p += b.b.extents[i].length;
		}
		/* The checkpoint's batch: its first extents are covered. */
		uint32_t first = k == 0 ? d->sb.checkpoint_skip : 0;
		for (uint32_t i = b.b.extent_count; i-- > first && rc >= 0;) {
			const struct devfmt_extent *x = &b.b.extents[i];
			if (x->type != DEVFMT_EXTENT_CLEAN)
				dev_l2_forget(d, x->slot, x->offset, x->length);
			d->st.replay_records++;
			if (d->slots[x->slot].discard)
				continue; /* cache-device-discard-dirty */
			/* A retired export's, under the CLEAN record over all
			 * of it, has no part left (and may have no export). */
			struct backend *be =
			    d->slots[x->slot].ce ? d->slots[x->slot].ce->backend : NULL;
			uint64_t size = be ? atomic_load(&be->size) : UINT64_MAX;
			if (x->type != DEVFMT_EXTENT_CLEAN &&
			    (x->offset > size || x->length > size - x->offset)) {
				log_error(
				    "cache device %s: a record of export \"%s\" at %llu, %llu "
				    "bytes, lies past its end (%llu): skipped",
				    d->path, d->slots[x->slot].id.name,
				    (unsigned long long)x->offset, (unsigned long long)x->length,
				    (unsigned long long)size);
				continue;
			}
			rc = plan_extent(d, g, &done[x->slot], x, at[i], (uint32_t)k);
		}
		g->batches[k].count = g->npieces - g->batches[k].first;
		if (!g->batches[k].count)
			g->batches[k].state = DEV_DRAIN_DONE;
	}
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		free(done[i].r);
	free(hdr);
	if (rc >= 0 && g->npieces > UINT32_MAX)
		rc = -ENOMEM;
	if (rc >= 0)
		rc = index_pieces(g);
	d->drain = g;
	if (rc < 0) {
		dev_drain_free(d);
		dev_walk_done(d);
		return dev_fail(err, len, rc, "cache device %s: reading its log: %s", d->path,
				strerror(-rc));
	}
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++)
		if (g->undone[s] && !d->slots[s].ce)
			return dev_fail(err, len, -EINVAL,
					"cache device %s: records of slot %u, which has no export",
					d->path, s); /* bind refused that already */
	d->st.replay_ns = clock_now_ns() - t0;
	d->st.replay_batches = d->nlive;
	dev_walk_done(d);
	return 0;
}

/* ---- --check-config: every batch's data (a start checks the committed
 * ones only as the drain writes them back) ---- */

int dev_check_data(struct cache_device *d, char *err, size_t len)
{
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	if (!hdr)
		return dev_fail(err, len, -ENOMEM, "cache device %s: out of memory", d->path);
	int rc = 0;
	for (size_t k = 0; k < d->nlive && rc == 0; k++) {
		struct walk b = {.off = d->live[k].off, .seq = d->live[k].seq};
		rc = dev_walk_next(d, &b, hdr);
		free(b.data);
		/* Its records all thrown away (cache-device-discard-dirty):
		 * its data is not needed. */
		bool needed = false;
		for (uint32_t i = k ? 0 : d->sb.checkpoint_skip; rc == 0 && i < b.b.extent_count;
		     i++)
			needed |= b.b.extents[i].type != DEVFMT_EXTENT_CLEAN &&
				  !d->slots[b.b.extents[i].slot].discard;
		if (rc == 0 && !needed)
			rc = 1;
		if (rc == 0)
			rc = dev_fail(err, len, -EIO,
				      "cache device %s: batch %llu of its log (at offset %llu) was "
				      "committed, but now %s: the device corrupted it; a start "
				      "would not write it back",
				      d->path, (unsigned long long)d->live[k].seq,
				      (unsigned long long)d->live[k].off, b.why);
		else if (rc < 0)
			rc = dev_fail(err, len, rc, "cache device %s: reading its log: %s", d->path,
				      strerror(-rc));
		else
			rc = 0;
	}
	free(hdr);
	return rc;
}
