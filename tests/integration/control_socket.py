#!/usr/bin/python3
"""The control socket's protocol from the daemon's side
(include/nbdcached/control.h): mode 0600; several requests in one write get
their replies in order; bad JSON, a non-object, a missing or unknown command
and a wrong argument type are EINVAL replies on a connection that stays
usable; a request line over 64 KiB closes the connection and the daemon
serves the next client; a second daemon cannot take a control socket in use;
--control none runs without one.

Hostile requests: a duplicate key (`{"command":"status","command":"reload"}`,
at the top or nested) and text after the object (another object, or a
word) are EINVAL replies and run nothing (no reload is logged); trailing
white space is fine. A client that pipelines 200000 `stats` requests and
reads no reply makes the daemon stop reading it once about 1 MiB of
replies is unread: the daemon's RSS grows by less than 32 MiB (it grew by
hundreds of MiB before), another client is served meanwhile, and the
flooding client then reads well-formed replies.

commands: "stats" counts client requests by command (and those with FUA),
per export and for the cache."""
import json
import os
import socket
import stat
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

MIB = 1 << 20
CHECKS = nbdtest.Checks()
expect = CHECKS.expect


def lines(sock, n, timeout=10):
    sock.settimeout(timeout)
    data = b""
    while data.count(b"\n") < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return [json.loads(l) for l in data.split(b"\n")[:-1] if l]   # complete lines only


def protocol(tmp):
    img = os.path.join(tmp, "p.img")
    nbdtest.sparse_file(img, 4 * MIB)
    with nbdtest.running_daemon([("p", img, "")]) as d:
        mode = stat.S_IMODE(os.stat(d.control).st_mode)
        expect(mode == 0o600, "control socket mode %o, want 600" % mode)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(d.control)
            s.sendall(b'{"command":"status"}\n{"command":"exports"}\n'
                      b'not json\n[1,2]\n{"nocommand":1}\n{"command":"frob"}\n'
                      b'{"command":"stats","export":7}\n{"command":"flush"}\n'
                      b'{"command":"stats","export":"p"}\n')
            r = lines(s, 9)
            log("  %d replies: %s" % (len(r), [x.get("errno", "ok") for x in r]))
            expect(len(r) == 9, "9 replies to 9 requests, got %d" % len(r))
            if len(r) == 9:
                expect(r[0]["ok"] and r[0]["pid"] == d.pid, "status first: %r" % r[0])
                expect(r[1]["ok"] and r[1]["exports"][0]["name"] == "p", "then exports")
                for i in range(2, 8):
                    expect(not r[i]["ok"] and r[i]["errno"] == "EINVAL",
                           "reply %d must be EINVAL: %r" % (i, r[i]))
                expect("frob" in r[5]["error"], "unknown command named: %r" % r[5])
                expect(r[8]["ok"] and [e["name"] for e in r[8]["exports"]] == ["p"],
                       "the connection still serves after errors: %r" % r[8])
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(d.control)
            s.settimeout(10)
            try:
                s.sendall(b"x" * (80 * 1024))
                closed = s.recv(100) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            expect(closed, "a request over 64 KiB did not close the connection")
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["ok"], "the next client is served")
        # A second daemon cannot take a control socket that answers.
        img2 = os.path.join(tmp, "q.img")
        nbdtest.sparse_file(img2, MIB)
        p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--unix",
                            os.path.join(tmp, "q.sock"), "--control", d.control,
                            "--export", "q=" + img2], capture_output=True, text=True,
                           timeout=30)
        log("  second daemon on the same --control: exit %d" % p.returncode)
        expect(p.returncode == 1 and "in use by another running daemon" in p.stderr,
               "second daemon: %d %r" % (p.returncode, p.stderr[-300:]))
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["pid"] == d.pid, "the first daemon still owns its control socket")


def hostile(tmp):
    img = os.path.join(tmp, "h.img")
    nbdtest.sparse_file(img, 4 * MIB)
    with nbdtest.running_daemon([("h", img, "")]) as d:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(d.control)
            s.sendall(b'{"command":"status","command":"reload"}\n'
                      b'{"command":"stats","x":{"a":1,"a":2}}\n'
                      b'{"command":"status"} x\n'
                      b'{"command":"status"}{"command":"reload"}\n'
                      b'{"command":"status"}  \r\n')
            r = lines(s, 5)
            log("  %d replies: %s" % (len(r), [x.get("errno", "ok") for x in r]))
            expect(len(r) == 5, "5 replies to 5 requests, got %d" % len(r))
            for i, what in enumerate(("a duplicate key", "a nested duplicate key",
                                      "a word after the object", "a second object")):
                if i < len(r):
                    expect(not r[i]["ok"] and r[i].get("errno") == "EINVAL",
                           "%s must be EINVAL: %r" % (what, r[i]))
            if len(r) == 5:
                expect(r[4]["ok"] and r[4].get("pid") == d.pid,
                       "trailing white space is fine: %r" % r[4])
        time.sleep(0.3)
        expect("reload" not in d.log_text(), "a rejected request ran a reload")

        base = nbdtest.rss(d.pid)
        count = 200000
        wire = b'{"command":"stats"}\n' * count
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(d.control)
            s.setblocking(False)
            mv = memoryview(wire)
            sent, peak = 0, base
            t0 = last = time.monotonic()
            while sent < len(wire) and time.monotonic() - t0 < 30 and time.monotonic() - last < 2:
                try:
                    sent += s.send(mv[sent:sent + 65536])
                    last = time.monotonic()
                except BlockingIOError:
                    time.sleep(0.01)
                peak = max(peak, nbdtest.rss(d.pid))
            for _ in range(10):
                time.sleep(0.1)
                peak = max(peak, nbdtest.rss(d.pid))
            log("  sent %d of %d stats requests in %.1f s; daemon RSS %d MiB at start, peak %d MiB"
                % (sent // 20, count, time.monotonic() - t0, base >> 20, peak >> 20))
            expect(peak - base < 32 * MIB, "the daemon's RSS grew by %d MiB with unread stats "
                   "replies (limit 32 MiB)" % ((peak - base) >> 20))
            expect(sent < len(wire), "the daemon read all %d requests without their replies "
                   "being read" % count)
            st = nbdtest.control_request(d.control, {"command": "status"}, timeout=10)
            expect(st["ok"], "another client is served during the flood")
            s.setblocking(True)
            r = lines(s, 50)
            expect(len(r) >= 50 and all(x["ok"] and "cache" in x for x in r[:50]),
                   "the flooding client's first replies are stats replies")


def no_control(tmp):
    img = os.path.join(tmp, "n.img")
    nbdtest.sparse_file(img, MIB)
    with nbdtest.running_daemon([("n", img, "")], extra=["--control", "none"]) as d:
        time.sleep(0.2)
        expect("control socket" not in d.log_text(), "--control none still made a socket")
        h = nbdtest.libnbd_handle(d.unix_uri("n"))
        expect(h.get_size() == MIB, "served without a control socket")
        h.shutdown()


def commands(tmp):
    """stats count client requests by command, per export and for the cache:
    two exports (a whole one and a window of the same file) share one cache
    export, and so one set of counts; a refused request is not counted."""
    import nbd
    img = os.path.join(tmp, "c.img")
    nbdtest.sparse_file(img, 4 * MIB)
    with nbdtest.running_daemon([("c", img, ""), ("w", img, "offset=1M,size=1M")]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("w"), meta=True)
        h.pwrite(b"x" * 4096, 0, nbd.CMD_FLAG_FUA)
        h.pwrite(b"y" * 4096, 4096)
        h.flush()
        h.trim(4096, 0)
        h.zero(4096, 8192)
        h.pread(4096, 0)
        h.pread(4096, 4096)
        h.cache(4096, 0)
        h.block_status(4096, 0, lambda *a: 0)
        try:
            h.set_strict_mode(0)
            h.pread(4096, MIB)  # past the window's end: refused, not counted
        except nbd.Error:
            pass
        h.shutdown()
        want = {"read": 2, "write": 2, "flush": 1, "trim": 1, "write_zeroes": 1, "cache": 1,
                "block_status": 1, "fua": 1}
        s = nbdtest.control_request(d.control, {"command": "stats"})
        got = {e["name"]: e["commands"] for e in s["exports"]}
        log("  %s" % got)
        expect(got.get("w") == want and got.get("c") == want,
               "per-export commands: %s, want %s for both" % (got, want))
        expect(s["cache"]["commands"] == want, "cache commands: %s" % s["cache"]["commands"])


def main():
    for name, fn in (("protocol", protocol), ("hostile", hostile), ("no_control", no_control),
                     ("commands", commands)):
        with nbdtest.tempdir() as tmp:
            CHECKS.run(name, fn, tmp)
    CHECKS.finish("control socket")


if __name__ == "__main__":
    main()
