#!/usr/bin/python3
"""resize_nbd: online resize of exports whose backend is another NBD server.

An NBD server tells its size once per connection, in the handshake. A
resize asks the server on a connection of its own; when it grew, the
backend's connections are renewed (each takes no new command, is closed
once its commands are answered and connects again, seeing the new size),
so requests past the old end go out on connections that know it.

One daemon in writeback mode (written data stays dirty until a FLUSH):
  u   nbd+unix:// to an nbdkit file plugin on a 32 MiB file, reads
      delayed 10 ms (multi-conn: several backend connections, all renewed)
  p   nbdkit:file on a 32 MiB file (a process per connection)
  m   nbdkit:memory 16M, allow-resize (a server that cannot grow)

  grow_under_load  u: a writer keeps random writes and reads checked
            against a byte model going on an old connection, and four
            readers beside it, each on an old connection of its own, more
            reads (misses through the delay, so backend commands are in
            flight; bounded counts), while the file is
            extended to 64 MiB and `nbdcachectl resize u` runs: a new
            connection sees 64 MiB at once and writes and reads the new
            part at once (its requests wait for a renewed backend
            connection, never fail); the old connection keeps 32 MiB and
            none of its requests fails; the daemon's log shows a backend
            connection renewed once its commands were answered; after
            FLUSH the file is the model
  reload    p: the file extended to 48 MiB; "reload" lists p as resized, a
            new connection sees 48 MiB and writes past the old end; after
            FLUSH the file holds it
  explicit  m: NBD_FLAG_SEND_RESIZE advertised (allow-resize, a server
            that can report its size); `resize m 32M` is refused (the
            server has 16 MiB: no space), nothing changed; `resize m 8M`
            is accepted (the export ends earlier, the server keeps 16 MiB)
            and kept across a reload; `resize m` follows the server again
            (16 MiB) with the bytes
            below 8 MiB kept; NBD_CMD_RESIZE past the server's size gets
            ENOSPC
  server_gone  u: its nbdkit killed: `resize u` fails saying it cannot
            ask the server, the size is unchanged; nbdkit started again,
            a WRITE and FLUSH reach the file (the backend reconnected)
"""

import os
import random
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
CMD_RESIZE = 8                  # the resize extension's command
FLAG_SEND_RESIZE = 1 << 9       # ... and its transmission flag
ENOSPC = 28
CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed, nbd.Error))
expect = CHECKS.expect








def grow_under_load(d, img):
    rng = random.Random(5)
    model = bytearray(open(img, "rb").read())
    h1 = nbdtest.libnbd_handle(d.unix_uri("u"))
    started = threading.Event()
    stop = threading.Event()
    errors = []
    count = [0]
    wrng = random.Random(6)

    def writer():
        try:
            for i in range(4000):
                if stop.is_set() and i >= 600:
                    break
                off = wrng.randrange(32 * MIB // 4096) * 4096
                n = min(wrng.choice((4096, 65536, 262144)), 32 * MIB - off)
                data = wrng.randbytes(n)
                h1.pwrite(data, off)
                model[off:off + n] = data
                # A READ too: misses keep the backend's connections busy,
                # so some are renewed with commands in flight.
                roff = wrng.randrange(32 * MIB // 4096) * 4096
                rn = min(131072, 32 * MIB - roff)
                if h1.pread(rn, roff) != model[roff:roff + rn]:
                    raise nbdtest.Failed("READ of %d bytes at %d: not the model" % (rn, roff))
                count[0] += 1
                if i == 50:
                    started.set()
                if i % 200 == 199:
                    h1.flush()      # unstable data, too, across the renewal
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            started.set()

    def reader(seed, h):
        # Misses through the delay filter beside the writer, each reader on
        # an old connection of its own (libnbd runs one handle's synchronous
        # calls one at a time): backend commands in flight at the renewal.
        # (Racing the writer: not compared; the writer's own reads are.)
        # Eight at a time (asynchronous), so that on a busy machine, too,
        # commands are in flight whenever the renewal comes.
        rrng = random.Random(seed)
        bufs = []
        try:
            for i in range(2000):
                if stop.is_set():
                    break
                while h.aio_in_flight() >= 8:
                    h.poll(-1)
                off = rrng.randrange(32 * MIB // 4096) * 4096
                buf = nbd.Buffer(4096)
                bufs.append(buf)
                h.aio_pread(buf, off)
                if len(bufs) > 64:
                    del bufs[:32]   # (completed long since: at most 8 in flight)
            while h.aio_in_flight() > 0:
                h.poll(-1)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    rhandles = [nbdtest.libnbd_handle(d.unix_uri("u")) for _ in range(4)]
    readers = [threading.Thread(target=reader, args=(12 + i, rh))
               for i, rh in enumerate(rhandles)]
    for rt in readers:
        rt.start()
    started.wait(60)
    os.truncate(img, 64 * MIB)
    p = nbdtest.nbdcachectl(d, "resize", "u")
    expect(p.returncode == 0 and "33554432 -> 67108864" in p.stdout,
           "nbdcachectl resize u: %r %r" % (p.stdout, p.stderr))
    # At once: the new part, through a new connection.
    h2 = nbdtest.libnbd_handle(d.unix_uri("u"))
    expect(h2.get_size() == 64 * MIB, "new connection: size %d" % h2.get_size())
    expect(h1.get_size() == 32 * MIB, "old connection: size %d" % h1.get_size())
    model.extend(bytes(32 * MIB))
    expect(h2.pread(MIB, 60 * MIB) == bytes(MIB), "the grown part does not read as zeros")
    for _ in range(64):
        off = 32 * MIB + rng.randrange(32 * MIB // 4096) * 4096
        n = min(65536, 64 * MIB - off)
        data = rng.randbytes(n)
        h2.pwrite(data, off, flags=nbd.CMD_FLAG_FUA if rng.random() < 0.25 else 0)
        model[off:off + n] = data
    stop.set()
    t.join(120)
    for rt in readers:
        rt.join(120)
    expect(not t.is_alive() and not any(rt.is_alive() for rt in readers),
           "the writer or a reader did not finish")
    expect("renewed, its commands answered" in d.log_text(),
           "no backend connection was renewed with commands in flight (the daemon's log)")
    expect(not errors, "the writer's I/O failed across the resize: %r" % errors)
    log("  %d writes on the old connection across the resize" % count[0])
    nbdtest.require_same(nbdtest.read_whole(h2, 64 * MIB), bytes(model), "u through the new connection")
    nbdtest.require_same(nbdtest.read_whole(h1, 32 * MIB), bytes(model[:32 * MIB]),
                         "u through the old connection")
    h1.flush()
    h2.flush()
    with open(img, "rb") as f:
        disk = f.read()
    expect(len(disk) == 64 * MIB, "u.img is %d bytes" % len(disk))
    nbdtest.require_same(disk, bytes(model), "u.img after FLUSH")
    h1.shutdown()
    h2.shutdown()
    for rh in rhandles:
        rh.shutdown()


def reload(d, img):
    h = nbdtest.libnbd_handle(d.unix_uri("p"))
    data = random.Random(7).randbytes(MIB)
    h.pwrite(data, 31 * MIB)        # dirty, below the old end
    os.truncate(img, 48 * MIB)
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and rep.get("resized") == ["p"], "reload reply: %r" % rep)
    h2 = nbdtest.libnbd_handle(d.unix_uri("p"))
    expect(h2.get_size() == 48 * MIB, "p after the reload: %d" % h2.get_size())
    tail = random.Random(8).randbytes(2 * MIB)
    h2.pwrite(tail, 46 * MIB)
    expect(h2.pread(2 * MIB, 46 * MIB) == tail, "p: the new part reads back wrong")
    h2.flush()
    with open(img, "rb") as f:
        f.seek(31 * MIB)
        expect(f.read(MIB) == data, "p.img: the write below the old end is not there")
        f.seek(46 * MIB)
        expect(f.read(2 * MIB) == tail, "p.img: the write past the old end is not there")
    h.shutdown()
    h2.shutdown()


def explicit(d):
    r = raw.RawClient(d.sock)
    r.open("m")
    expect(r.eflags & FLAG_SEND_RESIZE and r.size == 16 * MIB,
           "m: flags %#x size %d (wanted NBD_FLAG_SEND_RESIZE, 16 MiB)" % (r.eflags, r.size))
    c = r.request(CMD_RESIZE, 32 * MIB, 0)
    rep = r.read_reply(c)
    expect(rep.error == ENOSPC, "NBD_CMD_RESIZE past the server's size: error %d" % rep.error)
    r.close()
    h = nbdtest.libnbd_handle(d.unix_uri("m"))
    low = random.Random(9).randbytes(MIB)
    h.pwrite(low, 7 * MIB)
    h.flush()
    h.shutdown()
    p = nbdtest.nbdcachectl(d, "resize", "m", "32M")
    expect(p.returncode == 1 and "cannot grow to 33554432 bytes: it has 16777216" in p.stderr,
           "resize m 32M: %r" % p.stderr)
    expect(nbdtest.export_size(d, "m") == 16 * MIB, "m changed by a refused grow")
    p = nbdtest.nbdcachectl(d, "resize", "m", "8M")
    expect(p.returncode == 0, "resize m 8M: %r" % p.stderr)
    expect(nbdtest.export_size(d, "m") == 8 * MIB, "m after resize 8M: %d" % nbdtest.export_size(d, "m"))
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and not rep.get("resized"), "reload: %r" % rep)
    expect(nbdtest.export_size(d, "m") == 8 * MIB, "m after a reload: %d (the explicit 8M is kept)"
           % nbdtest.export_size(d, "m"))
    p = nbdtest.nbdcachectl(d, "resize", "m")
    expect(p.returncode == 0 and "8388608 -> 16777216" in p.stdout,
           "resize m (the server's size): %r %r" % (p.stdout, p.stderr))
    h = nbdtest.libnbd_handle(d.unix_uri("m"))
    expect(h.get_size() == 16 * MIB, "m after resize: %d" % h.get_size())
    expect(h.pread(MIB, 7 * MIB) == low, "m: the bytes below 8 MiB changed")
    h.shutdown()


def server_gone(d, server):
    before = nbdtest.export_size(d, "u")
    server.kill()                   # SIGKILL, by PID
    p = nbdtest.nbdcachectl(d, "resize", "u")
    expect(p.returncode == 1 and "cannot read its size" in p.stderr,
           "resize u without its server: %r" % p.stderr)
    expect(nbdtest.export_size(d, "u") == before, "u changed while its server was gone")
    server.start()
    h = nbdtest.libnbd_handle(d.unix_uri("u"))
    data = random.Random(10).randbytes(4096)
    h.pwrite(data, before - 4096)
    h.flush()                       # the backend must answer (after its reconnect)
    with open(server_img(server), "rb") as f:
        f.seek(before - 4096)
        expect(f.read(4096) == data, "u.img: the write after the server came back")
    h.shutdown()


def server_img(server):
    return server.args[2]


def main():
    with nbdtest.tempdir() as tmp:
        u_img = os.path.join(tmp, "u.img")
        p_img = os.path.join(tmp, "p.img")
        nbdtest.random_file(u_img, 32 * MIB, seed=1)
        nbdtest.random_file(p_img, 32 * MIB, seed=2)
        servers = []
        try:
            server = nbdtest.Nbdkit(tmp, "u", ["--filter=delay", "file", u_img, "rdelay=10ms"],
                                    peers=servers)
            exports = [("u", server.uri(), ""), ("p", "nbdkit:file " + p_img, ""),
                       ("m", "nbdkit:memory 16M", "allow-resize")]
            extra = ["--cache-size", "256M", "--cache-mode", "writeback",
                     "--dirty-expire", "3600", "--dirty-high", "90", "--dirty-low", "80",
                     "--backend-timeout", "20", "--log-level", "debug"]
            with nbdtest.running_daemon(exports, extra=extra) as d:
                CHECKS.run("grow_under_load", grow_under_load, d, u_img)
                CHECKS.run("reload", reload, d, p_img)
                CHECKS.run("explicit", explicit, d)
                CHECKS.run("server_gone", server_gone, d, server)
                CHECKS.dump_log(d)
        finally:
            for s in servers:
                s.stop()
    CHECKS.finish("resize_nbd")


if __name__ == "__main__":
    main()
