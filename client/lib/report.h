/*
 * client/lib/report.h: how the client programs talk to people on stderr.
 *
 * Owns: the program name every message starts with ("nbdcachectl: ...",
 * "nbdcache-io: ..."), set once by main() before anything is reported, so
 * that the library's messages read as the program's own.
 *
 * Locking: none; the client programs are single-threaded.
 */
#ifndef CLIENT_LIB_REPORT_H
#define CLIENT_LIB_REPORT_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* The name messages start with; `name` must outlive every report. */
void report_set_program(const char *name);

/* The name set, for a message written in pieces. */
const char *report_program(void);

/* One line on stderr: "PROGRAM: " PREFIX MESSAGE "\n". */
void report_v(const char *prefix, const char *fmt, va_list ap);
__attribute__((format(printf, 1, 2))) void report(const char *fmt, ...);

/*
 * Write a peer-supplied string on one line, a '?' for every byte that is
 * not printable: a server's name or message never moves the terminal.
 */
void print_safe(FILE *f, const void *s, size_t length);

#endif
