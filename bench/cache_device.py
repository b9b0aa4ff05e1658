#!/usr/bin/python3
"""bench/cache_device.py: what the intent log on a cache device
(--cache-device) does to FLUSH, side by side in one run. A benchmark: it
prints numbers and ratios and never fails on them.

  bench/cache_device.py [--seconds S] [--rounds R] [--replay-mib M]

Backends, each a 1 GiB file on the machine's disk (not tmpfs):
  slow   nbdkit --filter=delay file, every write, zero and trim 2 ms (the
         delay filter has no flush delay: a FLUSH is the file's fdatasync)
  file   the file itself

Servers in front of each (the cache device, when there is one, a 256 MiB
file on the same disk; nbdcached in writeback mode, cache 512 MiB):
  nbdcached+log   nbdcached --cache-device (cache-device-use log)
  nbdcached       nbdcached without one (FLUSH goes to the backend)
  nbdkit-cache    nbdkit --filter=cache nbd (cache=writeback), a FLUSH
                  written back to the backend and flushed

Workload: fio (nbd engine) 4 KiB random writes at iodepth 1 with a FLUSH
after each (--fsync=1), --seconds each; printed: write IOPS, FLUSH p50
and p99 (fio's sync latency), and the ratios of nbdcached+log's FLUSH p50
to the others'. The target of issue 28: over the 2 ms backend, p50 with
the log at most 1/5 of without it. Rounds alternate the servers' order;
the table shows the medians.

Then reads (--read-rounds, default 3): a working set of 256 MiB, 4x the
RAM cache (64 MiB) and within the level-2 area of a 512 MiB cache device;
the backend nbdkit --filter=delay file with reads delayed 2 ms too
(slowread), and the file itself. Each server reads the working set twice
sequentially first (1 MiB reads: what RAM cannot hold goes to the level-2
area), then fio 4 KiB random reads at iodepth 1 over it for --seconds:
  nbdcached+l2   nbdcached --cache-device (cache-device-use l2)
  nbdcached      without one
  nbdkit-cache   nbdkit --filter=cache (cache-max-size 64M)
printed: read IOPS and p50/p99 latency, and the ratio of nbdcached+l2's
IOPS to the others' (the target of issue 28: at least 5x without it over
the 2 ms backend). Then the hit path: the same random reads over 32 MiB
that RAM holds, nbdcached+l2 against nbdcached (within noise: 1.0).

Then the warm restart (--warm-gib G, default 2; 0: none): a G GiB working
set of random data behind nbdkit's delay filter (reads 2 ms), RAM cache
256 MiB, a cache device of 2G GiB (cache-device-warm all); the working
set read twice sequentially, SIGTERM (what RAM holds goes to the level-2
area, its map is kept), a new start, then one pass of 4 KiB random
reads over the whole working set (fio's random map: each block once,
iodepth 8): the share of its bytes read from the backend (the target of
issue 28: at most 5%). Then SIGKILL at once after that pass, a start,
and the same pass again: the share after a crash (the map on the device
is kept true while the daemon runs).

Then the replay: --replay-mib MiB (default 1024) written and FLUSHed
into a log of 2.5 times that, the daemon SIGKILLed; the next start timed
to serving (from its log lines: the log's end found from its headers,
its write-back planned), 32 random 4 KiB reads timed and checked while
the log drains, the drain's time and rate (from the stats), and the
floors: the device read once, the backend written once.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
BUILD = os.environ.get("BUILD", "build")
NBDCACHED = os.environ.get("NBDCACHED", os.path.join(TOP, BUILD, "nbdcached"))
MIB = 1 << 20
SIZE = 1 << 30
DEVICE = 256 * MIB
DELAY = "2ms"


def wait_socket(path, proc, timeout=30):
    import socket
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError("%s exited %d" % (proc.args[0], proc.returncode))
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("no socket %s" % path)


class Proc:
    """A server started by this script, stopped by its PID."""

    def __init__(self, argv, sock, log, ready=None):
        self.sock = sock
        if os.path.exists(sock):
            os.unlink(sock)
        self.logf = open(log, "w")
        # A cache device must be readable by its owner alone.
        for i, a in enumerate(argv[:-1]):
            if a == "--cache-device" and os.path.isfile(argv[i + 1]):
                os.chmod(argv[i + 1], 0o600)
        self.p = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT)
        wait_socket(sock, self.p)
        # nbdcached listens before its replay: "ready" says it is done.
        end = time.time() + 600
        while ready and time.time() < end and self.p.poll() is None:
            with open(log) as f:
                if ready in f.read():
                    break
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(120)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.logf.close()


def zero_file(path, size):
    """Written with zeros and fsync()ed: its blocks allocated, so that
    what is measured is writing over them (an SSD partition's case), not
    the file system allocating them."""
    buf = bytes(8 * MIB)
    with open(path, "wb") as f:
        for _ in range(size // len(buf)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())


def fio(uri, seconds, out):
    argv = ["fio", "--name=sync", "--ioengine=nbd", "--uri=" + uri, "--rw=randwrite",
            "--bs=4k", "--iodepth=1", "--fsync=1", "--size=%d" % (256 * MIB),
            "--time_based", "--runtime=%d" % seconds, "--output-format=json",
            "--output=" + out]
    subprocess.run(argv, check=True, timeout=seconds + 120, capture_output=True)
    with open(out) as f:
        job = json.load(f)["jobs"][0]
    pct = job["sync"]["lat_ns"].get("percentile", {})
    return {"iops": job["write"]["iops"],
            "p50": pct.get("50.000000", 0) / 1e3, "p99": pct.get("99.000000", 0) / 1e3,
            "flushes": job["sync"]["total_ios"]}


def backend(kind, tmp, path):
    """The backend's URI or path, and its process (None: a file)."""
    if kind == "file":
        return path, None
    sock = os.path.join(tmp, "backend.sock")
    delays = ["delay-write=" + DELAY, "delay-zero=" + DELAY, "delay-trim=" + DELAY]
    if kind == "slowread":
        delays.append("delay-read=" + DELAY)
    p = Proc(["nbdkit", "-U", sock, "-f", "--filter=delay", "file", path] + delays, sock,
             os.path.join(tmp, "backend.log"))
    return "nbd+unix:///?socket=" + sock, p


def server(name, tmp, spec, dev, cache="512M"):
    sock = os.path.join(tmp, "front.sock")
    if name.startswith("nbdcached"):
        argv = [NBDCACHED, "--foreground", "--unix", sock, "--control", "none",
                "--export", "d=" + spec, "--cache-size", cache, "--cache-mode",
                "writeback", "--threads", "2"]
        if name in ("nbdcached+log", "nbdcached+l2"):
            with open(dev, "r+b") as f:
                f.write(bytes(128 * 1024))  # zeros: formatted at start
                f.flush()
                os.fsync(f.fileno())
            argv += ["--cache-device", dev, "--cache-device-use",
                     "log" if name == "nbdcached+log" else "l2"]
        return Proc(argv, sock, os.path.join(tmp, name + ".log")), \
            "nbd+unix:///d?socket=" + sock
    plugin = (["nbd", "uri=" + spec] if spec.startswith("nbd") else ["file", spec])
    argv = ["nbdkit", "-U", sock, "-f", "--filter=cache"] + plugin + [
        "cache=writeback", "cache-max-size=" + cache]
    return Proc(argv, sock, os.path.join(tmp, name + ".log")), "nbd+unix:///?socket=" + sock


def device_floor(dev, n=2000):
    """The device file's own cost of a commit, no server: an 8 KiB
    O_DIRECT write (a batch header and a 4 KiB block) and fdatasync, n
    times at the offsets a log would use; p50 and p99 in us."""
    import mmap
    buf = mmap.mmap(-1, 8192)
    buf.write(os.urandom(8192))
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    lat = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            os.pwritev(fd, [buf], (1 << 20) + i * 8192)
            os.fdatasync(fd)
            lat.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
    lat.sort()
    return lat[len(lat) // 2], lat[len(lat) * 99 // 100]


def rounds(names, count, kind, tmp, path, dev, cache, measure, show):
    """count rounds, each server once a round (the order reversed every
    other round), each before a fresh backend of this kind: measure(uri)'s
    results printed (show) as they come; the medians of iops, p50, p99."""
    results = {s: [] for s in names}
    for rnd in range(count):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            spec, bp = backend(kind, tmp, path)
            try:
                p, uri = server(name, tmp, spec, dev, cache=cache)
                try:
                    r = measure(uri)
                finally:
                    p.stop()
            finally:
                if bp:
                    bp.stop()
            results[name].append(r)
            print("  round %d %-14s %s" % (rnd + 1, name, show(r)), flush=True)
    return {s: {k: statistics.median(x[k] for x in results[s]) for k in ("iops", "p50", "p99")}
            for s in names}


def flush_latency(args, tmp):
    path = os.path.join(tmp, "backend.img")
    dev = os.path.join(tmp, "cache.dev")
    t0 = time.time()
    zero_file(path, SIZE)
    zero_file(dev, DEVICE)
    print("backend file (%d MiB) and cache device file (%d MiB) written with zeros and "
          "fsync()ed in %.1f s" % (SIZE // MIB, DEVICE // MIB, time.time() - t0), flush=True)
    p50, p99 = device_floor(dev)
    print("FLOOR the device file alone: 8 KiB O_DIRECT write + fdatasync, p50 %.1f us, p99 "
          "%.1f us (what any commit to it costs)" % (p50, p99), flush=True)
    servers = ["nbdcached+log", "nbdcached", "nbdkit-cache"]
    for kind in ("slow", "file"):
        print("\n== backend: %s" % ("nbdkit --filter=delay file, writes %s, FLUSH fdatasync"
                                    % DELAY if kind == "slow" else "the file itself"),
              flush=True)
        med = rounds(servers, args.rounds, kind, tmp, path, dev, "512M",
                     lambda uri: fio(uri, args.seconds, os.path.join(tmp, "fio.json")),
                     lambda r: "%6.0f IOPS  FLUSH p50 %8.1f us  p99 %8.1f us  (%d FLUSHes)" % (
                         r["iops"], r["p50"], r["p99"], r["flushes"]))
        print("  %-14s %10s %14s %14s   (median of %d rounds)" % ("server", "IOPS",
                                                                   "FLUSH p50 us",
                                                                   "FLUSH p99 us",
                                                                   args.rounds))
        for s in servers:
            print("  %-14s %10.0f %14.1f %14.1f" % (s, med[s]["iops"], med[s]["p50"],
                                                    med[s]["p99"]))
        log = med["nbdcached+log"]
        for other in ("nbdcached", "nbdkit-cache"):
            q = log["p50"] / med[other]["p50"] if med[other]["p50"] else float("nan")
            q99 = log["p99"] / med[other]["p99"] if med[other]["p99"] else float("nan")
            print("  RATIO FLUSH p50 nbdcached+log / %s: %.3f (p99 %.3f)%s"
                  % (other, q, q99, ("  target <= 0.2: %s" % ("MET" if q <= 0.2 else
                                                              "NOT MET"))
                     if kind == "slow" and other == "nbdcached" else ""))


READ_SET = 256 * MIB
READ_CACHE = "64M"
READ_DEVICE = 512 * MIB


def fio_read(uri, seconds, out, size, rw="randread", bs="4k", time_based=True):
    argv = ["fio", "--name=read", "--ioengine=nbd", "--uri=" + uri, "--rw=" + rw,
            "--bs=" + bs, "--iodepth=1", "--size=%d" % size, "--output-format=json",
            "--output=" + out]
    if time_based:
        argv += ["--time_based", "--runtime=%d" % seconds]
    subprocess.run(argv, check=True, timeout=seconds + 300, capture_output=True)
    with open(out) as f:
        job = json.load(f)["jobs"][0]
    pct = job["read"]["clat_ns"].get("percentile", {})
    return {"iops": job["read"]["iops"], "p50": pct.get("50.000000", 0) / 1e3,
            "p99": pct.get("99.000000", 0) / 1e3}


def read_floor(dev, span, n=3000):
    """The device file's own random 4 KiB O_DIRECT read, no server: p50
    and p99 in us (what any read from the level-2 area costs)."""
    import mmap
    import random
    buf = mmap.mmap(-1, 4096)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    lat = []
    try:
        for _ in range(n):
            off = random.randrange(span // 4096) * 4096
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            lat.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
    lat.sort()
    return lat[len(lat) // 2], lat[len(lat) * 99 // 100]


def reads(args, tmp):
    path = os.path.join(tmp, "backend.img")
    dev = os.path.join(tmp, "read.dev")
    if not os.path.exists(path):
        zero_file(path, SIZE)
    zero_file(dev, READ_DEVICE)
    p50, p99 = read_floor(dev, READ_DEVICE)
    print("\nFLOOR the device file alone: random 4 KiB O_DIRECT reads, p50 %.1f us, p99 %.1f us "
          "(what any read from the level-2 area costs; at iodepth 1 at most %.0f IOPS)"
          % (p50, p99, 1e6 / p50 if p50 else 0), flush=True)
    with open(path, "r+b") as f:  # data, not zeros: nothing reads as a hole
        for off in range(0, READ_SET, 8 * MIB):
            f.seek(off)
            f.write(os.urandom(8 * MIB))
        os.fsync(f.fileno())
    servers = ["nbdcached+l2", "nbdcached", "nbdkit-cache"]
    for kind, size, names in (("slowread", READ_SET, servers), ("file", READ_SET, servers),
                              ("file", 32 * MIB, servers[:2])):
        hit = size < READ_SET
        print("\n== reads, backend: %s; %s" % (
            "nbdkit --filter=delay file, reads and writes %s" % DELAY if kind == "slowread"
            else "the file itself",
            "the hit path: 32 MiB, all in RAM" if hit else
            "working set %d MiB, RAM cache %s, cache device %d MiB" % (
                READ_SET // MIB, READ_CACHE, READ_DEVICE // MIB)), flush=True)
        out = os.path.join(tmp, "fio.json")

        def measure(uri, size=size):
            for _ in range(2):  # warm: RAM, then the level-2 area
                fio_read(uri, 0, out, size, rw="read", bs="1m", time_based=False)
            time.sleep(1)  # the level-2 thread writes what was staged
            return fio_read(uri, args.seconds, out, size)

        med = rounds(names, args.read_rounds, kind, tmp, path, dev, READ_CACHE, measure,
                     lambda r: "%8.0f IOPS  p50 %8.1f us  p99 %8.1f us" % (r["iops"], r["p50"],
                                                                         r["p99"]))
        print("  %-14s %10s %12s %12s   (median of %d rounds)" % (
            "server", "IOPS", "p50 us", "p99 us", args.read_rounds))
        for s in names:
            print("  %-14s %10.0f %12.1f %12.1f" % (s, med[s]["iops"], med[s]["p50"],
                                                    med[s]["p99"]))
        l2 = med["nbdcached+l2"]["iops"]
        for other in names[1:]:
            q = l2 / med[other]["iops"] if med[other]["iops"] else float("nan")
            target = ""
            if kind == "slowread" and other == "nbdcached":
                target = "  target >= 5: %s" % ("MET" if q >= 5 else "NOT MET")
            elif hit:
                target = "  (the hit path: within noise of 1.0)"
            print("  RATIO read IOPS nbdcached+l2 / %s: %.2f%s" % (other, q, target))


def control(sock, request):
    import socket
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)
        s.sendall((json.dumps(request) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def warm(args, tmp):
    size = args.warm_gib << 30
    path = os.path.join(tmp, "warm.img")
    dev = os.path.join(tmp, "warm.dev")
    t0 = time.time()
    with open(path, "wb") as f:
        for _ in range(size // (8 * MIB)):
            f.write(os.urandom(8 * MIB))
        f.flush()
        os.fsync(f.fileno())
    with open(dev, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 2 * size)
        f.flush()
        os.fsync(f.fileno())
    print("\n== warm restart: working set %d GiB (random data) behind nbdkit --filter=delay "
          "(reads %s), RAM cache 256 MiB, cache device %d GiB (files ready in %.1f s)"
          % (args.warm_gib, DELAY, 2 * args.warm_gib, time.time() - t0), flush=True)
    sock = os.path.join(tmp, "warm.sock")
    ctl = os.path.join(tmp, "warm.ctl")
    argv = [NBDCACHED, "--foreground", "--unix", sock, "--control", ctl, "--export",
            "d=nbdkit:--filter=delay file %s rdelay=%s" % (path, DELAY), "--cache-size", "256M",
            "--threads", "2", "--cache-device", dev, "--cache-device-warm", "all"]
    uri = "nbd+unix:///d?socket=" + sock
    out = os.path.join(tmp, "fio.json")

    def backend_bytes():
        return control(ctl, {"command": "stats"})["cache"]["backend_read_bytes"]

    def one_pass(label, seconds=0):
        a = backend_bytes()
        argv = ["fio", "--name=pass", "--ioengine=nbd", "--uri=" + uri, "--rw=randread",
                "--bs=4k", "--iodepth=8", "--size=%d" % size, "--output-format=json",
                "--output=" + out]
        if seconds:
            argv += ["--time_based", "--runtime=%d" % seconds]
        t = time.time()
        subprocess.run(argv, check=True, timeout=3600, capture_output=True)
        with open(out) as f:
            job = json.load(f)["jobs"][0]["read"]
        got = backend_bytes() - a
        print("  %s: %d MiB read in %.0f s (%.0f IOPS), %.1f MiB of it from the backend: "
              "%.2f%%" % (label, job["io_bytes"] >> 20, time.time() - t, job["iops"],
                          got / MIB, 100.0 * got / job["io_bytes"] if job["io_bytes"] else 0),
              flush=True)
        l2 = control(ctl, {"command": "stats"})["cache"]["cache_device"]["l2"]
        print("    level-2 since the start: %s" % {k: l2[k] for k in (
            "hits", "misses", "skipped", "stale_reads", "read_errors", "stored_bytes",
            "small_read_ns")}, flush=True)
        return got, job["io_bytes"]

    p = Proc(argv, sock, os.path.join(tmp, "warm1.log"), ready="info: ready:")
    try:
        t = time.time()
        for _ in range(2):
            fio_read(uri, 0, out, size, rw="read", bs="1m", time_based=False)
        for _ in range(600):
            if control(ctl, {"command": "stats"})["cache"]["cache_device"]["l2"][
                    "staged_bytes"] == 0:
                break
            time.sleep(0.1)
        l2 = control(ctl, {"command": "stats"})["cache"]["cache_device"]["l2"]
        print("  warmed in %.1f s: level-2 %d MiB used of %d" % (
            time.time() - t, l2["used_bytes"] >> 20, l2["bytes"] >> 20), flush=True)
        t = time.time()
    finally:
        p.stop()
    print("  SIGTERM: stopped in %.1f s (RAM moved to the level-2 area, map kept)" % (
        time.time() - t))
    p = Proc(argv, sock, os.path.join(tmp, "warm2.log"), ready="info: ready:")
    try:
        text = open(os.path.join(tmp, "warm2.log")).read()
        m = re.search(r"level-2 cache warm: \d+ MiB in \d+ ms", text)
        print("  start: %s" % (m.group(0) if m else "no warm line"), flush=True)
        got, read = one_pass("first pass after SIGTERM and start")
        share = 100.0 * got / read if read else 100
        print("  RATIO share of the first pass from the backend after a clean restart: %.2f%%"
              "  target <= 5%%: %s" % (share, "MET" if share <= 5 else "NOT MET"), flush=True)
    finally:
        p.stop(signal.SIGKILL)
    p = Proc(argv, sock, os.path.join(tmp, "warm3.log"), ready="info: ready:")
    try:
        text = open(os.path.join(tmp, "warm3.log")).read()
        m = re.search(r"level-2 cache warm: \d+ MiB in \d+ ms", text)
        print("  start after SIGKILL: %s" % (m.group(0) if m else "no warm line"), flush=True)
        got, read = one_pass("first pass after SIGKILL and start")
        share = 100.0 * got / read if read else 100
        print("  RATIO share of the first pass from the backend after a crash: %.2f%%  "
              "target <= 5%%: %s" % (share, "MET" if share <= 5 else "NOT MET"), flush=True)
    finally:
        p.stop()
    os.unlink(path)
    os.unlink(dev)


def replay(args, tmp):
    path = os.path.join(tmp, "backend.img")
    dev = os.path.join(tmp, "replay.dev")
    size = args.replay_mib * MIB
    if not os.path.exists(path) or os.path.getsize(path) < size:
        zero_file(path, max(SIZE, size))
    # Under half of the log (the whole device: cache-device-use log; with
    # a level-2 area the log is an eighth, at most 1 GiB): no checkpoint
    # round writes it back first. 2.5 times the data: a 16 GiB replay
    # fits on this machine's disk with its backend file.
    zero_file(dev, size * 5 // 2 + 64 * MIB)
    sock = os.path.join(tmp, "r.sock")
    ctl = os.path.join(tmp, "r.ctl")
    argv = [NBDCACHED, "--foreground", "--unix", sock, "--control", ctl, "--export",
            "d=" + path, "--cache-size", "%dM" % (args.replay_mib + 256), "--cache-mode",
            "writeback", "--dirty-expire", "3600", "--dirty-high", "99", "--dirty-low", "98",
            "--cache-device", dev, "--cache-device-use", "log"]
    print("\n== replay: %d MiB written (1 MiB WRITEs, a FLUSH after every 16 MiB) into the "
          "log, SIGKILL, start again" % args.replay_mib, flush=True)
    p = Proc(argv, sock, os.path.join(tmp, "replay1.log"))
    import nbd
    h = nbd.NBD()
    h.connect_uri("nbd+unix:///d?socket=" + sock)
    buf = os.urandom(MIB)
    t0 = time.time()
    for i in range(args.replay_mib):
        h.pwrite(buf, i * MIB)
        if i % 16 == 15:
            h.flush()
    h.flush()
    took = time.time() - t0
    h.shutdown()
    p.stop(signal.SIGKILL)
    print("  written and FLUSHed in %.2f s" % took)
    # The start: the log's end found from its headers, its write-back
    # planned; served from "ready" on while the drain writes it back.
    p = Proc(argv, sock, os.path.join(tmp, "replay2.log"), ready="info: ready:")
    try:
        text = open(os.path.join(tmp, "replay2.log")).read()
        m = re.search(r"(\d+) batch\(es\), (\d+) record\(s\), (\d+) bytes of data to write "
                      r"back, planned in ([0-9.]+) s", text)
        if not m:
            print("  no replay line in the log:\n" + text[-2000:])
            return
        print("  %s" % m.group(0))
        stamp = re.compile(r"^\d+-\d+-\d+T(\d+):(\d+):([0-9.]+)Z")
        lines = [ln for ln in text.splitlines() if stamp.match(ln)]
        ready = [ln for ln in lines if "info: ready:" in ln]

        def secs_of(line):
            g = stamp.match(line).groups()
            return int(g[0]) * 3600 + int(g[1]) * 60 + float(g[2])
        whole = secs_of(ready[0]) - secs_of(lines[0]) if lines and ready else -1
        print("  RESULT the whole start, to serving (finding the log's end, planning its "
              "write-back): %.3f s for %d MiB of log" % (whole, args.replay_mib), flush=True)
        # Reads while the log drains: each one of bytes not written back
        # yet waits for its batch alone.
        h = nbd.NBD()
        h.connect_uri("nbd+unix:///d?socket=" + sock)
        import random
        r = random.Random(7)
        lat, wrong = [], 0
        for _ in range(32):
            off = r.randrange(args.replay_mib) * MIB + r.randrange(256) * 4096
            t1 = time.time()
            got = h.pread(4096, off)
            lat.append(time.time() - t1)
            wrong += got != buf[off % MIB:off % MIB + 4096]
        st = control(ctl, {"command": "stats"})["cache"]["cache_device"]
        print("  RESULT 32 random 4 KiB reads while the log drains: p50 %.1f ms, max %.1f ms, "
              "%d wrong; then %d MiB not written back yet, %d request(s) waited"
              % (statistics.median(lat) * 1e3, max(lat) * 1e3, wrong,
                 st["replay_pending_bytes"] // MIB, st["replay_waits"]), flush=True)
        h.shutdown()
        t2 = time.time()
        while time.time() - t2 < 3600:
            st = control(ctl, {"command": "stats"})["cache"]["cache_device"]
            if st["replay_drain_ns"]:
                break
            time.sleep(0.5)
        drain = st["replay_drain_ns"] / 1e9
        print("  RESULT the drain: %d MiB written back in %.1f s while served (%.0f MiB/s)"
              % (st["replay_drained_bytes"] // MIB, drain,
                 st["replay_drained_bytes"] / MIB / drain if drain else 0), flush=True)
    finally:
        p.stop()
    # The floors: reading the log once, sequentially, O_DIRECT (the drain
    # reads it once), and writing the backend once.
    t0 = time.time()
    subprocess.run(["dd", "if=" + dev, "of=/dev/null", "bs=4M", "iflag=direct",
                    "count=%d" % (size // (4 * MIB))], check=True, capture_output=True)
    read = size / MIB / (time.time() - t0)
    print("  FLOOR the device file read sequentially (dd, 4 MiB O_DIRECT): %.0f MiB/s: reading "
          "a 16 GiB log once takes %.0f s here" % (read, 16 * 1024 / read))
    t0 = time.time()
    subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=4M", "oflag=direct",
                    "conv=notrunc,fdatasync", "count=%d" % (size // (4 * MIB))], check=True,
                   capture_output=True)
    write = size / MIB / (time.time() - t0)
    print("  FLOOR the backend file written sequentially (dd, 4 MiB O_DIRECT, fdatasync): %.0f "
          "MiB/s: writing 16 GiB back takes %.0f s here" % (write, 16 * 1024 / write))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replay-mib", type=int, default=1024)
    ap.add_argument("--read-rounds", type=int, default=3)
    ap.add_argument("--warm-gib", type=int, default=2)
    ap.add_argument("--skip-flush", action="store_true", help="only the reads and the replay")
    ap.add_argument("--dir", default=os.path.join(TOP, BUILD, "bench-cache-device"),
                    help="a directory on the disk to measure (default: under the build)")
    args = ap.parse_args()
    for tool in ("fio", "nbdkit"):
        if not shutil.which(tool):
            sys.exit("bench/cache_device.py: %s is not installed" % tool)
    if not os.path.exists(NBDCACHED):
        sys.exit("bench/cache_device.py: %s is not built" % NBDCACHED)
    os.makedirs(args.dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    try:
        print("bench/cache_device.py: %s on %s (%s), fio %s" % (
            os.path.relpath(NBDCACHED, TOP), tmp, subprocess.run(
                ["stat", "-f", "-c", "%T", tmp], capture_output=True, text=True).stdout.strip(),
            subprocess.run(["fio", "--version"], capture_output=True,
                           text=True).stdout.strip()))
        print("client: fio ioengine=nbd, 4 KiB random writes, iodepth 1, --fsync=1, %d s per "
              "run, %d rounds" % (args.seconds, args.rounds), flush=True)
        if not args.skip_flush:
            flush_latency(args, tmp)
        if args.read_rounds:
            reads(args, tmp)
        if args.warm_gib:
            warm(args, tmp)
        if args.replay_mib:
            replay(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
