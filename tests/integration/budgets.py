#!/usr/bin/python3
"""budgets: what all clients together can make the daemon hold, against the
real daemon (daemon/budget.h): arena bytes pinned by unsent replies, reply
memory, the number of connections, and the stall deadline.

1. Slow readers do not pin the cache. A daemon with a 256 MiB cache; four
   clients each pipeline 24 x 4 MiB READs of distinct data (384 MiB in
   all, more than the cache) and read no reply. Then: the control socket's
   stats say pinned_reply_bytes <= --max-pinned-replies (default: 1/8 of
   the cache, 32 MiB) plus one request; a well-behaved client reads 32 MiB
   of other data twice and the second pass is served from the cache (hits,
   and the right bytes): the cache still caches. When the slow clients
   close, pinned_reply_bytes and reply_bytes drop to 0.
2. CACHE counts against the connection's budget. An nbdkit backend
   whose reads take 1 s (it serves one CACHE at a time) behind a 512 MiB
   cache; a client warms 4 KiB, then pipelines 6 x 32 MiB CACHE and a READ
   of the warm 4 KiB. Three CACHEs fill the 96 MiB budget, so the daemon
   reads the READ only once enough have finished: its reply (a hit) comes
   after >= 0.75 s (before the fix, at once: CACHE was not counted). Every
   reply is a success.
3. Clients that never read. A daemon with a 256 MiB cache, the default
   memory limits and --stall-timeout 5 (the default 30 s made this check
   take 80 s; the deadline's meaning does not depend on its length); a
   well-behaved libnbd client measures its QD1 4 KiB read IOPS on warm
   data alone; then 32 clients (16 on the Unix socket, 16 on TCP) each
   pipeline 8 x 32 MiB READs and read nothing. They cannot all be served
   at once (512 MiB of reply memory, which they fill at least half: else
   nothing was checked): some wait, unread, and are served as the others
   go, in waves one stall timeout apart. Until all are gone, or
   for 8 stall timeouts: the daemon's RSS stays below its start RSS +
   cache size + --max-reply-memory (default 512 MiB) + 160 MiB (1 MiB per
   connection that each may hold whatever the others do, a reply being
   copied per worker, malloc's slack); the well-behaved client, reading
   all the while the non-readers are there, reads correct data and is
   not starved (at least 5% of its IOPS alone, measured in the same run:
   53% here; the ratio is printed, and bench/run --scenario slow-readers
   holds the 20% bar, too noisy for a test on a shared 2-core machine and
   under ASan); every non-reader is disconnected (reset) no sooner than the
   stall timeout - 1 s after the last 64 KiB of replies reached it (its
   unread queue, FIONREAD, grew by that much) and within 3 x the stall
   timeout after the last byte did (a busy event loop only delays the
   timer: 0-1 s late here), the daemon saying for each that the client
   "has not read its replies for N s" (the stall deadline, not another),
   none before it was sent anything, and none that was last sent anything
   more than 3 x the stall timeout earlier is still connected. A client
   whose WRITE payload stops after 1 MiB of 32 (its request admitted,
   holding reply memory) is disconnected in the same window, the daemon
   saying its payload came too slowly. Once all are gone, reply_bytes and
   pinned_reply_bytes are 0 again.
4. --max-clients. A daemon with --max-clients 4: four connections get
   their greeting, the fifth is closed at once without one, the log says
   "refusing new connections" once for the spell however many are refused,
   and once one closes a new client is served again.
5. Mode none pins nothing. An export in cache mode none over the same
   file; a client pipelines 8 x 4 MiB READs and reads no reply: the
   replies are held (reply_bytes above 0) but pinned_reply_bytes stays 0
   (the data is the request's, not the arena's); another client reads the
   right bytes; once the slow client closes, reply_bytes is 0 again.

BUDGETS_STALL_TIMEOUT (default 5, at least 3) is check 3's --stall-timeout:
the waves of non-readers come one stall timeout apart; the well-behaved
client is measured alone for 2 s less (at most 3 s), and beside the
non-readers for as long as they are there. BUDGETS_READ_DELAY (default 1) is check 2's backend
read delay in seconds. make asan and make i386 set 3 and 0.5: the window
around the deadline (1 s early, 3 x the stall timeout late) still tells
it from another, the well-behaved client still makes thousands of reads
in each 0.5 s or more, and the READ behind the CACHEs still waits for at
least one backend read.

No bound here is a wall-clock figure a busy machine could miss: times
are lower bounds (a deadline cannot end before it began; a READ held
behind the CACHEs waits for a backend read), a ratio to the same client
alone in the same run, or many times the deadline the daemon keeps.
BUDGETS_ONLY=DIGITS runs those checks only (e.g. 13). Check 2 runs on a
thread beside check 1 (their log lines mix; each is named), then 4, 3, 5.
"""

import fcntl
import os
import random
import select
import socket
import struct
import sys
import termios
import threading
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
BIG_SIZE = 640 * MIB
CACHE_SIZE = 256 * MIB
PINNED_DEFAULT = CACHE_SIZE // 8          # --max-pinned-replies default
REPLY_MEMORY_DEFAULT = 512 * MIB          # --max-reply-memory default
# check 3's --stall-timeout (the daemon's default 30)
STALL_TIMEOUT = int(os.environ.get("BUDGETS_STALL_TIMEOUT", "5"))
# How early and how late check 3 accepts a reset: early, the timer's and
# the poller's slack (a deadline cannot end before it began); late, a
# multiple of the deadline: resets come from a timer on a busy event loop,
# which a busy machine only delays (0-1 s seen; 7.7 s under ASan and 4.6 s
# without while a read that found the cache pinned scanned the eviction
# queues once per 4 KiB frame). That it was the stall deadline, and not
# another, that reset them the daemon's log says.
STALL_EARLY, STALL_LATE = 1, 2 * STALL_TIMEOUT
STALL_PROGRESS = 64 * KIB                 # conn.h's CONN_STALL_PROGRESS
WATCH = 8 * STALL_TIMEOUT                 # at most, check 3 watches the non-readers
# Check 2's backend read delay: the warm READ behind the CACHEs must wait
# for at least one such read (a READ not held back is answered at once).
CACHE_RDELAY = float(os.environ.get("BUDGETS_READ_DELAY", "1"))
# How long the waits for a state (a stats figure back to 0, a greeting) go on.
WAIT = 30
# Above the cache and --max-reply-memory: 1 MiB per connection that each may
# hold whatever the others do, a 32 MiB reply being copied per worker, malloc.
RSS_SLACK = 160 * MIB
HUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR

CHECKS = nbdtest.Checks()
expect = CHECKS.expect
need = nbdtest.require


def block_pattern(first, count):
    """count 4 KiB blocks, block i holding its number i (8 bytes) 512 times."""
    return b"".join(struct.pack(">Q", i) * 512 for i in range(first, first + count))


def make_big(path):
    with open(path, "wb") as f:
        for mib in range(BIG_SIZE // MIB):
            f.write(block_pattern(mib * 256, 256))


def want(off, n):
    """What the big file holds at [off, off + n), both 4 KiB aligned."""
    return block_pattern(off // 4096, n // 4096)


def stats(d):
    return nbdtest.control_request(d.control, {"command": "stats"}, timeout=20)


def client_stat(st, key):
    """A field of the stats reply's "clients" object; None when missing."""
    return st.get("clients", {}).get(key)


def export_stat(st, name, key):
    for e in st["exports"]:
        if e["name"] == name:
            return e[key]
    raise nbdtest.Failed("no export %s in stats" % name)


def bounded(what, timeout, fn, *args):
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
        raise nbdtest.Failed("%s did not finish within %d s" % (what, timeout))
    if "error" in box:
        raise nbdtest.Failed("%s: %s: %s" % (what, type(box["error"]).__name__, box["error"]))
    return box.get("value")


def send_all_nonblocking(r, wire, seconds):
    """Send what the daemon takes within `seconds`; the bytes sent."""
    r.s.setblocking(False)
    mv = memoryview(wire)
    sent = 0
    t0 = time.monotonic()
    while sent < len(wire) and time.monotonic() - t0 < seconds:
        try:
            sent += r.s.send(mv[sent:])
        except BlockingIOError:
            time.sleep(0.01)
    return sent


def pipeline_reads(r, offsets, length):
    wire = b"".join(r.encode_request(raw.CMD_READ, off, length)[1] for off in offsets)
    need(send_all_nonblocking(r, wire, 5) == len(wire), "could not send %d READ headers"
         % len(offsets))


# ---- 1. slow readers do not pin the cache ----

DEFAULT_STALL_TIMEOUT = 30               # the daemon's --stall-timeout in check 1


def pinned_replies(d):
    slow = []
    try:
        for k in range(4):
            r = raw.RawClient(d.sock)
            slow.append(r)
            r.open("big")
            pipeline_reads(r, [(k * 24 + j) * 4 * MIB for j in range(24)], 4 * MIB)
        sent = time.monotonic()
        time.sleep(4)
        st = stats(d)
        pinned = client_stat(st, "pinned_reply_bytes")
        log("     4 clients x 24 x 4 MiB READs unread: pinned_reply_bytes %s, reply_bytes %s, "
            "cache used %d MiB" % (pinned, client_stat(st, "reply_bytes"),
                                   st["cache"]["used_bytes"] >> 20))
        expect(pinned is not None, "the stats have no clients.pinned_reply_bytes")
        if pinned is not None:
            expect(pinned <= PINNED_DEFAULT + 4 * MIB,
                   "unsent replies pin %d MiB of the cache (limit %d MiB)"
                   % (pinned >> 20, PINNED_DEFAULT >> 20))
        # Another client's reads are still cached.
        h = nbd.NBD()
        bounded("libnbd connect", 15, h.connect_uri, d.unix_uri("big"))
        try:
            base = 512 * MIB
            for p in range(2):
                before = export_stat(stats(d), "big", "hits")
                for i in range(32):
                    off = base + i * MIB
                    got = bounded("libnbd pread", 20, h.pread, MIB, off)
                    if got != want(off, MIB):
                        raise nbdtest.Failed("pass %d: wrong data at %d MiB" % (p, off >> 20))
                hits = export_stat(stats(d), "big", "hits") - before
                log("     well-behaved client, pass %d over 32 MiB: %d of 32 reads were hits"
                    % (p + 1, hits))
            expect(hits >= 28, "with slow readers holding replies, a second pass over 32 MiB "
                   "got %d hits of 32: the cache is pinned and caches nothing new" % hits)
            bounded("libnbd shutdown", 10, h.shutdown)
        finally:
            del h
        # (Only while its stall deadline cannot have come: a machine slow
        # enough to take 30 s over this check would rightly reset them.)
        if time.monotonic() - sent < DEFAULT_STALL_TIMEOUT - STALL_EARLY:
            for r in slow:
                p = select.poll()
                p.register(r.s, HUP)
                expect(not p.poll(0), "a slow reader was disconnected before its stall deadline")
    finally:
        for r in slow:
            r.close()
    for _ in range(WAIT * 10):
        st = stats(d)
        if not client_stat(st, "pinned_reply_bytes") and not client_stat(st, "reply_bytes"):
            break
        time.sleep(0.1)
    log("     after they closed: pinned_reply_bytes %s, reply_bytes %s"
        % (client_stat(st, "pinned_reply_bytes"), client_stat(st, "reply_bytes")))
    expect(client_stat(st, "pinned_reply_bytes") == 0 and client_stat(st, "reply_bytes") == 0,
           "pinned_reply_bytes / reply_bytes not back to 0 once the clients closed")


# ---- 2. CACHE counts against the connection's budget ----

def cache_counted(tmp):
    workdir = os.path.join(tmp, "slow")
    os.makedirs(workdir)
    slow = "nbdkit:--filter=delay memory size=1G rdelay=%dms" % (CACHE_RDELAY * 1000)
    with nbdtest.running_daemon([("slow", slow, "")], extra=["--cache-size", "512M"],
                                workdir=workdir) as d:
        cache_pipeline(d)


def cache_pipeline(d):
    r = raw.RawClient(d.sock, timeout=30)
    try:
        r.open("slow")
        rep = r.command(raw.CMD_READ, 0, 4096)
        need(rep.error == 0, "warming READ: %s" % raw.err_name(rep.error))
        wire = b""
        for k in range(6):
            ck, hdr = r.encode_request(raw.CMD_CACHE, (2 + k) * 32 * MIB, 32 * MIB)
            r.pending[ck] = (raw.CMD_CACHE, (2 + k) * 32 * MIB, 32 * MIB)
            wire += hdr
        ck, hdr = r.encode_request(raw.CMD_READ, 0, 4096)
        r.pending[ck] = (raw.CMD_READ, 0, 4096)
        t0 = time.monotonic()
        r.send(wire + hdr)
        rep = r.read_reply(ck)
        waited = time.monotonic() - t0
        log("     the warm READ behind 6 x 32 MiB CACHE (backend reads take %g s) was "
            "answered after %.2f s" % (CACHE_RDELAY, waited))
        need(rep.error == 0, "warm READ: %s" % raw.err_name(rep.error))
        expect(waited >= 0.75 * CACHE_RDELAY, "the READ behind 192 MiB of CACHE was answered "
               "after %.2f s: the daemon took all six CACHE requests at once (96 MiB budget)"
               % waited)
        for c in list(r.pending):
            rep = r.read_reply(c)
            expect(rep.error == 0, "CACHE: %s" % raw.err_name(rep.error))
        r.disconnect()
    except (raw.Mismatch, raw.Closed) as e:
        raise nbdtest.Failed("CACHE pipeline: %s" % e)
    finally:
        r.close()


# ---- 3. clients that never read ----

def qd1_iops(h, seconds, rnd):
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        off = 600 * MIB + rnd.randrange(0, 16 * MIB // 4096) * 4096
        got = h.pread(4096, off)
        if got != want(off, 4096):
            raise nbdtest.Failed("wrong data at %d" % off)
        n += 1
    return n / (time.monotonic() - t0)


def expect_replies_released(d, tries, msg):
    """Wait (tries x 0.1 s at most) for reply_bytes to fall to 0, then expect
    reply_bytes and pinned_reply_bytes both 0; msg takes the two values."""
    for _ in range(tries):
        st = stats(d)
        if not client_stat(st, "reply_bytes"):
            break
        time.sleep(0.1)
    expect(client_stat(st, "reply_bytes") == 0 and client_stat(st, "pinned_reply_bytes") == 0,
           msg % (client_stat(st, "reply_bytes"), client_stat(st, "pinned_reply_bytes")))


class NonReader:
    """A raw client that pipelines READs and never reads; polls (without
    reading) for when its first reply bytes arrive and when it is closed."""

    def __init__(self, d, k):
        # Half on the Unix socket, half on TCP (where the kernel buffers more).
        self.r = raw.RawClient(d.sock) if k % 2 == 0 else raw.RawClient(port=d.port)
        self.first_data = self.closed = self.moved = self.grew = None
        self.queued = self.queued_at_move = 0

    def send(self, offsets, length):
        self.r.open("big")
        wire = b"".join(self.r.encode_request(raw.CMD_READ, o, length)[1] for o in offsets)
        self.r.s.setblocking(False)
        self.r.s.send(wire)
        self.sent = time.monotonic()
        self.poll = select.poll()
        self.poll.register(self.r.s, select.POLLIN | HUP)

    def look(self):
        if self.closed is not None:
            return
        now = time.monotonic()
        for _, ev in self.poll.poll(0):
            if ev & HUP:
                self.closed = now
                return
            if ev & select.POLLIN and self.first_data is None:
                self.first_data = self.moved = self.grew = now
                self.poll.modify(self.r.s, HUP)     # level-triggered: data stays unread
        if self.first_data is None:
            return
        # What the socket holds unread: each time it grows, the daemon made
        # progress sending; CONN_STALL_PROGRESS (64 KiB) of it restarts the
        # daemon's stall clock.
        queued = struct.unpack("i", fcntl.ioctl(self.r.s, termios.FIONREAD, b"\0" * 4))[0]
        if queued > self.queued:
            self.grew = now
            if queued >= self.queued_at_move + STALL_PROGRESS:
                self.moved, self.queued_at_move = now, queued
            self.queued = queued


def never_readers(tmp, big):
    workdir = os.path.join(tmp, "nr")
    os.makedirs(workdir)
    with nbdtest.running_daemon([("big", big, "")],
                                extra=["--cache-size", "256M",
                                       "--stall-timeout", str(STALL_TIMEOUT)],
                                workdir=workdir) as d:
        time.sleep(0.3)
        base = nbdtest.rss(d.pid)
        h = nbd.NBD()
        bounded("libnbd connect", 15, h.connect_uri, d.unix_uri("big"))
        rnd = random.Random(5)
        bounded("warm", 30, lambda h=h: [h.pread(MIB, 600 * MIB + i * MIB) for i in range(16)])
        alone = bounded("IOPS alone", 30, qd1_iops, h, min(3, STALL_TIMEOUT - 2), rnd)
        log("     daemon RSS %d MiB at start; well-behaved client alone: %.0f IOPS"
            % (base >> 20, alone))
        bound = base + CACHE_SIZE + REPLY_MEMORY_DEFAULT + RSS_SLACK
        hostile = []
        peak = [base]
        stop = threading.Event()

        # A WRITE whose 32 MiB payload stops after 1 MiB: admitted, it holds
        # its reservation; the stall deadline applies to it as well.
        half = raw.RawClient(d.sock)
        half.open("big")
        half.s.sendall(half.encode_request(raw.CMD_WRITE, 0, 32 * MIB)[1] + bytes(MIB))
        half_sent = time.monotonic()
        half_poll = select.poll()
        half_poll.register(half.s, HUP | select.POLLIN)
        half_closed = []

        def monitor():
            while not stop.is_set():
                peak[0] = max(peak[0], nbdtest.rss(d.pid))
                for n in list(hostile):
                    n.look()
                if not half_closed and half_poll.poll(0):
                    half_closed.append(time.monotonic() - half_sent)
                time.sleep(0.05)

        t = threading.Thread(target=monitor, daemon=True)
        t.start()       # before the first non-reader: it sees its first reply byte
        try:
            for k in range(32):
                n = NonReader(d, k)
                try:
                    n.send([((k * 8 + j) * 32 * MIB) % (576 * MIB) for j in range(8)], 32 * MIB)
                except (raw.Mismatch, raw.Closed) as e:
                    n.r.close()
                    expect(False, "non-reader %d could not connect while %d others held "
                           "their replies: %s" % (k, k, e))
                    break
                hostile.append(n)
            t0 = time.monotonic()
            # The well-behaved client reads throughout the flood, while one
            # wave after another holds the reply memory: not in a window of
            # fixed seconds after a fixed settling time, which on a busy
            # machine catches the first wave still being copied in (the
            # client then waits a worker's whole round of 32 MiB READs, up
            # to 1.5 s a READ seen under load: 0-4% of alone in 2.5 s).
            stop_reading = threading.Event()
            reading = {"reads": 0, "secs": 0.0}

            def read_on(h):
                start = time.monotonic()
                try:
                    while not stop_reading.is_set():
                        off = 600 * MIB + rnd.randrange(0, 16 * MIB // 4096) * 4096
                        if h.pread(4096, off) != want(off, 4096):
                            raise nbdtest.Failed("wrong data at %d" % off)
                        reading["reads"] += 1
                finally:
                    reading["secs"] = time.monotonic() - start
            reader = nbdtest.Beside("the well-behaved client beside the non-readers",
                                    read_on, h)
            # The reply memory is full once the first wave is in (the
            # non-readers then hold what they are sent, unread).
            held = [0]

            def full():
                held[0] = max(held[0], client_stat(stats(d), "reply_bytes") or 0)
                return held[0] >= REPLY_MEMORY_DEFAULT // 2
            nbdtest.wait_until(full, WATCH, step=0.2)
            st = stats(d)
            log("     stats: reply_bytes %d MiB (at most %d MiB seen), pinned_reply_bytes %d MiB"
                % ((client_stat(st, "reply_bytes") or 0) >> 20, held[0] >> 20,
                   (client_stat(st, "pinned_reply_bytes") or 0) >> 20))
            while (time.monotonic() - t0 < WATCH and
                   not all(n.closed for n in hostile)):
                time.sleep(0.2)
            stop_reading.set()
            reader.wait(60)
            during = reading["reads"] / reading["secs"]
            log("     with 32 clients x 8 x 32 MiB READs unread: %.0f IOPS over %.1f s "
                "(%.0f%% of alone), RSS %d MiB" % (during, reading["secs"], 100 * during / alone,
                                                  nbdtest.rss(d.pid) >> 20))
            expect(held[0] >= REPLY_MEMORY_DEFAULT // 2, "the non-readers held at most %d MiB "
                   "of the %d MiB reply memory: the well-behaved client was not checked "
                   "beside a full one" % (held[0] >> 20, REPLY_MEMORY_DEFAULT >> 20))
            stop.set()
            t.join(5)
            end = time.monotonic()
            served = [n for n in hostile if n.first_data is not None]
            closed = [n for n in hostile if n.closed is not None]
            after = sorted(n.closed - n.first_data for n in closed if n.first_data)
            # The deadline runs from the last progress the client saw: the
            # daemon keeps filling its socket (and sends later replies) well
            # after the first byte when the machine is busy.
            quiet = sorted((n.closed - n.moved, n.closed - n.grew)
                           for n in closed if n.first_data)
            log("     RSS peak %d MiB (bound %d MiB); in %.0f s %d of %d were sent replies, %d "
                "closed, %s s after their first reply byte"
                % (peak[0] >> 20, bound >> 20, end - t0, len(served), len(hostile), len(closed),
                   "%.1f..%.1f" % (after[0], after[-1]) if after else "-"))
            log("     closed %s s after the last 64 KiB they were sent, %s s after the last byte"
                % ("%.1f..%.1f" % (quiet[0][0], quiet[-1][0]) if quiet else "-",
                   "%.1f..%.1f" % (min(q[1] for q in quiet), max(q[1] for q in quiet))
                   if quiet else "-"))
            log("     first reply bytes at %s s after sending"
                % sorted(round(n.first_data - n.sent) for n in served))
            expect(peak[0] <= bound, "daemon RSS reached %d MiB with 32 non-reading clients "
                   "(bound %d MiB)" % (peak[0] >> 20, bound >> 20))
            # Not starved (its reads are correct, checked in qd1_iops): a
            # ratio to the same client alone, in the same run, with a
            # factor of 20 (53% here). The ratio to running alone is a
            # benchmark (bench/run --scenario slow-readers: within 20%),
            # not a test's business: under ASan the daemon copying the
            # non-readers' replies is CPU-bound.
            expect(during >= 0.05 * alone,
                   "the well-behaved client got %.0f IOPS with the non-readers, %.0f alone "
                   "(starved)" % (during, alone))
            expect(closed, "no non-reading client was closed in %d s" % WATCH)
            expect(all(n.first_data for n in closed), "a non-reader was closed before it was "
                   "sent anything")
            low, high = STALL_TIMEOUT - STALL_EARLY, STALL_TIMEOUT + STALL_LATE
            expect(all(low <= moved and grew <= high for moved, grew in quiet),
                   "non-reading clients closed (s after the last 64 KiB, after the last byte) "
                   "%s (deadline %d s)"
                   % (["%.1f,%.1f" % q for q in quiet], STALL_TIMEOUT))
            late = [n for n in served if n.closed is None and end - n.grew > high]
            expect(not late, "%d non-readers still connected more than %d s after they were "
                   "last sent anything" % (len(late), high))
            log("     the half-sent WRITE: %s" % ("reset after %.1f s" % half_closed[0]
                                                  if half_closed else "still connected"))
            expect(half_closed and low <= half_closed[0] <= high,
                   "a WRITE whose payload stopped coming: connection %s (deadline %d s)"
                   % ("ended after %.1f s" % half_closed[0] if half_closed else "still open",
                      STALL_TIMEOUT))
            # Why they were reset, in the daemon's words (conn.c): the stall
            # deadline of --stall-timeout, one line for each connection.
            replies_why = ": client has not read its replies for %d s;" % STALL_TIMEOUT
            payload_why = ": client sent a request's payload too slowly"
            said = [0]

            def reasons():
                said[0] = d.log_text().count(replies_why)
                return said[0] >= len(closed)
            nbdtest.wait_until(reasons, 10)
            log("     %d connections ended with '%s'" % (said[0], replies_why[2:-1]))
            expect(said[0] >= len(closed), "%d non-readers were reset, %d connections ended "
                   "with '%s' in the log" % (len(closed), said[0], replies_why[2:-1]))
            expect(not half_closed or d.log_text().count(payload_why) == 1,
                   "the half-sent WRITE's connection did not end with '%s' in the log"
                   % payload_why[2:])
            bounded("libnbd read after", 20, qd1_iops, h, 0.5, rnd)
            bounded("libnbd shutdown", 10, h.shutdown)
        finally:
            stop.set()
            for n in hostile:
                n.r.close()
            half.close()
            del h
        expect_replies_released(d, WAIT * 10, "reply_bytes %s, pinned_reply_bytes %s once "
                                "every client is gone")


# ---- 4. --max-clients ----

def greeted(path, timeout=WAIT):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        got = s.recv(18)
    except (socket.timeout, ConnectionResetError):
        got = b""
    return s, len(got) > 0


def max_clients(tmp, big):
    workdir = os.path.join(tmp, "mc")
    os.makedirs(workdir)
    with nbdtest.running_daemon([("big", big, "")], extra=["--max-clients", "4"],
                                workdir=workdir) as d:
        held = []
        try:
            for _ in range(4):
                s, ok = greeted(d.sock)
                held.append(s)
                expect(ok, "a connection below --max-clients got no greeting")
            refused = 0
            for _ in range(5):
                s, ok = greeted(d.sock)
                refused += not ok
                s.close()
            expect(refused == 5, "%d of 5 connections over --max-clients 4 were refused" % refused)
            n = d.log_text().count("refusing new connections")
            log("     5 over the limit refused; the log says so %d time(s)" % n)
            expect(n == 1, "'refusing new connections' logged %d times for one spell" % n)
            held.pop().close()
            ok = False
            t0 = time.monotonic()
            for _ in range(WAIT * 10):
                s, ok = greeted(d.sock)
                s.close()
                if ok or time.monotonic() - t0 > WAIT:
                    break
                time.sleep(0.1)
            expect(ok, "no greeting after a connection closed below --max-clients")
        finally:
            for s in held:
                s.close()


# ---- 5. mode none pins nothing ----

def none_pins_nothing(tmp, big):
    workdir = os.path.join(tmp, "none")
    os.makedirs(workdir)
    with nbdtest.running_daemon([("none", big, "cache-mode=none")],
                                extra=["--cache-size", "256M"], workdir=workdir) as d:
        r = raw.RawClient(d.sock)
        try:
            r.open("none")
            pipeline_reads(r, [j * 4 * MIB for j in range(8)], 4 * MIB)
            st = stats(d)
            for _ in range(WAIT * 10):
                st = stats(d)
                if client_stat(st, "reply_bytes"):
                    break
                time.sleep(0.1)
            log("     8 x 4 MiB READs unread, mode none: pinned_reply_bytes %s, reply_bytes %s"
                % (client_stat(st, "pinned_reply_bytes"), client_stat(st, "reply_bytes")))
            expect(client_stat(st, "reply_bytes"), "mode none: no reply bytes held for a "
                   "client that reads nothing (the check saw nothing)")
            expect(client_stat(st, "pinned_reply_bytes") == 0,
                   "mode none: unsent replies pin %s bytes of the cache"
                   % client_stat(st, "pinned_reply_bytes"))
            h = nbd.NBD()
            bounded("libnbd connect", 15, h.connect_uri, d.unix_uri("none"))
            for off in (0, 100 * MIB + 4096):
                got = bounded("libnbd pread", 20, h.pread, 256 * KIB, off)
                expect(got == want(off, 256 * KIB), "mode none: wrong data at %d" % off)
            bounded("libnbd shutdown", 10, h.shutdown)
            del h
        finally:
            r.close()
        expect_replies_released(d, WAIT * 10, "mode none: reply_bytes %s / pinned_reply_bytes "
                                "%s once the client closed")


def main():
    if STALL_TIMEOUT < 3:       # check 3 measures alone for STALL_TIMEOUT - 2 s
        nbdtest.fail("BUDGETS_STALL_TIMEOUT=%d: 3 at least" % STALL_TIMEOUT)
    only = os.environ.get("BUDGETS_ONLY", "12345")   # a subset, for a quick look
    with nbdtest.tempdir() as tmp:
        big = os.path.join(tmp, "big.img")
        make_big(big)
        two = None
        if "2" in only:
            # Beside 1: 2 waits for its delayed backend, 1 for the slow
            # readers' replies to pile up; each on a daemon of its own, and
            # neither's bounds are times the other could stretch (2's READ
            # must wait at least so long, not at most).
            name = "2. CACHE counts against the connection's budget"
            two = nbdtest.Beside(name, CHECKS.run, name, cache_counted, tmp)
        if "1" in only:
            workdir = os.path.join(tmp, "main")
            os.makedirs(workdir)
            with nbdtest.running_daemon([("big", big, "")], extra=["--cache-size", "256M"],
                                        workdir=workdir) as d:
                CHECKS.run("1. slow readers do not pin the cache", pinned_replies, d)
                CHECKS.dump_log(d)
        if two:
            try:
                two.wait(120)
            except nbdtest.Failed as e:
                CHECKS.add(str(e))
        if "4" in only:
            CHECKS.run("4. --max-clients", max_clients, tmp, big)
        if "3" in only:
            CHECKS.run("3. 32 clients that never read", never_readers, tmp, big)
        if "5" in only:
            CHECKS.run("5. mode none pins nothing", none_pins_nothing, tmp, big)
    CHECKS.finish("budget")


if __name__ == "__main__":
    main()
