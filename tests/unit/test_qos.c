/*
 * tests/unit/test_qos.c: the QoS module (daemon/qos.h): the token bucket
 * as pure arithmetic on an injected clock (rate, burst, a request above
 * the burst taken when full and paid back as debt, limits changed in
 * place), the limiter's admission of export and client buckets together,
 * client buckets shared by key and kept after their last reference until
 * they are full again (at most QOS_IDLE_CLIENTS_MAX of them, the soonest
 * full dropped first), the client key of a peer, and the limits' key=value
 * syntax.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>

#include "daemon/access.h"
#include "daemon/qos.h"

#define S 1000000000ull /* a second in ns */
#define MS 1000000ull

static void test_bucket_rate(void **state)
{
	(void)state;
	struct qos_bucket b = {0};
	uint64_t t = 5 * S;
	/* Unlimited: never waits, takes nothing. */
	assert_int_equal(qos_bucket_wait(&b, 1000, t), 0);
	qos_bucket_set(&b, 100, 0, t); /* 100 a second, burst one second's */
	assert_int_equal(b.burst, 100);
	/* Starts full: 100 at once, then one every 10 ms. */
	for (int i = 0; i < 100; i++) {
		assert_int_equal(qos_bucket_wait(&b, 1, t), 0);
		qos_bucket_take(&b, 1, t);
	}
	uint64_t w = qos_bucket_wait(&b, 1, t);
	assert_true(w >= 10 * MS && w <= 10 * MS + 2);
	assert_true(qos_bucket_wait(&b, 1, t + 9 * MS) > 0);
	assert_int_equal(qos_bucket_wait(&b, 1, t + 10 * MS), 0);
	/* Over 10 s at the rate: 1000 more, no more. */
	unsigned taken = 0;
	for (uint64_t now = t + 10 * MS; now < t + 10 * S; now += MS) {
		while (qos_bucket_wait(&b, 1, now) == 0) {
			qos_bucket_take(&b, 1, now);
			taken++;
		}
	}
	assert_true(taken >= 999 && taken <= 1000);
	/* Idle: it fills up to its burst, never above. */
	t += 100 * S;
	for (int i = 0; i < 100; i++) {
		assert_int_equal(qos_bucket_wait(&b, 1, t), 0);
		qos_bucket_take(&b, 1, t);
	}
	assert_true(qos_bucket_wait(&b, 1, t) > 0);
	/* A cost of 0 never waits, even in debt. */
	assert_int_equal(qos_bucket_wait(&b, 0, t), 0);
}

static void test_bucket_debt(void **state)
{
	(void)state;
	struct qos_bucket b = {0};
	uint64_t t = S;
	qos_bucket_set(&b, 1000, 1000, t); /* 1000 bytes a second */
	/* 4000 bytes, above the burst: taken when full, then 3 s of debt. */
	assert_int_equal(qos_bucket_wait(&b, 4000, t), 0);
	qos_bucket_take(&b, 4000, t);
	uint64_t w = qos_bucket_wait(&b, 1, t);
	assert_true(w >= 3001 * MS && w <= 3001 * MS + 2);
	/* The next large one waits until the bucket is full again: 4 s. */
	w = qos_bucket_wait(&b, 4000, t);
	assert_true(w >= 4 * S && w <= 4 * S + 2);
	assert_int_equal(qos_bucket_wait(&b, 4000, t + 4 * S), 0);
}

static void test_bucket_change(void **state)
{
	(void)state;
	struct qos_bucket b = {0};
	uint64_t t = S;
	qos_bucket_set(&b, 10, 0, t);
	for (int i = 0; i < 10; i++)
		qos_bucket_take(&b, 1, t);
	/* Half a second at 10: 5 earned; the new rate keeps them. */
	qos_bucket_set(&b, 1000, 0, t + S / 2);
	assert_int_equal(b.burst, 1000);
	double k = qos_bucket_tokens(&b, t + S / 2);
	assert_true(k > 4.99 && k < 5.01);
	assert_int_equal(qos_bucket_wait(&b, 5, t + S / 2), 0);
	/* A smaller burst cuts what it holds. */
	qos_bucket_set(&b, 1000, 0, t + 10 * S);
	qos_bucket_set(&b, 2, 3, t + 10 * S);
	assert_true(qos_bucket_tokens(&b, t + 10 * S) <= 3.0);
	/* Unlimited, then limited again: full. */
	qos_bucket_set(&b, 0, 0, t + 11 * S);
	assert_int_equal(qos_bucket_wait(&b, 100, t + 11 * S), 0);
	qos_bucket_set(&b, 7, 0, t + 12 * S);
	k = qos_bucket_tokens(&b, t + 12 * S);
	assert_true(k > 6.99 && k < 7.01);
}

static void test_limiter(void **state)
{
	(void)state;
	struct qos_limiter *q = qos_limiter_new();
	assert_non_null(q);
	assert_false(qos_limiter_active(q));
	uint64_t t = S;
	struct qos_limits l = {0};
	char err[256];
	assert_int_equal(qos_limits_set(&l, "iops-limit", "10", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "client-iops-limit", "4", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "client-bytes-limit", "8K", err, sizeof(err)), 1);
	qos_limiter_set(q, &l, t);
	assert_true(qos_limiter_active(q));
	struct qos_client *a1 = qos_client_get(q, "uid:0", t);
	struct qos_client *a2 = qos_client_get(q, "uid:0", t);
	struct qos_client *b = qos_client_get(q, "uid:1000", t);
	assert_ptr_equal(a1, a2); /* one client, one bucket */
	assert_ptr_not_equal(a1, b);
	/* a's 4 between its two connections, then it waits; b has its own. */
	for (int i = 0; i < 4; i++)
		assert_int_equal(qos_admit(q, i % 2 ? a1 : a2, 1, 0, t), 0);
	assert_true(qos_admit(q, a1, 1, 0, t) > 0);
	for (int i = 0; i < 4; i++)
		assert_int_equal(qos_admit(q, b, 1, 0, t), 0);
	/* The export's 10: 8 taken, 2 left for anyone without a client bucket. */
	assert_int_equal(qos_admit(q, NULL, 1, 0, t), 0);
	assert_int_equal(qos_admit(q, NULL, 1, 0, t), 0);
	uint64_t w = qos_admit(q, NULL, 1, 0, t);
	assert_true(w >= 100 * MS && w <= 100 * MS + 2);
	/* Refused: nothing taken from any bucket. */
	struct qos_client *c = qos_client_get(q, "uid:2", t);
	assert_true(qos_admit(q, c, 1, 0, t) > 0);
	assert_true(qos_bucket_tokens(&c->iops, t) > 3.99);
	/* Bytes: a client's 8 KiB a second. */
	assert_int_equal(qos_admit(q, c, 0, 8192, t + S), 0);
	w = qos_admit(q, c, 0, 4096, t + S);
	assert_true(w >= S / 2 && w <= S / 2 + 2);
	/* Limits changed in place: clients follow; off is unlimited. */
	struct qos_limits off = {0};
	qos_limiter_set(q, &off, t + S);
	assert_false(qos_limiter_active(q));
	assert_int_equal(qos_admit(q, a1, 1, 1 << 30, t + S), 0);
	qos_count_throttled(q, true, 0);
	qos_count_throttled(q, false, 5 * MS);
	struct qos_stats st;
	qos_limiter_get(q, &st);
	assert_int_equal(st.throttled_requests, 1);
	assert_int_equal(st.throttled_ns, 5 * MS);
	assert_int_equal(st.clients, 3);
	assert_int_equal(st.idle_clients, 0);
	/* Unlimited now: their buckets are full, freed with their last put. */
	qos_client_put(q, a1, t + S);
	qos_client_put(q, a2, t + S);
	qos_client_put(q, b, t + S);
	qos_client_put(q, c, t + S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 0);
	assert_int_equal(st.idle_clients, 0);
	qos_limiter_free(q);
}

/* A client that empties its bucket and reconnects finds it empty: its
 * buckets outlive its last connection until they are full again. */
static void test_client_idle(void **state)
{
	(void)state;
	struct qos_limiter *q = qos_limiter_new();
	assert_non_null(q);
	uint64_t t = S;
	struct qos_limits l = {0};
	char err[256];
	assert_int_equal(qos_limits_set(&l, "client-iops-limit", "10", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "client-bytes-limit", "4K", err, sizeof(err)), 1);
	qos_limiter_set(q, &l, t);
	struct qos_client *a = qos_client_get(q, "uid:0", t);
	for (int i = 0; i < 10; i++)
		assert_int_equal(qos_admit(q, a, 1, 0, t), 0);
	assert_true(qos_admit(q, a, 1, 0, t) > 0);
	/* Gone and back within the second: the same bucket, still empty. */
	qos_client_put(q, a, t);
	struct qos_stats st;
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 1);
	assert_int_equal(st.idle_clients, 1);
	struct qos_client *a2 = qos_client_get(q, "uid:0", t + 100 * MS);
	qos_limiter_get(q, &st);
	assert_int_equal(st.idle_clients, 0);
	assert_int_equal(qos_admit(q, a2, 1, 0, t + 100 * MS), 0); /* one earned */
	uint64_t w = qos_admit(q, a2, 1, 0, t + 100 * MS);
	assert_true(w >= 100 * MS && w <= 100 * MS + 2);
	/* 100 connections of connect, burst, disconnect in 1 s: the rate, not
	 * 100 bursts. */
	unsigned got = 0;
	qos_client_put(q, a2, t + 100 * MS);
	for (uint64_t now = t + 110 * MS; now < t + 1110 * MS; now += 10 * MS) {
		struct qos_client *x = qos_client_get(q, "uid:0", now);
		while (qos_admit(q, x, 1, 0, now) == 0)
			got++;
		qos_client_put(q, x, now);
	}
	assert_true(got >= 9 && got <= 11);
	/* The bytes bucket keeps it too: 8 KiB taken (4 KiB into debt) at
	 * t + 2 s make it full at t + 4 s (its requests' one is sooner). */
	uint64_t t2 = t + 2 * S;
	struct qos_client *y = qos_client_get(q, "uid:0", t2);
	assert_int_equal(qos_admit(q, y, 1, 8192, t2), 0);
	qos_client_put(q, y, t2);
	struct qos_client *other = qos_client_get(q, "uid:1", t2 + S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 2); /* uid:0 still refilling */
	assert_int_equal(st.idle_clients, 1);
	qos_client_put(q, other, t2 + S); /* full: freed at once */
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 1);
	/* Full again at t + 4 s: the next get or put frees it. */
	struct qos_client *z = qos_client_get(q, "uid:2", t + 4 * S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 1);
	assert_int_equal(st.idle_clients, 0);
	qos_client_put(q, z, t + 4 * S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 0);
	/* A limit removed: idle buckets are full, and go. */
	y = qos_client_get(q, "uid:0", t + 5 * S);
	qos_admit(q, y, 5, 0, t + 5 * S);
	qos_client_put(q, y, t + 5 * S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.idle_clients, 1);
	struct qos_limits off = {0};
	qos_limiter_set(q, &off, t + 5 * S);
	qos_limiter_get(q, &st);
	assert_int_equal(st.clients, 0);
	assert_int_equal(st.idle_clients, 0);
	qos_limiter_free(q);
}

/* At most QOS_IDLE_CLIENTS_MAX idle clients; past that the one full
 * soonest (the smallest debt) goes. The limiter frees the rest. */
static void test_client_idle_cap(void **state)
{
	(void)state;
	struct qos_limiter *q = qos_limiter_new();
	assert_non_null(q);
	uint64_t t = S;
	struct qos_limits l = {0};
	char err[256];
	assert_int_equal(qos_limits_set(&l, "client-iops-limit", "1", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "client-iops-burst", "1000", err, sizeof(err)), 1);
	qos_limiter_set(q, &l, t);
	char key[32];
	/* Client k takes (k % 900) + 1 tokens: full again that many s on. */
	for (unsigned k = 0; k < QOS_IDLE_CLIENTS_MAX + 10; k++) {
		snprintf(key, sizeof(key), "uid:%u", k);
		struct qos_client *cl = qos_client_get(q, key, t);
		assert_non_null(cl);
		assert_int_equal(qos_admit(q, cl, (k % 900) + 1, 0, t), 0);
		qos_client_put(q, cl, t);
	}
	struct qos_stats st;
	qos_limiter_get(q, &st);
	assert_int_equal(st.idle_clients, QOS_IDLE_CLIENTS_MAX);
	assert_int_equal(st.clients, QOS_IDLE_CLIENTS_MAX);
	/* The 10 full soonest went (one or two tokens taken: k = 0, 1, 900,
	 * 901, ...); one that took 900 is kept, as it left its bucket. */
	struct qos_client *kept = qos_client_get(q, "uid:899", t);
	assert_true(qos_bucket_tokens(&kept->iops, t) < 101.0);
	qos_client_put(q, kept, t);
	struct qos_client *fresh = qos_client_get(q, "uid:0", t);
	assert_true(qos_bucket_tokens(&fresh->iops, t) > 999.0);
	qos_client_put(q, fresh, t);
	qos_limiter_free(q); /* idle ones included: no leak under ASan */
}

static void test_keys(void **state)
{
	(void)state;
	struct qos_limits l = {0};
	char err[256];
	assert_int_equal(qos_limits_set(&l, "bytes-limit", "100M", err, sizeof(err)), 1);
	assert_int_equal(l.bytes.rate, 100u << 20);
	assert_int_equal(qos_limits_set(&l, "bytes-burst", "1G", err, sizeof(err)), 1);
	assert_int_equal(l.bytes.burst, 1u << 30);
	assert_int_equal(qos_limits_set(&l, "bytes-limit", "off", err, sizeof(err)), 1);
	assert_int_equal(l.bytes.rate, 0);
	assert_int_equal(qos_limits_set(&l, "iops-burst", "20", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "client-iops-burst", "0", err, sizeof(err)), 1);
	assert_int_equal(qos_limits_set(&l, "readonly", "1", err, sizeof(err)), 0);
	assert_int_equal(qos_limits_set(&l, "iops-limit", "-1", err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "iops-limit -1"));
	assert_int_equal(qos_limits_set(&l, "client-bytes-limit", "2P", err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "client-bytes-limit 2P: expected bytes a second"));
	assert_int_equal(qos_limits_set(&l, "iops-limit", "2048T", err, sizeof(err)), -EINVAL);
	assert_false(qos_limits_any(&l));
	assert_true(qos_is_key("client-bytes-burst"));
	assert_false(qos_is_key("client-bytes"));

	struct access_peer p = {0};
	char key[300];
	p.addr[10] = p.addr[11] = 0xff;
	p.addr[12] = 127, p.addr[15] = 1;
	p.port = 5000;
	qos_client_key(&p, key, sizeof(key));
	assert_string_equal(key, "ip:127.0.0.1"); /* not the port */
	p.has_identity = true;
	snprintf(p.identity, sizeof(p.identity), "alice");
	qos_client_key(&p, key, sizeof(key));
	assert_string_equal(key, "tls:alice");
	p = (struct access_peer){.is_unix = true, .has_cred = true, .uid = 65534};
	qos_client_key(&p, key, sizeof(key));
	assert_string_equal(key, "uid:65534");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_bucket_rate),	  cmocka_unit_test(test_bucket_debt),
	    cmocka_unit_test(test_bucket_change), cmocka_unit_test(test_limiter),
	    cmocka_unit_test(test_client_idle),	  cmocka_unit_test(test_client_idle_cap),
	    cmocka_unit_test(test_keys),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
