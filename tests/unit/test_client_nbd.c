/*
 * tests/unit/test_client_nbd.c: the client library's NBD client
 * (client/lib/nbd.h) against a scripted server.
 *
 * The "server" is the other end of a socketpair: each test writes the
 * server's bytes (built with proto/nbd.h) into it before the client runs,
 * since they fit in the socket buffer, then reads what the client sent and
 * decodes it. Checked: the handshake's flags, option haggling up to GO and
 * what it learns, LIST entries (and a malformed, too short one), READ through simple and structured replies (holes, data,
 * the bytes delivered), and the replies a client must refuse (overlapping
 * or missing chunks, a wrong cookie) or report (an NBD error).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/lib/nbd.h"
#include "client/lib/report.h"
#include "proto/nbd.h"

static struct nbd_client client; /* large: holds the option payload buffer */
static int server = -1;

static int setup(void **state)
{
	int sv[2];

	(void)state;
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	nbd_client_init(&client, sv[0], false);
	server = sv[1];
	return 0;
}

static int teardown(void **state)
{
	(void)state;
	close(client.fd);
	close(server);
	return 0;
}

static void server_send(const void *buf, size_t length)
{
	assert_int_equal(write(server, buf, length), (ssize_t)length);
}

static void server_receive(void *buf, size_t length)
{
	assert_int_equal(read(server, buf, length), (ssize_t)length);
}

/* One option reply with its payload. */
static void server_option_reply(uint32_t option, uint32_t type, const void *payload,
				uint32_t length)
{
	uint8_t header[NBD_OPTION_REPLY_HEADER_SIZE];

	server_send(header, nbd_encode_option_reply(header, option, type, length));
	if (length)
		server_send(payload, length);
}

static void server_chunk(uint16_t flags, uint16_t type, uint64_t cookie, const void *payload,
			 size_t length)
{
	uint8_t header[NBD_CHUNK_HEADER_MAX];

	server_send(header, nbd_encode_chunk_header(header, client.extended, flags, type, cookie, 0,
						    length));
	server_send(payload, length);
}

/* ---- Handshake and haggling. ---- */

static void test_handshake_flags(void **state)
{
	uint8_t buf[NBD_GREETING_SIZE];
	uint32_t flags;

	(void)state;
	server_send(buf, nbd_encode_greeting(buf, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES));
	assert_int_equal(nbd_client_handshake(&client), 0);
	assert_true(client.no_zeroes);
	server_receive(buf, NBD_CLIENT_FLAGS_SIZE);
	assert_int_equal(nbd_decode_client_flags(buf, NBD_CLIENT_FLAGS_SIZE, &flags), 0);
	assert_int_equal(flags, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES);
}

static void test_handshake_needs_fixed_newstyle(void **state)
{
	uint8_t buf[NBD_GREETING_SIZE];

	(void)state;
	server_send(buf, nbd_encode_greeting(buf, 0));
	assert_int_equal(nbd_client_handshake(&client), -EPROTO);
}

/* Extended headers acknowledged, then GO: the export and its block sizes. */
static void test_go(void **state)
{
	struct nbd_client_options o = {.export_name = "disk"};
	uint8_t info[NBD_INFO_BLOCK_SIZE_SIZE];

	(void)state;
	server_option_reply(NBD_OPT_EXTENDED_HEADERS, NBD_REP_ACK, NULL, 0);
	server_option_reply(NBD_OPT_GO, NBD_REP_INFO, info,
			    (uint32_t)nbd_encode_info_export(info, 1u << 20, NBD_FLAG_HAS_FLAGS));
	server_option_reply(NBD_OPT_GO, NBD_REP_INFO, info,
			    (uint32_t)nbd_encode_info_block_size(info, 512, 4096, 65536 + 100));
	server_option_reply(NBD_OPT_GO, NBD_REP_ACK, NULL, 0);
	assert_int_equal(nbd_client_go(&client, &o), 0);
	assert_true(client.extended && client.structured && !client.meta);
	assert_int_equal(client.size, 1u << 20);
	assert_int_equal(client.eflags, NBD_FLAG_HAS_FLAGS);
	assert_true(client.have_block_size);
	/* At most the maximum block size, cut to a multiple of the minimum. */
	assert_int_equal(client.max_payload, 65536);
	assert_true(nbd_client_max_effect(&client) == UINT64_MAX);
}

static void test_go_refused(void **state)
{
	struct nbd_client_options o = {.export_name = "nosuch", .no_extended = true};

	(void)state;
	server_option_reply(NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, NULL, 0);
	server_option_reply(NBD_OPT_GO, NBD_REP_ERR_UNKNOWN, "no such export", 14);
	assert_int_equal(nbd_client_go(&client, &o), -EREMOTEIO);
	assert_true(client.structured && !client.extended);
}

/* ---- LIST. ---- */

static int listed;

static void count_entry(void *opaque, const char *name, size_t name_length,
			const char *description, size_t description_length)
{
	(void)opaque;
	(void)name;
	(void)description;
	assert_true(name_length <= 64 && description_length <= 64);
	listed++;
}

static void test_list(void **state)
{
	uint8_t entry[4 + 4 + 5] = {0, 0, 0, 4, 'd', 'i', 's', 'k', 'a', ' ', 'd', 'i', 's'};

	(void)state;
	listed = 0;
	server_option_reply(NBD_OPT_LIST, NBD_REP_SERVER, entry, sizeof(entry));
	server_option_reply(NBD_OPT_LIST, NBD_REP_ACK, NULL, 0);
	server_option_reply(NBD_OPT_ABORT, NBD_REP_ACK, NULL, 0); /* LIST ends with ABORT */
	assert_int_equal(nbd_client_list(&client, count_entry, NULL), 0);
	assert_int_equal(listed, 1);
}

/* A server entry shorter than its name's length field is malformed (a
 * 3-byte one wrapped the length check around and read past the payload). */
static void test_list_short_entry(void **state)
{
	uint8_t entry[3] = {0, 0, 0};

	(void)state;
	listed = 0;
	server_option_reply(NBD_OPT_LIST, NBD_REP_SERVER, entry, sizeof(entry));
	assert_int_equal(nbd_client_list(&client, count_entry, NULL), -EPROTO);
	assert_int_equal(listed, 0);
}

/* Without extended headers an effect length is 32 bits, block aligned. */
static void test_max_effect_compact(void **state)
{
	(void)state;
	client.min_block = 512;
	assert_true(nbd_client_max_effect(&client) == 0xfffff000u);
	client.min_block = 65536;
	assert_true(nbd_client_max_effect(&client) == 0xffff0000u);
}

/* ---- Transmission. ---- */

static uint8_t data[8], map[8 / 8 + 1];

static struct nbd_transaction read_of(uint64_t offset, uint64_t length)
{
	memset(data, 0xee, sizeof(data));
	return (struct nbd_transaction){.command = "read",
					.type = NBD_CMD_READ,
					.offset = offset,
					.length = length,
					.data = data,
					.map = map};
}

static void test_read_simple(void **state)
{
	struct nbd_transaction t = read_of(4096, 8);
	uint8_t buf[NBD_EXTENDED_REQUEST_SIZE];
	struct nbd_request req;

	(void)state;
	server_send(buf, nbd_encode_simple_reply(buf, 1, 0));
	server_send("abcdefgh", 8);
	assert_int_equal(nbd_client_transact(&client, &t, NULL), 0);
	assert_memory_equal(data, "abcdefgh", 8);
	server_receive(buf, NBD_REQUEST_SIZE);
	assert_int_equal(nbd_decode_request(buf, NBD_REQUEST_SIZE, false, &req), 0);
	assert_int_equal(req.type, NBD_CMD_READ);
	assert_int_equal(req.cookie, 1);
	assert_int_equal(req.offset, 4096);
	assert_int_equal(req.length, 8);
}

static void test_read_error(void **state)
{
	struct nbd_transaction t = read_of(0, 8);
	uint8_t buf[NBD_SIMPLE_REPLY_SIZE];

	(void)state;
	server_send(buf, nbd_encode_simple_reply(buf, 1, NBD_EIO));
	assert_int_equal(nbd_client_transact(&client, &t, NULL), -EREMOTEIO);
	assert_int_equal(t.error, NBD_EIO);
}

static void test_read_wrong_cookie(void **state)
{
	struct nbd_transaction t = read_of(0, 8);
	uint8_t buf[NBD_SIMPLE_REPLY_SIZE];

	(void)state;
	server_send(buf, nbd_encode_simple_reply(buf, 7, 0));
	assert_int_equal(nbd_client_transact(&client, &t, NULL), -EPROTO);
}

/* A hole and data that together cover the request. */
static void test_read_structured(void **state)
{
	struct nbd_transaction t = read_of(100, 8);
	uint8_t hole[NBD_OFFSET_HOLE_SIZE], piece[NBD_OFFSET_DATA_PREFIX_SIZE + 4];

	(void)state;
	client.structured = true;
	server_chunk(0, NBD_REPLY_TYPE_OFFSET_HOLE, 1, hole, nbd_encode_offset_hole(hole, 100, 4));
	nbd_encode_offset_data_prefix(piece, 104);
	memcpy(piece + NBD_OFFSET_DATA_PREFIX_SIZE, "wxyz", 4);
	server_chunk(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_OFFSET_DATA, 1, piece, sizeof(piece));
	assert_int_equal(nbd_client_transact(&client, &t, NULL), 0);
	assert_memory_equal(data, "\0\0\0\0wxyz", 8);
}

static void test_read_overlap(void **state)
{
	struct nbd_transaction t = read_of(0, 8);
	uint8_t hole[NBD_OFFSET_HOLE_SIZE];

	(void)state;
	client.structured = true;
	server_chunk(0, NBD_REPLY_TYPE_OFFSET_HOLE, 1, hole, nbd_encode_offset_hole(hole, 0, 8));
	server_chunk(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_OFFSET_HOLE, 1, hole,
		     nbd_encode_offset_hole(hole, 4, 4));
	assert_int_equal(nbd_client_transact(&client, &t, NULL), -EPROTO);
}

static void test_read_gap(void **state)
{
	struct nbd_transaction t = read_of(0, 8);
	uint8_t hole[NBD_OFFSET_HOLE_SIZE];

	(void)state;
	client.structured = true;
	server_chunk(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_OFFSET_HOLE, 1, hole,
		     nbd_encode_offset_hole(hole, 0, 4));
	assert_int_equal(nbd_client_transact(&client, &t, NULL), -EPROTO);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test_setup_teardown(test_handshake_flags, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_handshake_needs_fixed_newstyle, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_go, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_go_refused, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_list, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_list_short_entry, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_max_effect_compact, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_simple, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_error, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_wrong_cookie, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_structured, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_overlap, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_read_gap, setup, teardown),
	};

	report_set_program("test_client_nbd");
	return cmocka_run_group_tests(tests, NULL, NULL);
}
