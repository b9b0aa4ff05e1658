#!/usr/bin/python3
"""durability: what a FLUSH promises, on the paths where things go wrong.

  torn        a writeback is stuck half sent (the backend nbdkit stopped
              with SIGSTOP while a FLUSH writes 8 MiB back through a full
              socket), and the client rewrites the same blocks meanwhile:
              once the backend runs again and the FLUSH completes, every
              4 KiB block of the backend file is all old or all new data,
              never a mix (the write waits for the blocks being sent)
  reaper      two exports, b writethrough over nbdkit (log filter): 4 KiB
              written to b without FLUSH, the client leaves, b is removed
              from the config, SIGHUP: the reaper flushes b's backend
              before closing it (a Flush in nbdkit's log after the write),
              says so, and SIGTERM later exits 0 (under ASan: no use after
              free of the closed backend)
  log-flood   a backend failing half its writes at random (nbdkit error
              filter) under writeback for 4 s: at most a failure and a
              recovery line per 10 s interval (WB_LOG_INTERVAL_NS) the
              flood touched, measured, not one per failure
  stop-notify systemd: stopping with dirty data on a slow backend (nbdkit
              delay filter, 2 s a write; 128 writes, at most 64 in flight:
              two rounds at least, whatever the machine) sends STOPPING,
              and EXTEND_TIMEOUT_USEC once the first round is written (the
              daemon says progress about once a second while data is left),
              and exits 0 with the backend exact
  stop-failing stopping while the backend refuses every write: the daemon
              keeps the data and says so; a second SIGTERM ends it with exit
              status 1 and the number of bytes lost
  mode-none   cache-mode none: a write, TRIM and WRITE_ZEROES reach the
              backend (nbdkit, log filter) as they are and read back; a
              FLUSH after them flushes the backend (a Flush in nbdkit's log
              after the last of them), and the cache holds nothing. Over
              tests/nbdkit-fault dropping unflushed writes when a flush
              fails: a FLUSH while the backend's flushes fail reports EIO
              and the next one succeeds; another connection's next FLUSH
              reports the lost direct write (EIO) once

Every check runs; the failures are listed at the end.
"""

import errno
import os
import random
import signal
import socket
import sys
import threading
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import faults  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect
PEERS = []


wait_until = nbdtest.wait_until


def stats(d, export=None):
    reply = nbdtest.control_request(d.control, {"command": "stats"})
    if export is None:
        return reply
    for e in reply.get("exports", []):
        if e.get("name") == export:
            return e
    raise Failed("no stats for export %r: %r" % (export, reply))


class TcpNbdkit(nbdtest.Nbdkit):
    """nbdkit on a TCP port of 127.0.0.1 (uri() is nbd://)."""

    def __init__(self, tmp, name, args):
        self.port = nbdtest.free_port()
        super().__init__(tmp, name, args, peers=PEERS)

    def start(self):
        if os.path.lexists(self.pidfile):
            os.unlink(self.pidfile)
        cmd = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(self.port), "-P", self.pidfile]
        return self.spawn(cmd + self.args, self.pidfile_written, "write its pidfile")

    def uri(self):
        return "nbd://127.0.0.1:%d/" % self.port


def torn(tmp):
    size = 256 * MIB
    chunk = 2 * MIB
    # Every other 2 MiB: each one entry, written back as one backend write
    # straight from the arena (adjacent ones would be gathered into a
    # copy); 64 MiB in all, more than loopback TCP buffers hold.
    chunks = range(0, 128 * MIB, 2 * chunk)
    img = os.path.join(tmp, "torn.img")
    nbdtest.sparse_file(img, size)
    # Over TCP: a stalled socket takes part of a request, so a writeback
    # can be left half sent while the client writes the same blocks again.
    kit = TcpNbdkit(tmp, "torn", ["file", img])
    old = bytes([0xAA]) * chunk
    new = bytes([0x55]) * chunk
    blk = 4 * KIB
    with nbdtest.running_daemon([("t", kit.uri(), "cache-mode=writeback,block-size=4096")],
                                extra=["--cache-size", "512M", "--dirty-expire", "3600",
                                       "--backend-timeout", "60"]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("t"))
        for off in chunks:
            h.pwrite(old, off)
        os.kill(kit.proc.pid, signal.SIGSTOP)
        try:
            flush = h.aio_flush()
            time.sleep(1.0)  # the writeback fills the sockets and stalls
            writes = [h.aio_pwrite(new[:256 * KIB], off + k)
                      for off in chunks for k in range(0, chunk, 256 * KIB)]
            # libnbd sends only while it is driven: drive it for a second.
            end = time.time() + 1.5
            for _ in range(1000):
                if time.time() > end:
                    break
                h.poll(10)
        finally:
            os.kill(kit.proc.pid, signal.SIGCONT)
        # What the first FLUSH left on the backend, before anything else is
        # written back (--dirty-expire 3600).
        wait_until(lambda: (h.poll(0) or True) and h.aio_command_completed(flush), 60, 0.01)
        data = nbdtest.read_at(img, 0, 128 * MIB)
        for c in writes:
            wait_until(lambda c=c: (h.poll(0) or True) and h.aio_command_completed(c), 60, 0.01)
        mixed = []
        kinds = {"old": 0, "new": 0}
        for base in chunks:
            for off in range(base, base + chunk, blk):
                b = data[off:off + blk]
                if b == old[:blk]:
                    kinds["old"] += 1
                elif b == new[:blk]:
                    kinds["new"] += 1
                else:
                    mixed.append(off)
        log("torn: 4 KiB blocks after the first FLUSH: %r, %d mixed" % (kinds, len(mixed)))
        expect(not mixed, "torn: %d blocks of the backend mix old and new data (first at %s)"
               % (len(mixed), mixed[:1]))
        h.flush()
        after = nbdtest.read_at(img, 0, 128 * MIB)
        expect(all(after[off:off + chunk] == new for off in chunks),
               "torn: after the second FLUSH the backend is not all new data")
        expect(all(h.pread(chunk, off) == new for off in chunks),
               "torn: the export does not read the new data")
        h.shutdown()
    kit.stop()


def write_config(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)


def reaper(tmp):
    a = os.path.join(tmp, "a.img")
    b = os.path.join(tmp, "b.img")
    nbdtest.sparse_file(a, 8 * MIB)
    nbdtest.sparse_file(b, 8 * MIB)
    kitlog = os.path.join(tmp, "b-kit.log")
    kit = nbdtest.Nbdkit(tmp, "reap", ["--filter=log", "file", b, "logfile=" + kitlog],
                         peers=PEERS)
    conf = os.path.join(tmp, "reap.conf")
    generic = "[generic]\ncache-size = 64M\ndirty-expire = 3600\n\n"
    write_config(conf, generic + "[a]\nbackend = %s\n\n[b]\nbackend = %s\ncache-mode = "
                 "writethrough\n" % (a, kit.uri()))
    d = nbdtest.CheckedDaemon([], extra=["--config", conf])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("b"))
        h.pwrite(b"\x42" * 4096, 0)
        h.shutdown()
        write_config(conf, generic + "[a]\nbackend = %s\n" % a)
        os.kill(d.pid, signal.SIGHUP)
        closed = wait_until(lambda: "written back and closed" in d.log_text(), 20)
        expect(closed, "reaper: the removed export was not closed within 20 s")
        time.sleep(1.0)
        with open(kitlog) as f:
            lines = f.read().splitlines()
        writes = [i for i, ln in enumerate(lines) if " Write " in ln]
        flushes = [i for i, ln in enumerate(lines) if " Flush " in ln]
        expect(writes, "reaper: nbdkit never saw the write")
        expect(writes and any(f > writes[-1] for f in flushes),
               "reaper: the backend was closed without a flush after the write "
               "(nbdkit log: %s)" % [ln[:60] for ln in lines if "Write" in ln or "Flush" in ln])
    finally:
        rc = d.stop(expect_rc=None, timeout=30)
        expect(rc == 0, "reaper: SIGTERM after the reap exited %s, not 0" % rc)
    kit.stop()


def failing_writes(tmp, name, img, rate):
    """nbdkit serving img whose writes fail with EIO at rate (nbdkit's error
    filter) while the returned error file exists."""
    efile = os.path.join(tmp, name + ".fail")
    open(efile, "w").close()
    kit = nbdtest.Nbdkit(tmp, name, ["--filter=error", "file", img, "error=EIO",
                                     "error-pwrite-rate=" + rate, "error-pwrite-file=" + efile],
                         peers=PEERS)
    return kit, efile


def log_flood(tmp):
    img = os.path.join(tmp, "flood.img")
    nbdtest.sparse_file(img, 16 * MIB)
    kit, efile = failing_writes(tmp, "flood", img, "50%")
    d = nbdtest.CheckedDaemon([("f", kit.uri(), "cache-mode=writeback")],
                              extra=["--cache-size", "64M", "--dirty-expire", "1"])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("f"))
        rng = random.Random(3)
        began = time.time()
        end = began + 4
        for _ in range(100000):
            if time.time() > end:
                break
            h.pwrite(rng.randbytes(4096), rng.randrange(4096) * 4096)
            time.sleep(0.001)
        text = d.log_text()
        span = time.time() - began
        failed = sum(1 for ln in text.splitlines() if "failed:" in ln and "backend" in ln)
        again = sum(1 for ln in text.splitlines() if "works again" in ln)
        errors = stats(d, "f").get("writeback_errors", 0)
        # A failure line and a recovery line per 10 s interval at most
        # (writeback.c, WB_LOG_INTERVAL_NS), in each interval the flood
        # touched: a count from its measured span (a busy machine may
        # stretch it), not a fixed one; one more interval of slack.
        bound = 2 * (2 + int(span / 10))
        log("log-flood: %d failure lines, %d recovery lines, %d writeback errors in %.1f s"
            % (failed, again, errors, span))
        expect(errors > 10, "log-flood: the backend did not fail (writeback_errors %d)" % errors)
        expect(failed + again <= bound, "log-flood: %d lines about %d writeback failures in "
               "%.1f s (at most %d)" % (failed + again, errors, span, bound))
        h.shutdown()
    finally:
        os.unlink(efile)
        d.stop(expect_rc=None, timeout=60)
    kit.stop()


def stop_notify(tmp):
    img = os.path.join(tmp, "slow.img")
    nbdtest.sparse_file(img, 64 * MIB)
    kit = nbdtest.Nbdkit(tmp, "slow", ["--filter=delay", "file", img, "delay-write=2"],
                         peers=PEERS)
    nsock = os.path.join(tmp, "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(nsock)
    srv.settimeout(0.2)
    msgs = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                msgs.append(srv.recv(4096).decode(errors="replace"))
            except socket.timeout:
                continue
            except OSError:
                return

    t = threading.Thread(target=listen)
    t.start()
    env = dict(os.environ, NOTIFY_SOCKET=nsock)
    d = nbdtest.CheckedDaemon([("s", kit.uri(), "cache-mode=writeback")],
                              extra=["--cache-size", "256M", "--dirty-expire", "3600",
                                     "--dirty-high", "90"], env=env)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("s"))
        rng = random.Random(9)
        model = {}
        # 128 scattered 64 KiB writes: 2 s a backend write, at most 64 in
        # flight (4 connections, 16 nbdkit threads each): about 4 s to drain,
        # in two rounds at least on any machine.
        for _ in range(128):
            off = rng.randrange(64 * MIB // (64 * KIB)) * 64 * KIB
            data = rng.randbytes(64 * KIB)
            model[off] = data
            h.pwrite(data, off)
        h.shutdown()
        t0 = time.time()
        rc = d.stop(expect_rc=None, timeout=120)
        took = time.time() - t0
        expect(rc == 0, "stop-notify: exit status %s" % rc)
    finally:
        stop.set()
        t.join()
        srv.close()
    ext = [m for m in msgs if "EXTEND_TIMEOUT_USEC=" in m]
    log("stop-notify: stopped in %.1f s; %d EXTEND_TIMEOUT_USEC messages" % (took, len(ext)))
    expect(any("STOPPING=1" in m for m in msgs), "stop-notify: no STOPPING=1")
    # Not "if it took over 2 s": the drain has two rounds of writes at
    # least (2 s each, delay-write), so data is left for 2 s after the
    # first round is written, and the daemon says that progress within
    # about a second (server.c, on_stop_progress). A machine that is
    # slower only makes the rounds longer.
    expect(took >= 2 * 2 - 0.5, "stop-notify: the stop took %.1f s, less than two rounds of "
           "2 s writes: the test's setup did not hold" % took)
    expect(ext, "stop-notify: %.1f s of writeback at stop and no EXTEND_TIMEOUT_USEC" % took)
    for off, data in model.items():
        expect(nbdtest.read_at(img, off, len(data)) == data,
               "stop-notify: the backend lacks the write at %d" % off)
    kit.stop()


def stop_failing(tmp):
    """Stopping while the backend refuses every write: the data is kept and
    retried; a second SIGTERM ends the daemon with exit status 1 and says
    how many bytes are not durable."""
    img = os.path.join(tmp, "refuse.img")
    nbdtest.sparse_file(img, 16 * MIB)
    kit, efile = failing_writes(tmp, "refuse", img, "100%")
    d = nbdtest.CheckedDaemon([("r", kit.uri(), "cache-mode=writeback")],
                              extra=["--cache-size", "64M", "--dirty-expire", "3600"])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("r"))
        h.pwrite(b"\x17" * (64 * KIB), 0)
        h.shutdown()
        os.kill(d.pid, signal.SIGTERM)
        expect(wait_until(lambda: "not durable yet" in d.log_text(), 15),
               "stop-failing: no line saying what is not durable")
        expect(d.alive(), "stop-failing: the daemon exited with its data not written")
        os.kill(d.pid, signal.SIGTERM)
        try:
            rc = d.proc.wait(timeout=15)
        except Exception:
            rc = None
        text = d.log_text()
        log("stop-failing: exit status %s" % rc)
        expect(rc == 1, "stop-failing: a second SIGTERM with 65536 bytes not durable "
               "exited %s, not 1" % rc)
        expect("65536 bytes not durable" in text,
               "stop-failing: the exit does not say how many bytes are lost")
    finally:
        d.kill()
        d.logf.close()
    kit.stop()


def mode_none(tmp):
    img = os.path.join(tmp, "none.img")
    nbdtest.sparse_file(img, 8 * MIB)
    kitlog = os.path.join(tmp, "none-kit.log")
    kit = nbdtest.Nbdkit(tmp, "none", ["--filter=log", "file", img, "logfile=" + kitlog],
                         peers=PEERS)
    # Flushes that fail drop what the backend acknowledged since the last
    # good one (tests/nbdkit-fault): nbdkit 1.32's error filter cannot
    # fail FLUSH.
    fimg = os.path.join(tmp, "none-fault.img")
    nbdtest.sparse_file(fimg, 8 * MIB)
    fkit = faults.NbdkitFault(tmp, fimg, name="none-fault", drop_unflushed=True)
    PEERS.append(fkit)
    with nbdtest.running_daemon([("n", kit.uri(), "cache-mode=none"),
                                 ("f", fkit.uri(), "cache-mode=none")],
                                extra=["--cache-size", "64M"]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("n"))
        data = bytes(random.Random(7).getrandbits(8) for _ in range(64 * KIB))
        h.pwrite(data, 0)
        h.zero(64 * KIB, 68 * KIB)
        h.trim(1 * MIB, 1 * MIB)
        h.flush()
        with open(kitlog) as f:
            lines = f.read().splitlines()
        changes = [i for i, ln in enumerate(lines)
                   if " Write " in ln or " Zero " in ln or " Trim " in ln]
        flushes = [i for i, ln in enumerate(lines) if " Flush " in ln]
        expect(len(changes) >= 3, "mode-none: nbdkit did not see the write, zero and "
               "trim (log: %s)" % [ln[:60] for ln in lines])
        expect(changes and any(f > changes[-1] for f in flushes),
               "mode-none: FLUSH did not flush the backend after the writes")
        expect(nbdtest.read_at(img, 0, 64 * KIB) == data,
               "mode-none: the backend file does not hold the write after FLUSH")
        expect(h.pread(64 * KIB, 0) == data, "mode-none: the export does not read the write")
        expect(h.pread(4 * KIB, 68 * KIB) == bytes(4 * KIB),
               "mode-none: the zeroed range does not read as zeros")
        st = stats(d, "n")
        expect(st.get("dirty_bytes", 0) == 0 and st.get("cached_bytes", 0) == 0,
               "mode-none: the cache holds something of the export: %r" % st)
        h.shutdown()

        g = nbdtest.libnbd_handle(d.unix_uri("f"))
        other = nbdtest.libnbd_handle(d.unix_uri("f"))
        g.pwrite(data[:4 * KIB], 0)
        g.flush()
        g.pwrite(data[4 * KIB:8 * KIB], 0)
        fkit.set("flush")
        results = []
        for i, handle in enumerate((g, g, other, other)):
            if i == 1:
                fkit.set()
            try:
                handle.flush()
                results.append("ok")
            except nbd.Error as e:
                results.append("EIO" if e.errnum == errno.EIO else "errno %s" % e.errnum)
        log("mode-none: FLUSH while the backend's flushes fail, again, then twice on another "
            "connection: %s" % results)
        expect(results == ["EIO", "ok", "EIO", "ok"],
               "mode-none: FLUSHes around a failed backend flush reported %s, not "
               "['EIO', 'ok', 'EIO', 'ok']" % results)
        expect(nbdtest.read_at(fimg, 0, 4 * KIB) == data[:4 * KIB],
               "mode-none: the failed flush did not drop the unflushed write (test broken)")
        g.shutdown()
        other.shutdown()
    kit.stop()
    fkit.stop()


def main():
    if not nbdtest.shutil.which("nbdkit"):
        nbdtest.fail("nbdkit not found")
    with nbdtest.tempdir() as tmp:
        try:
            for name, fn in (("torn", torn), ("reaper", reaper), ("log-flood", log_flood),
                             ("stop-notify", stop_notify), ("stop-failing", stop_failing),
                             ("mode-none", mode_none)):
                CHECKS.run(name, fn, tmp)
        finally:
            for p in PEERS:
                if p.alive():
                    os.kill(p.proc.pid, signal.SIGCONT)
                p.stop()
    CHECKS.finish("durability")


if __name__ == "__main__":
    main()
