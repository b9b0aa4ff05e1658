/*
 * tests/unit/test_rbd_spec.c: the rbd: backend string (daemon/rbd_spec.h):
 * pool/image, pool/namespace/image, a snapshot, the conf, id and keyring
 * keys, and every malformed string refused with a message naming what is
 * wrong.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>

#include "daemon/rbd_spec.h"

static void test_pool_image(void **state)
{
	(void)state;
	struct rbd_spec s;
	char err[256];
	assert_int_equal(rbd_spec_parse("rbd:rbd/vol1", &s, err, sizeof(err)), 0);
	assert_string_equal(s.pool, "rbd");
	assert_string_equal(s.image, "vol1");
	assert_string_equal(s.ns, "");
	assert_string_equal(s.snap, "");
	assert_string_equal(s.conf, "");
	assert_true(rbd_spec_handles("rbd:x/y"));
	assert_false(rbd_spec_handles("/dev/rbd0"));
	assert_false(rbd_spec_handles("nbd://h/x"));
}

static void test_namespace_snap_query(void **state)
{
	(void)state;
	struct rbd_spec s;
	char err[256];
	assert_int_equal(rbd_spec_parse("rbd:p/tenant/img@monday?conf=/c/ceph.conf&id=nbd&"
					"keyring=/c/k",
					&s, err, sizeof(err)),
			 0);
	assert_string_equal(s.pool, "p");
	assert_string_equal(s.ns, "tenant");
	assert_string_equal(s.image, "img");
	assert_string_equal(s.snap, "monday");
	assert_string_equal(s.conf, "/c/ceph.conf");
	assert_string_equal(s.id, "nbd");
	assert_string_equal(s.keyring, "/c/k");
	assert_int_equal(rbd_spec_parse("rbd:p/img?id=a", &s, err, sizeof(err)), 0);
	assert_string_equal(s.id, "a");
	assert_string_equal(s.image, "img");
}

static void refused(const char *spec, const char *words)
{
	struct rbd_spec s;
	char err[256] = "";
	int rc = rbd_spec_parse(spec, &s, err, sizeof(err));
	if (rc != -EINVAL || !strstr(err, words)) {
		fprintf(stderr, "%s: rc %d, err '%s', expected '%s'\n", spec, rc, err, words);
		fail();
	}
}

static void test_refused(void **state)
{
	(void)state;
	refused("rbd:", "expected rbd:POOL/IMAGE");
	refused("rbd:pool", "expected rbd:POOL/IMAGE");
	refused("rbd:/img", "bad pool name");
	refused("rbd:pool/", "bad image name");
	refused("rbd:a/b/c/d", "expected rbd:POOL/IMAGE");
	refused("rbd:a//c", "bad namespace name");
	refused("rbd:a/b@", "bad snapshot name");
	refused("rbd:a/b@s@t", "bad snapshot name");
	refused("rbd:a/b?", "nothing after '?'");
	refused("rbd:a/b?conf", "expected KEY=VALUE");
	refused("rbd:a/b?=x", "expected KEY=VALUE");
	refused("rbd:a/b?user=x", "unknown key 'user'");
	refused("rbd:a/b?id=", "empty or too long");
	refused("rbd:a/b?id=x&id=y", "id given twice");
	refused("rbd:a/b?id=x&", "nothing after the last '&'");
	refused("rbd:a/b\x01", "bad image name");
	refused("nbd://x", "not an rbd: backend");
	char long_name[400];
	memset(long_name, 'x', sizeof(long_name));
	memcpy(long_name, "rbd:p/", 6);
	long_name[sizeof(long_name) - 1] = '\0';
	refused(long_name, "bad image name");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_pool_image),
	    cmocka_unit_test(test_namespace_snap_query),
	    cmocka_unit_test(test_refused),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
