#!/usr/bin/python3
"""metrics_prometheus: the /metrics page as Debian's Prometheus sees it.

  scrape     a real prometheus (temporary config and storage, 1 s scrape
             interval, the daemon's --metrics address its only target)
             scrapes the daemon; a known workload runs through libnbd
             (20 cold READs, the same 20 again, 24 WRITEs, 7 FLUSHes of
             4 KiB, the connection kept open); after a scrape that came
             after it, Prometheus' HTTP API (/api/v1/query) must show every
             counter moved by exactly that: requests by command, bytes,
             hits and misses, errors none, the FLUSH histogram's _count 7,
             the READ histograms' counts 20 and 20, one connection
  lint       `promtool check metrics` on the page fetched directly: exit 0
             and nothing said; other paths are 404, POST is 405
  deny       metrics-deny 127.0.0.2: a client from 127.0.0.2 gets its
             connection closed without an HTTP answer (nbdcached(8):
             refused clients are disconnected at accept, as NBD clients
             are), while 127.0.0.1 (Prometheus) is served
  allow      a second daemon with metrics-allow 127.0.0.2 only: 127.0.0.1 is
             refused, 127.0.0.2 served
  reload     a third daemon with metrics, metrics-allow and metrics-deny in
             its config file's [generic]: a reload that changes the rules
             applies them to the next connection; one that changes the
             address is refused (refused_settings: metrics) and the old
             address keeps serving
  device     a daemon with a cache device: the page has the device's
             series (failed 0, level 2 on, ...) and promtool check metrics
             passes; the alert rules in configs/prometheus/ pass `promtool
             check rules` and their unit tests (`promtool test rules`),
             and every series the rules and the Grafana dashboard name is
             on such a page

Prometheus is started and stopped by its PID; every wait is bounded.
"""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
from nbdtest import require as expect  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
COLD_READS, WRITES, FLUSHES = 20, 24, 7


def fetch(port, path="/metrics", source="127.0.0.1", method="GET"):
    """(status, content type, body) of one request from a chosen source
    address; raises OSError / HTTPException when the connection is closed."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        c.close()


def refused(port, source):
    """True when a client from source gets no HTTP answer (closed)."""
    try:
        status, _, _ = fetch(port, source=source)
    except (OSError, http.client.HTTPException) as e:
        log("  from %s: %s (refused)" % (source, type(e).__name__))
        return True
    log("  from %s: HTTP %d" % (source, status))
    return False


class Prometheus:
    def __init__(self, tmp, target):
        self.port = nbdtest.free_port()
        conf = os.path.join(tmp, "prometheus.yml")
        with open(conf, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: nbdcached\n    static_configs:\n"
                    "      - targets: ['%s']\n" % target)
        self.logf = open(os.path.join(tmp, "prometheus.log"), "w")
        args = [PROMETHEUS, "--config.file=" + conf,
                "--storage.tsdb.path=" + os.path.join(tmp, "tsdb"),
                "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"]
        log("+ " + " ".join(args))
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT)

    def ready(self):
        if self.proc.poll() is not None:
            raise nbdtest.Failed("prometheus exited with %d" % self.proc.returncode)
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.port,
                                        timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr):
        """The instant vector of expr: {labels (frozen): float value}."""
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (
            self.port, urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as r:
            reply = json.load(r)
        if reply.get("status") != "success":
            raise nbdtest.Failed("query %s: %r" % (expr, reply))
        return {frozenset(v["metric"].items()): float(v["value"][1])
                for v in reply["data"]["result"]}

    def scalar(self, expr):
        v = self.query(expr)
        if len(v) != 1:
            raise nbdtest.Failed("query %s: %d series, expected 1: %r" % (expr, len(v), v))
        return next(iter(v.values()))

    def last_scrape(self):
        """When the target was last scraped (its up sample's time), or 0."""
        v = self.query('timestamp(up{job="nbdcached"})')
        return max(v.values()) if v else 0.0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # by PID
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


SERIES = {
    "reads": 'nbdcached_requests_total{export="m",command="read"}',
    "writes": 'nbdcached_requests_total{export="m",command="write"}',
    "flushes": 'nbdcached_requests_total{export="m",command="flush"}',
    "read_bytes": 'nbdcached_read_bytes_total{export="m"}',
    "written_bytes": 'nbdcached_written_bytes_total{export="m"}',
    "hits": 'nbdcached_cache_hits_total{export="m"}',
    "misses": 'nbdcached_cache_misses_total{export="m"}',
    "errors": 'nbdcached_errors_total{export="m"}',
    "flush_count": 'nbdcached_request_duration_seconds_count{export="m",kind="flush"}',
    "write_count": 'nbdcached_request_duration_seconds_count{export="m",kind="write"}',
    "hit_count": 'nbdcached_request_duration_seconds_count{export="m",kind="read_hit"}',
    "miss_count": 'nbdcached_request_duration_seconds_count{export="m",kind="read_miss"}',
    "flush_inf": 'nbdcached_request_duration_seconds_bucket{export="m",kind="flush",le="+Inf"}',
}


def scrape(prom, d):
    expect(nbdtest.wait_until(lambda: prom.last_scrape() > 0, 60, step=0.5),
           "prometheus did not scrape the daemon within 60 s")
    up = prom.scalar('up{job="nbdcached"}')
    expect(up == 1, "up is %r: the scrape failed" % up)
    before = {k: prom.scalar(e) for k, e in SERIES.items()}
    log("  before: %r" % before)
    h = nbdtest.libnbd_handle(d.unix_uri("m"))
    offsets = [i * MIB for i in range(COLD_READS)]  # apart: no read-ahead
    for off in offsets + offsets:
        h.pread(4 * KIB, off)
    for i in range(WRITES):
        h.pwrite(bytes([i + 1]) * (4 * KIB), 32 * MIB + i * 64 * KIB)
    for _ in range(FLUSHES):
        h.flush()
    done = time.time()
    expect(nbdtest.wait_until(lambda: prom.last_scrape() > done + 0.1, 30, step=0.25),
           "no scrape within 30 s after the workload")
    after = {k: prom.scalar(e) for k, e in SERIES.items()}
    log("  after:  %r" % after)
    want = {"reads": 2 * COLD_READS, "writes": WRITES, "flushes": FLUSHES,
            "read_bytes": 2 * COLD_READS * 4 * KIB, "written_bytes": WRITES * 4 * KIB,
            "hits": COLD_READS, "misses": COLD_READS, "errors": 0,
            "flush_count": FLUSHES, "write_count": WRITES, "hit_count": COLD_READS,
            "miss_count": COLD_READS, "flush_inf": FLUSHES}
    for k, n in want.items():
        got = after[k] - before[k]
        expect(got == n, "%s moved by %r in Prometheus, expected %d" % (SERIES[k], got, n))
    conns = prom.scalar('nbdcached_connections{export="m"}')
    expect(conns == 1, "nbdcached_connections is %r with one client attached" % conns)
    # The histogram in Prometheus' own terms: the FLUSHes' p100 is finite.
    q = prom.scalar('histogram_quantile(1, nbdcached_request_duration_seconds_bucket'
                    '{export="m",kind="flush"})')
    expect(0 < q < 10, "FLUSH p100 from Prometheus' histogram_quantile: %r" % q)
    h.shutdown()


def lint(port):
    status, ctype, body = fetch(port)
    expect(status == 200, "GET /metrics: HTTP %d" % status)
    expect(ctype == "text/plain; version=0.0.4; charset=utf-8",
           "Content-Type %r" % ctype)
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                       timeout=60)
    said = (p.stdout + p.stderr).decode(errors="replace").strip()
    log("  promtool check metrics: exit %d%s" % (p.returncode, (": " + said) if said else ""))
    expect(p.returncode == 0 and not said,
           "promtool check metrics: exit %d, %r" % (p.returncode, said))
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    log("  %d samples, %d bytes" % (len(lines), len(body)))
    status, _, _ = fetch(port, "/other")
    expect(status == 404, "GET /other: HTTP %d, expected 404" % status)
    status, _, _ = fetch(port, method="POST")
    expect(status == 405, "POST /metrics: HTTP %d, expected 405" % status)


def deny(port):
    expect(refused(port, "127.0.0.2"), "metrics-deny 127.0.0.2: 127.0.0.2 was served")
    expect(not refused(port, "127.0.0.1"), "127.0.0.1 was refused without a rule against it")


def allow(backend):
    port = nbdtest.free_port()
    with nbdtest.running_daemon([("m", backend, "")],
                                extra=["--metrics", "127.0.0.1:%d" % port,
                                       "--metrics-allow", "127.0.0.2"]):
        expect(refused(port, "127.0.0.1"), "metrics-allow 127.0.0.2: 127.0.0.1 was served")
        expect(not refused(port, "127.0.0.2"), "metrics-allow 127.0.0.2: 127.0.0.2 refused")


def reload(tmp, backend):
    port, other = nbdtest.free_port(), nbdtest.free_port()
    conf = os.path.join(tmp, "reload.conf")
    generic = "[generic]\nmetrics = 127.0.0.1:%d\nmetrics-allow = 127.0.0.0/8\n" % port

    def write(text):
        with open(conf, "w") as f:
            f.write(text)

    write(generic + "metrics-deny = 127.0.0.2\n")
    with nbdtest.running_daemon([("m", backend, "")], extra=["--config", conf]) as d:
        expect(refused(port, "127.0.0.2"), "config metrics-deny 127.0.0.2: 127.0.0.2 served")
        expect(not refused(port, "127.0.0.3"), "127.0.0.3 refused before the reload")
        write(generic + "metrics-deny = 127.0.0.3\n")
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok") and r.get("refused_settings") == [], "rules reload: %r" % r)
        expect(not refused(port, "127.0.0.2"), "after the reload 127.0.0.2 is still refused")
        expect(refused(port, "127.0.0.3"), "after the reload 127.0.0.3 is still served")
        write(generic.replace(str(port), str(other)))
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok") and r.get("refused_settings") == ["metrics"],
               "a new metrics address must be refused at reload: %r" % r)
        expect(not refused(port, "127.0.0.1"), "the old address stopped serving")


RULES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs",
                         "prometheus")


def device(tmp, backend):
    dev = os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(dev, 96 * MIB)
    nbdtest.own_device(dev)
    workdir = os.path.join(tmp, "device")
    os.makedirs(workdir)
    port = nbdtest.free_port()
    with nbdtest.Daemon([("m", backend, "")], workdir=workdir,
                        extra=["--metrics", "127.0.0.1:%d" % port, "--cache-device", dev]):
        status, _, body = fetch(port)
    expect(status == 200, "GET /metrics: HTTP %d" % status)
    page = body.decode()
    for want in ("nbdcached_cache_device_failed 0", "nbdcached_cache_device_l2_on 1",
                 "nbdcached_cache_device_replay_pending_bytes 0",
                 "nbdcached_cache_device_l2_checksum_errors_total 0",
                 'nbdcached_export_fenced{export="m"} 0'):
        expect(want in page, "the page lacks %r" % want)
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                       timeout=60)
    said = (p.stdout + p.stderr).decode(errors="replace").strip()
    expect(p.returncode == 0 and not said, "promtool check metrics (a cache device): exit %d, %r"
           % (p.returncode, said))
    families = set(re.findall(r"^# TYPE (\S+) ", page, re.M))
    rules = os.path.join(RULES_DIR, "nbdcached-alerts.yml")
    for args in (["check", "rules", rules],
                 ["test", "rules", os.path.join(RULES_DIR, "nbdcached-alerts.test.yml")]):
        p = subprocess.run([PROMTOOL] + args, capture_output=True, text=True, timeout=120)
        log("  promtool %s: exit %d" % (" ".join(args[:2]), p.returncode))
        expect(p.returncode == 0, "promtool %s: exit %d\n%s" % (" ".join(args[:2]), p.returncode,
                                                                (p.stdout + p.stderr)[-2000:]))
    named = set()
    with open(rules) as f:
        named |= set(re.findall(r"nbdcached_[a-z0-9_]+", f.read()))
    with open(os.path.join(RULES_DIR, "grafana-nbdcached.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    exprs += [v.get("query", "") for v in dash["templating"]["list"]]
    for e in exprs:
        named |= set(re.findall(r"nbdcached_[a-z0-9_]+", e))
    base = {re.sub(r"_(bucket|count|sum)$", "", n) if n not in families else n for n in named}
    missing = sorted(n for n in base if n not in families)
    log("  the rules and the dashboard name %d series, %d panels" % (len(base), len(dash["panels"])))
    expect(not missing, "named by the rules or the dashboard, not on the page: %s" % missing)


def main():
    for tool in (PROMETHEUS, PROMTOOL):
        if not os.access(tool, os.X_OK):
            nbdtest.fail("%s missing (scripts/deps installs prometheus)" % tool)
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        backend = os.path.join(tmp, "disk.img")
        nbdtest.sparse_file(backend, 64 * MIB)
        workdir = os.path.join(tmp, "daemon")  # the daemon removes it when it stops
        os.makedirs(workdir)
        port = nbdtest.free_port()
        prom = None
        with nbdtest.Daemon([("m", backend, "")], workdir=workdir,
                            extra=["--metrics", "127.0.0.1:%d" % port,
                                   "--metrics-deny", "127.0.0.2"]) as d:
            try:
                prom = Prometheus(tmp, "127.0.0.1:%d" % port)
                if not nbdtest.wait_until(prom.ready, 60, step=0.5):
                    checks.add("prometheus not ready within 60 s")
                else:
                    checks.run("scrape", scrape, prom, d)
                checks.run("lint", lint, port)
                checks.run("deny", deny, port)
            finally:
                if prom:
                    prom.stop()
                    if checks.failures:
                        with open(os.path.join(tmp, "prometheus.log")) as f:
                            log("---- prometheus log ----\n" + f.read()[-3000:])
            checks.dump_log(d)
        checks.run("allow", allow, backend)
        checks.run("reload", reload, tmp, backend)
        checks.run("device", device, tmp, backend)
    checks.finish("metrics_prometheus")


if __name__ == "__main__":
    main()
