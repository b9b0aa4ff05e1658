#!/usr/bin/python3
"""resize: online resize of an export (nbdcachectl resize, reload,
NBD_CMD_RESIZE of the resize extension).

One daemon in writeback mode with --dirty-expire 3600 and --dirty-high 90
(written data stays dirty until a FLUSH), exports:
  a    64 MiB file, the whole of it
  s    32 MiB file, split=16M
  d    64 MiB file (the shrink test)
  r    64 MiB file, allow-resize
  n    64 MiB file, no allow-resize
  ro   64 MiB file, allow-resize but read-only
  g    16 MiB file (reload)
  wf   32 MiB file, the whole of it, and
  w    a window made by hand over it: offset=0,size=16M
  z    32 MiB file (the race test)
  k    nbdkit memory 16M, allow-resize (an NBD backend)

  grow      a writer thread keeps random writes going on a connection to a
            (a byte model, a bounded count) while the file is extended with
            os.truncate and `nbdcachectl resize a` runs: a new connection sees
            96 MiB at once, the old one keeps 64 MiB and its writes go on
            (a raw connection made before a second grow has its READ past
            its own size refused EINVAL); the new connection writes
            the new part; the model holds over both connections, and in the
            file after FLUSH
  split     s grows 32 -> 64 MiB: NBD_OPT_LIST shows s/2 and s/3 (16 MiB
            each); then back to 16 MiB: only s/0 is listed, and a
            connection that still has s/1 gets ENOSPC for its bytes
  shrink    dirty data past the new end: `nbdcachectl resize d 32M` fails
            naming the dirty bytes (1 MiB); after FLUSH it succeeds, the
            file is 32 MiB; the old connection's READ past the new end gets
            ENOSPC (what the extension asks between the new and the old end),
            below it the model
  raw       a raw client sees NBD_FLAG_SEND_RESIZE on r only (not on n, not on
            read-only ro); NBD_CMD_RESIZE to 96 MiB is answered OK, a new
            connection sees it, the file is that long; again with extended
            headers to 128 MiB; the client that grew r writes and reads past
            the old end at once; a shrink while another connection uses r is
            EPERM, by its only connection EPERM over dirty data, OK after
            FLUSH (then its READ past the new end: ENOSPC); with a length or
            an unaligned size EINVAL; on n the command is EINVAL (not
            advertised)
  reload    g.img extended to 48 MiB, then "reload": the reply lists g as
            resized and a new connection sees 48 MiB
  race      random 4 KiB reads and writes around the cut on an old
            connection while z (32 MiB) is flushed, cut to 16 MiB (or
            refused EBUSY) and grown back, 60 times: every answer is success
            or ENOSPC, the bytes below the cut stay, the daemon lives
  race_writes  four connections write 4 KiB blocks sparsely just above
            16 MiB while z is flushed, cut to 16 MiB (or refused) and grown
            back, 150 times: every answer is success or ENOSPC, every grow
            back succeeds (no dirty byte was left past a cut end)
  bad       resize nosuch 1M, resize a 1000 (not a multiple of the block
            size), resize a xyz, resize s/1, a fixed window w (offset=,
            size=), a shrink of wf that would cut the window w, and k
            grown past what its NBD server has (resize_nbd.py does NBD
            backends at length): each refused with its reason, nothing
            changed; k (allow-resize) advertises NBD_FLAG_SEND_RESIZE
  config_key  allow-resize = true in a config file advertises the flag,
            false does not (a daemon of its own)
"""

import os
import random
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
CMD_RESIZE = 8                  # the resize extension's command
FLAG_SEND_RESIZE = 1 << 9       # ... and its transmission flag
CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed, nbd.Error))
expect = CHECKS.expect




def raw_list(d):
    """NBD_OPT_LIST: {name: description}."""
    r = raw.RawClient(d.sock)
    r.greeting()
    items = r.option(raw.OPT_LIST)
    r.close()
    names = {}
    for typ, p in items:
        (n,) = struct.unpack(">I", p[:4])
        names[p[4:4 + n].decode()] = p[4 + n:].decode()
    return names






def grow(d, img):
    rng = random.Random(11)
    model = bytearray(open(img, "rb").read())
    h1 = nbdtest.libnbd_handle(d.unix_uri("a"))
    started = threading.Event()
    stop = threading.Event()
    errors = []
    count = [0]

    def writer():
        try:
            for i in range(3000):
                if stop.is_set() and i >= 1000:
                    break
                off = rng.randrange(64 * MIB // 4096) * 4096
                n = rng.choice((4096, 16384, 65536))
                n = min(n, 64 * MIB - off)
                data = rng.randbytes(n)
                h1.pwrite(data, off)
                model[off:off + n] = data
                count[0] += 1
                if i == 100:
                    started.set()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            started.set()

    t = threading.Thread(target=writer)
    t.start()
    started.wait(60)
    os.truncate(img, 96 * MIB)
    p = nbdtest.nbdcachectl(d, "resize", "a")
    expect(p.returncode == 0 and "67108864 -> 100663296" in p.stdout,
           "nbdcachectl resize a: %r %r" % (p.stdout, p.stderr))
    h2 = nbdtest.libnbd_handle(d.unix_uri("a"))
    expect(h2.get_size() == 96 * MIB, "new connection: size %d" % h2.get_size())
    expect(h1.get_size() == 64 * MIB, "old connection: size %d" % h1.get_size())
    # The new part: zeros, then written through the new connection.
    model.extend(bytes(32 * MIB))
    expect(h2.pread(MIB, 80 * MIB) == bytes(MIB), "the grown part does not read as zeros")
    for _ in range(64):
        off = 64 * MIB + rng.randrange(32 * MIB // 4096) * 4096
        n = min(65536, 96 * MIB - off)
        data = rng.randbytes(n)
        h2.pwrite(data, off)
        model[off:off + n] = data
    stop.set()
    t.join(120)
    expect(not t.is_alive(), "the writer did not finish")
    expect(not errors, "the writer's I/O failed across the resize: %r" % errors)
    log("  %d writes on the old connection across the resize" % count[0])
    r = raw.RawClient(d.sock)
    r.open("a")
    expect(r.size == 96 * MIB, "raw connection after the grow: %d" % r.size)
    r.close()
    got = bytearray()
    for off in range(0, 96 * MIB, 16 * MIB):
        got += h2.pread(16 * MIB, off)
    nbdtest.require_same(bytes(got), bytes(model), "a through the new connection")
    got = bytearray()
    for off in range(0, 64 * MIB, 16 * MIB):
        got += h1.pread(16 * MIB, off)
    nbdtest.require_same(bytes(got), bytes(model[:64 * MIB]), "a through the old connection")
    h1.flush()
    h2.flush()
    with open(img, "rb") as f:
        disk = f.read()
    expect(len(disk) == 96 * MIB, "a.img is %d bytes" % len(disk))
    nbdtest.require_same(disk, bytes(model), "a.img after FLUSH")
    h1.shutdown()
    h2.shutdown()
    del got


def old_connection_bound(d, img):
    """The old connection's own size: a raw READ past 64 MiB is EINVAL."""
    # (grow() left a at 96 MiB: shrink it back is the shrink test's job;
    # here a new raw connection negotiates 96 MiB and one made before the
    # grow is simulated by growing again.)
    r = raw.RawClient(d.sock)
    r.open("a")
    before = r.size
    os.truncate(img, before + 16 * MIB)
    p = nbdtest.nbdcachectl(d, "resize", "a")
    expect(p.returncode == 0, "resize a again: %r" % p.stderr)
    c = r.request(raw.CMD_READ, before, 4096)
    rep = r.read_reply(c)
    expect(rep.error == raw.EINVAL, "old connection READ past its own size: error %d"
           % rep.error)
    c = r.request(raw.CMD_READ, before - 4096, 4096)
    expect(r.read_reply(c).error == 0, "old connection READ of its last block")
    r.close()
    expect(nbdtest.export_size(d, "a") == before + 16 * MIB, "new connection after the second grow")


def split(d, img):
    names = raw_list(d)
    expect(sorted(n for n in names if n.startswith("s")) == ["s", "s/0", "s/1"],
           "before: %r" % sorted(names))
    held = raw.RawClient(d.sock)
    held.open("s/1")
    os.truncate(img, 64 * MIB)
    p = nbdtest.nbdcachectl(d, "resize", "s")
    expect(p.returncode == 0, "resize s: %r" % p.stderr)
    names = raw_list(d)
    expect(sorted(n for n in names if n.startswith("s")) == ["s", "s/0", "s/1", "s/2", "s/3"],
           "after the grow: %r" % sorted(names))
    expect(names.get("s/3") == "bytes 50331648 to 67108863 of export 's'",
           "s/3's description: %r" % names.get("s/3"))
    expect(nbdtest.export_size(d, "s/3") == 16 * MIB and nbdtest.export_size(d, "s") == 64 * MIB, "sizes after the grow")
    p = nbdtest.nbdcachectl(d, "resize", "s", "16M")
    expect(p.returncode == 0, "resize s 16M: %r" % p.stderr)
    names = raw_list(d)
    expect(sorted(n for n in names if n.startswith("s")) == ["s", "s/0"],
           "after the shrink: %r" % sorted(names))
    expect(os.path.getsize(img) == 16 * MIB, "s.img is %d bytes" % os.path.getsize(img))
    # The connection to s/1 (gone now) keeps its window, past the end.
    c = held.request(raw.CMD_READ, 0, 4096)
    expect(held.read_reply(c).error == raw.ENOSPC, "READ on the removed window s/1")
    c = held.request(raw.CMD_WRITE, 0, 4096, payload=bytes(4096))
    expect(held.read_reply(c).error == raw.ENOSPC, "WRITE on the removed window s/1")
    held.close()


def shrink(d, img):
    rng = random.Random(5)
    model = bytearray(open(img, "rb").read())
    h = nbdtest.libnbd_handle(d.unix_uri("d"))
    for off in (8 * MIB, 60 * MIB):
        data = rng.randbytes(MIB)
        h.pwrite(data, off)
        model[off:off + MIB] = data
    st = nbdtest.control_request(d.control, {"command": "stats", "export": "d"})
    log("  d's stats: dirty %r" % [e.get("dirty_bytes") for e in st.get("exports", [st])])
    p = nbdtest.nbdcachectl(d, "resize", "d", "32M")
    expect(p.returncode == 1 and "1048576 dirty bytes past the new end" in p.stderr,
           "shrink over dirty data: %d %r" % (p.returncode, p.stderr))
    expect(os.path.getsize(img) == 64 * MIB, "d.img changed by a refused shrink")
    expect(nbdtest.export_size(d, "d") == 64 * MIB, "a refused shrink changed the size")
    rep = nbdtest.control_request(d.control, {"command": "resize", "export": "d", "size": "32M"})
    expect(not rep["ok"] and rep.get("errno") == "EBUSY", "control reply: %r" % rep)
    h.flush()
    p = nbdtest.nbdcachectl(d, "resize", "d", "32M")
    expect(p.returncode == 0 and "67108864 -> 33554432" in p.stdout,
           "shrink after FLUSH: %r %r" % (p.stdout, p.stderr))
    expect(os.path.getsize(img) == 32 * MIB, "d.img is %d bytes" % os.path.getsize(img))
    expect(nbdtest.export_size(d, "d") == 32 * MIB, "new connection after the shrink")
    # The old connection: libnbd still believes 64 MiB; the server refuses.
    expect(h.get_size() == 64 * MIB, "old connection's size %d" % h.get_size())
    expect(nbdtest.read_errno(h, 4096, 48 * MIB) == raw.ENOSPC,
           "old connection READ past the new end: %d" % nbdtest.read_errno(h, 4096, 48 * MIB))
    try:
        h.pwrite(bytes(4096), 40 * MIB)
        expect(False, "old connection WRITE past the new end succeeded")
    except nbd.Error as e:
        expect(e.errnum == raw.ENOSPC, "old connection WRITE past the new end: %s" % e)
    got = h.pread(32 * MIB, 0)
    nbdtest.require_same(got, bytes(model[:32 * MIB]), "d below the new end")
    nbdtest.require_same(open(img, "rb").read(), bytes(model[:32 * MIB]), "d.img")
    h.shutdown()


def raw_resize(d, imgs):
    r = raw.RawClient(d.sock)
    r.open("r")
    expect(r.eflags & FLAG_SEND_RESIZE, "r lacks NBD_FLAG_SEND_RESIZE: 0x%x" % r.eflags)
    c = r.request(CMD_RESIZE, 96 * MIB, 0)
    rep = r.read_reply(c)
    expect(rep.error == 0, "NBD_CMD_RESIZE to 96 MiB: error %d" % rep.error)
    expect(nbdtest.export_size(d, "r") == 96 * MIB, "new connection after NBD_CMD_RESIZE")
    expect(os.path.getsize(imgs["r"]) == 96 * MIB, "r.img after NBD_CMD_RESIZE")
    # The client that grew it uses the new size at once.
    c = r.request(raw.CMD_WRITE, 80 * MIB, 4096, payload=b"\x5a" * 4096)
    expect(r.read_reply(c).error == 0, "WRITE past the old end by the client that grew r")
    c = r.request(raw.CMD_READ, 80 * MIB, 4096)
    rep = r.read_reply(c)
    expect(rep.error == 0 and rep.data == b"\x5a" * 4096, "READ it back: error %d" % rep.error)
    c = r.request(CMD_RESIZE, 96 * MIB, 4096)
    expect(r.read_reply(c).error == raw.EINVAL, "NBD_CMD_RESIZE with a length")
    c = r.request(CMD_RESIZE, 96 * MIB + 1000, 0)
    expect(r.read_reply(c).error == raw.EINVAL, "NBD_CMD_RESIZE to an unaligned size")
    # Extended headers: the size is the 64-bit offset field as well.
    x = raw.RawClient(d.sock)
    x.open("r", extended=True)
    expect(x.eflags & FLAG_SEND_RESIZE, "r (extended) lacks NBD_FLAG_SEND_RESIZE")
    c = x.request(CMD_RESIZE, 128 * MIB, 0)
    expect(x.read_reply(c).error == 0, "extended NBD_CMD_RESIZE to 128 MiB")
    expect(nbdtest.export_size(d, "r") == 128 * MIB, "new connection after the extended resize")
    # A smaller size while another connection (x) uses the export: EPERM.
    c = r.request(CMD_RESIZE, 32 * MIB, 0)
    expect(r.read_reply(c).error == raw.EPERM, "shrink with another connection on r")
    expect(nbdtest.export_size(d, "r") == 128 * MIB, "a refused shrink changed r")
    x.close()
    r.close()
    alone = raw.RawClient(d.sock)
    alone.open("r")
    nbdtest.wait_until(lambda: nbdtest.control_request(d.control, {"command": "status"})
                       ["connections"] == 1, 5)
    c = alone.request(CMD_RESIZE, 32 * MIB, 0)
    expect(alone.read_reply(c).error == raw.EPERM,
           "shrink of r over the dirty block at 80 MiB (the extension's refusal: EPERM)")
    c = alone.request(raw.CMD_FLUSH, 0, 0)
    expect(alone.read_reply(c).error == 0, "FLUSH on r")
    c = alone.request(CMD_RESIZE, 32 * MIB, 0)
    expect(alone.read_reply(c).error == 0, "shrink of r by its only connection after FLUSH")
    expect(os.path.getsize(imgs["r"]) == 32 * MIB, "r.img after the shrink")
    c = alone.request(raw.CMD_READ, 40 * MIB, 4096)
    expect(alone.read_reply(c).error == raw.ENOSPC, "READ past the end the client set")
    alone.close()
    # n: not advertised, refused; ro: read-only, not advertised.
    n = raw.RawClient(d.sock)
    n.open("n")
    expect(not n.eflags & FLAG_SEND_RESIZE, "n advertises NBD_FLAG_SEND_RESIZE")
    c = n.request(CMD_RESIZE, 96 * MIB, 0)
    expect(n.read_reply(c).error == raw.EINVAL, "NBD_CMD_RESIZE on n")
    n.close()
    expect(nbdtest.export_size(d, "n") == 64 * MIB and os.path.getsize(imgs["n"]) == 64 * MIB,
           "n was resized")
    ro = raw.RawClient(d.sock)
    ro.open("ro")
    expect(not ro.eflags & FLAG_SEND_RESIZE, "read-only ro advertises NBD_FLAG_SEND_RESIZE")
    ro.close()


def reload(d, img):
    os.truncate(img, 48 * MIB)
    rep = nbdtest.control_request(d.control, {"command": "reload"})
    expect(rep["ok"] and rep.get("resized") == ["g"], "reload reply: %r" % rep)
    expect(nbdtest.export_size(d, "g") == 48 * MIB, "g after the reload: %d" % nbdtest.export_size(d, "g"))


def race(d, img):
    """I/O around the cut on an old connection while the export is cut and
    grown again and again: every request succeeds or gets ENOSPC, the
    bytes below the cut are untouched, the daemon lives."""
    rng = random.Random(3)
    below = nbdtest.read_at(img, 0, 8 * MIB)
    h = nbdtest.libnbd_handle(d.unix_uri("z"))
    stop = threading.Event()
    answers = {}

    def io():
        while not stop.is_set():
            off = 8 * MIB + rng.randrange(24 * MIB // 4096) * 4096
            try:
                if rng.random() < 0.5:
                    h.pread(4096, off)
                else:
                    h.pwrite(rng.randbytes(4096), off)
                err = 0
            except nbd.Error as e:
                err = e.errnum
            answers[err] = answers.get(err, 0) + 1

    t = threading.Thread(target=io)
    t.start()
    done = {"cut": 0, "refused": 0}
    try:
        for _ in range(60):
            nbdtest.control_request(d.control, {"command": "flush", "export": "z"})
            rep = nbdtest.control_request(d.control, {"command": "resize", "export": "z",
                                                      "size": "16M"})
            done["cut" if rep["ok"] else "refused"] += 1
            expect(rep["ok"] or rep.get("errno") == "EBUSY", "resize z 16M: %r" % rep)
            rep = nbdtest.control_request(d.control, {"command": "resize", "export": "z",
                                                      "size": "32M"})
            expect(rep["ok"], "resize z 32M: %r" % rep)
    finally:
        stop.set()
        t.join(60)
    log("  %r resizes; answers %r" % (done, answers))
    expect(set(answers) <= {0, raw.ENOSPC}, "answers other than success and ENOSPC: %r"
           % answers)
    expect(done["cut"] > 0 and answers.get(raw.ENOSPC, 0) > 0,
           "no cut succeeded or no request met the cut: %r %r" % (done, answers))
    h.flush()
    expect(h.pread(8 * MIB, 0) == below, "the bytes below the cut changed")
    h.shutdown()


def race_writes(d, img):
    """Writes from four connections just above the cut while z is flushed,
    cut and grown back: a WRITE admitted before a cut that lands after it
    gets ENOSPC; none leaves dirty data past the end (which would refuse
    the grow back: EBUSY)."""
    handles = [nbdtest.libnbd_handle(d.unix_uri("z")) for _ in range(4)]
    stop = threading.Event()
    answers = {}
    lock = threading.Lock()

    def io(h, seed):
        rng = random.Random(seed)
        for _ in range(100000):
            if stop.is_set():
                break
            off = 16 * MIB + rng.randrange(256) * 4096
            time.sleep(rng.random() * 0.002)  # sparse: cuts find nothing dirty
            try:
                h.pwrite(rng.randbytes(4096), off)
                err = 0
            except nbd.Error as e:
                err = e.errnum
            with lock:
                answers[err] = answers.get(err, 0) + 1

    threads = [threading.Thread(target=io, args=(h, 40 + i)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    done = {"cut": 0, "refused": 0}
    try:
        for _ in range(150):
            nbdtest.control_request(d.control, {"command": "flush", "export": "z"})
            rep = nbdtest.control_request(d.control, {"command": "resize", "export": "z",
                                                      "size": "16M"})
            done["cut" if rep["ok"] else "refused"] += 1
            rep = nbdtest.control_request(d.control, {"command": "resize", "export": "z",
                                                      "size": "32M"})
            if not rep["ok"]:
                expect(False, "resize z 32M: %r" % rep)
                break
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    log("  %r resizes; answers %r" % (done, answers))
    expect(set(answers) <= {0, raw.ENOSPC}, "answers other than success and ENOSPC: %r"
           % answers)
    for h in handles:
        h.shutdown()


def bad(d, imgs):
    cases = [
        (("resize", "nosuch", "1M"), "no such export 'nosuch'"),
        (("resize", "a", "1000"), "multiple of the export's block size"),
        (("resize", "a", "xyz"), "\"size\" must be"),
        (("resize", "s/0", "1G"), "window of split export 's'"),
        (("resize", "w", "8M"), "window of fixed size"),
        (("resize", "wf", "8M"), "window 'w'"),
        (("resize", "k", "32M"), "cannot grow to 33554432 bytes: it has 16777216"),
    ]
    for args, words in cases:
        p = nbdtest.nbdcachectl(d, *args)
        expect(p.returncode == 1 and words in p.stderr,
               "%s: exit %d, %r (wanted %r)" % (" ".join(args), p.returncode, p.stderr, words))
    expect(os.path.getsize(imgs["wf"]) == 32 * MIB, "wf.img changed by a refused shrink")
    expect(nbdtest.export_size(d, "wf") == 32 * MIB and nbdtest.export_size(d, "w") == 16 * MIB, "wf or w changed")
    p = nbdtest.nbdcachectl(d, "resize", "wf", "24M")  # the window still fits: fine
    expect(p.returncode == 0, "resize wf 24M: %r" % p.stderr)
    expect(nbdtest.export_size(d, "w") == 16 * MIB, "w changed with its backend")
    k = raw.RawClient(d.sock)
    k.open("k")
    expect(k.eflags & FLAG_SEND_RESIZE and k.size == 16 * MIB,
           "k (an NBD backend, allow-resize): no NBD_FLAG_SEND_RESIZE, or it changed")
    k.close()


def config_key(tmp):
    """allow-resize in the config file: the flag on c only."""
    conf = os.path.join(tmp, "resize.conf")
    img = os.path.join(tmp, "c.img")
    nbdtest.sparse_file(img, 16 * MIB)
    with open(conf, "w") as f:
        f.write("[generic]\ncache-size = 64M\n\n[c]\nexportname = %s\nallow-resize = true\n\n"
                "[c2]\nexportname = %s\nallow-resize = false\n" % (img, img))
    with nbdtest.running_daemon([], extra=["--config", conf]) as d:
        flags = {}
        for name in ("c", "c2"):
            r = raw.RawClient(d.sock)
            r.open(name)
            flags[name] = bool(r.eflags & FLAG_SEND_RESIZE)
            r.close()
        expect(flags == {"c": True, "c2": False}, "NBD_FLAG_SEND_RESIZE: %r" % flags)


def main():
    with nbdtest.tempdir() as tmp:
        sizes = {"a": 64, "s": 32, "d": 64, "r": 64, "n": 64, "ro": 64, "g": 16, "wf": 32,
                 "z": 32}
        imgs = {}
        for name, mib in sizes.items():
            imgs[name] = os.path.join(tmp, name + ".img")
            nbdtest.random_file(imgs[name], mib * MIB, seed=len(imgs))
        exports = [("a", imgs["a"], ""), ("s", imgs["s"], "split=16M"), ("d", imgs["d"], ""),
                   ("r", imgs["r"], "allow-resize"), ("n", imgs["n"], ""),
                   ("ro", imgs["ro"], "allow-resize,readonly"), ("g", imgs["g"], ""),
                   ("wf", imgs["wf"], ""), ("w", imgs["wf"], "offset=0,size=16M"),
                   ("z", imgs["z"], ""), ("k", "nbdkit:memory 16M", "allow-resize")]
        extra = ["--cache-size", "256M", "--cache-mode", "writeback", "--dirty-expire", "3600",
                 "--dirty-high", "90", "--dirty-low", "80"]
        with nbdtest.running_daemon(exports, extra=extra) as d:
            CHECKS.run("grow", grow, d, imgs["a"])
            CHECKS.run("old_connection_bound", old_connection_bound, d, imgs["a"])
            CHECKS.run("split", split, d, imgs["s"])
            CHECKS.run("shrink", shrink, d, imgs["d"])
            CHECKS.run("raw", raw_resize, d, imgs)
            CHECKS.run("reload", reload, d, imgs["g"])
            CHECKS.run("race", race, d, imgs["z"])
            CHECKS.run("race_writes", race_writes, d, imgs["z"])
            CHECKS.run("bad", bad, d, imgs)
            CHECKS.dump_log(d)
        CHECKS.run("config_key", config_key, tmp)
    CHECKS.finish("resize")


if __name__ == "__main__":
    main()
