/*
 * client/lib/ctl.c: the control socket's client side (see ctl.h).
 *
 * Replies are read into one growing buffer, up to REPLY_MAX; a reply line
 * is handed out in place (c->line) and dropped when the next is read, so
 * that --json can print it exactly as it arrived.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/lib/report.h"
#include "include/nbdcached/control.h"

#define REPLY_MAX (64u << 20) /* longest reply line accepted */

/* ---- Reply access. ---- */

json_object *ctl_field(json_object *o, const char *key)
{
	json_object *v = NULL;

	return o && json_object_object_get_ex(o, key, &v) ? v : NULL;
}

int64_t ctl_get_int(json_object *o, const char *key)
{
	return json_object_get_int64(ctl_field(o, key));
}

double ctl_get_double(json_object *o, const char *key)
{
	return json_object_get_double(ctl_field(o, key));
}

bool ctl_get_bool(json_object *o, const char *key)
{
	return json_object_get_boolean(ctl_field(o, key));
}

/* The string, or NULL when the field is missing, null or not a string. */
const char *ctl_get_string(json_object *o, const char *key)
{
	json_object *v = ctl_field(o, key);

	return json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

size_t ctl_array_length(json_object *o, const char *key)
{
	json_object *v = ctl_field(o, key);

	return json_object_is_type(v, json_type_array) ? json_object_array_length(v) : 0;
}

json_object *ctl_array_item(json_object *o, const char *key, size_t i)
{
	return json_object_array_get_idx(ctl_field(o, key), i);
}

/* The element of array `key` whose "name" is `name`, or NULL. */
json_object *ctl_find_named(json_object *o, const char *key, const char *name)
{
	for (size_t i = 0; i < ctl_array_length(o, key); i++) {
		const char *n = ctl_get_string(ctl_array_item(o, key, i), "name");
		if (n && strcmp(n, name) == 0)
			return ctl_array_item(o, key, i);
	}
	return NULL;
}

/* ---- The control connection. ---- */

int ctl_connect(struct ctl *c, const char *path)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	int err;

	c->path = path;
	if (strlen(path) >= sizeof(addr.sun_path)) {
		report("control socket path too long: %s", path);
		return -ENAMETOOLONG;
	}
	strcpy(addr.sun_path, path);
	c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->fd < 0)
		goto failed;
	if (connect(c->fd, (struct sockaddr *)&addr, sizeof(addr)) == 0)
		return 0;
failed:
	err = -errno;
	report("cannot connect to the control socket %s: %s%s", path, strerror(-err),
	       err == -ENOENT || err == -ECONNREFUSED ? " (is nbdcached running with --control?)"
	       : err == -EACCES			      ? " (it is root's unless loosened)"
						      : "");
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	return err;
}

void ctl_close(struct ctl *c)
{
	if (c->fd >= 0)
		close(c->fd);
	free(c->buffer);
	*c = (struct ctl)CTL_INIT;
}

/* Send one request line; takes the request (NULL: allocation failed). */
int ctl_send(struct ctl *c, json_object *request)
{
	const char *text =
	    request ? json_object_to_json_string_ext(request, JSON_C_TO_STRING_PLAIN |
								  JSON_C_TO_STRING_NOSLASHESCAPE)
		    : NULL;
	size_t length = text ? strlen(text) : 0, done = 0;
	char *line = text ? malloc(length + 1) : NULL;

	if (line) {
		memcpy(line, text, length);
		line[length++] = '\n';
	}
	json_object_put(request);
	if (!line) {
		report("%s", strerror(ENOMEM));
		return -ENOMEM;
	}
	/* The daemon would close the connection on a longer one. */
	if (length > NBDCACHED_CONTROL_MAX_REQUEST) {
		report("request longer than %d bytes", NBDCACHED_CONTROL_MAX_REQUEST);
		free(line);
		return -EMSGSIZE;
	}
	while (done < length) {
		ssize_t n = send(c->fd, line + done, length - done, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int err = -errno;
			report("%s: %s", c->path, strerror(-err));
			free(line);
			return err;
		}
		done += (size_t)n;
	}
	free(line);
	return 0;
}

/* The next line from the daemon into c->line, blocking until it is whole. */
static int ctl_read_line(struct ctl *c)
{
	char *newline;

	if (c->line) { /* drop the line handed out last time */
		memmove(c->buffer, c->buffer + c->line_size, c->length - c->line_size);
		c->length -= c->line_size;
		c->line = NULL;
	}
	while (!(newline = c->length ? memchr(c->buffer, '\n', c->length) : NULL)) {
		ssize_t n;
		if (c->length == c->capacity) {
			size_t capacity = c->capacity ? 2 * c->capacity : 65536;
			char *buffer = capacity <= REPLY_MAX ? realloc(c->buffer, capacity) : NULL;
			if (!buffer) {
				report("%s: reply longer than %u bytes", c->path, REPLY_MAX);
				return -EMSGSIZE;
			}
			c->buffer = buffer;
			c->capacity = capacity;
		}
		n = read(c->fd, c->buffer + c->length, c->capacity - c->length);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			int err = n < 0 ? -errno : -ECONNRESET;
			report("%s: %s", c->path,
			       n < 0 ? strerror(-err) : "the daemon closed the connection");
			return err;
		}
		c->length += (size_t)n;
	}
	*newline = '\0';
	c->line = c->buffer;
	c->line_size = (size_t)(newline - c->buffer) + 1;
	return 0;
}

/* One reply: an object with a boolean "ok". *reply is the caller's to put. */
int ctl_receive(struct ctl *c, json_object **reply)
{
	enum json_tokener_error jerr;
	int err = ctl_read_line(c);

	if (err)
		return err;
	*reply = json_tokener_parse_verbose(c->line, &jerr);
	if (*reply && json_object_is_type(*reply, json_type_object) &&
	    json_object_is_type(ctl_field(*reply, "ok"), json_type_boolean))
		return 0;
	report("%s: malformed reply (%s): %.200s", c->path,
	       *reply ? "not an object with a boolean \"ok\"" : json_tokener_error_desc(jerr),
	       c->line);
	json_object_put(*reply);
	*reply = NULL;
	return -EPROTO;
}

/* 0 for ok=true; for ok=false the daemon's message on stderr and -EREMOTEIO. */
int ctl_reply_status(json_object *reply)
{
	const char *error = ctl_get_string(reply, "error");

	if (ctl_get_bool(reply, "ok"))
		return 0;
	report("%s", error ? error : "the daemon refused (no message)");
	return -EREMOTEIO;
}

/* {"command": NAME, KEY: ARG...}: the positional ARGS in the command's fields. */
json_object *ctl_request(const char *name, const char *const *keys, char **args, int nargs)
{
	json_object *request = json_object_new_object();

	if (!request)
		return NULL;
	json_object_object_add(request, "command", json_object_new_string(name));
	for (int i = 0; i < nargs && i < 2 && keys[i]; i++)
		json_object_object_add(request, keys[i], json_object_new_string(args[i]));
	return request;
}

/*
 * Send one request, read its reply. 0 when the daemon said ok; -EREMOTEIO
 * when it refused (message printed, *reply still set for --json); other
 * errors leave *reply NULL.
 */
int ctl_call(struct ctl *c, json_object *request, json_object **reply)
{
	int err = ctl_send(c, request);

	*reply = NULL;
	if (!err)
		err = ctl_receive(c, reply);
	return err ? err : ctl_reply_status(*reply);
}
