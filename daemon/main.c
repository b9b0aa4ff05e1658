/*
 * daemon/main.c: nbdcached's entry point: read the command line and the
 * config file, then run the server (or, with --check-config, report what
 * would be served and exit). Everything else lives in the modules named in
 * docs/architecture.md.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/cache/device.h"
#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/options.h"
#include "daemon/server.h"
#include "daemon/stop_signals.h"
#include "daemon/tls.h"
#include "daemon/upgrade.h"

#ifndef NBDCACHED_VERSION
#define NBDCACHED_VERSION "0.1"
#endif

/* The access rules of a spec, on one line after prefix (none: nothing). */
static void print_access(const char *prefix, const struct access_spec *a)
{
	const char *sep = "";
	for (size_t i = 0; i < ACCESS_LISTS; i++) {
		const char *list = *access_spec_list((struct access_spec *)a, &access_lists[i]);
		if (!list)
			continue;
		printf("%s%s%s ", *sep ? "" : prefix, *sep ? sep : "access: ", access_lists[i].key);
		for (const char *p = list; *p; p++) /* identities: one per line */
			fputs(*p == '\n' ? " | " : (char[2]){*p, 0}, stdout);
		sep = "; ";
	}
	if (*sep)
		printf("\n");
}

/*
 * --check-config: the syntax and values are already checked; say what would
 * be served. A file backend that does not exist yet is worth a warning, not
 * a failure: images are often created after the config.
 */
static int check_config(const struct options *opts)
{
	/* The TLS credentials are loaded as the daemon would load them. */
	struct tls_creds *creds;
	char tls[1024];
	if (tls_creds_load(opts, &creds, tls, sizeof(tls)) < 0) {
		fprintf(stderr, "nbdcached: %s\n", tls);
		return 2;
	}
	tls_creds_describe(creds, tls, sizeof(tls));
	tls_creds_put(creds);
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *e = &opts->exports[i];
		struct stat st;
		if (options_backend_is_path(e->backend) && stat(e->backend, &st) < 0)
			fprintf(stderr, "nbdcached: warning: export '%s': %s: %m\n", e->name,
				e->backend);
		printf("export '%s': %s, cache %s, block size %u%s", e->name, e->backend,
		       options_cache_mode_name(e->cache_mode), e->block_size,
		       e->readonly ? ", read-only" : "");
		if (e->offset || e->size)
			printf(", bytes %" PRIu64 " to %s", e->offset, e->size ? "" : "the end");
		if (e->size)
			printf("%" PRIu64, e->offset + e->size - 1);
		if (e->split)
			printf(", split into windows of %" PRIu64 " bytes", e->split);
		if (e->tls_require)
			printf(", TLS required");
		size_t first = options_backend_first(opts, i);
		if (first != i)
			printf(", one cache with export '%s'", opts->exports[first].name);
		if (first != i && strcmp(opts->exports[first].backend, e->backend) != 0)
			printf(" (the same file as %s)", opts->exports[first].backend);
		putchar('\n');
		if (qos_limits_any(&e->qos)) {
			char limits[512];
			qos_limits_describe(&e->qos, limits, sizeof(limits));
			printf("  limits: %s\n", limits);
		}
		print_access("  ", &e->access);
	}
	print_access("global ", &opts->access);
	if (opts->max_connections_per_client)
		printf("at most %u connection(s) per client\n", opts->max_connections_per_client);
	if (strcmp(tls, "tls off") != 0)
		printf("%s\n", tls);
	if (opts->cache_device) {
		/* Read only: what a start would replay, or why it would refuse. */
		char text[2048];
		int rc = cache_device_check(opts->cache_device, opts, text, sizeof(text));
		if (rc < 0) {
			fprintf(stderr, "nbdcached: %s\n", text);
			return 1;
		}
		printf("%s\n", text);
	}
	if (opts->metrics) {
		printf("metrics on http://%s/metrics\n", opts->metrics);
		print_access("metrics ", &opts->metrics_access);
	}
	printf("config OK%s%s: %zu export(s)\n", opts->config_path ? ": " : "",
	       opts->config_path ? opts->config_path : "", opts->export_count);
	return 0;
}

int main(int argc, char **argv)
{
	/* Before anything else: a SIGTERM from here on is a clean stop, taken
	 * between the start's steps (stop_signals.h), never the default
	 * action's end with sockets and pidfile left behind. */
	stop_signals_block();
	struct options opts;
	char err[1024];
	/* A live upgrade's new daemon: the old one waits on this (upgrade.h). */
	int upgrade_fd = upgrade_child_fd();
	if (config_options(argc, argv, &opts, err, sizeof(err)) < 0) {
		fprintf(stderr, "nbdcached: %s\n", err);
		if (upgrade_fd >= 0)
			upgrade_child_fail(upgrade_fd, err);
		if (strncmp(err, "unknown or incomplete option", 28) == 0 ||
		    strncmp(err, "unexpected argument", 19) == 0)
			fputs(options_usage(), stderr);
		return 2;
	}
	if (opts.help || opts.version || opts.check_config)
		stop_signals_restore(); /* nothing to stop cleanly */
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
	if (opts.check_config) {
		int rc = check_config(&opts);
		options_free(&opts);
		return rc;
	}
	log_set_level(opts.log_level);
	int status = server_run(&opts, argc, argv, &upgrade_fd);
	if (status != 0 && upgrade_fd >= 0) {
		char why[1024];
		log_last_error(why, sizeof(why));
		upgrade_child_fail(upgrade_fd, why);
	}
	options_free(&opts);
	return status;
}
