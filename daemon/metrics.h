/*
 * daemon/metrics.h: GET /metrics in the Prometheus text format (0.0.4)
 * over HTTP, with libmicrohttpd; off unless --metrics / metrics = is set.
 *
 * Owns: the HTTP listener's thread (libmicrohttpd's internal thread,
 * polling with epoll, never select(), on a socket the server bound, so the
 * address syntax, IPv6 and privileged ports are the NBD listeners'; ":PORT"
 * is loopback, options.h), the HTTP side's limits (connections in all,
 * per address, idle timeout), the metric names and the page.
 * Who may fetch: the access policy's metrics rules (metrics-allow,
 * metrics-deny; access.h), checked at accept by the same matcher as the
 * NBD listeners' rules; a refused client is disconnected without an HTTP
 * answer, as a refused NBD client is. The rules are the published policy's,
 * so a reload changes them for the next connection; the address is fixed
 * at start (a reload that changes it is refused, control_reload.c).
 * What it names: exports that LIST shows to every client
 * (access_export_listed), or all of them with metrics-export-names = all
 * (the policy's too, so a reload changes it for the next page).
 *
 * Reads only what any thread may read: the cache's and each export's
 * counters and latency histograms (atomics, cache.h), the export table's
 * snapshot (export_list), the budget's totals. Nothing on the request path
 * waits for it.
 *
 * Threads: metrics_start() and metrics_stop() on the main thread;
 * everything else on libmicrohttpd's thread.
 */
#ifndef NBDCACHED_DAEMON_METRICS_H
#define NBDCACHED_DAEMON_METRICS_H

struct cache;
struct export_table;
struct metrics;

/* Start serving on fd (bound and listening; metrics takes it over, and
 * closes it on failure too): 0 or -errno. */
int metrics_start(int fd, struct cache *cache, struct export_table *exports, struct metrics **out);
/* Stop the thread, close the socket (NULL: nothing). */
void metrics_stop(struct metrics *m);

#endif
