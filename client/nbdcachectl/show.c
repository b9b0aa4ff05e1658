/*
 * client/nbdcachectl/show.c: the one-request commands' replies for people
 * (status, exports, stats, drop-clean, compact, set-mode, reload, resize).
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <json-c/json.h>

#include "client/lib/ctl.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

/* HOST:PORT, an IPv6 HOST in brackets. */
static void print_address(json_object *entry)
{
	const char *address = ctl_get_string(entry, "address");

	address = address ? address : "?";
	printf(strchr(address, ':') ? "[%s]:%" PRId64 : "%s:%" PRId64, address,
	       ctl_get_int(entry, "port"));
}

static void print_listen(json_object *entry)
{
	const char *type = ctl_get_string(entry, "type"), *path = ctl_get_string(entry, "path");

	type = type ? type : "?";
	if (strcmp(type, "unix") == 0) {
		printf("unix %s", path ? path : "?");
	} else if (strcmp(type, "tcp") == 0) {
		printf("tcp ");
		print_address(entry);
	} else if (strcmp(type, "fd") == 0) {
		printf("fd %" PRId64, ctl_get_int(entry, "fd"));
		if (ctl_get_string(entry, "address")) {
			printf(" (tcp ");
			print_address(entry);
			putchar(')');
		}
	} else {
		printf("%s", type);
	}
}

void print_status(json_object *r)
{
	int64_t cache = ctl_get_int(r, "cache_bytes");

	printf("nbdcached %s, pid %" PRId64 ", up %s\n",
	       ctl_get_string(r, "version") ? ctl_get_string(r, "version") : "?",
	       ctl_get_int(r, "pid"),
	       format_duration((char[32]){0}, 32, ctl_get_int(r, "uptime_ms")));
	printf("config       %s\n",
	       ctl_get_string(r, "config") ? ctl_get_string(r, "config") : "(none)");
	printf("listening    ");
	for (size_t i = 0; i < ctl_array_length(r, "listen"); i++) {
		fputs(i ? ", " : "", stdout);
		print_listen(ctl_array_item(r, "listen", i));
	}
	printf("%s\n", ctl_array_length(r, "listen") ? "" : "(nothing)");
	printf("exports      %" PRId64, ctl_get_int(r, "exports"));
	if (ctl_get_int(r, "removed_backends"))
		printf(" (+%" PRId64 " removed, finishing)", ctl_get_int(r, "removed_backends"));
	printf("\n");
	printf("connections  %" PRId64 "\n", ctl_get_int(r, "connections"));
	printf("threads      %" PRId64 "\n", ctl_get_int(r, "threads"));
	printf("arena        %s\n", ctl_get_string(r, "arena") ? ctl_get_string(r, "arena") : "?");
	printf("cache        %s\n", SIZE(cache));
	printf("used         %s (%s)\n", SIZE(ctl_get_int(r, "used_bytes")),
	       SHARE(ctl_get_int(r, "used_bytes"), cache));
	printf("dirty        %s (%s)\n", SIZE(ctl_get_int(r, "dirty_bytes")),
	       SHARE(ctl_get_int(r, "dirty_bytes"), cache));
}

void print_exports(json_object *r)
{
	static const char *const headers[] = {"NAME",	"KIND",	   "SIZE",	 "BLOCK",
					      "MODE",	"ACCESS",  "CONNS",	 "DIRTY",
					      "SEQCUT", "BACKEND", "DESCRIPTION"};
	struct table t = {
	    .columns = ARRAY_SIZE(headers), .headers = headers, .align = "llrrllrrrll"};

	for (size_t i = 0; i < ctl_array_length(r, "exports"); i++) {
		json_object *e = ctl_array_item(r, "exports", i);
		const char *s;
		table_cell(&t, "%s", (s = ctl_get_string(e, "name")) ? s : "?");
		table_cell(&t, "%s", (s = ctl_get_string(e, "kind")) ? s : "?");
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "size")));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "block_size"));
		table_cell(&t, "%s", (s = ctl_get_string(e, "cache_mode")) ? s : "?");
		table_cell(&t, "%s",
			   ctl_get_bool(e, "fenced")     ? "FENCED"
			   : ctl_get_bool(e, "readonly") ? "ro"
							 : "rw");
		if (ctl_get_int(e, "max_connections"))
			table_cell(&t, "%" PRId64 "/%" PRId64, ctl_get_int(e, "connections"),
				   ctl_get_int(e, "max_connections"));
		else
			table_cell(&t, "%" PRId64, ctl_get_int(e, "connections"));
		table_cell(&t, "%" PRId64 "%%-%" PRId64 "%%", ctl_get_int(e, "dirty_low"),
			   ctl_get_int(e, "dirty_high"));
		table_cell(&t, "%s",
			   ctl_get_int(e, "seq_cutoff") ? SIZE(ctl_get_int(e, "seq_cutoff"))
							: "off");
		table_cell(&t, "%s", (s = ctl_get_string(e, "backend")) ? s : "?");
		table_cell(&t, "%s", (s = ctl_get_string(e, "description")) ? s : "");
	}
	table_print(&t);
	table_free(&t);
}

void print_latency(json_object *r)
{
	static const char *const headers[] = {"EXPORT", "LATENCY", "COUNT", "P50", "P99", "P999"};
	static const char *const kinds[] = {"read_hit", "read_miss", "write", "flush", "backend"};
	struct table t = {.columns = ARRAY_SIZE(headers), .headers = headers, .align = "llrrrr"};

	for (size_t i = 0; i < ctl_array_length(r, "exports"); i++) {
		json_object *e = ctl_array_item(r, "exports", i), *lat = ctl_field(e, "latency");
		const char *name = ctl_get_string(e, "name");

		for (size_t k = 0; lat && k < ARRAY_SIZE(kinds); k++) {
			json_object *x = ctl_field(lat, kinds[k]);

			table_cell(&t, "%s", k == 0 ? (name ? name : "?") : "");
			table_cell(&t, "%s", kinds[k]);
			table_cell(&t, "%" PRId64, ctl_get_int(x, "count"));
			table_cell(&t, "%s", LATENCY(ctl_get_int(x, "p50_ns")));
			table_cell(&t, "%s", LATENCY(ctl_get_int(x, "p99_ns")));
			table_cell(&t, "%s", LATENCY(ctl_get_int(x, "p999_ns")));
		}
	}
	table_print(&t);
	table_free(&t);
}

/* A cache device's lines (stats, cache-device); nothing without one. */
static void print_device(json_object *dev)
{
	if (!dev)
		return;
	int64_t commits = ctl_get_int(dev, "commits");
	printf("cache device %s%slog %s, %s used, %s pending; %" PRId64
	       " commits (mean %.2f ms, max %.2f ms), %s logged, %" PRId64 " checkpoints, %" PRId64
	       " full-log fallbacks\n",
	       ctl_get_bool(dev, "failed") ? "FAILED (off until a restart), " : "",
	       ctl_get_bool(dev, "detached")	? "DETACHED (not used until a restart), "
	       : ctl_get_bool(dev, "detaching") ? "DETACHING, "
						: "",
	       SIZE(ctl_get_int(dev, "log_bytes")), SIZE(ctl_get_int(dev, "log_used_bytes")),
	       SIZE(ctl_get_int(dev, "pending_bytes")), commits,
	       commits ? (double)ctl_get_int(dev, "commit_ns") / (double)commits / 1e6 : 0.0,
	       (double)ctl_get_int(dev, "commit_max_ns") / 1e6,
	       SIZE(ctl_get_int(dev, "bytes_logged")), ctl_get_int(dev, "checkpoints"),
	       ctl_get_int(dev, "full_log_fallbacks"));
	printf("replay       %" PRId64 " batches, %" PRId64 " records, %s, planned in %.3f s at "
	       "start; ",
	       ctl_get_int(dev, "replay_batches"), ctl_get_int(dev, "replay_records"),
	       SIZE(ctl_get_int(dev, "replay_bytes")), (double)ctl_get_int(dev, "replay_ns") / 1e9);
	if (ctl_get_int(dev, "replay_drain_ns"))
		printf("written back in %.3f s while served",
		       (double)ctl_get_int(dev, "replay_drain_ns") / 1e9);
	else
		printf("%s not yet written back", SIZE(ctl_get_int(dev, "replay_pending_bytes")));
	printf(", %" PRId64 " requests waited for it\n", ctl_get_int(dev, "replay_waits"));
	json_object *l2 = ctl_field(dev, "l2");
	if (!l2)
		return;
	printf("level-2      %s%s, %s used, %s staged; %" PRId64 " hits (%s), %" PRId64
	       " misses, %" PRId64 " to a faster backend, %" PRId64
	       " stale; %s stored, %s left out, %s written over; %s warm "
	       "at start in %.3f s\n",
	       ctl_get_bool(l2, "failed") ? "FAILED (off until a restart), " : "",
	       ctl_get_bool(l2, "on") ? SIZE(ctl_get_int(l2, "bytes")) : "off",
	       SIZE(ctl_get_int(l2, "used_bytes")), SIZE(ctl_get_int(l2, "staged_bytes")),
	       ctl_get_int(l2, "hits"), SIZE(ctl_get_int(l2, "hit_bytes")),
	       ctl_get_int(l2, "misses"), ctl_get_int(l2, "skipped"),
	       ctl_get_int(l2, "stale_reads"), SIZE(ctl_get_int(l2, "stored_bytes")),
	       SIZE(ctl_get_int(l2, "dropped_bytes")), SIZE(ctl_get_int(l2, "invalidated_bytes")),
	       SIZE(ctl_get_int(l2, "loaded_bytes")), (double)ctl_get_int(l2, "load_ns") / 1e9);
}

void print_cache_device(json_object *r)
{
	const char *action = ctl_get_string(r, "action");
	if (action)
		printf("%s       %" PRId64 " export(s) written back and flushed in %" PRId64
		       " ms; %s\n",
		       action, ctl_get_int(r, "exports"), ctl_get_int(r, "time_ms"),
		       strcmp(action, "detach") == 0
			   ? "the device is marked clean and not used until a restart"
			   : "the log holds nothing older");
	printf("path         %s\n", ctl_get_string(r, "path") ? ctl_get_string(r, "path") : "?");
	print_device(ctl_field(r, "cache_device"));
}

void print_stats(json_object *r)
{
	static const char *const headers[] = {
	    "EXPORT",  "CONNS",	    "HITS",	 "MISSES",    "PARTIAL",    "HIT%",
	    "DIRTY",   "BE-READS",  "BE-READ",	 "BE-WRITES", "BE-WRITTEN", "WRITTEN-BACK",
	    "WB-RATE", "EVICTIONS", "WB-ERRORS", "THROTTLED", "THROTTLED-S"};
	_Static_assert(ARRAY_SIZE(headers) <= TABLE_MAX_COLUMNS, "table_print's widths");
	struct table t = {
	    .columns = ARRAY_SIZE(headers), .headers = headers, .align = "lrrrrrrrrrrrrrrrr"};
	json_object *c = ctl_field(r, "cache"), *arena = ctl_field(c, "arena");
	int64_t cache = ctl_get_int(c, "cache_bytes"),
		free_bytes = ctl_get_int(arena, "free_bytes");

	printf("cache        %s, used %s (%s), dirty %s (%s), %" PRId64 " entries, metadata %s\n",
	       SIZE(cache), SIZE(ctl_get_int(c, "used_bytes")),
	       SHARE(ctl_get_int(c, "used_bytes"), cache), SIZE(ctl_get_int(c, "dirty_bytes")),
	       SHARE(ctl_get_int(c, "dirty_bytes"), cache), ctl_get_int(c, "entries"),
	       SIZE(ctl_get_int(c, "metadata_bytes")));
	printf("reads        %" PRId64 " hits, %" PRId64 " misses, %" PRId64
	       " partial hits, hit ratio %s\n",
	       ctl_get_int(c, "hits"), ctl_get_int(c, "misses"), ctl_get_int(c, "partial_hits"),
	       PERCENT(ctl_get_double(c, "hit_ratio")));
	printf("backend      %" PRId64 " reads (%s), %" PRId64 " writes (%s)\n",
	       ctl_get_int(c, "backend_reads"), SIZE(ctl_get_int(c, "backend_read_bytes")),
	       ctl_get_int(c, "backend_writes"), SIZE(ctl_get_int(c, "backend_write_bytes")));
	printf("writeback    %s written back, %s/s, %" PRId64 " errors\n",
	       SIZE(ctl_get_int(c, "writeback_bytes")), SIZE(ctl_get_int(c, "writeback_rate")),
	       ctl_get_int(c, "writeback_errors"));
	printf("durability   %s unstable (written, not flushed), %" PRId64
	       " backend flushes, %" PRId64 " failed, %" PRId64 " losses\n",
	       SIZE(ctl_get_int(c, "unstable_bytes")), ctl_get_int(c, "backend_flushes"),
	       ctl_get_int(c, "backend_flush_errors"), ctl_get_int(c, "losses"));
	json_object *cmds = ctl_field(c, "commands");
	printf("requests     %" PRId64 " read, %" PRId64 " write, %" PRId64 " flush, %" PRId64
	       " trim, %" PRId64 " write-zeroes, %" PRId64 " cache, %" PRId64
	       " block-status; %" PRId64 " with FUA\n",
	       ctl_get_int(cmds, "read"), ctl_get_int(cmds, "write"), ctl_get_int(cmds, "flush"),
	       ctl_get_int(cmds, "trim"), ctl_get_int(cmds, "write_zeroes"),
	       ctl_get_int(cmds, "cache"), ctl_get_int(cmds, "block_status"),
	       ctl_get_int(cmds, "fua"));
	printf("other        %" PRId64 " evictions, %" PRId64 " bypassed reads, %" PRId64
	       " direct writes, %" PRId64 " writes received in place (%" PRId64
	       " swapped in), %" PRId64 " writes throttled\n",
	       ctl_get_int(c, "evictions"), ctl_get_int(c, "bypass_reads"),
	       ctl_get_int(c, "direct_writes"), ctl_get_int(c, "writes_in_place"),
	       ctl_get_int(c, "writes_swapped"), ctl_get_int(c, "throttled_writes"));
	print_device(ctl_field(c, "cache_device"));
	printf("arena        %s, %s free, fragmentation %s\n",
	       ctl_get_string(arena, "kind") ? ctl_get_string(arena, "kind") : "?",
	       SIZE(free_bytes), PERCENT(ctl_get_double(arena, "fragmentation")));
	printf("free by size");
	for (size_t k = 0; k < ctl_array_length(arena, "free_bytes_by_order"); k++)
		printf(
		    " %u%c:%s", k < 8 ? 4u << k : 1u << (k - 8), k < 8 ? 'K' : 'M',
		    SIZE(json_object_get_int64(ctl_array_item(arena, "free_bytes_by_order", k))));
	printf("\n\n");
	for (size_t i = 0; i < ctl_array_length(r, "exports"); i++) {
		json_object *e = ctl_array_item(r, "exports", i);
		table_cell(&t, "%s", ctl_get_string(e, "name") ? ctl_get_string(e, "name") : "?");
		table_cell(&t, "%" PRId64, ctl_get_int(e, "connections"));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "hits"));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "misses"));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "partial_hits"));
		table_cell(&t, "%s", PERCENT(ctl_get_double(e, "hit_ratio")));
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "dirty_bytes")));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "backend_reads"));
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "backend_read_bytes")));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "backend_writes"));
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "backend_write_bytes")));
		table_cell(&t, "%s", SIZE(ctl_get_int(e, "writeback_bytes")));
		table_cell(&t, "%s/s", SIZE(ctl_get_int(e, "writeback_rate")));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "evictions"));
		table_cell(&t, "%" PRId64, ctl_get_int(e, "writeback_errors"));
		/* QoS: requests held back by the export's limits, and for how long. */
		table_cell(&t, "%" PRId64, ctl_get_int(e, "throttled_requests"));
		table_cell(&t, "%.1f", (double)ctl_get_int(e, "throttled_ns") / 1e9);
	}
	table_print(&t);
	table_free(&t);
	printf("\n");
	print_latency(r);
}

void print_drop_clean(json_object *r)
{
	printf("%s: dropped %s of clean cache, %s still cached\n",
	       ctl_get_string(r, "export") ? ctl_get_string(r, "export") : "?",
	       SIZE(ctl_get_int(r, "dropped_bytes")), SIZE(ctl_get_int(r, "kept_bytes")));
}

void print_resize(json_object *r)
{
	int64_t was = ctl_get_int(r, "old_size"), now = ctl_get_int(r, "new_size");
	printf("%s: %s -> %s (%" PRId64 " -> %" PRId64 " bytes)\n",
	       ctl_get_string(r, "export") ? ctl_get_string(r, "export") : "?", SIZE(was),
	       SIZE(now), was, now);
}

void print_compact(json_object *r)
{
	printf("moved %" PRId64 " entries, skipped %" PRId64 " pinned, collapsed %" PRId64
	       ", freed %" PRId64 " chunks of 2 MiB, in %.1f ms\n",
	       ctl_get_int(r, "moved"), ctl_get_int(r, "skipped_pinned"),
	       ctl_get_int(r, "collapsed"), ctl_get_int(r, "freed_2m_chunks"),
	       (double)ctl_get_int(r, "time_ns") / 1e6);
	printf("fragmentation %s -> %s\n", PERCENT(ctl_get_double(r, "fragmentation_before")),
	       PERCENT(ctl_get_double(r, "fragmentation_after")));
}

void print_set_mode(json_object *r)
{
	printf("%s: %s -> %s\n", ctl_get_string(r, "export") ? ctl_get_string(r, "export") : "?",
	       ctl_get_string(r, "previous") ? ctl_get_string(r, "previous") : "?",
	       ctl_get_string(r, "mode") ? ctl_get_string(r, "mode") : "?");
}

static void print_names(const char *label, json_object *r, const char *key)
{
	printf("%-17s", label);
	for (size_t i = 0; i < ctl_array_length(r, key); i++) {
		json_object *v = ctl_array_item(r, key, i);
		printf("%s%s", i ? ", " : "",
		       json_object_is_type(v, json_type_string) ? json_object_get_string(v) : "?");
	}
	printf("%s\n", ctl_array_length(r, key) ? "" : "-");
}

void print_reload(json_object *r)
{
	print_names("added", r, "added");
	print_names("changed", r, "changed");
	print_names("removed", r, "removed");
	print_names("refused", r, "refused");
	if (ctl_array_length(r, "resized")) /* a backend's new size: rare */
		print_names("resized", r, "resized");
	print_names("needs a restart", r, "refused_settings");
}
