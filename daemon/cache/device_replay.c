/*
 * daemon/cache/device_replay.c: a cache device's live log read (batch by
 * batch, checked: for --check-config and the drain), bound to the
 * exports (cache_device_bind: found from its headers, each export's
 * records against its identity) and planned at start, before anything is
 * served: for every byte, the newest record over it, as the pieces the
 * drain then writes to the exports' backends (device_drain.c,
 * device_internal.h).
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
		w->expected = w->seq;
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

/* Batch k of the live log read again (data checked unless headers_only):
 * 1, 0 when it no longer reads as it did (w->why), or -errno. */
int dev_live_read(struct cache_device *d, size_t k, bool headers_only, struct walk *w, uint8_t *hdr)
{
	*w = (struct walk){
	    .off = d->live[k].off, .seq = d->live[k].seq, .headers_only = headers_only};
	return dev_walk_next(d, w, hdr);
}

/* Its header alone, which read well at bind: 1 or -errno. */
static int live_header(struct cache_device *d, size_t k, struct walk *w, uint8_t *hdr)
{
	int rc = dev_live_read(d, k, true, w, hdr);
	return rc == 0 ? -EIO : rc;
}

/* ---- bind: the live log against the exports ---- */

/* Is name in d's discard list? */
static bool discarded(const struct cache_device *d, const char *name)
{
	size_t n = strlen(name);
	for (const char *p = d->discard; p && *p;) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		if (len == n && memcmp(p, name, n) == 0)
			return true;
		p = comma ? comma + 1 : p + len;
	}
	return false;
}

/*
 * The data of every batch of the live log after the highest committed
 * mark its headers carry (those of the last commits, which a crash may
 * have torn), checked; the log ends at the first that does not check.
 * 0 or -errno.
 */
static int check_tail(struct cache_device *d, uint64_t committed, uint8_t *hdr)
{
	size_t k = 0;
	while (k < d->nlive && d->live[k].seq <= committed)
		k++;
	for (; k < d->nlive; k++) {
		struct walk b;
		int rc = dev_live_read(d, k, false, &b, hdr);
		free(b.data);
		if (rc < 0)
			return rc;
		if (rc > 0)
			continue;
		/* The log ends here: what follows was never committed. */
		d->live_end = d->live[k].off;
		d->live_end_seq = d->live[k].expect;
		d->live_torn = true;
		snprintf(d->live_why, sizeof(d->live_why), "%s", b.why);
		d->live_bytes =
		    (d->live_end + d->sb.log_bytes - d->sb.checkpoint_offset) % d->sb.log_bytes;
		if (k > 0 && d->live_bytes == 0)
			d->live_bytes = d->sb.log_bytes;
		d->nlive = k;
		return 0;
	}
	return 0;
}

int cache_device_bind(struct cache_device *d, char *err, size_t len)
{
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	if (!hdr)
		return dev_fail(err, len, -ENOMEM, "cache device %s: out of memory", d->path);
	/* The headers first: only a batch after every committed mark can be
	 * torn, so only those have their data read now (the drain checks
	 * the rest as it writes them back). */
	struct walk w = {
	    .off = d->sb.checkpoint_offset, .seq = d->sb.checkpoint_seq, .headers_only = true};
	int rc;
	while ((rc = dev_walk_next(d, &w, hdr)) > 0) {
		if (d->nlive == d->caplive) {
			size_t cap = d->caplive ? d->caplive * 2 : 64;
			struct dev_pos *p = realloc(d->live, cap * sizeof(*p));
			if (!p) {
				rc = dev_fail(err, len, -ENOMEM, "cache device %s: out of memory",
					      d->path);
				goto out;
			}
			d->live = p;
			d->caplive = cap;
		}
		d->live[d->nlive++] = (struct dev_pos){w.off, w.seq, w.expected};
		dev_walk_advance(d, &w);
	}
	d->live_end = w.off % d->sb.log_bytes;
	d->live_end_seq = w.seq;
	d->live_bytes = w.bytes;
	d->live_torn = w.torn;
	snprintf(d->live_why, sizeof(d->live_why), "%s", w.why);
	if (rc >= 0)
		rc = check_tail(d, w.committed, hdr);
	/* What each slot has in the live log, from its last whole-export
	 * CLEAN record on. */
	for (size_t k = 0; k < d->nlive && rc >= 0; k++) {
		struct walk h;
		rc = live_header(d, k, &h, hdr);
		for (uint32_t i = k ? 0 : d->sb.checkpoint_skip; rc > 0 && i < h.b.extent_count;
		     i++) {
			const struct devfmt_extent *x = &h.b.extents[i];
			if (x->slot >= DEVFMT_MAX_EXPORTS || !d->slots[x->slot].used) {
				rc = dev_fail(
				    err, len, -EINVAL,
				    "cache device %s: batch %llu holds a record of slot %u, "
				    "which its superblock does not name: refused",
				    d->path, (unsigned long long)h.seq, x->slot);
				goto out;
			}
			if (dev_extent_retired(x)) {
				/* Nothing of it before this is replayed. */
				d->slots[x->slot].live_records = 0;
				d->slots[x->slot].live_bytes = 0;
			}
			if (x->type == DEVFMT_EXTENT_CLEAN)
				continue;
			d->slots[x->slot].live_records++;
			d->slots[x->slot].live_bytes += x->length;
		}
	}
	if (rc < 0) {
		rc = dev_fail(err, len, rc, "cache device %s: reading its log: %s", d->path,
			      strerror(-rc));
		goto out;
	}
	rc = 0;
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS && rc == 0; i++) {
		struct dev_slot *s = &d->slots[i];
		if (!s->used || !s->live_records)
			continue;
		if (discarded(d, s->id.name)) {
			s->discard = true;
			log_warn(
			    "cache device %s: throwing away %llu bytes in %llu record(s) not yet "
			    "written back for export \"%s\" (backend %s), as "
			    "cache-device-discard-dirty says: they are not written back",
			    d->path, (unsigned long long)s->live_bytes,
			    (unsigned long long)s->live_records, s->id.name, s->id.backend);
			continue;
		}
		if (!s->configured) {
			rc = dev_fail(
			    err, len, -EINVAL,
			    "cache device %s holds %llu bytes in %llu record(s) not yet "
			    "written back for export \"%s\" (backend %s), which is not "
			    "configured: refused; configure it again to have them written back",
			    d->path, (unsigned long long)s->live_bytes,
			    (unsigned long long)s->live_records, s->id.name, s->id.backend);
			break;
		}
		if (s->backend && s->backend->shared) {
			/* Logged by a version that answered its FLUSHes from the
			 * log: another node may have owned the image since, and
			 * written over what the records hold. */
			rc = dev_fail(
			    err, len, -EINVAL,
			    "cache device %s holds %llu bytes in %llu record(s) not yet written "
			    "back for export \"%s\" (%s), which another node may have owned and "
			    "written since: refused; if no other node has had the image since, "
			    "start the version that wrote them once and stop it with SIGTERM; "
			    "else name the export in cache-device-discard-dirty",
			    d->path, (unsigned long long)s->live_bytes,
			    (unsigned long long)s->live_records, s->id.name, s->id.backend);
			break;
		}
		char why[600];
		/* Another size is no other backend (a resize, by the daemon or
		 * by hand, that a crash caught): its records are replayed, up
		 * to its end now (dev_plan). */
		const char *diff = dev_identity_differs(&s->id, &s->cfg, false, why, sizeof(why));
		if (!diff && s->id.size != s->cfg.size && s->cfg.size)
			log_info("cache device %s: export \"%s\": its backend has %llu bytes now, "
				 "%llu when its %llu bytes in %llu record(s) were logged (resized): "
				 "they are written back",
				 d->path, s->id.name, (unsigned long long)s->cfg.size,
				 (unsigned long long)s->id.size, (unsigned long long)s->live_bytes,
				 (unsigned long long)s->live_records);
		if (diff)
			rc = dev_fail(
			    err, len, -EINVAL,
			    "cache device %s holds %llu bytes in %llu record(s) not yet "
			    "written back for export \"%s\", whose backend is not the one they "
			    "were recorded for (%s): refused",
			    d->path, (unsigned long long)s->live_bytes,
			    (unsigned long long)s->live_records, s->id.name, diff);
	}
	if (rc == 0 && d->nlive)
		log_info("cache device %s: %zu batch(es) to replay from the checkpoint; the log "
			 "ends there: %s",
			 d->path, d->nlive, d->live_why);
	else if (rc == 0 && d->live_torn)
		log_warn("cache device %s: nothing to replay: the log ends at its checkpoint "
			 "(offset %llu), %s",
			 d->path, (unsigned long long)d->live_end, d->live_why);
out:
	free(w.data);
	free(hdr);
	return rc;
}

/* ---- the plan: the newest record over each byte ---- */

/* A record of the live log as the plan sees it: order is its place in
 * the log (higher: newer). */
struct prec {
	uint64_t offset, end, data, order;
	uint32_t batch;
	uint16_t slot;
	uint8_t type;
};

static int prec_cmp(const void *a, const void *b)
{
	const struct prec *x = a, *y = b;
	if (x->slot != y->slot)
		return x->slot < y->slot ? -1 : 1;
	return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* A max-heap of record indices by order (the newest on top). */
struct heap {
	size_t *v, n;
};

static void heap_push(struct heap *h, const struct prec *r, size_t i)
{
	size_t at = h->n++;
	while (at > 0 && r[h->v[(at - 1) / 2]].order < r[i].order) {
		h->v[at] = h->v[(at - 1) / 2];
		at = (at - 1) / 2;
	}
	h->v[at] = i;
}

static void heap_pop(struct heap *h, const struct prec *r)
{
	size_t last = h->v[--h->n], at = 0;
	for (;;) {
		size_t c = 2 * at + 1;
		if (c >= h->n)
			break;
		if (c + 1 < h->n && r[h->v[c + 1]].order > r[h->v[c]].order)
			c++;
		if (r[h->v[c]].order <= r[last].order)
			break;
		h->v[at] = h->v[c];
		at = c;
	}
	if (h->n)
		h->v[at] = last;
}

static int add_piece(struct dev_drain *g, const struct prec *r, uint64_t a, uint64_t b)
{
	/* The same record going on: one piece. */
	if (g->npieces) {
		struct dev_piece *p = &g->pieces[g->npieces - 1];
		if (p->slot == r->slot && p->batch == r->batch && p->offset + p->length == a &&
		    p->type == r->type &&
		    (r->type != DEVFMT_EXTENT_DATA ||
		     p->data + p->length == r->data + (a - r->offset))) {
			p->length += b - a;
			return 0;
		}
	}
	if (g->npieces == g->cappieces) {
		size_t cap = g->cappieces ? g->cappieces * 2 : 256;
		struct dev_piece *p = realloc(g->pieces, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		g->pieces = p;
		g->cappieces = cap;
	}
	g->pieces[g->npieces++] = (struct dev_piece){.offset = a,
						     .length = b - a,
						     .data = r->data + (a - r->offset),
						     .batch = r->batch,
						     .slot = r->slot,
						     .type = r->type};
	return 0;
}

/*
 * The pieces of one slot's records r[0 .. n) (sorted by offset): a sweep
 * over their starts and ends, the newest record over each stretch on top
 * of a heap (those ended taken off as they come up); its stretch becomes
 * a piece unless it is a CLEAN record's. O(n log n).
 */
static int sweep(struct dev_drain *g, const struct prec *r, size_t n, struct heap *h,
		 uint64_t end, uint64_t *past)
{
	size_t i = 0;
	uint64_t x = 0;
	h->n = 0;
	while (i < n || h->n) {
		if (!h->n && r[i].offset > x)
			x = r[i].offset;
		while (i < n && r[i].offset <= x)
			heap_push(h, r, i++);
		while (h->n && r[h->v[0]].end <= x)
			heap_pop(h, r);
		if (!h->n)
			continue;
		const struct prec *top = &r[h->v[0]];
		uint64_t y = top->end;
		if (i < n && r[i].offset < y)
			y = r[i].offset;
		if (top->type != DEVFMT_EXTENT_CLEAN) {
			/* Past the backend's end now (it was cut while the daemon
			 * was down, or before the resize that would have said so
			 * was recorded): those bytes are gone with it. */
			uint64_t b = y < end ? y : end;
			if (b < y)
				*past += y - (x > end ? x : end);
			int rc = x < b ? add_piece(g, top, x, b) : 0;
			if (rc < 0)
				return rc;
		}
		x = y;
	}
	return 0;
}

static int piece_batch_cmp(const void *a, const void *b)
{
	const struct dev_piece *x = a, *y = b;
	if (x->batch != y->batch)
		return x->batch < y->batch ? -1 : 1;
	if (x->slot != y->slot)
		return x->slot < y->slot ? -1 : 1;
	return x->offset < y->offset ? -1 : x->offset > y->offset;
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

/* Each slot's pieces by offset; each batch's pieces (contiguous). */
static int index_pieces(struct cache_device *d, struct dev_drain *g)
{
	if (g->npieces)
		qsort(g->pieces, g->npieces, sizeof(*g->pieces), piece_batch_cmp);
	for (size_t k = 0; k < d->nlive; k++)
		g->batches[k].state = DEV_DRAIN_DONE;
	for (size_t i = 0; i < g->npieces; i++) {
		struct dev_drain_batch *b = &g->batches[g->pieces[i].batch];
		if (b->state == DEV_DRAIN_DONE)
			*b = (struct dev_drain_batch){.first = i, .state = DEV_DRAIN_PENDING};
		b->count++;
		g->undone[g->pieces[i].slot]++;
		if (g->pieces[i].type == DEVFMT_EXTENT_DATA)
			d->st.replay_bytes += g->pieces[i].length;
	}
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

/* The live log's records from its headers (every range a record names
 * leaves the level-2 cache: its map is written before the log that names
 * them is let go, device_drain.c). */
static int gather(struct cache_device *d, struct prec **out, size_t *nout)
{
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	struct prec *r = NULL;
	size_t n = 0, cap = 0;
	uint64_t order = 0;
	int rc = hdr ? 0 : -ENOMEM;
	for (size_t k = 0; k < d->nlive && rc >= 0; k++) {
		struct walk b;
		rc = live_header(d, k, &b, hdr);
		if (rc < 0)
			break;
		uint64_t at = 0;
		/* The checkpoint's batch: its first extents are covered. */
		uint32_t first = k == 0 ? d->sb.checkpoint_skip : 0;
		for (uint32_t i = 0; i < b.b.extent_count; i++) {
			const struct devfmt_extent *x = &b.b.extents[i];
			uint64_t data = at;
			if (x->type == DEVFMT_EXTENT_DATA)
				at += x->length;
			if (i < first)
				continue;
			order++;
			if (x->type != DEVFMT_EXTENT_CLEAN)
				dev_l2_forget(d, x->slot, x->offset, x->length);
			d->st.replay_records++;
			if (d->slots[x->slot].discard)
				continue; /* cache-device-discard-dirty */
			/* (A retired export's lie under the CLEAN record over all
			 * of it, and may have no export.) */
			struct backend *be = d->slots[x->slot].backend;
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
			if (n == cap) {
				cap = cap ? cap * 2 : 1024;
				struct prec *p = realloc(r, cap * sizeof(*p));
				if (!p) {
					rc = -ENOMEM;
					break;
				}
				r = p;
			}
			r[n++] = (struct prec){.offset = x->offset,
					       .end = x->offset + x->length,
					       .data = data,
					       .order = order,
					       .batch = (uint32_t)k,
					       .slot = x->slot,
					       .type = x->type};
		}
	}
	free(hdr);
	if (rc < 0) {
		free(r);
		return rc;
	}
	*out = r;
	*nout = n;
	return 0;
}

/*
 * The live log's records (from the headers), sorted by export and
 * offset, swept: the newest record over each byte becomes a piece (a
 * CLEAN one's leaves the backend's bytes); the pieces grouped by batch
 * for the drain, and by offset for the gate.
 */
int dev_plan(struct cache_device *d, char *err, size_t len)
{
	uint64_t t0 = clock_now_ns();
	struct dev_drain *g = calloc(1, sizeof(*g));
	struct prec *r = NULL;
	size_t n = 0;
	struct heap h = {0};
	int rc = g ? 0 : -ENOMEM;
	if (g) {
		g->batches = calloc(d->nlive ? d->nlive : 1, sizeof(*g->batches));
		if (!g->batches)
			rc = -ENOMEM;
	}
	if (rc >= 0)
		rc = gather(d, &r, &n);
	if (rc >= 0 && n) {
		qsort(r, n, sizeof(*r), prec_cmp);
		h.v = malloc(n * sizeof(*h.v));
		if (!h.v)
			rc = -ENOMEM;
	}
	for (size_t i = 0; i < n && rc >= 0;) {
		size_t j = i;
		while (j < n && r[j].slot == r[i].slot)
			j++;
		const struct dev_slot *sl = &d->slots[r[i].slot];
		/* (--check-config knows no size but a file's: 0, not cut) */
		uint64_t end = sl->configured && sl->cfg.size ? sl->cfg.size : UINT64_MAX;
		uint64_t past = 0;
		rc = sweep(g, r + i, j - i, &h, end, &past);
		if (rc >= 0 && past) {
			log_error("cache device %s: export \"%s\": %llu bytes of its records lie past "
				  "its backend's end (%llu bytes now, %llu when recorded: cut while "
				  "the daemon was down?): they are not written back",
				  d->path, sl->cfg.name, (unsigned long long)past,
				  (unsigned long long)sl->cfg.size, (unsigned long long)sl->id.size);
			g->lost_bytes += past;
		}
		i = j;
	}
	free(h.v);
	free(r);
	if (rc >= 0 && g->npieces > UINT32_MAX)
		rc = -ENOMEM;
	if (rc >= 0)
		rc = index_pieces(d, g);
	d->drain = g;
	if (rc < 0) {
		dev_drain_free(d);
		dev_walk_done(d);
		return dev_fail(err, len, rc, "cache device %s: reading its log: %s", d->path,
				strerror(-rc));
	}
	for (unsigned s = 0; s < DEVFMT_MAX_EXPORTS; s++) {
		if (g->undone[s] && !d->slots[s].backend)
			return dev_fail(err, len, -EINVAL,
					"cache device %s: records of slot %u, which has no export",
					d->path, s); /* bind refused that already */
		if (g->undone[s]) {
			g->backend[s] = d->slots[s].backend;
			g->gate[s] = d->slots[s].replay_gate;
		}
	}
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
		struct walk b;
		rc = dev_live_read(d, k, false, &b, hdr);
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
				      "would lose what it holds (said for each export)",
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
