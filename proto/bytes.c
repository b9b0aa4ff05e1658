/*
 * proto/bytes.c: big-endian loads and stores at any alignment.
 *
 * Everything on the NBD wire is big-endian and nothing in a receive buffer
 * is guaranteed to be aligned, so every multi-byte field goes through these
 * six helpers: memcpy to or from a local (which compilers turn into a single
 * unaligned load or store) and an explicit byte swap from <endian.h>.
 */
#include <endian.h>
#include <string.h>

#include "proto/nbd.h"

uint16_t nbd_get16(const void *p)
{
	uint16_t v;

	memcpy(&v, p, sizeof v);
	return be16toh(v);
}

uint32_t nbd_get32(const void *p)
{
	uint32_t v;

	memcpy(&v, p, sizeof v);
	return be32toh(v);
}

uint64_t nbd_get64(const void *p)
{
	uint64_t v;

	memcpy(&v, p, sizeof v);
	return be64toh(v);
}

void nbd_put16(void *p, uint16_t v)
{
	v = htobe16(v);
	memcpy(p, &v, sizeof v);
}

void nbd_put32(void *p, uint32_t v)
{
	v = htobe32(v);
	memcpy(p, &v, sizeof v);
}

void nbd_put64(void *p, uint64_t v)
{
	v = htobe64(v);
	memcpy(p, &v, sizeof v);
}
