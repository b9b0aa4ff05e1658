/*
 * daemon/upgrade_internal.h: what the two sides of a live upgrade share
 * (upgrade.c, the old daemon's; upgrade_child.c, the new one's and the
 * messages). Not for anything else.
 */
#ifndef NBDCACHED_DAEMON_UPGRADE_INTERNAL_H
#define NBDCACHED_DAEMON_UPGRADE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/upgrade_record.h"

/* The environment variable that hands the new daemon its end of the pair. */
#define UPGRADE_ENV "NBDCACHED_UPGRADE_FD"

/* Send one record with at most one descriptor (fd < 0: none). 0 or -errno. */
int upgrade_send_record(int sock, const uint8_t *buf, size_t len, int fd);
/*
 * Receive one record within timeout_ms (-1: no limit) into buf (at least
 * UPGRADE_RECORD_MAX bytes) and decode it; its descriptor, if any, in
 * *fd. -ETIMEDOUT, -EPIPE (the other side is gone) or -EPROTO (why set).
 */
int upgrade_recv_record(int sock, uint8_t *buf, int timeout_ms, struct upgrade_record *r, int *fd,
			char *why, size_t why_len);

#endif
