/*
 * client/nbdcachectl/main.c: nbdcachectl, nbdcached's control client: its
 * command line and the table of commands.
 *
 * Talks to the daemon's control socket through client/lib/ctl.h. Most
 * commands are one request and one reply (run_simple), printed for people
 * by show.c (sizes in KiB/MiB/GiB, ratios as percentages, aligned tables)
 * or, with --json, as the daemon's reply line exactly as it arrived, so
 * that scripts see every field the daemon sends.
 *
 * Some commands do more, each in its own file:
 *   flush   (flush.c) the request on one connection, "stats" polled every
 *           100 ms on a second one to draw the dirty bytes draining;
 *   top     (top.c) "stats" every --interval, rates from two samples;
 *   attach  (attach.c) "status" and "exports" turned into an nbd-client
 *           command line, printed (shell-quoted) or executed;
 *   windows (attach.c) a split export's windows, from "exports";
 *   limit   (limit.c) KEY=VALUE arguments into one "limit" request;
 *   upgrade (upgrade.c) --binary and --timeout into one "upgrade" request.
 *
 *   main -> parse_args -> command->run (run_simple, run_flush, run_top,
 *           run_attach) -> ctl_call -> ctl_send / ctl_receive
 *
 * Errors are 0 / -errno inside and are printed where detected. Exit status:
 * 0 success; 1 the daemon refused (an ok=false reply), could not be
 * reached or broke the protocol; 2 a usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/lib/report.h"
#include "client/nbdcachectl/nbdcachectl.h"
#include "include/nbdcached/control.h"

#define PROGRAM "nbdcachectl"
int run_request(const struct options *o, json_object *req,
		void (*print)(json_object *reply, const struct options *o))
{
	struct ctl c = CTL_INIT;
	json_object *reply = NULL;
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, req, &reply);
	else
		json_object_put(req);
	if (reply && o->json)
		puts(c.line);
	else if (!err)
		print(reply, o);
	json_object_put(reply);
	ctl_close(&c);
	return err;
}

static void print_command(json_object *reply, const struct options *o)
{
	o->command->print(reply);
}

/* A command of one request: the reply as received (--json) or for people. */
static int run_simple(const struct options *o)
{
	return run_request(o, ctl_request(o->command->name, o->command->keys, o->args, o->nargs),
			   print_command);
}

/* ---- Command line. ---- */

static const struct command commands[] = {
    {"status", {NULL}, 0, 0, print_status, run_simple},
    {"exports", {NULL}, 0, 0, print_exports, run_simple},
    {"stats", {"export"}, 0, 1, print_stats, run_simple},
    {"flush", {"export"}, 1, 1, NULL, run_flush},
    {"drop-clean", {"export"}, 1, 1, print_drop_clean, run_simple},
    {"compact", {NULL}, 0, 0, print_compact, run_simple},
    {"set-mode", {"export", "mode"}, 2, 2, print_set_mode, run_simple},
    {"reload", {NULL}, 0, 0, print_reload, run_simple},
    {"top", {NULL}, 0, 0, NULL, run_top},
    {"attach", {NULL}, 1, 2, NULL, run_attach},
    {"windows", {NULL}, 1, 1, NULL, run_windows},
    {"connections", {NULL}, 0, 0, print_connections, run_simple},
    {"disconnect", {NULL}, 1, 1, NULL, run_disconnect},
    {"resize", {"export", "size"}, 1, 2, print_resize, run_simple},
    {"limit", {NULL}, 1, 64, NULL, run_limit},
    {"upgrade", {NULL}, 0, 0, NULL, run_upgrade},
    {"cache-device", {"action"}, 0, 1, print_cache_device, run_simple},
};

static void usage(FILE *f)
{
	fputs("usage: " PROGRAM " [--control PATH] [--json] COMMAND [ARGS]\n"
	      "commands: status | exports | stats [EXPORT] | flush EXPORT\n"
	      "          | drop-clean EXPORT | compact | set-mode EXPORT MODE | reload\n"
	      "          | top [--count N] [--interval SECONDS]\n"
	      "          | attach EXPORT [DEVICE] [--run] | windows EXPORT\n"
	      "          | connections | disconnect ID | resize EXPORT [SIZE]\n"
	      "          | limit EXPORT [KEY=VALUE...]  (iops-limit, bytes-limit,\n"
	      "            client-iops-limit, client-bytes-limit and their -burst)\n"
	      "          | upgrade [--binary PATH] [--timeout SECONDS]\n"
	      "          | cache-device [status | flush | detach]\n"
	      "default control socket: " NBDCACHED_CONTROL_DEFAULT "\n"
	      "exit status: 0 success, 1 the daemon refused or could not be reached, 2 usage\n",
	      f);
}

/* 0, 1 after --help, or -EINVAL after printing why. */
static int parse_args(int argc, char **argv, struct options *o)
{
	static const struct option options[] = {{"control", required_argument, NULL, 'c'},
						{"json", no_argument, NULL, 'j'},
						{"count", required_argument, NULL, 'n'},
						{"interval", required_argument, NULL, 'i'},
						{"run", no_argument, NULL, 'r'},
						{"binary", required_argument, NULL, 'b'},
						{"timeout", required_argument, NULL, 't'},
						{"help", no_argument, NULL, 'h'},
						{NULL, 0, NULL, 0}};
	char *end;
	int opt;

	*o = (struct options){.control = NBDCACHED_CONTROL_DEFAULT, .interval = 1};
	while ((opt = getopt_long(argc, argv, "c:jh", options, NULL)) != -1) {
		switch (opt) {
		case 'c':
			o->control = optarg;
			break;
		case 'j':
			o->json = true;
			break;
		case 'n':
			errno = 0;
			o->count = strtol(optarg, &end, 10);
			o->top_options = true;
			if (errno || *end || end == optarg || o->count < 0) {
				report("--count: not a count: %s", optarg);
				return -EINVAL;
			}
			break;
		case 'i':
			o->interval = strtod(optarg, &end);
			o->top_options = true;
			if (*end || end == optarg ||
			    !(o->interval >= 0.01 && o->interval <= 86400)) {
				report("--interval: 0.01 to 86400 seconds: %s", optarg);
				return -EINVAL;
			}
			break;
		case 'r':
			o->run = true;
			break;
		case 'b':
			o->binary = optarg;
			o->upgrade_options = true;
			break;
		case 't':
			errno = 0;
			o->timeout = strtol(optarg, &end, 10);
			o->upgrade_options = true;
			if (errno || *end || end == optarg || o->timeout < 1 || o->timeout > 3600) {
				report("--timeout: 1 to 3600 seconds: %s", optarg);
				return -EINVAL;
			}
			break;
		case 'h':
			usage(stdout);
			return 1;
		default:
			return -EINVAL;
		}
	}
	if (optind >= argc) {
		report("no COMMAND");
		return -EINVAL;
	}
	for (size_t i = 0; i < ARRAY_SIZE(commands); i++)
		if (strcmp(commands[i].name, argv[optind]) == 0)
			o->command = &commands[i];
	if (!o->command) {
		report("unknown command %s", argv[optind]);
		return -EINVAL;
	}
	o->args = argv + optind + 1;
	o->nargs = argc - optind - 1;
	if (o->nargs < o->command->min_args || o->nargs > o->command->max_args) {
		report("%s: wrong number of arguments", o->command->name);
		return -EINVAL;
	}
	if ((o->top_options && o->command->run != run_top) ||
	    (o->run && o->command->run != run_attach) ||
	    (o->upgrade_options && o->command->run != run_upgrade)) {
		report("%s: option not valid with this command", o->command->name);
		return -EINVAL;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct options o;
	int err;

	report_set_program(PROGRAM);
	err = parse_args(argc, argv, &o);
	if (err) {
		if (err < 0)
			fputs("Try '" PROGRAM " --help'.\n", stderr);
		return err < 0 ? 2 : 0;
	}
	signal(SIGPIPE, SIG_IGN);
	err = o.command->run(&o);
	if (fflush(stdout) != 0 && !err) {
		report("standard output: %s", strerror(errno));
		err = -EIO;
	}
	return err ? 1 : 0;
}
