#!/usr/bin/python3
"""crash_consistency: what a writeback export has promised survives a crash.

Each trial starts a daemon with a 32 MiB file-backed writeback export
(block size 4096 or 512) and one of four cache profiles (PROFILES): "lazy"
(16 MiB cache, no expiry, high watermark 95%) and "tight" (4 MiB, no
expiry, 90%) keep data dirty until the crash, "eager" (2 MiB, expiry 1 s,
10%) writes back almost at once, "default" (4 MiB) is the daemon's
defaults; every cache is smaller than what a trial writes, so eviction,
writeback and direct writes all happen. Four libnbd connections (two
Unix, two TCP) are driven by one thread with aio, 1 to 16 requests in
flight on each: WRITE, WRITE_ZEROES (with or without NO_HOLE), TRIM,
FLUSH and READ, 1 byte to 1 MiB, unaligned too, 60% of them in a 3 MiB
hot region so that writes overlap; each trial picks how often it flushes
(never to 1 request in 9) and how often a write, zero or trim has FUA
(never to 30%). After a random delay of up to 1.5 s (in a quarter of the
trials: at the first FLUSH or FUA reply after it) the daemon's cache
counters are read from its control socket and it gets SIGKILL; the
replies already on the sockets are still read (a reply the daemon sent
is a promise even if it died right after). Then every byte of the
backend file is checked against the model below.

Modes. "kill": SIGKILL only; the daemon's writes sit in the page cache
of the backend file and survive, so this checks that data reaches the
file before a FLUSH or FUA write is acknowledged. "power": the export is
served through tests/lib/faults.py's FUSE passthrough, faultfs (when
that module exists and the kernel has FUSE), in half the trials with
every backend operation delayed 1 or 3 ms so that more of them are in
flight at the kill. After the SIGKILL the file is checked as it is (as
in "kill": faultfs writes through), then fs.power_loss() rolls it back to
its last successful fsync and it is checked again: this checks that the
daemon really synced. (faultfs counts a write with RWF_DSYNC, the
daemon's FUA, as an fsync of the whole file.) The log says how many 4 KiB
blocks each power loss changed.

The model. Every request gets a tick (one counter, one thread) when it is
issued (taken before the aio call: no later than it is sent) and when its
reply is read (no earlier than the daemon sent it): so "acked before
issued" between ticks implies it for the real events. A write is
GUARANTEED once acknowledged with FUA, or when acknowledged before a
FLUSH was issued that later completed successfully, on any connection
(the export advertises CAN_MULTI_CONN, which promises exactly that). A
FLUSH that did not complete guarantees nothing; a request that got no
reply (in flight at the crash, or failed with the dead connection) may
have landed fully, partly or not at all, byte by byte.

For one byte, let g be the latest issue tick of a guaranteed write
covering it. The byte must hold the value of some write W covering it
that was not acknowledged before tick g (W did not finish before a
guaranteed write began, so the guaranteed write does not supersede it:
that includes the guaranteed writes themselves, writes concurrent with
them, and every later write, acknowledged or in flight); or, when no
guaranteed write covers it, the initial content of the file. The
"required" value is the one of the guaranteed write with tick g.
WRITE_ZEROES is a write of zeros.

TRIM: after a TRIM the NBD specification leaves the bytes undefined. This
daemon punches a hole (or leaves the data when it cannot), so the model
says "the old value or zero": a TRIM covering a byte adds zero to its
allowed values (when not superseded, as for a write) but never
guarantees anything and never supersedes an older write. (A TRIM that
made the bytes read back as older superseded data would be flagged: the
spec would allow it, a user would not expect it; CRASH_TRIM=0 leaves TRIM
out.)

The check walks the segments between write boundaries; a segment must
equal one allowed source as a whole, else each 512-byte piece, else each
byte, must match one of them. Every byte of the file is checked. A
self-test makes sure the checker flags a byte outside the allowed set.

Environment: CRASH_TRIALS (default 30, or 40 when both modes run),
CRASH_SEED (seed of the first
trial; trial i uses CRASH_SEED + i; rerun one trial with CRASH_SEED=S
CRASH_TRIALS=1, which repeats its configuration and operation sequence,
not the exact interleaving with the kill), CRASH_MODE (kill, power or
both; default both when tests/lib/faults.py exists and /dev/fuse too,
else kill; with both, odd seeds use power), CRASH_SECONDS (time budget; past it no new trial
starts), CRASH_TRIM (1 default, 0: no TRIM).

Mode "device" (tests/integration/cache_device_crash.py runs it): the
backend is a plain file, and --cache-device a 64 MiB file on faultfs, so
FLUSH and FUA are answered from its intent log. After the SIGKILL (and,
in half the trials, a power loss of the device: back to its last fsync)
a new daemon replays the log onto the backend and stops, writing
everything back; then the backend file is checked against the same
model: nothing FLUSH or FUA acknowledged may be missing.
"""

import os
import random
import select
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

try:
    import faults  # noqa: E402  (tests/lib/faults.py, when present)
except ImportError:
    faults = None

KIB = 1024
MIB = 1024 * KIB
SIZE = 32 * MIB
HOT = (3 * MIB + 777, 6 * MIB + 777)
CONNS = 4
BASE_SEED = int(os.environ.get("CRASH_SEED", "20240917"))
MODE = os.environ.get("CRASH_MODE", "") or (
    "both" if faults and os.path.exists("/dev/fuse") else "kill")
TRIALS = int(os.environ.get("CRASH_TRIALS", "30" if MODE == "kill" else "40"))
SECONDS = float(os.environ.get("CRASH_SECONDS", str(60 + 4 * TRIALS)))
WITH_TRIM = os.environ.get("CRASH_TRIM", "1") != "0"
WRITE_BUDGET = 96 * MIB      # bytes of write data per trial (kept for the check)
DRAIN_SECONDS = 3.0          # reading replies after the kill
PIECE = 512                  # the check's second granularity
DEVICE_SIZE = 96 * MIB       # device mode: the cache device (log and level-2 area)
MAX_RSS = 2 << 30            # this process's memory: a leak ends the run
INF = float("inf")

# name -> (cache size, daemon options)
PROFILES = {
    "lazy": ("16M", ["--dirty-expire", "3600", "--dirty-high", "95", "--dirty-low", "90"]),
    "tight": ("4M", ["--dirty-expire", "3600", "--dirty-high", "90", "--dirty-low", "60"]),
    "default": ("4M", []),
    "eager": ("2M", ["--dirty-expire", "1", "--dirty-high", "10", "--dirty-low", "2"]),
}
# kind -> weight; a trial picks the weight of FLUSH (FLUSH_WEIGHTS) and how
# often a write, zero or trim has FUA (FUA_RATES): rare flushes and FUAs
# leave much dirty data in the cache, and much unsynced data in the file
# for a power loss to undo.
WEIGHTS = (("write", 50), ("zero", 8), ("trim", 5 if WITH_TRIM else 0), ("read", 20))
FLUSH_WEIGHTS = (0, 1, 1, 2, 5, 10)
FUA_RATES = (0, 0, 0.02, 0.1, 0.3)


def pick_len(r):
    x = r.random()
    if x < 0.05:
        return r.randint(1, 16)
    if x < 0.15:
        return r.randint(17, 4095)
    if x < 0.45:
        return r.choice((512, 4096, 8192, 16384, 65536))
    if x < 0.80:
        return r.randint(4096, 65536)
    if x < 0.93:
        return r.randint(65537, 256 * KIB)
    return r.randint(256 * KIB + 1, MIB)


def pick_off(r, n):
    lo, hi = HOT if r.random() < 0.6 else (0, SIZE)
    off = r.randrange(lo, max(lo + 1, hi - n + 1))
    a = r.random()
    if a < 0.3:
        off -= off % 4096
    elif a < 0.6:
        off -= off % 512
    return max(0, min(off, SIZE - n))


class Op:
    """One request. issue/ack are ticks; ack is None until a successful reply."""

    __slots__ = ("no", "kind", "conn", "off", "n", "data", "fua", "flags", "issue", "ack",
                 "err", "buf", "t_issue", "t_ack")

    def __init__(self, no, kind, conn):
        self.no, self.kind, self.conn = no, kind, conn
        self.off = self.n = 0
        self.data = None
        self.fua = False
        self.flags = 0
        self.issue = self.ack = self.err = None
        self.buf = None
        self.t_issue = self.t_ack = None

    def describe(self, flush_mark=None):
        what = "%s #%d conn %d" % (self.kind.upper(), self.no, self.conn)
        if self.kind != "flush":
            what += " [%d,+%d)" % (self.off, self.n)
        if self.fua:
            what += " FUA"
        if self.flags & nbd.CMD_FLAG_NO_HOLE:
            what += " NO_HOLE"
        what += " issued@%d" % self.issue
        if self.ack is not None:
            what += " acked@%d" % self.ack
        elif self.err is not None:
            what += " failed (errno %d)" % self.err
        else:
            what += " no reply"
        if flush_mark is not None and self.guaranteed(flush_mark):
            what += " GUARANTEED"
        return what

    def is_write(self):
        return self.kind in ("write", "zero", "trim")

    def guaranteed(self, flush_mark):
        """Acknowledged with FUA, or before a FLUSH that completed was issued."""
        return (self.ack is not None and self.kind != "trim" and
                (self.fua or self.ack < flush_mark))

    def ack_or_inf(self):
        return INF if self.ack is None else self.ack

    def value(self, a, b):
        """The bytes this write puts at device offsets [a, b)."""
        if self.kind == "write":
            return self.data[a - self.off:b - self.off]
        return bytes(b - a)


class Violation:
    def __init__(self, offset, found, required, allowed, ops):
        self.offset, self.found, self.required = offset, found, required
        self.allowed, self.ops = allowed, ops


def segment_sources(active, flush_mark, initial, p, q):
    """The allowed sources of [p, q), a range covered by the same writes
    `active`: (a list of (op, its bytes of [p, q)), op None for the initial
    content; the guaranteed write whose value is required, or None)."""
    g = -1
    req = None
    for op in active:
        if op.guaranteed(flush_mark) and op.issue > g:
            g, req = op.issue, op
    srcs = []
    seen_zero = False
    for op in active:
        if op.ack_or_inf() < g:
            continue                   # finished before a guaranteed write began
        if op.kind != "write":
            if seen_zero:
                continue
            seen_zero = True
        srcs.append((op, op.value(p, q)))
    if g < 0:
        srcs.append((None, initial[p:q]))
    return srcs, req


def bad_bytes(got, srcs, p, q):
    """The device offsets in [p, q) whose byte in `got` (indexed from p)
    matches no source, in order: a PIECE that equals one source as a whole
    is skipped at once, only the others are looked at byte by byte."""
    for a in range(p - p % PIECE, q, PIECE):
        lo, hi = max(a, p) - p, min(a + PIECE, q) - p
        g = got[lo:hi]
        if any(g == s[lo:hi] for _, s in srcs):
            continue
        for i in range(lo, hi):
            if all(s[i] != got[i] for _, s in srcs):
                yield p + i


BAD_BYTES_SCAN = 4 * MIB     # bytes of failing segments scanned byte by byte at most


def check_file(got, initial, ops, flush_mark, max_report=5):
    """Every byte of `got` (the backend file) against the model. Returns
    (violations (at most max_report, one per segment), bad segments, stats);
    stats["bad"] counts the bad bytes in the first BAD_BYTES_SCAN bytes of
    failing segments."""
    writes = [op for op in ops if op.is_write()]
    starts, ends = {}, {}
    for op in writes:
        starts.setdefault(op.off, []).append(op)
        ends.setdefault(op.off + op.n, []).append(op)
    points = sorted(set(starts) | set(ends) | {0, len(got)})
    active = {}
    st = dict(bytes=0, required=0, multi=0, newer=0, untouched=0, bad=0, bad_scanned=0)
    violations = []
    bad_segments = 0
    for p, q in zip(points, points[1:]):
        for op in ends.get(p, ()):
            del active[op.no]
        for op in starts.get(p, ()):
            active[op.no] = op
        if q <= p:
            continue
        n = q - p
        st["bytes"] += n
        g = got[p:q]
        if not active:
            st["untouched"] += n
            srcs, req = [(None, initial[p:q])], None
        else:
            srcs, req = segment_sources(active.values(), flush_mark, initial, p, q)
            if req is not None:
                st["required"] += n
                if any(s is not req and s is not None and s.ack is not None for s, _ in srcs):
                    st["newer"] += n      # acknowledged data not yet guaranteed
            if len(srcs) > 1:
                st["multi"] += n
        if any(g == s for _, s in srcs):
            continue
        offsets = bad_bytes(g, srcs, p, q)
        bad = next(offsets, None)
        if bad is None:
            continue                   # a mix of allowed sources, byte by byte
        bad_segments += 1
        if st["bad_scanned"] < BAD_BYTES_SCAN:
            st["bad_scanned"] += n
            st["bad"] += 1 + sum(1 for _ in offsets)
        if len(violations) < max_report:
            i = bad - p
            violations.append(Violation(
                bad, g[i], None if req is None else req.value(bad, bad + 1)[0],
                sorted({s[i] for _, s in srcs}),
                sorted(active.values(), key=lambda o: o.issue)))
    return violations, bad_segments, st


def self_test(got, initial, ops, flush_mark):
    """The checker must flag a byte outside the allowed set: change one
    byte of a segment with a required value and check that segment."""
    writes = sorted((op for op in ops if op.guaranteed(flush_mark)), key=lambda o: -o.issue)
    for op in writes[:50]:
        p = op.off + op.n // 2
        active = [o for o in ops if o.is_write() and o.off <= p < o.off + o.n]
        srcs, req = segment_sources(active, flush_mark, initial, p, p + 1)
        allowed = {s[0] for _, s in srcs}
        if len(allowed) == 256:
            continue
        bad = next(v for v in range(256) if v not in allowed)
        require(next(bad_bytes(bytes([bad]), srcs, p, p + 1), None) == p,
                "self-test: byte 0x%02x at %d (allowed %s) not flagged" % (bad, p, sorted(allowed)))
        mutated = bytearray(got)
        mutated[p] = bad
        v, nbad, _ = check_file(mutated, initial, ops, flush_mark, max_report=1)
        require(nbad >= 1 and v and v[0].offset <= p,
                "self-test: the whole-file check missed byte 0x%02x at %d" % (bad, p))
        return True
    return False


def settle(fs):
    """A request of the dead daemon that faultfs had already taken may
    still be carried out: wait until its counters stop moving, so that
    nothing lands after the check or the power loss. The counters."""
    c = fs.counters()
    for _ in range(100):
        time.sleep(0.02)
        c, before = fs.counters(), c
        if c == before:
            break
    require(not c.get("undo_overflow"), "faultfs's undo log overflowed: %r" % c)
    return c


class Trial:
    def __init__(self, k, seed, mode, initial):
        self.k, self.seed, self.mode, self.initial = k, seed, mode, initial
        r = self.r = random.Random(seed)
        self.bs = r.choice((4096, 512))
        self.profile = r.choice(sorted(PROFILES))
        self.depth = r.choice((1, 2, 4, 8, 16))
        self.flush_weight = r.choice(FLUSH_WEIGHTS)
        self.fua_rate = r.choice(FUA_RATES)
        self.kill_after = r.uniform(0.03, 1.5)
        # else SIGKILL at the first FLUSH or FUA reply read after kill_after
        self.kill_at_once = r.random() < 0.75 or (self.flush_weight == 0 and self.fua_rate == 0)
        # power mode: every faultfs data operation sleeps this long first,
        # which keeps more backend I/O in flight at the kill
        self.fs_delay_ms = r.choice((0, 0, 1, 3))
        # device mode: a power loss of the cache device after the kill
        self.device_power_loss = r.random() < 0.5
        self.armed = False
        self.kinds = [kd for kd, w in WEIGHTS + (("flush", self.flush_weight),)
                      for _ in range(w)]
        self.ops = []
        self.tick_no = 0
        self.flush_mark = -1            # greatest issue tick of a completed FLUSH
        self.inflight = [0] * CONNS
        self.written = 0
        self.killed = None              # monotonic time of the kill
        self.kill_lock = threading.Lock()
        self.died_early = False
        self.unexpected = []            # errors before the kill
        self.daemon = None
        self.power_note = ""
        self.summarized = False
        self.power_changed = 0
        self.elapsed = 0.0
        self.checked = 0
        self.scratch = memoryview(bytearray(MIB))
        self.stats_note = ""

    def name(self):
        return "trial %d (seed %d, %s%s, bs %d, %s, depth %d, flush %d%%, fua %d%%, kill %s%.3fs)" % (
            self.k, self.seed, self.mode,
            " delay %d ms" % self.fs_delay_ms if self.mode == "power" else "",
            self.bs, self.profile, self.depth,
            self.flush_weight * 100 // (len(self.kinds)), self.fua_rate * 100,
            "" if self.kill_at_once else "at the first FLUSH/FUA reply after ", self.kill_after) + (
            ", device power loss" if self.mode == "device" and self.device_power_loss else "")

    def tick(self):
        self.tick_no += 1
        return self.tick_no

    # ---- the kill ----

    def snapshot(self):
        """The cache's counters from the control socket, just before the
        kill (a few milliseconds of the daemon's time; none if it fails)."""
        try:
            c = nbdtest.control_request(self.daemon.control, {"command": "stats"},
                                        timeout=1)["cache"]
            self.stats_note = ("; before the kill: dirty %d, evictions %d, written back %d, "
                               "direct writes %d" % (c["dirty_bytes"], c["evictions"],
                                                     c["writeback_bytes"], c["direct_writes"]))
        except (OSError, ValueError, KeyError, Failed) as e:
            self.stats_note = "; no stats before the kill (%s)" % e

    def timer_fired(self):
        self.snapshot()
        if self.kill_at_once:
            self.kill_now()
        else:
            self.armed = True

    def kill_now(self):
        with self.kill_lock:
            if self.killed is not None:
                return
            self.killed = time.monotonic()
            p = self.daemon.proc
            if p.poll() is not None:
                self.died_early = True
                return
            p.send_signal(signal.SIGKILL)

    # ---- the workload ----

    def done(self, op, err):
        e = err.value
        self.inflight[op.conn] -= 1
        op.buf = None
        if e == 0:
            op.ack = self.tick()
            op.t_ack = time.monotonic()
            if op.kind == "flush":
                self.flush_mark = max(self.flush_mark, op.issue)
            if self.armed and (op.kind == "flush" or (op.fua and op.kind != "trim")):
                self.kill_now()
        else:
            op.err = e
            if self.killed is None:
                self.unexpected.append("%s: errno %d" % (op.describe(), e))
        return 1

    def issue(self, c, h):
        r = self.r
        kind = r.choice(self.kinds)
        if kind in ("write", "zero") and self.written >= WRITE_BUDGET:
            kind = "read"
        op = Op(len(self.ops), kind, c)
        if kind != "flush":
            op.n = pick_len(r)
            op.off = pick_off(r, op.n)
        if kind == "write":
            op.data = r.randbytes(op.n)
            op.fua = r.random() < self.fua_rate
            self.written += op.n
        elif kind == "zero":
            op.flags = r.choice((0, 0, nbd.CMD_FLAG_NO_HOLE))
            op.fua = r.random() < self.fua_rate
        elif kind == "trim":
            op.fua = r.random() < self.fua_rate
        if op.fua:
            op.flags |= nbd.CMD_FLAG_FUA
        cb = lambda err, op=op: self.done(op, err)   # noqa: E731
        op.issue = self.tick()
        op.t_issue = time.monotonic()
        try:
            # Plain buffers, not nbd.Buffer: python3-libnbd 1.14 never frees
            # an nbd.Buffer given to aio_pwrite or aio_pread (a reference
            # leaks), which is gigabytes over a soak. Reads all land in one
            # scratch buffer: what they return is not checked here.
            if kind == "write":
                h.aio_pwrite(op.data, op.off, completion=cb, flags=op.flags)
            elif kind == "read":
                op.buf = self.scratch[:op.n]
                h.aio_pread(op.buf, op.off, completion=cb)
            elif kind == "zero":
                h.aio_zero(op.n, op.off, completion=cb, flags=op.flags)
            elif kind == "trim":
                h.aio_trim(op.n, op.off, completion=cb, flags=op.flags)
            else:
                h.aio_flush(completion=cb)
        except nbd.Error as e:
            if self.killed is None:
                raise Failed("%s: could not be issued: %s" % (op.describe(), e))
            return False                # never sent: not part of the model
        self.inflight[c] += 1
        self.ops.append(op)
        return True

    def drive(self, handles):
        """Keep `depth` requests in flight on each connection until the kill,
        then read what replies there are (at most DRAIN_SECONDS)."""
        t0 = time.monotonic()
        timer = threading.Timer(self.kill_after, self.timer_fired)
        timer.start()
        limit = self.kill_after + 2
        try:
            for _ in range(10 ** 7):
                now = time.monotonic()
                if self.killed is not None:
                    live = [h for h in handles if not (h.aio_is_dead() or h.aio_is_closed())]
                    if not live or now > self.killed + DRAIN_SECONDS:
                        break
                elif now > t0 + limit:
                    self.kill_now()     # no FLUSH/FUA reply came: kill anyway
                    continue
                if self.killed is None:
                    for c, h in enumerate(handles):
                        for _ in range(self.depth):
                            if self.inflight[c] >= self.depth or self.killed is not None:
                                break
                            self.issue(c, h)
                self.poll(handles)
            else:
                raise Failed("the workload loop did not end")
        finally:
            timer.cancel()
        return time.monotonic() - t0

    def poll(self, handles):
        pl = select.poll()
        by_fd = {}
        for h in handles:
            if h.aio_is_dead() or h.aio_is_closed():
                continue
            fd = h.aio_get_fd()
            d = h.aio_get_direction()
            ev = (select.POLLIN if d & nbd.AIO_DIRECTION_READ else 0) | \
                 (select.POLLOUT if d & nbd.AIO_DIRECTION_WRITE else 0)
            if ev:
                pl.register(fd, ev)
                by_fd[fd] = h
        for fd, ev in pl.poll(20):
            h = by_fd[fd]
            try:
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    h.aio_notify_read()
                elif ev & select.POLLOUT:
                    h.aio_notify_write()
            except nbd.Error as e:
                if self.killed is None:
                    raise Failed("connection failed before the kill: %s" % e)

    # ---- one trial ----

    def run(self, tmp):
        """The trial; returns the stats of the last check and the file it saw."""
        if self.mode == "device":
            return self.run_device(tmp)
        if self.mode == "kill":
            path = os.path.join(tmp, "disk.img")
            self.prepare(path)
            self.crash(path, tmp)
            return self.verify(path, "after the kill")
        with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
            self.prepare(fs.source("disk.img"))
            if self.fs_delay_ms:
                fs.set("delay-ms %d" % self.fs_delay_ms)
            self.crash(fs.path("disk.img"), tmp)
            c = settle(fs)
            # faultfs passes every write through: the source file is what
            # the daemon wrote, as after a kill; check that first.
            _, before = self.verify(fs.source("disk.img"), "after the kill")
            fs.power_loss()
            with open(fs.source("disk.img"), "rb") as f:
                after = f.read()
            changed = sum(1 for a in range(0, SIZE, 4096)
                          if before[a:a + 4096] != after[a:a + 4096])
            self.power_note = ("; the power loss changed %d 4 KiB blocks (its undo log: %d bytes "
                               "in %d ranges, %d fsyncs before)"
                               % (changed, c.get("undo_bytes", -1), c.get("undo_ranges", -1),
                                  c.get("fsyncs_ok", -1)))
            self.power_changed = changed
            return self.verify(fs.source("disk.img"), "after the power loss")

    def run_device(self, tmp):
        """The backend a plain file, the cache device (the intent log) a
        file on faultfs: SIGKILL, in half the trials a power loss of the
        device too (back to its last fsync), then a new daemon replays
        the log onto the backend and stops (writing everything back): the
        backend file must hold everything FLUSH or FUA acknowledged."""
        path = os.path.join(tmp, "disk.img")
        self.prepare(path)
        with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
            with open(fs.path("cache.dev"), "wb") as f:
                f.truncate(DEVICE_SIZE)
                os.fsync(f.fileno())
            extra = ["--cache-device", fs.path("cache.dev")]
            if self.fs_delay_ms:
                fs.set("delay-ms %d" % self.fs_delay_ms)
            self.crash(path, tmp, extra)
            c = settle(fs)
            fs.set("ok")
            if self.device_power_loss:
                fs.power_loss()
            cache, args = PROFILES[self.profile]
            workdir = os.path.join(tmp, "replay")
            os.mkdir(workdir)
            d = nbdtest.CheckedDaemon([("disk", path, "")], threads=2, workdir=workdir,
                                      extra=["--cache-mode", "writeback", "--cache-size", cache,
                                             "--block-size", str(self.bs)] + args + extra,
                                      what="the cache device after the crash")
            d.stop()
            with open(d.logpath) as f:
                text = f.read()
            replayed = [ln.split("info: ", 1)[-1] for ln in text.splitlines()
                        if "to write back" in ln or "on the backends:" in ln]
            self.power_note = "; %s; %s" % (
                "device power loss (%d fsyncs before)" % c.get("fsyncs_ok", -1)
                if self.device_power_loss else "no power loss",
                "; ".join(replayed) if replayed else "nothing to replay")
        return self.verify(path, "after the replay")

    def prepare(self, path):
        with open(path, "wb") as f:
            f.write(self.initial)
            f.flush()
            os.fsync(f.fileno())

    def crash(self, serve, tmp, more=()):
        """Start the daemon on `serve`, drive it, SIGKILL it, reap it."""
        cache, args = PROFILES[self.profile]
        extra = ["--cache-mode", "writeback", "--cache-size", cache, "--block-size",
                 str(self.bs)] + args + list(more)
        workdir = os.path.join(tmp, "daemon")
        os.mkdir(workdir)
        d = self.daemon = nbdtest.Daemon([("disk", serve, "")], threads=2, extra=extra,
                                         workdir=workdir)
        handles = []
        try:
            for i in range(CONNS):
                handles.append(nbdtest.libnbd_handle(d.unix_uri("disk") if i % 2 == 0
                                                     else d.tcp_uri("disk")))
            h = handles[0]
            require(h.get_size() == SIZE, "export size %d" % h.get_size())
            require(h.can_multi_conn() and h.can_flush() and h.can_fua(),
                    "the export lacks CAN_MULTI_CONN, FLUSH or FUA")
            require(h.can_zero() and (h.can_trim() or not WITH_TRIM),
                    "the export lacks WRITE_ZEROES or TRIM")
            self.elapsed = self.drive(handles)
        except Failed:
            d.kill()
            log(d.log_text()[-6000:])   # why the daemon failed before the kill
            raise
        finally:
            d.kill()                    # SIGKILL (if not yet) and reap, by PID
            text = d.log_text()
            d.logf.close()
            del handles[:]              # closed by libnbd when collected
        if self.died_early:
            log(text[-6000:])
            raise Failed("the daemon died before the kill")
        if "Sanitizer" in text or "runtime error:" in text:
            log(text[-8000:])
            raise Failed("sanitizer report in the daemon log")
        require(not self.unexpected, "requests failed before the kill: %s"
                % "; ".join(self.unexpected[:5]))

    def verify(self, source, stage):
        """Check every byte of the file `source` against the model."""
        require(os.path.getsize(source) == SIZE, "%s: the backend file has %d bytes"
                % (stage, os.path.getsize(source)))
        with open(source, "rb") as f:
            got = f.read()
        t1 = time.monotonic()
        violations, nbad, st = check_file(got, self.initial, self.ops, self.flush_mark)
        check_time = time.monotonic() - t1
        with open(source, "rb") as f:
            again = f.read()
        if again != got:
            log("  NOTE %s: the backend file changed while it was checked %s"
                % (self.name(), stage))
        if not self.summarized:
            self.summarize()
        log("    %s: %d bytes checked in %.2fs: %d with a required value, %d of them with "
            "acknowledged newer data, %d with several allowed values, %d never written%s"
            % (stage, st["bytes"], check_time, st["required"], st["newer"], st["multi"],
               st["untouched"], self.power_note if "power" in stage or "replay" in stage
               else ""))
        self.checked += st["bytes"]
        if violations:
            self.report(violations, stage)
            raise Failed("%s: %s%d byte(s) in %d segment(s) of the backend file hold data the "
                         "model does not allow (rerun: CRASH_SEED=%d CRASH_TRIALS=1 "
                         "CRASH_MODE=%s)"
                         % (stage, "at least " if st["bad_scanned"] >= BAD_BYTES_SCAN else "",
                            st["bad"], nbad, self.seed, self.mode))
        return st, got

    def summarize(self):
        self.summarized = True
        counts = {}
        lat = {}
        for op in self.ops:
            key = op.kind + ("+fua" if op.fua else "")
            a, b = counts.get(key, (0, 0))
            counts[key] = (a + 1, b + (op.ack is not None))
            if op.t_ack is not None:
                lat.setdefault(op.kind, []).append(op.t_ack - op.t_issue)
        log("  %s: %.2fs of load, %d requests (%s issued/acknowledged), %d flushes "
            "completed%s"
            % (self.name(), self.elapsed, len(self.ops),
               " ".join("%s=%d/%d" % (k, a, b) for k, (a, b) in sorted(counts.items())),
               sum(1 for op in self.ops if op.kind == "flush" and op.ack is not None),
               self.stats_note))
        log("    latency ms (mean/max): %s" % " ".join(
            "%s=%.1f/%.1f" % (k, 1000 * sum(v) / len(v), 1000 * max(v))
            for k, v in sorted(lat.items())))

    def report(self, violations, stage):
        for v in violations:
            req = "none (no guaranteed write)" if v.required is None else "0x%02x" % v.required
            log("  VIOLATION trial %d seed %d %s: offset %d: found 0x%02x, required %s, allowed {%s}"
                % (self.k, self.seed, stage, v.offset, v.found, req,
                   ", ".join("0x%02x" % a for a in v.allowed)))
            log("    initial byte 0x%02x; flush mark @%d; writes covering it, by issue:"
                % (self.initial[v.offset], self.flush_mark))
            for op in v.ops[-12:]:
                log("      %s: byte 0x%02x" % (op.describe(self.flush_mark),
                                               op.value(v.offset, v.offset + 1)[0]))


def trial_mode(seed):
    if MODE == "device":
        return "device"
    if MODE == "both":
        return "power" if seed % 2 else "kill"
    return MODE


def main():
    require_mode = MODE in ("kill", "power", "both", "device")
    nbdtest.check(require_mode, "CRASH_MODE must be kill, power, both or device, not %r" % MODE)
    if MODE == "device" and not os.path.exists("/dev/fuse"):
        nbdtest.skip("no /dev/fuse: the cache device lives on faultfs (FUSE)")
    if MODE in ("power", "both", "device") and faults is None:
        nbdtest.fail("CRASH_MODE=%s needs tests/lib/faults.py" % MODE)
    why = ("" if MODE != "kill" else " (no tests/lib/faults.py: no power loss)" if not faults
           else " (no /dev/fuse: no power loss)" if not os.path.exists("/dev/fuse") else "")
    log("crash_consistency: %d trial(s) from seed %d, mode %s%s, budget %gs"
        % (TRIALS, BASE_SEED, MODE, why, SECONDS))
    initial = random.Random(BASE_SEED ^ 0x5eed).randbytes(SIZE)
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    t0 = time.monotonic()
    done = {"kill": 0, "power": 0, "device": 0}
    checked = 0
    power_changed = 0
    self_tested = False
    base = nbdtest.shm_dir()
    for k in range(TRIALS):
        if time.monotonic() - t0 > SECONDS:
            log("time budget of %gs reached after %d of %d trials" % (SECONDS, k, TRIALS))
            break
        seed = BASE_SEED + k
        trial = Trial(k, seed, trial_mode(seed), initial)
        result = []

        def one(trial=trial, result=result):
            with nbdtest.tempdir(prefix="crash-", base=base) as tmp:
                result.append(trial.run(tmp))
        if checks.run(trial.name(), one, header=False):
            done[trial.mode] += 1
            st, got = result[0]
            checked += trial.checked
            power_changed += trial.power_changed
            if not self_tested and self_test(got, initial, trial.ops, trial.flush_mark):
                self_tested = True
                log("  checker self-test passed (a byte outside the allowed set is flagged)")
        # A trial keeps everything it wrote: let it go before the next one,
        # and make sure this process does not grow from trial to trial.
        trial.ops = None
        del result[:]
        rss = nbdtest.rss(os.getpid())
        if rss > MAX_RSS:
            checks.add("this test's own memory grew to %d MiB after trial %d" % (rss >> 20, k))
            break
    if MODE == "device":
        log("%d cache device trial(s) passed (kill, then replay; half with a power loss of the "
            "device), %d bytes checked, %.1fs" % (done["device"], checked,
                                                   time.monotonic() - t0))
    else:
        log("%d kill trial(s) and %d power-loss trial(s) passed, %d bytes checked, power "
            "losses changed %d 4 KiB blocks, %.1fs" % (done["kill"], done["power"], checked,
                                                      power_changed, time.monotonic() - t0))
    if not self_tested and not checks.failures:
        checks.add("the checker self-test never found a byte with a required value")
    checks.finish("crash consistency", unit="trial")


if __name__ == "__main__":
    main()
