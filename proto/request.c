/*
 * proto/request.c: the transmission phase, requests in and replies out.
 *
 * A request header comes in two shapes, chosen once at negotiation time:
 *
 *   compact  (28): magic | flags (16) | type (16) | cookie | offset | len (32)
 *   extended (32): magic | flags (16) | type (16) | cookie | offset | len (64)
 *
 * Both decode into one struct nbd_request, so everything after the decoder
 * is mode-agnostic except nbd_check_request, which needs the mode to decide
 * what the length field means and whether a payload follows.
 *
 * Replies come in three shapes: simple (16 bytes, no structured replies),
 * structured chunks (20 bytes, 32-bit payload length) and extended chunks
 * (32 bytes, echoing the request offset, 64-bit payload length). The chunk
 * payload encoders (offset data, hole, error, block status) are shared by
 * the structured and extended forms except for block status, whose
 * descriptors widen to 64 bits under extended headers.
 */
#include <assert.h>
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "proto/nbd.h"

#define KNOWN_CMD_FLAGS                                                                            \
	(NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_DF | NBD_CMD_FLAG_REQ_ONE |        \
	 NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_PAYLOAD_LEN)

size_t nbd_request_header_size(bool extended)
{
	return extended ? NBD_EXTENDED_REQUEST_SIZE : NBD_REQUEST_SIZE;
}

int nbd_decode_request(const void *buf, size_t len, bool extended, struct nbd_request *out)
{
	if (extended) {
		struct nbd_wire_extended_request w;

		if (len < sizeof w)
			return -EAGAIN;
		memcpy(&w, buf, sizeof w);
		if (be32toh(w.magic) != NBD_EXTENDED_REQUEST_MAGIC)
			return -EBADMSG;
		out->flags = be16toh(w.flags);
		out->type = be16toh(w.type);
		out->cookie = be64toh(w.cookie);
		out->offset = be64toh(w.offset);
		out->length = be64toh(w.length);
		/*
		 * The spec asks clients to flag WRITE payloads with PAYLOAD_LEN,
		 * but qemu 10's client does not; a WRITE always carries its data,
		 * so it is read as payload either way (as qemu-nbd does).
		 */
		out->payload_length =
		    ((out->flags & NBD_CMD_FLAG_PAYLOAD_LEN) || out->type == NBD_CMD_WRITE)
			? out->length
			: 0;
	} else {
		struct nbd_wire_request w;

		if (len < sizeof w)
			return -EAGAIN;
		memcpy(&w, buf, sizeof w);
		if (be32toh(w.magic) != NBD_REQUEST_MAGIC)
			return -EBADMSG;
		out->flags = be16toh(w.flags);
		out->type = be16toh(w.type);
		out->cookie = be64toh(w.cookie);
		out->offset = be64toh(w.offset);
		out->length = be32toh(w.length);
		out->payload_length = out->type == NBD_CMD_WRITE ? out->length : 0;
	}
	return 0;
}

size_t nbd_encode_request(void *buf, bool extended, const struct nbd_request *req)
{
	if (extended) {
		struct nbd_wire_extended_request w = {
		    .magic = htobe32(NBD_EXTENDED_REQUEST_MAGIC),
		    .flags = htobe16(req->flags),
		    .type = htobe16(req->type),
		    .cookie = htobe64(req->cookie),
		    .offset = htobe64(req->offset),
		    .length = htobe64(req->length),
		};

		memcpy(buf, &w, sizeof w);
		return sizeof w;
	} else {
		struct nbd_wire_request w = {
		    .magic = htobe32(NBD_REQUEST_MAGIC),
		    .flags = htobe16(req->flags),
		    .type = htobe16(req->type),
		    .cookie = htobe64(req->cookie),
		    .offset = htobe64(req->offset),
		    .length = htobe32((uint32_t)req->length),
		};

		assert(req->length <= UINT32_MAX);
		memcpy(buf, &w, sizeof w);
		return sizeof w;
	}
}

/* Step 4 of nbd_check_request: is every flag allowed on this command? */
static int check_flags(const struct nbd_request *req, const struct nbd_session *s)
{
	uint16_t f = req->flags, t = req->type, e = s->eflags;

	if (f & ~KNOWN_CMD_FLAGS)
		return NBD_EINVAL;
	if ((f & NBD_CMD_FLAG_FUA) && !(e & NBD_FLAG_SEND_FUA))
		return NBD_EINVAL;
	if ((f & NBD_CMD_FLAG_NO_HOLE) && t != NBD_CMD_WRITE_ZEROES)
		return NBD_EINVAL;
	if ((f & NBD_CMD_FLAG_DF) && (t != NBD_CMD_READ || !(e & NBD_FLAG_SEND_DF)))
		return NBD_EINVAL;
	if ((f & NBD_CMD_FLAG_REQ_ONE) && t != NBD_CMD_BLOCK_STATUS)
		return NBD_EINVAL;
	if ((f & NBD_CMD_FLAG_FAST_ZERO) &&
	    (t != NBD_CMD_WRITE_ZEROES || !(e & NBD_FLAG_SEND_FAST_ZERO)))
		return NBD_EINVAL;
	if (!s->extended) {
		if (f & NBD_CMD_FLAG_PAYLOAD_LEN)
			return NBD_EINVAL;
	} else if (t != NBD_CMD_WRITE && (f & NBD_CMD_FLAG_PAYLOAD_LEN)) {
		return NBD_EINVAL;
	}
	return NBD_SUCCESS;
}

/* Step 5: did we advertise this command? */
static bool command_available(uint16_t type, const struct nbd_session *s)
{
	switch (type) {
	case NBD_CMD_TRIM:
		return s->eflags & NBD_FLAG_SEND_TRIM;
	case NBD_CMD_WRITE_ZEROES:
		return s->eflags & NBD_FLAG_SEND_WRITE_ZEROES;
	case NBD_CMD_FLUSH:
		return s->eflags & NBD_FLAG_SEND_FLUSH;
	case NBD_CMD_BLOCK_STATUS:
		return s->structured && s->block_status;
	case NBD_CMD_RESIZE:
		return s->eflags & NBD_FLAG_SEND_RESIZE;
	default:
		return true;
	}
}

/*
 * The order matters and follows what a client can observe. First the two
 * payload-size checks, because they decide whether the payload can be read
 * at all: an oversized extended payload is a hard disconnect (we must not
 * read it), an oversized compact WRITE is an error after the caller
 * discards the data. Then syntax (type, flags), then what the export
 * offers, then permissions, then the range. Ranges are compared without
 * ever computing offset + length, which could wrap.
 */
int nbd_check_request(const struct nbd_request *req, const struct nbd_session *s)
{
	int err;

	if (s->extended && req->payload_length > s->max_payload)
		return NBD_CHECK_DISCONNECT;
	if (!s->extended && req->type == NBD_CMD_WRITE && req->length > s->max_payload)
		return NBD_EINVAL;

	if (req->type == NBD_CMD_DISC)
		return NBD_SUCCESS;
	if (req->type > NBD_CMD_RESIZE)
		return NBD_EINVAL;

	err = check_flags(req, s);
	if (err != NBD_SUCCESS)
		return err;

	/*
	 * A read-only export advertises neither TRIM nor WRITE_ZEROES, yet the
	 * spec asks for EPERM on any write to it: that answer comes first.
	 */
	if ((s->eflags & NBD_FLAG_READ_ONLY) &&
	    (req->type == NBD_CMD_WRITE || req->type == NBD_CMD_TRIM ||
	     req->type == NBD_CMD_WRITE_ZEROES))
		return NBD_EPERM;

	if (!command_available(req->type, s))
		return NBD_EINVAL;

	if (req->type == NBD_CMD_FLUSH)
		return (req->offset != 0 || req->length != 0) ? NBD_EINVAL : NBD_SUCCESS;
	/* RESIZE: offset is the new size, which the server judges (not a range). */
	if (req->type == NBD_CMD_RESIZE)
		return req->length != 0 ? NBD_EINVAL : NBD_SUCCESS;

	if (req->type == NBD_CMD_READ && req->length > s->max_payload)
		return s->structured ? NBD_EOVERFLOW : NBD_EINVAL;

	if (req->offset > s->size || req->length > s->size - req->offset) {
		if (req->type == NBD_CMD_WRITE || req->type == NBD_CMD_WRITE_ZEROES)
			return NBD_ENOSPC;
		return NBD_EINVAL;
	}

	if (s->min_block > 1 &&
	    (req->offset % s->min_block != 0 || req->length % s->min_block != 0))
		return NBD_EINVAL;
	if (req->type == NBD_CMD_BLOCK_STATUS && req->length == 0)
		return NBD_EINVAL;
	return NBD_SUCCESS;
}

size_t nbd_encode_simple_reply(void *buf, uint64_t cookie, uint32_t error)
{
	struct nbd_wire_simple_reply w = {
	    .magic = htobe32(NBD_SIMPLE_REPLY_MAGIC),
	    .error = htobe32(error),
	    .cookie = htobe64(cookie),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

size_t nbd_encode_chunk_header(void *buf, bool extended, uint16_t flags, uint16_t type,
			       uint64_t cookie, uint64_t offset, uint64_t payload_length)
{
	if (extended) {
		struct nbd_wire_extended_reply w = {
		    .magic = htobe32(NBD_EXTENDED_REPLY_MAGIC),
		    .flags = htobe16(flags),
		    .type = htobe16(type),
		    .cookie = htobe64(cookie),
		    .offset = htobe64(offset),
		    .length = htobe64(payload_length),
		};

		memcpy(buf, &w, sizeof w);
		return sizeof w;
	} else {
		struct nbd_wire_structured_reply w = {
		    .magic = htobe32(NBD_STRUCTURED_REPLY_MAGIC),
		    .flags = htobe16(flags),
		    .type = htobe16(type),
		    .cookie = htobe64(cookie),
		    .length = htobe32((uint32_t)payload_length),
		};

		assert(payload_length <= UINT32_MAX);
		memcpy(buf, &w, sizeof w);
		return sizeof w;
	}
}

size_t nbd_encode_offset_data_prefix(void *buf, uint64_t offset)
{
	nbd_put64(buf, offset);
	return NBD_OFFSET_DATA_PREFIX_SIZE;
}

size_t nbd_encode_offset_hole(void *buf, uint64_t offset, uint32_t length)
{
	struct nbd_wire_offset_hole w = {
	    .offset = htobe64(offset),
	    .length = htobe32(length),
	};

	memcpy(buf, &w, sizeof w);
	return sizeof w;
}

static size_t error_message_length(const char *message)
{
	return message ? strnlen(message, NBD_MAX_STRING) : 0;
}

size_t nbd_encode_error_chunk(void *buf, size_t cap, uint32_t error, const char *message)
{
	size_t n = error_message_length(message);
	struct nbd_wire_error_chunk w;

	assert(cap >= sizeof w);
	if (n > cap - sizeof w)
		n = cap - sizeof w;
	w.error = htobe32(error);
	w.message_length = htobe16((uint16_t)n);
	memcpy(buf, &w, sizeof w);
	if (n > 0)
		memcpy((uint8_t *)buf + sizeof w, message, n);
	return sizeof w + n;
}

size_t nbd_error_chunk_size(const char *message)
{
	return NBD_ERROR_CHUNK_FIXED_SIZE + error_message_length(message);
}

/*
 *   compact:  context id (32) | count x ( length (32) | flags (32) )
 *   extended: context id (32) | count (32) | count x ( length (64) | flags (64) )
 */
size_t nbd_block_status_size(bool extended, size_t count)
{
	if (extended)
		return NBD_BLOCK_STATUS_EXT_PREFIX_SIZE + count * NBD_BLOCK_DESC_EXT_SIZE;
	return NBD_BLOCK_STATUS_PREFIX_SIZE + count * NBD_BLOCK_DESC_SIZE;
}

size_t nbd_encode_block_status(void *buf, bool extended, uint32_t context_id,
			       const struct nbd_extent *extents, size_t count)
{
	uint8_t *p = buf;
	size_t i;

	nbd_put32(p, context_id);
	p += 4;
	if (extended) {
		assert(count <= UINT32_MAX);
		nbd_put32(p, (uint32_t)count);
		p += 4;
		for (i = 0; i < count; i++) {
			struct nbd_wire_block_desc_ext d = {
			    .length = htobe64(extents[i].length),
			    .flags = htobe64(extents[i].flags),
			};

			memcpy(p, &d, sizeof d);
			p += sizeof d;
		}
	} else {
		for (i = 0; i < count; i++) {
			struct nbd_wire_block_desc d = {
			    .length = htobe32((uint32_t)extents[i].length),
			    .flags = htobe32((uint32_t)extents[i].flags),
			};

			assert(extents[i].length <= UINT32_MAX);
			assert(extents[i].flags <= UINT32_MAX);
			memcpy(p, &d, sizeof d);
			p += sizeof d;
		}
	}
	assert((size_t)(p - (uint8_t *)buf) == nbd_block_status_size(extended, count));
	return (size_t)(p - (uint8_t *)buf);
}

/*
 * The client reads the 32-bit magic first; it says how long the header is.
 * Simple and structured replies only exist without extended headers, and
 * extended replies only with them: anything else is a protocol violation.
 */
int nbd_decode_reply(const void *buf, size_t len, bool extended, struct nbd_reply *out)
{
	uint32_t magic;

	if (len < 4)
		return -EAGAIN;
	magic = nbd_get32(buf);
	switch (magic) {
	case NBD_SIMPLE_REPLY_MAGIC: {
		struct nbd_wire_simple_reply w;

		if (extended)
			return -EBADMSG;
		if (len < sizeof w)
			return -EAGAIN;
		memcpy(&w, buf, sizeof w);
		out->magic = magic;
		out->flags = NBD_REPLY_FLAG_DONE;
		out->type = NBD_REPLY_TYPE_NONE;
		out->error = be32toh(w.error);
		out->cookie = be64toh(w.cookie);
		out->offset = 0;
		out->length = 0;
		return 0;
	}
	case NBD_STRUCTURED_REPLY_MAGIC: {
		struct nbd_wire_structured_reply w;

		if (extended)
			return -EBADMSG;
		if (len < sizeof w)
			return -EAGAIN;
		memcpy(&w, buf, sizeof w);
		out->magic = magic;
		out->flags = be16toh(w.flags);
		out->type = be16toh(w.type);
		out->error = 0;
		out->cookie = be64toh(w.cookie);
		out->offset = 0;
		out->length = be32toh(w.length);
		return 0;
	}
	case NBD_EXTENDED_REPLY_MAGIC: {
		struct nbd_wire_extended_reply w;

		if (!extended)
			return -EBADMSG;
		if (len < sizeof w)
			return -EAGAIN;
		memcpy(&w, buf, sizeof w);
		out->magic = magic;
		out->flags = be16toh(w.flags);
		out->type = be16toh(w.type);
		out->error = 0;
		out->cookie = be64toh(w.cookie);
		out->offset = be64toh(w.offset);
		out->length = be64toh(w.length);
		return 0;
	}
	default:
		return -EBADMSG;
	}
}
