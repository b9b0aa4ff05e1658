#!/usr/bin/python3
"""A block device backend: a loop device over a file, served by nbdcached.

Checks what a user of a real disk relies on: the size comes from the device
(BLKGETSIZE64), reads and writes land on the device, FUA and FLUSH reach it,
TRIM succeeds, WRITE_ZEROES (with and without NO_HOLE) reads back zero and
leaves the neighbours alone, FAST_ZERO either zeroes or fails with ENOTSUP
without touching the data, block status describes the whole range, and a
read-only export of the device refuses writes with EPERM. After the daemon
stops, the loop device's backing file holds exactly the model's bytes.

Skips (77) only when the kernel has no loop devices.
"""

import errno
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402

import nbd  # noqa: E402

SIZE = 256 << 20
MIB = 1 << 20


def losetup(path):
    p = subprocess.run(["losetup", "-f", "--show", path], capture_output=True, text=True)
    if p.returncode != 0:
        nbdtest.skip("no loop device available: " + p.stderr.strip())
    return p.stdout.strip()


def main():
    checks = nbdtest.Checks()
    rnd = random.Random(7)
    with nbdtest.tempdir() as tmp:
        backing = os.path.join(tmp, "backing.img")
        nbdtest.sparse_file(backing, SIZE)
        dev = losetup(backing)
        model = bytearray(SIZE)
        try:
            with nbdtest.Daemon([("blk", dev, ""), ("ro", dev, "readonly")]) as d:
                h = nbd.NBD()
                h.set_strict_mode(0)
                h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
                h.connect_uri(d.unix_uri("blk"))
                checks.expect(h.get_size() == SIZE,
                              "size %d, expected %d (BLKGETSIZE64)" % (h.get_size(), SIZE))

                # Writes at assorted offsets and sizes, one with FUA.
                for i in range(40):
                    n = rnd.choice([512, 4096, 65536, MIB, 3 * MIB + 512])
                    off = rnd.randrange(0, SIZE - n) // 512 * 512
                    data = rnd.randbytes(n)
                    h.pwrite(data, off, nbd.CMD_FLAG_FUA if i % 7 == 0 else 0)
                    model[off:off + n] = data
                for _ in range(20):
                    n = rnd.choice([4096, MIB])
                    off = rnd.randrange(0, SIZE - n) // 512 * 512
                    checks.expect(h.pread(n, off) == bytes(model[off:off + n]),
                                  "read of %d at %d differs from what was written" % (n, off))
                h.flush()

                # WRITE_ZEROES, with and without NO_HOLE: zero there, neighbours intact.
                for flags in (0, nbd.CMD_FLAG_NO_HOLE, nbd.CMD_FLAG_FUA):
                    off = rnd.randrange(MIB, SIZE - 4 * MIB) // 4096 * 4096
                    h.zero(2 * MIB, off, flags)
                    model[off:off + 2 * MIB] = bytes(2 * MIB)
                    got = h.pread(4 * MIB, off - MIB)
                    checks.expect(got == bytes(model[off - MIB:off + 3 * MIB]),
                                  "WRITE_ZEROES flags %#x at %d: wrong bytes" % (flags, off))

                # FAST_ZERO: zeroes quickly or refuses with ENOTSUP, changing nothing.
                off = 8 * MIB
                before = h.pread(MIB, off)
                try:
                    h.zero(MIB, off, nbd.CMD_FLAG_FAST_ZERO)
                    model[off:off + MIB] = bytes(MIB)
                    checks.expect(h.pread(MIB, off) == bytes(MIB), "FAST_ZERO succeeded, not zero")
                except nbd.Error as e:
                    checks.expect(e.errnum == errno.ENOTSUP,
                                  "FAST_ZERO failed with %s, expected ENOTSUP" % e)
                    checks.expect(h.pread(MIB, off) == before, "failed FAST_ZERO changed data")

                # TRIM is advisory: it must succeed; the range is then unspecified.
                off = 16 * MIB
                h.trim(MIB, off)
                model[off:off + MIB] = h.pread(MIB, off)

                # Block status covers the requested range with valid extents.
                seen = []
                h.block_status(SIZE, 0, lambda ctx, o, ents, err: seen.extend(ents))
                total = sum(seen[0::2])
                checks.expect(total >= 1 and all(f & ~3 == 0 for f in seen[1::2]),
                              "block status extents %r" % seen[:8])

                # Many requests in flight.
                bufs = []
                for i in range(64):
                    off = (i * 3 * MIB + 4096) % (SIZE - 65536)
                    data = rnd.randbytes(65536)
                    model[off:off + 65536] = data
                    bufs.append(h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), off))
                while h.aio_in_flight() > 0:
                    h.poll(-1)
                h.flush()
                h.shutdown()

                ro = nbd.NBD()
                ro.set_strict_mode(0)
                ro.connect_uri(d.unix_uri("ro"))
                checks.expect(ro.is_read_only(), "read-only export not flagged read-only")
                for name, call in (("pwrite", lambda: ro.pwrite(b"x" * 512, 0)),
                                   ("trim", lambda: ro.trim(512, 0)),
                                   ("zero", lambda: ro.zero(512, 0))):
                    checks.run("read-only " + name, nbdtest.expect_nbd_error, call,
                               errno.EPERM, "read-only " + name)
                checks.expect(ro.pread(4096, 0) == bytes(model[:4096]), "read-only read differs")
                ro.shutdown()
        finally:
            subprocess.run(["losetup", "-d", dev])
        with open(backing, "rb") as f:
            disk = f.read()
        checks.expect(disk == bytes(model),
                      "backing file differs from the model at byte %s"
                      % nbdtest.first_diff(disk, bytes(model)))
    checks.finish("block-device")


if __name__ == "__main__":
    main()
