#!/usr/bin/python3
"""cache_hit_path: a second read of cached data is served from the cache.

A 32 MiB backend file of random data, a 64 MiB writeback cache. The 4 MiB
region [8 MiB, 12 MiB) is read cold (1 MiB reads), then warm:

  - stats (SIGUSR1) S0 before, A after the cold read: backend_reads and
    backend_read_bytes grew (at least 4 MiB), else the rest proves nothing
  - B after the warm read (same reads, plus unaligned small ones inside the
    region, on the same connection): B.backend_reads == A.backend_reads,
    B.backend_read_bytes == A.backend_read_bytes, B.hits > A.hits
  - C after a warm read on a second connection: no backend read either
Then, independently of the counters: the region is overwritten in the
backend file directly (os.pwrite, behind the daemon's back); a read through
the daemon must still return the old, cached bytes.
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 32 * MIB
REGION = (8 * MIB, 12 * MIB)
SEED = 4242
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def read_region(h, old, what):
    for off in range(REGION[0], REGION[1], MIB):
        require_same(h.pread(MIB, off), old[off:off + MIB], "%s [%d,+1M)" % (what, off), base=off)


def small_reads(h, old, r):
    for _ in range(20):
        n = r.randint(1, 70000)
        off = r.randrange(REGION[0], REGION[1] - n)
        require_same(h.pread(n, off), old[off:off + n], "small warm read [%d,+%d)" % (off, n),
                     base=off)


def delta(a, b, key):
    return b[key] - a[key]


def show(label, st):
    log("  %s: %s" % (label, " ".join("%s=%s" % (k, st[k]) for k in sorted(st))))


def counters(d, hs, old, r):
    s0 = nbdtest.stats(d)
    show("S0", s0)
    read_region(hs[0], old, "cold read")
    a = nbdtest.stats(d)
    show("A (after the cold read)", a)
    expect(delta(s0, a, "backend_reads") > 0,
           "the cold read of 4 MiB did not count any backend read (backend_reads %d -> %d)"
           % (s0["backend_reads"], a["backend_reads"]))
    expect(delta(s0, a, "backend_read_bytes") >= REGION[1] - REGION[0],
           "the cold read of 4 MiB counted only %d backend_read_bytes"
           % delta(s0, a, "backend_read_bytes"))
    expect(delta(s0, a, "misses") + delta(s0, a, "partial_hits") > 0,
           "the cold read counted no miss and no partial hit")
    read_region(hs[0], old, "warm read")
    small_reads(hs[0], old, r)
    b = nbdtest.stats(d)
    show("B (after the warm read)", b)
    for key in ("backend_reads", "backend_read_bytes"):
        expect(b[key] == a[key], "the warm read touched the backend: %s %d -> %d"
               % (key, a[key], b[key]))
    expect(b["hits"] > a["hits"], "the warm read counted no hit: hits %d -> %d"
           % (a["hits"], b["hits"]))
    log("  warm read: hits +%d, misses +%d, partial_hits +%d" % (
        delta(a, b, "hits"), delta(a, b, "misses"), delta(a, b, "partial_hits")))
    read_region(hs[1], old, "warm read on a second connection")
    c = nbdtest.stats(d)
    show("C (after the warm read on conn 1)", c)
    for key in ("backend_reads", "backend_read_bytes"):
        expect(c[key] == b[key], "the warm read on a second connection touched the "
               "backend: %s %d -> %d" % (key, b[key], c[key]))
    expect(c["hits"] > b["hits"], "the warm read on a second connection counted no hit")


def behind_the_back(d, path, hs, old, r):
    n = REGION[1] - REGION[0]
    for c, h in enumerate(hs):      # cached now, whatever the check before did
        read_region(h, old, "conn %d: read before the overwrite" % c)
    new = r.randbytes(n)
    fd = os.open(path, os.O_WRONLY)
    try:
        require_same(nbdtest.read_at(path, REGION[0], n), old[REGION[0]:REGION[1]],
                     "test setup: backend file before the overwrite", base=REGION[0])
        written = os.pwrite(fd, new, REGION[0])
        expect(written == n, "test setup: os.pwrite wrote %d of %d bytes" % (written, n))
    finally:
        os.close(fd)
    for c, h in enumerate(hs):
        got = bytearray()
        for off in range(REGION[0], REGION[1], MIB):
            got += h.pread(MIB, off)
        fresh = sum(1 for k in range(0, n, 4096) if got[k:k + 4096] == new[k:k + 4096])
        expect(got == old[REGION[0]:REGION[1]],
               "conn %d, after the backend file was overwritten behind the daemon: %s; %d of "
               "%d 4 KiB blocks came from the backend instead of the cache"
               % (c, nbdtest.describe_diff(got, old[REGION[0]:REGION[1]], REGION[0]),
                  fresh, n // 4096))


def main():
    log("seed %d" % SEED)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = nbdtest.random_file(os.path.join(tmp, "disk.img"), SIZE, seed=SEED)
        with open(path, "rb") as f:
            old = f.read()
        r = random.Random(SEED + 1)
        extra = ["--cache-size", "64M", "--cache-mode", "writeback"]
        with nbdtest.Daemon([("disk", path, "")], extra=extra) as d:
            hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(2)]
            CHECKS.run("counters: cold then warm read", counters, d, hs, old, r)
            CHECKS.run("cached bytes win over a changed backend", behind_the_back,
                       d, path, hs, old, r)
            expect(d.alive(), "the daemon died")
            nbdtest.shutdown_all(hs)
            CHECKS.dump_log(d)
    CHECKS.finish("cache hit path")


if __name__ == "__main__":
    main()
