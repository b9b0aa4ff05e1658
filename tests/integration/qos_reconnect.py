#!/usr/bin/python3
"""qos_reconnect: a client cannot reset its client-iops-limit by
reconnecting (issue 40, defect 8; nbdcached(8), QOS).

One daemon, one export q over a 16 MiB file with client-iops-limit = 20
(burst: one second's worth, 20). Every connection comes from one client
(root on the Unix socket: one bucket).

  reconnect  CYCLES times: connect, send BURST READs at once, wait for
             them up to CYCLE_WAIT s, disconnect (no DISC: held requests
             are dropped). The READs completed over the whole loop are at
             most LIMIT x elapsed x 2 + BURST: the bucket a client emptied
             is still empty when it comes back. When each connection got a
             new, full bucket (main before the fix: the bucket went with
             the last connection), every cycle completed all BURST at once,
             some 50 times the limit.
  kept       right after the loop the export's stats count the client's
             bucket as kept with no connection (qos_clients 1,
             qos_idle_clients 1); once it would be full again (at most
             burst / limit s after the last token, plus the debt) a
             connection of another client (TCP, 127.0.0.1) frees it: while
             that one is open, one bucket (its own), none idle.

Only an upper bound on a rate is asserted, with a margin of 2: a busy
machine makes the loop slower, never faster.
"""
import os
import select
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 16 * MIB
LIMIT = 20
BURST = LIMIT           # the default burst: one second's worth
CYCLES = 40
CYCLE_WAIT = 0.1

CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, nbd.Error))
expect = CHECKS.expect


def one_cycle(d):
    """Connect, BURST READs at once, up to CYCLE_WAIT s for them, close
    without DISC: how many completed."""
    h = nbd.NBD()
    h.set_export_name("q")
    h.connect_unix(d.sock)
    bufs = [nbd.Buffer(4096) for _ in range(BURST)]
    cookies = [h.aio_pread(b, i * 4096) for i, b in enumerate(bufs)]
    end = time.monotonic() + CYCLE_WAIT
    done = set()
    for _ in range(10 ** 6):
        for c in cookies:
            if c not in done and h.aio_command_completed(c):
                done.add(c)
        left = end - time.monotonic()
        if len(done) == len(cookies) or left <= 0:
            break
        d_ = h.aio_get_direction()
        p = select.poll()
        p.register(h.aio_get_fd(), select.POLLOUT if d_ & nbd.AIO_DIRECTION_WRITE
                   else select.POLLIN)
        if p.poll(max(1, int(left * 1000))):
            if d_ & nbd.AIO_DIRECTION_WRITE:
                h.aio_notify_write()
            else:
                h.aio_notify_read()
    del h, bufs     # closes the socket, no DISC
    return len(done)


def export_stats(d):
    st = nbdtest.control_request(d.control, {"command": "stats", "export": "q"})
    return next(e for e in st["exports"] if e["name"] == "q")


def reconnect(d):
    t0 = time.monotonic()
    counts = [one_cycle(d) for _ in range(CYCLES)]
    elapsed = time.monotonic() - t0
    done = sum(counts)
    bound = LIMIT * elapsed * 2 + BURST
    log("%d cycles of connect, %d READs, disconnect: %d READs completed in %.2f s "
        "(%.0f/s; limit %d/s; bound %.0f); per cycle %s"
        % (CYCLES, BURST, done, elapsed, done / elapsed, LIMIT, bound, counts))
    expect(done <= bound, "a client reconnecting got %d READs in %.2f s (%.0f/s) past "
           "client-iops-limit=%d: more than %.0f" % (done, elapsed, done / elapsed, LIMIT,
                                                    bound))


def kept(d):
    # The last cycle's connection may still be closing on its worker.
    nbdtest.wait_until(lambda: export_stats(d)["connections"] == 0, 5)
    s = export_stats(d)
    log("after the loop: qos_clients %s, qos_idle_clients %s"
        % (s.get("qos_clients"), s.get("qos_idle_clients")))
    expect(s.get("qos_clients") == 1 and s.get("qos_idle_clients") == 1,
           "the client's emptied bucket is not kept after its last connection: %r"
           % {k: s.get(k) for k in ("qos_clients", "qos_idle_clients")})
    # Full again within burst / limit s of its last token (a READ held at
    # the close may have gone into a small debt): then another client's
    # connection frees it.
    time.sleep(BURST / LIMIT + 0.5)

    h = nbd.NBD()
    h.set_export_name("q")
    h.connect_tcp("127.0.0.1", str(d.port))
    h.pread(4096, 0)
    # Asked while that connection is open: its bucket is in use, root's
    # full one is gone.
    s = export_stats(d)
    h.shutdown()
    del h
    log("after it refilled and another client came: qos_clients %s, qos_idle_clients %s"
        % (s.get("qos_clients"), s.get("qos_idle_clients")))
    expect(s.get("qos_idle_clients") == 0 and s.get("qos_clients") == 1,
           "a refilled idle bucket was not freed: %r"
           % {k: s.get(k) for k in ("qos_clients", "qos_idle_clients")})


def main():
    with nbdtest.tempdir() as tmp:
        img = os.path.join(tmp, "q.img")
        nbdtest.random_file(img, SIZE)
        with nbdtest.running_daemon([("q", img, "client-iops-limit=%d" % LIMIT)]) as d:
            CHECKS.run("reconnect", reconnect, d)
            CHECKS.run("kept", kept, d)
            CHECKS.dump_log(d)
    CHECKS.finish("qos_reconnect")


if __name__ == "__main__":
    main()
