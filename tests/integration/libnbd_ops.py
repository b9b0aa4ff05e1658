#!/usr/bin/python3
"""libnbd_ops: every NBD command through python3-libnbd, checked byte for byte.

One daemon serves five exports, each for one concern so that the checks do
not disturb each other:

  rw      16 MiB of random data: pread/pwrite, FUA, flush, 64+ requests in
          flight, and at the end the backend file compared with the model
  layout  16 MiB with a known data/hole layout: structured reads (holes come
          back as holes), block status before and after writes, trims and
          zeroes, REQ_ONE, zero with NO_HOLE / FAST_ZERO
  mc      8 MiB sparse: several connections write disjoint regions, one
          flushes, all cross-read; the backend holds every region
  ro      readonly: EPERM for pwrite/trim/zero
  small   1 MiB: out-of-range requests (EINVAL/ENOSPC/EOVERFLOW) with
          libnbd's strict mode off so the requests reach the server

Every check runs even when an earlier one failed; the test fails at the end
listing each failure.
"""

import errno
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, clip_segments, expect_nbd_error, file_layout, log, \
    read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402  (raises Failed: ends the check)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
MAX_PAYLOAD = 32 * MIB
HOLE_FLAGS = nbdtest.HOLE_ZERO

RW_SIZE = 16 * MIB
# (start, end, is_data) of the "layout" export
LAYOUT = [(0, 4 * MIB, True), (4 * MIB, 8 * MIB, False), (8 * MIB, 10 * MIB, True),
          (10 * MIB, 16 * MIB, False)]
LAYOUT_SIZE = 16 * MIB
MC_SIZE = 8 * MIB
SMALL_SIZE = 1 * MIB


def expect_bytes(got, want, what):
    if bytes(got) != bytes(want):
        raise Failed("%s: data differs at byte %d (len %d vs %d)"
                     % (what, nbdtest.first_diff(got, want), len(got), len(want)))


status_map = nbdtest.block_status_map


def connect(d, export, meta=True, unix=True):
    return nbdtest.libnbd_handle(d.unix_uri(export) if unix else d.tcp_uri(export), meta)


class World:
    def __init__(self, d, files):
        self.d = d
        self.files = files
        self.models = {n: bytearray(open(p, "rb").read()) for n, p in files.items()
                       if n in ("rw", "layout", "mc")}
        self.h = {}

    def handle(self, export):
        if export not in self.h:
            self.h[export] = connect(self.d, export)
        return self.h[export]

    def write(self, export, off, data, flags=0):
        self.handle(export).pwrite(data, off, flags)
        self.models[export][off:off + len(data)] = data

    def check_read(self, export, off, n, what):
        got = self.handle(export).pread(n, off)
        expect_bytes(got, self.models[export][off:off + n], what)

    def check_backend(self, export, what):
        with open(self.files[export], "rb") as f:
            back = f.read()
        expect_bytes(back, self.models[export], "%s: backend file vs. what was written" % what)


# ---------------------------------------------------------------------------

def t_negotiated(w):
    """What libnbd sees: size, flags, block sizes, base:allocation."""
    h = w.handle("rw")
    expect(h.get_size() == RW_SIZE, "size %d" % h.get_size())
    expect(not h.is_read_only(), "rw export is read-only")
    for name in ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_df",
                 "can_multi_conn", "can_cache"):
        expect(getattr(h, name)(), "%s is false on a writable export" % name)
    expect(h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION), "base:allocation not negotiated")
    expect(h.get_structured_replies_negotiated(), "structured replies not negotiated")
    bs = (h.get_block_size(nbd.SIZE_MINIMUM), h.get_block_size(nbd.SIZE_PREFERRED),
          h.get_block_size(nbd.SIZE_MAXIMUM))
    expect(bs == (1, 4096, MAX_PAYLOAD), "block sizes %r" % (bs,))
    r = w.handle("ro")
    expect(r.is_read_only(), "ro export is not read-only")
    expect(not r.can_trim() and not r.can_zero() and not r.can_fast_zero(),
           "ro export advertises trim/zero/fast-zero")
    missing = [n for n in ("can_flush", "can_fua", "can_cache", "can_multi_conn")
               if not getattr(r, n)()]
    expect(not missing, "ro export lacks %s (contract: a readonly export drops only "
           "TRIM/WRITE_ZEROES/FAST_ZERO)" % ", ".join(missing))


def t_pread_pwrite(w):
    """Whole-export read, then unaligned and large writes read back."""
    h = w.handle("rw")
    expect_bytes(h.pread(RW_SIZE // 2, 0), w.models["rw"][:RW_SIZE // 2], "first half")
    expect_bytes(h.pread(RW_SIZE // 2, RW_SIZE // 2), w.models["rw"][RW_SIZE // 2:], "second half")
    r = random.Random(11)
    cases = [(0, 1), (12345, 777), (4095, 2), (8190, 8200), (RW_SIZE - 1, 1),
             (RW_SIZE - 5000, 5000), (3 * MIB + 17, 5 * MIB), (123 * KIB, 64 * KIB)]
    for off, n in cases:
        w.write("rw", off, r.randbytes(n))
    for off, n in cases:
        w.check_read("rw", max(0, off - 100), min(RW_SIZE, off + n + 100) - max(0, off - 100),
                     "read back [%d,+%d)" % (off, n))
    expect_bytes(h.pread(RW_SIZE, 0), w.models["rw"], "whole-export read in one request")


def t_flush_backend(w):
    """After FLUSH the backend file holds every byte written."""
    w.handle("rw").flush()
    w.check_backend("rw", "after flush")


def t_fua(w):
    """A FUA write is on the backend when it completes, without FLUSH."""
    h = w.handle("rw")
    r = random.Random(12)
    for off, n in ((5 * MIB + 3, 10000), (9 * MIB, 128 * KIB), (1000, 1)):
        data = r.randbytes(n)
        w.write("rw", off, data, nbd.CMD_FLAG_FUA)
        expect_bytes(read_at(w.files["rw"], off, n), data,
                     "backend right after FUA write [%d,+%d)" % (off, n))
    # A FUA write-zeroes, too.
    h.zero(64 * KIB, 6 * MIB, nbd.CMD_FLAG_FUA)
    w.models["rw"][6 * MIB:6 * MIB + 64 * KIB] = bytes(64 * KIB)
    expect_bytes(read_at(w.files["rw"], 6 * MIB, 64 * KIB), bytes(64 * KIB),
                 "backend right after FUA zero")
    w.check_read("rw", 6 * MIB - 10, 64 * KIB + 20, "read after FUA zero")


def run_aio(h, ops, deadline_s=120):
    """ops: list of (kind, offset, bytes-or-length). Returns read results by index.
    All are submitted before any is waited for; completion order is free."""
    cookies = []
    bufs = []
    for kind, off, x in ops:
        if kind == "w":
            b = nbd.Buffer.from_bytearray(bytearray(x))
            cookies.append(h.aio_pwrite(b, off))
        else:
            b = nbd.Buffer(x)
            cookies.append(h.aio_pread(b, off))
        bufs.append(b)
    peak = h.aio_in_flight()
    done = [False] * len(ops)
    deadline = time.time() + deadline_s
    for _ in range(10 ** 6):
        for i, c in enumerate(cookies):
            if not done[i] and h.aio_command_completed(c):
                done[i] = True
        if all(done):
            break
        expect(time.time() < deadline, "aio commands not complete after %ds" % deadline_s)
        h.poll(1000)
    expect(all(done), "aio commands never completed")
    return peak, [bufs[i].to_bytearray() if ops[i][0] == "r" else None for i in range(len(ops))]


def t_many_in_flight(w):
    """128 writes then 128 reads in flight, then 64 of each mixed; every byte checked."""
    h = w.handle("rw")
    r = random.Random(13)
    n = 128
    chunk = 64 * KIB
    offs = list(range(0, n * chunk, chunk))
    r.shuffle(offs)
    ops = [("w", o, r.randbytes(chunk)) for o in offs]
    peak, _ = run_aio(h, ops)
    log("  128 aio_pwrite: peak in flight %d" % peak)
    expect(peak >= 64, "only %d commands in flight" % peak)
    for _, o, data in ops:
        w.models["rw"][o:o + chunk] = data
    rops = [("r", o, chunk) for o in offs]
    peak, res = run_aio(h, rops)
    log("  128 aio_pread: peak in flight %d" % peak)
    for (_, o, _), got in zip(rops, res):
        expect_bytes(got, w.models["rw"][o:o + chunk], "aio read at %d" % o)
    # Mixed: unaligned sizes, reads of one half while writing the other.
    mixed = []
    for i in range(64):
        o = 8 * MIB + i * 65536 + r.randrange(1000)
        mixed.append(("w", o, r.randbytes(r.randrange(1, 60000))))
        ro = r.randrange(0, 8 * MIB - 70000)
        mixed.append(("r", ro, r.randrange(1, 70000)))
    r.shuffle(mixed)
    peak, res = run_aio(h, mixed)
    log("  64+64 mixed: peak in flight %d" % peak)
    for (kind, o, x), got in zip(mixed, res):
        if kind == "r":
            expect_bytes(got, w.models["rw"][o:o + x], "mixed aio read [%d,+%d)" % (o, x))
    for kind, o, x in mixed:
        if kind == "w":
            w.models["rw"][o:o + len(x)] = x
    w.check_read("rw", 8 * MIB, 8 * MIB, "after mixed aio")
    # Many small unaligned overlapping writes in flight: the last one submitted
    # need not win (NBD has no ordering), so make them disjoint but adjacent.
    ops = []
    base = 12 * MIB + 3
    for i in range(100):
        ops.append(("w", base + i * 513, r.randbytes(513)))
    run_aio(h, ops)
    for _, o, data in ops:
        w.models["rw"][o:o + 513] = data
    w.check_read("rw", base - 10, 100 * 513 + 20, "adjacent unaligned aio writes")


def t_structured_holes(w):
    """Reads of the layout export: holes arrive as holes, data as data, twice."""
    h = w.handle("layout")
    for attempt in (1, 2):
        chunks = []

        def cb(subbuf, off, status, err):
            chunks.append((off, len(subbuf), status, bytes(subbuf)))
            return 0
        got = h.pread_structured(4 * MIB, 2 * MIB, cb)
        expect_bytes(got, w.models["layout"][2 * MIB:6 * MIB], "structured read %d" % attempt)
        holes = sum(n for off, n, st, _ in chunks if st == nbd.READ_HOLE and off >= 4 * MIB)
        datas = [(off, n) for off, n, st, _ in chunks if st == nbd.READ_DATA and off + n > 4 * MIB]
        expect(holes == 2 * MIB and not datas,
               "read %d: the file hole [4M,6M) came as %d hole bytes and data chunks %r"
               % (attempt, holes, datas[:4]))
        expect(all(st != nbd.READ_HOLE for off, n, st, _ in chunks if off < 4 * MIB),
               "read %d: data region reported as a hole" % attempt)
    chunks = []

    def cb1(subbuf, off, status, err):
        chunks.append((off, len(subbuf), status))
        return 0
    got = h.pread_structured(2 * MIB, 3 * MIB, cb1, nbd.CMD_FLAG_DF)
    expect_bytes(got, w.models["layout"][3 * MIB:5 * MIB], "DF read")
    expect(len(chunks) == 1, "DF read came in %d chunks" % len(chunks))


def t_block_status(w):
    """base:allocation against the layout, REQ_ONE, and after write/trim/zero."""
    h = w.handle("layout")
    path = w.files["layout"]
    truth = [(s, e, 0 if data else HOLE_FLAGS) for s, e, data in LAYOUT]
    expect(file_layout(path, LAYOUT_SIZE) == truth, "test setup: the file lost its layout")
    got = status_map(h, 0, LAYOUT_SIZE)
    expect(got == truth, "block status %r, file %r" % (got, truth))
    got = status_map(h, 3 * MIB, 6 * MIB)
    expect(got == clip_segments(truth, 3 * MIB, 9 * MIB), "block status from 3M: %r" % got)
    # REQ_ONE: exactly one extent, never past the request.
    for off, n in ((0, LAYOUT_SIZE), (5 * MIB, 1 * MIB), (4 * MIB - 4096, 1 * MIB), (15 * MIB, MIB)):
        ents = []

        def cb(ctx, o, entries, err):
            if ctx == nbd.CONTEXT_BASE_ALLOCATION:
                ents.extend(entries)
            return 0
        h.block_status(n, off, cb, nbd.CMD_FLAG_REQ_ONE)
        expect(len(ents) == 2, "REQ_ONE at %d: %d extents" % (off, len(ents) // 2))
        ln, fl = ents
        expect(0 < ln <= n, "REQ_ONE extent length %d for a %d request" % (ln, n))
        want = clip_segments(truth, off, off + n)[0]
        expect(fl == want[2] and off + ln <= want[1],
               "REQ_ONE at %d: (%d, %d), file has %r" % (off, ln, fl, want))

    # A write into a hole is data at once (dirty data is data), and after FLUSH.
    r = random.Random(14)
    w.write("layout", 5 * MIB, r.randbytes(64 * KIB))
    got = status_map(h, 4 * MIB, 4 * MIB)
    seg = clip_segments(got, 5 * MIB, 5 * MIB + 64 * KIB)
    expect(seg == [(5 * MIB, 5 * MIB + 64 * KIB, 0)],
           "block status of freshly written (unflushed) data: %r" % seg)
    h.flush()
    expect_bytes(read_at(path, 5 * MIB, 64 * KIB), w.models["layout"][5 * MIB:5 * MIB + 64 * KIB],
                 "backend after flush")
    got = status_map(h, 0, LAYOUT_SIZE)
    expect(got == file_layout(path, LAYOUT_SIZE),
           "after write+flush: block status %r, file %r" % (got, file_layout(path, LAYOUT_SIZE)))
    expect(clip_segments(got, 5 * MIB, 5 * MIB + 64 * KIB) == [(5 * MIB, 5 * MIB + 64 * KIB, 0)],
           "written range not data after flush")

    # TRIM a data range: reads agree with the backend, status with the file.
    h.trim(1 * MIB, 8 * MIB)
    after_trim = h.pread(1 * MIB, 8 * MIB)
    h.flush()
    back = read_at(path, 8 * MIB, 1 * MIB)
    expect_bytes(after_trim, back, "read after TRIM vs. backend after FLUSH")
    w.models["layout"][8 * MIB:9 * MIB] = back
    got = status_map(h, 0, LAYOUT_SIZE)
    expect(got == file_layout(path, LAYOUT_SIZE),
           "after trim+flush: block status %r, file %r" % (got, file_layout(path, LAYOUT_SIZE)))
    log("  after TRIM [8M,9M): reads %s, status %r" % (
        "zero" if after_trim == bytes(MIB) else "old data", clip_segments(got, 8 * MIB, 9 * MIB)))

    # WRITE_ZEROES (may punch): reads zero; status agrees with the file after FLUSH.
    h.zero(512 * KIB, 9 * MIB)
    w.models["layout"][9 * MIB:9 * MIB + 512 * KIB] = bytes(512 * KIB)
    w.check_read("layout", 9 * MIB - 100, 512 * KIB + 200, "read after zero")
    h.flush()
    expect_bytes(read_at(path, 9 * MIB, 512 * KIB), bytes(512 * KIB), "backend after zero+flush")
    got = status_map(h, 0, LAYOUT_SIZE)
    expect(got == file_layout(path, LAYOUT_SIZE),
           "after zero+flush: block status %r, file %r" % (got, file_layout(path, LAYOUT_SIZE)))
    zs = clip_segments(got, 9 * MIB, 9 * MIB + 512 * KIB)
    log("  after WRITE_ZEROES [9M,+512K): status %r" % zs)

    # WRITE_ZEROES with NO_HOLE: zero and allocated on the backend after FLUSH.
    h.zero(256 * KIB, 12 * MIB, nbd.CMD_FLAG_NO_HOLE)
    w.models["layout"][12 * MIB:12 * MIB + 256 * KIB] = bytes(256 * KIB)
    w.check_read("layout", 12 * MIB, 256 * KIB, "read after NO_HOLE zero")
    h.flush()
    fl = clip_segments(file_layout(path, LAYOUT_SIZE), 12 * MIB, 12 * MIB + 256 * KIB)
    expect(fl == [(12 * MIB, 12 * MIB + 256 * KIB, 0)],
           "NO_HOLE zero left the backend with holes: %r" % fl)
    got = status_map(h, 11 * MIB, 2 * MIB)
    expect(got == clip_segments(file_layout(path, LAYOUT_SIZE), 11 * MIB, 13 * MIB),
           "after NO_HOLE zero: status %r" % got)

    # FAST_ZERO: either it zeroes, or it fails at once with ENOTSUP and
    # changes nothing.
    for off, flags in ((1 * MIB, nbd.CMD_FLAG_FAST_ZERO),
                       (2 * MIB, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE),
                       (14 * MIB, nbd.CMD_FLAG_FAST_ZERO)):
        before = h.pread(128 * KIB, off)
        t0 = time.time()
        try:
            h.zero(128 * KIB, off, flags)
            w.models["layout"][off:off + 128 * KIB] = bytes(128 * KIB)
            outcome = "zeroed"
        except nbd.Error as e:
            expect(e.errnum == errno.ENOTSUP, "FAST_ZERO failed with %s, expected ENOTSUP" % e.errno)
            outcome = "ENOTSUP"
        log("  FAST_ZERO flags 0x%x at %d: %s in %.3fs" % (flags, off, outcome, time.time() - t0))
        after = h.pread(128 * KIB, off)
        if outcome == "zeroed":
            expect_bytes(after, bytes(128 * KIB), "read after FAST_ZERO")
        else:
            expect_bytes(after, before, "FAST_ZERO failed but changed data")
    h.flush()
    w.check_backend("layout", "layout export after all ops")


def t_cache(w):
    h = w.handle("rw")
    h.cache(4 * MIB, 0)
    h.cache(RW_SIZE, 0)
    h.cache(1, RW_SIZE - 1)
    w.check_read("rw", 0, 4 * MIB, "read after CACHE")


def t_multi_conn(w):
    """Four connections (Unix and TCP) write disjoint regions; one FLUSH covers all."""
    hs = [connect(w.d, "mc", meta=False, unix=(i % 2 == 0)) for i in range(4)]
    for h in hs:
        expect(h.can_multi_conn(), "CAN_MULTI_CONN not advertised")
    region = MC_SIZE // 4
    r = random.Random(15)
    ops = {}
    for i, h in enumerate(hs):
        chunk = 128 * KIB
        ops[i] = [("w", i * region + j * chunk, r.randbytes(chunk)) for j in range(region // chunk)]
    # Submit on all four before waiting on any.
    cookies = []
    for i, h in enumerate(hs):
        for kind, off, data in ops[i]:
            cookies.append((h, h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), off)))
    deadline = time.time() + 120
    pending = list(cookies)
    for _ in range(10 ** 6):
        pending = [(h, c) for h, c in pending if not h.aio_command_completed(c)]
        if not pending:
            break
        expect(time.time() < deadline, "multi-conn writes not complete")
        pending[0][0].poll(100)
    for i in ops:
        for _, off, data in ops[i]:
            w.models["mc"][off:off + len(data)] = data
    # Every connection sees every other connection's completed writes.
    for i, h in enumerate(hs):
        for j in range(4):
            expect_bytes(h.pread(region, j * region), w.models["mc"][j * region:(j + 1) * region],
                         "connection %d reading region written by %d" % (i, j))
    # FLUSH on one connection covers the writes completed on all of them.
    hs[3].flush()
    w.check_backend("mc", "after FLUSH on connection 3 only")
    # Overwrite across connections, then read through a fresh one.
    hs[1].pwrite(b"\x5a" * 4096, 0)
    hs[2].pwrite(b"\xa5" * 4096, 4096)
    w.models["mc"][0:4096] = b"\x5a" * 4096
    w.models["mc"][4096:8192] = b"\xa5" * 4096
    fresh = connect(w.d, "mc", meta=False, unix=False)
    expect_bytes(fresh.pread(8192, 0), w.models["mc"][:8192], "fresh connection after cross writes")
    fresh.flush()
    w.check_backend("mc", "after cross writes + FLUSH on a fresh connection")
    for h in hs + [fresh]:
        h.shutdown()


def t_readonly(w):
    h = w.handle("ro")
    h.set_strict_mode(0)          # let libnbd send what the export forbids
    before = read_at(w.files["ro"], 0, SMALL_SIZE)
    expect_bytes(h.pread(SMALL_SIZE, 0), before, "read of readonly export")
    problems = []
    for what, fn in (("pwrite", lambda: h.pwrite(b"x" * 4096, 0)),
                     ("pwrite past the end", lambda: h.pwrite(b"x" * 4096, SMALL_SIZE)),
                     ("trim", lambda: h.trim(4096, 0)),
                     ("zero", lambda: h.zero(4096, 0)),
                     ("NO_HOLE zero", lambda: h.zero(4096, 0, nbd.CMD_FLAG_NO_HOLE)),
                     ("FUA pwrite", lambda: h.pwrite(b"x" * 4096, 0, nbd.CMD_FLAG_FUA))):
        try:
            expect_nbd_error(fn, errno.EPERM, what + " on readonly")
        except Failed as e:
            problems.append(str(e))
    expect(not problems, "; ".join(problems))
    h.flush()
    h.cache(SMALL_SIZE, 0)
    expect_bytes(h.pread(SMALL_SIZE, 0), before, "readonly export changed")
    expect_bytes(read_at(w.files["ro"], 0, SMALL_SIZE), before, "readonly backend changed")


def t_out_of_range(w):
    h = connect(w.d, "small")
    h.set_strict_mode(0)
    S = SMALL_SIZE
    cases = [
        ("pread past the end", lambda: h.pread(1024, S - 512), errno.EINVAL),
        ("pread at the end", lambda: h.pread(1, S), errno.EINVAL),
        ("pread far beyond", lambda: h.pread(4096, 1 << 62), errno.EINVAL),
        ("pread 64-bit wrap", lambda: h.pread(8192, (1 << 64) - 4096), errno.EINVAL),
        ("pwrite past the end", lambda: h.pwrite(b"y" * 1024, S - 512), errno.ENOSPC),
        ("pwrite 64-bit wrap", lambda: h.pwrite(b"y" * 8192, (1 << 64) - 4096), errno.ENOSPC),
        ("zero past the end", lambda: h.zero(4096, S), errno.ENOSPC),
        ("zero 64-bit wrap", lambda: h.zero(8192, (1 << 64) - 4096), errno.ENOSPC),
        ("trim past the end", lambda: h.trim(8192, S - 4096), errno.EINVAL),
        ("cache past the end", lambda: h.cache(8192, S - 4096), errno.EINVAL),
        ("block_status past the end",
         lambda: h.block_status(8192, S - 4096, lambda *a: 0), errno.EINVAL),
        ("pread 32 MiB + 1 (structured)", lambda: h.pread(MAX_PAYLOAD + 1, 0), errno.EOVERFLOW),
        ("pwrite 32 MiB + 1 (payload discarded)", lambda: h.pwrite(b"z" * (MAX_PAYLOAD + 1), 0),
         errno.EINVAL),
    ]
    before = read_at(w.files["small"], 0, S)
    for what, fn, e in cases:
        expect_nbd_error(fn, e, what)
        # the connection is still in sync after every error
        expect_bytes(h.pread(4096, 0), before[:4096], "read after %s" % what)
    expect_bytes(h.pread(S, 0), before, "small export changed by failed requests")
    h.flush()
    expect_bytes(read_at(w.files["small"], 0, S), before, "small backend changed")
    # The last byte is in range.
    h.pwrite(b"\x42", S - 1)
    expect(h.pread(1, S - 1) == b"\x42", "last byte")
    h.pwrite(before[-1:], S - 1)
    h.shutdown()


def t_zero_length_read(w):
    """A zero-length read must not break the connection (the spec says the
    server SHOULD NOT disconnect; an OFFSET_DATA chunk must carry data)."""
    h = connect(w.d, "small")
    h.set_strict_mode(0)
    problems = []
    try:
        got = h.pread(0, 4096)
        if got != b"":
            problems.append("zero-length read returned %d bytes" % len(got))
    except nbd.Error as e:
        problems.append("zero-length pread failed: %s" % e)
    try:
        h.pread(4096, 0)
    except nbd.Error as e:
        problems.append("connection unusable afterwards: %s" % e)
    expect(not problems, "; ".join(problems))
    h.shutdown()


def t_random_ops(w):
    """Property test: 600 random operations on two connections against a
    byte model; every read compared, the backend compared after FLUSH."""
    hs = [w.handle("rw"), connect(w.d, "rw", meta=False, unix=False)]
    m = w.models["rw"]
    r = random.Random(16)
    for i in range(600):
        h = hs[r.randrange(2)]
        op = r.choice("wwwwrrrrzztfa")
        off = r.randrange(RW_SIZE)
        n = min(RW_SIZE - off, r.choice((1, 512, 4096, 4097, 65536, 300000)))
        if op == "w":
            data = r.randbytes(n)
            h.pwrite(data, off, r.choice((0, 0, nbd.CMD_FLAG_FUA)))
            m[off:off + n] = data
        elif op == "r":
            expect_bytes(h.pread(n, off), m[off:off + n], "op %d: read [%d,+%d)" % (i, off, n))
        elif op == "z":
            h.zero(n, off, r.choice((0, nbd.CMD_FLAG_NO_HOLE, nbd.CMD_FLAG_FUA)))
            m[off:off + n] = bytes(n)
        elif op == "t":
            h.trim(n, off)
            # TRIM leaves the contents to the server, but both connections
            # must then agree, and every 4 KiB block is either kept or zero.
            a = hs[0].pread(n, off)
            b = hs[1].pread(n, off)
            expect_bytes(a, b, "op %d: connections disagree after trim [%d,+%d)" % (i, off, n))
            for blk_start in range(off - off % 4096, off + n, 4096):
                lo, hi = max(off, blk_start), min(off + n, blk_start + 4096)
                got = a[lo - off:hi - off]
                expect(got == m[lo:hi] or got == bytes(hi - lo),
                       "op %d: trimmed block at %d is neither old data nor zero" % (i, lo))
            m[off:off + n] = a
        elif op == "f":
            h.flush()
        else:
            ops = []
            for _ in range(r.randrange(2, 40)):
                o = r.randrange(RW_SIZE - 70000)
                if r.random() < 0.5:
                    ops.append(("r", o, r.randrange(1, 70000)))
                else:
                    ops.append(("w", o, r.randbytes(r.randrange(1, 70000))))
            # Overlapping requests in flight have no defined order: a write
            # may not overlap any other request of the same batch.
            batch = []
            for kind, o, x in ops:
                ln = x if kind == "r" else len(x)
                if any(o < bo + (bx if bk == "r" else len(bx)) and bo < o + ln and "w" in (kind, bk)
                       for bk, bo, bx in batch):
                    continue
                batch.append((kind, o, x))
            _, res = run_aio(h, batch)
            for (kind, o, x), got in zip(batch, res):
                if kind == "r":
                    expect_bytes(got, m[o:o + x], "op %d: aio read [%d,+%d)" % (i, o, x))
            for kind, o, x in batch:
                if kind == "w":
                    m[o:o + len(x)] = x
    hs[1].flush()
    w.check_backend("rw", "after random ops + FLUSH on the second connection")
    hs[1].shutdown()


def t_final_backend(w):
    """Everything written to rw is on the backend after a final FLUSH."""
    w.handle("rw").flush()
    w.check_backend("rw", "final")
    w.check_read("rw", 0, RW_SIZE, "final read")


TESTS = [t_negotiated, t_pread_pwrite, t_flush_backend, t_fua, t_many_in_flight,
         t_structured_holes, t_block_status, t_cache, t_multi_conn, t_readonly,
         t_out_of_range, t_zero_length_read, t_random_ops, t_final_backend]


def unflushed_writes(d, w):
    """Unflushed writes (the daemon is then stopped with SIGTERM)."""
    r = random.Random(17)
    h = connect(d, "rw", meta=False)
    for off, n in ((2 * MIB + 5, 300000), (RW_SIZE - 70000, 70000), (7, 4096)):
        data = r.randbytes(n)
        h.pwrite(data, off)
        w.models["rw"][off:off + n] = data
    h.zero(64 * KIB, 11 * MIB)
    w.models["rw"][11 * MIB:11 * MIB + 64 * KIB] = bytes(64 * KIB)
    h.shutdown()


def main():
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    with nbdtest.tempdir() as tmp:
        files = {n: os.path.join(tmp, n + ".img") for n in ("rw", "layout", "mc", "ro", "small")}
        nbdtest.random_file(files["rw"], RW_SIZE, seed=1)
        nbdtest.random_file(files["small"], SMALL_SIZE, seed=2)
        nbdtest.random_file(files["ro"], SMALL_SIZE, seed=3)
        nbdtest.sparse_file(files["mc"], MC_SIZE)
        nbdtest.data_runs_file(files["layout"], LAYOUT_SIZE,
                               [(s, e - s) for s, e, data in LAYOUT if data], seed=4)
        exports = [("rw", files["rw"], ""), ("layout", files["layout"], ""),
                   ("mc", files["mc"], ""), ("ro", files["ro"], "readonly"),
                   ("small", files["small"], "")]
        with nbdtest.Daemon(exports, threads=4) as d:
            w = World(d, files)
            for t in TESTS:
                if not checks.run(t.__name__, t, w):
                    # a broken handle must not poison the next check
                    w.h = {}
                nbdtest.check(d.alive(), "daemon died during %s" % t.__name__)
            # Unflushed writes, then SIGTERM: shutdown writes everything back.
            checks.run("unflushed writes before SIGTERM", unflushed_writes, d, w,
                       catch=(nbd.Error,))
            for h in w.h.values():
                try:
                    h.shutdown()
                except nbd.Error:
                    pass
            checks.dump_log(d)
        # The daemon has exited (0) on SIGTERM: the backend holds every byte.
        checks.run("backend after SIGTERM", w.check_backend, "rw",
                   "after SIGTERM with unflushed writes", catch=(Failed,))
    checks.finish("libnbd")


if __name__ == "__main__":
    main()
