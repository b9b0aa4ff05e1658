/*
 * daemon/config_keys.c: the keys of the config file (config_internal.h):
 * [generic] (generic_key), an export's section (export_key), the access
 * rules of both (access_key), and nbd-server's keys that nbdcached refuses
 * by name. Key names: dashes and underscores are the same (cache-size,
 * cache_size); nbd-server's spellings are aliases.
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

/* Bits of config_ctx.spec_keys, to refuse a key given twice. */
enum {
	K_BACKEND = 1u << 0,
	K_READONLY = 1u << 1,
	K_DESCRIPTION = 1u << 2,
	K_BLOCK_SIZE = 1u << 3,
	K_CACHE_MODE = 1u << 4,
	K_SEQ_CUTOFF = 1u << 5,
	K_MAX_CONNECTIONS = 1u << 6,
	K_DIRTY_HIGH = 1u << 7,
	K_DIRTY_LOW = 1u << 8,
	K_FLAGS = 1u << 9,
	K_WARM = 1u << 10,
	K_OFFSET = 1u << 12,
	K_SIZE = 1u << 13,
	K_SPLIT = 1u << 14,
	K_TLS = 1u << 15,
	K_ALLOW_RESIZE = 1u << 16,
	K_QOS = 1u << 17, /* ... QOS_KEYS bits from here, by qos_key_index() */
};
_Static_assert(QOS_KEYS <= 15, "the QoS keys' bits fit spec_keys");

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
	if (rc == -ENOMEM)
		return out_of_memory(x);
	if (rc < 0)
		return config_fail(x, "%s", why);
	x->set |= st->given;
	return 1;
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
	if (key_is(name, "readonly")) {
		if (!once(x, &x->spec_keys, K_READONLY, name))
			return 0;
		if (options_parse_bool(v, &e->readonly) < 0)
			return config_fail(x, "readonly %s: expected true or false", v);
		return 1;
	}
	if (key_is(name, "allow-resize")) {
		if (!once(x, &x->spec_keys, K_ALLOW_RESIZE, name))
			return 0;
		if (options_parse_bool(v, &e->allow_resize) < 0)
			return config_fail(x, "allow-resize %s: expected true or false", v);
		return 1;
	}
	if (key_is(name, "description")) {
		if (!once(x, &x->spec_keys, K_DESCRIPTION, name))
			return 0;
		if (strlen(v) > 4096)
			return config_fail(x, "description longer than 4096 bytes");
		return set_string(x, &e->description, v);
	}
	if (key_is(name, "block-size")) {
		if (!once(x, &x->spec_keys, K_BLOCK_SIZE, name))
			return 0;
		if (options_parse_block_size(v, &e->block_size) < 0)
			return config_fail(x,
					   "block-size %s: must be a power of two from 512 to "
					   "65536",
					   v);
		e->has_block_size = true;
		return 1;
	}
	if (key_is(name, "cache-mode")) {
		if (!once(x, &x->spec_keys, K_CACHE_MODE, name))
			return 0;
		if (options_parse_cache_mode(v, &e->cache_mode) < 0)
			return config_fail(x,
					   "cache-mode %s: expected writeback, writethrough, "
					   "writearound or none",
					   v);
		return 1;
	}
	if (key_is(name, "seq-cutoff")) {
		if (!once(x, &x->spec_keys, K_SEQ_CUTOFF, name))
			return 0;
		if (options_parse_size(v, &e->seq_cutoff) < 0)
			return config_fail(x, "seq-cutoff %s: expected a size", v);
		e->has_seq_cutoff = true;
		return 1;
	}
	if (key_is(name, "max-connections") || key_is(name, "maxconnections")) {
		if (!once(x, &x->spec_keys, K_MAX_CONNECTIONS, name))
			return 0;
		if (options_parse_max_connections(v, &e->max_connections) < 0)
			return config_fail(x, "%s %s: expected 0..%d (0: unlimited)", name, v,
					   OPTIONS_MAX_CONNECTIONS);
		e->has_max_connections = true;
		return 1;
	}
	if (key_is(name, "dirty-high") || key_is(name, "dirty-low")) {
		bool high = key_is(name, "dirty-high");
		if (!once(x, &x->spec_keys, high ? K_DIRTY_HIGH : K_DIRTY_LOW, name))
			return 0;
		if (options_parse_percent(v, high ? &e->dirty_high : &e->dirty_low) < 0)
			return config_fail(x, "%s %s: expected 0..100", name, v);
		*(high ? &e->has_dirty_high : &e->has_dirty_low) = true;
		return 1;
	}
	if (key_is(name, "offset") || key_is(name, "size")) {
		bool off = key_is(name, "offset");
		if (!once(x, &x->spec_keys, off ? K_OFFSET : K_SIZE, name))
			return 0;
		uint64_t *to = off ? &e->offset : &e->size;
		if (options_parse_size(v, to) < 0 || (!off && *to == 0))
			return config_fail(x, "%s %s: expected a size%s", name, v,
					   off ? "" : " above 0");
		return 1;
	}
	if (key_is(name, "split")) {
		if (!once(x, &x->spec_keys, K_SPLIT, name))
			return 0;
		if (options_parse_split(v, &e->split) < 0)
			return config_fail(x, "split %s: expected a size above 0, or 32bit", v);
		return 1;
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
	if (key_is(name, "tls")) {
		if (!once(x, &x->spec_keys, K_TLS, name))
			return 0;
		/* Only require: on and off are the global setting's ([generic]). */
		if (strcmp(v, "require") == 0)
			e->tls_require = true;
		else if (strcmp(v, "on") != 0)
			return config_fail(x, "tls %s: expected require (or on) in an export", v);
		return 1;
	}
	if (key_is(name, "cache-device-warm")) {
		if (!once(x, &x->spec_keys, K_WARM, name))
			return 0;
		if (options_parse_cache_device_warm(v, &e->cache_device_warm_all) < 0)
			return config_fail(x, "cache-device-warm %s: expected files or all", v);
		e->has_cache_device_warm = true;
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
