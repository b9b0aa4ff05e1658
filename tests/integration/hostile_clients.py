#!/usr/bin/python3
"""hostile_clients: clients that try to make the daemon hold memory, sockets,
file descriptors or CPU without end, against the real daemon.

1. Negotiation output is bounded. A client pipelines 200000 NBD_OPT_LIST
   options (16 bytes each; every reply carries a 1500-byte export
   description, so all of them would be ~300 MiB) and never reads a reply.
   The daemon must stop reading once ~1 MiB of replies is unread: the client
   cannot send everything, the daemon's VmRSS stays under 100 MiB and within
   48 MiB of its baseline (so a 64 MiB bound would not do), a second, normal
   libnbd client meanwhile connects, writes and reads correctly, and the
   replies the flooding client finally reads are well-formed.
2. Negotiation deadline (the daemon runs with --negotiation-timeout 5,
   from connecting; the default is 60 s). A client that dribbles one valid
   byte (client flags, then NBD_OPT_LIST options, whose replies it reads)
   every 0.05 s, and another one parked mid-option-header, are both
   disconnected, no sooner than 4.5 s after they connected (the deadline
   is armed after the connect) and within 35 s (7 x the deadline, well
   short of the 60 s default: a deadline that progress moves never ends
   the dribbler), and the daemon's log says "negotiation did not finish in
   5 s" for both (the dribbler having had at least 3 LISTs answered, so
   the bytes were valid). A libnbd client and a raw client that finished
   GO at the start, before those two connected, and then idle are not
   disconnected, though both of those were (and 5 s have passed since
   GO): both are used after.
3. Close and stall deadlines (the daemon runs with --stall-timeout 5, so
   the two deadlines differ and the check takes seconds, not half a
   minute). A client that sends 20 x 1 MiB READs then NBD_CMD_DISC and
   never reads a reply is disconnected no sooner than 8 s after sending
   (CONN_CLOSE_TIMEOUT, 10 s), the log saying "client did not read its last
   replies in time". One that sends 200 x 1 MiB READs then NBD_CMD_DISC
   backs its replies up past CONN_MAX_OUTPUT, so the daemon stops reading
   before the DISC; it is cut off when its replies have made no progress
   for --stall-timeout: no sooner than 4 s, and before the first one (the
   close deadline did not end it), the log saying "client has not read its
   replies for 5 s". Each is disconnected within 30 s (3 x the close
   deadline). The RSS then drops back.
4. EMFILE. A second daemon whose RLIMIT_NOFILE soft limit is lowered to 40
   (by prlimit on its PID before any client connects) gets 80 connections:
   it must not spin (utime+stime over 3 s below 0.5 s), it logs "pausing new
   connections", an accepted connection is still served, and after the 80
   close a new client gets its greeting (within 80 s: the daemon pauses
   accepting for 1 s at a time, and each pause ends with at least one of
   the 80 taken) and a new libnbd client is served.

Bounds of time are lower bounds (a deadline cannot end before it began;
a busy machine only delays), orders of events, or many times the deadline
the daemon keeps: none is a wall-clock figure a busy machine can miss.
5. NBD_CMD_CACHE with length 0 succeeds (libnbd with strict mode off, and
   raw simple and structured requests), at offsets 0 .. the export size, and
   does not read ahead the file (fadvise takes length 0 as "to the end"):
   checked with fincore on a 64 MiB file on a disk file system, with a
   non-zero CACHE as the positive control.

2 runs in threads while 5, 1 and 3 run one after another, and 4 (on its
own daemon) in a thread beside 3: both of those mostly wait, 3 for its two
deadlines (10 s), 4 for its CPU sample and for its daemon to take new
connections again, so the test takes about as long as 5, 1 and 3 (their
log lines mix; each is named). Every daemon must exit 0 on SIGTERM
(Daemon.stop). Failures are collected and listed together at the end; any
one fails the test.
"""

import os
import random
import resource
import select
import socket
import struct
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402  (RawClient and the wire constants)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
DATA_SIZE = 8 * MIB
COLD_SIZE = 64 * MIB
DESCRIPTION = "d" * 1500            # makes every NBD_REP_SERVER ~1.5 KiB

NEGOTIATION_TIMEOUT = 5             # --negotiation-timeout of the main daemon (default 60)
DRIBBLE_INTERVAL = 0.05             # seconds between the dribbler's bytes
CLOSE_TIMEOUT = 10                  # daemon/conn.h CONN_CLOSE_TIMEOUT
ACCEPT_PAUSE = 1                    # daemon/server.c on_accept_error: seconds paused at EMFILE
STALL_TIMEOUT = 5                   # --stall-timeout of the main daemon (default 30)
LIST_COUNT = 200000
RSS_LIMIT = 100 * MIB
RSS_GROWTH_LIMIT = 48 * MIB
EMFILE_NOFILE = 48
EMFILE_CONNS = 80
HUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR

CLK_TCK = os.sysconf("SC_CLK_TCK")


class Failed(Exception):
    """A check failed (raised in threads too, where sys.exit would not do)."""


def need(cond, msg):
    if not cond:
        raise Failed(msg)


def rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KIB
    return 0


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK     # utime + stime


def bounded(what, timeout, fn, *args):
    """Run fn in a thread; a call that does not return in time fails (libnbd
    blocks without a timeout when a server never answers)."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: B902 - reported below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Failed("%s did not finish within %d s" % (what, timeout))
    if "error" in box:
        raise Failed("%s: %s: %s" % (what, type(box["error"]).__name__, box["error"]))
    return box.get("value")


def close_handle(h):
    """libnbd 1.14's Python handle has no close(): it closes when collected."""
    close = getattr(h, "close", None)
    if close:
        close()


def fincore_bytes(path):
    p = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return None
    try:
        return int(p.stdout.split()[0])
    except (IndexError, ValueError):
        return None


class Model:
    """What the "data" export must hold."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self.data = bytearray(f.read())
        self.rnd = random.Random(99)
        self.lock = threading.Lock()

    def write(self, h, off, n):
        buf = self.rnd.randbytes(n)
        h.pwrite(buf, off)
        with self.lock:
            self.data[off:off + n] = buf

    def check(self, h, off, n, what):
        got = h.pread(n, off)
        with self.lock:
            want = bytes(self.data[off:off + n])
        if got != want:
            first = next(i for i in range(n) if got[i] != want[i])
            raise Failed("%s: read [%d,+%d) differs from what was written (first at +%d)"
                         % (what, off, n, first))


# ---- 2. The negotiation deadline, in threads. ----

class DeadlineClient(threading.Thread):
    """Connects, reads the greeting, then either dribbles one valid byte every
    DRIBBLE_INTERVAL (client flags, then LIST options; it reads their
    replies) or parks mid-option-header. Records when the daemon hangs up."""

    # Seconds this thread watches, at most: 7 x the deadline, and short of
    # the 60 s default (a daemon that ignored the setting is not let pass).
    LIMIT = NEGOTIATION_TIMEOUT + 30

    def __init__(self, name, connect, dribble):
        super().__init__(name=name, daemon=True)
        self.connect = connect
        self.dribble = dribble
        self.closed_after = None
        self.sent = 0
        self.received = 0
        self.error = None
        self.connected = threading.Event()

    def run(self):
        try:
            self.body()
        except Exception as e:  # noqa: B902 - reported by the main thread
            self.error = e
        finally:
            self.connected.set()

    def body(self):
        s = self.connect()
        t0 = time.monotonic()
        self.connected.set()
        try:
            s.settimeout(5)
            g = b""
            while len(g) < 18:
                c = s.recv(18 - len(g))
                need(c, "%s: no greeting" % self.name)
                g += c
            magic, opts, _ = struct.unpack(">QQH", g)
            need(magic == raw.NBD_MAGIC and opts == raw.NBD_OPTS_MAGIC, "%s: bad greeting" % self.name)
            flags = struct.pack(">I", raw.NBD_FLAG_C_FIXED_NEWSTYLE | raw.NBD_FLAG_C_NO_ZEROES)
            lst = struct.pack(">QII", raw.NBD_OPTS_MAGIC, raw.OPT_LIST, 0)
            if self.dribble:
                wire = flags + lst * 250           # 4004 bytes: 200 s at 20 bytes/s
            else:
                s.sendall(flags + lst[:8])         # parked mid-option-header
                self.sent = 12
                wire = b""
            s.setblocking(False)
            p = select.poll()
            p.register(s, select.POLLIN | HUP)
            next_send = t0 + DRIBBLE_INTERVAL
            pos = 0
            while True:
                now = time.monotonic()
                if now - t0 > self.LIMIT:
                    return
                wait = max(0.0, next_send - now) if self.dribble else DRIBBLE_INTERVAL
                for _, ev in p.poll(wait * 1000):
                    if ev & HUP:
                        self.closed_after = time.monotonic() - t0
                        return
                    if ev & select.POLLIN:
                        try:
                            c = s.recv(65536)
                        except ConnectionResetError:
                            c = b""
                        except BlockingIOError:
                            continue
                        if not c:
                            self.closed_after = time.monotonic() - t0
                            return
                        self.received += len(c)
                if self.dribble and time.monotonic() >= next_send and pos < len(wire):
                    try:
                        s.send(wire[pos:pos + 1])
                    except (BrokenPipeError, ConnectionResetError):
                        self.closed_after = time.monotonic() - t0
                        return
                    except BlockingIOError:
                        pass
                    else:
                        pos += 1
                        self.sent += 1
                    next_send += DRIBBLE_INTERVAL
        finally:
            s.close()


def check_deadline_client(t, dribble):
    need(t.error is None, "%s: %s" % (type(t.error).__name__, t.error))
    need(t.closed_after is not None,
         "still connected %d s after connecting; the negotiation deadline is %d s"
         % (t.LIMIT, NEGOTIATION_TIMEOUT))
    # The daemon arms the deadline when it accepts, which is after connect()
    # returned here: it cannot fire sooner (0.5 s for timer rounding).
    need(t.closed_after >= NEGOTIATION_TIMEOUT - 0.5,
         "disconnected %.1f s after connecting, before the %d s negotiation deadline"
         % (t.closed_after, NEGOTIATION_TIMEOUT))
    # (No upper bound but LIMIT: a busy machine only delays the deadline.
    # That it was this deadline that ended them, the log says: main().)
    if dribble:
        # Every 16 x DRIBBLE_INTERVAL (0.8 s) a LIST completes; its replies
        # (with the 1500-byte description) must have come back: the bytes
        # were valid and read, yet the deadline held.
        need(t.received >= 3 * len(DESCRIPTION),
             "only %d bytes of LIST replies in %.0f s: the dribbled options were not answered"
             % (t.received, t.closed_after))


# ---- 5. CACHE with length 0. ----

def cache_zero(d, paths):
    h = nbd.NBD()
    h.set_strict_mode(0)            # libnbd refuses a zero length itself otherwise
    bounded("libnbd connect to 'cold'", 15, h.connect_uri, d.unix_uri("cold"))
    try:
        need(h.can_cache(), "the export does not advertise NBD_FLAG_SEND_CACHE")
        need(h.get_size() == COLD_SIZE, "size %d" % h.get_size())
        path = paths["cold"]
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        before = fincore_bytes(path)
        for off in (0, 4096, 12345, COLD_SIZE // 2, COLD_SIZE - 1, COLD_SIZE):
            bounded("libnbd cache(0, %d)" % off, 10, h.cache, 0, off)
        for structured in (False, True):
            r = raw.RawClient(d.sock)
            try:
                r.open("cold", structured=structured)
                for off in (0, COLD_SIZE - 4096, COLD_SIZE):
                    rep = r.command(raw.CMD_CACHE, off, 0)
                    need(rep.error == 0, "raw %s CACHE(offset %d, length 0): %s"
                         % ("structured" if structured else "simple", off, raw.err_name(rep.error)))
                r.disconnect()
            except (raw.Mismatch, raw.Closed) as e:
                raise Failed("raw CACHE of length 0: %s" % e)
            finally:
                r.close()
        time.sleep(1)
        after = fincore_bytes(path)
        if before is None or after is None or before > 1 * MIB:
            log("     page-cache check not possible here (fincore %r before); skipped that part"
                % before)
        else:
            need(after - before < 4 * MIB,
                 "CACHE of length 0 brought %d MiB of the file into the page cache "
                 "(posix_fadvise takes length 0 as 'to the end of the file')"
                 % ((after - before) >> 20))
            # Positive control: a real CACHE does read ahead, so the check above can see it.
            bounded("libnbd cache(1 MiB, 32 MiB)", 10, h.cache, MIB, 32 * MIB)
            grown = None
            for _ in range(30):
                now = fincore_bytes(path)
                if now is not None and now - after >= 512 * KIB:
                    grown = now - after
                    break
                time.sleep(0.1)
            if grown is None:
                log("     (control: CACHE of 1 MiB did not show in fincore; the zero-length "
                    "check is inconclusive)")
            else:
                log("     page cache: %d KiB before, %d KiB after CACHE(len 0) x9, +%d KiB after "
                    "CACHE(1 MiB)" % (before >> 10, after >> 10, grown >> 10))
        with open(path, "rb") as f:
            f.seek(COLD_SIZE - 4096)
            want = f.read(4096)
        need(bounded("libnbd pread after CACHE", 10, h.pread, 4096, COLD_SIZE - 4096) == want,
             "read after CACHE(len 0) returned the wrong data")
    finally:
        try:
            bounded("libnbd shutdown", 10, h.shutdown)
        finally:
            close_handle(h)


# ---- 1. Pipelined NBD_OPT_LIST, replies never read. ----

def negotiation_flood(d, model, base):
    r = raw.RawClient(d.sock)
    try:
        r.greeting()
        wire = struct.pack(">QII", raw.NBD_OPTS_MAGIC, raw.OPT_LIST, 0) * LIST_COUNT
        mv = memoryview(wire)
        r.s.setblocking(False)
        sent = 0
        peak = rss(d.pid)
        t0 = last_progress = time.monotonic()
        while sent < len(wire) and time.monotonic() - t0 < 8 and time.monotonic() - last_progress < 1.5:
            try:
                n = r.s.send(mv[sent:sent + 256 * KIB])
                sent += n
                last_progress = time.monotonic()
            except BlockingIOError:
                time.sleep(0.01)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise Failed("the daemon closed the flooding connection after %d bytes: %s" % (sent, e))
            peak = max(peak, rss(d.pid))
        log("     sent %d of %d LIST options (%d KiB) in %.1f s; RSS %d MiB"
            % (sent // 16, LIST_COUNT, sent >> 10, time.monotonic() - t0, rss(d.pid) >> 20))

        # With the flood parked, a normal client is served correctly.
        h = nbd.NBD()
        bounded("libnbd connect during the LIST flood", 15, h.connect_uri, d.unix_uri("data"))
        try:
            bounded("libnbd pwrite during the LIST flood", 15, model.write, h, 1 * MIB, 256 * KIB)
            bounded("libnbd pread during the LIST flood", 15, model.check, h, 0, DATA_SIZE,
                    "libnbd during the LIST flood")
            bounded("libnbd flush", 15, h.flush)
            peak = max(peak, rss(d.pid))
            bounded("libnbd shutdown", 10, h.shutdown)
        finally:
            close_handle(h)
        for _ in range(10):
            time.sleep(0.1)
            peak = max(peak, rss(d.pid))
        log("     daemon RSS baseline %d MiB, peak during the flood %d MiB" % (base >> 20, peak >> 20))
        errors = []
        if sent >= len(wire):
            errors.append("the daemon read all %d LIST options (%d MiB of replies unread): it did "
                          "not stop reading" % (LIST_COUNT, LIST_COUNT * (60 + len(DESCRIPTION)) >> 20))
        if peak >= RSS_LIMIT:
            errors.append("daemon RSS reached %d MiB with unread LIST replies (limit %d MiB)"
                          % (peak >> 20, RSS_LIMIT >> 20))
        if peak - base >= RSS_GROWTH_LIMIT:
            errors.append("daemon RSS grew by %d MiB with unread LIST replies (limit %d MiB over "
                          "the baseline)" % ((peak - base) >> 20, RSS_GROWTH_LIMIT >> 20))
        need(not errors, "; ".join(errors))

        # The replies the daemon did produce are well-formed LIST replies.
        r.s.setblocking(True)
        r.s.settimeout(10)
        want = {"data": DESCRIPTION, "cold": ""}
        try:
            for i in range(50):
                typ, items, p = r.opt_replies(raw.OPT_LIST)
                need(typ == raw.REP_ACK and p == b"", "LIST reply %d: %s" % (i, raw.rep_name(typ)))
                got = {}
                for t, payload in items:
                    need(t == raw.REP_SERVER, "LIST reply %d: %s" % (i, raw.rep_name(t)))
                    name, desc = raw.parse_server_reply(payload)
                    got[name] = desc
                need(got == want, "LIST reply %d lists %r" % (i, sorted(got)))
        except (raw.Mismatch, raw.Closed) as e:
            raise Failed("reading the flood's LIST replies: %s" % e)
    finally:
        r.close()


# ---- 3. READs then DISC, replies never read. ----

def close_deadline(d):
    before = rss(d.pid)
    clients = []
    try:
        for count in (20, 200):
            r = raw.RawClient(d.sock)
            clients.append((count, r))
            r.open("data", structured=True)
        t0 = time.monotonic()
        for count, r in clients:
            wire = b"".join(r.encode_request(raw.CMD_READ, 0, MIB)[1] for _ in range(count))
            wire += r.encode_request(raw.CMD_DISC, 0, 0)[1]
            r.s.sendall(wire)
        polls = {}
        for count, r in clients:
            p = select.poll()
            p.register(r.s, HUP)
            polls[count] = p
        closed = {}
        peak = before
        # 20 MiB of replies fit the output buffer: the DISC is read and the
        # close deadline applies. 200 MiB do not: the stall deadline does.
        deadline = {20: CLOSE_TIMEOUT, 200: STALL_TIMEOUT}
        # How early each may end (no deadline ends before it began; a busy
        # machine only delays): that the stall deadline, not the close one,
        # ended the second is their order, and the log's reasons, below.
        low = {20: CLOSE_TIMEOUT - 2, 200: STALL_TIMEOUT - 1}
        # How long we watch: 3 x the close deadline.
        limit = 3 * CLOSE_TIMEOUT
        while len(closed) < len(clients) and time.monotonic() - t0 < limit:
            for count, _ in clients:
                if count not in closed and polls[count].poll(0):
                    closed[count] = time.monotonic() - t0
            peak = max(peak, rss(d.pid))
            time.sleep(0.1)
        for count, _ in clients:
            log("     %3d x 1 MiB READ + DISC: %s; RSS before %d MiB, peak %d MiB"
                % (count, "closed after %.1f s" % closed[count] if count in closed else
                   "still open after %.0f s" % limit, before >> 20, peak >> 20))
    finally:
        for _, r in clients:
            r.close()
    after = None
    for _ in range(300):                # 30 s at most
        time.sleep(0.1)
        after = rss(d.pid)
        if after < before + 32 * MIB:
            break
    log("     RSS %d MiB after the clients are gone" % (after >> 20))
    errors = []
    for count, _ in clients:
        t = closed.get(count)
        want = deadline[count]
        if t is None:
            errors.append("a client that sent %d x 1 MiB READs then NBD_CMD_DISC and read no reply "
                          "is still connected %d s later (deadline %d s)"
                          % (count, limit, want))
        elif t < low[count]:
            errors.append("a client that sent %d x 1 MiB READs then NBD_CMD_DISC was disconnected "
                          "after %.1f s, before its %d s deadline could end" % (count, t, want))
    if 20 in closed and 200 in closed and not closed[200] < closed[20]:
        errors.append("the client past CONN_MAX_OUTPUT was cut off after %.1f s, not before the "
                      "one under the close deadline (%.1f s): --stall-timeout %d did not apply"
                      % (closed[200], closed[20], STALL_TIMEOUT))
    # Why each was cut off, in the daemon's words (conn.c): one of each.
    text = d.log_text()
    for why in ("client did not read its last replies in time",
                "client has not read its replies for %d s" % STALL_TIMEOUT):
        n = text.count(": " + why + ";")
        if n != 1:
            errors.append("%d connections ended with '%s' in the log, expected 1 (the %s)"
                          % (n, why, "client under the close deadline" if "last" in why
                             else "one past CONN_MAX_OUTPUT"))
    if after >= before + 32 * MIB:
        errors.append("daemon RSS %d MiB after the non-reading clients were gone (%d MiB before)"
                      % (after >> 20, before >> 20))
    need(not errors, "; ".join(errors))


# ---- 4. EMFILE. ----

def emfile(tmp, path):
    workdir = os.path.join(tmp, "emfile")
    os.makedirs(workdir)
    d = nbdtest.Daemon([("data", path, "")], threads=2, workdir=workdir)
    try:
        emfile_checks(d, path)
    finally:
        # SIGTERM; it must exit 0 even after a failed check.
        d.stop()


def emfile_checks(d, path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (EMFILE_NOFILE, hard))
    nfd = len(os.listdir("/proc/%d/fd" % d.pid))
    log("     second daemon: %d fds open, RLIMIT_NOFILE soft limit now %d"
        % (nfd, EMFILE_NOFILE))
    need(nfd + 5 < EMFILE_NOFILE, "test setup: the daemon already has %d fds" % nfd)
    with open(path, "rb") as f:
        first_block = f.read(4096)
    conns = []
    try:
        for _ in range(EMFILE_CONNS):
            conns.append(raw.RawClient(d.sock, timeout=5))
        # Let it accept what it can and run into EMFILE.
        for _ in range(30):
            if len(os.listdir("/proc/%d/fd" % d.pid)) >= EMFILE_NOFILE - 1:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        c0 = cpu_seconds(d.pid)
        time.sleep(3)
        spent = cpu_seconds(d.pid) - c0
        log("     %d fds open with %d connections; CPU %.2f s over 3 s"
            % (len(os.listdir("/proc/%d/fd" % d.pid)), EMFILE_CONNS, spent))
        need(d.alive(), "the daemon died at EMFILE")
        need(spent < 0.5, "the daemon used %.2f s of CPU in 3 s while out of file "
             "descriptors (it spins on accept)" % spent)
        deadline = time.monotonic() + 30
        while "pausing new connections" not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        need("pausing new connections" in d.log_text(),
             "the log does not say 'pausing new connections' at EMFILE")
        # A connection accepted before the limit is still served.
        try:
            conns[0].open("data")
            rep = conns[0].command(raw.CMD_READ, 0, 4096)
            need(rep.error == 0 and rep.data == first_block,
                 "READ on an accepted connection at EMFILE: %s" % raw.err_name(rep.error))
            conns[0].disconnect()
        except (raw.Mismatch, raw.Closed) as e:
            raise Failed("an accepted connection is not served at EMFILE: %s" % e)
    finally:
        for c in conns:
            c.close()
    t0 = time.monotonic()
    served = None
    # The dead connections still in the backlog are taken first, as many
    # each time the listeners resume as there are free descriptors (3 to 5
    # pauses of ACCEPT_PAUSE here); each pause ends with at least one taken,
    # the workers having closed the ones taken before it meanwhile. So at
    # most one pause each: EMFILE_CONNS x ACCEPT_PAUSE. One connection
    # that waits its turn in the backlog (not one a second, each given up
    # after a while: those would be more dead connections to take).
    limit = EMFILE_CONNS * ACCEPT_PAUSE
    while served is None and time.monotonic() - t0 < limit:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(max(0.1, limit - (time.monotonic() - t0)))
                s.connect(d.sock)
                if len(s.recv(18)) == 18:
                    served = time.monotonic() - t0
                    break
        except socket.timeout:
            break
        except OSError:
            time.sleep(0.1)             # the backlog is full: try again
    log("     after closing the %d connections a new one got its greeting after %s"
        % (EMFILE_CONNS, "%.1f s" % served if served is not None else "never (%d s)" % limit))
    need(served is not None,
         "a new client was not served within %d s after the EMFILE connections closed (the "
         "daemon pauses accepting for %d s at a time)" % (limit, ACCEPT_PAUSE))
    h = nbd.NBD()
    bounded("libnbd connect after EMFILE", 10, h.connect_uri, d.tcp_uri("data"))
    try:
        buf = random.Random(7).randbytes(65536)
        bounded("libnbd pwrite after EMFILE", 10, h.pwrite, buf, 65536)
        need(bounded("libnbd pread after EMFILE", 10, h.pread, 65536, 65536) == buf,
             "libnbd after EMFILE read back the wrong data")
        need(bounded("libnbd pread after EMFILE", 10, h.pread, 4096, 0) == first_block,
             "libnbd after EMFILE read the wrong first block")
        bounded("libnbd shutdown", 10, h.shutdown)
    finally:
        close_handle(h)
    need(d.alive(), "the EMFILE daemon died")


def main():
    failures = []

    def sub(name, fn, *args):
        log("=== %s" % name)
        t = time.monotonic()
        try:
            fn(*args)
            log("ok   %s (%.1f s)" % (name, time.monotonic() - t))
        except Failed as e:
            log("FAIL %s: %s" % (name, e))
            failures.append("%s: %s" % (name, e))

    with nbdtest.tempdir() as tmp:
        rnd = random.Random(2024)
        paths = {}
        for name, size in (("data", DATA_SIZE), ("cold", COLD_SIZE), ("emfile", 1 * MIB)):
            paths[name] = os.path.join(tmp, name + ".img")
            with open(paths[name], "wb") as f:
                f.write(rnd.randbytes(size))
                f.flush()
                os.fsync(f.fileno())
        model = Model(paths["data"])
        exports = [("data", paths["data"], "description=" + DESCRIPTION),
                   ("cold", paths["cold"], "")]
        os.makedirs(os.path.join(tmp, "main"))
        with nbdtest.Daemon(exports, threads=2, workdir=os.path.join(tmp, "main"),
                            extra=["--stall-timeout", str(STALL_TIMEOUT),
                                   "--negotiation-timeout", str(NEGOTIATION_TIMEOUT)]) as d:
            time.sleep(0.3)
            base = rss(d.pid)
            log("daemon PID %d, RSS %d MiB at start" % (d.pid, base >> 20))

            # Clients that finish GO, then idle across the negotiation deadline.
            idle = nbd.NBD()
            bounded("idle libnbd connect", 15, idle.connect_uri, d.tcp_uri("data"))
            bounded("idle libnbd pread", 15, model.check, idle, 0, 64 * KIB, "idle client")
            idle_raw = raw.RawClient(d.sock)
            try:
                idle_raw.open("data")
            except (raw.Mismatch, raw.Closed) as e:
                nbdtest.fail("raw GO: %s" % e)
            idle_since = time.monotonic()

            # 2: the clients that must hit the negotiation deadline.
            def tcp():
                return socket.create_connection(("127.0.0.1", d.port), timeout=5)

            def unix():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(d.sock)
                return s

            dribbler = DeadlineClient("dribbler (TCP, 1 byte / %g s)" % DRIBBLE_INTERVAL, tcp, True)
            parked = DeadlineClient("parked mid-option-header (Unix)", unix, False)
            for t in (dribbler, parked):
                t.start()
                t.connected.wait(10)

            sub("5. CACHE with length 0", cache_zero, d, paths)
            sub("1. pipelined NBD_OPT_LIST, replies never read", negotiation_flood, d, model, base)
            four = nbdtest.Beside("4. EMFILE on a second daemon", sub,
                                  "4. EMFILE on a second daemon", emfile, tmp, paths["emfile"])
            sub("3. READs + NBD_CMD_DISC, replies never read", close_deadline, d)
            try:
                four.wait(120)
            except nbdtest.Failed as e:
                log("FAIL %s" % e)
                failures.append(str(e))

            log("=== 2. negotiation deadline (waiting for the threads)")
            for t in (dribbler, parked):
                t.join(DeadlineClient.LIMIT + 10)
                log("     %s: %s, sent %d bytes, received %d bytes"
                    % (t.name, "closed after %.1f s" % t.closed_after if t.closed_after is not None
                       else "not closed", t.sent, t.received))
            for t, dr in ((dribbler, True), (parked, False)):
                sub("2. %s" % t.name, check_deadline_client, t, dr)

            def deadline_reason():
                # The deadline that ended them, in the daemon's words (conn.c):
                # its own, configured, for both.
                why = "negotiation did not finish in %d s" % NEGOTIATION_TIMEOUT
                n = d.log_text().count(": " + why + ";")
                need(n == 2, "%d connections ended with '%s' in the log, expected 2 (the "
                     "dribbler and the parked client)" % (n, why))

            sub("2. the negotiation deadline ended both", deadline_reason)

            def idle_check():
                # They finished GO before the two above connected, so any
                # negotiation deadline on them would have ended them first:
                # the two are closed (joined above), so past it. And the
                # deadline's own time since GO, in case those failed early.
                need(dribbler.closed_after is not None and parked.closed_after is not None,
                     "the deadline clients were not disconnected: nothing to compare with")
                left = idle_since + NEGOTIATION_TIMEOUT - time.monotonic()
                if left > 0:
                    time.sleep(left)
                log("     idle clients used %.0f s after GO" % (time.monotonic() - idle_since))
                p = select.poll()
                p.register(idle_raw.s, HUP | select.POLLIN)
                need(not p.poll(0), "the raw client idle after GO was disconnected or sent data")
                try:
                    rep = idle_raw.command(raw.CMD_READ, 0, 65536)
                    need(rep.error == 0, "idle raw READ: %s" % raw.err_name(rep.error))
                    with model.lock:
                        want = bytes(model.data[:65536])
                    need(rep.data == want, "idle raw READ returned the wrong data")
                    idle_raw.disconnect()
                except (raw.Mismatch, raw.Closed) as e:
                    raise Failed("the raw client idle after GO: %s" % e)
                bounded("idle libnbd pwrite", 15, model.write, idle, DATA_SIZE - 128 * KIB, 128 * KIB)
                bounded("idle libnbd pread", 15, model.check, idle, 0, DATA_SIZE, "idle libnbd client")
                bounded("idle libnbd flush", 15, idle.flush)
                bounded("idle libnbd shutdown", 15, idle.shutdown)

            sub("2. clients idle after GO are not disconnected", idle_check)
            idle_raw.close()
            close_handle(idle)

            with open(paths["data"], "rb") as f:
                if f.read() != bytes(model.data):
                    failures.append("the backend file differs from what the clients wrote")
            nbdtest.check(d.alive(), "the daemon died")
            if failures:
                d.dump_log()
        # Daemon.stop: SIGTERM, exit 0, no sanitizer report.
    if failures:
        log("")
        log("%d check(s) failed:" % len(failures))
        for f in failures:
            log("  " + f)
        nbdtest.fail("%d of the hostile-client checks failed" % len(failures))
    log("all hostile-client checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
