#!/usr/bin/python3
"""One owner per image: two nbdcached daemons (two "nodes") on one rbd image.

1. Refuse and take over after a crash. Daemon A serves the image (write-back,
   writeback held back with a long --dirty-expire): 1 MiB written and
   FLUSHed, 1 MiB more written and not flushed. Daemon B with the default
   rbd-takeover = refuse exits at start naming A's address, and the image is
   byte for byte what it was (B wrote nothing). B with rbd-takeover = wait
   waits; A is killed (SIGKILL); B takes the lock once Ceph has blocklisted
   A, and serves every FLUSHed byte. A's address is on the blocklist.
2. A paused owner is fenced. A2 serves the image; B2 waits; A2 is stopped
   (SIGSTOP) until its watch expires, B2 takes over and writes; A2 resumes
   (SIGCONT): within seconds it is fenced (the log says so, `nbdcachectl
   exports` says FENCED), a WRITE, a FLUSH and a READ on A2's open
   connection fail with EIO, and nothing A2 was given reaches the image.
   A2 exits on SIGTERM without hanging on the dirty data it cannot write.
"""
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbd  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402
from cluster import Cluster  # noqa: E402

MiB = 1 << 20
WATCH_TIMEOUT = 8  # the cluster's osd client watch timeout (cluster.py)


class Node:
    """An nbdcached started by Popen (a waiting one is not ready, so not
    nbdtest.Daemon), stopped by its PID."""

    def __init__(self, root, name, backend, takeover="refuse", binary=None, extra=()):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, "nbd.sock")
        self.control = os.path.join(self.dir, "control.sock")
        self.logpath = os.path.join(self.dir, "log")
        self.name = name
        cmd = [binary or nbdtest.NBDCACHED, "--foreground", "--unix", self.sock, "--control",
               self.control, "--rbd-takeover", takeover, "--dirty-expire", "3600",
               "--export", "img=" + backend] + list(extra)
        nbdtest.own_device(cmd)
        log("+ %s: %s" % (name, " ".join(cmd)))
        with open(self.logpath, "w") as lf:
            self.proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)

    def log_text(self):
        with open(self.logpath, errors="replace") as f:
            return f.read()

    def wait_log(self, words, timeout):
        if not nbdtest.wait_until(lambda: words in self.log_text() or self.proc.poll()
                                  is not None, timeout, step=0.1):
            raise Failed("%s: no '%s' in its log within %d s:\n%s" %
                         (self.name, words, timeout, self.log_text()[-2000:]))
        if words not in self.log_text():
            raise Failed("%s exited with %s before '%s':\n%s" %
                         (self.name, self.proc.returncode, words, self.log_text()[-2000:]))

    def handle(self):
        return nbdtest.libnbd_handle("nbd+unix:///img?socket=" + self.sock)

    def exports(self):
        return nbdtest.control_request(self.control, {"command": "exports"})["exports"]

    def signal(self, sig):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise Failed("%s did not exit within %d s of SIGTERM:\n%s" %
                             (self.name, timeout, self.log_text()[-2000:]))
        text = self.log_text()
        if "Sanitizer" in text or "runtime error:" in text:
            raise Failed("%s: sanitizer report in its log:\n%s" % (self.name, text[-6000:]))
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def image_bytes(c, image, length):
    out = os.path.join(c.root, "export.img")
    c.rbd("export", "--no-progress", "rbd/" + image, out)
    with open(out, "rb") as f:
        data = f.read(length)
    os.unlink(out)
    return data


def owner_address(text):
    """The address in 'held by ADDR' of a refusal."""
    i = text.find("held by ")
    return text[i + 8:].split()[0] if i >= 0 else None


def refuse_then_take_over(c, checks, root):
    image = "own1"
    c.rbd("create", "--size", "16", "rbd/" + image)
    backend = "rbd:rbd/%s?conf=%s" % (image, c.conf)
    p1, p2 = os.urandom(MiB), os.urandom(MiB)
    a = Node(root, "a", backend)
    b = None
    try:
        a.wait_log("ready:", 60)
        h = a.handle()
        h.pwrite(p1, 0)
        h.flush()
        h.pwrite(p2, MiB)  # not flushed: A's alone
        before = image_bytes(c, image, 4 * MiB)
        b = Node(root, "b-refuse", backend)
        try:
            rc = b.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            b.kill()
            rc = None
        text = b.log_text()
        addr = owner_address(text)
        checks.expect(rc not in (0, None) and addr and addr.startswith("127.0.0.1:"),
                      "B (refuse) exit %s, its log: %s" % (rc, text[-600:]))
        log("B refused: exit %s; the owner named: %s" % (rc, addr))
        checks.expect(image_bytes(c, image, 4 * MiB) == before,
                      "the image changed while B was refused")
        b = Node(root, "b-wait", backend, takeover="wait")
        b.wait_log("waiting for the image's exclusive lock", 60)
        checks.expect(not os.path.exists(b.sock) or "ready:" not in b.log_text(),
                      "B (wait) is ready while A owns the image")
        t0 = time.time()
        a.kill()
        log("A killed (SIGKILL) with 1 MiB flushed and 1 MiB not")
        b.wait_log("took the image's exclusive lock", WATCH_TIMEOUT * 4 + 30)
        b.wait_log("ready:", 30)
        took = time.time() - t0
        hb = b.handle()
        got = hb.pread(MiB, 0)
        checks.expect(got == p1, "B does not serve the bytes A flushed")
        second = hb.pread(MiB, MiB)
        log("B took over %.1f s after A died; the flushed MiB is there; the unflushed MiB "
            "%s" % (took, "is there too" if second == p2 else "is not (A never wrote it)"))
        hb.pwrite(b"\xbb" * MiB, 2 * MiB)
        hb.flush()
        hb.shutdown()
        bl = c.ceph("osd", "blocklist", "ls")
        checks.expect(addr is not None and addr in bl,
                      "A's address %s is not on the blocklist:\n%s" % (addr, bl))
        rc = b.stop()
        checks.expect(rc == 0, "B exited with %s" % rc)
        checks.expect(image_bytes(c, image, 3 * MiB)[2 * MiB:] == b"\xbb" * MiB,
                      "B's FLUSHed write is not on the image")
    finally:
        a.kill()
        if b:
            b.kill()


def paused_owner_is_fenced(c, checks, root):
    image = "own2"
    c.rbd("create", "--size", "16", "rbd/" + image)
    backend = "rbd:rbd/%s?conf=%s" % (image, c.conf)
    a = Node(root, "a2", backend)
    b = None
    try:
        a.wait_log("ready:", 60)
        ha = a.handle()
        ha.pwrite(b"\xa1" * MiB, 0)
        ha.flush()
        b = Node(root, "b2", backend, takeover="wait")
        b.wait_log("waiting for the image's exclusive lock", 60)
        a.signal(signal.SIGSTOP)
        t0 = time.time()
        log("A2 paused (SIGSTOP)")
        b.wait_log("took the image's exclusive lock", WATCH_TIMEOUT * 4 + 30)
        b.wait_log("ready:", 30)
        log("B2 took over %.1f s after A2 paused" % (time.time() - t0))
        hb = b.handle()
        checks.expect(hb.pread(MiB, 0) == b"\xa1" * MiB, "B2 lacks A2's flushed MiB")
        hb.pwrite(b"\xb2" * MiB, 4 * MiB)
        hb.flush()
        a.signal(signal.SIGCONT)
        t1 = time.time()
        a.wait_log("fenced:", 30)
        log("A2 resumed; fenced %.1f s later" % (time.time() - t1))
        ex = a.exports()
        checks.expect(ex and ex[0].get("fenced") is True, "A2's exports: %s" % ex)
        p = subprocess.run([nbdtest.NBDCACHECTL, "--control", a.control, "exports"],
                           capture_output=True, text=True, timeout=30)
        checks.expect("FENCED" in p.stdout, "nbdcachectl exports on A2:\n%s" % p.stdout)

        def fails_eio(what, fn):
            try:
                fn()
                checks.expect(False, "A2 answered a %s after it was fenced" % what)
            except nbd.Error as e:
                checks.expect(e.errno == nbd.EIO if hasattr(nbd, "EIO") else e.errnum == 5,
                              "A2's %s failed with %s, not EIO" % (what, e))

        fails_eio("WRITE", lambda: ha.pwrite(b"\xee" * MiB, 4 * MiB))
        fails_eio("FLUSH", ha.flush)
        fails_eio("READ", lambda: ha.pread(4096, 0))
        hb.flush()
        data = image_bytes(c, image, 5 * MiB)
        checks.expect(data[4 * MiB:] == b"\xb2" * MiB,
                      "the image's [4 MiB, 5 MiB) is not B2's write: A2 wrote to it")
        hb.shutdown()
        t2 = time.time()
        rc = a.stop(timeout=30)
        log("A2 exited %s in %.1f s after SIGTERM" % (rc, time.time() - t2))
        rc = b.stop()
        checks.expect(rc == 0, "B2 exited with %s" % rc)
    finally:
        a.kill()
        if b:
            b.kill()


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(prefix="nbdcached-ceph-") as tmp:
        with Cluster(os.path.join(tmp, "ceph"), watch_timeout=WATCH_TIMEOUT, log=log) as c:
            for t in (refuse_then_take_over, paused_owner_is_fenced):
                checks.run(t.__name__, t, c, checks, tmp, catch=(Failed, nbd.Error, OSError))
    checks.finish("rbd owner")


if __name__ == "__main__":
    main()
