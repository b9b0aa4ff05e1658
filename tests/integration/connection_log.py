#!/usr/bin/python3
"""connection_log: every connection's end is logged once, with why, how
long, the export, and what it moved.

  disc      libnbd writes 64 KiB, reads 128 KiB (two READs), flushes and
            disconnects: "conn N: ended after S s: client disconnected
            (NBD_CMD_DISC); export "disk", 4 requests, 131072 bytes read,
            65536 bytes written"
  abort     a raw client that sends NBD_OPT_ABORT: ended, "client ended
            negotiation (NBD_OPT_ABORT)", export "", 0 requests
  eof       a raw client that closes its socket in transmission after one
            READ of 4 KiB: "client closed the connection", 1 request, 4096
            bytes read
  stall     a client that never reads the replies to 8 READs of 4 MiB is
            reset after --stall-timeout 2: "client has not read its replies
            for 2 s", ended after 2 to 5 s
Each connection id appears in exactly one "ended" line (the test harness's
own readiness probe is one more connection, logged too).
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

KIB = 1024
MIB = 1024 * KIB
ENDED = re.compile(r'conn (\d+): ended after (\d+\.\d{3}) s: (.*); export "([^"]*)", '
                   r'(\d+) requests, (\d+) bytes read, (\d+) bytes written')


def ended(d, count=0, timeout=10):
    """The "ended" lines of d's log, once there are at least count."""
    lines = []

    def enough():
        lines[:] = [m.groups() for m in map(ENDED.search, d.log_text().splitlines()) if m]
        return len(lines) >= count
    nbdtest.wait_until(enough, timeout, step=0.1)
    return lines


def one_more(d, before, timeout=10):
    """The "ended" lines after the first `before` (one is awaited)."""
    return ended(d, before + 1, timeout)[before:]


def main():
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    with nbdtest.tempdir() as tmp:
        img = nbdtest.random_file(os.path.join(tmp, "disk.img"), 64 * MIB, seed=3)
        d = nbdtest.CheckedDaemon([("disk", img, "")], workdir=tmp,
                                  extra=["--cache-size", "16M", "--stall-timeout", "2"])
        try:
            def disc():
                # The harness's readiness probe is connection 1: its line
                # first, or it may be taken for this connection's.
                before = len(ended(d, 1))
                h = nbdtest.libnbd_handle(d.unix_uri("disk"))
                h.pwrite(bytes(64 * KIB), 0)
                h.pread(64 * KIB, MIB)
                h.pread(64 * KIB, 2 * MIB)
                h.flush()
                h.shutdown()
                got = one_more(d, before)
                log("  %s" % (got,))
                _, secs, why, export, reqs, rd, wr = got[0]
                require(why == "client disconnected (NBD_CMD_DISC)" and export == "disk" and
                        (reqs, rd, wr) == ("4", "131072", "65536"),
                        "the end of a libnbd connection was logged as %s" % (got[0],))

            def abort():
                before = len(ended(d))
                r = raw.RawClient(d.sock)
                r.greeting()
                r.option(raw.OPT_ABORT)
                r.s.settimeout(5)
                while r.s.recv(4096):
                    pass
                r.close()
                got = one_more(d, before)
                log("  %s" % (got,))
                require(got and got[0][2] == "client ended negotiation (NBD_OPT_ABORT)" and
                        got[0][3] == "" and got[0][4] == "0",
                        "NBD_OPT_ABORT was logged as %s" % got)

            def eof():
                before = len(ended(d))
                r = raw.RawClient(d.sock)
                r.open("disk")
                r.s.sendall(r.encode_request(raw.CMD_READ, 0, 4 * KIB)[1])
                need = 4 * KIB + 16
                data = b""
                r.s.settimeout(5)
                while len(data) < need:
                    chunk = r.s.recv(need - len(data))
                    require(chunk, "the daemon closed before its READ reply")
                    data += chunk
                r.s.shutdown(socket.SHUT_RDWR)
                r.close()
                got = one_more(d, before)
                log("  %s" % (got,))
                require(got and got[0][2] == "client closed the connection" and
                        got[0][3] == "disk" and (got[0][4], got[0][5]) == ("1", "4096"),
                        "a client's EOF was logged as %s" % got)

            def stall():
                before = len(ended(d))
                r = raw.RawClient(d.sock)
                r.open("disk")
                r.s.sendall(b"".join(r.encode_request(raw.CMD_READ, k * 4 * MIB, 4 * MIB)[1]
                                     for k in range(8)))
                t0 = time.monotonic()
                got = one_more(d, before, timeout=15)
                log("  %s after %.1f s" % (got, time.monotonic() - t0))
                r.close()
                require(got and got[0][2] == "client has not read its replies for 2 s" and
                        2 <= float(got[0][1]) <= 5,
                        "a client that reads no replies was logged as %s" % got)

            # The harness's readiness probe is a connection too: its end is
            # logged when the daemon notices it, which may be after the first
            # check counted the lines. Wait for it first.
            ended(d, 1)
            for name, fn in (("disc", disc), ("abort", abort), ("eof", eof), ("stall", stall)):
                checks.run(name, fn)
            ids = [g[0] for g in ended(d)]
            checks.expect(len(ids) == len(set(ids)) >= 4,
                          "connection ids in the ended lines: %s (each once)" % ids)
        finally:
            d.stop()
    checks.finish("connection log")


if __name__ == "__main__":
    main()
