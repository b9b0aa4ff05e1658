#!/usr/bin/python3
"""nbd_backend_qemu: an export served from qemu-nbd (raw file) through libnbd.

A 64 MiB sparse raw file on /dev/shm with seeded data runs (and the
16 MiB at [32 MiB, 48 MiB) never touched) is served by
    qemu-nbd -k SOCK -f raw --persistent --shared=4 FILE
started here and stopped by its PID. qemu-nbd advertises multi-conn, so
the daemon may hold all 4 connections: everything is checked through the
daemon and against the file itself, never with a fifth connection. For
cache-mode writeback, then writethrough (one daemon each, one at a time):
  1  the size; the whole export reads back as the file
  2  seeded unaligned writes (one with FUA) and WRITE_ZEROES on two
     connections (Unix and TCP), each read back on the other; a FUA write
     is in the file at once; in writethrough every write is in the file
     before FLUSH
  3  FLUSH: the file equals the model byte for byte
  4  block status (base:allocation) over the whole export: the untouched
     [32 MiB, 48 MiB) is one hole, every byte written since is data, and
     everything reported as zero reads as zeros in the file
  5  SIGTERM: exit 0, the file still equals the model
Then a read-only qemu-nbd (-r): the export is read-only, a write is
refused with EPERM by the daemon, reads match the file. And qemu-nbd
--shared=2, which advertises multi-conn but takes only two clients at
once: the daemon must still start (within 15 s), serve and stop.
Seeds are fixed; every check runs; failures are listed at the end.
Environment: QEMU_NBD (default /usr/bin/qemu-nbd).
"""

import errno
import os
import random
import socket
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, expect_nbd_error, log, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
SEED = 6502
QEMU_NBD = os.environ.get("QEMU_NBD", "/usr/bin/qemu-nbd")
RUNS = ((MIB + 100, 300000), (20 * MIB, 2 * MIB), (50 * MIB + 4096, 65536))
UNTOUCHED = (32 * MIB, 48 * MIB)
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


class QemuNbd(nbdtest.NbdServer):
    """qemu-nbd on a Unix socket, started and stopped by PID."""

    label = "qemu-nbd"

    def __init__(self, tmp, path, extra=(), shared=4):
        self.sock = os.path.join(tmp, "qemu-nbd.sock")
        self.logpath = os.path.join(tmp, "qemu-nbd.log")
        if os.path.lexists(self.sock):
            os.unlink(self.sock)
        cmd = [QEMU_NBD, "-k", self.sock, "-f", "raw", "--persistent", "--shared=%d" % shared] + \
            list(extra) + [path]
        self.spawn(cmd, self.answers, "listen on " + self.sock, log_mode="w")
        time.sleep(0.1)       # let qemu-nbd retire the probe connection

    def answers(self):
        """The socket greets a client with NBDMAGIC."""
        if os.path.exists(self.sock):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(2)
                    s.connect(self.sock)
                    return s.recv(8) == b"NBDMAGIC"
            except OSError:
                pass
        return False


def running_daemon(exports, extra=(), hint=""):
    """nbdtest.running_daemon; `hint` ends the message when it does not start."""
    return nbdtest.running_daemon(exports, extra=extra, what="the qemu-nbd backend" + hint)


def make_image(path):
    nbdtest.data_runs_file(path, SIZE, RUNS, seed=SEED)
    with open(path, "rb") as f:
        return bytearray(f.read())


def pick_write(r):
    n = r.choice((1, 100, 4096, 4097, 65536, 200003, MIB))
    for _ in range(100):
        off = r.randrange(0, SIZE - n + 1)
        if r.random() < 0.4:
            off -= off % 4096
        if not (off < UNTOUCHED[1] and UNTOUCHED[0] < off + n):
            return off, n
    raise Failed("test setup: no write outside the untouched area")


def roundtrip(mode, seed):
    log("  mode %s, seed %d" % (mode, seed))
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = os.path.join(tmp, "disk.raw")
        model = make_image(path)
        q = QemuNbd(tmp, path)
        try:
            with running_daemon([("disk", q.uri(), "cache-mode=" + mode)],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600"]) as d:
                hs = [nbdtest.libnbd_handle(d.unix_uri("disk"), meta=True),
                      nbdtest.libnbd_handle(d.tcp_uri("disk"), meta=True)]
                try:
                    roundtrip_steps(mode, seed, d, hs, path, model)
                finally:
                    nbdtest.shutdown_all(hs)
            require_same(nbdtest.read_at(path, 0, SIZE), model,
                         "%s: the file after the daemon's SIGTERM" % mode)
        finally:
            q.stop()


def roundtrip_steps(mode, seed, d, hs, path, model):
    r = random.Random(seed)
    h0, h1 = hs
    require(h0.get_size() == SIZE, "%s: export size %d, file %d" % (mode, h0.get_size(), SIZE))
    require(not h0.is_read_only(), "%s: the export is read-only" % mode)
    require_same(read_all(h1), model,
                 "%s: the whole export before any write" % mode)
    written = []
    for k in range(24):
        off, n = pick_write(r)
        data = r.randbytes(n)
        fua = k == 11
        hs[k % 2].pwrite(data, off, nbd.CMD_FLAG_FUA if fua else 0)
        model[off:off + n] = data
        written.append((off, off + n))
        if fua:
            require_same(nbdtest.read_at(path, off, n), data,
                         "%s: the file right after a FUA write [%d,+%d)" % (mode, off, n),
                         base=off)
        lo, hi = max(0, off - 3000), min(SIZE, off + n + 3000)
        require_same(hs[(k + 1) % 2].pread(hi - lo, lo), model[lo:hi],
                     "%s: read back of write #%d [%d,+%d)" % (mode, k, off, n), base=lo)
    zeroed = []
    for k in range(3):
        off, n = pick_write(r)
        n = max(n, 8192)
        n = min(n, SIZE - off)
        if off < UNTOUCHED[1] and UNTOUCHED[0] < off + n:
            continue
        hs[k % 2].zero(n, off, nbd.CMD_FLAG_NO_HOLE if k == 1 else 0)
        model[off:off + n] = bytes(n)
        zeroed.append((off, off + n))
        lo, hi = max(0, off - 3000), min(SIZE, off + n + 3000)
        require_same(hs[(k + 1) % 2].pread(hi - lo, lo), model[lo:hi],
                     "%s: read back of the zero [%d,+%d)" % (mode, off, n), base=lo)
    if mode == "writethrough":
        require_same(nbdtest.read_at(path, 0, SIZE), model,
                     "writethrough: the file before FLUSH: every write must be in it")
    h1.flush()
    require_same(nbdtest.read_at(path, 0, SIZE), model, "%s: the file after FLUSH" % mode)
    # Block status through the daemon.
    segs = nbdtest.block_status_map(h0, 0, SIZE)
    log("  block status: %d segments, %s%s" % (len(segs), segs[:6], " ..." if len(segs) > 6
                                                 else ""))
    hole = nbdtest.clip_segments(segs, *UNTOUCHED)
    expect(hole == [(UNTOUCHED[0], UNTOUCHED[1], nbdtest.HOLE_ZERO)],
           "%s: the untouched [%d,%d) is not one hole: %s" % (mode, UNTOUCHED[0], UNTOUCHED[1],
                                                             hole))
    solid = written
    for zs, ze in zeroed:
        solid = [q for a, b in solid for q in ((a, min(b, zs)), (max(a, ze), b)) if q[1] > q[0]]
    for s, e, f in segs:
        if f & 1:
            bad = [(a, b) for a, b in solid if s < b and a < e]
            expect(not bad, "%s: block status says hole over written bytes [%d,%d) "
                   "(extent [%d,%d) flags %d)" % (mode, bad[0][0] if bad else 0,
                                                 bad[0][1] if bad else 0, s, e, f))
        if f & 2:
            got = nbdtest.read_at(path, s, e - s)
            expect(got == bytes(e - s), "%s: block status says zero at [%d,%d), the file "
                   "has data there (%s)" % (mode, s, e, nbdtest.describe_diff(got, bytes(e - s),
                                                                              base=s)))
    # Informational: where the file has a hole and the daemon says data.
    layout = nbdtest.file_layout(path, SIZE)
    for s, e, f in layout:
        if f == nbdtest.HOLE_ZERO:
            for a, b, g in nbdtest.clip_segments(segs, s, e):
                if not (g & 2):
                    log("  note: [%d,%d) is a hole in the file, block status says data" % (a, b))
    expect(d.alive(), "%s: the daemon died" % mode)


def read_all(h, chunk=4 * MIB):
    out = bytearray()
    for off in range(0, SIZE, chunk):
        out += h.pread(chunk, off)
    return out


def read_only():
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = os.path.join(tmp, "ro.raw")
        model = make_image(path)
        q = QemuNbd(tmp, path, extra=["-r"])
        try:
            with running_daemon([("ro", q.uri(), "")], extra=["--cache-size", "16M"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("ro"))
                try:
                    require(h.is_read_only(), "the export of a read-only qemu-nbd is writable")
                    h.set_strict_mode(0)       # let the daemon, not libnbd, refuse it
                    expect_nbd_error(lambda: h.pwrite(b"z" * 4096, MIB), errno.EPERM,
                                     "write to the read-only export")
                    require_same(read_all(h), model, "read-only: the whole export")
                finally:
                    nbdtest.shutdown_all([h])
            require_same(nbdtest.read_at(path, 0, SIZE), model, "read-only: the file")
        finally:
            q.stop()


def few_connections():
    """qemu-nbd --shared=2 still advertises multi-conn but serves only two
    clients at once: the daemon must start, serve the export and stop
    (not wait forever for connections the server will not take)."""
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        path = os.path.join(tmp, "two.raw")
        model = make_image(path)
        q = QemuNbd(tmp, path, shared=2)
        try:
            hint = (" --shared=2 within 15 s (qemu-nbd advertises multi-conn but takes only "
                    "two clients at once: the daemon must not wait for more)")
            with running_daemon([("two", q.uri(), "")], extra=["--cache-size", "16M"],
                                hint=hint) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("two"))
                try:
                    data = random.Random(SEED + 9).randbytes(70000)
                    h.pwrite(data, 5 * MIB + 3)
                    model[5 * MIB + 3:5 * MIB + 3 + len(data)] = data
                    h.flush()
                    require_same(read_all(h), model, "--shared=2: the whole export")
                finally:
                    nbdtest.shutdown_all([h])
            require_same(nbdtest.read_at(path, 0, SIZE), model, "--shared=2: the file")
        finally:
            q.stop()


def main():
    if not os.access(QEMU_NBD, os.X_OK):
        nbdtest.fail("%s not found (install qemu-utils)" % QEMU_NBD)
    log("seed %d" % SEED)
    t0 = time.time()
    for k, mode in enumerate(("writeback", "writethrough")):
        CHECKS.run("qemu-nbd backend, cache-mode=%s" % mode, roundtrip, mode, SEED + k)
    CHECKS.run("read-only qemu-nbd backend", read_only)
    CHECKS.run("qemu-nbd --shared=2 (multi-conn, two connections at most)", few_connections)
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("NBD backend qemu")


if __name__ == "__main__":
    main()
