#!/usr/bin/python3
"""access_flood: refused connects do not flood the log (nbdcached(8),
LOGGING), and another client is served throughout (nbdtest.ServedProbe:
no round over a quarter of the time it ran).

One daemon with --deny 127.0.0.2 (global), export "disk" with deny =
127.0.0.3, --max-connections-per-client 2, and export "probe" on its own
small file in /dev/shm, which nbdtest.ServedProbe uses over the Unix socket
all along.

  accept     3000 connects from 127.0.0.2, each closed at accept (bounded:
             3000 connects or 300 s): stats counts 3000 in
             clients.refused_access; the log has at most BURST lines and
             a count line per 5 s interval the flood touched (the
             flood's own duration, measured: not a fixed number of lines,
             which a flood slowed by a busy machine spreads over more
             intervals) of "refused 127.0.0.2", at least one line "connections
             refused at accept by the access rules: N similar lines
             suppressed", and the printed lines plus the N said add up to
             3000 (the last count is said by the tick once the interval is
             over, with no new refusal to carry it)
  export     2000 connects from 127.0.0.3 that ask INFO "disk" (answered
             NBD_REP_ERR_UNKNOWN) and close: the same for the "refused
             ... export 'disk'" lines, and for the "ended" lines of those
             connections (which never opened an export; at least 2000 with
             the counts, the harness's own readiness connections end so too)
  per_client 2 connections held from 127.0.0.4 and 2000 more refused
             (--max-connections-per-client): the same
  sessions   1500 connects from 127.0.0.5 that open "disk" (GO) and close:
             allowed, but any client can make them in a loop, so the
             "negotiated" and "ended" lines of sessions are limited too, at
             a larger burst (LOG_LIMIT_SESSION_BURST, 200 in 5 s: a hundred
             clients attaching at once are all logged): their lines for
             "disk" bounded, with the counts adding up to at least 1500
             (the probe's sessions, on "probe", count too)
  served     a client from 127.0.0.1 still opens "disk" and reads it

Each flood lasts seconds (2000 connects or more: about 3 s here), so
that a quarter of it, the probe's bound, is well above the few hundred
milliseconds a busy machine may stall a round for.

The floods run one after the other, each with the probe beside it, and
their lines are counted once the last has ended: a count is said only once
its kind's 5 s interval is over (the daemon's LOG_LIMIT_INTERVAL_NS), which
counting after each flood waited out four times over (24 s in all, now
about 12). Each kind of line has its own interval, but two kinds see other
lines than their flood's, and the bounds allow the flood two intervals, so
the order matters. sessions runs first: its flood starts an interval of
its kinds (the probes' sessions are lines of them too, and would have begun
one earlier). export runs last: the lines of its second kind that are not
its flood's (the harness's readiness connection and per_client's two held
connections, ended in negotiation) come before it, in the interval its
flood begins in or in one long over.
"""
import os
import re
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402

MIB = 1 << 20
LIMIT_S = 5  # LOG_LIMIT_INTERVAL_NS (daemon/log.h)
BURST = 10  # LOG_LIMIT_BURST
SESSION_BURST = 200  # LOG_LIMIT_SESSION_BURST


def connect_from(port, source):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def closed_at_accept(port, source):
    s = connect_from(port, source)
    try:
        got = s.recv(64)
    except ConnectionResetError:
        got = b""
    finally:
        s.close()
    require(got == b"", "a client from %s got %r (expected a close)" % (source, got[:20]))


def info_refused(port, source):
    r = raw.RawClient(sock=connect_from(port, source))
    try:
        r.greeting()
        r.send_opt(raw.OPT_INFO, raw.go_payload("disk"))
        typ, _, _ = r.opt_replies(raw.OPT_INFO)
        require(typ & raw.REP_FLAG_ERROR, "INFO disk from 127.0.0.3: %s" % raw.rep_name(typ))
    finally:
        r.close()


def session(port, source):
    r = raw.RawClient(sock=connect_from(port, source))
    try:
        r.open("disk")
    finally:
        r.close()


FLOOD_LIMIT = 300  # seconds a flood may take (3000 connects: about 4 s here)


def flood(what, count, fn, pace=0.001):
    """count calls of fn, pace seconds apart (so that the probe beside
    has rounds all along), in FLOOD_LIMIT s at most."""
    t0 = time.monotonic()
    n = 0
    while n < count and time.monotonic() - t0 < FLOOD_LIMIT:
        fn()
        n += 1
        time.sleep(pace)
    secs = time.monotonic() - t0
    log("  %s: %d connects in %.2f s" % (what, n, secs))
    require(n == count, "%s: only %d of %d connects in %d s" % (what, n, count, FLOOD_LIMIT))
    return secs


def accounted(d, line_re, kind, count, secs, exact=True, burst=BURST):
    """The lines matching line_re and kind's suppression counts: bounded,
    and adding up to count (at least count when not exact: other clients'
    lines of that kind count too); waits for the tick (once a second) to
    say the last count."""
    count_re = re.compile(re.escape(kind) + r": (\d+) similar lines suppressed in the last \d+ s")
    state = {}

    def settled():
        text = d.log_text().splitlines()
        state["lines"] = [ln for ln in text if re.search(line_re, ln)]
        state["counts"] = [int(m.group(1)) for ln in text for m in [count_re.search(ln)] if m]
        return len(state["lines"]) + sum(state["counts"]) >= count
    nbdtest.wait_until(settled, 4 * LIMIT_S, step=0.2)
    lines, counts = state["lines"], state["counts"]
    log("  %s: %d lines printed, %d suppression lines (%s)" % (
        kind, len(lines), len(counts), ", ".join(map(str, counts))))
    for ln in lines[:2]:
        log("    " + ln)
    require(counts, "%s: no line says how many were suppressed" % kind)
    # BURST lines and a count in each interval the flood touched: an
    # interval begins with a line and lasts LIMIT_S, so secs of flood
    # touch at most secs / LIMIT_S + 1 of them, and one more may have
    # begun before it with another client's line of that kind. No fixed
    # cap: the lines grow with the flood's duration, which a busy machine
    # stretches (a cap of 40 held only for floods under about 15 s); the
    # refusals do not, and a daemon that logs each of them still fails.
    bound = (burst + 1) * (2 + int(secs / LIMIT_S))
    require(len(lines) + len(counts) <= bound,
            "%s: %d lines for %d refusals in %.1f s (at most %d: %d a %d s interval)"
            % (kind, len(lines) + len(counts), count, secs, bound, burst + 1, LIMIT_S))
    require(len(lines) + sum(counts) == count or
            (not exact and len(lines) + sum(counts) > count),
            "%s: %d printed + %d counted as suppressed, for %d" % (
                kind, len(lines), sum(counts), count))


def main():
    with nbdtest.tempdir() as tmp, nbdtest.tempdir(base=nbdtest.shm_dir()) as shm:
        disk = nbdtest.random_file(os.path.join(tmp, "disk.img"), 4 * MIB, seed=71)
        probe_img = nbdtest.random_file(os.path.join(shm, "probe.img"), 1 * MIB, seed=72)
        checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
        with nbdtest.running_daemon(
                [("disk", disk, "deny=127.0.0.3"), ("probe", probe_img, "")], workdir=tmp,
                extra=["--cache-size", "32M", "--deny", "127.0.0.2",
                       "--max-connections-per-client", "2"]) as d:
            # The accounting of each flood that passed, done after the last.
            logged = []

            def accept():
                with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
                    secs = flood("127.0.0.2", 3000, lambda: closed_at_accept(d.port, "127.0.0.2"))
                probe.check("beside 3000 connects refused at accept")

                def counted():
                    st = nbdtest.control_request(d.control, {"command": "stats"})
                    return st["clients"]["refused_access"] == 3000
                require(nbdtest.wait_until(counted, 30), "stats did not count 3000 refusals")
                logged.append(("accept", lambda: accounted(
                    d, r"refused 127\.0\.0\.2:\d+: deny 127\.0\.0\.2 \(global access "
                    r"rules\); closed at accept",
                    "connections refused at accept by the access rules", 3000, secs)))

            def export():
                with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
                    secs = flood("127.0.0.3", 2000, lambda: info_refused(d.port, "127.0.0.3"))
                probe.check("beside 2000 connects refused export 'disk'")

                def lines():
                    accounted(d, r"refused 127\.0\.0\.3:\d+ export 'disk': deny 127\.0\.0\.3",
                              "refused exports", 2000, secs)
                    accounted(d, r"conn \d+: ended after [0-9.]+ s: .*; export \"\", 0 requests",
                              "connections ended in negotiation", 2000, secs, exact=False)
                logged.append(("export", lines))

            def per_client():
                held = [connect_from(d.port, "127.0.0.4") for _ in range(2)]
                try:
                    with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
                        secs = flood("127.0.0.4", 2000,
                                     lambda: closed_at_accept(d.port, "127.0.0.4"))
                    probe.check("beside 2000 connects over the per-client limit")
                    logged.append(("per_client", lambda: accounted(
                        d, r"refused 127\.0\.0\.4:\d+: it has 2 connections",
                        "connections refused at accept by --max-connections-per-client",
                        2000, secs)))
                finally:
                    for s in held:
                        s.close()

            def sessions():
                with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
                    secs = flood("127.0.0.5", 1500, lambda: session(d.port, "127.0.0.5"))
                probe.check("beside 1500 sessions opened and closed")

                def lines():
                    # The flood's lines ("disk"), not the probe's ("probe"):
                    # those go on beside the later floods, as many as the
                    # time they take, and a busy machine stretches that.
                    # Both kinds' counts are of both (one limit a kind).
                    for line_re, kind in (
                            (r"conn \d+: export \"disk\" negotiated", "exports negotiated"),
                            (r"conn \d+: ended after [0-9.]+ s: .*; export \"disk\"",
                             "connections ended")):
                        accounted(d, line_re, kind, 1500, secs, exact=False,
                                  burst=SESSION_BURST)
                logged.append(("sessions", lines))

            def served():
                h = nbdtest.libnbd_handle(d.tcp_uri("disk"))
                require(h.pread(4096, 0) == nbdtest.read_at(disk, 0, 4096), "READ disk")
                h.shutdown()

            for name, fn in (("sessions", sessions), ("accept", accept),
                             ("per_client", per_client), ("export", export)):
                checks.run(name, fn)
            for name, fn in logged:
                checks.run("%s: the log" % name, fn)
            checks.run("served", served)
            checks.dump_log(d)
        checks.finish("access flood")


if __name__ == "__main__":
    main()
