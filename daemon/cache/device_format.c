/*
 * daemon/cache/device_format.c: see device_format.h.
 */
#include "daemon/cache/device_format.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "proto/nbd.h"

/* ---- CRC32C: reflected, polynomial 0x82F63B78 ----
 * Eight bytes at a time: the CPU's crc32 instruction where it has one
 * (SSE4.2, checked at run time), else eight tables of 256 (slicing by 8).
 * The replay reads the whole log twice and checks each batch both times:
 * a byte at a time (about 280 MiB/s here) was most of its time. */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
static bool crc_hw;
#endif

static void crc_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
		crc_table[0][i] = c;
	}
	for (uint32_t i = 0; i < 256; i++)
		for (int t = 1; t < 8; t++)
			crc_table[t][i] =
			    (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	__builtin_cpu_init();
	crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t crc_sse42(uint32_t crc, const uint8_t *b,
							    size_t n)
{
	for (; n && ((uintptr_t)b & 7); n--)
		crc = __builtin_ia32_crc32qi(crc, *b++);
	for (; n >= 8; n -= 8, b += 8) {
		uint64_t v;
		memcpy(&v, b, 8);
		crc = (uint32_t)__builtin_ia32_crc32di(crc, v);
	}
	for (; n; n--)
		crc = __builtin_ia32_crc32qi(crc, *b++);
	return crc;
}
#endif

static uint32_t crc_slice8(uint32_t crc, const uint8_t *b, size_t n)
{
	for (; n && ((uintptr_t)b & 7); n--)
		crc = crc_table[0][(crc ^ *b++) & 0xff] ^ (crc >> 8);
	for (; n >= 8; n -= 8, b += 8) {
		/* Little-endian words, as the reflected CRC takes its bytes. */
		uint32_t lo = crc ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
				     (uint32_t)b[3] << 24);
		uint32_t hi = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 |
			      (uint32_t)b[7] << 24;
		crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
		      crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
		      crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
		      crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
	}
	for (; n; n--)
		crc = crc_table[0][(crc ^ *b++) & 0xff] ^ (crc >> 8);
	return crc;
}

uint32_t devfmt_crc32c(uint32_t crc, const void *p, size_t n)
{
	pthread_once(&crc_once, crc_init);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	if (crc_hw)
		return ~crc_sse42(~crc, p, n);
#endif
	return ~crc_slice8(~crc, p, n);
}

uint32_t devfmt_crc32c_portable(uint32_t crc, const void *p, size_t n)
{
	pthread_once(&crc_once, crc_init);
	return ~crc_slice8(~crc, p, n);
}

static int refuse(char *why, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int refuse(char *why, size_t len, const char *fmt, ...)
{
	if (why && len) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(why, len, fmt, ap);
		va_end(ap);
	}
	return -EINVAL;
}

/* ---- the superblock ---- */

int devfmt_sb_encode(const struct devfmt_sb *sb, uint8_t *buf)
{
	if (sb->export_count > DEVFMT_MAX_EXPORTS)
		return -EINVAL;
	memset(buf, 0, DEVFMT_SB_BYTES);
	nbd_put64(buf, DEVFMT_SB_MAGIC);
	nbd_put32(buf + 8, DEVFMT_VERSION);
	nbd_put32(buf + 12, sb->flags);
	memcpy(buf + 16, sb->uuid, 16);
	nbd_put64(buf + 32, sb->generation);
	nbd_put64(buf + 40, sb->device_bytes);
	nbd_put64(buf + 48, sb->log_offset);
	nbd_put64(buf + 56, sb->log_bytes);
	nbd_put64(buf + 64, sb->checkpoint_offset);
	nbd_put64(buf + 72, sb->checkpoint_seq);
	nbd_put32(buf + 80, sb->export_count);
	nbd_put32(buf + 84, sb->checkpoint_skip);
	nbd_put64(buf + 88, sb->l2_offset);
	nbd_put64(buf + 96, sb->l2_bytes);
	nbd_put64(buf + 104, sb->l2_map_offset);
	nbd_put32(buf + 112, sb->l2_map_gen);
	nbd_put64(buf + 116, sb->seq_floor);
	for (uint32_t i = 0; i < sb->export_count; i++) {
		const struct devfmt_identity *id = &sb->exports[i];
		size_t nl = strnlen(id->name, sizeof(id->name));
		size_t bl = strnlen(id->backend, sizeof(id->backend));
		if (nl == 0 || nl > DEVFMT_MAX_NAME || bl > DEVFMT_MAX_BACKEND)
			return -EINVAL;
		uint8_t *p = buf + DEVFMT_SB_HEADER + (size_t)i * DEVFMT_IDENTITY_BYTES;
		nbd_put16(p, id->slot);
		nbd_put16(p + 2, (uint16_t)nl);
		nbd_put16(p + 4, (uint16_t)bl);
		nbd_put32(p + 8, id->block_size);
		nbd_put32(p + 12, id->kind);
		nbd_put64(p + 16, id->size);
		nbd_put64(p + 24, id->dev);
		nbd_put64(p + 32, id->ino);
		memcpy(p + DEVFMT_IDENTITY_FIXED, id->name, nl);
		memcpy(p + DEVFMT_IDENTITY_FIXED + DEVFMT_MAX_NAME, id->backend, bl);
	}
	nbd_put32(buf + DEVFMT_SB_BYTES - 4, devfmt_crc32c(0, buf, DEVFMT_SB_BYTES - 4));
	return 0;
}

static bool valid_block_size(uint32_t bs)
{
	return bs >= 512 && bs <= 65536 && (bs & (bs - 1)) == 0;
}

int devfmt_sb_decode(const uint8_t *buf, struct devfmt_sb *out, char *why, size_t why_len)
{
	if (nbd_get64(buf) != DEVFMT_SB_MAGIC)
		return refuse(why, why_len, "no nbdcached superblock (magic 0x%016llx)",
			      (unsigned long long)nbd_get64(buf));
	uint32_t crc = devfmt_crc32c(0, buf, DEVFMT_SB_BYTES - 4);
	if (crc != nbd_get32(buf + DEVFMT_SB_BYTES - 4))
		return refuse(why, why_len, "superblock CRC32C 0x%08x, computed 0x%08x (corrupt)",
			      nbd_get32(buf + DEVFMT_SB_BYTES - 4), crc);
	uint32_t version = nbd_get32(buf + 8);
	if (version < DEVFMT_VERSION_OLDEST || version > DEVFMT_VERSION)
		return refuse(why, why_len,
			      "format version %u; this daemon reads versions %u to %u", version,
			      DEVFMT_VERSION_OLDEST, DEVFMT_VERSION);
	memset(out, 0, sizeof(*out));
	out->version = version;
	out->flags = nbd_get32(buf + 12);
	memcpy(out->uuid, buf + 16, 16);
	out->generation = nbd_get64(buf + 32);
	out->device_bytes = nbd_get64(buf + 40);
	out->log_offset = nbd_get64(buf + 48);
	out->log_bytes = nbd_get64(buf + 56);
	out->checkpoint_offset = nbd_get64(buf + 64);
	out->checkpoint_seq = nbd_get64(buf + 72);
	out->export_count = nbd_get32(buf + 80);
	out->checkpoint_skip = nbd_get32(buf + 84);
	out->l2_offset = nbd_get64(buf + 88);
	out->l2_bytes = nbd_get64(buf + 96);
	out->l2_map_offset = nbd_get64(buf + 104);
	out->l2_map_gen = nbd_get32(buf + 112);
	out->seq_floor = nbd_get64(buf + 116);
	if (out->flags & ~DEVFMT_SB_CLEAN)
		return refuse(why, why_len, "unknown flags 0x%x", out->flags);
	if (out->log_offset < DEVFMT_LOG_OFFSET || out->log_offset % DEVFMT_BLOCK ||
	    out->log_bytes < 2 * DEVFMT_BLOCK || out->log_bytes % DEVFMT_BLOCK ||
	    out->log_bytes > out->device_bytes ||
	    out->log_offset > out->device_bytes - out->log_bytes)
		return refuse(
		    why, why_len, "log at %llu, %llu bytes, does not fit a device of %llu bytes",
		    (unsigned long long)out->log_offset, (unsigned long long)out->log_bytes,
		    (unsigned long long)out->device_bytes);
	if (out->checkpoint_offset >= out->log_bytes || out->checkpoint_offset % DEVFMT_BLOCK ||
	    out->checkpoint_skip > DEVFMT_MAX_EXTENTS)
		return refuse(
		    why, why_len,
		    "checkpoint at %llu (skipping %u extents), outside a log of %llu bytes",
		    (unsigned long long)out->checkpoint_offset, out->checkpoint_skip,
		    (unsigned long long)out->log_bytes);
	if (out->l2_bytes &&
	    (out->l2_offset < out->log_offset + out->log_bytes || out->l2_offset % DEVFMT_BLOCK ||
	     out->l2_bytes % DEVFMT_BLOCK || out->l2_bytes > out->device_bytes ||
	     out->l2_offset > out->device_bytes - out->l2_bytes ||
	     out->l2_bytes / DEVFMT_BLOCK > UINT32_MAX))
		return refuse(why, why_len,
			      "level-2 area at %llu, %llu bytes, does not fit after the log on a "
			      "device of %llu bytes",
			      (unsigned long long)out->l2_offset, (unsigned long long)out->l2_bytes,
			      (unsigned long long)out->device_bytes);
	if (out->l2_bytes
		? out->l2_map_offset < out->log_offset + out->log_bytes ||
		      out->l2_map_offset % DEVFMT_BLOCK || out->l2_map_offset > out->l2_offset ||
		      devfmt_l2m_bytes(out->l2_bytes / DEVFMT_BLOCK, out->version) >
			  out->l2_offset - out->l2_map_offset
		: out->l2_map_offset != 0)
		return refuse(why, why_len,
			      "level-2 map at %llu does not fit between the log and the area at "
			      "%llu (%llu bytes)",
			      (unsigned long long)out->l2_map_offset,
			      (unsigned long long)out->l2_offset,
			      (unsigned long long)out->l2_bytes);
	if (out->export_count > DEVFMT_MAX_EXPORTS)
		return refuse(why, why_len, "%u exports; at most %u", out->export_count,
			      (unsigned)DEVFMT_MAX_EXPORTS);
	for (uint32_t i = 0; i < out->export_count; i++) {
		const uint8_t *p = buf + DEVFMT_SB_HEADER + (size_t)i * DEVFMT_IDENTITY_BYTES;
		struct devfmt_identity *id = &out->exports[i];
		uint16_t nl = nbd_get16(p + 2), bl = nbd_get16(p + 4);
		id->slot = nbd_get16(p);
		id->block_size = nbd_get32(p + 8);
		id->kind = nbd_get32(p + 12);
		id->size = nbd_get64(p + 16);
		id->dev = nbd_get64(p + 24);
		id->ino = nbd_get64(p + 32);
		if (nl == 0 || nl > DEVFMT_MAX_NAME || bl > DEVFMT_MAX_BACKEND)
			return refuse(why, why_len, "export %u: name of %u bytes, backend of %u", i,
				      nl, bl);
		memcpy(id->name, p + DEVFMT_IDENTITY_FIXED, nl);
		memcpy(id->backend, p + DEVFMT_IDENTITY_FIXED + DEVFMT_MAX_NAME, bl);
		if (memchr(id->name, 0, nl) || memchr(id->backend, 0, bl))
			return refuse(why, why_len, "export %u: a NUL byte in its name or backend",
				      i);
		if (!valid_block_size(id->block_size) ||
		    (id->kind != DEVFMT_BACKEND_FILE && id->kind != DEVFMT_BACKEND_OTHER))
			return refuse(why, why_len, "export \"%s\": block size %u, kind %u",
				      id->name, id->block_size, id->kind);
		for (uint32_t j = 0; j < i; j++)
			if (out->exports[j].slot == id->slot ||
			    strcmp(out->exports[j].name, id->name) == 0)
				return refuse(why, why_len,
					      "export \"%s\": slot %u or name given twice",
					      id->name, id->slot);
	}
	return 0;
}

/* ---- batches ---- */

uint64_t devfmt_batch_data_bytes(const struct devfmt_batch *b)
{
	uint64_t n = 0;
	for (uint32_t i = 0; i < b->extent_count && i < DEVFMT_MAX_EXTENTS; i++)
		if (b->extents[i].type == DEVFMT_EXTENT_DATA)
			n += b->extents[i].length;
	return n;
}

int devfmt_batch_encode(const struct devfmt_batch *b, const uint8_t uuid[16], uint8_t *buf)
{
	if (b->extent_count > DEVFMT_WRITE_EXTENTS)
		return -EINVAL;
	memset(buf, 0, DEVFMT_BLOCK);
	nbd_put64(buf, DEVFMT_BATCH_MAGIC);
	memcpy(buf + 8, uuid, 16);
	nbd_put64(buf + 24, b->seq);
	nbd_put32(buf + 32, b->flags);
	nbd_put32(buf + 36, b->extent_count);
	nbd_put32(buf + 40, b->data_blocks);
	nbd_put32(buf + 44, b->data_crc);
	for (uint32_t i = 0; i < b->extent_count; i++) {
		uint8_t *p = buf + DEVFMT_BATCH_HEADER + (size_t)i * DEVFMT_EXTENT_BYTES;
		p[0] = b->extents[i].type;
		nbd_put16(p + 2, b->extents[i].slot);
		nbd_put64(p + 8, b->extents[i].offset);
		nbd_put64(p + 16, b->extents[i].length);
	}
	nbd_put64(buf + DEVFMT_BATCH_PREV, b->prev_seq);
	nbd_put64(buf + DEVFMT_BATCH_COMMITTED, b->committed);
	nbd_put32(buf + DEVFMT_BLOCK - 4, devfmt_crc32c(0, buf, DEVFMT_BLOCK - 4));
	return 0;
}

/* The sequence number a header has in place of expect_seq: its own, or
 * an epoch batch's jump from it. */
static bool seq_fits(const uint8_t *buf, uint64_t expect_seq)
{
	uint64_t seq = nbd_get64(buf + 24);
	if (seq == expect_seq)
		return true;
	return (nbd_get32(buf + 32) & DEVFMT_BATCH_EPOCH) &&
	       nbd_get32(buf + 36) <= DEVFMT_WRITE_EXTENTS &&
	       nbd_get64(buf + DEVFMT_BATCH_PREV) == expect_seq && seq > expect_seq;
}

bool devfmt_batch_claims(const uint8_t *buf, const uint8_t uuid[16], uint64_t expect_seq)
{
	return nbd_get64(buf) == DEVFMT_BATCH_MAGIC && memcmp(buf + 8, uuid, 16) == 0 &&
	       seq_fits(buf, expect_seq);
}

int devfmt_batch_decode(const uint8_t *buf, const uint8_t uuid[16], uint64_t expect_seq,
			struct devfmt_batch *out, char *why, size_t why_len)
{
	if (nbd_get64(buf) != DEVFMT_BATCH_MAGIC)
		return refuse(why, why_len, "no batch header (magic 0x%016llx)",
			      (unsigned long long)nbd_get64(buf));
	uint32_t crc = devfmt_crc32c(0, buf, DEVFMT_BLOCK - 4);
	if (crc != nbd_get32(buf + DEVFMT_BLOCK - 4))
		return refuse(why, why_len,
			      "header CRC32C 0x%08x, computed 0x%08x (torn or corrupt)",
			      nbd_get32(buf + DEVFMT_BLOCK - 4), crc);
	if (memcmp(buf + 8, uuid, 16) != 0)
		return refuse(why, why_len, "a batch of another format of the device (UUID)");
	memset(out, 0, sizeof(*out));
	out->seq = nbd_get64(buf + 24);
	if (!seq_fits(buf, expect_seq))
		return refuse(why, why_len, "sequence number %llu, expected %llu (an older lap)",
			      (unsigned long long)out->seq, (unsigned long long)expect_seq);
	out->flags = nbd_get32(buf + 32);
	out->extent_count = nbd_get32(buf + 36);
	out->data_blocks = nbd_get32(buf + 40);
	out->data_crc = nbd_get32(buf + 44);
	if (out->extent_count <= DEVFMT_WRITE_EXTENTS) {
		out->prev_seq = nbd_get64(buf + DEVFMT_BATCH_PREV);
		out->committed = nbd_get64(buf + DEVFMT_BATCH_COMMITTED);
	}
	if (out->flags & ~(DEVFMT_BATCH_WRAP | DEVFMT_BATCH_EPOCH))
		return refuse(why, why_len, "unknown batch flags 0x%x", out->flags);
	if (out->committed && out->committed >= out->seq)
		return refuse(why, why_len, "says batch %llu was committed before it was written",
			      (unsigned long long)out->committed);
	if (!(out->flags & DEVFMT_BATCH_EPOCH) ? out->prev_seq != 0 : out->prev_seq >= out->seq)
		return refuse(why, why_len, "previous sequence number %llu (flags 0x%x)",
			      (unsigned long long)out->prev_seq, out->flags);
	if (out->extent_count > DEVFMT_MAX_EXTENTS)
		return refuse(why, why_len, "%u extents; at most %u", out->extent_count,
			      (unsigned)DEVFMT_MAX_EXTENTS);
	if ((out->flags & DEVFMT_BATCH_WRAP) && (out->extent_count || out->data_blocks))
		return refuse(why, why_len, "a wrap marker with extents or data");
	for (uint32_t i = 0; i < out->extent_count; i++) {
		const uint8_t *p = buf + DEVFMT_BATCH_HEADER + (size_t)i * DEVFMT_EXTENT_BYTES;
		struct devfmt_extent *x = &out->extents[i];
		x->type = p[0];
		x->slot = nbd_get16(p + 2);
		x->offset = nbd_get64(p + 8);
		x->length = nbd_get64(p + 16);
		if (x->type < DEVFMT_EXTENT_DATA || x->type > DEVFMT_EXTENT_CLEAN)
			return refuse(why, why_len, "extent %u: unknown type %u", i, x->type);
		if (x->length == 0 || x->offset > UINT64_MAX - x->length ||
		    (x->type == DEVFMT_EXTENT_DATA && x->length > DEVFMT_MAX_DATA_EXTENT))
			return refuse(why, why_len, "extent %u: %llu bytes at %llu", i,
				      (unsigned long long)x->length, (unsigned long long)x->offset);
	}
	uint64_t data = devfmt_batch_data_bytes(out);
	uint64_t blocks = (data + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK;
	if (blocks != out->data_blocks)
		return refuse(why, why_len,
			      "extents carry %llu bytes of data, the header says %u "
			      "blocks",
			      (unsigned long long)data, out->data_blocks);
	return 0;
}

/* ---- the level-2 map ---- */

uint64_t devfmt_l2m_bytes(uint64_t pages, uint32_t version)
{
	uint64_t per = version < DEVFMT_VERSION_L2_CRC ? DEVFMT_L2M_PER_BLOCK_V4 : DEVFMT_L2M_PER_BLOCK;
	return DEVFMT_BLOCK * (1 + (pages + per - 1) / per);
}

uint64_t devfmt_l2_pages_fit(uint64_t bytes)
{
	if (bytes < 2 * DEVFMT_BLOCK)
		return 0;
	/* Each map block describes DEVFMT_L2M_PER_BLOCK pages: a first guess
	 * from the ratio, then down to what fits. */
	uint64_t pages =
	    (bytes / DEVFMT_BLOCK - 1) * DEVFMT_L2M_PER_BLOCK / (DEVFMT_L2M_PER_BLOCK + 1);
	while (pages && devfmt_l2m_bytes(pages, DEVFMT_VERSION) + pages * DEVFMT_BLOCK > bytes)
		pages--;
	return pages;
}

bool devfmt_sb_l2_relayout(struct devfmt_sb *sb)
{
	if (sb->version >= DEVFMT_VERSION_L2_CRC || !sb->l2_bytes)
		return false;
	uint64_t pages = devfmt_l2_pages_fit(sb->l2_offset + sb->l2_bytes - sb->l2_map_offset);
	if (pages > UINT32_MAX)
		pages = UINT32_MAX;
	sb->l2_offset = sb->l2_map_offset + devfmt_l2m_bytes(pages, DEVFMT_VERSION);
	sb->l2_bytes = pages * DEVFMT_BLOCK;
	sb->l2_map_gen++;
	sb->version = DEVFMT_VERSION;
	return true;
}

void devfmt_l2m_header_encode(const struct devfmt_l2m_header *h, const uint8_t uuid[16],
			      uint8_t *buf)
{
	memset(buf, 0, DEVFMT_BLOCK);
	nbd_put64(buf, DEVFMT_L2M_MAGIC);
	memcpy(buf + 8, uuid, 16);
	nbd_put32(buf + 24, h->gen);
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		nbd_put64(buf + DEVFMT_L2M_FIXED + 8 * i, h->stamp[i]);
	nbd_put32(buf + DEVFMT_BLOCK - 4, devfmt_crc32c(0, buf, DEVFMT_BLOCK - 4));
}

int devfmt_l2m_header_decode(const uint8_t *buf, const uint8_t uuid[16], uint32_t gen,
			     struct devfmt_l2m_header *out, char *why, size_t why_len)
{
	if (nbd_get64(buf) != DEVFMT_L2M_MAGIC)
		return refuse(why, why_len, "no level-2 map (magic 0x%016llx)",
			      (unsigned long long)nbd_get64(buf));
	uint32_t crc = devfmt_crc32c(0, buf, DEVFMT_BLOCK - 4);
	if (crc != nbd_get32(buf + DEVFMT_BLOCK - 4))
		return refuse(why, why_len, "level-2 map header CRC32C 0x%08x, computed 0x%08x",
			      nbd_get32(buf + DEVFMT_BLOCK - 4), crc);
	if (memcmp(buf + 8, uuid, 16) != 0)
		return refuse(why, why_len, "a level-2 map of another device");
	memset(out, 0, sizeof(*out));
	out->gen = nbd_get32(buf + 24);
	if (out->gen != gen)
		return refuse(why, why_len,
			      "a level-2 map of generation %u; the superblock says %u", out->gen,
			      gen);
	for (unsigned i = 0; i < DEVFMT_MAX_EXPORTS; i++)
		out->stamp[i] = nbd_get64(buf + DEVFMT_L2M_FIXED + 8 * i);
	return 0;
}

void devfmt_l2m_block_encode(uint32_t index, uint32_t gen, const uint8_t uuid[16],
			     const uint64_t *keys, const uint32_t *crcs, uint32_t n, uint8_t *buf)
{
	memset(buf, 0, DEVFMT_BLOCK);
	nbd_put32(buf + 4, index);
	memcpy(buf + 8, uuid, 16);
	nbd_put32(buf + 24, gen);
	for (uint32_t i = 0; i < n && i < DEVFMT_L2M_PER_BLOCK; i++)
		if (keys[i]) {
			nbd_put64(buf + DEVFMT_L2M_FIXED + DEVFMT_L2M_ENTRY * i, keys[i]);
			nbd_put32(buf + DEVFMT_L2M_FIXED + DEVFMT_L2M_ENTRY * i + 8, crcs[i]);
		}
	nbd_put32(buf, devfmt_crc32c(0, buf + 4, DEVFMT_BLOCK - 4));
}

int devfmt_l2m_block_decode(const uint8_t *buf, uint32_t index, uint32_t gen,
			    const uint8_t uuid[16], uint64_t *keys, uint32_t *crcs, char *why,
			    size_t why_len)
{
	uint32_t crc = devfmt_crc32c(0, buf + 4, DEVFMT_BLOCK - 4);
	if (crc != nbd_get32(buf))
		return refuse(why, why_len, "map block %u: CRC32C 0x%08x, computed 0x%08x", index,
			      nbd_get32(buf), crc);
	if (nbd_get32(buf + 4) != index || memcmp(buf + 8, uuid, 16) != 0 ||
	    nbd_get32(buf + 24) != gen)
		return refuse(why, why_len,
			      "map block %u: of block %u, another device or generation %u", index,
			      nbd_get32(buf + 4), nbd_get32(buf + 24));
	if (nbd_get32(buf + 28))
		return refuse(why, why_len, "map block %u: its reserved bytes are set", index);
	for (uint32_t i = 0; i < DEVFMT_L2M_PER_BLOCK; i++) {
		const uint8_t *e = buf + DEVFMT_L2M_FIXED + DEVFMT_L2M_ENTRY * i;
		keys[i] = nbd_get64(e);
		crcs[i] = nbd_get32(e + 8);
		if (keys[i] && ((keys[i] >> 48) == 0 || (keys[i] >> 48) > DEVFMT_MAX_EXPORTS))
			return refuse(why, why_len, "map block %u: page %u names export slot %llu",
				      index, i, (unsigned long long)(keys[i] >> 48) - 1);
		if (nbd_get32(e + 12) || (!keys[i] && crcs[i]))
			return refuse(why, why_len,
				      "map block %u: page %u has bytes set where none may be", index,
				      i);
	}
	return 0;
}
