/*
 * client/lib/io.c: all-or-nothing reads and writes (see io.h).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "client/lib/io.h"

int io_full(int fd, void *buf, size_t length, bool writing)
{
	uint8_t *p = buf;

	while (length) {
		ssize_t n = writing ? write(fd, p, length) : read(fd, p, length);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -ENODATA;
		p += n;
		length -= (size_t)n;
	}
	return 0;
}
