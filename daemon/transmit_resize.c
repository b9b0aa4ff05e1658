/*
 * daemon/transmit_resize.c: NBD_CMD_RESIZE of the resize extension on the
 * transmission path (transmit_internal.h); the resize itself is
 * export_resize.c's.
 *
 * The command is rare, and it may cut or extend a file and walk the cache,
 * so it runs on the control thread (export_resize_post, serial with every
 * other resize and reload) and is answered on the connection's worker when
 * done. The request holds its connection meanwhile. It carries the
 * connection's version of its export, not its name: the control thread
 * resizes that export as it is then, or refuses.
 */
#include <errno.h>
#include <stdlib.h>

#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/transmit_internal.h"
#include "daemon/worker.h"

struct resize_request {
	struct export_resize_job job;
	struct request *r;
};

static void resize_done(struct export_resize_job *job)
{
	struct resize_request *rr = (struct resize_request *)job;
	struct request *r = rr->r;
	int result = job->result;
	/* The extension's errors: a refusal is EPERM (a shrink over dirty
	 * data, another connection, a window, allow-resize turned off by a
	 * reload), ENOSPC as it is, ESHUTDOWN while stopping or when a reload
	 * removed the connection's export (export_current: an export of that
	 * name now is another, never resized from here), EINVAL for a size
	 * the export cannot have; the rest EIO. */
	if (result == -EBUSY || result == -ENOTSUP)
		result = -EPERM;
	else if (result == -EFBIG)
		result = -ENOSPC;
	else if (result == -ENOENT)
		result = -ESHUTDOWN; /* removed by a reload meanwhile */
	/* The client that grew the export may use the new size at once (the
	 * extension's words); after a shrink it keeps its old size, so that
	 * its requests between the two ends get ENOSPC, not EINVAL. */
	if (result == 0 && r->hdr.offset > r->conn->session.size)
		r->conn->session.size = r->hdr.offset;
	if (result == 0)
		log_info("conn %llu: NBD_CMD_RESIZE: export '%s' %llu -> %llu bytes",
			 (unsigned long long)r->conn->id, job->export->name,
			 (unsigned long long)job->res.old_size,
			 (unsigned long long)job->res.new_size);
	free(rr);
	request_finish(r, result);
}

void resize_start(struct request *r)
{
	struct conn *c = r->conn;
	struct resize_request *rr = calloc(1, sizeof(*rr));
	if (!rr) {
		request_finish(r, -ENOMEM);
		return;
	}
	rr->r = r;
	rr->job.table = c->set->exports;
	rr->job.export = c->export;
	rr->job.size = r->hdr.offset;
	rr->job.reply_to = c->worker;
	rr->job.done = resize_done;
	log_debug("conn %llu: NBD_CMD_RESIZE to %llu bytes", (unsigned long long)c->id,
		  (unsigned long long)r->hdr.offset);
	export_resize_post(&rr->job);
}
