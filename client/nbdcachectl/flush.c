/*
 * client/nbdcachectl/flush.c: flush an export, the dirty bytes draining
 * drawn on a terminal.
 *
 * The flush request goes out on one connection and "stats" is polled every
 * FLUSH_POLL_MS on a second one, in one poll(2) loop over both, so that a
 * slow reply on one never stalls the other.
 */
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

#define FLUSH_POLL_MS 100

/* One rewritten line: "flushing NAME [####......]  40%  12.0 MiB dirty". */
static void draw_progress(const char *name, int64_t total, int64_t dirty)
{
	char bar[31];
	double done =
	    total > 0 ? (double)(total - (dirty < total ? dirty : total)) / (double)total : 0;
	size_t filled = (size_t)(done * (sizeof(bar) - 1));

	memset(bar, '#', filled);
	memset(bar + filled, '.', sizeof(bar) - 1 - filled);
	bar[sizeof(bar) - 1] = '\0';
	printf("\rflushing %s [%s] %3.0f%%  %s dirty\033[K", name, bar, 100 * done, SIZE(dirty));
	fflush(stdout);
}

/* Ask for the export's stats on the progress connection. */
static bool progress_request(struct ctl *c, const struct options *o)
{
	return ctl_send(c, ctl_request("stats", o->command->keys, o->args, 1)) == 0;
}

/* The export's dirty bytes from the reply; false (silently) when refused. */
static bool progress_reply(struct ctl *c, int64_t *dirty)
{
	json_object *sample = NULL;
	bool ok = ctl_receive(c, &sample) == 0 && ctl_get_bool(sample, "ok") &&
		  ctl_array_length(sample, "exports") == 1;

	if (ok)
		*dirty = ctl_get_int(ctl_array_item(sample, "exports", 0), "dirty_bytes");
	json_object_put(sample);
	return ok;
}

int run_flush(const struct options *o)
{
	const char *name = o->args[0];
	bool tty = !o->json && isatty(STDOUT_FILENO);
	struct ctl flush = CTL_INIT, progress = CTL_INIT;
	json_object *reply = NULL;
	double start, next_poll;
	bool polling = false, drawn = false; /* a stats request is in flight */
	int64_t total = 0, dirty;
	int err = ctl_connect(&flush, o->control);

	/*
	 * Progress is only drawn on a terminal. The sample taken before the
	 * flush is sent gives the total: the dirty bytes the flush will write.
	 */
	if (!err && tty)
		tty = ctl_connect(&progress, o->control) == 0 && progress_request(&progress, o) &&
		      progress_reply(&progress, &total);
	start = next_poll = now_s();
	if (!err)
		err = ctl_send(&flush, ctl_request("flush", o->command->keys, o->args, 1));
	while (!err && !reply) {
		struct pollfd fds[2] = {{.fd = flush.fd, .events = POLLIN},
					{.fd = progress.fd, .events = POLLIN}};
		double wait = polling || !tty ? -1 : next_poll - now_s();
		int n;

		if (tty && !polling && wait <= 0) {
			tty = polling = progress_request(&progress, o);
			next_poll = now_s() + FLUSH_POLL_MS / 1000.0;
			continue;
		}
		n = poll(fds, tty ? 2 : 1, wait < 0 ? -1 : (int)(wait * 1000) + 1);
		if (n < 0 && errno != EINTR)
			err = -errno;
		if (n <= 0)
			continue;
		if (fds[0].revents) {
			err = ctl_receive(&flush, &reply);
		} else if (tty && fds[1].revents) {
			/* A refused or broken poll only ends the progress display. */
			polling = false;
			tty = progress_reply(&progress, &dirty);
			if (tty) {
				draw_progress(name, total, dirty);
				drawn = true;
			}
		}
	}
	if (drawn) {
		printf("\r\033[K");
		fflush(stdout);
	}
	if (!err)
		err = ctl_reply_status(reply);
	if (reply && o->json)
		puts(flush.line);
	else if (!err)
		printf("flushed %s in %.1f s\n", SIZE(ctl_get_int(reply, "flushed_bytes")),
		       now_s() - start);
	json_object_put(reply);
	ctl_close(&progress);
	ctl_close(&flush);
	return err;
}
