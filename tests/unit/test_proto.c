/*
 * tests/unit/test_proto.c: the NBD wire codec against hand-written bytes.
 *
 * Every encoder is checked byte by byte against what the spec says should be
 * on the wire, then fed back through its decoder. Decoders are checked at
 * every short length (-EAGAIN), with every magic byte corrupted (-EBADMSG)
 * and, for the option payloads a hostile client controls, against a table
 * of malformed inputs. nbd_check_request is driven by a table with one row
 * per branch, each row going through encode -> decode -> check the way the
 * daemon sees a request.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "proto/nbd.h"

#define B16(x) (uint8_t)((x) >> 8), (uint8_t)(x)
#define B32(x) B16((uint32_t)(x) >> 16), B16((uint32_t)(x)&0xffff)
#define B64(x) B32((uint64_t)(x) >> 32), B32((uint64_t)(x)&0xffffffff)

#define BYTES(...) (const uint8_t[]){__VA_ARGS__}, sizeof((const uint8_t[]){__VA_ARGS__})

/* Compare `got` with the bytes listed, in order. */
#define ASSERT_BYTES(got, ...)                                                                     \
	do {                                                                                       \
		static const uint8_t want_[] = {__VA_ARGS__};                                      \
		assert_memory_equal((got), want_, sizeof want_);                                   \
	} while (0)

#define U63 0x7fffffffffffffffULL

/* ---- Byte order. ---- */

static void test_bytes_big_endian_unaligned(void **state)
{
	uint8_t buf[16];
	size_t off;

	(void)state;
	for (off = 0; off < 8; off++) {
		memset(buf, 0xee, sizeof buf);
		nbd_put16(buf + off, 0x0102);
		ASSERT_BYTES(buf + off, 0x01, 0x02);
		assert_int_equal(nbd_get16(buf + off), 0x0102);
		nbd_put32(buf + off, 0x01020304);
		ASSERT_BYTES(buf + off, 0x01, 0x02, 0x03, 0x04);
		assert_int_equal(nbd_get32(buf + off), 0x01020304);
		nbd_put64(buf + off, 0x0102030405060708ULL);
		ASSERT_BYTES(buf + off, 1, 2, 3, 4, 5, 6, 7, 8);
		assert_true(nbd_get64(buf + off) == 0x0102030405060708ULL);
		if (off > 0)
			assert_int_equal(buf[off - 1], 0xee);
		assert_int_equal(buf[off + 8], 0xee);
	}
	nbd_put64(buf, UINT64_MAX);
	assert_true(nbd_get64(buf) == UINT64_MAX);
	nbd_put64(buf, U63);
	assert_int_equal(buf[0], 0x7f);
	assert_true(nbd_get64(buf) == U63);
}

/*
 * Run a decoder at every length shorter than `need` and expect -EAGAIN: the
 * caller has not received the whole item yet.
 */
#define ASSERT_EAGAIN_BELOW(need, call_with_len)                                                   \
	do {                                                                                       \
		size_t len_;                                                                       \
		for (len_ = 0; len_ < (need); len_++) {                                            \
			size_t len = len_;                                                         \
			assert_int_equal((call_with_len), -EAGAIN);                                \
		}                                                                                  \
	} while (0)

/* ---- Handshake. ---- */

static void test_greeting(void **state)
{
	uint8_t buf[NBD_GREETING_SIZE + 1];
	uint16_t flags = 0;
	size_t i;

	(void)state;
	assert_int_equal(nbd_encode_greeting(buf, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES),
			 NBD_GREETING_SIZE);
	ASSERT_BYTES(buf, 'N', 'B', 'D', 'M', 'A', 'G', 'I', 'C', 'I', 'H', 'A', 'V', 'E', 'O', 'P',
		     'T', 0x00, 0x03);
	assert_int_equal(nbd_decode_greeting(buf, sizeof buf, &flags), 0);
	assert_int_equal(flags, 3);
	ASSERT_EAGAIN_BELOW(NBD_GREETING_SIZE, nbd_decode_greeting(buf, len, &flags));
	for (i = 0; i < 16; i++) {
		buf[i] ^= 0x20;
		assert_int_equal(nbd_decode_greeting(buf, NBD_GREETING_SIZE, &flags), -EBADMSG);
		buf[i] ^= 0x20;
	}
	assert_int_equal(nbd_encode_greeting(buf, 0xffff), NBD_GREETING_SIZE);
	assert_int_equal(nbd_decode_greeting(buf, NBD_GREETING_SIZE, &flags), 0);
	assert_int_equal(flags, 0xffff);
}

static void test_client_flags(void **state)
{
	uint8_t buf[4];
	uint32_t flags = 0;

	(void)state;
	assert_int_equal(
	    nbd_encode_client_flags(buf, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES),
	    NBD_CLIENT_FLAGS_SIZE);
	ASSERT_BYTES(buf, 0, 0, 0, 3);
	assert_int_equal(nbd_decode_client_flags(buf, sizeof buf, &flags), 0);
	assert_int_equal(flags, 3);
	ASSERT_EAGAIN_BELOW(NBD_CLIENT_FLAGS_SIZE, nbd_decode_client_flags(buf, len, &flags));
	nbd_encode_client_flags(buf, 0x80000001u);
	assert_int_equal(nbd_decode_client_flags(buf, sizeof buf, &flags), 0);
	assert_int_equal(flags, 0x80000001u);
}

static void test_option(void **state)
{
	uint8_t buf[NBD_OPTION_HEADER_SIZE];
	struct nbd_option opt;
	size_t i;

	(void)state;
	assert_int_equal(nbd_encode_option(buf, NBD_OPT_GO, 0x01020304), NBD_OPTION_HEADER_SIZE);
	ASSERT_BYTES(buf, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', B32(NBD_OPT_GO), 0x01, 0x02, 0x03,
		     0x04);
	memset(&opt, 0, sizeof opt);
	assert_int_equal(nbd_decode_option(buf, sizeof buf, &opt), 0);
	assert_int_equal(opt.option, NBD_OPT_GO);
	assert_int_equal(opt.length, 0x01020304);
	ASSERT_EAGAIN_BELOW(NBD_OPTION_HEADER_SIZE, nbd_decode_option(buf, len, &opt));
	for (i = 0; i < 8; i++) {
		buf[i] ^= 0x01;
		assert_int_equal(nbd_decode_option(buf, sizeof buf, &opt), -EBADMSG);
		buf[i] ^= 0x01;
	}
	nbd_encode_option(buf, UINT32_MAX, UINT32_MAX);
	assert_int_equal(nbd_decode_option(buf, sizeof buf, &opt), 0);
	assert_int_equal(opt.option, UINT32_MAX);
	assert_int_equal(opt.length, UINT32_MAX);
}

static void test_option_reply(void **state)
{
	uint8_t buf[NBD_OPTION_REPLY_HEADER_SIZE];
	struct nbd_option_reply rep;
	size_t i;

	(void)state;
	assert_int_equal(nbd_encode_option_reply(buf, NBD_OPT_LIST, NBD_REP_ERR_UNSUP, 7),
			 NBD_OPTION_REPLY_HEADER_SIZE);
	ASSERT_BYTES(buf, 0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 3, 0x80, 0, 0, 1,
		     0, 0, 0, 7);
	memset(&rep, 0, sizeof rep);
	assert_int_equal(nbd_decode_option_reply(buf, sizeof buf, &rep), 0);
	assert_int_equal(rep.option, NBD_OPT_LIST);
	assert_int_equal(rep.type, NBD_REP_ERR_UNSUP);
	assert_int_equal(rep.length, 7);
	ASSERT_EAGAIN_BELOW(NBD_OPTION_REPLY_HEADER_SIZE, nbd_decode_option_reply(buf, len, &rep));
	for (i = 0; i < 8; i++) {
		buf[i] ^= 0x80;
		assert_int_equal(nbd_decode_option_reply(buf, sizeof buf, &rep), -EBADMSG);
		buf[i] ^= 0x80;
	}
	/* An option header is not an option reply. */
	nbd_encode_option(buf, NBD_OPT_GO, 0);
	assert_int_equal(nbd_decode_option_reply(buf, sizeof buf, &rep), -EBADMSG);
}

static void test_export_name_reply(void **state)
{
	uint8_t buf[NBD_EXPORT_NAME_REPLY_SIZE + 1];
	size_t i;

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_export_name_reply(buf, U63, 0x0123, false),
			 NBD_EXPORT_NAME_REPLY_SIZE);
	ASSERT_BYTES(buf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x23);
	for (i = 10; i < NBD_EXPORT_NAME_REPLY_SIZE; i++)
		assert_int_equal(buf[i], 0);
	assert_int_equal(buf[NBD_EXPORT_NAME_REPLY_SIZE], 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_export_name_reply(buf, 1u << 20, NBD_FLAG_HAS_FLAGS, true),
			 NBD_EXPORT_NAME_REPLY_SHORT_SIZE);
	ASSERT_BYTES(buf, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 1, 0xaa);
}

static void test_info_items(void **state)
{
	uint8_t buf[32];

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_info_export(buf, U63, 0xfedc), NBD_INFO_EXPORT_SIZE);
	ASSERT_BYTES(buf, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xdc, 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_info_block_size(buf, 1, 4096, NBD_DEFAULT_MAX_PAYLOAD),
			 NBD_INFO_BLOCK_SIZE_SIZE);
	ASSERT_BYTES(buf, 0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0, 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_info_type(buf, NBD_INFO_DESCRIPTION), 2);
	ASSERT_BYTES(buf, 0, 2, 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_rep_server_prefix(buf, 0x00010203), 4);
	ASSERT_BYTES(buf, 0, 1, 2, 3, 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_meta_context_prefix(buf, 0xdeadbeef), 4);
	ASSERT_BYTES(buf, 0xde, 0xad, 0xbe, 0xef, 0xaa);
}

/* ---- NBD_OPT_GO / NBD_OPT_INFO payloads. ---- */

static void test_opt_go_valid(void **state)
{
	static const uint8_t data[] = {
	    B32(4),	'd', 'i', 's', 'k', B16(3), B16(NBD_INFO_NAME), B16(NBD_INFO_BLOCK_SIZE),
	    B16(0xabcd)};
	struct nbd_opt_go go;

	(void)state;
	assert_int_equal(nbd_parse_opt_go(data, sizeof data, &go), 0);
	assert_int_equal(go.name_length, 4);
	assert_memory_equal(go.name, "disk", 4);
	assert_ptr_equal(go.name, (const char *)data + 4);
	assert_int_equal(go.info_count, 3);
	assert_int_equal(nbd_opt_go_info(&go, 0), NBD_INFO_NAME);
	assert_int_equal(nbd_opt_go_info(&go, 1), NBD_INFO_BLOCK_SIZE);
	assert_int_equal(nbd_opt_go_info(&go, 2), 0xabcd);

	/* The default export, no information requests: the smallest payload. */
	assert_int_equal(nbd_parse_opt_go(BYTES(B32(0), B16(0)), &go), 0);
	assert_int_equal(go.name_length, 0);
	assert_int_equal(go.info_count, 0);
}

static void test_opt_go_name_limits(void **state)
{
	static uint8_t data[4 + NBD_MAX_STRING + 1 + 2];
	struct nbd_opt_go go;

	(void)state;
	memset(data, 'n', sizeof data);
	nbd_put32(data, NBD_MAX_STRING);
	nbd_put16(data + 4 + NBD_MAX_STRING, 0);
	assert_int_equal(nbd_parse_opt_go(data, 4 + NBD_MAX_STRING + 2, &go), 0);
	assert_int_equal(go.name_length, NBD_MAX_STRING);

	nbd_put32(data, NBD_MAX_STRING + 1);
	nbd_put16(data + 4 + NBD_MAX_STRING + 1, 0);
	assert_int_equal(nbd_parse_opt_go(data, sizeof data, &go), -EINVAL);
}

struct malformed {
	const char *what;
	const uint8_t *data;
	size_t size;  /* bytes in data */
	uint32_t len; /* bytes handed to the parser; 0 means size */
};

static uint32_t malformed_len(const struct malformed *m)
{
	return m->len ? m->len : (uint32_t)m->size;
}

static void test_opt_go_malformed(void **state)
{
	const struct malformed rows[] = {
	    {"1 byte", BYTES(0), 0},
	    {"5 bytes", BYTES(0, 0, 0, 0, 0), 0},
	    {"name length, no count", BYTES(B32(0), 0), 0},
	    {"name overruns by one", BYTES(B32(1), B16(0)), 0},
	    {"name overruns, count eats name", BYTES(B32(2), 'a', B16(0)), 0},
	    {"name length 2^32-1", BYTES(B32(0xffffffff), B16(0)), 0},
	    {"name length 2^32-4 (wraps 4 + n)", BYTES(B32(0xfffffffc), B16(0)), 0},
	    {"count 1, no request", BYTES(B32(0), B16(1)), 0},
	    {"count 1, half a request", BYTES(B32(0), B16(1), 0), 0},
	    {"count 2, one request", BYTES(B32(0), B16(2), B16(3)), 0},
	    {"count 0, trailing byte", BYTES(B32(0), B16(0), 0), 0},
	    {"count 1, trailing byte", BYTES(B32(1), 'x', B16(1), B16(3), 0), 0},
	    {"count 0xffff, one request", BYTES(B32(0), B16(0xffff), B16(3)), 0},
	    {"len shorter than data", BYTES(B32(1), 'x', B16(1), B16(3)), 8},
	};
	struct nbd_opt_go go;
	size_t i;

	(void)state;
	assert_int_equal(nbd_parse_opt_go(NULL, 0, &go), -EINVAL);
	for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
		int r = nbd_parse_opt_go(rows[i].data, malformed_len(&rows[i]), &go);

		if (r != -EINVAL)
			fail_msg("GO row \"%s\": got %d, want -EINVAL", rows[i].what, r);
	}
}

/* ---- NBD_OPT_{LIST,SET}_META_CONTEXT payloads. ---- */

static void test_opt_meta_valid(void **state)
{
	static const uint8_t data[] = {B32(3), 'e', 'x', 'p', B32(3), B32(15), 'b', 'a',
				       's',    'e', ':', 'a', 'l',    'l',     'o', 'c',
				       'a',    't', 'i', 'o', 'n',    B32(7),  'q', 'e',
				       'm',    'u', ':', 'x', 'y',    B32(0)};
	struct nbd_opt_meta meta;
	struct nbd_meta_iter it;
	const char *q;
	uint32_t qlen;

	(void)state;
	assert_int_equal(nbd_parse_opt_meta(data, sizeof data, &meta), 0);
	assert_int_equal(meta.name_length, 3);
	assert_memory_equal(meta.name, "exp", 3);
	assert_int_equal(meta.query_count, 3);
	assert_ptr_equal(meta.queries, data + 11);
	assert_int_equal(meta.queries_length, sizeof data - 11);

	nbd_meta_iter_init(&it, &meta);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 1);
	assert_int_equal(qlen, 15);
	assert_memory_equal(q, "base:allocation", 15);
	assert_true(nbd_meta_query_selects_base_allocation(q, qlen));
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 1);
	assert_int_equal(qlen, 7);
	assert_memory_equal(q, "qemu:xy", 7);
	assert_false(nbd_meta_query_selects_base_allocation(q, qlen));
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 1);
	assert_int_equal(qlen, 0);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 0);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 0);

	/* LIST with no query: "everything". */
	assert_int_equal(nbd_parse_opt_meta(BYTES(B32(0), B32(0)), &meta), 0);
	assert_int_equal(meta.name_length, 0);
	assert_int_equal(meta.query_count, 0);
	assert_int_equal(meta.queries_length, 0);
	nbd_meta_iter_init(&it, &meta);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 0);
}

static void test_opt_meta_string_limits(void **state)
{
	static uint8_t data[8 + NBD_MAX_STRING + 1 + 4 + NBD_MAX_STRING + 1];
	struct nbd_opt_meta meta;
	struct nbd_meta_iter it;
	const char *q;
	uint32_t qlen;

	(void)state;
	memset(data, 'x', sizeof data);

	/* Longest name, one longest query. */
	nbd_put32(data, NBD_MAX_STRING);
	nbd_put32(data + 4 + NBD_MAX_STRING, 1);
	nbd_put32(data + 8 + NBD_MAX_STRING, NBD_MAX_STRING);
	assert_int_equal(nbd_parse_opt_meta(data, 12 + 2 * NBD_MAX_STRING, &meta), 0);
	nbd_meta_iter_init(&it, &meta);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 1);
	assert_int_equal(qlen, NBD_MAX_STRING);
	assert_int_equal(nbd_meta_iter_next(&it, &q, &qlen), 0);

	/* Name one too long. */
	nbd_put32(data, NBD_MAX_STRING + 1);
	nbd_put32(data + 4 + NBD_MAX_STRING + 1, 0);
	assert_int_equal(nbd_parse_opt_meta(data, 8 + NBD_MAX_STRING + 1, &meta), -EINVAL);

	/* Query one too long. */
	nbd_put32(data, 0);
	nbd_put32(data + 4, 1);
	nbd_put32(data + 8, NBD_MAX_STRING + 1);
	assert_int_equal(nbd_parse_opt_meta(data, 12 + NBD_MAX_STRING + 1, &meta), -EINVAL);
}

static void test_opt_meta_malformed(void **state)
{
	const struct malformed rows[] = {
	    {"1 byte", BYTES(0), 0},
	    {"7 bytes", BYTES(0, 0, 0, 0, 0, 0, 0), 0},
	    {"name overruns count", BYTES(B32(1), B32(0)), 0},
	    {"name length 2^32-1", BYTES(B32(0xffffffff), B32(0)), 0},
	    {"name length 2^32-8 (wraps 8 + n)", BYTES(B32(0xfffffff8), B32(0)), 0},
	    {"count 1, no query", BYTES(B32(0), B32(1)), 0},
	    {"count 1, half a length", BYTES(B32(0), B32(1), 0, 0), 0},
	    {"count 1, 3 of 4 length bytes", BYTES(B32(0), B32(1), 0, 0, 0), 0},
	    {"query overruns by one", BYTES(B32(0), B32(1), B32(3), 'a', ':'), 0},
	    {"query length 2^32-1", BYTES(B32(0), B32(1), B32(0xffffffff), 'a', ':'), 0},
	    {"query length 2^32-4 (wraps)", BYTES(B32(0), B32(1), B32(0xfffffffc), 'a', ':'), 0},
	    {"count 0, trailing byte", BYTES(B32(0), B32(0), 0), 0},
	    {"count 1, trailing byte", BYTES(B32(0), B32(1), B32(2), 'a', ':', 0), 0},
	    {"count 1, trailing query", BYTES(B32(0), B32(1), B32(0), B32(0)), 0},
	    {"count 2, one query", BYTES(B32(0), B32(2), B32(2), 'a', ':'), 0},
	    {"count 2^32-1, one query", BYTES(B32(0), B32(0xffffffff), B32(2), 'a', ':'), 0},
	    {"len shorter than data", BYTES(B32(0), B32(1), B32(2), 'a', ':'), 13},
	};
	struct nbd_opt_meta meta;
	size_t i;

	(void)state;
	assert_int_equal(nbd_parse_opt_meta(NULL, 0, &meta), -EINVAL);
	for (i = 0; i < sizeof rows / sizeof rows[0]; i++) {
		int r = nbd_parse_opt_meta(rows[i].data, malformed_len(&rows[i]), &meta);

		if (r != -EINVAL)
			fail_msg("META row \"%s\": got %d, want -EINVAL", rows[i].what, r);
	}
}

static void test_meta_query_valid(void **state)
{
	static const struct {
		const char *query;
		uint32_t length;
		bool valid;
	} rows[] = {
	    {"base:allocation", 15, true},
	    {"base:", 5, true},
	    {"a:", 2, true},
	    {"x:y:z", 5, true},
	    {"qemu:dirty-bitmap:sda", 21, true},
	    {"x: leaf may have spaces", 23, true},
	    {"\xc3\xa9:utf8", 7, true},
	    {"~!@#:x", 6, true},
	    {"", 0, false},
	    {":", 1, false},
	    {"a", 1, false},
	    {":x", 2, false},
	    {"base", 4, false},
	    {"base:allocation", 4, false},
	    {"ba se:x", 7, false},
	    {"ba\tse:x", 7, false},
	    {" base:", 6, false},
	    {"\x7f:x", 3, false},
	    {"b\x7f:", 3, false},
	    {"b\x1f:", 3, false},
	    {"x\0:y", 4, false},
	    {"x:\0", 3, false},
	    {"x:ab\0", 5, false},
	};
	size_t i;

	(void)state;
	for (i = 0; i < sizeof rows / sizeof rows[0]; i++)
		if (nbd_meta_query_valid(rows[i].query, rows[i].length) != rows[i].valid)
			fail_msg("query row %zu (\"%s\"): want %s", i, rows[i].query,
				 rows[i].valid ? "valid" : "invalid");
}

static void test_meta_selects_base_allocation(void **state)
{
	(void)state;
	assert_true(nbd_meta_query_selects_base_allocation("base:", 5));
	assert_true(nbd_meta_query_selects_base_allocation("base:allocation", 15));
	assert_true(nbd_meta_query_selects_base_allocation("base:allocation", 5));
	assert_false(nbd_meta_query_selects_base_allocation("base:allocationx", 16));
	assert_false(nbd_meta_query_selects_base_allocation("base:alloc", 10));
	assert_false(nbd_meta_query_selects_base_allocation("base:allocatioN", 15));
	assert_false(nbd_meta_query_selects_base_allocation("BASE:allocation", 15));
	assert_false(nbd_meta_query_selects_base_allocation("base", 4));
	assert_false(nbd_meta_query_selects_base_allocation("", 0));
	assert_false(nbd_meta_query_selects_base_allocation("qemu:", 5));
	assert_false(nbd_meta_query_selects_base_allocation("qemu:allocation", 15));
}

/* ---- Requests. ---- */

static void assert_request_equal(const struct nbd_request *a, const struct nbd_request *b)
{
	assert_int_equal(a->flags, b->flags);
	assert_int_equal(a->type, b->type);
	assert_true(a->cookie == b->cookie);
	assert_true(a->offset == b->offset);
	assert_true(a->length == b->length);
	assert_true(a->payload_length == b->payload_length);
}

static void test_request_compact_bytes(void **state)
{
	struct nbd_request req = {.flags = NBD_CMD_FLAG_FUA,
				  .type = NBD_CMD_WRITE,
				  .cookie = 0x0102030405060708ULL,
				  .offset = U63,
				  .length = 0xfffffffe};
	struct nbd_request out;
	uint8_t buf[NBD_REQUEST_SIZE + 1];

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_request_header_size(false), NBD_REQUEST_SIZE);
	assert_int_equal(nbd_encode_request(buf, false, &req), NBD_REQUEST_SIZE);
	ASSERT_BYTES(buf, 0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0x7f, 0xff,
		     0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xaa);
	memset(&out, 0x55, sizeof out);
	assert_int_equal(nbd_decode_request(buf, NBD_REQUEST_SIZE, false, &out), 0);
	req.payload_length = 0xfffffffe;
	assert_request_equal(&out, &req);

	/* Only WRITE carries a payload in compact mode. */
	req.type = NBD_CMD_READ;
	req.length = UINT32_MAX;
	nbd_encode_request(buf, false, &req);
	assert_int_equal(nbd_decode_request(buf, NBD_REQUEST_SIZE, false, &out), 0);
	assert_true(out.length == UINT32_MAX);
	assert_true(out.payload_length == 0);

	/* ... even if the client sets PAYLOAD_LEN (which check_request rejects). */
	req.type = NBD_CMD_TRIM;
	req.flags = NBD_CMD_FLAG_PAYLOAD_LEN;
	nbd_encode_request(buf, false, &req);
	assert_int_equal(nbd_decode_request(buf, NBD_REQUEST_SIZE, false, &out), 0);
	assert_true(out.payload_length == 0);
}

static void test_request_extended_bytes(void **state)
{
	struct nbd_request req = {.flags = NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_PAYLOAD_LEN,
				  .type = NBD_CMD_WRITE,
				  .cookie = UINT64_MAX,
				  .offset = U63,
				  .length = 0x0000000100000000ULL};
	struct nbd_request out;
	uint8_t buf[NBD_EXTENDED_REQUEST_SIZE + 1];

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_request_header_size(true), NBD_EXTENDED_REQUEST_SIZE);
	assert_int_equal(nbd_encode_request(buf, true, &req), NBD_EXTENDED_REQUEST_SIZE);
	ASSERT_BYTES(buf, 0x21, 0xe4, 0x1c, 0x71, 0, 0x21, 0, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
		     0xff, 0xff, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 0, 0,
		     0, 0, 0xaa);
	assert_int_equal(nbd_decode_request(buf, NBD_EXTENDED_REQUEST_SIZE, true, &out), 0);
	req.payload_length = req.length;
	assert_request_equal(&out, &req);

	/* Without PAYLOAD_LEN the length is an effect length: no payload. */
	req.flags = 0;
	req.type = NBD_CMD_TRIM;
	req.length = UINT64_MAX;
	req.offset = 0;
	nbd_encode_request(buf, true, &req);
	assert_int_equal(nbd_decode_request(buf, NBD_EXTENDED_REQUEST_SIZE, true, &out), 0);
	req.payload_length = 0;
	assert_request_equal(&out, &req);

	/*
	 * A WRITE without the flag still carries its data: qemu 10 sends
	 * extended WRITEs that way, and leaving the data unread would desync
	 * the stream.
	 */
	req.type = NBD_CMD_WRITE;
	req.length = 512;
	nbd_encode_request(buf, true, &req);
	assert_int_equal(nbd_decode_request(buf, NBD_EXTENDED_REQUEST_SIZE, true, &out), 0);
	assert_true(out.payload_length == 512);

	/* Any command may carry a payload under extended headers. */
	req.type = NBD_CMD_BLOCK_STATUS;
	req.flags = NBD_CMD_FLAG_PAYLOAD_LEN;
	req.length = 16;
	nbd_encode_request(buf, true, &req);
	assert_int_equal(nbd_decode_request(buf, NBD_EXTENDED_REQUEST_SIZE, true, &out), 0);
	assert_true(out.payload_length == 16);
}

static void test_request_round_trip_extremes(void **state)
{
	static const uint64_t offsets[] = {
	    0, 1, 511, 4096, 0xffffffffULL, 0x100000000ULL, U63 - 1, U63, UINT64_MAX};
	static const uint64_t lengths[] = {0, 1, 0xffffffffULL, 0x100000000ULL, U63, UINT64_MAX};
	uint8_t buf[NBD_EXTENDED_REQUEST_SIZE];
	size_t i, j;
	uint16_t type;

	(void)state;
	for (i = 0; i < sizeof offsets / sizeof offsets[0]; i++)
		for (j = 0; j < sizeof lengths / sizeof lengths[0]; j++)
			for (type = 0; type <= 8; type++) {
				struct nbd_request req = {.flags = (uint16_t)(0x3f ^ type),
							  .type = type,
							  .cookie = offsets[i] ^ lengths[j],
							  .offset = offsets[i],
							  .length = lengths[j]};
				struct nbd_request out;

				req.payload_length = ((req.flags & NBD_CMD_FLAG_PAYLOAD_LEN) ||
						      type == NBD_CMD_WRITE)
							 ? req.length
							 : 0;
				nbd_encode_request(buf, true, &req);
				assert_int_equal(nbd_decode_request(buf, sizeof buf, true, &out),
						 0);
				assert_request_equal(&out, &req);
				if (lengths[j] > UINT32_MAX)
					continue;
				req.payload_length = type == NBD_CMD_WRITE ? req.length : 0;
				nbd_encode_request(buf, false, &req);
				assert_int_equal(
				    nbd_decode_request(buf, NBD_REQUEST_SIZE, false, &out), 0);
				assert_request_equal(&out, &req);
			}
}

static void test_request_short_and_bad_magic(void **state)
{
	struct nbd_request req = {.type = NBD_CMD_READ, .length = 512}, out;
	uint8_t compact[NBD_REQUEST_SIZE], extended[NBD_EXTENDED_REQUEST_SIZE];
	size_t i;

	(void)state;
	nbd_encode_request(compact, false, &req);
	nbd_encode_request(extended, true, &req);
	ASSERT_EAGAIN_BELOW(NBD_REQUEST_SIZE, nbd_decode_request(compact, len, false, &out));
	ASSERT_EAGAIN_BELOW(NBD_EXTENDED_REQUEST_SIZE,
			    nbd_decode_request(extended, len, true, &out));
	/* Enough bytes for a compact header are still short for an extended one. */
	assert_int_equal(nbd_decode_request(extended, NBD_REQUEST_SIZE, true, &out), -EAGAIN);

	/* The magic must be the negotiated one. */
	assert_int_equal(nbd_decode_request(extended, sizeof extended, false, &out), -EBADMSG);
	memcpy(extended, compact, sizeof compact);
	assert_int_equal(nbd_decode_request(extended, sizeof extended, true, &out), -EBADMSG);
	nbd_encode_request(extended, true, &req);
	for (i = 0; i < 4; i++) {
		compact[i] ^= 0x40;
		extended[i] ^= 0x40;
		assert_int_equal(nbd_decode_request(compact, sizeof compact, false, &out),
				 -EBADMSG);
		assert_int_equal(nbd_decode_request(extended, sizeof extended, true, &out),
				 -EBADMSG);
		compact[i] ^= 0x40;
		extended[i] ^= 0x40;
	}
	assert_int_equal(nbd_decode_request(compact, sizeof compact, false, &out), 0);
	assert_int_equal(nbd_decode_request(extended, sizeof extended, true, &out), 0);
}

/* ---- nbd_check_request: one row per branch. ---- */

#define SZ (1ULL << 20)
#define MAXP (64u * 1024)
#define ALL_EFLAGS                                                                                 \
	(NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_TRIM |       \
	 NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_DF | NBD_FLAG_SEND_CACHE |                     \
	 NBD_FLAG_SEND_FAST_ZERO | NBD_FLAG_SEND_RESIZE)

/*
 * The base session offers everything: structured replies with a meta
 * context, all commands and flags, 1 MiB export, 64 KiB payloads, no block
 * size constraint. Each row says how its session differs.
 */
struct check_row {
	const char *what;
	bool ext;	       /* extended headers */
	bool simple;	       /* no structured replies */
	bool no_meta;	       /* no meta context selected */
	uint16_t eflags_clear; /* transmission flags withdrawn */
	bool read_only;	       /* NBD_FLAG_READ_ONLY */
	uint64_t size;	       /* 0: SZ */
	bool empty;	       /* size 0 */
	uint32_t min_block;    /* 0: 1 */
	uint16_t flags;
	uint16_t type;
	uint64_t offset;
	uint64_t length;
	int want;
};

#define R NBD_CMD_READ
#define W NBD_CMD_WRITE
#define DISC NBD_CMD_DISC
#define FL NBD_CMD_FLUSH
#define TR NBD_CMD_TRIM
#define CA NBD_CMD_CACHE
#define WZ NBD_CMD_WRITE_ZEROES
#define BS NBD_CMD_BLOCK_STATUS
#define RS NBD_CMD_RESIZE
#define FUA NBD_CMD_FLAG_FUA
#define NOHOLE NBD_CMD_FLAG_NO_HOLE
#define DF NBD_CMD_FLAG_DF
#define ONE NBD_CMD_FLAG_REQ_ONE
#define FZ NBD_CMD_FLAG_FAST_ZERO
#define PL NBD_CMD_FLAG_PAYLOAD_LEN
#define OK NBD_SUCCESS
#define DISCONNECT NBD_CHECK_DISCONNECT

static const struct check_row check_rows[] = {
    /* 1. extended payload too large: hard disconnect, before anything else. */
    {"ext WRITE payload max+1", .ext = true, .flags = PL, .type = W, .length = MAXP + 1,
     .want = DISCONNECT},
    {"ext WRITE payload 2^63", .ext = true, .flags = PL, .type = W, .length = 1ULL << 63,
     .want = DISCONNECT},
    {"ext WRITE payload 2^32 (no 32-bit truncation)", .ext = true, .flags = PL, .type = W,
     .length = 1ULL << 32, .want = DISCONNECT},
    {"ext READ payload max+1 (before flag check)", .ext = true, .flags = PL, .type = R,
     .length = MAXP + 1, .want = DISCONNECT},
    {"ext DISC payload max+1 (before DISC)", .ext = true, .flags = PL, .type = DISC,
     .length = MAXP + 1, .want = DISCONNECT},
    {"ext unknown type payload max+1", .ext = true, .flags = PL, .type = 99, .length = MAXP + 1,
     .want = DISCONNECT},
    {"ext read-only WRITE payload max+1", .ext = true, .read_only = true, .flags = PL, .type = W,
     .length = MAXP + 1, .want = DISCONNECT},
    {"ext WRITE payload max", .ext = true, .flags = PL, .type = W, .length = MAXP, .want = OK},
    {"ext TRIM effect length is not a payload", .ext = true, .type = TR, .length = 1ULL << 19,
     .want = OK},

    /* 2. compact WRITE too large: EINVAL (payload discarded), before anything else. */
    {"WRITE max+1", .type = W, .length = MAXP + 1, .want = NBD_EINVAL},
    {"WRITE 2^32-1", .type = W, .length = UINT32_MAX, .want = NBD_EINVAL},
    {"read-only WRITE max+1", .read_only = true, .type = W, .length = MAXP + 1, .want = NBD_EINVAL},
    {"WRITE max+1 beyond end", .type = W, .offset = SZ, .length = MAXP + 1, .want = NBD_EINVAL},
    {"WRITE max", .type = W, .length = MAXP, .want = OK},

    /* 3. DISC needs nothing; unknown types. */
    {"DISC", .type = DISC, .want = OK},
    {"DISC with junk", .flags = 0xffff, .type = DISC, .offset = UINT64_MAX, .length = UINT32_MAX,
     .want = OK},
    {"ext DISC with junk", .ext = true, .flags = 0xffdf, .type = DISC, .offset = UINT64_MAX,
     .length = UINT64_MAX, .want = OK},
    {"read-only DISC", .read_only = true, .type = DISC, .want = OK},
    {"type 9", .type = 9, .want = NBD_EINVAL},
    {"type 0xffff", .type = 0xffff, .want = NBD_EINVAL},
    {"ext type 9", .ext = true, .type = 9, .want = NBD_EINVAL},

    /* RESIZE (8, the resize extension): only when SEND_RESIZE was sent; the
     * offset is the new size, not a range; length 0 only. */
    {"RESIZE without SEND_RESIZE", .eflags_clear = NBD_FLAG_SEND_RESIZE, .type = RS,
     .offset = 2 * SZ, .want = NBD_EINVAL},
    {"RESIZE to a larger size", .type = RS, .offset = 2 * SZ, .want = OK},
    {"RESIZE to a smaller size", .type = RS, .offset = SZ / 2, .want = OK},
    {"ext RESIZE past 2^32", .ext = true, .type = RS, .offset = 1ULL << 40, .want = OK},
    {"RESIZE with a length", .type = RS, .offset = 2 * SZ, .length = 512, .want = NBD_EINVAL},
    {"read-only RESIZE (never advertised)", .read_only = true, .eflags_clear = NBD_FLAG_SEND_RESIZE,
     .type = RS, .offset = 2 * SZ, .want = NBD_EINVAL},
    {"RESIZE with DF", .flags = DF, .type = RS, .offset = 2 * SZ, .want = NBD_EINVAL},

    /* 4. flags. */
    {"unknown flag 1<<6", .flags = 1u << 6, .type = R, .length = 1, .want = NBD_EINVAL},
    {"unknown flag 1<<15", .flags = 1u << 15, .type = R, .length = 1, .want = NBD_EINVAL},
    {"FUA READ", .flags = FUA, .type = R, .length = 512, .want = OK},
    {"FUA WRITE", .flags = FUA, .type = W, .length = 512, .want = OK},
    {"FUA FLUSH", .flags = FUA, .type = FL, .want = OK},
    {"FUA TRIM", .flags = FUA, .type = TR, .length = 512, .want = OK},
    {"FUA CACHE", .flags = FUA, .type = CA, .length = 512, .want = OK},
    {"FUA WRITE_ZEROES", .flags = FUA, .type = WZ, .length = 512, .want = OK},
    {"FUA BLOCK_STATUS", .flags = FUA, .type = BS, .length = 512, .want = OK},
    {"FUA WRITE without SEND_FUA", .eflags_clear = NBD_FLAG_SEND_FUA, .flags = FUA, .type = W,
     .length = 512, .want = NBD_EINVAL},
    {"FUA READ without SEND_FUA", .eflags_clear = NBD_FLAG_SEND_FUA, .flags = FUA, .type = R,
     .length = 512, .want = NBD_EINVAL},
    {"NO_HOLE WRITE_ZEROES", .flags = NOHOLE, .type = WZ, .length = 512, .want = OK},
    {"NO_HOLE WRITE", .flags = NOHOLE, .type = W, .length = 512, .want = NBD_EINVAL},
    {"NO_HOLE TRIM", .flags = NOHOLE, .type = TR, .length = 512, .want = NBD_EINVAL},
    {"NO_HOLE READ", .flags = NOHOLE, .type = R, .length = 512, .want = NBD_EINVAL},
    {"DF READ", .flags = DF, .type = R, .length = 512, .want = OK},
    {"DF READ without SEND_DF", .eflags_clear = NBD_FLAG_SEND_DF, .flags = DF, .type = R,
     .length = 512, .want = NBD_EINVAL},
    {"DF WRITE", .flags = DF, .type = W, .length = 512, .want = NBD_EINVAL},
    {"DF BLOCK_STATUS", .flags = DF, .type = BS, .length = 512, .want = NBD_EINVAL},
    {"REQ_ONE BLOCK_STATUS", .flags = ONE, .type = BS, .length = 512, .want = OK},
    {"REQ_ONE READ", .flags = ONE, .type = R, .length = 512, .want = NBD_EINVAL},
    {"REQ_ONE CACHE", .flags = ONE, .type = CA, .length = 512, .want = NBD_EINVAL},
    {"FAST_ZERO WRITE_ZEROES", .flags = FZ, .type = WZ, .length = 512, .want = OK},
    {"FAST_ZERO|NO_HOLE|FUA WRITE_ZEROES", .flags = FZ | NOHOLE | FUA, .type = WZ, .length = 512,
     .want = OK},
    {"FAST_ZERO without SEND_FAST_ZERO", .eflags_clear = NBD_FLAG_SEND_FAST_ZERO, .flags = FZ,
     .type = WZ, .length = 512, .want = NBD_EINVAL},
    {"FAST_ZERO WRITE", .flags = FZ, .type = W, .length = 512, .want = NBD_EINVAL},
    {"FAST_ZERO TRIM", .flags = FZ, .type = TR, .length = 512, .want = NBD_EINVAL},
    {"compact PAYLOAD_LEN READ", .flags = PL, .type = R, .length = 512, .want = NBD_EINVAL},
    {"compact PAYLOAD_LEN WRITE", .flags = PL, .type = W, .length = 512, .want = NBD_EINVAL},
    {"ext WRITE without PAYLOAD_LEN (qemu 10)", .ext = true, .type = W, .length = 512, .want = OK},
    {"ext WRITE without PAYLOAD_LEN max+1", .ext = true, .type = W, .length = MAXP + 1,
     .want = DISCONNECT},
    {"ext WRITE without PAYLOAD_LEN 2^63", .ext = true, .type = W, .length = 1ULL << 63,
     .want = DISCONNECT},
    {"ext WRITE without PAYLOAD_LEN, FUA", .ext = true, .flags = FUA, .type = W, .length = 512,
     .want = OK},
    {"ext read-only WRITE without PAYLOAD_LEN", .ext = true, .read_only = true, .type = W,
     .length = 512, .want = NBD_EPERM},
    {"ext WRITE PAYLOAD_LEN", .ext = true, .flags = PL, .type = W, .length = 512, .want = OK},
    {"ext WRITE FUA|PAYLOAD_LEN", .ext = true, .flags = PL | FUA, .type = W, .length = 512,
     .want = OK},
    {"ext READ PAYLOAD_LEN", .ext = true, .flags = PL, .type = R, .length = 512,
     .want = NBD_EINVAL},
    {"ext TRIM PAYLOAD_LEN", .ext = true, .flags = PL, .type = TR, .length = 512,
     .want = NBD_EINVAL},
    {"ext BLOCK_STATUS PAYLOAD_LEN", .ext = true, .flags = PL, .type = BS, .length = 16,
     .want = NBD_EINVAL},
    {"ext FLUSH PAYLOAD_LEN 0", .ext = true, .flags = PL, .type = FL, .want = NBD_EINVAL},
    {"read-only WRITE NO_HOLE: flags before EPERM", .read_only = true, .flags = NOHOLE, .type = W,
     .length = 512, .want = NBD_EINVAL},
    {"bad flag beyond end: flags before range", .flags = DF, .type = W, .offset = SZ, .length = 512,
     .want = NBD_EINVAL},

    /* 5. command availability. */
    {"TRIM without SEND_TRIM", .eflags_clear = NBD_FLAG_SEND_TRIM, .type = TR, .length = 512,
     .want = NBD_EINVAL},
    {"WRITE_ZEROES without SEND_WRITE_ZEROES", .eflags_clear = NBD_FLAG_SEND_WRITE_ZEROES,
     .type = WZ, .length = 512, .want = NBD_EINVAL},
    {"FLUSH without SEND_FLUSH", .eflags_clear = NBD_FLAG_SEND_FLUSH, .type = FL,
     .want = NBD_EINVAL},
    {"BLOCK_STATUS without structured replies", .simple = true, .type = BS, .length = 512,
     .want = NBD_EINVAL},
    {"BLOCK_STATUS without meta context", .no_meta = true, .type = BS, .length = 512,
     .want = NBD_EINVAL},
    {"CACHE without SEND_CACHE", .eflags_clear = NBD_FLAG_SEND_CACHE, .type = CA, .length = 512,
     .want = OK},
    {"read-only TRIM without SEND_TRIM: EPERM before availability", .read_only = true,
     .eflags_clear = NBD_FLAG_SEND_TRIM, .type = TR, .length = 512, .want = NBD_EPERM},
    {"read-only WRITE_ZEROES without SEND_WRITE_ZEROES: EPERM", .read_only = true,
     .eflags_clear = NBD_FLAG_SEND_WRITE_ZEROES, .type = WZ, .length = 512, .want = NBD_EPERM},

    /* 6. read-only export. */
    {"read-only WRITE", .read_only = true, .type = W, .length = 512, .want = NBD_EPERM},
    {"ext read-only WRITE", .ext = true, .read_only = true, .flags = PL, .type = W, .length = 512,
     .want = NBD_EPERM},
    {"read-only TRIM", .read_only = true, .type = TR, .length = 512, .want = NBD_EPERM},
    {"read-only WRITE_ZEROES", .read_only = true, .type = WZ, .length = 512, .want = NBD_EPERM},
    {"read-only WRITE beyond end: EPERM before range", .read_only = true, .type = W, .offset = SZ,
     .length = 512, .want = NBD_EPERM},
    {"read-only READ", .read_only = true, .type = R, .length = 512, .want = OK},
    {"read-only CACHE", .read_only = true, .type = CA, .length = 512, .want = OK},
    {"read-only FLUSH", .read_only = true, .type = FL, .want = OK},
    {"read-only BLOCK_STATUS", .read_only = true, .type = BS, .length = 512, .want = OK},

    /* 7. FLUSH. */
    {"FLUSH", .type = FL, .want = OK},
    {"FLUSH offset 1", .type = FL, .offset = 1, .want = NBD_EINVAL},
    {"FLUSH length 1", .type = FL, .length = 1, .want = NBD_EINVAL},
    {"FLUSH beyond end", .type = FL, .offset = SZ + 1, .length = 0, .want = NBD_EINVAL},
    {"FLUSH on an empty export", .empty = true, .type = FL, .want = OK},
    {"FLUSH skips alignment", .min_block = 512, .type = FL, .want = OK},

    /* 8. READ longer than the maximum payload. */
    {"READ max", .type = R, .length = MAXP, .want = OK},
    {"READ max+1 structured", .type = R, .length = MAXP + 1, .want = NBD_EOVERFLOW},
    {"READ max+1 simple", .simple = true, .type = R, .length = MAXP + 1, .want = NBD_EINVAL},
    {"ext READ 2^40", .ext = true, .type = R, .length = 1ULL << 40, .want = NBD_EOVERFLOW},
    {"READ max+1 beyond end: EOVERFLOW before range", .type = R, .offset = SZ, .length = MAXP + 1,
     .want = NBD_EOVERFLOW},
    {"TRIM longer than max payload is fine", .type = TR, .length = SZ, .want = OK},
    {"WRITE_ZEROES longer than max payload", .type = WZ, .length = SZ, .want = OK},
    {"CACHE longer than max payload", .type = CA, .length = SZ, .want = OK},
    {"BLOCK_STATUS longer than max payload", .type = BS, .length = SZ, .want = OK},

    /* 9. range. */
    {"READ last byte", .type = R, .offset = SZ - 1, .length = 1, .want = OK},
    {"READ 0 at end", .type = R, .offset = SZ, .length = 0, .want = OK},
    {"READ 1 past end", .type = R, .offset = SZ - 1, .length = 2, .want = NBD_EINVAL},
    {"READ offset past end", .type = R, .offset = SZ + 1, .length = 0, .want = NBD_EINVAL},
    {"WRITE 1 past end", .type = W, .offset = SZ - 511, .length = 512, .want = NBD_ENOSPC},
    {"WRITE at end", .type = W, .offset = SZ, .length = 1, .want = NBD_ENOSPC},
    {"WRITE 0 past end", .type = W, .offset = SZ + 1, .length = 0, .want = NBD_ENOSPC},
    {"WRITE_ZEROES past end", .type = WZ, .offset = 0, .length = SZ + 1, .want = NBD_ENOSPC},
    {"WRITE_ZEROES whole export", .type = WZ, .offset = 0, .length = SZ, .want = OK},
    {"TRIM past end", .type = TR, .offset = SZ, .length = 1, .want = NBD_EINVAL},
    {"CACHE past end", .type = CA, .offset = SZ, .length = 1, .want = NBD_EINVAL},
    {"BLOCK_STATUS past end", .type = BS, .offset = SZ, .length = 1, .want = NBD_EINVAL},
    {"TRIM wrapping offset+length", .type = TR, .offset = UINT64_MAX, .length = 2,
     .want = NBD_EINVAL},
    {"ext WRITE_ZEROES wrapping", .ext = true, .type = WZ, .offset = 2, .length = UINT64_MAX - 1,
     .want = NBD_ENOSPC},
    {"ext TRIM whole 2^63-1 export", .ext = true, .size = U63, .type = TR, .offset = 0,
     .length = U63, .want = OK},
    {"ext WRITE_ZEROES 2^63 on 2^63-1", .ext = true, .size = U63, .type = WZ, .length = 1ULL << 63,
     .want = NBD_ENOSPC},
    {"ext TRIM last byte of 2^63-1", .ext = true, .size = U63, .type = TR, .offset = U63 - 1,
     .length = 1, .want = OK},
    {"ext TRIM 2 at end of 2^63-1", .ext = true, .size = U63, .type = TR, .offset = U63 - 1,
     .length = 2, .want = NBD_EINVAL},
    {"READ at 2^63-1 on 2^63-1", .size = U63, .type = R, .offset = U63, .length = 0, .want = OK},
    {"READ near 2^63 on 2^63-1", .size = U63, .type = R, .offset = U63 - 512, .length = 512,
     .want = OK},
    {"READ at 2^64-1 on 2^63-1", .size = U63, .type = R, .offset = UINT64_MAX, .length = 1,
     .want = NBD_EINVAL},
    {"empty export READ 0", .empty = true, .type = R, .want = OK},
    {"empty export READ 1", .empty = true, .type = R, .length = 1, .want = NBD_EINVAL},
    {"empty export WRITE 1", .empty = true, .type = W, .length = 1, .want = NBD_ENOSPC},

    /* 10. alignment and zero-length BLOCK_STATUS. */
    {"aligned READ", .min_block = 512, .type = R, .offset = 512, .length = 1024, .want = OK},
    {"unaligned offset READ", .min_block = 512, .type = R, .offset = 1, .length = 512,
     .want = NBD_EINVAL},
    {"unaligned length READ", .min_block = 512, .type = R, .offset = 0, .length = 513,
     .want = NBD_EINVAL},
    {"unaligned WRITE", .min_block = 4096, .type = W, .offset = 512, .length = 4096,
     .want = NBD_EINVAL},
    {"unaligned TRIM", .min_block = 4096, .type = TR, .offset = 0, .length = 512,
     .want = NBD_EINVAL},
    {"unaligned CACHE", .min_block = 4096, .type = CA, .offset = 4095, .length = 4096,
     .want = NBD_EINVAL},
    {"unaligned BLOCK_STATUS", .min_block = 4096, .type = BS, .offset = 0, .length = 1,
     .want = NBD_EINVAL},
    {"min_block 1 anything goes", .min_block = 1, .type = R, .offset = 3, .length = 5, .want = OK},
    {"unaligned WRITE beyond end: range first", .min_block = 512, .type = W, .offset = SZ,
     .length = 1, .want = NBD_ENOSPC},
    {"aligned zero-length WRITE", .min_block = 512, .type = W, .offset = 512, .want = OK},
    {"BLOCK_STATUS length 0", .type = BS, .length = 0, .want = NBD_EINVAL},
    {"aligned BLOCK_STATUS length 0", .min_block = 512, .type = BS, .length = 0,
     .want = NBD_EINVAL},
    {"ext BLOCK_STATUS", .ext = true, .type = BS, .offset = 4096, .length = 8192, .want = OK},
    {"READ length 0", .type = R, .length = 0, .want = OK},
    {"TRIM length 0", .type = TR, .length = 0, .want = OK},
};

static void test_check_request_table(void **state)
{
	uint8_t buf[NBD_EXTENDED_REQUEST_SIZE];
	size_t i;
	int failures = 0;

	(void)state;
	for (i = 0; i < sizeof check_rows / sizeof check_rows[0]; i++) {
		const struct check_row *row = &check_rows[i];
		struct nbd_session s = {
		    .structured = !row->simple,
		    .extended = row->ext,
		    .block_status = !row->simple && !row->no_meta,
		    .eflags = (uint16_t)((ALL_EFLAGS & ~row->eflags_clear) |
					 (row->read_only ? NBD_FLAG_READ_ONLY : 0)),
		    .size = row->empty	? 0
			    : row->size ? row->size
					: SZ,
		    .max_payload = MAXP,
		    .min_block = row->min_block ? row->min_block : 1,
		};
		struct nbd_request req = {.flags = row->flags,
					  .type = row->type,
					  .cookie = i,
					  .offset = row->offset,
					  .length = row->length},
				   out;
		int got;

		/* As the daemon sees it: off the wire, decoded, checked. */
		if (!row->ext)
			assert_true(row->length <= UINT32_MAX);
		nbd_encode_request(buf, row->ext, &req);
		assert_int_equal(nbd_decode_request(buf, sizeof buf, row->ext, &out), 0);
		got = nbd_check_request(&out, &s);
		if (got != row->want) {
			print_error("check row %zu \"%s\": got %d (%s), want %d (%s)\n", i,
				    row->what, got, nbd_err_name((uint32_t)got), row->want,
				    nbd_err_name((uint32_t)row->want));
			failures++;
		}
	}
	assert_int_equal(failures, 0);
}

/* ---- Replies. ---- */

static void test_simple_reply(void **state)
{
	uint8_t buf[NBD_SIMPLE_REPLY_SIZE + 1];
	struct nbd_reply rep;
	size_t i;

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_simple_reply(buf, 0x0102030405060708ULL, NBD_ENOSPC),
			 NBD_SIMPLE_REPLY_SIZE);
	ASSERT_BYTES(buf, 0x67, 0x44, 0x66, 0x98, 0, 0, 0, 28, 1, 2, 3, 4, 5, 6, 7, 8, 0xaa);
	memset(&rep, 0x55, sizeof rep);
	assert_int_equal(nbd_decode_reply(buf, NBD_SIMPLE_REPLY_SIZE, false, &rep), 0);
	assert_int_equal(rep.magic, NBD_SIMPLE_REPLY_MAGIC);
	assert_int_equal(rep.type, NBD_REPLY_TYPE_NONE);
	assert_int_equal(rep.flags, NBD_REPLY_FLAG_DONE);
	assert_int_equal(rep.error, NBD_ENOSPC);
	assert_true(rep.cookie == 0x0102030405060708ULL);
	assert_true(rep.offset == 0);
	assert_true(rep.length == 0);
	ASSERT_EAGAIN_BELOW(NBD_SIMPLE_REPLY_SIZE, nbd_decode_reply(buf, len, false, &rep));
	/* Simple replies are forbidden under extended headers. */
	for (i = 4; i <= NBD_SIMPLE_REPLY_SIZE; i++)
		assert_int_equal(nbd_decode_reply(buf, i, true, &rep), -EBADMSG);
}

static void test_structured_chunk_header(void **state)
{
	uint8_t buf[NBD_STRUCTURED_REPLY_SIZE + 1];
	struct nbd_reply rep;

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_chunk_header(buf, false, NBD_REPLY_FLAG_DONE,
						 NBD_REPLY_TYPE_ERROR, 0xfedcba9876543210ULL, U63,
						 0xffffffffULL),
			 NBD_STRUCTURED_REPLY_SIZE);
	ASSERT_BYTES(buf, 0x66, 0x8e, 0x33, 0xef, 0, 1, 0x80, 0x01, 0xfe, 0xdc, 0xba, 0x98, 0x76,
		     0x54, 0x32, 0x10, 0xff, 0xff, 0xff, 0xff, 0xaa);
	memset(&rep, 0x55, sizeof rep);
	assert_int_equal(nbd_decode_reply(buf, NBD_STRUCTURED_REPLY_SIZE, false, &rep), 0);
	assert_int_equal(rep.magic, NBD_STRUCTURED_REPLY_MAGIC);
	assert_int_equal(rep.flags, NBD_REPLY_FLAG_DONE);
	assert_int_equal(rep.type, NBD_REPLY_TYPE_ERROR);
	assert_true(NBD_REPLY_TYPE_IS_ERR(rep.type));
	assert_int_equal(rep.error, 0);
	assert_true(rep.cookie == 0xfedcba9876543210ULL);
	assert_true(rep.offset == 0);
	assert_true(rep.length == 0xffffffffULL);
	ASSERT_EAGAIN_BELOW(NBD_STRUCTURED_REPLY_SIZE, nbd_decode_reply(buf, len, false, &rep));
	assert_int_equal(nbd_decode_reply(buf, NBD_STRUCTURED_REPLY_SIZE, true, &rep), -EBADMSG);
	assert_int_equal(nbd_decode_reply(buf, 4, true, &rep), -EBADMSG);
}

static void test_extended_chunk_header(void **state)
{
	uint8_t buf[NBD_EXTENDED_REPLY_SIZE + 1];
	struct nbd_reply rep;

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_chunk_header(buf, true, 0, NBD_REPLY_TYPE_BLOCK_STATUS_EXT, 7,
						 U63, 0x0000000100000008ULL),
			 NBD_EXTENDED_REPLY_SIZE);
	ASSERT_BYTES(buf, 0x6e, 0x8a, 0x27, 0x8c, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 7, 0x7f, 0xff,
		     0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 8, 0xaa);
	memset(&rep, 0x55, sizeof rep);
	assert_int_equal(nbd_decode_reply(buf, NBD_EXTENDED_REPLY_SIZE, true, &rep), 0);
	assert_int_equal(rep.magic, NBD_EXTENDED_REPLY_MAGIC);
	assert_int_equal(rep.flags, 0);
	assert_int_equal(rep.type, NBD_REPLY_TYPE_BLOCK_STATUS_EXT);
	assert_int_equal(rep.error, 0);
	assert_true(rep.cookie == 7);
	assert_true(rep.offset == U63);
	assert_true(rep.length == 0x0000000100000008ULL);
	ASSERT_EAGAIN_BELOW(NBD_EXTENDED_REPLY_SIZE, nbd_decode_reply(buf, len, true, &rep));
	/* 20 bytes would be a whole structured header, but not an extended one. */
	assert_int_equal(nbd_decode_reply(buf, NBD_STRUCTURED_REPLY_SIZE, true, &rep), -EAGAIN);
	assert_int_equal(nbd_decode_reply(buf, NBD_EXTENDED_REPLY_SIZE, false, &rep), -EBADMSG);
	assert_int_equal(nbd_decode_reply(buf, 4, false, &rep), -EBADMSG);

	nbd_encode_chunk_header(buf, true, 0xffff, 0xffff, UINT64_MAX, UINT64_MAX, UINT64_MAX);
	assert_int_equal(nbd_decode_reply(buf, NBD_EXTENDED_REPLY_SIZE, true, &rep), 0);
	assert_int_equal(rep.flags, 0xffff);
	assert_int_equal(rep.type, 0xffff);
	assert_true(rep.cookie == UINT64_MAX && rep.offset == UINT64_MAX &&
		    rep.length == UINT64_MAX);
}

static void test_decode_reply_bad_magic(void **state)
{
	static const uint32_t magics[] = {0,
					  0xffffffff,
					  NBD_REQUEST_MAGIC,
					  NBD_EXTENDED_REQUEST_MAGIC,
					  NBD_SIMPLE_REPLY_MAGIC ^ 1,
					  NBD_STRUCTURED_REPLY_MAGIC ^ 0x100,
					  NBD_EXTENDED_REPLY_MAGIC ^ 0x80000000};
	uint8_t buf[NBD_EXTENDED_REPLY_SIZE] = {0};
	struct nbd_reply rep;
	size_t i;

	(void)state;
	for (i = 0; i < sizeof magics / sizeof magics[0]; i++) {
		nbd_put32(buf, magics[i]);
		assert_int_equal(nbd_decode_reply(buf, sizeof buf, false, &rep), -EBADMSG);
		assert_int_equal(nbd_decode_reply(buf, sizeof buf, true, &rep), -EBADMSG);
		assert_int_equal(nbd_decode_reply(buf, 4, true, &rep), -EBADMSG);
		assert_int_equal(nbd_decode_reply(buf, 3, true, &rep), -EAGAIN);
	}
}

static void test_offset_data_and_hole(void **state)
{
	uint8_t buf[16];

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_offset_data_prefix(buf, U63), NBD_OFFSET_DATA_PREFIX_SIZE);
	ASSERT_BYTES(buf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xaa);
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_offset_hole(buf, 0x100000000ULL, 0x00010000),
			 NBD_OFFSET_HOLE_SIZE);
	ASSERT_BYTES(buf, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0xaa);
}

static void test_error_chunk(void **state)
{
	static char long_message[NBD_MAX_STRING + 100];
	static uint8_t buf[NBD_ERROR_CHUNK_FIXED_SIZE + NBD_MAX_STRING + 100];

	(void)state;
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_error_chunk_size("boom"), 10);
	assert_int_equal(nbd_encode_error_chunk(buf, sizeof buf, NBD_EINVAL, "boom"), 10);
	ASSERT_BYTES(buf, 0, 0, 0, 22, 0, 4, 'b', 'o', 'o', 'm', 0xaa);

	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_error_chunk_size(NULL), NBD_ERROR_CHUNK_FIXED_SIZE);
	assert_int_equal(nbd_encode_error_chunk(buf, sizeof buf, NBD_EIO, NULL), 6);
	ASSERT_BYTES(buf, 0, 0, 0, 5, 0, 0, 0xaa);
	assert_int_equal(nbd_error_chunk_size(""), 6);
	assert_int_equal(nbd_encode_error_chunk(buf, sizeof buf, NBD_EIO, ""), 6);

	/* Truncated to the cap (here exactly the fixed part: no message). */
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_error_chunk(buf, 8, NBD_EPERM, "read-only"), 8);
	ASSERT_BYTES(buf, 0, 0, 0, 1, 0, 2, 'r', 'e', 0xaa);
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_error_chunk(buf, 6, NBD_EPERM, "read-only"), 6);
	ASSERT_BYTES(buf, 0, 0, 0, 1, 0, 0, 0xaa);

	/* Truncated to NBD_MAX_STRING. */
	memset(long_message, 'm', sizeof long_message - 1);
	long_message[sizeof long_message - 1] = '\0';
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_error_chunk_size(long_message), 6 + NBD_MAX_STRING);
	assert_int_equal(nbd_encode_error_chunk(buf, sizeof buf, NBD_ENOMEM, long_message),
			 6 + NBD_MAX_STRING);
	ASSERT_BYTES(buf, 0, 0, 0, 12, 0x10, 0x00, 'm');
	assert_int_equal(buf[6 + NBD_MAX_STRING - 1], 'm');
	assert_int_equal(buf[6 + NBD_MAX_STRING], 0xaa);
	long_message[NBD_MAX_STRING] = '\0';
	assert_int_equal(nbd_error_chunk_size(long_message), 6 + NBD_MAX_STRING);
	long_message[NBD_MAX_STRING - 1] = '\0';
	assert_int_equal(nbd_error_chunk_size(long_message), 6 + NBD_MAX_STRING - 1);
}

static void test_block_status_compact(void **state)
{
	static const struct nbd_extent extents[] = {
	    {4096, NBD_STATE_HOLE | NBD_STATE_ZERO},
	    {0xffffffffULL, 0},
	    {512, NBD_STATE_ZERO},
	};
	uint8_t buf[64];

	(void)state;
	assert_int_equal(nbd_block_status_size(false, 0), 4);
	assert_int_equal(nbd_block_status_size(false, 3), 28);
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_block_status(buf, false, 0x01020304, extents, 3), 28);
	ASSERT_BYTES(buf, 0x01, 0x02, 0x03, 0x04, /* context id */
		     0x00, 0x00, 0x10, 0x00,	  /* 4096 */
		     0x00, 0x00, 0x00, 0x03,	  /* hole|zero */
		     0xff, 0xff, 0xff, 0xff,	  /* 2^32-1 */
		     0x00, 0x00, 0x00, 0x00,	  /* data */
		     0x00, 0x00, 0x02, 0x00,	  /* 512 */
		     0x00, 0x00, 0x00, 0x02,	  /* zero */
		     0xaa);
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_block_status(buf, false, 1, extents, 0), 4);
	ASSERT_BYTES(buf, 0, 0, 0, 1, 0xaa);
}

static void test_block_status_extended(void **state)
{
	static const struct nbd_extent extents[] = {
	    {0x0000000200000005ULL, NBD_STATE_HOLE | NBD_STATE_ZERO},
	    {U63, 0},
	};
	uint8_t buf[64];

	(void)state;
	assert_int_equal(nbd_block_status_size(true, 0), 8);
	assert_int_equal(nbd_block_status_size(true, 2), 40);
	memset(buf, 0xaa, sizeof buf);
	assert_int_equal(nbd_encode_block_status(buf, true, 0x01020304, extents, 2), 40);
	ASSERT_BYTES(buf, 0x01, 0x02, 0x03, 0x04,		     /* id */
		     0x00, 0x00, 0x00, 0x02,			     /* count */
		     0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x05, /* len */
		     0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, /* flags */
		     0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, /* len */
		     0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, /* flags */
		     0xaa);

	/* The same extents, compact and extended, differ only in layout. */
	memset(buf, 0xaa, sizeof buf);
	{
		const struct nbd_extent one = {4096, NBD_STATE_ZERO};

		assert_int_equal(nbd_encode_block_status(buf, false, 9, &one, 1), 12);
		ASSERT_BYTES(buf, 0, 0, 0, 9, 0, 0, 0x10, 0, 0, 0, 0, 2, 0xaa);
		memset(buf, 0xaa, sizeof buf);
		assert_int_equal(nbd_encode_block_status(buf, true, 9, &one, 1), 24);
		ASSERT_BYTES(buf, 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0,
			     0, 0, 2, 0xaa);
	}
}

/* ---- Errors and names. ---- */

static void test_error_from_errno(void **state)
{
	static const struct {
		int errnum;
		uint32_t want;
	} rows[] = {
	    {EPERM, NBD_EPERM},		{EROFS, NBD_EPERM},	{EIO, NBD_EIO},
	    {ENOMEM, NBD_ENOMEM},	{EINVAL, NBD_EINVAL},	{ERANGE, NBD_EINVAL},
	    {ENOSPC, NBD_ENOSPC},	{EDQUOT, NBD_ENOSPC},	{EFBIG, NBD_ENOSPC},
	    {EOVERFLOW, NBD_EOVERFLOW}, {ENOTSUP, NBD_ENOTSUP}, {EOPNOTSUPP, NBD_ENOTSUP},
	    {ESHUTDOWN, NBD_ESHUTDOWN}, {0, NBD_EIO},		{ENOENT, NBD_EIO},
	    {EAGAIN, NBD_EIO},		{EBADF, NBD_EIO},	{-EINVAL, NBD_EIO},
	    {100000, NBD_EIO},
	};
	size_t i;

	(void)state;
	for (i = 0; i < sizeof rows / sizeof rows[0]; i++)
		if (nbd_error_from_errno(rows[i].errnum) != rows[i].want)
			fail_msg("errno %d: got %u, want %u", rows[i].errnum,
				 nbd_error_from_errno(rows[i].errnum), rows[i].want);
}

static void test_names(void **state)
{
	(void)state;
	assert_string_equal(nbd_cmd_name(NBD_CMD_READ), "NBD_CMD_READ");
	assert_string_equal(nbd_cmd_name(NBD_CMD_WRITE), "NBD_CMD_WRITE");
	assert_string_equal(nbd_cmd_name(NBD_CMD_DISC), "NBD_CMD_DISC");
	assert_string_equal(nbd_cmd_name(NBD_CMD_FLUSH), "NBD_CMD_FLUSH");
	assert_string_equal(nbd_cmd_name(NBD_CMD_TRIM), "NBD_CMD_TRIM");
	assert_string_equal(nbd_cmd_name(NBD_CMD_CACHE), "NBD_CMD_CACHE");
	assert_string_equal(nbd_cmd_name(NBD_CMD_WRITE_ZEROES), "NBD_CMD_WRITE_ZEROES");
	assert_string_equal(nbd_cmd_name(NBD_CMD_BLOCK_STATUS), "NBD_CMD_BLOCK_STATUS");
	assert_string_equal(nbd_cmd_name(NBD_CMD_RESIZE), "NBD_CMD_RESIZE");
	assert_string_equal(nbd_cmd_name(9), "unknown");
	assert_string_equal(nbd_cmd_name(0xffff), "unknown");

	assert_string_equal(nbd_opt_name(NBD_OPT_EXPORT_NAME), "NBD_OPT_EXPORT_NAME");
	assert_string_equal(nbd_opt_name(NBD_OPT_ABORT), "NBD_OPT_ABORT");
	assert_string_equal(nbd_opt_name(NBD_OPT_LIST), "NBD_OPT_LIST");
	assert_string_equal(nbd_opt_name(NBD_OPT_STARTTLS), "NBD_OPT_STARTTLS");
	assert_string_equal(nbd_opt_name(NBD_OPT_INFO), "NBD_OPT_INFO");
	assert_string_equal(nbd_opt_name(NBD_OPT_GO), "NBD_OPT_GO");
	assert_string_equal(nbd_opt_name(NBD_OPT_STRUCTURED_REPLY), "NBD_OPT_STRUCTURED_REPLY");
	assert_string_equal(nbd_opt_name(NBD_OPT_LIST_META_CONTEXT), "NBD_OPT_LIST_META_CONTEXT");
	assert_string_equal(nbd_opt_name(NBD_OPT_SET_META_CONTEXT), "NBD_OPT_SET_META_CONTEXT");
	assert_string_equal(nbd_opt_name(NBD_OPT_EXTENDED_HEADERS), "NBD_OPT_EXTENDED_HEADERS");
	assert_string_equal(nbd_opt_name(0), "unknown");
	assert_string_equal(nbd_opt_name(4), "unknown");
	assert_string_equal(nbd_opt_name(12), "unknown");

	assert_string_equal(nbd_rep_name(NBD_REP_ACK), "NBD_REP_ACK");
	assert_string_equal(nbd_rep_name(NBD_REP_SERVER), "NBD_REP_SERVER");
	assert_string_equal(nbd_rep_name(NBD_REP_INFO), "NBD_REP_INFO");
	assert_string_equal(nbd_rep_name(NBD_REP_META_CONTEXT), "NBD_REP_META_CONTEXT");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_UNSUP), "NBD_REP_ERR_UNSUP");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_POLICY), "NBD_REP_ERR_POLICY");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_INVALID), "NBD_REP_ERR_INVALID");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_PLATFORM), "NBD_REP_ERR_PLATFORM");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_TLS_REQD), "NBD_REP_ERR_TLS_REQD");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_UNKNOWN), "NBD_REP_ERR_UNKNOWN");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_SHUTDOWN), "NBD_REP_ERR_SHUTDOWN");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_BLOCK_SIZE_REQD),
			    "NBD_REP_ERR_BLOCK_SIZE_REQD");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_TOO_BIG), "NBD_REP_ERR_TOO_BIG");
	assert_string_equal(nbd_rep_name(NBD_REP_ERR_EXT_HEADER_REQD),
			    "NBD_REP_ERR_EXT_HEADER_REQD");
	assert_string_equal(nbd_rep_name(0), "unknown");
	assert_string_equal(nbd_rep_name(NBD_REP_FLAG_ERROR), "unknown");
	assert_string_equal(nbd_rep_name(NBD_REP_FLAG_ERROR + 11), "unknown");

	assert_string_equal(nbd_err_name(NBD_SUCCESS), "NBD_SUCCESS");
	assert_string_equal(nbd_err_name(NBD_EPERM), "NBD_EPERM");
	assert_string_equal(nbd_err_name(NBD_EIO), "NBD_EIO");
	assert_string_equal(nbd_err_name(NBD_ENOMEM), "NBD_ENOMEM");
	assert_string_equal(nbd_err_name(NBD_EINVAL), "NBD_EINVAL");
	assert_string_equal(nbd_err_name(NBD_ENOSPC), "NBD_ENOSPC");
	assert_string_equal(nbd_err_name(NBD_EOVERFLOW), "NBD_EOVERFLOW");
	assert_string_equal(nbd_err_name(NBD_ENOTSUP), "NBD_ENOTSUP");
	assert_string_equal(nbd_err_name(NBD_ESHUTDOWN), "NBD_ESHUTDOWN");
	assert_string_equal(nbd_err_name(2), "unknown");
	assert_string_equal(nbd_err_name(UINT32_MAX), "unknown");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_bytes_big_endian_unaligned),
	    cmocka_unit_test(test_greeting),
	    cmocka_unit_test(test_client_flags),
	    cmocka_unit_test(test_option),
	    cmocka_unit_test(test_option_reply),
	    cmocka_unit_test(test_export_name_reply),
	    cmocka_unit_test(test_info_items),
	    cmocka_unit_test(test_opt_go_valid),
	    cmocka_unit_test(test_opt_go_name_limits),
	    cmocka_unit_test(test_opt_go_malformed),
	    cmocka_unit_test(test_opt_meta_valid),
	    cmocka_unit_test(test_opt_meta_string_limits),
	    cmocka_unit_test(test_opt_meta_malformed),
	    cmocka_unit_test(test_meta_query_valid),
	    cmocka_unit_test(test_meta_selects_base_allocation),
	    cmocka_unit_test(test_request_compact_bytes),
	    cmocka_unit_test(test_request_extended_bytes),
	    cmocka_unit_test(test_request_round_trip_extremes),
	    cmocka_unit_test(test_request_short_and_bad_magic),
	    cmocka_unit_test(test_check_request_table),
	    cmocka_unit_test(test_simple_reply),
	    cmocka_unit_test(test_structured_chunk_header),
	    cmocka_unit_test(test_extended_chunk_header),
	    cmocka_unit_test(test_decode_reply_bad_magic),
	    cmocka_unit_test(test_offset_data_and_hole),
	    cmocka_unit_test(test_error_chunk),
	    cmocka_unit_test(test_block_status_compact),
	    cmocka_unit_test(test_block_status_extended),
	    cmocka_unit_test(test_error_from_errno),
	    cmocka_unit_test(test_names),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
