/*
 * daemon/log.c: see log.h. Messages carry a UTC timestamp and the level; the
 * whole line is built first and written once, so concurrent threads cannot
 * interleave partial lines.
 *
 * Under systemd, stderr is a stream into the journal (JOURNAL_STREAM names
 * its device and inode). Lines then start with the syslog priority in
 * angle brackets ("<3>" for an error), which the journal turns into the
 * entry's priority, and leave out the timestamp and pid it records itself.
 */
#include "daemon/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/clock.h"

static volatile int current_level = LOG_INFO;

static const char *const level_names[] = {"error", "warn", "info", "debug"};
static const char *const journal_priorities[] = {"<3>", "<4>", "<6>", "<7>"};
static atomic_int to_journal = -1; /* -1: not yet known */

/* Is stderr the journal stream systemd gave us? */
static bool stderr_is_journal(void)
{
	const char *env = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;
	if (!env || sscanf(env, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) < 0)
		return false;
	return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

int log_parse_level(const char *text, enum log_level *out)
{
	for (unsigned i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
		if (strcmp(text, level_names[i]) == 0) {
			*out = (enum log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

void log_set_level(enum log_level level)
{
	current_level = level;
}

enum log_level log_get_level(void)
{
	return (enum log_level)current_level;
}

/* The last error line's message, for a live upgrade's new daemon to say
 * why it could not start (log_last_error). */
static pthread_mutex_t last_error_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[1024];

void log_last_error(char *out, size_t len)
{
	pthread_mutex_lock(&last_error_lock);
	snprintf(out, len, "%s", last_error);
	pthread_mutex_unlock(&last_error_lock);
}

static void log_vmsg(enum log_level level, const char *fmt, va_list ap)
{
	char line[2048];
	int n;
	if (to_journal < 0)
		to_journal = stderr_is_journal(); /* every thread finds the same */
	if (to_journal) {
		n = snprintf(line, sizeof(line), "%s%s: ", journal_priorities[level],
			     level_names[level]);
	} else {
		struct timespec ts;
		struct tm tm;
		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ nbdcached[%d] %s: ",
			     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
			     tm.tm_sec, ts.tv_nsec / 1000000, (int)getpid(), level_names[level]);
	}
	if (n < 0)
		return;
	int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	if (m < 0)
		return;
	size_t len = (size_t)n + (size_t)m;
	if (len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	if (level == LOG_ERROR) {
		pthread_mutex_lock(&last_error_lock);
		snprintf(last_error, sizeof(last_error), "%.*s", (int)(len - (size_t)n), line + n);
		pthread_mutex_unlock(&last_error_lock);
	}
	line[len++] = '\n';
	int saved = errno;
	ssize_t w = write(STDERR_FILENO, line, len);
	(void)w;
	errno = saved;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	if ((int)level > current_level)
		return;
	va_list ap;
	va_start(ap, fmt);
	log_vmsg(level, fmt, ap);
	va_end(ap);
}

bool log_due(_Atomic uint64_t *last_ns, uint64_t interval_ns)
{
	uint64_t now = clock_now_ns(), last = atomic_load(last_ns);
	return (!last || now - last >= interval_ns) &&
	       atomic_compare_exchange_strong(last_ns, &last, now);
}

/* ---- rate limits for lines a remote party can cause ---- */

/* Guards every struct log_limit and the list of them. Held while their
 * lines are written, so a count is never printed after the line it
 * precedes; the work under it is one write(2). */
static pthread_mutex_t limits_lock = PTHREAD_MUTEX_INITIALIZER;
static struct log_limit *limits;

/* Say l's count, if any (limits_lock held). */
static void limit_say(struct log_limit *l, uint64_t now)
{
	if (!l->suppressed)
		return;
	log_msg(l->level, "%s: %llu similar lines suppressed in the last %llu s", l->kind,
		(unsigned long long)l->suppressed,
		(unsigned long long)((now - l->window_ns + 999999999u) / 1000000000u));
	l->suppressed = 0;
}

void log_limited(struct log_limit *l, enum log_level level, const char *fmt, ...)
{
	if ((int)level > current_level)
		return;
	uint64_t now = clock_now_ns();
	pthread_mutex_lock(&limits_lock);
	if (!l->registered) {
		l->registered = true;
		l->next = limits;
		limits = l;
	}
	l->level = level;
	if (!l->window_ns || now - l->window_ns >= LOG_LIMIT_INTERVAL_NS) {
		limit_say(l, now);
		l->window_ns = now;
		l->printed = 0;
	}
	if (l->printed < (l->burst ? l->burst : LOG_LIMIT_BURST)) {
		l->printed++;
		va_list ap;
		va_start(ap, fmt);
		log_vmsg(level, fmt, ap);
		va_end(ap);
	} else {
		l->suppressed++;
	}
	pthread_mutex_unlock(&limits_lock);
}

void log_limits_flush(void)
{
	uint64_t now = clock_now_ns();
	pthread_mutex_lock(&limits_lock);
	for (struct log_limit *l = limits; l; l = l->next)
		if (l->suppressed && now - l->window_ns >= LOG_LIMIT_INTERVAL_NS)
			limit_say(l, now);
	pthread_mutex_unlock(&limits_lock);
}
