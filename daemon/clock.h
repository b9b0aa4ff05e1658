/*
 * daemon/clock.h: the monotonic clock in nanoseconds, for deadlines, ages
 * and rates. One definition for every module; any thread.
 */
#ifndef NBDCACHED_DAEMON_CLOCK_H
#define NBDCACHED_DAEMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t clock_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
