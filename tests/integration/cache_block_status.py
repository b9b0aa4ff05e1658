#!/usr/bin/python3
"""cache_block_status: dirty (unflushed) data is reported as data by block status.

Writeback mode, --dirty-expire 3600 and a 64 MiB cache (so nothing is
written back on its own), a 16 MiB sparse backend file on tmpfs:

  W1  64 KiB at 4 MiB (aligned) and W2  1000 bytes at 8 MiB + 100 (inside
      one 4 KiB block), written over holes, not flushed
  - the backend file still has holes there (SEEK_DATA/SEEK_HOLE, and it
    reads as zeros): the data is only in the cache
  - base:allocation, on the writing connection and on another one, reports
    W1 and W2 as data (no HOLE/ZERO flag), and the untouched neighbours
    [4M-64K, 4M), [4M+64K, 4M+128K), [8M-64K, 8M), [8M+4K, 8M+68K) as holes;
    REQ_ONE at 4 MiB gives one data extent
  - reads return the written bytes
Then FLUSH: the file has data there and holds the bytes; block status still
says data, the neighbours are still holes, and the whole map equals the
file's own layout. The seed is fixed (printed).
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, clip_segments, file_layout, log, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 16 * MIB
SEED = 31337
HOLE = nbd.STATE_HOLE
ZERO = nbd.STATE_ZERO
r = random.Random(SEED)
WRITES = [("W1", 4 * MIB, r.randbytes(64 * KIB)), ("W2", 8 * MIB + 100, r.randbytes(1000))]
NEIGHBOURS = [(4 * MIB - 64 * KIB, 4 * MIB), (4 * MIB + 64 * KIB, 4 * MIB + 128 * KIB),
              (8 * MIB - 64 * KIB, 8 * MIB), (8 * MIB + 4 * KIB, 8 * MIB + 68 * KIB)]
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def expect_status(h, conn, when):
    """W1 and W2 are data, the neighbours are holes, on handle h."""
    segs = nbdtest.block_status_map(h, 0, SIZE)
    for name, off, data in WRITES:
        part = clip_segments(segs, off, off + len(data))
        expect(all(f & (HOLE | ZERO) == 0 for _, _, f in part),
               "%s, conn %d: block status of %s [%d,+%d) is %r, expected data (flags 0)"
               % (when, conn, name, off, len(data), part))
    for s, e in NEIGHBOURS:
        part = clip_segments(segs, s, e)
        expect(all(f & HOLE for _, _, f in part),
               "%s, conn %d: untouched neighbour [%d, %d) is %r, expected a hole"
               % (when, conn, s, e, part))
        if not all(f & ZERO for _, _, f in part):
            log("  note: %s, conn %d: hole [%d, %d) without the ZERO flag: %r"
                % (when, conn, s, e, part))
    return segs


def expect_backend_hole(path, when):
    layout = file_layout(path, SIZE)
    for name, off, data in WRITES:
        part = clip_segments(layout, off, off + len(data))
        expect(part == [(off, off + len(data), nbdtest.HOLE_ZERO)],
               "%s: the backend file already has data for %s [%d,+%d): %r (writeback mode "
               "wrote it before any FLUSH; the test needs it only in the cache)"
               % (when, name, off, len(data), part))
        got = nbdtest.read_at(path, off, len(data))
        expect(got == bytes(len(data)), "%s: the backend file holds bytes of %s: %s"
               % (when, name, nbdtest.describe_diff(got, bytes(len(data)), off)))


def expect_reads(h, when):
    for name, off, data in WRITES:
        try:
            require_same(h.pread(len(data), off), data, "%s: read of %s" % (when, name), base=off)
        except Failed as e:
            expect(False, str(e))


def before_flush(d, path, hs):
    expect_backend_hole(path, "before FLUSH")
    for c, h in enumerate(hs):
        expect_status(h, c, "before FLUSH")
    ents = []

    def cb(ctx, off, entries, err):
        if ctx == nbd.CONTEXT_BASE_ALLOCATION:
            ents.extend(entries)
        return 0
    hs[1].block_status(64 * KIB, 4 * MIB, cb, nbd.CMD_FLAG_REQ_ONE)
    expect(len(ents) == 2 and 0 < ents[0] <= 64 * KIB and ents[1] & (HOLE | ZERO) == 0,
           "before FLUSH: REQ_ONE block status at 4 MiB gave %r, expected one data extent"
           % (ents,))
    expect_reads(hs[1], "before FLUSH")
    # Still nothing on the backend after all those requests.
    expect_backend_hole(path, "before FLUSH, after block status and reads")


def after_flush(d, path, hs):
    hs[0].flush()
    layout = file_layout(path, SIZE)
    for name, off, data in WRITES:
        part = clip_segments(layout, off, off + len(data))
        expect(part == [(off, off + len(data), 0)],
               "after FLUSH: the backend file layout of %s [%d,+%d) is %r, expected data"
               % (name, off, len(data), part))
        got = nbdtest.read_at(path, off, len(data))
        expect(got == data, "after FLUSH: backend file, %s: %s"
               % (name, nbdtest.describe_diff(got, data, off)))
    for c, h in enumerate(hs):
        segs = expect_status(h, c, "after FLUSH")
        expect(segs == layout, "after FLUSH, conn %d: block status %r, but the file's "
               "layout is %r" % (c, segs, layout))
    expect_reads(hs[1], "after FLUSH")


def main():
    log("seed %d" % SEED)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.sparse_file(os.path.join(tmp, "disk.img"), SIZE)
        extra = ["--cache-size", "64M", "--cache-mode", "writeback", "--dirty-expire", "3600"]
        with nbdtest.Daemon([("disk", path, "")], extra=extra) as d:
            hs = [nbdtest.libnbd_handle(d.unix_uri("disk"), meta=True) for _ in range(2)]
            ok = CHECKS.run("baseline: all hole", lambda: expect(
                nbdtest.block_status_map(hs[0], 0, SIZE) == file_layout(path, SIZE)
                == [(0, SIZE, nbdtest.HOLE_ZERO)], "block status of the empty file is %r"
                % (nbdtest.block_status_map(hs[0], 0, SIZE),)))
            if ok:
                for name, off, data in WRITES:
                    hs[0].pwrite(data, off)
                CHECKS.run("unflushed writes", before_flush, d, path, hs)
                CHECKS.run("after FLUSH", after_flush, d, path, hs)
            expect(d.alive(), "the daemon died")
            nbdtest.shutdown_all(hs)
            CHECKS.dump_log(d)
    CHECKS.finish("cache block status")


if __name__ == "__main__":
    main()
