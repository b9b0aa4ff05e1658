/*
 * daemon/config_keys.c: the keys of the config file (config_internal.h):
 * [generic] (generic_key), an export's section (export_key), the access
 * rules of both (access_key), and nbd-server's keys that nbdcached refuses
 * by name. Most keys are rows of settings.h's tables; here are those with a
 * shape of their own. Key names: dashes and underscores are the same
 * (cache-size, cache_size); nbd-server's spellings are aliases.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config_internal.h"
#include "daemon/option_values.h"
#include "daemon/settings.h"

/* (- and _ alike, as every key is read) */
#define key_is settings_key_is

static int out_of_memory(struct config_ctx *x)
{
	x->rc = -ENOMEM;
	return 0;
}

/* A setting read (settings.h): 1, or 0 with the error recorded. */
static int read_result(struct config_ctx *x, int rc, const char *why)
{
	if (rc == -ENOMEM)
		return out_of_memory(x);
	if (rc < 0)
		return config_fail(x, "%s", why);
	return 1;
}

static int set_string(struct config_ctx *x, char **slot, const char *value)
{
	char *copy = strdup(value);
	if (!copy)
		return out_of_memory(x);
	free(*slot);
	*slot = copy;
	return 1;
}

/* Keys of nbd-server that nbdcached does not implement: refused by name. */
static const char *const nbd_server_unsupported[] = {
    "allowlist",   "includedir", "oldstyle",
    "cacertfile",  "certfile",	 "keyfile",
    "tlsonly",	   "tlsprio",	 "duallisten",
    "copyonwrite", "sparse-cow", "sdp",
    "sync",	   "timeout",	 "filesize",
    "virtstyle",   "prerun",	 "postrun",
    "authfile",	   "multifile",	 "temporary",
    "treefiles",   "waitfile",	 "splice",
    "cowdir",	   "rotational", "maxconnections-per-client",
    NULL,
};

static bool is_nbd_server_key(const char *name)
{
	for (size_t i = 0; nbd_server_unsupported[i]; i++)
		if (key_is(name, nbd_server_unsupported[i]))
			return true;
	return false;
}

/* Bits of config_ctx.spec_keys, to refuse a key given twice (the keys of
 * export_settings have their bits in the export's given). */
enum {
	K_BACKEND = 1u << 0,
	K_QOS = 1u << 1, /* ... QOS_KEYS bits from here, by qos_key_index() */
};
_Static_assert(QOS_KEYS <= 31, "the QoS keys' bits fit spec_keys");

static int once(struct config_ctx *x, unsigned *mask, unsigned bit, const char *name)
{
	if (*mask & bit)
		return config_fail(x, "'%s' given twice", name);
	*mask |= bit;
	return 1;
}

/*
 * The access-rule keys, in [generic] (global) or an export's section
 * (access.h): allow, deny, allow-users, allow-groups, allow-identities
 * (one identity per key: a DN holds commas). Each is checked
 * now (addresses parsed, names looked up) so that an error names its line;
 * a key given twice adds to its list. -1: not one of them.
 */
static int access_key(struct config_ctx *x, const char *name, const char *v,
		      struct access_spec *spec)
{
	const struct access_list *l = NULL;
	for (size_t i = 0; i < ACCESS_LISTS && !l; i++)
		if (key_is(name, access_lists[i].key))
			l = &access_lists[i];
	if (!l)
		return -1;
	char why[256];
	int rc = access_spec_add(spec, l, v, why, sizeof(why));
	if (rc == -ENOMEM)
		return out_of_memory(x);
	if (rc < 0)
		return config_fail(x, "%s", why);
	if (spec == &x->file.access)
		x->set |= l->given;
	return 1;
}

static int generic_key(struct config_ctx *x, const char *name, const char *v)
{
	int access_rc = access_key(x, name, v, &x->file.access);
	if (access_rc >= 0)
		return access_rc;
	struct options *f = &x->file;
	if (key_is(name, "listen")) {
		/* Several addresses: repeat the key, or separate them by spaces. */
		char *copy = strdup(v), *save = NULL;
		if (!copy)
			return out_of_memory(x);
		for (char *t = strtok_r(copy, " \t,", &save); t;
		     t = strtok_r(NULL, " \t,", &save)) {
			char host[256], port[16];
			if (options_split_host_port(t, host, sizeof(host), port, sizeof(port)) <
			    0) {
				config_fail(x, "listen %s: expected HOST:PORT or [IPV6]:PORT", t);
				free(copy);
				return 0;
			}
			if (options_push_string(&f->listen, &f->listen_count, t) < 0) {
				free(copy);
				return out_of_memory(x);
			}
		}
		free(copy);
		x->set |= OPT_GIVEN_LISTEN;
		return 1;
	}
	if (key_is(name, "unix") || key_is(name, "unixsock")) {
		struct unix_listen u;
		char why[300];
		if (options_parse_unix(v, &u, why, sizeof(why)) < 0)
			return config_fail(x, "%s %s: %s", name, v, why);
		if (options_push_string(&f->unix_paths, &f->unix_count, v) < 0)
			return out_of_memory(x);
		x->set |= OPT_GIVEN_LISTEN;
		return 1;
	}
	if (key_is(name, "metrics") || key_is(name, "metrics-allow") ||
	    key_is(name, "metrics-deny") || key_is(name, "metrics-export-names")) {
		/* metrics and metrics-export-names once; the rule lists add
		 * up, as allow and deny do. */
		static const struct {
			const char *key;
			uint64_t bit;
			bool once;
		} keys[] = {
		    {"metrics", OPT_GIVEN_METRICS, true},
		    {"metrics-allow", OPT_GIVEN_METRICS_ALLOW, false},
		    {"metrics-deny", OPT_GIVEN_METRICS_DENY, false},
		    {"metrics-export-names", OPT_GIVEN_METRICS_EXPORT_NAMES, true},
		};
		size_t k = 0;
		while (!key_is(name, keys[k].key))
			k++;
		uint64_t bit = keys[k].bit;
		if (keys[k].once && (x->set & bit))
			return config_fail(x, "'%s' given twice", name);
		char why[300];
		int rc = options_metrics_value(f, keys[k].key, v, why, sizeof(why));
		if (rc == -ENOMEM)
			return out_of_memory(x);
		if (rc < 0)
			return config_fail(x, "%s", why);
		x->set |= bit;
		return 1;
	}
	if (key_is(name, "listenaddr")) {
		if (x->listenaddr)
			return config_fail(x, "'%s' given twice", name);
		return set_string(x, &x->listenaddr, v);
	}
	if (key_is(name, "port")) {
		char *end;
		unsigned long p = strtoul(v, &end, 10);
		if (v[0] == '\0' || *end || p == 0 || p > 65535)
			return config_fail(x, "port %s: expected 1..65535", v);
		if (x->port)
			return config_fail(x, "'%s' given twice", name);
		return set_string(x, &x->port, v);
	}
	const struct setting *st = settings_find(name);
	if (!st) {
		if (is_nbd_server_key(name))
			return config_fail(x, "nbd-server key '%s' is not supported by nbdcached",
					   name);
		return config_fail(x, "unknown key '%s' in [generic]", name);
	}
	if (x->set & st->given)
		return config_fail(x, "'%s' given twice", name);
	char why[300];
	int rc = settings_read(st, f, v, why, sizeof(why));
	if (rc == 0)
		x->set |= st->given;
	return read_result(x, rc, why);
}

void config_finish_export(struct config_ctx *x)
{
	if (!x->spec)
		return;
	if (!x->spec->backend && x->rc == 0) {
		/* Named where the section starts, not where it was found to end. */
		snprintf(x->err, x->errlen, "%s: export '%s' has no backend (or exportname)",
			 x->spec->origin, x->spec->name);
		x->rc = -EINVAL;
	}
	x->spec = NULL;
}

static int start_export(struct config_ctx *x, const char *section)
{
	config_finish_export(x);
	if (strlen(section) >= sizeof(x->current))
		return config_fail(x, "section name longer than 4096 bytes");
	strcpy(x->current, section);
	if (section[0] == '\0')
		return config_fail(x, "an export section needs a name");
	for (size_t i = 0; i < x->file.export_count; i++)
		if (strcmp(x->file.exports[i].name, section) == 0)
			return config_fail(x, "export '%s' defined twice (first at %s)", section,
					   x->file.exports[i].origin);
	struct export_spec spec = {0};
	char origin[4200];
	snprintf(origin, sizeof(origin), "%s:%u", x->path, x->section_line);
	spec.name = strdup(section);
	spec.origin = strdup(origin);
	if (!spec.name || !spec.origin ||
	    options_add_export(&x->file, &spec, x->err, x->errlen) < 0) {
		options_export_spec_free(&spec);
		return out_of_memory(x);
	}
	x->spec = &x->file.exports[x->file.export_count - 1];
	x->spec_keys = 0;
	return 1;
}

static int export_key(struct config_ctx *x, const char *name, const char *v)
{
	struct export_spec *e = x->spec;
	if (key_is(name, "backend") || key_is(name, "exportname")) {
		if (!once(x, &x->spec_keys, K_BACKEND, name))
			return 0;
		if (v[0] == '\0')
			return config_fail(x, "%s: empty", name);
		return set_string(x, &e->backend, v);
	}
	const struct setting *st = export_settings_find(name);
	if (st) {
		if (e->given & export_settings_bit(st))
			return config_fail(x, "'%s' given twice", name);
		char why[300];
		return read_result(x, export_settings_read(st, e, name, v, why, sizeof(why)), why);
	}
	int access_rc = access_key(x, name, v, &e->access);
	if (access_rc >= 0)
		return access_rc;
	char qos_key[32];
	snprintf(qos_key, sizeof(qos_key), "%s", name);
	for (char *u = qos_key; (u = strchr(u, '_'));)
		*u = '-';
	if (qos_is_key(qos_key)) {
		char why[200];
		if (!once(x, &x->spec_keys, K_QOS << qos_key_index(qos_key), name))
			return 0;
		if (qos_limits_set(&e->qos, qos_key, v, why, sizeof(why)) < 0)
			return config_fail(x, "%s", why);
		return 1;
	}
	/* nbd-server's flush, fua and trim: nbdcached always honours them. */
	if (key_is(name, "flush") || key_is(name, "fua") || key_is(name, "trim")) {
		bool on;
		if (options_parse_bool(v, &on) < 0)
			return config_fail(x, "%s %s: expected true or false", name, v);
		if (!on)
			return config_fail(x, "%s cannot be turned off in nbdcached", name);
		return 1;
	}
	if (is_nbd_server_key(name))
		return config_fail(x, "nbd-server key '%s' is not supported by nbdcached", name);
	return config_fail(x, "unknown key '%s' in export [%s]", name, x->current);
}

int config_on_key(void *user, const char *section, const char *name, const char *value)
{
	struct config_ctx *x = user;
	if (x->rc == -ENOMEM)
		return 0;
	if (strcmp(value, "\x1f") == 0) {
		if (!x->long_value)
			return out_of_memory(x);
		value = x->long_value;
	}
	if (strcmp(section, "\x1f") == 0) {
		if (!x->long_section)
			return out_of_memory(x);
		section = x->long_section;
	}
	if (strcmp(section, "generic") == 0) {
		config_finish_export(x);
		return generic_key(x, name, value);
	}
	if (!x->spec || strcmp(section, x->current) != 0) {
		if (section[0] == '\0')
			return config_fail(x, "'%s' outside a section: put it under [generic]",
					   name);
		if (!start_export(x, section))
			return 0;
	}
	return export_key(x, name, value);
}
