/*
 * daemon/cache/device_replay.c: a cache device's live log read (batch by
 * batch, checked: also for cache_device_bind and --check-config) and
 * written to the exports' backends at start, before anything is served
 * (device.h).
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
 * (w->why says why), or -errno (reading the device failed). */
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

/* ---- replay: the live log onto the backends ---- */

/*
 * The replay's backend requests, sent from thread w, up to REPLAY_WINDOW
 * in flight: each byte is written once (by the newest record over it), so
 * they never overlap and may complete in any order. A batch's data stays
 * until the last request that points into it is done (struct rbuf).
 */
#define REPLAY_WINDOW 16

struct rbuf {
	uint8_t *data;
	unsigned refs; /* window lock */
};

struct window {
	struct worker *w;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	unsigned inflight;
	int error;
};

struct rio {
	struct backend_io io;
	struct worker_task task;
	struct window *win;
	struct backend *be;
	struct rbuf *buf;
};

static void rbuf_put_locked(struct rbuf *b)
{
	if (b && --b->refs == 0) {
		free(b->data);
		free(b);
	}
}

static void rio_done(struct backend_io *io, int result)
{
	struct rio *r = (struct rio *)((char *)io - offsetof(struct rio, io));
	struct window *win = r->win;
	pthread_mutex_lock(&win->lock);
	if (result < 0 && !win->error)
		win->error = result;
	win->inflight--;
	rbuf_put_locked(r->buf);
	pthread_cond_broadcast(&win->cond);
	pthread_mutex_unlock(&win->lock);
	free(r);
}

static void rio_task(struct worker_task *task)
{
	struct rio *r = (struct rio *)((char *)task - offsetof(struct rio, task));
	/* r may be gone once submitted: a backend may complete inline. */
	struct worker *w = r->win->w;
	backend_submit(r->be, w, &r->io);
	uring_submit(&w->ring);
}

/* Send one request (buf: into b's data, or NULL); waits for room. */
static int rio_send(struct window *win, struct backend *be, enum backend_cmd cmd, uint64_t offset,
		    uint64_t length, uint8_t *buf, struct rbuf *b)
{
	struct rio *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	pthread_mutex_lock(&win->lock);
	while (win->inflight >= REPLAY_WINDOW)
		pthread_cond_wait(&win->cond, &win->lock);
	int error = win->error;
	if (!error) {
		win->inflight++;
		if (b)
			b->refs++;
	}
	pthread_mutex_unlock(&win->lock);
	if (error) {
		free(r);
		return error;
	}
	r->win = win;
	r->be = be;
	r->buf = b;
	r->io.cmd = cmd;
	r->io.offset = offset;
	r->io.length = length;
	r->io.buf = buf;
	r->io.done = rio_done;
	r->task.run = rio_task;
	worker_post(win->w, &r->task);
	return 0;
}

/* Every request sent is done: the first error, or 0. */
static int window_drain(struct window *win)
{
	pthread_mutex_lock(&win->lock);
	while (win->inflight)
		pthread_cond_wait(&win->cond, &win->lock);
	int error = win->error;
	pthread_mutex_unlock(&win->lock);
	return error;
}

static int replay_extent(struct cache_device *d, struct window *win, const struct devfmt_extent *x,
			 uint8_t *data, struct rbuf *b)
{
	struct cache_export *ce = d->slots[x->slot].ce;
	struct backend *be = ce->backend;
	uint64_t size = atomic_load(&be->size);
	if (x->offset > size || x->length > size - x->offset) {
		log_error("cache device %s: a record of export \"%s\" at %llu, %llu bytes, lies "
			  "past its end (%llu): skipped",
			  d->path, d->slots[x->slot].id.name, (unsigned long long)x->offset,
			  (unsigned long long)x->length, (unsigned long long)size);
		return 0;
	}
	if (x->type == DEVFMT_EXTENT_DATA) {
		for (uint64_t done = 0; done < x->length;) {
			uint64_t n =
			    x->length - done < DEV_EXTENT_MAX ? x->length - done : DEV_EXTENT_MAX;
			int rc =
			    rio_send(win, be, BACKEND_WRITE, x->offset + done, n, data + done, b);
			if (rc < 0)
				return rc;
			done += n;
		}
		return 0;
	}
	/* ZERO and TRIM: zeros (a trimmed range reads as anything, zeros too). */
	enum backend_cmd cmd =
	    x->type == DEVFMT_EXTENT_TRIM && be->can_trim ? BACKEND_TRIM : BACKEND_ZERO;
	uint64_t step = be->max_range ? be->max_range : x->length;
	for (uint64_t done = 0; done < x->length;) {
		uint64_t n = x->length - done < step ? x->length - done : step;
		int rc = rio_send(win, be, cmd, x->offset + done, n, NULL, NULL);
		if (rc < 0)
			return rc;
		done += n;
	}
	return 0;
}

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

/* Apply the parts of x (data: its bytes) no later record decided; *wrote
 * set when some part went to the backend. */
static int replay_part(struct cache_device *d, struct window *win, struct ranges *done,
		       const struct devfmt_extent *x, uint8_t *data, struct rbuf *buf, bool *wrote)
{
	uint64_t a = x->offset, end = x->offset + x->length;
	size_t i = ranges_find(done, a);
	int rc = 0;
	while (a < end && rc == 0) {
		uint64_t b = i < done->n && done->r[i][0] < end ? done->r[i][0] : end;
		if (b > a) {
			struct devfmt_extent part = *x;
			part.offset = a;
			part.length = b - a;
			if (x->type != DEVFMT_EXTENT_CLEAN) {
				rc = replay_extent(d, win, &part,
						   data ? data + (a - x->offset) : NULL, buf);
				*wrote = true;
			}
			d->st.replay_bytes += x->type == DEVFMT_EXTENT_DATA ? b - a : 0;
		}
		if (i < done->n && done->r[i][0] < end)
			a = done->r[i++][1];
		else
			a = end;
	}
	return rc < 0 ? rc : ranges_add(done, x->offset, end);
}

/*
 * The live log onto the backends: newest record first, each byte written
 * once, by the newest record over it (a CLEAN one leaves the backend's);
 * then every export written to is flushed.
 */
int dev_replay(struct cache_device *d, struct worker *w, char *err, size_t len)
{
	uint8_t *hdr = dev_aligned(DEVFMT_BLOCK);
	if (!hdr)
		return dev_fail(err, len, -ENOMEM, "cache device %s: out of memory", d->path);
	uint64_t t0 = clock_now_ns();
	/* Where each batch of the live log is: cache_device_bind() read it. */
	const struct dev_pos *pos = d->live;
	size_t npos = d->nlive;
	uint64_t end = d->live_end, end_seq = d->live_end_seq;
	int rc = 0;
	struct ranges done[DEVFMT_MAX_EXPORTS] = {{0}};
	bool touched[DEVFMT_MAX_EXPORTS] = {false};
	struct window win = {.w = w};
	pthread_mutex_init(&win.lock, NULL);
	pthread_cond_init(&win.cond, NULL);
	/* Backward: each batch again, its extents last to first. */
	for (size_t k = npos; k-- > 0 && rc >= 0;) {
		struct walk b = {.off = pos[k].off, .seq = pos[k].seq};
		rc = dev_walk_next(d, &b, hdr);
		if (rc == 0)
			rc = -EIO; /* it read well a moment ago */
		/* The batch's data lives on while requests point into it. */
		struct rbuf *buf = rc > 0 ? calloc(1, sizeof(*buf)) : NULL;
		if (rc > 0 && !buf)
			rc = -ENOMEM;
		if (buf) {
			buf->data = b.data;
			buf->refs = 1;
			b.data = NULL;
		}
		if (rc > 0) {
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
				/* Its range leaves the level-2 cache (its map is
				 * written before the log is emptied, below). */
				if (x->type != DEVFMT_EXTENT_CLEAN)
					dev_l2_forget(d, x->slot, x->offset, x->length);
				if (d->slots[x->slot].discard)
					continue; /* cache-device-discard-dirty */
				/* Only a record some part of which is written
				 * touches its export: a retired one's, under the
				 * CLEAN record over all of it, has none (and may
				 * have no export now). */
				bool wrote = false;
				rc = replay_part(d, &win, &done[x->slot], x,
						 x->type == DEVFMT_EXTENT_DATA ? buf->data + at[i]
									       : NULL,
						 buf, &wrote);
				if (wrote)
					touched[x->slot] = true;
				d->st.replay_records++;
			}
		}
		free(b.data);
		if (buf) {
			pthread_mutex_lock(&win.lock);
			rbuf_put_locked(buf);
			pthread_mutex_unlock(&win.lock);
		}
	}
	int werr = window_drain(&win);
	if (rc >= 0 && werr < 0)
		rc = werr;
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		free(done[i].r);
		done[i] = (struct ranges){0};
	}
	free(d->live);
	d->live = NULL;
	d->nlive = d->caplive = 0;
	free(hdr);
	dev_walk_done(d);
	if (rc < 0) {
		pthread_mutex_destroy(&win.lock);
		pthread_cond_destroy(&win.cond);
		return dev_fail(err, len, rc, "cache device %s: replaying its log: %s", d->path,
				strerror(-rc));
	}
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS && rc >= 0; i++) {
		if (!touched[i])
			continue;
		rc = rio_send(&win, d->slots[i].ce->backend, BACKEND_FLUSH, 0, 0, NULL, NULL);
		if (rc >= 0)
			rc = window_drain(&win);
		if (rc < 0)
			rc =
			    dev_fail(err, len, rc,
				     "cache device %s: flushing export \"%s\" after the replay: %s",
				     d->path, d->slots[i].id.name, strerror(-rc));
	}
	pthread_mutex_destroy(&win.lock);
	pthread_cond_destroy(&win.cond);
	if (rc < 0)
		return rc;
	/* The replayed ranges out of the level-2 map before the log that names
	 * them is emptied. */
	cache_device_l2_before_write(d);
	d->st.replay_ns = clock_now_ns() - t0;
	d->st.replay_batches = npos;
	if (npos)
		log_info("cache device %s: replayed %zu batch(es), %llu record(s), %llu bytes of "
			 "data in %.3f s; the log ended at offset %llu, batch %llu: %s",
			 d->path, npos, (unsigned long long)d->st.replay_records,
			 (unsigned long long)d->st.replay_bytes, (double)d->st.replay_ns / 1e9,
			 (unsigned long long)end, (unsigned long long)end_seq, d->live_why);
	/* Empty from here, and far past anything stale after it. */
	d->head = d->tail = end;
	d->head_seq = d->tail_seq = end_seq + DEV_SEQ_JUMP;
	d->tail_skip = 0;
	return 0;
}
