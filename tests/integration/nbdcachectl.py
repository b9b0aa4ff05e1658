#!/usr/bin/python3
"""nbdcachectl: every command against a real daemon doing real I/O.

One daemon (64 MiB writeback cache, --dirty-expire 3600 so nothing is
written back behind the test's back) with four exports:

  spare   from a config file (--config), removed again by the reload check
  disk    16 MiB file of random data: description, block-size 4096,
          max-connections 3
  other   8 MiB file: readonly, block-size 512, writethrough, seq-cutoff 1M,
          dirty-high 60, dirty-low 10
  faulty  nbdkit memory behind the error filter: writes fail with EIO while
          a trigger file exists

Each check drives I/O through python3-libnbd and compares what
`nbdcachectl --json` reports with what was done, field by field, and the
human output with the same facts:

  status       pid is the daemon's, listen holds its Unix and TCP sockets,
               config is the file, counts and cache size as configured
  exports      every field as configured; connections as opened
  stats        N warm 4 KiB reads of cached data: hits +N exactly, no miss,
               no backend read; the documented fields all present
  flush        dirty_bytes equals the block-aligned bytes written, the
               backend file does not have them yet; after flush it does and
               dirty_bytes is 0 (plain, --json and on a pseudo-terminal)
  flush EIO    the faulty backend: exit 1 with the message, errno EIO, data
               still dirty; set-mode refused with EIO, mode unchanged (both
               asked twice: human and --json); then the fault is removed
               and flush succeeds, the backend has the data
  drop-clean   clean data dropped (the next read is a miss and reaches the
               backend), dirty data kept
  set-mode     cache_mode changes, dirty data is written back, the next
               write reaches the backend file at once; none/bogus refused
  compact      ok with every documented field
  top          --json rates of a steady warm-read load: reads/s > 0, hit
               ratio 1; human form: two blocks, no ANSI codes on a pipe
  attach       the exact nbd-client command line; --run runs it (a fake
               nbd-client on PATH records its arguments)
  errors       unknown export: exit 1 and the daemon's message (ENOENT);
               a bad control path: exit 1 naming it; usage errors exit 2
  reload       the config file rewritten: added/removed as expected
"""

import json
import os
import pty
import random
import re
import select
import stat
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
DISK_SIZE = 16 * MIB
OTHER_SIZE = 8 * MIB
KIT_SIZE = 16 * MIB
CACHE_SIZE = 64 * MIB
SEED = 8086
CTL = nbdtest.NBDCACHECTL
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, ValueError, KeyError, TypeError))
expect = CHECKS.expect

CACHE_FIELDS = ("cache_bytes", "used_bytes", "entries", "dirty_bytes", "hits", "misses",
                "partial_hits", "backend_reads", "backend_read_bytes", "backend_writes",
                "backend_write_bytes", "writeback_bytes", "writeback_rate", "evictions",
                "writeback_errors", "bypass_reads", "direct_writes", "metadata_bytes")
EXPORT_STAT_FIELDS = ("connections", "hits", "misses", "partial_hits", "dirty_bytes",
                      "backend_reads", "backend_read_bytes", "backend_writes",
                      "backend_write_bytes", "writeback_bytes", "writeback_rate", "evictions",
                      "writeback_errors")


class Nbdkit(nbdtest.NbdServer):
    """nbdkit -f -U SOCK -P PIDFILE ARGS..., started and stopped by PID."""

    def __init__(self, tmp, args):
        self.label = "nbdkit"
        self.sock = os.path.join(tmp, "kit.sock")
        self.pidfile = os.path.join(tmp, "kit.pid")
        self.logpath = os.path.join(tmp, "kit.log")
        self.spawn(["nbdkit", "-f", "-U", self.sock, "-P", self.pidfile] + list(args),
                   self.ready, "write its pidfile")

    def ready(self):
        try:
            with open(self.pidfile) as f:
                return f.read().strip() == str(self.proc.pid)
        except OSError:
            return False


# ---- Running nbdcachectl. ----

def ctl(d, *args, rc=0, env=None):
    """nbdcachectl --control DAEMON'S ARGS...; the exit status must be rc."""
    p = nbdtest.run([CTL, "--control", d.control] + list(args), check_rc=False, env=env,
                    timeout=120)
    require(p.returncode == rc, "nbdcachectl %s: exit %d, expected %d; stderr: %r"
            % (" ".join(args), p.returncode, rc, p.stderr.strip()))
    return p


def parse_one_object(p, what):
    lines = p.stdout.splitlines()
    require(len(lines) == 1, "%s: %d lines on stdout, expected one JSON object: %r"
            % (what, len(lines), p.stdout[:500]))
    obj = json.loads(lines[0])
    require(isinstance(obj, dict), "%s: not a JSON object: %r" % (what, lines[0][:200]))
    return obj


def ctl_json(d, *args):
    """--json ARGS: must succeed; the reply object (ok must be true)."""
    obj = parse_one_object(ctl(d, "--json", *args), " ".join(args))
    require(obj.get("ok") is True, "%s: ok is %r" % (" ".join(args), obj.get("ok")))
    return obj


def ctl_refused(d, want_errno, *args):
    """ARGS must exit 1 with "nbdcachectl: MESSAGE" on stderr and, with
    --json, print {"ok": false, "error": ..., "errno": want_errno}."""
    p = ctl(d, *args, rc=1)
    expect(p.stderr.startswith("nbdcachectl: ") and len(p.stderr.strip()) > 13,
           "%s: stderr %r, expected 'nbdcachectl: MESSAGE'" % (" ".join(args), p.stderr))
    expect(p.stdout == "", "%s: refused but printed %r" % (" ".join(args), p.stdout))
    obj = parse_one_object(ctl(d, "--json", *args, rc=1), "--json " + " ".join(args))
    expect(obj.get("ok") is False, "%s: ok is %r" % (" ".join(args), obj.get("ok")))
    expect(obj.get("errno") == want_errno, "%s: errno %r, expected %s"
           % (" ".join(args), obj.get("errno"), want_errno))
    expect(isinstance(obj.get("error"), str) and obj["error"],
           "%s: no error text: %r" % (" ".join(args), obj))
    return obj


def export_stats(d, name):
    """stats --json NAME: (the whole reply, the export's object)."""
    r = ctl_json(d, "stats", name)
    ex = r.get("exports")
    require(isinstance(ex, list) and len(ex) == 1 and ex[0].get("name") == name,
            "stats %s: exports is %r, expected one object named %s" % (name, ex, name))
    return r, ex[0]


def export_info(d, name):
    for e in ctl_json(d, "exports")["exports"]:
        if e.get("name") == name:
            return e
    raise Failed("exports: no export named %s" % name)


def is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_ratio(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


def fields(obj, want, what):
    for k, v in want.items():
        expect(obj.get(k) == v, "%s: %s is %r, expected %r" % (what, k, obj.get(k), v))


def counts(obj, keys, what):
    for k in keys:
        expect(is_count(obj.get(k)), "%s: %s is %r, expected an integer >= 0"
               % (what, k, obj.get(k)))


def delta(a, b, key):
    return b[key] - a[key]


def block_span(off, n, bs=4096):
    return (off + n + bs - 1) // bs * bs - off // bs * bs


# ---- The checks. ----

class T:
    """What the checks share: the daemon, paths, handles, the model of disk."""

    def __init__(self, d, tmp, conf, paths, kit, efile):
        self.d, self.tmp, self.conf, self.paths, self.kit, self.efile = \
            d, tmp, conf, paths, kit, efile
        with open(paths["disk"], "rb") as f:
            self.disk = bytearray(f.read())
        self.r = random.Random(SEED + 1)
        self.h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        self.hf = nbdtest.libnbd_handle(d.unix_uri("faulty"))
        self.faulty_data = None

    def write(self, data, off):
        self.h.pwrite(data, off)
        self.disk[off:off + len(data)] = data

    def backend_has(self, off, n, what):
        require_same(nbdtest.read_at(self.paths["disk"], off, n), self.disk[off:off + n],
                     "%s: backend file" % what, base=off)


def check_status(t):
    d = t.d
    r = ctl_json(d, "status")
    fields(r, {"pid": d.pid, "config": t.conf, "exports": 4, "threads": 2,
               "cache_bytes": CACHE_SIZE}, "status")
    expect(isinstance(r.get("version"), str) and r["version"], "status: version %r"
           % r.get("version"))
    expect(r.get("arena") in ("hugetlb", "thp", "plain"), "status: arena %r" % r.get("arena"))
    counts(r, ("uptime_ms", "connections", "used_bytes", "dirty_bytes"), "status")
    expect(r.get("used_bytes", 0) <= CACHE_SIZE, "status: used_bytes %r above the cache size"
           % r.get("used_bytes"))
    listen = r.get("listen") or []
    expect({"type": "unix", "path": d.sock} in listen,
           "status: listen %r lacks the Unix socket %s" % (listen, d.sock))
    expect({"type": "tcp", "address": "127.0.0.1", "port": d.port} in listen,
           "status: listen %r lacks 127.0.0.1:%d" % (listen, d.port))
    expect(len(listen) == 2, "status: %d listen entries, expected 2: %r" % (len(listen), listen))
    # Connections: the two libnbd handles, once the ready probe is gone.
    deadline = time.time() + 5
    while r.get("connections") != 2 and time.time() < deadline:
        time.sleep(0.1)
        r = ctl_json(d, "status")
    expect(r.get("connections") == 2, "status: connections %r with two clients connected"
           % r.get("connections"))
    out = ctl(d, "status").stdout
    expect("pid %d" % d.pid in out, "status: human output lacks 'pid %d': %r" % (d.pid, out))
    expect("unix " + d.sock in out, "status: human output lacks the Unix socket: %r" % out)
    expect("tcp 127.0.0.1:%d" % d.port in out, "status: human output lacks the TCP address")
    expect(re.search(r"^cache\s+64\.0 MiB$", out, re.M), "status: no 'cache 64.0 MiB' line")


def check_exports(t):
    d = t.d
    ex = {e.get("name"): e for e in ctl_json(d, "exports")["exports"]}
    expect(sorted(ex) == ["disk", "faulty", "other", "spare"],
           "exports: names %r" % sorted(ex))
    common = {}
    want = {
        "disk": dict(common, description="test disk", backend=t.paths["disk"], kind="file",
                     size=DISK_SIZE, readonly=False, block_size=4096, cache_mode="writeback",
                     seq_cutoff=0, max_connections=3, connections=1, dirty_high=50,
                     dirty_low=25),
        "other": dict(common, description=None, backend=t.paths["other"], kind="file",
                      size=OTHER_SIZE, readonly=True, block_size=512,
                      cache_mode="writethrough", seq_cutoff=MIB, max_connections=0,
                      connections=0, dirty_high=60, dirty_low=10),
        "faulty": dict(common, backend=t.kit.uri(), kind="nbd", size=KIT_SIZE,
                       readonly=False, cache_mode="writeback", connections=1),
        "spare": dict(common, backend=t.paths["spare"], kind="file", size=MIB,
                      cache_mode="writeback", connections=0),
    }
    for name, w in want.items():
        if name in ex:
            fields(ex[name], w, "exports: %s" % name)
    out = ctl(d, "exports").stdout
    lines = out.splitlines()
    expect(lines and lines[0].split()[:3] == ["NAME", "KIND", "SIZE"],
           "exports: human header %r" % (lines[:1],))
    disk_line = next((ln for ln in lines if ln.startswith("disk ")), "")
    for word in ("file", "16.0 MiB", "4096", "writeback", "rw", "1/3", t.paths["disk"],
                 "test disk"):
        expect(word in disk_line, "exports: human line of disk lacks %r: %r" % (word, disk_line))
    other_line = next((ln for ln in lines if ln.startswith("other ")), "")
    for word in ("8.0 MiB", "512", "writethrough", "ro", "10%-60%", "1.0 MiB"):
        expect(word in other_line, "exports: human line of other lacks %r: %r"
               % (word, other_line))


def check_stats_hits(t):
    d = t.d
    n = 37
    lo = 2 * MIB
    s0 = export_stats(t.d, "disk")[1]
    require_same(t.h.pread(MIB, lo), t.disk[lo:lo + MIB], "cold read", base=lo)
    s1 = export_stats(d, "disk")[1]
    expect(delta(s0, s1, "misses") + delta(s0, s1, "partial_hits") == 1,
           "stats: one cold 1 MiB read counted %d misses and %d partial hits"
           % (delta(s0, s1, "misses"), delta(s0, s1, "partial_hits")))
    expect(delta(s0, s1, "backend_read_bytes") >= MIB,
           "stats: the cold read counted %d backend_read_bytes" % delta(s0, s1,
                                                                       "backend_read_bytes"))
    for _ in range(n):
        off = lo + 4096 * t.r.randrange(MIB // 4096)
        require_same(t.h.pread(4096, off), t.disk[off:off + 4096], "warm read", base=off)
    reply, s2 = export_stats(d, "disk")
    log("  disk: hits %d -> %d over %d warm reads" % (s1["hits"], s2["hits"], n))
    expect(delta(s1, s2, "hits") == n, "stats: %d warm 4 KiB reads counted %d hits"
           % (n, delta(s1, s2, "hits")))
    for key in ("misses", "partial_hits", "backend_reads", "backend_read_bytes"):
        expect(delta(s1, s2, key) == 0, "stats: warm reads changed %s: %d -> %d"
               % (key, s1[key], s2[key]))
    reads = s2["hits"] + s2["misses"] + s2["partial_hits"]
    expect(abs(s2.get("hit_ratio", -1) - s2["hits"] / reads) < 1e-6,
           "stats: disk hit_ratio %r, hits/reads is %r" % (s2.get("hit_ratio"),
                                                           s2["hits"] / reads))
    counts(s2, EXPORT_STAT_FIELDS, "stats disk")
    fields(s2, {"connections": 1}, "stats disk")
    # The whole reply: every documented field.
    r = ctl_json(d, "stats")
    expect(sorted(e.get("name") for e in r["exports"]) == ["disk", "faulty", "other", "spare"],
           "stats: exports %r" % [e.get("name") for e in r["exports"]])
    expect(is_count(r.get("time_ms")) and r["time_ms"] >= reply["time_ms"],
           "stats: time_ms %r after %r" % (r.get("time_ms"), reply.get("time_ms")))
    c = r["cache"]
    counts(c, CACHE_FIELDS, "stats cache")
    fields(c, {"cache_bytes": CACHE_SIZE}, "stats cache")
    expect(c["hits"] >= s2["hits"], "stats: cache hits %d below disk's %d"
           % (c["hits"], s2["hits"]))
    expect(is_ratio(c.get("hit_ratio")), "stats: cache hit_ratio %r" % c.get("hit_ratio"))
    a = c.get("arena") or {}
    expect(a.get("kind") in ("hugetlb", "thp", "plain"), "stats: arena kind %r" % a.get("kind"))
    counts(a, ("free_bytes",), "stats arena")
    order = a.get("free_bytes_by_order")
    expect(isinstance(order, list) and len(order) == 10 and all(is_count(v) for v in order)
           and sum(order) == a.get("free_bytes"),
           "stats: free_bytes_by_order %r does not add up to free_bytes %r"
           % (order, a.get("free_bytes")))
    expect(is_ratio(a.get("fragmentation")), "stats: fragmentation %r" % a.get("fragmentation"))
    out = ctl(d, "stats", "disk").stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("disk ")), "")
    expect(line.split()[1:3] == ["1", str(s2["hits"])],
           "stats: human line of disk %r, expected connections 1, hits %d" % (line, s2["hits"]))
    expect("hit ratio" in out and "%" in out, "stats: human output lacks the hit ratio")


def check_flush(t):
    d = t.d
    s0 = export_stats(d, "disk")[1]
    require(s0["dirty_bytes"] == 0, "test setup: disk has %d dirty bytes before the writes"
            % s0["dirty_bytes"])
    writes = [(4 * MIB, 64 * KIB), (5 * MIB + 100, 10000)]
    for off, n in writes:
        t.write(t.r.randbytes(n), off)
    want = sum(block_span(off, n) for off, n in writes)
    s1 = export_stats(d, "disk")[1]
    expect(s1["dirty_bytes"] == want, "flush: dirty_bytes %d after writing %d bytes in %d "
           "blocks, expected %d" % (s1["dirty_bytes"], sum(n for _, n in writes),
                                    want // 4096, want))
    for off, n in writes:
        expect(nbdtest.read_at(t.paths["disk"], off, n) != bytes(t.disk[off:off + n]),
               "flush: the backend file has the write at %d before any flush (not writeback)"
               % off)
    p = ctl(d, "flush", "disk")
    expect(re.fullmatch(r"flushed 76\.0 KiB in \d+\.\d s\n", p.stdout),
           "flush: output %r, expected 'flushed 76.0 KiB in N.N s'" % p.stdout)
    s2 = export_stats(d, "disk")[1]
    expect(s2["dirty_bytes"] == 0, "flush: dirty_bytes %d after flush" % s2["dirty_bytes"])
    expect(delta(s1, s2, "writeback_bytes") >= want, "flush: writeback_bytes grew by %d, "
           "expected at least %d" % (delta(s1, s2, "writeback_bytes"), want))
    for off, n in writes:
        t.backend_has(off, n, "after nbdcachectl flush")
    # --json: the reply's fields.
    for k in range(3):
        t.write(t.r.randbytes(4096), 6 * MIB + k * 8192)
    r = ctl_json(d, "flush", "disk")
    fields(r, {"export": "disk", "flushed_bytes": 3 * 4096}, "flush --json")
    counts(r, ("time_ms",), "flush --json")
    t.backend_has(6 * MIB, 5 * 4096, "after flush --json")
    # On a terminal: the progress line is rewritten, the final line stays.
    lo, n = 10 * MIB, 4 * MIB
    t.write(t.r.randbytes(n), lo)
    rc, out = run_on_pty([CTL, "--control", d.control, "flush", "disk"])
    log("  on a pty: exit %d, %r" % (rc, out[-200:]))
    expect(rc == 0, "flush on a terminal: exit %d" % rc)
    expect(re.search(r"flushed 4\.0 MiB in \d+\.\d s\r?\n$", out),
           "flush on a terminal: output ends %r" % out[-100:])
    t.backend_has(lo, n, "after flush on a terminal")


def run_on_pty(cmd, timeout=60):
    """Run cmd with stdout on a pseudo-terminal: (exit status, output)."""
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if p.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:         # EIO: the slave side is closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    try:
        rc = p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise Failed("%s did not finish within %ds" % (" ".join(cmd), timeout))
    return rc, out.decode(errors="replace")


def check_flush_eio(t):
    d = t.d
    data = t.r.randbytes(64 * KIB)
    open(t.efile, "w").close()
    t.faulty_data = data
    try:
        t.hf.pwrite(data, MIB)
        expect(export_stats(d, "faulty")[1]["dirty_bytes"] == 64 * KIB,
               "flush EIO: faulty's dirty_bytes after a 64 KiB write")
        ctl_refused(d, "EIO", "flush", "faulty")
        s = export_stats(d, "faulty")[1]
        expect(s["dirty_bytes"] == 64 * KIB, "flush EIO: dirty_bytes %d after a failed "
               "flush, expected the 64 KiB still dirty" % s["dirty_bytes"])
        expect(s["writeback_errors"] > 0, "flush EIO: writeback_errors is 0")
        ctl_refused(d, "EIO", "set-mode", "faulty", "writethrough")
        mode = export_info(d, "faulty").get("cache_mode")
        expect(mode == "writeback", "set-mode refused with EIO but cache_mode is %r" % mode)
        require_same(t.hf.pread(len(data), MIB), data, "flush EIO: read back while failing",
                     base=MIB)
    finally:
        os.unlink(t.efile)


def check_flush_recovers(t):
    """The fault is gone: flush succeeds (a failure seen before may be
    reported once). Runs even when check_flush_eio failed."""
    d = t.d
    data = t.faulty_data
    require(data is not None, "test setup: the EIO check wrote nothing")
    for attempt in range(3):
        p = nbdtest.run([CTL, "--control", d.control, "flush", "faulty"], check_rc=False,
                        timeout=120)
        if p.returncode == 0:
            break
        log("  flush %d after the fault went away: exit %d" % (attempt + 1, p.returncode))
    expect(p.returncode == 0, "flush EIO: flush still fails after the fault went away")
    require_same(t.kit.handle().pread(len(data), MIB), data, "flush EIO: backend after flush",
                 base=MIB)
    expect(export_stats(d, "faulty")[1]["dirty_bytes"] == 0,
           "flush EIO: dirty_bytes after the successful flush")


def check_drop_clean(t):
    d = t.d
    lo = 8 * MIB
    require_same(t.h.pread(MIB, lo), t.disk[lo:lo + MIB], "drop-clean: cold read", base=lo)
    dirty = t.r.randbytes(8 * KIB)
    t.write(dirty, 9 * MIB)
    r0, s0 = export_stats(d, "disk")
    require(s0["dirty_bytes"] == 8 * KIB, "test setup: dirty_bytes %d, expected 8 KiB"
            % s0["dirty_bytes"])
    r = ctl_json(d, "drop-clean", "disk")
    fields(r, {"export": "disk"}, "drop-clean --json")
    counts(r, ("dropped_bytes", "kept_bytes"), "drop-clean --json")
    expect(r.get("dropped_bytes", 0) >= MIB, "drop-clean: dropped_bytes %r, expected at "
           "least the 1 MiB read" % r.get("dropped_bytes"))
    expect(r.get("kept_bytes", 0) >= 8 * KIB, "drop-clean: kept_bytes %r below the 8 KiB "
           "dirty" % r.get("kept_bytes"))
    r1, s1 = export_stats(d, "disk")
    expect(s1["dirty_bytes"] == 8 * KIB, "drop-clean: dirty_bytes %d afterwards, expected "
           "8 KiB kept" % s1["dirty_bytes"])
    expect(r0["cache"]["used_bytes"] - r1["cache"]["used_bytes"] == r.get("dropped_bytes"),
           "drop-clean: used_bytes %d -> %d, dropped_bytes %r" % (
               r0["cache"]["used_bytes"], r1["cache"]["used_bytes"], r.get("dropped_bytes")))
    require_same(t.h.pread(4096, lo), t.disk[lo:lo + 4096], "drop-clean: read after",
                 base=lo)
    s2 = export_stats(d, "disk")[1]
    expect(delta(s1, s2, "misses") == 1 and delta(s1, s2, "hits") == 0,
           "drop-clean: the next read of dropped data counted %d misses, %d hits"
           % (delta(s1, s2, "misses"), delta(s1, s2, "hits")))
    expect(delta(s1, s2, "backend_reads") >= 1, "drop-clean: the next read did not reach "
           "the backend")
    require_same(t.h.pread(8 * KIB, 9 * MIB), dirty, "drop-clean: dirty data", base=9 * MIB)
    out = ctl(d, "drop-clean", "disk").stdout
    expect(re.fullmatch(r"disk: dropped \S+ \S+ of clean cache, \S+ \S+ still cached\n", out),
           "drop-clean: human output %r" % out)


def check_set_mode(t):
    d = t.d
    require(export_stats(d, "disk")[1]["dirty_bytes"] == 8 * KIB,
            "test setup: disk should hold 8 KiB dirty from drop-clean")
    r = ctl_json(d, "set-mode", "disk", "writethrough")
    fields(r, {"export": "disk", "mode": "writethrough", "previous": "writeback"},
           "set-mode --json")
    fields(export_info(d, "disk"), {"cache_mode": "writethrough"}, "exports after set-mode")
    expect(export_stats(d, "disk")[1]["dirty_bytes"] == 0,
           "set-mode: dirty data left after leaving writeback")
    t.backend_has(9 * MIB, 8 * KIB, "set-mode: leaving writeback")
    t.write(t.r.randbytes(4096), 15 * MIB)
    t.backend_has(15 * MIB, 4096, "set-mode: a write in writethrough mode, without flush")
    expect(export_stats(d, "disk")[1]["dirty_bytes"] == 0,
           "set-mode: a writethrough write left dirty data")
    ctl_refused(d, "ENOTSUP", "set-mode", "disk", "none")
    ctl_refused(d, "EINVAL", "set-mode", "disk", "bogus")
    out = ctl(d, "set-mode", "disk", "writeback").stdout
    expect(out == "disk: writethrough -> writeback\n", "set-mode: human output %r" % out)
    fields(export_info(d, "disk"), {"cache_mode": "writeback"}, "exports after set-mode back")


def check_compact(t):
    before = ctl_json(t.d, "stats")["cache"]["arena"]
    r = ctl_json(t.d, "compact")
    counts(r, ("moved", "skipped_pinned", "collapsed", "freed_2m_chunks", "time_ns"),
           "compact --json")
    after = ctl_json(t.d, "stats")["cache"]["arena"]
    # The pass is the daemon's own: its counters in stats move with it.
    expect(after["compact_passes"] >= before["compact_passes"] + 1,
           "compact: compact_passes %r -> %r" % (before["compact_passes"],
                                                 after["compact_passes"]))
    expect(after["compact_moves"] >= before["compact_moves"] + r["moved"] and
           after["compact_collapses"] >= before["compact_collapses"] + r["collapsed"],
           "compact: the reply's moves and collapses are in stats: %r %r" % (r, after))
    expect(r["fragmentation_after"] <= r["fragmentation_before"] or r["moved"] == 0,
           "compact: fragmentation grew: %r" % r)
    for k in ("fragmentation_before", "fragmentation_after"):
        expect(is_ratio(r.get(k)), "compact: %s %r" % (k, r.get(k)))
    out = ctl(t.d, "compact").stdout
    expect(out.startswith("moved ") and "fragmentation" in out,
           "compact: human output %r" % out)


def check_top(t):
    d = t.d
    lo = 2 * MIB
    t.h.pread(MIB, lo)          # cached again (drop-clean dropped it)
    stop = threading.Event()
    h = nbdtest.libnbd_handle(d.unix_uri("disk"))
    done = [0]

    def load():
        k = 0
        while not stop.is_set():
            h.pread(4096, lo + 4096 * (k % 256))
            k += 1
        done[0] = k
    th = threading.Thread(target=load)
    th.start()
    try:
        time.sleep(0.2)
        p = ctl(d, "--json", "top", "--count", "2", "--interval", "0.5")
        p2 = ctl(d, "top", "--count", "2", "--interval", "0.3")
    finally:
        stop.set()
        th.join()
        h.shutdown()
    log("  the load did %d warm reads" % done[0])
    lines = p.stdout.splitlines()
    expect(len(lines) == 2, "top --json --count 2: %d lines" % len(lines))
    last = 0
    for ln in lines:
        o = json.loads(ln)
        ex = {e["name"]: e for e in o["exports"]}
        expect(sorted(ex) == ["disk", "faulty", "other", "spare"], "top: exports %r"
               % sorted(ex))
        expect(250 <= o["interval_ms"] <= 3000, "top: interval_ms %r for --interval 0.5"
               % o["interval_ms"])
        expect(o["time_ms"] > last, "top: time_ms %r not after %r" % (o["time_ms"], last))
        last = o["time_ms"]
        disk = ex.get("disk", {})
        expect((disk.get("reads_per_s") or 0) > 0, "top: disk reads_per_s %r under a read "
               "load" % disk.get("reads_per_s"))
        expect(disk.get("hit_ratio") == 1, "top: disk hit_ratio %r for warm reads only"
               % disk.get("hit_ratio"))
        expect(disk.get("backend_read_bytes_per_s") == 0, "top: backend reads %r for warm "
               "reads" % disk.get("backend_read_bytes_per_s"))
        fields(disk, {"connections": 2, "dirty_bytes": 0}, "top disk")
        other = ex.get("other", {})
        fields(other, {"reads_per_s": 0, "hit_ratio": None}, "top other")
    out = p2.stdout
    expect(out.count("READS/S") == 2, "top --count 2: %d blocks" % out.count("READS/S"))
    expect("\033" not in out, "top: ANSI escapes on a pipe")
    kinds = ("read_hit", "read_miss", "write", "flush", "backend")
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("disk ")]
    disk_lines = [w for w in rows if w[1] not in kinds]  # the rates table
    expect(len(disk_lines) == 2 and all(float(w[1]) > 0 and w[2] == "100.0%"
                                         for w in disk_lines),
           "top: disk lines %r, expected reads/s > 0 and 100.0%%" % disk_lines)
    # The latency table since start: the warm reads' count and percentiles.
    hit_rows = [w for w in rows if w[1] == "read_hit"]
    expect(out.count("latency since start") == 2 and len(hit_rows) == 2 and
           all(int(w[2]) > 0 and w[4] in ("us", "ms") for w in hit_rows),
           "top: read_hit latency rows %r, expected a count and P50 / P99 / P999" % hit_rows)


def check_attach(t):
    d = t.d
    out = ctl(d, "attach", "disk").stdout
    want = "nbd-client -unix %s /dev/nbd0 -N disk -b 4096 -C 3\n" % d.sock
    expect(out == want, "attach disk: %r, expected %r" % (out, want))
    expect("-N disk -b 4096" in out, "attach: no '-N disk -b 4096' in %r" % out)
    out = ctl(d, "attach", "other", "/dev/nbd7").stdout
    want = "nbd-client -unix %s /dev/nbd7 -N other -b 512 -C 4 -readonly\n" % d.sock
    expect(out == want, "attach other: %r, expected %r" % (out, want))
    argv = ["nbd-client", "-unix", d.sock, "/dev/nbd1", "-N", "faulty", "-b", "4096", "-C", "4"]
    o = parse_one_object(ctl(d, "--json", "attach", "faulty", "/dev/nbd1"), "attach --json")
    expect(o.get("argv") == argv, "attach --json: %r, expected %r" % (o.get("argv"), argv))
    # --run: a fake nbd-client first on PATH records its arguments.
    fake_dir = os.path.join(t.tmp, "fakebin")
    os.makedirs(fake_dir, exist_ok=True)
    record = os.path.join(t.tmp, "nbd-client.args")
    fake = os.path.join(fake_dir, "nbd-client")
    with open(fake, "w") as f:
        f.write('#!/bin/sh\nfor a in "$@"; do printf "%%s\\n" "$a"; done > %s\nexit 3\n' % record)
    os.chmod(fake, os.stat(fake).st_mode | stat.S_IXUSR)
    env = dict(os.environ, PATH=fake_dir + ":" + os.environ.get("PATH", ""))
    p = ctl(d, "attach", "--run", "disk", "/dev/nbd5", rc=3, env=env)
    with open(record) as f:
        got = f.read().splitlines()
    want = ["-unix", d.sock, "/dev/nbd5", "-N", "disk", "-b", "4096", "-C", "3"]
    expect(got == want, "attach --run: nbd-client got %r, expected %r" % (got, want))
    expect(p.stdout == "", "attach --run printed %r" % p.stdout)
    p = ctl(d, "attach", "nope", rc=1)
    expect("nope" in p.stderr, "attach nope: stderr %r does not name the export" % p.stderr)


def check_errors(t):
    d = t.d
    for args in (("stats", "nope"), ("flush", "nope"), ("drop-clean", "nope"),
                 ("set-mode", "nope", "writeback")):
        ctl_refused(d, "ENOENT", *args)
    bad = os.path.join(t.tmp, "no-such-dir", "control.sock")
    p = nbdtest.run([CTL, "--control", bad, "status"], check_rc=False)
    expect(p.returncode == 1, "a missing control socket: exit %d, expected 1" % p.returncode)
    expect(bad in p.stderr, "a missing control socket: stderr %r does not name %s"
           % (p.stderr, bad))
    expect(p.stdout == "", "a missing control socket: stdout %r" % p.stdout)
    not_socket = os.path.join(t.tmp, "plain-file")
    open(not_socket, "w").close()
    p = nbdtest.run([CTL, "--control", not_socket, "--json", "status"], check_rc=False)
    expect(p.returncode == 1 and not_socket in p.stderr,
           "a control path that is no socket: exit %d, stderr %r" % (p.returncode, p.stderr))
    for args in (("bogus",), ("flush",), ("status", "extra"), ("status", "--count", "2"),
                 ("top", "--count", "x"), ("top", "--interval", "0"), ("flush", "--run", "a"),
                 ()):
        p = nbdtest.run([CTL, "--control", d.control] + list(args), check_rc=False)
        expect(p.returncode == 2, "usage error %r: exit %d, expected 2" % (args, p.returncode))
        expect(p.stderr.startswith("nbdcachectl: "), "usage error %r: stderr %r"
               % (args, p.stderr))
    p = nbdtest.run([CTL, "--help"], check_rc=False)
    expect(p.returncode == 0 and "usage:" in p.stdout, "--help: exit %d" % p.returncode)


def check_reload(t):
    d = t.d
    with open(t.conf, "w") as f:
        f.write("[added]\nbackend = %s\n" % t.paths["added"])
    r = ctl_json(d, "reload")
    fields(r, {"added": ["added"], "changed": [], "removed": ["spare"], "refused": [],
               "refused_settings": []}, "reload --json")
    ex = {e["name"]: e for e in ctl_json(d, "exports")["exports"]}
    expect(sorted(ex) == ["added", "disk", "faulty", "other"],
           "exports after reload: %r" % sorted(ex))
    if "added" in ex:
        fields(ex["added"], {"backend": t.paths["added"], "size": 2 * MIB},
               "exports after reload: added")
    fields(ctl_json(d, "status"), {"exports": 4}, "status after reload")
    h = nbdtest.libnbd_handle(d.unix_uri("added"))
    expect(h.get_size() == 2 * MIB, "the added export: size %d" % h.get_size())
    h.shutdown()
    out = ctl(d, "reload").stdout
    lines = out.splitlines()
    expect(len(lines) == 5 and all(ln.split()[-1] == "-" for ln in lines),
           "reload with nothing changed: %r" % out)


def main():
    log("seed %d" % SEED)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        paths = {"disk": os.path.join(tmp, "disk.img"), "other": os.path.join(tmp, "other.img"),
                 "spare": os.path.join(tmp, "spare.img"), "added": os.path.join(tmp, "added.img")}
        nbdtest.random_file(paths["disk"], DISK_SIZE, seed=SEED)
        nbdtest.random_file(paths["other"], OTHER_SIZE, seed=SEED + 2)
        nbdtest.sparse_file(paths["spare"], MIB)
        nbdtest.sparse_file(paths["added"], 2 * MIB)
        conf = os.path.join(tmp, "nbdcached.conf")
        with open(conf, "w") as f:
            f.write("[spare]\nbackend = %s\n" % paths["spare"])
        efile = os.path.join(tmp, "fail-pwrite")
        kit = Nbdkit(tmp, ["--filter=error", "memory", "size=%d" % KIT_SIZE, "error=EIO",
                           "error-pwrite-rate=1", "error-pwrite-file=" + efile])
        try:
            exports = [
                ("disk", paths["disk"], "description=test disk,block-size=4096,"
                 "max-connections=3"),
                ("other", paths["other"], "readonly,block-size=512,cache-mode=writethrough,"
                 "seq-cutoff=1M,dirty-high=60,dirty-low=10"),
                ("faulty", kit.uri(), "cache-mode=writeback"),
            ]
            extra = ["--cache-size", "64M", "--cache-mode", "writeback", "--dirty-expire", "3600",
                     "--config", conf]
            with nbdtest.Daemon(exports, extra=extra) as d:
                t = T(d, tmp, conf, paths, kit, efile)
                for name, fn in (("status", check_status), ("exports", check_exports),
                                 ("stats: warm reads are hits", check_stats_hits),
                                 ("flush", check_flush), ("flush: EIO", check_flush_eio),
                                 ("flush: the fault gone", check_flush_recovers),
                                 ("drop-clean", check_drop_clean), ("set-mode", check_set_mode),
                                 ("compact", check_compact), ("top", check_top),
                                 ("attach", check_attach), ("errors", check_errors),
                                 ("reload", check_reload)):
                    CHECKS.run(name, fn, t)
                    if not d.alive():
                        CHECKS.add("the daemon died during %s" % name)
                        break
                if os.path.exists(efile):
                    os.unlink(efile)
                nbdtest.shutdown_all([t.h, t.hf])
                CHECKS.dump_log(d)
        finally:
            if os.path.exists(efile):
                os.unlink(efile)
            kit.stop()
    CHECKS.finish("nbdcachectl")


if __name__ == "__main__":
    main()
