/*
 * client/nbdcachectl/format.c: numbers for people, and aligned tables.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/lib/report.h"
#include "client/nbdcachectl/format.h"
#include "client/nbdcachectl/nbdcachectl.h"

/* "512 B", "1.5 GiB": binary units, one decimal above bytes. */
const char *format_size(char *buf, size_t size, double bytes)
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

const char *format_percent(char *buf, size_t size, double ratio)
{
	snprintf(buf, size, "%.1f%%", 100.0 * ratio);
	return buf;
}

/* part / whole as a percentage; "-" when whole is 0. */
const char *format_share(char *buf, size_t size, double part, double whole)
{
	if (whole <= 0)
		snprintf(buf, size, "-");
	else
		format_percent(buf, size, part / whole);
	return buf;
}

/* "3d 04:05:06" or "04:05:06". */
const char *format_duration(char *buf, size_t size, int64_t ms)
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

const char *format_latency(char *buf, size_t size, int64_t ns)
{
	if (ns <= 0)
		snprintf(buf, size, "-");
	else if (ns < 1000000)
		snprintf(buf, size, "%.1f us", (double)ns / 1e3);
	else if (ns < 1000000000)
		snprintf(buf, size, "%.2f ms", (double)ns / 1e6);
	else
		snprintf(buf, size, "%.2f s", (double)ns / 1e9);
	return buf;
}

void table_cell(struct table *t, const char *fmt, ...)
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

int table_print(const struct table *t)
{
	size_t width[TABLE_MAX_COLUMNS] = {0};

	if (t->err) {
		report("%s", strerror(-t->err));
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

void table_free(struct table *t)
{
	for (size_t i = 0; i < t->count; i++)
		free(t->cells[i]);
	free(t->cells);
}
