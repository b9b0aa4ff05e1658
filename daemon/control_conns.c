/*
 * daemon/control_conns.c: the commands about NBD connections: connections
 * (who is connected, doing what) and disconnect (close one, gently).
 *
 * The connections live on the worker threads; conn_list() copies what
 * this thread may see of them under the connection registry's lock, and
 * conn_disconnect() posts the close to the connection's worker. Neither
 * waits for a worker, so neither blocks the control thread.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/control_internal.h"

static json_object *connection_object(const struct conn_info *i)
{
	json_object *o = json_object_new_object();
	control_add_u64(o, "id", i->id);
	const struct access_peer *p = &i->peer;
	control_add_string(o, "transport", p->is_unix ? "unix" : "tcp");
	if (p->is_unix) {
		json_object_object_add(o, "address", NULL);
		json_object_object_add(o, "port", NULL);
		json_object_object_add(o, "uid",
				       p->has_cred ? json_object_new_int64(p->uid) : NULL);
		json_object_object_add(o, "pid",
				       p->has_cred ? json_object_new_int64(p->pid) : NULL);
	} else {
		/* p->text is "ADDRESS:PORT" or "[V6]:PORT": the address alone. */
		char addr[64];
		const char *t = p->text;
		const char *colon = strrchr(t, ':');
		size_t n = colon ? (size_t)(colon - t) : strlen(t);
		if (t[0] == '[' && n >= 2) {
			t++;
			n -= 2;
		}
		snprintf(addr, sizeof(addr), "%.*s", (int)n, t);
		control_add_string(o, "address", addr);
		control_add_u64(o, "port", p->port);
		json_object_object_add(o, "uid", NULL);
		json_object_object_add(o, "pid", NULL);
	}
	control_add_string(o, "peer", p->text);
	control_add_string(o, "phase", i->transmitting ? "transmitting" : "negotiating");
	control_add_string(o, "export", i->transmitting ? i->export : NULL);
	control_add_u64(o, "bytes_read", i->bytes_read);
	control_add_u64(o, "bytes_written", i->bytes_written);
	control_add_u64(o, "requests", i->requests);
	control_add_u64(o, "payload_copied", i->payload_copied);
	control_add_u64(o, "inflight", i->inflight);
	control_add_u64(o, "age_s", i->age_ms / 1000);
	control_add_u64(o, "age_ms", i->age_ms);
	control_add_u64(o, "worker", i->worker);
	json_object_object_add(o, "disconnecting", json_object_new_boolean(i->closing));
	control_add_u64(o, "upgrades", i->upgrades);
	/* TLS, once its handshake is done: version, cipher suite, the client's
	 * identity (certificate DN or PSK username; null when it gave none). */
	json_object_object_add(o, "tls", json_object_new_boolean(i->tls));
	control_add_string(o, "tls_version", i->tls ? i->tls_version : NULL);
	control_add_string(o, "tls_cipher", i->tls ? i->tls_cipher : NULL);
	control_add_string(o, "tls_peer",
			   i->tls && p->has_identity ? p->identity : NULL);
	return o;
}

void control_cmd_connections(struct control_client *cl)
{
	struct conn_info *v;
	size_t n;
	if (conn_list(&v, &n) < 0) {
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++)
		json_object_array_add(a, connection_object(&v[i]));
	free(v);
	json_object *o = control_reply_ok();
	json_object_object_add(o, "connections", a);
	control_send(cl, o);
}

void control_cmd_disconnect(struct control_client *cl, json_object *req)
{
	json_object *v;
	if (!json_object_object_get_ex(req, "id", &v) || !json_object_is_type(v, json_type_int) ||
	    json_object_get_int64(v) <= 0) {
		control_send_error(cl, EINVAL,
				   "disconnect needs \"id\": a connection id (see "
				   "\"connections\")");
		return;
	}
	uint64_t id = (uint64_t)json_object_get_int64(v);
	int rc = conn_disconnect(id, "disconnected by the control socket");
	if (rc == -ENOENT) {
		control_send_error(cl, ENOENT, "no connection %" PRIu64, id);
		return;
	}
	if (rc < 0) {
		control_send_error(cl, -rc, "%s", strerror(-rc));
		return;
	}
	json_object *o = control_reply_ok();
	control_add_u64(o, "id", id);
	control_send(cl, o);
}
