/*
 * tests/unit/test_settings.c: the tables of global and per-export settings
 * (daemon/settings.h) against what reads them and what documents them:
 * every global setting parses on the command line and in the config file,
 * is in --help, is an option of nbdcached(8) and a key of
 * nbdcached.conf(5); every export setting is a key of --export in
 * nbdcached(8), of EXPORT KEYS in nbdcached.conf(5) and of --help, and
 * RELOAD there names it where a reload may change it and elsewhere where
 * it cannot; names are unique, getopt values too; the helpers read, move
 * and compare values.
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
#include <ctype.h>

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

/* What documents the settings: the two man pages, and --help. */
struct pages {
	char *man8, *man5;
	const char *help;
};

static int pages_read(void **state)
{
	static struct pages p;
	p.man8 = read_man("man/nbdcached.8");
	p.man5 = read_man("man/nbdcached.conf.5");
	p.help = options_usage();
	*state = &p;
	return p.man8 && p.man5 ? 0 : -1;
}

static int pages_free(void **state)
{
	struct pages *p = *state;
	free(p->man8);
	free(p->man5);
	return 0;
}

/* Every setting is documented where an admin looks, and in --help. */
static void test_documented(void **state)
{
	const struct pages *pages = *state;
	const char *man8 = pages->man8, *man5 = pages->man5, *help = pages->help;
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
	assert_int_equal(missing, 0);
}

/* The part of text from the first start to the end that follows it (not
 * included), malloc'd; "" when start is not there. */
static char *part(const char *text, const char *start, const char *end)
{
	const char *a = strstr(text, start);
	if (!a)
		return strdup("");
	const char *b = strstr(a + strlen(start), end);
	return strndup(a, b ? (size_t)(b - a) : strlen(a));
}

/* How often the groff name g stands in text as a word of its own
 * ("size" is not in "block\-size", nor "dirty" in "dirty\-high"). */
static int words(const char *text, const char *g)
{
	int n = 0;
	size_t len = strlen(g);
	for (const char *p = strstr(text, g); p; p = strstr(p + 1, g)) {
		char before = p == text ? ' ' : p[-1], after = p[len];
		bool font = p - text >= 3 && p[-3] == '\\' && p[-2] == 'f'; /* after \fB */
		if ((font || (!isalnum((unsigned char)before) && before != '-')) &&
		    !isalnum((unsigned char)after) && !(after == '\\' && p[len + 1] == '-'))
			n++;
	}
	return n;
}

/* Does a tag line (the line after ".TP") of section name g? */
static bool tagged(const char *section, const char *g)
{
	for (const char *p = strstr(section, ".TP\n"); p; p = strstr(p + 1, ".TP\n")) {
		const char *line = p + 4, *eol = strchr(line, '\n');
		char *tag = strndup(line, eol ? (size_t)(eol - line) : strlen(line));
		int found = words(tag, g);
		free(tag);
		if (found)
			return true;
	}
	return false;
}

static void test_export_table(void **state)
{
	(void)state;
	assert_true(export_settings_count > 10 && export_settings_count <= 32);
	for (size_t i = 0; i < export_settings_count; i++) {
		const struct setting *s = &export_settings[i];
		assert_non_null(s->name);
		assert_non_null(s->expect);
		assert_non_null(s->arg);
		assert_int_equal(s->opt, 0);
		assert_true(s->type != SETTING_VALUE || s->parse);
		assert_true(!s->optional || (s->type == SETTING_VALUE && s->size == sizeof(bool)));
		for (size_t j = 0; j < i; j++)
			if (strcmp(export_settings[j].name, s->name) == 0)
				fail_msg("two export settings named %s", s->name);
		assert_ptr_equal(export_settings_find(s->name), s);
		assert_int_equal(export_settings_bit(s), UINT32_C(1) << i);
		/* --export tells it from the keys with code of their own */
		assert_null(access_list_named(s->name, strlen(s->name)));
		assert_false(qos_is_key(s->name));
		/* An export without it takes the global setting given names. */
		if (s->given) {
			const struct setting *g = NULL;
			for (size_t k = 0; k < settings_count; k++)
				if (settings[k].given == s->given)
					g = &settings[k];
			if (!g || g->size != s->size || g->type != s->type)
				fail_msg("export setting %s: no global setting of its size",
					 s->name);
		}
	}
	assert_ptr_equal(export_settings_find("block_size"), export_settings_find("block-size"));
	assert_ptr_equal(export_settings_find("maxconnections"),
			 export_settings_find("max-connections"));
	assert_null(export_settings_find("backend"));
}

/* Every export setting is documented with --export, in EXPORT KEYS, in
 * --help, and in RELOAD as a reload treats it. */
static void test_export_documented(void **state)
{
	const struct pages *pages = *state;
	char *spec = part(pages->man8, ".BI \\-\\-export ", "\n.TP");
	char *keys = part(pages->man5, ".SH EXPORT KEYS", "\n.SH ");
	char *reload = part(pages->man5, ".SH RELOAD", "\n.SH ");
	char *changed = part(reload, ".TP\nChanged\n", "\n.TP");
	int missing = 0;
	for (size_t i = 0; i < export_settings_count; i++) {
		const struct setting *s = &export_settings[i];
		char g[200], in8[220], in_help[220];
		groff_name(s->name, g, sizeof(g));
		snprintf(in8, sizeof(in8), s->optional ? "\\fB%s\\fR" : "\\fB%s=", g);
		snprintf(in_help, sizeof(in_help), s->optional ? "[,%s]" : "[,%s=", s->name);
		if (!strstr(spec, in8)) {
			fprintf(stderr, "nbdcached(8) --export does not document %s\n", s->name);
			missing++;
		}
		if (!tagged(keys, g)) {
			fprintf(stderr, "nbdcached.conf(5) EXPORT KEYS does not document %s\n",
				s->name);
			missing++;
		}
		if (!strstr(pages->help, in_help)) {
			fprintf(stderr, "--help does not show --export ...,%s\n", s->name);
			missing++;
		}
		if (!s->fixed && !words(changed, g)) {
			fprintf(stderr, "nbdcached.conf(5) RELOAD: %s is not under Changed\n",
				s->name);
			missing++;
		}
		if (s->fixed && (words(changed, g) || !words(reload, g))) {
			fprintf(stderr,
				"nbdcached.conf(5) RELOAD: %s (a live export keeps it) is under "
				"Changed, or not in RELOAD\n",
				s->name);
			missing++;
		}
	}
	free(spec);
	free(keys);
	free(reload);
	free(changed);
	assert_int_equal(missing, 0);
}

/* An export's settings from the command line and the file: read, given,
 * defaults from the global ones, freed. */
static void test_export_helpers(void **state)
{
	(void)state;
	struct options o;
	options_defaults(&o);
	o.seq_cutoff = 1 << 20;
	o.cache_mode = CACHE_MODE_WRITETHROUGH;
	struct export_spec e;
	memset(&e, 0, sizeof(e));
	char why[300];
	const struct setting *cutoff = export_settings_find("seq-cutoff"),
			     *text = export_settings_find("description"),
			     *flag = export_settings_find("readonly"),
			     *tls = export_settings_find("tls"),
			     *mc = export_settings_find("maxconnections");
	assert_int_equal(export_settings_read(cutoff, &e, "seq_cutoff", "big", why, sizeof(why)),
			 -EINVAL);
	assert_string_equal(why, "seq_cutoff big: expected a size");
	assert_int_equal(e.given, 0);
	assert_int_equal(export_settings_read(cutoff, &e, "seq-cutoff", "4M", why, sizeof(why)), 0);
	assert_true(e.given & export_settings_bit(cutoff));
	assert_int_equal(export_settings_read(mc, &e, "maxconnections", "-2", why, sizeof(why)),
			 -EINVAL);
	assert_string_equal(why, "maxconnections -2: expected 0..65536 (0: unlimited)");
	/* a text may be empty and hold commas; not over 4096 bytes */
	assert_int_equal(export_settings_read(text, &e, "description", "", why, sizeof(why)), 0);
	assert_string_equal(e.description, "");
	assert_int_equal(export_settings_read(text, &e, "description", "a, b", why, sizeof(why)),
			 0);
	assert_string_equal(e.description, "a, b");
	char *longer = calloc(1, 4098);
	memset(longer, 'd', 4097);
	assert_int_equal(export_settings_read(text, &e, "description", longer, why, sizeof(why)),
			 -EINVAL);
	assert_string_equal(why, "description: longer than 4096 bytes");
	memset(longer + 4096, '\0', 1);
	assert_int_equal(export_settings_read(text, &e, "description", longer, why, sizeof(why)),
			 0);
	free(longer);
	/* a flag alone is true; the file's key says true or false */
	assert_int_equal(export_settings_read(flag, &e, "readonly", NULL, why, sizeof(why)), 0);
	assert_true(e.readonly);
	assert_int_equal(export_settings_read(flag, &e, "readonly", "no", why, sizeof(why)), 0);
	assert_false(e.readonly);
	/* tls: require, or on (the global setting: no change) */
	assert_int_equal(export_settings_read(tls, &e, "tls", "require", why, sizeof(why)), 0);
	assert_int_equal(export_settings_read(tls, &e, "tls", "on", why, sizeof(why)), 0);
	assert_true(e.tls_require);
	assert_int_equal(export_settings_read(tls, &e, "tls", "off", why, sizeof(why)), -EINVAL);
	assert_string_equal(why, "tls off: expected require (or on) in an export");
	/* a value word of expect as --export types it */
	char expect[200];
	assert_string_equal(settings_expect(tls, "tls", expect, sizeof(expect)),
			    "expected tls=require (or tls=on) in an export");
	/* what it was not given comes from the global settings */
	export_settings_defaults(&e, &o);
	assert_int_equal(e.seq_cutoff, 4u << 20);
	assert_int_equal(e.cache_mode, CACHE_MODE_WRITETHROUGH);
	assert_int_equal(e.block_size, OPTIONS_DEFAULT_BLOCK_SIZE);
	assert_int_equal(e.dirty_high, OPTIONS_DEFAULT_DIRTY_HIGH);
	export_settings_free(&e);
	assert_null(e.description);
	options_free(&o);
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
	    cmocka_unit_test_setup_teardown(test_documented, pages_read, pages_free),
	    cmocka_unit_test(test_helpers),
	    cmocka_unit_test(test_export_table),
	    cmocka_unit_test_setup_teardown(test_export_documented, pages_read, pages_free),
	    cmocka_unit_test(test_export_helpers),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
