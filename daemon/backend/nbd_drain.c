/*
 * daemon/backend/nbd_drain.c: the socket of a connection given up with
 * commands in flight, kept (a duplicate, after nbd_close() retired the
 * commands) and read, the replies discarded, until the server closes it
 * (its write side is shut when no request is half sent), or it was quiet
 * for NBD_DRAIN_QUIET_MS after answering, or NBD_DRAIN_MAX_MS passed.
 *
 * Why: a server that resumes after a stop then finds its client still
 * reading. nbdkit 1.32.4 to 1.33.9 abort when a client hangs up while
 * several threads have replies to send (RHBZ#2173054), and the backend
 * would be gone for good. (Not for nbdkit: backends: nbd_close() waits
 * for that process.)
 *
 * At most NBD_DRAIN_MAX at once; backend thread only (nbd_internal.h).
 */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/backend/nbd_internal.h"
#include "daemon/clock.h"

void nbd_drain_end(struct nbd_drain *d)
{
	struct nbd_backend *nb = d->nb;
	struct nbd_drain **p = &nb->drains;
	while (*p != d)
		p = &(*p)->next;
	*p = d->next;
	nb->ndrains--;
	if (d->ev)
		event_free(d->ev);
	close(d->fd);
	free(d);
}

static void drain_on_event(evutil_socket_t fd, short what, void *arg)
{
	struct nbd_drain *d = arg;
	static char sink[65536];
	if (what & EV_READ) {
		for (unsigned i = 0; i < 16; i++) {
			ssize_t n = read(fd, sink, sizeof(sink));
			if (n > 0) {
				d->answered = true;
				continue;
			}
			if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
				break;
			nbd_drain_end(d); /* the server closed it, or it broke */
			return;
		}
	} else if (d->half_sent && d->answered) {
		nbd_drain_end(d); /* answered, then quiet: nothing more is coming */
		return;
	}
	if (clock_now_ns() >= d->deadline_ns)
		nbd_drain_end(d);
}

/*
 * Keep h's socket open and read after nbd_close(h) (the file header says
 * why). False if it cannot be: the caller just closes.
 */
bool nbd_drain_start(struct nbd_backend *nb, struct nbd_handle *h)
{
	int fd = nbd_aio_get_fd(h);
	if (fd < 0 || nb->ndrains >= NBD_DRAIN_MAX)
		return false;
	struct nbd_drain *d = calloc(1, sizeof(*d));
	if (!d)
		return false;
	d->nb = nb;
	d->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (d->fd < 0) {
		free(d);
		return false;
	}
	d->half_sent = (nbd_aio_get_direction(h) & LIBNBD_AIO_DIRECTION_WRITE) != 0;
	d->deadline_ns = clock_now_ns() + (uint64_t)NBD_DRAIN_MAX_MS * 1000000u;
	struct timeval quiet = {NBD_DRAIN_QUIET_MS / 1000, (NBD_DRAIN_QUIET_MS % 1000) * 1000};
	d->ev = event_new(nb->loop, d->fd, EV_READ | EV_PERSIST, drain_on_event, d);
	if (!d->ev || event_add(d->ev, &quiet) < 0) {
		if (d->ev)
			event_free(d->ev);
		close(d->fd);
		free(d);
		return false;
	}
	if (!d->half_sent)
		shutdown(d->fd, SHUT_WR); /* the server sees EOF after whole requests */
	d->next = nb->drains;
	nb->drains = d;
	nb->ndrains++;
	return true;
}
