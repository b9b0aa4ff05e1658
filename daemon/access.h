/*
 * daemon/access.h: who may connect: address and CIDR rules for TCP
 * clients, user and group rules for Unix socket clients, globally and per
 * export, and the per-client connection limit's key.
 *
 * Owns: the syntax of the rule lists (allow, deny, allow-users,
 * allow-groups), the rules parsed, the matcher, and the policy in force (one
 * published struct access_policy, replaced whole at reload). Dependency-free
 * (libc only) so it is unit tested on i386 too.
 *
 * Semantics (nbdcached(8), ACCESS CONTROL):
 *   - TLS clients: when allow-identities is set, the client must have
 *     finished a TLS handshake whose identity (certificate DN, PSK
 *     username) is one of the list, compared whole; on any transport.
 *   - TCP clients: deny wins over allow; an empty allow list lets everyone
 *     in. IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) are IPv4 addresses:
 *     they match IPv4 rules (an IPv4 rule is kept as its mapped form).
 *     User and group rules do not apply to them.
 *   - Unix socket clients: when allow-users or allow-groups is set, the
 *     peer (SO_PEERCRED) must be one of the users or have one of the
 *     groups (its primary group or, from SO_PEERGROUPS, a supplementary
 *     one, however many it has); otherwise everyone. Address rules do not apply to them.
 *   - An export's rules apply on top of the global ones: a client must
 *     pass both.
 *
 * Threads: parsing and access_policy_build() on the thread that reads the
 * configuration (main thread at start, control thread at reload);
 * access_policy_get() / access_policy_put() / access_policy_set() from any
 * thread (a mutex guards the published pointer; a policy is freed when the
 * last reference goes).
 */
#ifndef NBDCACHED_DAEMON_ACCESS_H
#define NBDCACHED_DAEMON_ACCESS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* The rule lists as given (config keys, command-line options, export keys). */
struct access_spec {
	char *allow, *deny, *allow_users, *allow_groups; /* NULL: not given */
	char *allow_identities; /* TLS identities, one per line (DNs hold commas) */
};

/* One address rule: IPv6, or IPv4 kept as ::ffff:a.b.c.d (prefix + 96). */
struct access_net {
	uint8_t addr[16];
	unsigned prefix; /* 0..128 */
	char text[64];	 /* as written, for the log */
};

struct access_rules {
	struct access_net *allow, *deny;
	size_t allow_count, deny_count;
	uint32_t *users, *groups; /* uids, gids */
	size_t user_count, group_count;
	char **identities; /* TLS: certificate DNs or PSK usernames */
	size_t identity_count;
};

/* Who a connection comes from. */
struct access_peer {
	bool is_unix;
	uint8_t addr[16]; /* TCP: IPv6, or IPv4 as ::ffff:a.b.c.d */
	uint16_t port;
	bool has_cred;		/* Unix: SO_PEERCRED worked */
	uint32_t uid, gid, pid; /* Unix */
	uint32_t *groups;	/* Unix: supplementary groups (SO_PEERGROUPS), all of
				 * them (malloc'd; access_peer_release) */
	unsigned group_count;
	char text[64]; /* "127.0.0.1:5000", "[::1]:5000", "unix uid 0 pid 12" */
	/* TLS, once its handshake is done: the client certificate's DN or
	 * the PSK username (has_identity false before, and without TLS). */
	bool has_identity;
	char identity[256];
};

/*
 * The rule lists of struct access_spec, in one table for the command line
 * (--allow ..., --export ...,allow=...), the config file and
 * --check-config: the key, where its list is in the spec, what joins items
 * added one by one (identities hold commas and blanks: one per line), and
 * its bit in options.given (OPT_GIVEN_*).
 */
struct access_list {
	const char *key;
	size_t offset; /* of its char * in struct access_spec */
	char separator;
	uint64_t given;
};
#define ACCESS_LISTS 5
extern const struct access_list access_lists[ACCESS_LISTS];
/* The list named key (len bytes), or NULL. */
const struct access_list *access_list_named(const char *key, size_t len);
static inline char **access_spec_list(struct access_spec *s, const struct access_list *l)
{
	return (char **)(void *)((char *)s + l->offset);
}
/* Check value as items of list l, then add them to s's list: 0, -EINVAL
 * (the reason in err) or -ENOMEM. */
int access_spec_add(struct access_spec *s, const struct access_list *l, const char *value,
		    char *err, size_t errlen);

/* Parse an address list (addresses and CIDRs, IPv4 and IPv6, comma or
 * space separated) into a new array; 0 or -EINVAL with a reason in err. */
int access_parse_nets(const char *text, struct access_net **out, size_t *count, char *err,
		      size_t errlen);
/* Parse user (or group) names or numeric ids, comma or space separated;
 * names are looked up now (getpwnam_r / getgrnam_r). */
int access_parse_users(const char *text, uint32_t **out, size_t *count, char *err, size_t errlen);
int access_parse_groups(const char *text, uint32_t **out, size_t *count, char *err, size_t errlen);
/* Check a whole spec: 0, or -EINVAL naming the list and the bad item. */
int access_check_spec(const struct access_spec *spec, char *err, size_t errlen);
int access_rules_parse(const struct access_spec *spec, struct access_rules *out, char *err,
		       size_t errlen);
void access_rules_free(struct access_rules *r);
bool access_rules_empty(const struct access_rules *r);

/* Does net match addr (16 bytes, IPv4 mapped)? */
bool access_net_match(const struct access_net *net, const uint8_t addr[16]);
/*
 * May the peer pass these rules? When not, why (if not NULL) says which
 * rule refused it: "deny 127.0.0.2/32", "not in allow 127.0.0.1",
 * "uid 1001 gid 1001 not in allow-users / allow-groups".
 */
bool access_rules_allow(const struct access_rules *r, const struct access_peer *p, char *why,
			size_t whylen);
/*
 * May the peer's TLS identity pass these rules' allow-identities (any
 * identity when the list is empty)? Checked when a client opens an export
 * (the accept-time check cannot: no TLS yet). Why as above: "no TLS
 * identity (allow-identities)", "identity 'CN=x' not in allow-identities".
 */
bool access_identity_allow(const struct access_rules *r, const struct access_peer *p,
			   char *why, size_t whylen);

/*
 * Fill a peer from a socket address (sa, len) and, for Unix sockets, fd's
 * credentials and every supplementary group (the buffer grows to what
 * SO_PEERGROUPS says it needs). The peer owns its groups: a copy of the
 * struct takes them over (the accept thread hands the peer to a worker,
 * the worker to its connection), and whoever holds the peer last calls
 * access_peer_release().
 */
void access_peer_from_socket(struct access_peer *p, int fd, const void *sa, size_t len);
/* Free what the peer holds (its groups). */
void access_peer_release(const struct access_peer *p);

void access_spec_free(struct access_spec *s);
int access_spec_copy(struct access_spec *dst, const struct access_spec *src);

/* The policy in force: global rules, each export's, the per-client limit. */
struct access_export_rules {
	char *name;
	struct access_rules rules;
};

struct access_policy {
	atomic_uint refs;
	struct access_rules global;
	struct access_export_rules *exports; /* only exports that have rules */
	size_t export_count;
	unsigned max_per_client; /* 0: unlimited */
	/* Who may fetch /metrics (metrics-allow, metrics-deny; daemon/metrics.h). */
	struct access_rules metrics;
	/* metrics-export-names all: the page names every export; else only
	 * those access_export_listed() says LIST shows to every client. */
	bool metrics_export_names_all;
};

struct options;
/* Build a policy from opts (refs 1): 0, or -EINVAL / -ENOMEM with err. */
int access_policy_build(const struct options *opts, struct access_policy **out, char *err,
			size_t errlen);
/* Publish p (takes its reference); the previous one is put. NULL: none. */
void access_policy_set(struct access_policy *p);
/* The policy in force, referenced (NULL when none was set); put it after. */
struct access_policy *access_policy_get(void);
void access_policy_put(struct access_policy *p);
/* An export's rules in p, or NULL when it has none. */
const struct access_rules *access_policy_export(const struct access_policy *p, const char *name);
/*
 * Does LIST show the export of this name (its rules' name: a split window
 * is its export's) to every client that the global rules admit? Not when
 * it has rules of its own (any list: LIST hides it from whom they refuse)
 * or tls = require (hidden until STARTTLS). The /metrics page names only
 * such exports unless metrics-export-names is all (daemon/metrics.h).
 */
bool access_export_listed(const struct access_policy *p, const char *name, bool tls_require);

#endif
