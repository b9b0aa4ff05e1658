/*
 * client/nbdcachectl/attach.c: what a kernel client needs. attach: "status"
 * and "exports" turned into an nbd-client command line for one export,
 * printed (shell-quoted, or as JSON) or executed. windows: the windows of a
 * split export (EXPORT/K, from "exports"), for a 32-bit kernel that cannot
 * use the whole of a large one.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/lib/report.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

#define ATTACH_CONNECTIONS 4
#define NBD_CLIENT_MAX_BLOCK 4096 /* nbd-client accepts 512..4096 */

/* Print `s` so that a POSIX shell reads it back as one word. */
static void print_shell_word(const char *s)
{
	if (*s && strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
			    "0123456789_@%+=:,./-") == strlen(s)) {
		fputs(s, stdout);
		return;
	}
	putchar('\'');
	for (; *s; s++)
		fputs(*s == '\'' ? "'\\''" : (char[2]){*s, 0}, stdout);
	putchar('\'');
}

/* A wildcard listen address reached from this host: its loopback. */
static const char *local_address(const char *address)
{
	if (strcmp(address, "0.0.0.0") == 0)
		return "127.0.0.1";
	if (strcmp(address, "::") == 0)
		return "::1";
	return address;
}

/*
 * The daemon's socket nbd-client should use: a Unix one when there is any,
 * else the first TCP one (a socket-activated fd counts when it is TCP).
 */
static int pick_listen(json_object *status, const char **unix_path, const char **host,
		       int64_t *port)
{
	*unix_path = *host = NULL;
	for (size_t i = 0; i < ctl_array_length(status, "listen"); i++) {
		json_object *l = ctl_array_item(status, "listen", i);
		const char *type = ctl_get_string(l, "type");

		if (!type)
			continue;
		if (strcmp(type, "unix") == 0 && ctl_get_string(l, "path")) {
			*unix_path = ctl_get_string(l, "path");
			return 0;
		}
		if (!*host && strcmp(type, "unix") != 0 && ctl_get_string(l, "address")) {
			*host = local_address(ctl_get_string(l, "address"));
			*port = ctl_get_int(l, "port");
		}
	}
	return *host ? 0 : -ENOENT;
}

int run_attach(const struct options *o)
{
	static const char *const none[2] = {NULL};
	const char *name = o->args[0], *device = o->nargs > 1 ? o->args[1] : "/dev/nbd0";
	const char *unix_path, *host, *argv[16];
	char port[24], block[24], connections[24];
	struct ctl c = CTL_INIT;
	json_object *status = NULL, *exports = NULL, *export, *out;
	int64_t block_size, port_number = 0, conns = ATTACH_CONNECTIONS;
	size_t n = 0;
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, ctl_request("status", none, NULL, 0), &status);
	if (!err)
		err = ctl_call(&c, ctl_request("exports", none, NULL, 0), &exports);
	if (err)
		goto cleanup;
	export = ctl_find_named(exports, "exports", name);
	if (!export) {
		report("no export named %s", name);
		err = -ENOENT;
		goto cleanup;
	}
	if (pick_listen(status, &unix_path, &host, &port_number) != 0) {
		report("the daemon listens on no Unix or TCP socket");
		err = -ENOENT;
		goto cleanup;
	}
	argv[n++] = "nbd-client";
	if (unix_path) {
		argv[n++] = "-unix";
		argv[n++] = unix_path;
	} else {
		snprintf(port, sizeof(port), "%" PRId64, port_number);
		argv[n++] = host;
		argv[n++] = port;
	}
	argv[n++] = device;
	argv[n++] = "-N";
	argv[n++] = name;
	/* nbd-client takes 512..4096; the daemon serves any alignment from 1 byte. */
	block_size = ctl_get_int(export, "block_size");
	block_size = block_size > NBD_CLIENT_MAX_BLOCK ? NBD_CLIENT_MAX_BLOCK
		     : block_size < 512		       ? 512
						       : block_size;
	snprintf(block, sizeof(block), "%" PRId64, block_size);
	argv[n++] = "-b";
	argv[n++] = block;
	if (ctl_get_int(export, "max_connections") > 0 &&
	    ctl_get_int(export, "max_connections") < conns)
		conns = ctl_get_int(export, "max_connections");
	snprintf(connections, sizeof(connections), "%" PRId64, conns);
	argv[n++] = "-C";
	argv[n++] = connections;
	if (ctl_get_bool(export, "readonly"))
		argv[n++] = "-readonly";
	argv[n] = NULL;

	if (o->run) {
		fflush(stdout);
		execvp(argv[0], (char **)argv);
		err = -errno;
		report("cannot run %s: %s", argv[0], strerror(-err));
	} else if (o->json) {
		json_object *words = json_object_new_array();
		out = json_object_new_object();
		json_object_object_add(out, "argv", words);
		for (size_t i = 0; i < n; i++)
			json_object_array_add(words, json_object_new_string(argv[i]));
		puts(json_object_to_json_string_ext(out, JSON_C_TO_STRING_PLAIN |
							     JSON_C_TO_STRING_NOSLASHESCAPE));
		json_object_put(out);
	} else {
		for (size_t i = 0; i < n; i++) {
			fputs(i ? " " : "", stdout);
			print_shell_word(argv[i]);
		}
		putchar('\n');
	}
cleanup:
	json_object_put(exports);
	json_object_put(status);
	ctl_close(&c);
	return err;
}

int run_windows(const struct options *o)
{
	static const char *const none[2] = {NULL};
	static const char *const headers[] = {"NAME", "FIRST", "LAST", "SIZE", "BYTES"};
	const char *name = o->args[0];
	struct ctl c = CTL_INIT;
	json_object *exports = NULL, *out = NULL, *list = NULL;
	struct table t = {.columns = ARRAY_SIZE(headers), .headers = headers, .align = "lrrrr"};
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, ctl_request("exports", none, NULL, 0), &exports);
	if (err)
		goto cleanup;
	json_object *parent = ctl_find_named(exports, "exports", name);
	if (!parent) {
		report("no export named %s", name);
		err = -ENOENT;
		goto cleanup;
	}
	if (ctl_get_int(parent, "split") <= 0) {
		report("export %s has no windows (it has no split=)", name);
		err = -ENOENT;
		goto cleanup;
	}
	out = json_object_new_object();
	list = json_object_new_array();
	json_object_object_add(out, "export", json_object_new_string(name));
	json_object_object_add(out, "windows", list);
	for (size_t i = 0; i < ctl_array_length(exports, "exports"); i++) {
		json_object *e = ctl_array_item(exports, "exports", i);
		const char *of = ctl_get_string(e, "window_of"), *wname = ctl_get_string(e, "name");
		if (!of || !wname || strcmp(of, name) != 0)
			continue;
		/* Bytes of the split export (its own offset taken off). */
		int64_t first = ctl_get_int(e, "offset") - ctl_get_int(parent, "offset");
		int64_t size = ctl_get_int(e, "size");
		json_object *w = json_object_new_object();
		json_object_object_add(w, "name", json_object_new_string(wname));
		json_object_object_add(w, "first", json_object_new_int64(first));
		json_object_object_add(w, "last", json_object_new_int64(first + size - 1));
		json_object_object_add(w, "size", json_object_new_int64(size));
		json_object_array_add(list, w);
		table_cell(&t, "%s", wname);
		table_cell(&t, "%" PRId64, first);
		table_cell(&t, "%" PRId64, first + size - 1);
		table_cell(&t, "%s", SIZE(size));
		table_cell(&t, "%" PRId64, size);
	}
	if (o->json)
		puts(json_object_to_json_string_ext(out, JSON_C_TO_STRING_PLAIN |
							     JSON_C_TO_STRING_NOSLASHESCAPE));
	else if (table_print(&t) < 0)
		err = -ENOMEM;
cleanup:
	table_free(&t);
	json_object_put(out);
	json_object_put(exports);
	ctl_close(&c);
	return err;
}
