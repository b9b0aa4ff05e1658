#!/usr/bin/python3
"""upgrade: `nbdcachectl upgrade` hands every connection to a new daemon
while clients keep requests in flight, and rolls back when the new daemon
cannot take over.

One daemon (--config FILE: one export on a 64 MiB file, the cache 32 MiB
in writeback; a Unix socket and a TCP port on the command line). The test
process is a child subreaper, so each new daemon, orphaned when its
predecessor exits, is still its child (reaped, killed by PID).

  1  Under load, UPGRADES upgrades in a row: CLIENTS libnbd clients
     (structured replies, base:allocation), each on a region of its own,
     keep up to QD random commands in flight (READ checked against a byte
     model, WRITE, some with FUA, TRIM, WRITE_ZEROES, FLUSH, BLOCK_STATUS)
     and go on through every upgrade on the same connection: no command
     fails, no byte differs, no connection is dropped (the same ids, their
     request counters never go back), each upgrade's reply names a new PID
     and its pause. After the last, every region read whole equals its
     model, and so does the file after the daemon's exit. Beside them, on
     regions of their own: fio's nbd engine (random 4 KiB writes at QD 16,
     verified, loop after loop) and qemu-io (extended headers: write,
     read -P, discard, write -z, one command after another), both spanning
     several upgrades, both exiting 0 with nothing wrong.
  2  Roll-backs, each answered with the reason and followed by the old
     daemon serving on (the clients' connections, a new connection on
     each listener, the control socket): a binary that exits at once
     (/bin/false), one that hangs (killed after --timeout 2), and a config
     that no longer parses (the new daemon's own error in the reply).
  3  Refused up front: a daemon with an nbdkit: export (its data is in
     the nbdkit it started).
  4  Bad state records: the test plays the old daemon to a new one
     (NBDCACHED_UPGRADE_FD): after its HELLO, a record of another version
     (newer, older), one cut short, a CONNECTION without its descriptor,
     an END that does not add up. Each time the new daemon exits non-zero
     after an ERROR record that names the fault, serves nothing, and
     leaves the socket paths it was given in place.
  7  A WRITE whose payload is half sent when the upgrade starts (a raw
     client with extended headers): the upgrade waits for the rest (it
     does not answer while the payload is missing), the WRITE is answered
     with success, and the same connection then reads it back from the
     new daemon.
  9  Two raw clients have read the greeting when the upgrade parks the
     connections: one negotiates on (structured replies, GO, a WRITE) and
     is handed over in transmission, its WRITE answered by the new daemon
     and read back; the other says nothing and is closed after the grace
     (HOST_NEGOTIATION_GRACE_MS), the upgrade committing.
  8  A new configuration that gives the export another block size: the
     upgrade commits, and the new daemon closes the connection that was
     told the old one, saying why in its log; a new connection is served.
  6  A daemon that dropped its privileges (--user nobody, started as
     root) upgrades to a new one that runs as nobody from the start: the
     new one must not try to drop them again (and fail).
  5  What systemd hears (NOTIFY_SOCKET: a datagram socket of the test's,
     the sender of each message from SCM_CREDENTIALS; WATCHDOG_USEC and
     WATCHDOG_PID set as systemd sets them): the old daemon says
     RELOADING=1, then MAINPID= the new one's; the new one then says
     READY=1 and keeps the watchdog fed (WATCHDOG=1 from the new PID).
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 64 * MIB
CLIENTS = 4
REGION = 8 * MIB
BLOCK = 4096
QD = 32
UPGRADES = int(os.environ.get("UPGRADES", "20"))
# The binary to upgrade to. By default the daemon's own (/proc/self/exe);
# when NBDCACHED names a wrapper (the i386 pass runs the i386 daemon through
# the chroot's loader, which is then what /proc/self/exe says), the wrapper.
BINARY = ["--binary", nbdtest.NBDCACHED] if os.environ.get("NBDCACHED") else []
BINARY_REQ = {"binary": nbdtest.NBDCACHED} if BINARY else {}
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, OSError, subprocess.SubprocessError))
expect = CHECKS.expect


class Service:
    """The daemon through its upgrades: the current PID from the pidfile."""

    def __init__(self, tmp, conf):
        self.tmp = tmp
        self.sock = os.path.join(tmp, "nbd.sock")
        self.control = os.path.join(tmp, "control.sock")
        self.pidfile = os.path.join(tmp, "nbdcached.pid")
        self.logpath = os.path.join(tmp, "nbdcached.log")
        self.port = nbdtest.free_port()
        self.metrics_port = nbdtest.free_port()
        self.args = [nbdtest.NBDCACHED, "--foreground", "--config", conf,
                     "--metrics", "127.0.0.1:%d" % self.metrics_port,
                     "--unix", self.sock, "--listen", "127.0.0.1:%d" % self.port,
                     "--control", self.control, "--pidfile", self.pidfile,
                     "--threads", "2", "--log-level", "info"]
        self.logf = open(self.logpath, "w")
        log("+ " + " ".join(self.args))
        self.first = subprocess.Popen(self.args, stdout=self.logf, stderr=subprocess.STDOUT)
        require(nbdtest.wait_until(lambda: self.pid_file() == self.first.pid, 15),
                "the daemon did not start (no pidfile)")

    def pid_file(self):
        return nbdtest.pidfile_pid(self.pidfile)

    def uri(self, tcp=False):
        if tcp:
            return "nbd://127.0.0.1:%d/disk" % self.port
        return "nbd+unix:///disk?socket=%s" % self.sock

    def ctl(self, *args):
        cmd = [nbdtest.NBDCACHECTL, "--control", self.control] + list(args)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def log_text(self):
        self.logf.flush()
        with open(self.logpath) as f:
            return f.read()

    def reap(self):
        """Reap every exited child (old daemons, failed new ones), not the
        peers (fio, qemu-io): their Popen must see their exit status."""
        nbdtest.reap_children(PEERS)

    def stop(self):
        """SIGTERM the daemon serving now, by PID; its exit status."""
        pid = self.pid_file()
        require(pid > 0, "no daemon PID in the pidfile")
        rc = nbdtest.stop_pid(pid)
        return 0 if rc is None else rc

    def kill_all(self):
        for pid in {self.pid_file(), self.first.pid}:
            try:
                if pid > 0:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.reap()


class Client:
    """One connection, its region, its model; commands kept in flight."""

    def __init__(self, svc, index, seed):
        self.index = index
        self.base = index * REGION
        self.rng = random.Random(seed)
        self.model = bytearray(REGION)
        self.h = nbdtest.libnbd_handle(svc.uri(tcp=index % 2 == 1), meta=True)
        self.busy = set()        # blocks with a command in flight
        self.inflight = {}       # cookie -> (kind, block, data, buf)
        self.done = {"read": 0, "write": 0, "trim": 0, "zero": 0, "flush": 0, "status": 0}
        self.errors = []

    def free_block(self):
        for _ in range(64):
            b = self.rng.randrange(REGION // BLOCK)
            if b not in self.busy:
                return b
        return None

    def issue(self):
        kind = self.rng.choices(["read", "write", "trim", "zero", "flush", "status"],
                                [35, 35, 8, 8, 6, 8])[0]
        if kind == "flush":
            c = self.h.aio_flush()
            self.inflight[c] = (kind, None, None, None)
            return
        b = self.free_block()
        if b is None:
            return
        off = self.base + b * BLOCK
        if kind == "read":
            buf = nbd.Buffer(BLOCK)
            c = self.h.aio_pread(buf, off)
            self.inflight[c] = (kind, b, None, buf)
        elif kind == "write":
            data = bytes([self.rng.randrange(256)]) * 16 + os.urandom(BLOCK - 16)
            flags = nbd.CMD_FLAG_FUA if self.rng.random() < 0.2 else 0
            c = self.h.aio_pwrite(data, off, flags=flags)
            self.inflight[c] = (kind, b, data, None)
        elif kind == "trim":
            c = self.h.aio_trim(BLOCK, off)
            self.inflight[c] = (kind, b, bytes(BLOCK), None)
        elif kind == "zero":
            c = self.h.aio_zero(BLOCK, off)
            self.inflight[c] = (kind, b, bytes(BLOCK), None)
        else:
            seen = []

            def cb(metacontext, offset, entries, err):
                seen.append((offset, list(entries)))
                return 0
            c = self.h.aio_block_status(BLOCK, off, cb)
            self.inflight[c] = (kind, b, seen, None)
        self.busy.add(b)

    def reap(self):
        for c in list(self.inflight):
            try:
                if not self.h.aio_command_completed(c):
                    continue
            except nbd.Error as e:
                kind, b, _, _ = self.inflight.pop(c)
                self.busy.discard(b)
                self.errors.append("%s of block %s: %s" % (kind, b, e))
                continue
            kind, b, data, buf = self.inflight.pop(c)
            self.busy.discard(b)
            self.done[kind] += 1
            at = None if b is None else b * BLOCK
            if kind == "read":
                got = buf.to_bytearray()
                if got != self.model[at:at + BLOCK]:
                    self.errors.append("read of block %d: other bytes than the model" % b)
            elif kind in ("write", "trim", "zero"):
                self.model[at:at + BLOCK] = data
            elif kind == "status":
                covered = sum(n for _, ents in data for n in ents[0::2])
                if covered <= 0:
                    self.errors.append("block status of block %d: no extent" % b)

    def poll(self, timeout_ms):
        import select
        p = select.poll()
        d = self.h.aio_get_direction()
        ev = (select.POLLIN if d & nbd.AIO_DIRECTION_READ else 0) | \
             (select.POLLOUT if d & nbd.AIO_DIRECTION_WRITE else 0)
        fd = self.h.aio_get_fd()
        p.register(fd, ev or select.POLLIN)
        for _, e in p.poll(timeout_ms):
            if e & select.POLLIN:
                self.h.aio_notify_read()
            elif e & select.POLLOUT:
                self.h.aio_notify_write()
            elif e & (select.POLLHUP | select.POLLERR):
                raise Failed("client %d: the connection was closed" % self.index)

    def run(self, stop):
        """Keep QD commands in flight until stop is set (bounded: 10 min)."""
        deadline = time.time() + 600
        try:
            while not stop.is_set() and time.time() < deadline:
                while len(self.inflight) < QD:
                    self.issue()
                self.poll(50)
                self.reap()
            end = time.time() + 60
            while self.inflight and time.time() < end:
                self.poll(50)
                self.reap()
            if self.inflight:
                self.errors.append("%d commands never completed" % len(self.inflight))
        except Exception as e:  # noqa: BLE001 - reported with the client's
            self.errors.append("client %d: %s" % (self.index, e))


def connections(svc):
    r = nbdtest.control_request(svc.control, {"command": "connections"})
    require(r.get("ok"), "connections: %s" % r)
    return {c["id"]: c for c in r["connections"]}


def metrics_answer(svc):
    """GET /metrics on the --metrics address (handed over with the rest)."""
    import urllib.request
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % svc.metrics_port,
                                timeout=10) as r:
        require(r.status == 200, "GET /metrics: HTTP %d" % r.status)
        require(b"nbdcached_" in r.read(), "GET /metrics: not nbdcached's page")


def served(svc, what):
    """A new connection on each listener reads; the control socket answers;
    the metrics page answers."""
    for tcp in (False, True):
        h = nbdtest.libnbd_handle(svc.uri(tcp=tcp))
        try:
            h.pread(BLOCK, SIZE - BLOCK)
        finally:
            nbdtest.shutdown_all([h])
    r = nbdtest.control_request(svc.control, {"command": "status"})
    require(r.get("ok"), "%s: status: %s" % (what, r))
    metrics_answer(svc)


FIO_BASE, FIO_SIZE = 36 * MIB, 4 * MIB
QEMU_BASE = 48 * MIB
PEERS = set()  # the peers' PIDs, never reaped behind their Popen's back


def start_peers(svc):
    """fio (nbd engine, verify) and qemu-io, in the background."""
    peers = {}
    if shutil.which("fio"):
        peers["fio"] = subprocess.Popen(
            ["fio", "--name=up", "--ioengine=nbd", "--uri=" + svc.uri(), "--rw=randwrite",
             "--bs=4k", "--iodepth=16", "--offset=%d" % FIO_BASE, "--size=%d" % FIO_SIZE,
             "--loops=25", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
             "--verify_state_save=0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=svc.tmp, text=True)
    else:
        CHECKS.add("fio not found (install fio)")
    if shutil.which("qemu-io"):
        cmds = []
        rng = random.Random(7)
        for i in range(1500):
            off = QEMU_BASE + rng.randrange(64) * 65536
            pat = 1 + i % 250
            kind = rng.randrange(10)
            if kind < 6:
                cmds += ["write -P %d %d 65536" % (pat, off), "read -P %d %d 65536" % (pat, off)]
            elif kind < 8:
                cmds += ["discard %d 65536" % off, "read -P 0 %d 65536" % off]
            else:
                cmds += ["write -z %d 65536" % off, "read -P 0 %d 65536" % off]
            if i % 50 == 0:
                cmds.append("flush")
        args = ["qemu-io", "-f", "raw"]
        for c in cmds:
            args += ["-c", c]
        args.append("nbd+unix:///disk?socket=" + svc.sock)
        peers["qemu-io"] = subprocess.Popen(args, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
    else:
        CHECKS.add("qemu-io not found (install qemu-utils)")
    PEERS.update(p.pid for p in peers.values())
    return peers


def finish_peers(peers):
    t0 = time.time()
    for name, p in peers.items():
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            CHECKS.add("%s did not end within 300 s" % name)
            continue
        bad = [w for w in ("failed", "error", "mismatch", "verify:", "bad magic")
               if w in out.lower()]
        log("  %s: exit %d after %.1f s more%s" % (name, p.returncode, time.time() - t0,
                                 (", said " + ", ".join(bad)) if bad else ""))
        said = [line for line in out.splitlines() if any(w in line.lower() for w in bad)]
        expect(p.returncode == 0 and not bad, "%s: exit %d%s; output: %s"
               % (name, p.returncode, (", said: " + " | ".join(said[:3])) if said else "",
                  out[-1500:]))


def upgraded(svc, n, expect_fn=None, args=None):
    """Upgrade n (nbdcachectl --json upgrade ARGS, by default to the test's
    binary): its reply once the pidfile names the new daemon, or None
    after saying why (through expect_fn, this test's expect by default)."""
    check = expect_fn or expect
    before = svc.pid_file()
    r = svc.ctl("--json", "upgrade", *(BINARY if args is None else args))
    svc.reap()
    check(r.returncode == 0, "upgrade %d: exit %d: %s" % (n, r.returncode, r.stderr.strip()))
    if r.returncode:
        return None
    reply = json.loads(r.stdout)
    # The new daemon writes its pidfile and resumes the connections just
    # after the old one has replied.
    nbdtest.wait_until(lambda: svc.pid_file() == reply["pid"], 5)
    now = svc.pid_file()
    check(reply["pid"] == now and now != before,
          "upgrade %d: the reply says pid %s, the pidfile %d (was %d)"
          % (n, reply["pid"], now, before))
    return reply


def under_load(svc):
    clients = [Client(svc, i, 1000 + i) for i in range(CLIENTS)]
    ids_before = set(connections(svc))  # the clients' (the peers end on their own)
    peers = start_peers(svc)
    # The upgrades start once the peers are serving (fio connects twice:
    # to learn the size, then for its I/O), so that each spans several.
    # A client that connects during an upgrade is the next check's.
    nbdtest.wait_until(lambda: sum(1 for cid, c in connections(svc).items()
                                   if cid not in ids_before and c["requests"]) >= len(peers),
                       60)
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    pids, pauses = [], []
    last = connections(svc)
    try:
        for n in range(UPGRADES):
            time.sleep(0.3)
            reply = upgraded(svc, n + 1)
            if not reply:
                continue
            now = svc.pid_file()
            pids.append(now)
            pauses.append(reply["pause_ms"])
            expect(reply["moved"] >= CLIENTS,
                   "upgrade %d: %d connections moved, %d clients" % (n + 1, reply["moved"],
                                                                     CLIENTS))
            nbdtest.wait_until(lambda: ids_before <= set(connections(svc)), 5)
            conns = connections(svc)
            for cid, c in last.items():
                if cid not in ids_before:
                    continue
                expect(cid in conns, "upgrade %d: connection %d is gone" % (n + 1, cid))
                if cid in conns:
                    expect(conns[cid]["requests"] >= c["requests"],
                           "upgrade %d: connection %d's requests went from %d to %d"
                           % (n + 1, cid, c["requests"], conns[cid]["requests"]))
                    expect(conns[cid]["upgrades"] == n + 1 and
                           conns[cid]["age_ms"] >= c["age_ms"],
                           "upgrade %d: connection %d says upgrades %d, age %d ms (was %d)"
                           % (n + 1, cid, conns[cid]["upgrades"], conns[cid]["age_ms"],
                              c["age_ms"]))
            last = conns
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        finish_peers(peers)
    for c in clients:
        for e in c.errors[:5]:
            CHECKS.add("client %d: %s" % (c.index, e))
        log("  client %d: %s" % (c.index, ", ".join("%d %s" % (v, k) for k, v in c.done.items())))
        expect(sum(c.done.values()) > UPGRADES * 10, "client %d did too little" % c.index)
    # fio's and qemu-io's connections went through upgrades too.
    moved = {}
    for cid in re.findall(r"conn (\d+): resumed after the upgrade", svc.log_text()):
        if int(cid) not in ids_before:
            moved[int(cid)] = moved.get(int(cid), 0) + 1
    log("  the peers' connections resumed: %s" % moved)
    ext = set(int(c) for c in re.findall(r"conn (\d+): export \"disk\" negotiated "
                                          r"structured=1 extended=1", svc.log_text()))
    expect(any(moved.get(c, 0) >= 2 for c in ext),
           "no connection with extended headers (qemu-io's) went through upgrades")
    expect(len(peers) == 0 or sum(1 for n in moved.values() if n >= 2) >= len(peers),
           "fio's and qemu-io's connections were not each handed over twice or more: %s"
           % moved)
    if pauses:
        s = sorted(pauses)
        log("  %d upgrades, pids %s; pause p50 %d ms, max %d ms"
            % (len(pauses), " ".join(map(str, pids[:3])) + " ...", s[len(s) // 2], s[-1]))
    served(svc, "after %d upgrades" % UPGRADES)
    # Every region, read whole on its own connection, is its model.
    for c in clients:
        got = c.h.pread(REGION, c.base)
        nbdtest.require_same(bytes(got), bytes(c.model), "client %d's region" % c.index,
                             base=c.base)
        c.h.flush()
    nbdtest.shutdown_all([c.h for c in clients])
    return clients


def half_payload(svc):
    sys.path.insert(0, HERE)
    import bad_input as raw
    r = raw.RawClient(svc.sock, timeout=30)
    try:
        r.open("disk", extended=True)
        data = os.urandom(64 * 1024)
        off = 56 * MIB
        cookie, hdr = r.encode_request(raw.CMD_WRITE, off, len(data))
        r.pending[cookie] = (raw.CMD_WRITE, off, len(data))
        r.send(hdr + data[:20000])
        result = {}

        def up():
            result["r"] = svc.ctl("--json", "upgrade", *BINARY)
        t = threading.Thread(target=up, daemon=True)
        t.start()
        time.sleep(1.0)
        expect(t.is_alive(), "the upgrade ended while a WRITE's payload was half sent: %s"
               % result.get("r"))
        r.send(data[20000:])
        reply = r.read_reply(cookie)
        expect(reply.error == 0, "the half-sent WRITE: error %d" % reply.error)
        t.join(60)
        svc.reap()
        u = result.get("r")
        expect(u is not None and u.returncode == 0, "the upgrade: %s"
               % (u.stderr if u else "no answer in 60 s"))
        c2 = r.request(raw.CMD_READ, off, len(data))
        back = r.read_reply(c2)
        expect(back.error == 0 and bytes(back.data) == data,
               "the same connection does not read the WRITE back from the new daemon")
        log("  a 64 KiB WRITE, 20000 bytes sent before the upgrade: answered, read back")
    finally:
        r.close()


def negotiating(svc):
    """Two raw clients have read the greeting when the upgrade parks the
    connections: one goes on negotiating within the grace and is handed
    over in transmission (its WRITE, sent before the hand-over, answered
    by the new daemon); the other says nothing more and is closed once the
    grace is over, the upgrade going through."""
    sys.path.insert(0, HERE)
    import bad_input as raw
    a = raw.RawClient(svc.sock, timeout=30)
    b = raw.RawClient(svc.sock, timeout=30)
    try:
        a.greeting()
        b.greeting()
        mark = len(svc.log_text())
        result = {}

        def up():
            result["r"] = svc.ctl("--json", "upgrade", *BINARY)
        t = threading.Thread(target=up, daemon=True)
        t.start()
        require(nbdtest.wait_until(lambda: "connections parking" in svc.log_text()[mark:], 30,
                                   step=0.01),
                "the upgrade did not begin parking the connections within 30 s")
        time.sleep(0.05)
        a.option(raw.OPT_STRUCTURED_REPLY)
        a.structured = True
        a.go("disk")
        data = os.urandom(BLOCK)
        off = 58 * MIB
        cookie = a.request(raw.CMD_WRITE, off, len(data), payload=data)
        t.join(60)
        svc.reap()
        u = result.get("r")
        require(u is not None and u.returncode == 0, "the upgrade: %s"
                % (u.stderr if u else "no answer in 60 s"))
        reply = json.loads(u.stdout)
        log("  upgrade: %s" % reply)
        expect(reply["closed"] == 1, "%d connection(s) closed, expected 1 (the silent one)"
               % reply["closed"])
        expect(reply["pause_ms"] >= 400,
               "paused %d ms: the silent client did not get its grace" % reply["pause_ms"])
        w = a.read_reply(cookie)
        expect(w.error == 0, "the WRITE sent during the upgrade: error %d" % w.error)
        c2 = a.request(raw.CMD_READ, off, len(data))
        back = a.read_reply(c2)
        expect(back.error == 0 and bytes(back.data) == data,
               "the client that negotiated during the upgrade does not read its WRITE back")
        got = b.wait_closed(10)
        expect(got == b"", "the silent client was sent %r before its close" % got[:32])
        text = svc.log_text()[mark:]
        expect("still negotiating" in text,
               "the log does not say the silent client was closed while negotiating")
        log("  negotiated during the park: handed over, WRITE answered and read back; "
            "silent one closed after the grace")
    finally:
        a.close()
        b.close()


def changed_export(svc, conf, good_conf):
    h = nbdtest.libnbd_handle(svc.uri())
    h.pread(BLOCK, 0)
    with open(conf, "w") as f:
        f.write(good_conf + "block-size = 512\n")
    try:
        r = svc.ctl("--json", "upgrade", *BINARY)
        svc.reap()
        expect(r.returncode == 0, "upgrade: exit %d: %s" % (r.returncode, r.stderr.strip()))
        nbdtest.wait_until(lambda: "block sizes" in svc.log_text(), 5)
        try:
            h.pread(BLOCK, 0)
            CHECKS.add("the connection told block size 4096 was still served after the "
                       "export changed to 512")
        except nbd.Error as e:
            log("  the old connection: %s" % e)
        text = svc.log_text()
        expect(re.search(r"upgrade: export \"disk\" changed \(size \d+, flags 0x[0-9a-f]+, "
                         r"block sizes \d+/512/", text),
               "the new daemon's log does not say the export changed")
        h2 = nbdtest.libnbd_handle(svc.uri())
        expect(h2.get_block_size(nbd.SIZE_PREFERRED) == 512,
               "a new connection is not told the new block size")
        h2.pread(BLOCK, 0)
        nbdtest.shutdown_all([h2])
    finally:
        nbdtest.shutdown_all([h])
        with open(conf, "w") as f:
            f.write(good_conf)


def rollback(svc, conf, good_conf):
    h = nbdtest.libnbd_handle(svc.uri())
    pattern = os.urandom(BLOCK)
    h.pwrite(pattern, 60 * MIB)
    hang = os.path.join(svc.tmp, "hang.sh")
    with open(hang, "w") as f:
        f.write("#!/bin/sh\nexec sleep 600\n")
    os.chmod(hang, 0o755)
    # One that says HELLO, then takes nothing: the old daemon has parked
    # its connections and written its cache back by then, and resumes.
    silent = os.path.join(svc.tmp, "silent.py")
    with open(silent, "w") as f:
        f.write("#!%s\nimport os, struct, socket, time\n"
                "s = socket.socket(fileno=int(os.environ['NBDCACHED_UPGRADE_FD']))\n"
                "s.send(struct.pack('>IHHIII', 0x%x, 1, 1, 4, 0, os.getpid()))\n"
                "time.sleep(600)\n" % (sys.executable, MAGIC))
    os.chmod(silent, 0o755)
    cases = [("a binary that exits at once", ["--binary", "/bin/false"], "status 1"),
             ("a binary that hangs", ["--binary", hang, "--timeout", "2"], "within 2 s"),
             ("a new daemon that says HELLO and takes nothing",
              ["--binary", silent, "--timeout", "2"], "take the connections within 2 s"),
             ("a config that no longer parses", BINARY, "no-such-key")]
    try:
        for what, args, want in cases:
            pid = svc.pid_file()
            if "config" in what:
                with open(conf, "w") as f:
                    f.write(good_conf + "no-such-key = 1\n")
            t0 = time.time()
            r = svc.ctl("upgrade", *args)
            took = time.time() - t0
            svc.reap()
            if "config" in what:
                with open(conf, "w") as f:
                    f.write(good_conf)
            log("  %s: exit %d in %.1f s: %s" % (what, r.returncode, took, r.stderr.strip()))
            expect(r.returncode == 1, "%s: nbdcachectl upgrade exited %d" % (what, r.returncode))
            expect(want in r.stderr, "%s: the reason (%r) is not in %r" % (what, want, r.stderr))
            expect(svc.pid_file() == pid, "%s: the pidfile changed" % what)
            expect(h.pread(BLOCK, 60 * MIB) == pattern,
                   "%s: the old connection does not read its bytes" % what)
            h.pwrite(pattern, 60 * MIB)
            h.flush()
            served(svc, what)
    finally:
        nbdtest.shutdown_all([h])


def refused_nbdkit(tmp):
    if shutil.which("nbdkit") is None:
        raise Failed("nbdkit not found (install nbdkit)")
    os.mkdir(os.path.join(tmp, "kit"))
    d = nbdtest.Daemon([("kit", "nbdkit:memory size=1M", "")], workdir=os.path.join(tmp, "kit"))
    try:
        r = nbdtest.control_request(d.control, {"command": "upgrade"})
        expect(not r.get("ok") and "nbdkit" in r.get("error", ""),
               "an nbdkit: export: upgrade answered %s" % r)
        expect(d.alive(), "the daemon did not survive the refused upgrade")
    finally:
        d.stop()


MAGIC = 0x4e424355


def record(rtype, body, fds=0, version=1, length=None):
    import struct
    return struct.pack(">IHHII", MAGIC, version, rtype,
                       len(body) if length is None else length, fds) + body


def bad_records(tmp):
    import struct
    d = os.path.join(tmp, "bad")
    os.mkdir(d)
    disk = os.path.join(d, "disk.img")
    nbdtest.sparse_file(disk, MIB)
    sock_path = os.path.join(d, "nbd.sock")
    conn = struct.pack(">QQQQQQQHBIIIIH", 9, 1, 1, 0, 0, 0, MIB, 0, 1, 0, 512, 4096, MIB,
                       4) + b"disk" + \
        struct.pack(">I", 0)
    cases = [
        ("a newer version", record(4, struct.pack(">II", 0, 0), version=2), None,
         "version 2, this daemon reads version 1"),
        ("an older version", record(4, struct.pack(">II", 0, 0), version=0), None,
         "version 0"),
        ("a record cut short", record(3, conn[:20], fds=1, length=len(conn)), "fd",
         "cut short"),
        ("a CONNECTION without its descriptor", record(3, conn, fds=1), None,
         "1 descriptor(s) announced and 0 received"),
        ("an END that does not add up", record(4, struct.pack(">II", 3, 0)), None,
         "END says 3 connections"),
    ]
    for what, payload, with_fd, want in cases:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # A Unix socket the "old daemon" listens on: the new one must leave it.
        lsock = socket.socket(socket.AF_UNIX)
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        lsock.bind(sock_path)
        lsock.listen(1)
        env = dict(os.environ, NBDCACHED_UPGRADE_FD=str(b.fileno()))
        args = [nbdtest.NBDCACHED, "--foreground", "--unix", sock_path, "--control", "none",
                "--cache-size", "8M", "--export", "disk=" + disk]
        p = subprocess.Popen(args, env=env, pass_fds=[b.fileno()], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        b.close()
        try:
            a.settimeout(20)
            hello = a.recv(65536)
            require(len(hello) >= 16 and struct.unpack(">H", hello[6:8])[0] == 1,
                    "%s: no HELLO from the new daemon" % what)
            lrec = record(2, bytes([2]) + struct.pack(">H", len(sock_path)) +
                          sock_path.encode(), fds=1)
            socket.send_fds(a, [lrec], [lsock.fileno()])
            if with_fd:
                socket.send_fds(a, [payload], [lsock.fileno()])
            else:
                a.send(payload)
            err = a.recv(65536)
            text = err[16:].decode(errors="replace") if len(err) > 16 else ""
            rc = p.wait(timeout=20)
            out = p.stdout.read().decode(errors="replace")
            log("  %s: exit %d, ERROR %r" % (what, rc, text))
            expect(rc != 0, "%s: the new daemon exited 0" % what)
            expect(len(err) >= 16 and struct.unpack(">H", err[6:8])[0] == 7,
                   "%s: no ERROR record (got %r)" % (what, err[:16]))
            expect(want in text, "%s: the ERROR does not say %r: %r" % (what, want, text))
            expect(os.path.exists(sock_path),
                   "%s: the new daemon removed the socket path it was handed" % what)
            expect("ready" not in out, "%s: the new daemon said it was ready" % what)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            a.close()
            lsock.close()


def notify(tmp):
    import struct
    d = os.path.join(tmp, "notify")
    os.mkdir(d)
    disk = os.path.join(d, "disk.img")
    nbdtest.sparse_file(disk, MIB)
    npath = os.path.join(d, "notify.sock")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(npath)
    ns.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    control = os.path.join(d, "control.sock")
    pidfile = os.path.join(d, "pid")
    env = dict(os.environ, NOTIFY_SOCKET=npath, WATCHDOG_USEC="400000")
    args = ["sh", "-c", 'WATCHDOG_PID=$$ exec "$0" "$@"', nbdtest.NBDCACHED, "--foreground",
            "--unix", os.path.join(d, "nbd.sock"), "--control", control, "--pidfile", pidfile,
            "--cache-size", "8M", "--export", "disk=" + disk]
    logf = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen(args, env=env, stdout=logf, stderr=subprocess.STDOUT)
    msgs = []

    def drain(seconds):
        end = time.time() + seconds
        while time.time() < end:
            ns.settimeout(max(0.01, end - time.time()))
            try:
                data, anc, _, _ = ns.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                break
            pid = 0
            for level, kind, blob in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", blob[:12])[0]
            msgs.append((pid, data.decode(errors="replace")))
    new = 0
    try:
        drain(3)
        require(any("READY=1" in m for _, m in msgs), "no READY=1 at start: %s" % msgs)
        first = len(msgs)
        r = nbdtest.control_request(control, dict({"command": "upgrade"}, **BINARY_REQ),
                                    timeout=60)
        require(r.get("ok"), "upgrade: %s" % r)
        new = r["pid"]
        drain(1.5)
        after = msgs[first:]
        log("  after the upgrade: %s" % after)
        old_says = [m for pid, m in after if pid == p.pid]
        new_says = [m for pid, m in after if pid == new]
        expect(any("RELOADING=1" in m for m in old_says), "the old daemon never said RELOADING=1")
        expect(any(("MAINPID=%d" % new) in m for m in old_says),
               "the old daemon never said MAINPID=%d" % new)
        expect(any("READY=1" in m for m in new_says), "the new daemon never said READY=1")
        at_mainpid = next((i for i, (pid, m) in enumerate(after)
                           if pid == p.pid and "MAINPID=" in m), None)
        at_ready = next((i for i, (pid, m) in enumerate(after)
                         if pid == new and "READY=1" in m), None)
        expect(at_mainpid is not None and at_ready is not None and at_mainpid < at_ready,
               "the new daemon said READY=1 before the old one handed it MAINPID")
        expect(sum(1 for m in new_says if "WATCHDOG=1" in m) >= 2,
               "the new daemon does not feed the watchdog (WATCHDOG_PID is its own)")
    finally:
        for pid in (new, p.pid):
            nbdtest.stop_pid(pid, timeout=10)
        ns.close()
        logf.close()


def unprivileged(tmp):
    os.chmod(tmp, 0o755)  # the new daemon, as nobody, reaches the image
    d = os.path.join(tmp, "user")
    os.mkdir(d)
    os.chmod(d, 0o755)
    disk = os.path.join(d, "disk.img")
    nbdtest.sparse_file(disk, MIB)
    os.chmod(disk, 0o666)  # the new daemon opens it as nobody
    control = os.path.join(d, "control.sock")
    sock = os.path.join(d, "nbd.sock")
    args = [nbdtest.NBDCACHED, "--foreground", "--unix", sock, "--control", control,
            "--user", "nobody", "--cache-size", "8M", "--export", "disk=" + disk]
    logf = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT)
    new = 0
    try:
        require(nbdtest.wait_until(lambda: os.path.exists(control), 15), "no control socket")
        time.sleep(0.3)
        h = nbdtest.libnbd_handle("nbd+unix:///disk?socket=" + sock)
        h.pwrite(b"u" * BLOCK, 0)
        r = nbdtest.control_request(control, dict({"command": "upgrade"}, **BINARY_REQ),
                                    timeout=60)
        log("  upgrade as nobody: %s" % r)
        expect(r.get("ok"), "upgrading a daemon running as nobody: %s" % r)
        expect(r.get("ok") or r.get("errno") == "EAGAIN",
               "a failed upgrade answers errno %s, not EAGAIN" % r.get("errno"))
        new = r.get("pid", 0)
        expect(h.pread(BLOCK, 0) == b"u" * BLOCK, "the connection does not read its bytes")
        nbdtest.shutdown_all([h])
    finally:
        for pid in (new, p.pid):
            nbdtest.stop_pid(pid, timeout=10)
        logf.close()


def main():
    nbdtest.subreaper()
    t0 = time.time()
    with nbdtest.tempdir() as tmp:
        disk = os.path.join(tmp, "disk.img")
        nbdtest.sparse_file(disk, SIZE)
        conf = os.path.join(tmp, "nbdcached.conf")
        good_conf = ("[generic]\ncache-size = 32M\n\n[disk]\nbackend = %s\n" % disk)
        with open(conf, "w") as f:
            f.write(good_conf)
        svc = Service(tmp, conf)
        clients = []
        try:
            ok = CHECKS.run("%d upgrades with %d clients keeping %d commands in flight"
                            % (UPGRADES, CLIENTS, QD), lambda: clients.extend(under_load(svc)))
            CHECKS.run("roll-backs", rollback, svc, conf, good_conf)
            CHECKS.run("a WRITE payload half sent when the upgrade starts", half_payload, svc)
            CHECKS.run("clients negotiating when the upgrade parks", negotiating, svc)
            CHECKS.run("an export whose block size changed", changed_export, svc, conf,
                       good_conf)
            rc = svc.stop()
            expect(rc == 0, "the last daemon exited %d" % rc)
            svc.reap()
            if ok and clients:
                with open(disk, "rb") as f:
                    for c in clients:
                        f.seek(c.base)
                        nbdtest.require_same(f.read(REGION), bytes(c.model),
                                             "the file, client %d's region" % c.index,
                                             base=c.base)
            text = svc.log_text()
            expect("Sanitizer" not in text and "runtime error:" not in text,
                   "a sanitizer report in the daemons' log")
            expect(not os.path.exists(svc.sock), "the Unix socket is left after the last exit")
            expect(text.count("handed over to the new daemon") >= UPGRADES * CLIENTS,
                   "the log does not say every connection was handed over")
            pending = re.findall(r"so far, (\d+) bytes of input to parse", text)
            log("  %d connections resumed, %d of them with requests read and not parsed "
                "(%d bytes in all)" % (len(pending), sum(1 for p in pending if int(p)),
                                        sum(int(p) for p in pending)))
            expect(any(int(p) for p in pending),
                   "no connection was handed over with input read and not parsed: the "
                   "test did not exercise it")
        finally:
            if CHECKS.failures:
                log(svc.log_text()[-6000:])
            svc.kill_all()
        CHECKS.run("an nbdkit: export is refused up front", refused_nbdkit, tmp)
        CHECKS.run("bad state records: the new daemon refuses them and exits", bad_records, tmp)
        CHECKS.run("systemd: RELOADING, MAINPID, READY, the watchdog", notify, tmp)
        CHECKS.run("a daemon running as --user nobody", unprivileged, tmp)
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("upgrade")


if __name__ == "__main__":
    main()
