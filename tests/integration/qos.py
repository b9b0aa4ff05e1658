#!/usr/bin/python3
# tests/run: alone (measures rates over its own windows: a test beside it would disturb them)
"""QoS limits: token buckets per export and per client (nbdcached(8), QOS).

One daemon (config file, TLS on with a PSK file of alice and bob), exports
over one 16 MiB backend (they share its cache; reads are cache hits):
  c   client-iops-limit = 500       u   no limit
  e   iops-limit = 400 (the export, all clients)
  b   client-bytes-limit = 4M       t   client-iops-limit = 300
  f   client-iops-limit = 1         o   50 a second, burst 1

Checks (rates are measured from 1 s after the start, once the first
second's burst is spent; clients are forked processes, aio at QD 8):
  isolation  a client flooding c gets 500 IOPS +-10% while a client of u
             keeps at least 85% of the IOPS it gets alone (medians of
             0.25 s windows; alone and beside alternate every 1.5 s)
  live       on c: 500, then `nbdcachectl limit c client-iops-limit=200`
             -> 200, then SIGHUP with c's limit edited to 800 -> 800, each
             within 1 s
  bytes      64 KiB reads on b: 4 MiB/s +-10%; an 8 MiB READ (above the
             burst) goes once the bucket is full, the next READ pays for it
  export     two clients on e share 400 IOPS +-10%
  tls        on t: two connections as alice share 300; alice and bob get
             300 each
  uid        on t over the Unix socket: two root connections share 300;
             root and nobody get 300 each
  ip         on t over TCP: two connections from 127.0.0.1 share 300;
             127.0.0.1 and 127.0.0.2 (source addresses) get 300 each
  flush      on f, reads held back (1 a second), a FLUSH is answered at
             once; the reads complete after it, in time
  stats      throttled_requests and throttled_ns moved for f, the same on
             /metrics (nbdcached_qos_throttled_*); exports
             shows the limits
  order      WRITEs to one place on o (50 a second, burst 1) land in the
             order they were sent
  dropped    a client closing with requests held: they are dropped, its
             connection goes at once; at SIGTERM held requests end
             (ESHUTDOWN) and the daemon exits 0 in time
  bad        bad values refused at start, by --check-config (the message
             names key and value) and by nbdcachectl limit

bytes, export, tls, uid and ip run together, as the check "limits": each
is on an export or a client identity of its own, so that no limit is
another's; their first floods at once, then the second ones of tls, uid
and ip with bytes' 8 MiB READ beside them.

QOS_SECONDS (default 3; 2 at least) is how long the clients of bytes,
export, tls, uid and ip flood: their rates are measured over all but its
first second. The times of live scale with it (at 3: each limit measured
over 1.5, 1.5 and 2 s). make asan and make i386 set 2: the token buckets
are exact, a rate over 1 s is within a few requests of its limit, well
inside the 10%. QOS_ONLY=NAME runs one check (of limits' five, that one).
"""
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402

MIB = 1 << 20
SIZE = 16 * MIB
WINDOW = 0.25
# Each rate check's flood, seconds; its first second is left out.
FLOOD = float(os.environ.get("QOS_SECONDS", "3"))
NOBODY = 65534
# The checks of limits, run together (QOS_ONLY takes each name too).
LIMITS = ("bytes", "export", "tls", "uid", "ip")
CHECKS = nbdtest.Checks()
expect = CHECKS.expect
# Under ASan (make asan) the daemon is several times slower: the unlimited
# client's comparison is loosened, the limits themselves are not.
ASAN = "ASAN_OPTIONS" in os.environ
# How far the unlimited client's rate beside a limited one may stray from
# its rate alone: 15% here; make asan and make i386 (the chroot) set 0.5
# (QOS_ISOLATION_TOLERANCE in SHORT_REPEATS): the CI rehearsal at 0a61a3f
# saw the i386 pass swing 24%, 31% and 27% in three tries, both ways.
ISOLATION = float(os.environ.get("QOS_ISOLATION_TOLERANCE", "0.5" if ASAN else "0.15"))


def export_section(name, backend, limits):
    text = "[%s]\nbackend = %s\n" % (name, backend)
    for k, v in limits.items():
        text += "%s = %s\n" % (k, v)
    return text


def write_config(path, img, psk, c_limit=500):
    exports = [("c", {"client-iops-limit": c_limit}), ("u", {}),
               ("e", {"iops-limit": 400}), ("b", {"client-bytes-limit": "4M"}),
               ("t", {"client-iops-limit": 300}), ("f", {"client-iops-limit": 1}),
               ("o", {"client-iops-limit": 50, "client-iops-burst": 1})]
    text = "[generic]\ntls = on\ntls-psk = %s\n" % psk
    for name, limits in exports:
        text += export_section(name, img, limits)
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)


# ---- clients: forked processes, so that the GIL is nobody's bottleneck ----

def connect(d, export, tls_user=None, psk=None):
    """tls_user: a PSK user name, or "tcp:SOURCE:PORT" for plain TCP to
    127.0.0.1:PORT from the address SOURCE."""
    import nbd
    h = nbd.NBD()
    if tls_user and not tls_user.startswith("tcp:"):
        h.set_tls(nbd.TLS_REQUIRE)
        h.set_tls_psk_file(psk)
        h.set_tls_username(tls_user)
    h.set_export_name(export)
    if tls_user and tls_user.startswith("tcp:"):
        _, source, port = tls_user.split(":")
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.connect(("127.0.0.1", int(port)))
        h.connect_socket(s.detach())
    else:
        h.connect_unix(d.sock)
    return h


def flood(handles, start, duration, qd=8, size=4096, seed=1):
    """READs of size at random offsets, qd in flight on each handle, from
    time.time() == start for duration seconds: completions per WINDOW of
    each handle (a list per handle)."""
    import nbd
    rng = random.Random(seed)
    nwin = int(duration / WINDOW + 0.5)
    counts = [[0] * nwin for _ in handles]
    pending = [dict() for _ in handles]
    free = [[nbd.Buffer(size) for _ in range(qd)] for _ in handles]
    while time.time() < start:
        time.sleep(0.005)
    t0 = time.monotonic()
    end = t0 + duration
    for _ in range(10 ** 8):
        now = time.monotonic()
        if now >= end and not any(pending):
            break
        require(now < end + 30, "commands in flight 30 s after the end")
        for i, h in enumerate(handles):
            while now < end and free[i]:
                buf = free[i].pop()
                off = rng.randrange(SIZE // size) * size
                pending[i][h.aio_pread(buf, off)] = buf
        p = select.poll()
        for h in handles:
            d = h.aio_get_direction()
            ev = (select.POLLIN if d & nbd.AIO_DIRECTION_READ else 0) | \
                 (select.POLLOUT if d & nbd.AIO_DIRECTION_WRITE else 0)
            p.register(h.aio_get_fd(), ev or select.POLLIN)
        ready = {fd for fd, _ in p.poll(20)}
        for i, h in enumerate(handles):
            if h.aio_get_fd() in ready:
                if h.aio_get_direction() & nbd.AIO_DIRECTION_WRITE:
                    h.aio_notify_write()
                else:
                    h.aio_notify_read()
            t = time.monotonic()
            for cookie in [c for c in pending[i] if h.aio_command_completed(c)]:
                free[i].append(pending[i].pop(cookie))
                k = int((t - t0) / WINDOW)
                if k < nwin:
                    counts[i][k] += 1
    for h in handles:
        h.shutdown()
    return counts


def rate(counts, first=1.0, last=None):
    """Completions a second in [first, last) seconds of a flood."""
    a = int(first / WINDOW)
    b = len(counts) if last is None else int(last / WINDOW)
    return sum(counts[a:b]) / ((b - a) * WINDOW)


def median_rate(counts, first=0.5):
    v = sorted(counts[int(first / WINDOW):])
    return v[len(v) // 2] / WINDOW


def within(got, want, tolerance, what):
    ok = abs(got - want) <= tolerance * want
    log("%s: %.0f (want %.0f +-%d%%)%s" % (what, got, want, tolerance * 100,
                                            "" if ok else "  <-- FAIL"))
    expect(ok, "%s: %.0f, not %.0f +-%d%%" % (what, got, want, tolerance * 100))


def flood_child(d, export, duration, start=None, uid=None, n=1, users=None, psk=None,
                size=4096, seed=1):
    start = start or time.time() + 0.5
    users = users or [None] * n

    def run():
        return flood([connect(d, export, u, psk) for u in users], start, duration,
                     size=size, seed=seed)
    return nbdtest.Child(run, uid=uid)


def results(children):
    """{key: what each Child returned}, all of them waited for; Failed for
    the first that failed."""
    answers = {k: c.answer() for k, c in children.items()}
    for k, a in answers.items():
        if "error" in a:
            raise nbdtest.Failed("%s client: %s" % (k, a["error"]))
    return {k: a["result"] for k, a in answers.items()}


def ctl(d, *args, check_rc=True):
    return nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, *args],
                       check_rc=check_rc, timeout=30)


def main():
    if FLOOD < 2:       # a rate over 1 s at least
        nbdtest.fail("QOS_SECONDS=%g: 2 at least" % FLOOD)
    with nbdtest.tempdir() as tmp:
        img = os.path.join(tmp, "disk.img")
        nbdtest.random_file(img, SIZE)
        psk = os.path.join(tmp, "keys.psk")
        for user in ("alice", "bob"):
            nbdtest.run(["psktool", "-u", user, "-p", psk], timeout=60)
        conf = os.path.join(tmp, "nbdcached.conf")
        write_config(conf, img, psk)
        mport = nbdtest.free_port()
        with nbdtest.running_daemon([], extra=["--config", conf,
                                               "--metrics", "127.0.0.1:%d" % mport]) as d:
            # Every block in the cache: the reads below are hits.
            h = connect(d, "u")
            for off in range(0, SIZE, MIB):
                h.pread(MIB, off)
            h.shutdown()

            def isolation():
                # Phases of PHASE seconds, the unlimited client throughout,
                # the limited one in every other phase: alone and beside it
                # alternate, so a machine whose load drifts (a shared one)
                # drifts both alike. Medians of the 0.25 s windows, the first
                # window of each phase left out.
                phase, phases = 1.5, 6
                per = int(phase / WINDOW)
                # Up to three tries: the CI rehearsal of stop 35 saw the two
                # of old swing 17% one way (alone 50420, beside 41980 IOPS)
                # and 23% the other (41116, 50772) on an idle machine: noise
                # that no isolation fault makes point both ways.
                for attempt in range(3):
                    start = time.time() + 0.5
                    free = flood_child(d, "u", phase * phases, start=start, seed=2 + attempt)
                    lims = [flood_child(d, "c", phase, start=start + k * phase, seed=10 + k)
                            for k in range(1, phases, 2)]
                    free_counts = free.result()[0]
                    lim_rates = [rate(x.result()[0], first=WINDOW) for x in lims]
                    alone, beside = [], []
                    for k in range(phases):
                        (beside if k % 2 else alone).extend(
                            free_counts[k * per + 1:(k + 1) * per])
                    alone_rate, beside_rate = median_rate(alone, 0), median_rate(beside, 0)
                    log("unlimited alone %.0f, beside the limited one %.0f IOPS (medians); "
                        "limited %s" % (alone_rate, beside_rate,
                                        ["%.0f" % r for r in lim_rates]))
                    # A limit that leaked into another's bucket could only
                    # slow the unlimited client: faster beside the limited
                    # one is not a fault. The CI rehearsal at 398343e saw
                    # it faster in all three tries (alone 32144, 43284,
                    # 30872; beside 48668, 51508, 43928 IOPS): the daemon's
                    # threads kept busy by a second client answer sooner.
                    if attempt < 2 and beside_rate < alone_rate * (1 - ISOLATION):
                        log("retrying once: the machine is shared")
                        continue
                    break
                within(sum(lim_rates) / len(lim_rates), 500, 0.10, "client-iops-limit=500")
                ok = beside_rate >= alone_rate * (1 - ISOLATION)
                log("the unlimited client beside it: %.0f, alone %.0f (want at least -%d%%)%s"
                    % (beside_rate, alone_rate, ISOLATION * 100, "" if ok else "  <-- FAIL"))
                expect(ok, "the unlimited client beside it (vs alone): %.0f, below %.0f -%d%%"
                       % (beside_rate, alone_rate, ISOLATION * 100))

            def live():
                # Each limit measured over 1.5, 1.5 and 2 s (QOS_SECONDS 3),
                # the second and third from 1 s after the change.
                scale = (FLOOD - 1) / 2
                limited = 0.5 + 1.5 * scale
                reloaded = limited + 1 + 1.5 * scale
                end = reloaded + 1 + 2 * scale
                start = time.time() + 0.5
                child = flood_child(d, "c", end, start=start, seed=6)
                time.sleep(max(0.0, start + limited - time.time()))
                ctl(d, "limit", "c", "client-iops-limit=200")
                time.sleep(max(0.0, start + reloaded - time.time()))
                write_config(conf, img, psk, c_limit=800)
                os.kill(d.pid, signal.SIGHUP)
                counts = child.result()[0]
                within(rate(counts, 0.5, limited), 500, 0.10, "c at 500")
                within(rate(counts, limited + 1, reloaded), 200, 0.10,
                       "c 1 s after nbdcachectl limit ...=200")
                within(rate(counts, reloaded + 1, end), 800, 0.10,
                       "c 1 s after reload with 800")
                write_config(conf, img, psk)
                os.kill(d.pid, signal.SIGHUP)

            def limits():
                # bytes, export, tls, uid and ip at once, each on an export
                # or a client identity of its own (b; e; on t: alice and bob
                # by TLS, root and nobody by the Unix socket's uid, 127.0.0.1
                # and 127.0.0.2 by address), so that no limit is another's:
                # their clients ask for some 1500 READs a second in all, a
                # small part of what the daemon serves. The first flood of
                # each, then the second ones of tls, uid and ip with bytes'
                # 8 MiB READ beside them.
                only = os.environ.get("QOS_ONLY")
                parts = [p for p in LIMITS if only in (None, "limits", p)]
                one, two = "tcp:127.0.0.1:%d" % d.port, "tcp:127.0.0.2:%d" % d.port
                start = time.time() + 1.0
                floods = {}
                if "bytes" in parts:
                    floods["bytes"] = flood_child(d, "b", FLOOD, start=start, size=65536,
                                                  seed=7)
                if "export" in parts:
                    floods["export"] = flood_child(d, "e", FLOOD, start=start, n=2, seed=8)
                if "tls" in parts:
                    floods["tls"] = flood_child(d, "t", FLOOD, start=start,
                                                users=["alice", "alice"], psk=psk, seed=9)
                if "uid" in parts:
                    floods["uid"] = flood_child(d, "t", FLOOD, start=start, n=2, seed=11)
                if "ip" in parts:
                    # TCP: the client is its address, whatever its port.
                    floods["ip"] = flood_child(d, "t", FLOOD, start=start, users=[one, one],
                                               seed=14)
                counts = results(floods)
                if "bytes" in counts:
                    within(rate(counts["bytes"][0]) * 65536 / MIB, 4, 0.10,
                           "client-bytes-limit=4M, MiB/s of 64 KiB reads")
                if "export" in counts:
                    within(rate(counts["export"][0]) + rate(counts["export"][1]), 400, 0.10,
                           "iops-limit=400, two clients together")
                if "tls" in counts:
                    within(rate(counts["tls"][0]) + rate(counts["tls"][1]), 300, 0.10,
                           "two connections as alice together")
                if "uid" in counts:
                    within(rate(counts["uid"][0]) + rate(counts["uid"][1]), 300, 0.10,
                           "two root connections together")
                if "ip" in counts:
                    within(rate(counts["ip"][0]) + rate(counts["ip"][1]), 300, 0.10,
                           "two TCP connections from 127.0.0.1 together")

                if "uid" in parts:
                    os.chmod(tmp, 0o755)
                    os.chmod(d.tmp, 0o755)
                    os.chmod(d.sock, 0o777)
                start = time.time() + 1.0
                floods = {}
                if "tls" in parts:
                    floods["tls"] = flood_child(d, "t", FLOOD, start=start,
                                                users=["alice", "bob"], psk=psk, seed=10)
                if "uid" in parts:
                    floods["root"] = flood_child(d, "t", FLOOD, start=start, seed=12)
                    floods["nobody"] = flood_child(d, "t", FLOOD, start=start, uid=NOBODY,
                                                   seed=13)
                if "ip" in parts:
                    floods["ip"] = flood_child(d, "t", FLOOD, start=start, users=[one, two],
                                               seed=15)
                if "bytes" in parts:
                    # A READ above the burst goes once the bucket is full (it
                    # never starves); the next one pays its debt first.
                    h = connect(d, "b")
                    t0 = time.monotonic()
                    h.pread(8 * MIB, 0)
                    first = time.monotonic() - t0
                    h.pread(65536, 0)
                    second = time.monotonic() - t0 - first
                    h.shutdown()
                    log("8 MiB READ at 4 MiB/s: %.2f s, then 64 KiB: %.2f s" % (first, second))
                    expect(first < 1.5 and 0.8 < second < 1.6,
                           "8 MiB READ at 4 MiB/s, burst 4 MiB: %.2f s, the next %.2f s"
                           % (first, second))
                counts = results(floods)
                if "tls" in counts:
                    within(rate(counts["tls"][0]), 300, 0.10, "alice beside bob")
                    within(rate(counts["tls"][1]), 300, 0.10, "bob beside alice")
                if "root" in counts:
                    within(rate(counts["root"][0]), 300, 0.10, "root beside nobody")
                    within(rate(counts["nobody"][0]), 300, 0.10, "nobody beside root")
                if "ip" in counts:
                    within(rate(counts["ip"][0]), 300, 0.10, "127.0.0.1 beside 127.0.0.2")
                    within(rate(counts["ip"][1]), 300, 0.10, "127.0.0.2 beside 127.0.0.1")

            def flush():
                import nbd
                h = connect(d, "f")
                bufs = [nbd.Buffer(4096) for _ in range(4)]
                before = nbdtest.control_request(d.control, {"command": "stats",
                                                             "export": "f"})
                t0 = time.monotonic()
                reads = [h.aio_pread(b, i * 4096) for i, b in enumerate(bufs)]
                time.sleep(0.1)
                f0 = time.monotonic()
                h.flush()
                took = time.monotonic() - f0
                log("FLUSH took %.3f s with reads held back" % took)
                # (that it did not wait behind them: reads still held once
                # it is answered, below; its time is not asserted)
                # (aio_command_completed retires a command that completed)
                left = [c for c in reads if not h.aio_command_completed(c)]
                expect(len(left) >= 2, "%d of 4 reads done at once at 1 a second"
                       % (4 - len(left)))
                nbdtest.aio_wait([(h, c) for c in left], timeout=60)
                took = time.monotonic() - t0
                # At 1 a second, the last of 4 (one from the burst) cannot
                # be answered before 3 s: a lower bound the limiter
                # guarantees; how much later a busy machine makes it is not
                # asserted.
                expect(took > 2.5, "4 reads at 1 a second took %.2f s" % took)
                h.shutdown()
                after = nbdtest.control_request(d.control, {"command": "stats",
                                                            "export": "f"})
                b, a = before["exports"][0], after["exports"][0]
                log("f: throttled_requests %d -> %d, throttled_ns %d -> %d"
                    % (b["throttled_requests"], a["throttled_requests"],
                       b["throttled_ns"], a["throttled_ns"]))
                expect(a["throttled_requests"] >= b["throttled_requests"] + 2,
                       "throttled_requests did not move")
                expect(a["throttled_ns"] - b["throttled_ns"] > 2 * 10 ** 9,
                       "throttled_ns moved by %d ns only"
                       % (a["throttled_ns"] - b["throttled_ns"]))
                # The same counters on /metrics (idle now: they stay put).
                import urllib.request
                with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % mport,
                                            timeout=10) as r:
                    page = r.read().decode()
                series = {}
                for line in page.splitlines():
                    if line.startswith("nbdcached_qos_throttled_") and 'export="f"' in line:
                        series[line.split("{")[0]] = float(line.split()[-1])
                log("/metrics: %s" % series)
                expect(series.get("nbdcached_qos_throttled_requests_total")
                       == a["throttled_requests"]
                       and abs(series.get("nbdcached_qos_throttled_seconds_total", -1)
                               - a["throttled_ns"] / 1e9) < 1e-6,
                       "/metrics' throttled series %s, stats %d requests %d ns"
                       % (series, a["throttled_requests"], a["throttled_ns"]))
                ex = {e["name"]: e for e in
                      nbdtest.control_request(d.control, {"command": "exports"})["exports"]}
                expect(ex["f"]["limits"]["client_iops_limit"] == 1
                       and ex["b"]["limits"]["client_bytes_limit"] == 4 * MIB
                       and ex["u"]["limits"]["iops_limit"] == 0,
                       "exports' limits: %s" % {k: v["limits"] for k, v in ex.items()})
                out = ctl(d, "stats", "f").stdout.splitlines()
                # The exports table (a latency table follows it): sizes hold
                # a space, the last two columns are the QoS ones.
                head = next((i for i, line in enumerate(out)
                             if line.split()[-2:] == ["THROTTLED", "THROTTLED-S"]), None)
                row = out[head + 1].split() if head is not None and head + 1 < len(out) else []
                expect(len(row) >= 2 and row[-2] == str(a["throttled_requests"])
                       and float(row[-1]) > 2,
                       "nbdcachectl stats f: %r" % out)

            def bad_ctl():
                p = ctl(d, "limit", "c", "iops-limit=fast", check_rc=False)
                expect(p.returncode == 1 and "iops-limit fast" in p.stderr,
                       "nbdcachectl limit with a bad value: exit %d, %r"
                       % (p.returncode, p.stderr))
                p = ctl(d, "limit", "c", "iops-limits=5", check_rc=False)
                expect(p.returncode == 1 and "unknown limit" in p.stderr,
                       "nbdcachectl limit with an unknown key: %r" % p.stderr)
                p = ctl(d, "limit", "nosuch", "iops-limit=5", check_rc=False)
                expect(p.returncode == 1, "nbdcachectl limit of no export")

            def order():
                # WRITEs to one place, held back but the first: they land in
                # the order they were sent (the last one's data is read).
                h = connect(d, "o")
                datas = [bytes([k + 1]) * 65536 for k in range(10)]
                t0 = time.monotonic()
                nbdtest.aio_wait([(h, h.aio_pwrite(x, SIZE - 65536)) for x in datas])
                took = time.monotonic() - t0
                # 9 held 20 ms each at least (a lower bound the limiter
                # guarantees); the order below is the point.
                expect(took > 0.12, "10 WRITEs at 50 a second, burst 1, took %.2f s"
                       % took)
                got = h.pread(65536, SIZE - 65536)
                expect(got == datas[-1], "held WRITEs landed out of order: %d" % got[0])
                h.shutdown()

            def dropped():
                # A client that goes with requests held: they are dropped at
                # once (no leak: LeakSanitizer under make asan), the daemon
                # serves on.
                import nbd
                h = connect(d, "f")
                bufs = [nbd.Buffer(65536) for _ in range(50)]
                for i, b in enumerate(bufs):
                    h.aio_pread(b, i * 65536)
                time.sleep(0.3)
                conns = nbdtest.control_request(d.control, {"command": "connections"})
                held = [c for c in conns["connections"] if c["export"] == "f"]
                expect(held and held[0]["inflight"] >= 40,
                       "held requests are in flight: %s" % held)
                del h, bufs  # closes the socket, no DISC
                gone = nbdtest.wait_until(lambda: not [
                    c for c in nbdtest.control_request(
                        d.control, {"command": "connections"})["connections"]
                    if c["export"] == "f"], 3)
                expect(gone, "the connection with held requests is still there 3 s after "
                       "its client closed it")

            only = os.environ.get("QOS_ONLY")   # NAME: one check, while working on it
            for name, fn in (("isolation", isolation), ("live", live), ("limits", limits),
                             ("flush", flush),
                             ("order", order), ("dropped", dropped), ("bad_ctl", bad_ctl)):
                if only not in (None, name) and not (name == "limits" and only in LIMITS):
                    continue
                CHECKS.run(name, fn)
                require(d.alive(), "nbdcached died in %s" % name)
            # SIGTERM with requests held: they are answered ESHUTDOWN and
            # the daemon exits 0 at once (running_daemon checks).
            import nbd
            last = connect(d, "f")
            last_bufs = [nbd.Buffer(4096) for _ in range(20)]
            for i, b in enumerate(last_bufs):
                last.aio_pread(b, i * 4096)
            time.sleep(0.2)
            stop_at = time.monotonic()
        took = time.monotonic() - stop_at
        log("stopped in %.2f s with 19 requests held" % took)
        # Held requests are dropped, not served: serving them at 1 a second
        # would take 19 s; dropped, the stop takes what a stop takes.
        expect(took < 15, "SIGTERM with requests held took %.2f s (they were served, "
               "not dropped?)" % took)
        del last, last_bufs

        def bad():
            p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--export",
                                "x=%s,client-bytes-limit=4Q" % img],
                               capture_output=True, text=True, timeout=30)
            log(p.stderr.strip())
            expect(p.returncode != 0 and "client-bytes-limit 4Q" in p.stderr,
                   "--export with client-bytes-limit=4Q: exit %d, %r"
                   % (p.returncode, p.stderr))
            bad_conf = os.path.join(tmp, "bad.conf")
            with open(bad_conf, "w") as f:
                f.write("[x]\nbackend = %s\niops-limit = -3\n" % img)
            p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--config", bad_conf],
                               capture_output=True, text=True, timeout=30)
            log(p.stderr.strip())
            expect(p.returncode != 0 and "iops-limit -3" in p.stderr and "bad.conf:3" in
                   p.stderr, "config iops-limit = -3: exit %d, %r" % (p.returncode, p.stderr))
            with open(bad_conf, "w") as f:
                f.write("[x]\nbackend = %s\nbytes-limit = 5M\nbytes_limit = 6M\n" % img)
            p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--config", bad_conf],
                               capture_output=True, text=True, timeout=30)
            log(p.stderr.strip())
            expect(p.returncode != 0 and "bad.conf:4: 'bytes_limit' given twice" in p.stderr,
                   "a limit given twice: exit %d, %r" % (p.returncode, p.stderr))
            p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--unix",
                                os.path.join(tmp, "x.sock"), "--export",
                                "x=%s,iops-limit=1.5" % img],
                               capture_output=True, text=True, timeout=30)
            log(p.stderr.strip())
            expect(p.returncode != 0 and "iops-limit 1.5" in p.stderr,
                   "start with iops-limit=1.5: exit %d, %r" % (p.returncode, p.stderr))
            p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--export",
                                "x=%s,iops-limit=off,client-iops-limit=10K" % img],
                               capture_output=True, text=True, timeout=30)
            expect(p.returncode == 0, "good limits refused: %r" % p.stderr)

        CHECKS.run("bad", bad)
    CHECKS.finish("qos")


if __name__ == "__main__":
    main()
