/*
 * tests/fuzz/fuzz_negotiation.c: the daemon's option haggling
 * (daemon/handshake.c itself), TLS modes and STARTTLS included, as a
 * hostile client drives it.
 *
 * Input: byte 0 picks the server's TLS mode (off, on = SELECTIVETLS,
 * require = FORCEDTLS); the rest is what the client sends after the
 * greeting (client flags, then options), fed to handshake_step() in pieces
 * whose sizes come from byte 1.
 *
 * handshake.c is linked with stubs of what it uses below it: the
 * connection (libevent evbuffers for input and output), two exports ("open",
 * and "secret" with tls = require) and TLS. STARTTLS's ACK is the TLS
 * boundary: tls_start() marks it, and the input after it is taken as what
 * the client sends over TLS (the stub's handshake "succeeds" at once), so
 * the fuzzer covers the plaintext part, the boundary (what STARTTLS must
 * forget) and negotiation over TLS.
 *
 * Checked after every step, from the replies on the output buffer and the
 * connection's state:
 *   - every reply is a well-formed option reply to the option just sent;
 *   - TLS off: STARTTLS is refused (POLICY, or INVALID with data); never
 *     TLS_REQD;
 *   - tls require, before TLS: every option but STARTTLS and ABORT gets
 *     TLS_REQD (or TOO_BIG, when it is too long to be read: the connection
 *     ends), and transmission is never entered;
 *   - before TLS, "secret" is never listed, described or entered;
 *   - after STARTTLS's ACK: structured replies, extended headers and meta
 *     contexts are forgotten; a second STARTTLS gets INVALID; no TLS_REQD
 *     once TLS runs;
 *   - export references balance when the connection ends.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/handshake.h"
#include "daemon/log.h"
#include "daemon/tls.h"
#include "daemon/worker.h"
#include "proto/nbd.h"
#include "tests/fuzz/fuzz.h"

/* ---- the world below handshake.c ---- */

static struct evbuffer *in, *out;
static enum tls_mode mode;
static bool tls_started, secure, killed;
static int export_refs;
static struct backend the_backend = {.size = 1 << 20, .min_block = 512};
static struct export_backing backing_open, backing_secret;
static struct export exports[2] = {
    {.name = "open",
     .size = 1 << 20,
     .block_size = 4096,
     .max_payload = 1 << 25,
     .backend = &the_backend,
     .backing = &backing_open},
    {.name = "secret",
     .description = "TLS only",
     .size = 1 << 20,
     .block_size = 4096,
     .max_payload = 1 << 25,
     .tls_require = true,
     .backend = &the_backend,
     .backing = &backing_secret},
};

struct evbuffer *conn_output(struct conn *c)
{
	(void)c;
	return out;
}

struct evbuffer *conn_input(struct conn *c)
{
	(void)c;
	return in;
}

void conn_add(struct conn *c, const void *data, size_t n)
{
	if (c->bev && evbuffer_add(out, data, n) < 0)
		conn_kill(c, "out of memory queueing a reply");
}

void conn_kill(struct conn *c, const char *why)
{
	(void)why;
	c->bev = NULL;
	killed = true;
}

void conn_begin_close(struct conn *c, const char *why)
{
	(void)why;
	c->closing = true;
}

void conn_negotiation_done(struct conn *c)
{
	(void)c;
}

struct export *export_get(struct export_table *t, const char *name, size_t len)
{
	(void)t;
	for (size_t i = 0; i < 2; i++)
		if ((len == 0 && i == 0) ||
		    (len == strlen(exports[i].name) && memcmp(name, exports[i].name, len) == 0)) {
			export_refs++;
			return &exports[i];
		}
	return NULL;
}

void export_put(struct export *e)
{
	if (e)
		export_refs--;
	CHECK(export_refs >= 0);
}

void export_ref(struct export *e)
{
	(void)e;
	export_refs++;
}

int export_list(struct export_table *t, struct export ***list, size_t *count)
{
	(void)t;
	*list = malloc(2 * sizeof(**list));
	if (!*list)
		return -ENOMEM;
	(*list)[0] = &exports[0];
	(*list)[1] = &exports[1];
	export_refs += 2;
	*count = 2;
	return 0;
}

bool export_attach(struct export *e)
{
	(void)e;
	return true;
}

void export_detach(struct export *e)
{
	(void)e;
}

uint16_t export_eflags(const struct export *e, bool structured)
{
	(void)e;
	return NBD_FLAG_HAS_FLAGS | (structured ? NBD_FLAG_SEND_DF : 0);
}

uint64_t cache_export_error_seq(struct cache_export *e)
{
	(void)e;
	return 0;
}

void tls_conn_begin(struct conn *c)
{
	(void)c;
}

enum tls_mode tls_conn_mode(const struct conn *c)
{
	(void)c;
	return mode;
}

bool tls_conn_secure(const struct conn *c)
{
	(void)c;
	return secure;
}

/* The TLS boundary: from here the input is what comes over TLS. */
int tls_start(struct conn *c)
{
	CHECK(mode != TLS_OFF);
	CHECK(!tls_started);
	tls_started = true;
	c->tls = (struct tls_conn *)&tls_started; /* non-NULL: TLS is running */
	return 0;
}

enum log_level log_get_level(void)
{
	return LOG_ERROR;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	(void)level;
	(void)fmt;
}

void log_limited(struct log_limit *l, enum log_level level, const char *fmt, ...)
{
	(void)l;
	(void)level;
	(void)fmt;
}

/* ---- checking the replies ---- */

/* One option's replies, all on the output: each well-formed and for it. */
static void check_replies(uint32_t option, bool was_secure, bool was_started, bool entered)
{
	for (;;) {
		size_t avail = evbuffer_get_length(out);
		if (avail == 0)
			return;
		if (option == NBD_OPT_EXPORT_NAME && entered) {
			/* The export-name reply: size, flags, maybe zeroes. */
			CHECK(avail == 10 || avail == 134);
			evbuffer_drain(out, avail);
			return;
		}
		CHECK(avail >= NBD_OPTION_REPLY_HEADER_SIZE);
		uint8_t hdr[NBD_OPTION_REPLY_HEADER_SIZE];
		evbuffer_remove(out, hdr, sizeof(hdr));
		struct nbd_option_reply rep;
		CHECK(nbd_decode_option_reply(hdr, sizeof(hdr), &rep) == 0);
		CHECK(rep.option == option);
		CHECK(evbuffer_get_length(out) >= rep.length);
		uint8_t *p = malloc(rep.length ? rep.length : 1);
		CHECK(p);
		evbuffer_remove(out, p, rep.length);
		if (rep.type == NBD_REP_ERR_TOO_BIG) {
			/* Too long to be read, whatever it is: the end. */
			free(p);
			continue;
		}
		if (rep.type == NBD_REP_ERR_TLS_REQD)
			CHECK(mode != TLS_OFF && !was_secure);
		if (mode == TLS_REQUIRE && !was_secure && option != NBD_OPT_STARTTLS &&
		    option != NBD_OPT_ABORT)
			CHECK(rep.type == NBD_REP_ERR_TLS_REQD);
		if (option == NBD_OPT_STARTTLS) {
			if (mode == TLS_OFF)
				CHECK(rep.type == NBD_REP_ERR_POLICY ||
				      rep.type == NBD_REP_ERR_INVALID);
			if (was_started)
				CHECK(rep.type == NBD_REP_ERR_INVALID);
			if (rep.type == NBD_REP_ACK)
				CHECK(!was_started && mode != TLS_OFF);
		}
		/* "secret" is never listed or described before TLS. */
		if (!was_secure && rep.type == NBD_REP_SERVER && rep.length >= 4) {
			uint32_t n = nbd_get32(p);
			CHECK(!(n == 6 && rep.length >= 10 && memcmp(p + 4, "secret", 6) == 0));
		}
		if (!was_secure && rep.type == NBD_REP_INFO && rep.length >= 2 &&
		    nbd_get16(p) == NBD_INFO_DESCRIPTION)
			CHECK(!(rep.length == 10 && memcmp(p + 2, "TLS only", 8) == 0));
		free(p);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 2)
		return 0;
	mode = (enum tls_mode)(data[0] % 3);
	size_t piece = 1 + data[1] % 64;
	data += 2;
	size -= 2;
	in = evbuffer_new();
	out = evbuffer_new();
	CHECK(in && out);
	tls_started = secure = killed = false;
	export_refs = 0;
	struct export_table *table = NULL;
	struct worker w = {0};
	struct conn_set set = {.worker = &w, .exports = table};
	struct conn c = {
	    .worker = &w, .set = &set, .phase = CONN_FLAGS, .bev = (struct bufferevent *)&w};
	handshake_send_greeting(&c);
	CHECK(evbuffer_get_length(out) == NBD_GREETING_SIZE);
	evbuffer_drain(out, NBD_GREETING_SIZE);

	size_t fed = 0;
	while (c.bev && !c.closing && c.phase != CONN_TRANSMISSION) {
		int rc = 1;
		while (rc > 0 && c.bev && !c.closing && c.phase != CONN_TRANSMISSION) {
			uint32_t option = 0;
			bool have_option = false;
			size_t avail = evbuffer_get_length(in);
			if (c.phase == CONN_OPTIONS && avail >= NBD_OPTION_HEADER_SIZE) {
				uint8_t hdr[NBD_OPTION_HEADER_SIZE];
				struct nbd_option opt;
				evbuffer_copyout(in, hdr, sizeof(hdr));
				if (nbd_decode_option(hdr, sizeof(hdr), &opt) == 0) {
					option = opt.option;
					have_option = true;
				}
			}
			bool was_secure = secure, was_started = tls_started;
			rc = handshake_step(&c);
			if (have_option)
				check_replies(option, was_secure, was_started,
					      c.phase == CONN_TRANSMISSION);
			if (tls_started && !was_started) {
				/* Everything negotiated in plaintext is forgotten. */
				CHECK(!c.structured && !c.extended && !c.meta_selected &&
				      !c.meta_export);
				secure = true; /* the rest of the input comes over TLS */
			}
			if (c.phase == CONN_TRANSMISSION) {
				CHECK(secure || (mode != TLS_REQUIRE && !c.export->tls_require));
			}
		}
		if (fed >= size)
			break;
		size_t n = size - fed < piece ? size - fed : piece;
		evbuffer_add(in, data + fed, n);
		fed += n;
	}
	if (c.export)
		export_put(c.export);
	export_put(c.meta_export);
	CHECK(export_refs == 0);
	evbuffer_free(in);
	evbuffer_free(out);
	return 0;
}
