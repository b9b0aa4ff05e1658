/*
 * daemon/conn_registry.c: every connection, for the control thread (see
 * conn.h): conn_list() and conn_disconnect(), and the TLS facts a
 * connection lists once its handshake is done (conn_tls_established()).
 *
 * conn.c adds a connection at conn_start() and removes it when the struct
 * is freed (conn_unref()). The registry's lock orders the control thread's
 * reads after a connection's start and before its free; the counters it
 * reads are atomics. A disconnect runs on the connection's worker, posted
 * there as a task.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/conn_internal.h"
#include "daemon/uring.h"
#include "daemon/worker.h"

/*
 * The registry: every connection from conn_start() to its free, for
 * conn_list() and conn_disconnect() on other threads. Its lock orders the
 * control thread's reads after a connection's start and before its free;
 * the counters it reads are atomics.
 */
static struct {
	pthread_mutex_t lock;
	struct conn *head, *tail;
} registry = {.lock = PTHREAD_MUTEX_INITIALIZER};

void conn_registry_add(struct conn *c)
{
	pthread_mutex_lock(&registry.lock);
	c->reg_next = NULL;
	c->reg_prev = registry.tail;
	if (registry.tail)
		registry.tail->reg_next = c;
	else
		registry.head = c;
	registry.tail = c;
	pthread_mutex_unlock(&registry.lock);
}

void conn_tls_established(struct conn *c, const char *identity)
{
	pthread_mutex_lock(&registry.lock);
	c->peer.has_identity = identity[0] != '\0';
	snprintf(c->peer.identity, sizeof(c->peer.identity), "%s", identity);
	c->tls_listed = true;
	pthread_mutex_unlock(&registry.lock);
}

void conn_registry_remove(struct conn *c)
{
	pthread_mutex_lock(&registry.lock);
	if (c->reg_prev)
		c->reg_prev->reg_next = c->reg_next;
	else
		registry.head = c->reg_next;
	if (c->reg_next)
		c->reg_next->reg_prev = c->reg_prev;
	else
		registry.tail = c->reg_prev;
	pthread_mutex_unlock(&registry.lock);
}

int conn_list(struct conn_info **out, size_t *count)
{
	size_t n = 0, cap = 16;
	struct conn_info *v = malloc(cap * sizeof(*v));
	if (!v)
		return -ENOMEM;
	uint64_t now = clock_now_ns();
	pthread_mutex_lock(&registry.lock);
	for (struct conn *c = registry.head; c; c = c->reg_next) {
		if (n == cap) {
			struct conn_info *nv = realloc(v, 2 * cap * sizeof(*v));
			if (!nv) {
				pthread_mutex_unlock(&registry.lock);
				free(v);
				return -ENOMEM;
			}
			v = nv;
			cap *= 2;
		}
		struct conn_info *i = &v[n++];
		const char *name = atomic_load(&c->export_name);
		i->id = c->id;
		i->peer = c->peer;
		i->peer.groups = NULL; /* the connection's: not kept in a snapshot */
		i->peer.group_count = 0;
		i->transmitting = atomic_load(&c->phase) == CONN_TRANSMISSION;
		snprintf(i->export, sizeof(i->export), "%s", name ? name : "");
		i->bytes_read = atomic_load(&c->bytes_read);
		i->bytes_written = atomic_load(&c->bytes_written);
		i->requests = atomic_load(&c->requests);
		i->payload_copied = atomic_load(&c->payload_copied);
		i->inflight = atomic_load(&c->inflight);
		i->age_ms = (now - c->started_ns) / 1000000u;
		i->worker = c->worker->index;
		i->closing = atomic_load(&c->disconnect_asked);
		i->upgrades = atomic_load_explicit(&c->upgrades, memory_order_relaxed);
		i->tls = c->tls_listed;
		if (i->tls) {
			memcpy(i->tls_version, c->tls_version, sizeof(i->tls_version));
			memcpy(i->tls_cipher, c->tls_cipher, sizeof(i->tls_cipher));
		}
	}
	pthread_mutex_unlock(&registry.lock);
	*out = v;
	*count = n;
	return 0;
}

/* A disconnect, run on the connection's worker. */
struct disconnect_task {
	struct worker_task task;
	struct conn_set *set;
	uint64_t id;
	char why[96];
};

static void disconnect_run(struct worker_task *task)
{
	struct disconnect_task *d = (struct disconnect_task *)task;
	for (struct conn *c = d->set->conns; c; c = c->next) {
		if (c->id != d->id)
			continue;
		conn_ref(c);
		if (c->phase == CONN_TRANSMISSION)
			conn_begin_close(c, d->why);
		else
			conn_kill(c, d->why);
		conn_unref(c);
		break;
	}
	uring_submit(&d->set->worker->ring);
	free(d);
}

int conn_disconnect(uint64_t id, const char *why)
{
	struct disconnect_task *d = calloc(1, sizeof(*d));
	if (!d)
		return -ENOMEM;
	d->id = id;
	d->task.run = disconnect_run;
	snprintf(d->why, sizeof(d->why), "%s", why);
	int rc = -ENOENT;
	pthread_mutex_lock(&registry.lock);
	for (struct conn *c = registry.head; c; c = c->reg_next) {
		if (c->id != id)
			continue;
		atomic_store(&c->disconnect_asked, true);
		d->set = c->set;
		/* A stopping worker closes every connection anyway, and might
		 * end its loop before running the task (which would leak). */
		if (worker_post_if_running(c->worker, &d->task))
			d = NULL;
		rc = 0;
		break;
	}
	pthread_mutex_unlock(&registry.lock);
	free(d);
	return rc;
}
