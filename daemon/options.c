/*
 * daemon/options.c: command-line parsing (see options.h).
 *
 * getopt_long does the flag syntax; this file checks each value with the
 * parsers of option_values.c, hands each --export to export_spec.c, and
 * checks the whole (per-export defaults, windows, exports that share a
 * backend, TLS). The one thing it asks of the system is stat(2) of file
 * backends: two paths of one file are one backend.
 */
#include "daemon/options.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/rbd_spec.h"
#include "daemon/settings.h"

#define fail options_fail

const char *options_usage(void)
{
	static char text[8192];
	if (text[0])
		return text;
	size_t at =
	    (size_t)snprintf(text, sizeof(text), "%s",
			     "usage: nbdcached [--config FILE] [--check-config] [--foreground]\n"
			     "                 [--listen HOST:PORT]... [--unix "
			     "PATH[,mode=OCTAL][,group=GROUP]]...\n");
	/* Every setting of the tables (settings.h), as they declare them. */
	at += export_settings_usage(text + at, sizeof(text) - at, 17);
	at += settings_usage(text + at, sizeof(text) - at, 17);
	snprintf(
	    text + at, sizeof(text) - at, "%s",
	    "                 [--allow LIST] [--deny LIST] [--allow-users LIST]\n"
	    "                 [--allow-groups LIST] [--allow-identities IDENTITY]...\n"
	    "                 [--metrics HOST:PORT] [--metrics-allow LIST] [--metrics-deny "
	    "LIST]\n"
	    "                 [--metrics-export-names listed|all]\n"
	    "An --export also takes allow=LIST, deny=LIST, allow-users=LIST,\n"
	    "allow-groups=LIST (its access rules; a LIST runs on over commas),\n"
	    "allow-identities=IDENTITY (one, commas and all) and QoS limits (QOS in\n"
	    "nbdcached(8)).\n"
	    "BACKEND is a file or block device, an NBD URI (nbd://HOST[:PORT]/NAME,\n"
	    "nbd+unix:///NAME?socket=PATH, nbds://...), nbdkit:PLUGIN [ARG...] or a Ceph\n"
	    "RBD image rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][?conf=FILE&id=USER&keyring=FILE].\n"
	    "LEVEL is error, warn, info or debug. MODE is writeback (default), writethrough,\n"
	    "writearound or none. SIZE takes a K, M, G or T suffix. Default "
	    "listen: " OPTIONS_DEFAULT_LISTEN " (when neither --listen nor --unix is given).\n"
	    "The empty export name selects the first export. FILE (nbdcached.conf(5)) "
	    "is\n" OPTIONS_DEFAULT_CONFIG " when it exists and no --export is given;\n"
	    "the command line wins over it. SIGHUP re-reads it.\n");
	return text;
}

int options_push_string(char ***vec, size_t *count, const char *s)
{
	char **v = realloc(*vec, (*count + 1) * sizeof(**vec));
	if (!v)
		return -ENOMEM;
	*vec = v;
	v[*count] = strdup(s);
	if (!v[*count])
		return -ENOMEM;
	(*count)++;
	return 0;
}

void options_free(struct options *opts)
{
	for (size_t i = 0; i < opts->listen_count; i++)
		free(opts->listen[i]);
	free(opts->listen);
	for (size_t i = 0; i < opts->unix_count; i++)
		free(opts->unix_paths[i]);
	free(opts->unix_paths);
	for (size_t i = 0; i < opts->export_count; i++)
		options_export_spec_free(&opts->exports[i]);
	free(opts->exports);
	free(opts->pidfile);
	free(opts->cache_device);
	free(opts->cache_device_discard);
	free(opts->config_path);
	free(opts->control_path);
	free(opts->user);
	free(opts->group);
	access_spec_free(&opts->access);
	free(opts->metrics);
	access_spec_free(&opts->metrics_access);
	free(opts->tls_certificates);
	free(opts->tls_psk);
	free(opts->tls_priority);
	memset(opts, 0, sizeof(*opts));
}

uint64_t options_pinned_replies(const struct options *opts)
{
	if (opts->max_pinned_replies == OPTIONS_PINNED_DEFAULT)
		return opts->cache_size / 8;
	return opts->max_pinned_replies;
}

int options_add_export(struct options *opts, struct export_spec *spec, char *err, size_t errlen)
{
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *o = &opts->exports[i];
		if (strcmp(o->name, spec->name) == 0)
			return fail(err, errlen, -EEXIST, "duplicate export name '%s' (first at %s)",
				    spec->name, o->origin ? o->origin : "the command line");
	}
	struct export_spec *v = realloc(opts->exports, (opts->export_count + 1) * sizeof(*v));
	if (!v)
		return fail(err, errlen, -ENOMEM, "out of memory");
	opts->exports = v;
	v[opts->export_count++] = *spec;
	memset(spec, 0, sizeof(*spec));
	return 0;
}

void options_defaults(struct options *out)
{
	memset(out, 0, sizeof(*out));
	out->log_level = LOG_INFO;
	out->cache_size = OPTIONS_DEFAULT_CACHE_SIZE;
	out->cache_device_use = 3;
	out->block_size = OPTIONS_DEFAULT_BLOCK_SIZE;
	out->cache_mode = CACHE_MODE_WRITEBACK;
	out->dirty_high = OPTIONS_DEFAULT_DIRTY_HIGH;
	out->dirty_low = OPTIONS_DEFAULT_DIRTY_LOW;
	out->dirty_expire = OPTIONS_DEFAULT_DIRTY_EXPIRE;
	out->backend_timeout = OPTIONS_DEFAULT_BACKEND_TIMEOUT;
	out->compact = true;
	out->compact_interval_ms = OPTIONS_DEFAULT_COMPACT_INTERVAL_MS;
	out->compact_threshold = OPTIONS_DEFAULT_COMPACT_THRESHOLD;
	out->max_clients = OPTIONS_DEFAULT_MAX_CLIENTS;
	out->max_reply_memory = OPTIONS_DEFAULT_MAX_REPLY_MEMORY;
	out->max_pinned_replies = OPTIONS_PINNED_DEFAULT;
	out->stall_timeout = OPTIONS_DEFAULT_STALL_TIMEOUT;
	out->negotiation_timeout = OPTIONS_DEFAULT_NEGOTIATION_TIMEOUT;
}

static int set_string(char **slot, const char *value)
{
	char *copy = strdup(value);
	if (!copy)
		return -ENOMEM;
	free(*slot);
	*slot = copy;
	return 0;
}

/* Long-only options (no short letter) that are not settings (settings.h
 * has theirs, from 2000 on): the access rules and the metrics. */
enum {
	OPT_ACCESS_ALLOW = 256,
	OPT_ACCESS_DENY,
	OPT_ACCESS_USERS,
	OPT_ACCESS_GROUPS,
	OPT_ACCESS_IDENTITIES, /* ... in access_lists' order */
	OPT_METRICS,
	OPT_METRICS_ALLOW,
	OPT_METRICS_DENY,
	OPT_METRICS_EXPORT_NAMES,
};

/*
 * --metrics HOST:PORT, --metrics-allow LIST, --metrics-deny LIST (the
 * two lists grow, as --allow and --deny do) and --metrics-export-names.
 * Shared with the config file's keys (options_metrics_value).
 */
static int options_metrics_arg(int c, const char *arg, struct options *out, char *err,
			       size_t errlen)
{
	static const struct {
		int option;
		const char *key;
		uint64_t given;
	} keys[] = {
	    {OPT_METRICS, "metrics", OPT_GIVEN_METRICS},
	    {OPT_METRICS_ALLOW, "metrics-allow", OPT_GIVEN_METRICS_ALLOW},
	    {OPT_METRICS_DENY, "metrics-deny", OPT_GIVEN_METRICS_DENY},
	    {OPT_METRICS_EXPORT_NAMES, "metrics-export-names", OPT_GIVEN_METRICS_EXPORT_NAMES},
	};
	size_t k = 0;
	while (keys[k].option != c)
		k++;
	char why[300];
	int rc = options_metrics_value(out, keys[k].key, arg, why, sizeof(why));
	if (rc < 0)
		return fail(err, errlen, rc, "--%s", why);
	out->given |= keys[k].given;
	return 0;
}

int options_metrics_value(struct options *out, const char *key, const char *value, char *err,
			  size_t errlen)
{
	if (strcmp(key, "metrics") == 0) {
		char host[256], port[16];
		if (options_split_host_port(value, host, sizeof(host), port, sizeof(port)) < 0)
			return fail(err, errlen, -EINVAL,
				    "metrics %s: expected HOST:PORT or [IPV6]:PORT", value);
		if (host[0])
			return set_string(&out->metrics, value);
		/* ":PORT" is loopback, not every address (nbdcached(8)): stored
		 * so, the address the server binds, logs and compares at reload. */
		char loopback[sizeof(OPTIONS_METRICS_DEFAULT_HOST) + sizeof(port)];
		snprintf(loopback, sizeof(loopback), "%s:%s", OPTIONS_METRICS_DEFAULT_HOST, port);
		return set_string(&out->metrics, loopback);
	}
	if (strcmp(key, "metrics-export-names") == 0) {
		if (strcmp(value, "all") != 0 && strcmp(value, "listed") != 0)
			return fail(err, errlen, -EINVAL,
				    "metrics-export-names %s: expected listed or all", value);
		out->metrics_export_names_all = strcmp(value, "all") == 0;
		return 0;
	}
	/* access_lists[0] is allow, [1] deny: the same syntax, other lists. */
	const struct access_list *l = &access_lists[strcmp(key, "metrics-allow") == 0 ? 0 : 1];
	char why[250];
	int rc = access_spec_add(&out->metrics_access, l, value, why, sizeof(why));
	if (rc == -EINVAL)
		return fail(err, errlen, rc, "metrics-%s", why);
	return rc;
}

/* --allow, --deny, --allow-users, --allow-groups, --allow-identities (each
 * adds to its list). */
static int options_access_arg(int c, const char *arg, struct options *out, char *err, size_t errlen)
{
	const struct access_list *l = &access_lists[c - OPT_ACCESS_ALLOW];
	char why[200];
	int rc = access_spec_add(&out->access, l, arg, why, sizeof(why));
	if (rc == -EINVAL)
		return fail(err, errlen, rc, "--%s", why);
	if (rc == 0)
		out->given |= l->given;
	return rc;
}

int options_parse_args(int argc, char **argv, struct options *out, char *err, size_t errlen)
{
	/* The settings' options (settings.h), then these. */
	static const struct option own[] = {
	    {"foreground", no_argument, NULL, 'f'},
	    {"listen", required_argument, NULL, 'l'},
	    {"unix", required_argument, NULL, 'u'},
	    {"export", required_argument, NULL, 'e'},
	    {"config", required_argument, NULL, 'c'},
	    {"check-config", no_argument, NULL, 'K'},
	    {"allow", required_argument, NULL, OPT_ACCESS_ALLOW},
	    {"deny", required_argument, NULL, OPT_ACCESS_DENY},
	    {"allow-users", required_argument, NULL, OPT_ACCESS_USERS},
	    {"allow-groups", required_argument, NULL, OPT_ACCESS_GROUPS},
	    {"allow-identities", required_argument, NULL, OPT_ACCESS_IDENTITIES},
	    {"metrics", required_argument, NULL, OPT_METRICS},
	    {"metrics-allow", required_argument, NULL, OPT_METRICS_ALLOW},
	    {"metrics-deny", required_argument, NULL, OPT_METRICS_DENY},
	    {"metrics-export-names", required_argument, NULL, OPT_METRICS_EXPORT_NAMES},
	    {"help", no_argument, NULL, 'h'},
	    {"version", no_argument, NULL, 'V'},
	};
	static struct option longopts[sizeof(own) / sizeof(own[0]) + 64];
	if (!longopts[0].name) {
		size_t n = 0;
		if (settings_count >= 64)
			abort(); /* (the array above: 63 settings at most, and its end) */
		for (size_t i = 0; i < settings_count; i++)
			longopts[n++] = (struct option){settings[i].name,
							settings[i].optional ? optional_argument
									     : required_argument,
							NULL, settings[i].opt};
		for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++)
			longopts[n++] = own[i];
	}
	int rc = 0;
	options_defaults(out);
	optind = 1;
	opterr = 0;
	for (;;) {
		int c = getopt_long(argc, argv, "fl:u:e:t:p:L:C:H:B:M:S:D:d:E:T:m:c:Kx:U:G:P:I:F:N:R:Q:W:O:hV",
				    longopts, NULL);
		if (c == -1)
			break;
		switch (c) {
		case 'f':
			out->foreground = true;
			break;
		case 'l': {
			char host[256], port[16];
			if (options_split_host_port(optarg, host, sizeof(host), port,
						    sizeof(port)) < 0) {
				rc = fail(err, errlen, -EINVAL,
					  "--listen %s: expected HOST:PORT or [IPV6]:PORT", optarg);
				goto error;
			}
			if ((rc = options_push_string(&out->listen, &out->listen_count, optarg)) < 0)
				goto error;
			out->given |= OPT_GIVEN_LISTEN;
			break;
		}
		case 'u': {
			struct unix_listen u;
			char why[300];
			if ((rc = options_parse_unix(optarg, &u, why, sizeof(why))) < 0) {
				fail(err, errlen, rc, "--unix %s: %s", optarg, why);
				goto error;
			}
			if ((rc = options_push_string(&out->unix_paths, &out->unix_count, optarg)) <
			    0)
				goto error;
			out->given |= OPT_GIVEN_LISTEN;
			break;
		}
		case 'e': {
			struct export_spec spec;
			rc = options_parse_export(optarg, &spec, err, errlen);
			if (rc < 0)
				goto error;
			rc = options_add_export(out, &spec, err, errlen);
			if (rc < 0) {
				options_export_spec_free(&spec);
				if (rc == -EEXIST)
					rc = -EINVAL; /* the message says which name */
				goto error;
			}
			break;
		}
		case 'c':
			if ((rc = set_string(&out->config_path, optarg)) < 0)
				goto error;
			break;
		case 'K':
			out->check_config = true;
			break;
		case OPT_ACCESS_ALLOW:
		case OPT_ACCESS_DENY:
		case OPT_ACCESS_USERS:
		case OPT_ACCESS_GROUPS:
		case OPT_ACCESS_IDENTITIES:
			if ((rc = options_access_arg(c, optarg, out, err, errlen)) < 0)
				goto error;
			break;
		case OPT_METRICS:
		case OPT_METRICS_ALLOW:
		case OPT_METRICS_DENY:
		case OPT_METRICS_EXPORT_NAMES:
			if ((rc = options_metrics_arg(c, optarg, out, err, errlen)) < 0)
				goto error;
			break;
		case 'h':
			out->help = true;
			break;
		case 'V':
			out->version = true;
			break;
		default: {
			const struct setting *st = settings_by_opt(c);
			if (!st) {
				rc = fail(err, errlen, -EINVAL, "unknown or incomplete option '%s'",
					  argv[optind - 1]);
				goto error;
			}
			char why[300];
			rc = settings_read(st, out, optarg, why, sizeof(why));
			if (rc == -EINVAL && st->optional) /* (its value only after '=') */
				fail(err, errlen, rc, "--%s=%s: %s", st->name, optarg, st->expect);
			else if (rc == -EINVAL)
				fail(err, errlen, rc, "--%s", why);
			if (rc == -EINVAL)
				goto error;
			if (rc < 0)
				goto error;
			out->given |= st->given;
			break;
		}
		}
	}
	if (optind < argc) {
		rc = fail(err, errlen, -EINVAL, "unexpected argument '%s'", argv[optind]);
		goto error;
	}
	return 0;
error:
	if (rc == -ENOMEM)
		fail(err, errlen, rc, "out of memory");
	options_free(out);
	return rc;
}

int options_parse(int argc, char **argv, struct options *out, char *err, size_t errlen)
{
	int rc = options_parse_args(argc, argv, out, err, errlen);
	if (rc < 0 || out->help || out->version || out->config_path)
		return rc;
	rc = options_finish(out, err, errlen);
	if (rc < 0) {
		if (rc == -ENOMEM)
			fail(err, errlen, rc, "out of memory");
		options_free(out);
	}
	return rc;
}

bool options_backend_shared(const char *backend)
{
	return strncmp(backend, "nbdkit:", 7) != 0;
}

bool options_backend_is_path(const char *backend)
{
	return strstr(backend, "://") == NULL && strncmp(backend, "nbdkit:", 7) != 0 &&
	       !rbd_spec_handles(backend);
}

bool options_same_backend(const struct export_spec *a, const struct export_spec *b)
{
	if (!options_backend_shared(a->backend) || !options_backend_shared(b->backend))
		return false;
	if (strcmp(a->backend, b->backend) == 0)
		return true;
	return a->has_file_id && b->has_file_id && a->file_dev == b->file_dev &&
	       a->file_ino == b->file_ino;
}

size_t options_backend_first(const struct options *opts, size_t i)
{
	if (!options_backend_shared(opts->exports[i].backend))
		return i;
	for (size_t j = 0; j < i; j++)
		if (options_same_backend(&opts->exports[j], &opts->exports[i]))
			return j;
	return i;
}

/*
 * Who each file or block device backend is, as the file backend will see it
 * (its device and inode; a block device's device number), so that exports
 * naming one file by two paths get one backing and one cache rather than
 * two caches that each serve what they hold. A path not there now is left
 * to the open, which says why.
 */
static void identify_backends(struct options *opts)
{
	for (size_t i = 0; i < opts->export_count; i++) {
		struct export_spec *e = &opts->exports[i];
		struct stat st;
		e->has_file_id = false;
		if (!options_backend_is_path(e->backend) || stat(e->backend, &st) < 0)
			continue;
		if (S_ISBLK(st.st_mode)) {
			e->file_dev = (uint64_t)st.st_rdev;
			e->file_ino = 0;
		} else if (S_ISREG(st.st_mode)) {
			e->file_dev = (uint64_t)st.st_dev;
			e->file_ino = (uint64_t)st.st_ino;
		} else {
			continue;
		}
		e->has_file_id = true;
	}
}

/* What exports over one backend must agree on: they share its cache export,
 * which has one block size, one mode and one pair of watermarks. NULL when
 * they agree. */
static const char *backend_disagreement(const struct export_spec *a, const struct export_spec *b)
{
	if (a->block_size != b->block_size)
		return "block-size";
	if (a->cache_mode != b->cache_mode)
		return "cache-mode";
	if (a->dirty_high != b->dirty_high)
		return "dirty-high";
	if (a->dirty_low != b->dirty_low)
		return "dirty-low";
	return NULL;
}

/* Does name look like window K of a split export prefix ("prefix/K")? */
static bool window_name_of(const char *name, const char *prefix)
{
	size_t n = strlen(prefix);
	if (strncmp(name, prefix, n) != 0 || name[n] != '/' || !name[n + 1])
		return false;
	return strspn(name + n + 1, "0123456789") == strlen(name + n + 1);
}

/* Check one export's window and split against its block size and names. */
static int check_window(const struct options *opts, const struct export_spec *e, char *err,
			size_t errlen)
{
	const char *at = e->origin ? " at " : "", *origin = e->origin ? e->origin : "";
	if (e->offset % e->block_size || e->size % e->block_size || e->split % e->block_size)
		return fail(err, errlen, -EINVAL,
			    "export '%s'%s%s: offset, size and split must be multiples of its "
			    "block size %u",
			    e->name, at, origin, e->block_size);
	if (e->size && e->offset > UINT64_MAX - e->size)
		return fail(err, errlen, -EINVAL, "export '%s'%s%s: offset + size overflows",
			    e->name, at, origin);
	if ((e->offset > OPTIONS_MAX_EXPORT_SIZE) ||
	    (e->size && e->offset + e->size > OPTIONS_MAX_EXPORT_SIZE))
		return fail(err, errlen, -EINVAL,
			    "export '%s'%s%s: the window ends past 2^63 bytes", e->name, at,
			    origin);
	if (!e->split)
		return 0;
	if (strlen(e->name) > 4000)
		return fail(err, errlen, -EINVAL,
			    "export '%s'%s%s: name too long for split windows", e->name, at, origin);
	for (size_t j = 0; j < opts->export_count; j++)
		if (window_name_of(opts->exports[j].name, e->name))
			return fail(err, errlen, -EINVAL,
				    "export '%s' is named like a window of export '%s', which has "
				    "split=",
				    opts->exports[j].name, e->name);
	return 0;
}

/* TLS settings that only make sense together. */
static int options_check_tls(const struct options *o, char *err, size_t errlen)
{
	bool creds = o->tls_certificates || o->tls_psk;
	if (o->tls != TLS_OFF && !creds)
		return fail(err, errlen, -EINVAL,
			    "tls %s needs tls-certificates DIR or tls-psk FILE",
			    options_tls_name(o->tls));
	if (o->tls_verify_peer && !o->tls_certificates)
		return fail(err, errlen, -EINVAL,
			    "tls-verify-peer needs tls-certificates DIR (its ca-cert.pem)");
	for (size_t i = 0; i < o->export_count; i++) {
		const struct export_spec *e = &o->exports[i];
		if (e->tls_require && o->tls == TLS_OFF)
			return fail(err, errlen, -EINVAL,
				    "export '%s'%s%s: tls = require needs the global tls on or "
				    "require",
				    e->name, e->origin ? " at " : "", e->origin ? e->origin : "");
	}
	return 0;
}

int options_finish(struct options *out, char *err, size_t errlen)
{
	if (out->export_count == 0)
		return fail(err, errlen, -EINVAL,
			    "no export: give at least one --export NAME=PATH or a config file");
	if (out->dirty_low > out->dirty_high)
		return fail(err, errlen, -EINVAL, "dirty-low %u is above dirty-high %u",
			    out->dirty_low, out->dirty_high);
	const struct setting *dirty_low = export_settings_find("dirty-low");
	for (size_t i = 0; i < out->export_count; i++) {
		struct export_spec *e = &out->exports[i];
		export_settings_defaults(e, out);
		/* The global dirty-low, but not above the export's dirty-high. */
		if (!(e->given & export_settings_bit(dirty_low)) && e->dirty_low > e->dirty_high)
			e->dirty_low = e->dirty_high;
		if (e->dirty_low > e->dirty_high)
			return fail(err, errlen, -EINVAL,
				    "export '%s'%s%s: dirty-low %u is above dirty-high %u", e->name,
				    e->origin ? " at " : "", e->origin ? e->origin : "",
				    e->dirty_low, e->dirty_high);
	}
	identify_backends(out);
	for (size_t i = 0; i < out->export_count; i++) {
		struct export_spec *e = &out->exports[i];
		int rc = check_window(out, e, err, errlen);
		if (rc < 0)
			return rc;
		if (rbd_spec_handles(e->backend)) {
			struct rbd_spec rbd;
			char why[512];
			if (rbd_spec_parse(e->backend, &rbd, why, sizeof(why)) < 0)
				return fail(err, errlen, -EINVAL, "export '%s'%s%s: %s", e->name,
					    e->origin ? " at " : "", e->origin ? e->origin : "",
					    why);
		}
		size_t first = options_backend_first(out, i);
		const struct export_spec *f = &out->exports[first];
		const char *what = backend_disagreement(f, e);
		bool renamed = strcmp(f->backend, e->backend) != 0;
		if (what)
			return fail(err, errlen, -EINVAL,
				    "exports '%s' and '%s' share the backend %s%s%s%s, and so one "
				    "cache: their %s must be the same",
				    f->name, e->name, f->backend, renamed ? " (as " : "",
				    renamed ? e->backend : "", renamed ? ": the same file)" : "",
				    what);
	}
	if (out->max_connections_per_client && out->max_clients &&
	    out->max_connections_per_client >= out->max_clients)
		return fail(err, errlen, -EINVAL,
			    "max-connections-per-client %u must be below max-clients %u, so that "
			    "one client cannot take every connection",
			    out->max_connections_per_client, out->max_clients);
	int tls_rc = options_check_tls(out, err, errlen);
	if (tls_rc < 0)
		return tls_rc;
	if (out->listen_count == 0 && out->unix_count == 0) {
		int rc = options_push_string(&out->listen, &out->listen_count,
					     OPTIONS_DEFAULT_LISTEN);
		if (rc < 0)
			return fail(err, errlen, rc, "out of memory");
		out->listen_default = true;
	}
	return 0;
}
