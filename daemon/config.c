/*
 * daemon/config.c: see config.h; the keys are config_keys.c's.
 *
 * inih does the INI syntax; config_keys.c knows the keys. inih's handler does
 * not get line numbers in Debian's build, so the file is fed through our
 * own line reader, which counts lines: the handler then knows where it is,
 * and every error message starts with FILE:LINE. The first error wins;
 * inih keeps reading, later errors are dropped. Then merge() gives the
 * command line what the file set and the command line did not.
 */
#include "daemon/config.h"
#include "daemon/config_internal.h"
#include "daemon/settings.h"

#include <errno.h>
#include <ini.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CONFIG_MAX_LINE 8192

int config_fail(struct config_ctx *x, const char *fmt, ...)
{
	if (x->rc == 0) {
		int n = snprintf(x->err, x->errlen, "%s:%u: ", x->path, x->line);
		va_list ap;
		va_start(ap, fmt);
		if (n >= 0 && (size_t)n < x->errlen)
			vsnprintf(x->err + n, x->errlen - (size_t)n, fmt, ap);
		va_end(ap);
		x->rc = -EINVAL;
	}
	return 0;
}

/*
 * inih's reader: one line per call, counted. inih's line buffer is small
 * (200 bytes in Debian's build) and a backend URI or a description may be
 * longer, so a longer "key = value" line reaches inih as "key = \x1f" and
 * the handler takes the value kept here (long_value) instead.
 */
static char *read_line(char *str, int num, void *stream)
{
	struct config_ctx *x = stream;
	ssize_t n = getline(&x->buf, &x->bufsize, x->stream);
	if (n < 0)
		return NULL;
	x->line++;
	char *l = x->buf;
	size_t lead = strspn(l, " \t");
	if (l[lead] == '[') {
		x->section_line = x->line;
		/* inih keeps 50 bytes of a section name: a longer one reaches it
		 * as "[\x1f]" and the handler takes the name kept here. */
		char *close = strchr(l + lead, ']');
		size_t len = close ? (size_t)(close - l - lead - 1) : 0;
		if (close && len >= 40 && n <= CONFIG_MAX_LINE) {
			free(x->long_section);
			x->long_section = strndup(l + lead + 1, len);
			snprintf(str, (size_t)num, "[\x1f]\n");
			return str;
		}
	}
	if (n < num - 1) {
		memcpy(str, l, (size_t)n + 1);
		return str;
	}
	char *eq = strpbrk(l, "=:");
	size_t name_len = eq ? (size_t)(eq - l) : 0;
	if (n > CONFIG_MAX_LINE || !eq || name_len + 8 > (size_t)num || strchr(";#", l[lead])) {
		if (strchr(";#", l[lead]) && n <= CONFIG_MAX_LINE) {
			str[0] = '\0'; /* a long comment */
			return str;
		}
		if (x->rc == 0) {
			if (n > CONFIG_MAX_LINE)
				snprintf(x->err, x->errlen, "%s:%u: line longer than %d bytes",
					 x->path, x->line, CONFIG_MAX_LINE);
			else if (!eq)
				snprintf(x->err, x->errlen,
					 "%s:%u: syntax error: expected [section], "
					 "key = value or a comment",
					 x->path, x->line);
			else
				snprintf(x->err, x->errlen, "%s:%u: key name longer than %d bytes",
					 x->path, x->line, num - 8);
			x->rc = -EINVAL;
		}
		str[0] = '\0';
		return str;
	}
	char *v = eq + 1;
	v += strspn(v, " \t");
	size_t vn = strlen(v);
	while (vn && strchr(" \t\r\n", v[vn - 1]))
		vn--;
	free(x->long_value);
	x->long_value = strndup(v, vn);
	snprintf(str, (size_t)num, "%.*s= \x1f\n", (int)name_len, l);
	return str;
}

/* "cache_size" and "cache-size" are the same key. */
/* The file's settings go where the command line said nothing. */
static int merge(struct config_ctx *x)
{
	struct options *o = x->opts, *f = &x->file;
	uint64_t take = x->set & ~o->given;
	if (x->listenaddr || x->port) {
		char spec[300];
		const char *addr = x->listenaddr ? x->listenaddr : "";
		bool v6 = strchr(addr, ':') != NULL;
		snprintf(spec, sizeof(spec), "%s%s%s:%s", v6 ? "[" : "", addr, v6 ? "]" : "",
			 x->port ? x->port : "10809");
		if (options_push_string(&f->listen, &f->listen_count, spec) < 0)
			return -ENOMEM;
		take |= OPT_GIVEN_LISTEN & ~o->given;
	}
	if (take & OPT_GIVEN_LISTEN) {
		o->listen_from_config = true;
		for (size_t i = 0; i < f->listen_count; i++)
			if (options_push_string(&o->listen, &o->listen_count, f->listen[i]) < 0)
				return -ENOMEM;
		for (size_t i = 0; i < f->unix_count; i++)
			if (options_push_string(&o->unix_paths, &o->unix_count, f->unix_paths[i]) <
			    0)
				return -ENOMEM;
	}
#define TAKE(bit, field)                                                                           \
	do {                                                                                       \
		if (take & (bit))                                                                  \
			o->field = f->field;                                                       \
	} while (0)
#define TAKE_STRING(bit, field)                                                                    \
	do {                                                                                       \
		if (take & (bit)) {                                                                \
			free(o->field);                                                            \
			o->field = f->field;                                                       \
			f->field = NULL;                                                           \
		}                                                                                  \
	} while (0)
	for (size_t i = 0; i < settings_count; i++)
		if (take & settings[i].given)
			settings_take(&settings[i], o, f);
	TAKE_STRING(OPT_GIVEN_ALLOW, access.allow);
	TAKE_STRING(OPT_GIVEN_DENY, access.deny);
	TAKE_STRING(OPT_GIVEN_ALLOW_USERS, access.allow_users);
	TAKE_STRING(OPT_GIVEN_ALLOW_GROUPS, access.allow_groups);
	TAKE_STRING(OPT_GIVEN_ALLOW_IDENTITIES, access.allow_identities);
	TAKE_STRING(OPT_GIVEN_METRICS, metrics);
	TAKE_STRING(OPT_GIVEN_METRICS_ALLOW, metrics_access.allow);
	TAKE_STRING(OPT_GIVEN_METRICS_DENY, metrics_access.deny);
	TAKE(OPT_GIVEN_METRICS_EXPORT_NAMES, metrics_export_names_all);
#undef TAKE
#undef TAKE_STRING
	/* The file's exports first, then the command line's. */
	size_t n = f->export_count + o->export_count;
	struct export_spec *all = calloc(n ? n : 1, sizeof(*all));
	if (!all)
		return -ENOMEM;
	if (f->export_count)
		memcpy(all, f->exports, f->export_count * sizeof(*all));
	if (o->export_count)
		memcpy(all + f->export_count, o->exports, o->export_count * sizeof(*all));
	for (size_t i = f->export_count; i < n; i++)
		for (size_t j = 0; j < f->export_count; j++)
			if (strcmp(all[i].name, all[j].name) == 0) {
				snprintf(x->err, x->errlen,
					 "export '%s' is defined at %s and on the command line",
					 all[i].name, all[j].origin);
				free(all);
				return -EINVAL;
			}
	free(o->exports);
	free(f->exports);
	o->exports = all;
	o->export_count = n;
	f->exports = NULL;
	f->export_count = 0;
	return 0;
}

int config_load(const char *path, struct options *opts, char *err, size_t errlen)
{
	struct config_ctx x = {.path = path, .opts = opts, .err = err, .errlen = errlen};
	options_defaults(&x.file);
	x.stream = fopen(path, "re");
	if (!x.stream) {
		int rc = -errno;
		snprintf(err, errlen, "config %s: %s", path, strerror(-rc));
		return rc == -ENOMEM ? rc : -EINVAL;
	}
	/* A run-time setting in Debian's inih: nbd-server configs indent their
	 * keys, so an indented line is a key, never the continuation of the
	 * line before. */
	ini_allow_multiline = false;
	int line = ini_parse_stream(read_line, &x, config_on_key, &x);
	if (ferror(x.stream) && x.rc == 0) {
		snprintf(err, errlen, "config %s: read error", path);
		x.rc = -EINVAL;
	}
	fclose(x.stream);
	if (x.rc == 0)
		config_finish_export(&x);
	if (x.rc == 0 && line > 0) {
		/* A syntax error inih found itself (the handler said nothing). */
		snprintf(err, errlen,
			 "%s:%d: syntax error: expected [section], key = value or a "
			 "comment",
			 path, line);
		x.rc = -EINVAL;
	}
	if (x.rc == 0 && line < 0) {
		snprintf(err, errlen, "config %s: cannot read it", path);
		x.rc = -EINVAL;
	}
	if (x.rc == 0)
		x.rc = merge(&x);
	if (x.rc == -ENOMEM)
		snprintf(err, errlen, "out of memory");
	free(x.listenaddr);
	free(x.port);
	free(x.buf);
	free(x.long_value);
	free(x.long_section);
	options_free(&x.file);
	return x.rc;
}

int config_options(int argc, char **argv, struct options *out, char *err, size_t errlen)
{
	/* Not options_parse(): it would refuse a command line without an
	 * export before the default config file had a chance to give one. */
	int rc = options_parse_args(argc, argv, out, err, errlen);
	if (rc < 0)
		return rc;
	if (out->help || out->version)
		return 0;
	if (!out->config_path && out->export_count == 0 &&
	    access(OPTIONS_DEFAULT_CONFIG, F_OK) == 0) {
		out->config_path = strdup(OPTIONS_DEFAULT_CONFIG);
		if (!out->config_path) {
			options_free(out);
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
	}
	if (out->config_path)
		rc = config_load(out->config_path, out, err, errlen);
	if (rc == 0)
		rc = options_finish(out, err, errlen);
	if (rc < 0) {
		if (rc == -ENOMEM)
			snprintf(err, errlen, "out of memory");
		options_free(out);
		return rc;
	}
	return 0;
}
