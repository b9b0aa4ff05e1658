#!/usr/bin/python3
"""fault_matrix: writeback data survives backend faults, and FLUSH tells
the truth about it, over every kind of backend fault we can make.

Each case runs its own daemon (writeback, 64 MiB cache, --dirty-expire 1,
--backend-timeout 2) over an 8 MiB backend of seeded random bytes, and
three client connections (python libnbd, Unix socket):

  1  24 aligned writes of 4 KiB..256 KiB spread over the connections, no
     FUA: 12, then a wait until the background writeback has written and
     flushed them (no dirty or unstable bytes left: so that the fault
     finds data both written back and still dirty, and no background
     round under way; the stats must show backend writes), then 12 more
  2  the fault is injected
  3  FLUSH on every connection, one after the other, fails with EIO
     (answered within 10 x --backend-timeout: 20 s, under the 30 s
     default; one that never returns is a failure); in the -once case only
     the first must fail. Whenever any FLUSH succeeds, the backend must
     equal the clients' model at once
  4  the daemon is alive and every written range reads back, new data, on
     every connection (each answered within the same 20 s)
  5  the fault is cleared; FLUSH is retried until it succeeds (30 s at
     most), then the backend equals the model byte for byte; FLUSH on every
     connection succeeds; with faultfs, a power-loss then changes nothing
     (the data really was fsynced); the whole export reads back the model
  6  SIGTERM: exit 0, and the backend still equals the model

The cases:
  a1 file on faultfs, fail-fsync with lose-on-fsync-error: every failed
     fsync drops what was written since the last good one, as a kernel
     dropping dirty pages after a writeback error; data the daemon
     believes clean after a failed fsync is really gone
  a2 faultfs fail-fsync-once: the first fsync fails (dropping the unsynced
     data), later ones succeed; a daemon that retries the fsync without
     rewriting the data gets a FLUSH success over lost data (fsyncgate)
  a3 faultfs fail-write: writeback writes fail
  b1 nbdkit file plugin + tests/nbdkit-fault filter failing FLUSH, with
     drop-unflushed (a failed flush loses what was not flushed)
  b2 the filter failing WRITE
  c1 nbdkit SIGTERM (by PID) and, after step 4, a new nbdkit on the same
     socket
  c2 nbdkit serving a file on faultfs, SIGKILL, a power-loss of that file
     (the backend host crashed: what it had acknowledged but not flushed
     is gone), then a new nbdkit on the same socket
  d  nbdkit SIGSTOP, then SIGCONT after step 4

Nothing is skipped but for a kernel without FUSE (the faultfs cases). The
seed is fixed (printed). Every check runs; failures are listed at the end.

FAULT_MATRIX_BACKEND_TIMEOUT (default 2) is the daemons' --backend-timeout,
the wait in steps 3 and 4 10 x that; make asan and make i386 set 1.

No bound is a wall-clock figure that a busy machine could miss: the waits
are for states (written back, a reply), bounded at many times what the
daemon guarantees (its --backend-timeout; 30 s for the recovery).
"""

import errno
import os
import random
import signal
import sys
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import faults  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 8 * MIB
SEED = 31337
CONNS = 3
BACKEND_TIMEOUT = int(os.environ.get("FAULT_MATRIX_BACKEND_TIMEOUT", "2"))
# How long a FLUSH or READ under the fault may take before it counts as
# never answered: 10 x --backend-timeout, which bounds any request to an
# NBD backend (a file backend's errors come back at once), and less than
# the 30 s default, so a daemon that ignored the setting does not pass.
WAIT = 10 * BACKEND_TIMEOUT
RECOVER_SECONDS = 30
# After the first 12 writes, at most, for the background writeback
# (--dirty-expire 1 and a 250 ms tick: 1.25 s here).
WRITEBACK_LIMIT = 30
DAEMON_ARGS = ["--cache-size", "64M", "--cache-mode", "writeback", "--dirty-expire", "1",
               "--backend-timeout", str(BACKEND_TIMEOUT)]
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, OSError))


# ---- bounded calls ----

class Call(threading.Thread):
    """fn() on its own thread, so that a hang is seen, not suffered."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn = fn
        self.result = None
        self.error = None
        self.elapsed = None

    def run(self):
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except Exception as e:      # noqa: BLE001 - reported by the caller
            self.error = e
        self.elapsed = time.monotonic() - t0


def bounded(fn, timeout):
    """Start fn() and wait up to `timeout` s: the Call (alive if it hangs)."""
    c = Call(fn)
    c.start()
    c.join(timeout)
    return c


def outcome(c):
    """'ok', 'EIO', another errno name, or 'no reply'."""
    if c.is_alive():
        return "no reply"
    if c.error is None:
        return "ok"
    e = faults.errno_of(c.error)
    return errno.errorcode.get(e, str(c.error)) if e else str(c.error)


# ---- the backend and the model ----

def lost_summary(got, model, initial):
    """How the backend differs from the model, in 4 KiB blocks: how many
    differ and how many of those still hold the backend's initial bytes
    (writes lost)."""
    diff = old = 0
    for off in range(0, len(model), 4096):
        g, m = got[off:off + 4096], model[off:off + 4096]
        if g != m:
            diff += 1
            if g == initial[off:off + 4096]:
                old += 1
    return "%d of %d blocks differ, %d of them hold the bytes from before the writes " \
           "(acknowledged writes lost)" % (diff, len(model) // 4096, old)


class Case:
    """One backend fault. Subclasses set label, target (the --export path
    or URI) and implement inject(), clear() and backend_bytes()."""

    label = ""
    once = False        # only the first FLUSH must fail

    def __init__(self, tmp, initial):
        self.tmp = tmp
        self.initial = initial

    def inject(self):
        raise NotImplementedError

    def clear(self):
        raise NotImplementedError

    def backend_bytes(self):
        raise NotImplementedError

    def after_recovery(self, model):
        """Extra checks once a FLUSH succeeded (faultfs: power-loss)."""

    def close(self):
        pass

    def require_backend(self, model, when):
        got = self.backend_bytes()
        d = nbdtest.describe_diff(got, model)
        if d:
            raise Failed("the backend differs from the model %s: %s; %s"
                         % (when, d, lost_summary(got, model, self.initial)))


def write_initial(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class FaultfsCase(Case):
    mode = ""

    def __init__(self, tmp, initial, fs, name):
        super().__init__(tmp, initial)
        self.fs = fs
        self.name = name
        write_initial(fs.source(name), initial)      # underneath: nothing to undo
        self.target = fs.path(name)

    def inject(self):
        self.fs.lose_on_fsync_error(True)
        self.fs.set(self.mode)

    def clear(self):
        self.fs.set("ok")

    def backend_bytes(self):
        return nbdtest.read_at(self.fs.source(self.name), 0, SIZE + 1)

    def after_recovery(self, model):
        c = self.fs.counters()
        log("  faultfs: %s" % " ".join("%s=%s" % kv for kv in sorted(c.items())))
        self.fs.power_loss()
        self.require_backend(model, "after a power-loss that followed the successful FLUSH "
                             "(the data was not fsynced)")


class FailFsync(FaultfsCase):
    label = "a1 faultfs fail-fsync"
    mode = "fail-fsync"


class FailFsyncOnce(FaultfsCase):
    label = "a2 faultfs fail-fsync-once"
    mode = "fail-fsync-once"
    once = True


class FailWrite(FaultfsCase):
    label = "a3 faultfs fail-write"
    mode = "fail-write"


class FilterCase(Case):
    words = ()

    def __init__(self, tmp, initial, name):
        super().__init__(tmp, initial)
        self.image = os.path.join(tmp, name + ".img")
        write_initial(self.image, initial)
        self.kit = faults.NbdkitFault(tmp, self.image, name=name, drop_unflushed=True)
        self.target = self.kit.uri()

    def inject(self):
        self.kit.set(*self.words)

    def clear(self):
        self.kit.clear()

    def backend_bytes(self):
        return nbdtest.read_at(self.image, 0, SIZE + 1)

    def close(self):
        self.kit.stop()


class FilterFlush(FilterCase):
    label = "b1 nbdkit filter: flush fails (drop-unflushed)"
    words = ("flush",)


class FilterWrite(FilterCase):
    label = "b2 nbdkit filter: write fails"
    words = ("write",)


class KillRestart(FilterCase):
    label = "c1 nbdkit SIGTERM, restarted on the same socket"

    def inject(self):
        t0 = time.monotonic()
        self.kit.kill(signal.SIGTERM)
        log("  nbdkit exited %.2f s after SIGTERM" % (time.monotonic() - t0))

    def clear(self):
        if not self.kit.alive():
            self.kit.start()


class CrashPowerLoss(Case):
    label = "c2 nbdkit over faultfs: SIGKILL + power-loss, restarted"

    def __init__(self, tmp, initial, fs, name):
        super().__init__(tmp, initial)
        self.fs = fs
        self.name = name
        write_initial(fs.source(name), initial)
        self.kit = faults.NbdkitFault(tmp, fs.path(name), name=name)
        self.target = self.kit.uri()

    def inject(self):
        c = self.fs.counters()
        log("  before the crash: faultfs holds %d unsynced bytes of %d files"
            % (c["undo_bytes"], c["undo_files"]))
        self.kit.kill(signal.SIGKILL)
        self.fs.power_loss()

    def clear(self):
        if not self.kit.alive():
            self.kit.start()

    def backend_bytes(self):
        return nbdtest.read_at(self.fs.source(self.name), 0, SIZE + 1)

    def after_recovery(self, model):
        self.fs.power_loss()
        self.require_backend(model, "after a power-loss that followed the successful FLUSH "
                             "(nbdkit's flush was not an fsync of the data)")

    def close(self):
        self.kit.stop()


class StopCont(FilterCase):
    label = "d nbdkit SIGSTOP, then SIGCONT"

    def inject(self):
        self.kit.pause()

    def clear(self):
        self.kit.resume()


# ---- the steps ----

class Run:
    def __init__(self, case, d, seed):
        self.case = case
        self.d = d
        self.r = random.Random(seed)
        self.model = bytearray(case.initial)
        self.written = []           # (offset, length)
        self.hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(CONNS)]
        self.stuck = set()          # connections with a call that never returned
        self.calls = []             # every Call still possibly running
        self.reported_hang = False
        self.held = []              # the calls that did not return during the fault

    def expect(self, cond, msg):
        return CHECKS.expect(cond, "%s: %s" % (self.case.label, msg))

    def call(self, fn, timeout):
        c = bounded(fn, timeout)
        self.calls.append(c)
        return c

    def writes(self, n):
        sizes = (4 * KIB, 8 * KIB, 64 * KIB, 128 * KIB, 256 * KIB)
        for k in range(n):
            size = self.r.choice(sizes)
            off = self.r.randrange(0, (SIZE - size) // 4096 + 1) * 4096
            data = self.r.randbytes(size)
            self.hs[len(self.written) % CONNS].pwrite(data, off)
            self.model[off:off + size] = data
            self.written.append((off, size))

    def daemon_state(self):
        if self.d.alive():
            return "the daemon is running"
        return "the daemon is dead, exit status %s" % self.d.proc.returncode

    def flush_ok_check(self, k, when):
        """A FLUSH succeeded: everything acknowledged must be in the backend."""
        self.case.require_backend(self.model, "right after FLUSH on conn %d %s succeeded"
                                  % (k, when))

    def faulted_flushes(self):
        for k, h in enumerate(self.hs):
            if k in self.stuck:
                continue
            c = self.call(h.flush, WAIT)
            out = outcome(c)
            took = c.elapsed if c.elapsed is not None else WAIT
            log("  FLUSH on conn %d with the fault: %s after %.2f s" % (k, out, took))
            if out == "no reply":
                self.stuck.add(k)
                self.held.append(c)
                self.expect(False, "FLUSH on conn %d did not return within %.1f s "
                            "(--backend-timeout %d; expected EIO)"
                            % (k, WAIT, BACKEND_TIMEOUT))
                continue
            if out == "ok":
                if self.case.once and k > 0:
                    try:
                        self.flush_ok_check(k, "after the one failed fsync")
                    except Failed as e:
                        self.expect(False, str(e))
                    continue
                self.expect(False, "FLUSH on conn %d succeeded with the fault in place "
                            "(expected EIO)" % k)
                try:
                    self.flush_ok_check(k, "with the fault in place")
                except Failed as e:
                    self.expect(False, str(e))
            else:
                self.expect(out == "EIO", "FLUSH on conn %d failed with %s (%s), expected EIO"
                            % (k, out, self.daemon_state()))

    def reads_during_fault(self):
        self.expect(self.d.alive(), "the daemon died during the failed FLUSHes (%s)"
                    % self.daemon_state())
        if not self.d.alive():
            return
        for k, h in enumerate(self.hs):
            if k in self.stuck:
                continue
            for off, size in self.written:
                c = self.call(lambda h=h, off=off, size=size: h.pread(size, off), WAIT)
                out = outcome(c)
                if out != "ok":
                    if out == "no reply":
                        self.stuck.add(k)
                        self.held.append(c)
                    self.expect(False, "read of written range [%d, +%d) on conn %d during "
                                "the fault: %s" % (off, size, k, out))
                    break
                d = nbdtest.describe_diff(c.result, self.model[off:off + size], off)
                if d:
                    self.expect(False, "read of written range [%d, +%d) on conn %d during "
                                "the fault: not the new data: %s" % (off, size, k, d))
                    break

    def join_stuck(self):
        """Wait (5 s at most) for the calls the fault held; False if some
        still hang (reported once)."""
        deadline = time.monotonic() + 5
        for c in self.calls:
            c.join(max(0.0, deadline - time.monotonic()))
        still = [c for c in self.calls if c.is_alive()]
        if not still and self.stuck:
            log("  the calls held by the fault have returned: %s"
                % " ".join(outcome(c) for c in self.held))
            self.stuck.clear()
        if still and not self.reported_hang:
            self.reported_hang = True
            self.expect(False, "%d call(s) still without a reply 5 s after the fault was "
                        "cleared" % len(still))
        return not still

    def recover(self):
        """FLUSH until it succeeds (bounded), then check the backend."""
        usable = [k for k in range(CONNS) if k not in self.stuck]
        if usable:
            h = self.hs[usable[0]]
        else:
            h = nbdtest.libnbd_handle(self.d.unix_uri("disk"))
            self.hs.append(h)
            usable = [len(self.hs) - 1]
        deadline = time.monotonic() + RECOVER_SECONDS
        tries = []
        for _ in range(200):
            c = self.call(h.flush, max(1.0, deadline - time.monotonic()))
            out = outcome(c)
            tries.append(out)
            if out == "ok":
                break
            if out == "no reply" or time.monotonic() > deadline or not self.d.alive():
                break
            time.sleep(0.25)
        log("  FLUSH after clearing the fault: %d tries: %s" % (len(tries), " ".join(tries)))
        if tries[-1] != "ok":
            raise Failed("FLUSH never succeeded after the fault was cleared (%d tries, %s): %s"
                         % (len(tries), self.daemon_state(), " ".join(tries[-5:])))
        self.flush_ok_check(usable[0], "after the fault was cleared")
        for k in range(CONNS):
            if k in self.stuck:
                continue
            c = self.call(self.hs[k].flush, 10)
            self.expect(outcome(c) == "ok", "FLUSH on conn %d after recovery: %s"
                        % (k, outcome(c)))
        self.case.after_recovery(self.model)
        for k in range(CONNS):
            if k in self.stuck:
                continue
            c = self.call(lambda k=k: self.hs[k].pread(SIZE, 0), 10)
            if outcome(c) != "ok":
                self.expect(False, "read of the whole export on conn %d after recovery: %s"
                            % (k, outcome(c)))
                continue
            d = nbdtest.describe_diff(c.result, self.model)
            self.expect(not d, "read of the whole export on conn %d after recovery: %s"
                        % (k, d))

    def close(self):
        ok = self.join_stuck()
        if ok:
            nbdtest.shutdown_all([h for k, h in enumerate(self.hs) if k not in self.stuck])
        # Stuck handles are left to the daemon's exit: closing one under a
        # blocked call is not safe.


def run_case(case, seed):
    log("  %s: seed %d" % (case.label, seed))
    injected = False
    with nbdtest.running_daemon([("disk", case.target, "")], extra=DAEMON_ARGS) as d:
        run = Run(case, d, seed)
        try:
            run.writes(12)
            # --dirty-expire 1: the background writeback writes them and
            # its flush makes them clean (not a fixed sleep: a busy machine
            # may take longer than 1.25 s; and not only written: a fault
            # during the background flush makes the first FLUSH wait for
            # that round first, up to 2 x --backend-timeout)
            def settled():
                c = nbdtest.control_request(d.control, {"command": "stats"})["cache"]
                return c["dirty_bytes"] == 0 and c["unstable_bytes"] == 0
            written = nbdtest.wait_until(settled, WRITEBACK_LIMIT, step=0.1)
            run.writes(12)
            try:
                st = nbdtest.stats(d, keys=())
            except Failed as e:            # a missing stats line is not what this tests
                st = None
                log("  no stats before the fault: %s" % e)
            if st is not None:
                log("  before the fault: dirty_bytes=%s backend_writes=%s"
                    % (st.get("dirty_bytes"), st.get("backend_writes")))
                run.expect(written and int(st.get("backend_writes", 0)) > 0,
                           "test setup: the first 12 writes not written back within %d s "
                           "(--dirty-expire 1): the fault would find no data written back "
                           "but unflushed" % WRITEBACK_LIMIT)
            case.inject()
            injected = True
            run.faulted_flushes()
            run.reads_during_fault()
            case.clear()
            injected = False
            run.join_stuck()
            if not d.alive():
                raise Failed("no recovery to try: %s" % run.daemon_state())
            run.recover()
        finally:
            if injected:
                case.clear()
            run.close()
    case.require_backend(run.model, "after the daemon's SIGTERM")


def main():
    log("seed %d" % SEED)
    have_fuse = os.path.exists("/dev/fuse")
    if not have_fuse:
        log("SKIP: the faultfs cases (a1 a2 a3 c2): kernel lacks FUSE (no /dev/fuse)")
    init = random.Random(SEED).randbytes(SIZE)
    t_start = time.monotonic()
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        fs = faults.FaultFS(os.path.join(tmp, "ffs")).start() if have_fuse else None
        try:
            on_fs = [(FailFsync, "a1.img"), (FailFsyncOnce, "a2.img"), (FailWrite, "a3.img")]
            plans = [(cls, (tmp, init, fs, name)) for cls, name in on_fs] if fs else []
            plans += [(FilterFlush, (tmp, init, "b1")), (FilterWrite, (tmp, init, "b2")),
                      (KillRestart, (tmp, init, "c1"))]
            if fs:
                plans.append((CrashPowerLoss, (tmp, init, fs, "c2.img")))
            plans.append((StopCont, (tmp, init, "d")))
            for i, (cls, args) in enumerate(plans):
                made = []

                def one(cls=cls, args=args, i=i):
                    made.append(cls(*args))
                    run_case(made[0], SEED + i)
                try:
                    CHECKS.run(cls.label, one)
                finally:
                    if made:
                        made[0].close()
        finally:
            if fs:
                fs.stop()
    log("fault matrix took %.1f s" % (time.monotonic() - t_start))
    CHECKS.finish("fault matrix")


if __name__ == "__main__":
    main()
