/*
 * client/lib/nbd.h: an NBD client, blocking, one request in flight.
 *
 * Owns: one connection to an NBD server, from the greeting through option
 * haggling to transmission, and what the server told about the export.
 * Every byte on the wire is built or parsed by proto/nbd.h, so the client
 * is a second user of the codec the daemon relies on; the interop tests
 * run it (as nbdcache-io) against nbdcached and against qemu-nbd, an
 * independent implementation.
 *
 *   nbd_client_connect -> nbd_client_handshake
 *     -> nbd_client_list                        (NBD_OPT_LIST, then ABORT)
 *     -> nbd_client_go -> nbd_client_transact ... -> nbd_client_disconnect
 *
 * Negotiation (nbd_client_go): NBD_OPT_EXTENDED_HEADERS, falling back to
 * NBD_OPT_STRUCTURED_REPLY; NBD_OPT_SET_META_CONTEXT base:allocation when
 * asked; NBD_OPT_GO asking for block size, name and description
 * (NBD_OPT_EXPORT_NAME only if the server lacks GO).
 *
 * The client does not second-guess the server: out-of-range, unaligned or
 * unadvertised requests go out as asked, so tests see the server's answer.
 * What the server sends back is checked strictly against the
 * specification.
 *
 * Errors: 0 / -errno, reported on stderr where detected
 * (client/lib/report.h): -EREMOTEIO an error from the server (an option
 * refused, an NBD error to a command); -EPROTO a protocol violation by the
 * server or a lost connection, after which the connection is useless.
 *
 * Locking: none; one thread uses a client.
 */
#ifndef CLIENT_LIB_NBD_H
#define CLIENT_LIB_NBD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/nbd.h"

#define NBD_CLIENT_PAYLOAD_MAX 65536u /* largest option reply or error chunk */

struct nbd_client {
	int fd;
	bool debug; /* every option, request and reply on stderr */
	bool no_zeroes;
	bool structured; /* structured replies, or implied by extended headers */
	bool extended;
	bool meta; /* base:allocation selected, with id meta_id */
	uint32_t meta_id;
	bool have_export; /* NBD_OPT_GO delivered NBD_INFO_EXPORT */
	uint64_t size;
	uint16_t eflags;
	bool have_block_size;
	uint32_t min_block, preferred_block, max_block;
	uint32_t max_payload; /* what we put in one READ or WRITE */
	char name[NBD_MAX_STRING + 1], description[NBD_MAX_STRING + 1];
	uint64_t next_cookie;
	uint8_t payload[NBD_CLIENT_PAYLOAD_MAX + 1]; /* option reply or error chunk */
};

/* What nbd_client_go asks the server for. */
struct nbd_client_options {
	const char *export_name;
	bool no_extended, no_structured; /* extended headers imply structured replies */
	bool meta;			 /* select base:allocation (needs structured replies) */
};

/* One exported name, and its description (length 0 when it has none). */
typedef void nbd_list_entry(void *opaque, const char *name, size_t name_length,
			    const char *description, size_t description_length);

/* One base:allocation extent of a block status reply. */
typedef void nbd_extent(void *opaque, uint64_t offset, uint64_t length, uint64_t flags);

/*
 * One request and what its reply has delivered so far. The caller fills in
 * command (a name for messages: "read", "trim", ...), type, flags, offset
 * and length, and for a READ `data` (length bytes) and `map` (length / 8 + 1
 * bytes, the client's record of the bytes delivered, so that overlapping
 * or missing chunks are caught); for BLOCK_STATUS `extent`, called for
 * each extent as it is checked.
 */
struct nbd_transaction {
	const char *command;
	uint16_t type;
	uint16_t flags;
	uint64_t cookie, offset, length;
	uint8_t *data;
	uint8_t *map;
	nbd_extent *extent;
	void *opaque;	   /* passed to extent */
	uint64_t covered;  /* READ: bytes described by content chunks */
	unsigned statuses; /* BLOCK_STATUS: status chunks received */
	uint32_t error;	   /* first NBD error reported, 0 if none */
};

/*
 * A connected stream socket, to a Unix socket PATH or to HOST:PORT (HOST
 * may be a [bracketed] IPv6 address; TCP_NODELAY set): the descriptor, or
 * -errno (-EINVAL: no port; -EHOSTUNREACH: the name does not resolve).
 */
int nbd_client_connect(const char *unix_path, const char *host_port);

/* A client for connected socket `fd`, before the handshake. */
void nbd_client_init(struct nbd_client *c, int fd, bool debug);

/* The fixed newstyle greeting and our client flags. */
int nbd_client_handshake(struct nbd_client *c);

/* NBD_OPT_LIST: `entry` for each export, then NBD_OPT_ABORT. */
int nbd_client_list(struct nbd_client *c, nbd_list_entry *entry, void *opaque);

/* Option haggling up to NBD_OPT_GO: on success the client is transmitting. */
int nbd_client_go(struct nbd_client *c, const struct nbd_client_options *o);

/*
 * The longest effect length (TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS) one
 * request carries: 64 bits with extended headers, else 32 bits, cut to a
 * multiple of the minimum block size (and of 4 KiB).
 */
uint64_t nbd_client_max_effect(const struct nbd_client *c);

/* One request and its whole reply; an NBD error is reported as -EREMOTEIO. */
int nbd_client_transact(struct nbd_client *c, struct nbd_transaction *t, const void *payload);

/* NBD_CMD_DISC; no reply comes. */
int nbd_client_disconnect(struct nbd_client *c);

#endif
