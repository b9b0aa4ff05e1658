/*
 * daemon/settings.h: one declaration per setting, in two tables of one
 * struct: the global settings (settings[]) and the per-export ones
 * (export_settings[]). Every place a setting is read from walks them:
 *
 *   the command line   options.c: getopt's long options for --NAME, and
 *                      the value read into struct options; export_spec.c:
 *                      --export NAME=BACKEND,KEY=VALUE,... into struct
 *                      export_spec
 *   the config file    config_keys.c: the [generic] key NAME and the key
 *                      NAME of an export's section (- or _)
 *   the merge          config.c: the file's value where the command line
 *                      gave none; options.c: an export's value where it
 *                      gave none is the global setting's
 *   --help             options_usage(): every --NAME and every --export KEY
 *   a reload           control_reload.c: a global setting fixed at start
 *                      that a reload would change is named, and kept
 *   the man pages      tests/unit/test_settings.c: every name is an
 *                      option of nbdcached(8) and a key of
 *                      nbdcached.conf(5), an export's key under --export
 *                      and EXPORT KEYS, and in RELOAD where it may change
 *
 * A new global setting is one row of settings[] (and its field in struct
 * options, its OPT_GIVEN_ bit, its use); a new export setting is one row of
 * export_settings[] (and its field in struct export_spec, its use). Settings
 * with a shape of their own keep their own code: globally the listen
 * addresses, exports, access and metrics lists, TLS's optional argument on
 * the command line; per export the backend (NAME=BACKEND on the command
 * line, backend or exportname in the file: it names the export's backing,
 * never a setting of it), the access rules (a list runs on over commas and
 * adds up; access.h) and the QoS limits (a family of keys with their own
 * parser and messages; qos.h), and nbd-server's flush, fua and trim (only
 * true is accepted, and means nothing).
 *
 * What a reload does with an export's settings stays export.c's
 * (export_table_reload): it compares the live version with the new
 * export_spec, and the live version holds the values in shapes of its own
 * (the read-only flag with the backend's, the window's size against the
 * backend's size now, the cache mode the cache holds, which nbdcachectl
 * set-mode may have changed). An export row's `fixed` says what that code
 * does, and test_settings holds the man page's RELOAD to it: a live export
 * keeps a fixed setting (block-size: a reload that changes it is refused
 * for the export, which keeps its old settings; cache-device-warm: read
 * when the backend is opened, a reload says nothing of it); it takes the
 * others, unless the cache or the backend depends on them (readonly,
 * cache-mode to or from none: backing_refusal()).
 */
#ifndef NBDCACHED_DAEMON_SETTINGS_H
#define NBDCACHED_DAEMON_SETTINGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/options.h"

enum setting_type {
	SETTING_VALUE,	/* parse() reads it into its field */
	SETTING_STRING, /* a char * of struct options, copied; never empty */
	SETTING_TEXT,	/* a char *, copied; may be empty and hold commas (an
			 * --export's runs on over commas to the next key) */
};

/* A row. Where an export's row means something else, it says "export:". */
struct setting {
	/* --NAME, and the [generic] key NAME; export: the key KEY of --export
	 * (KEY=VALUE) and of an export's section */
	const char *name;
	int opt; /* getopt's value for --NAME: its short letter, or above 255;
		  * export: 0 */
	/* OPT_GIVEN_*; export: the OPT_GIVEN_* of the global setting whose
	 * value an export without this key takes (0: none) */
	uint64_t given;
	enum setting_type type;
	size_t offset, size; /* its field in struct options; export: in struct export_spec */
	int (*parse)(const char *text, void *field); /* SETTING_VALUE: 0 or < 0 */
	/* What a bad value is told: "NAME VALUE: EXPECT" (a string's, "NAME:
	 * EXPECT"), after "--" on the command line, after "FILE:LINE: " in the
	 * file; export: "--export EXPORT: bad NAME=VALUE: EXPECT" on the
	 * command line. A word =WORD is a value, said as it is typed:
	 * NAME=WORD in --export, WORD elsewhere (settings_expect). */
	const char *expect;
	size_t max_len; /* SETTING_STRING, _TEXT: shorter than this (0: any length) */
	/* a reload cannot change it: said, and the old value kept; export: a
	 * live export keeps it (a new export takes it) */
	bool fixed;
	/* --NAME alone says true (a bool: tls-verify-peer); export: KEY alone,
	 * its only spelling in --export (the file's key takes true or false) */
	bool optional;
	const char *arg; /* its value in --help: "N", "SIZE", "auto|require|off" */
};

extern const struct setting settings[];
extern const size_t settings_count;

/* Is name (a config key as written) key? - and _ alike. */
bool settings_key_is(const char *name, const char *key);
/* By its name (- or _ alike), or NULL. An alias of nbd-server's
 * (maxconnections) is found too. */
const struct setting *settings_find(const char *name);
/* By getopt's value, or NULL. */
const struct setting *settings_by_opt(int opt);
/* text into s's field of o: 0; -EINVAL with why ("NAME VALUE: EXPECT");
 * -ENOMEM. The given bits are the caller's. */
int settings_read(const struct setting *s, struct options *o, const char *text, char *why,
		  size_t why_len);
/* s's value of src becomes dst's (a string moves: src's is NULL after). */
void settings_take(const struct setting *s, struct options *dst, struct options *src);
/* s's expect into buf (len bytes), its values =WORD said as KEY=WORD (an
 * --export's) or, key NULL, as WORD: buf. */
const char *settings_expect(const struct setting *s, const char *key, char *buf, size_t len);
/* Do a and b hold different values of s? */
bool settings_differ(const struct setting *s, const struct options *a, const struct options *b);
/* "[--NAME ARG] ..." for every setting, wrapped as --help's lines after
 * indent spaces, into buf: the bytes written (at most len - 1). */
size_t settings_usage(char *buf, size_t len, unsigned indent);

/*
 * The per-export settings (struct export_spec). An export's given holds a
 * bit per row of this table, 1u << its index (export_settings_bit).
 */
extern const struct setting export_settings[];
extern const size_t export_settings_count;

/* By its config key (- or _ alike; nbd-server's maxconnections too), or NULL. */
const struct setting *export_settings_find(const char *name);
/* s's bit of export_spec.given. */
uint32_t export_settings_bit(const struct setting *s);
/* text (NULL: an optional row's KEY alone) into s's field of e, and s's bit
 * into e->given: 0; -EINVAL with why ("KEY VALUE: EXPECT", KEY as the caller
 * spells it); -ENOMEM. */
int export_settings_read(const struct setting *s, struct export_spec *e, const char *key,
			 const char *text, char *why, size_t why_len);
/* Each setting e was not given that has a global one takes o's value. */
void export_settings_defaults(struct export_spec *e, const struct options *o);
/* Free e's strings of the table (not its name, backend, origin). */
void export_settings_free(struct export_spec *e);
/* "[--export NAME=BACKEND[,KEY=ARG]...]..." with every export setting,
 * wrapped as --help's lines after indent spaces, into buf: the bytes
 * written (at most len - 1). */
size_t export_settings_usage(char *buf, size_t len, unsigned indent);

#endif
