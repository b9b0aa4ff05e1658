#!/usr/bin/python3
"""bench/upgrade.py: what a client sees of a live upgrade (nbdcachectl
upgrade), against what it sees of a restart (SIGTERM, then the daemon
started again), in one run. A benchmark: it prints numbers and never fails
on them.

  bench/upgrade.py [--upgrades N] [--dirty-mib M]

One daemon serves a 2 GiB sparse file on tmpfs (cache 1.5 GiB, writeback).
For each setup:

  idle-10, idle-100, idle-1000   that many connections doing nothing, and
                                 4 probes: connections each reading 4 KiB
                                 at QD 1 in a loop, timing every read
  busy-32                        32 probes, nothing idle
  idle-1000+dirty                1000 idle, 4 probes, and --dirty-mib MiB
                                 (default 1024) written just before each
                                 upgrade and left dirty in the cache

it runs --upgrades upgrades (default 5) and prints, per setup: the pause
the daemon reports (p50 and max of pause_ms: from parking the connections
to the hand-over), the longest read a probe saw across the upgrades (p50
and max over upgrades), the command's own time (the write-back before the
pause included), and the connections lost (none expected). Then, as the
peer, a restart of the same daemon with the same connections: the time
from SIGTERM until a new connection reads again, and the connections
lost (all of them: their clients must reconnect). The ratio printed is
the restart's outage over the upgrade's longest probe read.

The target of issue 29: a pause under 1 s with 1,000 connections and a
1 GiB dirty cache on a file backend, excluding the write-back itself.
"""

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
BUILD = os.environ.get("BUILD", "build")
NBDCACHED = os.path.join(TOP, BUILD, "nbdcached")
NBDCACHECTL = os.path.join(TOP, BUILD, "nbdcachectl")

import nbd  # noqa: E402

MiB = 1 << 20
SIZE = 2048 * MiB


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else 0.0


class Daemon:
    def __init__(self, tmp, disk):
        self.tmp = tmp
        self.sock = os.path.join(tmp, "nbd.sock")
        self.control = os.path.join(tmp, "control.sock")
        self.pidfile = os.path.join(tmp, "pid")
        self.args = [NBDCACHED, "--foreground", "--unix", self.sock, "--control", self.control,
                     "--pidfile", self.pidfile, "--threads", "2", "--cache-size", "1536M",
                     "--max-clients", "4096", "--export", "disk=" + disk]
        self.log = open(os.path.join(tmp, "daemon.log"), "a")
        self.start()

    def start(self):
        if os.path.exists(self.pidfile):
            os.unlink(self.pidfile)
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.pid() == self.proc.pid:
                return
            time.sleep(0.05)
        raise SystemExit("the daemon did not start")

    def pid(self):
        try:
            with open(self.pidfile) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def uri(self):
        return "nbd+unix:///disk?socket=" + self.sock

    def stop(self):
        pid = self.pid()
        if pid <= 0:
            return
        os.kill(pid, signal.SIGTERM)
        for _ in range(1200):
            try:
                got, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return
            if got == pid:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class Probe:
    """A connection reading 4 KiB at QD 1, timing each read."""

    def __init__(self, uri, offset):
        self.h = nbd.NBD()
        self.h.connect_uri(uri)
        self.offset = offset
        self.samples = []  # (start, seconds)
        self.errors = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        end = time.time() + 3600
        while not self.stop.is_set() and time.time() < end:
            t0 = time.monotonic()
            try:
                self.h.pread(4096, self.offset)
            except nbd.Error:
                self.errors += 1
                self.stop.wait(0.05)
                continue
            self.samples.append((t0, time.monotonic() - t0))

    def longest(self, t0, t1):
        return max((s for start, s in self.samples if t0 <= start <= t1), default=0.0)

    def close(self):
        self.stop.set()
        self.t.join(30)
        try:
            self.h.shutdown()
        except nbd.Error:
            pass


def connect_idle(uri, n):
    hs = []
    for _ in range(n):
        h = nbd.NBD()
        h.connect_uri(uri)
        hs.append(h)
    return hs


def alive(hs):
    lost = 0
    for h in hs:
        try:
            h.pread(512, 0)
        except nbd.Error:
            lost += 1
    return lost


def dirty(d, mib):
    """mib MiB written in 1 MiB WRITEs (not flushed): dirty in the cache."""
    if not mib:
        return
    h = nbd.NBD()
    h.connect_uri(d.uri())
    buf = os.urandom(MiB)
    for i in range(mib):
        h.pwrite(buf, 512 * MiB + i * MiB)
    h.shutdown()


def upgrade_setup(d, name, idle, probes, upgrades, dirty_mib):
    hs = connect_idle(d.uri(), idle)
    ps = [Probe(d.uri(), (i % 256) * 4096) for i in range(probes)]
    time.sleep(0.5)
    pauses, longest, cmd_times = [], [], []
    for _ in range(upgrades):
        dirty(d, dirty_mib)
        t0 = time.monotonic()
        p = subprocess.run([NBDCACHECTL, "--control", d.control, "--json", "upgrade"],
                           capture_output=True, text=True, timeout=600)
        t1 = time.monotonic()
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if p.returncode != 0:
            print("  %s: upgrade failed: %s" % (name, p.stderr.strip()))
            continue
        r = json.loads(p.stdout)
        pauses.append(r["pause_ms"])
        cmd_times.append((t1 - t0) * 1000)
        for _ in range(100):
            if d.pid() == r["pid"]:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        longest.append(max(pr.longest(t0, t1 + 0.5) for pr in ps) * 1000 if ps else 0.0)
    lost = alive(hs) + sum(1 for pr in ps if pr.errors)
    for pr in ps:
        pr.close()
    for h in hs:
        try:
            h.shutdown()
        except nbd.Error:
            pass
    return {"name": name, "pause_p50": pct(pauses, 0.5), "pause_max": max(pauses, default=0),
            "probe_p50": pct(longest, 0.5), "probe_max": max(longest, default=0.0),
            "cmd_p50": pct(cmd_times, 0.5), "cmd_max": max(cmd_times, default=0.0),
            "lost": lost, "conns": idle + probes, "runs": len(pauses)}


def restart_setup(d, idle, probes):
    """The peer: SIGTERM and start again; the outage a new client sees."""
    hs = connect_idle(d.uri(), idle)
    ps = [Probe(d.uri(), (i % 256) * 4096) for i in range(probes)]
    time.sleep(0.5)
    t0 = time.monotonic()
    d.stop()
    d.start()
    h = nbd.NBD()
    for _ in range(6000):
        try:
            h.connect_uri(d.uri())
            h.pread(4096, 0)
            break
        except nbd.Error:
            h = nbd.NBD()
            time.sleep(0.005)
    outage = (time.monotonic() - t0) * 1000
    h.shutdown()
    lost = alive(hs) + sum(1 for pr in ps if pr.errors)
    for pr in ps:
        pr.close()
    return {"outage": outage, "lost": lost, "conns": idle + probes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upgrades", type=int, default=5)
    ap.add_argument("--dirty-mib", type=int, default=1024)
    args = ap.parse_args()
    if not os.access(NBDCACHED, os.X_OK):
        raise SystemExit("%s is not built (make)" % NBDCACHED)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the new daemons stay ours
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = tempfile.mkdtemp(prefix="nbdcached-bench-upgrade-", dir=base)
    d = None
    try:
        disk = os.path.join(tmp, "disk.img")
        with open(disk, "wb") as f:
            f.truncate(SIZE)
        d = Daemon(tmp, disk)
        rows = []
        for name, idle, probes, mib in (("idle-10", 10, 4, 0), ("idle-100", 100, 4, 0),
                                        ("idle-1000", 1000, 4, 0), ("busy-32", 0, 32, 0),
                                        ("idle-1000+dirty", 1000, 4, args.dirty_mib)):
            rows.append(upgrade_setup(d, name, idle, probes, args.upgrades, mib))
            print("  %s done" % name, flush=True)
        peer = restart_setup(d, 1000, 4)
        print()
        print("%-16s %6s %5s %10s %10s %10s %10s %10s %10s %5s" % (
            "setup", "conns", "runs", "pause p50", "pause max", "probe p50", "probe max",
            "cmd p50", "cmd max", "lost"))
        for r in rows:
            print("%-16s %6d %5d %8.0fms %8.0fms %8.1fms %8.1fms %8.0fms %8.0fms %5d" % (
                r["name"], r["conns"], r["runs"], r["pause_p50"], r["pause_max"],
                r["probe_p50"], r["probe_max"], r["cmd_p50"], r["cmd_max"], r["lost"]))
        print("%-16s %6d %5d  outage %.0f ms until a new connection reads; %d of %d "
              "connections lost" % ("restart (peer)", peer["conns"], 1, peer["outage"],
                                    peer["lost"], peer["conns"]))
        big = rows[2]
        if big["probe_max"] > 0:
            print("\nrestart outage / upgrade's longest probe read (idle-1000): %.1fx"
                  % (peer["outage"] / big["probe_max"]))
        dirty_row = rows[4]
        print("target: pause < 1000 ms with 1000 connections and %d MiB dirty: pause max "
              "%.0f ms (%s); the command took up to %.0f ms with the write-back"
              % (args.dirty_mib, dirty_row["pause_max"],
                 "met" if dirty_row["pause_max"] < 1000 else "NOT met", dirty_row["cmd_max"]))
    finally:
        if d:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
