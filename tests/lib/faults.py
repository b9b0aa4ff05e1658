"""Fault injection for integration tests: faultfs and the nbdkit fault filter.

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
    import faults

faultfs (tests/faultfs/faultfs.c) is a FUSE passthrough of WORKDIR/src on
WORKDIR/mnt whose data operations fail, stall or are undone on command:

    with faults.FaultFS(workdir) as fs:
        path = fs.path("disk.img")        # the file as programs see it
        real = fs.source("disk.img")      # the file underneath
        fs.set("fail-fsync")              # ok fail-read fail-write fail-fsync
                                          # fail-fsync-once fail-all stall
                                          # "delay-ms N"
                                          # "fail-write-after N": N more
                                          # writes pass, then fail-write
        fs.lose_on_fsync_error(False)     # default on
        fs.power_loss()                   # every file back to its last fsync
        fs.counters()                     # dict: writes, bytes_written,
                                          # fsyncs_ok, fsyncs_failed, ...

The nbdkit fault filter (tests/nbdkit-fault/fault-filter.c) fails or
stalls NBD commands named in a file:

    kit = faults.NbdkitFault(workdir, image, drop_unflushed=True)
    kit.uri()                             # nbd+unix:///?socket=...
    kit.set("flush", "write")             # read write flush trim zero
                                          # extents cache all stall
    kit.clear()
    kit.pause(); kit.resume()             # SIGSTOP / SIGCONT by PID
    kit.kill(signal.SIGTERM); kit.start() # same socket
    kit.restart()
    kit.stop()

Both are started and stopped by PID; nothing else is ever signalled. A test
using faultfs skips (exit 77) only when the kernel has no FUSE.

Tools are found through $FAULTFS and $NBDKIT_FAULT_FILTER, else in
$BUILD/tests/, else in build/tests/ (the i386 run of the suite uses the
host's tools: they are test equipment, not the code under test).
"""

import errno
import json
import os
import signal
import subprocess
import time

import nbdtest
from nbdtest import Failed, log

NBDKIT = os.environ.get("NBDKIT", "nbdkit")


def _tool(env, name):
    if os.environ.get(env):
        return os.environ[env]
    for build in (nbdtest.BUILD, "build"):
        p = os.path.join(nbdtest.TOP, build, "tests", name)
        if os.path.exists(p):
            return p
    nbdtest.fail("%s not built (make all builds it into $BUILD/tests/%s)" % (name, name))


def faultfs_binary():
    return _tool("FAULTFS", "faultfs")


def filter_library():
    return _tool("NBDKIT_FAULT_FILTER", "nbdkit-fault-filter.so")


def require_fuse():
    """Skip the test (exit 77) when the kernel lacks FUSE."""
    if not os.path.exists("/dev/fuse"):
        nbdtest.skip("kernel lacks FUSE (no /dev/fuse)")


def _wait(cond, timeout, step=0.02):
    return nbdtest.wait_until(cond, timeout, step)


class FaultFS:
    """faultfs mounted on WORKDIR/mnt over WORKDIR/src (both made here),
    in the foreground, by PID. Unmounted (fusermount3 -u, lazily when
    busy) and reaped when the with-block ends."""

    CONTROL = ".faultfs"

    def __init__(self, workdir):
        require_fuse()
        self.workdir = workdir
        self.src = os.path.join(workdir, "src")
        self.mnt = os.path.join(workdir, "mnt")
        self.logpath = os.path.join(workdir, "faultfs.log")
        self.proc = None

    # ---- life cycle ----

    def start(self):
        os.makedirs(self.src, exist_ok=True)
        os.makedirs(self.mnt, exist_ok=True)
        # auto_unmount: the mount goes away with the process, even a killed one.
        cmd = [faultfs_binary(), self.src, self.mnt, "-f", "-o", "auto_unmount"]
        log("+ " + " ".join(cmd))
        with open(self.logpath, "a") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        if not _wait(lambda: self.proc.poll() is not None or self._mounted(), 10):
            self.stop()
            raise Failed("faultfs did not mount %s within 10 s: %s" % (self.mnt, self.log_tail()))
        if self.proc.poll() is not None:
            raise Failed("faultfs exited with %d at start: %s"
                         % (self.proc.returncode, self.log_tail()))
        return self

    def _mounted(self):
        return os.path.ismount(self.mnt) and os.path.exists(self.control_path())

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        """Unmount and reap; Failed when the log shows a sanitizer report."""
        if self.proc is None:
            return
        if self.alive():
            try:
                self.set("ok")          # let stalled operations go
            except OSError:
                pass
        for attempt in range(25):
            if not os.path.ismount(self.mnt):
                break
            lazy = ["-z"] if attempt == 24 else []
            p = subprocess.run(["fusermount3", "-u"] + lazy + [self.mnt],
                               capture_output=True, text=True)
            if p.returncode == 0:
                break
            time.sleep(0.2)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log("faultfs (pid %d) still running after unmount: SIGTERM" % self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        proc, self.proc = self.proc, None
        text = self.log_tail(8000)
        if "Sanitizer" in text or "runtime error:" in text:
            log(text)
            raise Failed("sanitizer report in faultfs's log")
        if proc.returncode not in (0, -signal.SIGTERM):
            log("faultfs exited with %d: %s" % (proc.returncode, text[-1500:]))

    def log_tail(self, n=1500):
        try:
            with open(self.logpath) as f:
                return f.read()[-n:].strip()
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        return False

    # ---- files ----

    def path(self, name):
        """The file as seen through the mount."""
        return os.path.join(self.mnt, name)

    def source(self, name):
        """The real file underneath."""
        return os.path.join(self.src, name)

    # ---- control ----

    def control_path(self):
        return os.path.join(self.mnt, self.CONTROL)

    def command(self, text):
        """Write command line(s) to the control file; OSError (EINVAL) when
        one is not understood."""
        fd = os.open(self.control_path(), os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def set(self, mode):
        """The fault mode: ok, fail-read, fail-write, fail-fsync,
        fail-fsync-once, fail-all, stall, "delay-ms N", or
        "fail-write-after N" (N more writes pass, then fail-write)."""
        log("  faultfs: %s" % mode)
        self.command(mode)

    def lose_on_fsync_error(self, on=True):
        self.command("lose-on-fsync-error %s" % ("on" if on else "off"))

    def power_loss(self):
        """Every file back to its last successful fsync (as a power cut)."""
        log("  faultfs: power-loss")
        self.command("power-loss")

    def counters(self):
        """The control file's JSON: mode, settings, counters, undo logs."""
        with open(self.control_path()) as f:
            return json.load(f)


class NbdkitFault(nbdtest.NbdServer):
    """nbdkit -f -U SOCK -P PIDFILE --filter=fault file IMAGE
    fault-file=FILE [drop-unflushed=true], started and stopped by PID."""

    def __init__(self, workdir, image, name="fault", drop_unflushed=False, sock=None,
                 start=True):
        self.name = name
        self.label = "nbdkit " + name
        self.image = image
        self.sock = sock or os.path.join(workdir, name + ".sock")
        self.pidfile = os.path.join(workdir, name + ".pid")
        self.logpath = os.path.join(workdir, name + ".log")
        self.fault_file = os.path.join(workdir, name + ".faults")
        self.drop_unflushed = drop_unflushed
        self.paused = False
        self.clear()
        if start:
            self.start()

    def start(self):
        for p in (self.sock, self.pidfile):
            if os.path.lexists(p):
                os.unlink(p)          # a killed nbdkit leaves its socket behind
        cmd = [NBDKIT, "-f", "-U", self.sock, "-P", self.pidfile,
               "--filter=" + filter_library(), "file", self.image,
               "fault-file=" + self.fault_file]
        if self.drop_unflushed:
            cmd.append("drop-unflushed=true")
        self.paused = False
        return self.spawn(cmd, self._listening, "write its pidfile")

    def _listening(self):
        """nbdkit writes the pidfile once it listens."""
        try:
            with open(self.pidfile) as f:
                return f.read().strip() == str(self.proc.pid)
        except OSError:
            return False

    def set(self, *words):
        """Fail (or stall) these commands from the next request on."""
        log("  %s faults: %s" % (self.label, " ".join(words) or "none"))
        tmp = self.fault_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(" ".join(words) + "\n")
        os.rename(tmp, self.fault_file)

    def clear(self):
        if os.path.exists(self.fault_file):
            log("  %s faults: none" % self.label)
            os.unlink(self.fault_file)

    def pause(self):
        """SIGSTOP by PID: the socket stays, nothing answers. Returns once
        every thread of it is stopped (Failed after 5 s)."""
        if self.alive():
            log("  SIGSTOP %s (pid %d)" % (self.label, self.proc.pid))
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True
            if not _wait(self._all_stopped, 5):
                raise Failed("%s (pid %d) not stopped 5 s after SIGSTOP"
                             % (self.label, self.proc.pid))

    def _all_stopped(self):
        """Every thread in state T (stopped)."""
        tasks = "/proc/%d/task" % self.proc.pid
        try:
            for tid in os.listdir(tasks):
                with open("%s/%s/stat" % (tasks, tid)) as f:
                    # The state follows the parenthesised command name.
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except OSError:
            return False
        return True

    def resume(self):
        if self.alive() and self.paused:
            log("  SIGCONT %s (pid %d)" % (self.label, self.proc.pid))
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def kill(self, sig=signal.SIGKILL):
        if self.paused and sig != signal.SIGKILL:
            self.resume()
        super().kill(sig)
        self.paused = False

    def restart(self, sig=signal.SIGTERM):
        """Stop it with `sig` and start a new one on the same socket."""
        self.kill(sig)
        return self.start()


def errno_of(exc):
    """The errno of an OSError or an nbd.Error, else None."""
    e = getattr(exc, "errnum", None)
    if e is None:
        e = getattr(exc, "errno", None)
    return e


def expect_eio(fn, what):
    """fn() must raise OSError / nbd.Error with EIO (raises Failed)."""
    try:
        fn()
    except Exception as e:      # noqa: BLE001 - OSError or nbd.Error
        if errno_of(e) == errno.EIO:
            return
        raise Failed("%s: %s, expected EIO" % (what, e))
    raise Failed("%s: succeeded, expected EIO" % what)
