/*
 * tests/faultfs/faults.c: the fault mode, its commands and the counters
 * (see faults.h).
 */
#include "tests/faultfs/faults.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum fault_mode {
	MODE_OK,
	MODE_FAIL_READ,
	MODE_FAIL_WRITE,
	MODE_FAIL_FSYNC,
	MODE_FAIL_FSYNC_ONCE,
	MODE_FAIL_ALL,
	MODE_STALL,
};

static const char *const mode_names[] = {
    [MODE_OK] = "ok",
    [MODE_FAIL_READ] = "fail-read",
    [MODE_FAIL_WRITE] = "fail-write",
    [MODE_FAIL_FSYNC] = "fail-fsync",
    [MODE_FAIL_FSYNC_ONCE] = "fail-fsync-once",
    [MODE_FAIL_ALL] = "fail-all",
    [MODE_STALL] = "stall",
};

static const char *const counter_names[FAULT_COUNTERS] = {
    [FAULT_READS] = "reads",
    [FAULT_WRITES] = "writes",
    [FAULT_BYTES_WRITTEN] = "bytes_written",
    [FAULT_FALLOCATES] = "fallocates",
    [FAULT_FSYNCS_OK] = "fsyncs_ok",
    [FAULT_FSYNCS_FAILED] = "fsyncs_failed",
    [FAULT_ROLLBACKS] = "rollbacks",
    [FAULT_POWER_LOSSES] = "power_losses",
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t mode_changed;
static pthread_once_t cond_once = PTHREAD_ONCE_INIT;
static enum fault_mode mode = MODE_OK;
static unsigned delay_ms;
/* fail-write-after N: writes pass until N more have, then fail (mode
 * fail-write from then on); 0: not armed. */
static uint64_t writes_left;
static bool lose_on_fsync_error = true;
static uint64_t counters[FAULT_COUNTERS];
static uint64_t ops_failed;
static uint64_t stalled;	/* operations waiting in a stall now */
static uint64_t stall_timeouts; /* stalls that gave up with EIO */

/* The stall deadline is on CLOCK_MONOTONIC: a clock step must not end it. */
static void init_cond(void)
{
	pthread_condattr_t attr;
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&mode_changed, &attr);
	pthread_condattr_destroy(&attr);
}

static void set_mode(enum fault_mode m)
{
	mode = m;
	pthread_cond_broadcast(&mode_changed);
}

static bool fails(enum fault_op op)
{
	switch (mode) {
	case MODE_OK:
	case MODE_STALL:
		return false;
	case MODE_FAIL_READ:
		return op == FAULT_OP_READ;
	case MODE_FAIL_WRITE:
		return op == FAULT_OP_WRITE;
	case MODE_FAIL_FSYNC:
	case MODE_FAIL_FSYNC_ONCE:
		return op == FAULT_OP_FSYNC;
	case MODE_FAIL_ALL:
		return true;
	}
	return false;
}

/* Wait while the mode is stall; false when FAULT_STALL_SECONDS passed.
 * Called and returns with the lock held. */
static bool wait_out_stall(void)
{
	struct timespec deadline;
	clock_gettime(CLOCK_MONOTONIC, &deadline);
	deadline.tv_sec += FAULT_STALL_SECONDS;
	stalled++;
	bool ok = true;
	while (mode == MODE_STALL) {
		if (pthread_cond_timedwait(&mode_changed, &lock, &deadline) == ETIMEDOUT &&
		    mode == MODE_STALL) {
			stall_timeouts++;
			ok = false;
			break;
		}
	}
	stalled--;
	return ok;
}

int fault_gate(enum fault_op op)
{
	pthread_once(&cond_once, init_cond);
	pthread_mutex_lock(&lock);
	unsigned delay = delay_ms;
	pthread_mutex_unlock(&lock);
	if (delay) {
		struct timespec ts = {delay / 1000, (long)(delay % 1000) * 1000000L};
		while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
	}
	pthread_mutex_lock(&lock);
	int rc = 0;
	if (op == FAULT_OP_WRITE && writes_left && --writes_left == 0)
		set_mode(MODE_FAIL_WRITE); /* the N that were to pass have */
	if (!wait_out_stall() || fails(op))
		rc = -EIO;
	if (rc < 0) {
		ops_failed++;
		if (op == FAULT_OP_FSYNC && mode == MODE_FAIL_FSYNC_ONCE)
			set_mode(MODE_OK);
	}
	pthread_mutex_unlock(&lock);
	return rc;
}

void fault_count(enum fault_counter c, uint64_t n)
{
	pthread_mutex_lock(&lock);
	counters[c] += n;
	pthread_mutex_unlock(&lock);
}

bool fault_lose_on_fsync_error(void)
{
	pthread_mutex_lock(&lock);
	bool lose = lose_on_fsync_error;
	pthread_mutex_unlock(&lock);
	return lose;
}

/* One command (a line without its newline, NUL-terminated). Lock held. */
static int one_command(char *line, bool *power_loss)
{
	char *save = NULL;
	char *word = strtok_r(line, " \t\r", &save);
	if (!word)
		return 0;
	char *arg = strtok_r(NULL, " \t\r", &save);
	if (strtok_r(NULL, " \t\r", &save))
		return -EINVAL;
	for (size_t m = 0; m < sizeof(mode_names) / sizeof(mode_names[0]); m++) {
		if (strcmp(word, mode_names[m]) == 0) {
			if (arg)
				return -EINVAL;
			set_mode((enum fault_mode)m);
			writes_left = 0;
			if (m == MODE_OK)
				delay_ms = 0;
			return 0;
		}
	}
	if (strcmp(word, "delay-ms") == 0) {
		char *end;
		if (!arg)
			return -EINVAL;
		errno = 0;
		unsigned long v = strtoul(arg, &end, 10);
		if (errno || *end || end == arg || v > 60000)
			return -EINVAL;
		delay_ms = (unsigned)v;
		return 0;
	}
	if (strcmp(word, "fail-write-after") == 0) {
		char *end;
		if (!arg)
			return -EINVAL;
		errno = 0;
		unsigned long long v = strtoull(arg, &end, 10);
		if (errno || *end || end == arg)
			return -EINVAL;
		/* the next v writes pass, the one after fails, and every write
		 * after it (fail-write) */
		writes_left = v + 1;
		return 0;
	}
	if (strcmp(word, "lose-on-fsync-error") == 0) {
		if (arg && strcmp(arg, "on") == 0)
			lose_on_fsync_error = true;
		else if (arg && strcmp(arg, "off") == 0)
			lose_on_fsync_error = false;
		else
			return -EINVAL;
		return 0;
	}
	if (arg)
		return -EINVAL;
	if (strcmp(word, "power-loss") == 0) {
		*power_loss = true;
		return 0;
	}
	if (strcmp(word, "reset-counters") == 0) {
		memset(counters, 0, sizeof(counters));
		ops_failed = 0;
		stall_timeouts = 0;
		return 0;
	}
	return -EINVAL;
}

int fault_command(const char *text, size_t len, bool *power_loss)
{
	pthread_once(&cond_once, init_cond);
	char *copy = malloc(len + 1);
	if (!copy)
		return -ENOMEM;
	memcpy(copy, text, len);
	copy[len] = '\0';
	int rc = 0;
	pthread_mutex_lock(&lock);
	char *save = NULL;
	for (char *line = strtok_r(copy, "\n", &save); line && rc == 0;
	     line = strtok_r(NULL, "\n", &save))
		rc = one_command(line, power_loss);
	pthread_mutex_unlock(&lock);
	free(copy);
	return rc;
}

size_t fault_status(char *buf, size_t size, const struct fault_undo_summary *undo)
{
	pthread_mutex_lock(&lock);
	size_t n = 0;
	int w = snprintf(buf, size,
			 "{\"mode\": \"%s\", \"delay_ms\": %u, \"lose_on_fsync_error\": %s, "
			 "\"ops_failed\": %llu, \"stalled\": %llu, \"stall_timeouts\": %llu",
			 mode_names[mode], delay_ms, lose_on_fsync_error ? "true" : "false",
			 (unsigned long long)ops_failed, (unsigned long long)stalled,
			 (unsigned long long)stall_timeouts);
	for (int c = 0; c < FAULT_COUNTERS && w >= 0 && (size_t)w < size - n; c++) {
		n += (size_t)w;
		w = snprintf(buf + n, size - n, ", \"%s\": %llu", counter_names[c],
			     (unsigned long long)counters[c]);
	}
	pthread_mutex_unlock(&lock);
	if (w >= 0 && (size_t)w < size - n) {
		n += (size_t)w;
		w = snprintf(
		    buf + n, size - n,
		    ", \"undo_files\": %llu, \"undo_bytes\": %llu, \"undo_buffered_bytes\": "
		    "%llu, \"undo_ranges\": %llu, \"undo_overflow\": %s}\n",
		    (unsigned long long)undo->files, (unsigned long long)undo->bytes,
		    (unsigned long long)undo->buffered_bytes, (unsigned long long)undo->ranges,
		    undo->overflow ? "true" : "false");
	}
	if (w >= 0 && (size_t)w < size - n)
		n += (size_t)w;
	return n;
}
