#!/usr/bin/python3
"""cache_device_l2: the cache device's level-2 cache (--cache-device,
cache-device-use l2 or both).

A 96 MiB working set on a 256 MiB backend file, served through nbdkit's
delay filter (reads 2 ms: a backend slower than the device, as the
level-2 cache is for; over a faster one small fills go to the backend),
a RAM cache of 16 MiB and a cache device of 176 MiB (a level-2 area of
about 150 MiB); a byte model of the whole export says what every read
must return.

  1  Level-2 at work: the working set written and FLUSHed, read once
     (evictions fill the level-2 area), then read again: at most 5% of
     its bytes come from the backend, the rest from the device (stats:
     hits, hit bytes, stored bytes; nbdcachectl stats' level-2 line; the
     SIGUSR1 line's device_l2_* figures).
  2  Never stale: rounds of 4 KiB and 1 MiB WRITEs, WRITE_ZEROES and TRIMs
     over ranges the level-2 area holds and RAM does not, each round then
     read whole against the model; then the same through a writethrough
     daemon (whose WRITEs go direct to the backend).
  3  Warm restart: SIGTERM (the log says the level-2 map was kept);
     a start with the default cache-device-warm files does not use the
     pages of the nbdkit backend (a write to it while the daemon was down
     could not be told: the log says so); with cache-device-warm all a
     new start reads the map back (its log line, and --check-config
     says warm), and the first pass over the working set reads at most
     5% of its bytes from the backend, every byte as the model says.
  4  The backend file itself (the export's backend, so its modification
     and change times are recorded) modified while the daemon was down: its pages are
     not used (the log says why), and a read returns the file's new bytes.
  5  After SIGKILL: warm as well. The working set read (the level-2
     area filled, the map given time to take the pages), then SIGKILL:
     the next start reads the map back, and its first pass reads at most
     5% from the backend. Then never stale across a crash: a round of
     writes over pages the area holds, FLUSHed, and SIGKILL at once
     (writeback and the replay's log still in flight), several times:
     each start replays the log, and the whole working set reads as the
     model says; then a few 4 KiB writes over claimed pages, FLUSHed, and
     SIGKILL at once (only the replay removes those pages); and rounds
     through a writethrough daemon (its writes go direct to the backend)
     each ended by SIGKILL.
  6  cache-device-use: log (no level-2 cache: the stats say off, evictions
     are not stored) and l2 (a FLUSH is not answered from the log: no
     commits, the bytes on the backend file after it).
  7  Device faults (the device a file on faultfs, cache-device-use l2):
     reads from the level-2 area failing go to the backend (read errors
     counted, every byte as the model says); then writes failing turn the
     level-2 cache off with a loud line, and reads go on from the
     backend; the daemon stops with status 0.
  8  Power cuts: the device a file on faultfs; rounds of writes
     FLUSHed, SIGKILL and a power cut of the device (back to its last
     fsync), a start (warm: the map's claims are made durable in order)
     and the whole working set read as the model says.
"""

import os
import random
import re
import subprocess
import time
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import faults  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 256 * MIB
WORKING = 96 * MIB
BASE = 64 * MIB              # the working set: [BASE, BASE + WORKING)
DEVICE = 176 * MIB
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect
SEED = int(os.environ.get("L2_SEED", "20261206"))
CRASH_ROUNDS = int(os.environ.get("L2_CRASH_ROUNDS", "3"))


class Model:
    """The export's bytes as every acknowledged command left them."""

    def __init__(self, path):
        self.buf = bytearray(nbdtest.read_at(path, 0, SIZE))

    def write(self, off, data):
        self.buf[off:off + len(data)] = data

    def zero(self, off, n):
        self.buf[off:off + n] = bytes(n)


class Run:
    def __init__(self, tmp):
        self.tmp = tmp
        self.disk = os.path.join(tmp, "disk.img")
        self.dev = os.path.join(tmp, "cache.dev")
        self.rng = random.Random(SEED)
        with open(self.disk, "wb") as f:
            f.truncate(SIZE)
            f.seek(BASE)
            f.write(self.rng.randbytes(WORKING))
        nbdtest.sparse_file(self.dev, DEVICE)
        self.model = Model(self.disk)
        self.d = None

    def start(self, mode="writeback", use=None, what=None, backend=None, warm_all=False,
              opts=""):
        # A check that failed half way left its daemon running: it goes
        # (SIGKILL), not to outlive the test.
        if self.d and self.d.alive():
            self.d.kill()
            self.d.logf.close()
        work = os.path.join(self.tmp, "d%d" % len(os.listdir(self.tmp)))
        os.mkdir(work)
        extra = ["--cache-device", self.dev, "--cache-size", "16M", "--cache-mode", mode,
                 "--hugepages", "off"]
        if use:
            extra += ["--cache-device-use", use]
        if warm_all:
            extra += ["--cache-device-warm", "all"]
        if backend is None:
            backend = "nbdkit:--filter=delay file %s rdelay=2ms" % self.disk
        self.d = nbdtest.CheckedDaemon([("disk", backend, opts)], workdir=work, tcp=False,
                                       extra=extra, what=what)
        self.h = nbdtest.libnbd_handle(self.d.unix_uri("disk"))
        return self.d

    def stats(self):
        st = nbdtest.control_request(self.d.control, {"command": "stats"})
        dev = st["cache"].get("cache_device")
        require(dev and "l2" in dev, "stats: no cache_device.l2: %s" % sorted(st["cache"]))
        return st["cache"], dev["l2"]

    def backend_read_bytes(self):
        cache, _ = self.stats()
        return cache["backend_read_bytes"]

    def settle(self):
        """Wait until nothing is staged for the level-2 area."""
        for _ in range(400):
            _, l2 = self.stats()
            if l2["staged_bytes"] == 0:
                return l2
            time.sleep(0.05)
        raise Failed("level-2 staging did not drain: %s" % l2)

    def read_all(self, what, chunk=MIB):
        """Read the working set (random order of 1 MiB chunks) against the
        model; the bytes read from the backend meanwhile."""
        before = self.backend_read_bytes()
        offs = list(range(BASE, BASE + WORKING, chunk))
        self.rng.shuffle(offs)
        for off in offs:
            got = self.h.pread(chunk, off)
            want = self.model.buf[off:off + chunk]
            if got != want:
                nbdtest.require_same(got, want, "%s: read at %d" % (what, off), base=off)
        return self.backend_read_bytes() - before

    def read_pages(self, what, count):
        """count random 4 KiB reads over the working set against the model;
        the bytes read from the backend meanwhile."""
        before = self.backend_read_bytes()
        for _ in range(count):
            off = BASE + self.rng.randrange(WORKING // 4096) * 4096
            got = self.h.pread(4096, off)
            if got != self.model.buf[off:off + 4096]:
                nbdtest.require_same(got, self.model.buf[off:off + 4096],
                                     "%s: read at %d" % (what, off), base=off)
        return self.backend_read_bytes() - before


def level2_at_work(r):
    r.start()
    data = r.rng.randbytes(WORKING)
    for off in range(0, WORKING, 4 * MIB):
        r.h.pwrite(data[off:off + 4 * MIB], BASE + off)
        r.model.write(BASE + off, data[off:off + 4 * MIB])
    r.h.flush()
    first = r.read_all("first pass")
    r.settle()
    second = r.read_all("second pass")
    cache, l2 = r.stats()
    log("  first pass %d MiB from the backend, second %.1f MiB; level-2: %s" % (
        first >> 20, second / MIB,
        {k: l2[k] for k in ("bytes", "used_bytes", "hits", "hit_bytes", "misses",
                            "stored_bytes", "dropped_bytes")}))
    expect(l2["on"] and l2["bytes"] > WORKING, "level-2 area: %s" % l2)
    expect(second <= WORKING // 20, "the second pass read %d bytes of %d from the backend "
           "(more than 5%%)" % (second, WORKING))
    expect(l2["hit_bytes"] >= WORKING // 2, "level-2 hit bytes %d" % l2["hit_bytes"])
    res = nbdtest.run([nbdtest.NBDCACHECTL, "--control", r.d.control, "stats"])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("level-2")]
    expect(line and "hits" in line[0], "nbdcachectl stats: no level-2 line:\n%s" % res.stdout)
    log("  nbdcachectl: %s" % (line[0] if line else ""))
    usr1 = nbdtest.stats(r.d)
    expect(usr1.get("device_l2_hits", 0) >= 1 and usr1.get("device_l2_bytes", 0) > 0,
           "SIGUSR1 line: %s" % {k: v for k, v in usr1.items() if k.startswith("device_l2")})


def one_round(r, i, settle=True):
    """Writes of every kind over the working set, then all of it read
    (settle: and the level-2 staging drained); without settle, what it
    wrote is only FLUSHed."""
    h = r.h
    for _ in range(60):
        kind = r.rng.randrange(4)
        if kind == 0:
            off = BASE + r.rng.randrange(WORKING // 4096) * 4096
            data = r.rng.randbytes(4096)
            h.pwrite(data, off)
            r.model.write(off, data)
        elif kind == 1:
            off = BASE + r.rng.randrange(WORKING // MIB) * MIB
            data = r.rng.randbytes(MIB)
            h.pwrite(data, off)
            r.model.write(off, data)
        elif kind == 2:
            off = BASE + r.rng.randrange(WORKING // 65536) * 65536
            h.zero(65536, off)
            r.model.zero(off, 65536)
        else:
            # TRIM, then the range written: what a trimmed range reads as
            # is the backend's to say, so the model keeps only the write.
            off = BASE + r.rng.randrange(WORKING // 65536) * 65536
            h.trim(65536, off)
            data = r.rng.randbytes(65536)
            h.pwrite(data, off)
            r.model.write(off, data)
        if r.rng.randrange(8) == 0:
            h.flush()
        if r.rng.randrange(4) == 0:
            r.read_pages("round %d" % i, 16)
    h.flush()
    if settle:
        r.read_all("round %d" % i)
        r.settle()


def never_stale(r):
    for i in range(4):
        one_round(r, i)
    _, l2 = r.stats()
    log("  level-2 after the rounds: %s" % {k: l2[k] for k in (
        "hits", "stale_reads", "invalidated_bytes", "stored_bytes", "used_bytes")})
    expect(l2["invalidated_bytes"] > 0, "no level-2 page was written over: the rounds did "
           "not reach the level-2 area")
    expect(l2["hits"] > 0, "no level-2 hit during the rounds")
    r.d.stop()
    r.start(mode="writethrough", what="writethrough")
    r.read_all("writethrough, before")
    r.settle()
    for i in range(2):
        one_round(r, 10 + i)
    r.d.stop()


def warm_restart(r):
    r.start()
    r.read_all("before the restart")
    r.settle()
    r.d.stop()
    r.start(what="cache-device-warm files")
    text = r.d.log_text()
    expect("could not be told (not a regular file)" in text and
           "level-2 cache warm" not in text,
           "cache-device-warm files used the pages of an nbdkit backend:\n%s" % text[-1500:])
    r.read_all("before the restart, again")
    r.settle()
    r.d.stop()
    with open(r.d.logpath) as f:
        text = f.read()
    m = re.search(r"level-2 map of (\d+) pages", text)
    require(m, "the clean close did not say it kept the level-2 map")
    log("  %s" % m.group(0))
    nbdtest.own_device(r.dev)
    p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--export",
                        "disk=nbdkit:--filter=delay file %s rdelay=2ms" % r.disk,
                        "--cache-device", r.dev], capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    expect(p.returncode == 0 and "warm: its map is kept" in out,
           "--check-config: exit %d: %s" % (p.returncode, out))
    r.start(what="warm start", warm_all=True)
    m = re.search(r"level-2 cache warm: (\d+) MiB in (\d+) ms", r.d.log_text())
    require(m, "no 'level-2 cache warm' line at start")
    log("  %s" % m.group(0))
    missed = first_pass(r, "first pass after the restart")
    expect(missed <= WORKING // 4 // 20, "after a clean restart %d bytes of %d read came from "
           "the backend not by choice (more than 5%%)" % (missed, WORKING // 4))
    r.d.stop()


def modified_while_down(r):
    # Once with the file as the backend (its time recorded by the close).
    r.start(backend=r.disk, what="the file as the backend")
    r.read_all("the file as the backend")
    r.settle()
    r.d.stop()
    off = BASE + 8 * MIB
    data = r.rng.randbytes(MIB)
    with open(r.disk, "r+b") as f:
        f.seek(off)
        f.write(data)
        os.fsync(f.fileno())
    r.model.write(off, data)
    r.start(backend=r.disk, what="after the backend file was modified")
    text = r.d.log_text()
    expect("was changed (its modification or change time) since the level-2 map was last "
           "written" in text, "the start did not say the backend file was modified; it "
           "said:\n%s" % text[-2000:])
    got = r.h.pread(MIB, off)
    nbdtest.require_same(got, data, "the modified range", base=off)
    r.read_all("after the modification")
    r.settle()
    r.d.stop()
    r.start(what="the delayed backend again")


def first_pass(r, what):
    """A first pass of random 4 KiB reads over a quarter of the working
    set: the bytes the level-2 cache could not give (apart from the small
    fills it sent to the backend by choice while the device answered
    slower: level2_worth, a sanitizer build beside another test, a busy
    disk; those say nothing of how warm it is)."""
    _, before = r.stats()
    first = r.read_pages(what, WORKING // 4096 // 4)
    _, after = r.stats()
    skipped = (after["skipped"] - before["skipped"]) * 4096
    log("  %s: %d random 4 KiB reads, %.1f MiB from the backend (%.1f%% of what was "
        "read), %.1f MiB of it sent there by choice (the device answered slower)"
        % (what, WORKING // 4096 // 4, first / MIB, 100.0 * first / (WORKING // 4),
           skipped / MIB))
    return max(first - skipped, 0)


def map_settle(r):
    """Wait until the level-2 map has taken what the ring wrote (it does
    after 200 ms idle)."""
    for _ in range(200):
        _, l2 = r.stats()
        if l2["staged_bytes"] == 0 and l2["map_pending_bytes"] == 0:
            return
        time.sleep(0.05)
    raise Failed("the level-2 map did not take what the ring wrote: %s" % l2)


def after_kill(r):
    r.d.stop()
    r.start(what="warm all", warm_all=True)
    r.read_all("before SIGKILL")
    map_settle(r)
    _, l2 = r.stats()
    log("  level-2 before SIGKILL: %s" % {k: l2[k] for k in (
        "used_bytes", "stored_bytes", "loaded_bytes", "hits", "map_writes")})
    r.d.kill()
    r.d.logf.close()
    r.start(what="after SIGKILL", warm_all=True)
    m = re.search(r"level-2 cache warm: (\d+) MiB in (\d+) ms", r.d.log_text())
    require(m, "no 'level-2 cache warm' line at the start after SIGKILL:\n%s"
            % r.d.log_text()[-2000:])
    log("  %s" % m.group(0))
    missed = first_pass(r, "first pass after SIGKILL")
    expect(missed <= WORKING // 4 // 20, "after SIGKILL %d bytes of %d read came from the "
           "backend not by choice (more than 5%%)" % (missed, WORKING // 4))
    r.read_all("after SIGKILL")
    # Never stale across a crash: writes over what the area holds, then
    # SIGKILL right after their FLUSH.
    for i in range(CRASH_ROUNDS):
        map_settle(r)
        one_round(r, 20 + i, settle=False)
        r.d.kill()
        r.d.logf.close()
        r.start(what="after SIGKILL %d" % (i + 1), warm_all=True)
        text = r.d.log_text()
        m = re.search(r"level-2 cache warm: (\d+) MiB", text)
        log("  start %d after SIGKILL: %s; %s" % (
            i + 1, m.group(0) if m else "cold",
            "log found" if "to write back" in text else "nothing replayed"))
        r.read_all("after SIGKILL %d" % (i + 1))
    # Writethrough: the writes go direct to the backend, each after the map
    # stopped claiming what it replaces.
    r.d.stop()
    r.start(mode="writethrough", what="writethrough, warm all", warm_all=True)
    for i in range(2):
        r.read_all("writethrough, before SIGKILL %d" % (i + 1))
        map_settle(r)
        one_round(r, 30 + i, settle=False)
        r.d.kill()
        r.d.logf.close()
        r.start(mode="writethrough", what="writethrough, after SIGKILL %d" % (i + 1),
                warm_all=True)
        r.read_all("writethrough, after SIGKILL %d" % (i + 1))
    r.d.stop()
    r.start(what="after the writethrough crashes", warm_all=True)
    # And at once: a few 4 KiB writes over pages the map claims, FLUSHed,
    # SIGKILL before the writeback or the level-2 thread could have
    # written the map again: only the replay removes them.
    for i in range(CRASH_ROUNDS):
        r.read_all("before quick SIGKILL %d" % (i + 1))
        map_settle(r)
        for _ in range(8):
            off = BASE + r.rng.randrange(WORKING // 4096) * 4096
            data = r.rng.randbytes(4096)
            r.h.pwrite(data, off)
            r.model.write(off, data)
        r.h.flush()
        r.d.kill()
        r.d.logf.close()
        r.start(what="after quick SIGKILL %d" % (i + 1), warm_all=True)
        r.read_all("after quick SIGKILL %d" % (i + 1))
    _, l2 = r.stats()
    log("  level-2 after the crashes: %s" % {k: l2[k] for k in (
        "hits", "stale_reads", "loaded_bytes", "map_writes")})
    expect(l2["loaded_bytes"] > 0, "the last start after SIGKILL loaded nothing: %s" % l2)
    r.d.stop()


def uses(r):
    r.start(use="log", what="cache-device-use log")
    r.read_all("use log")
    _, l2 = r.stats()
    expect(not l2["on"] and l2["stored_bytes"] == 0, "cache-device-use log: %s" % l2)
    r.d.stop()
    r.start(use="l2", what="cache-device-use l2")
    off = BASE + 40 * MIB
    data = r.rng.randbytes(MIB)
    r.h.pwrite(data, off)
    r.model.write(off, data)
    r.h.flush()
    st = nbdtest.control_request(r.d.control, {"command": "stats"})
    dev = st["cache"]["cache_device"]
    expect(dev["commits"] == 0 and dev["use"] == "l2", "cache-device-use l2: the log was "
           "used: %s" % {k: dev[k] for k in ("commits", "records", "use")})
    nbdtest.require_same(nbdtest.read_at(r.disk, off, MIB), data,
                         "cache-device-use l2: the backend file after FLUSH", base=off)
    r.read_all("use l2")
    r.settle()
    _, l2 = r.stats()
    expect(l2["on"] and l2["stored_bytes"] > 0, "cache-device-use l2: %s" % l2)
    r.d.stop()


def l2_policy(r):
    """An export's cache-device-l2: off keeps its pages out of the area and
    reads none from it; on reads from it even over a backend that answers
    faster (a file in the page cache), where auto may skip."""
    r.start(what="cache-device-l2=off", opts="cache-device-l2=off")
    first = r.read_all("cache-device-l2=off, first pass")
    second = r.read_all("cache-device-l2=off, second pass")
    _, l2 = r.stats()
    log("  off: %d and %d MiB from the backend; level-2 stored %d, hits %d"
        % (first >> 20, second >> 20, l2["stored_bytes"], l2["hits"]))
    expect(l2["on"] and l2["stored_bytes"] == 0 and l2["hits"] == 0,
           "cache-device-l2=off: the export used the level 2: %s" % l2)
    expect(second >= WORKING // 2, "cache-device-l2=off: the second pass read %d bytes of %d "
           "from the backend: served from elsewhere than RAM and the backend" % (second, WORKING))
    r.d.stop()
    r.start(what="cache-device-l2=on", opts="cache-device-l2=on", backend=r.disk)
    r.read_all("cache-device-l2=on, first pass")
    r.settle()
    r.read_pages("cache-device-l2=on, 4 KiB reads", 2000)
    _, l2 = r.stats()
    log("  on, a file backend: level-2 hits %d, skipped %d" % (l2["hits"], l2["skipped"]))
    expect(l2["hits"] > 0 and l2["skipped"] == 0,
           "cache-device-l2=on: fills went to the backend rather than the level 2: %s" % l2)
    r.d.stop()


def fault_device(fs):
    """A fresh (zeroed: formatted at start) cache device file on faultfs."""
    dev = fs.path("cache.dev")
    with open(dev, "wb") as f:
        f.truncate(DEVICE)
        os.fsync(f.fileno())
    return dev


def device_faults(r):
    with faults.FaultFS(os.path.join(r.tmp, "faultfs")) as fs:
        saved, r.dev = r.dev, fault_device(fs)
        try:
            r.start(use="l2", what="the device on faultfs")
            r.read_all("faultfs, warming")
            r.settle()
            r.read_all("faultfs, warm")
            _, l2 = r.stats()
            require(l2["hits"] > 0, "no level-2 hit on faultfs: %s" % l2)
            fs.set("fail-read")
            r.read_all("the device failing reads")
            _, l2 = r.stats()
            log("  reads failing: %s" % {k: l2[k] for k in ("hits", "read_errors", "on")})
            expect(l2["read_errors"] > 0 and l2["on"], "reads failing: %s" % l2)
            fs.set("fail-write")
            # New evictions: the rest of the export read through RAM.
            for off in range(0, BASE, MIB):
                got = r.h.pread(MIB, off)
                if got != r.model.buf[off:off + MIB]:
                    nbdtest.require_same(got, r.model.buf[off:off + MIB], "read at %d" % off,
                                         base=off)
            for _ in range(100):
                _, l2 = r.stats()
                if not l2["on"]:
                    break
                time.sleep(0.05)
            expect(not l2["on"] and l2["failed"], "writes failing: %s" % l2)
            expect("the level-2 cache is off from now on" in r.d.log_text(),
                   "no loud line when the level-2 area could not be written")
            r.read_all("the level-2 cache off")
            fs.set("ok")
            r.d.stop()
        finally:
            r.dev = saved


def power_cut(r):
    """The device on faultfs: rounds of writes FLUSHed, SIGKILL and a power
    cut of the device (every file back to its last fsync), a start: the
    map's claims that survive are true, every byte as the model says."""
    with faults.FaultFS(os.path.join(r.tmp, "faultfs-power")) as fs:
        saved, r.dev = r.dev, fault_device(fs)
        loaded = []
        try:
            r.start(what="the device on faultfs, power cuts", warm_all=True)
            for i in range(CRASH_ROUNDS):
                r.read_all("power cut %d, before" % (i + 1))
                map_settle(r)
                one_round(r, 40 + i, settle=False)
                r.d.kill()
                r.d.logf.close()
                fs.power_loss()
                r.start(what="after power cut %d" % (i + 1), warm_all=True)
                m = re.search(r"level-2 cache warm: (\d+) MiB", r.d.log_text())
                log("  start after power cut %d: %s" % (i + 1, m.group(0) if m else "cold"))
                _, l2 = r.stats()
                loaded.append(l2["loaded_bytes"])
                r.read_all("after power cut %d" % (i + 1))
            r.d.stop()
        finally:
            r.dev = saved
    expect(any(loaded), "no start after a power cut found the level-2 cache warm: %s" % loaded)


def main():
    with nbdtest.tempdir() as tmp:
        r = Run(tmp)
        CHECKS.run("level-2 at work", level2_at_work, r)
        CHECKS.run("never stale", never_stale, r)
        CHECKS.run("warm restart", warm_restart, r)
        CHECKS.run("backend modified while down", modified_while_down, r)
        CHECKS.run("after SIGKILL", after_kill, r)
        CHECKS.run("cache-device-use", uses, r)
        CHECKS.run("cache-device-l2 of an export", l2_policy, r)
        CHECKS.run("device faults", device_faults, r)
        CHECKS.run("power cut", power_cut, r)
        if r.d and r.d.alive():
            r.d.stop()
    CHECKS.finish("cache_device_l2")


if __name__ == "__main__":
    main()
