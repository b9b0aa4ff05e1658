"""Helpers for integration tests: start the real nbdcached, talk to it, stop it.

Every integration test is an executable in tests/integration/ run by
tests/run: exit 0 passes, exit 77 skips (only when the machine lacks a kernel
feature), anything else fails. Tests import this module with:

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
    import nbdtest

tests/run runs two integration tests at a time, so a test must not assume
the machine is its own (ports from free_port(), its own temporary
directory). A test that asserts times, rates or an upper bound on a wait,
which a test beside it would disturb, says so with a line
"# tests/run: alone" after its #! line: it then runs by itself.

The daemon is started by PID and stopped by PID; nothing else is killed.
"""

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

TOP = os.environ.get("NBDCACHED_TOP") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("BUILD", "build")
NBDCACHED = os.environ.get("NBDCACHED") or os.path.join(TOP, BUILD, "nbdcached")
NBDCACHE_IO = os.environ.get("NBDCACHE_IO") or os.path.join(TOP, BUILD, "nbdcache-io")
NBDCACHECTL = os.environ.get("NBDCACHECTL") or os.path.join(TOP, BUILD, "nbdcachectl")

EXIT_SKIP = 77
HOLE_ZERO = 3          # NBD_STATE_HOLE | NBD_STATE_ZERO: base:allocation flags of a hole
LOFF_MAX = 2 ** 63 - 1


def log(*args):
    # One write per line: checks run beside each other (Beside) log whole lines.
    sys.stdout.write(" ".join(str(a) for a in args) + "\n")
    sys.stdout.flush()


def skip(reason):
    """Skip the whole test: only for a missing kernel feature."""
    print("SKIP: " + reason, flush=True)
    sys.exit(EXIT_SKIP)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def wait_until(cond, timeout, step=0.05):
    """Poll cond() every step seconds for up to timeout seconds (bounded);
    its last value."""
    deadline = time.time() + timeout
    for _ in range(int(timeout / step) + 2):
        if cond():
            return True
        if time.time() > deadline:
            break
        time.sleep(step)
    return cond()


_PORTS_GIVEN = set()


def free_port():
    """A TCP port on 127.0.0.1 that is free now and that this process has
    not handed out before: the kernel may give a port just released again,
    and a test that asks twice before binding either (a daemon's --listen
    and its --metrics, say) must not get the same one twice."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise Failed("no free TCP port on 127.0.0.1 not handed out before")


def run(cmd, timeout=300, check_rc=True, **kw):
    """Run a command, echo it, return CompletedProcess (text)."""
    log("+ " + " ".join(str(c) for c in cmd))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if p.stdout:
        log(p.stdout.rstrip()[-4000:])
    if p.stderr:
        log(p.stderr.rstrip()[-4000:])
    if p.returncode != 0:
        log("  exit %d" % p.returncode)
    if check_rc and p.returncode != 0:
        fail("command failed with exit %d: %s" % (p.returncode, " ".join(map(str, cmd))))
    return p


def run_json(cmd, **kw):
    """run() a command that must succeed and print JSON; the parsed output."""
    return json.loads(run(cmd, **kw).stdout)


def qemu_io(uri, cmds, extra=(), timeout=300, failure_words=("failed", "error")):
    """Run qemu-io -f raw with one -c per command; fail on a non-zero exit or
    when the output holds any of failure_words (aio commands report pattern
    mismatches only on their output). Returns stdout + stderr."""
    args = ["qemu-io", "-f", "raw"] + list(extra)
    for c in cmds:
        args += ["-c", c]
    args.append(uri)
    p = run(args, timeout=timeout, check_rc=False)
    out = p.stdout + p.stderr
    if p.returncode != 0 or any(w in out.lower() for w in failure_words):
        fail("qemu-io reported a failure (exit %d) for %s" % (p.returncode, uri))
    return out


def sha256_file(path, length=None):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        while True:
            n = 1 << 20 if left is None else min(1 << 20, left)
            if n == 0:
                break
            b = f.read(n)
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h.hexdigest()


def sparse_file(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def own_device(args_or_path):
    """A cache device file (the path after --cache-device in args, or a
    path) made readable by its owner alone, as the daemon requires (a
    file others can read is refused: cache_device_claim.py checks that)."""
    if isinstance(args_or_path, str):
        paths = [args_or_path]
    else:
        a = list(args_or_path)
        paths = [a[i + 1] for i, x in enumerate(a[:-1]) if x == "--cache-device"]
    for p in paths:
        try:
            if stat.S_ISREG(os.stat(p).st_mode):
                os.chmod(p, 0o600)
        except OSError:
            pass                        # not there (yet): the daemon says so


def random_file(path, size, seed=1):
    r = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 1 << 20)
            f.write(r.randbytes(n))
            left -= n
    return path


def data_runs_file(path, size, runs, seed=None):
    """A sparse file of `size` bytes with random data at each (offset, length)
    of `runs`, holes elsewhere. The data comes from random.Random(seed), run
    after run, or from os.urandom when seed is None."""
    r = random.Random(seed) if seed is not None else None
    sparse_file(path, size)
    with open(path, "r+b") as f:
        for off, n in runs:
            f.seek(off)
            f.write(r.randbytes(n) if r else os.urandom(n))
    return path


def read_at(path, offset, length):
    """`length` bytes of the file at `offset` (fewer at EOF)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def allocated(path):
    """Bytes the file really uses on its filesystem."""
    return os.stat(path).st_blocks * 512


def merge_segments(segs):
    """(start, end, flags) segments in order: empty ones dropped, adjacent
    ones with the same flags joined."""
    out = []
    for s, e, f in segs:
        if e <= s:
            continue
        if out and out[-1][2] == f and out[-1][1] == s:
            out[-1] = (out[-1][0], e, f)
        else:
            out.append((s, e, f))
    return out


def clip_segments(segs, start, end):
    """The part of (start, end, flags) segments inside [start, end), merged."""
    return merge_segments([(max(s, start), min(e, end), f) for s, e, f in segs
                           if e > start and s < end])


def add_extents(segs, pos, end, extents):
    """Append a block status reply's (length, flags) extents, from `pos` on,
    to `segs` as (start, end, flags), cut at `end`; returns the new pos.
    Raises Failed on a zero-length extent."""
    for ln, fl in extents:
        require(ln > 0, "zero-length extent at %d" % pos)
        ln = min(ln, end - pos)
        segs.append((pos, pos + ln, fl))
        pos += ln
        if pos >= end:
            break
    return pos


def file_layout(path, size):
    """The file's own data/hole map from SEEK_DATA/SEEK_HOLE, as merged
    (start, end, flags) segments over [0, size): flags 0 for data, HOLE_ZERO
    for a hole (what base:allocation must report)."""
    segs = []
    with open(path, "rb") as f:
        fd = f.fileno()
        pos = 0
        for _ in range(100000):
            if pos >= size:
                break
            try:
                d = min(os.lseek(fd, pos, os.SEEK_DATA), size)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                d = size
            if d > pos:
                segs.append((pos, d, HOLE_ZERO))
                pos = d
            if pos >= size:
                break
            try:
                h = min(os.lseek(fd, pos, os.SEEK_HOLE), size)
            except OSError:
                # tmpfs rounds the EOF hole up to a page: for a file that
                # ends within a page of 2^63-1 that overflows loff_t (lseek
                # returns a negative offset with errno 0). The data runs to
                # EOF. Anywhere else the error is real.
                if size <= LOFF_MAX - (1 << 20):
                    raise
                h = size
            segs.append((pos, h, 0))
            pos = h
    return merge_segments(segs)


def model_bytes(model, offset, length):
    """Bytes [offset, offset+length) after the writes of `model`, a list of
    (offset, bytes) applied in order over zeros."""
    want = bytearray(length)
    end = offset + length
    for o, d in model:
        if o < end and o + len(d) > offset:
            a, b = max(o, offset), min(o + len(d), end)
            want[a - offset:b - offset] = d[a - o:b - o]
    return bytes(want)


def first_diff(a, b):
    """The index of the first byte where a and b differ (the shorter length
    when one is a prefix of the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def sha256_matches(path, want_sha, size, what):
    """`path` must have `size` bytes and the sha256 `want_sha`."""
    got = os.path.getsize(path)
    check(got == size, "%s: %d bytes, expected %d" % (what, got, size))
    check(sha256_file(path) == want_sha, "%s: the content differs (sha256)" % what)


def rss(pid):
    """The process's resident set size (VmRSS) in bytes; 0 if not reported."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def libnbd_handle(uri, meta=False):
    """A python3-libnbd handle connected to `uri`; with meta, base:allocation
    is requested first."""
    import nbd
    h = nbd.NBD()
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(uri)
    return h


# ---- Checks that all run, failures reported at the end. ----

def nbdcachectl(d, *args):
    """Run nbdcachectl against daemon d's control socket; the completed
    process (text stdout, stderr), its command and outcome logged."""
    p = subprocess.run([NBDCACHECTL, "--control", d.control] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=60)
    log("+ nbdcachectl %s -> %d: %s%s" % (" ".join(map(str, args)), p.returncode,
                                          p.stdout.strip(), p.stderr.strip()))
    return p


def export_size(d, name):
    """The size a new connection to export name of daemon d negotiates."""
    h = libnbd_handle(d.unix_uri(name))
    try:
        return h.get_size()
    finally:
        h.shutdown()


def read_whole(h, length, chunk=16 << 20):
    """Bytes [0, length) through libnbd handle h, chunk bytes a READ."""
    got = bytearray()
    for off in range(0, length, chunk):
        got += h.pread(min(chunk, length - off), off)
    return bytes(got)


def read_errno(h, length, offset):
    """The errno a READ through h gets (0: it succeeded)."""
    import nbd
    try:
        h.pread(length, offset)
    except nbd.Error as e:
        return e.errnum
    return 0


class Failed(Exception):
    """An expectation was not met: ends the check that raised it (Checks.run)."""


def require(cond, msg):
    """Raise Failed(msg) unless cond."""
    if not cond:
        raise Failed(msg)


def expect_nbd_error(fn, want_errno, what):
    """fn() must fail with an nbd.Error carrying errno want_errno (raises Failed)."""
    import nbd
    try:
        fn()
    except nbd.Error as e:
        require(e.errnum == want_errno, "%s: errno %s (%s), expected %s"
                % (what, e.errno, e.string, errno.errorcode[want_errno]))
        return
    raise Failed("%s: succeeded, expected %s" % (what, errno.errorcode[want_errno]))


def control_request(path, request, timeout=60):
    """One request on the daemon's control socket (include/nbdcached/control.h):
    the reply as a dict."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps(request) + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise Failed("control socket closed before replying to %r" % request)
            data += chunk
    return json.loads(data)


class Checks:
    """The failures of a whole test, so that one failure does not hide the next.

    expect() records a failure and carries on; run() runs one named check and
    records the exception that ends it (of a type in `catch`); finish()
    lists every failure and exits: 1 if there was any, else 0. A check run
    by a Beside is told only of the expect()s in that Beside's thread, and a
    check run outside any only of those outside any (in whatever thread).
    """

    def __init__(self, catch=(Failed,)):
        self.failures = []
        self.catch = tuple(catch)
        self._added_in = {}     # Beside (None: none) -> the expect() failures in it

    def _added(self):
        return self._added_in.get(getattr(_beside, "current", None), 0)

    def expect(self, cond, msg):
        if not cond:
            self.add(msg)
        return cond

    def add(self, msg):
        log("FAIL: " + msg)
        self.failures.append(msg)
        lane = getattr(_beside, "current", None)
        self._added_in[lane] = self._added_in.get(lane, 0) + 1

    def run(self, name, fn, *args, catch=None, header=True):
        """fn(*args) as the check `name`; False when it failed (an exception
        of a `catch` type, default the constructor's, or an expect() in it).
        Other exceptions propagate."""
        if header:
            log("=== %s" % name)
        before = self._added()
        t0 = time.time()
        try:
            fn(*args)
        except (self.catch if catch is None else tuple(catch)) as e:
            log("FAIL %s: %s" % (name, e))
            self.failures.append("%s: %s" % (name, e))
            return False
        if self._added() > before:
            log("FAIL %s: %d expectation(s) not met" % (name, self._added() - before))
            return False
        log("ok %s (%.2fs)" % (name, time.time() - t0))
        return True

    def dump_log(self, daemon):
        """The daemon's log, when anything failed."""
        if self.failures:
            daemon.dump_log()

    def finish(self, label, unit="check"):
        if self.failures:
            log("")
            log("%d %s(s) failed:" % (len(self.failures), unit))
            for f in self.failures:
                log("  " + f)
            fail("%d %s %s(s) failed" % (len(self.failures), label, unit))
        log("all %s %ss passed" % (label, unit))
        sys.exit(0)


class Daemon:
    """A running nbdcached on a Unix socket and a TCP port on 127.0.0.1.

    exports: list of (name, backend_path, options) where options is a string
    such as "readonly,description=x" or "".
    """

    def __init__(self, exports, threads=2, tcp=True, extra=(), workdir=None,
                 env=None):
        self.tmp = workdir or tempfile.mkdtemp(prefix="nbdcached-test-")
        self.sock = os.path.join(self.tmp, "nbd.sock")
        self.pidfile = os.path.join(self.tmp, "nbdcached.pid")
        self.logpath = os.path.join(self.tmp, "nbdcached.log")
        self.control = os.path.join(self.tmp, "control.sock")
        self.port = free_port() if tcp else None
        args = [NBDCACHED, "--foreground", "--unix", self.sock,
                "--pidfile", self.pidfile, "--threads", str(threads),
                "--control", self.control,
                "--log-level", "debug" if os.environ.get("NBDCACHED_DEBUG") else "info"]
        if tcp:
            args += ["--listen", "127.0.0.1:%d" % self.port]
        for name, path, opts in exports:
            spec = "%s=%s" % (name, path)
            if opts:
                spec += "," + opts
            args += ["--export", spec]
        args += list(extra)
        own_device(args)
        self.args = args
        self.logf = open(self.logpath, "w")
        log("+ " + " ".join(args))
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT,
                                     env=env)
        self._wait_ready()

    def _wait_ready(self, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.dump_log()
                fail("nbdcached exited early with %d" % self.proc.returncode)
            if os.path.exists(self.sock):
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(self.sock)
                        s.recv(8)
                    return
                except OSError:
                    pass
            time.sleep(0.05)
        self.dump_log()
        fail("nbdcached did not become ready")

    @property
    def pid(self):
        return self.proc.pid

    def unix_uri(self, name=""):
        return "nbd+unix:///%s?socket=%s" % (name, self.sock)

    def tcp_uri(self, name=""):
        return "nbd://127.0.0.1:%d/%s" % (self.port, name)

    def alive(self):
        return self.proc.poll() is None

    def rss(self):
        return rss(self.pid)

    def dump_log(self):
        self.logf.flush()
        try:
            with open(self.logpath) as f:
                data = f.read()
            log("---- nbdcached log ----")
            log(data[-6000:])
            log("---- end of log ----")
        except OSError:
            pass

    def log_text(self):
        self.logf.flush()
        with open(self.logpath) as f:
            return f.read()

    def stop(self, expect_rc=0, timeout=30):
        """SIGTERM by PID; the daemon must exit cleanly (and ASan-clean)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.dump_log()
                fail("nbdcached did not exit within %ds of SIGTERM" % timeout)
        rc = self.proc.returncode
        text = self.log_text()
        self.logf.close()
        if "Sanitizer" in text or "runtime error:" in text:
            log(text[-8000:])
            fail("sanitizer report in the daemon log")
        if expect_rc is not None and rc != expect_rc:
            log(text[-4000:])
            fail("nbdcached exited with %d, expected %d" % (rc, expect_rc))
        return rc

    def kill(self):
        """SIGKILL by PID, unless it has exited already, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def discard(self, show_log=False):
        """kill(), the log shown when show_log, closed, the work dir removed."""
        self.kill()
        if show_log:
            self.dump_log()
        self.logf.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            self.kill()
            self.dump_log()
        return False


class CheckedDaemon(Daemon):
    """A Daemon whose failure to start is a Failed (ends one check, not the
    whole test) and never leaves the process running: "nbdcached did not
    start with WHAT (its log is above)", WHAT by default the --export specs.
    ready_timeout: seconds to wait for the socket."""

    def __init__(self, exports, *args, what=None, ready_timeout=15, **kw):
        self.what = what
        self.ready_timeout = ready_timeout
        super().__init__(exports, *args, **kw)

    def _wait_ready(self, timeout=None):
        try:
            super()._wait_ready(self.ready_timeout if timeout is None else timeout)
        except SystemExit:
            self.discard()
            what = self.what
            if what is None:
                what = " ".join(a for a in self.args if "=" in a and "--" not in a)
            raise Failed("nbdcached did not start with %s (its log is above)" % what)


@contextlib.contextmanager
def running_daemon(exports, extra=(), threads=2, **kw):
    """A CheckedDaemon (kw: what, ready_timeout); stopped with SIGTERM (exit 0
    required, else Failed) when the body ends normally, killed by PID with
    its log shown when it raised."""
    d = CheckedDaemon(exports, threads=threads, extra=list(extra), **kw)
    ok = False
    try:
        yield d
        ok = True
    finally:
        if not ok:
            d.discard(show_log=True)
    try:
        d.stop(timeout=30)
    except SystemExit:
        raise Failed("nbdcached did not exit 0 within 30 s of SIGTERM (its log is above)")
    finally:
        shutil.rmtree(d.tmp, ignore_errors=True)


class NbdServer:
    """Another NBD server (nbdkit, qemu-nbd) on the Unix socket self.sock,
    started here and stopped by its PID. A subclass sets sock, logpath and
    label (for messages), then calls spawn(cmd, ready, waiting_for)."""

    proc = None

    def spawn(self, cmd, ready, waiting_for, log_mode="a"):
        """Run cmd (output to logpath) and wait up to 10 s until ready() is
        true; Failed when it exits first (with the end of its log) or, after
        stop(), when the 10 s pass ("LABEL did not WAITING_FOR within 10 s")."""
        log("+ " + " ".join(cmd))
        with open(self.logpath, log_mode) as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.time() + 10
        for _ in range(1000):
            if self.proc.poll() is not None:
                raise Failed("%s exited with %d at start: %s"
                             % (self.label, self.proc.returncode, self.log_tail()))
            if ready():
                return self
            if time.time() > deadline:
                break
            time.sleep(0.02)
        self.stop()
        raise Failed("%s did not %s within 10 s" % (self.label, waiting_for))

    def log_tail(self):
        try:
            with open(self.logpath) as f:
                return f.read()[-1500:].strip()
        except OSError:
            return ""

    def uri(self):
        return "nbd+unix:///?socket=%s" % self.sock

    def handle(self, meta=False):
        return libnbd_handle(self.uri(), meta)

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Send sig to the server (by PID) and reap it (SIGKILL after 10 s)."""
        if self.alive():
            log("  %s %s (pid %d)" % (signal.Signals(sig).name, self.label, self.proc.pid))
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self):
        self.kill(signal.SIGTERM)


class Nbdkit(NbdServer):
    """nbdkit -f -U SOCK -P PIDFILE ARGS..., started and stopped by PID.
    peers: a list this one is appended to (the caller stops them all)."""

    def __init__(self, tmp, name, args, sock=None, peers=None):
        self.name = name
        self.label = "nbdkit " + name
        self.sock = sock or os.path.join(tmp, name + ".sock")
        self.pidfile = os.path.join(tmp, name + ".pid")
        self.logpath = os.path.join(tmp, name + ".log")
        self.args = list(args)
        if peers is not None:
            peers.append(self)
        self.start()

    def start(self):
        for p in (self.sock, self.pidfile):
            if os.path.lexists(p):
                os.unlink(p)          # a killed nbdkit leaves its socket behind
        cmd = [os.environ.get("NBDKIT", "nbdkit"), "-f", "-U", self.sock,
               "-P", self.pidfile] + self.args
        return self.spawn(cmd, self.pidfile_written, "write its pidfile")

    def pidfile_written(self):
        """nbdkit writes the pidfile once it listens."""
        try:
            with open(self.pidfile) as f:
                return f.read().strip() == str(self.proc.pid)
        except OSError:
            return False


@contextlib.contextmanager
def tempdir(prefix="nbdcached-test-", base=None):
    """A directory removed afterwards (kept, and said, with
    NBDTEST_KEEP=1: to read the daemons' logs of a failure)."""
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield d
    finally:
        if os.environ.get("NBDTEST_KEEP"):
            log("kept: %s" % d)
        else:
            shutil.rmtree(d, ignore_errors=True)


def shm_dir():
    """A tmpfs directory for huge sparse images (ext4 caps a file at 16 TiB)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def run_each(tests, daemon=None, prefix=""):
    """Run test functions in order; the first failure ends the program. With
    a daemon, it must still be alive after each."""
    for t in tests:
        log("=== %s%s" % (prefix, t.__name__))
        t()
        if daemon is not None:
            check(daemon.alive(), "nbdcached died during %s" % t.__name__)
        log("ok %s%s" % (prefix, t.__name__))


def main(tests):
    """Run test functions in order; the first failure ends the program."""
    run_each(tests)
    log("all %d checks passed" % len(tests))
    sys.exit(0)


# ---- Helpers for the cache tests (tests/integration/cache_*.py). ----

CACHE_STATS_KEYS = ("cache_bytes", "used_bytes", "entries", "hits", "misses",
                    "partial_hits", "backend_reads", "backend_read_bytes",
                    "backend_writes", "backend_write_bytes", "dirty_bytes",
                    "evictions", "writeback_errors")


def parse_stats(line):
    """The key=value tokens after "stats:" in a log line, as a dict (values
    that are decimal numbers as int, others as str)."""
    out = {}
    for tok in line.split("stats:", 1)[1].split():
        k, sep, v = tok.partition("=")
        if sep:
            out[k] = int(v) if v.isdigit() else v
    return out


def _stats_lines(daemon):
    text = daemon.log_text()
    text = text[:text.rfind("\n") + 1]       # complete lines only
    return [ln for ln in text.splitlines() if "stats:" in ln and "=" in ln]


def stats(daemon, timeout=5.0, keys=CACHE_STATS_KEYS):
    """Send SIGUSR1 to the daemon (by PID) and return the parsed new "stats:"
    line of its log (the last one, once one more has appeared). Raises
    Failed when the daemon is dead, no new line appears within `timeout`
    seconds, or the line lacks one of `keys`."""
    require(daemon.alive(), "stats: the daemon is not running")
    before = len(_stats_lines(daemon))
    daemon.proc.send_signal(signal.SIGUSR1)
    deadline = time.time() + timeout
    for _ in range(100000):
        lines = _stats_lines(daemon)
        if len(lines) > before:
            st = parse_stats(lines[-1])
            missing = [k for k in keys if k not in st]
            require(not missing, "stats line lacks %s: %r" % (", ".join(missing), lines[-1]))
            return st
        require(daemon.alive(), "the daemon died after SIGUSR1")
        if time.time() > deadline:
            break
        time.sleep(0.05)
    raise Failed("no new 'stats:' line in the daemon log within %gs of SIGUSR1" % timeout)


def diff_span(a, b):
    """None when a and b are equal, else (first, last): the first and last
    index at which they differ (bytes past the shorter one count as
    different). Compares 64 KiB at a time, so it is quick on big buffers."""
    n = min(len(a), len(b))
    chunk = 65536
    first = None
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        if bytes(a[s:e]) != bytes(b[s:e]):
            first = s + next(i for i in range(e - s) if a[s + i] != b[s + i])
            break
    if first is None:
        return None if len(a) == len(b) else (n, max(len(a), len(b)) - 1)
    if len(a) != len(b):
        return first, max(len(a), len(b)) - 1
    last = first
    for e in range(n, first, -chunk):
        s = max(first, e - chunk)
        if bytes(a[s:e]) != bytes(b[s:e]):
            last = next(i for i in range(e - 1, s - 1, -1) if a[i] != b[i])
            break
    return first, last


def describe_diff(got, want, base=0):
    """'' when equal, else where got differs from want, in offsets of the
    export or file (`base` is the offset of index 0)."""
    span = diff_span(got, want)
    if span is None:
        return ""
    first, last = span
    g = "0x%02x" % got[first] if first < len(got) else "none"
    w = "0x%02x" % want[first] if first < len(want) else "none"
    return ("first difference at offset %d (got %s, expected %s), last at %d; "
            "%d bytes read, %d expected" % (base + first, g, w, base + last, len(got), len(want)))


_CRC32C_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC32C_TABLE.append(_c)


def crc32c(data):
    """CRC32C (Castagnoli), as the cache device's format has it."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def require_same(got, want, what, base=0):
    """Raise Failed (naming the offset of the first difference) unless the
    bytes got equal want; `base` is the offset of got[0]."""
    d = describe_diff(got, want, base)
    if d:
        raise Failed("%s: %s" % (what, d))


def block_status_walk(h, start, end, max_calls=10000, max_len=None, flags=0):
    """base:allocation from `start` towards `end` in at most max_calls
    BLOCK_STATUS requests, each for at most max_len bytes (None: all that is
    left): (merged (start, end, flags) segments, where the walk stopped).
    The handle must have negotiated base:allocation."""
    import nbd
    segs = []
    pos = start
    for _ in range(max_calls):
        if pos >= end:
            break
        got = []

        def cb(ctx, off, entries, err):
            if ctx == nbd.CONTEXT_BASE_ALLOCATION:
                require(off == pos, "extents for offset %d, asked %d" % (off, pos))
                got.extend(entries)
            return 0
        n = end - pos if max_len is None else min(end - pos, max_len)
        h.block_status(n, pos, cb, flags)
        require(got, "no base:allocation extents at %d" % pos)
        pos = add_extents(segs, pos, end, zip(got[0::2], got[1::2]))
    return merge_segments(segs), pos


def block_status_map(h, offset, length, flags=0):
    """base:allocation over [offset, offset+length) as merged (start, end,
    flags) segments, walking as many BLOCK_STATUS requests as needed (at most
    10000). The handle must have negotiated base:allocation."""
    end = offset + length
    segs, pos = block_status_walk(h, offset, end, flags=flags)
    require(pos >= end, "block status did not cover [%d, %d)" % (offset, end))
    return segs


def aio_wait(pending, timeout=120):
    """Wait until every (handle, cookie) of `pending` has completed, the
    handles possibly several: polls all their sockets at once. A command
    that failed raises its nbd.Error (from aio_command_completed); Failed
    after `timeout` seconds or when a connection closes."""
    import nbd
    import select
    left = list(pending)
    deadline = time.time() + timeout
    for _ in range(10 ** 7):
        left = [(h, c) for h, c in left if not h.aio_command_completed(c)]
        if not left:
            return
        require(time.time() < deadline, "%d aio command(s) not complete after %gs"
                % (len(left), timeout))
        p = select.poll()
        by_fd = {}
        for h, _ in left:
            fd = h.aio_get_fd()
            if fd in by_fd:
                continue
            d = h.aio_get_direction()
            ev = (select.POLLIN if d & nbd.AIO_DIRECTION_READ else 0) | \
                 (select.POLLOUT if d & nbd.AIO_DIRECTION_WRITE else 0)
            if ev:
                p.register(fd, ev)
                by_fd[fd] = h
        for fd, ev in p.poll(100):
            h = by_fd[fd]
            if ev & select.POLLIN:
                h.aio_notify_read()
            elif ev & select.POLLOUT:
                h.aio_notify_write()
            elif ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                raise Failed("the server closed a connection with commands in flight")
    raise Failed("aio commands never completed")


def subreaper():
    """Make this process a child subreaper (PR_SET_CHILD_SUBREAPER): the
    orphans of its children become its own, so that a daemon a live
    upgrade started (its predecessor, our child, having exited) can still
    be waited for and reaped by its PID."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    require(libc.prctl(36, 1, 0, 0, 0) == 0, "prctl(PR_SET_CHILD_SUBREAPER) failed")


def stop_pid(pid, timeout=30):
    """SIGTERM a child (or adopted orphan, see subreaper) by PID and reap it:
    its exit status; SIGKILL and Failed after `timeout` s. None when it is
    not ours (or already reaped)."""
    if not pid:
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + timeout
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise Failed("pid %d did not exit within %gs of SIGTERM" % (pid, timeout))
        time.sleep(0.05)


def pidfile_pid(path):
    """The PID a --pidfile holds, 0 when there is none (yet)."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def children_of(pid):
    """The PIDs of pid's children (every thread's, from /proc); [] once
    it is gone."""
    out = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def reap_children(keep=()):
    """Reap every child that has exited (without waiting for the others),
    except those in keep: processes a subprocess.Popen will wait for. (A
    child reaped behind Popen's back reads as exit status 0.)"""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            try:
                os.waitpid(int(name), os.WNOHANG)
            except ChildProcessError:
                pass


def shutdown_all(handles):
    """h.shutdown() on each libnbd handle, ignoring the errors of handles
    whose connection is already gone."""
    import nbd
    for h in handles:
        try:
            h.shutdown()
        except nbd.Error:
            pass


_beside = threading.local()     # .current: the Beside whose thread this is


class Beside:
    """fn(*args) on a thread of its own, started at once: a check that
    mostly waits (for a deadline, a timeout, a delayed backend), run beside
    another one that does too. wait(timeout) joins it and returns what fn
    returned; it raises Failed when fn still runs after timeout seconds, or
    when anything ended it (an exception, or sys.exit: nbdtest.fail ends
    only the thread it runs on), naming `what`."""

    def __init__(self, what, fn, *args):
        self.what = what
        self.value = self.error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        _beside.current = self
        try:
            self.value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - wait() reports it
            self.error = e

    def wait(self, timeout):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise Failed("%s: still running %g s later" % (self.what, timeout))
        if self.error is not None:
            raise Failed("%s: %s: %s" % (self.what, type(self.error).__name__, self.error))
        return self.value


class Child:
    """fn() in a forked process, started at once (as uid:gid with these
    supplementary groups when uid is given; root only): answer() waits for
    it and is {"result": what fn returned, JSON} or {"error": the
    exception's text}; result() is the result, or raises Failed."""

    def __init__(self, fn, uid=None, gid=None, groups=()):
        self.rd, wr = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.rd)
            try:
                if uid is not None:
                    os.setgroups(list(groups))
                    os.setgid(uid if gid is None else gid)
                    os.setuid(uid)
                answer = {"result": fn()}
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                answer = {"error": "%s: %s" % (type(e).__name__, e)}
            os.write(wr, json.dumps(answer).encode())
            os._exit(0)
        os.close(wr)

    def answer(self):
        data = b""
        while True:
            chunk = os.read(self.rd, 1 << 20)
            if not chunk:
                break
            data += chunk
        os.close(self.rd)
        os.waitpid(self.pid, 0)
        return json.loads(data.decode() or '{"error": "no answer"}')

    def result(self):
        answer = self.answer()
        if "error" in answer:
            raise Failed("client: " + answer["error"])
        return answer["result"]


def in_child_as(uid, gid, groups, fn):
    """fn() in a forked child running as uid:gid with these supplementary
    groups (root only), waited for: Child.answer()."""
    return Child(fn, uid, gid, groups).answer()


# ---- A client that must stay served while a hostile one misbehaves. ----

class ServedProbe:
    """Another client, served throughout a hostile test: in a thread,
    round after round, a new libnbd connection to `uri` (negotiation
    included), a 4 KiB WRITE of a fresh pattern at `offset`, FLUSH, and a
    READ that must return the pattern. Each round's time is kept; check()
    fails with the slowest rounds when any took longer than a quarter of
    the time the probe ran (or `limit`, if longer: PHASE_SHARE), or when
    a round failed, or when fewer than `min_rounds` rounds ended (a probe
    that hangs in its first round must not pass).

        with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
            ... the hostile client ...
        probe.check("while a WRITE payload trickles")

    Rounds are spaced by `interval` and bounded in number (max_rounds)."""

    def __init__(self, uri, offset=0, limit=0.1, interval=0.05, max_rounds=2000,
                 min_rounds=5):
        import threading
        self.uri, self.offset, self.limit = uri, offset, limit
        self.interval, self.max_rounds, self.min_rounds = interval, max_rounds, min_rounds
        self.times = []
        self.errors = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _round(self, n):
        import nbd
        data = (b"probe-%08d-" % n) * (4096 // 15) + b"\0" * (4096 % 15)
        start = time.monotonic()
        h = nbd.NBD()
        h.connect_uri(self.uri)
        h.pwrite(data, self.offset)
        h.flush()
        got = h.pread(4096, self.offset)
        h.shutdown()
        del h
        took = time.monotonic() - start
        if got != data:
            raise Failed("probe round %d read back other bytes" % n)
        return took

    def _loop(self):
        for n in range(self.max_rounds):
            if self._stop.is_set():
                return
            try:
                self.times.append(self._round(n))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                self.errors.append("round %d: %s" % (n, e))
                return
            self._stop.wait(self.interval)

    def __enter__(self):
        self._began = time.monotonic()
        self.ran = 0.0
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()

    def stop(self, timeout=60):
        """Ends the rounds; waits for the one in flight (bounded)."""
        if not self._stop.is_set():
            self.ran = time.monotonic() - self._began
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.errors.append("a round was still running %d s after the stop" % timeout)

    # A round may take at most this share of the time the probe ran (the
    # hostile phase), or `limit`, whichever is longer: a worker taken away
    # from everyone else makes a round as long as the whole flood (32 s
    # of a 32 s flood, before the fixes these tests guard), while a busy
    # 2-core machine stalls a round now and then for a few hundred ms. A
    # ratio of the phase, not a wall-clock bound.
    PHASE_SHARE = 0.25

    def bound(self):
        return max(self.limit, self.ran * self.PHASE_SHARE)

    def slow(self):
        return [t for t in self.times if t > self.bound()]

    def check(self, what):
        """Raises Failed (see Checks) unless every round was served within
        its bound (above), and enough of them ended."""
        self.stop()
        worst = sorted(self.times, reverse=True)[:5] or [0.0]
        log("probe %s: %d rounds in %.1f s, slowest %s s (bound %.3f s)" % (
            what, len(self.times), self.ran, ", ".join("%.3f" % t for t in worst),
            self.bound()))
        require(not self.errors, "probe %s: %s" % (what, "; ".join(self.errors)))
        require(len(self.times) >= self.min_rounds,
                "probe %s: only %d rounds ended" % (what, len(self.times)))
        require(not self.slow(), "probe %s: %d of %d rounds took over %.0f ms, a quarter of "
                "the %.1f s the probe ran (slowest %.3f s)" % (
                    what, len(self.slow()), len(self.times), self.bound() * 1000, self.ran,
                    worst[0]))
