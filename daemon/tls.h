/*
 * daemon/tls.h: TLS for NBD connections (STARTTLS), with GnuTLS.
 *
 * Owns: the credentials (x509 from a certificate directory, PSK from
 * psktool's key file, the priority string, whether client certificates are
 * required and verified), their reloading, and each connection's TLS
 * session.
 *
 * Credentials are loaded whole (tls_creds_load) and are immutable once
 * loaded; they are reference counted. The installed ones
 * (tls_creds_install, main thread at start, control thread at reload) are
 * what new connections take (tls_conn_begin, at the greeting) and keep until
 * they end: a reload changes what later connections get, never what a
 * connection already has, nor its mode (the spec wants one mode per TCP
 * connection).
 *
 * The session never blocks: after STARTTLS's ACK, tls_start() puts a
 * libevent filter bufferevent over the connection's socket bufferevent
 * (conn_set_filter). GnuTLS reads and writes through push and pull
 * functions on the socket bufferevent's buffers; the handshake is run from
 * the filter's input side as records arrive, then the input side decrypts
 * into the connection's input buffer. The output side encrypts straight
 * from the connection's output buffer: evbuffer_peek gives its chunks (for
 * READ replies, references into the cache arena), each goes to
 * gnutls_record_send in place, and only what GnuTLS took is drained, which
 * is when a reference's release callback runs. The ciphertext waits in the
 * socket bufferevent's output, at most TLS_CIPHERTEXT_HIGH (plus a record)
 * per connection, and is counted with the output (conn.h).
 *
 * Layer: a connection primitive beside conn.c (it knows struct conn);
 * handshake.c starts it, conn.c ends it.
 */
#ifndef NBDCACHED_DAEMON_TLS_H
#define NBDCACHED_DAEMON_TLS_H

#include <stdbool.h>
#include <stddef.h>

#include "daemon/options.h"

struct conn;
struct tls_creds;

/*
 * The socket's output takes ciphertext up to this, and is refilled once it
 * drains below TLS_CIPHERTEXT_LOW. Small on purpose: while the worker
 * encrypts a refill the socket is not written, so the client lives on what
 * the kernel already holds (a Unix socket's buffer is about 200 KiB); a
 * refill must take less time than that lasts. Measured with 1 MiB reads
 * (QD8, AES-256-GCM, three rounds each): 1 MiB / 256 KiB gave 385-826
 * MB/s, 256 / 128 KiB 739-1159, 128 / 64 KiB 821-1233, at less CPU per MiB.
 */
#define TLS_CIPHERTEXT_HIGH (128u << 10)
#define TLS_CIPHERTEXT_LOW (64u << 10)

/*
 * Load the credentials opts name (tls-certificates, tls-psk,
 * tls-priority, tls-verify-peer, tls). *out is NULL when tls is off. On
 * error -EINVAL (or -ENOMEM) with one line in err naming the file and
 * GnuTLS's reason. Any thread; nothing global changes.
 */
int tls_creds_load(const struct options *opts, struct tls_creds **out, char *err, size_t errlen);
/* One line saying what was loaded (for --check-config and the log). */
void tls_creds_describe(const struct tls_creds *creds, char *buf, size_t len);
void tls_creds_put(struct tls_creds *creds);
/* Make creds (NULL: TLS off) what new connections take; takes over the
 * caller's reference, drops the one on the previous credentials. */
void tls_creds_install(struct tls_creds *creds);
/* Drop the installed credentials (at exit). */
void tls_creds_uninstall(void);

/* Worker thread, at the greeting: the connection takes the installed
 * credentials (and so its mode). */
void tls_conn_begin(struct conn *c);
/* The connection's mode: TLS_OFF, TLS_ON (SELECTIVETLS), TLS_REQUIRE. */
enum tls_mode tls_conn_mode(const struct conn *c);
/* The TLS handshake finished: options and requests arrive encrypted. */
bool tls_conn_secure(const struct conn *c);
/*
 * STARTTLS was acknowledged (the ACK is queued): wrap the socket and
 * start the server side of the handshake. On failure the connection is
 * killed and -errno returned.
 */
int tls_start(struct conn *c);
/*
 * An orderly close (NBD_CMD_DISC, ABORT, shutdown), everything sent: queue
 * TLS's close_notify and return true, the first time; once it has gone
 * (conn_update_reading runs again then) or without TLS, false.
 */
bool tls_close_notify(struct conn *c);
/* The close_notify was queued (tls_close_notify): the client may go away
 * without reading it, and that is no error. */
bool tls_closing(const struct conn *c);
/* conn_kill, for why: detach the session from the connection (the session
 * itself goes with the bufferevent) and drop the credentials. A handshake
 * that had not finished is logged as failed, for why (the client closed,
 * the negotiation deadline...), with the client's address. */
void tls_conn_end(struct conn *c, const char *why);
/*
 * What the handshake agreed, for logs and the control socket: false when
 * the connection never finished one. Strings stay valid as long as c;
 * identity is the client certificate's DN, the PSK username, or "".
 */
bool tls_conn_info(const struct conn *c, const char **version, const char **cipher,
		   const char **identity);

#endif
