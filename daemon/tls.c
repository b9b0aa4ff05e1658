/*
 * daemon/tls.c: TLS for NBD connections (see tls.h).
 *
 *   conn->bev = filter bufferevent          plaintext: what conn.c,
 *     input  <- tls_filter_in  (decrypt)    handshake.c and transmit.c see
 *     output -> tls_filter_out (encrypt)
 *        |  gnutls_record_recv / gnutls_record_send
 *        v  pull / push
 *   socket bufferevent (underlying)         ciphertext
 *
 * Failures are never acted on inside libevent's filter callbacks: the
 * reason is kept, one log line written, and the connection killed from its
 * own event (tls_on_notify) on the next loop turn. The same event re-runs
 * conn_update_reading() when the last ciphertext of a closing connection
 * has left, since nothing else would.
 */
#include "daemon/tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/conn.h"
#include "daemon/log.h"
#include "daemon/worker.h"

struct tls_psk_key {
	char *username;
	gnutls_datum_t key;
};

struct tls_creds {
	atomic_uint refs;
	enum tls_mode mode;
	bool verify_peer;
	gnutls_priority_t priority;
	gnutls_certificate_credentials_t x509; /* NULL: no certificate directory */
	gnutls_psk_server_credentials_t psk;   /* NULL: no PSK file */
	struct tls_psk_key *keys;
	size_t key_count;
	char *certificates, *psk_file, *priority_string; /* as configured */
};

/* One connection's session: the filter's context, freed with the filter. */
struct tls_conn {
	struct conn *conn; /* NULL once the connection let go (tls_conn_end) */
	gnutls_session_t session;
	struct tls_creds *creds; /* a reference */
	struct bufferevent *under;
	struct evbuffer_cb_entry *under_cb;
	struct event *notify;
	bool handshake_done;
	bool bye_sent;
	bool failed;
	char why[256];
	char peer[96]; /* the client's address, for the log */
};

/* ------------------------------------------------------------------ */
/* Credentials                                                         */
/* ------------------------------------------------------------------ */

static pthread_mutex_t installed_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tls_creds *installed;

static void creds_free(struct tls_creds *cr)
{
	if (cr->priority)
		gnutls_priority_deinit(cr->priority);
	if (cr->x509)
		gnutls_certificate_free_credentials(cr->x509);
	if (cr->psk)
		gnutls_psk_free_server_credentials(cr->psk);
	for (size_t i = 0; i < cr->key_count; i++) {
		free(cr->keys[i].username);
		if (cr->keys[i].key.data) {
			memset(cr->keys[i].key.data, 0, cr->keys[i].key.size);
			gnutls_free(cr->keys[i].key.data);
		}
	}
	free(cr->keys);
	free(cr->certificates);
	free(cr->psk_file);
	free(cr->priority_string);
	free(cr);
}

void tls_creds_put(struct tls_creds *cr)
{
	if (cr && atomic_fetch_sub(&cr->refs, 1) == 1)
		creds_free(cr);
}

static struct tls_creds *creds_ref(struct tls_creds *cr)
{
	if (cr)
		atomic_fetch_add(&cr->refs, 1);
	return cr;
}

void tls_creds_install(struct tls_creds *cr)
{
	pthread_mutex_lock(&installed_lock);
	struct tls_creds *old = installed;
	installed = cr;
	pthread_mutex_unlock(&installed_lock);
	tls_creds_put(old);
}

void tls_creds_uninstall(void)
{
	tls_creds_install(NULL);
}

/* The session's connection record, found from GnuTLS's callbacks. */
static struct tls_conn *session_tls(gnutls_session_t s)
{
	return gnutls_session_get_ptr(s);
}

static void tls_note(struct tls_conn *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Keep the first precise reason a callback gave (the handshake's error
 * code alone would say less). */
static void tls_note(struct tls_conn *t, const char *fmt, ...)
{
	if (!t || t->why[0])
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(t->why, sizeof(t->why), fmt, ap);
	va_end(ap);
}

/* Client certificates, when tls-verify-peer: signed by the CA, in date, not
 * revoked by the CRL. Run during the handshake, so a refusal is an alert. */
static int verify_client(gnutls_session_t s)
{
	struct tls_conn *t = session_tls(s);
	unsigned status = 0;
	int rc = gnutls_certificate_verify_peers2(s, &status);
	if (rc < 0) {
		tls_note(t, "client certificate: %s", gnutls_strerror(rc));
		return -1;
	}
	if (status) {
		gnutls_datum_t out = {NULL, 0};
		if (gnutls_certificate_verification_status_print(status, GNUTLS_CRT_X509, &out,
								 0) == 0) {
			tls_note(t, "client certificate: %s", (const char *)out.data);
			gnutls_free(out.data);
		} else {
			tls_note(t, "client certificate not trusted (status %#x)", status);
		}
		return -1;
	}
	return 0;
}

static int psk_lookup(gnutls_session_t s, const char *username, gnutls_datum_t *key)
{
	struct tls_conn *t = session_tls(s);
	const struct tls_creds *cr = t ? t->creds : NULL;
	for (size_t i = 0; cr && i < cr->key_count; i++) {
		if (strcmp(cr->keys[i].username, username) != 0)
			continue;
		key->data = gnutls_malloc(cr->keys[i].key.size);
		if (!key->data)
			return -1;
		memcpy(key->data, cr->keys[i].key.data, cr->keys[i].key.size);
		key->size = cr->keys[i].key.size;
		return 0;
	}
	tls_note(t, "unknown PSK username '%.64s'", username);
	return -1;
}

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return rc;
}

static int load_x509(struct tls_creds *cr, const char *dir, char *err, size_t errlen)
{
	char ca[4096], cert[4096], key[4096], crl[4096];
	snprintf(ca, sizeof(ca), "%s/ca-cert.pem", dir);
	snprintf(cert, sizeof(cert), "%s/server-cert.pem", dir);
	snprintf(key, sizeof(key), "%s/server-key.pem", dir);
	snprintf(crl, sizeof(crl), "%s/ca-crl.pem", dir);
	int rc = gnutls_certificate_allocate_credentials(&cr->x509);
	if (rc < 0)
		return fail(err, errlen, -ENOMEM, "tls-certificates %s: %s", dir,
			    gnutls_strerror(rc));
	const char *need[] = {cert, key, cr->verify_peer ? ca : NULL};
	for (size_t i = 0; i < 3; i++)
		if (need[i] && access(need[i], R_OK) < 0)
			return fail(err, errlen, -EINVAL, "tls-certificates: %s: %s", need[i],
				    strerror(errno));
	rc = gnutls_certificate_set_x509_key_file(cr->x509, cert, key, GNUTLS_X509_FMT_PEM);
	if (rc < 0)
		return fail(err, errlen, -EINVAL, "tls-certificates: %s with %s: %s", cert, key,
			    gnutls_strerror(rc));
	if (access(ca, F_OK) == 0) {
		rc = gnutls_certificate_set_x509_trust_file(cr->x509, ca, GNUTLS_X509_FMT_PEM);
		if (rc <= 0)
			return fail(err, errlen, -EINVAL, "tls-certificates: %s: %s", ca,
				    rc < 0 ? gnutls_strerror(rc) : "no certificate in it");
	}
	if (access(crl, F_OK) == 0) {
		rc = gnutls_certificate_set_x509_crl_file(cr->x509, crl, GNUTLS_X509_FMT_PEM);
		if (rc < 0)
			return fail(err, errlen, -EINVAL, "tls-certificates: %s: %s", crl,
				    gnutls_strerror(rc));
	}
	gnutls_certificate_set_known_dh_params(cr->x509, GNUTLS_SEC_PARAM_MEDIUM);
	if (cr->verify_peer)
		gnutls_certificate_set_verify_function(cr->x509, verify_client);
	return 0;
}

/* psktool's file: one "username:hexkey" per line. Read whole, so that a
 * reload swaps keys at once and a broken file is refused before use. */
static int load_psk(struct tls_creds *cr, const char *path, char *err, size_t errlen)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return fail(err, errlen, -EINVAL, "tls-psk: %s: %s", path, strerror(errno));
	char *line = NULL;
	size_t cap = 0;
	unsigned lineno = 0;
	int rc = 0;
	ssize_t n;
	while ((n = getline(&line, &cap, f)) >= 0) {
		lineno++;
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			line[--n] = '\0';
		if (n == 0 || line[0] == '#')
			continue;
		char *colon = strchr(line, ':');
		if (!colon || colon == line || !colon[1]) {
			rc = fail(err, errlen, -EINVAL, "tls-psk: %s:%u: expected username:hexkey",
				  path, lineno);
			break;
		}
		*colon = '\0';
		gnutls_datum_t hex = {(unsigned char *)colon + 1, (unsigned)strlen(colon + 1)};
		gnutls_datum_t key = {NULL, 0};
		int grc = gnutls_hex_decode2(&hex, &key);
		if (grc < 0) {
			rc = fail(err, errlen, -EINVAL, "tls-psk: %s:%u: the key: %s", path, lineno,
				  gnutls_strerror(grc));
			break;
		}
		struct tls_psk_key *v = realloc(cr->keys, (cr->key_count + 1) * sizeof(*v));
		char *user = strdup(line);
		if (!v || !user) {
			if (v)
				cr->keys = v;
			free(user);
			gnutls_free(key.data);
			rc = fail(err, errlen, -ENOMEM, "out of memory");
			break;
		}
		cr->keys = v;
		v[cr->key_count++] = (struct tls_psk_key){user, key};
	}
	if (line) {
		memset(line, 0, cap);
		free(line);
	}
	fclose(f);
	if (rc == 0 && cr->key_count == 0)
		rc = fail(err, errlen, -EINVAL, "tls-psk: %s: no key in it", path);
	if (rc < 0)
		return rc;
	int grc = gnutls_psk_allocate_server_credentials(&cr->psk);
	if (grc < 0)
		return fail(err, errlen, -ENOMEM, "tls-psk: %s", gnutls_strerror(grc));
	gnutls_psk_set_server_credentials_function(cr->psk, psk_lookup);
	gnutls_psk_set_server_known_dh_params(cr->psk, GNUTLS_SEC_PARAM_MEDIUM);
	return 0;
}

int tls_creds_load(const struct options *opts, struct tls_creds **out, char *err, size_t errlen)
{
	*out = NULL;
	if (opts->tls == TLS_OFF)
		return 0;
	struct tls_creds *cr = calloc(1, sizeof(*cr));
	if (!cr)
		return fail(err, errlen, -ENOMEM, "out of memory");
	atomic_init(&cr->refs, 1);
	cr->mode = opts->tls;
	cr->verify_peer = opts->tls_verify_peer;
	const char *prio = opts->tls_priority ? opts->tls_priority : OPTIONS_DEFAULT_TLS_PRIORITY;
	cr->priority_string = strdup(prio);
	cr->certificates = opts->tls_certificates ? strdup(opts->tls_certificates) : NULL;
	cr->psk_file = opts->tls_psk ? strdup(opts->tls_psk) : NULL;
	int rc = 0;
	if (!cr->priority_string || (opts->tls_certificates && !cr->certificates) ||
	    (opts->tls_psk && !cr->psk_file)) {
		rc = fail(err, errlen, -ENOMEM, "out of memory");
		goto error;
	}
	const char *where = NULL;
	int grc = gnutls_priority_init(&cr->priority, prio, &where);
	if (grc < 0) {
		rc = fail(err, errlen, -EINVAL, "tls-priority \"%s\": %s%s%s", prio,
			  gnutls_strerror(grc), where ? " at " : "", where ? where : "");
		cr->priority = NULL;
		goto error;
	}
	if (opts->tls_certificates && (rc = load_x509(cr, opts->tls_certificates, err, errlen)) < 0)
		goto error;
	if (opts->tls_psk && (rc = load_psk(cr, opts->tls_psk, err, errlen)) < 0)
		goto error;
	*out = cr;
	return 0;
error:
	creds_free(cr);
	return rc;
}

void tls_creds_describe(const struct tls_creds *cr, char *buf, size_t len)
{
	if (!cr) {
		snprintf(buf, len, "tls off");
		return;
	}
	snprintf(buf, len, "tls %s: %s%s%s%s%s%s, %zu PSK key(s), priority \"%s\"",
		 options_tls_name(cr->mode), cr->certificates ? "certificates " : "",
		 cr->certificates ? cr->certificates : "",
		 cr->certificates && cr->verify_peer ? " (client certificates verified)" : "",
		 cr->certificates && cr->psk_file ? ", " : "", cr->psk_file ? "PSK file " : "",
		 cr->psk_file ? cr->psk_file : "", cr->key_count, cr->priority_string);
}

/* ------------------------------------------------------------------ */
/* Connections                                                         */
/* ------------------------------------------------------------------ */

void tls_conn_begin(struct conn *c)
{
	pthread_mutex_lock(&installed_lock);
	c->tls_creds = creds_ref(installed);
	pthread_mutex_unlock(&installed_lock);
}

enum tls_mode tls_conn_mode(const struct conn *c)
{
	return c->tls_creds ? c->tls_creds->mode : TLS_OFF;
}

bool tls_conn_secure(const struct conn *c)
{
	return c->tls && c->tls->handshake_done;
}

bool tls_conn_info(const struct conn *c, const char **version, const char **cipher,
		   const char **identity)
{
	if (!c->tls_version[0])
		return false;
	*version = c->tls_version;
	*cipher = c->tls_cipher;
	*identity = c->peer.identity;
	return true;
}

/* The client's address, for the log line of a failed handshake. */
static void peer_name(struct conn *c, char *buf, size_t len)
{
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	int fd = conn_fd(c);
	snprintf(buf, len, "?");
	if (fd < 0 || getpeername(fd, (struct sockaddr *)&ss, &sl) < 0)
		return;
	char host[INET6_ADDRSTRLEN];
	if (ss.ss_family == AF_INET) {
		const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
		inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
		snprintf(buf, len, "%s:%u", host, ntohs(in->sin_port));
	} else if (ss.ss_family == AF_INET6) {
		const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
		inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
		snprintf(buf, len, "[%s]:%u", host, ntohs(in6->sin6_port));
	} else if (ss.ss_family == AF_UNIX) {
		snprintf(buf, len, "a Unix socket client");
	}
}

/* Fail the session once: keep why, log it, and have the connection killed
 * from its own event. */
/* Failed TLS handshakes and sessions: a client can cause one per connect. */
LOG_LIMIT(tls_failed_log, "TLS failures");
LOG_LIMIT_SESSIONS(established_log, "TLS sessions established");

static void tls_fail(struct tls_conn *t, int rc)
{
	if (t->failed || !t->conn)
		return;
	t->failed = true;
	char reason[256];
	const char *alert = gnutls_alert_get_name(gnutls_alert_get(t->session));
	if (rc == GNUTLS_E_FATAL_ALERT_RECEIVED || rc == GNUTLS_E_WARNING_ALERT_RECEIVED)
		snprintf(reason, sizeof(reason), "%s: %s", gnutls_strerror(rc),
			 alert ? alert : "an unknown alert");
	else if (t->why[0])
		snprintf(reason, sizeof(reason), "%.160s (%.80s)", t->why, gnutls_strerror(rc));
	else
		snprintf(reason, sizeof(reason), "%s", gnutls_strerror(rc));
	snprintf(t->why, sizeof(t->why), "TLS %s failed: %.200s",
		 t->handshake_done ? "session" : "handshake", reason);
	log_limited(&tls_failed_log, LOG_WARN, "conn %llu: TLS %s with %s failed: %s",
		    (unsigned long long)t->conn->id, t->handshake_done ? "session" : "handshake",
		    t->peer, reason);
	event_active(t->notify, EV_TIMEOUT, 0);
}

static void tls_on_notify(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	struct tls_conn *t = arg;
	struct conn *c = t->conn;
	if (!c)
		return;
	conn_ref(c);
	if (t->failed)
		conn_kill(c, t->why);
	else
		conn_update_reading(c);
	conn_unref(c);
}

/* What GnuTLS writes goes to the socket's output buffer; it never waits. */
static ssize_t tls_push(gnutls_transport_ptr_t p, const void *data, size_t len)
{
	struct tls_conn *t = p;
	if (evbuffer_add(bufferevent_get_output(t->under), data, len) < 0) {
		gnutls_transport_set_errno(t->session, ENOMEM);
		return -1;
	}
	return (ssize_t)len;
}

static ssize_t tls_pull(gnutls_transport_ptr_t p, void *data, size_t len)
{
	struct tls_conn *t = p;
	int n = evbuffer_remove(bufferevent_get_input(t->under), data, len);
	if (n <= 0) {
		gnutls_transport_set_errno(t->session, EAGAIN);
		return -1;
	}
	return n;
}

static int tls_pull_timeout(gnutls_transport_ptr_t p, unsigned ms)
{
	(void)ms;
	struct tls_conn *t = p;
	return evbuffer_get_length(bufferevent_get_input(t->under)) > 0;
}

/* The handshake is done: note what it agreed on the connection. */
static void tls_established(struct tls_conn *t)
{
	struct conn *c = t->conn;
	gnutls_session_t s = t->session;
	t->handshake_done = true;
	const char *v = gnutls_protocol_get_name(gnutls_protocol_get_version(s));
	const char *cs = gnutls_ciphersuite_get(s);
	snprintf(c->tls_version, sizeof(c->tls_version), "%s", v ? v : "?");
	snprintf(c->tls_cipher, sizeof(c->tls_cipher), "%s", cs ? cs : "?");
	char identity[sizeof(c->peer.identity)] = "";
	if (gnutls_auth_get_type(s) == GNUTLS_CRD_PSK) {
		const char *user = gnutls_psk_server_get_username(s);
		snprintf(identity, sizeof(identity), "%s", user ? user : "");
	} else {
		unsigned n = 0;
		const gnutls_datum_t *certs = gnutls_certificate_get_peers(s, &n);
		gnutls_x509_crt_t crt;
		if (certs && n > 0 && gnutls_x509_crt_init(&crt) == 0) {
			gnutls_datum_t dn = {NULL, 0};
			if (gnutls_x509_crt_import(crt, &certs[0], GNUTLS_X509_FMT_DER) == 0 &&
			    gnutls_x509_crt_get_dn3(crt, &dn, 0) == 0) {
				snprintf(identity, sizeof(identity), "%s", (const char *)dn.data);
				gnutls_free(dn.data);
			}
			gnutls_x509_crt_deinit(crt);
		}
	}
	conn_tls_established(c, identity);
	log_limited(&established_log, LOG_INFO, "conn %llu: TLS with %s: %s, %s%s%s",
		    (unsigned long long)c->id, t->peer, c->tls_version, c->tls_cipher,
		    identity[0] ? ", identity " : "", identity);
}

/* The filter's input side: handshake, then decrypt into the connection's
 * input buffer (dst) whatever records have arrived. */
static enum bufferevent_filter_result tls_filter_in(struct evbuffer *src, struct evbuffer *dst,
						    ev_ssize_t limit,
						    enum bufferevent_flush_mode mode, void *ctx)
{
	(void)src;
	(void)mode;
	struct tls_conn *t = ctx;
	if (!t->conn || t->failed)
		return BEV_ERROR;
	if (!t->handshake_done) {
		int rc = gnutls_handshake(t->session);
		if (rc == GNUTLS_E_AGAIN || rc == GNUTLS_E_INTERRUPTED)
			return BEV_NEED_MORE;
		if (rc < 0) {
			tls_fail(t, rc);
			return BEV_ERROR;
		}
		tls_established(t);
	}
	size_t got = 0;
	for (;;) {
		if (limit >= 0 && got >= (size_t)limit)
			break;
		struct evbuffer_iovec v;
		if (evbuffer_reserve_space(dst, 16384, &v, 1) < 1) {
			tls_fail(t, GNUTLS_E_MEMORY_ERROR);
			return BEV_ERROR;
		}
		ssize_t n = gnutls_record_recv(t->session, v.iov_base, v.iov_len);
		if (n > 0) {
			v.iov_len = (size_t)n;
			evbuffer_commit_space(dst, &v, 1);
			got += (size_t)n;
			continue;
		}
		evbuffer_commit_space(dst, NULL, 0);
		if (n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED)
			break;
		if (n == 0) {
			/* close_notify: the socket's EOF follows, and conn.c's
			 * event callback ends the connection. */
			break;
		}
		tls_fail(t, (int)n);
		return BEV_ERROR;
	}
	return got ? BEV_OK : BEV_NEED_MORE;
}

/*
 * The filter's output side: encrypt the connection's output buffer (src)
 * in place. Its chunks (reply headers, and READ data referenced from the
 * arena or a request's buffer) go to gnutls_record_send as they are; only
 * what GnuTLS has taken is drained, so a reference is released once all of
 * its bytes are encrypted. dst (the socket's output) takes at most limit.
 */
static enum bufferevent_filter_result tls_filter_out(struct evbuffer *src, struct evbuffer *dst,
						     ev_ssize_t limit,
						     enum bufferevent_flush_mode mode, void *ctx)
{
	(void)mode;
	struct tls_conn *t = ctx;
	if (!t->conn || t->failed)
		return BEV_ERROR;
	if (!t->handshake_done)
		return BEV_NEED_MORE;
	size_t start = evbuffer_get_length(dst), taken = 0;
	bool full = false;
	while (!full && evbuffer_get_length(src) > 0) {
		struct evbuffer_iovec v[16];
		int n = evbuffer_peek(src, -1, NULL, v, 16);
		size_t done = 0;
		for (int i = 0; i < n && !full; i++) {
			const char *p = v[i].iov_base;
			size_t left = v[i].iov_len;
			while (left > 0) {
				if (limit >= 0 &&
				    evbuffer_get_length(dst) - start >= (size_t)limit) {
					full = true;
					break;
				}
				ssize_t r = gnutls_record_send(t->session, p, left);
				if (r == GNUTLS_E_AGAIN || r == GNUTLS_E_INTERRUPTED) {
					full = true; /* the push never waits: not reached */
					break;
				}
				if (r < 0) {
					evbuffer_drain(src, done);
					tls_fail(t, (int)r);
					return BEV_ERROR;
				}
				p += r;
				left -= (size_t)r;
				done += (size_t)r;
			}
		}
		evbuffer_drain(src, done);
		taken += done;
		if (!t->conn)
			break; /* a release ended the connection */
	}
	return taken ? BEV_OK : BEV_NEED_MORE;
}

/* The socket's output changed: the budget counts the ciphertext too, the
 * stall clock moves as the socket takes it, and a closing connection
 * whose last bytes left is finished (from the event: not inside the
 * socket's write). */
static void tls_under_output(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg)
{
	struct tls_conn *t = arg;
	struct conn *c = t->conn;
	if (!c || !c->bev)
		return;
	conn_output_sync(c);
	if (info->n_deleted) {
		conn_output_moved(c, info->n_deleted);
		if (c->closing && evbuffer_get_length(buf) == 0)
			event_active(t->notify, EV_TIMEOUT, 0);
	}
}

static void tls_conn_free(void *ctx)
{
	struct tls_conn *t = ctx;
	if (t->notify)
		event_free(t->notify);
	if (t->session)
		gnutls_deinit(t->session);
	tls_creds_put(t->creds);
	free(t);
}

static int tls_session_new(struct tls_conn *t)
{
	const struct tls_creds *cr = t->creds;
	int rc = gnutls_init(&t->session, GNUTLS_SERVER | GNUTLS_NONBLOCK | GNUTLS_NO_SIGNAL);
	if (rc < 0) {
		t->session = NULL;
		return rc;
	}
	gnutls_session_set_ptr(t->session, t);
	if ((rc = gnutls_priority_set(t->session, cr->priority)) < 0)
		return rc;
	if (cr->x509) {
		rc = gnutls_credentials_set(t->session, GNUTLS_CRD_CERTIFICATE, cr->x509);
		if (rc < 0)
			return rc;
		gnutls_certificate_server_set_request(
		    t->session, cr->verify_peer ? GNUTLS_CERT_REQUIRE : GNUTLS_CERT_IGNORE);
	}
	if (cr->psk && (rc = gnutls_credentials_set(t->session, GNUTLS_CRD_PSK, cr->psk)) < 0)
		return rc;
	/* The connection's negotiation deadline bounds the handshake. */
	gnutls_handshake_set_timeout(t->session, 0);
	gnutls_transport_set_ptr(t->session, t);
	gnutls_transport_set_push_function(t->session, tls_push);
	gnutls_transport_set_pull_function(t->session, tls_pull);
	gnutls_transport_set_pull_timeout_function(t->session, tls_pull_timeout);
	return 0;
}

int tls_start(struct conn *c)
{
	struct tls_conn *t = calloc(1, sizeof(*t));
	if (!t) {
		conn_kill(c, "out of memory starting TLS");
		return -ENOMEM;
	}
	t->conn = c;
	t->creds = creds_ref(c->tls_creds);
	peer_name(c, t->peer, sizeof(t->peer));
	t->under = c->bev;
	t->notify = event_new(c->worker->base, -1, 0, tls_on_notify, t);
	int rc = t->notify ? tls_session_new(t) : GNUTLS_E_MEMORY_ERROR;
	if (rc < 0) {
		log_error("conn %llu: cannot start TLS: %s", (unsigned long long)c->id,
			  gnutls_strerror(rc));
		tls_conn_free(t);
		conn_kill(c, "cannot start TLS");
		return -ENOMEM;
	}
	/* Not BEV_OPT_CLOSE_ON_FREE: conn_kill frees the socket's
	 * bufferevent after the filter, and a failure here leaves it as it was. */
	struct bufferevent *filter =
	    bufferevent_filter_new(c->bev, tls_filter_in, tls_filter_out, 0, tls_conn_free, t);
	if (!filter) {
		tls_conn_free(t);
		conn_kill(c, "out of memory starting TLS");
		return -ENOMEM;
	}
	/* From here the filter owns t (freed with it). */
	t->under_cb = evbuffer_add_cb(bufferevent_get_output(t->under), tls_under_output, t);
	if (!t->under_cb || conn_set_filter(c, filter) < 0) {
		t->conn = NULL;
		if (t->under_cb)
			evbuffer_remove_cb_entry(bufferevent_get_output(t->under), t->under_cb);
		bufferevent_free(filter);
		conn_kill(c, "out of memory starting TLS");
		return -ENOMEM;
	}
	c->tls = t;
	bufferevent_setwatermark(t->under, EV_WRITE, TLS_CIPHERTEXT_LOW, TLS_CIPHERTEXT_HIGH);
	/* A ClientHello that came with STARTTLS is not announced again. */
	bufferevent_trigger(t->under, EV_READ,
			    BEV_TRIG_IGNORE_WATERMARKS | BEV_TRIG_DEFER_CALLBACKS);
	log_debug("conn %llu: STARTTLS: TLS handshake started", (unsigned long long)c->id);
	return 0;
}

bool tls_close_notify(struct conn *c)
{
	struct tls_conn *t = c->tls;
	if (!t || !t->handshake_done || t->failed || t->bye_sent)
		return false;
	t->bye_sent = true;
	/* The push never waits, so this does not either. */
	int rc = gnutls_bye(t->session, GNUTLS_SHUT_WR);
	return rc == 0 && evbuffer_get_length(bufferevent_get_output(t->under)) > 0;
}

bool tls_closing(const struct conn *c)
{
	return c->tls && c->tls->bye_sent;
}

void tls_conn_end(struct conn *c, const char *why)
{
	struct tls_conn *t = c->tls;
	if (t && !t->handshake_done && !t->failed)
		log_limited(&tls_failed_log, LOG_WARN,
			    "conn %llu: TLS handshake with %s failed: %s",
			    (unsigned long long)c->id, t->peer, why);
	if (t) {
		t->conn = NULL;
		event_del(t->notify);
		if (t->under_cb) {
			evbuffer_remove_cb_entry(bufferevent_get_output(t->under), t->under_cb);
			t->under_cb = NULL;
		}
		c->tls = NULL;
	}
	tls_creds_put(c->tls_creds);
	c->tls_creds = NULL;
}
