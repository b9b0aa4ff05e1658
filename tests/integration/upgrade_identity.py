#!/usr/bin/python3
"""upgrade_identity: a live upgrade resumes a connection only on the object
it negotiated, and only for a client that the new access rules admit;
otherwise the new daemon closes it, after the replies the old one sent,
and the log and `nbdcachectl upgrade` say why (issue 40, item 5).

Each case starts a daemon (--config FILE, a Unix socket, a TCP port on
127.0.0.1), opens connections, changes the config file and runs
`nbdcachectl upgrade`. The test process is a child subreaper, so that the
new daemons, orphaned when their predecessor exits, are its children.

  1  Another file under the same export name (a.img -> b.img, same size):
     the connection is closed (READ and WRITE fail), the reply says
     refused 1 and why ("another backend"), so does the new daemon's log;
     a new connection reads b.img; in the end a.img holds what was written
     to it before the upgrade, and b.img is untouched.
  2  The same file under another path (a symbolic link to a.img): the
     connection is resumed and reads what it wrote (the identity is the
     file's, not its path's).
  3  The file replaced under the same path (os.replace of a copy with
     other bytes): the path is the same, the file is not; the connection
     is closed, and neither file gets anything from it.
  4  The access rules tightened: `allow` no longer names 127.0.0.1: the TCP
     connection is closed with the rule that refused it ("not in allow"),
     the Unix one (address rules do not apply to it) is resumed. Then the
     export's own allow-users names another user: the Unix connection is
     closed ("allow-users").
  5  "After its in-flight replies": a WRITE whose payload is half sent on
     TCP when the upgrade starts, to a new config that puts the export on
     b.img; once the upgrade has parked the connection, the rest of the
     payload and a second WRITE pipelined behind it. The first WRITE is
     answered (error 0) by the old daemon, then the new one closes the
     connection (EOF, no reply to the second WRITE); the first is in
     a.img, the second nowhere.

  6  An older daemon's hand-over (the test plays it, as upgrade.py's bad
     records do): a CONNECTION record without the backend's identity. The
     new daemon answers TAKEN in the layout an older daemon reads (its
     first field alone), and after COMMIT closes that connection (EOF),
     its log saying it was handed over without its backend's identity;
     it serves new connections.

On main the connection of 1, 3 and 5 goes on over b.img (or the new file),
the refused clients of 4 keep being served, and 6 closes the connection
for another reason, if at all.
"""

import json
import os
import re
import signal
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
SIZE = 4 * MIB
BLOCK = 4096
# As upgrade.py: the binary to upgrade to, when NBDCACHED names a wrapper.
BINARY = ["--binary", nbdtest.NBDCACHED] if os.environ.get("NBDCACHED") else []
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, OSError, subprocess.SubprocessError))
expect = CHECKS.expect


class Service:
    """One daemon through its upgrades: the current PID from the pidfile."""

    def __init__(self, tmp, conf):
        self.tmp = tmp
        self.conf = conf
        self.sock = os.path.join(tmp, "nbd.sock")
        self.control = os.path.join(tmp, "control.sock")
        self.pidfile = os.path.join(tmp, "nbdcached.pid")
        self.logpath = os.path.join(tmp, "nbdcached.log")
        self.port = nbdtest.free_port()
        self.args = [nbdtest.NBDCACHED, "--foreground", "--config", conf,
                     "--unix", self.sock, "--listen", "127.0.0.1:%d" % self.port,
                     "--control", self.control, "--pidfile", self.pidfile,
                     "--threads", "2", "--log-level", "info"]
        self.logf = open(self.logpath, "w")
        log("+ " + " ".join(self.args))
        self.first = subprocess.Popen(self.args, stdout=self.logf, stderr=subprocess.STDOUT)
        self.pids = {self.first.pid}
        require(nbdtest.wait_until(lambda: self.pid() == self.first.pid, 15),
                "the daemon did not start (no pidfile)")

    def pid(self):
        return nbdtest.pidfile_pid(self.pidfile)

    def uri(self, name, tcp=False):
        if tcp:
            return "nbd://127.0.0.1:%d/%s" % (self.port, name)
        return "nbd+unix:///%s?socket=%s" % (name, self.sock)

    def log_text(self):
        self.logf.flush()
        with open(self.logpath) as f:
            return f.read()

    def upgrade(self, json_out=True):
        """nbdcachectl upgrade: the reply (JSON) or the text it printed."""
        before = self.pid()
        cmd = [nbdtest.NBDCACHECTL, "--control", self.control] + \
            (["--json"] if json_out else []) + ["upgrade"] + BINARY
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        nbdtest.reap_children()
        require(r.returncode == 0, "upgrade: exit %d: %s" % (r.returncode, r.stderr.strip()))
        log("  upgrade: %s" % r.stdout.strip())
        if json_out:
            reply = json.loads(r.stdout)
            new = reply["pid"]
        else:
            m = re.search(r"pid (\d+) serves now", r.stdout)
            require(m, "upgrade: no pid in %r" % r.stdout)
            new, reply = int(m.group(1)), r.stdout
        self.pids.add(new)
        require(nbdtest.wait_until(lambda: self.pid() == new, 10),
                "the new daemon (pid %d) did not write its pidfile (was %d)" % (new, before))
        # The new daemon resumes (or closes) the connections just after the
        # old one has replied: its log says so for each.
        time.sleep(0.3)
        return reply

    def stop(self):
        pid = self.pid()

        def adopted():
            # The new daemon is this process's (a subreaper's) child only
            # once the old one has exited, which a slow build (TSan) takes
            # a while over after handing over.
            nbdtest.reap_children()
            try:
                with open("/proc/%d/stat" % pid) as f:
                    return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
            except (OSError, ValueError, IndexError):
                return True
        nbdtest.wait_until(adopted, 30)
        rc = nbdtest.stop_pid(pid)
        nbdtest.reap_children()
        text = self.log_text()
        expect("Sanitizer" not in text and "runtime error:" not in text,
               "a sanitizer report in the daemons' log")
        return rc

    def kill_all(self):
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        nbdtest.reap_children()
        self.logf.close()


def write_conf(path, export_lines, generic=""):
    with open(path, "w") as f:
        f.write("[generic]\ncache-size = 32M\n%s\n[x]\n%s\n" % (generic, export_lines))


def random_bytes(path, seed):
    nbdtest.random_file(path, SIZE, seed=seed)
    with open(path, "rb") as f:
        return f.read()


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def closed(h, what, other=None):
    """The connection of handle h no longer serves: a READ and a WRITE both
    fail. What it read, if it could, is in the failure (other: the bytes
    at MIB of the file it must not reach)."""
    try:
        got = h.pread(BLOCK, MIB)
        whose = " (the other file's bytes)" if other and bytes(got) == other else ""
        return "%s: READ still answered after the upgrade%s (%r...)" % (what, whose,
                                                                      bytes(got[:8]))
    except nbd.Error as e:
        log("  %s: READ: %s" % (what, e))
    try:
        h.pwrite(b"Z" * BLOCK, 2 * MIB)
        h.flush()
        return "%s: WRITE still answered after the upgrade" % what
    except nbd.Error as e:
        log("  %s: WRITE: %s" % (what, e))
    return None


def refused_said(reply, count, words, what):
    """The upgrade's reply says count connection(s) refused, and why."""
    got = reply.get("refused")
    expect(got == count, "%s: the upgrade's reply says refused %s, expected %d: %s"
           % (what, got, count, reply))
    why = reply.get("refused_why") or ""
    for w in words:
        expect(w in why, "%s: the upgrade's reply does not say %r: %r" % (what, w, why))


def another_file(tmp):
    a, b = os.path.join(tmp, "a.img"), os.path.join(tmp, "b.img")
    a0, b0 = random_bytes(a, 1), random_bytes(b, 2)
    conf = os.path.join(tmp, "one.conf")
    write_conf(conf, "backend = %s\n" % a)
    svc = Service(tmp, conf)
    try:
        h = nbdtest.libnbd_handle(svc.uri("x"))
        written = os.urandom(BLOCK)
        h.pwrite(written, 0)
        h.flush()
        require(h.pread(BLOCK, MIB) == a0[MIB:MIB + BLOCK], "the connection does not read a.img")
        write_conf(conf, "backend = %s\n" % b)
        mark = len(svc.log_text())
        reply = svc.upgrade()
        why = closed(h, "the connection opened on a.img", b0[MIB:MIB + BLOCK])
        if why:
            CHECKS.add(why)
        refused_said(reply, 1, ['"x"', "another backend", a, b], "another file")
        expect(reply.get("moved") == 0, "another file: moved %s, expected 0" % reply.get("moved"))
        text = svc.log_text()[mark:]
        expect(re.search(r"conn \d+: closed by the new daemon: .*\"x\" is on another backend",
                         text), "the new daemon's log does not say why it closed the connection")
        h2 = nbdtest.libnbd_handle(svc.uri("x"))
        expect(h2.pread(BLOCK, MIB) == b0[MIB:MIB + BLOCK], "a new connection does not read b.img")
        expect(h2.pread(BLOCK, 0) == b0[:BLOCK],
               "a new connection reads at 0 something else than b.img's bytes")
        nbdtest.shutdown_all([h, h2])
        expect(svc.stop() == 0, "the last daemon did not exit 0")
        want_a = bytearray(a0)
        want_a[:BLOCK] = written
        nbdtest.require_same(file_bytes(a), bytes(want_a), "a.img")
        nbdtest.require_same(file_bytes(b), b0, "b.img (which the connection never opened)")
        log("  a.img -> b.img: the connection was closed; a.img has its write, b.img nothing")
    finally:
        if CHECKS.failures:
            log(svc.log_text()[-3000:])
        svc.kill_all()


def same_file(tmp):
    d = os.path.join(tmp, "same")
    os.mkdir(d)
    a = os.path.join(d, "a.img")
    random_bytes(a, 3)
    alias = os.path.join(d, "alias.img")
    os.symlink(a, alias)
    conf = os.path.join(d, "same.conf")
    write_conf(conf, "backend = %s\n" % a)
    svc = Service(d, conf)
    try:
        h = nbdtest.libnbd_handle(svc.uri("x"))
        written = os.urandom(BLOCK)
        h.pwrite(written, 0)
        write_conf(conf, "backend = %s\n" % alias)
        reply = svc.upgrade()
        expect(reply.get("refused", 0) == 0 and reply.get("moved") == 1,
               "the same file under another path: %s" % reply)
        expect(h.pread(BLOCK, 0) == written,
               "the connection does not read its write after the upgrade")
        h.flush()
        nbdtest.shutdown_all([h])
        expect(svc.stop() == 0, "the last daemon did not exit 0")
        expect(file_bytes(a)[:BLOCK] == written, "a.img does not hold the write")
        log("  a.img -> a symbolic link to it: resumed")
    finally:
        if CHECKS.failures:
            log(svc.log_text()[-3000:])
        svc.kill_all()


def replaced_file(tmp):
    d = os.path.join(tmp, "replaced")
    os.mkdir(d)
    a, c = os.path.join(d, "a.img"), os.path.join(d, "c.img")
    a0, c0 = random_bytes(a, 4), random_bytes(c, 5)
    conf = os.path.join(d, "replaced.conf")
    write_conf(conf, "backend = %s\n" % a)
    svc = Service(d, conf)
    old = open(a, "rb")  # the file the connection is on, after the rename too
    try:
        h = nbdtest.libnbd_handle(svc.uri("x"))
        written = os.urandom(BLOCK)
        h.pwrite(written, 0)
        h.flush()
        os.replace(c, a)  # the same path, another file; the config unchanged
        reply = svc.upgrade()
        why = closed(h, "the connection opened on the file replaced since",
                     c0[MIB:MIB + BLOCK])
        if why:
            CHECKS.add(why)
        refused_said(reply, 1, ["another backend", "inode"], "the file replaced")
        nbdtest.shutdown_all([h])
        expect(svc.stop() == 0, "the last daemon did not exit 0")
        want = bytearray(a0)
        want[:BLOCK] = written
        old.seek(0)
        nbdtest.require_same(old.read(), bytes(want), "the replaced file")
        nbdtest.require_same(file_bytes(a), c0, "the file now at the path")
        log("  a.img replaced by another file: the connection was closed")
    finally:
        old.close()
        if CHECKS.failures:
            log(svc.log_text()[-3000:])
        svc.kill_all()


def access_rules(tmp):
    d = os.path.join(tmp, "access")
    os.mkdir(d)
    a = os.path.join(d, "a.img")
    a0 = random_bytes(a, 6)
    conf = os.path.join(d, "access.conf")
    write_conf(conf, "backend = %s\n" % a, generic="allow = 127.0.0.1\n")
    svc = Service(d, conf)
    try:
        tcp = nbdtest.libnbd_handle(svc.uri("x", tcp=True))
        unix = nbdtest.libnbd_handle(svc.uri("x"))
        tcp.pwrite(b"t" * BLOCK, 0)
        unix.pwrite(b"u" * BLOCK, BLOCK)
        write_conf(conf, "backend = %s\n" % a, generic="allow = 127.0.0.2\n")
        mark = len(svc.log_text())
        reply = svc.upgrade()
        why = closed(tcp, "the TCP connection from 127.0.0.1, no longer allowed")
        if why:
            CHECKS.add(why)
        refused_said(reply, 1, ["not in allow", "127.0.0.1"], "allow tightened")
        text = svc.log_text()[mark:]
        expect(re.search(r"conn \d+: closed by the new daemon: .*not in allow", text),
               "the new daemon's log does not say which rule refused the TCP client")
        expect(unix.pread(BLOCK, BLOCK) == b"u" * BLOCK,
               "the Unix connection (address rules do not apply) was not resumed")
        # The export's own rules: another user only.
        write_conf(conf, "backend = %s\nallow-users = 65534\n" % a,
                   generic="allow = 127.0.0.2\n")
        if os.getuid() == 65534:
            raise Failed("the test runs as uid 65534, the one the rule allows")
        out = svc.upgrade(json_out=False)
        why = closed(unix, "the Unix connection, its user no longer allowed")
        if why:
            CHECKS.add(why)
        expect("closed by the new daemon" in out and "allow-users" in out,
               "nbdcachectl upgrade does not say why it closed the Unix connection: %r" % out)
        nbdtest.shutdown_all([tcp, unix])
        expect(svc.stop() == 0, "the last daemon did not exit 0")
        want = bytearray(a0)
        want[:BLOCK] = b"t" * BLOCK
        want[BLOCK:2 * BLOCK] = b"u" * BLOCK
        nbdtest.require_same(file_bytes(a), bytes(want), "a.img")
        log("  allow tightened: the TCP client closed, the Unix one resumed; then "
            "allow-users: the Unix one closed")
    finally:
        if CHECKS.failures:
            log(svc.log_text()[-3000:])
        svc.kill_all()


def replies_first(tmp):
    sys.path.insert(0, HERE)
    import bad_input as raw
    d = os.path.join(tmp, "replies")
    os.mkdir(d)
    a, b = os.path.join(d, "a.img"), os.path.join(d, "b.img")
    a0, b0 = random_bytes(a, 7), random_bytes(b, 8)
    conf = os.path.join(d, "replies.conf")
    write_conf(conf, "backend = %s\n" % a)
    svc = Service(d, conf)
    r = None
    try:
        r = raw.RawClient(port=svc.port, timeout=30)
        r.open("x", extended=True)
        first, second = os.urandom(64 * 1024), os.urandom(BLOCK)
        off1, off2 = MIB, 3 * MIB
        cookie, hdr = r.encode_request(raw.CMD_WRITE, off1, len(first))
        r.pending[cookie] = (raw.CMD_WRITE, off1, len(first))
        r.send(hdr + first[:20000])
        write_conf(conf, "backend = %s\n" % b)
        mark = len(svc.log_text())
        result = {}

        def up():
            try:
                result["reply"] = svc.upgrade()
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = e
        t = threading.Thread(target=up, daemon=True)
        t.start()
        require(nbdtest.wait_until(lambda: "connections parking" in svc.log_text()[mark:], 30,
                                   step=0.01),
                "the upgrade did not begin parking the connections within 30 s")
        time.sleep(0.2)
        c2, hdr2 = r.encode_request(raw.CMD_WRITE, off2, len(second))
        r.pending[c2] = (raw.CMD_WRITE, off2, len(second))
        r.send(first[20000:] + hdr2 + second)
        reply = r.read_reply(cookie)
        expect(reply.error == 0, "the WRITE answered before the hand-over: error %d"
               % reply.error)
        t.join(120)
        require("reply" in result, "the upgrade: %s" % result.get("error", "no answer"))
        refused_said(result["reply"], 1, ["another backend"], "the pipelined client")
        try:
            got = r.wait_closed(15)
            expect(got == b"", "the refused connection was sent %d bytes after the "
                   "first reply (an answer to the second WRITE?)" % len(got))
        except raw.Mismatch as e:
            CHECKS.add("the refused connection: %s" % e)
        r.close()
        r = None
        expect(svc.stop() == 0, "the last daemon did not exit 0")
        want = bytearray(a0)
        want[off1:off1 + len(first)] = first
        nbdtest.require_same(file_bytes(a), bytes(want), "a.img (the first WRITE only)")
        nbdtest.require_same(file_bytes(b), b0, "b.img (the second WRITE must not reach it)")
        log("  the WRITE answered before the hand-over got its reply, then EOF; the one "
            "pipelined behind it went nowhere")
    finally:
        if r:
            r.close()
        if CHECKS.failures:
            log(svc.log_text()[-3000:])
        svc.kill_all()


MAGIC = 0x4e424355


def record(rtype, body, fds=0):
    import struct
    return struct.pack(">IHHII", MAGIC, 1, rtype, len(body), fds) + body


def older_daemon(tmp):
    """Play a daemon of the first record layout handing over a connection."""
    import socket
    import struct
    d = os.path.join(tmp, "older")
    os.mkdir(d)
    disk = os.path.join(d, "a.img")
    nbdtest.sparse_file(disk, SIZE)
    sock_path = os.path.join(d, "nbd.sock")
    logpath = os.path.join(d, "log")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(sock_path)
    lsock.listen(4)
    client, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ, NBDCACHED_UPGRADE_FD=str(b.fileno()))
    args = [nbdtest.NBDCACHED, "--foreground", "--unix", sock_path, "--control", "none",
            "--cache-size", "8M", "--export", "x=" + disk, "--log-level", "info"]
    logf = open(logpath, "w")
    p = subprocess.Popen(args, env=env, pass_fds=[b.fileno()], stdout=logf,
                         stderr=subprocess.STDOUT)
    b.close()
    try:
        a.settimeout(20)
        hello = a.recv(65536)
        require(len(hello) >= 16 and struct.unpack(">H", hello[6:8])[0] == 1,
                "no HELLO from the new daemon")
        lrec = record(2, bytes([2]) + struct.pack(">H", len(sock_path)) + sock_path.encode(),
                      fds=1)
        socket.send_fds(a, [lrec], [lsock.fileno()])
        # The first layout: no UPGRADE_CONN_IDENTITY, nothing after the
        # pending input (here a READ the client sent: never executed).
        body = struct.pack(">QQQQQQQHBIIIIH", 5, 1000, 3, 0, 0, 0, SIZE, 0, 1, 0, 1, 4096,
                           32 * MIB, 1) + b"x"
        read = struct.pack(">IHHQQI", 0x25609513, 0, 0, 0xabc, 0, 512)
        body += struct.pack(">I", len(read)) + read
        socket.send_fds(a, [record(3, body, fds=1)], [server_end.fileno()])
        server_end.close()
        a.send(record(4, struct.pack(">II", 1, 1)))
        taken = a.recv(65536)
        require(len(taken) >= 16 and struct.unpack(">H", taken[6:8])[0] == 5,
                "no TAKEN from the new daemon: %r" % taken[:32])
        expect(taken[8:12] == struct.pack(">I", 4) and len(taken) == 20,
               "the TAKEN to an older daemon is not the one it reads (a body of %d bytes)"
               % (len(taken) - 16))
        a.send(record(6, b""))
        client.settimeout(15)
        got = b""
        try:
            while True:
                c = client.recv(65536)
                if not c:
                    break
                got += c
        except socket.timeout:
            CHECKS.add("the connection handed over without an identity was not closed "
                       "within 15 s")
        except ConnectionResetError:
            pass
        expect(got == b"", "the connection without an identity was answered: %r" % got[:32])
        logf.flush()
        with open(logpath) as f:
            text = f.read()
        expect(re.search(r"conn 5: closed by the new daemon: .*without its backend's identity",
                         text), "the new daemon's log does not say why it closed conn 5")
        h = nbdtest.libnbd_handle("nbd+unix:///x?socket=" + sock_path)
        expect(len(h.pread(BLOCK, 0)) == BLOCK, "a new connection is not served")
        nbdtest.shutdown_all([h])
        log("  an older daemon's connection, without identity: TAKEN as it reads it, then "
            "closed, saying why")
    finally:
        client.close()
        lsock.close()
        a.close()
        if p.poll() is None:
            p.terminate()
            try:
                expect(p.wait(timeout=30) == 0, "the new daemon exited %s" % p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logf.close()
        with open(logpath) as f:
            text = f.read()
        expect("Sanitizer" not in text and "runtime error:" not in text,
               "a sanitizer report in the new daemon's log")
        if CHECKS.failures:
            with open(logpath) as f:
                log(f.read()[-3000:])


def main():
    nbdtest.subreaper()
    t0 = time.time()
    with nbdtest.tempdir() as tmp:
        CHECKS.run("another file under the export's name", another_file, tmp)
        CHECKS.run("the same file under another path", same_file, tmp)
        CHECKS.run("the file replaced under the same path", replaced_file, tmp)
        CHECKS.run("the access rules tightened", access_rules, tmp)
        CHECKS.run("the replies sent before the hand-over reach a refused client",
                   replies_first, tmp)
        CHECKS.run("an older daemon hands over a connection without its identity",
                   older_daemon, tmp)
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("upgrade_identity")


if __name__ == "__main__":
    main()
