/*
 * daemon/config_internal.h: what the config file's two halves share:
 * config.c reads the file (lines counted, long lines kept aside), merges
 * what it set into the command line's options and loads; config_keys.c
 * knows the keys of [generic] and of an export's section. One thread (the
 * main one, or the control thread's reload) at a time; no locking.
 */
#ifndef NBDCACHED_DAEMON_CONFIG_INTERNAL_H
#define NBDCACHED_DAEMON_CONFIG_INTERNAL_H

#include <stdint.h>
#include <stdio.h>

#include "daemon/config.h"
#include "daemon/options.h"

struct config_ctx {
	const char *path;
	FILE *stream;
	unsigned line;	       /* the line inih is parsing */
	unsigned section_line; /* where the last [section] header was */
	char *buf;	       /* the line read */
	size_t bufsize;
	char *long_value;	  /* the value of the last line too long for inih */
	char *long_section;	  /* the name of the last section too long for inih */
	struct options *opts;	  /* the command line so far */
	struct options file;	  /* what the file sets (globals and exports) */
	uint64_t set;		  /* OPT_GIVEN_* bits the file set */
	char *listenaddr, *port;  /* nbd-server style, combined at the end */
	char current[4097];	  /* section of the export being filled */
	struct export_spec *spec; /* the export of the current section */
	unsigned spec_keys;	  /* bits: backend and QoS keys given (config_keys.c) */
	int rc;
	char *err;
	size_t errlen;
};

/* Record the first error (with FILE:LINE) and tell inih this line failed:
 * returns 0. */
int config_fail(struct config_ctx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* inih's handler: one "key = value" of a section. */
int config_on_key(void *user, const char *section, const char *name, const char *value);
/* Finish the export of the section just left: it must name its backend. */
void config_finish_export(struct config_ctx *x);

#endif
