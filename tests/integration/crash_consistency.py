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

Environment: CRASH_TRIALS (default 30, or 40 when both modes run, 5 in
the families below), CRASH_SEED (seed of the first
trial; trial i uses CRASH_SEED + i; rerun one trial with CRASH_SEED=S
CRASH_TRIALS=1, which repeats its configuration and operation sequence,
not the exact interleaving with the kill), CRASH_MODE (kill, power or
both; default both when tests/lib/faults.py exists and /dev/fuse too,
else kill; with both, odd seeds use power; or device or one of the
families below), CRASH_SECONDS (time budget, default 60 + 4 s a trial,
10 s in the families; past it no new trial starts), CRASH_TRIM (1
default, 0: no TRIM).

Mode "device" (tests/integration/cache_device_crash.py runs it): the
backend is a plain file, and --cache-device a 96 MiB file on faultfs, so
FLUSH and FUA are answered from its intent log. After the SIGKILL (and,
in half the trials, a power loss of the device: back to its last fsync)
a new daemon replays the log onto the backend and stops, writing
everything back; then the backend file is checked against the same
model: nothing FLUSH or FUA acknowledged may be missing.

The families (issue 46): the device mode with an event during the load,
on a thread of its own beside it; each trial draws the event's
parameters after everything the modes above draw. In device-fault and
backend-loss a request answered EIO after the (first) event guarantees
nothing (a FLUSH so answered raises no flush mark) and is counted, not
a failure; any other error, or one before the event, is; in resize
every error before the kill is. The replay's daemon listens on its Unix
socket only and gets SIGTERM once its drain is done (the device mode
stops it during the drain). The log lists the events with their time
into the load and the daemon's warnings and errors; a violation also
names, for the write whose value was required, when it was acknowledged,
what guaranteed it (FUA, or the first successful FLUSH after it) and how
many FLUSHes were answered with an error in between.

  "device-fault" (cache_device_crash_fault.py): at fault_at (0.05 to
  1 s into the load) faultfs on the device is set to "fail-write-after
  N" (N 0 to 3): N more writes land, every one after fails, so a commit
  lands in part and the daemon turns the intent log off (its exports
  writethrough); the load goes on 0.05 to 1 s more, then SIGKILL; the
  restart is on the healed device (faultfs "ok"). The log says whether
  the daemon's log says the intent log is off (when no device write
  came after the fault, the trial is a plain device trial), and how many
  FLUSHes issued after the fault succeeded.

  "backend-loss" (cache_device_crash_backend.py): the backend is
  nbdkit (faults.NbdkitFault: the file plugin through the fault filter,
  no faults set) over the image file, which lies on a faultfs of its
  own, reached as nbd+unix; the cache is 2 or 4 MiB and 8% of the writes
  are 1 to 3 MiB, so that writes go around it besides WRITE_ZEROES, TRIM
  and FUA. A backend power cut: SIGKILL of nbdkit by PID, then (faultfs
  settled) its power loss: the file back to its last fsync (nbdkit's
  flush, and FUA), so every write nbdkit acknowledged and did not flush
  is lost. (Not the filter's drop-unflushed: that drops at a failed
  flush only, not at a kill, and a flush of the daemon that passed the
  filter's gate before the drop could still succeed after it.) 0 to 3
  cuts during the load (each at its moment or, in half the trials, at
  the first reply to a direct operation after it, within 0.5 s), each
  followed by a new nbdkit on the same socket, started through one
  long-lived thread (nbdkit sets PR_SET_PDEATHSIG: one whose starting
  thread ends exits with it); then SIGKILL of the daemon, a last cut, a
  new nbdkit, the replay on the device (power loss of the device in
  half the trials) and nbdkit's SIGTERM; the image file is checked. The
  log says how many 4 KiB blocks each cut changed.

  "resize" (cache_device_crash_resize.py): at resize_at the export
  grows by 1, 4 or 16 MiB: os.truncate of the file then `nbdcachectl
  resize disk`, or `nbdcachectl resize disk NEWSIZE` (the daemon grows
  the file); once it answered, a fifth connection (Unix) sees the new
  size and joins the load, half its requests in the grown part (never
  across the old end), the four others go on over the old size. The
  kill: at a random moment (before, during or after the resize), or
  right after the truncate, a few ms after nbdcachectl started, right
  after it answered, or at the first acknowledged write on the new
  connection. The file must then have the new size if it was grown or
  the resize answered, else the old or the new one; the grown part is
  checked as initially zero (the same model: zeros or what was written
  there), and a file of the old size is checked without the requests
  past the old end. A failure names the resize's stage at the kill.

  "drain" (cache_device_crash_drain.py; issue 40): no event during the
  load, a crash in the replay instead. The backend file lies on a
  faultfs of its own (the daemons all name it by the same path, so the
  device's record of the backend's identity holds), the profile is lazy
  in half the trials (so that the load leaves the log more to drain), a
  trial with neither FLUSH nor FUA gets FLUSHes (FLUSH_WEIGHTS 1, 2 or
  5), and the kill is 0.3 to 1.5 s into the load. After the SIGKILL (and the
  device's power loss in half the trials), the first replay's daemon
  runs over a slow backend: every operation of the backend's faultfs
  sleeps 5, 10 or 20 ms first ("delay-ms"), so the drain of the live log
  takes a while. Once its stats show the drain under way
  (replay_pending_bytes > 0; a file backend's drain is one group, of up
  to 64 MiB: replay_drained_bytes moves only at its end, so the point is
  measured by the bytes of WRITEs the backend's faultfs took since the
  start, against the "N bytes of data to write back" of the daemon's
  log) it gets SIGKILL at drain_frac (0.02 to 1) of them written (at
  once when the log holds only zeros and trims), and in half the trials
  the device a power loss right after (both
  faultfs settled first). Then the second replay's daemon, the backend's
  delay off, drains the log (its stats: pending 0, the drain's time
  set) and gets SIGTERM, and the backend file is checked. The log says
  how many bytes were pending at the drain's SIGKILL and how many the
  backend had taken; a log with nothing to drain is said, and the trial
  goes on.
"""

import errno
import os
import queue
import random
import re
import select
import signal
import subprocess
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
# The families of cache device trials with an event during the load (see
# the docstring): each a mode of its own, run by its own entry file.
FAMILIES = ("device-fault", "backend-loss", "resize", "drain")
DEVICE_MODES = ("device",) + FAMILIES
TRIALS = int(os.environ.get("CRASH_TRIALS", "5" if MODE in FAMILIES else
                            "30" if MODE == "kill" else "40"))
SECONDS = float(os.environ.get("CRASH_SECONDS", str(60 + (10 if MODE in FAMILIES else 4)
                                                    * TRIALS)))
WITH_TRIM = os.environ.get("CRASH_TRIM", "1") != "0"
WRITE_BUDGET = 96 * MIB      # bytes of write data per trial (kept for the check)
DRAIN_SECONDS = 3.0          # reading replies after the kill
PIECE = 512                  # the check's second granularity
DEVICE_SIZE = 96 * MIB       # device mode: the cache device (log and level-2 area)
EVENTS_JOIN = 90             # seconds an event thread may take to end after the kill
SMALL_PROFILES = ("default", "eager", "tight")   # backend-loss: caches of 2 or 4 MiB
MAX_RSS = 2 << 30            # this process's memory: a leak ends the run
DRAIN_WAIT = 30              # drain: seconds the first replay's drain may take to reach its kill
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


# the drain's plan at the start of a daemon (its log)
START_LINE = (r"(\d+) batch\(es\), (\d+) record\(s\), (\d+) bytes of data to write back")


def device_stats(d):
    """The cache device's stats of daemon `d` (its control socket)."""
    return nbdtest.control_request(d.control, {"command": "stats"},
                                   timeout=10)["cache"]["cache_device"]


def drained(d, what, timeout=60):
    """Wait until the live log daemon `d` found at start is all on the
    backends (as tests/integration/cache_device.py's): its device stats."""
    st = None
    for _ in range(int(timeout * 10)):
        st = device_stats(d)
        if st["replay_pending_bytes"] == 0 and (st["replay_drain_ns"] or
                                                not st["replay_drained_bytes"]):
            return st
        time.sleep(0.1)
    raise Failed("%s: the log found at start was not written back in %d s: %s"
                 % (what, timeout, st))


def settle(fs, step=0.02, undo=True):
    """A request of the dead daemon that faultfs had already taken may
    still be carried out: wait until its counters stop moving (for `step`
    seconds: more than an operation's delay-ms), so that nothing lands
    after the check or the power loss. The counters. undo: its undo log
    (for a power loss) must not have overflowed."""
    c = fs.counters()
    for _ in range(100):
        time.sleep(step)
        c, before = fs.counters(), c
        if c == before:
            break
    require(not undo or not c.get("undo_overflow"), "faultfs's undo log overflowed: %r" % c)
    return c


class Spawner:
    """Runs calls on one thread that lives until close(). nbdkit sets
    PR_SET_PDEATHSIG (SIGTERM), and the parent it watches is the thread
    that forked it: an nbdkit started by a thread that then ends exits
    with it. So the backend-loss events start nbdkit through this."""

    def __init__(self):
        self.q = queue.Queue()
        self.t = threading.Thread(target=self.loop, name="spawner", daemon=True)
        self.t.start()

    def loop(self):
        for _ in range(10 ** 6):
            item = self.q.get()
            if item is None:
                return
            fn, box, done = item
            try:
                box.append(("ok", fn()))
            except Exception as e:      # noqa: BLE001 - raised again by call()
                box.append(("error", e))
            done.set()

    def call(self, fn, timeout=60):
        box, done = [], threading.Event()
        self.q.put((fn, box, done))
        if not done.wait(timeout):
            raise Failed("%s did not return within %ds" % (fn, timeout))
        how, value = box[0]
        if how == "error":
            raise value
        return value

    def close(self):
        self.q.put(None)
        self.t.join(30)


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
        # The families (FAMILIES): an event during the load, on a thread
        # of its own (events()); their parameters are drawn here, after
        # everything the other modes draw, so those modes are unchanged.
        self.errors_ok = False          # errors (EIO) allowed from now on: the event happened
        self.allowed_errors = {}        # kind -> errors allowed so far
        self.stop_events = threading.Event()   # set at the kill: an event thread ends
        self.event_error = None         # what an event thread raised
        self.event_notes = []           # what the events did, for the log
        self.t0 = None                  # monotonic time the load began
        self.image = None               # the backend file
        self.fs = None                  # the device's faultfs
        self.kit = None                 # backend-loss: the nbdkit
        self.bfs = None                 # backend-loss: the faultfs the image is on
        self.spawner = None             # backend-loss: starts it during the load
        self.kit_died = 0               # backend-loss: nbdkit found dead at a cut
        self.cut_blocks = []            # backend-loss: 4 KiB blocks each cut changed
        self.handles_lock = threading.Lock()
        self.pending_handles = []       # resize: a connection made after the grow
        self.grown = False              # resize: the backend file was grown
        self.resize_stage = "not begun"
        self.resized = False            # resize: nbdcachectl said it was done
        self.family_note = ""
        self.loss_armed = False
        self.loss_go = threading.Event()
        self.drain_note = ""            # drain: what the first replay's kill found
        self.drain_pending = None       # drain: replay_pending_bytes at its kill
        if mode in FAMILIES:
            self.init_family(r)

    def init_family(self, r):
        if self.mode == "device-fault":
            # fail-write-after N: the device fails part way through a commit
            self.fault_at = r.uniform(0.05, 1.0)
            self.fault_writes = r.randint(0, 3)
            self.kill_after = self.fault_at + r.uniform(0.05, 1.0)
        elif self.mode == "backend-loss":
            # a small cache, and writes of 1 to 3 MiB, so that writes go around it
            self.profile = r.choice(SMALL_PROFILES)
            self.losses = sorted(r.uniform(0.02, 1.2) for _ in range(r.choice((0, 1, 1, 2, 3))))
            # the loss at the first reply to a direct operation (WRITE_ZEROES,
            # TRIM, FUA, a write of 1 MiB or more) after its moment
            self.loss_after_direct = r.random() < 0.5
            self.kill_after = (self.losses[-1] if self.losses else 0) + r.uniform(0.05, 0.8)
        elif self.mode == "resize":
            self.grow = r.choice((1, 4, 16)) * MIB
            self.new_size = SIZE + self.grow
            # "truncate": os.truncate, then `nbdcachectl resize disk`;
            # "size": `nbdcachectl resize disk NEWSIZE` (the daemon grows the file)
            self.resize_how = r.choice(("truncate", "size"))
            self.resize_at = r.uniform(0.05, 1.0)
            # when the kill comes: "timer" (kill_after, before, during or after
            # the resize), "truncated" (right after os.truncate), "during"
            # (this long after nbdcachectl started), "resized" (right after
            # its reply), "new-ack" (at the first acknowledged write on the
            # connection made after the grow)
            self.kill_phase = r.choice(("timer", "timer", "truncated", "during", "resized",
                                        "new-ack"))
            if self.kill_phase == "truncated" and self.resize_how != "truncate":
                self.kill_phase = "during"
            self.during_delay = r.uniform(0, 0.02)
            if self.kill_phase == "timer":
                self.kill_after = max(0.03, self.resize_at + r.uniform(-0.3, 1.0))
            else:
                self.kill_after = self.resize_at + 1.5    # if the phase never comes
                self.kill_at_once = True
            self.inflight.append(0)     # the connection made after the grow
        elif self.mode == "drain":
            # a lazy profile in half the trials, and a load of 0.3 s or more,
            # so that the log has something to drain
            if r.random() < 0.5:
                self.profile = "lazy"
            self.kill_after = r.uniform(0.3, 1.5)
            # neither FLUSH nor FUA leaves the log nothing to drain
            if self.flush_weight == 0 and self.fua_rate == 0:
                self.flush_weight = r.choice((1, 2, 5))
                self.kinds = [kd for kd, w in WEIGHTS + (("flush", self.flush_weight),)
                              for _ in range(w)]
            # the first replay: the backend's operations slowed by this much
            # each, SIGKILL at this fraction of its pending bytes written, a
            # power loss of the device right after
            self.drain_delay_ms = r.choice((5, 10, 20))
            self.drain_frac = r.uniform(0.02, 1.0)
            self.drain_power_loss = r.random() < 0.5

    def name(self):
        return "trial %d (seed %d, %s%s, bs %d, %s, depth %d, flush %d%%, fua %d%%, kill %s%.3fs)" % (
            self.k, self.seed, self.mode,
            " delay %d ms" % self.fs_delay_ms if self.mode == "power" else "",
            self.bs, self.profile, self.depth,
            self.flush_weight * 100 // (len(self.kinds)), self.fua_rate * 100,
            "" if self.kill_at_once else "at the first FLUSH/FUA reply after ", self.kill_after) + (
            self.family_name() +
            (", device power loss" if self.mode in DEVICE_MODES and self.device_power_loss
             else ""))

    def family_name(self):
        if self.mode == "device-fault":
            return ", fail-write-after %d at %.3fs" % (self.fault_writes, self.fault_at)
        if self.mode == "backend-loss":
            return ", %s backend loss(es)%s%s" % (
                len(self.losses), " at " + "/".join("%.3fs" % t for t in self.losses)
                if self.losses else "", " (at a direct reply)" if self.loss_after_direct and
                self.losses else "")
        if self.mode == "resize":
            return ", grow +%d MiB by %s at %.3fs, kill %s" % (
                self.grow // MIB, "os.truncate + resize" if self.resize_how == "truncate"
                else "resize NEWSIZE", self.resize_at,
                "by the timer" if self.kill_phase == "timer" else
                "%.3fs into nbdcachectl" % self.during_delay if self.kill_phase == "during"
                else "when " + self.kill_phase)
        if self.mode == "drain":
            return ", replay over a backend delayed %d ms, killed at %d%% of its drain%s" % (
                self.drain_delay_ms, round(self.drain_frac * 100),
                " then a device power loss" if self.drain_power_loss else "")
        return ""

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
            dev = c.get("cache_device")
            if self.mode in FAMILIES and dev:
                self.stats_note += ("; the device: %d commits, %d full rounds for want of log "
                                    "room, %s" % (dev.get("commits", -1),
                                                 dev.get("full_log_fallbacks", -1),
                                                 "failed" if dev.get("failed") else "not failed"))
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
            self.stop_events.set()
            p = self.daemon.proc
            if p.poll() is not None:
                self.died_early = True
                return
            p.send_signal(signal.SIGKILL)

    # ---- the families' events (a thread of their own beside the load) ----

    def start_events(self):
        fn = {"device-fault": self.fault_events, "backend-loss": self.loss_events,
              "resize": self.resize_events}.get(self.mode)
        if fn is None:
            return None
        t = threading.Thread(target=self.run_events, args=(fn,), name=self.mode, daemon=True)
        t.start()
        return t

    def run_events(self, fn):
        try:
            fn()
        except Exception as e:      # noqa: BLE001 - reported by drive()
            self.event_error = "%s: %s" % (type(e).__name__, e)
            self.kill_now()

    def wait_for(self, at):
        """Sleep until `at` seconds into the load; False once the kill came."""
        for _ in range(10 ** 5):
            left = self.t0 + at - time.monotonic()
            if self.killed is not None or self.stop_events.is_set():
                return False
            if left <= 0:
                return True
            self.stop_events.wait(min(left, 0.1))
        return False

    def note(self, text):
        text = "%.3fs: %s" % (time.monotonic() - self.t0, text)
        self.event_notes.append(text)
        log("  event at " + text)

    def fault_events(self):
        """device-fault: from fault_at on, the device takes fault_writes
        more writes and fails every one after."""
        if not self.wait_for(self.fault_at):
            return
        self.errors_ok = True
        self.fs.set("fail-write-after %d" % self.fault_writes)
        self.note("the cache device fails after %d more write(s)" % self.fault_writes)

    def loss_events(self):
        """backend-loss: at each moment of `losses` (or at the first reply
        to a direct operation after it, within 0.5 s), a power cut of the
        backend: its unflushed writes dropped, nbdkit killed and started
        again on the same socket."""
        for at in self.losses:
            if not self.wait_for(at):
                return
            how = "at its moment"
            if self.loss_after_direct:
                self.loss_go.clear()
                self.loss_armed = True
                fired = self.loss_go.wait(0.5)
                self.loss_armed = False
                how = "after a direct operation's reply" if fired else "(no direct reply in 0.5 s)"
            if self.killed is not None:
                return                  # the last cut follows the kill
            self.errors_ok = True
            self.backend_power_cut("the load " + how)
            if self.killed is not None:
                return                  # nbdkit stays down until the last cut
            self.spawner.call(self.kit.start)
            self.note("nbdkit started again")

    def backend_power_cut(self, why):
        """A power cut of the backend: nbdkit SIGKILLed by PID (no reply
        can follow), then the image's faultfs, once settled, rolls it
        back to its last successful fsync (nbdkit's flush and FUA)."""
        kit = self.kit
        if kit.alive():
            kit.kill(signal.SIGKILL)
            died = ""
        else:
            # (nbdkit 1.32 may abort when a client hangs up with replies
            # pending, RHBZ#2173054)
            self.kit_died += 1
            died = "; it had exited on its own (status %s: %s)" % (
                kit.proc.returncode, kit.log_tail()[-300:].replace("\n", " | "))
        settle(self.bfs)
        with open(self.bfs.source("disk.img"), "rb") as f:
            before = f.read()
        self.bfs.power_loss()
        with open(self.bfs.source("disk.img"), "rb") as f:
            after = f.read()
        n = max(len(before), len(after))
        changed = sum(1 for a in range(0, n, 4096) if before[a:a + 4096] != after[a:a + 4096])
        self.cut_blocks.append(changed)
        self.note("backend power cut (%s): nbdkit killed, its file back to its last fsync "
                  "(%d 4 KiB blocks changed)%s" % (why, changed, died))

    def resize_events(self):
        """resize: the backend grows by `grow` bytes at resize_at; a new
        connection then writes in the grown part too."""
        if not self.wait_for(self.resize_at):
            return
        args = ["resize", "disk"]
        if self.resize_how == "truncate":
            os.truncate(self.image, self.new_size)
            self.grown = True
            self.resize_stage = "file grown, nbdcachectl not yet run"
            self.note("backend file grown to %d bytes" % self.new_size)
            if self.kill_phase == "truncated":
                self.kill_now()
                return
        else:
            args.append(str(self.new_size))
        cmd = [nbdtest.NBDCACHECTL, "--control", self.daemon.control] + args
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
        self.resize_stage = "nbdcachectl %s running" % " ".join(args)
        if self.kill_phase == "during":
            time.sleep(self.during_delay)
            self.kill_now()
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()                    # by PID: the nbdcachectl started here
            p.communicate()
            raise Failed("nbdcachectl %s did not end within 60 s" % " ".join(args))
        self.note("nbdcachectl %s -> %d: %s%s" % (" ".join(args), p.returncode, out.strip(),
                                                   err.strip()))
        if self.resize_how == "size" and os.path.getsize(self.image) == self.new_size:
            self.grown = True
        if p.returncode != 0:
            if self.killed is not None:
                self.resize_stage = "nbdcachectl %s cut by the kill" % " ".join(args)
                return
            raise Failed("nbdcachectl %s failed before the kill: %s%s"
                         % (" ".join(args), out, err))
        self.resize_stage = "resized (nbdcachectl answered)"
        self.resized = True
        if self.kill_phase == "resized":
            self.kill_now()
            return
        if self.killed is not None:
            return
        try:
            h = nbdtest.libnbd_handle(self.daemon.unix_uri("disk"))
            size = h.get_size()
        except nbd.Error as e:
            if self.killed is not None:
                return
            raise Failed("a connection after the grow: %s" % e)
        require(size == self.new_size, "a connection after the grow sees %d bytes, not %d"
                % (size, self.new_size))
        with self.handles_lock:
            if self.killed is None:
                self.pending_handles.append(h)
                self.resize_stage = "resized, a new connection writing"
        self.note("a new connection (%d bytes) joins the load" % size)

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
            if self.loss_armed and (op.kind in ("zero", "trim") or op.fua or
                                    (op.kind == "write" and op.n >= MIB)):
                self.loss_armed = False
                self.loss_go.set()      # backend-loss: the loss follows this reply
            if (op.conn >= CONNS and op.kind == "write" and self.mode == "resize" and
                    self.kill_phase == "new-ack"):
                self.resize_stage = "a write on the new connection acknowledged"
                self.kill_now()
        else:
            op.err = e
            if self.killed is None:
                if self.errors_ok and e == errno.EIO:
                    # a family's event happened: an EIO guarantees nothing
                    self.allowed_errors[op.kind] = self.allowed_errors.get(op.kind, 0) + 1
                else:
                    self.unexpected.append("%s: errno %d" % (op.describe(), e))
        return 1

    def issue(self, c, h):
        r = self.r
        kind = r.choice(self.kinds)
        if kind in ("write", "zero") and self.written >= WRITE_BUDGET:
            kind = "read"
        op = Op(len(self.ops), kind, c)
        if kind != "flush":
            if kind == "write" and self.mode == "backend-loss" and r.random() < 0.08:
                op.n = r.randint(MIB, 3 * MIB)     # more than a small cache takes
            else:
                op.n = pick_len(r)
            if c >= CONNS and r.random() < 0.5:
                # resize: the new connection, in the grown part (never across
                # the old end, so the check can leave out what a crash before
                # the grow never wrote)
                op.n = min(op.n, self.grow)
                op.off = SIZE + r.randrange(self.grow - op.n + 1)
                if r.random() < 0.5:
                    op.off = max(SIZE, op.off - op.off % 4096)
            else:
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
        t0 = self.t0 = time.monotonic()
        timer = threading.Timer(self.kill_after, self.timer_fired)
        timer.start()
        events = self.start_events()
        limit = self.kill_after + 2
        try:
            for _ in range(10 ** 7):
                if self.pending_handles:
                    with self.handles_lock:
                        handles.extend(self.pending_handles)
                        del self.pending_handles[:]
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
            self.stop_events.set()
            if events is not None:
                events.join(EVENTS_JOIN)
                if events.is_alive():
                    self.kill_now()
                    raise Failed("the %s event thread did not end within %ds of the kill"
                                 % (self.mode, EVENTS_JOIN))
        if self.event_error is not None:
            raise Failed("%s event: %s" % (self.mode, self.event_error))
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
        if self.mode in DEVICE_MODES:
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
        """The backend a plain file (backend-loss: nbdkit over one), the
        cache device (the intent log) a file on faultfs: the load (and a
        family's event), SIGKILL, in half the trials a power loss of the
        device too (back to its last fsync; backend-loss: and always of
        the backend), then a new daemon replays the log onto the backend
        and stops (writing everything back): the backend file must hold
        everything FLUSH or FUA acknowledged."""
        path = self.image = os.path.join(tmp, "disk.img")
        if self.mode == "backend-loss":
            # the image on a faultfs of its own: a cut rolls it back alone
            self.bfs = faults.FaultFS(os.path.join(tmp, "backendfs"))
            path = self.image = self.bfs.source("disk.img")
        elif self.mode == "drain":
            # the image on a faultfs of its own: delay-ms slows the first
            # replay's drain (every daemon names it by the same path)
            self.bfs = faults.FaultFS(os.path.join(tmp, "backendfs"))
            path = self.image = self.bfs.source("disk.img")
        else:
            self.prepare(path)
        with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
            self.fs = fs
            with open(fs.path("cache.dev"), "wb") as f:
                f.truncate(DEVICE_SIZE)
                os.fsync(f.fileno())
            extra = ["--cache-device", fs.path("cache.dev")]
            if self.fs_delay_ms:
                fs.set("delay-ms %d" % self.fs_delay_ms)
            serve = path
            try:
                if self.mode == "backend-loss":
                    self.bfs.start()
                    self.prepare(path)
                    self.kit = faults.NbdkitFault(tmp, self.bfs.path("disk.img"), name="backend")
                    self.spawner = Spawner()
                    serve = self.kit.uri()
                elif self.mode == "drain":
                    self.bfs.start()
                    self.prepare(path)
                    serve = self.bfs.path("disk.img")
                self.crash(serve, tmp, extra)
                c = settle(fs)
                fs.set("ok")
                if self.mode == "backend-loss":
                    self.backend_power_cut("after the daemon's SIGKILL")
                    self.kit.start()
                if self.mode == "drain":
                    settle(self.bfs, undo=False)    # the killed daemon's backend writes
                if self.device_power_loss:
                    fs.power_loss()
                if self.mode == "drain":
                    self.drain_crash(tmp, serve, extra)
                cache, args = PROFILES[self.profile]
                workdir = os.path.join(tmp, "replay")
                os.mkdir(workdir)
                t1 = time.monotonic()
                try:
                    # (the families' replay without TCP: a port taken meanwhile by
                    # a test beside this one cannot fail it)
                    d = nbdtest.CheckedDaemon([("disk", serve, "")], threads=2, workdir=workdir,
                                              extra=["--cache-mode", "writeback", "--cache-size",
                                                     cache, "--block-size", str(self.bs)] +
                                              args + extra, tcp=self.mode not in FAMILIES,
                                              what="the cache device after the crash")
                except Failed as e:
                    raise Failed("%s%s" % (e, self.event_summary()))
                t2 = time.monotonic()
                if self.mode == "drain":
                    st = drained(d, "the second replay")
                    self.drain_note += "; the second replay drained %d bytes in %.2fs" % (
                        st["replay_drained_bytes"], st["replay_drain_ns"] / 1e9)
                elif self.mode in FAMILIES:
                    # SIGTERM once the drain is done (a stop during it
                    # waits for it; the device mode covers that)
                    for _ in range(300):
                        text = d.log_text()
                        if "to write back" not in text or "on the backends:" in text:
                            break
                        time.sleep(0.1)
                d.stop()
                t3 = time.monotonic()
            finally:
                if self.kit is not None:
                    self.kit.stop()     # SIGTERM by PID (its writes went through faultfs)
                if self.spawner is not None:
                    self.spawner.close()
                if self.bfs is not None:
                    self.bfs.stop()
            with open(d.logpath) as f:
                text = f.read()
            # Nothing fails during the replay's daemon: a stop during its
            # drain waits for it, and says no error of bytes not durable.
            if "are not durable yet" in text:
                raise Failed("the replay's daemon, stopped, said bytes were not durable "
                             "though nothing failed: %s" % next(
                                 ln for ln in text.splitlines() if "not durable yet" in ln))
            replayed = [ln.split("info: ", 1)[-1] for ln in text.splitlines()
                        if "to write back" in ln or "on the backends:" in ln]
            self.power_note = "; %s; %s" % (
                "device power loss (%d fsyncs before)" % c.get("fsyncs_ok", -1)
                if self.device_power_loss else "no power loss",
                "; ".join(replayed) if replayed else "nothing to replay")
            if self.mode in FAMILIES:
                self.power_note += "; the replay's daemon started in %.2fs, stopped in %.2fs" % (
                    t2 - t1, t3 - t2)
        return self.verify(path, "after the replay")

    def drain_crash(self, tmp, serve, extra):
        """drain: the first replay's daemon over the backend's faultfs with
        every operation delayed drain_delay_ms, SIGKILLed once drain_frac of
        the bytes pending at its start went to the backend (or its drain
        ended, or DRAIN_WAIT passed); both faultfs settled, then in half the
        trials a power loss of the device. The device's faultfs counters
        (for the power note)."""
        fs, bfs = self.fs, self.bfs
        cache, args = PROFILES[self.profile]
        workdir = os.path.join(tmp, "drain")
        os.mkdir(workdir)
        bfs.set("delay-ms %d" % self.drain_delay_ms)
        base = bfs.counters().get("bytes_written", 0)
        t1 = time.monotonic()
        try:
            d = nbdtest.CheckedDaemon([("disk", serve, "")], threads=2, workdir=workdir,
                                      extra=["--cache-mode", "writeback", "--cache-size", cache,
                                             "--block-size", str(self.bs)] + args + extra,
                                      tcp=False, what="the cache device after the crash "
                                      "(the first replay, a slow backend)")
        except Failed as e:
            raise Failed("%s%s" % (e, self.event_summary()))
        started = time.monotonic() - t1
        st = None
        wrote = 0
        try:
            st = first = device_stats(d)
            how = None
            if first["replay_pending_bytes"] == 0:
                how = ("nothing to drain" if not first["replay_drained_bytes"] else
                       "its drain over before the first stats (%d bytes drained)"
                       % first["replay_drained_bytes"])
            # The point of the drain: the bytes of WRITEs the backend's faultfs
            # took, of the log's "N bytes of data to write back" (a file
            # backend's drain is one group: replay_drained_bytes moves at its
            # end only; its WRITE_ZEROES and TRIM pieces are no writes there).
            data = None
            for _ in range(DRAIN_WAIT * 200):
                if how is not None:
                    break
                if data is None:
                    m = re.search(START_LINE, d.log_text())
                    data = int(m.group(3)) if m else None
                st = device_stats(d)
                wrote = bfs.counters().get("bytes_written", 0) - base
                if st["replay_pending_bytes"] == 0:
                    how = "its drain over before the kill (%d bytes drained)" % (
                        st["replay_drained_bytes"])
                elif data == 0:
                    how = "no data to write back, %d bytes of zeros and trims" % (
                        st["replay_pending_bytes"])
                elif data is not None and wrote >= self.drain_frac * data:
                    how = "%d%% of the drain's data written" % min(100, wrote * 100 // data)
                elif time.monotonic() - t1 > DRAIN_WAIT:
                    how = "its drain not at %d%% after %ds" % (round(self.drain_frac * 100),
                                                               DRAIN_WAIT)
                else:
                    time.sleep(0.005)
            t_kill = time.monotonic() - t1
            d.kill()                    # SIGKILL by PID, reaped
        finally:
            d.kill()
            text = d.log_text()
            d.logf.close()
        if "Sanitizer" in text or "runtime error:" in text:
            log(text[-8000:])
            raise Failed("sanitizer report in the first replay's daemon log")
        bfs.set("ok")                   # (also its delay off)
        settle(bfs, step=max(0.02, 0.003 * self.drain_delay_ms), undo=False)
        took = bfs.counters().get("bytes_written", 0) - base
        c = settle(fs)
        if self.drain_power_loss:
            fs.power_loss()
        self.drain_pending = st["replay_pending_bytes"] if st else None
        planned = [ln.split("info: ", 1)[-1] for ln in text.splitlines()
                   if "to write back" in ln or "on the backends:" in ln]
        warned = [ln for ln in text.splitlines() if "warn" in ln or "error" in ln]
        self.drain_note = (
            "started in %.2fs with %d bytes pending; SIGKILL %.2fs after its start (%s) with "
            "%d bytes pending, %d drained (stats); the backend took %d bytes from it "
            "(%d by the kill's poll); %s; %s%s"
            % (started, first["replay_pending_bytes"] if st else -1, t_kill, how,
               self.drain_pending if st else -1, st["replay_drained_bytes"] if st else -1,
               took, wrote, "then a device power loss (%d fsyncs before)" % c.get(
                   "fsyncs_ok", -1) if self.drain_power_loss else "no device power loss",
               "; ".join(planned) if planned else "its log says nothing to write back",
               "; %d warning(s)/error(s), the first: %s" % (len(warned), warned[0][:300])
               if warned else ""))
        log("  drain kill: %d bytes pending at the SIGKILL (%s)" % (
            self.drain_pending if st else -1, how))
        return c

    def event_summary(self):
        """The family's events, for a failure message."""
        if self.mode == "resize":
            return " (resize at the kill: %s)" % self.resize_stage
        if self.mode == "drain":
            return " (the first replay: %s)" % (self.drain_note or "not run")
        if self.event_notes:
            return " (events: %s)" % "; ".join(self.event_notes)
        return " (no event before the kill)" if self.mode in FAMILIES else ""

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
        if self.mode in FAMILIES:
            warned = [ln for ln in text.splitlines() if "warn" in ln or "error" in ln]
            for ln in warned[:8]:
                log("    daemon: %s" % ln[:300])
            if len(warned) > 8:
                log("    daemon: ... %d more warnings and errors" % (len(warned) - 8))
        if self.mode == "device-fault":
            self.family_note = "; the daemon's log %s" % (
                "says the intent log is off (writethrough)"
                if "intent log is off" in text or "writethrough from now on" in text
                else "does not say the intent log is off")
        require(not self.unexpected, "requests failed before the kill%s: %s"
                % (" (not EIO, or before the event)" if self.mode in FAMILIES else "",
                   "; ".join(self.unexpected[:5])))

    def sizes(self):
        """The sizes the backend file may have at the check."""
        if self.mode != "resize" or self.resize_stage == "not begun":
            return (SIZE,)
        if self.grown or self.resized:
            return (self.new_size,)
        return (SIZE, self.new_size)    # the kill came while the daemon grew it

    def model_for(self, got):
        """(the initial content, the requests) that `got` is checked
        against: resize: a grown part starts as zeros; a file not grown
        (a crash before the grow) is checked without the requests past the
        old end, which only a connection made after the grow sent."""
        if len(got) <= SIZE:
            return self.initial, [op for op in self.ops if op.off < SIZE]
        return self.initial + bytes(len(got) - SIZE), self.ops

    def verify(self, source, stage):
        """Check every byte of the file `source` against the model."""
        require(os.path.getsize(source) in self.sizes(), "%s: the backend file has %d bytes, "
                "not %s%s" % (stage, os.path.getsize(source),
                              " or ".join(map(str, self.sizes())), self.event_summary()))
        with open(source, "rb") as f:
            got = f.read()
        initial, ops = self.model_for(got)
        t1 = time.monotonic()
        violations, nbad, st = check_file(got, initial, ops, self.flush_mark)
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
            self.report(violations, stage, initial)
            raise Failed("%s: %s%d byte(s) in %d segment(s) of the backend file hold data the "
                         "model does not allow (rerun: CRASH_SEED=%d CRASH_TRIALS=1 "
                         "CRASH_MODE=%s)%s"
                         % (stage, "at least " if st["bad_scanned"] >= BAD_BYTES_SCAN else "",
                            st["bad"], nbad, self.seed, self.mode, self.event_summary()))
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
        if self.mode in FAMILIES:
            flushed_after = 0
            if self.mode == "drain":
                log("    the first replay: %s" % (self.drain_note or "not run"))
                return
            if self.mode == "resize":
                what = "resize at the kill: %s" % self.resize_stage
                new = [op for op in self.ops if op.conn >= CONNS]
                what += "; %d requests on the new connection (%d acknowledged, %d past the old " \
                    "end)" % (len(new), sum(1 for op in new if op.ack is not None),
                              sum(1 for op in new if op.off >= SIZE))
            else:
                what = "events: %s" % ("; ".join(self.event_notes) or "none before the kill")
                flushed_after = sum(1 for op in self.ops if op.kind == "flush" and
                                    op.ack is not None and op.err is None and
                                    op.t_issue >= self.t0 + (self.first_event_at() or INF))
                what += "; %d FLUSH(es) issued after the first event succeeded" % flushed_after
                if self.cut_blocks:
                    what += "; 4 KiB blocks each backend cut changed: %s" % "/".join(
                        map(str, self.cut_blocks))
                if self.kit_died:
                    what += "; nbdkit had exited on its own at %d cut(s)" % self.kit_died
            log("    %s; EIO allowed after the event: %s%s"
                % (what, " ".join("%s=%d" % kv for kv in sorted(self.allowed_errors.items()))
                   or "none", self.family_note))

    def first_event_at(self):
        """Seconds into the load of the first event noted, or None."""
        if not self.event_notes:
            return None
        return float(self.event_notes[0].split("s:", 1)[0])

    def report(self, violations, stage, initial):
        for v in violations:
            req = "none (no guaranteed write)" if v.required is None else "0x%02x" % v.required
            log("  VIOLATION trial %d seed %d %s: offset %d: found 0x%02x, required %s, allowed {%s}"
                % (self.k, self.seed, stage, v.offset, v.found, req,
                   ", ".join("0x%02x" % a for a in v.allowed)))
            log("    initial byte 0x%02x; flush mark @%d; writes covering it, by issue:"
                % (initial[v.offset], self.flush_mark))
            for op in v.ops[-12:]:
                log("      %s: byte 0x%02x" % (op.describe(self.flush_mark),
                                               op.value(v.offset, v.offset + 1)[0]))
            if self.mode in FAMILIES:
                self.report_promise(v)

    def report_promise(self, v):
        """The families: when the required write was acknowledged and what
        made it guaranteed, against the events' times."""
        g = [op for op in v.ops if op.guaranteed(self.flush_mark)]
        if not g:
            return
        w = max(g, key=lambda o: o.issue)
        flushes = [op for op in self.ops if op.kind == "flush" and op.issue > w.ack]
        ok = [op for op in flushes if op.ack is not None]
        failed = [op for op in flushes if op.err is not None and
                  (not ok or op.issue < ok[0].issue)]
        log("    the required write #%d: acknowledged %.3fs into the load; %s; FLUSHes answered "
            "with an error between its reply and that: %d%s"
            % (w.no, w.t_ack - self.t0,
               "FUA" if w.fua else "first successful FLUSH after it: #%d conn %d, issued %.3fs "
               "into the load" % (ok[0].no, ok[0].conn, ok[0].t_issue - self.t0) if ok else "?",
               len(failed), " (conn %s)" % ",".join(str(op.conn) for op in failed[:8])
               if failed else ""))


def trial_mode(seed):
    if MODE in DEVICE_MODES:
        return MODE
    if MODE == "both":
        return "power" if seed % 2 else "kill"
    return MODE


def main():
    require_mode = MODE in ("kill", "power", "both") + DEVICE_MODES
    nbdtest.check(require_mode, "CRASH_MODE must be kill, power, both, device, %s, not %r"
                  % (", ".join(FAMILIES), MODE))
    if MODE in DEVICE_MODES and not os.path.exists("/dev/fuse"):
        nbdtest.skip("no /dev/fuse: the cache device lives on faultfs (FUSE)")
    if MODE == "backend-loss" and not nbdtest.shutil.which(faults.NBDKIT if faults else "nbdkit"):
        nbdtest.fail("CRASH_MODE=backend-loss needs nbdkit")
    if MODE in ("power", "both") + DEVICE_MODES and faults is None:
        nbdtest.fail("CRASH_MODE=%s needs tests/lib/faults.py" % MODE)
    why = ("" if MODE != "kill" else " (no tests/lib/faults.py: no power loss)" if not faults
           else " (no /dev/fuse: no power loss)" if not os.path.exists("/dev/fuse") else "")
    log("crash_consistency: %d trial(s) from seed %d, mode %s%s, budget %gs"
        % (TRIALS, BASE_SEED, MODE, why, SECONDS))
    initial = random.Random(BASE_SEED ^ 0x5eed).randbytes(SIZE)
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    t0 = time.monotonic()
    done = dict.fromkeys(("kill", "power") + DEVICE_MODES, 0)
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
            if not self_tested and self_test(got, *trial.model_for(got), trial.flush_mark):
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
    elif MODE in FAMILIES:
        log("%d %s trial(s) passed (%s, kill, then replay; half with a power loss of the "
            "device%s), %d bytes checked, %.1fs"
            % (done[MODE], MODE, {"device-fault": "the device failing part way through a commit",
                                  "backend-loss": "backend power cuts during the load",
                                  "resize": "the export grown during the load",
                                  "drain": "SIGKILL of the replay during its drain, half of them "
                                           "with a power loss of the device then"}[MODE],
               ", always of the backend" if MODE == "backend-loss" else "", checked,
               time.monotonic() - t0))
    else:
        log("%d kill trial(s) and %d power-loss trial(s) passed, %d bytes checked, power "
            "losses changed %d 4 KiB blocks, %.1fs" % (done["kill"], done["power"], checked,
                                                      power_changed, time.monotonic() - t0))
    # A trial may promise nothing (no FLUSH or FUA succeeded: a family's
    # fault can fail them all); over a few trials (the sanitizer passes
    # run 2 or 3 of a family) that is no failure of the checker, said;
    # over 5 or more it would be.
    ran = sum(done.values())
    if not self_tested and not checks.failures and ran >= 5:
        checks.add("the checker self-test never found a byte with a required value")
    elif not self_tested and not checks.failures:
        log("the checker self-test was not run: none of the %d trial(s) promised a byte "
            "(it needs 5 or more to be required)" % ran)
    checks.finish("crash consistency", unit="trial")


if __name__ == "__main__":
    main()
