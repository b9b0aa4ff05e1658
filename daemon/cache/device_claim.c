/*
 * daemon/cache/device_claim.c: a cache device belongs to one daemon, and
 * to nobody else who could read it (device_internal.h, dev_claim).
 *
 * The device holds every byte a FLUSH acknowledged and the live log a
 * start replays: two daemons on it would replay each other's log and
 * write over each other's batches, and a user who can read it reads every
 * client's data. So, as long as it is open:
 *
 *   a lock   an OFD lock over the whole file (a write lock for a daemon, a
 *            read lock for --check-config, so that neither runs beside a
 *            daemon; released by the kernel when the process ends, even by
 *            SIGKILL); a block device is also opened O_EXCL (the kernel
 *            refuses it while it is mounted or opened so by anyone)
 *   a mode   a file readable or writable by anyone but its owner, a block
 *            device by anyone but its owner and group (disk), is refused
 *            with the chmod that fixes it, as ssh refuses a key file
 *
 * A refusal names the process holding the device where /proc says it.
 * A live upgrade hands the device over: the old daemon releases it
 * (cache_device_release: closed, its lock dropped), and the new one waits
 * for that only while no process but its parent, the old daemon, has it
 * open (dev_held_by_other).
 */
#include "daemon/cache/device_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/log.h"

/* Has process pid the file of st open (from /proc)? */
static bool pid_holds(long pid, const struct stat *st)
{
	char dir[64];
	snprintf(dir, sizeof(dir), "/proc/%ld/fd", pid);
	DIR *fds = opendir(dir);
	if (!fds)
		return false;
	struct dirent *f;
	bool has = false;
	while (!has && (f = readdir(fds)) != NULL) {
		char fd[PATH_MAX];
		struct stat fs;
		if (f->d_name[0] == '.')
			continue;
		snprintf(fd, sizeof(fd), "%s/%s", dir, f->d_name);
		has = stat(fd, &fs) == 0 && fs.st_dev == st->st_dev && fs.st_ino == st->st_ino &&
		      fs.st_rdev == st->st_rdev;
	}
	closedir(fds);
	return has;
}

bool dev_held_by_other(const char *path, pid_t parent)
{
	struct stat st;
	if (stat(path, &st) < 0)
		return true;
	DIR *proc = opendir("/proc");
	if (!proc)
		return true;
	pid_t self = getpid();
	bool other = false;
	struct dirent *p;
	while (!other && (p = readdir(proc)) != NULL) {
		char *end;
		long pid = strtol(p->d_name, &end, 10);
		other = !*end && pid > 0 && pid != self && pid != parent && pid_holds(pid, &st);
	}
	closedir(proc);
	return other;
}

/* The PIDs (up to 8, in buf) of processes other than this one that have
 * the file of st open, from /proc; "" when none could be seen. */
static void holders(const struct stat *st, char *buf, size_t len)
{
	buf[0] = '\0';
	DIR *proc = opendir("/proc");
	if (!proc)
		return;
	size_t at = 0;
	unsigned found = 0;
	pid_t self = getpid();
	struct dirent *p;
	while (found < 8 && (p = readdir(proc)) != NULL) {
		char *end;
		long pid = strtol(p->d_name, &end, 10);
		if (*end || pid <= 0 || pid == self || !pid_holds(pid, st))
			continue;
		char comm[64] = "?";
		char cpath[64];
		snprintf(cpath, sizeof(cpath), "/proc/%ld/comm", pid);
		FILE *c = fopen(cpath, "re");
		if (c) {
			if (fgets(comm, sizeof(comm), c))
				comm[strcspn(comm, "\n")] = '\0';
			fclose(c);
		}
		if (at < len)
			at += (size_t)snprintf(buf + at, len - at, "%s%s (PID %ld)", found ? ", " : "",
					       comm, pid);
		found++;
	}
	closedir(proc);
}

int dev_open_flags(const char *path, bool readonly)
{
	struct stat st;
	/* O_EXCL on a block device: not while mounted or opened so. */
	return (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC |
	       (stat(path, &st) == 0 && S_ISBLK(st.st_mode) ? O_EXCL : 0);
}

int dev_claim(struct cache_device *d, const struct stat *st, bool readonly, char *err,
	      size_t len)
{
	mode_t open_to = S_ISBLK(st->st_mode) ? st->st_mode & 0007 : st->st_mode & 0077;
	if (open_to)
		return dev_fail(err, len, -EPERM,
				"cache device %s: mode %04o: %s can %s it, and it holds every "
				"byte a FLUSH acknowledged: refused; fix it with: chmod %s %s",
				d->path, (unsigned)(st->st_mode & 07777),
				S_ISBLK(st->st_mode) ? "users outside its owner and group"
						     : "users other than its owner",
				open_to & 0044 ? "read" : "write",
				S_ISBLK(st->st_mode) ? "o-rwx" : "go-rwx", d->path);
	struct flock fl = {.l_type = readonly ? F_RDLCK : F_WRLCK, .l_whence = SEEK_SET};
	if (fcntl(d->fd, F_OFD_SETLK, &fl) == 0)
		return 0;
	int e = errno;
	if (e != EAGAIN && e != EACCES)
		return dev_fail(err, len, -e, "cache device %s: locking it: %s", d->path,
				strerror(e));
	char who[600];
	holders(st, who, sizeof(who));
	return dev_fail(err, len, -EBUSY,
			"cache device %s: in use by another daemon%s%s (it is locked): refused; a "
			"cache device belongs to one daemon at a time",
			d->path, who[0] ? ": " : "", who);
}

int cache_device_release(struct cache_device *d)
{
	pthread_mutex_lock(&d->lock);
	bool detached = d->detached, released = d->released;
	d->released = detached;
	pthread_mutex_unlock(&d->lock);
	if (!detached)
		return -EBUSY;
	if (released)
		return 0;
	/* The number stays a descriptor (of /dev/null) so that nothing can
	 * reach the device through it any more; the open file description,
	 * and with it the lock, goes. */
	int null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null < 0 || dup3(null, d->fd, O_CLOEXEC) < 0) {
		int e = errno;
		if (null >= 0)
			close(null);
		pthread_mutex_lock(&d->lock);
		d->released = false;
		pthread_mutex_unlock(&d->lock);
		return -e;
	}
	close(null);
	log_info("cache device %s: released (closed, its lock dropped): another daemon may "
		 "take it",
		 d->path);
	return 0;
}
