/*
 * client/lib/report.c: messages on stderr, prefixed with the program name.
 */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>

#include "client/lib/report.h"

static const char *program = "?";

void report_set_program(const char *name)
{
	program = name;
}

const char *report_program(void)
{
	return program;
}

void report_v(const char *prefix, const char *fmt, va_list ap)
{
	fprintf(stderr, "%s: %s", program, prefix);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
}

void report(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	report_v("", fmt, ap);
	va_end(ap);
}

void print_safe(FILE *f, const void *s, size_t length)
{
	for (size_t i = 0; i < length; i++) {
		int ch = ((const unsigned char *)s)[i];
		fputc(isprint(ch) ? ch : '?', f);
	}
}
