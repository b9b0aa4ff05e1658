/*
 * tests/unit/test_options.c: the command line as a user types it, parsed
 * into what the daemon will serve. Table-driven for the rejections, so every
 * bad value names the reason the daemon prints.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <errno.h>

#include "daemon/option_values.h"
#include "daemon/options.h"


static int parse(char **argv, int argc, struct options *o, char *err, size_t errlen)
{
	return options_parse(argc, argv, o, err, errlen);
}

static void test_defaults(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached", "--export", "disk=/tmp/x.img", NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(parse(argv, 3, &o, err, sizeof(err)), 0);
	assert_false(o.foreground);
	assert_int_equal(o.listen_count, 1);
	assert_string_equal(o.listen[0], "127.0.0.1:10809");
	assert_int_equal(o.unix_count, 0);
	assert_int_equal(o.export_count, 1);
	assert_string_equal(o.exports[0].name, "disk");
	assert_string_equal(o.exports[0].backend, "/tmp/x.img");
	assert_null(o.exports[0].description);
	assert_false(o.exports[0].readonly);
	assert_int_equal(o.exports[0].block_size, 4096);
	assert_int_equal(o.threads, 0);
	assert_int_equal(o.log_level, LOG_INFO);
	options_free(&o);
}

static void test_full_command_line(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached",
			"--foreground",
			"--listen",
			"[::1]:10810",
			"--listen",
			"127.0.0.1:10811",
			"--unix",
			"/run/n.sock",
			"--export",
			"a=/dev/shm/a,readonly,description=big disk, fast,block-size=512",
			"--export",
			"b=/tmp/b,description=x=y",
			"--threads",
			"3",
			"--pidfile",
			"/tmp/p",
			"--log-level",
			"debug",
			NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(parse(argv, 18, &o, err, sizeof(err)), 0);
	assert_true(o.foreground);
	assert_int_equal(o.listen_count, 2);
	assert_string_equal(o.listen[0], "[::1]:10810");
	assert_int_equal(o.unix_count, 1);
	assert_string_equal(o.unix_paths[0], "/run/n.sock");
	assert_int_equal(o.export_count, 2);
	assert_true(o.exports[0].readonly);
	/* A description keeps its commas up to the next known key. */
	assert_string_equal(o.exports[0].description, "big disk, fast");
	assert_int_equal(o.exports[0].block_size, 512);
	assert_string_equal(o.exports[1].description, "x=y");
	assert_int_equal(o.threads, 3);
	assert_string_equal(o.pidfile, "/tmp/p");
	assert_int_equal(o.log_level, LOG_DEBUG);
	options_free(&o);
}

static void test_unix_only_has_no_default_tcp(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached", "--unix", "/tmp/s", "--export", "=/tmp/x", NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.listen_count, 0);
	assert_string_equal(o.exports[0].name, ""); /* the default export name */
	options_free(&o);
}

struct bad_case {
	const char *flag;
	const char *value;
	const char *reason; /* substring of the message */
};

static void test_rejections(void **state)
{
	(void)state;
	static const struct bad_case cases[] = {
		{"--export", "noequals", "expected NAME=BACKEND"},
		{"--export", "a=", "empty backend"},
		{"--export", "a=/x,bogus", "unknown option"},
		{"--export", "a=/x,block-size=1000", "power of two"},
		{"--export", "a=/x,block-size=256", "power of two"},
		{"--export", "a=/x,block-size=131072", "power of two"},
		{"--export", "a=/x,block-size=", "power of two"},
		{"--listen", "10809", "HOST:PORT"},
		{"--listen", "::1:10809", "HOST:PORT"},
		{"--listen", "127.0.0.1:99999", "HOST:PORT"},
		{"--listen", "127.0.0.1:", "HOST:PORT"},
		{"--listen", "[::1]10809", "HOST:PORT"},
		{"--threads", "-1", "0..256"},
		{"--threads", "257", "0..256"},
		{"--threads", "two", "0..256"},
		{"--log-level", "loud", "expected error, warn"},
		{"--unix", "", "path empty"},
		{"--cache-size", "512K", "from 1M"},
		{"--cache-size", "lots", "from 1M"},
		{"--hugepages", "yes", "auto, require or off"},
		{"--block-size", "3000", "power of two"},
		{"--cache-mode", "fast", "expected writeback"},
		{"--export", "a=/x,cache-mode=fast", "expected writeback"},
		{"--export", "a=/x,seq-cutoff=big", "bad seq-cutoff"},
		{"--seq-cutoff", "-4", "expected a size"},
		{"--dirty-high", "101", "0..100"},
		{"--dirty-low", "x", "0..100"},
		{"--dirty-low", "60", "above dirty-high"},
		{"--max-connections", "-1", "0..65536"},
		{"--export", "a=/x,max-connections=70000", "bad max-connections"},
		{"--export", "a=/x,dirty-high=101", "bad dirty-high"},
		{"--export", "a=/x,dirty-high=10,dirty-low=20", "dirty-low 20 is above dirty-high 10"},
		{"--control", "", "path empty"},
		{"--user", "", "empty name"},
		{"--dirty-expire", "0", "1..86400"},
		{"--compact", "yes", "expected on or off"},
		{"--compact", "", "expected on or off"},
		{"--compact-interval-ms", "0", "1..3600000"},
		{"--compact-interval-ms", "3600001", "1..3600000"},
		{"--compact-threshold", "1001", "0..1000"},
		{"--compact-threshold", "-1", "0..1000"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char *argv[] = {"nbdcached", "--export", "ok=/tmp/x", (char *)cases[i].flag,
				(char *)cases[i].value, NULL};
		struct options o;
		char err[256] = "";
		int rc = parse(argv, 5, &o, err, sizeof(err));
		if (rc != -EINVAL || !strstr(err, cases[i].reason))
			fail_msg("case %zu (%s %s): rc %d, message '%s'", i, cases[i].flag,
				 cases[i].value, rc, err);
	}
}

/* Cache settings: defaults, suffixes, and per-export values that win over
 * the global ones whichever comes first on the command line. */
static void test_cache_settings(void **state)
{
	(void)state;
	char *argv[] = {"nbdcached", "--export", "a=/x,cache-mode=none,block-size=512",
			"--export", "b=/y,seq-cutoff=4M", "--cache-size", "512M",
			"--cache-mode", "writethrough", "--block-size", "65536",
			"--seq-cutoff", "1M", "--dirty-high", "70", "--dirty-low", "10",
			"--dirty-expire", "5", "--hugepages", "off", NULL};
	struct options o;
	char err[256] = "";
	assert_int_equal(parse(argv, 21, &o, err, sizeof(err)), 0);
	assert_int_equal(o.cache_size, 512ull << 20);
	assert_int_equal(o.hugepages, HUGEPAGES_OFF);
	assert_int_equal(o.dirty_high, 70);
	assert_int_equal(o.dirty_low, 10);
	assert_int_equal(o.dirty_expire, 5);
	assert_int_equal(o.exports[0].cache_mode, CACHE_MODE_NONE);
	assert_int_equal(o.exports[0].block_size, 512);
	assert_int_equal(o.exports[0].seq_cutoff, 1u << 20);
	assert_int_equal(o.exports[1].cache_mode, CACHE_MODE_WRITETHROUGH);
	assert_int_equal(o.exports[1].block_size, 65536);
	assert_int_equal(o.exports[1].seq_cutoff, 4u << 20);
	assert_string_equal(options_cache_mode_name(o.exports[1].cache_mode), "writethrough");
	options_free(&o);

	char *defaults[] = {"nbdcached", "--export", "a=/x", NULL};
	assert_int_equal(parse(defaults, 3, &o, err, sizeof(err)), 0);
	assert_int_equal(o.cache_size, OPTIONS_DEFAULT_CACHE_SIZE);
	assert_int_equal(o.hugepages, HUGEPAGES_AUTO);
	assert_int_equal(o.exports[0].cache_mode, CACHE_MODE_WRITEBACK);
	assert_int_equal(o.exports[0].seq_cutoff, 0);
	options_free(&o);
}

/* Background compaction: on by default, off for a benchmark's baseline,
 * and the knobs the tests use to make it run all the time. */
static void test_compact_settings(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *defaults[] = {"nbdcached", "--export", "a=/x", NULL};
	assert_int_equal(parse(defaults, 3, &o, err, sizeof(err)), 0);
	assert_true(o.compact);
	assert_int_equal(o.compact_interval_ms, OPTIONS_DEFAULT_COMPACT_INTERVAL_MS);
	assert_int_equal(o.compact_threshold, OPTIONS_DEFAULT_COMPACT_THRESHOLD);
	options_free(&o);

	char *off[] = {"nbdcached", "--compact", "off", "--export", "a=/x", NULL};
	assert_int_equal(parse(off, 5, &o, err, sizeof(err)), 0);
	assert_false(o.compact);
	options_free(&o);

	char *busy[] = {"nbdcached", "--export", "a=/x", "--compact", "off", "--compact", "on",
			"--compact-interval-ms", "5", "--compact-threshold", "0", NULL};
	assert_int_equal(parse(busy, 11, &o, err, sizeof(err)), 0);
	assert_true(o.compact); /* the last one wins */
	assert_int_equal(o.compact_interval_ms, 5);
	assert_int_equal(o.compact_threshold, 0);
	options_free(&o);
}

/* The daemon-wide budgets: defaults, the pinned share following the cache
 * size, 0 pinned bytes allowed, too little reply memory refused. */
static void test_budget_settings(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *defaults[] = {"nbdcached", "--export", "a=/x", "--cache-size", "256M", NULL};
	assert_int_equal(parse(defaults, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.max_clients, OPTIONS_DEFAULT_MAX_CLIENTS);
	assert_true(o.max_reply_memory == OPTIONS_DEFAULT_MAX_REPLY_MEMORY);
	assert_true(options_pinned_replies(&o) == (32ull << 20)); /* 1/8 of the cache */
	options_free(&o);

	char *given[] = {"nbdcached",	       "--max-clients",	       "0",
			 "--max-reply-memory", "1G",		       "--max-pinned-replies",
			 "0",		       "--export",	       "a=/x",
			 NULL};
	assert_int_equal(parse(given, 9, &o, err, sizeof(err)), 0);
	assert_int_equal(o.max_clients, 0);
	assert_true(o.max_reply_memory == (1ull << 30));
	assert_true(options_pinned_replies(&o) == 0);
	options_free(&o);

	char *small[] = {"nbdcached", "--max-reply-memory", "1M", "--export", "a=/x", NULL};
	assert_int_equal(parse(small, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "--max-reply-memory 1M"));
	char *many[] = {"nbdcached", "--max-clients", "70000", "--export", "a=/x", NULL};
	assert_int_equal(parse(many, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "--max-clients 70000"));
}

/* The stall deadline: 30 s unless given, 1..3600 s, whole seconds only. */
static void test_stall_timeout(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *defaults[] = {"nbdcached", "--export", "a=/x", NULL};
	assert_int_equal(parse(defaults, 3, &o, err, sizeof(err)), 0);
	assert_int_equal(o.stall_timeout, OPTIONS_DEFAULT_STALL_TIMEOUT);
	assert_int_equal(o.stall_timeout, 30);
	assert_false(o.given & OPT_GIVEN_STALL_TIMEOUT);
	options_free(&o);

	char *given[] = {"nbdcached", "--stall-timeout", "5", "--export", "a=/x", NULL};
	assert_int_equal(parse(given, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.stall_timeout, 5);
	assert_true(o.given & OPT_GIVEN_STALL_TIMEOUT);
	options_free(&o);

	char *lowest[] = {"nbdcached", "--stall-timeout", "1", "--export", "a=/x", NULL};
	assert_int_equal(parse(lowest, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.stall_timeout, 1);
	options_free(&o);
	char *highest[] = {"nbdcached", "--stall-timeout", "3600", "--export", "a=/x", NULL};
	assert_int_equal(parse(highest, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.stall_timeout, OPTIONS_MAX_STALL_TIMEOUT);
	options_free(&o);

	const char *bad[] = {"0", "3601", "-1", "5s", "", "1.5", "99999999999"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *argv[] = {"nbdcached", "--stall-timeout", (char *)bad[i], "--export", "a=/x",
				NULL};
		err[0] = '\0';
		assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), -EINVAL);
		char want[64];
		snprintf(want, sizeof(want), "--stall-timeout %s: expected 1..3600 seconds",
			 bad[i]);
		assert_non_null(strstr(err, want));
	}

	unsigned v = 7;
	assert_int_equal(options_parse_stall_timeout("3601", &v), -EINVAL);
	assert_int_equal(v, 7); /* untouched on error */
	assert_int_equal(options_parse_stall_timeout("60", &v), 0);
	assert_int_equal(v, 60);
}

/* The negotiation deadline: 60 s unless given, 1..3600 s, whole seconds only. */
static void test_negotiation_timeout(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *defaults[] = {"nbdcached", "--export", "a=/x", NULL};
	assert_int_equal(parse(defaults, 3, &o, err, sizeof(err)), 0);
	assert_int_equal(o.negotiation_timeout, OPTIONS_DEFAULT_NEGOTIATION_TIMEOUT);
	assert_int_equal(o.negotiation_timeout, 60);
	assert_false(o.given & OPT_GIVEN_NEGOTIATION_TIMEOUT);
	options_free(&o);

	char *given[] = {"nbdcached", "--negotiation-timeout", "5", "--export", "a=/x", NULL};
	assert_int_equal(parse(given, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.negotiation_timeout, 5);
	assert_true(o.given & OPT_GIVEN_NEGOTIATION_TIMEOUT);
	assert_int_equal(o.stall_timeout, OPTIONS_DEFAULT_STALL_TIMEOUT); /* independent */
	assert_false(o.given & OPT_GIVEN_STALL_TIMEOUT);
	options_free(&o);

	char *lowest[] = {"nbdcached", "--negotiation-timeout", "1", "--export", "a=/x", NULL};
	assert_int_equal(parse(lowest, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.negotiation_timeout, 1);
	options_free(&o);
	char *highest[] = {"nbdcached", "--negotiation-timeout", "3600", "--export", "a=/x", NULL};
	assert_int_equal(parse(highest, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.negotiation_timeout, OPTIONS_MAX_NEGOTIATION_TIMEOUT);
	options_free(&o);

	const char *bad[] = {"0", "3601", "-1", "5s", "", "1.5", "99999999999"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *argv[] = {
		    "nbdcached", "--negotiation-timeout", (char *)bad[i], "--export", "a=/x", NULL};
		err[0] = '\0';
		assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), -EINVAL);
		char want[80];
		snprintf(want, sizeof(want), "--negotiation-timeout %s: expected 1..3600 seconds",
			 bad[i]);
		assert_non_null(strstr(err, want));
	}

	unsigned v = 7;
	assert_int_equal(options_parse_negotiation_timeout("3601", &v), -EINVAL);
	assert_int_equal(v, 7); /* untouched on error */
	assert_int_equal(options_parse_negotiation_timeout("120", &v), 0);
	assert_int_equal(v, 120);
}

/* TLS: off unless given; on and require need credentials; a per-export
 * require needs the global on; verify-peer needs certificates. */
static void test_tls(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *defaults[] = {"nbdcached", "--export", "a=/x", NULL};
	assert_int_equal(parse(defaults, 3, &o, err, sizeof(err)), 0);
	assert_int_equal(o.tls, TLS_OFF);
	assert_null(o.tls_certificates);
	assert_null(o.tls_psk);
	assert_null(o.tls_priority);
	assert_false(o.tls_verify_peer);
	assert_false(o.exports[0].tls_require);
	options_free(&o);

	char *on[] = {"nbdcached", "--tls", "on", "--tls-certificates", "/etc/t",
		      "--tls-verify-peer", "--tls-psk", "/etc/k.psk", "--tls-priority", "NORMAL",
		      "--export", "a=/x,tls=require", "--export", "b=/y,tls=on", NULL};
	assert_int_equal(parse(on, 14, &o, err, sizeof(err)), 0);
	assert_int_equal(o.tls, TLS_ON);
	assert_string_equal(o.tls_certificates, "/etc/t");
	assert_string_equal(o.tls_psk, "/etc/k.psk");
	assert_string_equal(o.tls_priority, "NORMAL");
	assert_true(o.tls_verify_peer);
	assert_true(o.exports[0].tls_require);
	assert_false(o.exports[1].tls_require);
	assert_true(o.given & OPT_GIVEN_TLS);
	assert_true(o.given & OPT_GIVEN_TLS_VERIFY_PEER);
	options_free(&o);

	char *verify_false[] = {"nbdcached", "--tls", "require", "--tls-psk", "/k",
				"--tls-verify-peer=false", "--export", "a=/x", NULL};
	assert_int_equal(parse(verify_false, 8, &o, err, sizeof(err)), 0);
	assert_int_equal(o.tls, TLS_REQUIRE);
	assert_false(o.tls_verify_peer);
	options_free(&o);

	struct {
		char *argv[8];
		int argc;
		const char *want;
	} bad[] = {
	    {{"nbdcached", "--tls", "yes", "--export", "a=/x"}, 5,
	     "--tls yes: expected off, on or require"},
	    {{"nbdcached", "--tls", "on", "--export", "a=/x"}, 5,
	     "tls on needs tls-certificates DIR or tls-psk FILE"},
	    {{"nbdcached", "--export", "a=/x,tls=require"}, 3,
	     "export 'a': tls = require needs the global tls on or require"},
	    {{"nbdcached", "--tls", "on", "--tls-psk", "/k", "--tls-verify-peer", "--export",
	      "a=/x"},
	     8, "tls-verify-peer needs tls-certificates DIR"},
	    {{"nbdcached", "--export", "a=/x,tls=off"}, 3, "expected tls=require (or tls=on)"},
	    {{"nbdcached", "--tls-verify-peer=maybe", "--export", "a=/x"}, 4,
	     "--tls-verify-peer=maybe: expected true or false"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		assert_int_equal(parse(bad[i].argv, bad[i].argc, &o, err, sizeof(err)), -EINVAL);
		if (!strstr(err, bad[i].want))
			fail_msg("case %zu: '%s' does not say '%s'", i, err, bad[i].want);
	}
}

static void test_no_export_and_duplicates(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *none[] = {"nbdcached", "--foreground", NULL};
	assert_int_equal(parse(none, 2, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "no export"));
	char *dup[] = {"nbdcached", "--export", "a=/x", "--export", "a=/y", NULL};
	assert_int_equal(parse(dup, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "duplicate"));
	char *extra[] = {"nbdcached", "--export", "a=/x", "stray", NULL};
	assert_int_equal(parse(extra, 4, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "unexpected argument"));
	char *unknown[] = {"nbdcached", "--export", "a=/x", "--frobnicate", NULL};
	assert_int_equal(parse(unknown, 4, &o, err, sizeof(err)), -EINVAL);
}

/* Windows: offset=, size=, split= (a size or 32bit), checked against the
 * block size; exports over one backend must agree on what their shared
 * cache export holds. */
static void test_windows(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *ok[] = {"nbdcached", "--export", "big=/x,split=32bit,description=a, b",
		      "--export", "w=/x,offset=1M,size=2G,readonly", NULL};
	assert_int_equal(parse(ok, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.exports[0].split, (1ull << 44) - (2ull << 20));
	assert_int_equal(o.exports[0].split, OPTIONS_SPLIT_32BIT);
	assert_string_equal(o.exports[0].description, "a, b");
	assert_int_equal(o.exports[1].offset, 1ull << 20);
	assert_int_equal(o.exports[1].size, 2ull << 30);
	assert_int_equal(options_backend_first(&o, 1), 0);
	options_free(&o);
	/* Each nbdkit: export starts its own nbdkit: nothing shared, no
	 * agreement needed. */
	char *kits[] = {"nbdcached", "--export", "a=nbdkit:memory 1G", "--export",
			"b=nbdkit:memory 1G,cache-mode=none", NULL};
	assert_int_equal(parse(kits, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(options_backend_first(&o, 1), 1);
	options_free(&o);

	static const struct {
		const char *spec, *spec2, *why;
	} bad[] = {
	    {"a=/x,offset=1000", NULL, "multiples of its block size 4096"},
	    {"a=/x,size=6000", NULL, "multiples of its block size 4096"},
	    {"a=/x,split=5000", NULL, "multiples of its block size 4096"},
	    {"a=/x,split=0", NULL, "bad split=0"},
	    {"a=/x,split=-1", NULL, "bad split=-1"},
	    {"a=/x,size=0", NULL, "bad size=0"},
	    {"a=/x,offset=8E", NULL, "bad offset=8E"},
	    {"a=/x,offset=8388607T,size=2T", NULL, "past 2^63 bytes"},
	    {"a=/x,offset=16777215T,size=16777215T", NULL, "overflows"},
	    {"a=/x,split=1G", "a/0=/y", "named like a window of export 'a'"},
	    {"a=/x", "b=/x,block-size=512", "their block-size must be the same"},
	    {"a=/x", "b=/x,cache-mode=writethrough", "their cache-mode must be the same"},
	    {"a=/x,dirty-high=61", "b=/x", "their dirty-high must be the same"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *argv[] = {"nbdcached", "--export", (char *)bad[i].spec, "--export",
				(char *)bad[i].spec2, NULL};
		err[0] = '\0';
		int rc = parse(argv, bad[i].spec2 ? 5 : 3, &o, err, sizeof(err));
		if (rc != -EINVAL || !strstr(err, bad[i].why))
			fail_msg("%s %s: rc %d, '%s' (want '%s')", bad[i].spec,
				 bad[i].spec2 ? bad[i].spec2 : "", rc, err, bad[i].why);
	}
}

/* One file under several paths is one backend (its device and inode):
 * a hard link, "/./", a symbolic link; another file is not, and neither is
 * a path that is not there (compared as a string). */
static void test_same_file(void **state)
{
	(void)state;
	char dir[] = "/tmp/test_options.XXXXXX";
	assert_non_null(mkdtemp(dir));
	char file[64], dotted[64], hard[64], sym[64], other[64], gone[64];
	snprintf(file, sizeof(file), "%s/x.img", dir);
	snprintf(dotted, sizeof(dotted), "%s/./x.img", dir);
	snprintf(hard, sizeof(hard), "%s/hard.img", dir);
	snprintf(sym, sizeof(sym), "%s/sym.img", dir);
	snprintf(other, sizeof(other), "%s/other.img", dir);
	snprintf(gone, sizeof(gone), "%s/gone.img", dir);
	FILE *f = fopen(file, "w");
	assert_non_null(f);
	fclose(f);
	f = fopen(other, "w");
	assert_non_null(f);
	fclose(f);
	assert_int_equal(link(file, hard), 0);
	assert_int_equal(symlink(file, sym), 0);
	char specs[6][96];
	const char *paths[6] = {file, dotted, hard, sym, other, gone};
	char *argv[14] = {"nbdcached"};
	for (int i = 0; i < 6; i++) {
		snprintf(specs[i], sizeof(specs[i]), "%c=%s", 'a' + i, paths[i]);
		argv[1 + 2 * i] = "--export";
		argv[2 + 2 * i] = specs[i];
	}
	struct options o;
	char err[256] = "";
	assert_int_equal(parse(argv, 13, &o, err, sizeof(err)), 0);
	assert_int_equal(options_backend_first(&o, 1), 0);
	assert_int_equal(options_backend_first(&o, 2), 0);
	assert_int_equal(options_backend_first(&o, 3), 0);
	assert_int_equal(options_backend_first(&o, 4), 4);
	assert_int_equal(options_backend_first(&o, 5), 5);
	assert_true(o.exports[0].has_file_id);
	assert_false(o.exports[5].has_file_id);
	options_free(&o);
	/* Two block sizes on two names of one file: refused, both named. */
	snprintf(specs[1], sizeof(specs[1]), "b=%s,block-size=65536", hard);
	assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "exports 'a' and 'b' share the backend"));
	assert_non_null(strstr(err, hard));
	assert_non_null(strstr(err, "the same file"));
	unlink(file);
	unlink(hard);
	unlink(sym);
	unlink(other);
	rmdir(dir);
}

/* allow-resize: off by default, a bare key after a comma, and not a
 * prefix of anything else. */
static void test_allow_resize(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *argv[] = {"nbdcached", "--export", "a=/x,allow-resize,description=grows", "--export",
			"b=/y", NULL};
	assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), 0);
	assert_true(o.exports[0].allow_resize);
	assert_string_equal(o.exports[0].description, "grows");
	assert_false(o.exports[1].allow_resize);
	options_free(&o);
	char *bad[] = {"nbdcached", "--export", "a=/x,allow-resizes", NULL};
	assert_int_equal(parse(bad, 3, &o, err, sizeof(err)), -EINVAL);
}

/* cache-device-warm in an export: its own, else the global one. */
static void test_export_warm(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *argv[] = {"nbdcached",
			"--cache-device-warm",
			"all",
			"--export",
			"a=/x",
			"--export",
			"b=/y,cache-device-warm=files",
			NULL};
	assert_int_equal(parse(argv, 7, &o, err, sizeof(err)), 0);
	assert_true(o.exports[0].cache_device_warm_all);
	assert_false(o.exports[1].cache_device_warm_all);
	options_free(&o);
	char *argv2[] = {"nbdcached", "--export", "a=/x", "--export", "b=/y,cache-device-warm=all",
			 NULL};
	assert_int_equal(parse(argv2, 5, &o, err, sizeof(err)), 0);
	assert_false(o.exports[0].cache_device_warm_all);
	assert_true(o.exports[1].cache_device_warm_all);
	options_free(&o);
	char *bad[] = {"nbdcached", "--export", "a=/x,cache-device-warm=often", NULL};
	assert_int_equal(parse(bad, 3, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "expected cache-device-warm=files or cache-device-warm=all"));
}

static void test_rbd(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *argv[] = {"nbdcached", "--export", "a=rbd:pool/ns/img?conf=/c&id=nbd", NULL};
	assert_int_equal(parse(argv, 3, &o, err, sizeof(err)), 0);
	assert_false(o.rbd_takeover_wait);
	assert_string_equal(o.exports[0].backend, "rbd:pool/ns/img?conf=/c&id=nbd");
	options_free(&o);
	char *wait[] = {"nbdcached", "--rbd-takeover", "wait", "--export", "a=rbd:p/i", NULL};
	assert_int_equal(parse(wait, 5, &o, err, sizeof(err)), 0);
	assert_true(o.rbd_takeover_wait);
	assert_true(o.given & OPT_GIVEN_RBD_TAKEOVER);
	options_free(&o);
	char *bad[] = {"nbdcached", "--rbd-takeover", "maybe", "--export", "a=rbd:p/i", NULL};
	assert_int_equal(parse(bad, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "--rbd-takeover maybe: expected refuse or wait"));
	char *spec[] = {"nbdcached", "--export", "a=rbd:pool", NULL};
	assert_int_equal(parse(spec, 3, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "export 'a'"));
	assert_non_null(strstr(err, "expected rbd:POOL/IMAGE"));
	bool w = true;
	assert_int_equal(options_parse_rbd_takeover("refuse", &w), 0);
	assert_false(w);
	assert_int_equal(options_parse_rbd_takeover("Wait", &w), -EINVAL);
}

static void test_unix_listen(void **state)
{
	(void)state;
	struct unix_listen u;
	char err[256] = "";
	assert_int_equal(options_parse_unix("/run/n.sock", &u, err, sizeof(err)), 0);
	assert_string_equal(u.path, "/run/n.sock");
	assert_false(u.has_mode);
	assert_false(u.has_group);
	assert_int_equal(
	    options_parse_unix("/run/n.sock,mode=0660,group=root", &u, err, sizeof(err)), 0);
	assert_string_equal(u.path, "/run/n.sock");
	assert_true(u.has_mode && u.has_group);
	assert_int_equal(u.mode, 0660);
	assert_int_equal(u.gid, 0);
	assert_int_equal(options_parse_unix("/a,b.sock,group=4242,mode=600", &u, err, sizeof(err)),
			 0);
	assert_string_equal(u.path, "/a,b.sock"); /* a comma before no key: the path's */
	assert_int_equal(u.mode, 0600);
	assert_int_equal(u.gid, 4242);
	static const struct {
		const char *text, *why;
	} bad[] = {
	    {"", "path empty"},
	    {",mode=0600", "path empty"},
	    {"/s,mode=0999", "mode '0999' is not an octal mode"},
	    {"/s,mode=1777", "mode '1777' is not an octal mode"},
	    {"/s,mode=", "mode '' is not an octal mode"},
	    {"/s,mode=-1", "mode '-1' is not an octal mode"},
	    {"/s,mode=0600,mode=0600", "mode given twice"},
	    {"/s,group=no-such-group-xyz", "no such group 'no-such-group-xyz'"},
	    {"/s,group=", "no such group ''"},
	    {"/s,group=root root", "no such group 'root root'"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		assert_int_equal(options_parse_unix(bad[i].text, &u, err, sizeof(err)), -EINVAL);
		if (!strstr(err, bad[i].why))
			fail_msg("'%s': got '%s', want '%s'", bad[i].text, err, bad[i].why);
	}
	/* On the command line, the error names the option. */
	char *argv[] = {"nbdcached", "--unix", "/s,mode=8", "--export", "a=/x", NULL};
	struct options o;
	assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), -EINVAL);
	assert_string_equal(err, "--unix /s,mode=8: mode '8' is not an octal mode 0 to 0777");
	char *good[] = {"nbdcached", "--unix", "/s,mode=0660", "--export", "a=/x", NULL};
	assert_int_equal(parse(good, 5, &o, err, sizeof(err)), 0);
	assert_int_equal(o.unix_count, 1);
	assert_string_equal(o.unix_paths[0], "/s,mode=0660");
	options_free(&o);
}

static void test_split_host_port(void **state)
{
	(void)state;
	char host[64], port[8];
	assert_int_equal(options_split_host_port("127.0.0.1:10809", host, sizeof(host), port,
						 sizeof(port)),
			 0);
	assert_string_equal(host, "127.0.0.1");
	assert_string_equal(port, "10809");
	assert_int_equal(options_split_host_port("[::1]:1", host, sizeof(host), port,
						 sizeof(port)),
			 0);
	assert_string_equal(host, "::1");
	assert_string_equal(port, "1");
	assert_int_equal(options_split_host_port(":10809", host, sizeof(host), port,
						 sizeof(port)),
			 0);
	assert_string_equal(host, "");
	assert_int_equal(options_split_host_port("host:12a", host, sizeof(host), port,
						 sizeof(port)),
			 -EINVAL);
}

/* --metrics :PORT is loopback (stored so: what is bound, logged and compared
 * at reload); an address given stays as written; --metrics-export-names
 * takes listed or all, default listed. */
static void test_metrics(void **state)
{
	(void)state;
	struct options o;
	char err[256] = "";
	char *argv[] = {"nbdcached", "--metrics", ":9109", "--export", "a=/x", NULL};
	assert_int_equal(parse(argv, 5, &o, err, sizeof(err)), 0);
	assert_string_equal(o.metrics, "127.0.0.1:9109");
	assert_false(o.metrics_export_names_all);
	options_free(&o);
	char *every[] = {"nbdcached", "--metrics", "0.0.0.0:9109", "--metrics-export-names",
			 "all",	      "--export",  "a=/x",	   NULL};
	assert_int_equal(parse(every, 7, &o, err, sizeof(err)), 0);
	assert_string_equal(o.metrics, "0.0.0.0:9109");
	assert_true(o.metrics_export_names_all);
	assert_true(o.given & OPT_GIVEN_METRICS_EXPORT_NAMES);
	options_free(&o);
	char *bad[] = {"nbdcached", "--metrics-export-names", "some", "--export", "a=/x", NULL};
	assert_int_equal(parse(bad, 5, &o, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "--metrics-export-names some: expected listed or all"));
}

static void test_help_and_version(void **state)
{
	(void)state;
	struct options o;
	char err[64];
	char *help[] = {"nbdcached", "--help", NULL};
	assert_int_equal(parse(help, 2, &o, err, sizeof(err)), 0);
	assert_true(o.help);
	options_free(&o);
	char *version[] = {"nbdcached", "--version", NULL};
	assert_int_equal(parse(version, 2, &o, err, sizeof(err)), 0);
	assert_true(o.version);
	options_free(&o);
	assert_non_null(strstr(options_usage(), "--export NAME=BACKEND"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_defaults),
		cmocka_unit_test(test_full_command_line),
		cmocka_unit_test(test_unix_only_has_no_default_tcp),
		cmocka_unit_test(test_rejections),
		cmocka_unit_test(test_cache_settings),
		cmocka_unit_test(test_compact_settings),
		cmocka_unit_test(test_budget_settings),
		cmocka_unit_test(test_stall_timeout),
		cmocka_unit_test(test_negotiation_timeout),
		cmocka_unit_test(test_tls),
		cmocka_unit_test(test_no_export_and_duplicates),
		cmocka_unit_test(test_windows),
		cmocka_unit_test(test_same_file),
		cmocka_unit_test(test_allow_resize),
		cmocka_unit_test(test_export_warm),
		cmocka_unit_test(test_rbd),
		cmocka_unit_test(test_unix_listen),
		cmocka_unit_test(test_split_host_port),
		cmocka_unit_test(test_metrics),
		cmocka_unit_test(test_help_and_version),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
