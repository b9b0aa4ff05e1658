/*
 * client/nbdcachectl/conns.c: the NBD connections: connections (a table,
 * or the reply as is with --json) and disconnect ID.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/lib/ctl.h"
#include "client/lib/report.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

void print_connections(json_object *r)
{
	static const char *const headers[] = {"ID",   "PEER",	  "PHASE",    "EXPORT",
					      "READ", "WRITTEN",  "REQUESTS", "INFLIGHT",
					      "AGE",  "UPGRADES", "TLS"};
	struct table t = {
	    .columns = ARRAY_SIZE(headers), .headers = headers, .align = "rlllrrrrrrl"};

	for (size_t i = 0; i < ctl_array_length(r, "connections"); i++) {
		json_object *c = ctl_array_item(r, "connections", i);
		const char *s;
		table_cell(&t, "%" PRId64, ctl_get_int(c, "id"));
		table_cell(&t, "%s", (s = ctl_get_string(c, "peer")) ? s : "?");
		table_cell(&t, "%s%s", (s = ctl_get_string(c, "phase")) ? s : "?",
			   ctl_get_bool(c, "disconnecting") ? " (disconnecting)" : "");
		table_cell(&t, "%s", (s = ctl_get_string(c, "export")) ? s : "-");
		table_cell(&t, "%s", SIZE(ctl_get_int(c, "bytes_read")));
		table_cell(&t, "%s", SIZE(ctl_get_int(c, "bytes_written")));
		table_cell(&t, "%" PRId64, ctl_get_int(c, "requests"));
		table_cell(&t, "%" PRId64, ctl_get_int(c, "inflight"));
		table_cell(&t, "%s", format_duration((char[32]){0}, 32, ctl_get_int(c, "age_ms")));
		table_cell(&t, "%" PRId64, ctl_get_int(c, "upgrades"));
		/* TLS: its version and the client's identity, "-" without. */
		const char *who = ctl_get_string(c, "tls_peer");
		if (ctl_get_bool(c, "tls"))
			table_cell(&t, "%s%s%s",
				   (s = ctl_get_string(c, "tls_version")) ? s : "?",
				   who ? " " : "", who ? who : "");
		else
			table_cell(&t, "-");
	}
	table_print(&t);
	table_free(&t);
}

static void print_disconnect(json_object *reply, const struct options *o)
{
	(void)reply;
	printf("connection %s: disconnecting (in-flight replies go out first)\n", o->args[0]);
}

/* disconnect ID: the id goes as a number, not a string. */
int run_disconnect(const struct options *o)
{
	char *end;
	errno = 0;
	long long id = strtoll(o->args[0], &end, 10);
	if (errno || *end || end == o->args[0] || id <= 0) {
		report("disconnect: not a connection id: %s", o->args[0]);
		return -EINVAL;
	}
	json_object *req = json_object_new_object();
	json_object_object_add(req, "command", json_object_new_string("disconnect"));
	json_object_object_add(req, "id", json_object_new_int64(id));
	return run_request(o, req, print_disconnect);
}
