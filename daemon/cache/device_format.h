/*
 * daemon/cache/device_format.h: the on-device format of a cache device
 * (--cache-device): its superblock and the batches of its intent log.
 * Pure: encodes into and decodes from caller's buffers, no I/O. The
 * decoders are the trust boundary (a device written by another version,
 * another device's stale records, torn writes, corrupt bytes) and are
 * fuzzed (tests/fuzz/fuzz_device_format.c); each refusal says why.
 *
 * Layout, big-endian like NBD; every length in bytes:
 *
 *   [0, 64 KiB)        superblock copy A
 *   [64 KiB, 128 KiB)  superblock copy B
 *   [log_offset, log_offset + log_bytes)  the intent log, a ring of batches
 *   [l2_map_offset, + devfmt_l2m_bytes(pages))  the level-2 map: which
 *                                        export block each page holds
 *   [l2_offset, l2_offset + l2_bytes)    the level-2 cache: DEVFMT_BLOCK pages
 *                                        of clean data, written as a ring
 *
 * A superblock copy (DEVFMT_SB_BYTES):
 *
 *     0 u64 magic       DEVFMT_SB_MAGIC ("NBDCDEV\0")
 *     8 u32 version     DEVFMT_VERSION; an older one from
 *                       DEVFMT_VERSION_OLDEST on is read (its fields
 *                       missing here read as 0) and written as this one
 *                       at start (before version 5 the level-2 map had
 *                       no page checksums: its area is laid out again
 *                       then, and starts cold); any other is refused
 *    12 u32 flags       DEVFMT_SB_CLEAN: written back and closed cleanly
 *    16 u8[16] uuid     chosen at format time; every batch carries it
 *    32 u64 generation  the newer valid copy wins; each write goes to the
 *                       copy not holding the newest, so a torn write
 *                       leaves the other one
 *    40 u64 device_bytes  the size it was formatted for (geometry)
 *    48 u64 log_offset, 56 u64 log_bytes  (multiples of DEVFMT_BLOCK)
 *    64 u64 checkpoint_offset  where, within the log, replay starts
 *    72 u64 checkpoint_seq     the sequence number of the batch there
 *    80 u32 export_count       identities that follow (at most
 *                              DEVFMT_MAX_EXPORTS)
 *    84 u32 checkpoint_skip    extents of that batch already covered (not
 *                              replayed)
 *    88 u64 l2_offset, 96 u64 l2_bytes  the level-2 area (0 bytes: none;
 *                              after the log, multiples of DEVFMT_BLOCK)
 *   104 u64 l2_map_offset      the level-2 map (0 when there is no area:
 *                              after the log, before the area)
 *   112 u32 l2_map_gen         a map block of another generation is not
 *                              read: bumped when the map could no longer
 *                              be kept true (the level-2 cache turned off)
 *   116 u64 seq_floor  every batch a start after this one writes has
 *                      a sequence number past it: each start sets it to
 *                      its first before writing any (0: none said)
 *   124 4 bytes of zeros
 *   128 identities, DEVFMT_IDENTITY_BYTES each:
 *         u16 slot (the number batches use), u16 name length, u16 backend
 *         length, u16 reserved, u32 block size, u32 kind
 *         (DEVFMT_BACKEND_*), u64 size, u64 st_dev, u64 st_ino (a file's;
 *         0 otherwise), name (at most DEVFMT_MAX_NAME), backend string (at
 *         most DEVFMT_MAX_BACKEND), zero padded
 *   last 4 bytes: u32 CRC32C of the copy up to them
 *
 * A batch (what one log commit writes, DEVFMT_BLOCK aligned):
 *
 *   a header block (DEVFMT_BLOCK bytes):
 *     0 u64 magic       DEVFMT_BATCH_MAGIC ("NBDCLOG\0")
 *     8 u8[16] uuid     the superblock's: a batch of an earlier format of
 *                       the same device is not replayed
 *    24 u64 seq         one more than the batch before it
 *    32 u32 flags       DEVFMT_BATCH_WRAP: no extents; the next batch is
 *                       at the log's start. DEVFMT_BATCH_EPOCH: the first
 *                       batch a start wrote after the live log it found
 *                       (kept, not emptied): its sequence number jumps
 *                       from prev_seq, the one the walk expected there
 *    36 u32 extent_count (at most DEVFMT_WRITE_EXTENTS; version 3 wrote
 *                        up to DEVFMT_MAX_EXTENTS, and had no prev_seq
 *                        and committed then)
 *    40 u32 data_blocks  DEVFMT_BLOCK blocks of data after the header
 *    44 u32 data_crc     CRC32C of those blocks
 *    48 extents, 24 bytes each: u8 type (DEVFMT_EXTENT_*), u8 0, u16
 *       slot, u32 0, u64 offset, u64 length (a DATA extent's at most
 *       DEVFMT_MAX_DATA_EXTENT); the DATA extents' bytes
 *       follow the header in extent order, packed, the last block zero
 *       padded
 *  4056 u64 prev_seq    DEVFMT_BATCH_EPOCH: see flags (0 otherwise)
 *  4064 u64 committed   every batch up to this sequence number was
 *                       durable (a device flush had completed after it)
 *                       when this one was written: only a batch after
 *                       the highest such mark can be torn, so a start
 *                       reads the data of those alone (0: not said)
 *  4072 20 bytes of zeros
 *   last 4 bytes of the header block: u32 CRC32C of the block up to them
 *
 * The level-2 map (kept while the daemon runs, so that a start after a
 * crash finds the level-2 cache warm):
 *
 *   a header block (DEVFMT_BLOCK bytes):
 *     0 u64 magic       DEVFMT_L2M_MAGIC ("NBDCL2M\0")
 *     8 u8[16] uuid     the superblock's
 *    24 u32 gen         the superblock's l2_map_gen
 *    28 u32 0
 *    32 u64 stamp[DEVFMT_MAX_EXPORTS]  by export slot: a backend file's
 *                       modification and change times when the map was
 *                       last written, folded into 64 bits (0: not a
 *                       regular file; DEVFMT_L2M_STAMP_RACY: one of them
 *                       within the file system's timestamp granularity of
 *                       that moment, which proves nothing); another one at
 *                       start means it was changed since, and its pages
 *                       are not used (device_l2_map.c)
 *     last 4 bytes: u32 CRC32C of the block up to them
 *   then one map block per DEVFMT_L2M_PER_BLOCK pages, in page order:
 *     0 u32 CRC32C of the block's bytes after these four
 *     4 u32 index       of the block (0 for pages 0..507)
 *     8 u8[16] uuid, 24 u32 gen  as the header's
 *    28 u32 0
 *    32 per page, DEVFMT_L2M_ENTRY bytes: u64 key, 0 free, else
 *       (export slot + 1) << 48 | the export's offset / DEVFMT_BLOCK;
 *       u32 CRC32C of the page's bytes (checked on every read: a page
 *       that does not match is a miss, never served); u32 0. (Version 4
 *       had the keys alone, 8 bytes a page.)
 *   A map block claims a page only once the page's bytes are durable, and
 *   stops claiming it (durably) before the page is written over or the
 *   backend's bytes there change: a block that does not decode claims
 *   nothing, which only makes the level-2 cache colder.
 *
 * One write and one device flush commit a batch: the CRCs tell a torn or
 * partial batch from a whole one, so no flush is needed between the data
 * and the header (as OpenZFS's ZIL, which checksums its blocks).
 */
#ifndef NBDCACHED_DAEMON_CACHE_DEVICE_FORMAT_H
#define NBDCACHED_DAEMON_CACHE_DEVICE_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DEVFMT_SB_MAGIC 0x4e424443444556ull    /* "NBDCDEV" */
#define DEVFMT_BATCH_MAGIC 0x4e4244434c4f47ull /* "NBDCLOG" */
#define DEVFMT_L2M_MAGIC 0x4e4244434c324dull   /* "NBDCL2M" */
#define DEVFMT_VERSION 5u
/* The oldest version read (3: no seq_floor, prev_seq, committed). */
#define DEVFMT_VERSION_OLDEST 3u
#define DEVFMT_BLOCK 4096u
#define DEVFMT_SB_BYTES (64u * 1024u)
#define DEVFMT_SB_COPIES 2u
#define DEVFMT_SB_HEADER 128u
#define DEVFMT_IDENTITY_BYTES 1536u
#define DEVFMT_MAX_NAME 256u
#define DEVFMT_MAX_BACKEND 1200u
#define DEVFMT_IDENTITY_FIXED 40u
#define DEVFMT_MAX_EXPORTS ((DEVFMT_SB_BYTES - DEVFMT_SB_HEADER - 4u) / DEVFMT_IDENTITY_BYTES)
#define DEVFMT_BATCH_HEADER 48u
#define DEVFMT_EXTENT_BYTES 24u
#define DEVFMT_MAX_EXTENTS ((DEVFMT_BLOCK - DEVFMT_BATCH_HEADER - 4u) / DEVFMT_EXTENT_BYTES)
/* A version 4 batch carries one extent fewer than version 3 could: its
 * prev_seq and committed fields take the room (a header with
 * DEVFMT_MAX_EXTENTS extents is a version 3 one: they read as 0). */
#define DEVFMT_WRITE_EXTENTS (DEVFMT_MAX_EXTENTS - 1u)
#define DEVFMT_BATCH_PREV (DEVFMT_BATCH_HEADER + DEVFMT_WRITE_EXTENTS * DEVFMT_EXTENT_BYTES)
#define DEVFMT_BATCH_COMMITTED (DEVFMT_BATCH_PREV + 8u)
_Static_assert(DEVFMT_BATCH_COMMITTED + 8u <= DEVFMT_BLOCK - 4u,
	       "a batch header's prev_seq and committed fields fit before its CRC");
/* The log starts after both superblock copies. */
#define DEVFMT_LOG_OFFSET ((uint64_t)DEVFMT_SB_BYTES * DEVFMT_SB_COPIES)
/* The longest DATA extent: a batch's data then always adds up in 64 bits. */
#define DEVFMT_MAX_DATA_EXTENT (1ull << 30)
/* The smallest device: the superblocks and a log of 16 MiB (a few
 * batches of the largest size). */
#define DEVFMT_MIN_DEVICE (DEVFMT_LOG_OFFSET + (16u << 20))
/* The level-2 map: the fixed part of its blocks, a page's entry, pages
 * per block (a version 4 map's: keys alone). */
#define DEVFMT_L2M_FIXED 32u
#define DEVFMT_L2M_ENTRY 16u
#define DEVFMT_L2M_PER_BLOCK ((DEVFMT_BLOCK - DEVFMT_L2M_FIXED) / DEVFMT_L2M_ENTRY)
#define DEVFMT_L2M_PER_BLOCK_V4 ((DEVFMT_BLOCK - DEVFMT_L2M_FIXED) / 8u)
/* The first version whose map has page checksums. */
#define DEVFMT_VERSION_L2_CRC 5u
_Static_assert(DEVFMT_L2M_FIXED + DEVFMT_L2M_PER_BLOCK * DEVFMT_L2M_ENTRY == DEVFMT_BLOCK,
	       "a map block's entries fill it");

#define DEVFMT_SB_CLEAN 1u
#define DEVFMT_BATCH_WRAP 1u
#define DEVFMT_BATCH_EPOCH 2u

enum devfmt_backend_kind {
	DEVFMT_BACKEND_FILE = 1,  /* a file or block device: st_dev, st_ino */
	DEVFMT_BACKEND_OTHER = 2, /* nbd:, nbdkit:, rbd: the string and size only */
};

enum devfmt_extent_type {
	DEVFMT_EXTENT_DATA = 1, /* the bytes follow */
	DEVFMT_EXTENT_ZERO = 2, /* WRITE_ZEROES */
	DEVFMT_EXTENT_TRIM = 3, /* TRIM: replayed as zeros */
	/* No data: the backend holds these bytes durably as they were then
	 * (written back and flushed); an earlier record over them is not
	 * replayed. */
	DEVFMT_EXTENT_CLEAN = 4,
};

/* Who an export's dirty data belongs to. */
struct devfmt_identity {
	uint16_t slot;
	uint32_t block_size;
	uint32_t kind; /* enum devfmt_backend_kind */
	uint64_t size, dev, ino;
	char name[DEVFMT_MAX_NAME + 1];
	char backend[DEVFMT_MAX_BACKEND + 1];
};

struct devfmt_sb {
	uint32_t flags;
	uint8_t uuid[16];
	uint64_t generation;
	uint64_t device_bytes, log_offset, log_bytes;
	uint64_t checkpoint_offset, checkpoint_seq;
	uint32_t checkpoint_skip;
	uint64_t l2_offset, l2_bytes, l2_map_offset;
	uint32_t l2_map_gen;
	uint64_t seq_floor;
	uint32_t version; /* as read (encode writes DEVFMT_VERSION) */
	uint32_t export_count;
	struct devfmt_identity exports[DEVFMT_MAX_EXPORTS];
};

struct devfmt_extent {
	uint8_t type; /* enum devfmt_extent_type */
	uint16_t slot;
	uint64_t offset, length;
};

struct devfmt_batch {
	uint64_t seq;
	uint32_t flags;
	uint32_t extent_count;
	uint32_t data_blocks;
	uint32_t data_crc;
	uint64_t prev_seq;  /* DEVFMT_BATCH_EPOCH */
	uint64_t committed; /* see the layout above; 0: not said */
	struct devfmt_extent extents[DEVFMT_MAX_EXTENTS];
};

/* CRC32C (Castagnoli), as iSCSI and ext4 use it; crc 0 to start. The
 * CPU's instruction where it has one; _portable never uses it (the unit
 * test compares the two). */
uint32_t devfmt_crc32c(uint32_t crc, const void *p, size_t n);
uint32_t devfmt_crc32c_portable(uint32_t crc, const void *p, size_t n);

/* sb into buf (DEVFMT_SB_BYTES): 0, or -EINVAL for a field out of range
 * (a name or backend string too long, too many exports). */
int devfmt_sb_encode(const struct devfmt_sb *sb, uint8_t *buf);
/* A copy of DEVFMT_SB_BYTES bytes: 0, or -EINVAL with why. */
int devfmt_sb_decode(const uint8_t *buf, struct devfmt_sb *out, char *why, size_t why_len);

/* The header block of a batch into buf (DEVFMT_BLOCK): 0 or -EINVAL. */
int devfmt_batch_encode(const struct devfmt_batch *b, const uint8_t uuid[16], uint8_t *buf);
/*
 * A header block: 0, or -EINVAL with why (not a batch, another device's,
 * a sequence number other than expect_seq, unless an epoch batch's that
 * jumps from prev_seq == expect_seq; a corrupt header, extents that do
 * not add up to data_blocks, a committed mark not before its own
 * sequence number). The data's CRC is the caller's to check
 * (devfmt_crc32c over data_blocks blocks against b->data_crc).
 */
int devfmt_batch_decode(const uint8_t *buf, const uint8_t uuid[16], uint64_t expect_seq,
			struct devfmt_batch *out, char *why, size_t why_len);
/* Does the header block claim to be batch expect_seq of this device (its
 * magic, UUID and sequence number, or an epoch batch jumping from it),
 * whether or not it decodes? A torn batch does; unwritten space and an
 * older lap do not. */
bool devfmt_batch_claims(const uint8_t *buf, const uint8_t uuid[16], uint64_t expect_seq);
/* The bytes of data a batch's extents carry (the sum of DATA lengths). */
uint64_t devfmt_batch_data_bytes(const struct devfmt_batch *b);

/* The level-2 map's bytes for an area of pages: its header and blocks,
 * as a superblock of this version lays them out. */
uint64_t devfmt_l2m_bytes(uint64_t pages, uint32_t version);
/* The most pages an area and its map (of this version) fit in bytes. */
uint64_t devfmt_l2_pages_fit(uint64_t bytes);
/* A superblock read of a version before DEVFMT_VERSION_L2_CRC, with a
 * level-2 area: its map and area laid out again for this version's map
 * in the same bytes, under the next map generation (no map block of the
 * old layout is read as one of the new), and its version this one's: true
 * then. False, and sb unchanged, for any other. */
bool devfmt_sb_l2_relayout(struct devfmt_sb *sb);
/* The map's header block (DEVFMT_BLOCK bytes). */
struct devfmt_l2m_header {
	uint32_t gen;
	uint64_t stamp[DEVFMT_MAX_EXPORTS];
#define DEVFMT_L2M_STAMP_RACY 1ull
};
void devfmt_l2m_header_encode(const struct devfmt_l2m_header *h, const uint8_t uuid[16],
			      uint8_t *buf);
/* 0, or -EINVAL with why (not a map header, another device's, another
 * generation than gen, corrupt). */
int devfmt_l2m_header_decode(const uint8_t *buf, const uint8_t uuid[16], uint32_t gen,
			     struct devfmt_l2m_header *out, char *why, size_t why_len);
/* Map block index: keys[0 .. n) and their pages' checksums crcs[0 .. n)
 * (n at most DEVFMT_L2M_PER_BLOCK, the rest free) into buf (DEVFMT_BLOCK
 * bytes). */
void devfmt_l2m_block_encode(uint32_t index, uint32_t gen, const uint8_t uuid[16],
			     const uint64_t *keys, const uint32_t *crcs, uint32_t n, uint8_t *buf);
/* A map block: 0 with its DEVFMT_L2M_PER_BLOCK keys and checksums, or
 * -EINVAL with why (another index, device or generation, corrupt, a key
 * naming no export slot, a free page with a checksum or reserved bytes
 * set). */
int devfmt_l2m_block_decode(const uint8_t *buf, uint32_t index, uint32_t gen,
			    const uint8_t uuid[16], uint64_t *keys, uint32_t *crcs, char *why,
			    size_t why_len);

#endif
