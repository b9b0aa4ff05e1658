#!/usr/bin/python3
"""resize_blockdev: online resize of an export whose backend is a block
device (a loop device over a file in the test's temporary directory).

A block device is not cut or extended by the daemon: its size comes from
BLKGETSIZE64, an explicit size is taken up to what the device has (ENOSPC
past it) and a smaller one only ends the export earlier. One daemon in
writeback mode with --dirty-expire 3600 and --dirty-high 90 (written data
stays dirty until a FLUSH), one export b over the loop device (32 MiB of
random bytes to start with). A byte model follows every write; "the
device" below is the loop device's backing file, read directly.

  grow      random 4 KiB writes (a bounded count) on connection c1: not in
            the device before FLUSH, there after it; the file extended to
            64 MiB, `losetup -c`, `nbdcachectl resize b` ("33554432 ->
            67108864"): a new connection c2 sees 64 MiB, c1 keeps 32 MiB
            and writes on below it; c2 reads the new part as zeros, writes
            it and reads it back; the model holds through both connections,
            and in the device after FLUSH
  too_big   `resize b 128M` (more than the device has) is refused, saying
            the backend cannot grow to 134217728 bytes: it has 67108864
            (errno ENOSPC on the control socket); nothing changed: a new
            connection sees 64 MiB, the device is 64 MiB
  shrink    `resize b 48M` ("67108864 -> 50331648"): a new connection sees
            48 MiB, the device stays 64 MiB with its bytes past 48 MiB
            (a block device is not cut); c2's READ past the new end gets
            ENOSPC. Then 1 MiB written at 44 MiB without FLUSH: `resize b
            40M` fails naming "1048576 dirty bytes past the new end" (EBUSY
            on the control socket), nothing changed; after FLUSH it
            succeeds, the device still 64 MiB and holding the model
  reload    the explicit 40M holds: a reload with the device unchanged,
            and one after the file was extended to 80 MiB and `losetup -c`,
            leave b at 40 MiB (nothing listed as resized); `nbdcachectl
            resize b` without a size follows the device ("41943040 ->
            83886080"): a new connection sees 80 MiB, the device's bytes
            past 40 MiB (left there by the shrinks) and zeros past 64 MiB;
            it writes past 64 MiB, FLUSH, the device holds the model; the
            device grown to 96 MiB, a reload lists b as resized again

Skips (77) only when the kernel has no loop device support; any other
failure of losetup is a failure. The loop device is always detached.
"""

import errno
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
NAME = "b"
CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, nbd.Error))
expect = CHECKS.expect
require = nbdtest.require


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    log("+ %s -> %d: %s%s" % (" ".join(cmd), p.returncode, p.stdout.strip(), p.stderr.strip()))
    return p


def kernel_has_loop():
    """Does the running kernel have the loop driver (built in or loaded)?
    /proc/devices lists the block major "loop" when it has."""
    if os.path.exists("/sys/module/loop"):
        return True
    try:
        with open("/proc/devices") as f:
            block = f.read().split("Block devices:", 1)[-1]
    except OSError:
        return False
    return any(line.split()[-1:] == ["loop"] for line in block.splitlines())


def attach(img):
    """losetup --find --show: the loop device. Skips when the kernel has no
    loop support; any other failure of losetup fails the test."""
    try:
        p = run(["losetup", "--find", "--show", img])
    except FileNotFoundError:
        nbdtest.fail("losetup is not installed (util-linux)")
    if p.returncode != 0:
        if not kernel_has_loop():
            nbdtest.skip("the kernel has no loop device support (%s)"
                         % p.stderr.strip())
        nbdtest.fail("losetup --find --show %s failed: %s" % (img, p.stderr.strip()))
    return p.stdout.strip()


def device_size(dev):
    fd = os.open(dev, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def grow_device(img, dev, size):
    """The backing file extended to size bytes, the loop device told so."""
    os.truncate(img, size)
    p = run(["losetup", "-c", dev])
    require(p.returncode == 0, "losetup -c %s: %s" % (dev, p.stderr.strip()))
    require(device_size(dev) == size, "%s is %d bytes after losetup -c, expected %d"
            % (dev, device_size(dev), size))




def connect(d):
    return nbdtest.libnbd_handle(d.unix_uri(NAME))


def size_of(d):
    return nbdtest.export_size(d, NAME)






def write_random(h, model, rng, lo, hi, count):
    """count random 4 KiB writes in [lo, hi) through h, in the model too."""
    for _ in range(count):
        off = lo + rng.randrange((hi - lo) // 4096) * 4096
        data = rng.randbytes(4096)
        h.pwrite(data, off)
        model[off:off + 4096] = data


class State:
    def __init__(self, d, img, dev):
        self.d = d
        self.img = img
        self.dev = dev
        self.rng = random.Random(17)
        with open(img, "rb") as f:
            self.model = bytearray(f.read())
        self.c1 = None
        self.c2 = None

    def device_holds_model(self, what):
        """After a FLUSH: the device (its backing file, read directly) is the
        model, byte for byte."""
        with open(self.img, "rb") as f:
            disk = f.read()
        nbdtest.require_same(disk, bytes(self.model), "the device %s" % what)


def grow(s):
    d = s.d
    s.c1 = connect(d)
    require(s.c1.get_size() == 32 * MIB, "c1: size %d" % s.c1.get_size())
    write_random(s.c1, s.model, s.rng, 0, 32 * MIB, 400)
    # Writeback, nothing expires: the writes are in the cache only.
    with open(s.img, "rb") as f:
        require(f.read() != bytes(s.model), "the device has the writes before any FLUSH")
    s.c1.flush()
    s.device_holds_model("after the first FLUSH")
    grow_device(s.img, s.dev, 64 * MIB)
    s.model.extend(bytes(32 * MIB))
    p = nbdtest.nbdcachectl(d, "resize", NAME)
    require(p.returncode == 0 and "33554432 -> 67108864" in p.stdout,
            "nbdcachectl resize b: %d %r %r" % (p.returncode, p.stdout, p.stderr))
    s.c2 = connect(d)
    expect(s.c2.get_size() == 64 * MIB, "new connection: size %d" % s.c2.get_size())
    expect(s.c1.get_size() == 32 * MIB, "old connection: size %d" % s.c1.get_size())
    # The new part: zeros (the file's new bytes), then written through c2.
    nbdtest.require_same(s.c2.pread(32 * MIB, 32 * MIB), bytes(32 * MIB),
                         "the grown part through c2", base=32 * MIB)
    write_random(s.c2, s.model, s.rng, 32 * MIB, 64 * MIB, 200)
    # The old connection writes on, below its own end.
    write_random(s.c1, s.model, s.rng, 0, 32 * MIB, 100)
    nbdtest.require_same(nbdtest.read_whole(s.c2, 64 * MIB), bytes(s.model), "b through c2")
    nbdtest.require_same(nbdtest.read_whole(s.c1, 32 * MIB), bytes(s.model[:32 * MIB]), "b through c1")
    s.c1.flush()
    s.c2.flush()
    expect(os.path.getsize(s.img) == 64 * MIB, "the image is %d bytes" % os.path.getsize(s.img))
    s.device_holds_model("after FLUSH on both connections")


def too_big(s):
    d = s.d
    p = nbdtest.nbdcachectl(d, "resize", NAME, "128M")
    expect(p.returncode == 1 and "cannot grow to 134217728 bytes: it has 67108864"
           in p.stderr,
           "resize b 128M on a 64 MiB device: %d %r %r" % (p.returncode, p.stdout, p.stderr))
    rep = nbdtest.control_request(d.control, {"command": "resize", "export": NAME,
                                              "size": "128M"})
    expect(not rep["ok"] and rep.get("errno") == "ENOSPC", "control reply: %r" % rep)
    expect(size_of(d) == 64 * MIB, "a refused grow changed the size: %d" % size_of(d))
    expect(device_size(s.dev) == 64 * MIB, "the device changed: %d" % device_size(s.dev))
    expect(os.path.getsize(s.img) == 64 * MIB, "the image changed")
    nbdtest.require_same(nbdtest.read_whole(s.c2, 64 * MIB), bytes(s.model), "b after the refused grow")


def shrink(s):
    d = s.d
    p = nbdtest.nbdcachectl(d, "resize", NAME, "48M")
    require(p.returncode == 0 and "67108864 -> 50331648" in p.stdout,
            "resize b 48M: %d %r %r" % (p.returncode, p.stdout, p.stderr))
    expect(size_of(d) == 48 * MIB, "new connection after resize 48M: %d" % size_of(d))
    expect(device_size(s.dev) == 64 * MIB, "the device was cut: %d" % device_size(s.dev))
    expect(os.path.getsize(s.img) == 64 * MIB, "the image was cut: %d"
           % os.path.getsize(s.img))
    s.device_holds_model("after resize 48M (its bytes past 48 MiB stay)")
    # c2 negotiated 64 MiB: past the new end the server refuses.
    err = nbdtest.read_errno(s.c2, 4096, 56 * MIB)
    expect(err == errno.ENOSPC, "c2's READ past the new end: errno %d" % err)
    h = connect(d)
    nbdtest.require_same(nbdtest.read_whole(h, 48 * MIB), bytes(s.model[:48 * MIB]), "b after 48M")
    # Dirty data past a new, smaller end.
    data = s.rng.randbytes(MIB)
    h.pwrite(data, 44 * MIB)
    s.model[44 * MIB:45 * MIB] = data
    p = nbdtest.nbdcachectl(d, "resize", NAME, "40M")
    expect(p.returncode == 1 and "1048576 dirty bytes past the new end" in p.stderr,
           "resize b 40M over dirty data: %d %r" % (p.returncode, p.stderr))
    rep = nbdtest.control_request(d.control, {"command": "resize", "export": NAME,
                                              "size": "40M"})
    expect(not rep["ok"] and rep.get("errno") == "EBUSY", "control reply: %r" % rep)
    expect(size_of(d) == 48 * MIB, "a refused shrink changed the size: %d" % size_of(d))
    expect(h.pread(MIB, 44 * MIB) == data, "the dirty megabyte after the refused shrink")
    h.flush()
    s.device_holds_model("after FLUSH of the dirty megabyte")
    p = nbdtest.nbdcachectl(d, "resize", NAME, "40M")
    require(p.returncode == 0 and "50331648 -> 41943040" in p.stdout,
            "resize b 40M after FLUSH: %d %r %r" % (p.returncode, p.stdout, p.stderr))
    expect(size_of(d) == 40 * MIB, "new connection after resize 40M: %d" % size_of(d))
    expect(device_size(s.dev) == 64 * MIB, "the device was cut: %d" % device_size(s.dev))
    err = nbdtest.read_errno(h, 4096, 44 * MIB)
    expect(err == errno.ENOSPC, "READ past 40 MiB on a 48 MiB connection: errno %d" % err)
    nbdtest.require_same(nbdtest.read_whole(h, 40 * MIB), bytes(s.model[:40 * MIB]), "b after 40M")
    s.device_holds_model("after resize 40M")
    h.shutdown()


def reload(s):
    d = s.d
    # The explicit 40M holds across a reload while the device has more
    # (a block device is not cut: without the pin a reload of anything
    # would hand clients the tail the administrator cut off).
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and not rep.get("resized"), "reload, device unchanged: %r" % rep)
    expect(size_of(d) == 40 * MIB, "the explicit 40M after a reload: %d" % size_of(d))
    grow_device(s.img, s.dev, 80 * MIB)
    s.model.extend(bytes(16 * MIB))
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and not rep.get("resized"), "reload, device grown: %r" % rep)
    expect(size_of(d) == 40 * MIB, "the explicit 40M after the device grew: %d" % size_of(d))
    # A resize without a size follows the device again.
    p = nbdtest.nbdcachectl(d, "resize", NAME)
    require(p.returncode == 0 and "41943040 -> 83886080" in p.stdout,
            "resize b: %d %r %r" % (p.returncode, p.stdout, p.stderr))
    h = connect(d)
    require(h.get_size() == 80 * MIB, "new connection after resize: %d" % h.get_size())
    # Past 40 MiB: what the device holds (the cache dropped its blocks
    # there at the shrinks), zeros past 64 MiB.
    nbdtest.require_same(nbdtest.read_whole(h, 80 * MIB), bytes(s.model), "b after resize")
    write_random(h, s.model, s.rng, 64 * MIB, 80 * MIB, 100)
    nbdtest.require_same(h.pread(16 * MIB, 64 * MIB), bytes(s.model[64 * MIB:]),
                         "b past 64 MiB", base=64 * MIB)
    h.flush()
    s.device_holds_model("after the new part's writes")
    h.shutdown()
    # Following again: the next growth comes with a reload.
    grow_device(s.img, s.dev, 96 * MIB)
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and rep.get("resized") == [NAME], "reload after unpinning: %r" % rep)
    expect(size_of(d) == 96 * MIB, "after the reload: %d" % size_of(d))


def main():
    with nbdtest.tempdir() as tmp:
        img = os.path.join(tmp, "b.img")
        nbdtest.random_file(img, 32 * MIB, seed=23)
        dev = attach(img)
        try:
            extra = ["--cache-size", "256M", "--cache-mode", "writeback", "--dirty-expire",
                     "3600", "--dirty-high", "90", "--dirty-low", "80"]
            with nbdtest.running_daemon([(NAME, dev, "")], extra=extra) as d:
                s = State(d, img, dev)
                for name, fn in (("grow", grow), ("too_big", too_big), ("shrink", shrink),
                                 ("reload", reload)):
                    if not CHECKS.run(name, fn, s):
                        break  # each step starts where the one before left off
                for h in (s.c1, s.c2):
                    if h is not None:
                        CHECKS.run("shutdown", h.shutdown, header=False)
                expect(d.alive(), "nbdcached died")
                CHECKS.dump_log(d)
        except nbdtest.Failed as e:
            CHECKS.add(str(e))
        finally:
            p = run(["losetup", "-d", dev])
            expect(p.returncode == 0, "losetup -d %s: %s" % (dev, p.stderr.strip()))
    CHECKS.finish("resize_blockdev")


if __name__ == "__main__":
    main()
