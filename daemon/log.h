/*
 * daemon/log.h: leveled logging to stderr, one line per event.
 *
 * Owns: the global log level. Thread-safe: each message is formatted into
 * one buffer and written with a single write(2), so lines from different
 * worker threads never interleave. Callers decide whether an error is worth
 * a line (functions return -errno and stay silent).
 *
 * A line that a remote party can cause (a refused connect, a failed TLS
 * handshake, a connection that ended in negotiation) goes through a
 * struct log_limit, one per kind of line: at most LOG_LIMIT_BURST of them
 * in LOG_LIMIT_INTERVAL_NS, the rest counted. The count is said in a line
 * of its own, "KIND: N similar lines suppressed in the last S s", before
 * the next line of that kind is printed or, when none comes, by
 * log_limits_flush() (the control thread's tick, once a second) once the
 * interval is over. A limiter's fields are guarded by one lock in log.c;
 * a limiter registers itself, for the flush, on its first use.
 *
 * The lines of a client's session that opened an export (TLS with whom,
 * the export negotiated, how it ended) are any allowed client's to cause
 * too, by reconnecting in a loop, but a busy server has many of them: they
 * get LOG_LIMIT_SESSION_BURST (LOG_LIMIT_SESSIONS), so a hundred clients
 * attaching at once are all logged and a reconnect loop is not.
 */
#ifndef NBDCACHED_DAEMON_LOG_H
#define NBDCACHED_DAEMON_LOG_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum log_level { LOG_ERROR = 0, LOG_WARN, LOG_INFO, LOG_DEBUG };

/* Parse "error", "warn", "info", "debug"; returns 0 or -EINVAL. */
int log_parse_level(const char *text, enum log_level *out);
void log_set_level(enum log_level level);
enum log_level log_get_level(void);
void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * True at most once per interval_ns for one kind of line, whatever thread
 * asks: *last_ns (zero at first) is when it last said yes. For conditions
 * that may hold for every request (out of memory), so they get a line now
 * and then, not one each.
 */
bool log_due(_Atomic uint64_t *last_ns, uint64_t interval_ns);

#define LOG_LIMIT_BURST 10
#define LOG_LIMIT_SESSION_BURST 200
#define LOG_LIMIT_INTERVAL_NS (5 * 1000000000ull)

struct log_limit {
	const char *kind; /* names the lines in the suppression count */
	unsigned burst;	  /* lines per interval; 0: LOG_LIMIT_BURST */
	/* log.c's lock: */
	uint64_t window_ns;   /* when the current interval began (0: never) */
	unsigned printed;     /* lines printed in it */
	uint64_t suppressed;  /* lines not printed and not yet counted aloud */
	enum log_level level; /* of the last line: the count's level */
	bool registered;      /* on the list log_limits_flush() walks */
	struct log_limit *next;
};
/* A limiter for one call site: static, named, zero otherwise. */
#define LOG_LIMIT(var, kind_text) static struct log_limit var = {.kind = (kind_text)}
/* ... for a session's lines (see above). */
#define LOG_LIMIT_SESSIONS(var, kind_text)                                                          \
	static struct log_limit var = {.kind = (kind_text), .burst = LOG_LIMIT_SESSION_BURST}

/* log_msg() under l's limit (see above). Any thread. */
void log_limited(struct log_limit *l, enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Say the counts of limiters whose interval is over (any thread; the
 * control thread's tick calls it). */
void log_limits_flush(void);

/* The message of the last error line logged ("" if none). Any thread. */
void log_last_error(char *out, size_t len);

#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...)                                                                             \
	do {                                                                                       \
		if (log_get_level() >= LOG_DEBUG)                                                  \
			log_msg(LOG_DEBUG, __VA_ARGS__);                                           \
	} while (0)

#endif
