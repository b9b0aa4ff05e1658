/*
 * daemon/export.h: an export is a name, a backend and its policy.
 *
 * Owns: the table of exports, what each export advertises (size,
 * transmission flags, block sizes), and their life cycle across reloads.
 *
 *   export_table --lock--> [struct export *] ...     published versions
 *                          |  name, description, readonly, limits (immutable)
 *                          v
 *                 struct export_backing              one per opened backend
 *                   backend, cache export, connections, removed/closed
 *
 * A struct export is immutable once published and reference counted: the
 * table holds one reference, each connection that found it holds one (from
 * the option that named it to its close). A reload that changes an export
 * publishes a new version on the same backing; connections keep the version
 * they negotiated. A removed export leaves the table at once (new clients
 * get "unknown export"); its backing stays open until its last connection
 * has gone and its dirty data is written back (export_table_reap), then the
 * backend is closed.
 *
 * Windows: an export may serve a window of its backend, bytes [offset,
 * offset + size). Every export over one backend (the same backend string,
 * or the same file or block device under another path: its device and
 * inode, options_same_backend(); whole or windowed) shares one backing
 * and so one cache export: a write
 * through one is seen at once through every overlapping one, and a FLUSH on
 * any makes the backend durable. A split export (split=W) publishes its
 * windows NAME/0, NAME/1, ... of W bytes (the last one shorter) right after
 * itself; they copy its policy and are regenerated with it on reload. They
 * are its windows in every rule: the access rules of the export
 * (export_rules_name) decide who may see and open them, its tls setting
 * is theirs, and its max_connections counts the connections to it and to
 * all its windows together (they share its counter). A window made by
 * hand (offset=, size=) is an export of its own, with its own rules. The
 * connection layer adds e->offset to every request's offset.
 *
 * Resize (export_resize.c): an export without size= (e->to_end) follows
 * its backend's size. export_resize() moves the backing's size (the
 * backend's, then the cache's) and publishes new versions of every such
 * export over it, with their split windows regenerated (a grown split
 * export gains windows at its end; windows past a new end are unpublished
 * like removed exports). A window made by hand keeps its size; a shrink
 * that would cut it is refused. Connections keep the size they
 * negotiated, but every request is also checked against the backend's
 * size now (export_past_end). Resizes run on the control thread only
 * (the control socket's resize, reload, and NBD_CMD_RESIZE through
 * export_resize_post), so they are serial. The control socket names its
 * export; NBD_CMD_RESIZE acts on the current version of the export its
 * connection negotiated (export_current), with that version's
 * allow-resize, and fails when a reload removed that export.
 *
 * Locking: the table lock guards the published array and the backings list.
 * It is taken before any cache lock: export_table_reap holds it while it
 * asks the cache whether a backing is unflushed and retires its cache
 * export (cache_export_unflushed, cache_export_retire), and it is never
 * taken under a cache lock. References and connection
 * counts are atomics. Reload and reap run on one thread (the control
 * thread); lookups run on any worker.
 */
#ifndef NBDCACHED_DAEMON_EXPORT_H
#define NBDCACHED_DAEMON_EXPORT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/backend/backend.h"
#include "daemon/cache/cache.h"
#include "daemon/options.h"
#include "daemon/qos.h"

struct export_backing {
	char *spec; /* the backend as configured: path, URI, nbdkit:... */
	struct backend *backend;
	struct cache_export *cache;
	uint32_t block_size;	 /* the cache's block size for it */
	atomic_uint versions;	 /* struct export versions referring to it */
	atomic_uint connections; /* connections in transmission */
	bool removed;		 /* table lock: no version published any more */
	bool closed;		 /* control thread: backend closed */
	bool flushing;		 /* control thread: a reap flush is in flight */
	bool reap_failing;	 /* control thread: its last reap flush failed */
	uint64_t reap_retry_ns;	 /* control thread: no new reap flush before */
	/* Control thread: the end an explicit resize set below what the
	 * backend has (a block device or an NBD server is not cut); a reload
	 * keeps it until the backend has less, a resize without a size drops
	 * it. 0: the exports follow the backend's size. */
	uint64_t pinned_end;
	struct export_backing *next;
};

/* Connections of one export name and its split windows, carried across
 * their versions (for max_connections), and their QoS limiter (qos.h:
 * its buckets survive reloads; export_table_reload sets its limits in
 * place). It is also the export's identity across versions: a new export
 * of a removed one's name gets a counter of its own (export_current). */
struct export_counter {
	atomic_uint refs;
	atomic_uint connections;
	struct qos_limiter *qos;
};

struct export
{
	atomic_uint refs;
	char *name;
	char *description; /* NULL when none */
	uint64_t offset;   /* the window's first byte in the backend */
	uint64_t size;	   /* the window's size: what clients see */
	uint64_t split;	   /* window size of NAME/K windows; 0: none */
	char *window_of;   /* split windows: the name of their export; else NULL */
	bool readonly;
	uint32_t block_size; /* preferred block size advertised */
	uint32_t max_payload;
	unsigned max_connections;	/* 0: unlimited */
	unsigned dirty_high, dirty_low; /* percent, as configured */
	uint64_t seq_cutoff;		/* sequential reads beyond this bypass the cache */
	bool tls_require;		/* only for clients that did STARTTLS */
	bool allow_resize;		/* clients may send NBD_CMD_RESIZE (allow-resize) */
	bool to_end;			/* no size=: runs to the backend's end, follows resizes */
	struct backend *backend;	/* backing->backend */
	struct cache_export *cache;	/* backing->cache: how requests reach the backend */
	struct export_backing *backing;
	struct export_counter *counter;
};

/* A split export publishes at most this many windows. */
#define EXPORT_MAX_WINDOWS 4096

struct export_table {
	pthread_mutex_t lock;
	struct export **exports; /* published, in config order (windows after
				  * their export) */
	size_t count;
	struct export_backing *backings; /* every backing not yet closed */
	struct cache *cache;
	unsigned backend_timeout;
	bool rbd_takeover_wait;
	bool started; /* backends' threads run (after the daemon detached) */
	/* The control thread, where resizes run (export_resize_post); set
	 * when it starts, NULL before and after. */
	_Atomic(struct worker *) resize_worker;
};

/* What a reload did, by export name (each array malloc'd, names too);
 * resized: exports whose backend had a new size (export_table_refresh). */
struct export_reload {
	char **added, **changed, **removed, **refused, **resized;
	size_t added_count, changed_count, removed_count, refused_count, resized_count;
};

/* Open every export's backend and attach it to the cache. On error logs
 * which export failed. */
int export_table_open(struct export_table *table, const struct options *opts, struct cache *cache);
/* Start the backends' threads, if they have any (after detaching). */
int export_table_start(struct export_table *table);
/* Close every backend (connections are gone). */
void export_table_close(struct export_table *table);

/* The export of that name, referenced; "" is the first export (the
 * default). NULL when there is none. Any thread. */
struct export *export_get(struct export_table *table, const char *name, size_t len);
/* The published version of e's export, referenced: the same name, the
 * same counter (its versions share it; an export added under a removed
 * one's name does not) and so the same backing. NULL when a reload removed
 * the export, or removed it and added another of that name: what a
 * connection uses to act on the export it negotiated as it is now, never
 * on one found again by name. Any thread. */
struct export *export_current(struct export_table *table, const struct export *e);
/* A snapshot of the published exports, each referenced; put each, free the
 * array. */
int export_list(struct export_table *table, struct export ***out, size_t *count);
void export_ref(struct export *e);
void export_put(struct export *e);
/* A connection enters transmission on the export: false when it (with its
 * split windows, or its export and the other windows) already has
 * max_connections. export_detach() when the connection ends. */
bool export_attach(struct export *e);
void export_detach(struct export *e);

/*
 * Apply a new configuration: open and publish new exports, publish new
 * versions of changed ones, unpublish removed ones. A change that cannot
 * apply live (backend, block size, a read-only backend made writable, to or
 * from cache mode none) is refused with a log line and the export keeps its
 * old settings. Control thread only.
 */
int export_table_reload(struct export_table *table, const struct options *opts,
			struct export_reload *out);
void export_reload_free(struct export_reload *r);

/*
 * Close what removed exports leave behind once no connection uses them:
 * write back their dirty data (through start_flush, which must eventually
 * call export_reap_flushed), drop their cached blocks, close the backend.
 * Control thread only; call it periodically.
 */
void export_table_reap(struct export_table *table,
		       void (*start_flush)(struct export_backing *b, void *arg), void *arg);
void export_reap_flushed(struct export_backing *b, int result);

/* ---- online resize (export_resize.c) ---- */

struct export_resize_result {
	uint64_t old_size, new_size; /* the export's, as clients see it */
	uint64_t dirty_past;	     /* a refused shrink: dirty bytes past the new end */
	char message[320];	     /* why it failed, in words (empty on success) */
};

/*
 * Resize export name to size bytes (has_size), or to what its backend has
 * now (a file or block device grown or cut by someone else). A file is
 * extended or cut to the new size; a block device takes sizes up to its
 * own; an NBD backend cannot be resized while connected (-ENOTSUP). A
 * shrink is refused (-EBUSY) while the cut-off part holds data that is
 * dirty, unstable or in use: FLUSH, then resize again. -ENOENT: no such
 * export; -EINVAL: a window (resize its export, or change size= in the
 * config) or SIZE not a multiple of the block size. Control thread only.
 */
int export_resize(struct export_table *t, const char *name, bool has_size, uint64_t size,
		  struct export_resize_result *out);
/* Reload: every backing whose backend has a new size (probed) is resized
 * as export_resize would, names appended to r->resized. Control thread. */
int export_table_refresh(struct export_table *t, struct export_reload *r);

/* NBD_CMD_RESIZE from a connection's worker, run on the control thread:
 * fill the first fields, then export_resize_post(); done(job) runs on
 * reply_to with result and res set. It resizes export_current(export):
 * -ESHUTDOWN when there is none (a reload removed the connection's
 * export, whatever now has its name), -EPERM when that version does not
 * let clients resize (export_client_may_resize: allow-resize turned off
 * by a reload, say) or the size is smaller while other connections use
 * the backing; else as export_resize(). */
struct export_resize_job {
	struct export_table *table;
	struct export *export; /* the connection's version (referenced by it) */
	uint64_t size;	       /* the new size */
	struct worker *reply_to;
	void (*done)(struct export_resize_job *job);
	int result;
	struct export_resize_result res;
	struct worker_task task; /* private */
};
/* ESHUTDOWN at once (done runs before it returns) when the control thread
 * is not running. */
void export_resize_post(struct export_resize_job *job);

/* Is a request on connection version e for bytes [offset, offset+length)
 * of e past the end of its backend now (a shrink since it negotiated)? */
static inline bool export_past_end(const struct export *e, uint64_t offset, uint64_t length)
{
	uint64_t end = atomic_load(&e->backend->size);
	uint64_t at = e->offset + offset;
	return at > end || length > end - at;
}

/* May clients send NBD_CMD_RESIZE (NBD_FLAG_SEND_RESIZE)? allow-resize, a
 * whole export (not a window), writable, on a backend that can be resized. */
static inline bool export_client_may_resize(const struct export *e)
{
	return e->allow_resize && e->to_end && !e->window_of && !e->readonly &&
	       e->backend->ops->set_size;
}

/* Transmission flags for an export, given what the client negotiated. */
uint16_t export_eflags(const struct export *e, bool structured);
/* The export whose access rules apply to e: e's own name, or for a split
 * window the export it is a window of. */
static inline const char *export_rules_name(const struct export *e)
{
	return e->window_of ? e->window_of : e->name;
}
static inline uint64_t export_size(const struct export *e)
{
	return e->size;
}

#endif
