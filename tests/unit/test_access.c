/*
 * tests/unit/test_access.c: the access rules (daemon/access.h): address
 * and CIDR syntax, matching with IPv4-mapped addresses, deny over allow,
 * user and group rules for Unix peers, and the lists as options give them.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>
#include <cmocka.h>
#include <errno.h>
#include <grp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/options.h"

static struct access_peer tcp_peer(const char *addr)
{
	struct access_peer p;
	struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons(5000)};
	struct sockaddr_in6 in6 = {.sin6_family = AF_INET6, .sin6_port = htons(5000)};
	if (inet_pton(AF_INET, addr, &in.sin_addr) == 1) {
		access_peer_from_socket(&p, -1, &in, sizeof(in));
	} else {
		assert_int_equal(inet_pton(AF_INET6, addr, &in6.sin6_addr), 1);
		access_peer_from_socket(&p, -1, &in6, sizeof(in6));
	}
	return p;
}

static bool allowed(const char *allow, const char *deny, const char *addr, char *why, size_t n)
{
	struct access_spec spec = {.allow = (char *)allow, .deny = (char *)deny};
	struct access_rules r;
	char err[256];
	assert_int_equal(access_rules_parse(&spec, &r, err, sizeof(err)), 0);
	struct access_peer p = tcp_peer(addr);
	bool ok = access_rules_allow(&r, &p, why, n);
	access_rules_free(&r);
	return ok;
}

static void test_syntax(void **state)
{
	(void)state;
	static const char *const good[] = {
	    "127.0.0.1",
	    "10.0.0.0/8",
	    "0.0.0.0/0",
	    "::1",
	    "fd00::/8",
	    "::/0",
	    "::ffff:10.0.0.0/104",
	    "1.2.3.4/32, 5.6.7.0/24 ::1/128",
	    "192.168.1.0/24,192.168.2.0/24",
	};
	static const char *const bad[] = {
	    "10.0.0.1/8",  /* host bits */ "10.0.0.0/33",
	    "::1/129",	   "300.1.1.1",
	    "10.0.0.0/",   "10.0.0.0/-1",
	    "10.0.0.0/08", "localhost",
	    "fd00::/8x",   "1.2.3.4/32,nonsense",
	};
	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
		struct access_net *v = NULL;
		size_t n = 0;
		char err[256] = "";
		assert_int_equal(access_parse_nets(good[i], &v, &n, err, sizeof(err)), 0);
		assert_true(n >= 1);
		free(v);
	}
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct access_net *v = NULL;
		size_t n = 0;
		char err[256] = "";
		assert_int_equal(access_parse_nets(bad[i], &v, &n, err, sizeof(err)), -EINVAL);
		assert_non_null(strstr(err, "is not an address or CIDR"));
	}
	struct access_net *v = NULL;
	size_t n = 0;
	char err[256];
	assert_int_equal(access_parse_nets("1.2.3.4 , 5.6.7.0/24", &v, &n, err, sizeof(err)), 0);
	assert_int_equal(n, 2);
	assert_int_equal(v[0].prefix, 128);
	assert_int_equal(v[1].prefix, 96 + 24);
	assert_string_equal(v[1].text, "5.6.7.0/24");
	free(v);
}

static void test_match(void **state)
{
	(void)state;
	char why[128];
	/* Empty lists: everyone. */
	assert_true(allowed(NULL, NULL, "127.0.0.2", why, sizeof(why)));
	assert_true(allowed("127.0.0.1", NULL, "127.0.0.1", why, sizeof(why)));
	assert_false(allowed("127.0.0.1", NULL, "127.0.0.2", why, sizeof(why)));
	assert_string_equal(why, "not in allow list (first: 127.0.0.1)");
	assert_true(allowed("127.0.0.0/8", NULL, "127.255.0.9", why, sizeof(why)));
	assert_false(allowed("127.0.0.0/8", NULL, "128.0.0.1", why, sizeof(why)));
	/* Deny wins over allow. */
	assert_false(allowed("127.0.0.0/8", "127.0.0.2", "127.0.0.2", why, sizeof(why)));
	assert_string_equal(why, "deny 127.0.0.2");
	assert_true(allowed("127.0.0.0/8", "127.0.0.2", "127.0.0.3", why, sizeof(why)));
	/* Odd prefixes. */
	assert_true(allowed("10.0.0.0/9", NULL, "10.127.255.255", why, sizeof(why)));
	assert_false(allowed("10.0.0.0/9", NULL, "10.128.0.0", why, sizeof(why)));
	assert_true(allowed("0.0.0.0/0", NULL, "8.8.8.8", why, sizeof(why)));
	/* IPv4-mapped IPv6 clients match IPv4 rules... */
	assert_true(allowed("127.0.0.1", NULL, "::ffff:127.0.0.1", why, sizeof(why)));
	assert_false(allowed(NULL, "10.0.0.0/8", "::ffff:10.1.2.3", why, sizeof(why)));
	assert_string_equal(why, "deny 10.0.0.0/8");
	/* ... an IPv4 client a mapped rule, and IPv6 rules only IPv6. */
	assert_true(allowed("::ffff:10.0.0.0/104", NULL, "10.9.9.9", why, sizeof(why)));
	assert_true(allowed("::1", NULL, "::1", why, sizeof(why)));
	assert_false(allowed("::1", NULL, "127.0.0.1", why, sizeof(why)));
	assert_true(allowed("fd00::/8", NULL, "fd12::5", why, sizeof(why)));
	assert_false(allowed("fd00::/8", NULL, "fe80::1", why, sizeof(why)));
	assert_false(allowed("fc00::/7", "fd00::/16", "fd00::1", why, sizeof(why)));
	assert_true(allowed("fc00::/7", NULL, "fdff::1", why, sizeof(why)));
	/* ::/0 is every IPv6 address, mapped IPv4 ones included. */
	assert_true(allowed("::/0", NULL, "1.2.3.4", why, sizeof(why)));
	/* Address rules do not apply to Unix clients. */
	struct access_spec spec = {.allow = "127.0.0.1"};
	struct access_rules r;
	assert_int_equal(access_rules_parse(&spec, &r, why, sizeof(why)), 0);
	struct access_peer u = {.is_unix = true, .has_cred = true, .uid = 1000};
	assert_true(access_rules_allow(&r, &u, why, sizeof(why)));
	access_rules_free(&r);
	/* The peer's text. */
	struct access_peer p = tcp_peer("::1");
	assert_string_equal(p.text, "[::1]:5000");
	p = tcp_peer("127.0.0.2");
	assert_string_equal(p.text, "127.0.0.2:5000");
	p = tcp_peer("::ffff:127.0.0.3");
	assert_string_equal(p.text, "127.0.0.3:5000");
}

static void test_users_groups(void **state)
{
	(void)state;
	char why[128];
	struct access_spec spec = {.allow_users = "root 4242", .allow_groups = "4343"};
	struct access_rules r;
	assert_int_equal(access_rules_parse(&spec, &r, why, sizeof(why)), 0);
	assert_int_equal(r.user_count, 2);
	assert_int_equal(r.users[0], 0);
	assert_int_equal(r.users[1], 4242);
	struct access_peer u = {.is_unix = true, .has_cred = true, .uid = 4242, .gid = 1};
	assert_true(access_rules_allow(&r, &u, why, sizeof(why)));
	u.uid = 7;
	snprintf(u.text, sizeof(u.text), "unix uid 7 pid 1");
	assert_false(access_rules_allow(&r, &u, why, sizeof(why)));
	assert_string_equal(why, "uid 7 gid 1 not in allow-users / allow-groups");
	u.gid = 4343; /* the primary group */
	assert_true(access_rules_allow(&r, &u, why, sizeof(why)));
	u.gid = 1;
	uint32_t many[40];
	for (unsigned i = 0; i < 40; i++)
		many[i] = 5000 + i;
	many[39] = 4343; /* a supplementary one, the 40th */
	u.groups = many;
	u.group_count = 40;
	assert_true(access_rules_allow(&r, &u, why, sizeof(why)));
	u.group_count = 39;
	assert_false(access_rules_allow(&r, &u, why, sizeof(why)));
	u.group_count = 40;
	u.has_cred = false; /* no credentials: refused */
	assert_false(access_rules_allow(&r, &u, why, sizeof(why)));
	/* User rules do not apply to TCP clients. */
	struct access_peer t = tcp_peer("127.0.0.1");
	assert_true(access_rules_allow(&r, &t, why, sizeof(why)));
	access_rules_free(&r);

	uint32_t *ids = NULL;
	size_t n = 0;
	assert_int_equal(access_parse_users("no-such-user-xyz", &ids, &n, why, sizeof(why)),
			 -EINVAL);
	assert_string_equal(why, "no such user 'no-such-user-xyz'");
	assert_int_equal(access_parse_groups("root,no-such-group-xyz", &ids, &n, why, sizeof(why)),
			 -EINVAL);
	assert_string_equal(why, "no such group 'no-such-group-xyz'");
	assert_int_equal(access_parse_users("4294967295", &ids, &n, why, sizeof(why)), -EINVAL);
	assert_int_equal(access_parse_groups("root", &ids, &n, why, sizeof(why)), 0);
	assert_int_equal(n, 1);
	assert_int_equal(ids[0], 0);
	free(ids);
}

/*
 * A Unix peer in 40 supplementary groups (more than the 32 an earlier
 * fixed buffer held): access_peer_from_socket() reads every one. In a
 * child, which takes the groups with setgroups() (root only), and talks
 * to itself over a socketpair. The child's exit status is the result.
 */
static int peer_groups_child(void)
{
	gid_t want[40];
	for (unsigned i = 0; i < 40; i++)
		want[i] = (gid_t)(61000 + i);
	int sv[2];
	if (setgroups(40, want) < 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0)
		return 2;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct access_peer p;
	access_peer_from_socket(&p, sv[0], &sa, sizeof(sa_family_t));
	int rc = p.has_cred && p.group_count == 40 ? 0 : 3;
	for (unsigned i = 0; rc == 0 && i < 40; i++) {
		bool found = false;
		for (unsigned j = 0; j < p.group_count; j++)
			found |= p.groups[j] == want[i];
		rc = found ? 0 : 4;
	}
	struct access_spec spec = {.allow_groups = "61039"};
	struct access_rules r;
	char why[128];
	if (rc == 0 && (access_rules_parse(&spec, &r, why, sizeof(why)) < 0 ||
			!access_rules_allow(&r, &p, why, sizeof(why))))
		rc = 5;
	access_peer_release(&p);
	return rc;
}

static void test_peer_groups(void **state)
{
	(void)state;
	if (geteuid() != 0) {
		skip(); /* setgroups() needs root */
		return;
	}
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0)
		_exit(peer_groups_child());
	int status;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
}

static void test_options(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached",
			"--export",
			"a=/tmp/a,allow=10.0.0.0/8,192.168.0.0/16,readonly,deny=10.1.0.0/16",
			"--export",
			"b=/tmp/b,description=x, y,allow-users=root,0",
			"--allow",
			"127.0.0.1,::1",
			"--allow",
			"127.0.0.3",
			"--deny",
			"127.0.0.2",
			"--max-connections-per-client",
			"4",
			NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(options_parse(13, argv, &o, err, sizeof(err)), 0);
	assert_string_equal(o.access.allow, "127.0.0.1,::1 127.0.0.3");
	assert_string_equal(o.access.deny, "127.0.0.2");
	assert_int_equal(o.max_connections_per_client, 4);
	assert_string_equal(o.exports[0].access.allow, "10.0.0.0/8 192.168.0.0/16");
	assert_true(o.exports[0].readonly);
	assert_string_equal(o.exports[0].access.deny, "10.1.0.0/16");
	assert_string_equal(o.exports[1].description, "x, y");
	assert_string_equal(o.exports[1].access.allow_users, "root 0");
	struct access_policy *p;
	assert_int_equal(access_policy_build(&o, &p, err, sizeof(err)), 0);
	assert_int_equal(p->global.allow_count, 3);
	assert_int_equal(p->max_per_client, 4);
	const struct access_rules *ra = access_policy_export(p, "a");
	assert_non_null(ra);
	assert_int_equal(ra->allow_count, 2);
	assert_int_equal(ra->deny_count, 1);
	assert_null(access_policy_export(p, "c"));
	/* LIST shows c (no rules of its own) to every client, a and b not;
	 * c with tls = require neither (metrics-export-names listed). */
	assert_false(access_export_listed(p, "a", false));
	assert_false(access_export_listed(p, "b", false));
	assert_true(access_export_listed(p, "c", false));
	assert_false(access_export_listed(p, "c", true));
	assert_false(p->metrics_export_names_all);
	access_policy_set(p);
	struct access_policy *q = access_policy_get();
	assert_ptr_equal(p, q);
	access_policy_put(q);
	access_policy_set(NULL);
	options_free(&o);

	static const struct {
		const char *arg1, *arg2, *message;
	} bad[] = {
	    {"--allow", "10.0.0.1/8", "--allow: '10.0.0.1/8' is not an address or CIDR"},
	    {"--deny", "nope", "--deny: 'nope' is not an address or CIDR"},
	    {"--allow-users", "no-such-user-xyz", "--allow-users: no such user 'no-such-user-xyz'"},
	    {"--allow-groups", "no-such-group-xyz",
	     "--allow-groups: no such group 'no-such-group-xyz'"},
	    {"--export", "a=/tmp/a,allow=1.2.3.4,x", "--export a: allow: 'x' is not an address"},
	    {"--max-connections-per-client", "x", "--max-connections-per-client x: expected"},
	    {"--max-connections-per-client", "1024", "must be below max-clients 1024"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *bargv[] = {"nbdcached",	      "--export",	   "z=/tmp/z",
				 (char *)bad[i].arg1, (char *)bad[i].arg2, NULL};
		char e[256] = "";
		assert_int_equal(options_parse(5, bargv, &o, e, sizeof(e)), -EINVAL);
		if (!strstr(e, bad[i].message))
			fail_msg("%s %s: got '%s'", bad[i].arg1, bad[i].arg2, e);
	}
}

/* allow-identities: one identity per key (a DN keeps its commas), compared
 * whole; a peer without TLS has none; the accept-time rules ignore them. */
static void test_identities(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached",
			"--export",
			"a=/tmp/a,allow-identities=CN=client1,O=nbdcached tests,readonly",
			"--allow-identities",
			"alice",
			"--allow-identities",
			" CN=client1,O=nbdcached tests ",
			NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(options_parse(7, argv, &o, err, sizeof(err)), 0);
	assert_string_equal(o.exports[0].access.allow_identities, "CN=client1,O=nbdcached tests");
	assert_true(o.exports[0].readonly);
	assert_string_equal(o.access.allow_identities, "alice\n CN=client1,O=nbdcached tests ");
	struct access_policy *p;
	assert_int_equal(access_policy_build(&o, &p, err, sizeof(err)), 0);
	assert_int_equal(p->global.identity_count, 2);
	assert_string_equal(p->global.identities[1], "CN=client1,O=nbdcached tests");
	const struct access_rules *ra = access_policy_export(p, "a");
	assert_non_null(ra);
	struct access_peer peer = tcp_peer("127.0.0.1");
	char why[128] = "";
	assert_true(access_rules_allow(ra, &peer, why, sizeof(why))); /* at accept */
	assert_false(access_identity_allow(ra, &peer, why, sizeof(why)));
	assert_string_equal(why, "no TLS identity (allow-identities)");
	peer.has_identity = true;
	snprintf(peer.identity, sizeof(peer.identity), "alice");
	assert_true(access_identity_allow(&p->global, &peer, why, sizeof(why)));
	assert_false(access_identity_allow(ra, &peer, why, sizeof(why)));
	assert_string_equal(why, "identity 'alice' not in allow-identities");
	snprintf(peer.identity, sizeof(peer.identity), "CN=client1,O=nbdcached tests");
	assert_true(access_identity_allow(ra, &peer, why, sizeof(why)));
	snprintf(peer.identity, sizeof(peer.identity), "CN=client1");
	assert_false(access_identity_allow(ra, &peer, why, sizeof(why))); /* whole, not a prefix */
	access_policy_put(p);
	options_free(&o);
	char *empty[] = {"nbdcached", "--export", "z=/tmp/z", "--allow-identities", "", NULL};
	assert_int_equal(options_parse(5, empty, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "allow-identities: an empty identity"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_syntax),
	    cmocka_unit_test(test_match),
	    cmocka_unit_test(test_users_groups),
	    cmocka_unit_test(test_peer_groups),
	    cmocka_unit_test(test_options),
	    cmocka_unit_test(test_identities),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
