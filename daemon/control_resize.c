/*
 * daemon/control_resize.c: the control socket's resize command.
 *
 *   {"command": "resize", "export": NAME}               to the backend's size now
 *   {"command": "resize", "export": NAME, "size": SIZE} to SIZE bytes (a number,
 *                                                        or a string with a suffix)
 *
 * export_resize() does the work on this thread, as NBD_CMD_RESIZE's does:
 * one resize at a time, serial with reload. It may cut or extend a file
 * and walk the cache's entries past the new end: quick, but on this
 * thread, never an NBD worker. The reply says the old and new size; a
 * refused shrink says how many dirty bytes are past the new end.
 */
#include <errno.h>
#include <string.h>

#include "daemon/control_internal.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/option_values.h"

/* "size": absent (0, *has false), a non-negative integer, or a size string
 * ("64M", "1G", "4096"). -EINVAL (answered) otherwise. */
static int size_of(struct control_client *cl, json_object *req, bool *has, uint64_t *size)
{
	json_object *v;
	*has = json_object_object_get_ex(req, "size", &v) && v;
	if (!*has)
		return 0;
	if (json_object_is_type(v, json_type_int) && json_object_get_int64(v) > 0) {
		*size = (uint64_t)json_object_get_int64(v);
		return 0;
	}
	if (json_object_is_type(v, json_type_string) &&
	    options_parse_size(json_object_get_string(v), size) == 0)
		return 0;
	control_send_error(cl, EINVAL,
			   "\"size\" must be a positive number of bytes or a size such as "
			   "\"64M\" (suffixes K, M, G, T)");
	return -EINVAL;
}

void control_cmd_resize(struct control_client *cl, json_object *req)
{
	json_object *v;
	if (!json_object_object_get_ex(req, "export", &v) ||
	    !json_object_is_type(v, json_type_string)) {
		control_send_error(cl, EINVAL, "resize needs \"export\": NAME");
		return;
	}
	const char *name = json_object_get_string(v);
	bool has_size;
	uint64_t size = 0;
	if (size_of(cl, req, &has_size, &size) < 0)
		return;
	struct export_resize_result res;
	int rc = export_resize(cl->ctl->cfg.exports, name, has_size, size, &res);
	if (rc < 0) {
		log_warn("export '%s': resize refused (control socket): %s", name, res.message);
		control_send_error(cl, -rc, "resize '%s': %s", name, res.message);
		return;
	}
	log_info("export '%s': %llu -> %llu bytes (control socket)", name,
		 (unsigned long long)res.old_size, (unsigned long long)res.new_size);
	json_object *o = control_reply_ok();
	control_add_string(o, "export", name);
	control_add_u64(o, "old_size", res.old_size);
	control_add_u64(o, "new_size", res.new_size);
	control_send(cl, o);
}
