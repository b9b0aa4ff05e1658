#!/usr/bin/python3
"""Reload (SIGHUP and the control socket's "reload") under live connections.

Exports a and b (writeback, dirty-expire 3600 s so written data stays dirty in
the cache). Clients on a and b keep 64 KiB writes in flight while the config
changes: a is changed (description, seq-cutoff), b removed, c added, then
SIGHUP. Then:
  - every write in flight completes; the model of each export is exact;
  - a new client of b is refused (unknown export); the old client of b goes
    on writing, then leaves without FLUSH: its dirty data still reaches
    b.img (the daemon writes it back and closes b's backend), byte for byte;
  - a's new description shows; c serves reads and writes;
  - a refused change (a's block size, the cache size, the stall and
    negotiation timeouts) keeps the old settings
    and is reported; a broken config changes nothing and the daemon serves on.
Then: a removed export's dirty data waits for room on its backend; and
exports added and removed by many reloads leave no rate slot behind
(status rate_slots).
"""
import errno
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 8 * MIB
CHUNK = 64 * 1024
CHECKS = nbdtest.Checks()
expect = CHECKS.expect


def write_config(path, text):
    tmp = path + ".new"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def burst(h, model, rng, count):
    """count aio writes of CHUNK at random aligned offsets; returns pending."""
    pending = []
    for _ in range(count):
        off = rng.randrange(SIZE // CHUNK) * CHUNK
        data = rng.randbytes(CHUNK)
        model[off:off + CHUNK] = data
        pending.append((h, h.aio_pwrite(data, off)))
    return pending


def wait_for_log(d, words, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if words in d.log_text():
            return True
        time.sleep(0.1)
    return False


def exports(d):
    return {e["name"]: e for e in nbdtest.control_request(d.control,
                                                          {"command": "exports"})["exports"]}


def live_reload(tmp):
    rng = random.Random(7)
    imgs = {}
    models = {}
    for name in ("a", "b", "c"):
        imgs[name] = os.path.join(tmp, name + ".img")
        nbdtest.random_file(imgs[name], SIZE, seed=ord(name))
        models[name] = bytearray(open(imgs[name], "rb").read())
    conf = os.path.join(tmp, "nbdcached.conf")
    generic = "[generic]\ncache-size = 64M\ndirty-expire = 3600\ndirty-high = 90\n\n"
    write_config(conf, generic + "[a]\nbackend = %s\ndescription = first\n\n"
                 "[b]\nbackend = %s\n" % (imgs["a"], imgs["b"]))
    with nbdtest.running_daemon([], extra=["--config", conf]) as d:
        ha = nbdtest.libnbd_handle(d.unix_uri("a"))
        hb = nbdtest.libnbd_handle(d.unix_uri("b"))
        pending = burst(ha, models["a"], rng, 48) + burst(hb, models["b"], rng, 48)
        # a changed, b removed, c added; SIGHUP while the writes are in flight.
        write_config(conf, generic + "[a]\nbackend = %s\ndescription = second\nseq-cutoff = 1M\n"
                     "\n[c]\nbackend = %s\n" % (imgs["a"], imgs["c"]))
        os.kill(d.pid, signal.SIGHUP)
        pending += burst(ha, models["a"], rng, 48) + burst(hb, models["b"], rng, 48)
        nbdtest.aio_wait(pending)
        log("  192 writes in flight across the reload: all completed")
        expect(wait_for_log(d, "reload: 1 export(s) added, 1 changed, 1 removed, 0 refused", 10),
               "no reload summary line in the log")
        ex = exports(d)
        expect(sorted(ex) == ["a", "c"], "exports after the reload: %r" % sorted(ex))
        expect(ex.get("a", {}).get("description") == "second", "a's new description: %r"
               % ex.get("a"))
        expect(ex.get("a", {}).get("seq_cutoff") == MIB, "a's new seq-cutoff")
        # b: refused to new clients, served to the old one.
        try:
            nbdtest.libnbd_handle(d.unix_uri("b"))
            expect(False, "a new connection to the removed export b was accepted")
        except nbd.Error as e:
            log("  new client of b refused: %s" % e)
        nbdtest.aio_wait(burst(hb, models["b"], rng, 32))
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["removed_backends"] == 1 and st["connections"] == 2,
               "status while b's client is still on: %r" % st)
        got = hb.pread(SIZE, 0)
        expect(got == bytes(models["b"]), "b reads back its model on the old connection")
        expect(open(imgs["b"], "rb").read() != bytes(models["b"]),
               "b.img already holds every write: the test would prove nothing")
        hb.shutdown()  # no FLUSH: the data is dirty in the cache only
        del hb
        expect(wait_for_log(d, "removed backend %s: written back and closed" % imgs["b"], 20),
               "b's backend was not written back and closed within 20 s")
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["removed_backends"] == 0, "removed_backends after the close: %r" % st)
        expect(open(imgs["b"], "rb").read() == bytes(models["b"]),
               "b.img differs from what its client wrote: data lost at removal")
        # c: new and working.
        hc = nbdtest.libnbd_handle(d.unix_uri("c"))
        nbdtest.aio_wait(burst(hc, models["c"], rng, 16))
        hc.flush()
        expect(hc.pread(SIZE, 0) == bytes(models["c"]), "c reads back")
        expect(open(imgs["c"], "rb").read() == bytes(models["c"]), "c.img after FLUSH")
        hc.shutdown()
        # a: nothing lost across the reload.
        ha.flush()
        expect(ha.pread(SIZE, 0) == bytes(models["a"]), "a reads back its model")
        expect(open(imgs["a"], "rb").read() == bytes(models["a"]), "a.img after FLUSH")

        # Refused: a's block size, the cache size and the stall and
        # negotiation deadlines cannot change live.
        write_config(conf, generic.replace("64M", "128M").replace(
                         "\n\n", "\nstall-timeout = 7\nnegotiation-timeout = 9\n\n") +
                     "[a]\nbackend = %s\ndescription = third\nblock-size = 512\n\n"
                     "[c]\nbackend = %s\n" % (imgs["a"], imgs["c"]))
        r = nbdtest.control_request(d.control, {"command": "reload"})
        log("  reload with refused changes: %r" % r)
        expect(r.get("ok") and r.get("refused") == ["a"] and r.get("changed") == [],
               "a's block size change must be refused: %r" % r)
        expect(r.get("refused_settings") == ["cache-size", "stall-timeout",
                                             "negotiation-timeout"],
               "cache-size, stall-timeout and negotiation-timeout refused: %r" % r)
        ex = exports(d)
        expect(ex["a"]["block_size"] == 4096 and ex["a"]["description"] == "second",
               "a keeps all of its old settings: %r" % ex["a"])
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["cache_bytes"] == 64 * MIB, "the cache keeps its size")

        # A broken config changes nothing.
        write_config(conf, generic + "[a]\nbackend = %s\nbogus-key = 1\n" % imgs["a"])
        os.kill(d.pid, signal.SIGHUP)
        expect(wait_for_log(d, "bogus-key", 10), "the broken config is not reported")
        expect("the running configuration stays" in d.log_text(), "reload failure line")
        expect(sorted(exports(d)) == ["a", "c"], "a broken config changed the exports")
        h = nbdtest.libnbd_handle(d.unix_uri("c"))
        expect(h.pread(4096, 0) == bytes(models["c"][:4096]), "c still served")
        h.shutdown()
        ha.shutdown()


def removed_export_with_backend_down(tmp):
    """The removed export's dirty data cannot be written (the file system is
    full): nothing is dropped; the backend stays open until it can be."""
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    if os.system("mount -t tmpfs -o size=12m tmpfs %s" % mnt) != 0:
        nbdtest.skip("cannot mount a tmpfs (needs root)")
    try:
        img = os.path.join(mnt, "b.img")
        nbdtest.sparse_file(img, SIZE)
        keep = os.path.join(tmp, "a.img")
        nbdtest.sparse_file(keep, MIB)
        conf = os.path.join(tmp, "nbdcached.conf")
        generic = "[generic]\ncache-size = 64M\ndirty-expire = 3600\ndirty-high = 90\n\n"
        write_config(conf, generic + "[a]\nbackend = %s\n[b]\nbackend = %s\n" % (keep, img))
        with nbdtest.running_daemon([], extra=["--config", conf]) as d:
            hb = nbdtest.libnbd_handle(d.unix_uri("b"))
            data = random.Random(3).randbytes(SIZE)
            hb.pwrite(data, 0)  # cached, dirty; the sparse file takes no room yet
            filler = os.path.join(mnt, "filler")
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\xff" * MIB)
                        f.flush()
                except OSError as e:
                    expect(e.errno == errno.ENOSPC, "filling the tmpfs: %s" % e)
            hb.shutdown()
            del hb
            write_config(conf, generic + "[a]\nbackend = %s\n" % keep)
            os.kill(d.pid, signal.SIGHUP)
            expect(wait_for_log(d, "writing its dirty data back failed", 15),
                   "the failed writeback of the removed export is not reported")
            expect("written back and closed" not in d.log_text(),
                   "the backend was closed with its data unwritten")
            os.unlink(filler)
            expect(wait_for_log(d, "removed backend %s: written back and closed" % img, 30),
                   "not written back once the room came back")
            expect(open(img, "rb").read() == data, "b.img holds what was written")
    finally:
        os.system("umount %s" % mnt)


def rate_slots_across_reloads(tmp):
    """Exports that reloads add and remove leave no writeback-rate slot
    behind. CYCLES times: a reload adds an export, "stats" asks for it (so
    it has a rate slot), a reload removes it. Within a few ticks status's
    rate_slots must be back to the number of exports served. Before the fix
    the slots of removed exports stayed for good (2 + CYCLES here; after
    1024 of them no new export got a writeback_rate, and a new export whose
    cache export took a freed one's address inherited its stale count)."""
    cycles = 20
    keep = os.path.join(tmp, "a.img")
    nbdtest.sparse_file(keep, MIB)
    conf = os.path.join(tmp, "nbdcached.conf")
    base = "[generic]\ncache-size = 64M\n\n[a]\nbackend = %s\n" % keep
    write_config(conf, base)
    with nbdtest.running_daemon([], extra=["--config", conf]) as d:
        for i in range(cycles):
            name = "x%d" % i
            img = os.path.join(tmp, name + ".img")
            nbdtest.sparse_file(img, MIB)
            write_config(conf, base + "\n[%s]\nbackend = %s\n" % (name, img))
            r = nbdtest.control_request(d.control, {"command": "reload"})
            expect(r.get("ok") and r.get("added") == [name], "reload adding %s: %r" % (name, r))
            s = nbdtest.control_request(d.control, {"command": "stats", "export": name})
            expect(s.get("ok") and len(s.get("exports", [])) == 1, "stats of %s: %r" % (name, s))
            write_config(conf, base)
            r = nbdtest.control_request(d.control, {"command": "reload"})
            expect(r.get("ok") and r.get("removed") == [name],
                   "reload removing %s: %r" % (name, r))
        deadline = time.time() + 5
        while True:
            st = nbdtest.control_request(d.control, {"command": "status"})
            if st["rate_slots"] <= st["exports"] or time.time() > deadline:
                break
            time.sleep(0.2)
        log("  after %d reload cycles: rate_slots %d, exports %d"
            % (cycles, st["rate_slots"], st["exports"]))
        expect(st["exports"] == 1 and st["rate_slots"] == 1,
               "rate slots of removed exports are kept: %d slot(s) for %d export(s)"
               % (st["rate_slots"], st["exports"]))


def main():
    for name, fn in (("live_reload", live_reload),
                     ("removed_export_with_backend_down", removed_export_with_backend_down),
                     ("rate_slots_across_reloads", rate_slots_across_reloads)):
        with nbdtest.tempdir() as tmp:
            CHECKS.run(name, fn, tmp)
    CHECKS.finish("reload")


if __name__ == "__main__":
    main()
