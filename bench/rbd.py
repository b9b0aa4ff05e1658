"""bench/rbd.py: the rbd scenario of bench/run (issue 30: nbdcached's rbd:
backend against the other ways to reach a Ceph image; run it with
`bench/run --scenario rbd`). Imported by bench/run, whose helpers it uses
(server start and stop, fio, CPU time from /proc/PID/stat).

A throwaway single-node cluster (tests/ceph/cluster.py: one mon, one mgr,
one BlueStore OSD on 127.0.0.1) holds an image of --size bytes (default
1 GiB) filled with incompressible data (`rbd import` of the bench file).
The same fio workloads (4 KiB random reads and writes, iodepth 32; 1 MiB
sequential reads and writes, iodepth 8; --seconds each) run against:

  fio-rbd        fio's own rbd engine on the image: librbd with no NBD at
                 all (the floor). Its CPU per I/O is that of fio's whole
                 process tree (librbd runs in it; fio's own generation of
                 I/O included, which the NBD servers' numbers leave out).
  qemu-nbd       qemu-nbd -t --shared=8 --cache=none rbd:POOL/IMAGE (Debian's
                 qemu-block-extra), fio ioengine=nbd.
  nbdkit-cache   nbdkit --filter=cache nbd (cache-on-read=true) in front of
                 that qemu-nbd.
  nbdcached-cold nbdcached rbd:POOL/IMAGE with a 64 MiB cache: random reads
                 are misses (the cache holds 1/16 of a 1 GiB image).
  nbdcached      nbdcached rbd:POOL/IMAGE, cache 1.25x the image, warmed by
                 one sequential pass: reads are hits, writes are absorbed.

Printed: the table (IOPS, MiB/s, p99, the server's CPU per I/O), then the
issue's targets: warm 4 KiB random read IOPS >= 3x qemu-nbd's, and
nbdcached-cold's CPU per 4 KiB random read <= 1.2x fio-rbd's. The servers
run one after the other (each holds the image's exclusive lock while it
writes). The scenario never fails on numbers.
"""

import json
import os
import resource
import shutil
import sys
import time

MiB = 1 << 20
WORKLOADS = [
    ("randread-4k-qd32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("randwrite-4k-qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
    ("seqread-1m-qd8", ["--rw=read", "--bs=1m", "--iodepth=8"]),
    ("seqwrite-1m-qd8", ["--rw=write", "--bs=1m", "--iodepth=8"]),
]
COLD_CACHE = 64 * MiB
IMAGE = "bench"


def fio_rbd(h, c, name, size, opts, seconds, outdir):
    """fio's rbd engine: its numbers, and the CPU per I/O of its whole
    process tree (librbd's threads run in it; fio's own usr_cpu and
    sys_cpu count only its job thread: a sixth of it here)."""
    env = {"CEPH_CONF": c.conf}
    out = os.path.join(outdir, "fio-%s.json" % name)
    argv = ["fio", "--name=" + name, "--ioengine=rbd", "--clientname=admin",
            "--pool=" + c.pool, "--rbdname=" + IMAGE, "--size=%d" % size,
            "--output-format=json", "--output=" + out, "--time_based",
            "--runtime=%d" % seconds] + opts
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = h.run_bounded(argv, seconds + 120, env=env, cwd=outdir)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with open(out) as f:
            job = json.load(f)["jobs"][0]
    except (OSError, ValueError, IndexError, KeyError):
        raise RuntimeError("fio rbd %s failed (exit %d): %s" % (name, p.returncode,
                                                               (p.stderr or "")[-500:]))
    side = job[h.fio_direction(opts)]
    ios = side["total_ios"]
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"iops": side["iops"], "mibs": side["bw_bytes"] / MiB,
            "p99_us": side["clat_ns"]["percentile"]["99.000000"] / 1000.0,
            "cpu_us_per_io": cpu / ios * 1e6 if ios else float("nan")}


def nbd_server_runs(h, name, argv, sock, uri, size, seconds, outdir, warm, env=None):
    res = {}
    with h.running_server(name, argv, sock, outdir, env=env) as (proc, logpath):
        if warm:
            h.run_fio("%s-warmup" % name, uri, size, h.WARMUP, 0, outdir)
        for wname, opts in WORKLOADS:
            try:
                res[wname] = h.measured_run(proc, "%s-%s" % (name, wname), uri, size, opts,
                                            seconds, outdir)
            except RuntimeError as e:
                print("  %s %s FAILED: %s" % (name, wname, e), flush=True)
    return res


def print_table(results):
    print()
    print("%-16s %-18s %10s %9s %9s %10s" % ("server", "workload", "IOPS", "MiB/s", "p99 us",
                                               "CPU us/IO"))
    for server, rows in results.items():
        for wname, _ in WORKLOADS:
            m = rows.get(wname)
            if not m:
                print("%-16s %-18s %10s" % (server, wname, "n/a"))
                continue
            print("%-16s %-18s %10.0f %9.1f %9.0f %10.1f" % (server, wname, m["iops"], m["mibs"],
                                                            m["p99_us"], m["cpu_us_per_io"]))


def ratio(a, b):
    return a / b if a and b else float("nan")


def run(args, tmp, h):
    """Entry point from bench/run (h: that module, for its helpers)."""
    sys.path.insert(0, os.path.join(h.TOP, "tests", "ceph"))
    from cluster import Cluster  # noqa: E402  (tests/ceph/cluster.py)
    for prog in ("ceph-mon", "ceph-osd", "rbd", "qemu-nbd"):
        if not shutil.which(prog):
            print("rbd: %s is not installed (tests/ceph/deps installs it)" % prog)
            return
    size = args.size
    path = os.path.join(tmp, "bench.img")
    sock = os.path.join(tmp, "nbd.sock")
    uri = "nbd+unix:///?socket=" + sock
    with Cluster(os.path.join(tmp, "ceph"), log=print) as c:
        h.make_file(path, size)
        t0 = time.time()
        c.rbd("import", "--no-progress", path, "%s/%s" % (c.pool, IMAGE), timeout=1800)
        print("image: %s/%s, %d MiB, imported in %.1fs; fio: %ds per workload"
              % (c.pool, IMAGE, size // MiB, time.time() - t0, args.seconds), flush=True)
        results = {}
        rows = {}
        for wname, opts in WORKLOADS:
            try:
                rows[wname] = fio_rbd(h, c, "fio-rbd-" + wname, size, opts, args.seconds, tmp)
            except RuntimeError as e:
                print("  fio-rbd %s FAILED: %s" % (wname, e), flush=True)
        results["fio-rbd"] = rows
        qemu_spec = "rbd:%s/%s:conf=%s" % (c.pool, IMAGE, c.conf)
        qsock = os.path.join(tmp, "qemu.sock")
        qemu = ["qemu-nbd", "-t", "--shared=8", "--cache=none", "--format=raw", "--socket=" + sock,
                qemu_spec]
        results["qemu-nbd"] = nbd_server_runs(h, "qemu-nbd", qemu, sock, uri, size, args.seconds,
                                              tmp, False)
        if shutil.which("nbdkit"):
            qemu_back = ["qemu-nbd", "-t", "--shared=8", "--cache=none", "--format=raw",
                         "--socket=" + qsock, qemu_spec]
            with h.running_server("qemu-nbd-backend", qemu_back, qsock, tmp):
                nbdkit = ["nbdkit", "-f", "-U", sock, "--filter=cache", "nbd",
                          "socket=" + qsock, "cache-on-read=true",
                          "cache-max-size=%d" % (size * 5 // 4)]
                results["nbdkit-cache"] = nbd_server_runs(h, "nbdkit-cache", nbdkit, sock, uri,
                                                          size, args.seconds, tmp, True)
        spec = "rbd:%s/%s?conf=%s" % (c.pool, IMAGE, c.conf)
        for name, cache, warm in (("nbdcached-cold", COLD_CACHE, False),
                                  ("nbdcached", -(-size * 5 // 4 // MiB) * MiB, True)):
            argv = [h.NBDCACHED, "--foreground", "--unix", sock, "--threads", "2",
                    "--cache-size", "%d" % cache, "--export", "bench=" + spec]
            results[name] = nbd_server_runs(h, name, argv, sock, uri, size, args.seconds, tmp,
                                            warm)
    print_table(results)
    print()
    rr = "randread-4k-qd32"
    hit = results.get("nbdcached", {}).get(rr, {}).get("iops")
    q = results.get("qemu-nbd", {}).get(rr, {}).get("iops")
    r = ratio(hit, q)
    print("TARGET warm 4 KiB random reads: nbdcached %.0f IOPS / qemu-nbd rbd: %.0f = %.2fx "
          "(target >= 3x): %s" % (hit or 0, q or 0, r, "met" if r >= 3 else "NOT met"))
    cold = results.get("nbdcached-cold", {}).get(rr, {}).get("cpu_us_per_io")
    floor = results.get("fio-rbd", {}).get(rr, {}).get("cpu_us_per_io")
    r = ratio(cold, floor)
    print("TARGET misses, CPU per 4 KiB random read: nbdcached (64 MiB cache) %.1f us / fio rbd "
          "%.1f us = %.2fx (target <= 1.2x): %s"
          % (cold or 0, floor or 0, r, "met" if r <= 1.2 else "NOT met"))
    for wname, _ in WORKLOADS:
        a = results.get("nbdcached", {}).get(wname, {}).get("iops")
        for peer in ("fio-rbd", "qemu-nbd", "nbdkit-cache"):
            b = results.get(peer, {}).get(wname, {}).get("iops")
            print("  %-18s nbdcached / %-13s IOPS %.2fx" % (wname, peer, ratio(a, b)))
