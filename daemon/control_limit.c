/*
 * daemon/control_limit.c: the limit command: an export's QoS limits
 * (qos.h) changed live, in place on its limiter, shared by the export's
 * versions and its split windows. Every key=value is checked before any
 * applies (all or nothing). A limit set here lasts until the next reload,
 * which sets every export's limits to the configuration's again.
 *
 * Also the limits' JSON object, which exports and stats show.
 *
 * Control thread only (control_internal.h).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "daemon/clock.h"
#include "daemon/control_internal.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/qos.h"

json_object *control_limits_object(const struct qos_limits *l)
{
	json_object *o = json_object_new_object();
	control_add_u64(o, "iops_limit", l->iops.rate);
	control_add_u64(o, "iops_burst", l->iops.burst ? l->iops.burst : l->iops.rate);
	control_add_u64(o, "bytes_limit", l->bytes.rate);
	control_add_u64(o, "bytes_burst", l->bytes.burst ? l->bytes.burst : l->bytes.rate);
	control_add_u64(o, "client_iops_limit", l->client_iops.rate);
	control_add_u64(o, "client_iops_burst",
			l->client_iops.burst ? l->client_iops.burst : l->client_iops.rate);
	control_add_u64(o, "client_bytes_limit", l->client_bytes.rate);
	control_add_u64(o, "client_bytes_burst",
			l->client_bytes.burst ? l->client_bytes.burst : l->client_bytes.rate);
	return o;
}

void control_cmd_limit(struct control_client *cl, json_object *req)
{
	json_object *name, *set;
	if (!json_object_object_get_ex(req, "export", &name) ||
	    !json_object_is_type(name, json_type_string) ||
	    !json_object_object_get_ex(req, "limits", &set) ||
	    !json_object_is_type(set, json_type_object)) {
		control_send_error(
		    cl, EINVAL, "limit needs \"export\": NAME and \"limits\": {KEY: VALUE, ...}");
		return;
	}
	const char *export_name = json_object_get_string(name);
	struct export *e = export_get(cl->ctl->cfg.exports, export_name, strlen(export_name));
	if (!e || !export_name[0]) {
		export_put(e);
		control_send_error(cl, ENOENT, "no such export '%s'", export_name);
		return;
	}
	struct qos_stats now;
	qos_limiter_get(e->counter->qos, &now);
	struct qos_limits l = now.limits;
	json_object_object_foreach(set, key, value)
	{
		char text[64], why[200];
		if (json_object_is_type(value, json_type_int) && json_object_get_int64(value) >= 0)
			snprintf(text, sizeof(text), "%lld",
				 (long long)json_object_get_int64(value));
		else if (json_object_is_type(value, json_type_string))
			snprintf(text, sizeof(text), "%s", json_object_get_string(value));
		else
			snprintf(text, sizeof(text), "(not a string)");
		int rc = qos_limits_set(&l, key, text, why, sizeof(why));
		if (rc == 0) {
			control_send_error(
			    cl, EINVAL,
			    "unknown limit '%s' (iops-limit, iops-burst, bytes-limit, "
			    "bytes-burst, client-iops-limit, client-iops-burst, "
			    "client-bytes-limit, client-bytes-burst)",
			    key);
			export_put(e);
			return;
		}
		if (rc < 0) {
			control_send_error(cl, EINVAL, "%s", why);
			export_put(e);
			return;
		}
	}
	qos_limiter_set(e->counter->qos, &l, clock_now_ns());
	char text[512];
	qos_limits_describe(&l, text, sizeof(text));
	log_info("export '%s': limits %s, set by the control socket until the next reload",
		 export_rules_name(e), text);
	json_object *o = control_reply_ok();
	control_add_string(o, "export", e->name);
	json_object_object_add(o, "limits", control_limits_object(&l));
	control_send(cl, o);
	export_put(e);
}
