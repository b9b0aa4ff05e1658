/*
 * daemon/main.c: nbdcached's entry point: parse the command line, run the
 * server. Everything else lives in the modules named in DESIGN.md.
 */
#include <stdio.h>

#include "daemon/log.h"
#include "daemon/options.h"
#include "daemon/server.h"

#ifndef NBDCACHED_VERSION
#define NBDCACHED_VERSION "0.1"
#endif

int main(int argc, char **argv)
{
	struct options opts;
	char err[512];
	if (options_parse(argc, argv, &opts, err, sizeof(err)) < 0) {
		fprintf(stderr, "nbdcached: %s\n%s", err, options_usage());
		return 2;
	}
	if (opts.help) {
		fputs(options_usage(), stdout);
		options_free(&opts);
		return 0;
	}
	if (opts.version) {
		puts("nbdcached " NBDCACHED_VERSION);
		options_free(&opts);
		return 0;
	}
	log_set_level(opts.log_level);
	int status = server_run(&opts);
	options_free(&opts);
	return status;
}
