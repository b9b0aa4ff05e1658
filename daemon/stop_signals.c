/*
 * daemon/stop_signals.c: see stop_signals.h.
 *
 * Blocking, not a handler that sets a flag: a handler runs on whichever
 * thread the kernel picks and interrupts what it was waiting in (a poll()
 * in libnbd's connect fails with EINTR, and the start with it), where a
 * blocked signal changes nothing until it is asked for.
 */
#include "daemon/stop_signals.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const int steering[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};
#define STEERING (sizeof(steering) / sizeof(steering[0]))

static sigset_t started_with; /* the mask main() began with */
static sigset_t five;
static struct sigaction found[STEERING];
static bool keep_in_child; /* main thread, around its own fork only */
static bool hooked;

static void absorb(int sig)
{
	(void)sig;
}

/* In the child of any fork(), before it execs: the mask main() began with,
 * unless the fork is the daemon's own. */
static void child_mask(void)
{
	if (!keep_in_child)
		pthread_sigmask(SIG_SETMASK, &started_with, NULL);
}

void stop_signals_block(void)
{
	sigemptyset(&five);
	for (size_t i = 0; i < STEERING; i++)
		sigaddset(&five, steering[i]);
	pthread_sigmask(SIG_BLOCK, &five, &started_with);
	struct sigaction sa = {.sa_handler = absorb, .sa_flags = SA_RESTART};
	sigemptyset(&sa.sa_mask);
	for (size_t i = 0; i < STEERING; i++)
		sigaction(steering[i], &sa, &found[i]);
	if (!hooked && pthread_atfork(NULL, NULL, child_mask) == 0)
		hooked = true;
}

void stop_signals_restore(void)
{
	for (size_t i = 0; i < STEERING; i++)
		sigaction(steering[i], &found[i], NULL);
	pthread_sigmask(SIG_SETMASK, &started_with, NULL);
}

int stop_signal_pending(void)
{
	sigset_t p;
	if (sigpending(&p) < 0)
		return 0;
	if (sigismember(&p, SIGTERM) == 1)
		return SIGTERM;
	if (sigismember(&p, SIGINT) == 1)
		return SIGINT;
	return 0;
}

int stop_signal_take(void)
{
	int sig = stop_signal_pending();
	if (!sig)
		return 0;
	sigset_t stop;
	sigemptyset(&stop);
	sigaddset(&stop, SIGTERM);
	sigaddset(&stop, SIGINT);
	const struct timespec now = {0, 0};
	while (sigtimedwait(&stop, NULL, &now) > 0)
		;
	return sig;
}

void stop_signals_unblock(void)
{
	pthread_sigmask(SIG_UNBLOCK, &five, NULL);
}

void stop_signals_keep_in_child(bool keep)
{
	keep_in_child = keep;
}

/* Every one of the five pending here, taken and sent to child. */
static void pass_on(pid_t child)
{
	const struct timespec now = {0, 0};
	int sig;
	while ((sig = sigtimedwait(&five, NULL, &now)) > 0)
		kill(child, sig);
}

int stop_signals_relay(pid_t child, int ready)
{
	/* A signalfd wakes the wait at once; without one, a tenth of a
	 * second is the longest a signal waits to be passed on. */
	int sfd = signalfd(-1, &five, SFD_CLOEXEC | SFD_NONBLOCK);
	for (;;) {
		pass_on(child);
		struct pollfd f[2] = {{.fd = ready, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
		int n = poll(f, sfd >= 0 ? 2 : 1, sfd >= 0 ? -1 : 100);
		if (n < 0 && errno != EINTR)
			break;
		if (n <= 0 || !f[0].revents)
			continue; /* the signalfd is not read: pass_on() takes them */
		char c;
		ssize_t got = read(ready, &c, 1);
		if (got == 1) {
			pass_on(child); /* what came with it */
			return 0;
		}
		if (got == 0 || (errno != EINTR && errno != EAGAIN))
			break;
	}
	int status;
	while (waitpid(child, &status, 0) < 0) {
		if (errno != EINTR)
			return 1;
		pass_on(child);
	}
	return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
