/*
 * daemon/rbd_spec.h: the backend string of a Ceph RBD image.
 *
 *   rbd:POOL/IMAGE[@SNAP][?KEY=VALUE[&KEY=VALUE]...]
 *   rbd:POOL/NAMESPACE/IMAGE[@SNAP][?...]
 *
 * KEYs: conf (a ceph.conf; default: librados's search, $CEPH_CONF first),
 * id (the cephx user without "client."; default admin), keyring (a
 * keyring file; default: the conf's). A snapshot is read-only.
 *
 * Owns: parsing and checking that string, nothing else; no Ceph library
 * (daemon/backend/rbd.c opens what it names), so options.c can refuse a
 * bad one when the config is read, and it builds for the i386 core.
 */
#ifndef NBDCACHED_DAEMON_RBD_SPEC_H
#define NBDCACHED_DAEMON_RBD_SPEC_H

#include <stdbool.h>
#include <stddef.h>

#define RBD_SPEC_NAME_MAX 256  /* a pool, namespace, image or snapshot name */
#define RBD_SPEC_PATH_MAX 1024 /* conf and keyring paths */

struct rbd_spec {
	char pool[RBD_SPEC_NAME_MAX];
	char ns[RBD_SPEC_NAME_MAX]; /* "" when none */
	char image[RBD_SPEC_NAME_MAX];
	char snap[RBD_SPEC_NAME_MAX]; /* "" when none */
	char conf[RBD_SPEC_PATH_MAX];
	char id[RBD_SPEC_NAME_MAX];
	char keyring[RBD_SPEC_PATH_MAX];
};

/* Does the backend string name an RBD image ("rbd:" first)? */
bool rbd_spec_handles(const char *backend);
/* Parse; -EINVAL with a message naming what is wrong in err. */
int rbd_spec_parse(const char *backend, struct rbd_spec *out, char *err, size_t errlen);

#endif
