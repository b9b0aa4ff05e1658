/*
 * client/lib/io.h: all-or-nothing reads and writes on a file descriptor,
 * for the client programs' sockets and their standard input and output.
 *
 * Locking: none; the descriptor is the caller's.
 */
#ifndef CLIENT_LIB_IO_H
#define CLIENT_LIB_IO_H

#include <stdbool.h>
#include <stddef.h>

/*
 * Read or write exactly `length` bytes, retrying after EINTR and short
 * transfers: 0 or -errno; -ENODATA when the input ends early.
 */
int io_full(int fd, void *buf, size_t length, bool writing);

#endif
