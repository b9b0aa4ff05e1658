/*
 * tests/fuzz/fuzz_device_format.c: a cache device's superblock copy and
 * batch header (daemon/cache/device_format.c) as a corrupt or hostile
 * device could hold them. The first input byte picks which (even: a
 * superblock, odd with bit 3: the level-2 table's header block and, read
 * again from the same bytes, its entries; odd without: a batch header,
 * expecting the sequence number in the next 8 bytes), the rest is the
 * block, zero padded; with bit 2 of that
 * byte the harness writes a good magic, version and CRC over the fuzzer's
 * bytes, so that the checks past them are reached. Whatever is accepted
 * keeps the promises the replay relies on: the log lies within the
 * device, the checkpoint within the log, names and backend strings are
 * NUL-terminated, extents are nonempty and do not wrap, the data blocks
 * match the extents, and encoding it again decodes to the same; a refusal
 * always says why.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cache/device_format.h"
#include "proto/nbd.h"
#include "tests/fuzz/fuzz.h"

static uint8_t block[DEVFMT_SB_BYTES];
static uint8_t again[DEVFMT_SB_BYTES];
static const uint8_t uuid[16] = {0x6e, 0x62, 0x64};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	char why[256] = "";
	memset(block, 0, sizeof(block));
	if (data[0] % 2 == 0) {
		size_t n = size - 1 < DEVFMT_SB_BYTES ? size - 1 : DEVFMT_SB_BYTES;
		memcpy(block, data + 1, n);
		if (data[0] & 4) {
			nbd_put64(block, DEVFMT_SB_MAGIC);
			nbd_put32(block + 8, DEVFMT_VERSION);
			nbd_put32(block + DEVFMT_SB_BYTES - 4,
				  devfmt_crc32c(0, block, DEVFMT_SB_BYTES - 4));
		}
		static struct devfmt_sb sb, sb2;
		if (devfmt_sb_decode(block, &sb, why, sizeof(why)) < 0) {
			CHECK(why[0] != '\0');
			return 0;
		}
		CHECK(sb.log_offset + sb.log_bytes <= sb.device_bytes);
		CHECK(sb.checkpoint_offset < sb.log_bytes);
		CHECK(sb.export_count <= DEVFMT_MAX_EXPORTS);
		CHECK(!sb.l2_bytes || (sb.l2_offset >= sb.log_offset + sb.log_bytes &&
				       sb.l2_offset + sb.l2_bytes <= sb.device_bytes));
		CHECK(!sb.l2_bytes ||
		      (sb.l2_map_offset >= sb.log_offset + sb.log_bytes &&
		       sb.l2_map_offset + devfmt_l2m_bytes(sb.l2_bytes / DEVFMT_BLOCK, sb.version) <=
			   sb.l2_offset));
		/* An older version's level-2 geometry is laid out again before
		 * it is written as this version's (device.c), within its bytes. */
		uint64_t l2_end = sb.l2_offset + sb.l2_bytes;
		if (devfmt_sb_l2_relayout(&sb))
			CHECK(sb.l2_offset + sb.l2_bytes <= l2_end &&
			      sb.l2_map_offset + devfmt_l2m_bytes(sb.l2_bytes / DEVFMT_BLOCK,
								  DEVFMT_VERSION) <=
				  sb.l2_offset);
		for (uint32_t i = 0; i < sb.export_count; i++) {
			CHECK(memchr(sb.exports[i].name, 0, sizeof(sb.exports[i].name)));
			CHECK(memchr(sb.exports[i].backend, 0, sizeof(sb.exports[i].backend)));
			CHECK(sb.exports[i].name[0] != '\0');
		}
		CHECK(devfmt_sb_encode(&sb, again) == 0);
		CHECK(devfmt_sb_decode(again, &sb2, why, sizeof(why)) == 0);
		CHECK(memcmp(&sb, &sb2, sizeof(sb)) == 0);
		return 0;
	}
	if (data[0] & 8) {
		/* The level-2 map: a header block or a map block (generation 7,
		 * index 3), the fuzzer's bytes with the right fields half the
		 * time. */
		size_t n = size - 1 < DEVFMT_BLOCK ? size - 1 : DEVFMT_BLOCK;
		memcpy(block, data + 1, n);
		if (data[0] & 16) {
			static struct devfmt_l2m_header h, h2;
			if (data[0] & 4) {
				nbd_put64(block, DEVFMT_L2M_MAGIC);
				memcpy(block + 8, uuid, 16);
				nbd_put32(block + 24, 7);
				nbd_put32(block + DEVFMT_BLOCK - 4,
					  devfmt_crc32c(0, block, DEVFMT_BLOCK - 4));
			}
			if (devfmt_l2m_header_decode(block, uuid, 7, &h, why, sizeof(why)) < 0) {
				CHECK(why[0] != '\0');
				return 0;
			}
			CHECK(h.gen == 7);
			devfmt_l2m_header_encode(&h, uuid, again);
			CHECK(devfmt_l2m_header_decode(again, uuid, 7, &h2, why, sizeof(why)) == 0);
			CHECK(memcmp(&h, &h2, sizeof(h)) == 0);
			return 0;
		}
		if (data[0] & 4) {
			nbd_put32(block + 4, 3);
			memcpy(block + 8, uuid, 16);
			nbd_put32(block + 24, 7);
			nbd_put32(block, devfmt_crc32c(0, block + 4, DEVFMT_BLOCK - 4));
		}
		static uint64_t keys[DEVFMT_L2M_PER_BLOCK], keys2[DEVFMT_L2M_PER_BLOCK];
		static uint32_t crcs[DEVFMT_L2M_PER_BLOCK], crcs2[DEVFMT_L2M_PER_BLOCK];
		if (devfmt_l2m_block_decode(block, 3, 7, uuid, keys, crcs, why, sizeof(why)) < 0) {
			CHECK(why[0] != '\0');
			return 0;
		}
		for (unsigned i = 0; i < DEVFMT_L2M_PER_BLOCK; i++)
			CHECK(keys[i] >> 48 <= DEVFMT_MAX_EXPORTS && (keys[i] || !crcs[i]));
		devfmt_l2m_block_encode(3, 7, uuid, keys, crcs, DEVFMT_L2M_PER_BLOCK, again);
		CHECK(devfmt_l2m_block_decode(again, 3, 7, uuid, keys2, crcs2, why, sizeof(why)) ==
		      0);
		CHECK(memcmp(keys, keys2, sizeof(keys)) == 0);
		CHECK(memcmp(crcs, crcs2, sizeof(crcs)) == 0);
		CHECK(memcmp(block, again, DEVFMT_BLOCK) == 0);
		return 0;
	}
	if (size < 9)
		return 0;
	uint64_t seq;
	memcpy(&seq, data + 1, 8);
	size_t n = size - 9 < DEVFMT_BLOCK ? size - 9 : DEVFMT_BLOCK;
	memcpy(block, data + 9, n);
	/* Half the time, the fuzzer's bytes carry this uuid. */
	if (data[0] & 2)
		memcpy(block + 8, uuid, 16);
	if (data[0] & 4) {
		nbd_put64(block, DEVFMT_BATCH_MAGIC);
		nbd_put64(block + 24, seq);
		nbd_put32(block + DEVFMT_BLOCK - 4, devfmt_crc32c(0, block, DEVFMT_BLOCK - 4));
	}
	static struct devfmt_batch b, b2;
	if (devfmt_batch_decode(block, uuid, seq, &b, why, sizeof(why)) < 0) {
		CHECK(why[0] != '\0');
		return 0;
	}
	CHECK(b.seq == seq);
	CHECK(b.extent_count <= DEVFMT_MAX_EXTENTS);
	for (uint32_t i = 0; i < b.extent_count; i++) {
		CHECK(b.extents[i].length > 0);
		CHECK(b.extents[i].offset + b.extents[i].length > b.extents[i].offset);
	}
	CHECK((devfmt_batch_data_bytes(&b) + DEVFMT_BLOCK - 1) / DEVFMT_BLOCK == b.data_blocks);
	CHECK(devfmt_batch_encode(&b, uuid, again) == 0);
	CHECK(devfmt_batch_decode(again, uuid, seq, &b2, why, sizeof(why)) == 0);
	CHECK(memcmp(&b, &b2, sizeof(b)) == 0);
	return 0;
}
