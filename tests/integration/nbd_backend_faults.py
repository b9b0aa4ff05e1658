#!/usr/bin/python3
"""nbd_backend_faults: an NBD backend that dies, stalls, hangs up or changes.

Each backend is an nbdkit on a Unix socket, started and stopped by PID
(the Nbdkit class of nbd_backend.py), some behind a small proxy started
here that can cut one connection or hold a new one unanswered. The daemon
reaches it as nbd+unix:///?socket=SOCK.

  1  the backend goes away while the daemon holds dirty data (writeback,
     nbdkit file plugin): 1 MiB written, nbdkit SIGTERM, the data still
     reads back from the cache, nbdkit started again on the same socket,
     FLUSH (retried while it fails) succeeds, the daemon never dies and the
     backend file holds exactly the written bytes. Repeated RUNS times
     (default 15): a daemon that dies once fails.
  1b the proxy cuts a random connection every 50 ms for 3 s while 24
     disjoint writes of 2 MiB - 4 KiB (cache-mode=none, 2 client connections) are in
     flight: every write succeeds (sent again on another connection), the
     daemon lives, each connection's FLUSH may report EIO once (acknowledged
     writes on a cut connection, which mode none cannot write again) and
     then succeeds, and the backend file holds every byte.
  2  the backend stops answering (SIGSTOP), --backend-timeout 3: a FLUSH
     that has dirty data to write fails, not before the 3 s (nothing
     answered it), after the daemon logged "no reply within 3 s", and
     well before the 30 s default would end (20 s); cached data still
     reads; after SIGCONT a FLUSH succeeds and the backend file holds
     exactly the written bytes.
  3  the same stall with cache-mode=none and a read in flight: SIGTERM ends
     the daemon (exit 0) within 10 x its --backend-timeout 2.
  4  multi-conn through the proxy (4 connections): one connection cut by
     the proxy is reconnected on its own (within 20 s: the back-off starts
     at 0.1 s and tops at 5 s) while the others serve requests; all cut
     with the first new connection held unanswered in the handshake: a
     read that misses, submitted while connecting, completes while that
     connection is still held, and so do 1 s of writes and reads after
     it; the held connection is given up no sooner than the connect
     timeout (10 s) after the cut, and then 4 connections are back.
     Every write and read of this check returns in under the connect
     timeout (10 s; each takes milliseconds): one that waited for a
     connection that is not there would take that long, or the 30 s
     --backend-timeout.
  5  the backend restarted without multi-conn (nbdkit multi-conn filter,
     log filter): after FLUSH, every connection that carried a write has
     a flush sent after that write's reply (nbdkit's log), and the backend
     file holds the bytes.
  6  the backend answers reads with ESHUTDOWN (error filter): a read fails,
     not before the timeout (2 s: it is sent again until then), and within
     10 x the timeout; the daemon uses under half a CPU meanwhile (no
     retry spin); once the fault is gone reads succeed.
  7  the backend shrinks (restarted on a truncated file): a read past its
     new end fails (within 10 x the timeout, 3 s), reads below it still
     work, the daemon lives.
  8  acknowledged writes lost with the server (memory plugin, writeback
     --dirty-expire 1): once the background writeback has written 1 MiB
     (dirty_bytes 0, the backend holds it, nothing flushed), nbdkit is
     killed and an empty one started on the same socket; FLUSH (retried
     while it fails) succeeds and the new backend holds the data. This
     relies on the cache writing again what it had not flushed when the
     backend's loss_seq moved (backend.h); the backend only reports it.
  9  the backend stops answering (SIGSTOP) for 6 s with 4 KiB writes in
     flight on every connection (cache-mode=none, --backend-timeout 2, multi-conn
     nbdkit file plugin), so that the daemon gives up the connections
     while nbdkit still holds requests and tries new ones while it is
     stopped; after SIGCONT a write, its read and FLUSH succeed (tried
     for 30 s: the daemon tries to connect at least every 5 s), and
     nbdkit is still running (nbdkit 1.32.4-1.33.9 abort when a
     client hangs up with replies pending on several threads,
     RHBZ#2173054: the daemon must not hang up so). Repeated RUNS9 times
     (default 3), each with its own daemon and nbdkit.

No bound here is a wall-clock figure of its own: each is a lower bound
(a timeout cannot end before it began, which a busy machine only delays),
an order of events, or a large multiple of a timeout the daemon
guarantees (so the test is not run alone).

Every check runs; failures are listed at the end. Seeds are fixed.
Environment: NBDKIT (default "nbdkit"), RUNS (check 1, default 15), ONLY
(a comma-separated list of check numbers to run, default all).
"""

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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require, require_same, running_daemon  # noqa: E402

import nbd  # noqa: E402
from nbd_backend import Nbdkit, stop_peers  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
SEED = 1947
NBDKIT = os.environ.get("NBDKIT", "nbdkit")
RUNS = int(os.environ.get("RUNS", "15"))
RUNS9 = int(os.environ.get("RUNS9", "3"))
PAUSE = float(os.environ.get("PAUSE", "0.3"))
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect

LOST = "backend connection lost"
RECONNECTED = "backend reconnected"
# The daemon's own constants (daemon/backend/nbd_internal.h, options.c):
CONNECT_TIMEOUT = 10        # NBD_CONNECT_TIMEOUT_MS: a handshake not done is given up
BACKOFF_MAX = 5             # NBD_BACKOFF_MAX_MS: a failed slot is tried again at least this often
DEFAULT_BACKEND_TIMEOUT = 30
# A request waits for a backend for at most its --backend-timeout; the
# tests below allow this many times that before they call it hung.
MARGIN = 10
# What a lower bound allows for the client's clock read after the request
# was sent (microseconds) and the daemon's 100 ms deadline tick.
SLACK = 0.5


# ---- helpers ----

def image(tmp, size=SIZE, name="back.img"):
    return nbdtest.sparse_file(os.path.join(tmp, name), size)


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def alive(d, when):
    if not d.alive():
        d.dump_log()
        raise Failed("the daemon died (%s), exit %s" % (when, d.proc.returncode))


def wait_until(cond, timeout, step=0.05):
    """True once cond() is true, polled for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / step) + 2):
        if cond():
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(step)
    return cond()


def wait_command(h, cookie, timeout):
    """Wait for one aio command: (None, seconds) when it succeeded,
    (nbd.Error, seconds) when it failed, (False, seconds) when it is still
    pending after `timeout` seconds."""
    t0 = time.monotonic()
    for _ in range(int(timeout * 20) + 2):
        try:
            if h.aio_command_completed(cookie):
                return None, time.monotonic() - t0
        except nbd.Error as e:
            return e, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            break
        h.poll(50)
    return False, time.monotonic() - t0


def flush_until_ok(d, h, what, tries=40, timeout=40):
    """FLUSH until one succeeds (each failure logged); Failed when none
    does or the daemon dies."""
    deadline = time.monotonic() + timeout
    errors = []
    for attempt in range(tries):
        alive(d, "%s, FLUSH %d" % (what, attempt + 1))
        try:
            h.flush()
            log("  %s: FLUSH %d succeeded" % (what, attempt + 1))
            return
        except nbd.Error as e:
            errors.append(e.string)
            log("  %s: FLUSH %d failed: %s" % (what, attempt + 1, e.string))
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise Failed("%s: no FLUSH succeeded (%d tries): %s" % (what, len(errors), errors[-3:]))


def sigstop(proc):
    """SIGSTOP by PID, then wait (up to 5 s) until every thread of it is
    stopped: the signal alone does not stop a thread that is running."""
    proc.send_signal(signal.SIGSTOP)

    def stopped():
        try:
            tasks = os.listdir("/proc/%d/task" % proc.pid)
            states = []
            for t in tasks:
                with open("/proc/%d/task/%s/stat" % (proc.pid, t)) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return all(st == "T" for st in states)
    require(wait_until(stopped, 5, step=0.01), "test setup: pid %d not stopped 5 s after "
            "SIGSTOP" % proc.pid)


def cpu_seconds(pid):
    """utime + stime of the process, in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Proxy:
    """A Unix-socket proxy in front of the socket `upstream`: each accepted
    connection is forwarded to a new upstream connection, or, while
    `stall` > 0, held open and never answered. cut() closes one forwarded
    connection at both ends, as a server that dropped it."""

    def __init__(self, path, upstream):
        self.path, self.upstream = path, upstream
        self.lock = threading.Lock()
        self.pairs = []         # [client, server, open] per forwarded connection
        self.held = []          # connections held unanswered
        self.accepted = 0
        self.stall = 0
        self.stopping = False
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(path)
        self.lsock.listen(16)
        self.lsock.settimeout(0.1)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def uri(self):
        return "nbd+unix:///?socket=%s" % self.path

    def _accept(self):
        for _ in range(10 ** 7):
            if self.stopping:
                return
            try:
                c, _ = self.lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            c.settimeout(None)
            with self.lock:
                self.accepted += 1
                if self.stall > 0:
                    self.stall -= 1
                    self.held.append(c)
                    continue
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                u.connect(self.upstream)
            except OSError:
                c.close()
                u.close()
                continue
            pair = [c, u, True]
            with self.lock:
                self.pairs.append(pair)
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(pair, src, dst), daemon=True).start()

    def _pump(self, pair, src, dst):
        try:
            for _ in range(10 ** 8):
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._close(pair)

    def _close(self, pair):
        with self.lock:
            if not pair[2]:
                return
            pair[2] = False
        for s in pair[:2]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def live(self):
        with self.lock:
            return [p for p in self.pairs if p[2]]

    def cut(self, pair):
        self._close(pair)

    def held_closed(self):
        """How many held connections the client has closed."""
        n = 0
        with self.lock:
            held = list(self.held)
        for c in held:
            try:
                if c.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    n += 1
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.lsock.close()
        for p in list(self.pairs):
            self._close(p)
        for c in self.held:
            c.close()


# ---- 1: the backend goes away with dirty data in the cache ----

def dies_with_dirty_data(run):
    r = random.Random(SEED + run)
    off = r.randrange(0, SIZE // MIB - 1) * MIB + r.choice((0, 4096, 12345))
    data = r.randbytes(MIB)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        sock = os.path.join(tmp, "b.sock")
        kit = Nbdkit(tmp, "file", ["file", img], sock=sock)
        try:
            with running_daemon([("r", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("r"))
                old = kit.proc
                try:
                    h.pwrite(data, off)
                    # nbdkit ends an idle connection only when a request
                    # comes: the daemon's next write meets a closing server.
                    log("  SIGTERM nbdkit (pid %d), not waiting for it" % old.pid)
                    old.send_signal(signal.SIGTERM)
                    require_same(h.pread(MIB, off), data,
                                 "run %d: read back from the cache with the backend going away"
                                 % run, base=off)
                    time.sleep(PAUSE)
                    kit.start()
                    flush_until_ok(d, h, "run %d" % run)
                    alive(d, "run %d, after FLUSH" % run)
                finally:
                    nbdtest.shutdown_all([h])
                    try:
                        old.wait(10)
                    except subprocess.TimeoutExpired:
                        old.kill()
                        old.wait()
                text = d.log_text()
                expect("double free" not in text, "run %d: 'double free' in the log" % run)
                lost = [ln for ln in text.splitlines() if LOST in ln]
                log("  run %d: %s" % (run, lost[0].split(": ", 2)[-1] if lost else
                                      "the daemon did not lose its backend connection"))
            want = bytearray(SIZE)
            want[off:off + MIB] = data
            # Nothing was written back before nbdkit went away (dirty-expire
            # 3600), so this does not rely on the cache's loss_seq handling.
            require_same(file_bytes(img), want, "run %d: backend file after FLUSH" % run)
        finally:
            kit.stop()


def check_dies_with_dirty_data():
    for run in range(RUNS):
        if not CHECKS.run("1 backend gone with dirty data, run %d/%d" % (run + 1, RUNS),
                          dies_with_dirty_data, run):
            break


def cuts_during_writes(d, h, proxy, img):
    r = random.Random(SEED + 50)
    require(wait_until(lambda: len(proxy.live()) == 4, 5),
            "test setup: %d connections through the proxy, expected 4" % len(proxy.live()))
    h2 = nbdtest.libnbd_handle(d.unix_uri("p"))
    model, pending = [], []
    try:
        for k in range(24):
            off = k * 2 * MIB + r.randrange(0, 4096)
            data = r.randbytes(2 * MIB - 4096)      # disjoint: in flight together
            hk = (h, h2)[k % 2]
            pending.append((hk, hk.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), off)))
            model.append((off, data))
        stop = threading.Event()
        cuts = []

        def cutter():
            for _ in range(60):
                if stop.wait(0.05):
                    return
                live = proxy.live()
                if live:
                    proxy.cut(r.choice(live))
                    cuts.append(time.monotonic())
        t = threading.Thread(target=cutter, daemon=True)
        t.start()
        try:
            nbdtest.aio_wait(pending, timeout=60)
        finally:
            stop.set()
            t.join(10)
        log("  %d connections cut while the writes were in flight" % len(cuts))
        alive(d, "after the cuts")
        # Writes the server acknowledged on a connection that was then
        # cut may be lost with it (the daemon cannot tell a cut from a
        # server that restarted), and mode none holds no copy to write
        # again: each connection's next FLUSH says so once (EIO). The one
        # after must succeed.
        for hk in (h, h2):
            try:
                hk.flush()
                log("  FLUSH: ok")
            except nbd.Error as e:
                require(e.errno == "EIO", "the first FLUSH after the cuts failed with %s, "
                        "not EIO" % e.errno)
                log("  FLUSH: EIO (writes acknowledged on a cut connection), once")
                hk.flush()
    finally:
        nbdtest.shutdown_all([h2])
    require_same(file_bytes(img), nbdtest.model_bytes(model, 0, SIZE),
                 "backend file after writes through connections being cut")


# ---- 2, 3: the backend stops answering ----

def stalled_flush():
    r = random.Random(SEED + 100)
    a, b = r.randbytes(MIB), r.randbytes(MIB)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        kit = Nbdkit(tmp, "stall", ["file", img])
        stopped = False
        try:
            with running_daemon([("s", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600",
                                       "--backend-timeout", "3"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("s"))
                try:
                    h.pwrite(a, 0)
                    h.flush()
                    h.pwrite(b, 8 * MIB + 512)
                    log("  SIGSTOP nbdkit (pid %d)" % kit.proc.pid)
                    stopped = True
                    sigstop(kit.proc)
                    cookie = h.aio_flush()
                    # 20 s: under the 30 s default, so the configured 3 s is
                    # what ended it, not a daemon that ignored the setting
                    err, took = wait_command(h, cookie, 20)
                    require(err is not False, "FLUSH with the backend stopped is still pending "
                            "after %.0f s (--backend-timeout 3)" % took)
                    log("  FLUSH with the backend stopped: %s after %.2f s"
                        % ("ok" if err is None else err.string, took))
                    expect(err is not None, "FLUSH succeeded with the backend stopped")
                    # Nothing answered its writeback: it can only fail once
                    # the connection was declared dead, 3 s after the write
                    # was sent (nbd_pool_expire), which the log says first.
                    expect(took >= 3 - SLACK, "FLUSH failed %.2f s after it was sent, before "
                           "--backend-timeout 3 could end" % took)
                    expect("no reply within 3 s" in d.log_text(), "FLUSH failed with the "
                           "backend stopped, but the daemon never logged 'no reply within "
                           "3 s' (--backend-timeout 3)")
                    require_same(h.pread(MIB, 8 * MIB + 512), b,
                                 "cached read with the backend stopped", base=8 * MIB + 512)
                    alive(d, "with the backend stopped")
                    kit.proc.send_signal(signal.SIGCONT)
                    stopped = False
                    flush_until_ok(d, h, "after SIGCONT")
                finally:
                    if stopped:
                        kit.proc.send_signal(signal.SIGCONT)
                    nbdtest.shutdown_all([h])
            want = bytearray(SIZE)
            want[0:MIB] = a
            want[8 * MIB + 512:9 * MIB + 512] = b
            require_same(file_bytes(img), want, "backend file after the stall and FLUSH")
        finally:
            if stopped:
                kit.proc.send_signal(signal.SIGCONT)
            kit.stop()


def stalled_shutdown():
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        kit = Nbdkit(tmp, "stall2", ["file", img])
        d = None
        try:
            d = nbdtest.CheckedDaemon([("n", kit.uri(), "cache-mode=none")],
                                      extra=["--cache-size", "16M", "--backend-timeout", "2",
                                             "--log-level", "debug"])
            h = nbdtest.libnbd_handle(d.unix_uri("n"))
            h.pread(4096, 0)
            try:
                sigstop(kit.proc)
                buf = nbd.Buffer(64 * KIB)
                h.aio_pread(buf, 5 * MIB)
                require(wait_until(lambda: "offset %d length" % (5 * MIB) in d.log_text(), 10),
                        "test setup: the daemon did not log the read within 10 s")
                time.sleep(0.2)     # on its way to the backend
                t0 = time.monotonic()
                d.proc.send_signal(signal.SIGTERM)
                # the read ends at its --backend-timeout (2 s) at most
                gone = wait_until(lambda: not d.alive(), MARGIN * 2)
                took = time.monotonic() - t0
                require(gone, "the daemon did not exit within %d s of SIGTERM with a read "
                        "in flight on a stopped backend (--backend-timeout 2)" % (MARGIN * 2))
                log("  exited %d, %.2f s after SIGTERM" % (d.proc.returncode, took))
                expect(d.proc.returncode == 0, "exit %d after SIGTERM" % d.proc.returncode)
                text = d.log_text()
                expect("Sanitizer" not in text and "runtime error:" not in text,
                       "sanitizer report in the daemon log")
            finally:
                kit.proc.send_signal(signal.SIGCONT)
                try:
                    h.shutdown()
                except nbd.Error:
                    pass
        finally:
            if d is not None:
                if d.alive():
                    d.dump_log()
                d.discard()
            kit.stop()


# ---- 4: connections one by one ----

def with_proxy(fn):
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        kit = Nbdkit(tmp, "px", ["file", img])
        proxy = Proxy(os.path.join(tmp, "proxy.sock"), kit.sock)
        try:
            with running_daemon([("p", proxy.uri(), "cache-mode=none")],
                                extra=["--cache-size", "16M"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("p"))
                try:
                    fn(d, h, proxy, img)
                finally:
                    nbdtest.shutdown_all([h])
        finally:
            proxy.close()
            kit.stop()


def traffic(d, h, r, seconds, what):
    """Writes (FUA) and reads that go to the backend for `seconds`: each
    must succeed, in under the connect timeout (10 s; each takes a few
    milliseconds): one that waited for a connection that is not there (cut,
    or held in its handshake) would take that long, or the 30 s default
    --backend-timeout."""
    end = time.monotonic() + seconds
    for k in range(1000):
        if time.monotonic() > end:
            break
        off = r.randrange(0, SIZE // 4096 - 16) * 4096
        data = r.randbytes(64 * KIB)
        t0 = time.monotonic()
        h.pwrite(data, off, nbd.CMD_FLAG_FUA)
        require_same(h.pread(len(data), off), data, "%s: read back #%d" % (what, k), base=off)
        took = time.monotonic() - t0
        require(took < CONNECT_TIMEOUT, "%s: a write and read took %.2f s, as long as a "
                "connect timeout (%d s): it waited for a connection that is not there"
                % (what, took, CONNECT_TIMEOUT))
    alive(d, what)


def one_connection_cut(d, h, proxy, img):
    r = random.Random(SEED + 400)
    require(wait_until(lambda: len(proxy.live()) == 4, 5),
            "test setup: %d connections through the proxy, expected 4 (multi-conn)"
            % len(proxy.live()))
    before = proxy.accepted
    proxy.cut(proxy.live()[1])
    log("  cut one of 4 connections")
    traffic(d, h, r, 1.0, "one connection cut")
    back = wait_until(lambda: proxy.accepted > before and len(proxy.live()) == 4,
                      4 * BACKOFF_MAX)
    log("  %d connection(s) live, %d accepted since the cut"
        % (len(proxy.live()), proxy.accepted - before))
    require(back, "the cut connection was not reconnected within %d s while the others live "
            "(%d live; the daemon tries at least every %d s)"
            % (4 * BACKOFF_MAX, len(proxy.live()), BACKOFF_MAX))
    traffic(d, h, r, 0.5, "after the reconnect")


def handshake_held(d, h, proxy, img):
    r = random.Random(SEED + 500)
    require(wait_until(lambda: len(proxy.live()) == 4, 5),
            "test setup: %d connections through the proxy, expected 4" % len(proxy.live()))
    data = r.randbytes(64 * KIB)
    with open(img, "r+b") as f:
        f.seek(40 * MIB)
        f.write(data)
    with proxy.lock:
        proxy.stall = 1
    t_cut = time.monotonic()
    for p in proxy.live():
        proxy.cut(p)
    log("  cut all 4 connections; the next new one is held unanswered")
    buf = nbd.Buffer(len(data))
    cookie = h.aio_pread(buf, 40 * MIB)
    err, took = wait_command(h, cookie, 3 * CONNECT_TIMEOUT)
    held_open = proxy.held_closed() == 0
    log("  read submitted while reconnecting: %s after %.2f s, the held connection %s"
        % ("pending" if err is False else "ok" if err is None else err.string, took,
           "still held" if held_open else "given up by then"))
    require(err is None, "a read submitted while reconnecting, with one new connection "
            "held in the handshake, %s after %.2f s"
            % ("still pending" if err is False else "failed", took))
    # The order, not the time: a read that waited for the held connection
    # to be given up (the connect timeout) is answered only after that.
    require(held_open, "a read submitted while reconnecting was answered only after the "
            "connection held in the handshake was given up (%.2f s): it waited for it" % took)
    require_same(buf.to_bytearray(), data, "the read submitted while reconnecting",
                 base=40 * MIB)
    traffic(d, h, r, 1.0, "with one connection held in the handshake")
    require(proxy.held_closed() == 0, "the writes and reads beside the connection held in "
            "the handshake ended only after it was given up: they waited for it")
    given_up = wait_until(lambda: proxy.held_closed() == 1, 4 * CONNECT_TIMEOUT, step=0.1)
    gone_after = time.monotonic() - t_cut
    log("  the held connection given up %.2f s after the cut (connect timeout %d s)"
        % (gone_after, CONNECT_TIMEOUT))
    expect(given_up, "the connection held in the handshake was not closed within %d s "
           "(the connect timeout is %d s)" % (4 * CONNECT_TIMEOUT, CONNECT_TIMEOUT))
    # It was connected after the cut: no sooner than the connect timeout later.
    expect(not given_up or gone_after >= CONNECT_TIMEOUT - SLACK,
           "the connection held in the handshake was given up %.2f s after the cut, before "
           "the %d s connect timeout" % (gone_after, CONNECT_TIMEOUT))
    back = wait_until(lambda: len(proxy.live()) == 4, 4 * BACKOFF_MAX)
    expect(back, "%d connections live after the held one was given up, expected 4"
           % len(proxy.live()))
    traffic(d, h, r, 0.5, "after the held connection was given up")


# ---- 5: a FLUSH covers every connection ----

LOG_LINE = re.compile(r"connection=(\d+) (\.\.\.)?(\w+) id=(\d+)(.*)")


def flush_coverage():
    r = random.Random(SEED + 600)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        sock = os.path.join(tmp, "b.sock")
        nlog = os.path.join(tmp, "nbdkit-requests.log")
        kit = Nbdkit(tmp, "mc", ["file", img], sock=sock)
        try:
            with running_daemon([("f", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "3600"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("f"))
                try:
                    model = flush_coverage_steps(d, h, r, tmp, sock, nlog, kit)
                finally:
                    nbdtest.shutdown_all([h])
            want = nbdtest.model_bytes(model, 0, SIZE)
            require_same(file_bytes(img), want, "backend file after FLUSH")
        finally:
            kit.stop()
            stop_peers()


def flush_coverage_steps(d, h, r, tmp, sock, nlog, kit):
    model = []
    data = r.randbytes(MIB)
    h.pwrite(data, 0)
    model.append((0, data))
    h.flush()
    kit.kill(signal.SIGKILL)
    img = os.path.join(tmp, "back.img")
    kit2 = Nbdkit(tmp, "nomc", ["--filter=log", "--filter=multi-conn", "file", img,
                                "multi-conn-mode=disable", "logfile=" + nlog], sock=sock)
    direct = kit2.handle()
    require(not direct.can_multi_conn(), "test setup: the multi-conn filter still advertises "
            "multi-conn")
    nbdtest.shutdown_all([direct])
    for k in range(24):
        off = (2 + k) * MIB + r.randrange(0, 4096)
        data = r.randbytes(128 * KIB)
        for attempt in range(40):
            try:
                h.pwrite(data, off)
                break
            except nbd.Error:
                time.sleep(0.25)    # the backend is coming back
        model.append((off, data))
    flush_until_ok(d, h, "no multi-conn")
    with open(nlog) as f:
        lines = f.read().splitlines()
    last_write, flushes = {}, {}
    for i, ln in enumerate(lines):
        m = LOG_LINE.search(ln)
        if not m:
            continue
        conn, reply, kind = m.group(1), m.group(2), m.group(3)
        if kind == "Write" and reply and "return=0" in m.group(5):
            last_write[conn] = i
        elif kind == "Flush" and not reply:
            flushes.setdefault(conn, []).append(i)
    log("  connections with writes: %s; with flushes: %s"
        % (sorted(last_write), sorted(flushes)))
    for conn, i in sorted(last_write.items()):
        expect(any(j > i for j in flushes.get(conn, [])),
               "connection %s of a backend without multi-conn: no flush sent after its "
               "last write's reply" % conn)
    return model


# ---- 6: ESHUTDOWN ----

def eshutdown():
    data = random.Random(SEED + 700).randbytes(256 * KIB)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        with open(img, "r+b") as f:
            f.seek(3 * MIB)
            f.write(data)
        efile = os.path.join(tmp, "fail-pread")
        kit = Nbdkit(tmp, "esd", ["--filter=error", "file", img, "error=ESHUTDOWN",
                                  "error-pread-rate=1", "error-pread-file=" + efile])
        try:
            with running_daemon([("e", kit.uri(), "cache-mode=none")],
                                extra=["--cache-size", "16M", "--backend-timeout", "2"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("e"))
                try:
                    open(efile, "w").close()
                    cpu0, t0 = cpu_seconds(d.pid), time.monotonic()
                    cookie = h.aio_pread(nbd.Buffer(64 * KIB), 3 * MIB)
                    err, took = wait_command(h, cookie, MARGIN * 2)
                    cpu = cpu_seconds(d.pid) - cpu0
                    wall = time.monotonic() - t0
                    log("  read with ESHUTDOWN injected: %s after %.2f s; daemon CPU %.2f s"
                        % ("pending" if err is False else "ok" if err is None else err.string,
                           took, cpu))
                    require(err is not False, "a read answered with ESHUTDOWN is still pending "
                            "after %.0f s (--backend-timeout 2)" % took)
                    expect(err is not None, "a read answered with ESHUTDOWN succeeded")
                    # ESHUTDOWN closes the connection and the read is sent
                    # again while younger than the timeout (nbd.c): a read
                    # failed at the first ESHUTDOWN was not retried.
                    expect(took >= 2 - SLACK, "a read answered with ESHUTDOWN failed after "
                           "%.2f s, before --backend-timeout 2: it was not sent again" % took)
                    expect(cpu < wall / 2, "the daemon used %.2f s of CPU in %.2f s while the "
                           "backend said ESHUTDOWN" % (cpu, wall))
                    alive(d, "after ESHUTDOWN")
                    os.unlink(efile)
                    got = None
                    for _ in range(20):
                        try:
                            got = h.pread(len(data), 3 * MIB)
                            break
                        except nbd.Error:
                            time.sleep(0.25)
                    require(got is not None, "reads still fail after the fault went away")
                    require_same(got, data, "read after the fault went away", base=3 * MIB)
                finally:
                    if os.path.exists(efile):
                        os.unlink(efile)
                    nbdtest.shutdown_all([h])
        finally:
            kit.stop()


# ---- 7: the backend shrinks ----

def shrinks():
    data = random.Random(SEED + 800).randbytes(64 * KIB)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        with open(img, "r+b") as f:
            f.seek(MIB)
            f.write(data)
        sock = os.path.join(tmp, "b.sock")
        kit = Nbdkit(tmp, "big", ["file", img], sock=sock)
        try:
            with running_daemon([("s", kit.uri(), "cache-mode=none")],
                                extra=["--cache-size", "16M", "--backend-timeout", "3"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("s"))
                try:
                    require_same(h.pread(len(data), MIB), data, "read before the change",
                                 base=MIB)
                    kit.kill(signal.SIGKILL)
                    os.truncate(img, SIZE // 2)
                    kit.start()
                    got = None
                    for _ in range(40):
                        try:
                            got = h.pread(len(data), MIB)
                            break
                        except nbd.Error:
                            time.sleep(0.25)
                    require(got is not None, "reads fail after the backend came back smaller")
                    require_same(got, data, "read below the new end", base=MIB)
                    cookie = h.aio_pread(nbd.Buffer(64 * KIB), SIZE - MIB)
                    err, took = wait_command(h, cookie, MARGIN * 3)
                    log("  read past the new end: %s after %.2f s"
                        % ("pending" if err is False else "ok" if err is None else err.string,
                           took))
                    require(err is not False, "a read past the backend's new end is still "
                            "pending after %.0f s" % took)
                    expect(err is not None, "a read past the backend's new end succeeded")
                    alive(d, "after the read past the new end")
                    require_same(h.pread(len(data), MIB), data, "read below the new end again",
                                 base=MIB)
                finally:
                    nbdtest.shutdown_all([h])
        finally:
            kit.stop()


# ---- 8: acknowledged writes lost with the server ----

def acked_writes_lost():
    data = random.Random(SEED + 900).randbytes(MIB)
    off = 5 * MIB + 4096
    with nbdtest.tempdir() as tmp:
        sock = os.path.join(tmp, "b.sock")
        kit = Nbdkit(tmp, "mem1", ["memory", "size=%d" % SIZE], sock=sock)
        try:
            with running_daemon([("m", kit.uri(), "cache-mode=writeback")],
                                extra=["--cache-size", "64M", "--dirty-expire", "1"]) as d:
                h = nbdtest.libnbd_handle(d.unix_uri("m"))
                try:
                    h.pwrite(data, off)
                    require(wait_until(lambda: nbdtest.stats(d)["dirty_bytes"] == 0, 10),
                            "test setup: still dirty 10 s after the write (--dirty-expire 1)")
                    direct = kit.handle()
                    require_same(direct.pread(MIB, off), data, "test setup: the backend after "
                                 "the background writeback", base=off)
                    nbdtest.shutdown_all([direct])
                    kit.kill(signal.SIGKILL)
                    kit = Nbdkit(tmp, "mem2", ["memory", "size=%d" % SIZE], sock=sock)
                    flush_until_ok(d, h, "after the backend lost acknowledged writes")
                    direct = kit.handle()
                    got = direct.pread(MIB, off)
                    nbdtest.shutdown_all([direct])
                    # Needs the cache to rewrite unflushed data when
                    # loss_seq moved (the lead's daemon/cache change).
                    require_same(got, data, "the new backend after FLUSH: writes the old one "
                                 "acknowledged but never flushed (needs the cache's loss_seq "
                                 "handling)", base=off)
                    require_same(h.pread(MIB, off), data, "read through the daemon", base=off)
                finally:
                    nbdtest.shutdown_all([h])
        finally:
            kit.stop()


# ---- 9: a long stop with requests in flight, then SIGCONT ----

def stopped_with_writes_in_flight(run):
    r = random.Random(SEED + 1000 + run)
    with nbdtest.tempdir() as tmp:
        img = image(tmp)
        kit = Nbdkit(tmp, "long%d" % run, ["file", img])
        stopped = False
        try:
            with running_daemon([("l", kit.uri(), "cache-mode=none")],
                                extra=["--backend-timeout", "2"]) as d:
                hs = [nbdtest.libnbd_handle(d.unix_uri("l")) for _ in range(2)]
                busy = threading.Event()
                quit_writers = threading.Event()

                def writer(h, k):
                    """Up to 32 writes of 4 KiB in flight until told to stop: small
                    requests, so that many are whole in nbdkit's socket buffer."""
                    wr = random.Random(SEED + 2000 + 10 * run + k)
                    buf = nbd.Buffer.from_bytearray(bytearray(wr.randbytes(4 * KIB)))
                    pending = []
                    for _ in range(100000):
                        if quit_writers.is_set():
                            break
                        while len(pending) < 32:
                            off = wr.randrange(0, SIZE // 4096) * 4096
                            pending.append(h.aio_pwrite(buf, off))
                        busy.set()
                        h.poll(20)
                        for c in list(pending):
                            try:
                                if h.aio_command_completed(c):
                                    pending.remove(c)
                            except nbd.Error:
                                pending.remove(c)
                    for _ in range(200):          # let what is pending come back
                        if not h.aio_in_flight():
                            break
                        h.poll(50)
                threads = [threading.Thread(target=writer, args=(h, k), daemon=True)
                           for k, h in enumerate(hs)]
                for t in threads:
                    t.start()
                try:
                    require(busy.wait(10), "test setup: no write in flight within 10 s")
                    time.sleep(0.3)
                    log("  SIGSTOP nbdkit (pid %d) with writes in flight" % kit.proc.pid)
                    stopped = True
                    sigstop(kit.proc)
                    require(wait_until(lambda: LOST in d.log_text(), MARGIN * 2),
                            "the daemon did not give up the stopped backend within %d s "
                            "(--backend-timeout 2)" % (MARGIN * 2))
                    time.sleep(4.5)               # reconnects tried while it is stopped
                    quit_writers.set()
                    for t in threads:
                        t.join(15)
                    alive(d, "with the backend stopped")
                    log("  SIGCONT nbdkit")
                    kit.proc.send_signal(signal.SIGCONT)
                    stopped = False
                    t0 = time.monotonic()
                    data = r.randbytes(MIB)
                    off = 32 * MIB + 4096
                    h = hs[0]
                    ok = False
                    errors = []
                    for _ in range(1000):
                        try:
                            h.pwrite(data, off)
                            got = h.pread(MIB, off)
                            h.flush()
                            ok = got == data
                            if ok:
                                break
                            errors.append("read back different bytes")
                        except nbd.Error as e:
                            errors.append(e.string)
                        if time.monotonic() - t0 > RECOVER or kit.proc.poll() is not None:
                            break
                        time.sleep(0.1)
                    took = time.monotonic() - t0
                    log("  after SIGCONT: %s after %.2f s (%d failures)"
                        % ("write, read, FLUSH ok" if ok else "still failing", took,
                           len(errors)))
                    expect(kit.proc.poll() is None, "nbdkit exited (status %s) after SIGCONT: "
                           "%s" % (kit.proc.poll(), kit_log_tail(kit)))
                    require(ok, "write, read and FLUSH did not all succeed within %d s of "
                            "SIGCONT (the daemon tries to connect at least every %d s): %s"
                            % (RECOVER, BACKOFF_MAX, errors[-3:]))
                    alive(d, "after SIGCONT")
                finally:
                    quit_writers.set()
                    if stopped:
                        kit.proc.send_signal(signal.SIGCONT)
                        stopped = False
                    for t in threads:
                        t.join(15)
                    nbdtest.shutdown_all(hs)
            require_same(file_bytes(img)[off:off + MIB], data,
                         "backend file after the FLUSH that followed SIGCONT", base=off)
        finally:
            if stopped:
                kit.proc.send_signal(signal.SIGCONT)
            kit.stop()


# How long check 9 tries after SIGCONT: six times the longest back-off
# between two connection attempts (a correct daemon takes under a second).
RECOVER = 6 * BACKOFF_MAX


def kit_log_tail(kit):
    try:
        with open(kit.logpath, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-3:])
    except (OSError, AttributeError):
        return "(no nbdkit log)"


def check_stopped_with_writes_in_flight():
    for run in range(RUNS9):
        if not CHECKS.run("9 backend stopped 6 s with writes in flight, run %d/%d"
                          % (run + 1, RUNS9), lambda run=run: stopped_with_writes_in_flight(run)):
            break


def main():
    if shutil.which(NBDKIT) is None:
        nbdtest.fail("%s not found (install nbdkit)" % NBDKIT)
    only = os.environ.get("ONLY", "")
    t0 = time.time()
    checks = (
        ("1", check_dies_with_dirty_data, None),
        ("1", "1b connections cut while writes are in flight",
         lambda: with_proxy(cuts_during_writes)),
        ("2", "2 backend stopped: FLUSH fails at the timeout, then succeeds",
         stalled_flush),
        ("3", "3 backend stopped: SIGTERM with a read in flight", stalled_shutdown),
        ("4", "4 one connection cut: reconnected on its own",
         lambda: with_proxy(one_connection_cut)),
        ("4", "4 all cut, one new connection held in the handshake",
         lambda: with_proxy(handshake_held)),
        ("5", "5 backend without multi-conn: FLUSH covers every connection", flush_coverage),
        ("6", "6 ESHUTDOWN replies: EIO at the timeout, no spin", eshutdown),
        ("7", "7 the backend shrinks", shrinks),
        ("8", "8 acknowledged writes lost with the server (needs the cache change)",
         acked_writes_lost),
        ("9", check_stopped_with_writes_in_flight, None),
    )
    try:
        for key, name, fn in checks:
            if only and key not in only.split(","):
                continue
            if fn is None:
                name()
            else:
                CHECKS.run(name, fn)
    finally:
        stop_peers()
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("NBD backend faults")


if __name__ == "__main__":
    main()
