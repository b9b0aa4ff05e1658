#!/usr/bin/python3
"""nbd_backend: exports served from another NBD server (nbdkit on a Unix socket).

Every backend is an nbdkit started here in the foreground (-f -U SOCK -P
PIDFILE), reached by the daemon as nbd+unix:///?socket=SOCK, and stopped
by its PID. nbdkit's memory plugin shares its data between connections,
so a separate libnbd handle straight to nbdkit ("direct") shows what
really reached the backend.

  a  round trips (writeback, writethrough, none; 64 MiB memory backend,
     three connections over Unix and TCP): seeded unaligned writes, async
     writes in flight on all connections, zero, trim, each read back on
     another connection; FUA writes are in the backend at once; in
     writethrough/none every write is in the backend before FLUSH; after
     FLUSH and again after SIGTERM the whole backend equals the model
  a+ what the export advertises against what the backend offers: the
     size and read-only flag exactly, every capability of the backend;
     a capability the backend lacks (nozero, no FUA, nocache, no
     multi-conn, no structured replies) that the export still advertises
     must work (write-zeroes emulated by writing zeros, FUA reaches the
     backend, FAST_ZERO succeeds or says ENOTSUP); a read-only backend
     answers a write with EPERM; an odd-sized backend (10000005 bytes):
     the last, partial, cache block is written, read back and flushed
  b  slow disk (delay filter, 5 ms per read and write): a cold sequential
     read of 8 MiB in 32 KiB requests, then a warm one that sends not one
     read to the backend (stats), both byte-exact (their times logged)
  c  backend errors (error filter, switched by error files): writethrough
     and none writes fail with the backend's errno (EIO, ENOSPC) while the
     file exists and succeed after; in writeback (--dirty-expire 1) writes
     succeed, FLUSH and FUA writes fail with EIO, the data stays readable
     and dirty, and once the file is gone FLUSH succeeds and the backend
     holds every byte; reads that miss fail with EIO in none and writeback
     mode, a cached range still reads in writeback mode
  d  outage: writeback, --dirty-expire 3600: dirty data, the backend
     killed (SIGKILL by PID), the cached data still reads, a read that
     misses waits (it completes, as zeros, once a new empty nbdkit listens
     on the same socket), FLUSH then succeeds (within 30 s: the daemon
     tries to connect at least every 5 s) and the new backend holds the
     data; the log says "backend connection lost" and "backend
     reconnected" exactly once each. With --backend-timeout 2 and the
     backend down a read that misses fails with EIO, no sooner than 1.5 s
     and within 20 s (10 x the timeout), cached data still reads, and the
     daemon stays up; SIGTERM then ends it (exit 0 within 20 s: nothing was
     ever written, so nothing is dirty).

Seeds are fixed (printed). Every check runs; the failures are listed at
the end. Environment: NBDKIT (default "nbdkit").
"""

import errno
import os
import random
import shutil
import signal
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import (Failed, expect_nbd_error, log, require, require_same,  # noqa: E402
                     running_daemon)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
SEED = 5150
NBDKIT = os.environ.get("NBDKIT", "nbdkit")
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect
PEERS = []          # every nbdkit started here, stopped by PID at the end

LOST = "backend connection lost"
RECONNECTED = "backend reconnected"


# ---- nbdkit peers and the daemon ----

class Nbdkit(nbdtest.Nbdkit):
    """An nbdkit stopped with the others at the end (PEERS)."""

    def __init__(self, tmp, name, args, sock=None):
        super().__init__(tmp, name, args, sock=sock, peers=PEERS)


def stop_peers():
    for p in PEERS:
        p.stop()
    del PEERS[:]


def read_all(h, size, chunk=4 * MIB):
    out = bytearray()
    for off in range(0, size, chunk):
        out += h.pread(min(chunk, size - off), off)
    return out


def count_lines(d, text):
    return sum(1 for ln in d.log_text().splitlines() if text in ln)


def wait_log(d, text, timeout):
    """True once `text` is in the daemon's log (polled for `timeout` s)."""
    deadline = time.time() + timeout
    for _ in range(100000):
        if text in d.log_text():
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return False


def alive(d, when):
    require(d.alive(), "the daemon died (%s)" % when)


# ---- a: round trips ----

WRITE_SIZES = (1, 7, 511, 4096, 4097, 65536, 131075, MIB, MIB + 513)


def pick_write(r, size=SIZE):
    n = r.choice(WRITE_SIZES)
    off = r.randrange(0, size - n + 1)
    if r.random() < 0.4:
        off -= off % 4096
    return off, n


def roundtrip(mode, seed):
    log("  mode %s, seed %d" % (mode, seed))
    r = random.Random(seed)
    model = bytearray(SIZE)
    with nbdtest.tempdir() as tmp:
        kit = Nbdkit(tmp, "mem-" + mode, ["memory", "size=%d" % SIZE])
        try:
            with running_daemon([("disk", kit.uri(), "cache-mode=" + mode)],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600"]) as d:
                hs = [nbdtest.libnbd_handle(d.unix_uri("disk")),
                      nbdtest.libnbd_handle(d.tcp_uri("disk")),
                      nbdtest.libnbd_handle(d.unix_uri("disk"))]
                direct = kit.handle()
                try:
                    roundtrip_ops(mode, r, model, d, hs, direct)
                finally:
                    nbdtest.shutdown_all(hs)
            # SIGTERM: exit 0 (running_daemon); everything written back.
            require_same(read_all(direct, SIZE), model,
                         "%s: backend (direct) after the daemon's SIGTERM" % mode)
            nbdtest.shutdown_all([direct])
        finally:
            kit.stop()


def roundtrip_ops(mode, r, model, d, hs, direct):
    h0 = hs[0]
    require(h0.get_size() == SIZE, "%s: export size %d, backend %d" % (mode, h0.get_size(), SIZE))
    for k in range(36):
        off, n = pick_write(r)
        data = r.randbytes(n)
        fua = k % 9 == 8
        hs[k % 3].pwrite(data, off, nbd.CMD_FLAG_FUA if fua else 0)
        model[off:off + n] = data
        if fua:
            require_same(direct.pread(n, off), data,
                         "%s: backend (direct) right after FUA write #%d [%d,+%d)"
                         % (mode, k, off, n), base=off)
        lo, hi = max(0, off - 1000), min(SIZE, off + n + 1000)
        require_same(hs[(k + 1) % 3].pread(hi - lo, lo), model[lo:hi],
                     "%s: read back of write #%d [%d,+%d) on conn %d"
                     % (mode, k, off, n, (k + 1) % 3), base=lo)
    # Async writes in flight on every connection at once, disjoint ranges.
    pending, taken = [], []
    for _ in range(200):
        if len(pending) >= 12:
            break
        off, n = pick_write(r)
        if any(off < e and s < off + n for s, e in taken):
            continue
        taken.append((off, off + n))
        data = r.randbytes(n)
        h = hs[len(pending) % 3]
        pending.append((h, h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), off)))
        model[off:off + n] = data
    nbdtest.aio_wait(pending, timeout=60)
    # Zero and trim (nbdkit memory reads trimmed bytes as zeros).
    for k, kind in enumerate(("zero", "trim", "zero")):
        off, n = pick_write(r)
        n = max(n, 4096)
        n = min(n, SIZE - off)
        if kind == "zero":
            hs[k % 3].zero(n, off, nbd.CMD_FLAG_NO_HOLE if k else 0)
        else:
            hs[k % 3].trim(n, off)
        model[off:off + n] = bytes(n)
        lo, hi = max(0, off - 5000), min(SIZE, off + n + 5000)
        require_same(hs[(k + 2) % 3].pread(hi - lo, lo), model[lo:hi],
                     "%s: read back of the %s [%d,+%d)" % (mode, kind, off, n), base=lo)
    before = read_all(direct, SIZE)
    if mode in ("writethrough", "none"):
        require_same(before, model, "%s: backend (direct) before any FLUSH: every write "
                     "must have reached it" % mode)
    else:
        log("  writeback: %s of the data in the backend before FLUSH"
            % ("all" if before == model else "not all"))
    hs[1].flush()
    require_same(read_all(direct, SIZE), model, "%s: backend (direct) after FLUSH" % mode)
    require_same(read_all(hs[2], SIZE), model, "%s: full read through the daemon" % mode)
    alive(d, mode)


def check_roundtrips():
    for k, mode in enumerate(("writeback", "writethrough", "none")):
        CHECKS.run("a round trip, cache-mode=%s" % mode, roundtrip, mode, SEED + k)


# ---- a+: what the export advertises ----

CAPS = ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_cache",
        "can_multi_conn")


def caps_of(h):
    c = {cap: bool(getattr(h, cap)()) for cap in CAPS}
    c["base:allocation"] = bool(h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION))
    return c


def advertised(name, args, size):
    with nbdtest.tempdir() as tmp:
        kit = Nbdkit(tmp, name, args)
        try:
            with running_daemon([("x", kit.uri(), "cache-mode=writethrough")],
                                extra=["--cache-size", "64M"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("x"), meta=True)
                h2 = nbdtest.libnbd_handle(d.tcp_uri("x"), meta=True)
                direct = kit.handle(meta=True)
                try:
                    advertised_checks(name, size, d, h, h2, direct)
                finally:
                    nbdtest.shutdown_all([h, h2, direct])
        finally:
            kit.stop()


def advertised_checks(name, size, d, h, h2, direct):
    require(direct.get_size() == size, "test setup: nbdkit %s has %d bytes" % (name, size))
    expect(h.get_size() == size, "%s: export size %d, backend %d" % (name, h.get_size(), size))
    ro, back_ro = bool(h.is_read_only()), bool(direct.is_read_only())
    expect(ro == back_ro, "%s: export read-only %s, backend read-only %s" % (name, ro, back_ro))
    mine, theirs = caps_of(h), caps_of(direct)
    log("  backend: %s" % " ".join("%s=%d" % kv for kv in sorted(theirs.items())))
    log("  export:  %s" % " ".join("%s=%d" % kv for kv in sorted(mine.items())))
    for cap in sorted(theirs):
        if cap in ("can_trim", "can_zero", "can_fast_zero") and back_ro:
            continue            # nothing to write on a read-only export
        expect(mine[cap] or not theirs[cap],
               "%s: the backend offers %s, the export does not" % (name, cap))
    extra = sorted(c for c in mine if mine[c] and not theirs[c])
    if extra:
        log("  advertised although the backend lacks it (checked below): %s" % ", ".join(extra))
    if back_ro:
        h.set_strict_mode(0)       # let the server, not libnbd, refuse the write
        expect_nbd_error(lambda: h.pwrite(b"x" * 4096, 0), errno.EPERM,
                         "%s: write to the read-only export" % name)
        require_same(h.pread(65536, 0), bytes(65536), "%s: read of the read-only export" % name)
        return
    r = random.Random(SEED + 77)
    off = 3 * MIB + 123
    data = r.randbytes(256 * KIB)
    h.pwrite(data, off)
    require_same(direct.pread(len(data), off), data, "%s: backend after a writethrough write"
                 % name, base=off)
    if mine["can_zero"]:
        h.zero(100 * KIB, off + 1000)
        want = bytearray(data)
        want[1000:1000 + 100 * KIB] = bytes(100 * KIB)
        require_same(direct.pread(len(data), off), want, "%s: backend after WRITE_ZEROES%s"
                     % (name, "" if theirs["can_zero"] else " (emulated: zeros written)"),
                     base=off)
        data = bytes(want)
    if mine["can_fast_zero"]:
        try:
            h.zero(8 * KIB, off + 200 * KIB, nbd.CMD_FLAG_FAST_ZERO)
            want = bytearray(data)
            want[200 * KIB:208 * KIB] = bytes(8 * KIB)
            data = bytes(want)
            log("  FAST_ZERO succeeded (backend fast zero %d)" % theirs["can_fast_zero"])
        except nbd.Error as e:
            require(e.errnum == errno.ENOTSUP, "%s: FAST_ZERO failed with %s, expected "
                    "success or ENOTSUP" % (name, e.string))
            log("  FAST_ZERO: ENOTSUP (backend fast zero %d)" % theirs["can_fast_zero"])
        require_same(direct.pread(len(data), off), data, "%s: backend after FAST_ZERO" % name,
                     base=off)
    if mine["can_fua"]:
        fdata = r.randbytes(20000)
        h.pwrite(fdata, 7 * MIB + 5, nbd.CMD_FLAG_FUA)
        require_same(direct.pread(len(fdata), 7 * MIB + 5), fdata,
                     "%s: backend right after a FUA write" % name, base=7 * MIB + 5)
    if mine["can_cache"]:
        h.cache(MIB, 0)
    if mine["can_flush"]:
        h.flush()
    if mine["can_multi_conn"]:
        mdata = r.randbytes(5000)
        h.pwrite(mdata, 9 * MIB + 1)
        h.flush()
        require_same(h2.pread(len(mdata), 9 * MIB + 1), mdata,
                     "%s: multi-conn: a write on one connection read on another" % name)
    if mine["base:allocation"]:
        segs = nbdtest.block_status_map(h, 0, size)
        log("  block status: %s" % segs[:8])
        for s, e, f in segs:
            expect(not (f & 1 and s < off + 100 and e > off),
                   "%s: block status says hole over written data at %d" % (name, off))


def check_advertised():
    variants = (
        ("full", ["memory", "size=%d" % SIZE], SIZE),
        ("odd-size", ["memory", "size=10000005"], 10000005),
        ("read-only", ["-r", "memory", "size=%d" % MIB], MIB),
        ("limited", ["--no-sr", "--filter=nozero", "--filter=fua", "--filter=nocache",
                     "--filter=multi-conn", "memory", "size=%d" % (16 * MIB), "zeromode=none",
                     "cachemode=none", "multi-conn-mode=disable"], 16 * MIB),
    )
    for name, args, size in variants:
        CHECKS.run("a+ advertised flags, backend %s" % name, advertised, name, args, size)


def odd_size_tail():
    """A backend whose size is not a multiple of the cache block: the last
    partial block is written and read back, and reaches the backend."""
    size = 10000005
    with nbdtest.tempdir() as tmp:
        kit = Nbdkit(tmp, "odd", ["memory", "size=%d" % size])
        try:
            with running_daemon([("x", kit.uri(), "")], extra=["--cache-size", "16M"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("x"))
                direct = kit.handle()
                data = random.Random(SEED + 5).randbytes(10000)
                h.pwrite(data, size - len(data))
                h.pwrite(b"\x5a", size - 1)
                want = data[:-1] + b"\x5a"
                require_same(h.pread(len(want), size - len(want)), want,
                             "odd size: read back of the last 10000 bytes",
                             base=size - len(want))
                h.flush()
                require_same(direct.pread(len(want), size - len(want)), want,
                             "odd size: backend after FLUSH", base=size - len(want))
                nbdtest.shutdown_all([h, direct])
                alive(d, "odd size")
        finally:
            kit.stop()


# ---- b: slow disk ----

def slow_disk():
    n, chunk = 8 * MIB, 32 * KIB
    data = random.Random(SEED + 10).randbytes(n)
    with nbdtest.tempdir() as tmp:
        kit = Nbdkit(tmp, "slow", ["--filter=delay", "memory", "size=%d" % SIZE,
                                   "rdelay=5ms", "wdelay=5ms"])
        try:
            direct = kit.handle()
            for off in range(0, n, MIB):
                direct.pwrite(data[off:off + MIB], MIB + off)
            nbdtest.shutdown_all([direct])
            with running_daemon([("slow", kit.uri(), "")], extra=["--cache-size", "64M"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("slow"))
                times, backend = [], []
                for label in ("cold", "warm"):
                    got = bytearray()
                    t0 = time.monotonic()
                    for off in range(0, n, chunk):
                        got += h.pread(chunk, MIB + off)
                    times.append(time.monotonic() - t0)
                    log("  %s read of 8 MiB in 32 KiB requests: %.3f s" % (label, times[-1]))
                    require_same(got, data, "%s read" % label, base=MIB)
                    st = nbdtest.stats(d)
                    backend.append(st["backend_reads"])
                    log("  stats: hits=%d misses=%d backend_reads=%d" %
                        (st["hits"], st["misses"], st["backend_reads"]))
                nbdtest.shutdown_all([h])
                # From the cache: not one backend read. That is the check;
                # the times are logged, not compared (readahead makes the
                # cold read only about 0.1 s, so a load spike of 50 ms in
                # the warm one would have failed "under half of the cold";
                # under ASan the warm read took 0.023-0.033 s of it).
                expect(backend[0] > 0, "the cold read sent no read to the backend (test "
                       "setup)")
                expect(backend[1] == backend[0], "the warm read sent %d reads to the backend"
                       % (backend[1] - backend[0]))
        finally:
            kit.stop()


# ---- c: backend errors ----

def errno_passthrough():
    """Writethrough and none writes carry the backend's errno (EIO, ENOSPC)."""
    with nbdtest.tempdir() as tmp:
        kits, exports, files = {}, [], {}
        try:
            for ename in ("EIO", "ENOSPC"):
                files[ename] = os.path.join(tmp, "fail-" + ename)
                # A server per mode: exports over one backend share one
                # cache export, and so one cache mode.
                for mode in ("writethrough", "none"):
                    name = "%s-%s" % (ename.lower(), mode)
                    kits[name] = Nbdkit(tmp, name, [
                        "--filter=error", "memory", "size=%d" % SIZE, "error=" + ename,
                        "error-pwrite-rate=1", "error-pwrite-file=" + files[ename]])
                    exports.append((name, kits[name].uri(), "cache-mode=" + mode))
            with running_daemon(exports, extra=["--cache-size", "64M"]) as d:
                r = random.Random(SEED + 20)
                for k, (name, _, _) in enumerate(exports):
                    ename = name.split("-")[0].upper()
                    h = nbdtest.libnbd_handle(d.unix_uri(name))
                    direct = kits[name].handle()
                    off = (k % 2) * 16 * MIB + 12345        # disjoint per export
                    old, new = r.randbytes(70000), r.randbytes(70000)
                    h.pwrite(old, off)
                    open(files[ename], "w").close()
                    try:
                        for fua in (0, nbd.CMD_FLAG_FUA):
                            expect_nbd_error(lambda: h.pwrite(new, off, fua),
                                             getattr(errno, ename),
                                             "%s: write%s with %s injected" %
                                             (name, " (FUA)" if fua else "", ename))
                        alive(d, "%s: after the failed writes" % name)
                    finally:
                        os.unlink(files[ename])
                    h.pwrite(new, off)
                    require_same(h.pread(len(new), off), new,
                                 "%s: read back after the fault went away" % name, base=off)
                    require_same(direct.pread(len(new), off), new,
                                 "%s: backend after the fault went away" % name, base=off)
                    h.flush()
                    nbdtest.shutdown_all([h, direct])
                alive(d, "after the errno checks")
        finally:
            for kit in kits.values():
                kit.stop()


def writeback_fault():
    """Writeback: a failing backend keeps the data dirty, FLUSH says EIO."""
    with nbdtest.tempdir() as tmp:
        efile = os.path.join(tmp, "fail-pwrite")
        kit = Nbdkit(tmp, "wb-err", ["--filter=error", "memory", "size=%d" % SIZE, "error=EIO",
                                     "error-pwrite-rate=1", "error-pwrite-file=" + efile])
        try:
            with running_daemon([("wb", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "1"]) as d:
                hs = [nbdtest.libnbd_handle(d.unix_uri("wb")),
                      nbdtest.libnbd_handle(d.tcp_uri("wb"))]
                direct = kit.handle()
                try:
                    writeback_fault_steps(d, hs, direct, efile)
                finally:
                    if os.path.exists(efile):
                        os.unlink(efile)      # never leave the daemon a failing backend
                    nbdtest.shutdown_all(hs + [direct])
        finally:
            kit.stop()


def writeback_fault_steps(d, hs, direct, efile):
    r = random.Random(SEED + 30)
    model = bytearray(4 * MIB)
    open(efile, "w").close()
    for k in range(16):
        off = k * 240 * KIB + 77 * k
        data = r.randbytes(64 * KIB)
        hs[k % 2].pwrite(data, off)
        model[off:off + len(data)] = data

    def reads(when):
        for c, h in enumerate(hs):
            require_same(h.pread(len(model), 0), model, "writeback: %s: read on conn %d"
                         % (when, c))

    reads("writes absorbed while the backend fails")
    expect_nbd_error(hs[0].flush, errno.EIO, "writeback: FLUSH while the backend fails")
    expect_nbd_error(lambda: hs[1].pwrite(b"\x11" * 4096, 5 * MIB, nbd.CMD_FLAG_FUA),
                     errno.EIO, "writeback: FUA write while the backend fails")
    time.sleep(2.5)             # --dirty-expire 1: the background writeback fails too
    reads("2.5 s later")
    st = nbdtest.stats(d)
    log("  stats: writeback_errors=%d dirty_bytes=%d" % (st["writeback_errors"],
                                                        st["dirty_bytes"]))
    expect(st["writeback_errors"] > 0, "writeback: writeback_errors is 0 after failed writebacks")
    expect(st["dirty_bytes"] > 0, "writeback: dirty_bytes is 0 while nothing could be written")
    expect_nbd_error(hs[1].flush, errno.EIO, "writeback: second FLUSH while the backend fails")
    alive(d, "while the backend fails")
    os.unlink(efile)
    errors = []
    for attempt in range(3):
        try:
            hs[0].flush()
            break
        except nbd.Error as e:
            errors.append(e.string)
            log("  FLUSH %d after the fault went away failed: %s" % (attempt + 1, e.string))
    else:
        raise Failed("writeback: FLUSH fails after the fault went away: %s" % "; ".join(errors))
    require_same(direct.pread(len(model), 0), model, "writeback: backend (direct) after FLUSH")
    st = nbdtest.stats(d)
    expect(st["dirty_bytes"] == 0, "writeback: dirty_bytes %d after a successful FLUSH"
           % st["dirty_bytes"])
    reads("after recovery")


def read_faults():
    """Reads that miss carry the backend's EIO; cached data does not need it."""
    with nbdtest.tempdir() as tmp:
        efile = os.path.join(tmp, "fail-pread")
        # Two servers failing on the same file: exports over one backend
        # share one cache export, and so one cache mode.
        kits = [Nbdkit(tmp, name, ["--filter=error", "memory", "size=%d" % SIZE, "error=EIO",
                                   "error-pread-rate=1", "error-pread-file=" + efile])
                for name in ("rd-err", "rd-err-none")]
        kit, kit_none = kits
        try:
            data = random.Random(SEED + 40).randbytes(2 * MIB)
            base = 8 * MIB + 4321
            direct = kit.handle()
            direct.pwrite(data, base)
            direct_none = kit_none.handle()
            direct_none.pwrite(data, base)
            with running_daemon([("none", kit_none.uri(), "cache-mode=none"),
                                 ("wb", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M"]) as d:
                hn = nbdtest.libnbd_handle(d.unix_uri("none"))
                hw = nbdtest.libnbd_handle(d.unix_uri("wb"))
                try:
                    open(efile, "w").close()
                    expect_nbd_error(lambda: hn.pread(MIB, base), errno.EIO,
                                     "cache-mode=none: read with EIO injected")
                    expect_nbd_error(lambda: hw.pread(MIB, base), errno.EIO,
                                     "writeback: read that misses with EIO injected")
                    alive(d, "after the failed reads")
                    os.unlink(efile)
                    require_same(hn.pread(len(data), base), data,
                                 "cache-mode=none: read after the fault went away", base=base)
                    require_same(hw.pread(len(data), base), data,
                                 "writeback: read after the fault went away", base=base)
                    open(efile, "w").close()
                    require_same(hw.pread(len(data), base), data,
                                 "writeback: cached read while the backend fails", base=base)
                    expect_nbd_error(lambda: hn.pread(4096, base), errno.EIO,
                                     "cache-mode=none: read with EIO injected again")
                finally:
                    if os.path.exists(efile):
                        os.unlink(efile)
                    nbdtest.shutdown_all([hn, hw, direct, direct_none])
                alive(d, "after the read faults")
        finally:
            for k in kits:
                k.stop()


# ---- d: outage ----

def outage_reconnect():
    with nbdtest.tempdir() as tmp:
        sock = os.path.join(tmp, "backend.sock")
        kit = Nbdkit(tmp, "outage1", ["memory", "size=%d" % SIZE], sock=sock)
        try:
            with running_daemon([("wb", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600"]) as d:
                hs = [nbdtest.libnbd_handle(d.unix_uri("wb")),
                      nbdtest.libnbd_handle(d.tcp_uri("wb"))]
                try:
                    kit = outage_steps(d, hs, tmp, sock, kit)
                finally:
                    nbdtest.shutdown_all(hs)
        finally:
            kit.stop()


# How long the outage check waits for the daemon to be back on the new
# backend: six times the longest back-off between connection attempts
# (NBD_BACKOFF_MAX_MS, 5 s).
RECOVER = 30


def outage_steps(d, hs, tmp, sock, kit):
    r = random.Random(SEED + 50)
    runs = []
    for k in range(12):
        off, n = k * 5 * MIB + r.randrange(0, MIB), r.randrange(1, 256 * KIB)
        data = r.randbytes(n)
        hs[k % 2].pwrite(data, off)
        runs.append((off, data))
    st = nbdtest.stats(d)
    expect(st["dirty_bytes"] > 0, "outage: no dirty data before the backend goes away")
    kit.kill(signal.SIGKILL)
    if not wait_log(d, LOST, 10):
        CHECKS.add("outage: no '%s' in the log within 10 s of killing the backend" % LOST)
    for off, data in runs[:4]:
        require_same(hs[1].pread(len(data), off), data,
                     "outage: cached dirty data read while the backend is down", base=off)
    alive(d, "with the backend down")
    # A read that misses waits for the backend (--backend-timeout 30).
    wbuf = nbd.Buffer(64 * KIB)
    waiting = hs[1].aio_pread(wbuf, 62 * MIB + 4321)
    time.sleep(0.5)
    require(not hs[1].aio_command_completed(waiting),
            "outage: a read that misses completed while the backend was down")
    kit = Nbdkit(tmp, "outage2", ["memory", "size=%d" % SIZE], sock=sock)   # empty
    t0 = time.monotonic()
    try:
        nbdtest.aio_wait([(hs[1], waiting)], timeout=RECOVER)
    except nbd.Error as e:
        raise Failed("outage: a read that waited for the backend failed %.1f s after it "
                     "came back: %s" % (time.monotonic() - t0, e.string))
    log("  the waiting read completed %.2f s after the restart" % (time.monotonic() - t0))
    require_same(wbuf.to_bytearray(), bytes(64 * KIB),
                 "outage: the read that waited (the new backend is empty)", base=62 * MIB + 4321)
    try:
        hs[0].flush()
    except nbd.Error as e:
        raise Failed("outage: FLUSH after the new backend started failed after %.1f s: %s"
                     % (time.monotonic() - t0, e.string))
    took = time.monotonic() - t0
    log("  FLUSH after the restart took %.2f s" % took)
    expect(took < RECOVER, "outage: FLUSH took %.1f s after the backend came back (the daemon "
           "tries to connect at least every 5 s)" % took)
    direct = kit.handle()
    want = nbdtest.model_bytes(runs, 0, SIZE)
    require_same(read_all(direct, SIZE), want, "outage: the new backend after FLUSH")
    nbdtest.shutdown_all([direct])
    wait_log(d, RECONNECTED, 5)
    lost, back = count_lines(d, LOST), count_lines(d, RECONNECTED)
    expect(lost == 1, "outage: %d '%s' lines in the log, expected 1" % (lost, LOST))
    expect(back == 1, "outage: %d '%s' lines in the log, expected 1" % (back, RECONNECTED))
    alive(d, "after the reconnect")
    return kit


def outage_timeout(state):
    """The backend goes down for good: a read that misses fails with EIO
    after --backend-timeout; the daemon is left running (state) for
    stop_with_backend_down()."""
    tmp = state["tmp"] = tempfile.mkdtemp(prefix="nbdcached-test-")
    kit = Nbdkit(tmp, "down", ["memory", "size=%d" % SIZE])
    data = random.Random(SEED + 60).randbytes(MIB)
    direct = kit.handle()
    direct.pwrite(data, 0)
    nbdtest.shutdown_all([direct])
    d = state["daemon"] = nbdtest.CheckedDaemon(
        [("wb", kit.uri(), "")], extra=["--cache-size", "64M", "--backend-timeout", "2"])
    h = nbdtest.libnbd_handle(d.unix_uri("wb"))
    try:
        require_same(h.pread(MIB, 0), data, "timeout: read before the outage")
        kit.kill(signal.SIGKILL)
        state["down"] = True
        if not wait_log(d, LOST, 10):
            CHECKS.add("timeout: no '%s' in the log within 10 s" % LOST)
        t0 = time.monotonic()
        # Asynchronous, waited for 10 x the timeout: one never answered is
        # a failure, not a hang.
        expect_nbd_error(lambda: nbdtest.aio_wait(
            [(h, h.aio_pread(nbd.Buffer(64 * KIB), 32 * MIB))], timeout=10 * 2),
            errno.EIO, "timeout: read that misses with the backend down")
        took = time.monotonic() - t0
        log("  the read failed after %.2f s (--backend-timeout 2)" % took)
        # No sooner than the timeout (it waits for a connection that long).
        expect(took >= 1.5, "timeout: the read failed after %.2f s, before --backend-timeout 2"
               % took)
        alive(d, "after the timed-out read")
        require_same(h.pread(MIB, 0), data, "timeout: cached read with the backend down")
        nbdtest.stats(d)
        expect(count_lines(d, LOST) == 1, "timeout: %d '%s' lines, expected 1"
               % (count_lines(d, LOST), LOST))
        expect(count_lines(d, RECONNECTED) == 0, "timeout: '%s' logged while the backend "
               "is down" % RECONNECTED)
    finally:
        nbdtest.shutdown_all([h])
    alive(d, "with the backend still down")


def stop_with_backend_down(state):
    """Nothing was ever written through the daemon, so nothing is dirty:
    SIGTERM must end it (exit 0) although the backend is gone."""
    try:
        state["daemon"].stop(timeout=10 * 2)
    except SystemExit:
        raise Failed("nbdcached did not exit 0 within 20 s (10 x --backend-timeout) of SIGTERM "
                     "with the backend down and nothing dirty (its log is above)")


def check_outage_timeout():
    state = {}
    try:
        CHECKS.run("d outage: --backend-timeout 2 fails a read with EIO", outage_timeout, state)
        if state.get("down") and state["daemon"].alive():
            CHECKS.run("d outage: SIGTERM with the backend down and nothing dirty",
                       stop_with_backend_down, state)
    finally:
        d = state.get("daemon")
        if d is not None:
            if d.alive():
                d.kill()
                d.dump_log()
            if not d.logf.closed:
                d.logf.close()
            shutil.rmtree(d.tmp, ignore_errors=True)
        if "tmp" in state:
            shutil.rmtree(state["tmp"], ignore_errors=True)


def main():
    if shutil.which(NBDKIT) is None:
        nbdtest.fail("%s not found (install nbdkit)" % NBDKIT)
    log("seed %d" % SEED)
    t0 = time.time()
    try:
        check_roundtrips()
        check_advertised()
        CHECKS.run("a+ odd-sized backend: the last partial block", odd_size_tail)
        CHECKS.run("b slow disk: warm reads from the cache", slow_disk)
        CHECKS.run("c writethrough/none writes carry EIO and ENOSPC", errno_passthrough)
        CHECKS.run("c writeback: failing backend keeps data dirty", writeback_fault)
        CHECKS.run("c reads that miss carry EIO", read_faults)
        CHECKS.run("d outage: reconnect, dirty data written to the new backend",
                   outage_reconnect)
        check_outage_timeout()
    finally:
        stop_peers()
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("NBD backend")


if __name__ == "__main__":
    main()
