#!/usr/bin/python3
"""reply_writes: replies reach the client whether the socket takes them at
once or backs up.

A plaintext connection writes its replies itself, once per round of events,
in one writev; only what the socket does not take then is left to the
bufferevent, which writes it when the socket drains, and the connection
goes back to writing itself once all of it is gone. These checks go back
and forth between the two, over Unix and TCP:

  backlog   a raw client pipelines 12 READs of 4 MiB (48 MiB: far more than
            the socket buffers hold) and up to 16 WRITEs of 4 KiB elsewhere,
            then reads nothing for 1 s; it then reads every reply, and each
            matches a byte model, and so do READs of the written blocks
  after     then 200 READs of 4 KiB one at a time, each answered (a reply
            left unwritten would show as a 10 s timeout), at random offsets,
            matching the model; the whole cycle three times per transport
  mixed     libnbd, 64 in flight, 2,000 random READs and WRITEs of 4 KiB to
            1 MiB, then every byte read back and compared
"""

import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
from nbdtest import require as expect  # noqa: E402
import bad_input as raw  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 128 * MIB


def backlog_cycle(r, model, rng, cycle):
    pending = []
    for _ in range(12):
        off = rng.randrange(0, SIZE // 2 // MIB - 4) * MIB  # the lower half
        pending.append((r.request(raw.CMD_READ, off, 4 * MIB), off, 4 * MIB))
    written = []
    for _ in range(16):
        # The upper half, not read meanwhile (a READ concurrent with a WRITE
        # may see either), each block once.
        off = rng.randrange(SIZE // 2 // (4 * KIB), SIZE // (4 * KIB)) * 4 * KIB
        if off in written:
            continue
        data = os.urandom(4 * KIB)
        model[off:off + len(data)] = data
        written.append(off)
        pending.append((r.request(raw.CMD_WRITE, off, len(data), payload=data), None, 0))
    time.sleep(1)
    t0 = time.monotonic()
    for cookie, off, length in pending:
        rep = r.read_reply(cookie)
        expect(rep.error == 0, "cycle %d: request 0x%x failed with error %d"
               % (cycle, cookie, rep.error))
        if off is not None:
            expect(rep.data == bytes(model[off:off + length]),
                   "cycle %d: READ at %d (%d bytes) after the backlog: wrong bytes"
                   % (cycle, off, length))
    log("   cycle %d: %d backed-up replies read in %.2f s"
        % (cycle, len(pending), time.monotonic() - t0))
    for off in written:
        rep = r.command(raw.CMD_READ, off, 4 * KIB)
        expect(rep.error == 0 and rep.data == bytes(model[off:off + 4 * KIB]),
               "cycle %d: READ of a block written during the backlog: error %d or wrong bytes"
               % (cycle, rep.error))
    t0 = time.monotonic()
    for _ in range(200):
        off = rng.randrange(0, SIZE // (4 * KIB)) * 4 * KIB
        rep = r.command(raw.CMD_READ, off, 4 * KIB)
        expect(rep.error == 0 and rep.data == bytes(model[off:off + 4 * KIB]),
               "cycle %d: a READ one at a time after the backlog: error %d or wrong bytes"
               % (cycle, rep.error))
    log("   cycle %d: then 200 READs one at a time in %.2f s" % (cycle, time.monotonic() - t0))


def backlog(d, path, model, transport):
    rng = random.Random(7)
    r = raw.RawClient(d.sock if transport == "unix" else None,
                      port=d.port if transport == "tcp" else None, timeout=10)
    try:
        r.open("disk")
        for cycle in range(3):
            backlog_cycle(r, model, rng, cycle)
        r.disconnect()
    finally:
        r.close()


def mixed(d, model):
    rng = random.Random(11)
    h = nbd.NBD()
    h.connect_uri(d.unix_uri("disk"))
    try:
        bufs = []
        for i in range(2000):
            length = rng.choice([4 * KIB, 64 * KIB, 1 * MIB])
            off = rng.randrange(0, (SIZE - length) // (4 * KIB)) * 4 * KIB
            while h.aio_in_flight() >= 64:
                h.poll(-1)
            if rng.random() < 0.5:
                data = os.urandom(length)
                model[off:off + length] = data
                h.aio_pwrite(data, off)
            else:
                buf = nbd.Buffer(length)
                bufs.append(buf)
                h.aio_pread(buf, off)
        while h.aio_in_flight() > 0:
            h.poll(-1)
        for off in range(0, SIZE, 8 * MIB):
            expect(h.pread(8 * MIB, off) == bytes(model[off:off + 8 * MIB]),
                   "after the mixed run: wrong bytes in [%d, +8 MiB)" % off)
        h.shutdown()
    finally:
        del h


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        path = os.path.join(tmp, "disk.img")
        nbdtest.random_file(path, SIZE, seed=5)
        model = bytearray(nbdtest.read_at(path, 0, SIZE))
        with nbdtest.Daemon([("disk", path, "")], extra=["--cache-size", "256M"]) as d:
            for transport in ("unix", "tcp"):
                checks.run("backlog and after, " + transport, backlog, d, path, model, transport)
            checks.run("mixed", mixed, d, model)
    checks.finish("reply_writes")


if __name__ == "__main__":
    main()
