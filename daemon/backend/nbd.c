/*
 * daemon/backend/nbd.c: an export whose bytes live on another NBD server,
 * reached through libnbd: nbd://, nbds://, nbd+unix:// URIs, or
 * "nbdkit:PLUGIN ARG..." for any nbdkit plugin, which the daemon starts
 * itself through libnbd's systemd socket activation (nbdkit exits with us).
 *
 * The backend owns one thread with its own libevent loop; it drives every
 * libnbd handle of the backend through nbd_aio_* calls, each handle's
 * socket watched in the direction libnbd asks for. backend_submit() may be
 * called from any worker: it queues the request and wakes the backend
 * thread; the completion is posted back to the submitting worker.
 *
 *   worker --submit--> queue --wake--> backend thread --aio--> server
 *   worker <--post---- done  <-------- free callback  <------- reply
 *
 * Connections. One slot, or NBD_MAX_CONNS when the server advertises
 * multi-conn (URIs only: each nbdkit: handle is a process of its own).
 * Each slot lives on its own:
 *
 *   IDLE --timer--> CONNECTING --handshake done--> READY
 *     ^                 |  no handshake within          |  EOF, error, a reply
 *     |                 |  NBD_CONNECT_TIMEOUT_MS        |  pending longer than
 *     +---- backoff ----+-------------------------------+  --backend-timeout
 *
 * (OFF: a slot not wanted, or given up. RETIRING: an online resize found
 * the server grown; a ready connection takes no new command and connects
 * again once its commands are answered: see "Online resize" below.)
 *
 * Connecting is asynchronous (only the first connection, in
 * backend_nbd_open, is waited for), so a server that accepts but never
 * answers costs one slot, not the thread. A failed slot is tried again
 * after 0.1 s, doubling to 5 s. An extra slot that fails NBD_EXTRA_ATTEMPTS
 * times before it ever worked is given up (the server serves fewer
 * connections than it advertises); while the server reached through slot
 * 0 lacks multi-conn, only slot 0 is used.
 *
 * Requests. A request is cut into chunks the server accepts (its maximum
 * block size; 32-bit lengths for TRIM, WRITE_ZEROES and BLOCK_STATUS), at
 * most NBD_WINDOW in flight, spread over the ready connections. What the
 * server lacks is emulated or answered honestly: no WRITE_ZEROES -> zeros
 * are written; no FUA -> a flush after the write; no FAST_ZERO -> ENOTSUP;
 * no TRIM or CACHE -> nothing to do; no base:allocation -> all data.
 *
 * A FLUSH covers every write completed before it was sent: one flush when
 * every ready connection advertises multi-conn, else one on each.
 *
 * Failures. A chunk lost with its connection sends the whole request
 * again, on another connection or once one is back, while the request is
 * younger than --backend-timeout; after that it fails with EIO, as does a
 * request that waited that long for a connection. A connection whose
 * oldest command has had no reply for --backend-timeout is closed. When no
 * connection had any reply meanwhile the server is silent: every
 * connection is closed, and until a handshake succeeds again a request
 * that finds no connection fails at once. So no request waits much longer
 * than the timeout. An error the server returns is the request's error; a
 * connection error (ESHUTDOWN) also closes the connection.
 *
 * A connection given up with commands in flight is not simply closed: its
 * socket is kept (a duplicate, after nbd_close() retired the commands) and
 * read, the replies discarded, until the server closes it (its write side
 * is shut when no request is half sent), or it was quiet for
 * NBD_DRAIN_QUIET_MS after answering, or NBD_DRAIN_MAX_MS passed. A server
 * that resumes after a stop then finds its client still reading: nbdkit
 * 1.32.4 to 1.33.9 abort when a client hangs up while several threads
 * have replies to send (RHBZ#2173054), and the backend would be gone for
 * good. (Not for nbdkit: backends: nbd_close() waits for that process.)
 *
 * Durability is the cache's: a connection lost after commands that write
 * were sent on it moves base.loss_seq (backend.h), since writes the server
 * acknowledged may be gone with it. An emulated FUA write whose flush
 * completes after loss_seq moved is sent again. A write sent on a
 * connection declared dead may still be carried out by a server that was
 * only slow; nothing on the client side can take it back.
 *
 * The backend going down (no ready connection left) and coming back are
 * logged once each; single connections at debug level.
 *
 * libnbd ownership (libnbd(3) "Callback lifetimes", lib/rw.c): every
 * nbd_aio_* command's free callback runs exactly once. When the call
 * returns -1 it has already run; otherwise the command was queued, and the
 * callbacks run when it retires: when the reply comes, when the connection
 * dies (even inside the very nbd_aio_* call that queued it), or in
 * nbd_close(). So a chunk belongs to libnbd from the call on, and only
 * chunk_free() accounts for it.
 *
 * The code, one concern a file (nbd_internal.h, which they share, draws
 * the map): this file reads the spec, makes the first connection and
 * learns the export's size and capabilities; nbd_thread.c is the thread
 * and its event handlers; nbd_io.c the requests and their libnbd
 * commands; nbd_pool.c the connections and their deadlines; nbd_drain.c
 * the sockets of given-up connections.
 */
#include <errno.h>
#include <libnbd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/nbd_internal.h"
#include "daemon/clock.h"
#include "daemon/log.h"
#include "daemon/stop_signals.h"

/*
 * A connection waited for (at most timeout_ms): the first one, whose
 * handshake gives the export's size and capabilities, and a resize's
 * probe. The backend thread's loop drives the others. A stop asked during
 * the daemon's start (stop_signals.h) ends the wait: NULL with *stopped
 * set, and an nbdkit started for it is told to go.
 */
static struct nbd_handle *connect_wait(struct nbd_backend *nb, unsigned timeout_ms, char *err,
				       size_t errlen, bool *stopped)
{
	struct nbd_handle *h = nbd_pool_handle_begin(nb, err, errlen);
	if (!h)
		return NULL;
	uint64_t deadline = clock_now_ns() + (uint64_t)timeout_ms * 1000000u;
	int rc = 0;
	while (rc == 0 && !nbd_aio_is_ready(h)) {
		if (nbd_aio_is_dead(h) || nbd_aio_is_closed(h)) {
			rc = -1;
			break;
		}
		uint64_t now = clock_now_ns();
		if (now >= deadline) {
			snprintf(err, errlen, "no answer within %u ms", timeout_ms);
			nbd_close(h);
			return NULL;
		}
		if (stop_signal_pending()) {
			snprintf(err, errlen, "the daemon is stopping");
			*stopped = true;
			if (nb->argv)
				nbd_kill_subprocess(h, SIGTERM);
			nbd_close(h);
			return NULL;
		}
		unsigned dir = nbd_aio_get_direction(h);
		struct pollfd pfd = {.fd = nbd_aio_get_fd(h),
				     .events =
					 (short)((dir & LIBNBD_AIO_DIRECTION_READ ? POLLIN : 0) |
						 (dir & LIBNBD_AIO_DIRECTION_WRITE ? POLLOUT : 0))};
		int wait_ms = (int)((deadline - now) / 1000000u) + 1;
		if (pfd.fd < 0 || poll(&pfd, 1, wait_ms > 100 ? 100 : wait_ms) < 0) {
			rc = -1;
			break;
		}
		if (pfd.revents & (POLLIN | POLLHUP | POLLERR))
			rc = nbd_aio_notify_read(h);
		else if (pfd.revents & POLLOUT)
			rc = nbd_aio_notify_write(h);
	}
	if (rc < 0) {
		snprintf(err, errlen, "%s",
			 nbd_get_error() ? nbd_get_error() : "connection failed");
		nbd_close(h);
		return NULL;
	}
	return h;
}

/*
 * Online resize. The size comes with the handshake, once per connection
 * (and libnbd refuses requests past it), so a server that grew is asked on
 * a connection of our own, closed at once; then the backend's connections
 * are renewed: each takes no new command, is closed once its commands are
 * answered, and connects again, seeing the new size. Requests meanwhile
 * wait for a connection as after a loss (--backend-timeout). A server
 * that shrank needs no renewal: the export's end moves first (export.h).
 * Closing a connection that wrote moves loss_seq (nbd_pool.c), so the
 * cache writes its unstable data again rather than trust a flush for it.
 */
static int server_size(struct nbd_backend *nb, uint64_t *size)
{
	char err[256];
	bool stopped = false;
	struct nbd_handle *h = connect_wait(nb, NBD_PROBE_TIMEOUT_MS, err, sizeof(err), &stopped);
	if (!h) {
		log_warn("backend %s: cannot ask the server its size: %s", nb->name, err);
		return -EIO;
	}
	int64_t have = nbd_get_size(h);
	nbd_aio_disconnect(h, 0);
	nbd_close(h);
	if (have < 0)
		return -EIO;
	*size = (uint64_t)have;
	if (*size > nb->renewed_size && nb->started) {
		nb->renewed_size = *size;
		log_info("backend %s: the server has %llu bytes now; renewing its connections",
			 nb->name, (unsigned long long)*size);
		nbd_renew(nb, *size);
	}
	return 0;
}

int nbd_probe_size(struct backend *be, uint64_t *size)
{
	return server_size(to_nbd(be), size);
}

int nbd_set_size(struct backend *be, uint64_t size, uint64_t *have)
{
	int rc = server_size(to_nbd(be), have);
	return rc < 0 ? rc : size > *have ? -ENOSPC : 0;
}

bool backend_nbd_handles(const char *spec)
{
	static const char *const prefixes[] = {"nbd://",       "nbds://",      "nbd+unix://",
					       "nbds+unix://", "nbd+vsock://", "nbds+vsock://",
					       "nbdkit:"};
	for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++)
		if (strncmp(spec, prefixes[i], strlen(prefixes[i])) == 0)
			return true;
	return false;
}

/* "nbdkit:PLUGIN ARG..." -> {"nbdkit", "-f", "--exit-with-parent", PLUGIN, ARG..., NULL} */
static char **nbdkit_argv(const char *spec)
{
	const char *p = spec + strlen("nbdkit:");
	size_t n = 4;
	for (const char *q = p; *q; q++)
		if (*q == ' ')
			n++;
	char **argv = calloc(n + 1, sizeof(*argv));
	if (!argv)
		return NULL;
	size_t k = 0;
	argv[k++] = strdup("nbdkit");
	argv[k++] = strdup("-f");
	argv[k++] = strdup("--exit-with-parent");
	while (*p) {
		while (*p == ' ')
			p++;
		const char *e = p;
		while (*e && *e != ' ')
			e++;
		if (e > p)
			argv[k++] = strndup(p, (size_t)(e - p));
		p = e;
	}
	for (size_t i = 0; i < k; i++)
		if (!argv[i])
			goto err;
	if (k < 4)
		goto err; /* no plugin */
	return argv;
err:
	for (size_t i = 0; i < k; i++)
		free(argv[i]);
	free(argv);
	return NULL;
}

int backend_nbd_open(const char *spec, bool readonly, unsigned timeout_seconds,
		     struct backend **out)
{
	struct nbd_backend *nb = calloc(1, sizeof(*nb));
	if (!nb)
		return -ENOMEM;
	pthread_mutex_init(&nb->lock, NULL);
	nb->base.ops = &nbd_backend_ops;
	atomic_init(&nb->base.loss_seq, 0);
	nb->name = strdup(spec);
	nb->timeout_s = timeout_seconds;
	nb->timeout_ns = (uint64_t)timeout_seconds * 1000000000u;
	for (unsigned i = 0; i < NBD_MAX_CONNS; i++) {
		nb->conns[i].nb = nb;
		nb->conns[i].index = i;
		nb->conns[i].fd = -1;
		nb->conns[i].backoff_ms = NBD_BACKOFF_MIN_MS;
	}
	int rc = -ENOMEM;
	if (!nb->name)
		goto err;
	if (strncmp(spec, "nbdkit:", 7) == 0) {
		nb->argv = nbdkit_argv(spec);
		if (!nb->argv) {
			rc = -EINVAL;
			log_error("backend %s: expected nbdkit:PLUGIN [ARG...]", spec);
			goto err;
		}
	} else {
		nb->uri = strdup(spec);
		if (!nb->uri)
			goto err;
	}
	char err[256];
	bool stopped = false;
	struct nbd_handle *h = connect_wait(nb, NBD_CONNECT_TIMEOUT_MS, err, sizeof(err), &stopped);
	if (!h && stopped) {
		log_info("backend %s: no longer waited for: %s", spec, err);
		rc = -EINTR;
		goto err;
	}
	if (!h) {
		log_error("backend %s: %s", spec, err);
		rc = -EIO;
		goto err;
	}
	int64_t size = nbd_get_size(h);
	nb->base.size = size > 0 ? (uint64_t)size : 0;
	nb->expect_size = nb->renewed_size = nb->base.size;
	nb->base.readonly = readonly || nbd_is_read_only(h) == 1;
	nb->base.can_trim = nbd_can_trim(h) == 1;
	nb->base.can_zero = nbd_can_zero(h) == 1;
	nb->base.max_range = NBD_COMPACT_MAX; /* chunk_limit (nbd_io.c) */
	nb->can_flush = nbd_can_flush(h) == 1;
	nb->can_fua = nbd_can_fua(h) == 1;
	nb->can_fast_zero = nbd_can_fast_zero(h) == 1;
	nb->can_cache = nbd_can_cache(h) == 1;
	nb->can_block_status = nbd_can_meta_context(h, LIBNBD_CONTEXT_BASE_ALLOCATION) == 1;
	int64_t minimum = nbd_get_block_size(h, LIBNBD_SIZE_MINIMUM);
	int64_t maximum = nbd_get_block_size(h, LIBNBD_SIZE_MAXIMUM);
	nb->base.min_block = minimum > 1 ? (uint32_t)minimum : 1;
	nb->max_block = maximum > 0 && maximum < (32 << 20) ? (uint32_t)maximum : (32u << 20);
	struct nbd_conn *first = &nb->conns[0];
	first->h = h;
	first->state = CONN_READY;
	first->ever_ready = true;
	first->multi_conn = nb->uri && nbd_can_multi_conn(h) == 1;
	nb->max_conns = first->multi_conn ? NBD_MAX_CONNS : 1;
	nb->want_conns = 1; /* the others connect once the thread runs */
	nb->nready = 1;
	log_info("backend %s: %llu bytes, %u connection(s)%s%s%s%s%s", spec,
		 (unsigned long long)nb->base.size, nb->max_conns,
		 nb->base.readonly ? ", read-only" : "", nb->base.can_trim ? ", trim" : "",
		 nb->base.can_zero ? ", zero" : ", zero emulated",
		 nb->can_fua ? ", fua" : ", fua emulated",
		 nb->can_block_status ? ", base:allocation" : "");
	*out = &nb->base;
	return 0;
err:
	nbd_backend_free(nb);
	return rc;
}
