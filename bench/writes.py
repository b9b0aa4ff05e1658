"""bench/writes.py: the writes scenario of bench/run (issue 15's
measurements; run it with `bench/run --scenario writes`). Imported by
bench/run, whose helpers it uses (server start and stop, fio, CPU time from
/proc/PID/stat, the table and its ratios). See bench/README.md.

In the order it prints them:

1, 2, 5. The write table: nbdcached (writeback, its cache warm) against
  nbdkit memory (and, when installed, nbdkit --filter=cache file and
  qemu-nbd), each over the Unix socket and over TCP on 127.0.0.1: 1 MiB
  sequential writes iodepth 8, 4 KiB random writes iodepth 32, and as
  hit-path references 4 KiB random reads iodepth 32 x 2 jobs and 1 MiB
  sequential reads iodepth 8. The writes stay within a region below
  nbdcached's dirty high watermark (nothing is written back during them).
  The one-pass cell (the first) is the median of CLEAN_ROUNDS passes, each
  server started and warmed anew for each. Then that cell once more, Unix
  socket, with nbdcached's backend an NBD server taking 1 ms per request
  (nbdkit --filter=delay file), against the same on the file backend:
  SLOW_PAIRS pairs, compared by medians. Every row also has the server's
  kernel share of its CPU and fio's own CPU (a client at a whole CPU is
  what bounds the cell, not the server).
3. Sustained sequential 1 MiB writes, twice a smaller cache's size, into a
  file on a disk file system, through nbdcached (final FLUSH included)
  against fio writing the same file itself (libaio, O_DIRECT, final fsync).
4. Metadata: the cache's metadata_bytes (control socket `stats`) per cached
  byte and per entry after 4 KiB random reads fill a 1 GiB cache, and after
  2 MiB sequential reads do.

Targets are printed beside the measured ratios, "met" or "NOT met"; the
scenario never fails on numbers.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time

MiB = 1 << 20
GiB = 1 << 30

# (name, fio options, numjobs, writes: confined to the region below the
# dirty high watermark). The first cell is one pass over that region, whose
# cached blocks are all clean then (the file was read whole): writes into a
# warm cache. The second loops over it for --seconds, so after its first
# pass it rewrites dirty blocks, which a payload arriving in pieces is not
# received into (a torn one would destroy their only copy): it is read into
# a buffer and copied.
TABLE_WORKLOADS = [
    ("seqwrite-1m-qd8-clean", ["--rw=write", "--bs=1m", "--iodepth=8", "--time_based=0"], 1,
     True),
    ("seqwrite-1m-qd8", ["--rw=write", "--bs=1m", "--iodepth=8"], 1, True),
    ("randwrite-4k-qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"], 1, True),
    ("randread-4k-qd32-j2", ["--rw=randread", "--bs=4k", "--iodepth=32"], 2, False),
    ("seqread-1m-qd8", ["--rw=read", "--bs=1m", "--iodepth=8"], 1, False),
]
COLUMNS = [("iops", "IOPS", "%.0f"), ("mibs", "MiB/s", "%.1f"), ("p99_us", "p99 us", "%.0f"),
           ("cpu_us_per_io", "CPU us/IO", "%.2f"), ("cpu_us_per_mib", "CPU us/MiB", "%.1f"),
           ("sys_pct", "kernel %", "%.0f"), ("client_cpu_pct", "client %", "%.0f"),
           ("ios", "I/Os", "%d")]
TRANSPORTS = ("unix", "tcp")
PEER = "nbdkit-memory"
# A server that only receives (writes discarded, reads zeros): what no server
# can do better than with this client on this machine (print_targets).
FLOOR = "nbdkit-null"
# (workload, metric, label, "min" or "max", bound): nbdcached/PEER.
TARGETS = [
    ("seqwrite-1m-qd8-clean", "mibs", "MiB/s", "min", 1.3),
    ("seqwrite-1m-qd8-clean", "cpu_us_per_mib", "CPU/MiB", "max", 0.5),
    ("seqwrite-1m-qd8", "mibs", "MiB/s", "min", 1.3),
    ("seqwrite-1m-qd8", "cpu_us_per_mib", "CPU/MiB", "max", 0.5),
    ("randwrite-4k-qd32", "cpu_us_per_io", "CPU/IO", "max", 1 / 3),
    ("randwrite-4k-qd32", "iops", "IOPS", "min", 1.0),
]
# Nothing expires during the scenario: the write cells stay in the cache.
DIRTY_EXPIRE = "3600"
# The write region: this share of the dirty high watermark.
REGION_SHARE = 0.9
SLOW_DELAY = "1ms"
# The 1 ms backend's cell, each time right after the same on the file.
SLOW_PAIRS = 3
# The one-pass cell of the table, each server started and warmed anew for
# each: a pass is short (0.3 s at the defaults) and drifts between runs.
CLEAN_ROUNDS = 3
# fio at this share of one CPU or more, with both servers: the cell measures
# the client (print_targets says so).
CLIENT_BOUND_PCT = 90
SUSTAINED_TARGET = 0.9
# "The same as with a fast backend": within the noise of a pass.
SLOW_TARGET = 0.9
METADATA_TARGETS = {"4k": 0.01, "2m": 0.001}


def fmt_ratio(r):
    return "n/a" if r is None else "%.2f" % r


def verdict(r, kind, bound):
    if r is None:
        return "n/a"
    return "met" if (r >= bound if kind == "min" else r <= bound) else "NOT met"


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_region(args):
    """Bytes the write cells cover: the file, at most REGION_SHARE of the
    dirty high watermark, whole MiB."""
    high = args.cache_size * args.dirty_high // 100
    return min(args.size, int(high * REGION_SHARE) // MiB * MiB)


def dirty_options(args):
    return ["--dirty-high", str(args.dirty_high),
            "--dirty-low", str(min(25, args.dirty_high // 2)), "--dirty-expire", DIRTY_EXPIRE]


def cache_options(args, cache_size):
    return ["--cache-size", "%dM" % (cache_size // MiB), "--cache-mode", args.cache_mode,
            "--hugepages", args.hugepages]


def listen(server, transport, sock, port):
    """The server's options to listen on the Unix socket or on 127.0.0.1:port."""
    unix = transport == "unix"
    return {
        "nbdcached": ["--unix", sock] if unix else ["--listen", "127.0.0.1:%d" % port],
        "nbdkit": ["--unix", sock] if unix else ["-i", "127.0.0.1", "-p", str(port)],
        "qemu-nbd": ["-k", sock] if unix else ["-b", "127.0.0.1", "-p", str(port)],
    }[server]


def table_servers(h, args, transport, sock, port, path, tmp):
    """name -> spec, as bench/run's servers() makes them. Every server is
    stopped with SIGKILL: what it was measured for is done, and nbdcached
    would otherwise write back its dirty data and flush the file."""
    kill = signal.SIGKILL
    s = {
        "nbdcached": {"argv": [h.NBDCACHED, "--foreground"] + listen("nbdcached", transport,
                                                                     sock, port)
                      + ["--control", "none", "--export", "bench=" + path, "--threads", "2",
                         "--log-level", "info"] + cache_options(args, args.cache_size)
                      + dirty_options(args),
                      "stats": True, "stop_signal": kill},
        "nbdkit-memory": {"argv": ["nbdkit", "--foreground"] + listen("nbdkit", transport, sock,
                                                                      port)
                          + ["memory", "size=%d" % args.size],
                          "needs": ["nbdkit", "nbdcopy"],
                          "probe": ["nbdkit", "--dump-plugin", "memory"],
                          "prefill": True, "stop_signal": kill},
        "nbdkit-cache": {"argv": ["nbdkit", "--foreground"] + listen("nbdkit", transport, sock,
                                                                     port)
                         + ["--filter=cache", "file", path, "cache-on-read=true",
                            "cache-max-size=%d" % args.cache_size],
                         "needs": ["nbdkit"],
                         "probe": ["nbdkit", "--filter=cache", "file", "--dump-plugin"],
                         "env": {"TMPDIR": tmp}, "stop_signal": kill},
        "qemu-nbd": {"argv": ["qemu-nbd"] + listen("qemu-nbd", transport, sock, port)
                     + ["-f", "raw", "-t", "--shared=8", path],
                     "needs": ["qemu-nbd"], "stop_signal": kill},
        # Not a peer: the floor. It receives each payload and discards it
        # (reads return zeros), so its rate is what this client sends to a
        # server that does nothing, and its CPU what receiving alone costs.
        FLOOR: {"argv": ["nbdkit", "--foreground"] + listen("nbdkit", transport, sock, port)
                + ["null", "size=%d" % args.size],
                "needs": ["nbdkit"], "probe": ["nbdkit", "--dump-plugin", "null"],
                "stop_signal": kill},
    }
    return {k: v for k, v in s.items() if not args.servers or k in args.servers}


def stats_delta(info, keys=("backend_writes", "backend_write_bytes", "misses",
                             "writes_in_place", "writes_swapped", "entry_splits")):
    """The SIGUSR1 stats' counters over the measured runs, and dirty bytes at
    the end, as text (or why not)."""
    a, b = info["stats"].get("warm"), info["stats"].get("end")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return "n/a (%s)" % (b if isinstance(b, str) else a if isinstance(a, str) else "no stats")
    return " ".join("%s=+%d" % (k, b[k] - a[k]) for k in keys
                    if isinstance(a.get(k), int) and isinstance(b.get(k), int)) + \
        " dirty_bytes=%s" % b.get("dirty_bytes", "?")


def run_table(h, args, tmp, path):
    """Every server over every transport: {transport: {server: {wname:
    metrics}}}, {transport: {server: stats text}}, {server: reason n/a}."""
    region = write_region(args)
    workloads = [(w, opts + (["--size=%d" % region] if writes else []), jobs)
                 for w, opts, jobs, writes in TABLE_WORKLOADS]
    sock = os.path.join(tmp, "nbd.sock")
    results = {t: {} for t in args.transports}
    stats = {t: {} for t in args.transports}
    reasons = {}
    names = list(table_servers(h, args, "unix", sock, 0, path, tmp))
    # Servers outer, transports inner: nbdkit-cache and qemu-nbd, whose
    # writes leave dirty pages of the file for the kernel to write out, last.
    for name in names:
        for transport in args.transports:
            port = free_port()
            spec = table_servers(h, args, transport, sock, port, path, tmp)[name]
            if name not in reasons:
                reason = h.unavailable(spec)
                if reason:
                    print("%s: n/a (%s)" % (name, reason), flush=True)
                    reasons[name] = reason
            if name in reasons:
                results[transport][name] = {}
                continue
            uri, addr = (("nbd+unix:///?socket=" + sock, sock) if transport == "unix"
                         else ("nbd://127.0.0.1:%d/" % port, ("127.0.0.1", port)))
            print("running %s over %s ..." % (name, transport), flush=True)
            info = {"workloads": {}, "mem": {}, "stats": {}}
            try:
                h.bench_server("%s-%s" % (name, transport), spec, addr, uri, path, args.size,
                               args.seconds, tmp, workloads, info)
                clean_rounds(h, args, name, transport, spec, addr, uri, path, tmp,
                             workloads[0], info)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print("  %s over %s: %s" % (name, transport, e), flush=True)
            results[transport][name] = info["workloads"]
            if spec.get("stats"):
                stats[transport][name] = stats_delta(info)
    return results, stats, reasons


def clean_rounds(h, args, name, transport, spec, addr, uri, path, tmp, cell, info):
    """The one-pass cell CLEAN_ROUNDS - 1 times more, each on a freshly
    started and warmed server (nbdcached's blocks must be clean again); its
    metrics become the medians of all its passes, and "rounds" their MiB/s."""
    wname = cell[0]
    passes = [info["workloads"][wname]]
    for i in range(1, CLEAN_ROUNDS):
        passes.append(one_cell(h, args, "%s-%s-clean%d" % (name, transport, i), spec, addr, uri,
                               path, tmp, cell)[0])
    # The table's keys: the repeated passes also carry "mem".
    m = {k: statistics.median([p[k] for p in passes]) for k in passes[0]}
    m["rounds"] = [p["mibs"] for p in passes]
    info["workloads"][wname] = m


def one_cell(h, args, label, spec, addr, uri, path, tmp, cell):
    """A fresh server, warmed, and one cell on it: its metrics with "mem"
    (the server's memory after the warm-up), and bench_server's info."""
    info = {"workloads": {}, "mem": {}, "stats": {}}
    h.bench_server(label, spec, addr, uri, path, args.size, args.seconds, tmp, [cell], info)
    return dict(info["workloads"][cell[0]], mem=info["mem"].get("warm")), info


def print_targets(results, transport):
    ours = results.get("nbdcached", {})
    theirs = results.get(PEER, {})
    floor = results.get(FLOOR, {})
    print()
    print("TARGETS %s, nbdcached/%s" % (transport, PEER))
    for wname, key, label, kind, bound in TARGETS:
        a, b = ours.get(wname), theirs.get(wname)
        r = a[key] / b[key] if a and b and b[key] else None
        print("  %-18s %-8s %s %.2f: %6s %s%s" % (wname, label, ">=" if kind == "min" else "<=",
                                                  bound, fmt_ratio(r), verdict(r, kind, bound),
                                                  target_context(a, b, floor.get(wname), key)))


def target_context(a, b, f, key):
    """What bounds a target's cell from outside the daemon: for a rate,
    fio's own CPU (a client near one whole CPU cannot go faster, whoever
    serves it); for CPU, the share of ours spent in the kernel. Then the
    floor's ratio to the peer (f: FLOOR's metrics, if it ran): the best any
    server could show here, one that only receives."""
    if not a or not b:
        return ""
    at_floor = ""
    if f and b[key]:
        at_floor = "; %s %.2f" % (FLOOR, f[key] / b[key])
    if key in ("mibs", "iops"):
        bound = " (client-bound)" if min(a["client_cpu_pct"], b["client_cpu_pct"]) >= \
            CLIENT_BOUND_PCT else ""
        return "  fio at %.0f%% / %.0f%% of a CPU%s%s" % (
            a["client_cpu_pct"], b["client_cpu_pct"], bound, at_floor)
    return "  ours %.0f%% in the kernel%s" % (a["sys_pct"], at_floor)


# ---------------------------------------------------------------- 1 ms backend

def run_slow(h, args, tmp, path):
    """nbdcached over an NBD backend with SLOW_DELAY per request (nbdkit
    --filter=delay file on the same file), Unix socket: warm-up read, then
    the sequential write cell; SLOW_PAIRS times, each right after the same
    on the file backend (a pass is short, and the machine drifts between
    the table and here). {"slow": [metrics], "file": [metrics]} and the
    last slow run's stats text, or None and why."""
    bsock = os.path.join(tmp, "backend.sock")
    backend = {"argv": ["nbdkit", "-U", bsock, "-f", "-P", os.path.join(tmp, "backend.pid"),
                        "--filter=delay", "file", path, "rdelay=" + SLOW_DELAY,
                        "wdelay=" + SLOW_DELAY],
               "needs": ["nbdkit"],
               "probe": ["nbdkit", "--filter=delay", "file", "--dump-plugin"]}
    reason = h.unavailable(backend)
    if reason:
        return None, "n/a (%s)" % reason
    sock = os.path.join(tmp, "nbd.sock")
    uri = "nbd+unix:///?socket=" + sock
    wname, opts, jobs, _ = TABLE_WORKLOADS[0]
    spec = {"argv": [h.NBDCACHED, "--foreground", "--unix", sock, "--control", "none",
                     "--export", "d=nbd+unix:///?socket=" + bsock, "--threads", "2",
                     "--log-level", "info"] + cache_options(args, args.cache_size)
            + dirty_options(args),
            "stats": True, "stop_signal": signal.SIGKILL}
    filespec = table_servers(h, args, "unix", sock, 0, path, tmp)["nbdcached"]
    cell = (wname, opts + ["--size=%d" % write_region(args)], jobs)
    runs = {"file": [], "slow": []}
    print("running nbdcached over the file and over the %s backend (Unix socket), %d times ..."
          % (SLOW_DELAY, SLOW_PAIRS), flush=True)
    try:
        for i in range(SLOW_PAIRS):
            runs["file"].append(one_cell(h, args, "nbdcached-file-%d" % i, filespec, sock, uri,
                                         path, tmp, cell)[0])
            # The daemon (SIGKILL: its dirty data is not written back)
            # stops before the backend.
            with h.running_server("slow-backend-%d" % i, backend["argv"], bsock, tmp):
                m, info = one_cell(h, args, "nbdcached-slow-%d" % i, spec, sock, uri, path, tmp,
                                   cell)
            runs["slow"].append(m)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
        return None, "FAILED (%s)" % e
    return runs, stats_delta(info)


def thp_share(mem):
    """AnonHugePages / VmRSS as text: a pass into an arena the kernel could
    not give huge pages costs more (TLB misses in the receive copy)."""
    if not mem or not mem.get("rss") or mem.get("thp") is None:
        return "n/a"
    return "%.0f%%" % (100.0 * mem["thp"] / mem["rss"])



# ---------------------------------------------------------------- sustained

def disk_dir(h, tmp):
    """A directory on a disk file system for the sustained cell: the bench
    directory unless it is tmpfs (or ramfs), else /var/tmp, else /tmp.
    (path, fstype, made: a directory of ours to remove) or (None, why, None)."""
    seen = []
    for base, own in ((tmp, False), ("/var/tmp", True), ("/tmp", True)):
        fs = h.fstype(base)
        seen.append("%s: %s" % (base, fs))
        if fs in ("tmpfs", "ramfs", "?") or not os.access(base, os.W_OK):
            continue
        d = tempfile.mkdtemp(prefix="nbdcached-bench-sustained-", dir=base) if own else tmp
        return d, fs, d if own else None
    return None, "no disk file system (%s)" % ", ".join(seen), None


def fresh_file(path, size):
    """The file anew, its blocks allocated (the same start for both runs)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def fio_pass(h, name, opts, timeout, outdir):
    """One fio job (not time based) with these options: its JSON job and
    the time (epoch seconds) fio stamped its output with, after the job."""
    out = os.path.join(outdir, "fio-%s.json" % name)
    argv = ["fio", "--name=" + name, "--output-format=json", "--output=" + out] + opts
    p = h.run_bounded(argv, timeout, cwd=outdir)
    try:
        with open(out) as f:
            doc = json.load(f)
        job, stamp = doc["jobs"][0], doc["timestamp_ms"] / 1000.0
    except (OSError, ValueError, IndexError, KeyError):
        job = None
    if p.returncode != 0 or job is None or job["error"] != 0:
        raise RuntimeError("fio %s failed (exit %d): %s" % (name, p.returncode,
                                                           (p.stderr or "")[-500:]))
    return job, stamp


# The final flush, in a process of its own (bounded; the same start-up cost
# for both): NBD_CMD_FLUSH on a new connection, or fsync() of the file.
FLUSH_NBD = "import nbd, sys; h = nbd.NBD(); h.connect_uri(sys.argv[1]); h.flush(); h.shutdown()"
FLUSH_FILE = "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); os.fsync(fd); os.close(fd)"


def final_flush(h, code, target, timeout):
    """Run the flush; the time (epoch seconds) it was done."""
    p = h.run_bounded(["/usr/bin/python3", "-c", code, target], timeout)
    if p.returncode != 0:
        raise RuntimeError("the final flush failed (exit %d): %s"
                           % (p.returncode, p.stderr.strip()[-300:]))
    return time.time()


def sustained_metrics(job, stamp, flushed, volume, cpu):
    """Writes plus the final flush: fio's runtime of the writes, then from
    fio's output stamp until the flush returned."""
    w = job["write"]
    flush_s = flushed - stamp
    secs = w["runtime"] / 1000.0 + flush_s
    return {"secs": secs, "mibs": volume / MiB / secs, "fio_mibs": w["bw_bytes"] / MiB,
            "flush_s": flush_s,
            "cpu_us_per_mib": None if cpu is None else cpu * 1e6 / (volume / MiB)}


def run_sustained(h, args, tmp):
    """Sequential 1 MiB writes, iodepth 8, 2x --sustained-cache, one pass,
    then a flush: through nbdcached (file backend) and by fio itself
    (libaio, O_DIRECT). {"where": text, "runs": {name: metrics or error}}."""
    cache = args.sustained_cache
    volume = 2 * cache
    d, fs, made = disk_dir(h, tmp)
    res = {"where": None, "volume": volume, "cache": cache, "runs": {}}
    if d is None:
        res["where"] = fs
        return res
    res["where"] = "%s (%s)" % (d, fs)
    target = os.path.join(d, "sustained.img")
    seq = ["--rw=write", "--bs=1m", "--iodepth=8", "--size=%d" % volume]
    timeout = h.size_timeout(volume)
    try:
        # nbdcached, default watermarks and expiry, its cache 1/2 the volume.
        print("sustained: nbdcached, %s of 1 MiB writes into %s ..."
              % (h.human(volume), res["where"]), flush=True)
        sock = os.path.join(tmp, "nbd.sock")
        uri = "nbd+unix:///?socket=" + sock
        argv = [h.NBDCACHED, "--foreground", "--unix", sock, "--control", "none",
                "--export", "bench=" + target, "--threads", "2", "--log-level", "info"] + \
            cache_options(args, cache)
        try:
            fresh_file(target, volume)
            with h.running_server("nbdcached-sustained", argv, sock, tmp) as (proc, logpath):
                # Steady state: the cache full of clean data first (its
                # memory touched once: the first touch of fresh memory is
                # the kernel zeroing pages, slow on a VM, and not what a
                # running service pays).
                fio_pass(h, "sustained-warm", ["--ioengine=nbd", "--uri=" + uri, "--rw=read",
                                               "--bs=1m", "--iodepth=8", "--size=%d" % cache],
                         timeout, tmp)
                cpu0 = h.cpu_seconds(proc.pid)
                job, stamp = fio_pass(h, "sustained-nbdcached",
                                      ["--ioengine=nbd", "--uri=" + uri] + seq, timeout, tmp)
                flushed = final_flush(h, FLUSH_NBD, uri, timeout)
                cpu = h.cpu_seconds(proc.pid) - cpu0
                r = sustained_metrics(job, stamp, flushed, volume, cpu)
                try:
                    st = h.daemon_stats(proc, logpath)
                    r["stats"] = "backend_writes=%s backend_write_bytes=%s dirty_bytes=%s" % (
                        st.get("backend_writes"), st.get("backend_write_bytes"),
                        st.get("dirty_bytes"))
                except RuntimeError as e:
                    r["stats"] = str(e)
            res["runs"]["nbdcached"] = r
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            res["runs"]["nbdcached"] = "FAILED (%s)" % e
        print("sustained: fio libaio direct=1, the same writes into the same file ...",
              flush=True)
        try:
            fresh_file(target, volume)
            job, stamp = fio_pass(h, "sustained-direct",
                                  ["--ioengine=libaio", "--direct=1", "--filename=" + target]
                                  + seq, timeout, tmp)
            flushed = final_flush(h, FLUSH_FILE, target, timeout)
            r = res["runs"]["fio-direct"] = sustained_metrics(job, stamp, flushed, volume, None)
            r["stats"] = ""
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            res["runs"]["fio-direct"] = "FAILED (%s)" % e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(target)
        if made:
            shutil.rmtree(made, ignore_errors=True)
    return res


def print_sustained(res):
    print()
    print("SUSTAINED sequential 1 MiB writes, iodepth 8, %s (2x nbdcached's --cache-size %s), "
          "one pass, then a flush, into %s"
          % (human(res["volume"]), human(res["cache"]), res["where"]))
    print("  %-22s %9s %9s %9s %10s %10s  %s" % ("", "MiB/s", "seconds", "flush s",
                                                "fio MiB/s", "CPU us/MiB",
                                                "nbdcached stats at the end"))
    for name, label in (("nbdcached", "nbdcached (file)"), ("fio-direct", "fio libaio direct=1")):
        r = res["runs"].get(name)
        if not isinstance(r, dict):
            print("  %-22s %s" % (label, r or "not run"))
            continue
        print("  %-22s %9.1f %9.2f %9.3f %10.1f %10s  %s" % (
            label, r["mibs"], r["secs"], r["flush_s"], r["fio_mibs"],
            "-" if r["cpu_us_per_mib"] is None else "%.1f" % r["cpu_us_per_mib"], r["stats"]))
    a, b = res["runs"].get("nbdcached"), res["runs"].get("fio-direct")
    r = a["mibs"] / b["mibs"] if isinstance(a, dict) and isinstance(b, dict) else None
    print("TARGET sustained MiB/s (writes + flush) nbdcached/fio-direct >= %.2f: %s %s"
          % (SUSTAINED_TARGET, fmt_ratio(r), verdict(r, "min", SUSTAINED_TARGET)))


# ---------------------------------------------------------------- metadata

def run_metadata(h, args, tmp, path):
    """Fresh daemons with --metadata-cache, filled by 4 KiB random reads and
    by 2 MiB sequential reads of a region that size: {kind: dict or error}."""
    cache = args.metadata_cache
    region = min(cache, args.size)
    sock = os.path.join(tmp, "nbd.sock")
    control = os.path.join(tmp, "control.sock")
    uri = "nbd+unix:///?socket=" + sock
    argv = [h.NBDCACHED, "--foreground", "--unix", sock, "--control", control,
            "--export", "bench=" + path, "--threads", "2", "--log-level", "warn"] + \
        cache_options(args, cache)
    fills = (("4k", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
             ("2m", ["--rw=read", "--bs=2m", "--iodepth=8"]))
    out = {"cache": cache, "region": region}
    for kind, opts in fills:
        print("metadata: nbdcached --cache-size %s, %s reads of %s ..."
              % (human(cache), "4 KiB random" if kind == "4k" else "2 MiB sequential",
                 human(region)), flush=True)
        try:
            with h.running_server("nbdcached-metadata-%s" % kind, argv, sock, tmp,
                                  stop_signal=signal.SIGKILL):
                empty = h.durability.ctl_stats(h, control)["cache"]
                # One pass: fio's random map reads every 4 KiB block once.
                h.run_fio("metadata-%s" % kind, uri, region, opts, 0, tmp)
                full = h.durability.ctl_stats(h, control)["cache"]
            out[kind] = {"empty_meta": empty["metadata_bytes"], "meta": full["metadata_bytes"],
                         "arena_meta": full.get("arena_metadata_bytes", 0),
                         "used": full["used_bytes"], "entries": full["entries"],
                         "large_share": full.get("arena", {}).get("large_share")}
        except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
            out[kind] = "FAILED (%s)" % e
    return out


def print_metadata(res):
    print()
    print("METADATA nbdcached --cache-size %s (control socket `stats`: cache.metadata_bytes, "
          "used_bytes, entries), after one pass of reads over %s"
          % (human(res["cache"]), human(res["region"])))
    print("  %-22s %10s %9s %12s %12s %11s %10s %10s" % (
        "fill", "cached MiB", "entries", "metadata B", "empty-cache", "meta/cached",
        "B/entry", "B/entry+"))
    for kind, label in (("4k", "4 KiB random reads"), ("2m", "2 MiB sequential reads")):
        r = res.get(kind)
        if not isinstance(r, dict):
            print("  %-22s %s" % (label, r or "not run"))
            continue
        ent = r["entries"]
        print("  %-22s %10.1f %9d %12d %12d %10.4f%% %10s %10s" % (
            label, r["used"] / MiB, ent, r["meta"], r["empty_meta"],
            100.0 * r["meta"] / r["used"] if r["used"] else float("nan"),
            "%.1f" % (r["meta"] / ent) if ent else "n/a",
            "%.1f" % ((r["meta"] - r["empty_meta"]) / ent) if ent else "n/a"))
    # The index (metadata_bytes), and with the arena's own tables
    # (arena_metadata_bytes: a record per 2 MiB chunk, per-frame tables with
    # the owners for split chunks): all the memory the cache needs besides
    # the arena.
    for kind, label in (("4k", "4 KiB entries"), ("2m", "2 MiB entries")):
        r = res.get(kind)
        ok = isinstance(r, dict) and r["used"]
        bound = METADATA_TARGETS[kind]
        for what, ratio in (("metadata_bytes", r["meta"] / r["used"] if ok else None),
                            ("metadata_bytes + arena_metadata_bytes",
                             (r["meta"] + r["arena_meta"]) / r["used"] if ok else None)):
            print("TARGET %s / cached bytes, %s <= %g%%: %s %s" % (
                what, label, 100 * bound, "n/a" if ratio is None else "%.4f%%" % (100 * ratio),
                verdict(ratio, "max", bound)))


# ---------------------------------------------------------------- main

def human(n):
    for unit, div in (("GiB", GiB), ("MiB", MiB)):
        if n >= div and n % div == 0:
            return "%d %s" % (n // div, unit)
    return "%.1f MiB" % (n / MiB)


def run(args, tmp, h):
    """Entry point from bench/run (h: that module, for its helpers)."""
    path = os.path.join(tmp, "bench.img")
    region = write_region(args)
    print("nbdcached: %s --threads 2 %s %s; nbdkit-memory: nbdkit memory size=%d (filled with "
          "nbdcopy); nbdkit-cache: nbdkit --filter=cache file FILE cache-on-read=true "
          "cache-max-size=%d; qemu-nbd -f raw -t --shared=8 FILE"
          % (os.path.relpath(h.NBDCACHED, h.TOP), " ".join(cache_options(args, args.cache_size)),
             " ".join(dirty_options(args)), args.size, args.cache_size))
    print("client: fio ioengine=nbd, measured runs %ds each over %s; writes confined to the "
          "first %s (%d%% of the dirty high watermark, %d%% of %s)"
          % (args.seconds, " and ".join(args.transports), human(region),
             int(REGION_SHARE * 100), args.dirty_high, human(args.cache_size)), flush=True)
    # 3 first: its file is the only one being written, no other dirty
    # pages of ours for the kernel to write out beside it.
    sustained = run_sustained(h, args, tmp) if args.sustained_cache else None
    t0 = time.time()
    h.make_file(path, args.size)
    h.durability.fsync_file(path)
    print("file written and fsync()ed in %.1fs" % (time.time() - t0), flush=True)
    metadata = run_metadata(h, args, tmp, path) if args.metadata_cache else None
    results, stats, reasons = run_table(h, args, tmp, path)
    slow = None
    if not args.servers or "nbdcached" in args.servers:
        slow = run_slow(h, args, tmp, path)

    workloads = [(w, o, j) for w, o, j, _ in TABLE_WORKLOADS]
    for transport in args.transports:
        print()
        print("=== %s (%s) ===" % (transport, "nbd+unix:///?socket=SOCK" if transport == "unix"
                                   else "nbd://127.0.0.1:PORT/"))
        h.print_table(results[transport], workloads, COLUMNS, reasons)
        clean = TABLE_WORKLOADS[0][0]
        print("  %s: medians of %d passes, each on a fresh server; MiB/s of the passes: %s"
              % (clean, CLEAN_ROUNDS, "; ".join(
                  "%s %s" % (s, " ".join("%.0f" % v for v in r[clean]["rounds"]))
                  for s, r in results[transport].items() if clean in r)))
        print_targets(results[transport], transport)
        if "nbdcached" in stats[transport]:
            print("  nbdcached stats over the measured runs: %s" % stats[transport]["nbdcached"])
    if slow is not None:
        runs, st = slow
        print()
        print("1 MiB SEQUENTIAL WRITES, nbdcached over an NBD backend with %s per request "
              "(nbdkit --filter=delay file) against the file backend, one pass each, %d pairs, "
              "Unix socket, below the dirty high watermark" % (SLOW_DELAY, SLOW_PAIRS))
        if runs is None:
            print("  %s" % st)
        else:
            for kind in ("file", "slow"):
                ms = runs[kind]
                print("  %-4s MiB/s %s (median %.1f); CPU us/MiB median %.1f; p99 us median %.0f"
                      % (kind, " ".join("%.1f" % m["mibs"] for m in ms),
                         statistics.median([m["mibs"] for m in ms]),
                         statistics.median([m["cpu_us_per_mib"] for m in ms]),
                         statistics.median([m["p99_us"] for m in ms])))
                print("       huge pages (THP) of RSS after the warm-up: %s"
                      % " ".join(thp_share(m.get("mem")) for m in ms))
            f, s = (statistics.median([m["mibs"] for m in runs[kind]]) for kind in ("file", "slow"))
            r = s / f if f else None
            print("  ratio of the medians, 1 ms backend / file backend >= %.2f: %s %s"
                  % (SLOW_TARGET, fmt_ratio(r), verdict(r, "min", SLOW_TARGET)))
            print("  nbdcached stats over the last 1 ms backend run: %s" % st)
    if sustained is not None:
        print_sustained(sustained)
    if metadata is not None:
        print_metadata(metadata)
