/*
 * daemon/control_reload.c: reloading the configuration, and reaping what
 * removed exports leave behind.
 *
 * A reload comes from SIGHUP (control_reload(), any thread: it posts
 * control_reload_task to the control thread, at most one pending) or from
 * a client's "reload" request; both run control_reload_now() here, one at a
 * time. Settings that cannot change while running are reported, not
 * applied; exports are added, changed and removed by export_table_reload().
 *
 * The tick calls control_reap() once a second: a removed export whose
 * connections are gone has its dirty data flushed (control_flush_start,
 * answered to no client) and then its backend closed (export_table_reap).
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "daemon/access.h"
#include "daemon/config.h"
#include "daemon/control_internal.h"
#include "daemon/log.h"
#include "daemon/settings.h"
#include "daemon/tls.h"

static bool same_strings(char **a, size_t an, char **b, size_t bn)
{
	if (an != bn)
		return false;
	for (size_t i = 0; i < an; i++)
		if (strcmp(a[i], b[i]) != 0)
			return false;
	return true;
}

static bool same_opt_string(const char *a, const char *b)
{
	return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static void refused(const char *name, json_object *out)
{
	log_warn("reload: %s cannot change while running; restart to apply it", name);
	json_object_array_add(out, json_object_new_string(name));
}

/* Settings fixed at start (settings.h: fixed; and the listen addresses and
 * the metrics address); a reload that changes them is told so. */
static void refused_globals(const struct options *was, const struct options *now, json_object *out)
{
	for (size_t i = 0; i < settings_count; i++)
		if (settings[i].fixed && settings_differ(&settings[i], was, now))
			refused(settings[i].name, out);
	if (!same_strings(was->listen, was->listen_count, now->listen, now->listen_count) ||
	    !same_strings(was->unix_paths, was->unix_count, now->unix_paths, now->unix_count))
		refused("listen", out);
	if (!same_opt_string(was->metrics, now->metrics))
		refused("metrics", out);
}

/*
 * TLS: new credentials from the files as they are now (certificates, CRL,
 * PSK keys), for connections from now on; connections keep theirs. A file
 * that does not load is refused, logged, and the old credentials stay.
 */
static void reload_tls(const struct options *opts, json_object *refused)
{
	struct tls_creds *creds;
	char err[1024];
	if (tls_creds_load(opts, &creds, err, sizeof(err)) < 0) {
		log_error("reload: %s; the running TLS credentials stay", err);
		json_object_array_add(refused, json_object_new_string("tls"));
		return;
	}
	tls_creds_describe(creds, err, sizeof(err));
	log_info("reload: %s", err);
	tls_creds_install(creds);
}

static json_object *names_array(char **v, size_t n)
{
	json_object *a = json_object_new_array();
	for (size_t i = 0; i < n; i++)
		json_object_array_add(a, json_object_new_string(v[i]));
	return a;
}

void control_reload_now(struct control *ctl, struct control_client *cl)
{
	sd_notify(0, "RELOADING=1\nSTATUS=reloading the configuration");
	struct options opts;
	char err[1024];
	int rc = config_options(ctl->cfg.argc, ctl->cfg.argv, &opts, err, sizeof(err));
	if (rc < 0) {
		log_error("reload: %s; the running configuration stays", err);
		sd_notify(0, "READY=1\nSTATUS=reload failed; serving the previous configuration");
		if (cl)
			control_send_error(cl, EINVAL, "%s", err);
		return;
	}
	/* The access rules change live: new negotiations follow them. */
	struct access_policy *policy;
	if (access_policy_build(&opts, &policy, err, sizeof(err)) < 0) {
		log_error("reload: access rules: %s; the running configuration stays", err);
		sd_notify(0, "READY=1\nSTATUS=reload failed; serving the previous configuration");
		if (cl)
			control_send_error(cl, EINVAL, "%s", err);
		options_free(&opts);
		return;
	}
	access_policy_set(policy);
	log_set_level(opts.log_level);
	cache_set_writeback_policy(ctl->cfg.cache, opts.dirty_high, opts.dirty_low,
				   opts.dirty_expire);
	json_object *refused = json_object_new_array();
	refused_globals(ctl->cfg.opts, &opts, refused);
	reload_tls(&opts, refused);
	struct export_reload r;
	rc = export_table_reload(ctl->cfg.exports, &opts, &r);
	options_free(&opts);
	log_info("reload: %zu export(s) added, %zu changed, %zu removed, %zu refused%s",
		 r.added_count, r.changed_count, r.removed_count, r.refused_count,
		 rc < 0 ? " (stopped early: out of memory)" : "");
	struct export_table *t = ctl->cfg.exports;
	pthread_mutex_lock(&t->lock);
	size_t count = t->count;
	pthread_mutex_unlock(&t->lock);
	sd_notifyf(0, "READY=1\nSTATUS=serving %zu export(s)", count);
	if (cl) {
		if (rc < 0) {
			control_send_error(cl, -rc, "reload stopped early: %s", strerror(-rc));
			json_object_put(refused);
		} else {
			json_object *o = control_reply_ok();
			json_object_object_add(o, "added", names_array(r.added, r.added_count));
			json_object_object_add(o, "changed",
					       names_array(r.changed, r.changed_count));
			json_object_object_add(o, "removed",
					       names_array(r.removed, r.removed_count));
			json_object_object_add(o, "refused",
					       names_array(r.refused, r.refused_count));
			json_object_object_add(o, "resized",
					       names_array(r.resized, r.resized_count));
			json_object_object_add(o, "refused_settings", refused);
			control_send(cl, o);
		}
	} else {
		json_object_put(refused);
	}
	export_reload_free(&r);
}

void control_reload_task(struct worker_task *task)
{
	struct control *ctl =
	    (struct control *)((char *)task - offsetof(struct control, reload_task));
	pthread_mutex_lock(&ctl->reload_lock);
	ctl->reload_posted = false;
	pthread_mutex_unlock(&ctl->reload_lock);
	if (!ctl->stopping)
		control_reload_now(ctl, NULL);
}

void control_reload(struct control *ctl)
{
	pthread_mutex_lock(&ctl->reload_lock);
	bool post = !ctl->reload_posted;
	ctl->reload_posted = true;
	pthread_mutex_unlock(&ctl->reload_lock);
	if (post)
		worker_post(&ctl->worker, &ctl->reload_task);
}

static void reap_flush(struct export_backing *b, void *arg)
{
	struct control *ctl = arg;
	struct control_wait *w = calloc(1, sizeof(*w));
	if (!w) {
		export_reap_flushed(b, -ENOMEM);
		return;
	}
	w->reap = b;
	control_flush_start(ctl, w, b->cache);
}

void control_reap(struct control *ctl)
{
	export_table_reap(ctl->cfg.exports, reap_flush, ctl);
}
