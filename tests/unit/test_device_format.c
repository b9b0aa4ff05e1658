/*
 * tests/unit/test_device_format.c: the on-device format of a cache device
 * (daemon/cache/device_format.h): CRC32C against its published check
 * value; a superblock with identities and a batch header round-trip; and
 * a superblock or batch that is corrupt, of another version or device,
 * from an older lap of the log, or whose fields do not add up is refused
 * with a message saying which.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>

#include "daemon/cache/device_format.h"
#include "proto/nbd.h"

static uint8_t sbuf[DEVFMT_SB_BYTES];
static uint8_t bbuf[DEVFMT_BLOCK];
static struct devfmt_sb sb, back;
static struct devfmt_batch batch, bback;
static char why[256];
static const uint8_t uuid[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

static void make_sb(void)
{
	memset(&sb, 0, sizeof(sb));
	memcpy(sb.uuid, uuid, 16);
	sb.generation = 7;
	sb.device_bytes = 1ull << 32;
	sb.log_offset = DEVFMT_LOG_OFFSET;
	sb.log_bytes = (1ull << 32) - DEVFMT_LOG_OFFSET;
	sb.checkpoint_offset = 8 * DEVFMT_BLOCK;
	sb.checkpoint_seq = 99;
	sb.checkpoint_skip = 5;
	sb.export_count = 2;
	sb.exports[0] = (struct devfmt_identity){.slot = 0,
						 .block_size = 4096,
						 .kind = DEVFMT_BACKEND_FILE,
						 .size = 1ull << 40,
						 .dev = 0x803,
						 .ino = 12345};
	strcpy(sb.exports[0].name, "disk");
	strcpy(sb.exports[0].backend, "/srv/disk.img");
	sb.exports[1] = (struct devfmt_identity){
	    .slot = 3, .block_size = 512, .kind = DEVFMT_BACKEND_OTHER, .size = 1ull << 30};
	strcpy(sb.exports[1].name, "remote");
	strcpy(sb.exports[1].backend, "nbd://127.0.0.1:10810/x");
}

static int sb_decode(void)
{
	why[0] = '\0';
	return devfmt_sb_decode(sbuf, &back, why, sizeof(why));
}

/* CRC32C a bit at a time: the definition, nothing shared with the code. */
static uint32_t reference_crc(uint32_t crc, const uint8_t *p, size_t n)
{
	crc = ~crc;
	while (n--) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
	}
	return ~crc;
}

static void test_crc32c(void **state)
{
	(void)state;
	/* The check value of CRC-32C (RFC 3720's polynomial). */
	assert_int_equal(devfmt_crc32c(0, "123456789", 9), 0xe3069283u);
	/* Incremental equals whole. */
	uint32_t a = devfmt_crc32c(0, "1234", 4);
	assert_int_equal(devfmt_crc32c(a, "56789", 5), 0xe3069283u);
	static const uint8_t zeros[32];
	assert_int_equal(devfmt_crc32c(0, zeros, 32), 0x8a9136aau);
	/* Against a byte at a time, every length and alignment up to 300 and
	 * a long run: the CPU's instruction and the tables agree. */
	static uint8_t buf[70000];
	uint32_t x = 12345;
	for (size_t k = 0; k < sizeof(buf); k++) {
		x = x * 1103515245u + 12345u;
		buf[k] = (uint8_t)(x >> 16);
	}
	for (size_t off = 0; off < 9; off++)
		for (size_t n = 0; n < 300; n++) {
			uint32_t want = reference_crc(7, buf + off, n);
			assert_int_equal(devfmt_crc32c(7, buf + off, n), want);
			assert_int_equal(devfmt_crc32c_portable(7, buf + off, n), want);
		}
	assert_int_equal(devfmt_crc32c(0, buf + 3, 65536), reference_crc(0, buf + 3, 65536));
	assert_int_equal(devfmt_crc32c_portable(0, buf + 1, 65536),
			 reference_crc(0, buf + 1, 65536));
}

static void test_sb_round_trip(void **state)
{
	(void)state;
	make_sb();
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), 0);
	assert_int_equal(sb_decode(), 0);
	assert_int_equal(back.generation, 7);
	assert_int_equal(back.checkpoint_seq, 99);
	assert_int_equal(back.checkpoint_skip, 5);
	assert_int_equal(back.checkpoint_offset, 8 * DEVFMT_BLOCK);
	assert_memory_equal(back.uuid, uuid, 16);
	assert_int_equal(back.export_count, 2);
	assert_string_equal(back.exports[0].name, "disk");
	assert_string_equal(back.exports[0].backend, "/srv/disk.img");
	assert_int_equal(back.exports[0].ino, 12345);
	assert_int_equal(back.exports[1].slot, 3);
	assert_int_equal(back.exports[1].block_size, 512);
	assert_string_equal(back.exports[1].backend, "nbd://127.0.0.1:10810/x");
	assert_true(DEVFMT_MAX_EXPORTS >= 32);
	assert_true(DEVFMT_IDENTITY_FIXED + DEVFMT_MAX_NAME + DEVFMT_MAX_BACKEND <=
		    DEVFMT_IDENTITY_BYTES);
}

static void test_sb_refusals(void **state)
{
	(void)state;
	make_sb();
	devfmt_sb_encode(&sb, sbuf);
	sbuf[1000] ^= 1; /* a flipped bit in an identity */
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "CRC32C"));

	memset(sbuf, 0, sizeof(sbuf));
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "no nbdcached superblock"));

	/* Another version (1: before the level-2 area), with a good CRC. */
	devfmt_sb_encode(&sb, sbuf);
	nbd_put32(sbuf + 8, 1);
	nbd_put32(sbuf + DEVFMT_SB_BYTES - 4, devfmt_crc32c(0, sbuf, DEVFMT_SB_BYTES - 4));
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "format version 1"));

	/* A level-2 area over the log, or past the device's end. */
	make_sb();
	sb.log_bytes = 1u << 30;
	sb.l2_offset = DEVFMT_LOG_OFFSET + (1u << 29);
	sb.l2_bytes = 1u << 30;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 area at"));
	sb.l2_offset = DEVFMT_LOG_OFFSET + (1u << 30);
	sb.l2_bytes = sb.device_bytes - (1u << 30);
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 area at"));
	/* A map inside the log, too small for the area, or without an area. */
	sb.l2_offset = DEVFMT_LOG_OFFSET + (1u << 30);
	sb.l2_bytes = (1u << 30);
	sb.l2_map_offset = DEVFMT_LOG_OFFSET + (1u << 29);
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 map at"));
	sb.l2_map_offset = sb.l2_offset - DEVFMT_BLOCK;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 map at"));
	sb.l2_map_offset = sb.l2_offset - devfmt_l2m_bytes(sb.l2_bytes / DEVFMT_BLOCK, DEVFMT_VERSION);
	sb.log_bytes = sb.l2_map_offset - DEVFMT_LOG_OFFSET;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), 0);
	sb.l2_bytes = 0;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 map at"));

	/* A log that does not fit the device. */
	make_sb();
	sb.log_bytes = sb.device_bytes;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "does not fit"));

	make_sb();
	sb.checkpoint_offset = sb.log_bytes;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "checkpoint at"));

	make_sb();
	sb.exports[1].slot = 0;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "given twice"));

	make_sb();
	sb.exports[0].block_size = 3000;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "block size 3000"));

	make_sb();
	sb.export_count = DEVFMT_MAX_EXPORTS + 1;
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), -EINVAL);
	make_sb();
	sb.exports[0].name[0] = '\0';
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), -EINVAL);
}

static void test_l2(void **state)
{
	(void)state;
	/* The geometry round-trips. */
	make_sb();
	uint64_t pages = ((1ull << 32) - DEVFMT_LOG_OFFSET - (1u << 29)) / DEVFMT_BLOCK - 4000;
	sb.log_bytes = 1u << 29;
	sb.l2_map_offset = DEVFMT_LOG_OFFSET + (1u << 29);
	sb.l2_offset = sb.l2_map_offset + devfmt_l2m_bytes(pages, DEVFMT_VERSION);
	sb.l2_bytes = pages * DEVFMT_BLOCK;
	sb.l2_map_gen = 0x12345678;
	sb.flags = DEVFMT_SB_CLEAN;
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), 0);
	assert_int_equal(sb_decode(), 0);
	assert_int_equal(back.l2_offset, sb.l2_offset);
	assert_int_equal(back.l2_bytes, sb.l2_bytes);
	assert_int_equal(back.l2_map_offset, sb.l2_map_offset);
	assert_int_equal(back.l2_map_gen, 0x12345678);
	assert_int_equal(back.exports[1].slot, 3); /* identities after the longer header */
	/* The map: a header block and a block per 254 pages (a key and a
	 * checksum each); version 4's, per 508 (keys alone). */
	assert_int_equal(DEVFMT_L2M_PER_BLOCK, 254);
	assert_int_equal(devfmt_l2m_bytes(1, DEVFMT_VERSION), 2 * DEVFMT_BLOCK);
	assert_int_equal(devfmt_l2m_bytes(254, DEVFMT_VERSION), 2 * DEVFMT_BLOCK);
	assert_int_equal(devfmt_l2m_bytes(255, DEVFMT_VERSION), 3 * DEVFMT_BLOCK);
	assert_int_equal(devfmt_l2m_bytes(508, 4), 2 * DEVFMT_BLOCK);
	assert_int_equal(devfmt_l2m_bytes(509, 4), 3 * DEVFMT_BLOCK);
	/* What fits: the map and the pages, and one page more would not. */
	for (uint64_t bytes = 2 * DEVFMT_BLOCK; bytes < 3000 * DEVFMT_BLOCK; bytes += 4093) {
		uint64_t p = devfmt_l2_pages_fit(bytes);
		assert_true(devfmt_l2m_bytes(p, DEVFMT_VERSION) + p * DEVFMT_BLOCK <= bytes);
		assert_true(devfmt_l2m_bytes(p + 1, DEVFMT_VERSION) + (p + 1) * DEVFMT_BLOCK > bytes);
	}

	/* A version 4 superblock's geometry is read as version 4 laid it out
	 * (its map half the size), and laid out again for this version in
	 * the same bytes, under the next map generation. */
	uint64_t v4pages = pages + 2000;
	sb.l2_offset = sb.l2_map_offset + devfmt_l2m_bytes(v4pages, 4);
	sb.l2_bytes = v4pages * DEVFMT_BLOCK;
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), 0);
	nbd_put32(sbuf + 8, 4);
	nbd_put32(sbuf + DEVFMT_SB_BYTES - 4, devfmt_crc32c(0, sbuf, DEVFMT_SB_BYTES - 4));
	assert_int_equal(sb_decode(), 0);
	assert_int_equal(back.version, 4);
	uint64_t end = back.l2_offset + back.l2_bytes;
	assert_true(devfmt_sb_l2_relayout(&back));
	assert_int_equal(back.version, DEVFMT_VERSION);
	assert_int_equal(back.l2_map_gen, 0x12345679);
	assert_int_equal(back.l2_map_offset, sb.l2_map_offset);
	assert_true(back.l2_offset + back.l2_bytes <= end);
	assert_true(back.l2_bytes / DEVFMT_BLOCK < v4pages);
	assert_int_equal(back.l2_offset,
			 back.l2_map_offset +
			     devfmt_l2m_bytes(back.l2_bytes / DEVFMT_BLOCK, DEVFMT_VERSION));
	assert_false(devfmt_sb_l2_relayout(&back)); /* once */
	/* ... and this version's encoding of it decodes. */
	assert_int_equal(devfmt_sb_encode(&back, sbuf), 0);
	static struct devfmt_sb again;
	assert_int_equal(devfmt_sb_decode(sbuf, &again, why, sizeof(why)), 0);
	/* A version 4 geometry written as this version does not fit: refused. */
	sb.l2_bytes = v4pages * DEVFMT_BLOCK;
	assert_int_equal(devfmt_sb_encode(&sb, sbuf), 0);
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "level-2 map at"));
	sb.l2_offset = sb.l2_map_offset + devfmt_l2m_bytes(pages, DEVFMT_VERSION);
	sb.l2_bytes = pages * DEVFMT_BLOCK;

	/* The map's header. */
	static struct devfmt_l2m_header h, hb;
	memset(&h, 0, sizeof(h));
	h.gen = 7;
	h.stamp[0] = 1700000000123456789ull;
	h.stamp[DEVFMT_MAX_EXPORTS - 1] = 5;
	devfmt_l2m_header_encode(&h, uuid, bbuf);
	assert_int_equal(devfmt_l2m_header_decode(bbuf, uuid, 7, &hb, why, sizeof(why)), 0);
	assert_int_equal(hb.gen, 7);
	assert_int_equal(hb.stamp[0], 1700000000123456789ull);
	assert_int_equal(hb.stamp[DEVFMT_MAX_EXPORTS - 1], 5);
	assert_int_equal(devfmt_l2m_header_decode(bbuf, uuid, 8, &hb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "generation 7; the superblock says 8"));
	static const uint8_t other[16] = {9};
	assert_int_equal(devfmt_l2m_header_decode(bbuf, other, 7, &hb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "another device"));
	bbuf[100] ^= 1;
	assert_int_equal(devfmt_l2m_header_decode(bbuf, uuid, 7, &hb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "CRC32C"));
	memset(bbuf, 0, 8);
	assert_int_equal(devfmt_l2m_header_decode(bbuf, uuid, 7, &hb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "no level-2 map"));

	/* A map block: keys and checksums round-trip, the rest free; each
	 * refusal says why. */
	uint64_t keys[DEVFMT_L2M_PER_BLOCK], kb[DEVFMT_L2M_PER_BLOCK];
	uint32_t crcs[DEVFMT_L2M_PER_BLOCK], cb[DEVFMT_L2M_PER_BLOCK];
	keys[0] = (1ull << 48) | 12345;
	crcs[0] = 0xdeadbeef;
	keys[1] = 0;
	crcs[1] = 0x1234; /* a free page's is not written */
	keys[2] = ((uint64_t)DEVFMT_MAX_EXPORTS << 48) | ((1ull << 48) - 1);
	crcs[2] = 0;
	devfmt_l2m_block_encode(9, 7, uuid, keys, crcs, 3, bbuf);
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), 0);
	assert_int_equal(kb[0], keys[0]);
	assert_int_equal(cb[0], 0xdeadbeef);
	assert_int_equal(kb[1], 0);
	assert_int_equal(cb[1], 0);
	assert_int_equal(kb[2], keys[2]);
	assert_int_equal(cb[2], 0);
	for (unsigned i = 3; i < DEVFMT_L2M_PER_BLOCK; i++)
		assert_int_equal(kb[i], 0);
	/* A free page with a checksum, reserved bytes set: refused (a version
	 * 4 block read as this version's is). */
	nbd_put32(bbuf + DEVFMT_L2M_FIXED + DEVFMT_L2M_ENTRY * 1 + 8, 1);
	nbd_put32(bbuf, devfmt_crc32c(0, bbuf + 4, DEVFMT_BLOCK - 4));
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "page 1 has bytes set"));
	devfmt_l2m_block_encode(9, 7, uuid, keys, crcs, 3, bbuf);
	bbuf[DEVFMT_L2M_FIXED + DEVFMT_L2M_ENTRY * 0 + 12] = 1;
	nbd_put32(bbuf, devfmt_crc32c(0, bbuf + 4, DEVFMT_BLOCK - 4));
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "page 0 has bytes set"));
	devfmt_l2m_block_encode(9, 7, uuid, keys, crcs, 3, bbuf);
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 10, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "map block 10: of block 9"));
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 6, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, other, kb, cb, why, sizeof(why)), -EINVAL);
	bbuf[DEVFMT_BLOCK - 1] ^= 0x80;
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "CRC32C"));
	keys[2] = (uint64_t)(DEVFMT_MAX_EXPORTS + 1) << 48;
	devfmt_l2m_block_encode(9, 7, uuid, keys, crcs, 3, bbuf);
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "names export slot"));
	keys[2] = 5; /* a page number without a slot */
	devfmt_l2m_block_encode(9, 7, uuid, keys, crcs, 3, bbuf);
	assert_int_equal(devfmt_l2m_block_decode(bbuf, 9, 7, uuid, kb, cb, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "names export slot"));
}

static void make_batch(void)
{
	memset(&batch, 0, sizeof(batch));
	batch.seq = 100;
	batch.extent_count = 3;
	batch.extents[0] = (struct devfmt_extent){DEVFMT_EXTENT_DATA, 0, 4096, 8192};
	batch.extents[1] = (struct devfmt_extent){DEVFMT_EXTENT_ZERO, 3, 1ull << 40, 1ull << 30};
	batch.extents[2] = (struct devfmt_extent){DEVFMT_EXTENT_DATA, 3, 512, 1024};
	batch.data_blocks = 3; /* 9216 bytes */
	batch.data_crc = 0xdeadbeef;
}

static int b_decode(uint64_t seq)
{
	why[0] = '\0';
	return devfmt_batch_decode(bbuf, uuid, seq, &bback, why, sizeof(why));
}

static void test_batch(void **state)
{
	(void)state;
	make_batch();
	assert_int_equal(devfmt_batch_data_bytes(&batch), 9216);
	assert_int_equal(devfmt_batch_encode(&batch, uuid, bbuf), 0);
	assert_int_equal(b_decode(100), 0);
	assert_int_equal(bback.extent_count, 3);
	assert_int_equal(bback.data_crc, 0xdeadbeef);
	assert_int_equal(bback.extents[1].type, DEVFMT_EXTENT_ZERO);
	assert_int_equal(bback.extents[1].slot, 3);
	assert_int_equal(bback.extents[1].offset, 1ull << 40);
	assert_int_equal(bback.extents[2].length, 1024);

	/* An older lap: the same place, an earlier sequence number. */
	assert_int_equal(b_decode(101), -EINVAL);
	assert_non_null(strstr(why, "sequence number 100, expected 101"));

	static const uint8_t other[16] = {9};
	why[0] = '\0';
	assert_int_equal(devfmt_batch_decode(bbuf, other, 100, &bback, why, sizeof(why)), -EINVAL);
	assert_non_null(strstr(why, "another format"));

	/* Torn: the second half of the header block is from before. It still
	 * claims to be batch 100 of this device (not another's, nor 101). */
	assert_true(devfmt_batch_claims(bbuf, uuid, 100));
	memset(bbuf + 2048, 0x5a, 100);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "torn or corrupt"));
	assert_true(devfmt_batch_claims(bbuf, uuid, 100));
	assert_false(devfmt_batch_claims(bbuf, uuid, 101));
	assert_false(devfmt_batch_claims(bbuf, other, 100));

	make_batch();
	batch.data_blocks = 2;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "carry 9216 bytes"));

	make_batch();
	batch.extents[1].type = 7;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "unknown type 7"));

	make_batch();
	batch.extents[1].offset = UINT64_MAX;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "extent 1"));

	make_batch();
	batch.flags = DEVFMT_BATCH_WRAP;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "wrap marker with extents"));
	memset(&batch, 0, sizeof(batch));
	batch.seq = 5;
	batch.flags = DEVFMT_BATCH_WRAP;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(5), 0);
	assert_int_equal(bback.flags, DEVFMT_BATCH_WRAP);

	make_batch();
	batch.extent_count = DEVFMT_MAX_EXTENTS + 1;
	assert_int_equal(devfmt_batch_encode(&batch, uuid, bbuf), -EINVAL);
	memset(bbuf, 0, sizeof(bbuf));
	assert_int_equal(b_decode(1), -EINVAL);
	assert_non_null(strstr(why, "no batch header"));
}

/* Version 4's fields: the committed mark, epoch batches, a version 3
 * device and header read as they are. */
static void test_v4(void **state)
{
	(void)state;
	make_batch();
	batch.committed = 99;
	assert_int_equal(devfmt_batch_encode(&batch, uuid, bbuf), 0);
	assert_int_equal(b_decode(100), 0);
	assert_int_equal(bback.committed, 99);
	assert_int_equal(bback.prev_seq, 0);
	batch.committed = 100; /* not before itself */
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(100), -EINVAL);
	assert_non_null(strstr(why, "committed before it was written"));

	/* An epoch batch: where 40 was expected, 1 << 33 jumping from 40. */
	make_batch();
	batch.seq = 1ull << 33;
	batch.flags = DEVFMT_BATCH_EPOCH;
	batch.prev_seq = 40;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(40), 0);
	assert_int_equal(bback.seq, 1ull << 33);
	assert_int_equal(b_decode(1ull << 33), 0); /* its own number (a checkpoint there) */
	assert_true(devfmt_batch_claims(bbuf, uuid, 40));
	assert_int_equal(b_decode(41), -EINVAL); /* not where 41 is expected */
	assert_non_null(strstr(why, "expected 41"));
	assert_false(devfmt_batch_claims(bbuf, uuid, 41));
	/* The same jump without the flag is an older lap's; a jump back is
	 * refused. */
	batch.flags = 0;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(40), -EINVAL);
	assert_int_equal(b_decode(1ull << 33), -EINVAL);
	assert_non_null(strstr(why, "previous sequence number 40"));
	batch.flags = DEVFMT_BATCH_EPOCH | DEVFMT_BATCH_WRAP;
	batch.extent_count = 0;
	batch.data_blocks = 0;
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(40), 0);
	batch.seq = 30; /* "jumping" backwards */
	devfmt_batch_encode(&batch, uuid, bbuf);
	assert_int_equal(b_decode(40), -EINVAL);

	/* A version 3 header of DEVFMT_MAX_EXTENTS extents: the last one lies
	 * where version 4 has prev_seq and committed, which read as 0. */
	memset(&batch, 0, sizeof(batch));
	batch.seq = 7;
	assert_int_equal(devfmt_batch_encode(&batch, uuid, bbuf), 0);
	nbd_put32(bbuf + 36, DEVFMT_MAX_EXTENTS);
	for (uint32_t i = 0; i < DEVFMT_MAX_EXTENTS; i++) {
		uint8_t *p = bbuf + DEVFMT_BATCH_HEADER + (size_t)i * DEVFMT_EXTENT_BYTES;
		p[0] = DEVFMT_EXTENT_ZERO;
		nbd_put64(p + 8, 0xffffull << 20);
		nbd_put64(p + 16, 4096);
	}
	nbd_put32(bbuf + 32, DEVFMT_BATCH_EPOCH);
	nbd_put32(bbuf + DEVFMT_BLOCK - 4, devfmt_crc32c(0, bbuf, DEVFMT_BLOCK - 4));
	assert_int_equal(b_decode(6), -EINVAL); /* no epoch with so many */
	nbd_put32(bbuf + 32, 0);
	nbd_put32(bbuf + DEVFMT_BLOCK - 4, devfmt_crc32c(0, bbuf, DEVFMT_BLOCK - 4));
	assert_int_equal(b_decode(7), 0);
	assert_int_equal(bback.extent_count, DEVFMT_MAX_EXTENTS);
	assert_int_equal(bback.committed, 0);
	assert_int_equal(bback.prev_seq, 0);
	assert_int_equal(bback.extents[DEVFMT_MAX_EXTENTS - 1].offset, 0xffffull << 20);
	make_batch();
	batch.extent_count = DEVFMT_WRITE_EXTENTS + 1; /* version 4 writes fewer */
	assert_int_equal(devfmt_batch_encode(&batch, uuid, bbuf), -EINVAL);

	/* The superblock: seq_floor kept; version 3 read, written as this
	 * version. */
	make_sb();
	sb.seq_floor = 12345ull << 32;
	devfmt_sb_encode(&sb, sbuf);
	assert_int_equal(sb_decode(), 0);
	assert_int_equal(back.seq_floor, 12345ull << 32);
	assert_int_equal(back.version, DEVFMT_VERSION);
	nbd_put32(sbuf + 8, 3);
	memset(sbuf + 116, 0, 8);
	nbd_put32(sbuf + DEVFMT_SB_BYTES - 4, devfmt_crc32c(0, sbuf, DEVFMT_SB_BYTES - 4));
	assert_int_equal(sb_decode(), 0);
	assert_int_equal(back.version, 3);
	assert_int_equal(back.seq_floor, 0);
	nbd_put32(sbuf + 8, DEVFMT_VERSION + 1);
	nbd_put32(sbuf + DEVFMT_SB_BYTES - 4, devfmt_crc32c(0, sbuf, DEVFMT_SB_BYTES - 4));
	assert_int_equal(sb_decode(), -EINVAL);
	assert_non_null(strstr(why, "versions 3 to 5"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_v4),
	    cmocka_unit_test(test_crc32c),
	    cmocka_unit_test(test_sb_round_trip),
	    cmocka_unit_test(test_sb_refusals),
	    cmocka_unit_test(test_l2),
	    cmocka_unit_test(test_batch),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
