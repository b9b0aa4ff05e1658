"""Helpers for integration tests: start the real nbdcached, talk to it, stop it.

Every integration test is an executable in tests/integration/ run by
tests/run: exit 0 passes, exit 77 skips (only when the machine lacks a kernel
feature), anything else fails. Tests import this module with:

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
    import nbdtest

The daemon is started by PID and stopped by PID; nothing else is killed.
"""

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

TOP = os.environ.get("NBDCACHED_TOP") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("BUILD", "build")
NBDCACHED = os.environ.get("NBDCACHED") or os.path.join(TOP, BUILD, "nbdcached")
NBDCACHE_IO = os.environ.get("NBDCACHE_IO") or os.path.join(TOP, BUILD, "nbdcache-io")

EXIT_SKIP = 77


def log(*args):
    print(*args, flush=True)


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


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=300, check_rc=True, **kw):
    """Run a command, echo it, return CompletedProcess (text)."""
    log("+ " + " ".join(str(c) for c in cmd))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if p.stdout:
        log(p.stdout.rstrip()[-4000:])
    if p.stderr:
        log(p.stderr.rstrip()[-4000:])
    if check_rc and p.returncode != 0:
        fail("command failed with exit %d: %s" % (p.returncode, " ".join(map(str, cmd))))
    return p


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


def random_file(path, size, seed=1):
    import random
    r = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 1 << 20)
            f.write(r.randbytes(n))
            left -= n
    return path


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
        self.port = free_port() if tcp else None
        args = [NBDCACHED, "--foreground", "--unix", self.sock,
                "--pidfile", self.pidfile, "--threads", str(threads),
                "--log-level", "debug" if os.environ.get("NBDCACHED_DEBUG") else "info"]
        if tcp:
            args += ["--listen", "127.0.0.1:%d" % self.port]
        for name, path, opts in exports:
            spec = "%s=%s" % (name, path)
            if opts:
                spec += "," + opts
            args += ["--export", spec]
        args += list(extra)
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

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.dump_log()
        return False


@contextlib.contextmanager
def tempdir(prefix="nbdcached-test-", base=None):
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def shm_dir():
    """A tmpfs directory for huge sparse images (ext4 caps a file at 16 TiB)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def main(tests):
    """Run test functions in order; the first failure ends the program."""
    for t in tests:
        log("=== %s" % t.__name__)
        t()
        log("ok %s" % t.__name__)
    log("all %d checks passed" % len(tests))
    sys.exit(0)
