/*
 * daemon/upgrade_child.c: see upgrade.h. The messages both sides exchange
 * (upgrade_internal.h) and the new daemon's side: take the descriptor,
 * say HELLO, receive the listeners and connections, confirm, wait for
 * COMMIT.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/upgrade.h"
#include "daemon/upgrade_internal.h"

/* ---- Messages ---- */

/* Send one record with at most one descriptor (fd < 0: none). */
int upgrade_send_record(int sock, const uint8_t *buf, size_t len, int fd)
{
	struct iovec iov = {(void *)buf, len};
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(sizeof(int))];
	} u;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	if (fd >= 0) {
		memset(&u, 0, sizeof(u));
		msg.msg_control = u.space;
		msg.msg_controllen = sizeof(u.space);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	for (;;) {
		ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
		if (n == (ssize_t)len)
			return 0;
		if (n < 0 && errno == EINTR)
			continue;
		return n < 0 ? -errno : -EMSGSIZE;
	}
}

/*
 * Receive one record within timeout_ms (-1: no limit) into buf (at least
 * UPGRADE_RECORD_MAX bytes) and decode it; its descriptor, if any, in
 * *fd. -ETIMEDOUT, -EPIPE (the other side is gone) or -EPROTO (why set).
 */
int upgrade_recv_record(int sock, uint8_t *buf, int timeout_ms, struct upgrade_record *r, int *fd,
			char *why, size_t why_len)
{
	*fd = -1;
	struct pollfd p = {sock, POLLIN, 0};
	int rc;
	do
		rc = poll(&p, 1, timeout_ms);
	while (rc < 0 && errno == EINTR);
	if (rc == 0)
		return -ETIMEDOUT;
	if (rc < 0)
		return -errno;
	struct iovec iov = {buf, UPGRADE_RECORD_MAX};
	union {
		struct cmsghdr h;
		char space[CMSG_SPACE(4 * sizeof(int))];
	} u;
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.space,
			     .msg_controllen = sizeof(u.space)};
	ssize_t n;
	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	int fds[4];
	unsigned nfds = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k && nfds < 4; i++)
			memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	if (n == 0 && nfds == 0)
		return -EPIPE;
	if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		snprintf(why, why_len,
			 "a state record longer than %u bytes, or with more "
			 "descriptors than it may have",
			 (unsigned)UPGRADE_RECORD_MAX);
		return -EPROTO;
	}
	rc = upgrade_record_decode(buf, (size_t)n, nfds, r, why, why_len);
	if (rc < 0 || nfds == 0) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		return rc;
	}
	*fd = fds[0];
	return 0;
}

/* ---- The new daemon ---- */

int upgrade_child_fd(void)
{
	const char *v = getenv(UPGRADE_ENV);
	if (!v)
		return -1;
	char *end;
	long fd = strtol(v, &end, 10);
	unsetenv(UPGRADE_ENV);
	if (*end || fd < 3 || fd > 1 << 20 || fcntl((int)fd, F_GETFD) < 0)
		return -1;
	fcntl((int)fd, F_SETFD, FD_CLOEXEC);
	return (int)fd;
}

void upgrade_child_fail(int fd, const char *why)
{
	uint8_t buf[UPGRADE_RECORD_HEADER + UPGRADE_MAX_TEXT];
	size_t n = upgrade_record_error(buf, why && *why ? why : "it could not start");
	upgrade_send_record(fd, buf, n, -1);
}

/* array (*cap elements of size bytes) with room for one more after count:
 * itself, or a larger copy; NULL when out of memory (array unchanged). */
static void *grow(void *array, size_t *cap, size_t count, size_t size)
{
	if (count < *cap)
		return array;
	size_t n = *cap ? *cap * 2 : 16;
	void *p = realloc(array, n * size);
	if (p)
		*cap = n;
	return p;
}

int upgrade_child_hello(int fd, char *why, size_t why_len)
{
	uint8_t buf[64];
	size_t n = upgrade_record_hello(buf, (uint32_t)getpid());
	int rc = upgrade_send_record(fd, buf, n, -1);
	if (rc < 0)
		snprintf(why, why_len, "upgrade: the old daemon is gone: %s", strerror(-rc));
	return rc;
}

int upgrade_child_receive(int fd, bool hello_sent, struct upgrade_taken *t, char *why,
			  size_t why_len)
{
	memset(t, 0, sizeof(*t));
	int rc = hello_sent ? 0 : upgrade_child_hello(fd, why, why_len);
	if (rc < 0)
		return rc;
	uint8_t *buf = malloc(UPGRADE_RECORD_MAX);
	if (!buf) {
		snprintf(why, why_len, "out of memory");
		return -ENOMEM;
	}
	size_t lcap = 0, ccap = 0;
	for (;;) {
		struct upgrade_record r;
		int rfd;
		char err[512] = "";
		rc = upgrade_recv_record(fd, buf, -1, &r, &rfd, err, sizeof(err));
		if (rc < 0) {
			snprintf(why, why_len, "upgrade: the state record: %s",
				 rc == -EPROTO	? err
				 : rc == -EPIPE ? "the old daemon went away"
						: strerror(-rc));
			break;
		}
		if (r.type == UPGRADE_END) {
			if (r.connections != t->conn_count || r.listeners != t->listener_count) {
				snprintf(why, why_len,
					 "upgrade: END says %u connections and %u listeners, %zu "
					 "and %zu came",
					 r.connections, r.listeners, t->conn_count,
					 t->listener_count);
				rc = -EPROTO;
			}
			break;
		}
		if (r.type == UPGRADE_LISTENER) {
			void *more =
			    grow(t->listeners, &lcap, t->listener_count, sizeof(*t->listeners));
			if (!more) {
				close(rfd);
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
			t->listeners = more;
			char *spec = strdup(r.spec);
			t->listeners[t->listener_count++] =
			    (struct upgrade_listener){.fd = rfd, .kind = r.kind, .spec = spec};
			if (!spec) {
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
		} else if (r.type == UPGRADE_CONNECTION) {
			void *more = grow(t->conns, &ccap, t->conn_count, sizeof(*t->conns));
			if (!more) {
				close(rfd);
				rc = -ENOMEM;
				snprintf(why, why_len, "upgrade: out of memory");
				break;
			}
			t->conns = more;
			struct upgrade_taken_conn *c = &t->conns[t->conn_count++];
			c->fd = rfd;
			c->refused = NULL;
			c->st = r.conn;
			c->st.pending = NULL;
			if (r.conn.pending_len) {
				uint8_t *p = malloc(r.conn.pending_len);
				if (!p) {
					c->st.pending_len = 0;
					rc = -ENOMEM;
					snprintf(why, why_len, "upgrade: out of memory");
					break;
				}
				memcpy(p, r.conn.pending, r.conn.pending_len);
				c->st.pending = p;
			}
		} else {
			if (rfd >= 0)
				close(rfd);
			snprintf(why, why_len, "upgrade: a state record of type %u out of place",
				 (unsigned)r.type);
			rc = -EPROTO;
			break;
		}
	}
	free(buf);
	if (rc < 0)
		upgrade_taken_free(t);
	return rc;
}

int upgrade_take_listener(struct upgrade_taken *t, enum upgrade_listener_kind kind,
			  const char *spec)
{
	for (size_t i = 0; i < t->listener_count; i++) {
		struct upgrade_listener *l = &t->listeners[i];
		if (l->fd >= 0 && l->kind == kind && strcmp(l->spec, spec) == 0) {
			int fd = l->fd;
			l->fd = -1;
			return fd;
		}
	}
	return -1;
}

/*
 * Why t's refused connections will be closed, for the old daemon's reply:
 * "conn ID: REASON; ..." within len bytes, the first ones, and how many
 * more the log names. How many are refused.
 */
static unsigned refusals(const struct upgrade_taken *t, char *out, size_t len)
{
	unsigned refused = 0, said = 0;
	size_t at = 0;
	out[0] = '\0';
	for (size_t i = 0; i < t->conn_count; i++) {
		const char *why = t->conns[i].refused;
		if (!why)
			continue;
		refused++;
		if (strncmp(why, "upgrade: ", 9) == 0)
			why += 9; /* it is all about the upgrade */
		char one[UPGRADE_MAX_TEXT + 1];
		int n = snprintf(one, sizeof(one), "%sconn %llu: %s", said ? "; " : "",
				 (unsigned long long)t->conns[i].st.id, why);
		if (n > 0 && at + (size_t)n + 64 < len) { /* room left for the "more" */
			memcpy(out + at, one, (size_t)n + 1);
			at += (size_t)n;
			said++;
		}
	}
	if (said < refused)
		snprintf(out + at, len - at, "%s%u more (the new daemon's log says why)",
			 said ? "; and " : "", refused - said);
	return refused;
}

int upgrade_child_commit(int fd, const struct upgrade_taken *t)
{
	/* An old daemon that sent identities reads what TAKEN says it closes;
	 * an older one reads its first field only, and refuses more. */
	bool identities = false;
	for (size_t i = 0; i < t->conn_count; i++)
		identities |= (t->conns[i].st.flags & UPGRADE_CONN_IDENTITY) != 0;
	char closing[UPGRADE_MAX_TEXT + 1];
	unsigned refused = refusals(t, closing, sizeof(closing));
	uint8_t buf[UPGRADE_TAKEN_MAX];
	size_t n =
	    upgrade_record_taken(buf, (uint32_t)t->conn_count, identities ? refused : 0, closing);
	int rc = upgrade_send_record(fd, buf, n, -1);
	if (rc == 0) {
		uint8_t *in = malloc(UPGRADE_RECORD_MAX);
		struct upgrade_record r;
		int rfd;
		char why[512];
		rc = in ? upgrade_recv_record(fd, in, -1, &r, &rfd, why, sizeof(why)) : -ENOMEM;
		if (rc == 0 && rfd >= 0)
			close(rfd);
		if (rc == 0 && r.type != UPGRADE_COMMIT)
			rc = -EPROTO;
		/* The old daemon gone before it said so: it cannot serve on, so
		 * this one does (it only rolls back after killing this one). */
		if (rc == -EPIPE || rc == -ECONNRESET)
			rc = 0;
		free(in);
	}
	close(fd);
	return rc;
}

void upgrade_taken_free(struct upgrade_taken *t)
{
	for (size_t i = 0; i < t->listener_count; i++) {
		if (t->listeners[i].fd >= 0)
			close(t->listeners[i].fd);
		free(t->listeners[i].spec);
	}
	free(t->listeners);
	for (size_t i = 0; i < t->conn_count; i++) {
		if (t->conns[i].fd >= 0)
			close(t->conns[i].fd);
		free((void *)t->conns[i].st.pending);
		free(t->conns[i].refused);
	}
	free(t->conns);
	memset(t, 0, sizeof(*t));
}
