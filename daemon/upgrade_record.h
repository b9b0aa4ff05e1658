/*
 * daemon/upgrade_record.h: the state record of a live upgrade: what a
 * running daemon hands to the daemon that replaces it, one record per
 * message on a Unix SOCK_SEQPACKET pair, with at most one descriptor each
 * (SCM_RIGHTS). Pure: encodes into and decodes from caller's buffers; the
 * decoder is the trust boundary (a record from another version, cut short,
 * or missing its descriptor is refused with the reason) and is fuzzed.
 *
 * Layout (big-endian, like NBD), UPGRADE_RECORD_HEADER bytes of header:
 *
 *   u32 magic   UPGRADE_RECORD_MAGIC ("NBCU")
 *   u16 version UPGRADE_RECORD_VERSION: equal, or the record is refused
 *   u16 type    enum upgrade_record_type
 *   u32 length  of the body that follows (the rest of the message)
 *   u32 fds     descriptors that came with it: 1 for LISTENER and
 *               CONNECTION, 0 for the others
 *
 * Bodies:
 *   HELLO       u32 pid: the new daemon read its config and opened its
 *               exports; it is ready to take
 *   LISTENER    u8 kind (enum upgrade_listener_kind), u16 n, n bytes: the
 *               option's text it was bound from (--listen HOST:PORT,
 *               --unix spec, --control path, --metrics HOST:PORT; empty
 *               for socket activation)
 *   CONNECTION  u64 id, u64 age_ms, u64 requests, u64 bytes_read,
 *               u64 bytes_written, u64 payload_copied, u64 size (the
 *               export's size the client knows), u16 transmission flags
 *               sent, u8 flags (UPGRADE_CONN_*), u32 upgrades (times it
 *               was handed over before this one), u32 min_block, u32
 *               pref_block, u32 max_payload (the block size constraints
 *               the client was given), u16 n, n bytes: the
 *               export's name (1..4096), u32 m, m bytes (at most
 *               UPGRADE_MAX_PENDING): input read from the client and
 *               not yet parsed, which comes first; then, when flags has
 *               UPGRADE_CONN_IDENTITY, what the connection reads and
 *               writes (the backing object, which the export's name does
 *               not prove): u64 offset (the export's first byte in its
 *               backend: a window's), u8 kind (enum upgrade_backend_kind),
 *               u64 dev, u64 ino (a file: st_dev and st_ino; a block
 *               device: st_rdev and 0; 0 and 0 for the other kinds),
 *               u16 b, b bytes: the backend as configured (1..4096)
 *   END         u32 connections, u32 listeners: everything was sent
 *   TAKEN       u32 connections: the new daemon holds them all and will
 *               serve once committed; then, only to an old daemon whose
 *               CONNECTION records carried UPGRADE_CONN_IDENTITY (an
 *               older one reads the u32 alone, and refuses more), and
 *               only when it closes some: u32 closed (1..connections),
 *               u16 n, n bytes (at most UPGRADE_MAX_TEXT): how many of
 *               them the new daemon closes instead of serving, and why
 *   COMMIT      empty: the old daemon is gone from here on
 *   ERROR       n bytes of text (at most UPGRADE_MAX_TEXT): why the new
 *               daemon cannot take over
 *
 * The backend's identity is a trailing, optional part of CONNECTION under
 * the same version, not a version 2, so that a daemon of version 1
 * without it can still be upgraded to this one: its listeners, control
 * socket and clients' next connections move without a gap, and each of
 * its connections, whose object cannot be proven, is closed by the new
 * daemon with that reason (a version 2 would refuse the whole upgrade,
 * and a restart would close them all the same). The other way, a daemon
 * that sends identities to a version 1 daemon without them is refused
 * (unknown flags): that daemon would resume connections on whatever its
 * configuration names.
 */
#ifndef NBDCACHED_DAEMON_UPGRADE_RECORD_H
#define NBDCACHED_DAEMON_UPGRADE_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define UPGRADE_RECORD_MAGIC 0x4e424355u /* "NBCU" */
#define UPGRADE_RECORD_VERSION 1u
#define UPGRADE_RECORD_HEADER 16u
#define UPGRADE_MAX_NAME 4096u
#define UPGRADE_MAX_SPEC 1024u
#define UPGRADE_MAX_TEXT 1024u
#define UPGRADE_MAX_PENDING (1u << 20)
#define UPGRADE_MAX_BACKEND 4096u
/* A CONNECTION's identity part (UPGRADE_CONN_IDENTITY) at its largest. */
#define UPGRADE_IDENTITY_MAX (8 + 1 + 8 + 8 + 2 + UPGRADE_MAX_BACKEND)
/* The largest record: a CONNECTION with the most pending input. */
#define UPGRADE_RECORD_MAX                                                                         \
	(UPGRADE_RECORD_HEADER + 7 * 8 + 2 + 1 + 4 * 4 + 2 + UPGRADE_MAX_NAME + 4 +                \
	 UPGRADE_MAX_PENDING + UPGRADE_IDENTITY_MAX)
/* The largest TAKEN: with the most text. */
#define UPGRADE_TAKEN_MAX (UPGRADE_RECORD_HEADER + 4 + 4 + 2 + UPGRADE_MAX_TEXT)

enum upgrade_record_type {
	UPGRADE_HELLO = 1,
	UPGRADE_LISTENER = 2,
	UPGRADE_CONNECTION = 3,
	UPGRADE_END = 4,
	UPGRADE_TAKEN = 5,
	UPGRADE_COMMIT = 6,
	UPGRADE_ERROR = 7,
};

enum upgrade_listener_kind {
	UPGRADE_LISTEN_TCP = 1,
	UPGRADE_LISTEN_UNIX = 2,
	UPGRADE_LISTEN_ACTIVATED = 3,
	UPGRADE_LISTEN_CONTROL = 4,
	UPGRADE_LISTEN_METRICS = 5,
};

#define UPGRADE_CONN_STRUCTURED 0x01u
#define UPGRADE_CONN_EXTENDED 0x02u
#define UPGRADE_CONN_META 0x04u /* base:allocation selected */
#define UPGRADE_CONN_IDENTITY 0x08u /* the backend's identity follows */
#define UPGRADE_CONN_FLAGS 0x0fu

/* How a CONNECTION's backend is recognised in the new daemon. */
enum upgrade_backend_kind {
	UPGRADE_BACKEND_NAMED = 0, /* by its string (an NBD server, an RBD image) */
	UPGRADE_BACKEND_FILE = 1,  /* a file or block device: by dev and ino */
};

struct upgrade_conn_state {
	uint64_t id, age_ms, requests, bytes_read, bytes_written, payload_copied, size;
	uint16_t tx_flags;
	uint8_t flags;
	uint32_t upgrades;
	uint32_t min_block, pref_block, max_payload;
	char name[UPGRADE_MAX_NAME + 1];
	const uint8_t *pending; /* into the decoded buffer */
	uint32_t pending_len;
	/* With UPGRADE_CONN_IDENTITY in flags (else zero, and backend ""). */
	uint64_t offset;
	enum upgrade_backend_kind backend_kind;
	uint64_t backend_dev, backend_ino;
	char backend[UPGRADE_MAX_BACKEND + 1];
};

/* A decoded record: the fields of its type (pointers into the buffer). */
struct upgrade_record {
	enum upgrade_record_type type;
	uint32_t pid;			 /* HELLO */
	enum upgrade_listener_kind kind; /* LISTENER */
	char spec[UPGRADE_MAX_SPEC + 1]; /* LISTENER */
	struct upgrade_conn_state conn;	 /* CONNECTION */
	uint32_t connections, listeners; /* END (both), TAKEN (connections) */
	uint32_t closed;		 /* TAKEN: 0 when it said none */
	char text[UPGRADE_MAX_TEXT + 1]; /* ERROR; TAKEN: why it closes them */
};

/*
 * Decode the message buf[0..len) that came with nfds descriptors. 0, or
 * -EPROTO with why filled in (another version, another magic, a length
 * that does not add up, a field out of its bounds, a descriptor missing
 * or too many). Never reads past len.
 */
int upgrade_record_decode(const uint8_t *buf, size_t len, unsigned nfds, struct upgrade_record *out,
			  char *why, size_t why_len);

/*
 * Encoders: the message into buf (UPGRADE_RECORD_MAX bytes are always
 * enough, UPGRADE_TAKEN_MAX for TAKEN); its length, or 0 when a field is
 * out of its bounds (a name too long, pending input over
 * UPGRADE_MAX_PENDING, an identity without a backend string). TAKEN with
 * closed 0 is the plain one (why unused); else why (cut at
 * UPGRADE_MAX_TEXT) says why, and closed must not exceed connections.
 */
size_t upgrade_record_hello(uint8_t *buf, uint32_t pid);
size_t upgrade_record_listener(uint8_t *buf, enum upgrade_listener_kind kind, const char *spec);
size_t upgrade_record_connection(uint8_t *buf, const struct upgrade_conn_state *c);
size_t upgrade_record_end(uint8_t *buf, uint32_t connections, uint32_t listeners);
size_t upgrade_record_taken(uint8_t *buf, uint32_t connections, uint32_t closed, const char *why);
size_t upgrade_record_commit(uint8_t *buf);
size_t upgrade_record_error(uint8_t *buf, const char *text);

#endif
