"""bench/durability.py: the flush-scale, sync-writers and slow-readers
scenarios of bench/run (imported by it; run them with
`bench/run --scenario NAME`). See bench/README.md.

flush-scale: FLUSH cost with many scattered dirty blocks in nbdcached's
  cache (writeback mode, nothing written back before the FLUSHes), against
  nbdkit file given the same writes: (a) one FLUSH; (b) 128 FLUSHes at
  once, 8 connections x 16 in flight, each connection's 16 after its own
  16 28-byte writes; (c) 128 (28-byte write, FLUSH) pairs one after
  another on one connection; and BLOCK_STATUS (4 KiB, REQ_ONE) latency
  with no dirty data and with the dirty set elsewhere in the export.

sync-writers: synchronous writers, nbdcached (writeback) against nbdkit
  file: fio 4 KiB random writes at iodepth 1 with a FLUSH after each
  (fsync=1), and at iodepth 32 with a FLUSH after every 32 (fsync=32).

slow-readers: a well-behaved fio client (4 KiB random reads, iodepth 8) on
  a warm cache, alone and while 32 other connections each send four 32 MiB
  READs and never read a byte of the replies: its IOPS, its export's hit
  ratio, the daemon's RSS and how many of the slow connections are still
  open. Twice, each with a fresh daemon: "cold", the slow clients on a
  second export (another file, not cached), and "warm", on the same export
  as the well-behaved client (the cached working set).

Every wait is bounded (a FLUSH cell by --flush-timeout, fio by --seconds
+ 120 s, the setup writes by a pass over the file at 1 MiB/s); a cell
that runs out of time prints "timeout after N s" and the scenario goes on
(nbdcached is then stopped with SIGKILL).
"""

import contextlib
import gc
import json
import os
import random
import select
import signal
import socket
import statistics
import struct
import subprocess
import threading
import time

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
BLOCK = 4096

SCENARIOS = ("flush-scale", "sync-writers", "slow-readers")
DEFAULT_SIZE = {"flush-scale": 2 * GiB, "sync-writers": 1 * GiB, "slow-readers": 512 * MiB}

# flush-scale
TINY = 28                  # bytes of each write before a FLUSH in (b) and (c)
FLUSH_CONNS = 8            # (b): connections ...
FLUSH_DEPTH = 16           # ... times FLUSHes in flight on each = 128
SERIAL_PAIRS = 128         # (c)
WRITE_QD = 64              # requests in flight while writing the dirty set
BS_SECONDS = 5.0           # each BLOCK_STATUS cell: at most this long ...
BS_ITERATIONS = 20000      # ... and at most this many requests
BS_OFFSETS = 4096          # distinct offsets each cell cycles through
BS_TARGET = 2.0            # dirty/clean BLOCK_STATUS latency, at most
FLUSH_TARGET = 2.0         # (b)/(a), at most
DIRTY_EXPIRE = "3600"      # nothing expires during the scenario
DIRTY_HIGH, DIRTY_LOW = "95", "90"

# slow-readers
WELL_IODEPTH = 8
SLOW_SETTLE = 2.0          # seconds between the slow clients' requests and the measured run
SLOW_DEADLINE = 30         # the daemon drops a client whose replies make no progress this long
SLOW_TARGET = 0.8          # well-behaved IOPS with / alone, at least


class Timeout(Exception):
    pass


def nbd_module():
    try:
        import nbd
    except ImportError:
        raise SystemExit("bench/run: python3-libnbd is missing (import nbd failed; "
                         "scripts/deps installs it; run bench/run with /usr/bin/python3)")
    return nbd


def fsync_file(path):
    """Write the file's dirty pages out, so that no earlier step's writes are
    left for a measured FLUSH to pay for."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ctl_path(h):
    return os.path.join(os.path.dirname(h.NBDCACHED), "nbdcachectl")


def ctl_stats(h, control):
    """The daemon's `stats` through its control socket (nbdcachectl --json)."""
    p = h.run_bounded([ctl_path(h), "--control", control, "--json", "stats"], 15)
    try:
        reply = json.loads(p.stdout)
    except ValueError:
        raise RuntimeError("nbdcachectl stats: %s" % (p.stderr.strip() or p.stdout.strip()))
    if not reply.get("ok"):
        raise RuntimeError("nbdcachectl stats: %s" % reply.get("error"))
    return reply


def export_stats(reply, name):
    for e in reply.get("exports", []):
        if e.get("name") == name:
            return e
    raise RuntimeError("no export %r in the stats" % name)


def nbdcached_argv(h, args, sock, control, exports, extra=()):
    argv = [h.NBDCACHED, "--foreground", "--unix", sock, "--control", control,
            "--threads", "2", "--log-level", "info",
            "--cache-size", "%dM" % (args.cache_size // MiB), "--cache-mode", "writeback",
            "--hugepages", args.hugepages]
    for name, path in exports:
        argv += ["--export", "%s=%s" % (name, path)]
    return argv + list(extra)


def nbdkit_file_argv(sock, path):
    return ["nbdkit", "--foreground", "--unix", sock, "file", path]


def fmt_s(x):
    return "n/a" if x is None else "%.3f" % x


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


def fmt_ratio(r):
    return "n/a" if r is None else "%.2f" % r


# ---------------------------------------------------------------- libnbd helpers

class Conn:
    """One libnbd connection, every wait bounded by a deadline (monotonic)."""

    def __init__(self, nbd, uri, meta=False):
        self.nbd = nbd
        self.h = nbd.NBD()
        if meta:
            self.h.add_meta_context("base:allocation")
        self.h.connect_uri(uri)
        self.errors = 0

    def wait(self, cond, deadline):
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout()
            self.h.poll(max(1, int(min(left, 1.0) * 1000)))

    def one(self, issue, deadline):
        """issue(completion) one command and wait for it; its errno."""
        st = []

        def done(err):
            st.append(err.value)
            return 1
        issue(done)
        self.wait(lambda: st, deadline)
        return st[0]

    def pwrite(self, buf, off, deadline):
        err = self.one(lambda cb: self.h.aio_pwrite(buf, off, completion=cb), deadline)
        if err:
            raise RuntimeError("write at %d: %s" % (off, os.strerror(err)))

    def flush(self, deadline):
        err = self.one(lambda cb: self.h.aio_flush(completion=cb), deadline)
        if err:
            raise RuntimeError("flush: %s" % os.strerror(err))

    def many_writes(self, buf, offsets, qd, deadline):
        """Write buf at every offset, qd in flight."""
        state = {"done": 0, "err": 0}

        def done(err):
            state["done"] += 1
            if err.value:
                state["err"] = err.value
            return 1
        i = 0
        while state["done"] < len(offsets):
            while i < len(offsets) and i - state["done"] < qd:
                self.h.aio_pwrite(buf, offsets[i], completion=done)
                i += 1
            if time.monotonic() >= deadline:
                raise Timeout()
            self.h.poll(1000)
        if state["err"]:
            raise RuntimeError("a write failed: %s" % os.strerror(state["err"]))

    def close(self):
        """Disconnect (NBD_CMD_DISC when nothing is in flight) and drop the
        handle (libnbd closes the socket when it is freed)."""
        if self.h is None:
            return
        with contextlib.suppress(Exception):
            if self.h.aio_in_flight() == 0:
                self.h.shutdown()
        self.h = None
        gc.collect()


# ---------------------------------------------------------------- flush-scale

def flush_layout(size, n_dirty, seed=1):
    """Where everything goes, in 4 KiB blocks: the dirty set on even blocks
    of the first three quarters (no two adjacent: scattered), the 28-byte
    writes and the 'between' BLOCK_STATUS queries on odd blocks there, the
    'far' queries in the last quarter (no dirty block)."""
    rng = random.Random(seed)
    nblocks = size // BLOCK
    front = nblocks * 3 // 4
    evens = range(0, front, 2)
    if len(evens) < n_dirty:
        raise SystemExit("bench/run: --size too small for %d scattered dirty blocks (needs at "
                         "least %d MiB)" % (n_dirty, n_dirty * 8 * BLOCK * 4 // 3 // MiB + 1))
    dirty = rng.sample(evens, n_dirty)          # written in this (random) order
    odds = rng.sample(range(1, front, 2), 2 * SERIAL_PAIRS + BS_OFFSETS)
    tiny_b = [b * BLOCK + 100 for b in odds[:SERIAL_PAIRS]]
    tiny_c = [b * BLOCK + 100 for b in odds[SERIAL_PAIRS:2 * SERIAL_PAIRS]]
    between = [b * BLOCK for b in odds[2 * SERIAL_PAIRS:]]
    far = [b * BLOCK for b in rng.sample(range(front, nblocks), BS_OFFSETS)]
    return {"dirty": [b * BLOCK for b in dirty], "tiny_b": tiny_b, "tiny_c": tiny_c,
            "between": between, "far": far}


def block_status_cell(nbd, uri, offsets, seconds=BS_SECONDS, iterations=BS_ITERATIONS):
    """Mean, median and p99 latency (us) of 4 KiB REQ_ONE BLOCK_STATUS
    requests, one at a time, cycling through offsets, for at most seconds
    and iterations; and how many were done."""
    c = Conn(nbd, uri, meta=True)
    try:
        if not c.h.can_meta_context("base:allocation"):
            raise RuntimeError("the server did not agree to base:allocation")
        lat = []
        seen = []

        def extent(meta, off, entries, err):
            seen.append(len(entries))
            return 0
        end = time.monotonic() + seconds
        i = 0
        while i < iterations and time.monotonic() < end:
            off = offsets[i % len(offsets)]
            t0 = time.perf_counter()
            err = c.one(lambda cb: c.h.aio_block_status(BLOCK, off, extent, completion=cb,
                                                         flags=nbd.CMD_FLAG_REQ_ONE),
                        time.monotonic() + 30)
            lat.append(time.perf_counter() - t0)
            if err:
                raise RuntimeError("block status at %d: %s" % (off, os.strerror(err)))
            i += 1
        lat.sort()
        return {"mean_us": statistics.fmean(lat) * 1e6, "p50_us": lat[len(lat) // 2] * 1e6,
                "p99_us": lat[min(len(lat) - 1, len(lat) * 99 // 100)] * 1e6, "n": len(lat)}
    finally:
        c.close()


def write_dirty_set(nbd, uri, offsets):
    """The scattered 4 KiB writes, WRITE_QD in flight on one connection;
    seconds taken."""
    buf = nbd.Buffer.from_bytearray(bytearray(os.urandom(BLOCK)))
    c = Conn(nbd, uri)
    try:
        t0 = time.monotonic()
        c.many_writes(buf, offsets, WRITE_QD, t0 + 60 + len(offsets) * BLOCK // (256 * KiB))
        return time.monotonic() - t0
    finally:
        c.close()


def concurrent_flushes(nbd, uri, tiny, timeout):
    """(b): FLUSH_CONNS connections; each writes its share of tiny (one
    28-byte write per offset, all in flight, waits for them), then, all
    connections together once every write is done, sends FLUSH_DEPTH
    FLUSHes at once. Returns (seconds from the first FLUSH sent until the
    last completed, or None on timeout; completion times of the FLUSHes)."""
    conns = [Conn(nbd, uri) for _ in range(FLUSH_CONNS)]
    buf = nbd.Buffer.from_bytearray(bytearray(b"x" * TINY))
    shares = [tiny[i::FLUSH_CONNS] for i in range(FLUSH_CONNS)]
    t0 = [None]
    done_at = []
    failed = []
    lock = threading.Lock()
    barrier = threading.Barrier(FLUSH_CONNS, action=lambda: t0.__setitem__(0, time.monotonic()),
                                timeout=120)

    def worker(c, offs):
        try:
            c.many_writes(buf, offs, len(offs), time.monotonic() + 60)
            barrier.wait()
            pending = [FLUSH_DEPTH]

            def done(err):
                with lock:
                    done_at.append(time.monotonic() - t0[0])
                    if err.value:
                        failed.append(os.strerror(err.value))
                pending[0] -= 1
                return 1
            for _ in range(FLUSH_DEPTH):
                c.h.aio_flush(completion=done)
            c.wait(lambda: pending[0] == 0, t0[0] + timeout)
        except Timeout:
            pass
        except Exception as e:  # noqa: BLE001 - reported, the cell fails
            with lock:
                failed.append(str(e))
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()
    threads = [threading.Thread(target=worker, args=(c, s), daemon=True)
               for c, s in zip(conns, shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 200)
    total = None
    if len(done_at) == FLUSH_CONNS * FLUSH_DEPTH and not failed:
        total = max(done_at)
    return total, sorted(done_at), failed, conns


def serial_pairs(nbd, uri, tiny, timeout):
    """(c): on one connection, SERIAL_PAIRS times: a 28-byte write, wait,
    a FLUSH, wait. (total seconds or None, FLUSH latencies done, error)."""
    c = Conn(nbd, uri)
    buf = nbd.Buffer.from_bytearray(bytearray(b"y" * TINY))
    lat = []
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        for off in tiny:
            c.pwrite(buf, off, deadline)
            t1 = time.monotonic()
            c.flush(deadline)
            lat.append(time.monotonic() - t1)
        return time.monotonic() - t0, lat, None, c
    except Timeout:
        return None, lat, None, c
    except RuntimeError as e:
        return None, lat, str(e), c


def flush_scale_server(name, h, nbd, args, tmp, path, layout, res):
    """The three setups and cells for one server; fills res."""
    sock = os.path.join(tmp, "nbd.sock")
    control = os.path.join(tmp, "control.sock")
    uri = "nbd+unix:///?socket=" + sock
    ours = name == "nbdcached"
    n = len(layout["dirty"])
    if ours:
        argv = nbdcached_argv(h, args, sock, control, [("bench", path)],
                              ["--dirty-expire", DIRTY_EXPIRE, "--dirty-high", DIRTY_HIGH,
                               "--dirty-low", DIRTY_LOW])
    else:
        argv = nbdkit_file_argv(sock, path)
    # SIGKILL: nbdcached must not write back what a timed-out cell left.
    stop = signal.SIGKILL if ours else signal.SIGTERM
    timeout = args.flush_timeout

    def check_dirty(want, label):
        if not ours:
            return
        st = ctl_stats(h, control)["cache"]
        res.setdefault("checks", []).append(
            "%s: dirty_bytes=%d (want %d) backend_writes=%d backend_write_bytes=%d%s"
            % (label, st["dirty_bytes"], want, st["backend_writes"], st["backend_write_bytes"],
               "" if st["dirty_bytes"] == want and st["backend_writes"] == 0
               else "  <-- NOT the intended state"))
        print("  %s" % res["checks"][-1], flush=True)

    def after(label):
        if not ours:
            return
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            st = ctl_stats(h, control)["cache"]
            res.setdefault("after", []).append(
                "%s: dirty_bytes=%d backend_writes=%d backend_write_bytes=%d writeback_bytes=%d"
                % (label, st["dirty_bytes"], st["backend_writes"], st["backend_write_bytes"],
                   st["writeback_bytes"]))

    # Setup 1: block status clean, the dirty set, block status dirty, (a).
    fsync_file(path)
    with h.running_server("%s-a" % name, argv, sock, tmp, stop_signal=stop):
        res["bs_clean_far"] = block_status_cell(nbd, uri, layout["far"])
        res["bs_clean_between"] = block_status_cell(nbd, uri, layout["between"])
        res["write_s"] = write_dirty_set(nbd, uri, layout["dirty"])
        print("  %s: %d scattered 4 KiB writes in %.1fs" % (name, n, res["write_s"]), flush=True)
        check_dirty(n * BLOCK, "before (a)")
        res["bs_dirty_far"] = block_status_cell(nbd, uri, layout["far"])
        res["bs_dirty_between"] = block_status_cell(nbd, uri, layout["between"])
        print("  %s: BLOCK_STATUS mean us: clean far %.1f between %.1f; dirty far %.1f "
              "between %.1f" % (name, res["bs_clean_far"]["mean_us"],
                                res["bs_clean_between"]["mean_us"], res["bs_dirty_far"]["mean_us"],
                                res["bs_dirty_between"]["mean_us"]), flush=True)
        c = Conn(nbd, uri)
        t0 = time.monotonic()
        try:
            c.flush(t0 + timeout)
            res["a"] = time.monotonic() - t0
        except Timeout:
            res["a"] = None
        finally:
            c.close()
        print("  %s: (a) one FLUSH: %s" % (name, fmt_s(res["a"]) + " s" if res["a"] is not None
                                          else "timeout after %d s" % timeout), flush=True)
        after("after (a)")
        if res["a"] is not None:
            # Clean again, the written-back blocks still cached: brackets
            # the dirty cells in time (noise) and separates "dirty" from
            # "many cached entries".
            res["bs_after_far"] = block_status_cell(nbd, uri, layout["far"])
            res["bs_after_between"] = block_status_cell(nbd, uri, layout["between"])

    # Setup 2: the dirty set, then (b).
    fsync_file(path)
    with h.running_server("%s-b" % name, argv, sock, tmp, stop_signal=stop):
        write_dirty_set(nbd, uri, layout["dirty"])
        check_dirty(n * BLOCK, "before (b)")
        total, done_at, failed, conns = concurrent_flushes(nbd, uri, layout["tiny_b"], timeout)
        res["b"], res["b_done"], res["b_failed"] = total, done_at, failed
        print("  %s: (b) %d FLUSHes at once: %s%s" % (
            name, FLUSH_CONNS * FLUSH_DEPTH,
            fmt_s(total) + " s" if total is not None
            else "timeout after %d s (%d done)" % (timeout, len(done_at)),
            "; errors: %s" % "; ".join(sorted(set(failed))[:3]) if failed else ""), flush=True)
        after("after (b)")
        for c in conns:
            c.close()

    # Setup 3: the dirty set, then (c).
    fsync_file(path)
    with h.running_server("%s-c" % name, argv, sock, tmp, stop_signal=stop):
        write_dirty_set(nbd, uri, layout["dirty"])
        check_dirty(n * BLOCK, "before (c)")
        total, lat, err, c = serial_pairs(nbd, uri, layout["tiny_c"], timeout)
        c.close()
        res["c"], res["c_lat"], res["c_err"] = total, lat, err
        print("  %s: (c) %d x (28-byte write, FLUSH) at QD1: %s" % (
            name, SERIAL_PAIRS, fmt_s(total) + " s" if total is not None
            else "%s after %d pairs" % (err or "timeout after %d s" % timeout, len(lat))),
            flush=True)
        after("after (c)")
    fsync_file(path)


def run_flush_scale(args, tmp, h):
    nbd = nbd_module()
    path = os.path.join(tmp, "bench.img")
    n = args.dirty_blocks
    layout = flush_layout(args.size, n)
    print("flush-scale: %d scattered dirty 4 KiB blocks (%.1f MiB) on even blocks of the first "
          "3/4 of a %d MiB file, written by one libnbd connection, %d in flight"
          % (n, n * BLOCK / MiB, args.size // MiB, WRITE_QD))
    print("nbdcached: %s --threads 2 --cache-size %dM --cache-mode writeback --hugepages %s "
          "--dirty-expire %s --dirty-high %s --dirty-low %s | nbdkit file (default threads, "
          "its FLUSH is fdatasync)" % (os.path.relpath(h.NBDCACHED, h.TOP),
                                       args.cache_size // MiB, args.hugepages, DIRTY_EXPIRE,
                                       DIRTY_HIGH, DIRTY_LOW))
    print("(a) one FLUSH after the dirty set | (b) fresh server, the dirty set, then %d "
          "connections each with %d 28-byte writes (done), then %d FLUSHes in flight on each "
          "(%d at once); time from the first FLUSH sent to the last done | (c) fresh server, "
          "the dirty set, then %d x (28-byte write, FLUSH) on one connection, one at a time"
          % (FLUSH_CONNS, FLUSH_DEPTH, FLUSH_DEPTH, FLUSH_CONNS * FLUSH_DEPTH, SERIAL_PAIRS))
    print("BLOCK_STATUS: 4 KiB, REQ_ONE, base:allocation, python libnbd, one at a time (aio + "
          "poll), at most %d requests or %.0f s per cell, at %d offsets: 'far' in the last "
          "quarter (no dirty block there), 'between' on odd blocks among the dirty ones"
          % (BS_ITERATIONS, BS_SECONDS, BS_OFFSETS))
    print("every FLUSH cell bounded by --flush-timeout %d s; the file is fsync()ed before each "
          "server start" % args.flush_timeout, flush=True)
    t0 = time.time()
    h.make_file(path, args.size)
    fsync_file(path)
    print("file written and fsync()ed in %.1fs" % (time.time() - t0), flush=True)
    names = [s for s in ("nbdcached", "nbdkit") if not args.servers or s in args.servers]
    results = {}
    for name in names:
        if name == "nbdkit":
            reason = h.unavailable({"needs": ["nbdkit"]})
            if reason:
                print("nbdkit: n/a (%s)" % reason)
                continue
        print("running %s ..." % name, flush=True)
        res = results[name] = {}
        try:
            flush_scale_server(name, h, nbd, args, tmp, path, layout, res)
        except (RuntimeError, subprocess.TimeoutExpired, Timeout, nbd.Error) as e:
            print("  %s: FAILED: %s" % (name, e), flush=True)
    print_flush_scale(results, names, args)


def print_flush_scale(results, names, args):
    print()
    cols = names + (["nbdcached/nbdkit"] if len(names) == 2 else [])
    print("%-52s %s" % ("FLUSH-SCALE", " ".join("%16s" % c for c in cols)))
    to = "timeout>%ds" % args.flush_timeout

    def val(name, key, fmt="%.3f", timeout_text=to):
        r = results.get(name, {})
        if key not in r:
            return None, "FAILED" if name in results else "n/a"
        v = r[key]
        if v is None:
            return None, timeout_text
        return v, fmt % v

    def row(label, key, fmt="%.3f", peer_ratio=True):
        cells, vals = [], []
        for name in names:
            v, text = val(name, key, fmt)
            vals.append(v)
            cells.append(text)
        if len(names) == 2:
            cells.append(fmt_ratio(ratio(vals[0], vals[1])) if peer_ratio else "")
        print("%-52s %s" % (label, " ".join("%16s" % c for c in cells)))

    row("setup: the dirty set written (s)", "write_s", "%.1f")
    row("(a) one FLUSH (s)", "a")
    row("(b) %d concurrent FLUSHes, %dx%d, total (s)" % (FLUSH_CONNS * FLUSH_DEPTH, FLUSH_CONNS,
                                                        FLUSH_DEPTH), "b")
    for label, pick in (("first", lambda d: d[0]), ("median", lambda d: d[len(d) // 2])):
        cells, vals = [], []
        for name in names:
            d = results.get(name, {}).get("b_done")
            v = pick(d) if d else None
            vals.append(v)
            cells.append("n/a" if v is None else "%.3f" % v)
        if len(names) == 2:
            cells.append(fmt_ratio(ratio(vals[0], vals[1])))
        print("%-52s %s" % ("    (b) %s FLUSH done after (s)" % label,
                            " ".join("%16s" % c for c in cells)))
    cells = []
    for name in names:
        d = results.get(name, {}).get("b_done")
        cells.append("%d/%d" % (len(d) if d else 0, FLUSH_CONNS * FLUSH_DEPTH))
    print("%-52s %s" % ("    (b) FLUSHes completed", " ".join("%16s" % c for c in cells)))
    cells = []
    for name in names:
        r = results.get(name, {})
        cells.append(fmt_ratio(ratio(r.get("b"), r.get("a"))))
    print("%-52s %s" % ("(b)/(a) (target <= %.0f)" % FLUSH_TARGET,
                        " ".join("%16s" % c for c in cells)))
    row("(c) %d x (28 B write + FLUSH), QD1, total (s)" % SERIAL_PAIRS, "c")
    cells, vals = [], []
    for name in names:
        lat = results.get(name, {}).get("c_lat")
        v = statistics.fmean(lat[1:]) * 1e3 if lat and len(lat) > 1 else None
        vals.append(v)
        cells.append("n/a" if v is None else "%.2f" % v)
    if len(names) == 2:
        cells.append(fmt_ratio(ratio(vals[0], vals[1])))
    print("%-52s %s" % ("    (c) first FLUSH (ms)", " ".join(
        "%16s" % ("n/a" if not results.get(n, {}).get("c_lat") else
                  "%.1f" % (results[n]["c_lat"][0] * 1e3)) for n in names)))
    print("%-52s %s" % ("    (c) mean of the other FLUSHes (ms)",
                        " ".join("%16s" % c for c in cells)))
    print()
    print("%-52s %s" % ("BLOCK_STATUS 4 KiB REQ_ONE, mean/p50/p99 us", " ".join(
        "%16s" % c for c in names)))
    for where in ("far", "between"):
        for state, label in (("clean", "0 dirty (fresh server)"),
                             ("dirty", "%d dirty" % args.dirty_blocks),
                             ("after", "0 dirty (after (a): %d cached, clean)"
                              % args.dirty_blocks)):
            key = "bs_%s_%s" % (state, where)
            cells = []
            for name in names:
                b = results.get(name, {}).get(key)
                cells.append("n/a" if not b else "%.0f/%.0f/%.0f" % (b["mean_us"], b["p50_us"],
                                                                   b["p99_us"]))
            print("%-52s %s" % ("  %s, %s" % (where, label), " ".join("%16s" % c for c in cells)))
        for clean, label in (("clean", "dirty/fresh, mean/p50 (target: mean <= %.0f)" % BS_TARGET),
                             ("after", "dirty/after (a), mean/p50")):
            cells = []
            for name in names:
                r = results.get(name, {})
                a, b = r.get("bs_%s_%s" % (clean, where)), r.get("bs_dirty_" + where)
                cells.append("%s/%s" % (fmt_ratio(ratio(b and b["mean_us"], a and a["mean_us"])),
                                        fmt_ratio(ratio(b and b["p50_us"], a and a["p50_us"]))))
            print("%-52s %s" % ("  %s, %s" % (where, label), " ".join("%16s" % c for c in cells)))
    n_bs = [results.get(n, {}).get("bs_clean_far", {}).get("n") for n in names]
    print("  (requests per BLOCK_STATUS cell: %s)" % ", ".join(
        "%s %s" % (n, c) for n, c in zip(names, n_bs)))
    r = results.get("nbdcached")
    if r:
        print()
        print("TARGETS nbdcached")
        q = ratio(r.get("b"), r.get("a"))
        if q is not None:
            verdict = "%.2f %s" % (q, "MET" if q <= FLUSH_TARGET else "NOT MET")
        elif r.get("a") and "b" in r and not r.get("b_failed"):
            # (b) timed out: the ratio is above what the bound allows.
            low = args.flush_timeout / r["a"]
            verdict = "> %.2f (timeout) %s" % (low, "NOT MET" if low > FLUSH_TARGET
                                               else "undecided (raise --flush-timeout)")
        else:
            verdict = "n/a (a timeout or failure)"
        print("  (b)/(a) <= %.1f: %s" % (FLUSH_TARGET, verdict))
        for where in ("far", "between"):
            a, b = r.get("bs_clean_" + where), r.get("bs_dirty_" + where)
            q = ratio(b and b["mean_us"], a and a["mean_us"])
            print("  BLOCK_STATUS %s, %d dirty / 0 dirty <= %.1f: %s" % (
                where, args.dirty_blocks, BS_TARGET, "n/a" if q is None else "%.2f %s" % (
                    q, "MET" if q <= BS_TARGET else "NOT MET")))
        print()
        print("STATS nbdcached (control socket)")
        for line in r.get("checks", []) + r.get("after", []):
            print("  " + line)


# ---------------------------------------------------------------- sync-writers

# fio's fsync=N with an async engine and iodepth > 1 does not send one FLUSH
# per N writes: while a FLUSH is in flight the write count stays a multiple
# of N, so fio keeps queueing FLUSHes (nbdkit memory here: 0.84 FLUSH per
# write at iodepth 32, 0.11 at 4, 1/32 at 1). qd1-fsync32 is the exact "one
# FLUSH after every 32 writes"; qd32-fsync32 is fio's flush storm: writes
# and many FLUSHes in flight together.
SYNC_WORKLOADS = [
    ("randwrite-4k-qd1-fsync1", ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=1"]),
    ("randwrite-4k-qd1-fsync32", ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=32"]),
    ("randwrite-4k-qd32-fsync32", ["--rw=randwrite", "--bs=4k", "--iodepth=32", "--fsync=32"]),
]


def run_fio_job(h, name, uri, size, opts, seconds, outdir):
    """fio (nbd engine), one job, time based; its whole job object."""
    out = os.path.join(outdir, "fio-%s.json" % name)
    argv = ["fio", "--name=" + name, "--ioengine=nbd", "--uri=" + uri, "--size=%d" % size,
            "--output-format=json", "--output=" + out, "--time_based",
            "--runtime=%d" % seconds] + opts
    p = h.run_bounded(argv, seconds + 120, cwd=outdir)
    try:
        with open(out) as f:
            job = json.load(f)["jobs"][0]
    except (OSError, ValueError, IndexError, KeyError):
        job = None
    if p.returncode != 0 or job is None or job["error"] != 0:
        raise RuntimeError("fio %s failed (exit %d): %s" % (name, p.returncode,
                                                           (p.stderr or "")[-500:]))
    return job


def sync_server_round(name, argv, args, tmp, h, path, control, uri):
    """One server, the workloads in order on a freshly fsync()ed file:
    {wname: metrics}, {wname: nbdcached stats delta text}."""
    sock = os.path.join(tmp, "nbd.sock")
    out, stats = {}, {}
    fsync_file(path)
    with h.running_server("sync-%s" % name, argv, sock, tmp) as (proc, _):
        for wname, opts in SYNC_WORKLOADS:
            before = h.cpu_seconds(proc.pid)
            s0 = ctl_stats(h, control)["cache"] if name == "nbdcached" else None
            job = run_fio_job(h, "%s-%s" % (name, wname), uri, args.size, opts, args.seconds,
                              tmp)
            cpu = h.cpu_seconds(proc.pid) - before
            w, sy = job["write"], job["sync"]
            r = out[wname] = {
                "iops": w["iops"], "ios": w["total_ios"],
                "p99_us": w["clat_ns"]["percentile"]["99.000000"] / 1e3,
                "syncs": sy["total_ios"],
                "sync_mean_us": sy["lat_ns"]["mean"] / 1e3,
                "sync_p99_us": sy["lat_ns"].get("percentile", {}).get("99.000000", 0) / 1e3,
                "cpu_us_per_io": cpu / w["total_ios"] * 1e6 if w["total_ios"] else 0,
            }
            if s0 is not None:
                s1 = ctl_stats(h, control)["cache"]
                stats[wname] = " ".join(
                    "%s=+%d" % (k, s1[k] - s0[k]) for k in
                    ("backend_writes", "backend_write_bytes", "writeback_bytes",
                     "direct_writes")) + " dirty_bytes=%d" % s1["dirty_bytes"]
            print("  %s %s: %.0f write IOPS, %d FLUSHes (mean %.0f us)"
                  % (name, wname, r["iops"], r["syncs"], r["sync_mean_us"]), flush=True)
    return out, stats


def run_sync_writers(args, tmp, h):
    path = os.path.join(tmp, "bench.img")
    sock = os.path.join(tmp, "nbd.sock")
    control = os.path.join(tmp, "control.sock")
    uri = "nbd+unix:///?socket=" + sock
    specs = {
        "nbdcached": nbdcached_argv(h, args, sock, control, [("bench", path)]),
        "nbdkit": nbdkit_file_argv(sock, path),
    }
    names = [s for s in specs if not args.servers or s in args.servers]
    if "nbdkit" in names and h.unavailable({"needs": ["nbdkit"]}):
        print("nbdkit: n/a (not installed)")
        names.remove("nbdkit")
    rounds = args.rounds
    print("sync-writers: a %d MiB file (written, fsync()ed) served by nbdcached (writeback, "
          "default watermarks and expiry: %s) and by nbdkit file (default threads; FLUSH is "
          "fdatasync)" % (args.size // MiB, " ".join(specs["nbdcached"][1:]).replace(tmp, "TMP")))
    print("client: fio ioengine=nbd (libnbd), one job, time based %ds: %s" % (
        args.seconds, "; ".join("%s: %s" % (w, " ".join(o)) for w, o in SYNC_WORKLOADS)))
    print("(fio's fsync=N sends an NBD FLUSH after every N writes at iodepth 1; at iodepth 32 "
          "it keeps sending FLUSHes while one is in flight: see the FLUSHes column.) %d "
          "round(s), the servers' order reversed each round; each server starts on a freshly "
          "fsync()ed file and runs the workloads in this order; the table shows the median "
          "over the rounds" % rounds, flush=True)
    t0 = time.time()
    h.make_file(path, args.size)
    fsync_file(path)
    print("file written and fsync()ed in %.1fs" % (time.time() - t0), flush=True)
    per_round = {n: [] for n in names}    # name -> [{wname: metrics}] per round
    stats = {}
    for rnd in range(rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        print("round %d: %s" % (rnd + 1, ", ".join(order)), flush=True)
        for name in order:
            try:
                out, st = sync_server_round(name, specs[name], args, tmp, h, path, control, uri)
                per_round[name].append(out)
                for k, v in st.items():
                    stats["round %d %s" % (rnd + 1, k)] = v
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print("  %s: FAILED: %s" % (name, e), flush=True)
                per_round[name].append({})

    def median_of(name, wname, key):
        vals = [r[wname][key] for r in per_round.get(name, []) if wname in r]
        return statistics.median(vals) if vals else None
    print()
    cols = [("iops", "write IOPS", "%.0f"), ("p99_us", "wr p99 us", "%.0f"),
            ("syncs", "FLUSHes", "%d"), ("sync_mean_us", "FLUSH us", "%.0f"),
            ("sync_p99_us", "FLUSH p99", "%.0f"), ("cpu_us_per_io", "CPU us/wr", "%.1f")]
    print("%-26s %-10s %s   (median of %d round(s))" % (
        "workload", "server", " ".join("%10s" % c[1] for c in cols), rounds))
    for wname, _ in SYNC_WORKLOADS:
        for name in names:
            cells = []
            for k, _, fmt in cols:
                v = median_of(name, wname, k)
                cells.append("%10s" % ("FAILED" if v is None else fmt % v))
            print("%-26s %-10s %s" % (wname, name, " ".join(cells)))
    if len(names) == 2:
        print()
        print("RATIOS nbdcached/nbdkit of the medians (write IOPS: above 1 is better; FLUSH "
              "latency, CPU: below 1 is better); IOPS ratio of each round")
        for wname, _ in SYNC_WORKLOADS:
            m = {k: fmt_ratio(ratio(median_of("nbdcached", wname, k),
                                    median_of("nbdkit", wname, k)))
                 for k in ("iops", "sync_mean_us", "cpu_us_per_io")}
            each = []
            for a, b in zip(per_round["nbdcached"], per_round["nbdkit"]):
                each.append(fmt_ratio(ratio(a.get(wname, {}).get("iops"),
                                            b.get(wname, {}).get("iops"))))
            print("  %-26s IOPS %s  FLUSH mean %s  CPU/write %s   rounds: %s" % (
                wname, m["iops"], m["sync_mean_us"], m["cpu_us_per_io"], " ".join(each)))
    if stats:
        print()
        print("STATS nbdcached over each run (control socket)")
        for k, v in stats.items():
            print("  %s: %s" % (k, v))


# ---------------------------------------------------------------- slow-readers

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
NBD_OPT_EXPORT_NAME = 1
NBD_REQUEST_MAGIC = 0x25609513
NBD_CMD_READ = 0


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        got = s.recv(n - len(b))
        if not got:
            raise RuntimeError("server closed the connection during the handshake")
        b += got
    return b


def slow_client(sockpath, export, offsets, length):
    """Connect (fixed newstyle, NBD_OPT_EXPORT_NAME, no zeroes), send one
    READ of length bytes per offset, and return the socket: its replies are
    never read. SO_RCVBUF as small as the kernel allows."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(sockpath)
    magic, opt, hflags = struct.unpack(">QQH", recv_exact(s, 18))
    if magic != NBD_MAGIC or opt != IHAVEOPT:
        raise RuntimeError("not a newstyle NBD server")
    s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    name = export.encode()
    s.sendall(struct.pack(">QII", IHAVEOPT, NBD_OPT_EXPORT_NAME, len(name)) + name)
    size, tflags = struct.unpack(">QH", recv_exact(s, 10 if hflags & 2 else 134)[:10])
    for i, off in enumerate(offsets):
        if off + length > size:
            raise RuntimeError("slow export too small")
        s.sendall(struct.pack(">IHHQQI", NBD_REQUEST_MAGIC, 0, NBD_CMD_READ, 0x5100 + i, off,
                              length))
    return s


def open_count(socks):
    """How many of socks the server has not closed (no POLLHUP/POLLRDHUP:
    their unread replies hide an EOF from recv)."""
    n = 0
    for sk in socks:
        p = select.poll()
        p.register(sk, select.POLLHUP | select.POLLRDHUP | select.POLLERR)
        if not p.poll(0):
            n += 1
    return n


class RssSampler(threading.Thread):
    def __init__(self, h, pid, period=0.5):
        super().__init__(daemon=True)
        self.h, self.pid, self.period = h, pid, period
        self.samples = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            m = self.h.memory(self.pid)["rss"]
            if m is not None:
                self.samples.append(m)
            self.stop.wait(self.period)


SLOW_VARIANTS = [
    # (name, the slow clients' export, what it says)
    ("cold", "slow", "slow clients read export 'slow' (another file, not cached: their READs "
                     "miss and compete for cache memory)"),
    ("warm", "bench", "slow clients read export 'bench' (the warm working set: their READs "
                      "hit and pin cached entries)"),
]


def slow_variant(variant, slow_export, args, tmp, h, argv, paths, res):
    """One daemon: warm the working set, the well-behaved run alone, then
    the slow clients connect, then the well-behaved run again. Fills res."""
    sock = os.path.join(tmp, "nbd.sock")
    control = os.path.join(tmp, "control.sock")
    uri = "nbd+unix:///bench?socket=" + sock
    n_slow, rsize, per = args.slow_clients, args.slow_read_size, args.slow_reads
    wl = ["--rw=randread", "--bs=4k", "--iodepth=%d" % WELL_IODEPTH]
    slow_socks = []
    try:
        with h.running_server("slow-readers-%s" % variant, argv, sock, tmp) as (proc, _):
            res["rss_start"] = h.memory(proc.pid)["rss"]
            h.run_fio("warmup-%s" % variant, uri, args.size, h.WARMUP, 0, tmp)
            for phase in ("alone", "slow", "after"):
                if phase == "after":
                    # Bracket the run with the slow clients in time (noise):
                    # close them, read the working set again (the cold
                    # variant lost it), the well-behaved run again.
                    for sk in slow_socks:
                        sk.close()
                    slow_socks = []
                    time.sleep(1)
                    res["rss_after_close"] = h.memory(proc.pid)["rss"]
                    h.run_fio("rewarm-%s" % variant, uri, args.size, h.WARMUP, 0, tmp)
                s_pre = ctl_stats(h, control)
                if phase == "slow":
                    size = paths[slow_export][1]
                    nchunks = size // rsize
                    rng = random.Random(2)
                    for i in range(n_slow):
                        offs = [((i * per + k) % nchunks) * rsize for k in range(per)]
                        rng.shuffle(offs)
                        slow_socks.append(slow_client(sock, slow_export, offs, rsize))
                    time.sleep(SLOW_SETTLE)
                    res["rss_settled"] = h.memory(proc.pid)["rss"]
                s0 = ctl_stats(h, control)
                sampler = RssSampler(h, proc.pid)
                sampler.start()
                cpu0 = h.cpu_seconds(proc.pid)
                try:
                    job = run_fio_job(h, "well-behaved-%s-%s" % (variant, phase), uri, args.size,
                                      wl, args.seconds, tmp)
                finally:
                    sampler.stop.set()
                    sampler.join()
                cpu = h.cpu_seconds(proc.pid) - cpu0
                s1 = ctl_stats(h, control)
                e0, e1 = export_stats(s0, "bench"), export_stats(s1, "bench")
                looked = sum(e1[k] - e0[k] for k in ("hits", "misses", "partial_hits"))
                c0, c1, cp = s0["cache"], s1["cache"], s_pre["cache"]
                clooked = sum(c1[k] - c0[k] for k in ("hits", "misses", "partial_hits"))
                r = res[phase] = {
                    "iops": job["read"]["iops"],
                    "p99_us": job["read"]["clat_ns"]["percentile"]["99.000000"] / 1e3,
                    "hit": (e1["hits"] - e0["hits"]) / looked if looked else None,
                    "misses": e1["misses"] - e0["misses"],
                    "all_hit": (c1["hits"] - c0["hits"]) / clooked if clooked else None,
                    "evictions": c1["evictions"] - cp["evictions"],
                    "bypass": c1["bypass_reads"] - cp["bypass_reads"],
                    "backend_reads": c1["backend_read_bytes"] - cp["backend_read_bytes"],
                    "used": c1["used_bytes"],
                    "rss_max": max(sampler.samples) if sampler.samples else None,
                    "cpu_s": cpu,
                    "slow_conns": open_count(slow_socks) if phase == "slow" else None,
                }
                print("  %s, %s: %.0f IOPS, 'bench' hit ratio %s, RSS max %.0f MiB%s"
                      % (variant, phase, r["iops"], "n/a" if r["hit"] is None
                         else "%.4f" % r["hit"], (r["rss_max"] or 0) / MiB,
                         ", slow connections open at the end %d" % r["slow_conns"]
                         if phase == "slow" else ""), flush=True)
            res["daemon_alive"] = proc.poll() is None
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print("  %s: FAILED: %s" % (variant, e), flush=True)
    finally:
        for sk in slow_socks:
            sk.close()


def run_slow_readers(args, tmp, h):
    path = os.path.join(tmp, "bench.img")
    slow_path = os.path.join(tmp, "slow.img")
    sock = os.path.join(tmp, "nbd.sock")
    control = os.path.join(tmp, "control.sock")
    n_slow, rsize, per = args.slow_clients, args.slow_read_size, args.slow_reads
    slow_size = max(args.size * 2, rsize * per)
    if args.size < rsize:
        raise SystemExit("bench/run: --size must be at least --slow-read-size")
    paths = {"bench": (path, args.size), "slow": (slow_path, slow_size)}
    argv = nbdcached_argv(h, args, sock, control, [("bench", path), ("slow", slow_path)])
    print("slow-readers: nbdcached %s" % " ".join(argv[1:]).replace(tmp, "TMP"))
    print("well-behaved client: fio ioengine=nbd, export 'bench' (%d MiB, all of it the "
          "working set, read once before: warm), --rw=randread --bs=4k --iodepth=%d, one job, "
          "%ds, alone and then with the slow clients" % (args.size // MiB, WELL_IODEPTH,
                                                         args.seconds))
    print("slow clients: %d connections, each sends %d READs of %d MiB (simple replies, "
          "SO_RCVBUF 4 KiB) and never reads; the measured run starts %.0f s after they sent; "
          "the daemon's unread-reply deadline is %d s" % (n_slow, per, rsize // MiB, SLOW_SETTLE,
                                                        SLOW_DEADLINE))
    print("two variants, each a fresh daemon (warm-up, alone, with): %s" % "; ".join(
        "%s: %s" % (v, what) for v, _, what in SLOW_VARIANTS), flush=True)
    if args.seconds + SLOW_SETTLE >= SLOW_DEADLINE:
        print("note: --seconds %d + %.0f s >= %d s: the daemon may drop the slow clients during "
              "the run" % (args.seconds, SLOW_SETTLE, SLOW_DEADLINE))
    t0 = time.time()
    h.make_file(path, args.size)
    h.make_file(slow_path, slow_size)
    h.read_whole_file(path)
    h.read_whole_file(slow_path)
    print("files written (bench %d MiB, slow %d MiB; read once: page cache hot) in %.1fs"
          % (args.size // MiB, slow_size // MiB, time.time() - t0), flush=True)
    results = {}
    for variant, slow_export, _ in SLOW_VARIANTS:
        print("variant %s ..." % variant, flush=True)
        results[variant] = {}
        slow_variant(variant, slow_export, args, tmp, h, argv, paths, results[variant])
    print_slow_readers(results, args)


def alone_mean(res, key):
    """The mean of the two runs without slow clients (before and after)."""
    vals = [res[p][key] for p in ("alone", "after") if res.get(p, {}).get(key) is not None]
    return statistics.fmean(vals) if vals else None


def print_slow_readers(results, args):
    rows = [("well-behaved IOPS", "iops", "%.0f"), ("well-behaved p99 us", "p99_us", "%.0f"),
            ("'bench' export hit ratio", "hit", "%.4f"), ("'bench' export misses", "misses", "%d"),
            ("whole cache hit ratio", "all_hit", "%.4f"),
            ("evictions (incl. settle / re-warm)", "evictions", "%d"),
            ("bypassed reads (incl. settle / re-warm)", "bypass", "%d"),
            ("backend MiB read (incl. settle / re-warm)", "backend_reads", None),
            ("cache used MiB at the end", "used", None),
            ("daemon RSS max during the run (MiB)", "rss_max", None),
            ("daemon CPU s", "cpu_s", "%.1f"),
            ("slow connections open at the end", "slow_conns", "%d")]
    for variant, _, what in SLOW_VARIANTS:
        res = results.get(variant, {})
        print()
        print("SLOW-READERS %s: %s" % (variant, what))
        print("%-42s %14s %14s %14s %10s" % ("", "alone", "with %d slow" % args.slow_clients,
                                             "alone again", "with/alone"))
        for label, key, fmt in rows:
            cells, vals = [], []
            for phase in ("alone", "slow", "after"):
                v = res.get(phase, {}).get(key)
                vals.append(v)
                if v is None:
                    cells.append("n/a")
                elif fmt is None:
                    cells.append("%.1f" % (v / MiB))
                else:
                    cells.append(fmt % v)
            q = (ratio(vals[1], alone_mean(res, key))
                 if key in ("iops", "p99_us", "hit", "rss_max") else None)
            print("%-42s %14s %14s %14s %10s" % (label, cells[0], cells[1], cells[2],
                                                 "" if q is None else "%.2f" % q))
        print("with/alone: divided by the mean of 'alone' and 'alone again' (after the slow "
              "clients closed and the working set was read once more)")
        print("daemon RSS: %s at start, %s after the slow clients settled, %s 1 s after they "
              "closed; daemon %s" % tuple(
                  ["n/a" if res.get(k) is None else "%.1f MiB" % (res[k] / MiB)
                   for k in ("rss_start", "rss_settled", "rss_after_close")]
                  + ["still running" if res.get("daemon_alive")
                     else "NOT running (or not reached)"]))
    print()
    for variant, _, _ in SLOW_VARIANTS:
        res = results.get(variant, {})
        for key, label in (("iops", "well-behaved IOPS"), ("hit", "'bench' hit ratio")):
            q = ratio(res.get("slow", {}).get(key), alone_mean(res, key))
            print("TARGET %s: %s with/alone >= %.2f: %s" % (
                variant, label, SLOW_TARGET, "n/a" if q is None else "%.2f %s" % (
                    q, "MET" if q >= SLOW_TARGET else "NOT MET")))


def run(args, tmp, h):
    """Entry point from bench/run (h: that module, for its helpers)."""
    {"flush-scale": run_flush_scale, "sync-writers": run_sync_writers,
     "slow-readers": run_slow_readers}[args.scenario](args, tmp, h)
