#!/usr/bin/python3
"""cache_eviction: 4 MiB of writes through a 1 MiB writeback cache, then FLUSH.

Each part starts its own daemon (--cache-size 1M, writeback,
--dirty-expire 3600 so that only eviction and FLUSH write back) on a 16 MiB
sparse backend file, and writes 64 pieces of 64 KiB with distinct random
contents at distinct offsets in a shuffled order. Right after the FLUSH the
backend file itself must hold every piece (and zeros elsewhere), before any
read through the daemon and before shutdown; then all 64 are read back
through the daemon; after SIGTERM the file is checked again.

  a         one connection, 64 KiB-aligned pieces, block size 4096
  a-512     one connection, unaligned pieces (offset 72 KiB * i + 0..8191),
            block size 512
  b         the writes alternate between two connections (one at a time),
            the FLUSH goes on a third
  b-aio     the same, with all 64 writes in flight on both connections at
            once, then the FLUSH on the third

  all-pinned  a 16 MiB writethrough cache filled by reads, every entry then
            pinned by the zero-copy replies of a client that never reads
            them. 4 READs of 4 MiB elsewhere and 4 WRITEs of 4 MiB (cached
            after they are written, where room can be found) must each give
            up on the cache after one failed allocation (alloc_failures grows
            by 1 to 8, not once per 4 KiB frame, each failure costing a scan
            of the eviction queues), and return and store the right bytes.
            Once the non-reader is gone the cache takes new data again.

  stream    a 128 MiB writeback cache (default watermarks) filled by reads,
            then 1 MiB WRITEs, 8 in flight, over four times the cache from
            the start: the first quarter hits the cached entries (so they
            move to the main queue), the rest needs new ones while the small
            queue holds the dirty data. Clean entries are in the cache all
            along (dirty data is throttled at the high watermark), so the
            WRITEs must find room in it: evictions grows, and at most 1/16
            of them go to the backend directly (direct_writes, control
            socket; a few may, when the data written back and not flushed
            yet briefly fills what the dirty data leaves). Then FLUSH, and
            the file holds every byte. (Eviction used to scan only the small
            queue while it was over its share, passing over the same dirty
            entries until it gave up: 370 of the 512 went directly.)

Seeds are fixed (printed); CACHE_EVICTION_SEED changes the base seed.
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require, require_same  # noqa: E402

import nbd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bad_input as raw  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 16 * MIB
PIECE = 64 * KIB
NPIECES = 64
BASE_SEED = int(os.environ.get("CACHE_EVICTION_SEED", "640064"))


def pieces(r, unaligned):
    """64 (offset, data): distinct, non-overlapping, in a shuffled order."""
    if unaligned:
        offs = [i * 72 * KIB + r.randrange(8192) for i in range(NPIECES)]
    else:
        offs = [s * PIECE for s in r.sample(range(SIZE // PIECE), NPIECES)]
    r.shuffle(offs)
    out = [(o, r.randbytes(PIECE)) for o in offs]
    require(len({d for _, d in out}) == NPIECES, "test setup: contents not distinct")
    return out


def model_of(ps):
    m = bytearray(SIZE)
    for o, d in ps:
        m[o:o + len(d)] = d
    return m


def check_file(path, ps, model, what):
    """Each piece in the backend file (reported by piece), then the whole file."""
    bad = []
    for k, (o, d) in enumerate(ps):
        got = nbdtest.read_at(path, o, len(d))
        diff = nbdtest.describe_diff(got, d, base=o)
        if diff:
            bad.append("piece %d [%d,+%d): %s" % (k, o, len(d), diff))
    require(not bad, "%s: %d of %d pieces wrong in the backend file; %s"
            % (what, len(bad), len(ps), "; ".join(bad[:4])))
    with open(path, "rb") as f:
        require_same(f.read(), model, "%s: backend file (outside the pieces)" % what)


def read_back(h, ps, what):
    for k, (o, d) in enumerate(ps):
        require_same(h.pread(len(d), o), d, "%s: piece %d read through the daemon" % (what, k),
                     base=o)


def part(name, seed, bs, unaligned, writers, aio):
    log("  %s: seed %d" % (name, seed))
    r = random.Random(seed)
    ps = pieces(r, unaligned)
    model = model_of(ps)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.sparse_file(os.path.join(tmp, "disk.img"), SIZE)
        extra = ["--cache-size", "1M", "--cache-mode", "writeback", "--dirty-expire", "3600",
                 "--block-size", str(bs)]
        with nbdtest.Daemon([("disk", path, "")], threads=4, extra=extra) as d:
            nconn = writers + (1 if writers > 1 else 0)
            hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(nconn)]
            try:
                if aio:
                    pending, bufs = [], []
                    for k, (o, data) in enumerate(ps):
                        h = hs[k % writers]
                        bufs.append(nbd.Buffer.from_bytearray(bytearray(data)))
                        pending.append((h, h.aio_pwrite(bufs[-1], o)))
                    nbdtest.aio_wait(pending, timeout=120)
                else:
                    for k, (o, data) in enumerate(ps):
                        hs[k % writers].pwrite(data, o)
                hs[-1].flush()
                # The file right after FLUSH, before anything else happens.
                check_file(path, ps, model, "%s: right after FLUSH on conn %d" % (name, nconn - 1))
                for c, h in enumerate(hs):
                    read_back(h, ps, "%s conn %d" % (name, c))
                require(d.alive(), "%s: the daemon died" % name)
            finally:
                nbdtest.shutdown_all(hs)
        check_file(path, ps, model, "%s: after SIGTERM" % name)


def all_pinned(seed):
    log("  all-pinned: seed %d" % seed)
    r = random.Random(seed)
    size, cache, span = 64 * MIB, 16 * MIB, 4 * MIB
    keys = nbdtest.CACHE_STATS_KEYS + ("alloc_failures",)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.random_file(os.path.join(tmp, "disk.img"), size, seed=seed)
        model = bytearray(nbdtest.read_at(path, 0, size))
        # Replies stay zero-copy (the whole cache may be pinned by them).
        extra = ["--cache-size", "16M", "--cache-mode", "writethrough",
                 "--max-pinned-replies", "16M"]
        with nbdtest.Daemon([("disk", path, "")], threads=2, extra=extra) as d:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            for off in range(0, cache, MIB):
                h.pread(MIB, off)
            st = nbdtest.stats(d, keys=keys)
            require(st["used_bytes"] == cache, "the warm-up reads left %d of %d bytes of the "
                    "cache used" % (st["used_bytes"], cache))
            # Pin every entry: hits whose replies are never read.
            pin = raw.RawClient(d.sock)
            pin.open("disk")
            pin.s.sendall(b"".join(pin.encode_request(raw.CMD_READ, off, span)[1]
                                   for off in range(0, cache, span)))
            time.sleep(0.5)
            before = nbdtest.stats(d, keys=keys)
            t0 = time.monotonic()
            for k in range(4):
                off = 32 * MIB + k * span
                require_same(h.pread(span, off), model[off:off + span],
                             "a 4 MiB read while the cache is pinned", base=off)
            reads_s = time.monotonic() - t0
            mid = nbdtest.stats(d, keys=keys)
            t0 = time.monotonic()
            for k in range(4):
                off = 48 * MIB + k * span
                data = r.randbytes(span)
                h.pwrite(data, off)
                model[off:off + span] = data
            writes_s = time.monotonic() - t0
            after = nbdtest.stats(d, keys=keys)
            failed_reads = mid["alloc_failures"] - before["alloc_failures"]
            failed_writes = after["alloc_failures"] - mid["alloc_failures"]
            log("    pinned cache: 4 reads of 4 MiB in %.2f s, %d failed allocations; "
                "4 writes in %.2f s, %d" % (reads_s, failed_reads, writes_s, failed_writes))
            require(1 <= failed_reads <= 4, "4 READs that found no room made %d failed "
                    "allocations (one each at most: the rest of the request goes around "
                    "the cache)" % failed_reads)
            require(1 <= failed_writes <= 4, "4 writethrough WRITEs that found no room made "
                    "%d failed allocations (one each at most)" % failed_writes)
            pin.close()
            off = 32 * MIB

            def cached():
                require_same(h.pread(span, off), model[off:off + span], "a read after", base=off)
                st = nbdtest.stats(d, keys=keys)
                return st["hits"] > after["hits"]
            require(nbdtest.wait_until(cached, 10, step=0.2),
                    "once the pins were gone, a 4 MiB read was not cached")
            require_same(h.pread(16 * MIB, 48 * MIB), model[48 * MIB:], "the written range",
                         base=48 * MIB)
            h.shutdown()
        require_same(nbdtest.read_at(path, 0, size), model, "the backend file after SIGTERM")


def stream(seed):
    log("  stream: seed %d" % seed)
    r = random.Random(seed)
    cache, size, piece, depth = 128 * MIB, 512 * MIB, MIB, 8
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.sparse_file(os.path.join(tmp, "disk.img"), size)
        model = bytearray(size)
        extra = ["--cache-size", "128M", "--cache-mode", "writeback"]
        with nbdtest.Daemon([("disk", path, "")], threads=2, extra=extra) as d:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            try:
                for off in range(0, cache, piece):
                    h.pread(piece, off)
                before = nbdtest.control_request(d.control, {"command": "stats"})["cache"]
                pending, bufs = [], []
                for off in range(0, size, piece):
                    data = r.randbytes(piece)
                    model[off:off + piece] = data
                    bufs.append(nbd.Buffer.from_bytearray(bytearray(data)))
                    pending.append((h, h.aio_pwrite(bufs[-1], off)))
                    if len(pending) >= depth:
                        nbdtest.aio_wait(pending[:1], timeout=60)
                        pending.pop(0)
                nbdtest.aio_wait(pending, timeout=60)
                after = nbdtest.control_request(d.control, {"command": "stats"})["cache"]
                direct = after["direct_writes"] - before["direct_writes"]
                evicted = after["evictions"] - before["evictions"]
                log("    %d WRITEs of 1 MiB: %d went to the backend directly, %d evictions"
                    % (size // piece, direct, evicted))
                require(direct <= size // piece // 16, "%d of %d WRITEs found no room in a "
                        "cache that held clean data, and went to the backend directly"
                        % (direct, size // piece))
                require(evicted > 0, "a stream four times the cache evicted nothing")
                h.flush()
                require_same(nbdtest.read_at(path, 0, size), model, "the file after FLUSH")
            finally:
                nbdtest.shutdown_all([h])


def main():
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    parts = [("a", 4096, False, 1, False), ("a-512", 512, True, 1, False),
             ("b", 4096, False, 2, False), ("b-aio", 4096, False, 2, True)]
    for k, (name, bs, unaligned, writers, aio) in enumerate(parts):
        checks.run(name, part, name, BASE_SEED + k, bs, unaligned, writers, aio)
    checks.run("all-pinned", all_pinned, BASE_SEED + len(parts))
    checks.run("stream", stream, BASE_SEED + len(parts) + 1)
    checks.finish("cache eviction", unit="part")


if __name__ == "__main__":
    main()
