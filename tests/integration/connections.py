#!/usr/bin/python3
"""connections: the control socket's "connections" and "disconnect", and
nbdcachectl's.

Exports "disk" (a file) and "slow" (nbdkit memory behind the delay filter,
READs take 1.5 s). Three raw clients: A on TCP from 127.0.0.1 opens "disk"
and does a READ of 4 KiB and a WRITE of 8 KiB; B on the Unix socket opens
"slow"; C on TCP sends only its flags (negotiating).

  list        nbdcachectl --json connections: A is tcp, its address and
              port, transmitting "disk", 4096 bytes read, 8192 written, 2
              requests, none in flight; B is unix with this process's uid
              and pid, transmitting "slow"; C negotiating, export null;
              every connection's tls is false and its TLS fields null; the table has a row
              for each id
  disconnect  B sends a READ of 64 KiB; once the list shows it in flight,
              nbdcachectl disconnect B: B still gets the whole READ reply,
              then EOF; the log's ended line says "disconnected by the
              control socket" with 1 request; the list no longer has B;
              A goes on reading
  negotiating disconnect of C, still negotiating: closed at once, logged
  concurrent  4 clients x 200 READs and 20 short connections while the
              list is asked for 100 times (bounded; meant for tsan too)
  unknown     disconnect of an id nobody has: exit 1, "no connection N";
              a request whose id is not a number: EINVAL
"""
import json
import os
import re
import subprocess
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


def ctl(d, *args, check_rc=True):
    p = subprocess.run([nbdtest.NBDCACHECTL, "--control", d.control] + list(args),
                       capture_output=True, text=True, timeout=30)
    if check_rc:
        require(p.returncode == 0, "nbdcachectl %s: exit %d: %s"
                % (" ".join(args), p.returncode, p.stderr.strip()))
    return p


def listing(d):
    return {c["id"]: c for c in json.loads(ctl(d, "--json", "connections").stdout)["connections"]}


def main():
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    with nbdtest.tempdir() as tmp:
        img = nbdtest.random_file(os.path.join(tmp, "disk.img"), 8 * MIB, seed=9)
        slow = "nbdkit:--filter=delay memory size=64M rdelay=1500ms"
        d = nbdtest.CheckedDaemon([("disk", img, ""), ("slow", slow, "")], workdir=tmp,
                                  extra=["--cache-size", "16M"])
        try:
            a = raw.RawClient(port=d.port)
            a.open("disk")
            require(a.command(raw.CMD_READ, 0, 4 * KIB).error == 0, "A: READ")
            require(a.command(raw.CMD_WRITE, 64 * KIB, 8 * KIB, payload=bytes(8 * KIB)).error
                    == 0, "A: WRITE")
            b = raw.RawClient(sock_path=d.sock)
            b.open("slow")
            c = raw.RawClient(port=d.port)
            c.greeting()
            ids = {}

            def find(conns, **want):
                for cid, conn in conns.items():
                    if all(conn.get(k) == v for k, v in want.items()):
                        return cid, conn
                return None, None

            def list_():
                def all_there():
                    conns = listing(d)
                    return (find(conns, port=a.s.getsockname()[1])[0] and
                            find(conns, transport="unix", pid=os.getpid())[0] and
                            find(conns, port=c.s.getsockname()[1], phase="negotiating")[0] and
                            find(conns, port=a.s.getsockname()[1])[1]["requests"] == 2)
                nbdtest.wait_until(all_there, 5)
                conns = listing(d)
                log("  %s" % json.dumps(list(conns.values()))[:2000])
                aid, ca = find(conns, port=a.s.getsockname()[1])
                bid, cb = find(conns, transport="unix", pid=os.getpid())
                cid, cc = find(conns, port=c.s.getsockname()[1])
                require(aid and bid and cid, "A, B and C in %s" % conns)
                want_a = {"transport": "tcp", "address": "127.0.0.1", "phase": "transmitting",
                          "export": "disk", "bytes_read": 4096, "bytes_written": 8192,
                          "requests": 2, "inflight": 0, "uid": None, "pid": None}
                for k, v in want_a.items():
                    require(ca.get(k) == v, "A's %s is %r, expected %r" % (k, ca.get(k), v))
                want_b = {"transport": "unix", "address": None, "uid": os.getuid(),
                          "pid": os.getpid(), "phase": "transmitting", "export": "slow",
                          "requests": 0, "inflight": 0}
                for k, v in want_b.items():
                    require(cb.get(k) == v, "B's %s is %r, expected %r" % (k, cb.get(k), v))
                require(cc["phase"] == "negotiating" and cc["export"] is None,
                        "C: %s" % cc)
                for conn in (ca, cb, cc):
                    require(isinstance(conn["age_s"], int) and 0 <= conn["age_s"] < 60,
                            "age_s %r" % conn["age_s"])
                    require(conn.get("tls") is False, "tls: %r" % conn.get("tls"))
                    for k in ("tls_version", "tls_cipher", "tls_peer"):
                        require(k in conn and conn[k] is None, "%s: %r" % (k, conn.get(k)))
                table = ctl(d, "connections").stdout
                log(table)
                require(table.splitlines()[0].split()[:4] == ["ID", "PEER", "PHASE", "EXPORT"],
                        "table header: %r" % table.splitlines()[0])
                for cid_ in (aid, bid, cid):
                    require(re.search(r"^\s*%d\s" % cid_, table, re.M),
                            "no row for %d in the table" % cid_)
                ids.update(a=aid, b=bid, c=cid)

            def disconnect():
                require(ids, "the list check found the ids")
                cookie = b.request(raw.CMD_READ, 0, 64 * KIB)
                nbdtest.wait_until(lambda: listing(d)[ids["b"]]["inflight"] == 1, 5, step=0.02)
                require(listing(d)[ids["b"]]["inflight"] == 1, "B's READ in flight")
                out = ctl(d, "disconnect", str(ids["b"])).stdout
                log("  " + out.strip())
                reply = b.read_reply(cookie)
                require(reply.error == 0 and reply.data == bytes(64 * KIB),
                        "B's READ after disconnect: error %d, %d bytes"
                        % (reply.error, len(reply.data or b"")))
                rest = b.wait_closed(timeout=5)
                require(rest == b"", "B got %r after its reply" % rest[:32])
                b.close()
                line = nbdtest.wait_until(
                    lambda: re.search(r"conn %d: ended after [\d.]+ s: disconnected by the "
                                      r"control socket; export \"slow\", 1 requests" % ids["b"],
                                      d.log_text()), 5)
                require(line, "no ended line for B (disconnected by the control socket)")
                require(ids["b"] not in listing(d), "B still listed")
                require(a.command(raw.CMD_READ, 0, 4 * KIB).error == 0, "A reads on")
                require(listing(d)[ids["a"]]["requests"] == 3, "A's requests: 3")

            def negotiating():
                require(ids, "the list check found the ids")
                ctl(d, "disconnect", str(ids["c"]))
                rest = c.wait_closed(timeout=5)
                require(rest == b"", "C got %r before the close" % rest[:32])
                line = nbdtest.wait_until(
                    lambda: re.search(r"conn %d: ended after [\d.]+ s: disconnected by the "
                                      r"control socket; export \"\", 0 requests" % ids["c"],
                                      d.log_text()), 5)
                require(line, "no ended line for C (disconnected by the control socket)")

            def concurrent():
                # Bounded: 4 clients x 200 READs while the list is asked for
                # 100 times and 20 short connections come and go; the list
                # stays consistent (under ThreadSanitizer, race-free).
                errors = []

                def reader(k):
                    try:
                        r = raw.RawClient(port=d.port) if k % 2 else raw.RawClient(d.sock)
                        r.open("disk")
                        for i in range(200):
                            if r.command(raw.CMD_READ, (i * 4 * KIB) % (4 * MIB), 4 * KIB).error:
                                errors.append("READ failed")
                                break
                        r.disconnect()
                        r.close()
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append("reader %d: %s" % (k, e))

                def churn():
                    try:
                        for _ in range(20):
                            r = raw.RawClient(port=d.port)
                            r.greeting()
                            r.close()
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append("churn: %s" % e)
                threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
                threads.append(threading.Thread(target=churn))
                for t in threads:
                    t.start()
                polls = 0
                for _ in range(100):
                    reply = nbdtest.control_request(d.control, {"command": "connections"})
                    require(reply["ok"], "connections: %s" % reply)
                    for conn in reply["connections"]:
                        require(conn["inflight"] <= 128 and conn["bytes_read"] % 4096 == 0,
                                "odd entry %s" % conn)
                    polls += 1
                for t in threads:
                    t.join(60)
                require(not errors, "; ".join(errors[:5]))
                log("  %d polls during 800 READs and 20 short connections" % polls)

            def unknown():
                p = ctl(d, "disconnect", "999999", check_rc=False)
                require(p.returncode == 1 and "no connection 999999" in p.stderr,
                        "disconnect 999999: exit %d, %r" % (p.returncode, p.stderr))
                reply = nbdtest.control_request(d.control, {"command": "disconnect", "id": "x"})
                require(not reply["ok"] and reply["errno"] == "EINVAL", "id x: %s" % reply)
                reply = nbdtest.control_request(d.control, {"command": "disconnect",
                                                            "id": 999999})
                require(not reply["ok"] and reply["errno"] == "ENOENT", "id 999999: %s" % reply)

            for name, fn in (("list", list_), ("disconnect", disconnect),
                             ("negotiating", negotiating), ("concurrent", concurrent),
                             ("unknown", unknown)):
                checks.run(name, fn)
            a.close()
            c.close()
            require(d.alive(), "the daemon is alive")
        finally:
            d.stop()
    checks.finish("connections")


if __name__ == "__main__":
    main()
