/*
 * tests/unit/test_upgrade_record.c: the state record of a live upgrade
 * (daemon/upgrade_record.h): every type round-trips, and a record from
 * another version, with another magic, cut short, longer than its fields,
 * with a descriptor missing or one too many, or with a field out of its
 * bounds is refused with a message saying which.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>

#include "daemon/upgrade_record.h"
#include "proto/nbd.h"

static uint8_t buf[UPGRADE_RECORD_MAX];
static struct upgrade_record r;
static char why[256];

static int decode(size_t len, unsigned nfds)
{
	why[0] = '\0';
	return upgrade_record_decode(buf, len, nfds, &r, why, sizeof(why));
}

static void test_round_trips(void **state)
{
	(void)state;
	size_t n = upgrade_record_hello(buf, 4242);
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.type, UPGRADE_HELLO);
	assert_int_equal(r.pid, 4242);

	n = upgrade_record_listener(buf, UPGRADE_LISTEN_UNIX, "/run/nbd.sock,mode=0660");
	assert_int_equal(decode(n, 1), 0);
	assert_int_equal(r.kind, UPGRADE_LISTEN_UNIX);
	assert_string_equal(r.spec, "/run/nbd.sock,mode=0660");
	n = upgrade_record_listener(buf, UPGRADE_LISTEN_ACTIVATED, "");
	assert_int_equal(decode(n, 1), 0);
	assert_string_equal(r.spec, "");

	static struct upgrade_conn_state c;
	memset(&c, 0, sizeof(c));
	c.id = 7;
	c.age_ms = 123456;
	c.requests = 1u << 20;
	c.bytes_read = 1ull << 40;
	c.bytes_written = 3;
	c.payload_copied = 4;
	c.size = 1ull << 62;
	c.tx_flags = 0x1234;
	c.flags = UPGRADE_CONN_STRUCTURED | UPGRADE_CONN_META;
	c.upgrades = 41;
	c.min_block = 512;
	c.pref_block = 4096;
	c.max_payload = 32u << 20;
	strcpy(c.name, "vol1");
	const uint8_t pending[5] = {0x25, 0x60, 0x95, 0x13, 0};
	c.pending = pending;
	c.pending_len = sizeof(pending);
	n = upgrade_record_connection(buf, &c);
	assert_int_equal(decode(n, 1), 0);
	assert_int_equal(r.type, UPGRADE_CONNECTION);
	assert_int_equal(r.conn.id, 7);
	assert_int_equal(r.conn.age_ms, 123456);
	assert_int_equal(r.conn.requests, 1u << 20);
	assert_true(r.conn.bytes_read == 1ull << 40);
	assert_int_equal(r.conn.bytes_written, 3);
	assert_int_equal(r.conn.payload_copied, 4);
	assert_true(r.conn.size == 1ull << 62);
	assert_int_equal(r.conn.tx_flags, 0x1234);
	assert_int_equal(r.conn.flags, UPGRADE_CONN_STRUCTURED | UPGRADE_CONN_META);
	assert_int_equal(r.conn.upgrades, 41);
	assert_int_equal(r.conn.min_block, 512);
	assert_int_equal(r.conn.pref_block, 4096);
	assert_int_equal(r.conn.max_payload, 32u << 20);
	assert_string_equal(r.conn.name, "vol1");
	assert_int_equal(r.conn.pending_len, 5);
	assert_memory_equal(r.conn.pending, pending, 5);

	n = upgrade_record_end(buf, 1000, 3);
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.connections, 1000);
	assert_int_equal(r.listeners, 3);
	n = upgrade_record_taken(buf, 999);
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.connections, 999);
	n = upgrade_record_commit(buf);
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.type, UPGRADE_COMMIT);
	n = upgrade_record_error(buf, "config: line 3: unknown key");
	assert_int_equal(decode(n, 0), 0);
	assert_string_equal(r.text, "config: line 3: unknown key");
}

static void test_versions(void **state)
{
	(void)state;
	size_t n = upgrade_record_hello(buf, 1);
	nbd_put16(buf + 4, UPGRADE_RECORD_VERSION + 1);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "version 2, this daemon reads version 1"));
	nbd_put16(buf + 4, UPGRADE_RECORD_VERSION - 1);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "version 0"));
	n = upgrade_record_hello(buf, 1);
	buf[0] ^= 1;
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "not a state record"));
	n = upgrade_record_hello(buf, 1);
	nbd_put16(buf + 6, 99);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "unknown type 99"));
}

static void test_truncated(void **state)
{
	(void)state;
	static struct upgrade_conn_state c;
	memset(&c, 0, sizeof(c));
	c.id = 9;
	strcpy(c.name, "x");
	size_t n = upgrade_record_connection(buf, &c);
	/* Cut anywhere: refused, never read past the end. */
	for (size_t cut = 0; cut < n; cut++)
		assert_int_equal(decode(cut, 1), -EPROTO);
	assert_int_equal(decode(10, 1), -EPROTO);
	assert_non_null(strstr(why, "shorter than its header"));
	assert_int_equal(decode(n - 1, 1), -EPROTO);
	assert_non_null(strstr(why, "cut short"));
	/* A length field that agrees with the shorter message: still short. */
	nbd_put32(buf + 8, (uint32_t)(n - 1 - UPGRADE_RECORD_HEADER));
	assert_int_equal(decode(n - 1, 1), -EPROTO);
	assert_non_null(strstr(why, "CONNECTION record cut short"));
	/* One byte too many, announced. */
	n = upgrade_record_taken(buf, 1);
	buf[n] = 0;
	nbd_put32(buf + 8, 5);
	assert_int_equal(decode(n + 1, 0), -EPROTO);
	assert_non_null(strstr(why, "1 bytes more than its fields"));
}

static void test_descriptors(void **state)
{
	(void)state;
	static struct upgrade_conn_state c;
	memset(&c, 0, sizeof(c));
	strcpy(c.name, "vol");
	size_t n = upgrade_record_connection(buf, &c);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "1 descriptor(s) announced and 0 received"));
	assert_int_equal(decode(n, 2), -EPROTO);
	n = upgrade_record_hello(buf, 5);
	assert_int_equal(decode(n, 1), -EPROTO);
	nbd_put32(buf + 12, 1);
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "expected 0"));
}

static void test_bounds(void **state)
{
	(void)state;
	static struct upgrade_conn_state c;
	memset(&c, 0, sizeof(c));
	assert_int_equal(upgrade_record_connection(buf, &c), 0); /* no name */
	strcpy(c.name, "v");
	c.pending_len = UPGRADE_MAX_PENDING + 1;
	assert_int_equal(upgrade_record_connection(buf, &c), 0);
	c.pending_len = 0;
	c.flags = 0x80;
	assert_int_equal(upgrade_record_connection(buf, &c), 0);
	c.flags = 0;
	size_t n = upgrade_record_connection(buf, &c);
	/* flags at header + 7 * 8 + 2; upgrades and the block sizes after them
	 * (16 bytes), then the name */
	buf[UPGRADE_RECORD_HEADER + 58] = 0x40;
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "unknown flags 0x40"));
	n = upgrade_record_connection(buf, &c);
	nbd_put16(buf + UPGRADE_RECORD_HEADER + 75, 0); /* the name's length */
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "an export name of 0 bytes"));
	n = upgrade_record_connection(buf, &c);
	buf[UPGRADE_RECORD_HEADER + 77] = '\0'; /* the name itself */
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "a NUL in the export name"));
	n = upgrade_record_connection(buf, &c);
	nbd_put32(buf + UPGRADE_RECORD_HEADER + 78, UPGRADE_MAX_PENDING + 1);
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "pending input, at most"));
	n = upgrade_record_listener(buf, UPGRADE_LISTEN_TCP, "127.0.0.1:10809");
	buf[UPGRADE_RECORD_HEADER] = 9;
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "unknown kind 9"));
	n = upgrade_record_hello(buf, 5);
	nbd_put32(buf + UPGRADE_RECORD_HEADER, 0);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "pid 0"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_round_trips), cmocka_unit_test(test_versions),
	    cmocka_unit_test(test_truncated),	cmocka_unit_test(test_descriptors),
	    cmocka_unit_test(test_bounds),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
