#!/usr/bin/python3
"""writeback_direct: writeback in large O_DIRECT writes, and the write throttle.

  ext4       a file on the disk (the test's temporary directory; skipped
             unless that file system takes O_DIRECT): a model-checked mix of
             runs of 4 KiB writes across many cache entries (one vectored
             backend write each), 1 MiB writes, unaligned writes and the
             unaligned tail of an export whose size is not a multiple of
             4096; after FLUSH the file matches the model byte for byte,
             the aligned data written back never went through the page
             cache (mincore: not resident), and reading back through the
             daemon after drop-clean (the backend read with buffered I/O
             after direct writes) matches too
  evict      the same on a cache smaller than the data (entries written
             back and evicted while the writer goes on), read back through
             the daemon
  tmpfs      the same mix on a file in /dev/shm: no O_DIRECT there (the log
             says so once), writes buffered, bytes exact
  throttle   a writer (1 MiB writes, 8 in flight) faster than a backend
             slowed by faultfs (every FUSE operation sleeps 50 ms): dirty
             data stays near --dirty-high (never above it by more than what
             the writer has in flight and one group), no write goes around
             the cache (direct_writes stays 0: it waited instead), writes
             did wait (throttled_writes), none fails, no gap between two
             completed writes is longer than STALL_MAX (10 x the
             throttle's patience), and the writer goes at a quarter of the
             backend's pace at least (a FLUSH of 12 MiB before it, timed: a
             ratio in the same run); the file matches after FLUSH
  throttle-fail  the same writer when writeback starts failing (faultfs
             fail-write) while writes are throttled: no write waits for
             ever (the failing export is not throttled), and once the
             backend works again FLUSH succeeds and every acknowledged write
             is in the file
"""

import ctypes
import mmap
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import faults  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import log, read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 48 * MIB + 1536  # not a multiple of 4096: the last block is partial

# The longest a throttled writer may wait between two completed writes.
# The backend below (FUSE requests of at most 128 KiB, each sleeping
# 200 ms, many at a time) takes 25-35 MB/s here. With --dirty-high at
# 16 MiB at most 16 MiB is dirty or being written, in groups of at most
# 8 MiB (plus one entry), which background writeback keeps few in flight
# so they complete one after another: a waiting write is let in when the
# next group completes, a fraction of a second at that rate (0.2-1.0 s
# measured, 1 MiB written per 30-40 ms on average), or, when none has
# completed for the throttle's patience (THROTTLE_PATIENCE_NS, 2 s,
# throttle.c), at once. So the code bounds a wait by the patience; the
# test allows 10 x that, which a busy machine does not reach, and a
# writer held for ever (waiters never woken, no patience) still fails.
# Without the throttle (the code before it) this bound held too, but the
# writer filled the cache and wrote around it: direct_writes == 0 and
# throttled_writes > 0 are what fail there; a writer held back more than
# writeback needs fails the average of the dirty bytes.
THROTTLE_PATIENCE = 2.0
STALL_MAX = 10 * THROTTLE_PATIENCE
# What the throttle check writes and FLUSHes first, timed: the backend's
# pace in the same run (under --dirty-high, 16 MiB: not throttled).
BASELINE = 12 * MIB


def write_mix(h, model, rnd):
    """The writes of the ext4 / tmpfs / evict checks, into model too."""
    def put(off, data):
        h.pwrite(data, off)
        model[off:off + len(data)] = data
    # Runs of 4 KiB writes: 4 KiB entries next to each other, written back
    # as one run across entries (the vectored write).
    for base in (1 * MIB, 5 * MIB + 64 * KIB, 17 * MIB):
        for i in range(256):
            put(base + i * 4 * KIB, rnd.randbytes(4 * KIB))
    # Large aligned writes.
    for i in range(8):
        put(24 * MIB + i * MIB, rnd.randbytes(MIB))
    # Unaligned writes: partial blocks, filled from the backend first.
    for off, n in ((1000, 5000), (3 * MIB + 123, 70000), (33 * MIB - 7, 14),
                   (40 * MIB + 4095, 4097)):
        put(off, rnd.randbytes(n))
    # The tail: the last, partial 4 KiB block of the export, and a run
    # that ends in it.
    put(SIZE - 10 * KIB, rnd.randbytes(10 * KIB))
    put(SIZE - 3 * MIB, rnd.randbytes(2 * MIB))


def resident_pages(path, offset, length):
    """Pages of [offset, offset+length) of the file in the page cache
    (mincore over a shared mapping, which reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        expect(addr is not None and addr != ctypes.c_void_p(-1).value,
               "mmap failed: errno %d" % ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
            rc = libc.mincore(addr, length, vec)
            expect(rc == 0, "mincore failed: errno %d" % ctypes.get_errno())
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, length)
    finally:
        os.close(fd)


def read_all(h, size):
    """The export through the daemon, in reads of at most 4 MiB."""
    return b"".join(h.pread(min(4 * MIB, size - off), off) for off in range(0, size, 4 * MIB))


def drop_and_read(d, h, model, what):
    rep = nbdtest.control_request(d.control, {"command": "drop-clean", "export": "disk"})
    expect(rep.get("ok"), "drop-clean: %s" % rep)
    nbdtest.require_same(read_all(h, SIZE), bytes(model), what)


def check_file(tmp, path, direct, cache="64M"):
    with open(path, "wb") as f:
        f.truncate(SIZE)
    model = bytearray(SIZE)
    d = nbdtest.Daemon([("disk", path, "")], workdir=tmp,
                       extra=["--cache-size", cache, "--dirty-expire", "3600",
                              "--log-level", "debug"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        write_mix(h, model, random.Random(7))
        h.flush()
        st = nbdtest.stats(d)
        expect(st["dirty_bytes"] == 0, "dirty bytes %d after FLUSH" % st["dirty_bytes"])
        logtext = d.log_text()
        if direct:
            expect("aligned writes O_DIRECT" in logtext,
                   "the log does not say writes go O_DIRECT")
            # The 1 MiB writes went around the page cache (read the file
            # only after this).
            n = resident_pages(path, 24 * MIB, 8 * MIB)
            expect(n == 0, "%d pages of 8 MiB written back O_DIRECT are in the page cache" % n)
        else:
            expect(logtext.count("no O_DIRECT") == 1,
                   "the log does not say once that the file stays buffered")
        nbdtest.require_same(read_at(path, 0, SIZE), bytes(model), "the file after FLUSH")
        drop_and_read(d, h, model, "read back through the daemon after drop-clean")
        h.shutdown()


def odirect_supported(directory):
    p = os.path.join(directory, "probe")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        fd = os.open(p, os.O_RDWR | os.O_DIRECT)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        os.unlink(p)


def check_ext4(tmp):
    if not odirect_supported(tmp):
        log("SKIP ext4: %s does not take O_DIRECT" % tmp)
        return
    check_file(tmp, os.path.join(tmp, "disk.img"), True)


def check_evict(tmp):
    if not odirect_supported(tmp):
        log("SKIP evict: %s does not take O_DIRECT" % tmp)
        return
    path = os.path.join(tmp, "disk.img")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    model = bytearray(SIZE)
    rnd = random.Random(11)
    d = nbdtest.Daemon([("disk", path, "")], workdir=tmp,
                       extra=["--cache-size", "8M", "--dirty-expire", "3600"])
    with d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        for _ in range(3):
            write_mix(h, model, rnd)
        st = nbdtest.stats(d)
        expect(st["evictions"] > 0, "nothing evicted with an 8 MiB cache")
        # Read back through the daemon: mostly misses, read from the file
        # with buffered I/O after the direct writes.
        nbdtest.require_same(read_all(h, SIZE), bytes(model),
                             "read back through the daemon (evicted)")
        h.flush()
        nbdtest.require_same(read_at(path, 0, SIZE), bytes(model), "the file after FLUSH")
        h.shutdown()


def check_tmpfs(tmp):
    shm = nbdtest.shm_dir()
    if not shm:
        log("SKIP tmpfs: no /dev/shm")
        return
    with nbdtest.tempdir(base=shm) as d:
        check_file(tmp, os.path.join(d, "disk.img"), False)


def slow_backend_daemon(tmp, fs, total, cache_size):
    """A daemon over a file of total bytes in fs, 200 ms per backend
    operation: dirty-high 25%, dirty-low 10%, nothing expires."""
    with open(fs.source("disk.img"), "wb") as f:
        f.truncate(total)
    fs.set("delay-ms 200")
    return nbdtest.Daemon([("disk", fs.path("disk.img"), "")], workdir=tmp,
                          extra=["--cache-size", cache_size, "--dirty-high", "25",
                                 "--dirty-low", "10", "--dirty-expire", "3600"])


def check_throttle(tmp):
    total = 192 * MIB
    with faults.FaultFS(tmp) as fs:
        d = slow_backend_daemon(tmp, fs, total, "64M")
        with d:
            high = 16 * MIB
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            rnd = random.Random(3)
            model = bytearray(total)
            samples = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    try:
                        samples.append(nbdtest.stats(d)["dirty_bytes"])
                    except Exception as e:  # noqa: BLE001 (a sample lost is fine)
                        log("stats sample: %s" % e)
                    time.sleep(0.05)
            t = threading.Thread(target=sample, daemon=True)
            t.start()
            done, errors = [], []

            def cb(err, errors=errors, done=done):
                done.append(time.monotonic())
                if err.value:
                    errors.append(err.value)
                return 1
            # The backend's pace in this run: BASELINE written (under the
            # high mark: not throttled) and a FLUSH of it, timed.
            for o in range(0, BASELINE, MIB):
                data = rnd.randbytes(MIB)
                model[o:o + MIB] = data
                h.pwrite(data, o)
            f0 = time.monotonic()
            h.flush()
            backend_rate = BASELINE / (time.monotonic() - f0)
            start = time.monotonic()
            off = 0
            try:
                while off < total or h.aio_in_flight() > 0:
                    while off < total and h.aio_in_flight() < 8:
                        data = rnd.randbytes(MIB)
                        model[off:off + MIB] = data
                        h.aio_pwrite(data, off, completion=cb)
                        off += MIB
                    h.poll(1000)
                    expect(time.monotonic() - start < 300, "writer not done in 300 s")
            finally:
                stop.set()
                t.join()
            elapsed = time.monotonic() - start
            expect(not errors, "write errors: %r" % errors[:5])
            gaps = [b - a for a, b in zip([start] + done, done)]
            worst = max(gaps)
            full = nbdtest.control_request(d.control, {"command": "stats"})["cache"]
            log("throttle: %d MiB in %.1f s (%.1f MB/s); longest gap %.2f s; dirty bytes "
                "max %.1f MiB, mean %.1f MiB over %d samples; throttled_writes %d, "
                "direct_writes %d" % (total // MIB, elapsed, total / elapsed / 1e6, worst,
                                      max(samples) / MIB, sum(samples) / len(samples) / MIB,
                                      len(samples), full.get("throttled_writes", 0),
                                      full["direct_writes"]))
            expect(full.get("throttled_writes", 0) > 0, "no write waited for writeback")
            expect(full["direct_writes"] == 0,
                   "%d writes went around the cache instead of waiting"
                   % full["direct_writes"])
            # Above the mark: at most the writes in flight (8 MiB) and what
            # was admitted together after a completion.
            expect(max(samples) <= high + 16 * MIB,
                   "dirty bytes reached %.1f MiB (--dirty-high: %d MiB)"
                   % (max(samples) / MIB, high // MIB))
            # Near the mark while the writer runs: after the first second
            # (the cache filling up to it), on average at least half of it.
            late = samples[len(samples) // 4:] or samples
            expect(sum(late) / len(late) >= high / 2,
                   "dirty bytes averaged %.1f MiB, far below --dirty-high (%d MiB): "
                   "the writer was held back more than writeback needed"
                   % (sum(late) / len(late) / MIB, high // MIB))
            expect(worst <= STALL_MAX, "a gap of %.2f s between completed writes "
                   "(at most %.1f s: 10 x the throttle's patience)" % (worst, STALL_MAX))
            # The writer goes at the backend's pace, measured in the same
            # run (the FLUSH of BASELINE, above). A writer let in only by
            # the patience, or held for a whole cycle from high to low,
            # goes at a fraction of it.
            writer_rate = total / elapsed
            log("throttle: the writer went at %.1f MB/s, %.0f%% of the backend's %.1f MB/s "
                "(a FLUSH of %d MiB)" % (writer_rate / 1e6, 100 * writer_rate / backend_rate,
                                         backend_rate / 1e6, BASELINE // MIB))
            expect(writer_rate >= backend_rate / 4,
                   "the writer went at %.1f MB/s, under a quarter of the %.1f MB/s the backend "
                   "took a FLUSH at: held back more than writeback needed"
                   % (writer_rate / 1e6, backend_rate / 1e6))
            h.flush()
            fs.set("ok")
            nbdtest.require_same(read_at(fs.source("disk.img"), 0, total), bytes(model),
                                 "the file after FLUSH")
            h.shutdown()


def check_throttle_fail(tmp):
    """Writes throttled at the high watermark when writeback starts failing:
    none waits for ever; each ends (cached, or EIO from a direct write) and,
    once the backend works again, FLUSH makes every acknowledged write
    durable."""
    total = 48 * MIB
    with faults.FaultFS(tmp) as fs:
        d = slow_backend_daemon(tmp, fs, total, "16M")
        with d:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            rnd = random.Random(5)
            data = {}
            failed = set()
            done = []

            def cb(err, off, done=done, failed=failed):
                done.append(time.monotonic())
                if err.value:
                    failed.add(off)
                return 1
            start = time.monotonic()
            off = 0
            while off < total or h.aio_in_flight() > 0:
                while off < total and h.aio_in_flight() < 8:
                    data[off] = rnd.randbytes(MIB)
                    h.aio_pwrite(data[off], off, completion=lambda err, o=off: cb(err, o))
                    off += MIB
                    if off == 8 * MIB:
                        fs.set("fail-write")  # writeback fails from now on
                h.poll(1000)
                expect(time.monotonic() - start < 120, "writes still waiting after 120 s")
            gaps = [b - a for a, b in zip([start] + done, done)]
            log("throttle-fail: %d MiB in %.1f s, %d failed, longest gap %.2f s"
                % (total // MIB, time.monotonic() - start, len(failed), max(gaps)))
            # Waiting on a failing export's writeback would never end; the
            # throttle lets the writes through instead (at most the patience
            # of 2 s, plus direct writes on a backend that sleeps 200 ms:
            # 10 x the patience allowed).
            expect(max(gaps) <= STALL_MAX, "a gap of %.2f s between completed writes (at most "
                   "%g s: 10 x the throttle's patience)" % (max(gaps), STALL_MAX))
            fs.set("ok")
            t_ok = time.monotonic()
            for _ in range(60):
                try:
                    h.flush()
                    break
                except Exception as e:  # noqa: BLE001 (EIO once: direct writes failed)
                    log("flush: %s" % e)
                    if time.monotonic() - t_ok > 60:
                        expect(False, "FLUSH never succeeded in 60 s after the backend "
                               "recovered")
                    time.sleep(1)
            else:
                expect(False, "FLUSH never succeeded after the backend recovered")
            h.flush()
            got = read_at(fs.source("disk.img"), 0, total)
            for o, b in data.items():
                if o not in failed:
                    nbdtest.require_same(got[o:o + MIB], b, "acknowledged write at %d" % o, o)
            h.shutdown()


def main():
    checks = nbdtest.Checks()
    for name, fn in (("ext4", check_ext4), ("evict", check_evict), ("tmpfs", check_tmpfs),
                     ("throttle", check_throttle), ("throttle-fail", check_throttle_fail)):
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue  # writeback_direct.py [CHECK...]: only those
        with nbdtest.tempdir() as tmp:
            checks.run(name, fn, tmp)
    checks.finish("writeback direct")


if __name__ == "__main__":
    main()
