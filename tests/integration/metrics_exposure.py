#!/usr/bin/python3
"""metrics_exposure: what the /metrics listener shows, to whom, and that
clients cannot take it away from a scraper (issue 40, item 9). Each check
failed on main before the fix.

  loopback     --metrics :PORT binds loopback only: a client of 127.0.0.1
               is served, a connect to 127.0.0.2:PORT is refused; both
               --check-config with --metrics :PORT and with the config key
               say http://127.0.0.1:PORT/metrics
  names        an export with access rules of its own (allow = 127.0.0.2,
               so LIST from 127.0.0.1 does not show it) and one with
               allow-users are not on the page, an export without rules is;
               a reload with metrics-export-names = all puts them on it, one
               back to listed takes them off; --metrics-export-names takes
               listed and all and refuses anything else
  descriptors  with 1,100 NBD clients connected (the daemon past 1,024
               descriptors, select()'s FD_SETSIZE) a scrape is answered, and
               counts them in nbdcached_clients
  slow         63 clients that connect and send nothing (15 from 127.0.0.1,
               12 each from 127.0.0.2..5) do not keep a scraper of 127.0.0.1
               from being answered while they are all still connected
  full         with 64 of them (every slot, 16 from each of 127.0.0.2..5) a
               scraper of 127.0.0.1 is answered (bounded: 60 s; it waits for
               the idle timeout), and the daemon closes all 64 (60 s)
  log          200 connections from one address past its per-address limit
               give at most a burst of libmicrohttpd's lines in the log, and
               a "suppressed" count for the rest

Every wait is bounded; the only times asserted are generous bounds.
"""

import http.client
import json
import os
import resource
import select
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
from nbdtest import require as expect  # noqa: E402

MIB = 1 << 20
CLIENTS = 1100          # NBD clients held open: past FD_SETSIZE (1024)
SLOTS = 64              # the daemon's HTTP connection limit (nbdcached(8), METRICS)
PER_ADDRESS = 16        # ... and per-address limit
LOG_BURST = 10          # LOG_LIMIT_BURST (daemon/log.h)


def fetch(port, source="127.0.0.1", host="127.0.0.1", timeout=60):
    """(status, body) of GET /metrics from source; raises OSError or
    HTTPException when the connection is refused or closed."""
    c = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0))
    try:
        c.request("GET", "/metrics")
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def page(port, what):
    try:
        status, body = fetch(port)
    except (OSError, http.client.HTTPException) as e:
        raise nbdtest.Failed("%s: GET /metrics from 127.0.0.1: %s: %s"
                             % (what, type(e).__name__, e))
    expect(status == 200, "%s: GET /metrics: HTTP %d" % (what, status))
    return body


def silent_clients(port, sources):
    """One TCP connection to the metrics port per item of sources (its
    source address), each sending nothing."""
    socks = []
    try:
        for src in sources:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(10)
            s.bind((src, 0))
            s.connect(("127.0.0.1", port))
    except OSError:
        close_all(socks)
        raise
    return socks


def closed_by_peer(s):
    """True when the daemon has closed s (EOF or reset), without waiting."""
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def close_all(socks):
    for s in socks:
        s.close()


def check_config(*args):
    p = subprocess.run([nbdtest.NBDCACHED, "--check-config", *args], capture_output=True,
                       text=True, errors="replace", timeout=60)
    return p.returncode, p.stdout + p.stderr


def loopback(tmp, backend):
    port = nbdtest.free_port()
    with nbdtest.running_daemon([("m", backend, "")], extra=["--metrics", ":%d" % port]):
        body = page(port, ":PORT")
        expect("nbdcached_cache_size_bytes" in body, ":PORT: no cache gauge on the page")
        try:
            with socket.create_connection(("127.0.0.2", port), timeout=10):
                pass
            log("  127.0.0.2:%d: connected" % port)
            reached = True
        except ConnectionRefusedError:
            log("  127.0.0.2:%d: connection refused" % port)
            reached = False
        expect(not reached, "--metrics :%d is reachable on 127.0.0.2: it binds every "
               "address, not loopback" % port)
    want = "http://127.0.0.1:%d/metrics" % port
    rc, out = check_config("--export", "m=" + backend, "--metrics", ":%d" % port)
    log("  --check-config --metrics :%d: exit %d, %s" % (
        port, rc, [ln for ln in out.splitlines() if "metrics on" in ln]))
    expect(rc == 0 and want in out, "--check-config --metrics :%d does not say %s: %s"
           % (port, want, out))
    conf = os.path.join(tmp, "loopback.conf")
    with open(conf, "w") as f:
        f.write("[generic]\nmetrics = :%d\n[m]\nbackend = %s\n" % (port, backend))
    rc, out = check_config("--config", conf)
    expect(rc == 0 and want in out, "--check-config with metrics = :%d does not say %s: %s"
           % (port, want, out))


def listed(port):
    """The export names LIST gives a TCP client of 127.0.0.1 (nbdinfo)."""
    p = subprocess.run(["nbdinfo", "--list", "--json", "nbd://127.0.0.1:%d" % port],
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise nbdtest.Failed("nbdinfo --list: exit %d: %s" % (p.returncode, p.stderr))
    return sorted(e["export-name"] for e in json.loads(p.stdout)["exports"])


def names_on(body):
    return sorted({ln.split('export="', 1)[1].split('"', 1)[0]
                   for ln in body.splitlines() if 'export="' in ln and not ln.startswith("#")})


def names(tmp):
    files = {}
    for n in ("pub", "priv", "users"):
        files[n] = os.path.join(tmp, n + ".img")
        nbdtest.sparse_file(files[n], 4 * MIB)
    port = nbdtest.free_port()
    conf = os.path.join(tmp, "names.conf")

    def write(extra):
        with open(conf, "w") as f:
            f.write("[generic]\nmetrics = 127.0.0.1:%d\n%s"
                    "[pub]\nbackend = %s\n"
                    "[priv]\nbackend = %s\nallow = 127.0.0.2\n"
                    "[users]\nbackend = %s\nallow-users = root\n"
                    % (port, extra, files["pub"], files["priv"], files["users"]))

    write("")
    with nbdtest.running_daemon([], extra=["--config", conf]) as d:
        shown = listed(d.port)
        log("  LIST from 127.0.0.1: %r" % shown)
        expect(shown == ["pub", "users"], "LIST from 127.0.0.1 gave %r, expected pub and "
               "users (the premise: priv is hidden from it)" % shown)
        on_page = names_on(page(port, "names"))
        log("  exports on the page: %r" % on_page)
        expect(on_page == ["pub"], "the page names %r: an export with access rules of its "
               "own must not be named (metrics-export-names listed, the default)" % on_page)
        write("metrics-export-names = all\n")
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok") and r.get("refused_settings") == [], "reload to all: %r" % r)
        on_page = names_on(page(port, "names all"))
        log("  after a reload with metrics-export-names = all: %r" % on_page)
        expect(on_page == ["priv", "pub", "users"],
               "metrics-export-names = all: the page names %r" % on_page)
        write("metrics-export-names = listed\n")
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok") and r.get("refused_settings") == [], "reload to listed: %r" % r)
        on_page = names_on(page(port, "names listed"))
        log("  after a reload with metrics-export-names = listed: %r" % on_page)
        expect(on_page == ["pub"], "metrics-export-names = listed: the page names %r" % on_page)
    for value, ok in (("all", True), ("listed", True), ("some", False)):
        rc, out = check_config("--export", "m=" + files["pub"], "--metrics", ":%d" % port,
                               "--metrics-export-names", value)
        log("  --metrics-export-names %s: exit %d" % (value, rc))
        if ok:
            expect(rc == 0, "--metrics-export-names %s refused: %s" % (value, out))
        else:
            expect(rc != 0 and "expected listed or all" in out,
                   "--metrics-export-names %s: exit %d, %s" % (value, rc, out))


def descriptors(backend):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CLIENTS + 1000
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            log("  skipped: RLIMIT_NOFILE hard limit %d < %d" % (hard, want))
            return
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the daemon inherits it
    port = nbdtest.free_port()
    socks = []
    with nbdtest.running_daemon([("m", backend, "")],
                                extra=["--metrics", "127.0.0.1:%d" % port,
                                       "--max-clients", str(CLIENTS + 500),
                                       "--negotiation-timeout", "600"]) as d:
        try:
            deadline = time.time() + 120
            while len(socks) < CLIENTS:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(d.sock)
                    socks.append(s)
                except BlockingIOError:  # the backlog is full: wait for accept
                    s.close()
                    if time.time() > deadline:
                        raise nbdtest.Failed("only %d of %d clients connected in 120 s"
                                             % (len(socks), CLIENTS))
                    time.sleep(0.01)
            fds = lambda: len(os.listdir("/proc/%d/fd" % d.pid))  # noqa: E731
            expect(nbdtest.wait_until(lambda: fds() > CLIENTS, 60, step=0.2),
                   "the daemon holds %d descriptors 60 s after %d clients connected"
                   % (fds(), CLIENTS))
            log("  the daemon holds %d descriptors" % fds())
            body = page(port, "%d clients" % CLIENTS)
            clients = [ln for ln in body.splitlines() if ln.startswith("nbdcached_clients ")]
            log("  " + (clients[0] if clients else "no nbdcached_clients"))
            expect(clients and int(clients[0].split()[1]) >= CLIENTS,
                   "nbdcached_clients on the page: %r, expected at least %d"
                   % (clients, CLIENTS))
        finally:
            close_all(socks)


def slow(backend):
    port = nbdtest.free_port()
    with nbdtest.running_daemon([("m", backend, "")],
                                extra=["--metrics", "127.0.0.1:%d" % port]):
        # 15 from the scraper's address, 12 from each of four others: one
        # slot left, and no address at its limit.
        few = ["127.0.0.1"] * (PER_ADDRESS - 1) + \
            ["127.0.0.%d" % (2 + i % 4) for i in range(SLOTS - PER_ADDRESS)]
        held = silent_clients(port, few)
        try:
            time.sleep(0.5)  # accepted (the check below holds either way)
            body = page(port, "beside %d silent clients" % len(held))
            expect("nbdcached_cache_size_bytes" in body, "no cache gauge on the page")
            dropped = sum(closed_by_peer(s) for s in held)
            log("  %d silent clients (%d from 127.0.0.1): scrape answered, %d of them "
                "closed meanwhile" % (len(held), PER_ADDRESS - 1, dropped))
            expect(dropped == 0, "%d silent clients were closed before the scrape was "
                   "answered: it was not answered while they held their connections"
                   % dropped)
        finally:
            close_all(held)


def full(backend):
    port = nbdtest.free_port()
    with nbdtest.running_daemon([("m", backend, "")],
                                extra=["--metrics", "127.0.0.1:%d" % port]):
        sources = ["127.0.0.%d" % (2 + i % 4) for i in range(SLOTS)]
        held = silent_clients(port, sources)
        try:
            time.sleep(0.5)
            t0 = time.time()
            body = page(port, "with every slot held by a silent client")
            waited = time.time() - t0
            dropped = sum(closed_by_peer(s) for s in held)
            log("  %d silent clients: scrape answered after %.1f s, %d of them closed by "
                "the daemon by then" % (len(held), waited, dropped))
            expect(waited < 60, "the scrape took %.1f s" % waited)
            expect("nbdcached_cache_size_bytes" in body, "no cache gauge on the page")
            expect(nbdtest.wait_until(lambda: all(closed_by_peer(s) for s in held), 60,
                                      step=0.5),
                   "%d of %d silent clients still connected after 60 s: no idle timeout"
                   % (sum(not closed_by_peer(s) for s in held), len(held)))
        finally:
            close_all(held)


def log_lines(d, words):
    return [ln for ln in d.log_text().splitlines() if words in ln]


def logs(backend):
    port = nbdtest.free_port()
    with nbdtest.running_daemon([("m", backend, "")],
                                extra=["--metrics", "127.0.0.1:%d" % port]) as d:
        held = silent_clients(port, ["127.0.0.3"] * PER_ADDRESS)
        try:
            time.sleep(0.5)
            refused = 0
            t0 = time.time()
            for _ in range(200):
                try:
                    s = silent_clients(port, ["127.0.0.3"])[0]
                except OSError:
                    refused += 1
                    continue
                s.settimeout(10)
                try:
                    if s.recv(1) == b"":
                        refused += 1
                except OSError:
                    refused += 1
                s.close()
            lines = log_lines(d, "metrics: ")
            # A burst per interval begun (5 s, LOG_LIMIT_INTERVAL_NS), and one more.
            allowed = LOG_BURST * (int((time.time() - t0) / 5) + 2)
            log("  %d of 200 connections past the per-address limit closed; %d lines "
                "of the metrics server in the log (at most %d allowed)"
                % (refused, len(lines), allowed))
            expect(refused == 200, "%d of 200 connections past the limit were closed"
                   % refused)
            expect(len(lines) <= allowed,
                   "%d lines of libmicrohttpd for 200 refused connections (no rate limit): "
                   "%r" % (len(lines), lines[:3]))
            said = nbdtest.wait_until(lambda: log_lines(d, "similar lines suppressed"), 20,
                                      step=0.5)
            expect(said, "no 'similar lines suppressed' count within 20 s")
            for ln in log_lines(d, "similar lines suppressed"):
                log("  " + ln.split(": ", 1)[-1])
        finally:
            close_all(held)


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        backend = os.path.join(tmp, "disk.img")
        nbdtest.sparse_file(backend, 16 * MIB)
        checks.run("loopback", loopback, tmp, backend)
        checks.run("names", names, tmp)
        checks.run("descriptors", descriptors, backend)
        checks.run("slow", slow, backend)
        checks.run("full", full, backend)
        checks.run("log", logs, backend)
    checks.finish("metrics_exposure")


if __name__ == "__main__":
    main()
