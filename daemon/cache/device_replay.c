/*
 * daemon/cache/device_replay.c: a cache device's live log written to the
 * exports' backends at start, before anything is served (device.h).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"

/* ---- replay: the live log onto the backends ---- */

/* A backend request from the replay, sent from thread w, waited for here. */
struct sync_io {
	struct backend_io io;
	struct worker_task task;
	struct worker *w;
	struct backend *be;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool done;
	int result;
};

static void sync_io_done(struct backend_io *io, int result)
{
	struct sync_io *s = (struct sync_io *)((char *)io - offsetof(struct sync_io, io));
	pthread_mutex_lock(&s->lock);
	s->done = true;
	s->result = result;
	pthread_cond_signal(&s->cond);
	pthread_mutex_unlock(&s->lock);
}

static void sync_io_task(struct worker_task *task)
{
	struct sync_io *s = (struct sync_io *)((char *)task - offsetof(struct sync_io, task));
	/* s may be gone once submitted: a backend may complete inline. */
	struct worker *w = s->w;
	backend_submit(s->be, w, &s->io);
	uring_submit(&w->ring);
}

static int sync_io(struct worker *w, struct backend *be, enum backend_cmd cmd, uint64_t offset,
		   uint64_t length, void *buf)
{
	struct sync_io s;
	memset(&s, 0, sizeof(s));
	pthread_mutex_init(&s.lock, NULL);
	pthread_cond_init(&s.cond, NULL);
	s.w = w;
	s.be = be;
	s.io.cmd = cmd;
	s.io.offset = offset;
	s.io.length = length;
	s.io.buf = buf;
	s.io.done = sync_io_done;
	s.task.run = sync_io_task;
	worker_post(w, &s.task);
	pthread_mutex_lock(&s.lock);
	while (!s.done)
		pthread_cond_wait(&s.cond, &s.lock);
	pthread_mutex_unlock(&s.lock);
	pthread_mutex_destroy(&s.lock);
	pthread_cond_destroy(&s.cond);
	return s.result < 0 ? s.result : 0;
}

static int replay_extent(struct cache_device *d, struct worker *w, const struct devfmt_extent *x,
			 uint8_t *data)
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
			int rc = sync_io(w, be, BACKEND_WRITE, x->offset + done, n, data + done);
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
		int rc = sync_io(w, be, cmd, x->offset + done, n, NULL);
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

/* Apply the parts of x (data: its bytes) no later record decided. */
static int replay_part(struct cache_device *d, struct worker *w, struct ranges *done,
		       const struct devfmt_extent *x, uint8_t *data)
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
			if (x->type != DEVFMT_EXTENT_CLEAN)
				rc = replay_extent(d, w, &part,
						   data ? data + (a - x->offset) : NULL);
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
	/* Forward: where each batch of the live log is. */
	struct walk w2 = {.off = d->sb.checkpoint_offset, .seq = d->sb.checkpoint_seq};
	struct {
		uint64_t off, seq;
	} *pos = NULL;
	size_t npos = 0, cappos = 0;
	int rc;
	while ((rc = dev_walk_next(d, &w2, hdr)) > 0) {
		if (npos == cappos) {
			size_t cap = cappos ? cappos * 2 : 64;
			void *p = realloc(pos, cap * sizeof(*pos));
			if (!p) {
				rc = -ENOMEM;
				break;
			}
			pos = p;
			cappos = cap;
		}
		pos[npos].off = w2.off;
		pos[npos].seq = w2.seq;
		npos++;
		dev_walk_advance(d, &w2);
	}
	uint64_t end = w2.off % d->sb.log_bytes, end_seq = w2.seq;
	struct ranges done[DEVFMT_MAX_EXPORTS] = {{0}};
	bool touched[DEVFMT_MAX_EXPORTS] = {false};
	/* Backward: each batch again, its extents last to first. */
	for (size_t k = npos; k-- > 0 && rc >= 0;) {
		struct walk b = {.off = pos[k].off, .seq = pos[k].seq};
		rc = dev_walk_next(d, &b, hdr);
		if (rc == 0)
			rc = -EIO; /* it read well a moment ago */
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
				rc = replay_part(d, w, &done[x->slot], x,
						 x->type == DEVFMT_EXTENT_DATA ? b.data + at[i]
									       : NULL);
				if (x->type != DEVFMT_EXTENT_CLEAN)
					touched[x->slot] = true;
				d->st.replay_records++;
			}
		}
		free(b.data);
	}
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		free(done[i].r);
		done[i] = (struct ranges){0};
	}
	free(pos);
	free(w2.data);
	free(hdr);
	if (rc < 0)
		return dev_fail(err, len, rc, "cache device %s: replaying its log: %s", d->path,
				strerror(-rc));
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		if (!touched[i])
			continue;
		rc = sync_io(w, d->slots[i].ce->backend, BACKEND_FLUSH, 0, 0, NULL);
		if (rc < 0)
			return dev_fail(
			    err, len, rc,
			    "cache device %s: flushing export \"%s\" after the replay: %s", d->path,
			    d->slots[i].id.name, strerror(-rc));
	}
	d->st.replay_ns = clock_now_ns() - t0;
	d->st.replay_batches = npos;
	if (npos)
		log_info("cache device %s: replayed %zu batch(es), %llu record(s), %llu bytes of "
			 "data in %.3f s; the log ended at offset %llu, batch %llu: %s",
			 d->path, npos, (unsigned long long)d->st.replay_records,
			 (unsigned long long)d->st.replay_bytes, (double)d->st.replay_ns / 1e9,
			 (unsigned long long)end, (unsigned long long)end_seq, w2.why);
	/* Empty from here, and far past anything stale after it. */
	d->head = d->tail = end;
	d->head_seq = d->tail_seq = end_seq + DEV_SEQ_JUMP;
	d->tail_skip = 0;
	return 0;
}
