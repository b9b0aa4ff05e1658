/*
 * client/nbdcachectl/upgrade.c: upgrade [--binary PATH] [--timeout S]: the
 * daemon starts a new one (its own binary by default) and hands it every
 * connection; the reply comes once the new one serves (with those it
 * closed instead, and why), or with the reason it did not (then the old
 * one serves on, and the exit status is 1).
 */
#include <stdio.h>

#include <json-c/json.h>

#include "client/nbdcachectl/nbdcachectl.h"

static long long field(json_object *r, const char *key)
{
	json_object *v;
	return json_object_object_get_ex(r, key, &v) ? (long long)json_object_get_int64(v) : -1;
}

static void print_upgrade(json_object *reply, const struct options *o)
{
	(void)o;
	printf("upgraded: pid %lld serves now; %lld connection(s) moved, %lld closed; clients "
	       "paused %lld ms\n",
	       field(reply, "pid"), field(reply, "moved"), field(reply, "closed"),
	       field(reply, "pause_ms"));
	/* Those the new daemon would not resume: another object under the
	 * export's name, a client the access rules no longer admit. */
	json_object *why;
	if (field(reply, "refused") > 0 && json_object_object_get_ex(reply, "refused_why", &why))
		printf("closed by the new daemon: %lld: %s\n", field(reply, "refused"),
		       json_object_get_string(why));
}

int run_upgrade(const struct options *o)
{
	json_object *req = json_object_new_object();
	json_object_object_add(req, "command", json_object_new_string("upgrade"));
	if (o->binary)
		json_object_object_add(req, "binary", json_object_new_string(o->binary));
	if (o->timeout)
		json_object_object_add(req, "timeout", json_object_new_int64(o->timeout));
	return run_request(o, req, print_upgrade);
}
