#!/usr/bin/python3
"""cache_device_l2_stamp: the level-2 cache never serves what a backend
file changed while the daemon was down, though its modification time
says otherwise (issue 40, item 2).

Each case: a file export with a cache device (cache-device-use both), 2
MiB written through the daemon and read back, SIGTERM (the clean stop
writes it back, moves what RAM holds to the level-2 area and keeps its
map); then the file changed behind the daemon's back, a warm start, and
a read of the 2 MiB: it must return the file's bytes.

  1  Unchanged (the control): the warm start reads the 2 MiB from the
     level-2 area (its hit bytes), not the backend.
  2  Rewritten in place, its old modification time put back (as touch
     -d, rsync -t and cp -p do): its change time moved, the pages are not
     used, the read returns the new bytes.
  3  A file system of whole-second timestamps (ext4 with 128-byte inodes
     on a loop device): rewritten in place right after the stop, within
     the second of the daemon's own last write when it can (up to three
     tries; said how often it did): a stamp recorded within that second
     proves nothing, and the read returns the new bytes. Not run (said)
     when the machine cannot make and mount such a file system.
"""

import os
import re
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 64 * MIB
DEVICE = 96 * MIB
AT = 8 * MIB
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def start(work, disk, dev, what):
    sub = os.path.join(work, "d%d" % len(os.listdir(work)))
    os.mkdir(sub)
    return nbdtest.CheckedDaemon([("disk", disk, "")], workdir=sub, tcp=False,
                                 extra=["--cache-device", dev, "--cache-device-use", "both",
                                        "--cache-size", "32M", "--cache-mode", "writeback",
                                        "--hugepages", "off"], what=what)


def l2_stats(d):
    return nbdtest.control_request(d.control, {"command": "stats"})[
        "cache"]["cache_device"]["l2"]


def write_and_stop(work, disk, dev):
    """2 MiB written and read through a daemon, then SIGTERM: the bytes."""
    data = os.urandom(2 * MIB)
    d = start(work, disk, dev, "the first daemon")
    h = nbdtest.libnbd_handle(d.unix_uri("disk"))
    h.pwrite(data, AT)
    nbdtest.require_same(h.pread(len(data), AT), data, "read back", base=AT)
    h.shutdown()
    d.stop()
    return data


def warm_read(work, disk, dev, want, what):
    """A warm start's read of the 2 MiB: (right, bytes from the area)."""
    d = start(work, disk, dev, what)
    try:
        text = d.log_text()
        m = re.search(r"level-2 cache warm: [^\n]*|its backend file was changed[^\n]*", text)
        log("  %s: %s" % (what, m.group(0) if m else "no level-2 line at start"))
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        before = l2_stats(d)["hit_bytes"]
        got = h.pread(len(want), AT)
        hits = l2_stats(d)["hit_bytes"] - before
        h.shutdown()
    finally:
        d.stop()
    if got != want:
        log("  %s: %s" % (what, nbdtest.describe_diff(got, want, AT)))
    return got == want, hits


def rewrite(disk):
    """New bytes over the 2 MiB, in place (no truncate): they."""
    new = os.urandom(2 * MIB)
    fd = os.open(disk, os.O_WRONLY)
    try:
        os.pwrite(fd, new, AT)
        os.fsync(fd)
    finally:
        os.close(fd)
    return new


def unchanged(work):
    disk, dev = os.path.join(work, "disk.img"), os.path.join(work, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    data = write_and_stop(work, disk, dev)
    ok, hits = warm_read(work, disk, dev, data, "unchanged")
    expect(ok, "unchanged: the read does not return the bytes written")
    expect(hits == len(data), "unchanged: %d bytes from the level-2 area, want %d (the "
           "warm start is not warm)" % (hits, len(data)))


def mtime_put_back(work):
    disk, dev = os.path.join(work, "disk.img"), os.path.join(work, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    write_and_stop(work, disk, dev)
    st = os.stat(disk)
    new = rewrite(disk)
    os.utime(disk, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(disk)
    log("  rewritten: modification time %d put back (now %d), change time %d -> %d"
        % (st.st_mtime_ns, after.st_mtime_ns, st.st_ctime_ns, after.st_ctime_ns))
    ok, hits = warm_read(work, disk, dev, new, "rewritten, its modification time put back")
    expect(ok, "rewritten with its old modification time put back: the warm start served "
           "the bytes from before (%d from the level-2 area)" % hits)


def run(args):
    return subprocess.run(args, capture_output=True, text=True)


def coarse(work):
    img, mnt = os.path.join(work, "ext4.img"), os.path.join(work, "mnt")
    os.mkdir(mnt)
    nbdtest.sparse_file(img, 256 * MIB)
    p = run(["mkfs.ext4", "-q", "-F", "-I", "128", img])
    if p.returncode != 0:
        log("  not run: mkfs.ext4 -I 128: %s" % p.stderr.strip())
        return
    p = run(["mount", "-o", "loop", img, mnt])
    if p.returncode != 0:
        log("  not run: the machine cannot mount a loop device (%s)" % p.stderr.strip())
        return
    try:
        dev = os.path.join(work, "cache.dev")
        nbdtest.sparse_file(dev, DEVICE)
        disk = os.path.join(mnt, "disk.img")
        nbdtest.sparse_file(disk, SIZE)
        raced = 0
        for i in range(3):
            write_and_stop(work, disk, dev)
            st = os.stat(disk)
            new = rewrite(disk)
            after = os.stat(disk)
            same = (after.st_mtime_ns, after.st_ctime_ns) == (st.st_mtime_ns, st.st_ctime_ns)
            raced += same
            log("  try %d: times after the stop %d.%09d; the rewrite %s them" % (
                i + 1, st.st_mtime_ns // 10 ** 9, st.st_mtime_ns % 10 ** 9,
                "left" if same else "moved"))
            expect(st.st_mtime_ns % 10 ** 9 == 0, "the file system shows nanoseconds: it "
                   "is not one of whole seconds")
            ok, hits = warm_read(work, disk, dev, new, "coarse times, try %d" % (i + 1))
            expect(ok, "coarse times, try %d: the warm start served the bytes from before "
                   "the rewrite (%d from the level-2 area; the rewrite %s the file's "
                   "times)" % (i + 1, hits, "left" if same else "moved"))
            if raced:
                break
        log("  the rewrite left the file's times as the stop left them in %d of %d "
            "tries" % (raced, i + 1))
    finally:
        run(["umount", mnt])


def main():
    with nbdtest.tempdir() as tmp:
        for name, fn in (("1 unchanged: warm", unchanged),
                         ("2 rewritten, its modification time put back", mtime_put_back),
                         ("3 whole-second timestamps, rewritten in the same second",
                          coarse)):
            sub = os.path.join(tmp, fn.__name__)
            os.mkdir(sub)
            CHECKS.run(name, fn, sub)
    CHECKS.finish("level-2 stamps")


if __name__ == "__main__":
    main()
