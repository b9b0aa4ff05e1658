/*
 * daemon/cache/device_log.c: a cache device's intent log while it runs:
 * records appended, committed in batches by the log thread (group
 * commit), waiters answered, checkpoints, and the device's figures
 * (device.h, device_internal.h).
 */
#include "daemon/cache/device_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"

/* ---- appending and waiting ---- */

bool cache_device_usable(struct cache_device *d)
{
	if (!(d->use & CACHE_DEVICE_USE_LOG))
		return false;
	pthread_mutex_lock(&d->lock);
	bool ok = d->started && !d->failed && !d->detaching;
	pthread_mutex_unlock(&d->lock);
	return ok;
}

bool cache_device_voiding(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	bool r = d->failed && !d->voided;
	pthread_mutex_unlock(&d->lock);
	return r;
}

static int pend_reserve(struct cache_device *d, size_t data)
{
	if (d->npend == d->cappend) {
		size_t cap = d->cappend ? d->cappend * 2 : 256;
		struct dev_rec *p = realloc(d->pend, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		d->pend = p;
		d->cappend = cap;
	}
	if (d->pdata_len + data > d->pdata_cap) {
		size_t cap = d->pdata_cap ? d->pdata_cap : (1u << 20);
		while (cap < d->pdata_len + data)
			cap *= 2;
		uint8_t *p = realloc(d->pdata, cap);
		if (!p)
			return -ENOMEM;
		d->pdata = p;
		d->pdata_cap = cap;
	}
	return 0;
}

/* The log cannot hold every record any more: off for good, loudly. */
void dev_fail_locked(struct cache_device *d, int error, const char *what)
{
	if (d->failed)
		return;
	d->failed = true;
	d->st.failed = true;
	/* The log must be emptied on the device before anything is answered
	 * through the backends (ready_locked): a checkpoint writes the
	 * superblock even if the tail does not move. */
	d->sb_stale = true;
	d->checkpoint_due = true;
	pthread_cond_signal(&d->cond);
	log_error("cache device %s: %s: %s; the intent log is off from now on: FLUSH goes to "
		  "the backends again (each export is switched to writethrough)",
		  d->path, what, strerror(-error));
}

uint64_t cache_device_append(struct cache_device *d, int slot, unsigned type, uint64_t offset,
			     uint64_t length, const void *data)
{
	/* A backend another node may take over gets no record: what is
	 * acknowledged of it is on it (backend.h: shared). */
	if (!(d->use & CACHE_DEVICE_USE_LOG) || slot < 0 ||
	    atomic_load_explicit(&d->slots[slot].shared, memory_order_relaxed))
		return 0;
	pthread_mutex_lock(&d->lock);
	/* While detaching, direct steps still append (the log stays a whole
	 * redo log until it is empty); no log round does (not usable). */
	if (!d->started || d->failed || d->detached) {
		pthread_mutex_unlock(&d->lock);
		return 0;
	}
	uint64_t rec = 0;
	for (uint64_t done = 0; done < length;) {
		uint64_t n = length - done;
		if (type == DEVFMT_EXTENT_DATA && n > DEV_EXTENT_MAX)
			n = DEV_EXTENT_MAX;
		if (pend_reserve(d, type == DEVFMT_EXTENT_DATA ? (size_t)n : 0) < 0) {
			/* A record the log cannot hold: it no longer says
			 * everything, so it must not be trusted for more. */
			dev_fail_locked(d, -ENOMEM, "no memory for a record");
			pthread_mutex_unlock(&d->lock);
			return 0;
		}
		struct dev_rec *r = &d->pend[d->npend++];
		r->rec = rec = ++d->appended;
		r->type = (uint8_t)type;
		r->slot = (uint16_t)slot;
		d->slots[slot].last = rec;
		r->offset = offset + done;
		r->length = n;
		r->data = d->pdata_len;
		if (type == DEVFMT_EXTENT_DATA) {
			memcpy(d->pdata + d->pdata_len, (const uint8_t *)data + done, (size_t)n);
			d->pdata_len += (size_t)n;
		}
		done += n;
	}
	pthread_mutex_unlock(&d->lock);
	return rec;
}

uint64_t cache_device_last(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	uint64_t r = d->appended;
	pthread_mutex_unlock(&d->lock);
	return r;
}

uint64_t cache_device_pending(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	uint64_t r = d->pdata_len;
	pthread_mutex_unlock(&d->lock);
	return r;
}

uint64_t cache_device_room(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	uint64_t r = d->sb.log_bytes - d->used;
	pthread_mutex_unlock(&d->lock);
	return r;
}

/* The live log found at start is still held (device_drain.c): no
 * checkpoint covers anything until it is let go. Lock held. */
static bool held_locked(const struct cache_device *d)
{
	return d->nbatches && d->batches[0].last_rec == DEV_HELD_REC;
}

/* Take the waiters that can be answered now off the list. Lock held. */
static struct cache_device_waiter *ready_locked(struct cache_device *d)
{
	struct cache_device_waiter *ready = NULL, **pp = &d->waiters;
	while (*pp) {
		struct cache_device_waiter *w = *pp;
		int result = 1;
		if (d->detached) /* every record is on the backends: nothing to wait for */
			result = 0;
		else if (!w->checkpoint && w->rec && w->rec <= d->durable)
			/* its records are durable (committed before a failure, or
			 * covered by a checkpoint) */
			result = 0;
		else if (d->failed)
			/* A log round's commit that cannot happen now fails (its
			 * FLUSHes get EIO, the exports go writethrough). Anything
			 * else is answered through the backends, which may hold
			 * newer bytes than the log's records by then: only once the
			 * log is emptied on the device (voided), or -EIO when that
			 * cannot be written. */
			result = w->fallback ? -EIO
				 : d->voided ? 0
				 : d->void_error && d->void_error_at > w->void_after ? d->void_error
										      : 1;
		else if (w->fallback && d->detaching)
			/* A log round while a detach began: some of its entries
			 * may not have been appended; it writes back instead. */
			result = -ENOSPC;
		else if (w->checkpoint ? !held_locked(d) && w->rec <= d->checkpointed
				       : w->rec <= d->durable)
			result = 0;
		else if (w->fallback && d->no_room)
			result = -ENOSPC;
		if (result > 0) {
			pp = &w->next;
			continue;
		}
		*pp = w->next;
		if (w->checkpoint)
			d->checkpoint_waiters--;
		w->result = result;
		w->next = ready;
		ready = w;
	}
	return ready;
}

static void post_ready(struct cache_device_waiter *ready)
{
	while (ready) {
		struct cache_device_waiter *next = ready->next;
		worker_post(ready->worker, &ready->task);
		ready = next;
	}
}

void cache_device_wait(struct cache_device *d, struct cache_device_waiter *w)
{
	pthread_mutex_lock(&d->lock);
	w->next = d->waiters;
	d->waiters = w;
	w->void_after = d->void_attempts;
	if (w->checkpoint) {
		d->checkpoint_waiters++;
		d->checkpoint_due = true;
	} else if (w->rec > d->want) {
		d->want = w->rec;
	}
	if (d->failed && !d->voided) {
		/* The void is tried again for it, and it is answered by that
		 * attempt or a later one (void_after): not by the failure of
		 * one already under way when it came (the device may have
		 * healed since). */
		d->checkpoint_due = true;
	}
	struct cache_device_waiter *ready = ready_locked(d);
	pthread_cond_signal(&d->cond);
	pthread_mutex_unlock(&d->lock);
	post_ready(ready);
}

int cache_device_retire(struct cache_device *d, int slot, uint64_t *rec)
{
	if (slot < 0)
		return 0;
	pthread_mutex_lock(&d->lock);
	bool again = (d->use & CACHE_DEVICE_USE_LOG) && (*rec == 0 || d->slots[slot].last > *rec);
	pthread_mutex_unlock(&d->lock);
	if (again) {
		/* Every byte of it is on its backend, flushed: a CLEAN record
		 * over all of them keeps any older one of it from a replay (0:
		 * not logging, failed or detached: nothing to keep out). */
		*rec =
		    cache_device_append(d, slot, DEVFMT_EXTENT_CLEAN, 0, DEV_RETIRED_LENGTH, NULL);
	}
	pthread_mutex_lock(&d->lock);
	int rc = 0;
	if (*rec && !d->failed && !d->detached && *rec > d->durable) {
		if (*rec > d->want)
			d->want = *rec;
		pthread_cond_signal(&d->cond);
		rc = 1;
	} else {
		/* No checkpoint waits for it any more; a reload may give its
		 * slot to an export of its name. */
		d->slots[slot].retired = true;
	}
	pthread_mutex_unlock(&d->lock);
	return rc;
}

void cache_device_covered(struct cache_device *d, int slot, uint64_t rec)
{
	if (slot < 0)
		return;
	pthread_mutex_lock(&d->lock);
	if (rec > d->slots[slot].covered) {
		d->slots[slot].covered = rec;
		d->checkpoint_due = true;
		pthread_cond_signal(&d->cond);
	}
	pthread_mutex_unlock(&d->lock);
}

bool cache_device_wants_checkpoint(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	/* A failed device is emptied (voided) once every export's full round
	 * has put its records on the backend: those rounds run at once. */
	bool r = d->started && !d->detached &&
		 (d->failed ? !d->voided
			    : d->no_room || d->checkpoint_waiters || d->used > d->sb.log_bytes / 2 ||
				  d->pdata_len > d->sb.log_bytes / 4);
	pthread_mutex_unlock(&d->lock);
	return r;
}

/* ---- the log thread ---- */

/* Where a batch of size bytes goes from *head (updating it and *used),
 * or false: no room. The free space is [head, L) and [0, tail) while the
 * head is ahead of the tail (or the log is empty), else [head, tail). */
static bool place(const struct cache_device *d, uint64_t *head, uint64_t *used, uint64_t size)
{
	uint64_t L = d->sb.log_bytes, tail = d->tail;
	if (*used > 0 && *head == tail)
		return false; /* full */
	if (*used == 0 || *head > tail) {
		if (*head + size <= L) {
			*head += size;
			*used += size;
			return true;
		}
		/* The rest of the ring is skipped (a wrap marker says so). */
		uint64_t limit = *used == 0 ? *head : tail;
		if (size > limit)
			return false;
		*used += (L - *head) + size;
		*head = size;
		return true;
	}
	if (*head + size > tail)
		return false;
	*head += size;
	*used += size;
	return true;
}

static int64_t unix_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int push_batch(struct cache_device *d, const struct dev_batch *nb)
{
	if (d->nbatches == d->capbatches) {
		size_t cap = d->capbatches ? d->capbatches * 2 : 64;
		struct dev_batch *b = realloc(d->batches, cap * sizeof(*b));
		if (!b)
			return -ENOMEM;
		d->batches = b;
		d->capbatches = cap;
	}
	d->batches[d->nbatches++] = *nb;
	d->used += nb->bytes;
	return 0;
}

/*
 * Commit every pending record (lock held on entry and exit, dropped for
 * the I/O): batches of at most DEVFMT_WRITE_EXTENTS extents and
 * DEV_BATCH_DATA bytes, each one write at the head, then one flush.
 */
static void commit_locked(struct cache_device *d)
{
	/* Plan the batches, and check they fit. */
	size_t n = d->npend;
	uint64_t head = d->head, used = d->used;
	size_t nb = 0;
	for (size_t i = 0; i < n;) {
		size_t j = i;
		uint64_t data = 0;
		while (j < n && j - i < DEVFMT_WRITE_EXTENTS &&
		       (d->pend[j].type != DEVFMT_EXTENT_DATA || j == i ||
			data + d->pend[j].length <= DEV_BATCH_DATA)) {
			if (d->pend[j].type == DEVFMT_EXTENT_DATA)
				data += d->pend[j].length;
			j++;
		}
		uint64_t size =
		    DEVFMT_BLOCK + (data + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK * DEVFMT_BLOCK;
		if (!place(d, &head, &used, size)) {
			if (!d->no_room)
				log_warn(
				    "cache device %s: the log is full (%llu of %llu bytes used, "
				    "%llu pending): FLUSH writes back to the backend until a "
				    "checkpoint frees it",
				    d->path, (unsigned long long)d->used,
				    (unsigned long long)d->sb.log_bytes,
				    (unsigned long long)d->pdata_len);
			d->no_room = true;
			d->st.fallbacks++;
			return;
		}
		nb++;
		i = j;
	}
	/* Take the records: appends go on meanwhile into a fresh list. */
	struct dev_rec *recs = d->pend;
	uint8_t *pdata = d->pdata;
	d->pend = NULL;
	d->npend = d->cappend = 0;
	d->pdata = NULL;
	d->pdata_len = d->pdata_cap = 0;
	uint64_t last = recs[n - 1].rec;
	d->committing = true; /* records neither pending nor in a batch */
	/* The first batch after the live log a start kept says where the
	 * sequence numbers jump from. */
	bool epoch = d->epoch_due;
	uint64_t epoch_prev = d->epoch_prev;
	pthread_mutex_unlock(&d->lock);

	uint64_t t0 = clock_now_ns();
	int rc = 0;
	uint64_t bytes_logged = 0;
	struct dev_batch *done = calloc(2 * nb + 1, sizeof(*done));
	size_t ndone = 0;
	uint64_t seq = d->head_seq;
	/* Every batch before this commit's is durable (each commit ended with
	 * a device flush, and a start flushed the device before its first):
	 * each batch says so, so that a start reads the data of this commit's
	 * batches alone. */
	uint64_t committed = seq - 1;
	head = d->head;
	uint8_t *buf = NULL;
	if (!done)
		rc = -ENOMEM;
	for (size_t i = 0; i < n && rc == 0;) {
		size_t j = i;
		uint64_t data = 0;
		while (j < n && j - i < DEVFMT_WRITE_EXTENTS &&
		       (recs[j].type != DEVFMT_EXTENT_DATA || j == i ||
			data + recs[j].length <= DEV_BATCH_DATA)) {
			if (recs[j].type == DEVFMT_EXTENT_DATA)
				data += recs[j].length;
			j++;
		}
		uint64_t blocks = (data + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK;
		uint64_t size = (blocks + 1) * DEVFMT_BLOCK;
		if (head + size > d->sb.log_bytes) {
			/* The rest of the ring is skipped: say so there. */
			uint64_t waste = d->sb.log_bytes - head;
			if (waste >= DEVFMT_BLOCK) {
				struct devfmt_batch wb;
				memset(&wb, 0, sizeof(wb));
				wb.seq = seq;
				wb.flags = DEVFMT_BATCH_WRAP;
				wb.committed = committed;
				if (epoch) {
					wb.flags |= DEVFMT_BATCH_EPOCH;
					wb.prev_seq = epoch_prev;
					epoch = false;
				}
				uint8_t *hb = dev_aligned(DEVFMT_BLOCK);
				rc = hb ? devfmt_batch_encode(&wb, d->sb.uuid, hb) : -ENOMEM;
				if (rc == 0)
					rc = dev_pwrite_all(d->fd, hb, DEVFMT_BLOCK,
							    d->sb.log_offset + head);
				free(hb);
				if (rc < 0)
					break;
				done[ndone++] = (struct dev_batch){
				    head, waste, seq, recs[i].rec, recs[i].rec - 1, 0};
				seq++;
			}
			head = 0;
		}
		free(buf);
		buf = dev_aligned((size_t)size);
		if (!buf) {
			rc = -ENOMEM;
			break;
		}
		memset(buf + (size - DEVFMT_BLOCK), 0, DEVFMT_BLOCK);
		struct devfmt_batch b;
		memset(&b, 0, sizeof(b));
		b.seq = seq;
		b.committed = committed;
		if (epoch) {
			b.flags = DEVFMT_BATCH_EPOCH;
			b.prev_seq = epoch_prev;
			epoch = false;
		}
		b.extent_count = (uint32_t)(j - i);
		b.data_blocks = (uint32_t)blocks;
		uint64_t pos = 0;
		for (size_t k = i; k < j; k++) {
			b.extents[k - i] = (struct devfmt_extent){recs[k].type, recs[k].slot,
								  recs[k].offset, recs[k].length};
			if (recs[k].type == DEVFMT_EXTENT_DATA) {
				memcpy(buf + DEVFMT_BLOCK + pos, pdata + recs[k].data,
				       (size_t)recs[k].length);
				pos += recs[k].length;
			}
		}
		b.data_crc = devfmt_crc32c(0, buf + DEVFMT_BLOCK, (size_t)(blocks * DEVFMT_BLOCK));
		rc = devfmt_batch_encode(&b, d->sb.uuid, buf);
		if (rc == 0)
			/* pwrite and fdatasync here, not io_uring: through a ring
			 * the fsync runs on a kernel worker, and a commit took
			 * longer (docs/architecture.md, the intent log). */
			rc = dev_pwrite_all(d->fd, buf, (size_t)size, d->sb.log_offset + head);
		if (rc < 0)
			break;
		done[ndone++] = (struct dev_batch){
		    head, size, seq, recs[i].rec, recs[j - 1].rec, (uint32_t)(j - i)};
		bytes_logged += data;
		head += size;
		seq++;
		i = j;
	}
	free(buf);
	if (rc == 0)
		rc = dev_sync(d);
	uint64_t took = clock_now_ns() - t0;
	free(recs);
	free(pdata);

	pthread_mutex_lock(&d->lock);
	d->committing = false;
	if (rc < 0) {
		/* Batches before the one that failed may be on the device with
		 * good CRCs and the next sequence numbers: the void's checkpoint
		 * (dev_fail_locked) must name a number past every one of them,
		 * or a start would replay them over what the backends got
		 * since. */
		d->head_seq = seq + 1;
		/* (into the superblock by its next write, dev_sb_update: the
		 * superblock's fields change under its lock only) */
		if (d->floor_due < d->head_seq)
			d->floor_due = d->head_seq;
		dev_fail_locked(d, rc, "writing its log");
	} else {
		for (size_t k = 0; k < ndone && rc == 0; k++)
			rc = push_batch(d, &done[k]);
		if (rc < 0)
			dev_fail_locked(d, rc, "keeping track of its log");
		d->head = head % d->sb.log_bytes;
		d->head_seq = seq;
		d->epoch_due = false;
		if (last > d->durable)
			d->durable = last;
		d->st.commits++;
		d->st.commit_ns += took;
		if (took > d->st.commit_max_ns)
			d->st.commit_max_ns = took;
		d->st.records += n;
		d->st.bytes_logged += bytes_logged;
		d->st.last_commit_unix_ms = unix_ms();
	}
	free(done);
}

/* Move the tail past every batch the exports' backends cover. */
static void checkpoint_locked(struct cache_device *d)
{
	d->checkpoint_due = false;
	uint64_t covered = UINT64_MAX;
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++) {
		const struct dev_slot *s = &d->slots[i];
		/* An export with no record past its last full round holds
		 * nothing back. */
		if (s->backend && !s->retired && s->last > s->covered && s->covered < covered)
			covered = s->covered;
	}
	if (covered == UINT64_MAX)
		covered = d->appended;
	/* The drain has put the live log found at start on the backends. */
	bool release = d->held_release;
	d->held_release = false;
	if (release && d->nbatches && d->batches[0].last_rec == DEV_HELD_REC)
		d->batches[0].last_rec = 0;
	/* Until then nothing is covered: its records (and those after it,
	 * which cannot be popped before it) would be replayed over what the
	 * backends got since. A full round's FLUSH waits for the drain. */
	if (held_locked(d))
		return;
	if (covered <= d->checkpointed && !release && !d->sb_stale)
		return;
	/* Records not committed yet that the backends cover: never written. */
	size_t drop = 0;
	while (drop < d->npend && d->pend[drop].rec <= covered)
		drop++;
	if (drop) {
		size_t keep_data = drop < d->npend ? d->pend[drop].data : d->pdata_len;
		memmove(d->pend, d->pend + drop, (d->npend - drop) * sizeof(*d->pend));
		d->npend -= drop;
		for (size_t i = 0; i < d->npend; i++)
			d->pend[i].data -= keep_data;
		if (d->pdata_len > keep_data) /* (pdata is NULL while nothing is kept) */
			memmove(d->pdata, d->pdata + keep_data, d->pdata_len - keep_data);
		d->pdata_len -= keep_data;
	}
	size_t pop = 0;
	while (pop < d->nbatches && d->batches[pop].last_rec <= covered)
		pop++;
	uint64_t tail = d->tail, tail_seq = d->tail_seq;
	uint32_t skip = d->tail_skip;
	if (pop)
		skip = 0;
	if (pop) {
		for (size_t i = 0; i < pop; i++)
			d->used -= d->batches[i].bytes;
		if (pop < d->nbatches) {
			tail = d->batches[pop].offset;
			tail_seq = d->batches[pop].seq;
		} else {
			tail = d->head;
			tail_seq = d->head_seq;
		}
		memmove(d->batches, d->batches + pop, (d->nbatches - pop) * sizeof(*d->batches));
		d->nbatches -= pop;
	}
	if (d->nbatches == 0) {
		/* Empty: the tail is the head (after a failed commit, past
		 * the numbers of every batch it attempted). */
		tail = d->head;
		tail_seq = d->head_seq;
		skip = 0;
	}
	/* The batch now at the tail may begin with covered records: they
	 * must not be replayed either (they may be older than what the
	 * backend has now). */
	if (d->nbatches && d->batches[0].extents && d->batches[0].first_rec <= covered) {
		uint64_t n = covered - d->batches[0].first_rec + 1;
		if (n > skip)
			skip = (uint32_t)(n < d->batches[0].extents ? n : d->batches[0].extents);
	}
	if (tail != d->tail || tail_seq != d->tail_seq || skip != d->tail_skip || d->sb_stale) {
		d->tail = tail;
		d->tail_seq = tail_seq;
		d->tail_skip = skip;
		uint64_t attempt = d->failed ? ++d->void_attempts : 0;
		pthread_mutex_unlock(&d->lock);
		pthread_mutex_lock(&d->sb_lock);
		int rc = dev_sb_update(d, false);
		pthread_mutex_unlock(&d->sb_lock);
		pthread_mutex_lock(&d->lock);
		/* Failed: written again at the next checkpoint (a device that
		 * failed keeps trying: its log must not outlive what the
		 * backends now hold). */
		d->sb_stale = rc < 0;
		if (rc < 0) {
			if (d->failed && !d->void_said)
				log_error("cache device %s: its log cannot be emptied after its failure "
					  "(writing its superblock: %s): FLUSH and FUA fail with EIO "
					  "until it can be (a start could replay its records over "
					  "what they acknowledge); tried again at each",
					  d->path, strerror(-rc));
			if (d->failed) {
				d->void_error = rc;
				/* (a device that failed here: this attempt counts) */
				d->void_error_at = attempt ? attempt : ++d->void_attempts;
			}
			d->void_said |= d->failed;
			dev_fail_locked(d, rc, "writing its checkpoint");
			return;
		}
		d->st.checkpoints++;
		if (d->failed && d->nbatches == 0 && d->npend == 0 && !d->committing &&
		    !d->voided) {
			d->voided = true;
			d->void_error = 0;
			log_warn("cache device %s: its log is empty again (everything is on the "
				 "backends, and its superblock says so); it stays off until a "
				 "restart",
				 d->path);
		}
	}
	if (covered > d->checkpointed)
		d->checkpointed = covered;
	if (covered > d->durable)
		d->durable = covered > d->appended ? d->appended : covered;
	/* The log's positions: nothing durable that was not appended, the
	 * tail not past the head. */
	DCHECK(d->durable <= d->appended);
	DCHECK(d->tail_seq <= d->head_seq);
	d->no_room = false;
}

void *dev_log_thread(void *arg)
{
	struct cache_device *d = arg;
	pthread_mutex_lock(&d->lock);
	for (;;) {
		if (d->checkpoint_due) {
			checkpoint_locked(d);
		} else if (d->npend && d->want > d->durable && !d->no_room && !d->failed) {
			commit_locked(d);
		} else if (d->stop) {
			break;
		} else {
			pthread_cond_wait(&d->cond, &d->lock);
			continue;
		}
		struct cache_device_waiter *ready = ready_locked(d);
		pthread_mutex_unlock(&d->lock);
		post_ready(ready);
		pthread_mutex_lock(&d->lock);
	}
	struct cache_device_waiter *ready = ready_locked(d);
	pthread_mutex_unlock(&d->lock);
	post_ready(ready);
	return NULL;
}

/* ---- the figures ---- */

void cache_device_count_round(struct cache_device *d, uint64_t entries)
{
	pthread_mutex_lock(&d->lock);
	d->st.log_rounds++;
	d->st.log_round_entries += entries;
	pthread_mutex_unlock(&d->lock);
}

void cache_device_get_stats(struct cache_device *d, struct cache_device_stats *out)
{
	pthread_mutex_lock(&d->lock);
	*out = d->st;
	out->attached = true;
	out->device_bytes = d->device_bytes;
	out->log_bytes = d->sb.log_bytes;
	out->log_used = d->used;
	out->pending_bytes = d->pdata_len;
	out->use = d->use;
	pthread_mutex_unlock(&d->lock);
	dev_l2_stats(d, out);
	dev_drain_stats(d, out);
}

/* ---- detaching ---- */

int cache_device_detach_begin(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	int rc = d->detached ? -EALREADY : d->failed || !d->started ? -EIO : 0;
	bool first = rc == 0 && !d->detaching;
	if (rc == 0) {
		d->detaching = true;
		d->st.detaching = true;
	}
	pthread_mutex_unlock(&d->lock);
	if (first) {
		log_info("cache device %s: detaching: the log takes no more records (FLUSH goes to "
			 "the backends), the level-2 cache is off; writing every export on it back",
			 d->path);
		dev_l2_detach(d);
	}
	return rc;
}

int cache_device_detach_end(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	int rc = d->detached ? -EALREADY : d->failed ? -EIO : 0;
	/* Only at an instant the log is empty (every record covered by a
	 * checkpoint, none pending, none being committed) do appends stop:
	 * from then on no record older than what the backends hold is left
	 * to be replayed over it. Else the caller runs its rounds again. */
	if (rc == 0 && (!d->detaching || d->nbatches || d->npend || d->committing ||
			d->checkpointed < d->appended))
		rc = -EBUSY;
	if (rc < 0) {
		pthread_mutex_unlock(&d->lock);
		return rc;
	}
	d->detached = true;
	d->st.detached = true;
	d->stop = true;
	pthread_cond_signal(&d->cond);
	pthread_mutex_unlock(&d->lock);
	pthread_join(d->thread, NULL);
	d->running = false;
	pthread_mutex_lock(&d->sb_lock);
	rc = dev_sb_update(d, true);
	pthread_mutex_unlock(&d->sb_lock);
	pthread_mutex_lock(&d->lock);
	d->started = false;
	struct cache_device_waiter *ready = ready_locked(d); /* any left: answered */
	pthread_mutex_unlock(&d->lock);
	post_ready(ready);
	if (rc < 0) {
		log_error("cache device %s: detached (it holds nothing the backends lack), but "
			  "marking it clean failed: %s",
			  d->path, strerror(-rc));
		return rc;
	}
	log_info("cache device %s: detached: everything on it is on the backends, it is "
		 "marked clean and not used again until a restart",
		 d->path);
	return 0;
}
