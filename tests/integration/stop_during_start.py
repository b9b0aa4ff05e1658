#!/usr/bin/python3
"""stop_during_start: a SIGTERM at any moment of a start is a clean stop
(issue 40; nbdcached(8), SIGNALS).

The daemon blocks its signals from main()'s first line: a SIGTERM before
the event loop handles them stays pending, the start stops between its
steps (and an NBD backend's first connection stops waiting), and the
process ends as a stop does: exit status 0, its Unix sockets (NBD and
control) and its pidfile removed, no error in its log, the line "signal
15 during the start" or, once it serves, "signal 15: shutting down", and
"stopped" last. On main the socket could be connected to before the
signal handlers were installed: a SIGTERM then ended the daemon by the
signal's default action (exit -15, sockets and pidfile left behind).

  moments       ROUNDS x DELAYS starts over a file (and as many with a
                fresh cache device): SIGTERM as soon as the NBD socket
                appears, then after each of DELAYS; every one a clean stop.
  nbd_connect   an nbdkit: backend whose open takes OPEN_DELAY s (20 s,
                nbdkit's delay filter; under the 30 s --backend-timeout the
                first connection waits): SIGTERM while the daemon waits for
                its first connection (before any socket exists), at two
                moments; a clean stop within STOP_WITHIN s (half the open
                delay: a stop that waited for the open takes the rest of
                it, one that does not takes milliseconds), nbdkit gone with
                it.
  children      an nbdkit the daemon starts (through libnbd) does not
                inherit the blocked signals: SIGTERM and SIGINT are not in
                its SigBlk; the daemon's own main thread takes them once it
                serves.
  detached      without --foreground: SIGTERM to the process that started
                as soon as the NBD socket appears (while it was still
                alive): whether it came before or after the fork, the
                daemon stops (the socket goes away, nothing answers on it,
                no pidfile), never serves on unstopped.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import shutil
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402

ROUNDS = 3
DELAYS = [0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.02]
# The backend's open is long enough that a stop waiting for it shows as
# many seconds (OPEN_DELAY - 1.5 at least), and the bound, half of it, is
# thousands of times what a stop that does not wait takes (milliseconds):
# a busy machine cannot reach it.
OPEN_DELAY = 20
STOP_WITHIN = OPEN_DELAY / 2
CHECKS = nbdtest.Checks()
expect = CHECKS.expect


class Start:
    """One daemon started in its own directory, its log in a file."""

    def __init__(self, backend, extra=(), foreground=True, tmp=None):
        self.tmp = tmp or tempfile.mkdtemp(prefix="nbdcached-stop-")
        self.sock = os.path.join(self.tmp, "nbd.sock")
        self.control = os.path.join(self.tmp, "control.sock")
        self.pidfile = os.path.join(self.tmp, "nbdcached.pid")
        self.logpath = os.path.join(self.tmp, "nbdcached.log")
        args = [nbdtest.NBDCACHED, "--unix", self.sock, "--control", self.control,
                "--pidfile", self.pidfile, "--threads", "2", "--cache-size", "64M",
                "--export", "a=" + backend] + list(extra)
        if foreground:
            args.insert(1, "--foreground")
        nbdtest.own_device(args)
        self.logf = open(self.logpath, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT)

    def wait_socket(self, timeout=10):
        """Busy-wait (no sleep: the moment matters) for the NBD socket."""
        end = time.monotonic() + timeout
        while not os.path.exists(self.sock):
            if time.monotonic() > end or self.proc.poll() is not None:
                return False
        return True

    def term(self):
        self.proc.send_signal(signal.SIGTERM)
        self.t_term = time.monotonic()

    def wait(self, timeout=30):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        return self.proc.returncode

    def log_text(self):
        self.logf.flush()
        with open(self.logpath) as f:
            return f.read()

    def left_behind(self):
        return [os.path.basename(p) for p in (self.sock, self.control, self.pidfile)
                if os.path.lexists(p)]

    def clean(self):
        self.logf.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def clean_stop(s, rc, what):
    """The stop was clean: exit 0, nothing left, the log says so (one
    failure naming every way it was not)."""
    text = s.log_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    wrong = []
    if rc != 0:
        wrong.append("exit status %s, not 0" % rc)
    if s.left_behind():
        wrong.append("left behind: %s" % ", ".join(s.left_behind()))
    # The daemon's own lines (an nbdkit it started says what it thinks of
    # a client that went away in the middle of its handshake).
    errors = [ln for ln in lines if " error: " in ln and "nbdcached[" in ln]
    if errors:
        wrong.append("errors in the log: %r" % errors[:3])
    if "during the start" not in text and "shutting down" not in text:
        wrong.append("the log does not say that a signal stopped it")
    if not lines or not lines[-1].endswith("stopped"):
        wrong.append("the log does not end with \"stopped\"")
    if wrong:
        log("---- log of %s ----\n%s---- end ----" % (what, text[-3000:]))
        CHECKS.add("%s: %s" % (what, "; ".join(wrong)))
    return not wrong


def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def moments_of(tmp, extra, label):
    img = nbdtest.sparse_file(os.path.join(tmp, "a.img"), 16 << 20)
    tally = {}
    steps = {}          # where the signal was taken: a step of the start, or serving
    for r in range(ROUNDS):
        for delay in DELAYS:
            dev = os.path.join(tmp, "dev%d.img" % r)
            ex = [x.replace("DEVICE", dev) for x in extra]
            if extra:
                nbdtest.sparse_file(dev, 64 << 20)
            s = Start(img, ex)
            appeared = s.wait_socket()
            if appeared and delay:
                spin(delay)
            s.term()
            rc = s.wait()
            what = "%s, SIGTERM %.1f ms after the socket appeared%s" % (
                label, delay * 1000, "" if appeared else " (it never did)")
            tally.setdefault(delay, []).append(rc)
            text = s.log_text()
            m = re.search(r"during the start \(([^)]*)\)", text)
            step = m.group(1) if m else ("serving" if "shutting down" in text else "?")
            steps[step] = steps.get(step, 0) + 1
            clean_stop(s, rc, what)
            s.clean()
            if extra and os.path.exists(dev):
                os.unlink(dev)
    log("  %s: exit status by delay after the socket appeared (ms): %s" % (
        label, ", ".join("%.1f: %s" % (d * 1000, v) for d, v in tally.items())))
    log("  %s: where the signal was taken: %s" % (label, steps))


def moments(tmp):
    moments_of(tmp, [], "a file backend")
    moments_of(tmp, ["--cache-device", "DEVICE"], "a file backend and a cache device")


def nbd_connect(tmp):
    for at in (0.3, 1.5):
        s = Start("nbdkit:--filter=delay memory size=16M delay-open=%d" % OPEN_DELAY,
                  tmp=tempfile.mkdtemp(prefix="nbdcached-stop-", dir=tmp))
        # From when its start holds the stop signals (main.c), not from
        # the exec: a loaded machine may take longer than `at` to get
        # there, and a SIGTERM before it ends the process unhandled.
        require(nbdtest.wait_until(lambda: sigterm_held(s.proc.pid), 30),
                "the daemon never held SIGTERM during its start")
        spin(at)
        kids = nbdtest.children_of(s.proc.pid)
        s.term()
        rc = s.wait()
        took = time.monotonic() - s.t_term
        what = "an NBD backend opening for %d s, SIGTERM %.1f s after the start" % (
            OPEN_DELAY, at)
        log("  %s: exit %s after %.2f s; nbdkit %s" % (what, rc, took, kids))
        clean_stop(s, rc, what)
        expect(took < STOP_WITHIN, "%s: it took %.2f s to stop (at most %.1f)"
               % (what, took, STOP_WITHIN))
        gone = nbdtest.wait_until(lambda: not any(alive(k) for k in kids), 10)
        expect(gone, "%s: its nbdkit %s is still running" % (what, kids))
        s.clean()


def sigterm_held(pid):
    """Is SIGTERM in pid's blocked set (/proc/PID/status SigBlk)?"""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def sig_blocked(pid, task=None):
    path = "/proc/%d/status" % pid if task is None else "/proc/%d/task/%d/status" % (pid, task)
    with open(path) as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    return 0


def children(tmp):
    with nbdtest.running_daemon([("k", "nbdkit:memory size=16M", "")]) as d:
        kids = nbdtest.children_of(d.pid)
        expect(kids, "no nbdkit child of the daemon found")
        for k in kids:
            blk = sig_blocked(k)
            log("  nbdkit %d: SigBlk %016x" % (k, blk))
            for sig in (signal.SIGTERM, signal.SIGINT):
                expect(not blk & (1 << (sig - 1)),
                       "the nbdkit the daemon started has %s blocked" % sig.name)
        blk = sig_blocked(d.pid, d.pid)
        log("  the daemon's main thread: SigBlk %016x" % blk)
        expect(not blk & (1 << (signal.SIGTERM - 1)),
               "the daemon's main thread blocks SIGTERM while it serves")


def detached(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "a.img"), 16 << 20)
    sent = 0
    for r in range(6):
        s = Start(img, foreground=False, tmp=tempfile.mkdtemp(prefix="nbdcached-stop-", dir=tmp))
        appeared = s.wait_socket()
        if r % 2 and appeared:
            spin(0.0002)
        # Only while the process that started is there: a signal after it
        # handed over to its child and exited stops nothing, by design. It
        # hands over once the child serves, which writes the pidfile just
        # before: a signal sent after that may come too late (the process
        # may exit before it takes it), and is not counted.
        ready = os.path.exists(s.pidfile) and open(s.pidfile).read().strip()
        if s.proc.poll() is None:
            s.term()
            was_sent = not ready
            sent += was_sent
        else:
            was_sent = False
        rc = s.wait()
        if not was_sent:
            stop_served(s)
            s.clean()
            continue
        gone = nbdtest.wait_until(lambda: not s.left_behind(), 10)
        answered = False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(2)
                c.connect(s.sock)
                answered = True
        except OSError:
            pass
        what = "detached start %d, SIGTERM %s after the socket appeared" % (
            r, "0.2 ms" if r % 2 else "at once")
        log("  %s: the first process exited %s; left behind %s" % (what, rc, s.left_behind()))
        expect(rc == 0, "%s: the first process exited %s" % (what, rc))
        expect(gone and not answered,
               "%s: not stopped cleanly (left behind: %s; the socket answers: %s)"
               % (what, s.left_behind(), answered))
        stop_served(s)
        s.clean()
    log("  %d of 6 signals reached the process that started" % sent)


def stop_served(s):
    """A daemon that serves on (main: a stop lost across the fork): by the PID
    its pidfile names, so that no test leaves one behind."""
    if not nbdtest.wait_until(lambda: os.path.exists(s.pidfile) and
                              open(s.pidfile).read().strip(), 1):
        return
    try:
        pid = int(open(s.pidfile).read())
        os.kill(pid, signal.SIGTERM)
        nbdtest.wait_until(lambda: not alive(pid), 10)
    except (OSError, ValueError):
        pass


def main():
    for name, fn in (("moments", moments), ("nbd_connect", nbd_connect),
                     ("children", children), ("detached", detached)):
        with nbdtest.tempdir() as tmp:
            CHECKS.run(name, fn, tmp)
    CHECKS.finish("stop_during_start")


if __name__ == "__main__":
    main()
