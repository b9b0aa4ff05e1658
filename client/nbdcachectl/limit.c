/*
 * client/nbdcachectl/limit.c: limit EXPORT KEY=VALUE...: an export's QoS
 * limits set live (the control socket's "limit"), then the limits in force
 * printed. With no KEY=VALUE, the limits are only shown (a "limit" with
 * nothing to change).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "client/lib/ctl.h"
#include "client/lib/report.h"
#include "client/nbdcachectl/nbdcachectl.h"

static void print_rate(json_object *l, const char *what, const char *rate, const char *burst,
		       const char *unit)
{
	int64_t r = ctl_get_int(l, rate);
	if (r)
		printf("  %-14s %" PRId64 " %s (burst %" PRId64 ")\n", what, r, unit,
		       ctl_get_int(l, burst));
	else
		printf("  %-14s unlimited\n", what);
}

static void print_limits(json_object *reply, const struct options *o)
{
	json_object *l = ctl_field(reply, "limits");
	printf("export %s (until the next reload):\n", o->args[0]);
	print_rate(l, "export iops", "iops_limit", "iops_burst", "requests/s");
	print_rate(l, "export bytes", "bytes_limit", "bytes_burst", "bytes/s");
	print_rate(l, "client iops", "client_iops_limit", "client_iops_burst", "requests/s");
	print_rate(l, "client bytes", "client_bytes_limit", "client_bytes_burst", "bytes/s");
}

int run_limit(const struct options *o)
{
	json_object *limits = json_object_new_object();
	for (int i = 1; i < o->nargs; i++) {
		const char *eq = strchr(o->args[i], '=');
		if (!eq || eq == o->args[i] || !eq[1]) {
			report("limit: expected KEY=VALUE, not %s", o->args[i]);
			json_object_put(limits);
			return -EINVAL;
		}
		char key[64];
		snprintf(key, sizeof(key), "%.*s", (int)(eq - o->args[i]), o->args[i]);
		json_object_object_add(limits, key, json_object_new_string(eq + 1));
	}
	json_object *req = json_object_new_object();
	json_object_object_add(req, "command", json_object_new_string("limit"));
	json_object_object_add(req, "export", json_object_new_string(o->args[0]));
	json_object_object_add(req, "limits", limits);
	return run_request(o, req, print_limits);
}
