#!/usr/bin/python3
"""The OSD under an rbd: export fails, under load: no crash, no wrong byte,
FLUSH honest.

The daemon serves a 64 MiB image in write-back mode with --backend-timeout
5. Two load threads (their own connections) write and read random ranges of
[32 MiB, 64 MiB) all along, each READ checked against a model whose bytes a
failed WRITE makes unknown. Meanwhile, on [0, 32 MiB):

1. The OSD is stopped (SIGSTOP) with data written and not flushed: a
   FLUSH fails with EIO within 4 x --backend-timeout; the OSD resumes
   (SIGCONT) and a FLUSH succeeds (retried until it does, at most 60 s).
2. The OSD is killed (SIGKILL) with more data not flushed: a FLUSH fails
   with EIO within 4 x --backend-timeout; the OSD is started again and a
   FLUSH succeeds.

After each, `rbd export` of the image is the model (its known bytes), and the
daemon has neither crashed nor fenced itself (no other owner ever came).
"""
import os
import random
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbd  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402
from cluster import Cluster  # noqa: E402

MiB = 1 << 20
SIZE = 64 * MiB
LOAD_START = 32 * MiB
TIMEOUT = 5


class Loaded:
    """The model of the whole image: data, and which bytes are known (a
    WRITE that failed may or may not have landed)."""

    def __init__(self):
        self.data = bytearray(SIZE)
        self.known = bytearray(b"\x01") * SIZE
        self.lock = threading.Lock()
        self.wrong = []
        self.counts = {"write": 0, "write_eio": 0, "read": 0, "read_eio": 0}

    def wrote(self, off, buf, ok):
        with self.lock:
            self.data[off:off + len(buf)] = buf
            self.known[off:off + len(buf)] = (b"\x01" if ok else b"\x00") * len(buf)

    def check(self, off, got, what):
        with self.lock:
            for i in range(len(got)):
                if self.known[off + i] and got[i] != self.data[off + i]:
                    self.wrong.append("%s: byte %d is %#x, the model says %#x" %
                                      (what, off + i, got[i], self.data[off + i]))
                    return False
        return True


def load(uri, m, seed, stop):
    r = random.Random(seed)
    h = nbdtest.libnbd_handle(uri)
    lo = LOAD_START + (seed % 2) * 16 * MiB  # each thread its own half
    while not stop.is_set():
        n = r.choice((4096, 65536, 262144))
        off = lo + r.randrange(0, (16 * MiB - n) // 4096) * 4096
        if r.random() < 0.5:
            buf = r.randbytes(n)
            try:
                h.pwrite(buf, off)
                m.wrote(off, buf, True)
                m.counts["write"] += 1
            except nbd.Error:
                m.wrote(off, buf, False)
                m.counts["write_eio"] += 1
        else:
            try:
                got = h.pread(n, off)
                m.counts["read"] += 1
                m.check(off, got, "load READ")
            except nbd.Error:
                m.counts["read_eio"] += 1
    h.shutdown()


def flush_fails_in_time(h, checks, what):
    t0 = time.time()
    try:
        h.flush()
        checks.expect(False, "%s: FLUSH succeeded while the OSD was down" % what)
    except nbd.Error as e:
        dt = time.time() - t0
        checks.expect(e.errnum == 5, "%s: FLUSH failed with %s, not EIO" % (what, e))
        # A FLUSH that comes while a round is already waiting on the dead
        # OSD waits for that round, then times its own out: at most two
        # timeouts; four leave a busy machine its margin and still catch a
        # FLUSH that waits on without one.
        checks.expect(dt <= 4 * TIMEOUT, "%s: FLUSH failed after %.1f s, more than 4 x "
                      "--backend-timeout %d s" % (what, dt, TIMEOUT))
        log("%s: FLUSH failed with EIO in %.1f s" % (what, dt))


def flush_succeeds(h, what, limit=60):
    t0 = time.time()
    tries = 0
    while True:
        tries += 1
        try:
            h.flush()
            log("%s: FLUSH succeeded %.1f s after the OSD came back (%d tries)" %
                (what, time.time() - t0, tries))
            return
        except nbd.Error:
            if time.time() - t0 > limit:
                raise Failed("%s: no FLUSH succeeded within %d s of the OSD's return" %
                             (what, limit))
            time.sleep(0.5)


def image_matches(c, m, checks, what, h, d):
    out = os.path.join(c.root, "export.img")
    c.rbd("export", "--no-progress", "rbd/f1", out)
    with open(out, "rb") as f:
        got = f.read()
    os.unlink(out)
    with m.lock:
        wrong = [i for i in range(0, SIZE, 4096)
                 if got[i:i + 4096] != m.data[i:i + 4096] and
                 any(m.known[j] and got[j] != m.data[j] for j in range(i, i + 4096))]
    if wrong:
        # What the daemon holds there, and what it thinks is left to
        # write: tells data lost in the cache from data it never sent.
        cached = h.pread(4096, wrong[0])
        st = nbdtest.stats(d)
        log("%s: %d block(s) of 4 KiB differ, first at %s; the image there is %s, the "
            "daemon reads %s; dirty_bytes %s, unstable_bytes %s, writeback_errors %s; the "
            "daemon's log ends:\n%s"
            % (what, len(wrong), wrong[:8],
               "zeros" if not any(got[wrong[0]:wrong[0] + 4096]) else "other bytes",
               "the model" if cached == bytes(m.data[wrong[0]:wrong[0] + 4096])
               else "something else", st.get("dirty_bytes"), st.get("unstable_bytes"),
               st.get("writeback_errors"), "\n".join(d.log_text().splitlines()[-40:])))
    checks.expect(not wrong, "%s: rbd export differs from the model near byte %s" %
                  (what, wrong[0] if wrong else None))
    if not wrong:
        log("%s: rbd export is the model (%d bytes)" % (what, len(got)))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(prefix="nbdcached-ceph-") as tmp:
        with Cluster(os.path.join(tmp, "ceph"), log=log) as c:
            c.rbd("create", "--size", str(SIZE // MiB), "rbd/f1")
            backend = "rbd:rbd/f1?conf=%s" % c.conf
            m = Loaded()
            stop = threading.Event()
            with nbdtest.running_daemon([("f1", backend, "cache-mode=writeback")],
                                        extra=["--backend-timeout", str(TIMEOUT),
                                               "--dirty-expire", "3600"],
                                        ready_timeout=60) as d:
                uri = d.unix_uri("f1")
                threads = [threading.Thread(target=load, args=(uri, m, s, stop))
                           for s in (1, 2)]
                for t in threads:
                    t.start()
                h = nbdtest.libnbd_handle(uri)
                try:
                    x = os.urandom(2 * MiB)
                    h.pwrite(x, 0)
                    h.flush()
                    m.wrote(0, x, True)
                    y = os.urandom(2 * MiB)
                    h.pwrite(y, 8 * MiB)
                    m.wrote(8 * MiB, y, True)
                    c.signal("osd.0", signal.SIGSTOP)
                    log("osd.0 stopped (SIGSTOP)")
                    time.sleep(1)
                    flush_fails_in_time(h, checks, "OSD stopped")
                    c.signal("osd.0", signal.SIGCONT)
                    log("osd.0 resumed (SIGCONT)")
                    flush_succeeds(h, "OSD resumed")
                    stop.set()
                    for t in threads:
                        t.join()
                    h.flush()
                    image_matches(c, m, checks, "after the stop", h, d)
                    stop.clear()
                    threads = [threading.Thread(target=load, args=(uri, m, s, stop))
                               for s in (3, 4)]
                    for t in threads:
                        t.start()
                    z = os.urandom(2 * MiB)
                    h.pwrite(z, 16 * MiB)
                    m.wrote(16 * MiB, z, True)
                    c.kill("osd.0")
                    log("osd.0 killed (SIGKILL)")
                    flush_fails_in_time(h, checks, "OSD killed")
                    c.start_osd(0)
                    log("osd.0 started again")
                    flush_succeeds(h, "OSD restarted", limit=120)
                    stop.set()
                    for t in threads:
                        t.join()
                    h.flush()
                    image_matches(c, m, checks, "after the kill", h, d)
                    ex = nbdtest.control_request(d.control, {"command": "exports"})["exports"]
                    checks.expect(not ex[0].get("fenced"), "the daemon fenced itself: %s" % ex)
                    checks.expect(not m.wrong, "; ".join(m.wrong[:3]))
                    log("load: %s" % m.counts)
                finally:
                    stop.set()
                    for t in threads:
                        t.join()
                    h.shutdown()
                checks.expect(d.alive(), "nbdcached died")
    checks.finish("rbd faults")


if __name__ == "__main__":
    main()
