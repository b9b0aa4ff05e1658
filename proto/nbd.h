/*
 * proto/nbd.h: the NBD wire protocol, as constants, wire structs and a pure
 * codec.
 *
 * Owns: every byte layout of the protocol (fixed newstyle handshake, option
 * haggling, compact and extended requests, simple, structured and extended
 * replies). Nothing here does I/O or allocates: callers hand in buffers, get
 * back sizes. That makes the codec usable by the daemon, by our own test
 * client and by the fuzzers alike, and builds on i386 with no dependency.
 *
 * Locking: none; every function is reentrant.
 *
 * Conventions: functions that decode return 0 or a negative errno
 * (-EAGAIN: not enough bytes yet; -EBADMSG: bad magic; -EINVAL: malformed).
 * Encoders return the number of bytes written; the caller sizes the buffer
 * with the NBD_*_SIZE constants.
 *
 * The reference is doc/proto.md of the NBD project, including the
 * extended-headers extension (64-bit effect lengths).
 */
#ifndef NBDCACHED_PROTO_NBD_H
#define NBDCACHED_PROTO_NBD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Handshake magics. */
#define NBD_MAGIC 0x4e42444d41474943ULL      /* "NBDMAGIC" */
#define NBD_OPTS_MAGIC 0x49484156454F5054ULL /* "IHAVEOPT" */
#define NBD_REP_MAGIC 0x0003e889045565a9ULL  /* option reply */

/* Transmission magics. */
#define NBD_REQUEST_MAGIC 0x25609513u
#define NBD_EXTENDED_REQUEST_MAGIC 0x21e41c71u
#define NBD_SIMPLE_REPLY_MAGIC 0x67446698u
#define NBD_STRUCTURED_REPLY_MAGIC 0x668e33efu
#define NBD_EXTENDED_REPLY_MAGIC 0x6e8a278cu

/* Handshake flags (server) and client flags. */
#define NBD_FLAG_FIXED_NEWSTYLE (1u << 0)
#define NBD_FLAG_NO_ZEROES (1u << 1)
#define NBD_FLAG_C_FIXED_NEWSTYLE (1u << 0)
#define NBD_FLAG_C_NO_ZEROES (1u << 1)

/* Options. */
#define NBD_OPT_EXPORT_NAME 1
#define NBD_OPT_ABORT 2
#define NBD_OPT_LIST 3
#define NBD_OPT_STARTTLS 5
#define NBD_OPT_INFO 6
#define NBD_OPT_GO 7
#define NBD_OPT_STRUCTURED_REPLY 8
#define NBD_OPT_LIST_META_CONTEXT 9
#define NBD_OPT_SET_META_CONTEXT 10
#define NBD_OPT_EXTENDED_HEADERS 11

/* Option replies. */
#define NBD_REP_ACK 1u
#define NBD_REP_SERVER 2u
#define NBD_REP_INFO 3u
#define NBD_REP_META_CONTEXT 4u
#define NBD_REP_FLAG_ERROR (1u << 31)
#define NBD_REP_ERR_UNSUP (NBD_REP_FLAG_ERROR + 1)
#define NBD_REP_ERR_POLICY (NBD_REP_FLAG_ERROR + 2)
#define NBD_REP_ERR_INVALID (NBD_REP_FLAG_ERROR + 3)
#define NBD_REP_ERR_PLATFORM (NBD_REP_FLAG_ERROR + 4)
#define NBD_REP_ERR_TLS_REQD (NBD_REP_FLAG_ERROR + 5)
#define NBD_REP_ERR_UNKNOWN (NBD_REP_FLAG_ERROR + 6)
#define NBD_REP_ERR_SHUTDOWN (NBD_REP_FLAG_ERROR + 7)
#define NBD_REP_ERR_BLOCK_SIZE_REQD (NBD_REP_FLAG_ERROR + 8)
#define NBD_REP_ERR_TOO_BIG (NBD_REP_FLAG_ERROR + 9)
#define NBD_REP_ERR_EXT_HEADER_REQD (NBD_REP_FLAG_ERROR + 10)

/* NBD_REP_INFO types. */
#define NBD_INFO_EXPORT 0
#define NBD_INFO_NAME 1
#define NBD_INFO_DESCRIPTION 2
#define NBD_INFO_BLOCK_SIZE 3

/* Transmission flags. */
#define NBD_FLAG_HAS_FLAGS (1u << 0)
#define NBD_FLAG_READ_ONLY (1u << 1)
#define NBD_FLAG_SEND_FLUSH (1u << 2)
#define NBD_FLAG_SEND_FUA (1u << 3)
#define NBD_FLAG_ROTATIONAL (1u << 4)
#define NBD_FLAG_SEND_TRIM (1u << 5)
#define NBD_FLAG_SEND_WRITE_ZEROES (1u << 6)
#define NBD_FLAG_SEND_DF (1u << 7)
#define NBD_FLAG_CAN_MULTI_CONN (1u << 8)
#define NBD_FLAG_SEND_RESIZE (1u << 9)
#define NBD_FLAG_SEND_CACHE (1u << 10)
#define NBD_FLAG_SEND_FAST_ZERO (1u << 11)
#define NBD_FLAG_BLOCK_STATUS_PAYLOAD (1u << 12)

/* Commands. */
#define NBD_CMD_READ 0
#define NBD_CMD_WRITE 1
#define NBD_CMD_DISC 2
#define NBD_CMD_FLUSH 3
#define NBD_CMD_TRIM 4
#define NBD_CMD_CACHE 5
#define NBD_CMD_WRITE_ZEROES 6
#define NBD_CMD_BLOCK_STATUS 7
/*
 * The experimental RESIZE extension (NetworkBlockDevice/nbd, branch
 * extension-resize, doc/proto.md; master lists the bit and the number as
 * reserved for it): a client may send it only when the server set
 * NBD_FLAG_SEND_RESIZE (bit 9 of the transmission flags, above). The new
 * size is the request's offset field (64 bits under both header forms);
 * no payload, and the length is not used (we take 0 only, as for FLUSH).
 * Errors it names: EPERM (not allowed; optionally a shrink while others
 * use the export), EIO, ENOSPC (a grow without room), ESHUTDOWN.
 */
#define NBD_CMD_RESIZE 8

/* Command flags. */
#define NBD_CMD_FLAG_FUA (1u << 0)
#define NBD_CMD_FLAG_NO_HOLE (1u << 1)
#define NBD_CMD_FLAG_DF (1u << 2)
#define NBD_CMD_FLAG_REQ_ONE (1u << 3)
#define NBD_CMD_FLAG_FAST_ZERO (1u << 4)
#define NBD_CMD_FLAG_PAYLOAD_LEN (1u << 5)

/* Structured / extended reply flags and types. */
#define NBD_REPLY_FLAG_DONE (1u << 0)
#define NBD_REPLY_TYPE_NONE 0
#define NBD_REPLY_TYPE_OFFSET_DATA 1
#define NBD_REPLY_TYPE_OFFSET_HOLE 2
#define NBD_REPLY_TYPE_BLOCK_STATUS 5
#define NBD_REPLY_TYPE_BLOCK_STATUS_EXT 6
#define NBD_REPLY_TYPE_ERROR ((1u << 15) + 1)
#define NBD_REPLY_TYPE_ERROR_OFFSET ((1u << 15) + 2)
#define NBD_REPLY_TYPE_IS_ERR(t) (((t) & (1u << 15)) != 0)

/* Error values on the wire. */
#define NBD_SUCCESS 0
#define NBD_EPERM 1
#define NBD_EIO 5
#define NBD_ENOMEM 12
#define NBD_EINVAL 22
#define NBD_ENOSPC 28
#define NBD_EOVERFLOW 75
#define NBD_ENOTSUP 95
#define NBD_ESHUTDOWN 108

/* base:allocation status flags. */
#define NBD_STATE_HOLE (1u << 0)
#define NBD_STATE_ZERO (1u << 1)

#define NBD_META_BASE_ALLOCATION "base:allocation"

/* Limits. */
#define NBD_MAX_STRING 4096u		     /* names, descriptions, queries */
#define NBD_DEFAULT_MAX_PAYLOAD (32u << 20)  /* what we advertise */
#define NBD_MAX_OFFSET 0x7fffffffffffffffULL /* largest export size we accept */

/* Sizes of fixed wire items. */
#define NBD_GREETING_SIZE 18
#define NBD_CLIENT_FLAGS_SIZE 4
#define NBD_OPTION_HEADER_SIZE 16
#define NBD_OPTION_REPLY_HEADER_SIZE 20
#define NBD_EXPORT_NAME_REPLY_SIZE 134
#define NBD_EXPORT_NAME_REPLY_SHORT_SIZE 10
#define NBD_INFO_EXPORT_SIZE 12
#define NBD_INFO_BLOCK_SIZE_SIZE 14
#define NBD_REQUEST_SIZE 28
#define NBD_EXTENDED_REQUEST_SIZE 32
#define NBD_SIMPLE_REPLY_SIZE 16
#define NBD_STRUCTURED_REPLY_SIZE 20
#define NBD_EXTENDED_REPLY_SIZE 32
#define NBD_CHUNK_HEADER_MAX 32
#define NBD_OFFSET_DATA_PREFIX_SIZE 8
#define NBD_OFFSET_HOLE_SIZE 12
#define NBD_ERROR_CHUNK_FIXED_SIZE 6
#define NBD_BLOCK_STATUS_PREFIX_SIZE 4
#define NBD_BLOCK_STATUS_EXT_PREFIX_SIZE 8
#define NBD_BLOCK_DESC_SIZE 8
#define NBD_BLOCK_DESC_EXT_SIZE 16

/* ---- Wire structs (big-endian fields; packed; sizes asserted). ---- */

struct nbd_wire_greeting {
	uint64_t magic;
	uint64_t opts_magic;
	uint16_t flags;
} __attribute__((packed));

struct nbd_wire_option {
	uint64_t magic;
	uint32_t option;
	uint32_t length;
} __attribute__((packed));

struct nbd_wire_option_reply {
	uint64_t magic;
	uint32_t option;
	uint32_t type;
	uint32_t length;
} __attribute__((packed));

struct nbd_wire_export_name_reply {
	uint64_t size;
	uint16_t flags;
	uint8_t zeroes[124];
} __attribute__((packed));

struct nbd_wire_info_export {
	uint16_t type;
	uint64_t size;
	uint16_t flags;
} __attribute__((packed));

struct nbd_wire_info_block_size {
	uint16_t type;
	uint32_t minimum;
	uint32_t preferred;
	uint32_t maximum;
} __attribute__((packed));

struct nbd_wire_request {
	uint32_t magic;
	uint16_t flags;
	uint16_t type;
	uint64_t cookie;
	uint64_t offset;
	uint32_t length;
} __attribute__((packed));

struct nbd_wire_extended_request {
	uint32_t magic;
	uint16_t flags;
	uint16_t type;
	uint64_t cookie;
	uint64_t offset;
	uint64_t length;
} __attribute__((packed));

struct nbd_wire_simple_reply {
	uint32_t magic;
	uint32_t error;
	uint64_t cookie;
} __attribute__((packed));

struct nbd_wire_structured_reply {
	uint32_t magic;
	uint16_t flags;
	uint16_t type;
	uint64_t cookie;
	uint32_t length;
} __attribute__((packed));

struct nbd_wire_extended_reply {
	uint32_t magic;
	uint16_t flags;
	uint16_t type;
	uint64_t cookie;
	uint64_t offset;
	uint64_t length;
} __attribute__((packed));

struct nbd_wire_offset_hole {
	uint64_t offset;
	uint32_t length;
} __attribute__((packed));

struct nbd_wire_error_chunk {
	uint32_t error;
	uint16_t message_length;
} __attribute__((packed));

struct nbd_wire_block_desc {
	uint32_t length;
	uint32_t flags;
} __attribute__((packed));

struct nbd_wire_block_desc_ext {
	uint64_t length;
	uint64_t flags;
} __attribute__((packed));

_Static_assert(sizeof(struct nbd_wire_greeting) == NBD_GREETING_SIZE, "greeting");
_Static_assert(sizeof(struct nbd_wire_option) == NBD_OPTION_HEADER_SIZE, "option");
_Static_assert(sizeof(struct nbd_wire_option_reply) == NBD_OPTION_REPLY_HEADER_SIZE, "opt reply");
_Static_assert(sizeof(struct nbd_wire_export_name_reply) == NBD_EXPORT_NAME_REPLY_SIZE, "exp");
_Static_assert(sizeof(struct nbd_wire_info_export) == NBD_INFO_EXPORT_SIZE, "info export");
_Static_assert(sizeof(struct nbd_wire_info_block_size) == NBD_INFO_BLOCK_SIZE_SIZE, "info bs");
_Static_assert(sizeof(struct nbd_wire_request) == NBD_REQUEST_SIZE, "request");
_Static_assert(sizeof(struct nbd_wire_extended_request) == NBD_EXTENDED_REQUEST_SIZE, "ext req");
_Static_assert(sizeof(struct nbd_wire_simple_reply) == NBD_SIMPLE_REPLY_SIZE, "simple reply");
_Static_assert(sizeof(struct nbd_wire_structured_reply) == NBD_STRUCTURED_REPLY_SIZE, "sr");
_Static_assert(sizeof(struct nbd_wire_extended_reply) == NBD_EXTENDED_REPLY_SIZE, "ext reply");
_Static_assert(sizeof(struct nbd_wire_offset_hole) == NBD_OFFSET_HOLE_SIZE, "hole");
_Static_assert(sizeof(struct nbd_wire_error_chunk) == NBD_ERROR_CHUNK_FIXED_SIZE, "error");
_Static_assert(sizeof(struct nbd_wire_block_desc) == NBD_BLOCK_DESC_SIZE, "desc");
_Static_assert(sizeof(struct nbd_wire_block_desc_ext) == NBD_BLOCK_DESC_EXT_SIZE, "desc ext");

/* ---- Decoded (host order) forms. ---- */

/* One option request header from the client. */
struct nbd_option {
	uint32_t option;
	uint32_t length; /* bytes of option data that follow */
};

/*
 * An option reply header (client side: our test client decodes these).
 */
struct nbd_option_reply {
	uint32_t option;
	uint32_t type;
	uint32_t length;
};

/* NBD_OPT_INFO / NBD_OPT_GO data, pointing into the caller's buffer. */
struct nbd_opt_go {
	const char *name; /* not NUL-terminated */
	uint32_t name_length;
	uint16_t info_count;
	const uint8_t *info; /* info_count big-endian 16-bit requests */
};

/* NBD_OPT_LIST/SET_META_CONTEXT data, pointing into the caller's buffer. */
struct nbd_opt_meta {
	const char *name;
	uint32_t name_length;
	uint32_t query_count;
	const uint8_t *queries; /* validated: query_count length-prefixed strings */
	uint32_t queries_length;
};

struct nbd_meta_iter {
	const uint8_t *pos;
	const uint8_t *end;
};

/*
 * A request header, decoded and normalised. `length` is the header's length
 * field (payload length when payload_length != 0, else effect length);
 * `payload_length` is how many bytes of payload follow the header on the
 * wire: the WRITE data (in both modes: qemu 10 sends extended WRITEs without
 * NBD_CMD_FLAG_PAYLOAD_LEN), or length when an extended request carries
 * NBD_CMD_FLAG_PAYLOAD_LEN.
 */
struct nbd_request {
	uint16_t flags;
	uint16_t type;
	uint64_t cookie;
	uint64_t offset;
	uint64_t length;
	uint64_t payload_length;
};

/* What the server negotiated; input to request validation. */
struct nbd_session {
	bool structured;     /* structured replies (or extended headers) */
	bool extended;	     /* extended headers */
	bool block_status;   /* at least one meta context selected */
	uint16_t eflags;     /* transmission flags sent to the client */
	uint64_t size;	     /* export size */
	uint32_t max_payload;
	uint32_t min_block;
};

/* A decoded reply header of any kind (client side). */
struct nbd_reply {
	uint32_t magic; /* which of the three reply magics */
	uint16_t flags;
	uint16_t type;	/* NBD_REPLY_TYPE_*; NONE for simple replies */
	uint32_t error; /* simple replies only */
	uint64_t cookie;
	uint64_t offset; /* extended only */
	uint64_t length; /* payload length (structured/extended) */
};

/* One extent for block status replies. */
struct nbd_extent {
	uint64_t length;
	uint64_t flags;
};

/* ---- Byte order helpers. ---- */
uint16_t nbd_get16(const void *p);
uint32_t nbd_get32(const void *p);
uint64_t nbd_get64(const void *p);
void nbd_put16(void *p, uint16_t v);
void nbd_put32(void *p, uint32_t v);
void nbd_put64(void *p, uint64_t v);

/* ---- Handshake (proto/handshake.c). ---- */
size_t nbd_encode_greeting(void *buf, uint16_t flags);
int nbd_decode_greeting(const void *buf, size_t len, uint16_t *flags);
size_t nbd_encode_client_flags(void *buf, uint32_t flags);
int nbd_decode_client_flags(const void *buf, size_t len, uint32_t *flags);
size_t nbd_encode_option(void *buf, uint32_t option, uint32_t length);
int nbd_decode_option(const void *buf, size_t len, struct nbd_option *out);
size_t nbd_encode_option_reply(void *buf, uint32_t option, uint32_t type, uint32_t length);
int nbd_decode_option_reply(const void *buf, size_t len, struct nbd_option_reply *out);
size_t nbd_encode_export_name_reply(void *buf, uint64_t size, uint16_t eflags, bool no_zeroes);
size_t nbd_encode_info_export(void *buf, uint64_t size, uint16_t eflags);
size_t nbd_encode_info_block_size(void *buf, uint32_t minimum, uint32_t preferred,
				  uint32_t maximum);
/* NBD_INFO_NAME / NBD_INFO_DESCRIPTION: the 2-byte type; the string follows. */
size_t nbd_encode_info_type(void *buf, uint16_t type);
/* NBD_REP_SERVER payload prefix: 4-byte name length; name, then description follow. */
size_t nbd_encode_rep_server_prefix(void *buf, uint32_t name_length);
/* NBD_REP_META_CONTEXT payload prefix: 4-byte context id; the name follows. */
size_t nbd_encode_meta_context_prefix(void *buf, uint32_t context_id);

int nbd_parse_opt_go(const void *data, uint32_t len, struct nbd_opt_go *out);
uint16_t nbd_opt_go_info(const struct nbd_opt_go *go, uint16_t i);
int nbd_parse_opt_meta(const void *data, uint32_t len, struct nbd_opt_meta *out);
void nbd_meta_iter_init(struct nbd_meta_iter *it, const struct nbd_opt_meta *meta);
/* 1 and a query, or 0 at the end. Queries were validated by nbd_parse_opt_meta. */
int nbd_meta_iter_next(struct nbd_meta_iter *it, const char **query, uint32_t *length);
/* Does `query` select base:allocation? ("base:" or "base:allocation") */
bool nbd_meta_query_selects_base_allocation(const char *query, uint32_t length);
/* Is `query` well formed: a namespace, a colon, printable? */
bool nbd_meta_query_valid(const char *query, uint32_t length);

/* ---- Transmission (proto/request.c). ---- */
size_t nbd_request_header_size(bool extended);
/*
 * Decode one request header. Returns 0, -EAGAIN if fewer than the header's
 * bytes are available, or -EBADMSG if the magic is not the one negotiated.
 */
int nbd_decode_request(const void *buf, size_t len, bool extended, struct nbd_request *out);
/* Client side: encode a request header; returns 28 or 32. */
size_t nbd_encode_request(void *buf, bool extended, const struct nbd_request *req);

#define NBD_CHECK_DISCONNECT (-1)
/*
 * Validate a decoded request against the session. Returns NBD_SUCCESS, an
 * NBD error code (the payload, if any, must still be consumed), or
 * NBD_CHECK_DISCONNECT when the protocol says to hard-disconnect (an
 * extended payload larger than the maximum payload, which must not be read).
 */
int nbd_check_request(const struct nbd_request *req, const struct nbd_session *s);

size_t nbd_encode_simple_reply(void *buf, uint64_t cookie, uint32_t error);
/*
 * A structured (20 bytes) or extended (32 bytes) chunk header. `offset` is
 * the request's offset (extended only).
 */
size_t nbd_encode_chunk_header(void *buf, bool extended, uint16_t flags, uint16_t type,
			       uint64_t cookie, uint64_t offset, uint64_t payload_length);
size_t nbd_encode_offset_data_prefix(void *buf, uint64_t offset);
size_t nbd_encode_offset_hole(void *buf, uint64_t offset, uint32_t length);
/* Error chunk payload: error, message length, message (truncated to NBD_MAX_STRING). */
size_t nbd_encode_error_chunk(void *buf, size_t cap, uint32_t error, const char *message);
size_t nbd_error_chunk_size(const char *message);
/*
 * Block status payload for one context: compact (32-bit descriptors) or
 * extended (64-bit, with a descriptor count). In compact form extents longer
 * than 32 bits must have been split or capped by the caller.
 */
size_t nbd_block_status_size(bool extended, size_t count);
size_t nbd_encode_block_status(void *buf, bool extended, uint32_t context_id,
			       const struct nbd_extent *extents, size_t count);
/* Client side: decode any reply header; -EAGAIN if short, -EBADMSG on bad magic. */
int nbd_decode_reply(const void *buf, size_t len, bool extended, struct nbd_reply *out);

/* ---- Errors and names (proto/names.c). ---- */
/* The one place that turns a (positive) errno into an NBD error code. */
uint32_t nbd_error_from_errno(int errnum);
const char *nbd_cmd_name(uint16_t type);
const char *nbd_opt_name(uint32_t option);
const char *nbd_rep_name(uint32_t type);
const char *nbd_err_name(uint32_t error);

#endif
