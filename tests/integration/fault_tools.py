#!/usr/bin/python3
"""fault_tools: the fault injection tools themselves do what they say
(no nbdcached here). The tools are tests/faultfs and tests/nbdkit-fault,
driven through tests/lib/faults.py.

faultfs (a FUSE mount over a tmpfs directory; skips only without FUSE):
  f1 passthrough without caching: a write through the mount is in the
     source file at once (no writeback cache), a change to the source is
     seen through the mount at once (no page cache); counters writes and
     bytes_written move by exactly what was written; SEEK_DATA/SEEK_HOLE
     through the mount give the source's layout; punch hole works
  f2 fail-write: pwrite and fallocate fail with EIO and change nothing;
     ops_failed counts them; reads still work
  f3 fail-fsync with lose-on-fsync-error (default): fsync and fdatasync
     fail with EIO, the unsynced writes are rolled back in the source,
     fsyncs_failed and rollbacks count; with lose-on-fsync-error off the
     data stays
  f4 fail-fsync-once: the next fsync fails, the one after succeeds, the
     mode is ok again
  f5 fail-all: read, write, fsync, fallocate fail with EIO; lseek works
  f6 stall: 8 writes from 8 threads block (stalled == 8) until the mode
     changes, then complete; delay-ms 200 makes a write take >= 0.2 s
  f7 power-loss: a file fsynced with known content, then written over,
     extended, punched and truncated (some of it after closing) goes back
     to exactly the fsynced bytes and size; another file fsynced after its
     writes keeps them; a second power-loss changes nothing; an O_DSYNC
     write counts as an fsync (kept by power-loss) and fails under
     fail-fsync
  f8 a command not understood fails with EINVAL

nbdkit fault filter (nbdkit file plugin, python libnbd):
  n1 no fault file: every command works
  n2 each of read, write, flush, trim, zero alone fails exactly that
     command with EIO, the others work; "all" fails every one; a FUA write
     fails under "flush"; an unknown word fails everything
  n3 stall: a FLUSH waits until the file changes, then succeeds
  n4 drop-unflushed: a failed FLUSH puts the unflushed bytes back to their
     flushed values in the file; after the fault, FLUSH succeeds and the
     file holds the new bytes
  n5 SIGSTOP/SIGCONT and a restart (SIGTERM) on the same socket: a new
     connection works after each
"""

import ctypes
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
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SEED = 4242
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, OSError))
expect = CHECKS.expect

FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch(fd, offset, length):
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def delta(before, after, key):
    return after[key] - before[key]


class FileOn:
    """A file opened O_RDWR through the mount, closed at the end."""

    def __init__(self, fs, name, create_size=None):
        if create_size is not None:
            nbdtest.sparse_file(fs.source(name), create_size)
        self.fd = os.open(fs.path(name), os.O_RDWR)

    def __enter__(self):
        return self.fd

    def __exit__(self, *a):
        os.close(self.fd)
        return False


# ---- faultfs ----

def f1_passthrough(fs):
    r = random.Random(SEED)
    with FileOn(fs, "f1", 4 * MIB) as fd:
        c0 = fs.counters()
        data = r.randbytes(MIB)
        require(os.pwrite(fd, data, 123) == MIB, "short write through the mount")
        c1 = fs.counters()
        require(nbdtest.read_at(fs.source("f1"), 123, MIB) == data,
                "a write through the mount is not in the source file before any fsync")
        expect(delta(c0, c1, "bytes_written") == MIB, "bytes_written moved by %d, wrote %d"
               % (delta(c0, c1, "bytes_written"), MIB))
        expect(delta(c0, c1, "writes") >= 1, "writes did not move")
        # A change underneath shows at once: nothing is cached in the kernel.
        os.pread(fd, 4096, 0)
        with open(fs.source("f1"), "r+b") as f:
            f.seek(0)
            f.write(b"underneath")
        require(os.pread(fd, 10, 0) == b"underneath",
                "a change to the source file is not seen through the mount (page cache?)")
        punch(fd, 2 * MIB, MIB)
        require(os.pread(fd, MIB, 2 * MIB) == bytes(MIB), "punched range does not read zeros")
        require(nbdtest.file_layout(fs.path("f1"), 4 * MIB)
                == nbdtest.file_layout(fs.source("f1"), 4 * MIB),
                "SEEK_DATA/SEEK_HOLE through the mount differ from the source: %s vs %s"
                % (nbdtest.file_layout(fs.path("f1"), 4 * MIB),
                   nbdtest.file_layout(fs.source("f1"), 4 * MIB)))
        os.fsync(fd)


def f2_fail_write(fs):
    with FileOn(fs, "f2", MIB) as fd:
        os.pwrite(fd, b"A" * 8192, 0)
        os.fsync(fd)
        c0 = fs.counters()
        fs.set("fail-write")
        try:
            faults.expect_eio(lambda: os.pwrite(fd, b"B" * 4096, 0), "pwrite under fail-write")
            faults.expect_eio(lambda: punch(fd, 0, 4096), "punch hole under fail-write")
            require(os.pread(fd, 8192, 0) == b"A" * 8192, "read under fail-write")
            os.fsync(fd)
        finally:
            fs.set("ok")
        c1 = fs.counters()
        expect(delta(c0, c1, "ops_failed") == 2, "ops_failed moved by %d, expected 2"
               % delta(c0, c1, "ops_failed"))
        expect(delta(c0, c1, "bytes_written") == 0, "bytes_written moved under fail-write")
        require(nbdtest.read_at(fs.source("f2"), 0, 8192) == b"A" * 8192,
                "the source changed under fail-write")


def f3_fail_fsync(fs):
    with FileOn(fs, "f3", MIB) as fd:
        os.pwrite(fd, b"S" * 4096, 0)
        os.fsync(fd)
        os.pwrite(fd, b"U" * 4096, 0)
        os.pwrite(fd, b"V" * 100, 5000)
        c0 = fs.counters()
        fs.set("fail-fsync")
        try:
            faults.expect_eio(lambda: os.fsync(fd), "fsync under fail-fsync")
            os.pwrite(fd, b"W" * 10, 0)
            faults.expect_eio(lambda: os.fdatasync(fd), "fdatasync under fail-fsync")
        finally:
            fs.set("ok")
        c1 = fs.counters()
        expect(delta(c0, c1, "fsyncs_failed") == 2, "fsyncs_failed moved by %d, expected 2"
               % delta(c0, c1, "fsyncs_failed"))
        expect(delta(c0, c1, "rollbacks") == 2, "rollbacks moved by %d, expected 2"
               % delta(c0, c1, "rollbacks"))
        want = b"S" * 4096 + bytes(MIB - 4096)
        require(read_file(fs.source("f3")) == want,
                "after failed fsyncs (lose-on-fsync-error) the source is not its fsynced self")
        require(os.pread(fd, 4096, 0) == b"S" * 4096, "the mount does not show the rollback")
        # lose-on-fsync-error off: the data stays.
        fs.lose_on_fsync_error(False)
        try:
            os.pwrite(fd, b"K" * 4096, 0)
            fs.set("fail-fsync")
            faults.expect_eio(lambda: os.fsync(fd), "fsync under fail-fsync (keep)")
            fs.set("ok")
            require(nbdtest.read_at(fs.source("f3"), 0, 4096) == b"K" * 4096,
                    "lose-on-fsync-error off: the data was rolled back")
            os.fsync(fd)
        finally:
            fs.set("ok")
            fs.lose_on_fsync_error(True)
        st = fs.counters()
        expect(st["lose_on_fsync_error"] is True, "lose_on_fsync_error not reported on again")


def f4_fail_fsync_once(fs):
    with FileOn(fs, "f4", 64 * KIB) as fd:
        os.pwrite(fd, b"1" * 10, 0)
        fs.set("fail-fsync-once")
        require(fs.counters()["mode"] == "fail-fsync-once", "mode not reported")
        faults.expect_eio(lambda: os.fsync(fd), "first fsync under fail-fsync-once")
        require(fs.counters()["mode"] == "ok", "mode after the failed fsync is %r, expected ok"
                % fs.counters()["mode"])
        os.pwrite(fd, b"2" * 10, 0)
        os.fsync(fd)
        require(nbdtest.read_at(fs.source("f4"), 0, 10) == b"2" * 10,
                "data written after the failed fsync")


def f5_fail_all(fs):
    with FileOn(fs, "f5", MIB) as fd:
        os.pwrite(fd, b"D" * 4096, 8192)
        os.fsync(fd)
        c0 = fs.counters()
        fs.set("fail-all")
        try:
            faults.expect_eio(lambda: os.pread(fd, 4096, 0), "pread under fail-all")
            faults.expect_eio(lambda: os.pwrite(fd, b"x", 0), "pwrite under fail-all")
            faults.expect_eio(lambda: os.fsync(fd), "fsync under fail-all")
            faults.expect_eio(lambda: punch(fd, 0, 4096), "fallocate under fail-all")
            require(os.lseek(fd, 0, os.SEEK_DATA) == 8192, "SEEK_DATA under fail-all")
        finally:
            fs.set("ok")
        c1 = fs.counters()
        expect(delta(c0, c1, "ops_failed") == 4, "ops_failed moved by %d, expected 4"
               % delta(c0, c1, "ops_failed"))
        require(os.pread(fd, 4096, 8192) == b"D" * 4096, "read after fail-all")


def f6_stall_and_delay(fs):
    # The kernel serializes direct writes to one FUSE file (the inode
    # lock), so each stalled writer has a file of its own. 16 is more than
    # libfuse's default thread limit (10): faultfs must raise it.
    n = 16
    fds = [os.open(fs.path("f6-%d" % i), os.O_RDWR | os.O_CREAT, 0o600) for i in range(n)]
    try:
        fs.set("stall")
        results = [None] * n

        def writer(i):
            try:
                results[i] = os.pwrite(fds[i], bytes([65 + i]) * 4096, 4096)
            except OSError as e:
                results[i] = e

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        try:
            for t in threads:
                t.start()
            ok = faults._wait(lambda: fs.counters()["stalled"] == n, 5)
            require(ok, "stalled is %d, expected %d writes waiting"
                    % (fs.counters()["stalled"], n))
            time.sleep(0.3)
            require(all(r is None for r in results), "a write finished during the stall: %r"
                    % results)
        finally:
            fs.set("ok")
            for t in threads:
                t.join(10)
        require(not any(t.is_alive() for t in threads), "writes still blocked after ok")
        require(results == [4096] * n, "stalled writes after ok: %r" % results)
        for i in range(n):
            require(nbdtest.read_at(fs.source("f6-%d" % i), 4096, 4096)
                    == bytes([65 + i]) * 4096, "stalled write %d is not in the source" % i)
        fs.set("delay-ms 200")
        try:
            t0 = time.monotonic()
            os.pwrite(fds[0], b"d", 0)
            took = time.monotonic() - t0
        finally:
            fs.set("ok")
        require(took >= 0.19, "a write under delay-ms 200 took %.3f s" % took)
        require(fs.counters()["delay_ms"] == 0, "ok did not reset delay-ms")
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def f7_power_loss(fs):
    r = random.Random(SEED + 7)
    size = 3 * MIB
    base = bytearray(size)
    for off, n in ((0, 100 * KIB), (MIB - 5, 300 * KIB), (2 * MIB + 7, 500 * KIB)):
        base[off:off + n] = r.randbytes(n)
    with open(fs.source("f7"), "wb") as f:
        f.truncate(size)
    with open(fs.source("g7"), "wb") as f:
        f.truncate(MIB)
    fd = os.open(fs.path("f7"), os.O_RDWR)
    gd = os.open(fs.path("g7"), os.O_RDWR)
    files0 = fs.counters()["undo_files"]
    try:
        for off, n in ((0, 100 * KIB), (MIB - 5, 300 * KIB), (2 * MIB + 7, 500 * KIB)):
            os.pwrite(fd, bytes(base[off:off + n]), off)
        os.fsync(fd)
        require(read_file(fs.source("f7")) == base, "setup: source after the fsync")
        # Unsynced changes: overwrites (one overlapping another), a write
        # past EOF, a punch, a write into a hole.
        os.pwrite(fd, r.randbytes(200 * KIB), 50 * KIB)
        os.pwrite(fd, r.randbytes(10 * KIB), 60 * KIB)
        os.pwrite(fd, r.randbytes(4096), size + 4096)
        punch(fd, MIB, 64 * KIB)
        os.pwrite(fd, r.randbytes(777), 1536 * KIB)
        # The other file: written and fsynced; then written again, unsynced.
        gdata = r.randbytes(64 * KIB)
        os.pwrite(gd, gdata, 4096)
        os.fsync(gd)
        os.pwrite(gd, b"lost" * 1024, 4096)
        c = fs.counters()
        expect(c["undo_files"] == files0 + 2, "undo_files is %d, expected %d"
               % (c["undo_files"], files0 + 2))
    finally:
        os.close(fd)
    # Truncation after closing: a new open, then power loss.
    os.truncate(fs.path("f7"), MIB)
    fs.power_loss()
    os.close(gd)
    got = read_file(fs.source("f7"))
    require(len(got) == size, "f7 after power-loss: %d bytes, fsynced size %d" % (len(got), size))
    require(got == base, "f7 after power-loss differs from its fsynced bytes at %d"
            % nbdtest.first_diff(got, base))
    want_g = bytes(4096) + gdata + bytes(MIB - 4096 - len(gdata))
    require(read_file(fs.source("g7")) == want_g, "g7 after power-loss is not its fsynced self")
    c = fs.counters()
    expect(c["undo_files"] == 0 and c["undo_bytes"] == 0 and c["undo_buffered_bytes"] == 0,
           "undo logs not empty after power-loss: %r" % c)
    fs.power_loss()
    require(read_file(fs.source("f7")) == base, "a second power-loss changed f7")
    # O_DSYNC writes are fsyncs.
    fd = os.open(fs.path("f7"), os.O_RDWR)
    try:
        c0 = fs.counters()
        os.pwritev(fd, [b"sync" * 1024], 0, os.RWF_DSYNC)
        c1 = fs.counters()
        expect(delta(c0, c1, "fsyncs_ok") == 1, "an RWF_DSYNC write counted %d fsyncs"
               % delta(c0, c1, "fsyncs_ok"))
        fs.power_loss()
        require(nbdtest.read_at(fs.source("f7"), 0, 4096) == b"sync" * 1024,
                "an RWF_DSYNC write did not survive power-loss")
        fs.set("fail-fsync")
        try:
            faults.expect_eio(lambda: os.pwritev(fd, [b"nope" * 1024], 0, os.RWF_DSYNC),
                              "RWF_DSYNC write under fail-fsync")
        finally:
            fs.set("ok")
        require(nbdtest.read_at(fs.source("f7"), 0, 4096) == b"sync" * 1024,
                "a failed RWF_DSYNC write was not rolled back")
    finally:
        os.close(fd)


def f8_bad_command(fs):
    for bad in ("bogus", "delay-ms", "delay-ms x", "fail-write now", "lose-on-fsync-error 2"):
        try:
            fs.command(bad)
        except OSError as e:
            require(e.errno == errno.EINVAL, "%r: %s, expected EINVAL" % (bad, e))
            continue
        raise Failed("%r was accepted" % bad)
    require(fs.counters()["mode"] == "ok", "a bad command changed the mode")


# ---- nbdkit fault filter ----

COMMANDS = ("read", "write", "flush", "trim", "zero")


def try_commands(h):
    """{command: errno or 0} for one of each command."""
    out = {}
    ops = {
        "read": lambda: h.pread(4096, 0),
        "write": lambda: h.pwrite(b"w" * 4096, 8192),
        "flush": lambda: h.flush(),
        "trim": lambda: h.trim(4096, 65536),
        "zero": lambda: h.zero(4096, 131072),
    }
    for name in COMMANDS:
        try:
            ops[name]()
            out[name] = 0
        except nbd.Error as e:
            out[name] = e.errnum
    return out


def n1_n2_each_command(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "n.img"), 4 * MIB)
    kit = faults.NbdkitFault(tmp, img, name="n12")
    try:
        h = kit.handle()
        got = try_commands(h)
        require(got == {c: 0 for c in COMMANDS}, "n1 without faults: %r" % got)
        for c in COMMANDS:
            kit.set(c)
            got = try_commands(h)
            want = {k: (errno.EIO if k == c else 0) for k in COMMANDS}
            expect(got == want, "n2 fault %r: %r, expected %r" % (c, got, want))
        kit.set("all")
        got = try_commands(h)
        expect(got == {c: errno.EIO for c in COMMANDS}, "n2 fault 'all': %r" % got)
        kit.set("flush")
        try:
            faults.expect_eio(lambda: h.pwrite(b"f" * 4096, 0, nbd.CMD_FLAG_FUA),
                              "FUA write under 'flush'")
        except Failed as e:
            expect(False, "n2 %s" % e)
        kit.set("wrte")
        got = try_commands(h)
        expect(got == {c: errno.EIO for c in COMMANDS}, "n2 unknown word: %r" % got)
        kit.clear()
        got = try_commands(h)
        require(got == {c: 0 for c in COMMANDS}, "n2 after clearing: %r" % got)
        h.shutdown()
    finally:
        kit.stop()


def n3_stall(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "n3.img"), MIB)
    kit = faults.NbdkitFault(tmp, img, name="n3")
    try:
        h = kit.handle()
        h.pwrite(b"s" * 4096, 0)
        kit.set("stall")
        done = []

        def flusher():
            try:
                h.flush()
                done.append(0)
            except nbd.Error as e:
                done.append(e.errnum)

        t = threading.Thread(target=flusher)
        t.start()
        time.sleep(0.5)
        stalled = not done
        kit.clear()
        t.join(10)
        require(stalled, "FLUSH finished while the filter stalled: %r" % done)
        require(done == [0], "FLUSH after the stall ended: %r" % done)
        h.shutdown()
    finally:
        kit.stop()


def n4_drop_unflushed(tmp):
    r = random.Random(SEED + 4)
    size = 2 * MIB
    img = nbdtest.sparse_file(os.path.join(tmp, "n4.img"), size)
    kit = faults.NbdkitFault(tmp, img, name="n4", drop_unflushed=True)
    try:
        h = kit.handle()
        flushed = r.randbytes(size)
        h.pwrite(flushed, 0)
        h.flush()
        require(read_file(img) == flushed, "setup: the image after FLUSH")
        h.pwrite(r.randbytes(300 * KIB), 5)
        h.trim(64 * KIB, MIB)
        h.zero(8 * KIB, MIB + 200 * KIB)
        kit.set("flush")
        faults.expect_eio(h.flush, "FLUSH under 'flush' with drop-unflushed")
        got = read_file(img)
        require(got == flushed, "after the failed FLUSH the image is not its flushed self "
                "(first difference at %d)" % nbdtest.first_diff(got, flushed))
        kit.clear()
        new = r.randbytes(100 * KIB)
        h.pwrite(new, 4096)
        h.flush()
        want = flushed[:4096] + new + flushed[4096 + len(new):]
        require(read_file(img) == want, "after a good FLUSH the image lacks the new bytes")
        h.shutdown()
    finally:
        kit.stop()


def n5_pause_restart(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "n5.img"), MIB)
    kit = faults.NbdkitFault(tmp, img, name="n5")
    try:
        h = kit.handle()
        h.pwrite(b"p" * 4096, 0)
        kit.pause()
        done = []
        t = threading.Thread(target=lambda: done.append(h.pread(4096, 0)))
        t.start()
        time.sleep(0.3)
        require(not done, "a read was answered by a stopped nbdkit")
        kit.resume()
        t.join(10)
        require(done == [b"p" * 4096], "read after SIGCONT: %r" % done[:1])
        h.flush()
        h.shutdown()    # nbdkit 1.32 exits on SIGTERM only once its clients have gone
        kit.restart()
        h2 = kit.handle()
        require(h2.pread(4096, 0) == b"p" * 4096, "read after restart")
        h2.shutdown()
    finally:
        kit.stop()


def main():
    faults.require_fuse()
    log("seed %d" % SEED)
    with nbdtest.tempdir(base=nbdtest.shm_dir()) as tmp:
        with faults.FaultFS(os.path.join(tmp, "ffs")) as fs:
            for name, fn in (("f1 passthrough without caching", f1_passthrough),
                             ("f2 fail-write", f2_fail_write),
                             ("f3 fail-fsync and lose-on-fsync-error", f3_fail_fsync),
                             ("f4 fail-fsync-once", f4_fail_fsync_once),
                             ("f5 fail-all", f5_fail_all),
                             ("f6 stall and delay-ms", f6_stall_and_delay),
                             ("f7 power-loss", f7_power_loss),
                             ("f8 bad commands", f8_bad_command)):
                CHECKS.run(name, fn, fs)
                fs.set("ok")
            log("faultfs counters: %s" % fs.counters())
        for name, fn in (("n1/n2 each command fails alone", n1_n2_each_command),
                         ("n3 stall", n3_stall),
                         ("n4 drop-unflushed", n4_drop_unflushed),
                         ("n5 SIGSTOP/SIGCONT and restart", n5_pause_restart)):
            CHECKS.run(name, fn, tmp)
    CHECKS.finish("fault tools")


if __name__ == "__main__":
    main()
