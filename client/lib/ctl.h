/*
 * client/lib/ctl.h: a client of nbdcached's control socket.
 *
 * Owns: one connection to the control socket (a Unix stream socket) and the
 * bytes read from it but not yet used. The protocol is the one of
 * include/nbdcached/control.h: one JSON object per line each way, one reply
 * per request, in order; every reply is an object with a boolean "ok".
 *
 *   ctl_connect -> ctl_call (ctl_send, ctl_receive, ctl_reply_status) ...
 *               -> ctl_close
 *
 * ctl_send and ctl_receive may also be used apart, to keep a request in
 * flight while waiting on something else (nbdcachectl flush polls two
 * connections at once).
 *
 * Errors: 0 / -errno, and the reason is reported on stderr where it is
 * found (client/lib/report.h), so a caller only passes the error on.
 *
 * Reply fields are read with the ctl_get_* accessors: a missing or
 * mistyped field reads as 0, false or NULL, so a reply from an older or
 * newer daemon never crashes the client.
 *
 * Locking: none; one thread uses a connection.
 */
#ifndef CLIENT_LIB_CTL_H
#define CLIENT_LIB_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <json-c/json.h>

struct ctl {
	int fd;
	const char *path;
	char *buffer;
	size_t length, capacity;
	char *line;	  /* the last reply line, NUL-terminated, valid until the next */
	size_t line_size; /* bytes of the buffer it takes, newline included */
};
#define CTL_INIT                                                                                   \
	{                                                                                          \
		.fd = -1                                                                           \
	}

int ctl_connect(struct ctl *c, const char *path);
void ctl_close(struct ctl *c);

/* Send one request line; takes the request (NULL: allocation failed). */
int ctl_send(struct ctl *c, json_object *request);

/* One reply: an object with a boolean "ok". *reply is the caller's to put. */
int ctl_receive(struct ctl *c, json_object **reply);

/* 0 for ok=true; for ok=false the daemon's message on stderr and -EREMOTEIO. */
int ctl_reply_status(json_object *reply);

/*
 * Send one request, read its reply. 0 when the daemon said ok; -EREMOTEIO
 * when it refused (message printed, *reply still set for --json); other
 * errors leave *reply NULL.
 */
int ctl_call(struct ctl *c, json_object *request, json_object **reply);

/*
 * {"command": NAME, KEY: ARG...}: up to two positional ARGS in the fields
 * `keys` names, in order (a NULL key ends the list). NULL when out of memory.
 */
json_object *ctl_request(const char *name, const char *const *keys, char **args, int nargs);

/* ---- Reply access: a missing or mistyped field reads as 0, false or NULL. ---- */

json_object *ctl_field(json_object *o, const char *key);
int64_t ctl_get_int(json_object *o, const char *key);
double ctl_get_double(json_object *o, const char *key);
bool ctl_get_bool(json_object *o, const char *key);
/* The string, or NULL when the field is missing, null or not a string. */
const char *ctl_get_string(json_object *o, const char *key);
size_t ctl_array_length(json_object *o, const char *key);
json_object *ctl_array_item(json_object *o, const char *key, size_t i);
/* The element of array `key` whose "name" is `name`, or NULL. */
json_object *ctl_find_named(json_object *o, const char *key, const char *name);

#endif
