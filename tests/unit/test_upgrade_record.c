/*
 * tests/unit/test_upgrade_record.c: the state record of a live upgrade
 * (daemon/upgrade_record.h): every type round-trips (CONNECTION with and
 * without its backend's identity, TAKEN plain and saying what it
 * closes), and a record from another version, with another magic, cut
 * short, longer than its fields, with a descriptor missing or one too
 * many, or with a field out of its bounds is refused with a message
 * saying which.
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
	/* Without UPGRADE_CONN_IDENTITY (an older daemon's): none. */
	assert_int_equal(r.conn.backend_kind, UPGRADE_BACKEND_NAMED);
	assert_string_equal(r.conn.backend, "");

	/* With the backend's identity: a file's, then a named backend's. */
	c.flags |= UPGRADE_CONN_IDENTITY;
	c.offset = 1ull << 33;
	c.backend_kind = UPGRADE_BACKEND_FILE;
	c.backend_dev = 0x803;
	c.backend_ino = 1ull << 50;
	strcpy(c.backend, "/srv/vol1.img");
	n = upgrade_record_connection(buf, &c);
	assert_int_equal(decode(n, 1), 0);
	assert_int_equal(r.conn.flags,
			 UPGRADE_CONN_STRUCTURED | UPGRADE_CONN_META | UPGRADE_CONN_IDENTITY);
	assert_true(r.conn.offset == 1ull << 33);
	assert_int_equal(r.conn.backend_kind, UPGRADE_BACKEND_FILE);
	assert_int_equal(r.conn.backend_dev, 0x803);
	assert_true(r.conn.backend_ino == 1ull << 50);
	assert_string_equal(r.conn.backend, "/srv/vol1.img");
	assert_memory_equal(r.conn.pending, pending, 5); /* still before it */
	c.backend_kind = UPGRADE_BACKEND_NAMED;
	c.backend_dev = c.backend_ino = 0;
	strcpy(c.backend, "nbd+unix:///disk?socket=/run/server.sock");
	n = upgrade_record_connection(buf, &c);
	assert_int_equal(decode(n, 1), 0);
	assert_int_equal(r.conn.backend_kind, UPGRADE_BACKEND_NAMED);
	assert_string_equal(r.conn.backend, "nbd+unix:///disk?socket=/run/server.sock");

	n = upgrade_record_end(buf, 1000, 3);
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.connections, 1000);
	assert_int_equal(r.listeners, 3);
	n = upgrade_record_taken(buf, 999, 0, "unused");
	assert_int_equal(n, UPGRADE_RECORD_HEADER + 4); /* what an older daemon reads */
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.connections, 999);
	assert_int_equal(r.closed, 0);
	assert_string_equal(r.text, "");
	n = upgrade_record_taken(buf, 5, 2, "conn 3: export \"x\" is on another backend now");
	assert_int_equal(decode(n, 0), 0);
	assert_int_equal(r.connections, 5);
	assert_int_equal(r.closed, 2);
	assert_string_equal(r.text, "conn 3: export \"x\" is on another backend now");
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
	n = upgrade_record_end(buf, 1, 1);
	buf[n] = 0;
	nbd_put32(buf + 8, 9);
	assert_int_equal(decode(n + 1, 0), -EPROTO);
	assert_non_null(strstr(why, "1 bytes more than its fields"));
	/* An identity cut anywhere; one without its flag is bytes too many. */
	c.flags = UPGRADE_CONN_IDENTITY;
	c.backend_kind = UPGRADE_BACKEND_FILE;
	c.backend_dev = 1;
	c.backend_ino = 2;
	strcpy(c.backend, "/a.img");
	n = upgrade_record_connection(buf, &c);
	for (size_t cut = 0; cut < n; cut++)
		assert_int_equal(decode(cut, 1), -EPROTO);
	assert_int_equal(decode(n, 1), 0);
	buf[UPGRADE_RECORD_HEADER + 58] = 0;
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "33 bytes more than its fields"));
	/* A TAKEN cut in its closing part. */
	n = upgrade_record_taken(buf, 2, 1, "why");
	for (size_t cut = UPGRADE_RECORD_HEADER + 5; cut < n; cut++) {
		nbd_put32(buf + 8, (uint32_t)(cut - UPGRADE_RECORD_HEADER));
		assert_int_equal(decode(cut, 0), -EPROTO);
		assert_non_null(strstr(why, "TAKEN record cut short"));
	}
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
	/* The identity: after the empty pending input (4 bytes at 78), u64
	 * offset at 82, u8 kind at 90, u64 dev at 91, u64 ino at 99, u16 at 107
	 * and the backend string at 109. */
	c.flags = UPGRADE_CONN_IDENTITY;
	c.backend_kind = UPGRADE_BACKEND_NAMED;
	assert_int_equal(upgrade_record_connection(buf, &c), 0); /* no backend string */
	c.backend_dev = 3;
	strcpy(c.backend, "nbd://server/x");
	assert_int_equal(upgrade_record_connection(buf, &c), 0); /* named, with a device */
	c.backend_dev = 0;
	n = upgrade_record_connection(buf, &c);
	assert_int_equal(decode(n, 1), 0);
	buf[UPGRADE_RECORD_HEADER + 90] = 2;
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "a backend of unknown kind 2"));
	n = upgrade_record_connection(buf, &c);
	nbd_put64(buf + UPGRADE_RECORD_HEADER + 99, 7);
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "named with a device and inode"));
	n = upgrade_record_connection(buf, &c);
	nbd_put16(buf + UPGRADE_RECORD_HEADER + 107, 0);
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "a backend string of 0 bytes"));
	n = upgrade_record_connection(buf, &c);
	buf[UPGRADE_RECORD_HEADER + 112] = '\0';
	assert_int_equal(decode(n, 1), -EPROTO);
	assert_non_null(strstr(why, "a NUL in the backend string"));
	/* TAKEN: closes at least one, at most what it took. */
	assert_int_equal(upgrade_record_taken(buf, 2, 3, "x"), 0);
	n = upgrade_record_taken(buf, 2, 2, "x");
	nbd_put32(buf + UPGRADE_RECORD_HEADER + 4, 3);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "closes 3 of 2 connections"));
	nbd_put32(buf + UPGRADE_RECORD_HEADER + 4, 0);
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "closes 0 of 2 connections"));
	n = upgrade_record_taken(buf, 2, 2, "xy");
	buf[n - 1] = '\0';
	assert_int_equal(decode(n, 0), -EPROTO);
	assert_non_null(strstr(why, "TAKEN record: 2 bytes of text, or with a NUL"));
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
