/*
 * daemon/log.h: leveled logging to stderr, one line per event.
 *
 * Owns: the global log level. Thread-safe: each message is formatted into
 * one buffer and written with a single write(2), so lines from different
 * worker threads never interleave. Callers decide whether an error is worth
 * a line (functions return -errno and stay silent).
 */
#ifndef NBDCACHED_DAEMON_LOG_H
#define NBDCACHED_DAEMON_LOG_H

#include <stdatomic.h>
#include <stdbool.h>
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

#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...)                                                                             \
	do {                                                                                       \
		if (log_get_level() >= LOG_DEBUG)                                                  \
			log_msg(LOG_DEBUG, __VA_ARGS__);                                           \
	} while (0)

#endif
