/*
 * daemon/backend/rbd_none.c: the rbd backend of a build without Ceph (make
 * RBD=0, as the i386 chroot builds, needing no librbd-dev): an rbd: export
 * is refused at start with a message saying why. A normal build has rbd.c
 * and rbd_io.c in its place.
 */
#include <errno.h>

#include "daemon/backend/backend.h"
#include "daemon/log.h"
#include "daemon/rbd_spec.h"

bool backend_rbd_handles(const char *spec)
{
	return rbd_spec_handles(spec);
}

int backend_rbd_open(const char *spec, bool readonly, unsigned timeout_seconds, bool takeover_wait,
		     struct backend **out)
{
	(void)readonly;
	(void)timeout_seconds;
	(void)takeover_wait;
	(void)out;
	log_error("backend %s: this nbdcached was built without Ceph RBD support (make RBD=0)",
		  spec);
	return -ENOTSUP;
}
