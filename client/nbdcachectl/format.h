/*
 * client/nbdcachectl/format.h: numbers for people (binary sizes,
 * percentages, durations) and tables printed with aligned columns.
 *
 * The format_* functions write into the caller's buffer and return it; the
 * SIZE, PERCENT and SHARE macros give each use its own compound-literal
 * buffer, so several fit in one printf.
 *
 * Locking: none; nbdcachectl is single-threaded.
 */
#ifndef CLIENT_NBDCACHECTL_FORMAT_H
#define CLIENT_NBDCACHECTL_FORMAT_H

#include <stddef.h>
#include <stdint.h>

/* "512 B", "1.5 GiB": binary units, one decimal above bytes. */
const char *format_size(char *buf, size_t size, double bytes);
const char *format_percent(char *buf, size_t size, double ratio);
/* part / whole as a percentage; "-" when whole is 0. */
const char *format_share(char *buf, size_t size, double part, double whole);
/* "3d 04:05:06" or "04:05:06". */
const char *format_duration(char *buf, size_t size, int64_t ms);

/* "850.0 us", "5.24 ms", "1.50 s"; "-" for 0 (no value). */
const char *format_latency(char *buf, size_t size, int64_t ns);

#define LATENCY(ns) format_latency((char[24]){0}, 24, (ns))
#define SIZE(x) format_size((char[24]){0}, 24, (double)(x))
#define PERCENT(x) format_percent((char[16]){0}, 16, (x))
#define SHARE(part, whole) format_share((char[16]){0}, 16, (double)(part), (double)(whole))

/*
 * A table printed with aligned columns: headers, then one cell per column
 * and row, each column left-aligned ('l') or right-aligned ('r'). A cell
 * that cannot be allocated is remembered and reported by table_print.
 * Trailing empty cells of a row are not padded.
 */
/* The most columns a table has (table_print's widths). */
#define TABLE_MAX_COLUMNS 32

struct table {
	size_t columns;
	const char *const *headers;
	const char *align;
	char **cells;
	size_t count, capacity;
	int err;
};

__attribute__((format(printf, 2, 3))) void table_cell(struct table *t, const char *fmt, ...);
/* 0, or the first allocation failure (reported here) as -ENOMEM. */
int table_print(const struct table *t);
void table_free(struct table *t);

#endif
