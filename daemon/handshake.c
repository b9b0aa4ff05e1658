/*
 * daemon/handshake.c: fixed newstyle negotiation, server side.
 *
 *   S: NBDMAGIC IHAVEOPT flags     (handshake_send_greeting)
 *   C: client flags                (CONN_FLAGS)
 *   C: IHAVEOPT option length data (CONN_OPTIONS, repeated)
 *   S: option replies ...
 *   ... until GO or EXPORT_NAME succeeds -> CONN_TRANSMISSION
 *
 * Every option is parsed by proto/ from a contiguous view of the input
 * buffer (evbuffer_pullup), so option data is never copied or allocated
 * separately. Option data is bounded by CONN_MAX_OPTION_LENGTH: a longer
 * option is answered with NBD_REP_ERR_TOO_BIG and the connection closed,
 * without reading it.
 */
#include "daemon/handshake.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/access.h"
#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/log.h"
#include "daemon/tls.h"
#include "daemon/upgrade_record.h"
#include "daemon/worker.h"

#define KNOWN_CLIENT_FLAGS (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)

void handshake_send_greeting(struct conn *c)
{
	uint8_t buf[NBD_GREETING_SIZE];
	size_t n = nbd_encode_greeting(buf, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
	conn_add(c, buf, n);
	if (c->bev)
		tls_conn_begin(c); /* the TLS mode of this connection, for its whole life */
}

static void option_reply(struct conn *c, uint32_t option, uint32_t type, const void *data,
			 size_t len)
{
	uint8_t hdr[NBD_OPTION_REPLY_HEADER_SIZE];
	nbd_encode_option_reply(hdr, option, type, (uint32_t)len);
	conn_add(c, hdr, sizeof(hdr));
	if (len)
		conn_add(c, data, len);
}

static void option_error(struct conn *c, uint32_t option, uint32_t type, const char *message)
{
	log_debug("conn %llu: %s -> %s: %s", (unsigned long long)c->id, nbd_opt_name(option),
		  nbd_rep_name(type), message);
	option_reply(c, option, type, message, strlen(message));
}

static void option_ack(struct conn *c, uint32_t option)
{
	option_reply(c, option, NBD_REP_ACK, NULL, 0);
}

/* Reply with a prefix and a string, in one NBD_REP_* message. */
static void option_reply_prefixed(struct conn *c, uint32_t option, uint32_t type,
				  const void *prefix, size_t prefix_len, const char *a,
				  size_t a_len, const char *b, size_t b_len)
{
	uint8_t hdr[NBD_OPTION_REPLY_HEADER_SIZE];
	nbd_encode_option_reply(hdr, option, type, (uint32_t)(prefix_len + a_len + b_len));
	conn_add(c, hdr, sizeof(hdr));
	conn_add(c, prefix, prefix_len);
	if (a_len)
		conn_add(c, a, a_len);
	if (b_len)
		conn_add(c, b, b_len);
}

/* What a client may know of an export (export_view). */
enum export_view {
	EXPORT_OPEN,	  /* it may open it */
	EXPORT_NEEDS_TLS, /* its address or user may, but only after STARTTLS */
	EXPORT_HIDDEN,	  /* the rules refuse it: answered as if there were no such export */
};

/*
 * The one place that decides what a client may know of e, for LIST, INFO,
 * GO, the meta context options and EXPORT_NAME alike (export_view), and
 * for a connection a live upgrade hands over (handshake_resume_export), by
 * the access rules in force now (a reload changes them for the
 * negotiations that follow; a new daemon's are its configuration's). The
 * client is peer, with TLS or not (secure). The rules of a split window
 * are its export's (export_rules_name): its address, user, group and
 * identity rules, as its tls and its connection limit are. The global
 * rules were checked at accept; they are checked again here, in case a
 * reload tightened them meanwhile. Address and user rules come before TLS
 * (a refused client does not learn that an export wants TLS); identity
 * rules after it (without TLS there is no identity). When hidden, why and
 * *scope say which rule.
 */
static enum export_view peer_view(const struct access_peer *peer, bool secure,
				  const struct export *e, char *why, size_t len, const char **scope)
{
	struct access_policy *p = access_policy_get();
	const struct access_rules *r = access_policy_export(p, export_rules_name(e));
	enum export_view v = EXPORT_HIDDEN;
	*scope = "global access rules";
	if (p && !access_rules_allow(&p->global, peer, why, len))
		goto out;
	*scope = "the export's access rules";
	if (r && !access_rules_allow(r, peer, why, len))
		goto out;
	v = EXPORT_NEEDS_TLS; /* SELECTIVETLS: tls = require, and no TLS yet */
	if (e->tls_require && !secure)
		goto out;
	v = EXPORT_HIDDEN;
	*scope = "global access rules";
	if (p && !access_identity_allow(&p->global, peer, why, len))
		goto out;
	*scope = "the export's access rules";
	if (r && !access_identity_allow(r, peer, why, len))
		goto out;
	v = EXPORT_OPEN;
out:
	access_policy_put(p);
	return v;
}

static enum export_view export_view(const struct conn *c, const struct export *e, char *why,
				    size_t len, const char **scope)
{
	return peer_view(&c->peer, tls_conn_secure(c), e, why, len, scope);
}

LOG_LIMIT(refused_export_log, "refused exports");
LOG_LIMIT(export_full_log, "exports at their connection limit");
LOG_LIMIT_SESSIONS(negotiated_log, "exports negotiated");

/* export_view() for a client that named e (NULL: no such export): a
 * refusal is logged, once per connection (and under a rate limit). */
static enum export_view export_view_named(struct conn *c, const struct export *e)
{
	if (!e)
		return EXPORT_HIDDEN;
	char why[320] = "";
	const char *scope;
	enum export_view v = export_view(c, e, why, sizeof(why), &scope);
	if (v == EXPORT_HIDDEN && !c->access_logged) {
		const char *of = e->window_of ? "' (a window of '" : "";
		log_limited(&refused_export_log, LOG_WARN,
			    "conn %llu: refused %s export '%s%s%s%s: %s (%s)",
			    (unsigned long long)c->id, c->peer.text, e->name, of,
			    e->window_of ? e->window_of : "", e->window_of ? "')" : "'", why,
			    scope);
		c->access_logged = true;
	}
	return v;
}

/* Attach c to e for transmission: false (logged) when e and its windows
 * already have max_connections. */
static bool attach(struct conn *c, struct export *e)
{
	if (export_attach(e))
		return true;
	log_limited(&export_full_log, LOG_WARN, "conn %llu: export '%s' has its %u connections",
		    (unsigned long long)c->id, export_rules_name(e), e->max_connections);
	return false;
}

/* Takes over the caller's reference to e, and its attachment. */
static void enter_transmission(struct conn *c, struct export *e)
{
	c->export = e;
	atomic_store(&c->export_name, e->name);
	c->phase = CONN_TRANSMISSION;
	c->seen_error = cache_export_error_seq(e->cache);
	conn_negotiation_done(c); /* idle clients are fine from now on */
	c->session = (struct nbd_session){
		.structured = c->structured,
		.extended = c->extended,
		.block_status = c->meta_selected && c->meta_export &&
				c->meta_export->backing == e->backing,
		.eflags = export_eflags(e, c->structured),
		.size = export_size(e),
		.max_payload = e->max_payload,
		.min_block = e->backend->min_block,
	};
	log_limited(&negotiated_log, LOG_INFO,
		    "conn %llu: export \"%s\" negotiated structured=%d extended=%d meta=%d",
		    (unsigned long long)c->id, e->name, c->structured, c->extended,
		    c->session.block_status);
}

/* A backend as the log names it: its string, and a file's identity. */
static void describe_backend(char *out, size_t len, const char *spec, bool file, uint64_t dev,
			     uint64_t ino)
{
	if (!file)
		snprintf(out, len, "%s", spec);
	else if (ino == 0)
		snprintf(out, len, "%s (block device 0x%llx)", spec, (unsigned long long)dev);
	else
		snprintf(out, len, "%s (device 0x%llx, inode %llu)", spec, (unsigned long long)dev,
			 (unsigned long long)ino);
}

/*
 * Is e the object that the connection st describes read and wrote: the
 * same backend at the same offset? A file or block device is the same by
 * its device and inode, whatever path names it now (a file replaced under
 * the old path is not); another backend by its string, which is all that
 * names it (an NBD server's URI, an RBD image's spec). false: why says
 * what each is.
 */
static bool same_object(const struct export *e, const struct upgrade_conn_state *st, char *why,
			size_t len)
{
	const struct backend *be = e->backend;
	if (!(st->flags & UPGRADE_CONN_IDENTITY)) {
		snprintf(
		    why, len,
		    "upgrade: handed over without its backend's identity (by an older "
		    "nbdcached): whether export \"%s\" is still on the object it was on cannot "
		    "be checked",
		    st->name);
		return false;
	}
	bool same = st->backend_kind == UPGRADE_BACKEND_FILE
			? be->ident_file && be->ident_dev == st->backend_dev &&
			      be->ident_ino == st->backend_ino
			: !be->ident_file && strcmp(e->backing->spec, st->backend) == 0;
	if (!same) {
		char now[512], was[512];
		describe_backend(now, sizeof(now), e->backing->spec, be->ident_file, be->ident_dev,
				 be->ident_ino);
		describe_backend(was, sizeof(was), st->backend,
				 st->backend_kind == UPGRADE_BACKEND_FILE, st->backend_dev,
				 st->backend_ino);
		snprintf(why, len,
			 "upgrade: export \"%s\" is on another backend now: %s; the connection was "
			 "on %s",
			 e->name, now, was);
		return false;
	}
	if (e->offset != st->offset) {
		snprintf(why, len,
			 "upgrade: export \"%s\" is another window of %s now: from byte %llu; the "
			 "connection's began at byte %llu",
			 e->name, e->backing->spec, (unsigned long long)e->offset,
			 (unsigned long long)st->offset);
		return false;
	}
	return true;
}

struct export *handshake_resume_export(struct export_table *t, const struct upgrade_conn_state *st,
				       const struct access_peer *peer, char *why, size_t len)
{
	char rule[320] = "";
	const char *scope;
	struct export *e = export_get(t, st->name, strlen(st->name));
	if (!e) {
		snprintf(why, len, "upgrade: export \"%s\" is not in the new configuration",
			 st->name);
		return NULL;
	}
	if (!same_object(e, st, why, len))
		goto refused;
	/* Handed over in plaintext: a TLS session is never moved. */
	enum export_view v = peer_view(peer, false, e, rule, sizeof(rule), &scope);
	if (v == EXPORT_NEEDS_TLS) {
		snprintf(why, len,
			 "upgrade: export \"%s\" requires TLS now (tls = require), which this "
			 "connection does not use",
			 e->name);
		goto refused;
	}
	if (v == EXPORT_HIDDEN) {
		snprintf(why, len, "upgrade: %s is no longer admitted to export \"%s\": %s (%s)",
			 peer->text, e->name, rule, scope);
		goto refused;
	}
	uint16_t eflags = export_eflags(e, (st->flags & UPGRADE_CONN_STRUCTURED) != 0);
	if (export_size(e) != st->size || eflags != st->tx_flags ||
	    e->backend->min_block != st->min_block || e->block_size != st->pref_block ||
	    e->max_payload != st->max_payload) {
		snprintf(why, len,
			 "upgrade: export \"%s\" changed (size %llu, flags 0x%x, block sizes "
			 "%u/%u/%u; the client has %llu, 0x%x, %u/%u/%u)",
			 e->name, (unsigned long long)export_size(e), eflags, e->backend->min_block,
			 e->block_size, e->max_payload, (unsigned long long)st->size, st->tx_flags,
			 st->min_block, st->pref_block, st->max_payload);
		goto refused;
	}
	return e;
refused:
	export_put(e);
	return NULL;
}

bool handshake_resume(struct conn *c, const struct upgrade_conn_state *st)
{
	/* The new daemon checked it before it confirmed the hand-over
	 * (adopt_connections); a reload since could have changed the answer. */
	char why[1024];
	struct export *e = handshake_resume_export(c->set->exports, st, &c->peer, why, sizeof(why));
	if (!e) {
		conn_kill(c, why);
		return false;
	}
	c->structured = (st->flags & UPGRADE_CONN_STRUCTURED) != 0;
	c->extended = (st->flags & UPGRADE_CONN_EXTENDED) != 0;
	if (!attach(c, e)) {
		export_put(e);
		conn_kill(c, "upgrade: the export is at its connection limit");
		return false;
	}
	/* The meta context was selected for this export (block status). */
	c->meta_selected = (st->flags & UPGRADE_CONN_META) != 0;
	if (c->meta_selected) {
		export_ref(e);
		c->meta_export = e;
	}
	enter_transmission(c, e);
	return true;
}

/* The refusal of such an export: TLS_REQD, but never to a connection that
 * began while TLS was off (NOTLS must not send it; the export came with a
 * reload that turned TLS on). */
static void refuse_needs_tls(struct conn *c, uint32_t option)
{
	if (tls_conn_mode(c) == TLS_OFF)
		option_error(c, option, NBD_REP_ERR_POLICY,
			     "this export requires TLS, which this connection cannot use");
	else
		option_error(c, option, NBD_REP_ERR_TLS_REQD,
			     "this export requires TLS: send NBD_OPT_STARTTLS first");
}

static void handle_export_name(struct conn *c, const char *data, uint32_t len)
{
	if (c->extended) {
		conn_kill(c, "EXPORT_NAME after extended headers");
		return;
	}
	/* EXPORT_NAME cannot fail: the spec wants the session ended. A hidden
	 * export ends it as an unknown one does. */
	struct export *e = export_get(c->set->exports, data, len);
	enum export_view v = export_view_named(c, e);
	if (v != EXPORT_OPEN || !attach(c, e)) {
		export_put(e);
		conn_kill(c, v == EXPORT_HIDDEN ? "EXPORT_NAME of an unknown export"
			     : v == EXPORT_NEEDS_TLS
				 ? "EXPORT_NAME without TLS of an export with tls = require"
				 : "EXPORT_NAME of an export at its connection limit");
		return;
	}
	uint8_t buf[NBD_EXPORT_NAME_REPLY_SIZE];
	size_t n = nbd_encode_export_name_reply(buf, export_size(e),
						export_eflags(e, c->structured), c->no_zeroes);
	conn_add(c, buf, n);
	enter_transmission(c, e);
}

static void send_info(struct conn *c, uint32_t option, const struct export *e,
		      const struct nbd_opt_go *go)
{
	uint8_t buf[NBD_INFO_BLOCK_SIZE_SIZE];
	bool want_name = false, want_description = false;
	for (uint16_t i = 0; i < go->info_count; i++) {
		uint16_t t = nbd_opt_go_info(go, i);
		want_name |= t == NBD_INFO_NAME;
		want_description |= t == NBD_INFO_DESCRIPTION;
	}
	size_t n = nbd_encode_info_export(buf, export_size(e), export_eflags(e, c->structured));
	option_reply(c, option, NBD_REP_INFO, buf, n);
	if (want_name) {
		n = nbd_encode_info_type(buf, NBD_INFO_NAME);
		option_reply_prefixed(c, option, NBD_REP_INFO, buf, n, e->name, strlen(e->name),
				      NULL, 0);
	}
	if (want_description && e->description) {
		n = nbd_encode_info_type(buf, NBD_INFO_DESCRIPTION);
		option_reply_prefixed(c, option, NBD_REP_INFO, buf, n, e->description,
				      strlen(e->description), NULL, 0);
	}
	/* Always sent: a client that ignores it loses nothing (minimum is 1). */
	n = nbd_encode_info_block_size(buf, e->backend->min_block, e->block_size, e->max_payload);
	option_reply(c, option, NBD_REP_INFO, buf, n);
}

/*
 * The export an INFO, GO or meta context option names, referenced, when
 * this client may use it; else NULL, the option answered: no such export,
 * or one the access rules hide from it (UNKNOWN, the same answer: a
 * refused client does not learn which names exist), or TLS first
 * (TLS_REQD, or POLICY in NOTLS mode).
 */
static struct export *option_export(struct conn *c, uint32_t option, const char *name,
				    size_t len)
{
	struct export *e = export_get(c->set->exports, name, len);
	switch (export_view_named(c, e)) {
	case EXPORT_OPEN:
		return e;
	case EXPORT_NEEDS_TLS:
		refuse_needs_tls(c, option);
		break;
	case EXPORT_HIDDEN:
		option_error(c, option, NBD_REP_ERR_UNKNOWN, "no such export");
		break;
	}
	export_put(e);
	return NULL;
}

static void handle_info_go(struct conn *c, uint32_t option, const uint8_t *data, uint32_t len)
{
	struct nbd_opt_go go;
	if (nbd_parse_opt_go(data, len, &go) < 0) {
		option_error(c, option, NBD_REP_ERR_INVALID, "malformed INFO/GO request");
		return;
	}
	struct export *e = option_export(c, option, go.name, go.name_length);
	if (!e)
		return;
	if (option == NBD_OPT_GO && !attach(c, e)) {
		option_error(c, option, NBD_REP_ERR_POLICY,
			     "the export has reached its maximum number of connections");
		export_put(e);
		return;
	}
	send_info(c, option, e, &go);
	option_ack(c, option);
	if (option == NBD_OPT_GO)
		enter_transmission(c, e);
	else
		export_put(e);
}

static void handle_list(struct conn *c, uint32_t len)
{
	if (len != 0) {
		option_error(c, NBD_OPT_LIST, NBD_REP_ERR_INVALID, "LIST takes no data");
		return;
	}
	struct export **list;
	size_t count;
	if (export_list(c->set->exports, &list, &count) < 0) {
		option_error(c, NBD_OPT_LIST, NBD_REP_ERR_UNSUP, "out of memory");
		return;
	}
	for (size_t i = 0; i < count; i++) {
		const struct export *e = list[i];
		/* Only what the client may open, not what needs TLS first (the
		 * spec allows that); no log line: a LIST is no refusal. */
		const char *scope;
		if (export_view(c, e, NULL, 0, &scope) != EXPORT_OPEN)
			continue;
		uint8_t prefix[4];
		size_t name_len = strlen(e->name);
		size_t n = nbd_encode_rep_server_prefix(prefix, (uint32_t)name_len);
		option_reply_prefixed(c, NBD_OPT_LIST, NBD_REP_SERVER, prefix, n, e->name,
				      name_len, e->description,
				      e->description ? strlen(e->description) : 0);
	}
	for (size_t i = 0; i < count; i++)
		export_put(list[i]);
	free(list);
	option_ack(c, NBD_OPT_LIST);
}

static void handle_meta(struct conn *c, uint32_t option, const uint8_t *data, uint32_t len)
{
	bool set = option == NBD_OPT_SET_META_CONTEXT;
	if (set) {
		/* SET replaces the selection, even when it fails. */
		c->meta_selected = false;
		export_put(c->meta_export);
		c->meta_export = NULL;
	}
	if (!c->structured) {
		option_error(c, option, NBD_REP_ERR_INVALID,
			     "negotiate structured replies or extended headers first");
		return;
	}
	struct nbd_opt_meta meta;
	if (nbd_parse_opt_meta(data, len, &meta) < 0) {
		option_error(c, option, NBD_REP_ERR_INVALID, "malformed meta context request");
		return;
	}
	struct export *e = option_export(c, option, meta.name, meta.name_length);
	if (!e)
		return;
	bool selected = !set && meta.query_count == 0; /* LIST with no query: all */
	struct nbd_meta_iter it;
	const char *q;
	uint32_t qlen;
	nbd_meta_iter_init(&it, &meta);
	while (nbd_meta_iter_next(&it, &q, &qlen)) {
		if (!nbd_meta_query_valid(q, qlen)) {
			option_error(c, option, NBD_REP_ERR_INVALID, "malformed meta context query");
			export_put(e);
			return;
		}
		if (set ? (qlen == strlen(NBD_META_BASE_ALLOCATION) &&
			   memcmp(q, NBD_META_BASE_ALLOCATION, qlen) == 0)
			: nbd_meta_query_selects_base_allocation(q, qlen))
			selected = true;
	}
	if (selected) {
		uint8_t prefix[4];
		size_t n = nbd_encode_meta_context_prefix(prefix, set ? CONN_META_CONTEXT_ID : 0);
		option_reply_prefixed(c, option, NBD_REP_META_CONTEXT, prefix, n,
				      NBD_META_BASE_ALLOCATION, strlen(NBD_META_BASE_ALLOCATION),
				      NULL, 0);
	}
	if (set && selected) {
		c->meta_selected = true;
		c->meta_export = e;
		e = NULL;
	}
	export_put(e);
	option_ack(c, option);
}

/*
 * STARTTLS (see the spec's "TLS support"). Refused with POLICY when TLS is
 * off here (the server can do TLS; this configuration does not); INVALID
 * once TLS is running. Otherwise the ACK goes out in plaintext, the TLS
 * handshake follows, and negotiation starts again: what was negotiated in
 * plaintext is forgotten.
 */
static void handle_starttls(struct conn *c, uint32_t len)
{
	if (len) {
		option_error(c, NBD_OPT_STARTTLS, NBD_REP_ERR_INVALID, "STARTTLS takes no data");
		return;
	}
	if (tls_conn_mode(c) == TLS_OFF) {
		option_error(c, NBD_OPT_STARTTLS, NBD_REP_ERR_POLICY,
			     "TLS is not enabled on this server");
		return;
	}
	if (c->tls) {
		option_error(c, NBD_OPT_STARTTLS, NBD_REP_ERR_INVALID, "TLS is already running");
		return;
	}
	option_ack(c, NBD_OPT_STARTTLS);
	c->structured = false;
	c->extended = false;
	c->meta_selected = false;
	export_put(c->meta_export);
	c->meta_export = NULL;
	tls_start(c);
}

/* FORCEDTLS: before TLS, every option but STARTTLS and ABORT is refused
 * (EXPORT_NAME, which cannot be, ends the session). True when refused. */
static bool tls_refused(struct conn *c, uint32_t option)
{
	if (tls_conn_mode(c) != TLS_REQUIRE || tls_conn_secure(c) || option == NBD_OPT_STARTTLS ||
	    option == NBD_OPT_ABORT)
		return false;
	if (option == NBD_OPT_EXPORT_NAME)
		conn_kill(c, "EXPORT_NAME without TLS (tls = require)");
	else
		option_error(c, option, NBD_REP_ERR_TLS_REQD,
			     "TLS is required: send NBD_OPT_STARTTLS first");
	return true;
}

/* One option whose data (len bytes) is contiguous at data. */
static void handle_option(struct conn *c, uint32_t option, const uint8_t *data, uint32_t len)
{
	log_debug("conn %llu: option %s, %u bytes", (unsigned long long)c->id,
		  nbd_opt_name(option), len);
	if (tls_refused(c, option))
		return;
	switch (option) {
	case NBD_OPT_EXPORT_NAME:
		handle_export_name(c, (const char *)data, len);
		return;
	case NBD_OPT_ABORT:
		option_ack(c, option);
		c->abort_requested = true;
		return;
	case NBD_OPT_LIST:
		handle_list(c, len);
		return;
	case NBD_OPT_STARTTLS:
		handle_starttls(c, len);
		return;
	case NBD_OPT_INFO:
	case NBD_OPT_GO:
		handle_info_go(c, option, data, len);
		return;
	case NBD_OPT_STRUCTURED_REPLY:
		if (len)
			option_error(c, option, NBD_REP_ERR_INVALID, "option takes no data");
		else if (c->extended)
			option_error(c, option, NBD_REP_ERR_EXT_HEADER_REQD,
				     "extended headers already negotiated");
		else {
			c->structured = true;
			option_ack(c, option);
		}
		return;
	case NBD_OPT_EXTENDED_HEADERS:
		if (len) {
			option_error(c, option, NBD_REP_ERR_INVALID, "option takes no data");
		} else {
			c->extended = true;
			c->structured = true;
			option_ack(c, option);
		}
		return;
	case NBD_OPT_LIST_META_CONTEXT:
	case NBD_OPT_SET_META_CONTEXT:
		handle_meta(c, option, data, len);
		return;
	default:
		option_error(c, option, NBD_REP_ERR_UNSUP, "unknown option");
		return;
	}
}

int handshake_step(struct conn *c)
{
	struct evbuffer *in = conn_input(c);
	size_t avail = evbuffer_get_length(in);
	if (c->discard) {
		/* Never used in negotiation: oversize options close the connection. */
		return -1;
	}
	if (c->phase == CONN_FLAGS) {
		uint8_t buf[NBD_CLIENT_FLAGS_SIZE];
		uint32_t flags;
		if (avail < sizeof(buf))
			return 0;
		evbuffer_remove(in, buf, sizeof(buf));
		nbd_decode_client_flags(buf, sizeof(buf), &flags);
		if (flags & ~KNOWN_CLIENT_FLAGS) {
			conn_kill(c, "unknown client flags");
			return -1;
		}
		c->no_zeroes = flags & NBD_FLAG_C_NO_ZEROES;
		c->phase = CONN_OPTIONS;
		return 1;
	}
	if (avail < NBD_OPTION_HEADER_SIZE)
		return 0;
	uint8_t hdr[NBD_OPTION_HEADER_SIZE];
	struct nbd_option opt;
	evbuffer_copyout(in, hdr, sizeof(hdr));
	if (nbd_decode_option(hdr, sizeof(hdr), &opt) < 0) {
		conn_kill(c, "bad option magic");
		return -1;
	}
	if (opt.length > CONN_MAX_OPTION_LENGTH) {
		option_error(c, opt.option, NBD_REP_ERR_TOO_BIG, "option data too long");
		conn_begin_close(c, "option data too long");
		return -1;
	}
	size_t total = NBD_OPTION_HEADER_SIZE + (size_t)opt.length;
	if (avail < total)
		return 0;
	const uint8_t *p = evbuffer_pullup(in, (ev_ssize_t)total);
	if (!p) {
		conn_kill(c, "out of memory");
		return -1;
	}
	handle_option(c, opt.option, p + NBD_OPTION_HEADER_SIZE, opt.length);
	if (c->bev)
		evbuffer_drain(in, total);
	if (c->bev && c->abort_requested) {
		conn_begin_close(c, "client ended negotiation (NBD_OPT_ABORT)");
		return -1;
	}
	return c->bev ? 1 : -1;
}
