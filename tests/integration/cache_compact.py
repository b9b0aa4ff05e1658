#!/usr/bin/python3
"""cache_compact: defragmentation (daemon/cache/compact.c) under load.

The compactor runs all the time here (--compact-interval-ms 2
--compact-threshold 0) over a tiny arena, so entries move and ranges
collapse while requests are in flight.

  concurrency  8 MiB cache, 6 connections on 6 threads, each owning 2 MiB
        device ranges interleaved with the others' (so the entries of all of
        them share the arena and the shards): random reads and writes of
        512 bytes to 256 KiB, sequential scans of a whole range in 128 KiB
        reads (2 MiB readahead entries, nudges when they cannot be had),
        full-range writes of many small pieces (ranges that collapse),
        FLUSH now and then. Every byte read equals the model; after
        SIGTERM the backend file does too; compact_moves and
        compact_collapses moved (so the test really ran against moves).
  pinned-send  a 4 MiB read served from ~1024 small cached entries, whose
        reply the client does not read for 1.5 s: the daemon's send stalls
        with those entries pinned, while another connection churns the
        arena. compact_skipped_pinned must grow, and the reply, read at
        last, must hold the right bytes (a moved or freed entry would send
        another entry's data).
  pinned-fill  two exports share one 8 MiB cache: one behind nbdkit's
        delay filter (reads take 1.5 s), one a fast file. 64 reads of
        scattered 4 KiB blocks of the slow one are in flight (their entries
        pinned while the backend fills them) while a connection to the fast
        one churns the arena. compact_moves and compact_skipped_pinned must
        grow meanwhile; every slow read returns the backend's bytes (a fill
        landing in a moved entry's old place would leave the new one
        holding other data).

  readahead    a backend (nbdkit sh) whose reads fail with EIO over
        [3 MiB, 4 MiB) of an 8 MiB export. A read continuing the previous
        one gets a 2 MiB entry read whole: at 6 MiB it costs one backend
        read of 2 MiB and the next 4 KiB is a hit; at 2 MiB the read ahead
        runs into the bad range, and the read must still succeed (the
        error is not its own); a read inside the bad range fails with EIO.

Seeds are fixed (printed); CACHE_COMPACT_SEED changes the base seed,
CACHE_COMPACT_SECONDS the concurrency run's length (default 20).
"""

import errno
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, read_at, require, require_same  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SEED = int(os.environ.get("CACHE_COMPACT_SEED", "20261203"))
SECONDS = float(os.environ.get("CACHE_COMPACT_SECONDS", "20"))
BUSY = ["--compact", "on", "--compact-interval-ms", "2", "--compact-threshold", "0"]
STAT_KEYS = nbdtest.CACHE_STATS_KEYS + ("compact_moves", "compact_collapses",
                                        "compact_skipped_pinned", "compact_passes",
                                        "fragmentation", "large_bytes")

CONNS = 6
RANGES_EACH = 3            # 2 MiB ranges per connection
CONC_CACHE = "16M"


def churn_ops(r, h, base, size, model, lock, stop):
    """Random writes and reads on [base, base+size) of handle h until stop
    is set; model updated under lock (only this thread writes there)."""
    while not stop.is_set():
        off = base + r.randrange(size // 512) * 512
        ln = min(r.choice((512, 4 * KIB, 16 * KIB, 64 * KIB)), base + size - off)
        if r.random() < 0.6:
            data = r.randbytes(ln)
            h.pwrite(data, off)
            with lock:
                model[off:off + ln] = data
        else:
            got = h.pread(ln, off)
            with lock:
                want = bytes(model[off:off + ln])
            require_same(got, want, "churn read [%d,+%d)" % (off, ln), base=off)


def concurrency(tmp):
    ranges = CONNS * RANGES_EACH
    size = ranges * 2 * MIB
    r0 = random.Random(SEED)
    path = os.path.join(tmp, "conc.img")
    model = bytearray(r0.randbytes(size))
    with open(path, "wb") as f:
        f.write(model)
    extra = ["--cache-size", CONC_CACHE, "--dirty-expire", "1"] + BUSY
    errors = []
    counts = [0] * CONNS
    with nbdtest.Daemon([("disk", path, "")], threads=2, extra=extra) as d:
        hs = [nbdtest.libnbd_handle(d.unix_uri("disk")) for _ in range(CONNS)]

        def worker(i):
            r = random.Random(SEED + 100 + i)
            h = hs[i]
            mine = [(k * CONNS + i) * 2 * MIB for k in range(RANGES_EACH)]
            t_end = time.time() + SECONDS
            n = 0
            try:
                while time.time() < t_end:
                    x = r.random()
                    base = r.choice(mine)
                    if x < 0.06:
                        # A sequential scan: readahead asks for 2 MiB entries.
                        for off in range(base, base + 2 * MIB, 128 * KIB):
                            got = h.pread(128 * KIB, off)
                            require_same(got, model[off:off + 128 * KIB],
                                         "conn %d scan read at %d" % (i, off), base=off)
                    elif x < 0.10:
                        # The whole range in 16 KiB writes: small entries
                        # that cover it, for collapse.
                        for off in range(base, base + 2 * MIB, 16 * KIB):
                            data = r.randbytes(16 * KIB)
                            h.pwrite(data, off)
                            model[off:off + 16 * KIB] = data
                    elif x < 0.16:
                        # The whole range in 16 KiB reads, in a random order:
                        # clean small entries that cover it, for collapse.
                        offs = list(range(base, base + 2 * MIB, 16 * KIB))
                        r.shuffle(offs)
                        for off in offs:
                            got = h.pread(16 * KIB, off)
                            require_same(got, model[off:off + 16 * KIB],
                                         "conn %d cover read at %d" % (i, off), base=off)
                    elif x < 0.18:
                        h.flush()
                    else:
                        off = base + r.randrange(4096) * 512
                        ln = min(r.choice((512, 4 * KIB, 12 * KIB, 64 * KIB, 256 * KIB)),
                                 base + 2 * MIB - off)
                        if x < 0.55:
                            data = r.randbytes(ln)
                            h.pwrite(data, off)
                            model[off:off + ln] = data
                        else:
                            got = h.pread(ln, off)
                            require_same(got, model[off:off + ln],
                                         "conn %d read [%d,+%d)" % (i, off, ln), base=off)
                    n += 1
            except (Failed, nbd.Error) as e:
                errors.append("conn %d (seed %d) after %d ops: %s" % (i, SEED + 100 + i, n, e))
            counts[i] = n

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONNS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        require(not errors, "; ".join(errors))
        st = nbdtest.stats(d, keys=STAT_KEYS)
        log("  %d ops; compact_moves=%d compact_collapses=%d compact_skipped_pinned=%d "
            "compact_passes=%d large_bytes=%d evictions=%d"
            % (sum(counts), st["compact_moves"], st["compact_collapses"],
               st["compact_skipped_pinned"], st["compact_passes"], st["large_bytes"],
               st["evictions"]))
        require(st["compact_moves"] > 0, "no entry was moved: the test did not run against "
                "compaction")
        require(st["compact_collapses"] > 0, "no range was collapsed")
        # Everything read back once more, from whatever the cache holds now.
        for off in range(0, size, 1 * MIB):
            require_same(hs[0].pread(MIB, off), model[off:off + MIB],
                         "final read at %d" % off, base=off)
        nbdtest.shutdown_all(hs)
    require_same(read_at(path, 0, size + 1), model, "backend file after SIGTERM")


def pinned_send(tmp):
    size = 40 * MIB
    r = random.Random(SEED + 1)
    path = nbdtest.random_file(os.path.join(tmp, "send.img"), size, seed=SEED + 1)
    model = bytearray(read_at(path, 0, size))
    lock = threading.Lock()
    # The unread reply must stay pinned in the arena (the default
    # --max-pinned-replies, 2 MiB of this cache, would copy it out).
    extra = ["--cache-size", "16M", "--dirty-expire", "1", "--max-pinned-replies", "16M"] + BUSY
    with nbdtest.Daemon([("disk", path, "")], threads=2, extra=extra) as d:
        a = nbdtest.libnbd_handle(d.unix_uri("disk"))
        b = nbdtest.libnbd_handle(d.unix_uri("disk"))
        big = 4 * MIB
        # 4 KiB entries, each allocated next to a filler entry that the
        # churn evicts: the chunks they lie in become sparse, the first the
        # compactor wants to empty. The last block of each 2 MiB range is
        # left out, and the fillers are 8 KiB apart, so that no range is
        # covered (and collapsed) before the big read pins them.
        order = [o for o in range(0, big, 4 * KIB) if (o + 4 * KIB) % (2 * MIB)]
        r.shuffle(order)
        for k, off in enumerate(order):
            a.pread(4 * KIB, off)
            a.pread(4 * KIB, 28 * MIB + k * 8 * KIB)
        before = nbdtest.stats(d, keys=STAT_KEYS)
        # The reply is 4 MiB: far more than a Unix socket buffers, so the
        # send stalls with every entry pinned until the client reads.
        buf = nbd.Buffer(big)
        cookie = a.aio_pread(buf, 0)
        stop = threading.Event()
        err = []

        def churn():
            try:
                churn_ops(random.Random(SEED + 2), b, 8 * MIB, 20 * MIB, model, lock, stop)
            except (Failed, nbd.Error) as e:
                err.append(str(e))
        t = threading.Thread(target=churn)
        t.start()
        time.sleep(1.5)
        mid = nbdtest.stats(d, keys=STAT_KEYS)
        stop.set()
        t.join()
        require(not err, "churn: %s" % "; ".join(err))
        nbdtest.aio_wait([(a, cookie)], 30)
        require_same(buf.to_bytearray(), model[:big], "the stalled 4 MiB reply")
        log("  during the stalled send: compact_skipped_pinned %d -> %d, moves %d -> %d"
            % (before["compact_skipped_pinned"], mid["compact_skipped_pinned"],
               before["compact_moves"], mid["compact_moves"]))
        require(mid["compact_skipped_pinned"] > before["compact_skipped_pinned"],
                "the compactor never met the pinned entries: the window was not exercised")
        require_same(a.pread(big, 0), model[:big], "the 4 MiB read again")
        nbdtest.shutdown_all([a, b])


def pinned_fill(tmp):
    size = 32 * MIB
    path = nbdtest.random_file(os.path.join(tmp, "fill.img"), size, seed=SEED + 3)
    slow_model = read_at(path, 0, size)
    fast = nbdtest.random_file(os.path.join(tmp, "fast.img"), size, seed=SEED + 4)
    model = bytearray(read_at(fast, 0, size))
    lock = threading.Lock()
    backend = "nbdkit:--filter=delay file %s rdelay=1500ms" % path
    # Replies stay zero-copy here (--max-pinned-replies: the whole cache;
    # the default, 1 MiB of this cache, copies the churn's replies out and
    # unpins at once, which leaves the arena too tidy to need moves).
    extra = ["--cache-size", "8M", "--dirty-expire", "1", "--max-pinned-replies", "8M"] + BUSY
    # Two exports, one cache: the fast one churns the arena while the slow
    # one's fills are in flight.
    with nbdtest.Daemon([("slow", backend, ""), ("fast", fast, "")], threads=2,
                        extra=extra) as d:
        a = nbdtest.libnbd_handle(d.unix_uri("slow"))
        b = nbdtest.libnbd_handle(d.unix_uri("fast"))
        r = random.Random(SEED + 4)
        for off in range(0, 8 * MIB, 64 * KIB):
            b.pread(64 * KIB, off)
        # Whether the churn fragments the arena enough to need moves while
        # the fills are held depends on timing: up to 3 rounds of held
        # fills, until the compactor has both moved and met a pinned entry
        # (the bytes are checked in every round), counted over the rounds.
        first = None
        for attempt in range(3):
            before = nbdtest.stats(d, keys=STAT_KEYS)
            first = first or before
            offs = sorted(r.sample(range(0, 8 * MIB, 4 * KIB), 64))
            bufs = [nbd.Buffer(4 * KIB) for _ in offs]
            pending = [(a, a.aio_pread(bf, off)) for bf, off in zip(bufs, offs)]
            stop = threading.Event()
            err = []

            def churn():
                try:
                    churn_ops(random.Random(SEED + 5 + attempt), b, 0, 24 * MIB, model, lock,
                              stop)
                except (Failed, nbd.Error) as e:
                    err.append(str(e))
            t = threading.Thread(target=churn)
            t.start()
            try:
                nbdtest.aio_wait(pending, 60)
                mid = nbdtest.stats(d, keys=STAT_KEYS)
            finally:
                stop.set()
                t.join()
            require(not err, "churn: %s" % "; ".join(err))
            for bf, off in zip(bufs, offs):
                require_same(bf.to_bytearray(), slow_model[off:off + 4 * KIB],
                             "slow read at %d" % off, base=off)
            log("  during the slow fills (round %d): passes %d -> %d, moves %d -> %d, "
                "pinned skips %d -> %d"
                % (attempt + 1, before["compact_passes"], mid["compact_passes"],
                   before["compact_moves"], mid["compact_moves"],
                   before["compact_skipped_pinned"], mid["compact_skipped_pinned"]))
            if (mid["compact_moves"] > first["compact_moves"] and
                    mid["compact_skipped_pinned"] > first["compact_skipped_pinned"]):
                break
        require(mid["compact_moves"] > first["compact_moves"],
                "the compactor moved nothing during the slow fills (3 rounds)")
        require(mid["compact_skipped_pinned"] > first["compact_skipped_pinned"],
                "the compactor never met a pinned entry during the slow fills (3 rounds)")
        nbdtest.shutdown_all([a, b])


BAD_BACKEND = r'''#!/bin/sh
case "$1" in
get_size) echo 8388608 ;;
pread)
    if [ "$4" -lt 4194304 ] && [ $(($4 + $3)) -gt 3145728 ]; then
        echo "EIO bad range" >&2
        exit 1
    fi
    head -c "$3" /dev/zero ;;
*) exit 2 ;;
esac
'''


def readahead(tmp):
    script = os.path.join(tmp, "bad.sh")
    with open(script, "w") as f:
        f.write(BAD_BACKEND)
    os.chmod(script, 0o755)
    keys = STAT_KEYS + ("backend_read_bytes",)
    with nbdtest.Daemon([("disk", "nbdkit:sh " + script, "readonly")], threads=1,
                        extra=["--cache-size", "16M"]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        zero = bytes(4 * KIB)
        require_same(h.pread(4 * KIB, 6 * MIB - 4 * KIB), zero, "read at 6 MiB - 4 KiB")
        before = nbdtest.stats(d, keys=keys)
        require_same(h.pread(4 * KIB, 6 * MIB), zero, "sequential read at 6 MiB")
        mid = nbdtest.stats(d, keys=keys)
        require_same(h.pread(4 * KIB, 6 * MIB + 4 * KIB), zero, "sequential read at 6 MiB + 4K")
        after = nbdtest.stats(d, keys=keys)
        log("  read ahead: %d backend reads, %d bytes; then %d more reads"
            % (mid["backend_reads"] - before["backend_reads"],
               mid["backend_read_bytes"] - before["backend_read_bytes"],
               after["backend_reads"] - mid["backend_reads"]))
        require(mid["backend_reads"] - before["backend_reads"] == 1 and
                mid["backend_read_bytes"] - before["backend_read_bytes"] == 2 * MIB,
                "a sequential 4 KiB read at 6 MiB did not read its 2 MiB entry in one request")
        require(after["backend_reads"] == mid["backend_reads"],
                "the next sequential read was not a hit")
        require(mid["large_bytes"] >= 2 * MIB, "no 2 MiB entry was made")
        require_same(h.pread(4 * KIB, 2 * MIB - 4 * KIB), zero, "read at 2 MiB - 4 KiB")
        require_same(h.pread(4 * KIB, 2 * MIB), zero,
                     "sequential read at 2 MiB, whose read ahead hits the bad range")
        nbdtest.expect_nbd_error(lambda: h.pread(4 * KIB, 3 * MIB), errno.EIO,
                                 "read inside the bad range")
        h.shutdown()


def main():
    checks = nbdtest.Checks(catch=(Failed, nbd.Error))
    log("seed %d" % SEED)
    with nbdtest.tempdir(prefix="cache-compact-") as tmp:
        checks.run("concurrency", concurrency, tmp)
        checks.run("pinned-send", pinned_send, tmp)
        checks.run("pinned-fill", pinned_fill, tmp)
        checks.run("readahead", readahead, tmp)
    checks.finish("cache compaction")


if __name__ == "__main__":
    main()
