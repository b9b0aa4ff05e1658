#!/usr/bin/python3
"""cache_property: random operations through the block cache against a byte model.

For each cache mode (writeback, writethrough, writearound, none) and block
size (4096, 512): one daemon with a 64 MiB sparse export on tmpfs and a
1 MiB cache (1/64 of the working set), four libnbd connections. A seeded
random sequence of pread / pwrite / trim / zero / flush / cache (1 byte to
1 MiB, unaligned too, most 4-64 KiB, 60% of them in a 3 MiB hot region so
that the cache both hits and evicts) goes round-robin over the connections,
mixed with batches of async reads, writes, trims and zeroes in flight on
several connections at once, on pairwise disjoint ranges (overlapping
requests in flight have no defined order).

  - every read is compared byte for byte with the model (a bytearray;
    TRIM and WRITE_ZEROES make a range read back as zeros)
  - after every FLUSH the whole backend file equals the model
  - at the end: a full read through the daemon, then SIGTERM (exit 0), and
    the backend file must equal the model again

Environment: CACHE_PROPERTY_OPS (ops per run, default 500),
CACHE_PROPERTY_SEED (base seed, default 7340033; run i uses seed + i),
CACHE_PROPERTY_ONLY (run only the runs whose name, e.g. "writeback/512",
contains it), CACHE_PROPERTY_SECONDS (per-run time budget, default 30: past
it a run stops issuing random ops, says so, and still does the final checks).
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
CACHE_SIZE = "1M"
CONNS = 4
HOT = (5 * MIB + 12345, 8 * MIB + 12345)          # 3 MiB: bigger than the cache
MODES = ("writeback", "writethrough", "writearound", "none")
BLOCK_SIZES = (4096, 512)
OPS = int(os.environ.get("CACHE_PROPERTY_OPS", "500"))
BASE_SEED = int(os.environ.get("CACHE_PROPERTY_SEED", "7340033"))
ONLY = os.environ.get("CACHE_PROPERTY_ONLY", "")
RUN_SECONDS = float(os.environ.get("CACHE_PROPERTY_SECONDS", "30"))
# op -> weight; "batch" is a set of async requests on several connections
WEIGHTS = (("read", 28), ("write", 30), ("trim", 6), ("zero", 6), ("flush", 4),
           ("cache", 4), ("batch", 10))


def pick_len(r, limit=MIB):
    x = r.random()
    if x < 0.05:
        n = r.randint(1, 16)
    elif x < 0.15:
        n = r.randint(17, 4095)
    elif x < 0.45:
        n = r.choice((4096, 8192, 16384, 32768, 65536))
    elif x < 0.70:
        n = r.randint(4096, 65536)
    elif x < 0.85:
        n = r.randint(65537, 256 * KIB)
    else:
        n = r.randint(256 * KIB + 1, MIB)
    return min(n, limit)


def pick_off(r, n):
    lo, hi = HOT if r.random() < 0.6 and n <= HOT[1] - HOT[0] else (0, SIZE)
    off = r.randrange(lo, hi - n + 1)
    a = r.random()
    if a < 0.3:
        off -= off % 4096
    elif a < 0.6:
        off -= off % 512
    return max(0, min(off, SIZE - n))


class Run:
    def __init__(self, name, seed, d, path):
        self.name, self.seed, self.d, self.path = name, seed, d, path
        self.r = random.Random(seed)
        self.model = bytearray(SIZE)
        self.hs = [nbdtest.libnbd_handle(d.unix_uri("disk") if i % 2 == 0 else
                                         d.tcp_uri("disk")) for i in range(CONNS)]
        self.trace = []          # the last ops, printed on a failure
        self.counts = {}

    def note(self, i, text):
        self.trace.append("#%d %s" % (i, text))
        del self.trace[:-25]

    def ctx(self, i, what):
        return "%s seed %d op #%d %s" % (self.name, self.seed, i, what)

    def read_check(self, i, c, off, n, why="read"):
        what = "%s on conn %d [%d,+%d)" % (why, c, off, n)
        got = self.hs[c].pread(n, off)
        require_same(got, self.model[off:off + n], self.ctx(i, what), base=off)

    def check_backend(self, what):
        with open(self.path, "rb") as f:
            back = f.read()
        require_same(back, self.model, "%s seed %d: backend file %s" % (self.name, self.seed, what))

    def op(self, i, kind):
        r, m = self.r, self.model
        c = i % CONNS
        h = self.hs[c]
        other = (c + 1 + r.randrange(CONNS - 1)) % CONNS
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "batch":
            return self.batch(i)
        if kind == "flush":
            self.note(i, "flush conn %d" % c)
            h.flush()
            return self.check_backend("after op #%d (FLUSH on conn %d)" % (i, c))
        n = pick_len(r)
        off = pick_off(r, n)
        self.note(i, "%s conn %d [%d,+%d)" % (kind, c, off, n))
        if kind == "read":
            self.read_check(i, c, off, n)
        elif kind == "write":
            data = r.randbytes(n)
            h.pwrite(data, off, nbd.CMD_FLAG_FUA if r.random() < 0.1 else 0)
            m[off:off + n] = data
            if r.random() < 0.3:
                self.read_check(i, other, off, n, "read back of the write")
        elif kind in ("trim", "zero"):
            if kind == "trim":
                h.trim(n, off)
            else:
                h.zero(n, off, r.choice((0, 0, nbd.CMD_FLAG_NO_HOLE, nbd.CMD_FLAG_FUA)))
            m[off:off + n] = bytes(n)
            lo, hi = max(0, off - 700), min(SIZE, off + n + 700)
            self.read_check(i, other, lo, hi - lo, "read back of the %s" % kind)
        elif kind == "cache":
            h.cache(n, off)
            if r.random() < 0.5:
                self.read_check(i, other, off, n, "read after CACHE")

    def batch(self, i):
        """Async requests on several connections in flight at once, on
        pairwise disjoint ranges: reads see the model from before the
        batch, writes/trims/zeroes apply after it."""
        r = self.r
        want = r.randint(4, 16)
        ops, taken = [], []
        for _ in range(want * 10):
            if len(ops) >= want:
                break
            n = pick_len(r, 256 * KIB)
            if taken and r.random() < 0.3:       # right after another: same cache block
                off = min(taken[-1][1] + r.randrange(0, 100), SIZE - n)
            else:
                off = pick_off(r, n)
            if any(off < e and s < off + n for s, e in taken):
                continue
            taken.append((off, off + n))
            kind = r.choice(("r", "r", "r", "w", "w", "w", "t", "z"))
            ops.append((kind, r.randrange(CONNS), off, r.randbytes(n) if kind == "w" else n))
        self.note(i, "batch " + " ".join("%s%d[%d,+%d)" % (k, c, o, x if isinstance(x, int)
                                          else len(x)) for k, c, o, x in ops))
        pending, bufs = [], []
        for kind, c, off, x in ops:
            h = self.hs[c]
            if kind == "w":
                b = nbd.Buffer.from_bytearray(bytearray(x))
                cookie = h.aio_pwrite(b, off)
            elif kind == "r":
                b = nbd.Buffer(x)
                cookie = h.aio_pread(b, off)
            elif kind == "t":
                b, cookie = None, h.aio_trim(x, off)
            else:
                b, cookie = None, h.aio_zero(x, off)
            bufs.append(b)
            pending.append((h, cookie))
        nbdtest.aio_wait(pending, timeout=120)
        for (kind, c, off, x), b in zip(ops, bufs):
            if kind == "r":
                require_same(b.to_bytearray(), self.model[off:off + x],
                             self.ctx(i, "async read on conn %d [%d,+%d)" % (c, off, x)), base=off)
        for kind, c, off, x in ops:
            if kind == "w":
                self.model[off:off + len(x)] = x
            elif kind in ("t", "z"):
                self.model[off:off + x] = bytes(x)

    def random_ops(self):
        kinds = [k for k, w in WEIGHTS for _ in range(w)]
        t0 = time.time()
        for i in range(OPS):
            if time.time() - t0 > RUN_SECONDS:
                log("  %s: time budget of %gs reached after %d of %d ops" %
                    (self.name, RUN_SECONDS, i, OPS))
                break
            kind = self.r.choice(kinds)
            try:
                self.op(i, kind)
            except nbd.Error as e:
                raise Failed(self.ctx(i, "%s failed: %s" % (kind, e)))
        # Unflushed writes left for the final read and for SIGTERM.
        for j in range(8):
            n = pick_len(self.r, 256 * KIB)
            off = pick_off(self.r, n)
            data = self.r.randbytes(n)
            self.note(OPS + j, "final write conn %d [%d,+%d)" % (j % CONNS, off, n))
            self.hs[j % CONNS].pwrite(data, off)
            self.model[off:off + n] = data
        log("  %s: %s" % (self.name, " ".join("%s=%d" % kv for kv in sorted(self.counts.items()))))

    def final_read(self):
        for k, off in enumerate(range(0, SIZE, MIB)):
            self.read_check(OPS + 8, k % CONNS, off, MIB, "final full read")

    def close(self):
        nbdtest.shutdown_all(self.hs)


def one_run(name, mode, bs, seed):
    log("  %s: seed %d (rerun: CACHE_PROPERTY_SEED=%d CACHE_PROPERTY_ONLY=%s), %d ops"
        % (name, seed, BASE_SEED, name, OPS))
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.sparse_file(os.path.join(tmp, "disk.img"), SIZE)
        if bs == 4096:      # the global options
            exports = [("disk", path, "")]
            extra = ["--cache-mode", mode, "--block-size", str(bs)]
        else:               # the per-export suboptions
            exports = [("disk", path, "cache-mode=%s,block-size=%d" % (mode, bs))]
            extra = []
        extra = ["--cache-size", CACHE_SIZE] + extra
        with nbdtest.Daemon(exports, threads=4, extra=extra) as d:
            run = Run(name, seed, d, path)
            h = run.hs[0]
            require(h.get_size() == SIZE, "export size %d" % h.get_size())
            for cap in ("can_flush", "can_trim", "can_zero", "can_cache", "can_multi_conn"):
                require(getattr(h, cap)(), "%s: %s is false" % (name, cap))
            minimum = h.get_block_size(nbd.SIZE_MINIMUM)
            require(minimum in (0, 1), "%s: minimum block size %d; this test sends "
                    "byte-granular requests" % (name, minimum))
            try:
                run.random_ops()
                run.final_read()
            except (Failed, nbd.Error):
                log("  last operations of %s:\n    %s" % (name, "\n    ".join(run.trace)))
                raise
            finally:
                run.close()
            require(d.alive(), "%s: the daemon died" % name)
        # Daemon.stop(): SIGTERM, exit code 0. Everything must be written back.
        run.check_backend("after SIGTERM")


def main():
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    t0 = time.time()
    k = 0
    for bs in BLOCK_SIZES:
        for mode in MODES:
            name = "%s/%d" % (mode, bs)
            seed = BASE_SEED + k
            k += 1
            if ONLY and ONLY not in name:
                continue
            checks.run(name, one_run, name, mode, bs, seed)
    log("total %.1fs" % (time.time() - t0))
    checks.finish("cache property", unit="run")


if __name__ == "__main__":
    main()
