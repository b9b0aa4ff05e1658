#!/usr/bin/python3
"""cache_races: regression tests for races in the block cache found in review.

Every request waits at most a deadline: a request not answered in time is a
failure (the daemon is then killed by PID), so a hang fails the test rather
than stalling it. The backend files live on a disk file system (the first of
$TMPDIR or /tmp, $BUILD, /var/tmp that is not tmpfs): on tmpfs every backend
I/O completes inline and these races need I/O in flight.

  flush-during-writeback  --dirty-high 0 keeps the writeback thread busy
        with up to 64 writes in flight; 64 async 4 KiB writes at scattered
        offsets of a 1 GiB sparse file, then a FLUSH, over and over (400
        times or 25 s). A FLUSH finding entries under background writeback
        waits for them; a completion woke it and advanced it again, so it
        got on the wait queue twice and the writeback thread spun forever.
        Each FLUSH must be answered within 20 s and leave the 64 writes in
        the backend file.
  bypass-with-busy-block  seq-cutoff=4K, connection B a sequential stream.
        For each X: X evicted from the page cache, X+4K read into it; A reads
        [X, +4K) (a cache fill through io_uring) while B reads [X, +8K): X
        waits for A's fill, X+4K bypasses the cache and completes inline,
        which re-ran B's request inside itself and registered it twice on
        the wait queue. 1500 times or 20 s; each pair within 10 s, bytes
        right, and bypass_reads shows B's reads did bypass.
  block-status-req-one    4 KiB dirty at 8192 in an empty file: REQ_ONE
        block status from 0, 4096 and 8192 must not report a hole over it
        (the one-extent reply used to grow its hole over the dirty data).
  block-status-many-extents  600 4 KiB data runs 16 KiB apart (more
        extents than one reply holds, 512), dirty 4 KiB in the holes between
        some of them (near the start and around the 512th extent): no hole
        reported may hold a non-zero byte, dirty or on the backend.
  model   seeded random pread / pwrite (20% FUA) / zero / trim / flush /
        cache, 1 byte to 300 KB, on 3 connections, export sizes that are
        not multiples of the block size, block sizes 512 / 4096 / 65536,
        writeback / writethrough / writearound, 1-2 MiB caches (one 64 MiB):
        reads equal a byte model; after SIGTERM the backend file does too.
        3000 ops per run, 30 s for all runs.

Seeds are fixed (printed); CACHE_RACES_SEED changes the base seed and
CACHE_RACES_ONLY runs only the parts whose name contains it.
CACHE_RACES_WB_ITERATIONS (flush-during-writeback's rounds, default 400)
and CACHE_RACES_MODEL_OPS (ops per model run, default 3000) repeat less
(make asan and make i386: SHORT_REPEATS in the Makefile).
"""

import collections
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, read_at, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SEED = int(os.environ.get("CACHE_RACES_SEED", "20261203"))
ONLY = os.environ.get("CACHE_RACES_ONLY", "")
DEADLINE = 20              # seconds for any request
HOLE = nbd.STATE_HOLE

WB_SIZE, WB_SECONDS, WB_BATCH = 1 << 30, 25, 64
WB_ITERATIONS = int(os.environ.get("CACHE_RACES_WB_ITERATIONS", "400"))
BP_SIZE, BP_ITERATIONS, BP_SECONDS, BP_DEADLINE = 12 * MIB + 16 * KIB, 1500, 20, 10
RUN, RUNS = 16 * KIB, 600          # block-status-many-extents: data every RUN bytes
DIRTY_HOLES = (1, 2) + tuple(range(248, 264))
MODEL_OPS = int(os.environ.get("CACHE_RACES_MODEL_OPS", "3000"))
MODEL_SECONDS = 30
MODEL_CONFIGS = (  # export size, block size, cache mode, cache size
    (100000, 512, "writeback", "1M"),
    (1000003, 4096, "writeback", "1M"),
    (777777, 65536, "writeback", "2M"),
    (1234567, 4096, "writethrough", "1M"),
    (3333333, 65536, "writethrough", "2M"),
    (999999, 512, "writearound", "1M"),
    (5000000, 4096, "writeback", "64M"),
)


def disk_dir():
    """A directory on a file system that is not in memory, or None."""
    for d in (tempfile.gettempdir(), os.path.join(nbdtest.TOP, nbdtest.BUILD), "/var/tmp"):
        p = subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True)
        if p.returncode == 0 and p.stdout.strip() not in ("tmpfs", "ramfs"):
            return d
    log("note: no disk file system found; on tmpfs the races are unlikely to show")
    return None


def wait(pending, what, timeout=DEADLINE):
    """Wait for (handle, cookie) pairs; Failed naming `what` on an error or
    when they are not all answered within `timeout` seconds (a hang: the
    daemon is then killed by PID as the Daemon context ends)."""
    t0 = time.time()
    try:
        nbdtest.aio_wait(pending, timeout)
    except (Failed, nbd.Error) as e:
        hang = time.time() - t0 >= timeout
        raise Failed("%s: %s%s" % (what, e, " (hung: the daemon is killed)" if hang else ""))


def flush_during_writeback(base):
    r = random.Random(SEED)
    path = nbdtest.sparse_file(os.path.join(base, "writeback.img"), WB_SIZE)
    slots = WB_SIZE // (64 * KIB)
    extra = ["--cache-size", "64M", "--dirty-expire", "1", "--dirty-high", "0",
             "--dirty-low", "0"]
    with nbdtest.Daemon([("disk", path, "")], threads=2, extra=extra) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        t0 = time.time()
        done = 0
        for it in range(WB_ITERATIONS):
            if time.time() - t0 > WB_SECONDS:
                break
            # 7919 is odd, slots a power of 2: the offsets of a batch differ
            writes = [((it * WB_BATCH + i) * 7919 % slots * 64 * KIB, r.randbytes(4 * KIB))
                      for i in range(WB_BATCH)]
            bufs = [nbd.Buffer.from_bytearray(bytearray(data)) for _, data in writes]
            wait([(h, h.aio_pwrite(b, off)) for b, (off, _) in zip(bufs, writes)],
                 "iteration %d: %d writes" % (it, WB_BATCH))
            wait([(h, h.aio_flush())], "iteration %d: FLUSH during background writeback" % it)
            for off, data in writes:
                require(read_at(path, off, len(data)) == data, "iteration %d: after FLUSH "
                        "the backend file lacks the 4 KiB written at %d" % (it, off))
            done += 1
        log("  %d iterations of %d writes + FLUSH in %.1fs" % (done, WB_BATCH, time.time() - t0))
        h.shutdown()


def bypass_busy_block(base):
    path = nbdtest.random_file(os.path.join(base, "bypass.img"), BP_SIZE, seed=SEED)
    want = read_at(path, 0, BP_SIZE)
    with nbdtest.Daemon([("disk", path, "seq-cutoff=4K")], threads=2,
                        extra=["--cache-size", "64M"]) as d:
        a, b = (nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(2))
        b.pread(8 * KIB, 0)
        b.pread(8 * KIB, 8 * KIB)         # b is a sequential stream from here on
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)    # no readahead past X+4K
            t0 = time.time()
            done = 0
            for it in range(BP_ITERATIONS):
                x = 16 * KIB + it * 8 * KIB
                if x + 8 * KIB > BP_SIZE or time.time() - t0 > BP_SECONDS:
                    break
                os.posix_fadvise(fd, x, 4 * KIB, os.POSIX_FADV_DONTNEED)
                os.pread(fd, 4 * KIB, x + 4 * KIB)
                ba, bb = nbd.Buffer(4 * KIB), nbd.Buffer(8 * KIB)
                wait([(a, a.aio_pread(ba, x)), (b, b.aio_pread(bb, x))],
                     "iteration %d: reads of [%d,+4K) on A and [%d,+8K) on B" % (it, x, x),
                     BP_DEADLINE)
                require_same(ba.to_bytearray(), want[x:x + 4 * KIB],
                             "iteration %d: A's read" % it, base=x)
                require_same(bb.to_bytearray(), want[x:x + 8 * KIB],
                             "iteration %d: B's read" % it, base=x)
                done += 1
        finally:
            os.close(fd)
        log("  %d iterations in %.1fs" % (done, time.time() - t0))
        st = nbdtest.stats(d, keys=nbdtest.CACHE_STATS_KEYS + ("bypass_reads",))
        require(st["bypass_reads"] >= done, "bypass_reads %d after %d iterations: B's reads "
                "did not bypass the cache, the race is not exercised" % (st["bypass_reads"], done))
        nbdtest.shutdown_all([a, b])


def bs_daemon(path):
    extra = ["--cache-size", "64M", "--cache-mode", "writeback", "--dirty-expire", "3600"]
    return nbdtest.Daemon([("disk", path, "")], threads=1, extra=extra)


def block_status_req_one(base):
    path = nbdtest.sparse_file(os.path.join(base, "empty.img"), 16 * MIB)
    data = random.Random(SEED).randbytes(4 * KIB)
    with bs_daemon(path) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"), meta=True)
        h.pwrite(data, 8192)
        for start in (0, 4096, 8192):
            ents = []
            h.block_status(MIB - start, start, lambda ctx, off, e, err: ents.extend(e) or 0,
                           nbd.CMD_FLAG_REQ_ONE)
            require(len(ents) == 2, "REQ_ONE from %d: %d extents %r"
                    % (start, len(ents) // 2, ents))
            end = start + ents[0]
            require(not ents[1] & HOLE or end <= 8192, "REQ_ONE block status from %d reports "
                    "a hole [%d, %d) over the dirty 4 KiB at 8192" % (start, start, end))
        require_same(h.pread(4 * KIB, 8192), data, "read of the dirty 4 KiB", base=8192)
        h.shutdown()


def block_status_many_extents(base):
    r = random.Random(SEED)
    size = RUNS * RUN
    path = nbdtest.data_runs_file(os.path.join(base, "runs.img"), size,
                                  [(i * RUN, 4 * KIB) for i in range(RUNS)], seed=SEED)
    model = bytearray(read_at(path, 0, size))
    dirty = [i * RUN + 8 * KIB for i in DIRTY_HOLES]   # the middle of the 12 KiB hole
    with bs_daemon(path) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"), meta=True)
        for off in dirty:
            model[off:off + 4 * KIB] = r.randbytes(4 * KIB)
            h.pwrite(bytes(model[off:off + 4 * KIB]), off)
        segs = nbdtest.block_status_map(h, 0, size)
        bad = []
        for s, e, f in segs:
            if f & HOLE and model.count(0, s, e) != e - s:
                nz = e - len(bytes(model[s:e]).lstrip(b"\0"))
                covered = [o for o in dirty if s < o + 4 * KIB and o < e]
                bad.append("[%d, %d) holds data from %d on, over %d dirty write(s)%s"
                           % (s, e, nz, len(covered), " at %s" % covered[:3] if covered else ""))
        require(not bad, "%d reported hole(s) are not zero: %s" % (len(bad), "; ".join(bad[:4])))
        h.shutdown()


def model_run(base, k, size, bs, mode, cache, budget):
    seed = SEED + 1 + k
    r = random.Random(seed)
    name = "%s bs %d size %d cache %s" % (mode, bs, size, cache)
    log("  %s: seed %d" % (name, seed))
    path = os.path.join(base, "model%d.img" % k)
    model = bytearray(r.randbytes(size))
    with open(path, "wb") as f:
        f.write(model)
    extra = ["--block-size", str(bs), "--cache-size", cache]
    with nbdtest.Daemon([("disk", path, "cache-mode=" + mode)], threads=2, extra=extra) as d:
        hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(3)]
        trace = collections.deque(maxlen=12)
        t0 = time.time()
        ops = 0
        try:
            for n in range(MODEL_OPS):
                if time.time() - t0 > budget:
                    break
                c = r.randrange(3)
                h = hs[c]
                off = r.randrange(size)
                ln = r.randint(1, min(size - off, 300000))
                x = r.random()
                if x >= .35 and x < .75 and r.random() < 0.3 and size >= 2 * bs:
                    # Whole blocks, 64 KiB or more where the export allows:
                    # over dirty blocks these are swapped in (fresh frames
                    # replacing the entry's, its entry split first).
                    off = r.randrange(size // bs) * bs
                    ln = min(size - off, bs * r.randint(max(1, 65536 // bs),
                                                        max(2, 1048576 // bs)))
                    ln -= ln % bs if off + ln < size else 0
                kind = ("read" if x < .35 else "write" if x < .75 else "zero" if x < .82
                        else "trim" if x < .88 else "flush" if x < .95 else "cache")
                fua = kind == "write" and r.random() < 0.2
                what = "%s seed %d op #%d: %s%s on conn %d%s" % (
                    name, seed, n, kind, " FUA" if fua else "", c,
                    "" if kind == "flush" else " [%d,+%d)" % (off, ln))
                trace.append(what)
                if kind == "read":
                    buf = nbd.Buffer(ln)
                    wait([(h, h.aio_pread(buf, off))], what)
                    require_same(buf.to_bytearray(), model[off:off + ln], what, base=off)
                    ops += 1
                    continue
                if kind == "write":
                    model[off:off + ln] = r.randbytes(ln)
                    buf = nbd.Buffer.from_bytearray(model[off:off + ln])
                    cookie = h.aio_pwrite(buf, off, flags=nbd.CMD_FLAG_FUA if fua else 0)
                elif kind in ("zero", "trim"):
                    model[off:off + ln] = bytes(ln)
                    cookie = (h.aio_zero if kind == "zero" else h.aio_trim)(ln, off)
                elif kind == "flush":
                    cookie = h.aio_flush()
                else:
                    cookie = h.aio_cache(ln, off)
                wait([(h, cookie)], what)
                ops += 1
        except (Failed, nbd.Error):
            log("  last operations:\n    " + "\n    ".join(trace))
            raise
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]
        log("  %d ops in %.1fs; %d WRITEs swapped in, %d entry splits"
            % (ops, time.time() - t0, st["writes_swapped"], st["arena"]["entry_splits"]))
        nbdtest.shutdown_all(hs)
    # Daemon.stop(): SIGTERM, exit 0; every dirty byte must be written back.
    require_same(read_at(path, 0, size + 1), model,
                 "%s seed %d: backend file after SIGTERM" % (name, seed))


def main():
    base = disk_dir()
    log("seed %d, files in %s" % (SEED, base or tempfile.gettempdir()))
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    t0 = time.time()
    with nbdtest.tempdir(prefix="cache-races-", base=base) as tmp:
        for name, fn in (("flush-during-writeback", flush_during_writeback),
                         ("bypass-with-busy-block", bypass_busy_block),
                         ("block-status-req-one", block_status_req_one),
                         ("block-status-many-extents", block_status_many_extents)):
            if ONLY in name:
                checks.run(name, fn, tmp)
        budget = MODEL_SECONDS / len(MODEL_CONFIGS)
        for k, (size, bs, mode, cache) in enumerate(MODEL_CONFIGS):
            name = "model %s/%d/%d" % (mode, bs, size)
            if ONLY in name:
                checks.run(name, model_run, tmp, k, size, bs, mode, cache, budget)
    log("total %.1fs" % (time.time() - t0))
    checks.finish("cache race")


if __name__ == "__main__":
    main()
