/*
 * client/nbdcachectl/top.c: "stats" every --interval, rates per export from
 * two samples and the daemon's time_ms, as a table or one JSON line each.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

struct rates {
	bool known; /* the export was in the previous sample and no counter went back */
	double reads, hit_ratio, read_bytes, write_bytes, writeback_bytes;
	bool any_reads;
};

static struct rates export_rates(json_object *before, json_object *after, double seconds)
{
	static const char *const counters[] = {
	    "hits",	      "misses", "partial_hits", "backend_read_bytes", "backend_write_bytes",
	    "writeback_bytes"};
	struct rates r = {.known = before && seconds > 0};
	double d[ARRAY_SIZE(counters)];

	for (size_t i = 0; r.known && i < ARRAY_SIZE(counters); i++) {
		d[i] = (double)(ctl_get_int(after, counters[i]) - ctl_get_int(before, counters[i]));
		r.known = d[i] >= 0;
	}
	if (!r.known)
		return r;
	r.reads = (d[0] + d[1] + d[2]) / seconds;
	r.any_reads = d[0] + d[1] + d[2] > 0;
	r.hit_ratio = r.any_reads ? d[0] / (d[0] + d[1] + d[2]) : 0;
	r.read_bytes = d[3] / seconds;
	r.write_bytes = d[4] / seconds;
	r.writeback_bytes = d[5] / seconds;
	return r;
}

static json_object *json_rate(bool known, double value)
{
	return known ? json_object_new_double(value) : NULL;
}

/* One line of JSON per refresh: the computed rates, null where unknown. */
static void print_top_json(json_object *before, json_object *after, double seconds)
{
	json_object *out = json_object_new_object(), *exports = json_object_new_array();

	json_object_object_add(out, "time_ms",
			       json_object_new_int64(ctl_get_int(after, "time_ms")));
	json_object_object_add(out, "interval_ms",
			       json_object_new_int64((int64_t)(seconds * 1000 + 0.5)));
	json_object_object_add(out, "exports", exports);
	for (size_t i = 0; i < ctl_array_length(after, "exports"); i++) {
		json_object *e = ctl_array_item(after, "exports", i), *x = json_object_new_object();
		const char *name = ctl_get_string(e, "name");
		struct rates r =
		    export_rates(name ? ctl_find_named(before, "exports", name) : NULL, e, seconds);

		json_object_object_add(x, "name", json_object_new_string(name ? name : ""));
		json_object_object_add(x, "reads_per_s", json_rate(r.known, r.reads));
		json_object_object_add(x, "hit_ratio", json_rate(r.any_reads, r.hit_ratio));
		json_object_object_add(x, "backend_read_bytes_per_s",
				       json_rate(r.known, r.read_bytes));
		json_object_object_add(x, "backend_write_bytes_per_s",
				       json_rate(r.known, r.write_bytes));
		json_object_object_add(x, "writeback_bytes_per_s",
				       json_rate(r.known, r.writeback_bytes));
		json_object_object_add(x, "dirty_bytes",
				       json_object_new_int64(ctl_get_int(e, "dirty_bytes")));
		json_object_object_add(x, "connections",
				       json_object_new_int64(ctl_get_int(e, "connections")));
		/* Percentiles since start, as stats gives them. */
		json_object *lat = ctl_field(e, "latency");
		json_object_object_add(x, "latency", lat ? json_object_get(lat) : NULL);
		json_object_array_add(exports, x);
	}
	puts(json_object_to_json_string_ext(out, JSON_C_TO_STRING_PLAIN |
						     JSON_C_TO_STRING_NOSLASHESCAPE));
	json_object_put(out);
}

static void print_top(json_object *before, json_object *after, double seconds, bool tty)
{
	static const char *const headers[] = {"EXPORT",	    "READS/S",	   "HIT%",  "BE-READ/S",
					      "BE-WRITE/S", "WRITEBACK/S", "DIRTY", "CONNS"};
	struct table t = {.columns = ARRAY_SIZE(headers), .headers = headers, .align = "lrrrrrrr"};
	json_object *c = ctl_field(after, "cache");
	int64_t cache = ctl_get_int(c, "cache_bytes");

	if (tty)
		fputs("\033[H\033[2J", stdout);
	printf("nbdcached: cache %s, used %s (%s), dirty %s (%s); rates over %.1f s\n", SIZE(cache),
	       SIZE(ctl_get_int(c, "used_bytes")), SHARE(ctl_get_int(c, "used_bytes"), cache),
	       SIZE(ctl_get_int(c, "dirty_bytes")), SHARE(ctl_get_int(c, "dirty_bytes"), cache),
	       seconds);
	for (size_t i = 0; i < ctl_array_length(after, "exports"); i++) {
		json_object *e = ctl_array_item(after, "exports", i);
		const char *name = ctl_get_string(e, "name");
		struct rates r =
		    export_rates(name ? ctl_find_named(before, "exports", name) : NULL, e, seconds);

		table_cell(&t, "%s", name ? name : "?");
		if (r.known) {
			table_cell(&t, "%.1f", r.reads);
			table_cell(&t, "%s", r.any_reads ? PERCENT(r.hit_ratio) : "-");
			table_cell(&t, "%s/s", SIZE(r.read_bytes));
			table_cell(&t, "%s/s", SIZE(r.write_bytes));
			table_cell(&t, "%s/s", SIZE(r.writeback_bytes));
		} else {
			for (int k = 0; k < 5; k++)
				table_cell(&t, "-");
		}
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "dirty_bytes")));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "connections"));
	}
	table_print(&t);
	table_free(&t);
	printf("\nlatency since start\n");
	print_latency(after);
	if (!tty)
		putchar('\n');
}

/* Sleep until `deadline` on the monotonic clock. */
static void sleep_until(double deadline)
{
	struct timespec ts = {.tv_sec = (time_t)deadline,
			      .tv_nsec = (long)((deadline - (double)(time_t)deadline) * 1e9)};

	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

int run_top(const struct options *o)
{
	static const char *const keys[2] = {NULL};
	struct ctl c = CTL_INIT;
	json_object *before = NULL, *after = NULL;
	bool tty = !o->json && isatty(STDOUT_FILENO);
	double start = now_s();
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, ctl_request("stats", keys, NULL, 0), &before);
	for (long i = 0; !err && (o->count == 0 || i < o->count); i++) {
		double seconds;

		sleep_until(start + (double)(i + 1) * o->interval);
		err = ctl_call(&c, ctl_request("stats", keys, NULL, 0), &after);
		if (err)
			break;
		seconds =
		    (double)(ctl_get_int(after, "time_ms") - ctl_get_int(before, "time_ms")) / 1000;
		if (o->json)
			print_top_json(before, after, seconds);
		else
			print_top(before, after, seconds, tty);
		fflush(stdout);
		json_object_put(before);
		before = after;
		after = NULL;
	}
	json_object_put(after);
	json_object_put(before);
	ctl_close(&c);
	return err;
}
