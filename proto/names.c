/*
 * proto/names.c: errno to NBD error mapping, and names for logging.
 *
 * nbd_error_from_errno is the one place that decides which NBD error a
 * client sees for a local failure; the protocol only has a handful of
 * values, so everything unrecognised becomes NBD_EIO. The name functions
 * turn wire numbers into the spec's identifiers for log lines and test
 * failure messages; numbers we do not know come back as "unknown".
 */
#include <errno.h>

#include "proto/nbd.h"

uint32_t nbd_error_from_errno(int errnum)
{
	switch (errnum) {
	case EPERM:
	case EROFS:
		return NBD_EPERM;
	case EIO:
		return NBD_EIO;
	case ENOMEM:
		return NBD_ENOMEM;
	case EINVAL:
	case ERANGE:
		return NBD_EINVAL;
	case ENOSPC:
	case EDQUOT:
	case EFBIG:
		return NBD_ENOSPC;
	case EOVERFLOW:
		return NBD_EOVERFLOW;
	case ENOTSUP:
#if EOPNOTSUPP != ENOTSUP
	case EOPNOTSUPP:
#endif
		return NBD_ENOTSUP;
	case ESHUTDOWN:
		return NBD_ESHUTDOWN;
	default:
		return NBD_EIO;
	}
}

#define NAME(x)                                                                                    \
	case x:                                                                                    \
		return #x

const char *nbd_cmd_name(uint16_t type)
{
	switch (type) {
		NAME(NBD_CMD_READ);
		NAME(NBD_CMD_WRITE);
		NAME(NBD_CMD_DISC);
		NAME(NBD_CMD_FLUSH);
		NAME(NBD_CMD_TRIM);
		NAME(NBD_CMD_CACHE);
		NAME(NBD_CMD_WRITE_ZEROES);
		NAME(NBD_CMD_BLOCK_STATUS);
		NAME(NBD_CMD_RESIZE);
	default:
		return "unknown";
	}
}

const char *nbd_opt_name(uint32_t option)
{
	switch (option) {
		NAME(NBD_OPT_EXPORT_NAME);
		NAME(NBD_OPT_ABORT);
		NAME(NBD_OPT_LIST);
		NAME(NBD_OPT_STARTTLS);
		NAME(NBD_OPT_INFO);
		NAME(NBD_OPT_GO);
		NAME(NBD_OPT_STRUCTURED_REPLY);
		NAME(NBD_OPT_LIST_META_CONTEXT);
		NAME(NBD_OPT_SET_META_CONTEXT);
		NAME(NBD_OPT_EXTENDED_HEADERS);
	default:
		return "unknown";
	}
}

const char *nbd_rep_name(uint32_t type)
{
	switch (type) {
		NAME(NBD_REP_ACK);
		NAME(NBD_REP_SERVER);
		NAME(NBD_REP_INFO);
		NAME(NBD_REP_META_CONTEXT);
		NAME(NBD_REP_ERR_UNSUP);
		NAME(NBD_REP_ERR_POLICY);
		NAME(NBD_REP_ERR_INVALID);
		NAME(NBD_REP_ERR_PLATFORM);
		NAME(NBD_REP_ERR_TLS_REQD);
		NAME(NBD_REP_ERR_UNKNOWN);
		NAME(NBD_REP_ERR_SHUTDOWN);
		NAME(NBD_REP_ERR_BLOCK_SIZE_REQD);
		NAME(NBD_REP_ERR_TOO_BIG);
		NAME(NBD_REP_ERR_EXT_HEADER_REQD);
	default:
		return "unknown";
	}
}

const char *nbd_err_name(uint32_t error)
{
	switch (error) {
		NAME(NBD_SUCCESS);
		NAME(NBD_EPERM);
		NAME(NBD_EIO);
		NAME(NBD_ENOMEM);
		NAME(NBD_EINVAL);
		NAME(NBD_ENOSPC);
		NAME(NBD_EOVERFLOW);
		NAME(NBD_ENOTSUP);
		NAME(NBD_ESHUTDOWN);
	default:
		return "unknown";
	}
}
