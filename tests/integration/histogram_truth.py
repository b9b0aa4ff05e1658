#!/usr/bin/python3
"""histogram_truth: the latency histograms tell the truth about a backend
whose every read takes 5 ms (nbdkit memory behind the delay filter,
rdelay=5ms, started by the daemon).

  40 cold 4 KiB READs, 1 MiB apart (no read-ahead): each a miss, each at
  least 5 ms. Then 400 READs of the same blocks: each a hit. The client
  times every READ too: a request's time in the daemon is part of its time
  at the client, so the daemon's quantiles can be no larger than the
  client's (the buckets are 12.5% wide: 15% is allowed), whatever else
  the machine is doing. No bound is a wall-clock figure of its own but the
  delay filter's 5 ms, below which no miss can be.

  stats      `nbdcachectl stats --json`'s latency: read_miss count 40 and
             p50 at least 5 ms and at most the client's miss p50; read_hit
             count 400, p50 and p99 at most the client's hit p50 and p99,
             and its p50 below the miss p50; backend p50 at least 5 ms and
             at most the client's miss p50. The human output shows the
             same p50 / p99 / p999.
  metrics    the /metrics histograms give the same: the read_miss and
             read_hit p50 computed from the cumulative buckets the way
             Prometheus' histogram_quantile() does (linear inside the
             bucket) within the same bounds, the counts 40 and 400.
"""

import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
from nbdtest import require as expect  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
MS = 1000000
MISSES, HIT_ROUNDS = 40, 10
BACKEND = "nbdkit:--filter=delay memory size=64M rdelay=5ms"
SLACK = 1.15                 # a quantile from the buckets: within 12.5%
CLIENT = {}                  # kind -> the client's times, ns


def quantile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def workload(d):
    h = nbdtest.libnbd_handle(d.unix_uri("slow"))
    offsets = [i * MIB for i in range(MISSES)]
    CLIENT["read_miss"], CLIENT["read_hit"] = [], []
    for off in offsets:
        t0 = time.monotonic_ns()
        h.pread(4 * KIB, off)
        CLIENT["read_miss"].append(time.monotonic_ns() - t0)
    for _ in range(HIT_ROUNDS):
        for off in offsets:
            t0 = time.monotonic_ns()
            h.pread(4 * KIB, off)
            CLIENT["read_hit"].append(time.monotonic_ns() - t0)
    h.shutdown()
    for kind in ("read_miss", "read_hit"):
        log("  client %-9s p50 %8.3f ms p99 %8.3f ms" % (
            kind, quantile(CLIENT[kind], 0.5) / MS, quantile(CLIENT[kind], 0.99) / MS))


def from_stats(d):
    out = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, "stats", "--json"],
                      timeout=30).stdout
    lat = json.loads(out)["exports"][0]["latency"]
    for kind in ("read_miss", "read_hit", "backend"):
        x = lat[kind]
        log("  stats %-9s count %4d p50 %8.3f ms p99 %8.3f ms p999 %8.3f ms" % (
            kind, x["count"], x["p50_ns"] / MS, x["p99_ns"] / MS, x["p999_ns"] / MS))
    miss, hit, backend = lat["read_miss"], lat["read_hit"], lat["backend"]
    expect(miss["count"] == MISSES, "read_miss count %d, expected %d" % (miss["count"], MISSES))
    cmiss = quantile(CLIENT["read_miss"], 0.5)
    chit50, chit99 = quantile(CLIENT["read_hit"], 0.5), quantile(CLIENT["read_hit"], 0.99)
    expect(5 * MS <= miss["p50_ns"] <= SLACK * cmiss,
           "read_miss p50 %.3f ms, expected 5 ms .. the client's %.3f ms"
           % (miss["p50_ns"] / MS, cmiss / MS))
    expect(hit["count"] == MISSES * HIT_ROUNDS,
           "read_hit count %d, expected %d" % (hit["count"], MISSES * HIT_ROUNDS))
    expect(hit["p50_ns"] <= SLACK * chit50, "read_hit p50 %.3f ms, above the client's %.3f ms"
           % (hit["p50_ns"] / MS, chit50 / MS))
    expect(hit["p99_ns"] <= SLACK * chit99, "read_hit p99 %.3f ms, above the client's %.3f ms"
           % (hit["p99_ns"] / MS, chit99 / MS))
    expect(hit["p50_ns"] < miss["p50_ns"], "read_hit p50 %.3f ms not below read_miss p50 %.3f ms"
           % (hit["p50_ns"] / MS, miss["p50_ns"] / MS))
    expect(backend["count"] >= MISSES, "backend count %d < %d misses" % (backend["count"], MISSES))
    expect(5 * MS <= backend["p50_ns"] <= SLACK * cmiss,
           "backend p50 %.3f ms, expected 5 ms .. the client's miss p50 %.3f ms"
           % (backend["p50_ns"] / MS, cmiss / MS))
    human = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, "stats"],
                        timeout=30).stdout
    rows = [ln for ln in human.splitlines() if "read_miss" in ln]
    log("  nbdcachectl stats: %s" % (rows[0].strip() if rows else "(no read_miss row)"))
    expect(rows and "P50" in human and "P999" in human,
           "nbdcachectl stats shows no read_miss percentiles:\n" + human)


def bucket_quantile(q, buckets):
    """Prometheus' histogram_quantile(): buckets [(le, cumulative count)]."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def from_metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    buckets = {"read_miss": [], "read_hit": []}
    counts = {}
    for line in text.splitlines():
        if not line.startswith("nbdcached_request_duration_seconds"):
            continue
        name, value = line.rsplit(" ", 1)
        labels = dict(kv.split("=", 1) for kv in name[name.index("{") + 1:-1].split(","))
        kind = labels["kind"].strip('"')
        if kind not in buckets:
            continue
        if name.startswith("nbdcached_request_duration_seconds_bucket"):
            le = labels["le"].strip('"')
            buckets[kind].append((float("inf") if le == "+Inf" else float(le), float(value)))
        elif name.startswith("nbdcached_request_duration_seconds_count"):
            counts[kind] = float(value)
    miss = bucket_quantile(0.5, buckets["read_miss"])
    hit = bucket_quantile(0.5, buckets["read_hit"])
    log("  /metrics read_miss count %d p50 %.3f ms (%d buckets); read_hit count %d p50 %.3f ms"
        % (counts.get("read_miss", -1), miss * 1e3, len(buckets["read_miss"]),
           counts.get("read_hit", -1), hit * 1e3))
    expect(counts.get("read_miss") == MISSES, "/metrics read_miss count %r" % counts.get("read_miss"))
    expect(counts.get("read_hit") == MISSES * HIT_ROUNDS,
           "/metrics read_hit count %r" % counts.get("read_hit"))
    cmiss = quantile(CLIENT["read_miss"], 0.5) / 1e9
    chit = quantile(CLIENT["read_hit"], 0.5) / 1e9
    expect(0.005 <= miss <= SLACK * cmiss, "/metrics read_miss p50 %.3f ms, expected 5 ms .. "
           "the client's %.3f ms" % (miss * 1e3, cmiss * 1e3))
    expect(hit <= SLACK * chit and hit < miss, "/metrics read_hit p50 %.3f ms, expected at most "
           "the client's %.3f ms and below the miss p50" % (hit * 1e3, chit * 1e3))


def main():
    checks = nbdtest.Checks()
    port = nbdtest.free_port()
    with nbdtest.Daemon([("slow", BACKEND, "")], extra=["--metrics", "127.0.0.1:%d" % port,
                                                         "--cache-size", "64M"]) as d:
        if checks.run("workload", workload, d):
            checks.run("stats", from_stats, d)
            checks.run("metrics", from_metrics, port)
        checks.dump_log(d)
    checks.finish("histogram_truth")


if __name__ == "__main__":
    main()
