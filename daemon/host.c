/*
 * daemon/host.c: see host.h.
 */
#include "daemon/host.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/budget.h"
#include "daemon/clock.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/session.h"

static struct host *host_of(struct worker *w)
{
	return (struct host *)((char *)w - offsetof(struct host, loop));
}

static void refused_end(struct refused_close *r, bool reset, const char *how);

/* The host's events go before the loop ends (worker_join frees the
 * base they belong to), on the worker thread. */
static void host_finish(struct host *h)
{
	if (h->stop_timer)
		event_free(h->stop_timer);
	h->stop_timer = NULL;
	if (h->park_timer)
		event_free(h->park_timer);
	h->park_timer = NULL;
	while (h->refused)
		refused_end(h->refused, false, "the daemon stops");
	conn_set_free(&h->set);
	worker_exit(&h->loop);
}

static void host_on_empty(struct conn_set *set)
{
	host_finish(host_of(set->worker));
}

static void host_on_stop_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct host *h = arg;
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		if (c->bev)
			conn_kill(c, "shutdown grace period over");
		c = next;
	}
}

/* The loop's stop callback: on the worker thread, after every task
 * posted before the request (hand-offs among them). */
static void host_on_stop(struct worker *w)
{
	struct host *h = host_of(w);
	h->set.stopping = true;
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		conn_shutdown(c);
		c = next;
	}
	struct timeval tv = {HOST_STOP_GRACE_SECONDS, 0};
	h->stop_timer = evtimer_new(w->base, host_on_stop_timer, h);
	if (h->stop_timer)
		evtimer_add(h->stop_timer, &tv);
	if (h->set.count == 0)
		host_finish(h);
}

int host_start(struct host *h, unsigned index, struct export_table *exports)
{
	memset(h, 0, sizeof(*h));
	int rc = worker_start(&h->loop, index, host_on_stop);
	if (rc < 0)
		return rc;
	/* The set's timer belongs to the loop's base: made here, before any
	 * connection (nothing runs on the thread yet but the loop). */
	rc = conn_set_init(&h->set, &h->loop, exports, host_on_empty);
	if (rc < 0) {
		worker_request_stop(&h->loop); /* host_on_stop: no connection */
		worker_join(&h->loop);
	}
	return rc;
}

/* An accepted socket on its way to its thread. */
struct hand_off {
	struct worker_task task;
	struct host *host;
	int fd;
	uint64_t id;
	struct access_peer peer;
};

/* A connection that could not start (out of memory): one per connect. */
LOG_LIMIT(start_failed_log, "connections that could not start");

static void hand_off_run(struct worker_task *task)
{
	struct hand_off *o = (struct hand_off *)task;
	struct host *h = o->host;
	if (h->set.stopping) {
		/* Posted before the stop request, run after it: ended too. */
		close(o->fd);
		budget_peer_remove(&o->peer);
		access_peer_release(&o->peer);
		budget_client_remove();
	} else {
		int rc = session_start(&h->set, o->fd, o->id, &o->peer);
		if (rc < 0)
			log_limited(&start_failed_log, LOG_WARN, "conn %llu: cannot start: %s",
				    (unsigned long long)o->id, strerror(-rc));
		/* Accepted just before a live upgrade paused the listeners: it
		 * waits like the others (the newest is the set's first). */
		else if (h->parking && h->set.conns && h->set.conns->id == o->id) {
			conn_park(h->set.conns, true);
			if (h->negotiation_ended)
				conn_park_negotiation_end(h->set.conns);
		}
	}
	free(o);
}

void host_hand_off(struct host *h, int fd, uint64_t id, const struct access_peer *peer)
{
	struct hand_off *o = malloc(sizeof(*o));
	if (o) {
		*o = (struct hand_off){
		    .task.run = hand_off_run, .host = h, .fd = fd, .id = id, .peer = *peer};
		if (worker_post_if_running(&h->loop, &o->task))
			return;
		free(o);
	} else {
		log_limited(&start_failed_log, LOG_ERROR, "conn %llu: out of memory handing off",
			    (unsigned long long)id);
	}
	close(fd);
	budget_peer_remove(peer);
	access_peer_release(peer);
	budget_client_remove();
}

void host_request_stop(struct host *h)
{
	worker_request_stop(&h->loop);
}

void host_join(struct host *h)
{
	worker_join(&h->loop);
}

void host_budget_wake(struct worker *w)
{
	conn_budget_wake(&host_of(w)->set);
}

/* ---- A live upgrade (host.h) ---- */

#define HOST_PARK_CHECK_MS 10

/* Connections that are not parked yet (closing ones end by themselves). */
static unsigned count_busy(struct host *h)
{
	unsigned busy = 0;
	for (struct conn *c = h->set.conns; c; c = c->next)
		if (c->bev && !c->closing && !conn_parked(c))
			busy++;
	return busy;
}

/* Connections still negotiating stop where they are: they will be closed. */
static void end_negotiations(struct host *h)
{
	if (h->negotiation_ended)
		return;
	h->negotiation_ended = true;
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		conn_ref(c);
		conn_park_negotiation_end(c);
		conn_unref(c);
		c = next;
	}
}

static void host_on_park_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct host *h = arg;
	if (clock_now_ns() - h->park_ns >= (uint64_t)HOST_NEGOTIATION_GRACE_MS * 1000000u)
		end_negotiations(h);
	atomic_store(&h->busy, count_busy(h));
}

static void park_run(struct worker_task *task)
{
	struct host *h = (struct host *)((char *)task - offsetof(struct host, park_task));
	bool on = h->park_on;
	h->parking = on;
	h->negotiation_ended = false;
	h->park_ns = clock_now_ns();
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		conn_ref(c);
		conn_park(c, on);
		conn_unref(c);
		c = next;
	}
	if (on) {
		if (!h->park_timer)
			h->park_timer =
			    event_new(h->loop.base, -1, EV_PERSIST, host_on_park_timer, h);
		struct timeval tv = {0, HOST_PARK_CHECK_MS * 1000};
		if (h->park_timer)
			event_add(h->park_timer, &tv);
		/* else no timer: busy stays UINT32_MAX, never counted ready */
	} else if (h->park_timer) {
		event_free(h->park_timer);
		h->park_timer = NULL;
	}
	uring_submit(&h->loop.ring);
}

void host_park(struct host *h, bool on)
{
	atomic_store(&h->busy, UINT32_MAX); /* until the timer has counted */
	h->park_on = on;
	h->park_task.run = park_run;
	worker_post(&h->loop, &h->park_task);
}

unsigned host_busy(struct host *h)
{
	return atomic_load(&h->busy);
}

/* Why c cannot be handed over, or NULL: it can. */
static const char *cannot_move(struct conn *c)
{
	if (c->phase != CONN_TRANSMISSION)
		return "upgrade: still negotiating (the client may connect again)";
	if (c->tls)
		return "upgrade: a TLS session cannot be handed over";
	if (!conn_parked(c))
		return "upgrade: not at a request boundary in time";
	if (evbuffer_get_length(conn_input(c)) > UPGRADE_MAX_PENDING ||
	    strlen(c->export->name) > UPGRADE_MAX_NAME)
		return "upgrade: too much unparsed input to hand over";
	if (strlen(c->export->backing->spec) > UPGRADE_MAX_BACKEND)
		return "upgrade: its backend's name is too long to hand over";
	return NULL;
}

/* What c reads and writes, for the new daemon to check against the export
 * of that name it opened (upgrade_record.h: the export's name proves
 * nothing, a new configuration may put it on another file). */
static void collect_identity(const struct conn *c, struct upgrade_conn_state *s)
{
	const struct export *e = c->export;
	s->flags |= UPGRADE_CONN_IDENTITY;
	s->offset = e->offset;
	s->backend_kind = e->backend->ident_file ? UPGRADE_BACKEND_FILE : UPGRADE_BACKEND_NAMED;
	s->backend_dev = e->backend->ident_file ? e->backend->ident_dev : 0;
	s->backend_ino = e->backend->ident_file ? e->backend->ident_ino : 0;
	snprintf(s->backend, sizeof(s->backend), "%s", e->backing->spec);
}

/* The state of a parked plaintext connection in transmission; false
 * (with why) when it cannot be handed over. */
static bool collect_one(struct conn *c, struct host_moved *m, const char **why)
{
	*why = cannot_move(c);
	if (*why)
		return false;
	struct evbuffer *in = conn_input(c);
	size_t pending = evbuffer_get_length(in);
	memset(m, 0, sizeof(*m));
	uint8_t *copy = NULL;
	if (pending) {
		copy = malloc(pending);
		if (!copy || evbuffer_copyout(in, copy, pending) != (ev_ssize_t)pending) {
			free(copy);
			*why = "upgrade: out of memory";
			return false;
		}
	}
	m->fd = fcntl(conn_fd(c), F_DUPFD_CLOEXEC, 3);
	if (m->fd < 0) {
		free(copy);
		*why = "upgrade: cannot duplicate its socket";
		return false;
	}
	struct upgrade_conn_state *s = &m->state;
	s->id = c->id;
	s->age_ms = (clock_now_ns() - c->started_ns) / 1000000u;
	s->requests = atomic_load(&c->requests);
	s->bytes_read = atomic_load(&c->bytes_read);
	s->bytes_written = atomic_load(&c->bytes_written);
	s->payload_copied = atomic_load(&c->payload_copied);
	s->size = c->session.size;
	s->tx_flags = c->session.eflags;
	s->upgrades = atomic_load_explicit(&c->upgrades, memory_order_relaxed);
	s->min_block = c->session.min_block;
	s->pref_block = c->export->block_size;
	s->max_payload = c->session.max_payload;
	s->flags = (uint8_t)((c->session.structured ? UPGRADE_CONN_STRUCTURED : 0) |
			     (c->session.extended ? UPGRADE_CONN_EXTENDED : 0) |
			     (c->session.block_status ? UPGRADE_CONN_META : 0));
	snprintf(s->name, sizeof(s->name), "%s", c->export->name);
	collect_identity(c, s);
	s->pending = copy;
	s->pending_len = (uint32_t)pending;
	return true;
}

static void collect_run(struct worker_task *task)
{
	struct host *h = (struct host *)((char *)task - offsetof(struct host, collect_task));
	h->moved = calloc(h->set.count ? h->set.count : 1, sizeof(*h->moved));
	h->moved_count = 0;
	h->closed_count = 0;
	end_negotiations(h); /* nothing new is read from here on */
	for (struct conn *c = h->set.conns; c; c = c->next) {
		if (!c->bev || c->closing)
			continue; /* ending anyway */
		const char *why = "upgrade: out of memory";
		if (h->moved && collect_one(c, &h->moved[h->moved_count], &why))
			h->moved_count++;
		else
			h->closed_count++;
	}
	atomic_store(&h->collected, true);
}

void host_collect(struct host *h)
{
	atomic_store(&h->collected, false);
	h->collect_task.run = collect_run;
	worker_post(&h->loop, &h->collect_task);
}

static bool was_moved(struct host *h, uint64_t id)
{
	for (size_t i = 0; i < h->moved_count; i++)
		if (h->moved[i].state.id == id)
			return true;
	return false;
}

static void finish_run(struct worker_task *task)
{
	struct host *h = (struct host *)((char *)task - offsetof(struct host, finish_task));
	struct conn *c = h->set.conns;
	while (c) {
		struct conn *next = c->next;
		if (c->bev && !c->closing && !was_moved(h, c->id)) {
			const char *why = cannot_move(c);
			conn_kill(c, why ? why : "upgrade: could not be collected (out of memory)");
		} else if (c->bev && was_moved(h, c->id)) {
			log_info("conn %llu: handed over to the new daemon",
				 (unsigned long long)c->id);
		}
		c = next;
	}
	atomic_store(&h->finished, true);
}

void host_finish_upgrade(struct host *h)
{
	atomic_store(&h->finished, false);
	h->finish_task.run = finish_run;
	worker_post(&h->loop, &h->finish_task);
}

void host_collected_free(struct host *h)
{
	for (size_t i = 0; i < h->moved_count; i++) {
		if (h->moved[i].fd >= 0)
			close(h->moved[i].fd);
		free((void *)h->moved[i].state.pending);
	}
	free(h->moved);
	h->moved = NULL;
	h->moved_count = 0;
}

/* A connection handed over, on its way to its thread. */
struct adopt {
	struct worker_task task;
	struct host *host;
	int fd;
	struct access_peer peer;
	struct upgrade_conn_state st; /* st.pending: malloc'd */
};

static void adopt_run(struct worker_task *task)
{
	struct adopt *a = (struct adopt *)task;
	int rc = session_adopt(&a->host->set, a->fd, &a->peer, &a->st);
	if (rc < 0)
		log_warn("conn %llu: cannot resume after the upgrade: %s",
			 (unsigned long long)a->st.id, strerror(-rc));
	free((void *)a->st.pending);
	free(a);
}

void host_adopt(struct host *h, int fd, const struct access_peer *peer,
		const struct upgrade_conn_state *st)
{
	struct adopt *a = malloc(sizeof(*a));
	uint8_t *pending = st->pending_len ? malloc(st->pending_len) : NULL;
	if (!a || (st->pending_len && !pending)) {
		free(a);
		free(pending);
		log_error("conn %llu: out of memory resuming it after the upgrade",
			  (unsigned long long)st->id);
		close(fd);
		budget_peer_remove(peer);
		access_peer_release(peer);
		budget_client_remove();
		return;
	}
	a->task.run = adopt_run;
	a->host = h;
	a->fd = fd;
	a->peer = *peer;
	a->st = *st;
	if (pending)
		memcpy(pending, st->pending, st->pending_len);
	a->st.pending = pending;
	worker_post(&h->loop, &a->task);
}

/* ---- A connection handed over and not resumed (host.h) ---- */

struct refused_close {
	struct worker_task task; /* first: its start on the host's thread */
	struct host *host;
	int fd;
	uint64_t id;
	uint64_t deadline_ns;
	struct event *ev; /* readable, or the deadline */
	struct refused_close *prev, *next;
};

/* Close it now: a reset when its client has not taken every byte yet
 * (the deadline), a plain close otherwise. */
static void refused_end(struct refused_close *r, bool reset, const char *how)
{
	struct host *h = r->host;
	if (r->prev)
		r->prev->next = r->next;
	else if (h->refused == r)
		h->refused = r->next;
	if (r->next)
		r->next->prev = r->prev;
	if (r->ev)
		event_free(r->ev);
	if (reset) {
		struct linger now = {.l_onoff = 1, .l_linger = 0};
		setsockopt(r->fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
	}
	close(r->fd);
	log_debug("conn %llu: closed after the upgrade: %s", (unsigned long long)r->id, how);
	free(r);
}

/* What the socket holds that its client's end has not acknowledged (TCP;
 * a Unix socket's bytes are in the client's queue once written). */
static int refused_unacked(int fd)
{
	int unacked = 0;
	if (ioctl(fd, SIOCOUTQ, &unacked) < 0)
		return 0;
	return unacked;
}

/* Readable, or the deadline: drop what came, end at EOF or the deadline. */
static void refused_event(evutil_socket_t fd, short what, void *arg)
{
	struct refused_close *r = arg;
	char scratch[16384];
	for (int i = 0; i < 64 && (what & EV_READ); i++) {
		ssize_t n = recv((int)fd, scratch, sizeof(scratch), MSG_DONTWAIT);
		if (n > 0)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		if (n < 0 && errno == EINTR)
			continue;
		refused_end(r, false, n == 0 ? "the client closed its end" : strerror(errno));
		return;
	}
	if (clock_now_ns() >= r->deadline_ns) {
		bool unread = refused_unacked((int)fd) > 0;
		refused_end(r, unread,
			    unread ? "the client did not take its last replies in time (reset)"
				   : "the client did not close its end in time");
	}
}

static void refused_start(struct worker_task *task)
{
	struct refused_close *r = (struct refused_close *)task;
	struct host *h = r->host;
	r->next = h->refused;
	if (r->next)
		r->next->prev = r;
	h->refused = r;
	if (h->set.stopping) {
		refused_end(r, false, "the daemon stops");
		return;
	}
	/* The FIN goes after the replies the old daemon wrote. */
	if (shutdown(r->fd, SHUT_WR) < 0) {
		refused_end(r, false, strerror(errno));
		return;
	}
	r->deadline_ns = clock_now_ns() + (uint64_t)CONN_CLOSE_TIMEOUT * 1000000000u;
	struct timeval tv = {CONN_CLOSE_TIMEOUT, 0};
	r->ev = event_new(h->loop.base, r->fd, EV_READ | EV_PERSIST, refused_event, r);
	if (!r->ev || event_add(r->ev, &tv) < 0)
		refused_end(r, false, "out of memory");
}

void host_close_refused(struct host *h, int fd, uint64_t id)
{
	struct refused_close *r = calloc(1, sizeof(*r));
	if (r) {
		r->task.run = refused_start;
		r->host = h;
		r->fd = fd;
		r->id = id;
		if (worker_post_if_running(&h->loop, &r->task))
			return;
		free(r);
	}
	close(fd);
}
