/*
 * daemon/control.c: see control.h; the protocol is include/nbdcached/control.h.
 *
 * Each client is a bufferevent on the control thread. A request line is
 * parsed with json-c and answered by one handler. Handlers that wait for the
 * cache (flush, set-mode leaving writeback) stop reading from their client
 * until they reply, so replies stay in request order; other clients go on
 * being served meanwhile (nbdcachectl flush polls stats on a second
 * connection while its flush runs).
 *
 *   client --line--> dispatch --> reply now
 *                             \-> cache op (FLUSH) --done on this thread--> reply
 *
 * Once a second a timer samples the writeback counters (for writeback_rate)
 * and reaps removed exports (export_table_reap).
 *
 * This file is the socket: clients, request lines, dispatch, the tick and
 * the thread's life cycle. The commands are in control_stats.c,
 * control_cache.c and control_reload.c (control_internal.h).
 */
#include "daemon/control.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <json-c/json.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/budget.h"
#include "daemon/clock.h"
#include "daemon/control_internal.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "include/nbdcached/control.h"

/*
 * A client whose unread replies reach CONTROL_MAX_OUTPUT is not read (and
 * its requests not answered) until they drain below half of it; at most
 * CONTROL_MAX_CLIENTS clients at a time. So all of them together hold at
 * most CONTROL_MAX_CLIENTS x (CONTROL_MAX_OUTPUT + one reply + one
 * request line).
 */
#define CONTROL_MAX_OUTPUT (1u << 20)
#define CONTROL_MAX_CLIENTS 64

static const char *errno_name(int e)
{
	switch (e) {
	case ENOENT:
		return "ENOENT";
	case EINVAL:
		return "EINVAL";
	case EIO:
		return "EIO";
	case EBUSY:
		return "EBUSY";
	case ENOTSUP:
		return "ENOTSUP";
	case ENOMEM:
		return "ENOMEM";
	case ENOSPC:
		return "ENOSPC";
	case EAGAIN:
		return "EAGAIN";
	default:
		return "EIO";
	}
}

/* ---- replies ---- */

void control_send(struct control_client *cl, json_object *reply)
{
	if (cl->bev) {
		const char *text = json_object_to_json_string_ext(reply, JSON_C_TO_STRING_PLAIN);
		struct evbuffer *out = bufferevent_get_output(cl->bev);
		evbuffer_add(out, text, strlen(text));
		evbuffer_add(out, "\n", 1);
	}
	json_object_put(reply);
}

json_object *control_reply_ok(void)
{
	json_object *o = json_object_new_object();
	json_object_object_add(o, "ok", json_object_new_boolean(1));
	return o;
}

void control_send_error(struct control_client *cl, int err, const char *fmt, ...)
{
	char text[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	json_object *o = json_object_new_object();
	json_object_object_add(o, "ok", json_object_new_boolean(0));
	json_object_object_add(o, "error", json_object_new_string(text));
	json_object_object_add(o, "errno", json_object_new_string(errno_name(err)));
	control_send(cl, o);
}

/* ---- requests ---- */

/* Keys in the text: strings followed by a colon (strict JSON: only '"' quotes). */
static size_t keys_in_text(const char *text, size_t len)
{
	size_t keys = 0;
	for (size_t i = 0; i < len; i++) {
		if (text[i] != '"')
			continue;
		for (i++; i < len && text[i] != '"'; i++)
			if (text[i] == '\\')
				i++;
		size_t j = i + 1;
		while (j < len && strchr(" \t\r\n", text[j]))
			j++;
		if (j < len && text[j] == ':')
			keys++;
	}
	return keys;
}

/* Keys json-c kept, at every depth (its tokener bounds the depth). */
static size_t keys_in_tree(json_object *o)
{
	size_t keys = 0;
	if (json_object_is_type(o, json_type_object)) {
		json_object_object_foreach(o, key, value)
		{
			(void)key;
			keys += 1 + keys_in_tree(value);
		}
	} else if (json_object_is_type(o, json_type_array)) {
		for (size_t i = 0; i < json_object_array_length(o); i++)
			keys += keys_in_tree(json_object_array_get_idx(o, i));
	}
	return keys;
}

/*
 * One request: strict JSON, one object, nothing but white space after it,
 * no key twice in any object. json-c keeps the last of duplicate keys
 * without a word, so {"command":"status","command":"reload"} would reload:
 * a duplicate shows as fewer keys in the tree than in the text (each one
 * drops at least itself). NULL, with *why set, when refused.
 */
static json_object *parse_request(const char *line, size_t len, const char **why)
{
	*why = "expected one JSON object per line with \"command\": NAME";
	json_tokener *tok = json_tokener_new();
	if (!tok)
		return NULL;
	json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
	json_object *req = json_tokener_parse_ex(tok, line, (int)len);
	bool complete = json_tokener_get_error(tok) == json_tokener_success;
	size_t end = json_tokener_get_parse_end(tok);
	json_tokener_free(tok);
	if (!req || !complete || !json_object_is_type(req, json_type_object))
		goto refuse;
	for (size_t i = end; i < len; i++) {
		if (!strchr(" \t\r", line[i])) {
			*why = "text after the JSON object (one object per line)";
			goto refuse;
		}
	}
	if (keys_in_tree(req) != keys_in_text(line, end)) {
		*why = "a key given twice in one object";
		goto refuse;
	}
	return req;
refuse:
	json_object_put(req);
	return NULL;
}

static void dispatch(struct control_client *cl, const char *line, size_t len)
{
	const char *why;
	json_object *req = parse_request(line, len, &why);
	json_object *v;
	if (!req || !json_object_object_get_ex(req, "command", &v) ||
	    !json_object_is_type(v, json_type_string)) {
		control_send_error(cl, EINVAL, "%s", req ? "expected \"command\": NAME" : why);
		json_object_put(req);
		return;
	}
	const char *cmd = json_object_get_string(v);
	if (strcmp(cmd, "status") == 0)
		control_cmd_status(cl);
	else if (strcmp(cmd, "exports") == 0)
		control_cmd_exports(cl);
	else if (strcmp(cmd, "stats") == 0) {
		json_object *e;
		const char *only = NULL;
		if (json_object_object_get_ex(req, "export", &e)) {
			if (!json_object_is_type(e, json_type_string)) {
				control_send_error(cl, EINVAL, "\"export\" must be a string");
				json_object_put(req);
				return;
			}
			only = json_object_get_string(e);
		}
		control_cmd_stats(cl, only);
	} else if (strcmp(cmd, "flush") == 0)
		control_cmd_flush(cl, req, false);
	else if (strcmp(cmd, "set-mode") == 0)
		control_cmd_flush(cl, req, true);
	else if (strcmp(cmd, "drop-clean") == 0)
		control_cmd_drop_clean(cl, req);
	else if (strcmp(cmd, "compact") == 0)
		control_cmd_compact(cl);
	else if (strcmp(cmd, "reload") == 0)
		control_reload_now(cl->ctl, cl);
	else if (strcmp(cmd, "connections") == 0)
		control_cmd_connections(cl);
	else if (strcmp(cmd, "disconnect") == 0)
		control_cmd_disconnect(cl, req);
	else if (strcmp(cmd, "resize") == 0)
		control_cmd_resize(cl, req);
	else if (strcmp(cmd, "limit") == 0)
		control_cmd_limit(cl, req);
	else if (strcmp(cmd, "upgrade") == 0)
		control_cmd_upgrade(cl, req);
	else if (strcmp(cmd, "cache-device") == 0)
		control_cmd_cache_device(cl, req);
	else if (strcmp(cmd, "debug-unpin") == 0 && control_debug_hooks())
		control_cmd_debug_unpin(cl, req);
	else
		control_send_error(
		    cl, EINVAL,
		    "unknown command '%s' (status, exports, stats, flush, drop-clean, "
		    "compact, set-mode, reload, connections, disconnect, resize, limit, "
		    "upgrade, cache-device)",
		    cmd);
	json_object_put(req);
}

/* ---- clients ---- */

static void client_free(struct control_client *cl)
{
	if (cl->wait)
		cl->wait->client = NULL; /* its completion finds no one to answer */
	if (cl->prev)
		cl->prev->next = cl->next;
	else
		cl->ctl->clients = cl->next;
	if (cl->next)
		cl->next->prev = cl->prev;
	if (cl->bev)
		bufferevent_free(cl->bev);
	cl->ctl->client_count--;
	free(cl);
}

static size_t client_unread(struct control_client *cl)
{
	return evbuffer_get_length(bufferevent_get_output(cl->bev));
}

/*
 * Answer the complete lines read so far, while no request waits and fewer
 * than CONTROL_MAX_OUTPUT bytes of replies are unread; then read more only
 * if that still holds. False when the client was freed.
 */
static bool client_process(struct control_client *cl)
{
	struct evbuffer *in = bufferevent_get_input(cl->bev);
	while (!cl->wait && !cl->closing && client_unread(cl) < CONTROL_MAX_OUTPUT) {
		size_t len;
		char *line = evbuffer_readln(in, &len, EVBUFFER_EOL_LF);
		if (!line) {
			if (evbuffer_get_length(in) > NBDCACHED_CONTROL_MAX_REQUEST) {
				log_warn(
				    "control: request longer than %d bytes; closing the client",
				    NBDCACHED_CONTROL_MAX_REQUEST);
				client_free(cl);
				return false;
			}
			if (cl->eof) {
				/* Everything it sent is answered: close once it is read. */
				if (client_unread(cl) == 0) {
					client_free(cl);
					return false;
				}
				cl->closing = true;
			}
			break;
		}
		if (len)
			dispatch(cl, line, len);
		free(line);
	}
	if (!cl->wait && !cl->eof && !cl->closing && client_unread(cl) < CONTROL_MAX_OUTPUT)
		bufferevent_enable(cl->bev, EV_READ);
	else
		bufferevent_disable(cl->bev, EV_READ);
	return true;
}

void control_client_resume(struct control_client *cl)
{
	if (!cl->bev)
		return;
	client_process(cl);
}

static void on_client_read(struct bufferevent *bev, void *arg)
{
	(void)bev;
	client_process(arg);
}

/* The output drained below the low watermark (half of CONTROL_MAX_OUTPUT). */
static void on_client_write(struct bufferevent *bev, void *arg)
{
	(void)bev;
	struct control_client *cl = arg;
	if (cl->closing) {
		if (client_unread(cl) == 0)
			client_free(cl);
		return;
	}
	client_process(cl);
}

static void on_client_event(struct bufferevent *bev, short what, void *arg)
{
	(void)bev;
	struct control_client *cl = arg;
	if (what & BEV_EVENT_EOF) {
		/* Answer what was already read before going: a client may send
		 * requests and shut down its side. */
		cl->eof = true;
		if (!cl->wait)
			client_process(cl);
		return; /* else answered when the request completes */
	}
	if (what & BEV_EVENT_ERROR) {
		if (cl->wait) {
			cl->closing = true; /* answered (to no one) when it completes */
			return;
		}
		client_free(cl);
	}
}

static void on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len,
		      void *arg)
{
	(void)l;
	(void)sa;
	(void)len;
	struct control *ctl = arg;
	if (ctl->client_count >= CONTROL_MAX_CLIENTS) {
		if (!ctl->refusing)
			log_warn("control: %d clients connected; refusing more until one leaves",
				 CONTROL_MAX_CLIENTS);
		ctl->refusing = true;
		close(fd);
		return;
	}
	ctl->refusing = false;
	struct control_client *cl = calloc(1, sizeof(*cl));
	if (!cl) {
		close(fd);
		return;
	}
	cl->ctl = ctl;
	cl->bev = bufferevent_socket_new(ctl->worker.base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (!cl->bev) {
		close(fd);
		free(cl);
		return;
	}
	cl->next = ctl->clients;
	if (ctl->clients)
		ctl->clients->prev = cl;
	ctl->clients = cl;
	ctl->client_count++;
	bufferevent_setcb(cl->bev, on_client_read, on_client_write, on_client_event, cl);
	bufferevent_setwatermark(cl->bev, EV_WRITE, CONTROL_MAX_OUTPUT / 2, 0);
	bufferevent_enable(cl->bev, EV_READ | EV_WRITE);
}

/* ---- the once-a-second tick: rates, reaping, suppressed log lines ---- */

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct control *ctl = arg;
	budget_trim_tick(); /* a flood of replies ended: its memory back */
	/* Sample first: it frees the rate slots of removed exports, before
	 * reaping may free their cache exports. */
	control_sample_rates(ctl);
	if (!ctl->stopping)
		control_reap(ctl);
	log_limits_flush(); /* the counts of rate-limited lines whose flood ended */
}

/* ---- life cycle ---- */

int control_listen(const char *path, int *fd)
{
	bool is_default = path == NULL;
	if (is_default)
		path = NBDCACHED_CONTROL_DEFAULT;
	*fd = -1;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	if (is_default)
		mkdir("/run/nbdcached", 0755); /* systemd's RuntimeDirectory= may have made it */
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	/* A live daemon answers on it; a stale socket refuses. */
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		close(s);
		if (is_default) {
			log_warn(
			    "control socket %s is in use by another nbdcached; running without "
			    "one (give --control PATH)",
			    path);
			return 0;
		}
		log_error("--control %s: in use by another running daemon", path);
		return -EADDRINUSE;
	}
	close(s);
	s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	struct stat st;
	if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
		unlink(path);
	mode_t old = umask(0077); /* the owner (and root) until the operator says otherwise */
	int rc = 0;
	if (bind(s, (struct sockaddr *)&sa, sizeof(sa)) < 0 || chmod(path, 0600) < 0 ||
	    listen(s, 16) < 0)
		rc = -errno;
	umask(old);
	if (rc < 0) {
		close(s);
		if (is_default) {
			log_warn("control socket %s: %s; running without one", path, strerror(-rc));
			return 0;
		}
		log_error("--control %s: %s", path, strerror(-rc));
		return rc;
	}
	log_info("control socket %s", path);
	*fd = s;
	return 0;
}

static void start_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, start_task));
	ctl->tick = event_new(ctl->worker.base, -1, EV_PERSIST, on_tick, ctl);
	struct timeval tv = {1, 0};
	if (ctl->tick)
		event_add(ctl->tick, &tv);
	if (ctl->cfg.control_fd >= 0) {
		evutil_make_socket_nonblocking(ctl->cfg.control_fd);
		ctl->listener = evconnlistener_new(ctl->worker.base, on_accept, ctl,
						   LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC,
						   -1, ctl->cfg.control_fd);
		if (!ctl->listener) {
			log_error("control socket: cannot listen");
			close(ctl->cfg.control_fd);
		}
		ctl->cfg.control_fd = -1;
	}
}

static void stop_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, stop_task));
	ctl->stopping = true;
	if (ctl->listener)
		evconnlistener_free(ctl->listener);
	ctl->listener = NULL;
	if (ctl->tick)
		event_free(ctl->tick);
	ctl->tick = NULL;
	while (ctl->clients)
		client_free(ctl->clients);
	control_stop_when_idle(ctl);
}

int control_start(const struct control_config *cfg, struct control **out)
{
	struct control *ctl = calloc(1, sizeof(*ctl));
	if (!ctl)
		return -ENOMEM;
	ctl->cfg = *cfg;
	ctl->started_ns = clock_now_ns();
	pthread_mutex_init(&ctl->reload_lock, NULL);
	ctl->reload_task.run = control_reload_task;
	ctl->start_task.run = start_task;
	ctl->stop_task.run = stop_task;
	int rc = worker_start(&ctl->worker, cfg->threads, NULL);
	if (rc < 0) {
		pthread_mutex_destroy(&ctl->reload_lock);
		free(ctl);
		return rc;
	}
	worker_post(&ctl->worker, &ctl->start_task);
	/* NBD_CMD_RESIZE runs here (export_resize_post). */
	atomic_store(&cfg->exports->resize_worker, &ctl->worker);
	*out = ctl;
	return 0;
}

struct worker *control_worker(struct control *ctl)
{
	return &ctl->worker;
}

void control_stop(struct control *ctl)
{
	if (!ctl)
		return;
	atomic_store(&ctl->cfg.exports->resize_worker, NULL);
	worker_post(&ctl->worker, &ctl->stop_task);
	worker_join(&ctl->worker);
	if (ctl->cfg.control_path)
		unlink(ctl->cfg.control_path);
	pthread_mutex_destroy(&ctl->reload_lock);
	free(ctl);
}
