#!/usr/bin/python3
# tests/run: alone (asserts times that a test beside it would disturb)
"""slow_payload: a WRITE whose payload arrives slowly holds up nobody else.

A FLUSH covers only writes already acknowledged, and a READ concurrent with
a WRITE may see the old bytes: neither has a reason to wait for a payload
still arriving. A hostile client sends the header of a 2 MiB WRITE and then
trickles its payload.

  held      (--stall-timeout 30, the default) two raw clients trickle
            2 MiB WRITEs at 64 KiB a second for 3 s: one over 2 MiB of
            dirty blocks (the swap path), one over 2 MiB of clean cached
            blocks (received in place on main). Meanwhile another client
            (nbdtest.ServedProbe: connect, 4 KiB WRITE, FLUSH, READ) is
            served every round within a quarter of the time it ran (at
            least 100 ms), and READs of both ranges answer within the same
            bound with the old bytes: a held one would take the whole 3 s. Then the rest of the
            payloads come at once: both WRITEs succeed, READ shows them,
            and after FLUSH the file holds them.
  floor     (--stall-timeout 2) a payload trickled at 64 KiB a second is
            cut off: it is slower than the floor rate (1 MiB/s averaged
            since the payload began, after a grace of --stall-timeout), so
            the connection is reset 1.5 to 6 s after the header although it
            never stops moving; the blocks keep their old bytes (READ, and
            the file after FLUSH).
"""

import os
import random
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402
import bad_input as raw  # noqa: E402  (RawClient: requests cut anywhere)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
DIRTY_AT = 0            # 2 MiB written first: the trickled WRITE swaps over dirty blocks
CLEAN_AT = 8 * MIB      # 2 MiB read first: cached clean
PROBE_AT = 40 * MIB
N = 2 * MIB
TRICKLE = 64 * KIB      # a second
LIMIT = 0.1


def raw_write_start(d, offset):
    r = raw.RawClient(d.sock, timeout=30)
    r.open("disk", structured=True)
    cookie, hdr = r.encode_request(raw.CMD_WRITE, offset, N)
    r.pending[cookie] = (raw.CMD_WRITE, offset, N)
    r.send(hdr)
    return r, cookie


class TimedReads(threading.Thread):
    """READs of (offset, want) ranges, round after round on one connection:
    each must answer with the bytes wanted, within a quarter of the time the
    READs ran (at least LIMIT; as nbdtest.ServedProbe): a READ held by a
    trickled payload takes as long as the whole trickle."""

    def __init__(self, d, ranges):
        super().__init__(daemon=True)
        self.d, self.ranges = d, ranges
        self.stop = threading.Event()
        self.times, self.errors = [], []
        self.t0 = self.t1 = None

    def run(self):
        self.t0 = time.monotonic()
        try:
            h = nbd.NBD()
            h.connect_uri(self.d.unix_uri("disk"))
            for _ in range(10000):
                if self.stop.is_set():
                    break
                for offset, want in self.ranges:
                    t0 = time.monotonic()
                    got = h.pread(len(want), offset)
                    self.times.append(time.monotonic() - t0)
                    if got != want:
                        self.errors.append("READ at %d: %s" % (
                            offset, nbdtest.describe_diff(got, want, offset)))
                        return
                self.stop.wait(0.05)
            h.shutdown()
        except Exception as e:  # noqa: BLE001 (reported by check)
            self.errors.append("READ failed: %s" % e)

    def check(self, what):
        self.stop.set()
        if self.is_alive():
            self.errors.append("a READ was still waiting when the payloads were let through")
        ran = time.monotonic() - self.t0 if self.t0 else 0.0
        self.join(30)
        worst = max(self.times) if self.times else 0.0
        bound = max(LIMIT, ran / 4)
        log("reads %s: %d in %.2f s, slowest %.3f s (bound %.3f s)"
            % (what, len(self.times), ran, worst, bound))
        expect(not self.errors, "reads %s: %s" % (what, "; ".join(self.errors)))
        expect(len(self.times) >= 10, "reads %s: only %d answered" % (what, len(self.times)))
        expect(worst <= bound, "reads %s: the slowest took %.3f s (a quarter of the %.2f s they "
               "ran: %.3f s)" % (what, worst, ran, bound))


def check_held(tmp):
    path = os.path.join(tmp, "held.img")
    nbdtest.random_file(path, SIZE, seed=27)
    rnd = random.Random(2)
    dirty_old = rnd.randbytes(N)
    new_dirty, new_clean = rnd.randbytes(N), rnd.randbytes(N)
    clean_old = read_at(path, CLEAN_AT, N)
    with nbdtest.Daemon([("disk", path, "")], threads=2) as d:
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        h.pwrite(dirty_old, DIRTY_AT)   # dirty, not flushed
        h.pread(N, CLEAN_AT)            # cached, clean
        h.shutdown()
        writers = [raw_write_start(d, DIRTY_AT) + (new_dirty,),
                   raw_write_start(d, CLEAN_AT) + (new_clean,)]
        reads = TimedReads(d, [(DIRTY_AT, dirty_old), (CLEAN_AT, clean_old)])
        with nbdtest.ServedProbe(d.unix_uri("disk"), offset=PROBE_AT, limit=LIMIT) as probe:
            reads.start()
            sent = 0
            t0 = time.monotonic()
            for i in range(3 * 4):      # 3 s, a quarter of TRICKLE at a time
                for r, _, data in writers:
                    r.send(data[sent:sent + TRICKLE // 4])
                sent += TRICKLE // 4
                time.sleep(max(0.0, t0 + (i + 1) * 0.25 - time.monotonic()))
            # A round held by a payload would hold these joins too: bounded,
            # and a round still running is a failure (ServedProbe.stop).
            probe.stop(timeout=1)
            reads.stop.set()
            reads.join(1)
            for r, cookie, data in writers:
                r.send(data[sent:])
                rep = r.read_reply(cookie)
                expect(rep.error == 0, "the trickled WRITE failed: %s" % raw.err_name(rep.error))
                r.close()
            failures = []
            for fn, what in ((probe.check, "while two WRITE payloads trickle"),
                             (reads.check, "of the ranges under the trickled WRITEs")):
                try:
                    fn(what)
                except Failed as e:
                    failures.append(str(e))
            expect(not failures, "; ".join(failures))
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        for offset, want in ((DIRTY_AT, new_dirty), (CLEAN_AT, new_clean)):
            got = h.pread(N, offset)
            expect(got == want, "after the trickled WRITE at %d: %s"
                   % (offset, nbdtest.describe_diff(got, want, offset)))
        h.flush()
        h.shutdown()
        for offset, want in ((DIRTY_AT, new_dirty), (CLEAN_AT, new_clean)):
            got = read_at(path, offset, N)
            expect(got == want, "the file after FLUSH at %d: %s"
                   % (offset, nbdtest.describe_diff(got, want, offset)))


def check_floor(tmp):
    path = os.path.join(tmp, "floor.img")
    nbdtest.random_file(path, SIZE, seed=28)
    old = read_at(path, CLEAN_AT, N)
    data = random.Random(3).randbytes(N)
    with nbdtest.Daemon([("disk", path, "")], threads=2,
                        extra=["--stall-timeout", "2"]) as d:
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        h.pread(N, CLEAN_AT)
        h.shutdown()
        r, _ = raw_write_start(d, CLEAN_AT)
        t0 = time.monotonic()
        cut, sent = None, 0
        for i in range(8 * 8):          # at most 8 s, 1/8 of TRICKLE at a time
            try:
                r.s.sendall(data[sent:sent + TRICKLE // 8])
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic() - t0
                break
            sent += TRICKLE // 8
            time.sleep(max(0.0, t0 + (i + 1) * 0.125 - time.monotonic()))
        if cut is None:
            # A reset may only show on the next read.
            r.s.settimeout(0.5)
            try:
                got = r.s.recv(4096)
                if got == b"":
                    cut = time.monotonic() - t0
            except ConnectionResetError:
                cut = time.monotonic() - t0
            except socket.timeout:
                pass
        r.close()
        expect(cut is not None, "a payload trickled at 64 KiB/s for %.1f s (%d KiB) was "
               "not cut off (--stall-timeout 2, floor 1 MiB/s)"
               % (time.monotonic() - t0, sent // KIB))
        expect(1.5 <= cut <= 6, "cut off after %.1f s; the grace is 2 s" % cut)
        log("floor: cut off after %.1f s, %d KiB sent" % (cut, sent // KIB))
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        got = h.pread(N, CLEAN_AT)
        h.flush()
        h.shutdown()
        expect(got == old, "blocks changed by a WRITE cut off: %s"
               % nbdtest.describe_diff(got, old, CLEAN_AT))
        expect(read_at(path, CLEAN_AT, N) == old, "the file changed by a WRITE cut off")


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        checks.run("held", check_held, tmp)
        checks.run("floor", check_floor, tmp)
    checks.finish("slow_payload")


if __name__ == "__main__":
    main()
