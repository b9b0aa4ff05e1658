#!/usr/bin/python3
"""cache_backend_error: writeback onto a full filesystem keeps the data, then recovers.

A 16 MiB tmpfs is mounted (root only; skipped otherwise) holding an 8 MiB
sparse backend file and a filler file that takes up every remaining page.
The daemon runs in writeback mode with --dirty-expire 1 and a 64 MiB cache.

  1  1 MiB of random data in 16 writes (unaligned, over holes) succeeds and
     reads back through the daemon
  2  FLUSH fails with EIO; the data still reads back, on both connections
  3  after 2.5 s (background writeback at --dirty-expire 1 fails too): the
     data still reads back, stats show writeback_errors > 0 and
     dirty_bytes > 0, and FLUSH still fails with EIO on either connection
  4  the filler is deleted: FLUSH succeeds (up to 3 tries, for an error
     raised by a background writeback just before the fault went away), the
     backend file holds every byte at once, dirty_bytes is 0
  5  SIGTERM: exit 0, the backend file still holds every byte
The daemon must be alive after each step. The seed is fixed (printed).
"""

import errno
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, expect_nbd_error, log, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
FS_SIZE = "16m"
SIZE = 8 * MIB
SEED = 2718
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def fill(path):
    """Write the filler file until ENOSPC (bounded); its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    total = 0
    try:
        for chunk, limit in ((MIB, 64), (4096, 4096)):
            buf = b"\xee" * chunk
            for _ in range(limit):
                try:
                    total += os.write(fd, buf)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
            else:
                nbdtest.fail("test setup: the filler never hit ENOSPC (%d bytes)" % total)
    finally:
        os.close(fd)
    return total


def is_full(mnt):
    probe = os.path.join(mnt, "probe")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        return False
    except OSError as e:
        return e.errno == errno.ENOSPC
    finally:
        os.close(fd)
        os.unlink(probe)


def umount(mnt):
    for _ in range(20):
        if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
            return
        time.sleep(0.25)
    log("umount %s still busy: lazy umount" % mnt)
    subprocess.run(["umount", "-l", mnt])


class World:
    def __init__(self, d, mnt, path, filler):
        self.d, self.mnt, self.path, self.filler = d, mnt, path, filler
        self.model = bytearray(SIZE)
        self.hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(2)]

    def reads(self, when):
        for c, h in enumerate(self.hs):
            require_same(h.pread(SIZE, 0), self.model, "%s: read of the whole export on conn %d"
                         % (when, c))

    def alive(self, when):
        expect(self.d.alive(), "the daemon died (%s)" % when)


def step_writes(w):
    r = random.Random(SEED)
    for k in range(16):
        off = k * 448 * KIB + 123 * k
        data = r.randbytes(64 * KIB)
        w.hs[k % 2].pwrite(data, off)
        w.model[off:off + len(data)] = data
    require(is_full(w.mnt), "test setup: the filesystem has room again")
    w.reads("after the writes")
    w.alive("after the writes")


def step_flush_fails(w):
    expect_nbd_error(w.hs[0].flush, errno.EIO, "FLUSH with the filesystem full")
    w.reads("after the failed FLUSH")
    w.alive("after the failed FLUSH")


def step_still_dirty(w):
    time.sleep(2.5)          # --dirty-expire 1: background writeback runs and fails
    w.reads("2.5 s after the failed FLUSH")
    st = nbdtest.stats(w.d)
    log("  stats: %s" % " ".join("%s=%s" % kv for kv in sorted(st.items())))
    expect(st["writeback_errors"] > 0, "writeback_errors is %d after failed writebacks"
           % st["writeback_errors"])
    expect(st["dirty_bytes"] > 0, "dirty_bytes is 0 while nothing could be written back")
    for c in (1, 0):
        try:
            expect_nbd_error(w.hs[c].flush, errno.EIO,
                             "FLUSH on conn %d with the filesystem still full" % c)
        except Failed as e:
            expect(False, str(e))
    w.reads("after the second failed FLUSH")
    w.alive("while the filesystem is full")


def step_recover(w):
    if os.path.exists(w.filler):
        os.unlink(w.filler)
    errors = []
    for attempt in range(3):
        try:
            w.hs[0].flush()
            break
        except nbd.Error as e:
            errors.append("%s (errno %s)" % (e.string, e.errno))
            log("  FLUSH %d after the fault went away failed: %s" % (attempt + 1, errors[-1]))
    else:
        raise Failed("FLUSH fails after the filler was deleted: %s" % "; ".join(errors))
    require_same(nbdtest.read_at(w.path, 0, SIZE), w.model,
                 "backend file right after the successful FLUSH")
    st = nbdtest.stats(w.d)
    expect(st["dirty_bytes"] == 0, "dirty_bytes is %d after a successful FLUSH"
           % st["dirty_bytes"])
    w.reads("after recovery")
    w.alive("after recovery")


def main():
    if os.geteuid() != 0:
        nbdtest.skip("mounting a tmpfs needs root")
    log("seed %d" % SEED)
    mnt = tempfile.mkdtemp(prefix="nbdcached-full-")
    mounted = False
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + FS_SIZE, "tmpfs", mnt],
                           capture_output=True, text=True)
        if p.returncode != 0:
            nbdtest.fail("mount -t tmpfs failed as root: %s" % p.stderr.strip())
        mounted = True
        path = nbdtest.sparse_file(os.path.join(mnt, "disk.img"), SIZE)
        filler = os.path.join(mnt, "filler")
        log("filler: %d bytes" % fill(filler))
        nbdtest.check(is_full(mnt), "test setup: the filesystem is not full")
        extra = ["--cache-size", "64M", "--cache-mode", "writeback", "--dirty-expire", "1"]
        with nbdtest.Daemon([("disk", path, "")], extra=extra) as d:
            w = World(d, mnt, path, filler)
            try:
                ok = CHECKS.run("1 writes into a full filesystem", step_writes, w)
                if ok:
                    CHECKS.run("2 FLUSH fails with EIO", step_flush_fails, w)
                    CHECKS.run("3 data stays dirty and readable", step_still_dirty, w)
            finally:
                # Never stop the daemon on a full filesystem: it would keep
                # retrying the writeback.
                if os.path.exists(filler):
                    os.unlink(filler)
            CHECKS.run("4 recovery: FLUSH succeeds", step_recover, w)
            nbdtest.shutdown_all(w.hs)
            CHECKS.dump_log(d)
        CHECKS.run("5 backend after SIGTERM", lambda: require_same(
            nbdtest.read_at(path, 0, SIZE), w.model, "backend file after SIGTERM"))
    finally:
        if mounted:
            umount(mnt)
        os.rmdir(mnt)
    CHECKS.finish("cache backend error")


if __name__ == "__main__":
    main()
