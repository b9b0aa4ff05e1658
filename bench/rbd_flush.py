#!/usr/bin/python3
"""bench/rbd_flush.py: FLUSH latency of an rbd: export with and without a
cache device (issue 40, item 1), side by side in one run. A benchmark: it
prints numbers and ratios and never fails on them.

  bench/rbd_flush.py [--seconds S] [--rounds R] [--old PATH] [--no-file]

A throwaway single-node cluster (tests/ceph/cluster.py: one mon, one mgr,
one BlueStore OSD on 127.0.0.1, its block a sparse file in --dir; packages
from tests/ceph/deps) holds a 256 MiB image, written once in full (`rbd
bench`) so that no measured write creates an object. Servers, one after
the other (each holds the image's exclusive lock while it runs; nbdcached
in writeback mode, cache 512 MiB, 2 threads, stopped by SIGTERM):

  fio-rbd            fio's own rbd engine (librbd, no NBD): the cluster's
                     floor for a 4 KiB write and a flush
  nbdcached          nbdcached rbd:POOL/IMAGE
  nbdcached+device   the same with --cache-device (a 256 MiB file in --dir,
                     cache-device-use both, the default). An rbd: export
                     writes nothing to the log: its FLUSH goes to the OSDs
  old+device         with --old PATH (default $NBDCACHED_OLD): a build from
                     before the fix with the same device, whose FLUSH was
                     answered from the log: what the log bought, and what
                     it cost (the data was on this node alone)

Then, for contrast, a 256 MiB file on the same disk (--no-file: not):
nbdcached and nbdcached+device, where the log answers the FLUSH.

Workload: fio 4 KiB random writes at iodepth 1 with a FLUSH after each
(--fsync=1), --seconds each (default 10); printed: write IOPS, FLUSH p50
and p99 (fio's sync latency) and the ratios of the device's FLUSH p50 and
p99 to the same server without it. Rounds (default 3) alternate the
servers' order; the tables show the medians.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(TOP, "tests", "ceph"))
import cache_device as cd  # noqa: E402  (bench/cache_device.py: Proc, fio, zero_file)

MIB = 1 << 20
SIZE = 256 * MIB
DEVICE = 256 * MIB
IMAGE = "flush"


def fio_rbd(c, seconds, out):
    """fio's rbd engine with --fsync=1: iops, FLUSH p50 and p99 (us)."""
    argv = ["fio", "--name=sync", "--ioengine=rbd", "--clientname=admin", "--pool=" + c.pool,
            "--rbdname=" + IMAGE, "--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=1",
            "--size=%d" % SIZE, "--time_based", "--runtime=%d" % seconds,
            "--output-format=json", "--output=" + out]
    subprocess.run(argv, check=True, timeout=seconds + 120, capture_output=True,
                   env=c.env())
    with open(out) as f:
        job = json.load(f)["jobs"][0]
    pct = job["sync"]["lat_ns"].get("percentile", {})
    return {"iops": job["write"]["iops"],
            "p50": pct.get("50.000000", 0) / 1e3, "p99": pct.get("99.000000", 0) / 1e3,
            "flushes": job["sync"]["total_ios"]}


def format_device(dev):
    """Zeros over the first 128 KiB: formatted afresh at the next start
    (an earlier server's log and level-2 map gone)."""
    with open(dev, "r+b") as f:
        f.write(bytes(128 * 1024))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(dev, 0o600)


def nbdcached(binary, tmp, name, spec, dev):
    sock = os.path.join(tmp, "front.sock")
    argv = [binary, "--foreground", "--unix", sock, "--control", "none",
            "--export", "d=" + spec, "--cache-size", "512M", "--cache-mode", "writeback",
            "--threads", "2"]
    if dev:
        format_device(dev)
        argv += ["--cache-device", dev]
    p = cd.Proc(argv, sock, os.path.join(tmp, name + ".log"), ready="info: ready:")
    if p.p.poll() is not None:
        raise RuntimeError("%s exited %d at start (its log: %s)" % (
            name, p.p.returncode, os.path.join(tmp, name + ".log")))
    return p, "nbd+unix:///d?socket=" + sock


def rounds(servers, count):
    """servers: [(name, run(name) -> result)], each once a round, the order
    reversed every other round; the medians of iops, p50, p99."""
    results = {name: [] for name, _ in servers}
    for rnd in range(count):
        for name, run in (servers if rnd % 2 == 0 else servers[::-1]):
            try:
                r = run(name)
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                print("  round %d %-17s FAILED: %s" % (rnd + 1, name, e), flush=True)
                continue
            results[name].append(r)
            print("  round %d %-17s %6.0f IOPS  FLUSH p50 %8.1f us  p99 %8.1f us  (%d "
                  "FLUSHes)" % (rnd + 1, name, r["iops"], r["p50"], r["p99"], r["flushes"]),
                  flush=True)
    return {name: {k: statistics.median(x[k] for x in rs) for k in ("iops", "p50", "p99")}
            for name, rs in results.items() if rs}


def table(med, names, count):
    print("  %-17s %10s %14s %14s   (median of %d rounds)" % (
        "server", "IOPS", "FLUSH p50 us", "FLUSH p99 us", count))
    for s in names:
        if s in med:
            print("  %-17s %10.0f %14.1f %14.1f" % (s, med[s]["iops"], med[s]["p50"],
                                                    med[s]["p99"]))
        else:
            print("  %-17s %10s" % (s, "n/a"))


def ratio(med, a, b, note=""):
    if a not in med or b not in med or not med[b]["p50"] or not med[b]["p99"]:
        return
    print("  RATIO FLUSH %s / %s: p50 %.3f, p99 %.3f%s" % (
        a, b, med[a]["p50"] / med[b]["p50"], med[a]["p99"] / med[b]["p99"], note), flush=True)


def run(args, tmp):
    from cluster import Cluster  # noqa: E402  (tests/ceph/cluster.py)
    dev = os.path.join(tmp, "cache.dev")
    out = os.path.join(tmp, "fio.json")
    t0 = time.time()
    cd.zero_file(dev, DEVICE)
    print("cache device file (%d MiB) written with zeros and fsync()ed in %.1f s"
          % (DEVICE // MIB, time.time() - t0), flush=True)
    p50, p99 = cd.device_floor(dev)
    print("FLOOR the device file alone: 8 KiB O_DIRECT write + fdatasync, p50 %.1f us, p99 "
          "%.1f us (what a log commit costs at least)" % (p50, p99), flush=True)
    with Cluster(os.path.join(tmp, "ceph"), log=lambda m: print(m, flush=True)) as c:
        c.rbd("create", "--size", str(SIZE // MIB), "%s/%s" % (c.pool, IMAGE))
        t0 = time.time()
        c.rbd("bench", "--io-type", "write", "--io-size", "4M", "--io-pattern", "seq",
              "--io-total", str(SIZE), "%s/%s" % (c.pool, IMAGE), timeout=600)
        print("image %s/%s: %d MiB, written in full in %.1f s" % (
            c.pool, IMAGE, SIZE // MIB, time.time() - t0), flush=True)
        spec = "rbd:%s/%s?conf=%s" % (c.pool, IMAGE, c.conf)

        def served(binary, with_dev, spec=spec):
            def go(name):
                p, uri = nbdcached(binary, tmp, name, spec, dev if with_dev else None)
                try:
                    return cd.fio(uri, args.seconds, out)
                finally:
                    p.stop()
            return go

        servers = [("fio-rbd", lambda name: fio_rbd(c, args.seconds, out)),
                   ("nbdcached", served(cd.NBDCACHED, False)),
                   ("nbdcached+device", served(cd.NBDCACHED, True))]
        if args.old:
            servers.append(("old+device", served(args.old, True)))
        print("\n== backend: %s (one BlueStore OSD on 127.0.0.1, pool size 1)" % spec,
              flush=True)
        med = rounds(servers, args.rounds)
        table(med, [s for s, _ in servers], args.rounds)
        ratio(med, "nbdcached+device", "nbdcached",
              "  (the log takes no part in an rbd: export's FLUSH: expect about 1)")
        ratio(med, "nbdcached", "fio-rbd", "  (nbdcached over librbd alone)")
        if args.old:
            ratio(med, "old+device", "nbdcached",
                  "  (the pre-fix log's answer: fast, and on this node alone)")
    if args.no_file:
        return
    path = os.path.join(tmp, "backend.img")
    cd.zero_file(path, SIZE)
    servers = [("nbdcached", served_file(tmp, path, dev, False, args, out)),
               ("nbdcached+device", served_file(tmp, path, dev, True, args, out))]
    print("\n== backend: a %d MiB file on the same disk (for contrast: the log answers the "
          "FLUSH)" % (SIZE // MIB), flush=True)
    med = rounds(servers, args.rounds)
    table(med, [s for s, _ in servers], args.rounds)
    ratio(med, "nbdcached+device", "nbdcached")


def served_file(tmp, path, dev, with_dev, args, out):
    def go(name):
        p, uri = nbdcached(cd.NBDCACHED, tmp, name, path, dev if with_dev else None)
        try:
            return cd.fio(uri, args.seconds, out)
        finally:
            p.stop()
    return go


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old", default=os.environ.get("NBDCACHED_OLD"),
                    help="a build from before the fix (its FLUSH answered from the log)")
    ap.add_argument("--no-file", action="store_true", help="only the rbd: export")
    ap.add_argument("--dir", default=os.path.join(TOP, cd.BUILD, "bench-rbd-flush"),
                    help="a directory on the disk to measure (default: under the build)")
    args = ap.parse_args()
    for tool in ("fio", "ceph-mon", "ceph-osd", "rbd"):
        if not shutil.which(tool):
            sys.exit("bench/rbd_flush.py: %s is not installed (tests/ceph/deps installs the "
                     "Ceph packages)" % tool)
    for b in [cd.NBDCACHED] + ([args.old] if args.old else []):
        if not os.path.exists(b):
            sys.exit("bench/rbd_flush.py: %s is not built" % b)
    os.makedirs(args.dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    try:
        print("bench/rbd_flush.py: %s%s on %s (%s), fio %s" % (
            os.path.relpath(cd.NBDCACHED, TOP), ", old: %s" % args.old if args.old else "",
            tmp, subprocess.run(["stat", "-f", "-c", "%T", tmp], capture_output=True,
                                text=True).stdout.strip(),
            subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()))
        print("client: fio, 4 KiB random writes, iodepth 1, --fsync=1 (a FLUSH after each), "
              "%d s per run, %d rounds" % (args.seconds, args.rounds), flush=True)
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
