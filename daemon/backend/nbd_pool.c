/*
 * daemon/backend/nbd_pool.c: the NBD backend's connection slots. One slot,
 * or NBD_MAX_CONNS when the server advertises multi-conn (URIs only: each
 * nbdkit: handle is a process of its own). Each slot lives on its own:
 *
 *   IDLE --timer--> CONNECTING --handshake done--> READY
 *     ^                 |  no handshake within          |  EOF, error, a reply
 *     |                 |  NBD_CONNECT_TIMEOUT_MS        |  pending longer than
 *     +---- backoff ----+-------------------------------+  --backend-timeout
 *
 * (OFF: a slot not wanted, or given up. RETIRING: the server grew, an
 * online resize: a ready connection takes no new command and, once its
 * commands are answered, says goodbye and connects again at once, its
 * handshake giving the new size.)
 *
 * Connecting is asynchronous (only the first connection, in
 * backend_nbd_open, is waited for), so a server that accepts but never
 * answers costs one slot, not the thread. A failed slot is tried again
 * after 0.1 s, doubling to 5 s. An extra slot that fails NBD_EXTRA_ATTEMPTS
 * times before it ever worked is given up (the server serves fewer
 * connections than it advertises); while the server reached through slot
 * 0 lacks multi-conn, only slot 0 is used.
 *
 * Deadlines: one tick (NBD_TICK_MS) while a command is in flight or a
 * request waits for a connection. A connection whose oldest command has
 * had no reply for --backend-timeout is declared dead: closed (an nbdkit we
 * started is killed), its socket handed to nbd_drain.c when commands were
 * in flight.
 *
 * Durability: a ready connection lost after commands that write were sent
 * on it moves base.loss_seq (backend.h).
 *
 * Nothing here calls into the requests: closing a handle makes libnbd
 * retire its commands, whose free callbacks (nbd_io.c) only mark the
 * requests; the event handlers in nbd_thread.c then move them along, and
 * send the waiting ones when a handler here reports a connection ready.
 * Backend thread only (nbd_internal.h).
 */
#include <errno.h>
#include <event2/event.h>
#include <libnbd.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "daemon/backend/nbd_internal.h"
#include "daemon/log.h"

struct nbd_handle *nbd_pool_handle_begin(struct nbd_backend *nb, char *err, size_t errlen)
{
	struct nbd_handle *h = nbd_create();
	if (!h) {
		snprintf(err, errlen, "%s", nbd_get_error());
		return NULL;
	}
	/* The URI is the administrator's: nbds:// backends name their
	 * credentials with tls-certificates=DIR or tls-psk-file=FILE. */
	if (nbd_add_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION) < 0 ||
	    nbd_set_uri_allow_local_file(h, true) < 0 ||
	    (nb->uri ? nbd_aio_connect_uri(h, nb->uri)
		     : nbd_aio_connect_systemd_socket_activation(h, nb->argv)) < 0) {
		snprintf(err, errlen, "%s", nbd_get_error() ? nbd_get_error() : "connect failed");
		nbd_close(h);
		return NULL;
	}
	return h;
}

/* Watch what libnbd wants next on c's socket; false if it cannot be. */
static bool conn_watch(struct nbd_conn *c)
{
	unsigned dir = nbd_aio_get_direction(c->h);
	int fd = nbd_aio_get_fd(c->h);
	if (c->ev && c->dir == dir && c->fd == fd)
		return true;
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	if (fd < 0)
		return false;
	short what = (dir & LIBNBD_AIO_DIRECTION_READ ? EV_READ : 0) |
		     (dir & LIBNBD_AIO_DIRECTION_WRITE ? EV_WRITE : 0);
	c->ev = event_new(c->nb->loop, fd, what | EV_PERSIST, c->nb->on_conn_event, c);
	if (!c->ev || event_add(c->ev, NULL) < 0)
		return false;
	c->dir = dir;
	c->fd = fd;
	return true;
}

/*
 * Close c's handle. libnbd retires every command it still holds inside
 * nbd_close(): their chunk_free() marks the requests to be sent again.
 * An nbdkit we started is killed first when it stopped answering, so that
 * nbd_close() does not wait for it. goodbye: c holds no command, the
 * server is told (NBD_CMD_DISC) and nothing is left to read.
 */
static void conn_close(struct nbd_conn *c, bool kill, bool goodbye)
{
	if (c->ev) {
		event_free(c->ev);
		c->ev = NULL;
	}
	evtimer_del(c->timer);
	struct nbd_handle *h = c->h;
	c->h = NULL;
	c->state = CONN_OFF;
	if (h) {
		if (kill && c->nb->argv)
			nbd_kill_subprocess(h, SIGKILL);
		if (goodbye && !nbd_aio_is_dead(h) && !nbd_aio_is_closed(h))
			nbd_aio_disconnect(h, 0);
		else if (!c->nb->argv && !nbd_aio_is_dead(h) && !nbd_aio_is_closed(h) &&
			 (c->oldest || nbd_aio_in_flight(h) > 0) && nbd_drain_start(c->nb, h))
			log_debug("backend %s: connection %u: its socket is read until the server "
				  "is done with it",
				  c->nb->name, c->index + 1);
		nbd_close(h);
	}
	if (c->oldest)
		log_error("backend %s: connection %u: commands left after close", c->nb->name,
			  c->index + 1);
	c->oldest = c->newest = NULL;
}

/* The next attempt in delay_ms, if the slot is wanted. */
static void conn_schedule(struct nbd_conn *c, unsigned delay_ms)
{
	struct nbd_backend *nb = c->nb;
	if (c->index >= nb->want_conns || c->given_up) {
		c->state = CONN_OFF;
		return;
	}
	c->state = CONN_IDLE;
	struct timeval tv = {delay_ms / 1000, (delay_ms % 1000) * 1000};
	if (evtimer_add(c->timer, &tv) < 0) {
		log_error("backend %s: connection %u: cannot arm its timer; left closed", nb->name,
			  c->index + 1);
		c->state = CONN_OFF;
	}
}

/*
 * c failed: close it and try again later. Writes acknowledged on a ready
 * connection may be lost with it (loss_seq). Never calls back into the
 * requests: the ones it held are deferred (chunk_free).
 */
void nbd_pool_fail(struct nbd_conn *c, const char *why, bool kill)
{
	struct nbd_backend *nb = c->nb;
	if (c->state == CONN_RETIRING) {
		if (c->wrote)
			atomic_fetch_add(&nb->base.loss_seq, 1);
		log_debug("backend %s: connection %u lost while retiring (%s)", nb->name,
			  c->index + 1, why);
	} else if (c->state == CONN_READY) {
		nb->nready--;
		if (c->wrote)
			atomic_fetch_add(&nb->base.loss_seq, 1);
		log_debug("backend %s: connection %u lost (%s)", nb->name, c->index + 1, why);
		if (nb->nready == 0 && !nb->down) {
			nb->down = true;
			log_error("backend %s: backend connection lost (%s); reconnecting",
				  nb->name, why);
		}
	} else if (c->state == CONN_CONNECTING) {
		log_debug("backend %s: connection %u: connecting failed: %s", nb->name,
			  c->index + 1, why);
		if (c->index > 0 && !c->ever_ready && ++c->failures >= NBD_EXTRA_ATTEMPTS) {
			c->given_up = true;
			log_info("backend %s: connection %u: %s; using fewer", nb->name,
				 c->index + 1, why);
		}
	}
	conn_close(c, kill, false);
	unsigned delay = c->backoff_ms;
	c->backoff_ms = delay * 2 > NBD_BACKOFF_MAX_MS ? NBD_BACKOFF_MAX_MS : delay * 2;
	conn_schedule(c, delay);
}

/* After a libnbd call on c: close it if it died, else watch it. False if it failed. */
bool nbd_pool_settle(struct nbd_conn *c)
{
	char why[256];
	if (nbd_aio_is_dead(c->h) || nbd_aio_is_closed(c->h)) {
		last_error(why, sizeof(why), "closed");
		nbd_pool_fail(c, why, false);
		return false;
	}
	if (c->broken) {
		snprintf(why, sizeof(why), "a command failed: %s", strerror(c->broken));
		nbd_pool_fail(c, why, false);
		return false;
	}
	if (!conn_watch(c)) {
		nbd_pool_fail(c, "cannot watch its socket", false);
		return false;
	}
	return true;
}

/*
 * The handshake is done: c takes requests (true; the caller sends the
 * requests that waited for a connection), or it is an extra slot whose
 * server lacks multi-conn and is closed (false).
 */
static bool conn_ready(struct nbd_conn *c)
{
	struct nbd_backend *nb = c->nb;
	evtimer_del(c->timer);
	c->multi_conn = nb->uri && nbd_can_multi_conn(c->h) == 1;
	int64_t size = nbd_get_size(c->h);
	if (size < 0 || (uint64_t)size != nb->expect_size)
		log_warn("backend %s: size changed to %lld after reconnecting", nb->name,
			 (long long)size);
	if (c->index > 0 && !c->multi_conn) {
		/* Without multi-conn the NBD standard asks for one connection. */
		log_debug("backend %s: connection %u: no multi-conn; closed", nb->name,
			  c->index + 1);
		conn_close(c, false, false);
		return false;
	}
	c->state = CONN_READY;
	c->ever_ready = true;
	c->wrote = false;
	c->broken = 0;
	nb->nready++;
	nb->silent = false;
	log_debug("backend %s: connection %u ready", nb->name, c->index + 1);
	if (nb->down) {
		nb->down = false;
		log_info("backend %s: backend reconnected", nb->name);
	}
	if (c->index == 0)
		nbd_pool_set_want(nb, c->multi_conn ? nb->max_conns : 1);
	return true;
}

static void conn_renew(struct nbd_conn *c, bool waited);

/* Start an attempt on an idle slot. True if c is ready already. */
static bool conn_connect(struct nbd_conn *c)
{
	char err[256];
	c->state = CONN_CONNECTING;
	c->broken = 0;
	c->h = nbd_pool_handle_begin(c->nb, err, sizeof(err));
	if (!c->h) {
		nbd_pool_fail(c, err, false);
		return false;
	}
	struct timeval tv = {NBD_CONNECT_TIMEOUT_MS / 1000, (NBD_CONNECT_TIMEOUT_MS % 1000) * 1000};
	if (evtimer_add(c->timer, &tv) < 0) {
		nbd_pool_fail(c, "cannot arm its timer", false);
		return false;
	}
	if (nbd_pool_settle(c) && nbd_aio_is_ready(c->h))
		return conn_ready(c);
	return false;
}

/* Slots [0, want) are kept connected; the others are left as they are. */
void nbd_pool_set_want(struct nbd_backend *nb, unsigned want)
{
	nb->want_conns = want;
	for (unsigned i = 1; i < want; i++) {
		struct nbd_conn *c = &nb->conns[i];
		if (c->state == CONN_OFF && !c->given_up)
			conn_schedule(c, 0);
	}
}

bool nbd_pool_on_timer(struct nbd_conn *c)
{
	char why[64];
	if (c->state == CONN_IDLE)
		return conn_connect(c);
	if (c->state == CONN_CONNECTING) {
		snprintf(why, sizeof(why), "no handshake within %u s",
			 NBD_CONNECT_TIMEOUT_MS / 1000);
		nbd_pool_fail(c, why, true);
	}
	return false;
}

bool nbd_pool_on_event(struct nbd_conn *c, short what)
{
	if (what & EV_READ)
		nbd_aio_notify_read(c->h);
	if ((what & EV_WRITE) && !nbd_aio_is_dead(c->h) && !nbd_aio_is_closed(c->h))
		nbd_aio_notify_write(c->h);
	if (!nbd_pool_settle(c))
		return false;
	if (c->state == CONN_CONNECTING && nbd_aio_is_ready(c->h))
		return conn_ready(c);
	if (c->state == CONN_RETIRING && !c->oldest)
		conn_renew(c, true);
	return false;
}

/* ---- renewal (online resize, nbd.c) ---- */

/* A retired connection that holds no command: goodbye, and connect again at once. */
/* Close c (goodbye: it holds no command) and connect again at once. */
static void conn_restart(struct nbd_conn *c, bool goodbye)
{
	conn_close(c, false, goodbye);
	c->backoff_ms = NBD_BACKOFF_MIN_MS;
	conn_schedule(c, 0);
}

static void conn_renew(struct nbd_conn *c, bool waited)
{
	struct nbd_backend *nb = c->nb;
	/* What it wrote counts only once a flush on a live connection covers it. */
	if (c->wrote)
		atomic_fetch_add(&nb->base.loss_seq, 1);
	log_debug("backend %s: connection %u renewed%s", nb->name, c->index + 1,
		  waited ? ", its commands answered" : "");
	conn_restart(c, true);
}

void nbd_pool_renew(struct nbd_backend *nb, uint64_t size)
{
	nb->expect_size = size;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		struct nbd_conn *c = &nb->conns[i];
		if (c->state == CONN_READY) {
			nb->nready--;
			c->state = CONN_RETIRING;
			if (!c->oldest)
				conn_renew(c, false);
		} else if (c->state == CONN_CONNECTING) {
			/* Its handshake may have carried the old size. */
			conn_restart(c, false);
		}
	}
	nbd_pool_tick_arm(nb);
}

/* ---- deadlines ---- */

bool nbd_pool_tick_needed(struct nbd_backend *nb)
{
	if (nb->waiting)
		return true;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++)
		if (nb->conns[i].oldest || nb->conns[i].state == CONN_RETIRING)
			return true;
	return false;
}

void nbd_pool_tick_arm(struct nbd_backend *nb)
{
	if (evtimer_pending(nb->tick, NULL))
		return;
	struct timeval tv = {0, NBD_TICK_MS * 1000};
	if (evtimer_add(nb->tick, &tv) < 0)
		log_error("backend %s: cannot arm the deadline timer", nb->name);
}

/*
 * A connection whose oldest command has had no reply for --backend-timeout
 * is dead; if no connection had any reply meanwhile, the server is silent
 * and every connection is closed (nb->silent, until a handshake succeeds
 * again). Their requests are sent again while their time lasts (chunk_free
 * marked them; the caller moves them along).
 */
void nbd_pool_expire(struct nbd_backend *nb, uint64_t now)
{
	char why[64];
	snprintf(why, sizeof(why), "no reply within %u s", nb->timeout_s);
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		struct nbd_conn *c = &nb->conns[i];
		if (c->state == CONN_RETIRING && !c->oldest) {
			conn_renew(c, true);
			continue;
		}
		if ((c->state != CONN_READY && c->state != CONN_RETIRING) || !c->oldest ||
		    now - c->oldest->sent_ns < nb->timeout_ns)
			continue;
		if (nb->last_reply_ns < c->oldest->sent_ns) {
			log_warn("backend %s: %s on any connection; closing them", nb->name, why);
			nb->silent = true;
			for (unsigned k = 0; k < NBD_MAX_CONNS; k++)
				if (nb->conns[k].state == CONN_READY ||
				    nb->conns[k].state == CONN_RETIRING)
					nbd_pool_fail(&nb->conns[k], why, true);
			break;
		}
		log_warn("backend %s: connection %u: %s; closing it", nb->name, i + 1, why);
		nbd_pool_fail(c, why, true);
	}
}

/*
 * After the thread: close every slot's handle (a ready one that holds no
 * command is told goodbye first) and free its events. nbd_close() stops an
 * nbdkit we started and frees what libnbd still holds (chunk_free). True
 * if a slot still held commands.
 */
bool nbd_pool_teardown(struct nbd_backend *nb)
{
	bool left = false;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		struct nbd_conn *c = &nb->conns[i];
		left = left || c->oldest;
		if (c->ev)
			event_free(c->ev);
		c->ev = NULL;
		if (c->h) {
			if (c->state == CONN_READY && !c->oldest)
				nbd_aio_disconnect(c->h, 0);
			nbd_close(c->h); /* stops an nbdkit we started */
			c->h = NULL;
		}
		if (c->timer)
			event_free(c->timer);
	}
	return left;
}
