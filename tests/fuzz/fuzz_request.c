/*
 * tests/fuzz/fuzz_request.c: the transmission phase as a hostile peer sends
 * it.
 *
 * The first 16 bytes of the input describe a negotiated session (mode,
 * transmission flags, export size, maximum payload, minimum block size); the
 * rest is a request header, decoded in both compact and extended modes and
 * validated against that session, then a reply header, decoded as a client
 * would. Whatever is accepted is checked for the promises callers rely on:
 * a request nbd_check_request lets through lies entirely inside the export,
 * and every decoded header re-encodes to the bytes it came from.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/nbd.h"
#include "tests/fuzz/fuzz.h"

#define SESSION_BYTES 16

static void session_from_bytes(const uint8_t *p, struct nbd_session *s)
{
	s->structured = p[0] & 1;
	s->extended = p[0] & 2;
	s->block_status = p[0] & 4;
	s->eflags = nbd_get16(p + 1);
	/* Mostly small exports, so that in-range requests are common. */
	s->size = (p[0] & 8) ? nbd_get64(p + 3) & NBD_MAX_OFFSET : nbd_get32(p + 3);
	s->max_payload = nbd_get32(p + 11) & 0x03ffffffu;
	s->min_block = (p[15] & 0x80) ? 1u << (p[15] & 0x1f) : p[15];
}

static bool valid_check_result(int r)
{
	switch (r) {
	case NBD_SUCCESS:
	case NBD_EPERM:
	case NBD_EINVAL:
	case NBD_ENOSPC:
	case NBD_EOVERFLOW:
	case NBD_CHECK_DISCONNECT:
		return true;
	default:
		return false;
	}
}

static void fuzz_one_request(const uint8_t *buf, size_t len, bool extended, struct nbd_session s)
{
	uint8_t again[NBD_EXTENDED_REQUEST_SIZE];
	struct nbd_request req;
	size_t hs = nbd_request_header_size(extended);
	int r;

	s.extended = extended;
	if (extended)
		s.structured = true;
	r = nbd_decode_request(buf, len, extended, &req);
	if (r != 0) {
		CHECK(r == -EAGAIN || r == -EBADMSG);
		CHECK((r == -EAGAIN) == (len < hs));
		return;
	}
	CHECK(nbd_encode_request(again, extended, &req) == hs);
	CHECK(memcmp(again, buf, hs) == 0);
	if (extended)
		CHECK(req.payload_length ==
		      ((req.flags & NBD_CMD_FLAG_PAYLOAD_LEN) || req.type == NBD_CMD_WRITE
			   ? req.length
			   : 0));
	else
		CHECK(req.payload_length == (req.type == NBD_CMD_WRITE ? req.length : 0));
	(void)nbd_cmd_name(req.type);

	r = nbd_check_request(&req, &s);
	CHECK(valid_check_result(r));
	(void)nbd_err_name((uint32_t)r);
	if (r == NBD_CHECK_DISCONNECT)
		CHECK(extended && req.payload_length > s.max_payload);
	if (r != NBD_SUCCESS || req.type == NBD_CMD_DISC)
		return;
	CHECK(req.type <= NBD_CMD_RESIZE);
	CHECK(req.payload_length <= s.max_payload);
	if (req.type == NBD_CMD_FLUSH) {
		CHECK(req.offset == 0 && req.length == 0);
		return;
	}
	if (req.type == NBD_CMD_RESIZE) {
		/* The resize extension: only when advertised; offset is the new
		 * size, not a range. */
		CHECK((s.eflags & NBD_FLAG_SEND_RESIZE) && req.length == 0);
		return;
	}
	CHECK(req.offset <= s.size && req.length <= s.size - req.offset);
	if (req.type == NBD_CMD_READ)
		CHECK(req.length <= s.max_payload);
	if (s.min_block > 1)
		CHECK(req.offset % s.min_block == 0 && req.length % s.min_block == 0);
	if (s.eflags & NBD_FLAG_READ_ONLY)
		CHECK(req.type != NBD_CMD_WRITE && req.type != NBD_CMD_TRIM &&
		      req.type != NBD_CMD_WRITE_ZEROES);
}

static void fuzz_one_reply(const uint8_t *buf, size_t len, bool extended)
{
	uint8_t again[NBD_CHUNK_HEADER_MAX];
	struct nbd_reply rep;
	size_t n;
	int r;

	r = nbd_decode_reply(buf, len, extended, &rep);
	if (r != 0) {
		CHECK(r == -EAGAIN || r == -EBADMSG);
		return;
	}
	switch (rep.magic) {
	case NBD_SIMPLE_REPLY_MAGIC:
		CHECK(!extended && rep.type == NBD_REPLY_TYPE_NONE && rep.length == 0);
		n = nbd_encode_simple_reply(again, rep.cookie, rep.error);
		break;
	case NBD_STRUCTURED_REPLY_MAGIC:
		CHECK(!extended && rep.length <= UINT32_MAX);
		n = nbd_encode_chunk_header(again, false, rep.flags, rep.type, rep.cookie, 0,
					    rep.length);
		break;
	default:
		CHECK(extended && rep.magic == NBD_EXTENDED_REPLY_MAGIC);
		n = nbd_encode_chunk_header(again, true, rep.flags, rep.type, rep.cookie,
					    rep.offset, rep.length);
		break;
	}
	CHECK(n <= len);
	CHECK(memcmp(again, buf, n) == 0);
}

/* The reply payload encoders, with arguments taken from the input. */
static void fuzz_encoders(const uint8_t *p, size_t len)
{
	static uint8_t out[NBD_ERROR_CHUNK_FIXED_SIZE + NBD_MAX_STRING];
	struct nbd_extent extents[4];
	char message[64];
	size_t n, count, cap, i;
	bool extended;

	if (len < 8)
		return;
	extended = p[7] & 1;
	count = p[0] % 5;
	for (i = 0; i < count; i++) {
		extents[i].length = nbd_get32(p + 1 + (i % 2) * 3);
		extents[i].flags = p[i + 1] & 3;
		if (extended)
			extents[i].length |= (uint64_t)p[6] << 40;
	}
	n = nbd_encode_block_status(out, extended, nbd_get32(p + 2), extents, count);
	CHECK(n == nbd_block_status_size(extended, count));
	CHECK(nbd_get32(out) == nbd_get32(p + 2));
	for (i = 0; i < count; i++)
		CHECK(extended ? nbd_get64(out + 8 + 16 * i) == extents[i].length
			       : nbd_get32(out + 4 + 8 * i) == extents[i].length);

	n = len - 8 < sizeof message - 1 ? len - 8 : sizeof message - 1;
	memcpy(message, p + 8, n);
	message[n] = '\0';
	cap = NBD_ERROR_CHUNK_FIXED_SIZE + p[1] % 32;
	n = nbd_encode_error_chunk(out, cap, nbd_error_from_errno((int8_t)p[2]), message);
	CHECK(n <= cap && n <= nbd_error_chunk_size(message));
	CHECK(nbd_get16(out + 4) == n - NBD_ERROR_CHUNK_FIXED_SIZE);
	CHECK(memcmp(out + 6, message, n - NBD_ERROR_CHUNK_FIXED_SIZE) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct nbd_session s;
	uint8_t *rest;
	size_t len;

	if (size < SESSION_BYTES)
		return 0;
	session_from_bytes(data, &s);
	len = size - SESSION_BYTES;
	/* An exact-size heap copy, so that ASan sees any overread. */
	rest = malloc(len ? len : 1);
	if (!rest)
		return 0;
	memcpy(rest, data + SESSION_BYTES, len);

	fuzz_one_request(rest, len, false, s);
	fuzz_one_request(rest, len, true, s);
	fuzz_one_reply(rest, len, false);
	fuzz_one_reply(rest, len, true);
	fuzz_encoders(rest, len);
	free(rest);
	return 0;
}
