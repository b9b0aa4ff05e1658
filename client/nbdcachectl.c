/*
 * nbdcachectl: nbdcached's control client.
 *
 * Talks to the daemon's control socket (a Unix stream socket) in the
 * protocol of include/nbdcached/control.h: one JSON object per line each
 * way, one reply per request, in order. Most commands are one request and
 * one reply, printed for people (sizes in KiB/MiB/GiB, ratios as
 * percentages, aligned tables) or, with --json, as the daemon's reply line
 * exactly as it arrived, so that scripts see every field the daemon sends.
 *
 * Three commands do more:
 *   flush   the request on one connection, "stats" polled every 100 ms on
 *           a second one to draw the dirty bytes draining (one poll(2) loop
 *           over both, so a slow reply on one never stalls the other);
 *   top     "stats" every --interval, rates from two samples and time_ms;
 *   attach  "status" and "exports" turned into an nbd-client command line,
 *           printed (shell-quoted) or executed.
 *
 *   main -> parse_args -> command->run (run_simple, run_flush, run_top,
 *           run_attach) -> ctl_call -> ctl_send / ctl_receive
 *
 * Errors are 0 / -errno inside and are printed where detected. Exit status:
 * 0 success; 1 the daemon refused (an ok=false reply), could not be
 * reached or broke the protocol; 2 a usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "include/nbdcached/control.h"

#define PROGRAM "nbdcachectl"
#define REPLY_MAX (64u << 20) /* longest reply line accepted */
#define FLUSH_POLL_MS 100
#define ATTACH_CONNECTIONS 4
#define NBD_CLIENT_MAX_BLOCK 4096 /* nbd-client accepts 512..4096 */
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/* One connection to the control socket and the bytes read but not yet used. */
struct ctl {
	int fd;
	const char *path;
	char *buffer;
	size_t length, capacity;
	char *line;	  /* the last reply line, NUL-terminated, valid until the next */
	size_t line_size; /* bytes of the buffer it takes, newline included */
};
#define CTL_INIT                                                                                   \
	{                                                                                          \
		.fd = -1                                                                           \
	}

struct options {
	const char *control;
	bool json;
	bool run;	  /* attach --run */
	long count;	  /* top --count; 0: forever */
	double interval;  /* top --interval, seconds */
	bool top_options; /* --count or --interval given */
	const struct command *command;
	char **args;
	int nargs;
};

struct command {
	const char *name;
	const char *keys[2]; /* request fields filled by the positional ARGS, in order */
	int min_args, max_args;
	void (*print)(json_object *reply); /* human output of a one-request command */
	int (*run)(const struct options *o);
};

/* ---- JSON access: a missing or mistyped field reads as 0, "" or NULL. ---- */

static json_object *field(json_object *o, const char *key)
{
	json_object *v = NULL;

	return o && json_object_object_get_ex(o, key, &v) ? v : NULL;
}

static int64_t get_int(json_object *o, const char *key)
{
	return json_object_get_int64(field(o, key));
}

static double get_double(json_object *o, const char *key)
{
	return json_object_get_double(field(o, key));
}

static bool get_bool(json_object *o, const char *key)
{
	return json_object_get_boolean(field(o, key));
}

/* The string, or NULL when the field is missing, null or not a string. */
static const char *get_string(json_object *o, const char *key)
{
	json_object *v = field(o, key);

	return json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

static size_t array_length(json_object *o, const char *key)
{
	json_object *v = field(o, key);

	return json_object_is_type(v, json_type_array) ? json_object_array_length(v) : 0;
}

static json_object *array_item(json_object *o, const char *key, size_t i)
{
	return json_object_array_get_idx(field(o, key), i);
}

/* The element of array `key` whose "name" is `name`, or NULL. */
static json_object *find_named(json_object *o, const char *key, const char *name)
{
	for (size_t i = 0; i < array_length(o, key); i++) {
		const char *n = get_string(array_item(o, key, i), "name");
		if (n && strcmp(n, name) == 0)
			return array_item(o, key, i);
	}
	return NULL;
}

/* ---- Human formats. ---- */

/* "512 B", "1.5 GiB": binary units, one decimal above bytes. */
static const char *format_size(char *buf, size_t size, double bytes)
{
	static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
	size_t u = 0;

	while ((bytes >= 1024 || bytes <= -1024) && u + 1 < ARRAY_SIZE(units)) {
		bytes /= 1024;
		u++;
	}
	if (u == 0)
		snprintf(buf, size, "%.0f B", bytes);
	else
		snprintf(buf, size, "%.1f %s", bytes, units[u]);
	return buf;
}

static const char *format_percent(char *buf, size_t size, double ratio)
{
	snprintf(buf, size, "%.1f%%", 100.0 * ratio);
	return buf;
}

/* part / whole as a percentage; "-" when whole is 0. */
static const char *format_share(char *buf, size_t size, double part, double whole)
{
	if (whole <= 0)
		snprintf(buf, size, "-");
	else
		format_percent(buf, size, part / whole);
	return buf;
}

/* "3d 04:05:06" or "04:05:06". */
static const char *format_duration(char *buf, size_t size, int64_t ms)
{
	int64_t s = ms / 1000;

	if (s >= 86400)
		snprintf(buf, size, "%" PRId64 "d %02d:%02d:%02d", s / 86400, (int)(s / 3600 % 24),
			 (int)(s / 60 % 60), (int)(s % 60));
	else
		snprintf(buf, size, "%02d:%02d:%02d", (int)(s / 3600), (int)(s / 60 % 60),
			 (int)(s % 60));
	return buf;
}

#define SIZE(x) format_size((char[24]){0}, 24, (double)(x))
#define PERCENT(x) format_percent((char[16]){0}, 16, (x))
#define SHARE(part, whole) format_share((char[16]){0}, 16, (double)(part), (double)(whole))

/*
 * A table printed with aligned columns: headers, then one cell per column
 * and row, each column left-aligned ('l') or right-aligned ('r'). A cell
 * that cannot be allocated is remembered and reported by table_print.
 */
struct table {
	size_t columns;
	const char *const *headers;
	const char *align;
	char **cells;
	size_t count, capacity;
	int err;
};

__attribute__((format(printf, 2, 3))) static void table_cell(struct table *t, const char *fmt, ...)
{
	va_list ap;
	char *cell;
	int n;

	if (t->err)
		return;
	if (t->count == t->capacity) {
		size_t capacity = t->capacity ? 2 * t->capacity : 64;
		char **cells = realloc(t->cells, capacity * sizeof(*cells));
		if (!cells) {
			t->err = -ENOMEM;
			return;
		}
		t->cells = cells;
		t->capacity = capacity;
	}
	va_start(ap, fmt);
	n = vasprintf(&cell, fmt, ap);
	va_end(ap);
	if (n < 0)
		t->err = -ENOMEM;
	else
		t->cells[t->count++] = cell;
}

static int table_print(const struct table *t)
{
	size_t width[16] = {0};

	if (t->err) {
		fprintf(stderr, PROGRAM ": %s\n", strerror(-t->err));
		return t->err;
	}
	for (size_t c = 0; c < t->columns && c < ARRAY_SIZE(width); c++)
		width[c] = strlen(t->headers[c]);
	for (size_t i = 0; i < t->count; i++)
		if (strlen(t->cells[i]) > width[i % t->columns])
			width[i % t->columns] = strlen(t->cells[i]);
	for (size_t row = 0; row <= t->count / t->columns; row++) {
		const char *const *cells =
		    row ? (const char *const *)t->cells + (row - 1) * t->columns : t->headers;
		size_t end = t->columns; /* trailing empty cells are not padded */

		while (end > 1 && !*cells[end - 1])
			end--;
		for (size_t c = 0; c < end; c++)
			printf(t->align[c] == 'r' ? "%*s%s" : "%-*s%s",
			       c + 1 == end ? 0 : (int)width[c], cells[c],
			       c + 1 == end ? "\n" : "  ");
	}
	return 0;
}

static void table_free(struct table *t)
{
	for (size_t i = 0; i < t->count; i++)
		free(t->cells[i]);
	free(t->cells);
}

/* ---- The control connection. ---- */

static int ctl_connect(struct ctl *c, const char *path)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	int err;

	c->path = path;
	if (strlen(path) >= sizeof(addr.sun_path)) {
		fprintf(stderr, PROGRAM ": control socket path too long: %s\n", path);
		return -ENAMETOOLONG;
	}
	strcpy(addr.sun_path, path);
	c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->fd < 0)
		goto failed;
	if (connect(c->fd, (struct sockaddr *)&addr, sizeof(addr)) == 0)
		return 0;
failed:
	err = -errno;
	fprintf(stderr, PROGRAM ": cannot connect to the control socket %s: %s%s\n", path,
		strerror(-err),
		err == -ENOENT || err == -ECONNREFUSED ? " (is nbdcached running with --control?)"
		: err == -EACCES		       ? " (it is root's unless loosened)"
						       : "");
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	return err;
}

static void ctl_close(struct ctl *c)
{
	if (c->fd >= 0)
		close(c->fd);
	free(c->buffer);
	*c = (struct ctl)CTL_INIT;
}

/* Send one request line; takes the request (NULL: allocation failed). */
static int ctl_send(struct ctl *c, json_object *request)
{
	const char *text =
	    request ? json_object_to_json_string_ext(request, JSON_C_TO_STRING_PLAIN |
								  JSON_C_TO_STRING_NOSLASHESCAPE)
		    : NULL;
	size_t length = text ? strlen(text) : 0, done = 0;
	char *line = text ? malloc(length + 1) : NULL;

	if (line) {
		memcpy(line, text, length);
		line[length++] = '\n';
	}
	json_object_put(request);
	if (!line) {
		fprintf(stderr, PROGRAM ": %s\n", strerror(ENOMEM));
		return -ENOMEM;
	}
	/* The daemon would close the connection on a longer one. */
	if (length > NBDCACHED_CONTROL_MAX_REQUEST) {
		fprintf(stderr, PROGRAM ": request longer than %d bytes\n",
			NBDCACHED_CONTROL_MAX_REQUEST);
		free(line);
		return -EMSGSIZE;
	}
	while (done < length) {
		ssize_t n = send(c->fd, line + done, length - done, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int err = -errno;
			fprintf(stderr, PROGRAM ": %s: %s\n", c->path, strerror(-err));
			free(line);
			return err;
		}
		done += (size_t)n;
	}
	free(line);
	return 0;
}

/* The next line from the daemon into c->line, blocking until it is whole. */
static int ctl_read_line(struct ctl *c)
{
	char *newline;

	if (c->line) { /* drop the line handed out last time */
		memmove(c->buffer, c->buffer + c->line_size, c->length - c->line_size);
		c->length -= c->line_size;
		c->line = NULL;
	}
	while (!(newline = c->length ? memchr(c->buffer, '\n', c->length) : NULL)) {
		ssize_t n;
		if (c->length == c->capacity) {
			size_t capacity = c->capacity ? 2 * c->capacity : 65536;
			char *buffer = capacity <= REPLY_MAX ? realloc(c->buffer, capacity) : NULL;
			if (!buffer) {
				fprintf(stderr, PROGRAM ": %s: reply longer than %u bytes\n",
					c->path, REPLY_MAX);
				return -EMSGSIZE;
			}
			c->buffer = buffer;
			c->capacity = capacity;
		}
		n = read(c->fd, c->buffer + c->length, c->capacity - c->length);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			int err = n < 0 ? -errno : -ECONNRESET;
			fprintf(stderr, PROGRAM ": %s: %s\n", c->path,
				n < 0 ? strerror(-err) : "the daemon closed the connection");
			return err;
		}
		c->length += (size_t)n;
	}
	*newline = '\0';
	c->line = c->buffer;
	c->line_size = (size_t)(newline - c->buffer) + 1;
	return 0;
}

/* One reply: an object with a boolean "ok". *reply is the caller's to put. */
static int ctl_receive(struct ctl *c, json_object **reply)
{
	enum json_tokener_error jerr;
	int err = ctl_read_line(c);

	if (err)
		return err;
	*reply = json_tokener_parse_verbose(c->line, &jerr);
	if (*reply && json_object_is_type(*reply, json_type_object) &&
	    json_object_is_type(field(*reply, "ok"), json_type_boolean))
		return 0;
	fprintf(stderr, PROGRAM ": %s: malformed reply (%s): %.200s\n", c->path,
		*reply ? "not an object with a boolean \"ok\"" : json_tokener_error_desc(jerr),
		c->line);
	json_object_put(*reply);
	*reply = NULL;
	return -EPROTO;
}

/* 0 for ok=true; for ok=false the daemon's message on stderr and -EREMOTEIO. */
static int reply_status(json_object *reply)
{
	const char *error = get_string(reply, "error");

	if (get_bool(reply, "ok"))
		return 0;
	fprintf(stderr, PROGRAM ": %s\n", error ? error : "the daemon refused (no message)");
	return -EREMOTEIO;
}

/* {"command": NAME, KEY: ARG...}: the positional ARGS in the command's fields. */
static json_object *build_request(const char *name, const char *const *keys, char **args, int nargs)
{
	json_object *request = json_object_new_object();

	if (!request)
		return NULL;
	json_object_object_add(request, "command", json_object_new_string(name));
	for (int i = 0; i < nargs && i < 2 && keys[i]; i++)
		json_object_object_add(request, keys[i], json_object_new_string(args[i]));
	return request;
}

/*
 * Send one request, read its reply. 0 when the daemon said ok; -EREMOTEIO
 * when it refused (message printed, *reply still set for --json); other
 * errors leave *reply NULL.
 */
static int ctl_call(struct ctl *c, json_object *request, json_object **reply)
{
	int err = ctl_send(c, request);

	*reply = NULL;
	if (!err)
		err = ctl_receive(c, reply);
	return err ? err : reply_status(*reply);
}

/* ---- One-request commands: what people see. ---- */

/* HOST:PORT, an IPv6 HOST in brackets. */
static void print_address(json_object *entry)
{
	const char *address = get_string(entry, "address");

	address = address ? address : "?";
	printf(strchr(address, ':') ? "[%s]:%" PRId64 : "%s:%" PRId64, address,
	       get_int(entry, "port"));
}

static void print_listen(json_object *entry)
{
	const char *type = get_string(entry, "type"), *path = get_string(entry, "path");

	type = type ? type : "?";
	if (strcmp(type, "unix") == 0) {
		printf("unix %s", path ? path : "?");
	} else if (strcmp(type, "tcp") == 0) {
		printf("tcp ");
		print_address(entry);
	} else if (strcmp(type, "fd") == 0) {
		printf("fd %" PRId64, get_int(entry, "fd"));
		if (get_string(entry, "address")) {
			printf(" (tcp ");
			print_address(entry);
			putchar(')');
		}
	} else {
		printf("%s", type);
	}
}

static void print_status(json_object *r)
{
	int64_t cache = get_int(r, "cache_bytes");

	printf("nbdcached %s, pid %" PRId64 ", up %s\n",
	       get_string(r, "version") ? get_string(r, "version") : "?", get_int(r, "pid"),
	       format_duration((char[32]){0}, 32, get_int(r, "uptime_ms")));
	printf("config       %s\n", get_string(r, "config") ? get_string(r, "config") : "(none)");
	printf("listening    ");
	for (size_t i = 0; i < array_length(r, "listen"); i++) {
		fputs(i ? ", " : "", stdout);
		print_listen(array_item(r, "listen", i));
	}
	printf("%s\n", array_length(r, "listen") ? "" : "(nothing)");
	printf("exports      %" PRId64, get_int(r, "exports"));
	if (get_int(r, "removed_backends"))
		printf(" (+%" PRId64 " removed, finishing)", get_int(r, "removed_backends"));
	printf("\n");
	printf("connections  %" PRId64 "\n", get_int(r, "connections"));
	printf("threads      %" PRId64 "\n", get_int(r, "threads"));
	printf("arena        %s\n", get_string(r, "arena") ? get_string(r, "arena") : "?");
	printf("cache        %s\n", SIZE(cache));
	printf("used         %s (%s)\n", SIZE(get_int(r, "used_bytes")),
	       SHARE(get_int(r, "used_bytes"), cache));
	printf("dirty        %s (%s)\n", SIZE(get_int(r, "dirty_bytes")),
	       SHARE(get_int(r, "dirty_bytes"), cache));
}

static void print_exports(json_object *r)
{
	static const char *const headers[] = {"NAME",	"KIND",	   "SIZE",	 "BLOCK",
					      "MODE",	"ACCESS",  "CONNS",	 "DIRTY",
					      "SEQCUT", "BACKEND", "DESCRIPTION"};
	struct table t = {
	    .columns = ARRAY_SIZE(headers), .headers = headers, .align = "llrrllrrrll"};

	for (size_t i = 0; i < array_length(r, "exports"); i++) {
		json_object *e = array_item(r, "exports", i);
		const char *s;
		table_cell(&t, "%s", (s = get_string(e, "name")) ? s : "?");
		table_cell(&t, "%s", (s = get_string(e, "kind")) ? s : "?");
		table_cell(&t, "%s", SIZE(get_int(e, "size")));
		table_cell(&t, "%" PRId64, get_int(e, "block_size"));
		table_cell(&t, "%s", (s = get_string(e, "cache_mode")) ? s : "?");
		table_cell(&t, "%s", get_bool(e, "readonly") ? "ro" : "rw");
		if (get_int(e, "max_connections"))
			table_cell(&t, "%" PRId64 "/%" PRId64, get_int(e, "connections"),
				   get_int(e, "max_connections"));
		else
			table_cell(&t, "%" PRId64, get_int(e, "connections"));
		table_cell(&t, "%" PRId64 "%%-%" PRId64 "%%", get_int(e, "dirty_low"),
			   get_int(e, "dirty_high"));
		table_cell(&t, "%s",
			   get_int(e, "seq_cutoff") ? SIZE(get_int(e, "seq_cutoff")) : "off");
		table_cell(&t, "%s", (s = get_string(e, "backend")) ? s : "?");
		table_cell(&t, "%s", (s = get_string(e, "description")) ? s : "");
	}
	table_print(&t);
	table_free(&t);
}

static void print_stats(json_object *r)
{
	static const char *const headers[] = {"EXPORT",	 "CONNS",     "HITS",	    "MISSES",
					      "PARTIAL", "HIT%",      "DIRTY",	    "BE-READS",
					      "BE-READ", "BE-WRITES", "BE-WRITTEN", "WRITTEN-BACK",
					      "WB-RATE", "EVICTIONS", "WB-ERRORS"};
	struct table t = {
	    .columns = ARRAY_SIZE(headers), .headers = headers, .align = "lrrrrrrrrrrrrrr"};
	json_object *c = field(r, "cache"), *arena = field(c, "arena");
	int64_t cache = get_int(c, "cache_bytes"), free_bytes = get_int(arena, "free_bytes");

	printf("cache        %s, used %s (%s), dirty %s (%s), %" PRId64 " entries, metadata %s\n",
	       SIZE(cache), SIZE(get_int(c, "used_bytes")), SHARE(get_int(c, "used_bytes"), cache),
	       SIZE(get_int(c, "dirty_bytes")), SHARE(get_int(c, "dirty_bytes"), cache),
	       get_int(c, "entries"), SIZE(get_int(c, "metadata_bytes")));
	printf("reads        %" PRId64 " hits, %" PRId64 " misses, %" PRId64
	       " partial hits, hit ratio %s\n",
	       get_int(c, "hits"), get_int(c, "misses"), get_int(c, "partial_hits"),
	       PERCENT(get_double(c, "hit_ratio")));
	printf("backend      %" PRId64 " reads (%s), %" PRId64 " writes (%s)\n",
	       get_int(c, "backend_reads"), SIZE(get_int(c, "backend_read_bytes")),
	       get_int(c, "backend_writes"), SIZE(get_int(c, "backend_write_bytes")));
	printf("writeback    %s written back, %s/s, %" PRId64 " errors\n",
	       SIZE(get_int(c, "writeback_bytes")), SIZE(get_int(c, "writeback_rate")),
	       get_int(c, "writeback_errors"));
	printf("durability   %s unstable (written, not flushed), %" PRId64 " backend flushes, %" PRId64
	       " failed, %" PRId64 " losses\n",
	       SIZE(get_int(c, "unstable_bytes")), get_int(c, "backend_flushes"),
	       get_int(c, "backend_flush_errors"), get_int(c, "losses"));
	printf("other        %" PRId64 " evictions, %" PRId64 " bypassed reads, %" PRId64
	       " direct writes\n",
	       get_int(c, "evictions"), get_int(c, "bypass_reads"), get_int(c, "direct_writes"));
	printf("arena        %s, %s free, fragmentation %s\n",
	       get_string(arena, "kind") ? get_string(arena, "kind") : "?", SIZE(free_bytes),
	       PERCENT(get_double(arena, "fragmentation")));
	printf("free by size");
	for (size_t k = 0; k < array_length(arena, "free_bytes_by_order"); k++)
		printf(" %u%c:%s", k < 8 ? 4u << k : 1u << (k - 8), k < 8 ? 'K' : 'M',
		       SIZE(json_object_get_int64(array_item(arena, "free_bytes_by_order", k))));
	printf("\n\n");
	for (size_t i = 0; i < array_length(r, "exports"); i++) {
		json_object *e = array_item(r, "exports", i);
		table_cell(&t, "%s", get_string(e, "name") ? get_string(e, "name") : "?");
		table_cell(&t, "%" PRId64, get_int(e, "connections"));
		table_cell(&t, "%" PRId64, get_int(e, "hits"));
		table_cell(&t, "%" PRId64, get_int(e, "misses"));
		table_cell(&t, "%" PRId64, get_int(e, "partial_hits"));
		table_cell(&t, "%s", PERCENT(get_double(e, "hit_ratio")));
		table_cell(&t, "%s", SIZE(get_int(e, "dirty_bytes")));
		table_cell(&t, "%" PRId64, get_int(e, "backend_reads"));
		table_cell(&t, "%s", SIZE(get_int(e, "backend_read_bytes")));
		table_cell(&t, "%" PRId64, get_int(e, "backend_writes"));
		table_cell(&t, "%s", SIZE(get_int(e, "backend_write_bytes")));
		table_cell(&t, "%s", SIZE(get_int(e, "writeback_bytes")));
		table_cell(&t, "%s/s", SIZE(get_int(e, "writeback_rate")));
		table_cell(&t, "%" PRId64, get_int(e, "evictions"));
		table_cell(&t, "%" PRId64, get_int(e, "writeback_errors"));
	}
	table_print(&t);
	table_free(&t);
}

static void print_drop_clean(json_object *r)
{
	printf("%s: dropped %s of clean cache, %s still cached\n",
	       get_string(r, "export") ? get_string(r, "export") : "?",
	       SIZE(get_int(r, "dropped_bytes")), SIZE(get_int(r, "kept_bytes")));
}

static void print_compact(json_object *r)
{
	printf("moved %" PRId64 " entries, skipped %" PRId64 " pinned, collapsed %" PRId64
	       ", freed %" PRId64 " chunks of 2 MiB, in %.1f ms\n",
	       get_int(r, "moved"), get_int(r, "skipped_pinned"), get_int(r, "collapsed"),
	       get_int(r, "freed_2m_chunks"), (double)get_int(r, "time_ns") / 1e6);
	printf("fragmentation %s -> %s\n", PERCENT(get_double(r, "fragmentation_before")),
	       PERCENT(get_double(r, "fragmentation_after")));
}

static void print_set_mode(json_object *r)
{
	printf("%s: %s -> %s\n", get_string(r, "export") ? get_string(r, "export") : "?",
	       get_string(r, "previous") ? get_string(r, "previous") : "?",
	       get_string(r, "mode") ? get_string(r, "mode") : "?");
}

static void print_names(const char *label, json_object *r, const char *key)
{
	printf("%-17s", label);
	for (size_t i = 0; i < array_length(r, key); i++) {
		json_object *v = array_item(r, key, i);
		printf("%s%s", i ? ", " : "",
		       json_object_is_type(v, json_type_string) ? json_object_get_string(v) : "?");
	}
	printf("%s\n", array_length(r, key) ? "" : "-");
}

static void print_reload(json_object *r)
{
	print_names("added", r, "added");
	print_names("changed", r, "changed");
	print_names("removed", r, "removed");
	print_names("refused", r, "refused");
	print_names("needs a restart", r, "refused_settings");
}

/* A command of one request: the reply as received (--json) or for people. */
static int run_simple(const struct options *o)
{
	struct ctl c = CTL_INIT;
	json_object *reply = NULL;
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c,
			       build_request(o->command->name, o->command->keys, o->args, o->nargs),
			       &reply);
	if (reply && o->json)
		puts(c.line);
	else if (!err)
		o->command->print(reply);
	json_object_put(reply);
	ctl_close(&c);
	return err;
}

/* ---- flush: the request on one connection, progress from another. ---- */

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

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
	return ctl_send(c, build_request("stats", o->command->keys, o->args, 1)) == 0;
}

/* The export's dirty bytes from the reply; false (silently) when refused. */
static bool progress_reply(struct ctl *c, int64_t *dirty)
{
	json_object *sample = NULL;
	bool ok = ctl_receive(c, &sample) == 0 && get_bool(sample, "ok") &&
		  array_length(sample, "exports") == 1;

	if (ok)
		*dirty = get_int(array_item(sample, "exports", 0), "dirty_bytes");
	json_object_put(sample);
	return ok;
}

static int run_flush(const struct options *o)
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
		err = ctl_send(&flush, build_request("flush", o->command->keys, o->args, 1));
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
		err = reply_status(reply);
	if (reply && o->json)
		puts(flush.line);
	else if (!err)
		printf("flushed %s in %.1f s\n", SIZE(get_int(reply, "flushed_bytes")),
		       now_s() - start);
	json_object_put(reply);
	ctl_close(&progress);
	ctl_close(&flush);
	return err;
}

/* ---- top: rates from two samples of stats. ---- */

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
		d[i] = (double)(get_int(after, counters[i]) - get_int(before, counters[i]));
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

	json_object_object_add(out, "time_ms", json_object_new_int64(get_int(after, "time_ms")));
	json_object_object_add(out, "interval_ms",
			       json_object_new_int64((int64_t)(seconds * 1000 + 0.5)));
	json_object_object_add(out, "exports", exports);
	for (size_t i = 0; i < array_length(after, "exports"); i++) {
		json_object *e = array_item(after, "exports", i), *x = json_object_new_object();
		const char *name = get_string(e, "name");
		struct rates r =
		    export_rates(name ? find_named(before, "exports", name) : NULL, e, seconds);

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
				       json_object_new_int64(get_int(e, "dirty_bytes")));
		json_object_object_add(x, "connections",
				       json_object_new_int64(get_int(e, "connections")));
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
	json_object *c = field(after, "cache");
	int64_t cache = get_int(c, "cache_bytes");

	if (tty)
		fputs("\033[H\033[2J", stdout);
	printf("nbdcached: cache %s, used %s (%s), dirty %s (%s); rates over %.1f s\n", SIZE(cache),
	       SIZE(get_int(c, "used_bytes")), SHARE(get_int(c, "used_bytes"), cache),
	       SIZE(get_int(c, "dirty_bytes")), SHARE(get_int(c, "dirty_bytes"), cache), seconds);
	for (size_t i = 0; i < array_length(after, "exports"); i++) {
		json_object *e = array_item(after, "exports", i);
		const char *name = get_string(e, "name");
		struct rates r =
		    export_rates(name ? find_named(before, "exports", name) : NULL, e, seconds);

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
		table_cell(&t, "%s", SIZE(get_int(e, "dirty_bytes")));
		table_cell(&t, "%" PRId64, get_int(e, "connections"));
	}
	table_print(&t);
	table_free(&t);
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

static int run_top(const struct options *o)
{
	static const char *const keys[2] = {NULL};
	struct ctl c = CTL_INIT;
	json_object *before = NULL, *after = NULL;
	bool tty = !o->json && isatty(STDOUT_FILENO);
	double start = now_s();
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, build_request("stats", keys, NULL, 0), &before);
	for (long i = 0; !err && (o->count == 0 || i < o->count); i++) {
		double seconds;

		sleep_until(start + (double)(i + 1) * o->interval);
		err = ctl_call(&c, build_request("stats", keys, NULL, 0), &after);
		if (err)
			break;
		seconds = (double)(get_int(after, "time_ms") - get_int(before, "time_ms")) / 1000;
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

/* ---- attach: the nbd-client command line for an export. ---- */

/* Print `s` so that a POSIX shell reads it back as one word. */
static void print_shell_word(const char *s)
{
	if (*s && strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
			    "0123456789_@%+=:,./-") == strlen(s)) {
		fputs(s, stdout);
		return;
	}
	putchar('\'');
	for (; *s; s++)
		fputs(*s == '\'' ? "'\\''" : (char[2]){*s, 0}, stdout);
	putchar('\'');
}

/* A wildcard listen address reached from this host: its loopback. */
static const char *local_address(const char *address)
{
	if (strcmp(address, "0.0.0.0") == 0)
		return "127.0.0.1";
	if (strcmp(address, "::") == 0)
		return "::1";
	return address;
}

/*
 * The daemon's socket nbd-client should use: a Unix one when there is any,
 * else the first TCP one (a socket-activated fd counts when it is TCP).
 */
static int pick_listen(json_object *status, const char **unix_path, const char **host,
		       int64_t *port)
{
	*unix_path = *host = NULL;
	for (size_t i = 0; i < array_length(status, "listen"); i++) {
		json_object *l = array_item(status, "listen", i);
		const char *type = get_string(l, "type");

		if (!type)
			continue;
		if (strcmp(type, "unix") == 0 && get_string(l, "path")) {
			*unix_path = get_string(l, "path");
			return 0;
		}
		if (!*host && strcmp(type, "unix") != 0 && get_string(l, "address")) {
			*host = local_address(get_string(l, "address"));
			*port = get_int(l, "port");
		}
	}
	return *host ? 0 : -ENOENT;
}

static int run_attach(const struct options *o)
{
	static const char *const none[2] = {NULL};
	const char *name = o->args[0], *device = o->nargs > 1 ? o->args[1] : "/dev/nbd0";
	const char *unix_path, *host, *argv[16];
	char port[24], block[24], connections[24];
	struct ctl c = CTL_INIT;
	json_object *status = NULL, *exports = NULL, *export, *out;
	int64_t block_size, port_number = 0, conns = ATTACH_CONNECTIONS;
	size_t n = 0;
	int err = ctl_connect(&c, o->control);

	if (!err)
		err = ctl_call(&c, build_request("status", none, NULL, 0), &status);
	if (!err)
		err = ctl_call(&c, build_request("exports", none, NULL, 0), &exports);
	if (err)
		goto cleanup;
	export = find_named(exports, "exports", name);
	if (!export) {
		fprintf(stderr, PROGRAM ": no export named %s\n", name);
		err = -ENOENT;
		goto cleanup;
	}
	if (pick_listen(status, &unix_path, &host, &port_number) != 0) {
		fprintf(stderr, PROGRAM ": the daemon listens on no Unix or TCP socket\n");
		err = -ENOENT;
		goto cleanup;
	}
	argv[n++] = "nbd-client";
	if (unix_path) {
		argv[n++] = "-unix";
		argv[n++] = unix_path;
	} else {
		snprintf(port, sizeof(port), "%" PRId64, port_number);
		argv[n++] = host;
		argv[n++] = port;
	}
	argv[n++] = device;
	argv[n++] = "-N";
	argv[n++] = name;
	/* nbd-client takes 512..4096; the daemon serves any alignment from 1 byte. */
	block_size = get_int(export, "block_size");
	block_size = block_size > NBD_CLIENT_MAX_BLOCK ? NBD_CLIENT_MAX_BLOCK
		     : block_size < 512		       ? 512
						       : block_size;
	snprintf(block, sizeof(block), "%" PRId64, block_size);
	argv[n++] = "-b";
	argv[n++] = block;
	if (get_int(export, "max_connections") > 0 && get_int(export, "max_connections") < conns)
		conns = get_int(export, "max_connections");
	snprintf(connections, sizeof(connections), "%" PRId64, conns);
	argv[n++] = "-C";
	argv[n++] = connections;
	if (get_bool(export, "readonly"))
		argv[n++] = "-readonly";
	argv[n] = NULL;

	if (o->run) {
		fflush(stdout);
		execvp(argv[0], (char **)argv);
		err = -errno;
		fprintf(stderr, PROGRAM ": cannot run %s: %s\n", argv[0], strerror(-err));
	} else if (o->json) {
		json_object *words = json_object_new_array();
		out = json_object_new_object();
		json_object_object_add(out, "argv", words);
		for (size_t i = 0; i < n; i++)
			json_object_array_add(words, json_object_new_string(argv[i]));
		puts(json_object_to_json_string_ext(out, JSON_C_TO_STRING_PLAIN |
							     JSON_C_TO_STRING_NOSLASHESCAPE));
		json_object_put(out);
	} else {
		for (size_t i = 0; i < n; i++) {
			fputs(i ? " " : "", stdout);
			print_shell_word(argv[i]);
		}
		putchar('\n');
	}
cleanup:
	json_object_put(exports);
	json_object_put(status);
	ctl_close(&c);
	return err;
}

/* ---- Command line. ---- */

static const struct command commands[] = {
    {"status", {NULL}, 0, 0, print_status, run_simple},
    {"exports", {NULL}, 0, 0, print_exports, run_simple},
    {"stats", {"export"}, 0, 1, print_stats, run_simple},
    {"flush", {"export"}, 1, 1, NULL, run_flush},
    {"drop-clean", {"export"}, 1, 1, print_drop_clean, run_simple},
    {"compact", {NULL}, 0, 0, print_compact, run_simple},
    {"set-mode", {"export", "mode"}, 2, 2, print_set_mode, run_simple},
    {"reload", {NULL}, 0, 0, print_reload, run_simple},
    {"top", {NULL}, 0, 0, NULL, run_top},
    {"attach", {NULL}, 1, 2, NULL, run_attach},
};

static void usage(FILE *f)
{
	fputs("usage: " PROGRAM " [--control PATH] [--json] COMMAND [ARGS]\n"
	      "commands: status | exports | stats [EXPORT] | flush EXPORT\n"
	      "          | drop-clean EXPORT | compact | set-mode EXPORT MODE | reload\n"
	      "          | top [--count N] [--interval SECONDS]\n"
	      "          | attach EXPORT [DEVICE] [--run]\n"
	      "default control socket: " NBDCACHED_CONTROL_DEFAULT "\n"
	      "exit status: 0 success, 1 the daemon refused or could not be reached, 2 usage\n",
	      f);
}

/* 0, 1 after --help, or -EINVAL after printing why. */
static int parse_args(int argc, char **argv, struct options *o)
{
	static const struct option options[] = {{"control", required_argument, NULL, 'c'},
						{"json", no_argument, NULL, 'j'},
						{"count", required_argument, NULL, 'n'},
						{"interval", required_argument, NULL, 'i'},
						{"run", no_argument, NULL, 'r'},
						{"help", no_argument, NULL, 'h'},
						{NULL, 0, NULL, 0}};
	char *end;
	int opt;

	*o = (struct options){.control = NBDCACHED_CONTROL_DEFAULT, .interval = 1};
	while ((opt = getopt_long(argc, argv, "c:jh", options, NULL)) != -1) {
		switch (opt) {
		case 'c':
			o->control = optarg;
			break;
		case 'j':
			o->json = true;
			break;
		case 'n':
			errno = 0;
			o->count = strtol(optarg, &end, 10);
			o->top_options = true;
			if (errno || *end || end == optarg || o->count < 0) {
				fprintf(stderr, PROGRAM ": --count: not a count: %s\n", optarg);
				return -EINVAL;
			}
			break;
		case 'i':
			o->interval = strtod(optarg, &end);
			o->top_options = true;
			if (*end || end == optarg ||
			    !(o->interval >= 0.01 && o->interval <= 86400)) {
				fprintf(stderr, PROGRAM ": --interval: 0.01 to 86400 seconds: %s\n",
					optarg);
				return -EINVAL;
			}
			break;
		case 'r':
			o->run = true;
			break;
		case 'h':
			usage(stdout);
			return 1;
		default:
			return -EINVAL;
		}
	}
	if (optind >= argc) {
		fputs(PROGRAM ": no COMMAND\n", stderr);
		return -EINVAL;
	}
	for (size_t i = 0; i < ARRAY_SIZE(commands); i++)
		if (strcmp(commands[i].name, argv[optind]) == 0)
			o->command = &commands[i];
	if (!o->command) {
		fprintf(stderr, PROGRAM ": unknown command %s\n", argv[optind]);
		return -EINVAL;
	}
	o->args = argv + optind + 1;
	o->nargs = argc - optind - 1;
	if (o->nargs < o->command->min_args || o->nargs > o->command->max_args) {
		fprintf(stderr, PROGRAM ": %s: wrong number of arguments\n", o->command->name);
		return -EINVAL;
	}
	if ((o->top_options && o->command->run != run_top) ||
	    (o->run && o->command->run != run_attach)) {
		fprintf(stderr, PROGRAM ": %s: option not valid with this command\n",
			o->command->name);
		return -EINVAL;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct options o;
	int err = parse_args(argc, argv, &o);

	if (err) {
		if (err < 0)
			fputs("Try '" PROGRAM " --help'.\n", stderr);
		return err < 0 ? 2 : 0;
	}
	signal(SIGPIPE, SIG_IGN);
	err = o.command->run(&o);
	if (fflush(stdout) != 0 && !err) {
		fprintf(stderr, PROGRAM ": standard output: %s\n", strerror(errno));
		err = -EIO;
	}
	return err ? 1 : 0;
}
