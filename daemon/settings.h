/*
 * daemon/settings.h: one declaration per global setting, the table that
 * every place a setting is read from walks:
 *
 *   the command line   options.c: getopt's long options for --NAME, and
 *                      the value read into struct options
 *   the config file    config_keys.c: the [generic] key NAME (- or _)
 *   the merge          config.c: the file's value where the command line
 *                      gave none
 *   a reload           control_reload.c: a setting fixed at start that a
 *                      reload would change is named, and kept
 *   the man pages      tests/integration/settings_table.py: every name is
 *                      an option of nbdcached(8) and a key of
 *                      nbdcached.conf(5)
 *
 * A new global setting is one row here (and its field in struct options,
 * its OPT_GIVEN_ bit, its use). Settings with a shape of their own (the
 * listen addresses, exports, access and metrics lists, TLS's optional
 * argument on the command line) keep their own code.
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
};

struct setting {
	const char *name; /* --NAME, and the [generic] key NAME */
	int opt;	  /* getopt's value for --NAME: its short letter, or above 255 */
	uint64_t given;	  /* OPT_GIVEN_* */
	enum setting_type type;
	size_t offset, size; /* its field in struct options */
	int (*parse)(const char *text, void *field); /* SETTING_VALUE: 0 or < 0 */
	/* What a bad value is told: "NAME VALUE: EXPECT" (a string's, "NAME:
	 * EXPECT"), after "--" on the command line, after "FILE:LINE: " in the
	 * file. */
	const char *expect;
	size_t max_len; /* SETTING_STRING: shorter than this (0: any length) */
	bool fixed;	/* a reload cannot change it: said, and the old value kept */
	bool optional;	/* --NAME alone says true (a bool: tls-verify-peer) */
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
/* Do a and b hold different values of s? */
bool settings_differ(const struct setting *s, const struct options *a, const struct options *b);
/* "[--NAME ARG] ..." for every setting, wrapped as --help's lines after
 * indent spaces, into buf: the bytes written (at most len - 1). */
size_t settings_usage(char *buf, size_t len, unsigned indent);

#endif
