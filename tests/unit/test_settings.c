/*
 * tests/unit/test_settings.c: the table of global settings
 * (daemon/settings.h) against what reads it and what documents it:
 * every setting parses on the command line and in the config file, is in
 * --help, is an option of nbdcached(8) and a key of nbdcached.conf(5);
 * names are unique, getopt values too; the helpers read, move and
 * compare values.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/options.h"
#include "daemon/settings.h"

/* A man page's text (the tests run from the top of the tree, as tests/run
 * does; NBDCACHED_TOP says where it is otherwise). */
static char *read_man(const char *rel)
{
	const char *top = getenv("NBDCACHED_TOP");
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", top ? top : ".", rel);
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "%s: cannot open (run from the top of the tree, or set "
				"NBDCACHED_TOP)\n",
			path);
		return NULL;
	}
	static char buf[1 << 20];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	return strdup(buf);
}

/* "cache-size" as groff writes it: "cache\-size". */
static void groff_name(const char *name, char *out, size_t len)
{
	size_t at = 0;
	for (; *name && at + 3 < len; name++) {
		if (*name == '-')
			out[at++] = '\\';
		out[at++] = *name;
	}
	out[at] = '\0';
}

static void test_table(void **state)
{
	(void)state;
	assert_true(settings_count > 30);
	for (size_t i = 0; i < settings_count; i++) {
		const struct setting *s = &settings[i];
		assert_non_null(s->name);
		assert_non_null(s->expect);
		assert_non_null(s->arg);
		assert_true(s->given != 0);
		assert_true(s->type == SETTING_STRING || s->parse);
		for (size_t j = 0; j < i; j++) {
			if (strcmp(settings[j].name, s->name) == 0 || settings[j].opt == s->opt ||
			    settings[j].given == s->given)
				fail_msg("settings %s and %s share a name, getopt value or given bit",
					 settings[j].name, s->name);
		}
		assert_ptr_equal(settings_find(s->name), s);
		assert_ptr_equal(settings_by_opt(s->opt), s);
	}
	/* _ for -, and nbd-server's spelling */
	assert_ptr_equal(settings_find("cache_size"), settings_find("cache-size"));
	assert_ptr_equal(settings_find("maxconnections"), settings_find("max-connections"));
	assert_null(settings_find("cache-sizes"));
}

/* Every setting is documented where an admin looks, and in --help. */
static void test_documented(void **state)
{
	(void)state;
	char *man8 = read_man("man/nbdcached.8"), *man5 = read_man("man/nbdcached.conf.5");
	assert_non_null(man8);
	assert_non_null(man5);
	const char *help = options_usage();
	int missing = 0;
	for (size_t i = 0; i < settings_count; i++) {
		char g[200], opt[220], flag[220];
		groff_name(settings[i].name, g, sizeof(g));
		snprintf(opt, sizeof(opt), "\\-\\-%s", g);
		snprintf(flag, sizeof(flag), "--%s", settings[i].name);
		if (!strstr(man8, opt)) {
			fprintf(stderr, "nbdcached(8) does not document %s\n", flag);
			missing++;
		}
		if (!strstr(man5, g)) {
			fprintf(stderr, "nbdcached.conf(5) does not document the key %s\n",
				settings[i].name);
			missing++;
		}
		if (!strstr(help, flag)) {
			fprintf(stderr, "--help does not show %s\n", flag);
			missing++;
		}
	}
	free(man8);
	free(man5);
	assert_int_equal(missing, 0);
}

/* Read, move, compare; a bad value's message; a string never empty. */
static void test_helpers(void **state)
{
	(void)state;
	struct options a, b;
	memset(&a, 0, sizeof(a));
	memset(&b, 0, sizeof(b));
	char why[300];
	const struct setting *size = settings_find("cache-size"), *user = settings_find("user"),
			     *ctl = settings_find("control"), *verify = settings_find("tls-verify-peer");
	assert_int_equal(settings_read(size, &a, "64M", why, sizeof(why)), 0);
	assert_int_equal(a.cache_size, 64ull << 20);
	assert_int_equal(settings_read(size, &a, "lots", why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "cache-size lots: expected a size"));
	assert_true(settings_differ(size, &a, &b));
	settings_take(size, &b, &a);
	assert_false(settings_differ(size, &a, &b));

	assert_int_equal(settings_read(user, &a, "", why, sizeof(why)), -EINVAL);
	assert_string_equal(why, "user: empty name");
	assert_int_equal(settings_read(user, &a, "nbd", why, sizeof(why)), 0);
	assert_string_equal(a.user, "nbd");
	assert_true(settings_differ(user, &a, &b));
	settings_take(user, &b, &a);
	assert_null(a.user);
	assert_string_equal(b.user, "nbd");
	free(b.user);

	char longpath[200];
	memset(longpath, 'x', sizeof(longpath) - 1);
	longpath[sizeof(longpath) - 1] = '\0';
	assert_int_equal(settings_read(ctl, &a, longpath, why, sizeof(why)), -EINVAL);
	assert_string_equal(why, "control: path empty or longer than 107 bytes");

	/* --tls-verify-peer alone: true */
	assert_int_equal(settings_read(verify, &a, NULL, why, sizeof(why)), 0);
	assert_true(a.tls_verify_peer);
	assert_int_equal(settings_read(verify, &a, "false", why, sizeof(why)), 0);
	assert_false(a.tls_verify_peer);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_table),
	    cmocka_unit_test(test_documented),
	    cmocka_unit_test(test_helpers),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
