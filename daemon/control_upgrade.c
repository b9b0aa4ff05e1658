/*
 * daemon/control_upgrade.c: upgrade: start a new daemon and hand it
 * every connection (daemon/upgrade.h).
 *
 *   {"command": "upgrade"}                               the binary we run
 *   {"command": "upgrade", "binary": PATH, "timeout": S}
 *
 * The client is not read while it runs (cl->wait, as a flush). The reply
 * comes from the upgrade thread's end, posted here: {"ok": true, "pid",
 * "moved", "closed", "refused", "refused_why", "pause_ms"} once the new
 * daemon serves (and then
 * this daemon writes it out and exits: the connections are no longer
 * its own), or the reason it failed and this daemon serves on.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/control_internal.h"
#include "daemon/log.h"
#include "daemon/upgrade.h"

struct upgrade_reply {
	struct worker_task task;
	struct control *ctl;
	struct control_wait *wait; /* its client: NULL once it has gone */
	struct upgrade_result r;
};

/* Write what the client's output holds now, for up to a second (the
 * process ends next: the loop would not send it). The bufferevent owns
 * the buffer's start, so its bytes are read in place (evbuffer_peek). */
static void write_out(struct control_client *cl)
{
	struct evbuffer *out = bufferevent_get_output(cl->bev);
	int fd = bufferevent_getfd(cl->bev);
	struct evbuffer_iovec v[8];
	int n = evbuffer_peek(out, -1, NULL, v, 8);
	for (int k = 0; k < n && k < 8; k++) {
		const char *p = v[k].iov_base;
		size_t left = v[k].iov_len;
		for (int i = 0; i < 100 && left > 0; i++) {
			ssize_t w = write(fd, p, left);
			if (w > 0) {
				p += w;
				left -= (size_t)w;
				continue;
			}
			if (w < 0 && errno != EAGAIN && errno != EINTR)
				return;
			struct pollfd pf = {fd, POLLOUT, 0};
			poll(&pf, 1, 10);
		}
	}
}

static void reply_task(struct worker_task *task)
{
	struct upgrade_reply *u = (struct upgrade_reply *)task;
	struct control_client *cl = u->wait->client;
	if (cl) {
		cl->wait = NULL;
		if (u->r.committed) {
			json_object *o = control_reply_ok();
			control_add_u64(o, "pid", (uint64_t)u->r.pid);
			control_add_u64(o, "moved", u->r.moved);
			control_add_u64(o, "closed", u->r.closed);
			control_add_u64(o, "refused", u->r.refused);
			control_add_string(o, "refused_why",
					   u->r.refused ? u->r.refused_why : NULL);
			control_add_u64(o, "pause_ms", u->r.pause_ms);
			control_send(cl, o);
			write_out(cl);
		} else {
			control_send_error(cl, EAGAIN, "upgrade failed: %s", u->r.why);
			control_client_resume(cl);
		}
	}
	if (u->r.committed) {
		log_info("upgrade: pid %d serves from here on; exiting", (int)u->r.pid);
		_exit(0);
	}
	free(u->wait);
	free(u);
}

static void upgrade_done(const struct upgrade_result *r, void *arg)
{
	struct upgrade_reply *u = arg;
	u->r = *r;
	u->task.run = reply_task;
	worker_post(&u->ctl->worker, &u->task);
	if (r->committed)
		for (;;)
			pause(); /* the control thread ends the process */
}

void control_cmd_upgrade(struct control_client *cl, json_object *req)
{
	struct control *ctl = cl->ctl;
	struct upgrade_server *up = ctl->cfg.upgrade;
	json_object *v;
	const char *binary = NULL;
	unsigned timeout = 0;
	if (json_object_object_get_ex(req, "binary", &v)) {
		if (!json_object_is_type(v, json_type_string) || !*json_object_get_string(v)) {
			control_send_error(cl, EINVAL, "\"binary\" must be a path");
			return;
		}
		binary = json_object_get_string(v);
	}
	if (json_object_object_get_ex(req, "timeout", &v)) {
		int64_t t = json_object_get_int64(v);
		if (!json_object_is_type(v, json_type_int) || t < 1 || t > 3600) {
			control_send_error(cl, EINVAL, "\"timeout\" must be 1 to 3600 seconds");
			return;
		}
		timeout = (unsigned)t;
	}
	if (!up) {
		control_send_error(cl, ENOTSUP, "this daemon cannot be upgraded live");
		return;
	}
	char buf[512];
	const char *why = upgrade_refusal(ctl->cfg.exports, buf, sizeof(buf));
	if (why) {
		control_send_error(cl, ENOTSUP, "upgrade refused: %s", why);
		return;
	}
	struct upgrade_reply *u = calloc(1, sizeof(*u));
	struct control_wait *w = calloc(1, sizeof(*w));
	if (!u || !w) {
		free(u);
		free(w);
		control_send_error(cl, ENOMEM, "out of memory");
		return;
	}
	u->ctl = ctl;
	u->wait = w;
	w->client = cl;
	w->ctl = ctl;
	int rc = upgrade_begin(up, binary, timeout, upgrade_done, u);
	if (rc < 0) {
		free(u);
		free(w);
		control_send_error(cl, -rc, "%s",
				   rc == -EBUSY ? "an upgrade is in progress already"
						: "cannot start the upgrade");
		return;
	}
	cl->wait = w;
}
