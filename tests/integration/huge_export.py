#!/usr/bin/python3
"""huge_export: 64-bit offsets end to end, on exports far beyond 16 TiB.

A 64 TiB sparse file on /dev/shm (tmpfs; ext4 caps a file at 16 TiB):
  - pwrite/pread with libnbd at offsets straddling 2^32 and 2^44 (16 TiB,
    where a 32-bit page index runs out), above 2^45, and at the last byte;
    after FLUSH the backend file holds the bytes at those offsets
  - block status over the whole export (compact, 32-bit descriptors) and
    with extended headers (64-bit descriptors, 64-bit effect lengths), both
    matching the file's SEEK_DATA/SEEK_HOLE layout
  - trim/zero near the end, and their range errors
Then the largest file tmpfs allows (2^63-1, falling back to smaller): the
size is reported exactly, the last 4 KiB read (and written) correctly.
The daemon's RSS must not grow with the export size: it is compared with the
same daemon serving a 1 MiB export through the same kind of requests.
The files are removed at the end.
"""

import errno
import os
import random
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbdtest  # noqa: E402
from nbdtest import Failed, file_layout, log, merge_segments, model_bytes, read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402  (raises Failed: ends the check)
import bad_input as raw  # noqa: E402  (RawClient: extended headers, which libnbd 1.14 lacks)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB
HUGE = 64 * TIB
RSS_SLACK = 64 * MIB

CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, raw.Mismatch, raw.Closed))


def status_walk(h, offset, length, max_requests=100000, deadline_s=240):
    """libnbd block status over a range; returns (segments, requests)."""
    segs = []
    pos, end = offset, offset + length
    t_end = time.time() + deadline_s
    n = 0
    while pos < end:
        expect(n < max_requests and time.time() < t_end,
               "block status walk stuck at %d after %d requests" % (pos, n))
        got = []

        def cb(ctx, off, entries, err):
            if ctx == nbd.CONTEXT_BASE_ALLOCATION:
                got.extend(entries)
            return 0
        # Ask for at most 4 GiB - 4 KiB: a compact request length is 32 bits.
        h.block_status(min(end - pos, 4 * GIB - 4096), pos, cb)
        n += 1
        expect(got, "no extents at %d" % pos)
        pos = nbdtest.add_extents(segs, pos, end, zip(got[0::2], got[1::2]))
    return merge_segments(segs), n


def raw_status_walk(r, offset, length, max_requests, deadline_s=240):
    """Extended-header block status (64-bit lengths): (segments, requests, longest extent)."""
    segs = []
    pos, end = offset, offset + length
    longest = 0
    t_end = time.time() + deadline_s
    n = 0
    while pos < end:
        expect(n < max_requests and time.time() < t_end,
               "extended block status walk stuck at %d after %d requests" % (pos, n))
        rep = r.command(raw.CMD_BLOCK_STATUS, pos, end - pos)
        n += 1
        expect(rep.error == 0, "extended BLOCK_STATUS at %d: %s" % (pos, raw.err_name(rep.error)))
        expect(rep.ctx == r.meta_ctx, "block status for context %r" % rep.ctx)
        expect(rep.extents, "no extents at %d" % pos)
        for i, (ln, fl) in enumerate(rep.extents):
            expect(ln > 0, "zero-length extent at %d" % pos)
            longest = max(longest, ln)
            last = i == len(rep.extents) - 1
            # Only the final extent may run past the request, never past the export.
            expect(pos + ln <= (r.size if last else end - 1),
                   "extent [%d,+%d) runs past %s" % (pos, ln, "the export" if last else "the request"))
            ln = min(ln, end - pos)
            segs.append((pos, pos + ln, fl))
            pos += ln
            if pos >= end:
                break
    return merge_segments(segs), n, longest


# ---------------------------------------------------------------------------

OFFSETS = [
    (2 ** 32 - 2048, 4096),          # straddles 4 GiB
    (2 ** 32, 512),
    (2 ** 40 + 12345, 70000),
    (2 ** 44 - 2048, 4096),          # straddles 16 TiB
    (2 ** 44 + 1, 1),
    (2 ** 45 + 7, 100000),
    (HUGE - 8192, 4096),
    (HUGE - 4096, 4096),             # the last block
    (HUGE - 1, 1),                   # the last byte
]


def exercise(h, size, offsets, model):
    """The request mix used for both the small and the huge export."""
    r = random.Random(size & 0xFFFFFFFF)
    for off, n in offsets:
        data = r.randbytes(n)
        h.pwrite(data, off)
        model.append((off, data))
    for off, n in offsets:
        lo = max(0, off - 1000)
        hi = min(size, off + n + 1000)
        got = h.pread(hi - lo, lo)
        want = model_bytes(model, lo, hi - lo)
        if got != want:
            raise Failed("read back around [%d,+%d) differs at %d"
                         % (off, n, lo + nbdtest.first_diff(got, want)))


def t_small_baseline(tmp, state):
    path = nbdtest.sparse_file(os.path.join(tmp, "small.img"), 1 * MIB)
    with nbdtest.Daemon([("small", path, "")]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("small"), meta=True)
        offs = [(0, 4096), (12345, 70000), (MIB - 4096, 4096), (MIB - 1, 1)]
        exercise(h, MIB, offs, [])
        h.flush()
        status_walk(h, 0, MIB)
        h.zero(64 * KIB, MIB - 64 * KIB)
        h.trim(64 * KIB, 0)
        h.flush()
        state["rss_small"] = d.rss()
        h.shutdown()
    log("  RSS serving 1 MiB: %d KiB" % (state["rss_small"] >> 10))


def t_huge_rw(d, path, state):
    h = state["h"]
    expect(h.get_size() == HUGE, "size %d, expected %d" % (h.get_size(), HUGE))
    model = state["model"]
    exercise(h, HUGE, OFFSETS, model)
    # Never-written regions far out read as zeros.
    for off in (2 ** 43, 2 ** 45 + 2 ** 30, HUGE - 2 * MIB):
        expect(h.pread(MIB, off) == bytes(MIB), "unwritten MiB at %d is not zero" % off)
    # Dirty (unflushed) data is reported as data.
    for off, n in OFFSETS:
        segs, _ = status_walk(h, off, n)
        expect(all(f == 0 for _, _, f in segs), "unflushed data at %d reported as %r" % (off, segs))
    h.flush()
    for o, data in model:
        expect(read_at(path, o, len(data)) == model_bytes(model, o, len(data)),
               "backend bytes at %d differ after FLUSH" % o)


def t_huge_status_compact(d, path, state):
    h = state["h"]
    segs, n = status_walk(h, 0, HUGE)
    want = file_layout(path, HUGE)
    expect(segs == want, "block status (compact) %r..., file %r..." % (segs[:6], want[:6]))
    log("  whole 64 TiB export in %d compact BLOCK_STATUS requests, %d segments" % (n, len(segs)))


def t_huge_extended(d, path, state):
    r = raw.RawClient(d.sock)
    try:
        r.open("huge", extended=True, meta=["base:allocation"])
        expect(r.size == HUGE, "extended GO size %d" % r.size)
        expect(r.meta_ctx is not None, "base:allocation not selected")
        segs, n, longest = raw_status_walk(r, 0, HUGE, max_requests=2000)
        want = file_layout(path, HUGE)
        expect(segs == want, "block status (extended) %r..., file %r..." % (segs[:6], want[:6]))
        log("  whole 64 TiB export in %d extended requests, longest extent %d" % (n, longest))
        expect(longest > 2 ** 32, "no extent longer than 4 GiB with 64-bit descriptors "
               "(longest %d)" % longest)
        # 64-bit reads at the far end.
        for off, n_ in ((HUGE - 4096, 4096), (2 ** 44 - 2048, 4096)):
            rep = r.command(raw.CMD_READ, off, n_)
            expect(rep.error == 0, "extended READ at %d: %s" % (off, raw.err_name(rep.error)))
            expect(rep.data == read_at(path, off, n_), "extended READ at %d differs" % off)
        # 64-bit effect lengths: zero and trim more than 4 GiB of hole in one request.
        base = 2 ** 42
        shm_before = os.statvfs(path)
        for typ, name in ((raw.CMD_WRITE_ZEROES, "WRITE_ZEROES"), (raw.CMD_TRIM, "TRIM")):
            rep = r.command(typ, base, 2 ** 32 + 64 * KIB)
            expect(rep.error == 0, "extended %s of 4 GiB + 64 KiB: %s" % (name, raw.err_name(rep.error)))
            base += 2 ** 33
        rep = r.command(raw.CMD_FLUSH, 0, 0)
        expect(rep.error == 0, "FLUSH: %s" % raw.err_name(rep.error))
        shm_after = os.statvfs(path)
        grown = (shm_before.f_bfree - shm_after.f_bfree) * shm_after.f_frsize
        log("  tmpfs use grew by %d KiB for 8 GiB of zeroes/trims over holes" % (grown >> 10))
        rep = r.command(raw.CMD_READ, 2 ** 42 + 2 ** 32, 64 * KIB)
        expect(rep.error == 0 and rep.data == bytes(64 * KIB), "zeroed range does not read as zero")
        # Past the end, with 64-bit lengths.
        for typ, want_err in ((raw.CMD_WRITE_ZEROES, raw.ENOSPC), (raw.CMD_TRIM, raw.EINVAL),
                              (raw.CMD_BLOCK_STATUS, raw.EINVAL), (raw.CMD_CACHE, raw.EINVAL)):
            rep = r.command(typ, HUGE - 4096, 2 ** 33)
            expect(rep.error == want_err, "extended command %d past the end: %s, expected %s"
                   % (typ, raw.err_name(rep.error), raw.err_name(want_err)))
        r.disconnect()
    finally:
        r.close()


def t_huge_trim_zero_end(d, path, state):
    h = state["h"]
    h.set_strict_mode(0)
    end = HUGE
    h.zero(64 * KIB, end - 64 * KIB)
    expect(h.pread(64 * KIB, end - 64 * KIB) == bytes(64 * KIB), "zero at the end: not zero")
    h.trim(128 * KIB, end - 192 * KIB)
    got = h.pread(128 * KIB, end - 192 * KIB)
    h.flush()
    expect(got == read_at(path, end - 192 * KIB, 128 * KIB),
           "read after trim at the end differs from the backend after FLUSH")
    expect(read_at(path, end - 64 * KIB, 64 * KIB) == bytes(64 * KIB), "backend end not zero")
    for what, fn, e in (
            ("zero past the end", lambda: h.zero(8192, end - 4096), errno.ENOSPC),
            ("pwrite past the end", lambda: h.pwrite(b"x" * 8192, end - 4096), errno.ENOSPC),
            ("trim past the end", lambda: h.trim(8192, end - 4096), errno.EINVAL),
            ("pread past the end", lambda: h.pread(2, end - 1), errno.EINVAL)):
        nbdtest.expect_nbd_error(fn, e, what)
    segs, _ = status_walk(h, end - 16 * MIB, 16 * MIB)
    want = nbdtest.clip_segments(file_layout(path, HUGE), end - 16 * MIB, end)
    expect(segs == want, "status of the last 16 MiB %r, file %r" % (segs, want))


def t_huge_rss(d, state):
    now = d.rss()
    state["rss_huge"] = now
    log("  RSS serving 64 TiB (+ the maximum): %d KiB; serving 1 MiB: %d KiB"
        % (now >> 10, state["rss_small"] >> 10))
    expect(now < state["rss_small"] + RSS_SLACK,
           "RSS %d MiB with huge exports vs %d MiB with 1 MiB: grows with export size"
           % (now >> 20, state["rss_small"] >> 20))


def t_max(d, path, size):
    h = nbdtest.libnbd_handle(d.tcp_uri("max"), meta=True)
    try:
        expect(h.get_size() == size, "size %d, expected %d" % (h.get_size(), size))
        last = h.pread(4096, size - 4096)
        expect(last == bytes(4096), "last 4 KiB of a sparse file not zero")
        data = random.Random(5).randbytes(4096)
        h.pwrite(data, size - 4096)
        expect(h.pread(4096, size - 4096) == data, "last 4 KiB not read back")
        expect(h.pread(1, size - 1) == data[-1:], "last byte")
        h.flush()
        expect(read_at(path, size - 4096, 4096) == data, "backend last 4 KiB after FLUSH")
        segs, _ = status_walk(h, size - 8 * MIB, 8 * MIB)
        want = nbdtest.clip_segments(file_layout(path, size), size - 8 * MIB, size)
        expect(segs == want, "status near the end %r, file %r" % (segs, want))
        h.set_strict_mode(0)
        nbdtest.expect_nbd_error(lambda: h.pread(4096, size - 2048), errno.EINVAL,
                                 "read across the end of the maximum export")
    finally:
        h.shutdown()
    # The whole export through 64-bit block status: a few requests, not billions.
    r = raw.RawClient(d.sock)
    try:
        r.open("max", extended=True, meta=["base:allocation"])
        expect(r.size == size, "extended GO size %d" % r.size)
        segs, n, longest = raw_status_walk(r, 0, size, max_requests=1000)
        expect(segs == file_layout(path, size), "extended status of the maximum export %r, file %r"
               % (segs[:4], file_layout(path, size)[:4]))
        log("  %d-byte export mapped in %d extended requests" % (size, n))
        r.disconnect()
    finally:
        r.close()


def main():
    shm = nbdtest.shm_dir()
    if shm is None:
        nbdtest.skip("no tmpfs at /dev/shm for a 64 TiB sparse file")
    state = {}
    with nbdtest.tempdir() as tmp:
        CHECKS.run("small export baseline", t_small_baseline, tmp, state)
    nbdtest.check("rss_small" in state, "baseline failed: %s" % CHECKS.failures)
    with nbdtest.tempdir(prefix="nbdcached-huge-", base=shm) as stmp:
        huge = nbdtest.sparse_file(os.path.join(stmp, "huge.img"), HUGE)
        maxp = os.path.join(stmp, "max.img")
        max_size = None
        for s in (2 ** 63 - 1, 2 ** 62, 2 ** 60, 2 ** 56, 2 ** 50):
            try:
                nbdtest.sparse_file(maxp, s)
                max_size = s
                break
            except OSError as e:
                log("  tmpfs refuses a %d-byte file: %s" % (s, e))
        nbdtest.check(max_size is not None, "tmpfs refused every large size")
        log("largest tmpfs file: %d bytes" % max_size)
        with nbdtest.Daemon([("huge", huge, ""), ("max", maxp, "")]) as d:
            h = nbdtest.libnbd_handle(d.unix_uri("huge"), meta=True)
            state["h"] = h
            state["model"] = []
            CHECKS.run("64 TiB pwrite/pread at far offsets", t_huge_rw, d, huge, state)
            CHECKS.run("64 TiB block status (compact)", t_huge_status_compact, d, huge, state)
            CHECKS.run("64 TiB extended headers", t_huge_extended, d, huge, state)
            CHECKS.run("64 TiB trim/zero near the end", t_huge_trim_zero_end, d, huge, state)
            CHECKS.run("maximum tmpfs export", t_max, d, maxp, max_size)
            CHECKS.run("RSS independent of export size", t_huge_rss, d, state)
            nbdtest.check(d.alive(), "daemon died")
            try:
                h.shutdown()
            except nbd.Error:
                pass
            CHECKS.dump_log(d)
        os.unlink(huge)
        os.unlink(maxp)
    CHECKS.finish("huge-export")


if __name__ == "__main__":
    main()
