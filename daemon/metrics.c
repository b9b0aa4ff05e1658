/*
 * daemon/metrics.c: the Prometheus /metrics page (metrics.h), served by
 * libmicrohttpd's own thread.
 *
 * The page is written whole for each GET into a memory stream and handed
 * to libmicrohttpd, which frees it once sent:
 *
 *   cache gauges          nbdcached_cache_{size,used,dirty,unstable}_bytes, ..._entries
 *   clients               nbdcached_clients, nbdcached_clients_refused_total{reason}
 *   per export counters   export_counters(): requests by command, bytes,
 *                         hits, misses, backend I/O, writeback, errors, ...
 *   per export gauges     connections, dirty, unstable and cached bytes
 *   histograms            nbdcached_request_duration_seconds{export,kind}
 *                         nbdcached_backend_request_duration_seconds{export}
 *
 * Every family's samples are together, as the format requires: the tables
 * below are walked family by family, each over every export. A split
 * export's windows share their export's cache export and connection
 * counter, so only the export itself has series (its name is the label).
 *   the cache device      device_metrics(): its state (failed, detached),
 *                         the intent log (size, use, commits, the live log
 *                         found at start still to write back or lost) and
 *                         the level-2 cache (hits, misses, stale reads,
 *                         read and checksum errors); only with one
 *
 * configs/prometheus/ has alert rules over these and a dashboard.
 */
#include "daemon/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/access.h"
#include "daemon/budget.h"
#include "daemon/cache/cache.h"
#include "daemon/check.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/qos.h"

#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
/*
 * What HTTP clients may hold. A connection that sends nothing keeps its
 * slot until the idle timeout. With every slot taken, libmicrohttpd stops
 * accepting: a new scraper waits in the listen backlog, first in line, and
 * is served once the idle ones are closed, within the timeout, inside
 * Prometheus' default scrape timeout (10 s). One address may hold a
 * quarter of the slots (past that it is closed at once), so no one host
 * delays the others' scrapers, and a scraper beside a few stuck clients on
 * its own host (all of loopback's, by default) is served at once. A page
 * is malloc'd per GET and freed once sent: at most this many pages.
 */
#define METRICS_CONNECTION_LIMIT 64
#define METRICS_PER_IP_LIMIT 16
#define METRICS_TIMEOUT_SECONDS 5

struct metrics {
	struct MHD_Daemon *daemon;
	struct cache *cache;
	struct export_table *exports;
};

/* One export's numbers, read once per page. */
struct export_sample {
	const char *name;
	struct cache_export *ce;
	struct cache_export_stats s;
	struct cache_reply_stats r;
	struct qos_stats q;
	uint64_t connections;
	uint64_t fenced; /* 1: another node owns its backend (backend.h: fenced) */
};

/* A label value with \, " and newline escaped (the text format's rule). */
static void put_label_value(FILE *f, const char *v)
{
	for (; *v; v++) {
		if (*v == '\\' || *v == '"')
			fputc('\\', f);
		if (*v == '\n') {
			fputs("\\n", f);
			continue;
		}
		fputc(*v, f);
	}
}

static void family(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(FILE *f, const char *name, const char *help, uint64_t v)
{
	family(f, name, "gauge", help);
	fprintf(f, "%s %" PRIu64 "\n", name, v);
}

/* ---- per export counters and gauges ---- */

#define SAMPLE(field) offsetof(struct export_sample, field), false
/* A uint64_t of nanoseconds, shown as seconds. */
#define SAMPLE_NS(field) offsetof(struct export_sample, field), true

struct export_series {
	const char *name, *type, *help;
	const char *label, *label_value; /* a second label, or NULL */
	size_t offset;			 /* of a uint64_t in struct export_sample */
	bool ns;			 /* nanoseconds, shown as seconds */
};

/*
 * Every per-export counter and gauge on the page, one row per series, the
 * rows of one family together. The one place to add per-export numbers.
 * The QoS counters belong to an export with its split windows (the
 * limiter hangs off their shared counter), like every other series here.
 */
static const struct export_series export_series[] = {
    {"nbdcached_requests_total", "counter", "Client requests started, by command.", "command",
     "read", SAMPLE(s.commands[BACKEND_READ])},
    {"nbdcached_requests_total", NULL, NULL, "command", "write", SAMPLE(s.commands[BACKEND_WRITE])},
    {"nbdcached_requests_total", NULL, NULL, "command", "flush", SAMPLE(s.commands[BACKEND_FLUSH])},
    {"nbdcached_requests_total", NULL, NULL, "command", "trim", SAMPLE(s.commands[BACKEND_TRIM])},
    {"nbdcached_requests_total", NULL, NULL, "command", "write_zeroes",
     SAMPLE(s.commands[BACKEND_ZERO])},
    {"nbdcached_requests_total", NULL, NULL, "command", "cache", SAMPLE(s.commands[BACKEND_CACHE])},
    {"nbdcached_requests_total", NULL, NULL, "command", "block_status",
     SAMPLE(s.commands[BACKEND_BLOCK_STATUS])},
    {"nbdcached_fua_requests_total", "counter", "Client requests that carried FUA.", NULL, NULL,
     SAMPLE(s.fua_commands)},
    {"nbdcached_read_bytes_total", "counter", "Bytes of successful client READs.", NULL, NULL,
     SAMPLE(r.read_bytes)},
    {"nbdcached_written_bytes_total", "counter", "Bytes of successful client WRITEs.", NULL, NULL,
     SAMPLE(r.written_bytes)},
    {"nbdcached_errors_total", "counter", "Client requests answered with an error.", NULL, NULL,
     SAMPLE(r.errors)},
    {"nbdcached_cache_hits_total", "counter", "READs served from the cache alone.", NULL, NULL,
     SAMPLE(s.hits)},
    {"nbdcached_cache_misses_total", "counter", "READs of which nothing was cached.", NULL, NULL,
     SAMPLE(s.misses)},
    {"nbdcached_cache_partial_hits_total", "counter", "READs of which part was cached.", NULL, NULL,
     SAMPLE(s.partial_hits)},
    {"nbdcached_cache_bypass_reads_total", "counter",
     "READs sent around the cache (sequential cut-off).", NULL, NULL, SAMPLE(s.bypass_reads)},
    {"nbdcached_cache_evictions_total", "counter", "Cache entries evicted.", NULL, NULL,
     SAMPLE(s.evictions)},
    {"nbdcached_backend_requests_total", "counter", "Requests the cache sent to the backend.",
     "direction", "read", SAMPLE(s.backend_reads)},
    {"nbdcached_backend_requests_total", NULL, NULL, "direction", "write",
     SAMPLE(s.backend_writes)},
    {"nbdcached_backend_requests_total", NULL, NULL, "direction", "flush",
     SAMPLE(s.backend_flushes)},
    {"nbdcached_backend_bytes_total", "counter",
     "Bytes the cache read from or wrote to the backend.", "direction", "read",
     SAMPLE(s.backend_read_bytes)},
    {"nbdcached_backend_bytes_total", NULL, NULL, "direction", "write",
     SAMPLE(s.backend_write_bytes)},
    {"nbdcached_backend_flush_errors_total", "counter", "Backend flushes that failed.", NULL, NULL,
     SAMPLE(s.backend_flush_errors)},
    {"nbdcached_backend_losses_total", "counter",
     "Times the backend may have lost writes it acknowledged.", NULL, NULL, SAMPLE(s.losses)},
    {"nbdcached_writeback_bytes_total", "counter", "Dirty bytes written back successfully.", NULL,
     NULL, SAMPLE(s.writeback_bytes)},
    {"nbdcached_writeback_errors_total", "counter", "Writeback writes that failed.", NULL, NULL,
     SAMPLE(s.writeback_errors)},
    {"nbdcached_direct_writes_total", "counter", "Writes sent to the backend around the cache.",
     NULL, NULL, SAMPLE(s.direct_writes)},
    {"nbdcached_writeback_throttled_writes_total", "counter",
     "Cached WRITEs that waited for writeback.", NULL, NULL, SAMPLE(s.throttled_writes)},
    {"nbdcached_qos_throttled_requests_total", "counter",
     "Requests the export's QoS limits held back.", NULL, NULL, SAMPLE(q.throttled_requests)},
    {"nbdcached_qos_throttled_seconds_total", "counter",
     "Time requests spent held back by the export's QoS limits.", NULL, NULL,
     SAMPLE_NS(q.throttled_ns)},
    {"nbdcached_connections", "gauge", "Client connections in transmission on the export.", NULL,
     NULL, SAMPLE(connections)},
    {"nbdcached_export_dirty_bytes", "gauge", "Dirty bytes of the export in the cache.", NULL, NULL,
     SAMPLE(s.dirty_bytes)},
    {"nbdcached_export_unstable_bytes", "gauge",
     "Bytes of the export written back but not flushed on the backend yet.", NULL, NULL,
     SAMPLE(s.unstable_bytes)},
    {"nbdcached_export_cached_bytes", "gauge", "Cache bytes the export's entries hold.", NULL, NULL,
     SAMPLE(s.cached_bytes)},
    {"nbdcached_export_fenced", "gauge",
     "1 while another node owns the export's backend (its writes fail).", NULL, NULL,
     SAMPLE(fenced)},
};

static void export_counters(FILE *f, const struct export_sample *x, size_t n)
{
	for (size_t i = 0; i < sizeof(export_series) / sizeof(export_series[0]); i++) {
		const struct export_series *e = &export_series[i];
		if (e->type)
			family(f, e->name, e->type, e->help);
		for (size_t k = 0; k < n; k++) {
			uint64_t v;
			memcpy(&v, (const char *)&x[k] + e->offset, sizeof(v));
			fprintf(f, "%s{export=\"", e->name);
			put_label_value(f, x[k].name);
			if (e->label)
				fprintf(f, "\",%s=\"%s", e->label, e->label_value);
			if (e->ns)
				fprintf(f, "\"} %.9f\n", (double)v / 1e9);
			else
				fprintf(f, "\"} %" PRIu64 "\n", v);
		}
	}
}

/* ---- histograms ---- */

/*
 * The "le" bounds shown: every power of two of nanoseconds and 1.5 times
 * it, from 1024 ns (2 of the histogram's 8 sub-buckets per power of two,
 * each an exact bucket bound, so a cumulative count is exact); about 55.
 */
static bool shown_bound(unsigned i)
{
	return i == 0 || (i < HISTOGRAM_BUCKETS - 1 &&
			  (i - 1) % (HISTOGRAM_SUB / 2) == HISTOGRAM_SUB / 2 - 1);
}

static void histogram_series(FILE *f, const char *name, const char *export_name, const char *kind,
			     const struct histogram *h)
{
	uint64_t seen = 0;
	for (unsigned i = 0; i < HISTOGRAM_BUCKETS; i++) {
		seen += h->counts[i];
		bool last = i == HISTOGRAM_BUCKETS - 1;
		if (!last && !shown_bound(i))
			continue;
		fprintf(f, "%s_bucket{export=\"", name);
		put_label_value(f, export_name);
		if (kind)
			fprintf(f, "\",kind=\"%s", kind);
		if (last)
			fprintf(f, "\",le=\"+Inf\"} %" PRIu64 "\n", seen);
		else
			fprintf(f, "\",le=\"%.10g\"} %" PRIu64 "\n",
				(double)histogram_bucket_upper(i) / 1e9, seen);
	}
	for (int part = 0; part < 2; part++) {
		fprintf(f, "%s_%s{export=\"", name, part ? "count" : "sum");
		put_label_value(f, export_name);
		if (kind)
			fprintf(f, "\",kind=\"%s", kind);
		if (part)
			fprintf(f, "\"} %" PRIu64 "\n", seen);
		else
			fprintf(f, "\"} %.9f\n", (double)h->sum_ns / 1e9);
	}
}

static void histograms(FILE *f, const struct export_sample *x, size_t n, struct histogram *h)
{
	static const char request[] = "nbdcached_request_duration_seconds";
	static const char backend[] = "nbdcached_backend_request_duration_seconds";
	family(f, request, "histogram",
	       "Client requests from arrival to reply queued, by kind (read_hit, read_miss, "
	       "write, flush).");
	for (size_t k = 0; k < n; k++)
		for (unsigned kind = 0; kind < CACHE_LATENCIES; kind++) {
			if (kind == CACHE_LATENCY_BACKEND)
				continue;
			cache_export_get_latency(x[k].ce, kind, h);
			histogram_series(f, request, x[k].name, cache_latency_name(kind), h);
		}
	family(f, backend, "histogram",
	       "The cache's backend requests from submission to completion.");
	for (size_t k = 0; k < n; k++) {
		cache_export_get_latency(x[k].ce, CACHE_LATENCY_BACKEND, h);
		histogram_series(f, backend, x[k].name, NULL, h);
	}
}

/* ---- the page ---- */

static void cache_gauges(FILE *f, struct cache *c)
{
	struct cache_stats s;
	cache_get_stats(c, &s);
	gauge(f, "nbdcached_cache_size_bytes", "Size of the cache (the arena).", s.cache_bytes);
	gauge(f, "nbdcached_cache_used_bytes", "Cache bytes allocated to entries.", s.used_bytes);
	gauge(f, "nbdcached_cache_dirty_bytes", "Dirty bytes in the cache, being written back too.",
	      s.traffic.dirty_bytes);
	gauge(f, "nbdcached_cache_unstable_bytes",
	      "Bytes written back but not flushed on their backend yet.", s.traffic.unstable_bytes);
	gauge(f, "nbdcached_cache_entries", "Cache entries.", s.entries);
	gauge(f, "nbdcached_cache_metadata_bytes", "Memory of the cache's index.",
	      s.metadata_bytes + s.arena_metadata_bytes);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v)
{
	family(f, name, "counter", help);
	fprintf(f, "%s %" PRIu64 "\n", name, v);
}

static void device_metrics(FILE *f, struct cache *c)
{
	struct cache_device_stats d;
	if (!cache_get_device_stats(c, &d) || !d.attached)
		return;
	gauge(f, "nbdcached_cache_device_failed",
	      "1 once the cache device failed: its log is off, the exports write through.",
	      d.failed);
	gauge(f, "nbdcached_cache_device_detached", "1 once the cache device was detached.",
	      d.detached);
	gauge(f, "nbdcached_cache_device_log_bytes", "Size of the intent log.", d.log_bytes);
	gauge(f, "nbdcached_cache_device_log_used_bytes", "Intent log bytes in use.", d.log_used);
	counter(f, "nbdcached_cache_device_commits_total", "Intent log commits.", d.commits);
	counter(f, "nbdcached_cache_device_logged_bytes_total", "Bytes of data logged.",
		d.bytes_logged);
	counter(f, "nbdcached_cache_device_full_log_fallbacks_total",
		"FLUSH rounds written back because the log was full.", d.fallbacks);
	gauge(f, "nbdcached_cache_device_replay_pending_bytes",
	      "Bytes of the log found at start not on the backends yet.", d.replay_pending_bytes);
	counter(f, "nbdcached_cache_device_replay_lost_bytes_total",
		"Bytes of the log found at start that the device corrupted (lost).",
		d.replay_lost_bytes);
	gauge(f, "nbdcached_cache_device_l2_on", "1 while the level-2 cache is on.", d.l2_on);
	gauge(f, "nbdcached_cache_device_l2_used_bytes", "Level-2 cache bytes in use.", d.l2_used);
	counter(f, "nbdcached_cache_device_l2_hits_total", "Fills served by the level-2 cache.",
		d.l2_hits);
	counter(f, "nbdcached_cache_device_l2_misses_total",
		"Fills the level-2 cache could not serve.", d.l2_misses);
	counter(f, "nbdcached_cache_device_l2_read_errors_total",
		"Level-2 reads that failed (read from the backend).", d.l2_read_errors);
	counter(f, "nbdcached_cache_device_l2_checksum_errors_total",
		"Level-2 pages whose bytes did not match their checksum (never served).",
		d.l2_checksum_errors);
}

static void client_metrics(FILE *f)
{
	counter(f, "nbdcached_invariant_violations_total",
		"Internal invariants found broken (the daemon went on; each is logged).",
		check_violations());
	struct budget_stats b;
	budget_get_stats(&b);
	gauge(f, "nbdcached_clients", "Client connections, negotiating ones too.", b.clients);
	family(f, "nbdcached_clients_refused_total", "counter",
	       "Connections closed at accept, by reason.");
	fprintf(f, "nbdcached_clients_refused_total{reason=\"max_clients\"} %" PRIu64 "\n",
		b.refused_clients);
	fprintf(f, "nbdcached_clients_refused_total{reason=\"per_client\"} %" PRIu64 "\n",
		b.refused_per_client);
	fprintf(f, "nbdcached_clients_refused_total{reason=\"access\"} %" PRIu64 "\n",
		b.refused_access);
}

/*
 * Is e on the page? Not a split window (its export's series are its own).
 * Not an export that LIST hides from some clients (access_export_listed),
 * unless the config says metrics-export-names = all: its name, and that it
 * exists, are for the clients its rules admit, and a scraper is not one.
 * The policy in force is read per page, so a reload applies to the next.
 */
static bool export_shown(const struct access_policy *p, const struct export *e)
{
	if (e->window_of)
		return false;
	return (p && p->metrics_export_names_all) ||
	       access_export_listed(p, e->name, e->tls_require);
}

/* The page, malloc'd, in *text (*len bytes): 0 or -ENOMEM. */
static int metrics_page(struct metrics *m, char **text, size_t *len)
{
	struct export **list;
	size_t n;
	if (export_list(m->exports, &list, &n) < 0)
		return -ENOMEM;
	int rc = -ENOMEM;
	struct access_policy *p = access_policy_get();
	struct export_sample *x = calloc(n ? n : 1, sizeof(*x));
	struct histogram *h = malloc(sizeof(*h));
	FILE *f = open_memstream(text, len);
	if (!x || !h || !f)
		goto out;
	size_t shown = 0;
	for (size_t i = 0; i < n; i++) {
		struct export *e = list[i];
		if (!export_shown(p, e))
			continue;
		struct export_sample *s = &x[shown++];
		s->name = e->name;
		s->ce = e->cache;
		cache_export_get_stats(e->cache, &s->s);
		cache_export_get_reply_stats(e->cache, &s->r);
		qos_limiter_get(e->counter->qos, &s->q);
		s->connections = atomic_load(&e->counter->connections);
		s->fenced = atomic_load(&e->backend->fenced);
	}
	cache_gauges(f, m->cache);
	device_metrics(f, m->cache);
	client_metrics(f);
	export_counters(f, x, shown);
	histograms(f, x, shown, h);
	rc = ferror(f) ? -ENOMEM : 0;
out:
	if (f && fclose(f) != 0)
		rc = -ENOMEM;
	if (rc < 0 && f) {
		free(*text);
		*text = NULL;
	}
	free(h);
	free(x);
	access_policy_put(p);
	for (size_t i = 0; i < n; i++)
		export_put(list[i]);
	free(list);
	return rc;
}

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
	struct MHD_Response *r =
	    MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
	if (!r)
		return MHD_NO;
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
	if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
	enum MHD_Result ret = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
				  const char *method, const char *version, const char *upload_data,
				  size_t *upload_data_size, void **con_cls)
{
	(void)version;
	(void)upload_data;
	(void)upload_data_size;
	(void)con_cls;
	struct metrics *m = cls;
	if (strcmp(url, "/metrics") != 0)
		return reply_text(conn, MHD_HTTP_NOT_FOUND, "not found: the page is /metrics\n");
	if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
		return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
	char *text;
	size_t len;
	if (metrics_page(m, &text, &len) < 0)
		return reply_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
	struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
	if (!r) {
		free(text);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, METRICS_CONTENT_TYPE);
	enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
	MHD_destroy_response(r);
	return ret;
}

/* libmicrohttpd's accept policy: the published metrics rules (access.h). */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
	(void)cls;
	LOG_LIMIT(refused_log, "metrics refusals");
	struct access_peer peer;
	access_peer_from_socket(&peer, -1, addr, addrlen);
	struct access_policy *p = access_policy_get();
	char why[128] = "no access policy";
	bool allowed = p && access_rules_allow(&p->metrics, &peer, why, sizeof(why));
	access_policy_put(p);
	access_peer_release(&peer);
	if (!allowed)
		log_limited(&refused_log, LOG_INFO, "metrics: %s refused: %s", peer.text, why);
	return allowed ? MHD_YES : MHD_NO;
}

/* libmicrohttpd's messages: a client can cause them (one per connection
 * past a limit, or reset), so they are rate-limited as our own are. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	LOG_LIMIT(mhd_log, "metrics server messages");
	char line[512];
	vsnprintf(line, sizeof(line), fmt, ap);
	size_t n = strlen(line);
	while (n && line[n - 1] == '\n')
		line[--n] = '\0';
	log_limited(&mhd_log, LOG_WARN, "metrics: %s", line);
}

/*
 * libmicrohttpd with its own thread polling with epoll (poll where the
 * library was built without it), never select(): select() cannot watch a
 * descriptor past FD_SETSIZE (1024), and a daemon with a thousand clients
 * has every new one past it, so every scrape would be refused.
 */
static struct MHD_Daemon *start_daemon(unsigned flags, int fd, struct metrics *m)
{
	/* The logger first: options before it would log to stderr. */
	return MHD_start_daemon(
	    flags | MHD_USE_ERROR_LOG, 0, on_accept, NULL, on_request, m,
	    MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
	    MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_CONNECTION_LIMIT,
	    MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)METRICS_PER_IP_LIMIT,
	    MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)METRICS_TIMEOUT_SECONDS, MHD_OPTION_END);
}

int metrics_start(int fd, struct cache *cache, struct export_table *exports, struct metrics **out)
{
	struct metrics *m = calloc(1, sizeof(*m));
	int flags = fcntl(fd, F_GETFL);
	if (!m || flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
		int rc = m ? -errno : -ENOMEM;
		free(m);
		close(fd);
		return rc;
	}
	m->cache = cache;
	m->exports = exports;
	if (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES)
		m->daemon = start_daemon(MHD_USE_EPOLL_INTERNAL_THREAD, fd, m);
	else if (MHD_is_feature_supported(MHD_FEATURE_POLL) == MHD_YES)
		m->daemon = start_daemon(MHD_USE_POLL_INTERNAL_THREAD, fd, m);
	else
		log_error("metrics: libmicrohttpd has neither epoll nor poll (select() only)");
	if (!m->daemon) {
		free(m);
		close(fd);
		return -EIO;
	}
	*out = m;
	return 0;
}

void metrics_stop(struct metrics *m)
{
	if (!m)
		return;
	MHD_stop_daemon(m->daemon); /* joins its thread, closes the socket */
	free(m);
}
