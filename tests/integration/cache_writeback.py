#!/usr/bin/python3
# tests/run: alone (asserts times or rates that a test beside it would disturb)
"""cache_writeback: when and how dirty data reaches the backend.

  coalesce   256 sequential 4 KiB writes (256 cache entries), FLUSH: the
             backend gets them in one write, not 256
  expire     --dirty-expire 3: unflushed data is not on the backend right
             after its WRITE, and is there within 10 s, without FLUSH
  watermark  cache 8 MiB, --dirty-high 50 --dirty-low 25: 6 MiB written
             without FLUSH; the writeback thread brings dirty data down to
             at most 25% of the cache, and what it wrote is on the backend
  no-read    a full-block write of an uncached block reads nothing from the
             backend; a partial one reads exactly one block first
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


def daemon(tmp, extra):
    path = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(path, 64 * MIB)
    return path, nbdtest.Daemon([("disk", path, "")], workdir=tmp, extra=extra)


def wait_for(cond, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def check_coalesce(tmp):
    path, d = daemon(tmp, ["--cache-size", "16M", "--dirty-expire", "3600"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        data = os.urandom(MIB)
        for i in range(256):
            h.pwrite(data[i * 4 * KIB:(i + 1) * 4 * KIB], 8 * MIB + i * 4 * KIB)
        before = nbdtest.stats(d)
        expect(before["entries"] >= 256, "entries %d after 256 writes" % before["entries"])
        h.flush()
        after = nbdtest.stats(d)
        writes = after["backend_writes"] - before["backend_writes"]
        expect(writes == 1, "FLUSH of 256 adjacent 4 KiB entries took %d backend writes"
               % writes)
        expect(read_at(path, 8 * MIB, MIB) == data, "backend after FLUSH")
        h.shutdown()


def check_expire(tmp):
    # 3 s: the look right after the WRITE (not written back yet) must come
    # before the expiry, also on a machine busy enough to pause this
    # process for a second.
    path, d = daemon(tmp, ["--cache-size", "16M", "--dirty-expire", "3"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        data = os.urandom(256 * KIB)
        h.pwrite(data, 4 * MIB)
        expect(read_at(path, 4 * MIB, len(data)) != data, "written back at once?")
        ok = wait_for(lambda: read_at(path, 4 * MIB, len(data)) == data, 10)
        expect(ok, "data dirty for 10 s with --dirty-expire 3 is not on the backend")
        # The file has the data a moment before the write's completion is
        # counted: give the counter the same few seconds.
        expect(wait_for(lambda: nbdtest.stats(d)["dirty_bytes"] == 0, 5),
               "dirty bytes left after expiry")
        h.shutdown()


def check_watermark(tmp):
    path, d = daemon(tmp, ["--cache-size", "8M", "--dirty-high", "50", "--dirty-low", "25",
                           "--dirty-expire", "3600"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        data = os.urandom(6 * MIB)
        for i in range(6):
            h.pwrite(data[i * MIB:(i + 1) * MIB], 16 * MIB + i * MIB)
        ok = wait_for(lambda: nbdtest.stats(d)["dirty_bytes"] <= 2 * MIB, 5)
        st = nbdtest.stats(d)
        expect(ok, "dirty bytes %d, above --dirty-low (2 MiB) 5 s after passing "
               "--dirty-high" % st["dirty_bytes"])
        expect(st["backend_write_bytes"] >= 4 * MIB,
               "only %d bytes written back" % st["backend_write_bytes"])
        expect(h.pread(len(data), 16 * MIB) == data, "read back")
        h.flush()
        expect(read_at(path, 16 * MIB, len(data)) == data, "backend after FLUSH")
        h.shutdown()


def check_no_read(tmp):
    path, d = daemon(tmp, ["--cache-size", "16M", "--dirty-expire", "3600"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        s0 = nbdtest.stats(d)
        h.pwrite(os.urandom(4 * KIB), 32 * MIB)
        s1 = nbdtest.stats(d)
        expect(s1["backend_reads"] == s0["backend_reads"],
               "a full 4 KiB block write read %d times from the backend"
               % (s1["backend_reads"] - s0["backend_reads"]))
        h.pwrite(b"x" * 100, 40 * MIB + 1000)
        s2 = nbdtest.stats(d)
        expect(s2["backend_reads"] - s1["backend_reads"] == 1 and
               s2["backend_read_bytes"] - s1["backend_read_bytes"] == 4 * KIB,
               "a 100-byte write read %d requests, %d bytes (want 1, 4096)"
               % (s2["backend_reads"] - s1["backend_reads"],
                  s2["backend_read_bytes"] - s1["backend_read_bytes"]))
        h.shutdown()


def main():
    checks = nbdtest.Checks()
    for name, fn in (("coalesce", check_coalesce), ("expire", check_expire),
                     ("watermark", check_watermark), ("no-read", check_no_read)):
        with nbdtest.tempdir() as tmp:
            checks.run(name, fn, tmp)
    checks.finish("cache writeback")


if __name__ == "__main__":
    main()
