/*
 * daemon/access.c: access rules, their syntax and matching (see access.h).
 *
 * Every address is kept as 16 bytes: an IPv4 address or rule as its
 * IPv4-mapped IPv6 form, with 96 added to an IPv4 prefix. A client that
 * reaches an IPv6 socket from IPv4 (::ffff:a.b.c.d) then matches IPv4
 * rules with no special case, and a plain IPv6 rule never matches an IPv4
 * client unless it covers ::ffff:0:0/96.
 */
#include "daemon/access.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <grp.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/option_values.h"
#include "daemon/options.h"

#define ACCESS_SEPARATORS " \t,"

#define fail options_fail

static void map_v4(uint8_t out[16], const struct in_addr *a)
{
	memset(out, 0, 10);
	out[10] = 0xff;
	out[11] = 0xff;
	memcpy(out + 12, &a->s_addr, 4);
}

static bool is_v4_mapped(const uint8_t a[16])
{
	static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	return memcmp(a, prefix, 12) == 0;
}

/* One item: ADDRESS or ADDRESS/PREFIX. */
static int parse_net(const char *item, struct access_net *out)
{
	char buf[64];
	if (strlen(item) >= sizeof(buf))
		return -EINVAL;
	strcpy(buf, item);
	snprintf(out->text, sizeof(out->text), "%s", item);
	char *slash = strchr(buf, '/');
	long prefix = -1;
	if (slash) {
		*slash = '\0';
		char *end;
		const char *p = slash + 1;
		if (*p < '0' || *p > '9')
			return -EINVAL;
		errno = 0;
		prefix = strtol(p, &end, 10);
		if (*end || errno || (p[0] == '0' && p[1] != '\0'))
			return -EINVAL;
	}
	struct in_addr v4;
	struct in6_addr v6;
	if (inet_pton(AF_INET, buf, &v4) == 1) {
		if (prefix > 32)
			return -EINVAL;
		map_v4(out->addr, &v4);
		out->prefix = prefix < 0 ? 128 : (unsigned)prefix + 96;
	} else if (inet_pton(AF_INET6, buf, &v6) == 1) {
		if (prefix > 128)
			return -EINVAL;
		memcpy(out->addr, v6.s6_addr, 16);
		out->prefix = prefix < 0 ? 128 : (unsigned)prefix;
	} else {
		return -EINVAL;
	}
	/* Host bits set (10.0.0.1/8): refused, a typo more often than not. */
	for (unsigned bit = out->prefix; bit < 128; bit++)
		if (out->addr[bit / 8] & (0x80u >> (bit % 8)))
			return -EINVAL;
	return 0;
}

bool access_net_match(const struct access_net *net, const uint8_t addr[16])
{
	unsigned full = net->prefix / 8, rest = net->prefix % 8;
	if (memcmp(net->addr, addr, full) != 0)
		return false;
	if (rest == 0)
		return true;
	uint8_t mask = (uint8_t)(0xffu << (8 - rest));
	return (net->addr[full] & mask) == (addr[full] & mask);
}

/* Call item(text, arg) for each item of a comma- or space-separated list. */
static int each_item(const char *text, int (*item)(const char *t, void *arg), void *arg,
		     size_t *count)
{
	char *copy = strdup(text), *save = NULL;
	if (!copy)
		return -ENOMEM;
	int rc = 0;
	*count = 0;
	for (char *t = strtok_r(copy, ACCESS_SEPARATORS, &save); t && rc == 0;
	     t = strtok_r(NULL, ACCESS_SEPARATORS, &save)) {
		rc = item(t, arg);
		if (rc == 0)
			(*count)++;
	}
	free(copy);
	return rc;
}

struct collect {
	void *v;
	size_t n, size;
	char bad[64];
	int (*parse)(const char *t, void *slot);
};

static int collect_item(const char *t, void *arg)
{
	struct collect *c = arg;
	char *v = realloc(c->v, (c->n + 1) * c->size);
	if (!v)
		return -ENOMEM;
	c->v = v;
	if (c->parse(t, v + c->n * c->size) < 0) {
		snprintf(c->bad, sizeof(c->bad), "%s", t);
		return -EINVAL;
	}
	c->n++;
	return 0;
}

static int collect(const char *text, size_t size, int (*parse)(const char *t, void *slot),
		   void **out, size_t *count, char *bad)
{
	struct collect c = {.size = size, .parse = parse};
	size_t n;
	int rc = each_item(text, collect_item, &c, &n);
	if (rc < 0) {
		snprintf(bad, 64, "%s", c.bad);
		free(c.v);
		return rc;
	}
	*out = c.v;
	*count = c.n;
	return 0;
}

static int net_slot(const char *t, void *slot)
{
	return parse_net(t, slot);
}

int access_parse_nets(const char *text, struct access_net **out, size_t *count, char *err,
		      size_t errlen)
{
	char bad[64] = "";
	int rc = collect(text, sizeof(struct access_net), net_slot, (void **)out, count, bad);
	if (rc == -EINVAL)
		return fail(err, errlen, rc,
			    "'%s' is not an address or CIDR (a.b.c.d[/0..32], IPV6[/0..128], "
			    "no host bits set)",
			    bad);
	if (rc < 0)
		return fail(err, errlen, rc, "out of memory");
	return 0;
}

/* A decimal id below 2^32 - 1 (that one is (uid_t)-1, "nobody set"). */
static bool numeric_id(const char *t, uint32_t *out)
{
	if (*t < '0' || *t > '9')
		return false;
	char *end;
	errno = 0;
	unsigned long long v = strtoull(t, &end, 10);
	if (*end || errno || v >= UINT32_MAX)
		return false;
	*out = (uint32_t)v;
	return true;
}

static int user_slot(const char *t, void *slot)
{
	if (numeric_id(t, slot))
		return 0;
	struct passwd pw, *res = NULL;
	char buf[4096];
	if (getpwnam_r(t, &pw, buf, sizeof(buf), &res) != 0 || !res)
		return -EINVAL;
	*(uint32_t *)slot = (uint32_t)pw.pw_uid;
	return 0;
}

static int group_slot(const char *t, void *slot)
{
	if (numeric_id(t, slot))
		return 0;
	struct group gr, *res = NULL;
	char buf[16384];
	if (getgrnam_r(t, &gr, buf, sizeof(buf), &res) != 0 || !res)
		return -EINVAL;
	*(uint32_t *)slot = (uint32_t)gr.gr_gid;
	return 0;
}

int access_parse_users(const char *text, uint32_t **out, size_t *count, char *err, size_t errlen)
{
	char bad[64] = "";
	int rc = collect(text, sizeof(uint32_t), user_slot, (void **)out, count, bad);
	if (rc == -EINVAL)
		return fail(err, errlen, rc, "no such user '%s'", bad);
	if (rc < 0)
		return fail(err, errlen, rc, "out of memory");
	return 0;
}

int access_parse_groups(const char *text, uint32_t **out, size_t *count, char *err, size_t errlen)
{
	char bad[64] = "";
	int rc = collect(text, sizeof(uint32_t), group_slot, (void **)out, count, bad);
	if (rc == -EINVAL)
		return fail(err, errlen, rc, "no such group '%s'", bad);
	if (rc < 0)
		return fail(err, errlen, rc, "out of memory");
	return 0;
}

void access_rules_free(struct access_rules *r)
{
	free(r->allow);
	free(r->deny);
	free(r->users);
	free(r->groups);
	for (size_t i = 0; i < r->identity_count; i++)
		free(r->identities[i]);
	free(r->identities);
	memset(r, 0, sizeof(*r));
}

bool access_rules_empty(const struct access_rules *r)
{
	return !r->allow_count && !r->deny_count && !r->user_count && !r->group_count &&
	       !r->identity_count;
}

/* Identities, one per line (leading and trailing blanks dropped). */
static int parse_identities(const char *text, char ***out, size_t *count, char *err,
			    size_t errlen)
{
	if (!*text)
		return fail(err, errlen, -EINVAL, "an empty identity");
	for (const char *p = text; *p;) {
		const char *eol = strchr(p, '\n');
		size_t n = eol ? (size_t)(eol - p) : strlen(p);
		const char *a = p, *b = p + n;
		while (a < b && (*a == ' ' || *a == '\t'))
			a++;
		while (b > a && (b[-1] == ' ' || b[-1] == '\t'))
			b--;
		p = eol ? eol + 1 : p + n;
		if (a == b)
			return fail(err, errlen, -EINVAL, "an empty identity");
		if ((size_t)(b - a) >= sizeof(((struct access_peer *)0)->identity))
			return fail(err, errlen, -EINVAL, "identity longer than %zu bytes",
				    sizeof(((struct access_peer *)0)->identity) - 1);
		char **v = realloc(*out, (*count + 1) * sizeof(*v));
		if (!v)
			return fail(err, errlen, -ENOMEM, "out of memory");
		*out = v;
		if (!(v[*count] = strndup(a, (size_t)(b - a))))
			return fail(err, errlen, -ENOMEM, "out of memory");
		(*count)++;
	}
	return 0;
}

int access_rules_parse(const struct access_spec *spec, struct access_rules *out, char *err,
		       size_t errlen)
{
	memset(out, 0, sizeof(*out));
	char why[200];
	int rc = 0;
	const char *list = NULL;
	if (spec->allow && (rc = access_parse_nets(spec->allow, &out->allow, &out->allow_count, why,
						   sizeof(why))) < 0)
		list = "allow";
	else if (spec->deny && (rc = access_parse_nets(spec->deny, &out->deny, &out->deny_count,
						       why, sizeof(why))) < 0)
		list = "deny";
	else if (spec->allow_users &&
		 (rc = access_parse_users(spec->allow_users, &out->users, &out->user_count, why,
					  sizeof(why))) < 0)
		list = "allow-users";
	else if (spec->allow_groups &&
		 (rc = access_parse_groups(spec->allow_groups, &out->groups, &out->group_count, why,
					   sizeof(why))) < 0)
		list = "allow-groups";
	else if (spec->allow_identities &&
		 (rc = parse_identities(spec->allow_identities, &out->identities,
					&out->identity_count, why, sizeof(why))) < 0)
		list = "allow-identities";
	if (rc < 0) {
		access_rules_free(out);
		return fail(err, errlen, rc, "%s: %s", list, why);
	}
	return 0;
}

int access_check_spec(const struct access_spec *spec, char *err, size_t errlen)
{
	struct access_rules r;
	int rc = access_rules_parse(spec, &r, err, errlen);
	if (rc == 0)
		access_rules_free(&r);
	return rc;
}

static bool has_id(const uint32_t *v, size_t n, uint32_t id)
{
	for (size_t i = 0; i < n; i++)
		if (v[i] == id)
			return true;
	return false;
}

bool access_rules_allow(const struct access_rules *r, const struct access_peer *p, char *why,
			size_t whylen)
{
	if (p->is_unix) {
		if (!r->user_count && !r->group_count)
			return true;
		if (p->has_cred) {
			if (has_id(r->users, r->user_count, p->uid) ||
			    has_id(r->groups, r->group_count, p->gid))
				return true;
			for (unsigned i = 0; i < p->group_count; i++)
				if (has_id(r->groups, r->group_count, p->groups[i]))
					return true;
		}
		if (p->has_cred)
			fail(why, whylen, 0, "uid %u gid %u not in allow-users / allow-groups",
			     p->uid, p->gid);
		else
			fail(why, whylen, 0, "no peer credentials (allow-users / allow-groups)");
		return false;
	}
	for (size_t i = 0; i < r->deny_count; i++)
		if (access_net_match(&r->deny[i], p->addr)) {
			fail(why, whylen, 0, "deny %s", r->deny[i].text);
			return false;
		}
	if (!r->allow_count)
		return true;
	for (size_t i = 0; i < r->allow_count; i++)
		if (access_net_match(&r->allow[i], p->addr))
			return true;
	fail(why, whylen, 0, "not in allow list (first: %s)", r->allow[0].text);
	return false;
}

bool access_identity_allow(const struct access_rules *r, const struct access_peer *p,
			   char *why, size_t whylen)
{
	if (!r->identity_count)
		return true;
	if (!p->has_identity) {
		fail(why, whylen, 0, "no TLS identity (allow-identities)");
		return false;
	}
	for (size_t i = 0; i < r->identity_count; i++)
		if (strcmp(r->identities[i], p->identity) == 0)
			return true;
	fail(why, whylen, 0, "identity '%s' not in allow-identities", p->identity);
	return false;
}

/*
 * All of a Unix peer's supplementary groups. SO_PEERGROUPS fails with
 * ERANGE when the buffer is short, and then says in gl how long it must
 * be: grow to that and ask again (the peer's groups are fixed at its
 * connect, so the second answer fits; a few tries cover a kernel that says
 * otherwise). Without memory, or without SO_PEERGROUPS, the peer has no
 * supplementary groups: a rule on them refuses it, never lets it in.
 */
static void peer_groups(struct access_peer *p, int fd)
{
#ifdef SO_PEERGROUPS
	gid_t small[64], *groups = small;
	socklen_t gl = sizeof(small);
	int rc = -1;
	for (int tries = 0; tries < 4; tries++) {
		socklen_t have = gl;
		rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &gl);
		if (rc == 0 || errno != ERANGE || gl <= have)
			break;
		if (groups != small)
			free(groups);
		groups = malloc(gl);
		if (!groups)
			return;
	}
	unsigned n = rc == 0 ? (unsigned)(gl / sizeof(gid_t)) : 0;
	if (n && (p->groups = malloc(n * sizeof(*p->groups)))) {
		for (unsigned i = 0; i < n; i++)
			p->groups[i] = (uint32_t)groups[i];
		p->group_count = n;
	}
	if (groups != small)
		free(groups);
#else
	(void)p;
	(void)fd;
#endif
}

void access_peer_release(const struct access_peer *p)
{
	free(p->groups);
}

void access_peer_from_socket(struct access_peer *p, int fd, const void *sa, size_t len)
{
	memset(p, 0, sizeof(*p));
	const struct sockaddr *s = sa;
	if (len >= sizeof(struct sockaddr_in) && s->sa_family == AF_INET) {
		const struct sockaddr_in *in = sa;
		map_v4(p->addr, &in->sin_addr);
		p->port = ntohs(in->sin_port);
	} else if (len >= sizeof(struct sockaddr_in6) && s->sa_family == AF_INET6) {
		const struct sockaddr_in6 *in6 = sa;
		memcpy(p->addr, in6->sin6_addr.s6_addr, 16);
		p->port = ntohs(in6->sin6_port);
	} else {
		p->is_unix = true;
	}
	if (!p->is_unix) {
		char host[INET6_ADDRSTRLEN];
		if (is_v4_mapped(p->addr)) {
			inet_ntop(AF_INET, p->addr + 12, host, sizeof(host));
			snprintf(p->text, sizeof(p->text), "%s:%u", host, p->port);
		} else {
			inet_ntop(AF_INET6, p->addr, host, sizeof(host));
			snprintf(p->text, sizeof(p->text), "[%s]:%u", host, p->port);
		}
		return;
	}
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	if (fd >= 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
		p->has_cred = true;
		p->uid = (uint32_t)cred.uid;
		p->gid = (uint32_t)cred.gid;
		p->pid = (uint32_t)cred.pid;
		peer_groups(p, fd);
		snprintf(p->text, sizeof(p->text), "unix uid %u pid %u", p->uid, p->pid);
	} else {
		snprintf(p->text, sizeof(p->text), "unix (no credentials)");
	}
}

const struct access_list access_lists[ACCESS_LISTS] = {
    {"allow", offsetof(struct access_spec, allow), ' ', OPT_GIVEN_ALLOW},
    {"deny", offsetof(struct access_spec, deny), ' ', OPT_GIVEN_DENY},
    {"allow-users", offsetof(struct access_spec, allow_users), ' ', OPT_GIVEN_ALLOW_USERS},
    {"allow-groups", offsetof(struct access_spec, allow_groups), ' ', OPT_GIVEN_ALLOW_GROUPS},
    {"allow-identities", offsetof(struct access_spec, allow_identities), '\n',
     OPT_GIVEN_ALLOW_IDENTITIES},
};

const struct access_list *access_list_named(const char *key, size_t len)
{
	for (size_t i = 0; i < ACCESS_LISTS; i++)
		if (strlen(access_lists[i].key) == len && memcmp(access_lists[i].key, key, len) == 0)
			return &access_lists[i];
	return NULL;
}

int access_spec_add(struct access_spec *s, const struct access_list *l, const char *value,
		    char *err, size_t errlen)
{
	struct access_spec one = {0};
	char **mine = access_spec_list(&one, l), **slot = access_spec_list(s, l);
	if (!(*mine = strdup(value)))
		return fail(err, errlen, -ENOMEM, "out of memory");
	int rc = access_check_spec(&one, err, errlen);
	access_spec_free(&one);
	if (rc < 0)
		return rc;
	size_t had = *slot ? strlen(*slot) : 0;
	char *joined = realloc(*slot, had + strlen(value) + 2);
	if (!joined)
		return fail(err, errlen, -ENOMEM, "out of memory");
	if (had)
		joined[had++] = l->separator;
	strcpy(joined + had, value);
	*slot = joined;
	return 0;
}

void access_spec_free(struct access_spec *s)
{
	free(s->allow);
	free(s->deny);
	free(s->allow_users);
	free(s->allow_groups);
	free(s->allow_identities);
	memset(s, 0, sizeof(*s));
}

static int copy_string(char **dst, const char *src)
{
	*dst = NULL;
	if (!src)
		return 0;
	*dst = strdup(src);
	return *dst ? 0 : -ENOMEM;
}

int access_spec_copy(struct access_spec *dst, const struct access_spec *src)
{
	if (copy_string(&dst->allow, src->allow) < 0 || copy_string(&dst->deny, src->deny) < 0 ||
	    copy_string(&dst->allow_users, src->allow_users) < 0 ||
	    copy_string(&dst->allow_groups, src->allow_groups) < 0 ||
	    copy_string(&dst->allow_identities, src->allow_identities) < 0) {
		access_spec_free(dst);
		return -ENOMEM;
	}
	return 0;
}

/* ---- the policy in force ---- */

static struct {
	pthread_mutex_t lock;
	struct access_policy *current;
} published = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void policy_free(struct access_policy *p)
{
	access_rules_free(&p->global);
	access_rules_free(&p->metrics);
	for (size_t i = 0; i < p->export_count; i++) {
		free(p->exports[i].name);
		access_rules_free(&p->exports[i].rules);
	}
	free(p->exports);
	free(p);
}

int access_policy_build(const struct options *opts, struct access_policy **out, char *err,
			size_t errlen)
{
	struct access_policy *p = calloc(1, sizeof(*p));
	if (!p)
		return fail(err, errlen, -ENOMEM, "out of memory");
	atomic_init(&p->refs, 1);
	p->max_per_client = opts->max_connections_per_client;
	p->metrics_export_names_all = opts->metrics_export_names_all;
	int rc = access_rules_parse(&opts->access, &p->global, err, errlen);
	if (rc < 0)
		goto error;
	char metrics_why[256];
	rc = access_rules_parse(&opts->metrics_access, &p->metrics, metrics_why,
				sizeof(metrics_why));
	if (rc < 0) {
		fail(err, errlen, rc, "metrics: %s", metrics_why);
		goto error;
	}
	p->exports = calloc(opts->export_count ? opts->export_count : 1, sizeof(*p->exports));
	if (!p->exports) {
		rc = fail(err, errlen, -ENOMEM, "out of memory");
		goto error;
	}
	for (size_t i = 0; i < opts->export_count; i++) {
		const struct export_spec *e = &opts->exports[i];
		struct access_export_rules *x = &p->exports[p->export_count];
		char why[256];
		rc = access_rules_parse(&e->access, &x->rules, why, sizeof(why));
		if (rc < 0) {
			fail(err, errlen, rc, "export '%s': %s", e->name, why);
			goto error;
		}
		if (access_rules_empty(&x->rules))
			continue;
		x->name = strdup(e->name);
		if (!x->name) {
			access_rules_free(&x->rules);
			rc = fail(err, errlen, -ENOMEM, "out of memory");
			goto error;
		}
		p->export_count++;
	}
	*out = p;
	return 0;
error:
	policy_free(p);
	return rc;
}

void access_policy_put(struct access_policy *p)
{
	if (p && atomic_fetch_sub(&p->refs, 1) == 1)
		policy_free(p);
}

void access_policy_set(struct access_policy *p)
{
	pthread_mutex_lock(&published.lock);
	struct access_policy *old = published.current;
	published.current = p;
	pthread_mutex_unlock(&published.lock);
	access_policy_put(old);
}

struct access_policy *access_policy_get(void)
{
	pthread_mutex_lock(&published.lock);
	struct access_policy *p = published.current;
	if (p)
		atomic_fetch_add(&p->refs, 1);
	pthread_mutex_unlock(&published.lock);
	return p;
}

const struct access_rules *access_policy_export(const struct access_policy *p, const char *name)
{
	for (size_t i = 0; p && i < p->export_count; i++)
		if (strcmp(p->exports[i].name, name) == 0)
			return &p->exports[i].rules;
	return NULL;
}

bool access_export_listed(const struct access_policy *p, const char *name, bool tls_require)
{
	return !tls_require && !access_policy_export(p, name);
}
