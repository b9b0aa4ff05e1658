/*
 * daemon/check.c: see check.h. A violation's line goes through one rate
 * limiter (a broken invariant in a hot path must not flood the log); the
 * count is exact.
 */
#include "daemon/check.h"

#include <stdatomic.h>
#include <stdlib.h>

#include "daemon/log.h"

static atomic_uint_fast64_t violations;

LOG_LIMIT(violation_limit, "invariant violations");

void check_violated(const char *file, int line, const char *what)
{
	atomic_fetch_add_explicit(&violations, 1, memory_order_relaxed);
	log_limited(&violation_limit, LOG_ERROR,
		    "internal error: %s at %s:%d does not hold; going on (counted in the stats' "
		    "invariant_violations): please report it",
		    what, file, line);
}

void check_abort(const char *file, int line, const char *what)
{
	log_error("internal error: DCHECK(%s) at %s:%d does not hold; aborting", what, file, line);
	abort();
}

uint64_t check_violations(void)
{
	return atomic_load_explicit(&violations, memory_order_relaxed);
}
