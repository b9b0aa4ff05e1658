#!/usr/bin/python3
"""write_receive: WRITE payloads read from the socket straight into the cache.

A WRITE of whole blocks whose payload came whole with its header is copied
into the arena at once; one whose payload is still to come is received into
fresh frames, one whole entry's for each piece of 64 KiB or more (the
entries at its edges split to fit), that replace the entries' at the end
(stats: writes_in_place, writes_swapped); any other WRITE is received into
a buffer of its own. All in large reads, with the next request's header in
the same read.
These checks drive both paths and what can go wrong while a payload is
still arriving:

  mixed       600 pipelined WRITEs and READs (libnbd, 64 in flight), sizes
              from 512 bytes to 4 MiB, aligned and not, over uncached,
              clean and dirty blocks, simple and extended headers; every
              READ and the file after FLUSH match a byte model, and both
              paths were taken (writes_in_place moved, and not for all)
  truncated   a WRITE cut off after half its payload by the client closing
              changes nothing, whether its blocks were uncached, cached
              clean or dirty: a READ
              from another connection while the half is in, READ after, and
              the file after FLUSH show the old bytes
  straight    1 MiB WRITEs, 8 in flight, over TCP: at most 1/32 of their
              payload bytes pass through the input buffer (the connection's
              payload_copied, control socket); the rest is read from the
              socket straight into the arena or the request's buffer
  rewrite     4 KiB WRITEs over dirty blocks, each sent whole with its
              header: received in place (the payload cannot be cut short
              any more), and READ shows the last one
  dribble     a 1 MiB payload sent in 64 pieces 20 ms apart completes with
              the right bytes while another connection reads on unhindered:
              at least 3 of its READs begin after the WRITE's header was
              sent and end before its last piece was (an order, not a rate)
  stall       --stall-timeout 2: a payload that stops half way ends the
              connection, no sooner than 1.5 s and within 10 x the
              deadline, the log saying the payload came too slowly; the
              blocks are unchanged and reply_bytes is back to 0
  swap        1 MiB WRITEs, three times over 2 MiB entries: each is
              received into fresh frames that then replace the entry's
              (writes_swapped), its 2 MiB entry split in two first
              (entry_splits, once); READ and the file after FLUSH match. A
              swap WRITE cut short changes nothing, while a READ and a
              FLUSH from other connections see the old bytes, and the
              FLUSH writes the old dirty bytes. One whose entry another
              connection's unsent READ reply pins is copied instead (not
              swapped) and lands all the same; one whose edges are off
              64 KiB splits nothing and is copied
  swap-stress 4 connections in regions of their own send WRITEs of 64 KiB
              to 1 MiB (swapped in over dirty blocks, entries split),
              READs and FLUSHes while a fifth asks for compaction passes
              and a small cache keeps writeback running: every READ
              matches a model, and the file does after SIGTERM
  segments    a 1 MiB WRITE into 256 clean one-block entries scattered in
              the arena, its payload after its header: received in more
              segments than one read takes, completes and reads back
  shutdown    SIGTERM while a payload is half sent: the client sends the
              rest, gets its reply (success), and the bytes are in the file
              once the daemon has exited 0
"""

import os
import random
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402
import bad_input as raw  # noqa: E402  (RawClient: requests cut anywhere)

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 80 * MIB
# mixed writes below this; swap uses what is above it.
MIXED_SPAN = 64 * MIB
SWAP_AT = MIXED_SPAN


def control_stats(d):
    return nbdtest.control_request(d.control, {"command": "stats"}, timeout=20)


def in_place(d):
    return control_stats(d)["cache"]["writes_in_place"]


def raw_open(d, extended=False):
    r = raw.RawClient(d.sock, timeout=20)
    r.open("disk", structured=True, extended=extended)
    return r


def write_header(r, offset, length):
    """The header of a WRITE, for sending with a payload cut short."""
    cookie, hdr = r.encode_request(raw.CMD_WRITE, offset, length)
    r.pending[cookie] = (raw.CMD_WRITE, offset, length)
    return cookie, hdr


def libnbd_read(d, offset, length):
    h = nbd.NBD()
    try:
        h.connect_uri(d.unix_uri("disk"))
        return h.pread(length, offset)
    finally:
        h.shutdown()


def libnbd_flush(d):
    h = nbd.NBD()
    try:
        h.connect_uri(d.unix_uri("disk"))
        h.flush()
    finally:
        h.shutdown()


def check_mixed(d, path, model):
    rnd = random.Random(15)
    before = in_place(d)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        pending = []
        bufs = []
        reads = []
        writes = 0
        for i in range(600):
            kind = rnd.random()
            if kind < 0.1:
                n = rnd.choice([512, 1000, 4096 + 512])
            elif kind < 0.6:
                n = rnd.choice([4 * KIB, 8 * KIB, 64 * KIB, 1 * MIB])
            else:
                n = rnd.choice([2 * MIB, 4 * MIB, 3 * MIB + 4 * KIB])
            align = 4 * KIB if kind >= 0.1 else 512
            # Half the writes go to the first 8 MiB: rewrites of dirty blocks.
            span = 8 * MIB if rnd.random() < 0.5 else MIXED_SPAN
            off = rnd.randrange(0, span - n + 1) // align * align
            if rnd.random() < 0.75:
                data = rnd.randbytes(n)
                model[off:off + n] = data
                bufs.append(nbd.Buffer.from_bytearray(bytearray(data)))
                pending.append(h.aio_pwrite(bufs[-1], off))
                writes += 1
            else:
                buf = nbd.Buffer(n)
                # A READ issued after the WRITEs before it completed sees them.
                for c in pending:
                    while not h.aio_command_completed(c):
                        h.poll(1)
                pending = []
                bufs = []
                h.aio_pread(buf, off)
                while h.aio_in_flight():
                    h.poll(1)
                got = buf.to_bytearray()
                reads.append(off)
                expect(bytes(got) == bytes(model[off:off + n]),
                       "READ [%d,+%d) after pipelined WRITEs differs from the model: %s"
                       % (off, n, nbdtest.describe_diff(bytes(got), bytes(model[off:off + n]),
                                                        off)))
            while h.aio_in_flight() >= 64:
                h.poll(1)
        while h.aio_in_flight():
            h.poll(1)
        for c in pending:
            expect(h.aio_command_completed(c), "a WRITE did not complete")
        h.flush()
    finally:
        h.shutdown()
    moved = in_place(d) - before
    log("  %d WRITEs, %d READs; %d received in place" % (writes, len(reads), moved))
    expect(0 < moved < writes, "writes_in_place moved by %d of %d WRITEs: both paths must be "
           "taken (in place over clean whole blocks, a buffer otherwise)" % (moved, writes))
    got = read_at(path, 0, SIZE)
    expect(got == bytes(model), "the file after FLUSH differs from the model: %s"
           % nbdtest.describe_diff(got, bytes(model)))


def truncated(d, path, model, offset, state):
    """Cut a 256 KiB WRITE at offset after half its payload; nothing changes."""
    n = 256 * KIB
    if state == "cached clean":
        libnbd_flush(d)
        libnbd_read(d, offset, n)
    elif state == "dirty":
        data = random.Random(offset).randbytes(n)
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        h.pwrite(data, offset)
        h.shutdown()
        model[offset:offset + n] = data
    r = raw_open(d)
    _, hdr = write_header(r, offset, n)
    r.send(hdr + b"\xee" * (n // 2))
    time.sleep(0.2)
    # Another connection reads the range while the payload is half in: it
    # must never see the half (it waits, or reads what was there).
    seen = []
    reader = threading.Thread(target=lambda: seen.append(libnbd_read(d, offset, n)))
    reader.start()
    time.sleep(0.2)
    r.close()
    reader.join(30)
    expect(seen and seen[0] == bytes(model[offset:offset + n]),
           "%s blocks read by another connection while a WRITE's payload was half in: %s" % (
               state, nbdtest.describe_diff(seen[0], bytes(model[offset:offset + n]), offset)
               if seen else "no reply within 30 s"))
    # The server notices the close; the request ends without touching data.
    deadline = time.time() + 10
    while time.time() < deadline:
        conns = nbdtest.control_request(d.control, {"command": "connections"})["connections"]
        if not any(c.get("transmitting") and c.get("inflight") for c in conns):
            break
        time.sleep(0.05)
    got = libnbd_read(d, offset, n)
    expect(got == bytes(model[offset:offset + n]),
           "%s blocks after a WRITE cut off half way: %s" % (
               state, nbdtest.describe_diff(got, bytes(model[offset:offset + n]), offset)))
    libnbd_flush(d)
    got = read_at(path, offset, n)
    expect(got == bytes(model[offset:offset + n]),
           "%s blocks: the file after FLUSH: %s" % (
               state, nbdtest.describe_diff(got, bytes(model[offset:offset + n]), offset)))


def check_truncated(d, path, model):
    before = control_stats(d)["cache"]
    truncated(d, path, model, 40 * MIB, "uncached")
    truncated(d, path, model, 44 * MIB, "cached clean")
    truncated(d, path, model, 48 * MIB, "dirty")
    after = control_stats(d)["cache"]
    expect(after["writes_in_place"] == before["writes_in_place"] + 1,
           "writes_in_place %d -> %d: only the dirty case's setup WRITE completes in place"
           % (before["writes_in_place"], after["writes_in_place"]))


def payload_copied(d):
    """The one transmitting connection's payload_copied."""
    conns = [c for c in nbdtest.control_request(d.control, {"command": "connections"},
                                                timeout=20)["connections"]
             if c["phase"] == "transmitting"]
    expect(len(conns) == 1, "%d transmitting connections, not 1" % len(conns))
    return conns[0]["payload_copied"]


def pipelined_writes(h, model, rnd, offsets, n):
    """WRITEs of n random bytes at each offset, 8 in flight; the model too."""
    bufs = []
    for off in offsets:
        data = rnd.randbytes(n)
        model[off:off + n] = data
        bufs.append(nbd.Buffer.from_bytearray(bytearray(data)))
        h.aio_pwrite(bufs[-1], off)
        while h.aio_in_flight() >= 8:
            h.poll(1)
    while h.aio_in_flight():
        h.poll(1)


def check_straight(d, path, model):
    offset, span, passes = 16 * MIB, 32 * MIB, 4
    rnd = random.Random(16)
    h = nbd.NBD()
    h.connect_uri(d.tcp_uri("disk"))
    try:
        for off in range(offset, offset + span, MIB):
            h.pread(MIB, off)
        before = payload_copied(d)
        pipelined_writes(h, model, rnd, list(range(offset, offset + span, MIB)) * passes, MIB)
        copied = payload_copied(d) - before
        got = h.pread(span, offset)
    finally:
        h.shutdown()
    total = passes * span
    log("  %d of %d payload bytes through the input buffer (%.2f%%)"
        % (copied, total, 100.0 * copied / total))
    expect(copied <= total // 32, "%d of %d WRITE payload bytes went through the input buffer "
           "(at most 1/32 may)" % (copied, total))
    expect(got == bytes(model[offset:offset + span]), "READ after the WRITEs: %s"
           % nbdtest.describe_diff(got, bytes(model[offset:offset + span]), offset))


def check_rewrite(d, path, model):
    offset = 56 * MIB
    r = raw_open(d)
    try:
        before = in_place(d)
        for i in range(16):
            data = bytes([i + 1]) * (4 * KIB)
            cookie = r.request(raw.CMD_WRITE, offset, len(data), 0, data)
            rep_ = r.read_reply(cookie)
            expect(rep_.error == 0, "rewrite %d failed with %s" % (i, raw.err_name(rep_.error)))
            model[offset:offset + len(data)] = data
        moved = in_place(d) - before
    finally:
        r.close()
    expect(moved == 16, "%d of 16 WRITEs over a dirty block, each sent whole, were received in "
           "place" % moved)
    got = libnbd_read(d, offset, 4 * KIB)
    expect(got == bytes(model[offset:offset + 4 * KIB]), "the dirty block after 16 rewrites: %s"
           % nbdtest.describe_diff(got, bytes(model[offset:offset + 4 * KIB]), offset))


def cache_counters(d):
    c = control_stats(d)["cache"]
    return c["writes_swapped"], c["arena"]["entry_splits"], c["writes_in_place"]


def swap_rewrites(d, path, model):
    """8 MiB read in 2 MiB READs, then written three times in 1 MiB WRITEs:
    each 2 MiB entry is split once, by the first WRITE into it (clean
    blocks), and every WRITE, over clean or dirty blocks, is swapped in."""
    offset, span = SWAP_AT, 8 * MIB
    rnd = random.Random(17)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        for off in range(offset, offset + span, 2 * MIB):
            h.pread(2 * MIB, off)
        offsets = list(range(offset, offset + span, MIB))
        swapped0, splits0, _ = cache_counters(d)
        for _ in range(3):
            pipelined_writes(h, model, rnd, offsets, MIB)
        swapped, splits, _ = cache_counters(d)
        got = h.pread(span, offset)
        h.flush()
    finally:
        h.shutdown()
    writes = 3 * len(offsets)
    log("  %d of %d WRITEs swapped in, %d entries split"
        % (swapped - swapped0, writes, splits - splits0))
    # Each 2 MiB entry splits once; a WRITE finding its entry pinned (the
    # writeback thread, say) is copied instead: at most a few.
    expect(splits - splits0 == span // (2 * MIB), "%d entry splits, not %d (one per 2 MiB "
           "entry)" % (splits - splits0, span // (2 * MIB)))
    expect(swapped - swapped0 >= writes * 7 // 8, "%d of %d 1 MiB WRITEs were swapped in"
           % (swapped - swapped0, writes))
    expect(got == bytes(model[offset:offset + span]), "READ after the rewrites: %s"
           % nbdtest.describe_diff(got, bytes(model[offset:offset + span]), offset))
    disk = read_at(path, offset, span)
    expect(disk == bytes(model[offset:offset + span]), "the file after FLUSH: %s"
           % nbdtest.describe_diff(disk, bytes(model[offset:offset + span]), offset))


def swap_cut_short(d, path, model):
    """A 1 MiB WRITE over dirty blocks, in the middle of a 2 MiB entry (split
    to fit it by the WRITE that dirtied them), cut off after 3/4 of its
    payload: nothing changes; a READ and a FLUSH from other connections
    meanwhile see (and write) the old bytes."""
    base, offset, n = SWAP_AT + 8 * MIB, SWAP_AT + 8 * MIB + 512 * KIB, MIB
    old = random.Random(18).randbytes(n)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        h.pread(2 * MIB, base)
        splits0 = cache_counters(d)[1]
        h.pwrite(old, offset) # clean blocks: the entry split to fit it
    finally:
        h.shutdown()
    model[offset:offset + n] = old
    swapped0, _, in_place0 = cache_counters(d)
    r = raw_open(d)
    _, hdr = write_header(r, offset, n)
    r.send(hdr + b"\xee" * (3 * n // 4))
    time.sleep(0.2)
    seen, flushed = [], []
    reader = threading.Thread(target=lambda: seen.append(libnbd_read(d, offset, n)))
    reader.start()

    def flush():
        libnbd_flush(d)
        flushed.append(time.time())
    flusher = threading.Thread(target=flush)
    flusher.start()
    time.sleep(0.3)
    closed_at = time.time()
    r.close()
    reader.join(30)
    flusher.join(30)
    want = bytes(model[offset:offset + n])
    expect(seen and seen[0] == want, "READ by another connection while a swap WRITE's payload "
           "was 3/4 in: %s" % (nbdtest.describe_diff(seen[0], want, offset) if seen
                               else "no reply within 30 s"))
    expect(bool(flushed), "a FLUSH from another connection did not complete within 30 s of "
           "the WRITE being cut short")
    swapped, splits, in_place_ = cache_counters(d)
    # The 2 MiB entry is split twice at each edge: four of 512 KiB.
    expect(splits - splits0 == 3, "%d entry splits for a 1 MiB WRITE in the middle of a 2 MiB "
           "entry, not 3 (2 MiB -> 1+1 -> 512 KiB pieces at both edges)" % (splits - splits0))
    expect(swapped == swapped0 and in_place_ == in_place0,
           "a WRITE cut short counted as received (writes_swapped %d -> %d, writes_in_place "
           "%d -> %d)" % (swapped0, swapped, in_place0, in_place_))
    got = libnbd_read(d, offset, n)
    expect(got == want, "after a swap WRITE cut short: %s"
           % nbdtest.describe_diff(got, want, offset))
    disk = read_at(path, offset, n)
    expect(disk == want, "the file after the FLUSH beside the cut-short WRITE: %s"
           % nbdtest.describe_diff(disk, want, offset))
    log("  the FLUSH completed %.2f s after the WRITE was cut short"
        % (flushed[0] - closed_at))


def swap_pinned(d, path, model):
    """Another connection's READ reply, unsent (its client reads nothing),
    pins the entry: the WRITE over it is copied into place, not swapped."""
    offset, n = SWAP_AT, MIB
    dirty = random.Random(20).randbytes(n)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        h.pwrite(dirty, offset) # flushed before: clean, in place; dirty after
    finally:
        h.shutdown()
    model[offset:offset + n] = dirty
    b = raw_open(d)
    try:
        cookie = b.request(raw.CMD_READ, offset, n)
        deadline = time.time() + 10
        while (control_stats(d)["clients"]["pinned_reply_bytes"] == 0
               and time.time() < deadline):
            time.sleep(0.02)
        expect(control_stats(d)["clients"]["pinned_reply_bytes"] > 0,
               "a READ reply its client does not read pins nothing")
        swapped0, _, in_place0 = cache_counters(d)
        data = random.Random(19).randbytes(n)
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        try:
            h.pwrite(data, offset)
            model[offset:offset + n] = data
            got = h.pread(n, offset)
        finally:
            h.shutdown()
        swapped, _, in_place_ = cache_counters(d)
        expect(swapped == swapped0 and in_place_ == in_place0 + 1,
               "a WRITE over a pinned entry: writes_swapped %d -> %d (must stay), "
               "writes_in_place %d -> %d (must grow by 1)"
               % (swapped0, swapped, in_place0, in_place_))
        expect(got == data, "READ after a WRITE over an entry a READ reply pins: %s"
               % nbdtest.describe_diff(got, data, offset))
        rep_ = b.read_reply(cookie)
        expect(rep_.error == 0, "the pinned READ failed with %s" % raw.err_name(rep_.error))
    finally:
        b.close()
    libnbd_flush(d)
    disk = read_at(path, offset, n)
    expect(disk == bytes(model[offset:offset + n]), "the file after FLUSH: %s"
           % nbdtest.describe_diff(disk, bytes(model[offset:offset + n]), offset))


def swap_unaligned(d, path, model):
    """A 512 KiB WRITE over dirty blocks 4 KiB past a 64 KiB boundary: its
    entry is not split (its edge pieces would be too small to swap), it is
    copied, and it lands."""
    offset, n = SWAP_AT + 2 * MIB, MIB
    rnd = random.Random(21)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        dirty = rnd.randbytes(n)
        h.pwrite(dirty, offset)
        model[offset:offset + n] = dirty
        swapped0, splits0, _ = cache_counters(d)
        at, data = offset + 4 * KIB, rnd.randbytes(512 * KIB)
        h.pwrite(data, at)
        model[at:at + len(data)] = data
        swapped, splits, _ = cache_counters(d)
        got = h.pread(n, offset)
    finally:
        h.shutdown()
    expect(splits == splits0 and swapped == swapped0,
           "a WRITE over dirty blocks with edges off 64 KiB: entry_splits %d -> %d, "
           "writes_swapped %d -> %d (both must stay)" % (splits0, splits, swapped0, swapped))
    expect(got == bytes(model[offset:offset + n]), "READ after it: %s"
           % nbdtest.describe_diff(got, bytes(model[offset:offset + n]), offset))


def check_swap(d, path, model):
    swap_rewrites(d, path, model)
    swap_cut_short(d, path, model)
    swap_pinned(d, path, model)
    swap_unaligned(d, path, model)


def check_dribble(d, path, model):
    offset, n = 52 * MIB, 1 * MIB
    data = random.Random(52).randbytes(n)
    before = in_place(d)
    r = raw_open(d, extended=True)
    cookie, hdr = write_header(r, offset, n)
    stop = threading.Event()
    reads = [0]
    spans = []          # (began, ended) of each READ of the other connection
    errors = []

    def reader():
        try:
            h = nbd.NBD()
            h.connect_uri(d.unix_uri("disk"))
            while not stop.is_set() and reads[0] < 100000:
                began = time.monotonic()
                got = h.pread(64 * KIB, 0)
                spans.append((began, time.monotonic()))
                if got != bytes(model[:64 * KIB]):
                    errors.append("the other connection read wrong bytes")
                    break
                reads[0] += 1
            h.shutdown()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append("the other connection failed: %s" % e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        header_sent = time.monotonic()
        r.send(hdr)
        piece = n // 64
        for i in range(64):
            if i == 63:
                last_sent = time.monotonic()
            r.send(data[i * piece:(i + 1) * piece])
            time.sleep(0.02)
        rep = r.read_reply(cookie)
    finally:
        stop.set()
        t.join(30)
    expect(rep.error == 0, "dribbled WRITE failed with %s" % raw.err_name(rep.error))
    expect(not errors, "; ".join(errors))
    # The order, not a rate: READs of the other connection that began
    # after the WRITE's header and were answered before its last piece
    # went. A daemon that holds others up while a payload arrives answers
    # none there (a READ in flight then ends only after the WRITE does).
    beside = sum(1 for a, b in spans if a > header_sent and b < last_sent)
    log("  other connection: %d READs answered while the payload was arriving (%.2f s)"
        % (beside, last_sent - header_sent))
    expect(beside >= 3, "the other connection got %d READs answered between the WRITE's "
           "header and its last piece (%.2f s apart): held up by the payload"
           % (beside, last_sent - header_sent))
    model[offset:offset + n] = data
    r.close()
    expect(in_place(d) == before + 1, "the dribbled WRITE was not received in place")
    got = libnbd_read(d, offset, n)
    expect(got == data, "dribbled WRITE reads back wrong: %s"
           % nbdtest.describe_diff(got, data, offset))
    log("  other connection: %d reads meanwhile" % reads[0])


def check_stall(tmp):
    path = os.path.join(tmp, "stall.img")
    nbdtest.random_file(path, 8 * MIB, seed=3)
    old = read_at(path, 0, 8 * MIB)
    with nbdtest.Daemon([("disk", path, "")], extra=["--stall-timeout", "2"]) as d:
        libnbd_read(d, 1 * MIB, 1 * MIB)  # cached clean: the in-place path
        r = raw_open(d)
        _, hdr = write_header(r, 1 * MIB, 1 * MIB)
        r.send(hdr + b"\x55" * (300 * KIB))
        t0 = time.time()
        expect(nbdtest.wait_until(lambda: control_stats(d)["clients"]["reply_bytes"] > 0, 30),
               "reply_bytes 0 while a WRITE's payload is arriving")
        r.s.settimeout(20)      # 10 x the deadline
        try:
            got = r.s.recv(4096)
            why = "closed" if got == b"" else "sent %r" % got[:32]
        except ConnectionResetError:
            why = "reset"
        except socket.timeout:
            why = None
        waited = time.time() - t0
        expect(why is not None, "no reset within 20 s of a stalled payload (--stall-timeout 2)")
        # (Over a Unix socket the reset reads as an end of file.)
        expect(why in ("reset", "closed"), "a stalled payload's connection %s" % why)
        # No sooner than the deadline (a busy machine only delays it), and
        # that deadline, in the daemon's words (conn.c).
        expect(waited >= 1.5, "reset after %.1f s, before the 2 s deadline" % waited)
        expect(nbdtest.wait_until(lambda: "client sent a request's payload too slowly "
                                  "(under 1 MiB/s after 2 s, or nothing for 2 s)" in d.log_text(),
                                  10),
               "the stalled payload's connection did not end with the payload deadline's "
               "reason (--stall-timeout 2) in the log")
        r.close()
        expect(nbdtest.wait_until(lambda: control_stats(d)["clients"]["reply_bytes"] == 0, 30),
               "reply_bytes stays %d after the reset" % control_stats(d)["clients"]["reply_bytes"])
        got = libnbd_read(d, 0, 8 * MIB)
        expect(got == old, "blocks changed by a stalled WRITE: %s" % nbdtest.describe_diff(got, old))
        log("  reset after %.1f s; reply_bytes back to 0; data unchanged" % waited)


def check_swap_stress(tmp):
    """4 connections, each in a 4 MiB region of its own read in 2 MiB
    READs, send WRITEs of 64 KiB to 1 MiB at 64 KiB multiples (swapped in
    over dirty blocks, entries split) and READs, FLUSHes now and then, while
    a fifth asks for compaction passes; a 64 MiB cache with --dirty-high 10
    keeps writeback running under them. Every READ matches the region's
    model, and so does the file after SIGTERM."""
    path = os.path.join(tmp, "stress.img")
    region, workers, ops = 4 * MIB, 4, 150
    nbdtest.random_file(path, region * workers, seed=5)
    model = bytearray(read_at(path, 0, region * workers))
    errors = []
    with nbdtest.Daemon([("disk", path, "")], extra=["--cache-size", "64M", "--dirty-high",
                                                      "10", "--dirty-low", "5"]) as d:
        stop = threading.Event()

        def worker(k):
            rnd = random.Random(100 + k)
            base = k * region
            h = nbd.NBD()
            try:
                h.connect_uri(d.unix_uri("disk"))
                for off in range(base, base + region, 2 * MIB):
                    h.pread(2 * MIB, off)
                for i in range(ops):
                    n = rnd.randint(1, 16) * 64 * KIB
                    off = base + rnd.randrange(0, (region - n) // (64 * KIB) + 1) * 64 * KIB
                    x = rnd.random()
                    if x < 0.6:
                        data = rnd.randbytes(n)
                        h.pwrite(data, off)
                        model[off:off + n] = data
                    elif x < 0.95:
                        got = h.pread(n, off)
                        if got != bytes(model[off:off + n]):
                            errors.append("connection %d op %d: READ [%d,+%d): %s" % (
                                k, i, off, n, nbdtest.describe_diff(
                                    got, bytes(model[off:off + n]), off)))
                            return
                    else:
                        h.flush()
            except nbd.Error as e:
                errors.append("connection %d: %s" % (k, e))
            finally:
                h.shutdown()

        def compactor():
            while not stop.is_set():
                nbdtest.control_request(d.control, {"command": "compact"}, timeout=20)
                time.sleep(0.02)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
        c = threading.Thread(target=compactor)
        c.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        c.join(30)
        expect(not any(t.is_alive() for t in threads), "a connection still running after 120 s")
        expect(not errors, "; ".join(errors[:3]))
        st = control_stats(d)["cache"]
        log("  %d WRITEs swapped in, %d entry splits, %d written back, %d collapses"
            % (st["writes_swapped"], st["arena"]["entry_splits"], st["backend_writes"],
               st["arena"]["compact_collapses"]))
        expect(st["writes_swapped"] > 0 and st["backend_writes"] > 0,
               "the stress did not exercise what it is for: writes_swapped %d, backend_writes %d"
               % (st["writes_swapped"], st["backend_writes"]))
    # Daemon exit: SIGTERM, exit 0, everything written back.
    got = read_at(path, 0, region * workers)
    expect(got == bytes(model), "the file after SIGTERM: %s"
           % nbdtest.describe_diff(got, bytes(model)))


def check_shutdown(tmp):
    path = os.path.join(tmp, "shutdown.img")
    nbdtest.sparse_file(path, 8 * MIB)
    data = random.Random(9).randbytes(2 * MIB)
    d = nbdtest.Daemon([("disk", path, "")])
    try:
        r = raw_open(d)
        cookie, hdr = write_header(r, 2 * MIB, len(data))
        r.send(hdr + data[:MIB])
        time.sleep(0.2)
        d.proc.send_signal(15)
        time.sleep(0.3)
        r.send(data[MIB:])
        rep = r.read_reply(cookie)
        expect(rep.error == 0, "WRITE half sent at SIGTERM: %s" % raw.err_name(rep.error))
        r.close()
        d.stop()
    finally:
        d.discard()
    got = read_at(path, 2 * MIB, len(data))
    expect(got == data, "after shutdown the file lacks the WRITE: %s"
           % nbdtest.describe_diff(got, data, 2 * MIB))


def check_segments(tmp):
    """A 1 MiB WRITE over 256 clean one-block entries cached in random
    order (scattered in the arena: no two adjacent), its payload sent after
    its header: received into the arena in 256 segments, more than one
    read of the socket takes (CONN_SINK_IOV). On main the bytes of the
    first read past the segments it had went to the input buffer, and the
    sink then waited for them: the WRITE never completed (cut off by the
    stall deadline, --stall-timeout 3 here)."""
    path = os.path.join(tmp, "segments.img")
    nbdtest.random_file(path, 8 * MIB, seed=23)
    data = random.Random(23).randbytes(MIB)
    with nbdtest.Daemon([("disk", path, "")], extra=["--cache-size", "64M",
                                                     "--stall-timeout", "3"]) as d:
        blocks = list(range(MIB // 4096, 2 * MIB // 4096))
        random.Random(24).shuffle(blocks)
        h = nbd.NBD()
        h.connect_uri(d.unix_uri("disk"))
        try:
            for b in blocks:
                h.pread(4096, b * 4096)
        finally:
            h.shutdown()
        before = in_place(d)
        # Over TCP, with room for all of it: one read can take more than
        # the segments it is given.
        r = raw.RawClient(port=d.port, timeout=20)
        r.s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        r.open("disk", structured=True)
        cookie, hdr = write_header(r, MIB, MIB)
        r.send(hdr)
        time.sleep(0.2)
        r.send(data)
        r.s.settimeout(10)
        try:
            rep = r.read_reply(cookie)
        except (raw.Closed, raw.Mismatch) as e:
            raise Failed("a WRITE received in 256 segments got no reply: %s" % e)
        finally:
            r.close()
        expect(rep.error == 0, "the WRITE failed: %s" % raw.err_name(rep.error))
        expect(in_place(d) == before + 1, "the WRITE was not received into the arena")
        got = libnbd_read(d, MIB, MIB)
        expect(got == data, "READ after it: %s" % nbdtest.describe_diff(got, data, MIB))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        path = os.path.join(tmp, "disk.img")
        nbdtest.random_file(path, SIZE, seed=11)
        model = bytearray(read_at(path, 0, SIZE))
        d = nbdtest.Daemon([("disk", path, "")], extra=["--cache-size", "256M"])
        try:
            checks.run("straight", check_straight, d, path, model)
            checks.run("mixed", check_mixed, d, path, model)
            checks.run("truncated", check_truncated, d, path, model)
            checks.run("rewrite", check_rewrite, d, path, model)
            checks.run("dribble", check_dribble, d, path, model)
            checks.run("swap", check_swap, d, path, model)
            d.stop()
        except Failed:
            d.dump_log()
            raise
        finally:
            d.discard()
        checks.run("stall", check_stall, tmp)
        checks.run("swap-stress", check_swap_stress, tmp)
        checks.run("shutdown", check_shutdown, tmp)
        checks.run("segments", check_segments, tmp)
    checks.finish("write_receive")


if __name__ == "__main__":
    main()
