/*
 * daemon/check.h: tripwires. The invariants the code relies on are kept
 * in the code, where a test run trips over them (SQLite's ALWAYS and
 * NEVER, the kernel's WARN_ON), not in a document only:
 *
 *   DCHECK(x)   x holds. In a build with NBDCACHED_CHECKS (make asan
 *               defines it) x is evaluated and a violation aborts, naming
 *               the file, the line and x; otherwise x is not evaluated
 *               and costs nothing. For facts whose violation leaves
 *               nothing sane to go on with.
 *   ALWAYS(x)   x holds, but the code survives if it does not: x is always
 *   NEVER(x)    evaluated and the macro's value is x's, so the caller
 *               handles the case (`if (NEVER(n == 0)) return;`); a
 *               violation is counted (check_violations(): the stats'
 *               invariant_violations, nbdcached_invariant_violations_total)
 *               and logged, rate-limited. They never abort: a daemon
 *               serving clients goes on, loudly.
 *
 * Any thread; no lock.
 */
#ifndef NBDCACHED_DAEMON_CHECK_H
#define NBDCACHED_DAEMON_CHECK_H

#include <stdbool.h>
#include <stdint.h>

/* Count and log a violated invariant (ALWAYS, NEVER); abort (DCHECK). */
void check_violated(const char *file, int line, const char *what);
void check_abort(const char *file, int line, const char *what) __attribute__((noreturn));
/* Violations of ALWAYS and NEVER since the start. */
uint64_t check_violations(void);

#define ALWAYS(x) \
	(__builtin_expect(!!(x), 1) ? true : (check_violated(__FILE__, __LINE__, "ALWAYS(" #x ")"), false))
#define NEVER(x) \
	(__builtin_expect(!!(x), 0) ? (check_violated(__FILE__, __LINE__, "NEVER(" #x ")"), true) : false)

#ifdef NBDCACHED_CHECKS
#define DCHECK(x) \
	((void)(__builtin_expect(!!(x), 1) ? 0 : (check_abort(__FILE__, __LINE__, #x), 0)))
#else
#define DCHECK(x) ((void)sizeof(!(x)))
#endif

#endif
