/*
 * tests/fuzz/fuzz_upgrade_record.c: the state record of a live upgrade
 * (daemon/upgrade_record.c) as a broken or hostile peer could send it.
 * The first input byte is the number of descriptors that came with it
 * (0..2), the rest the message. Whatever is accepted keeps the promises
 * the new daemon relies on: every string is NUL-terminated within its
 * buffer, a connection's export name is not empty, its pending input lies
 * within the message and within UPGRADE_MAX_PENDING, its backend's
 * identity has a backend string when it has one at all, a TAKEN closes no
 * more connections than it took, and re-encoding it gives back the same
 * bytes; a refusal always says why.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/upgrade_record.h"
#include "tests/fuzz/fuzz.h"

static uint8_t again[UPGRADE_RECORD_MAX];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	unsigned nfds = data[0] % 3;
	const uint8_t *msg = data + 1;
	size_t len = size - 1;
	static struct upgrade_record r;
	char why[256] = "";
	int rc = upgrade_record_decode(msg, len, nfds, &r, why, sizeof(why));
	if (rc < 0) {
		CHECK(why[0] != '\0');
		return 0;
	}
	size_t n = 0;
	switch (r.type) {
	case UPGRADE_HELLO:
		CHECK(r.pid != 0);
		n = upgrade_record_hello(again, r.pid);
		break;
	case UPGRADE_LISTENER:
		CHECK(strnlen(r.spec, sizeof(r.spec)) < sizeof(r.spec));
		n = upgrade_record_listener(again, r.kind, r.spec);
		break;
	case UPGRADE_CONNECTION: {
		size_t name = strnlen(r.conn.name, sizeof(r.conn.name));
		CHECK(name > 0 && name < sizeof(r.conn.name));
		CHECK(r.conn.pending_len <= UPGRADE_MAX_PENDING);
		if (r.conn.pending_len) {
			CHECK(r.conn.pending >= msg);
			CHECK(r.conn.pending + r.conn.pending_len <= msg + len);
		}
		/* An identity has a backend string; a named backend no device. */
		size_t backend = strnlen(r.conn.backend, sizeof(r.conn.backend));
		CHECK(backend < sizeof(r.conn.backend));
		CHECK((backend > 0) == ((r.conn.flags & UPGRADE_CONN_IDENTITY) != 0));
		CHECK(r.conn.backend_kind == UPGRADE_BACKEND_FILE ||
		      (r.conn.backend_dev == 0 && r.conn.backend_ino == 0));
		n = upgrade_record_connection(again, &r.conn);
		break;
	}
	case UPGRADE_END:
		n = upgrade_record_end(again, r.connections, r.listeners);
		break;
	case UPGRADE_TAKEN:
		CHECK(r.closed <= r.connections);
		CHECK(strnlen(r.text, sizeof(r.text)) < sizeof(r.text));
		n = upgrade_record_taken(again, r.connections, r.closed, r.text);
		break;
	case UPGRADE_COMMIT:
		n = upgrade_record_commit(again);
		break;
	case UPGRADE_ERROR:
		CHECK(strnlen(r.text, sizeof(r.text)) < sizeof(r.text));
		n = upgrade_record_error(again, r.text);
		break;
	}
	CHECK(n == len);
	CHECK(memcmp(again, msg, len) == 0);
	return 0;
}
