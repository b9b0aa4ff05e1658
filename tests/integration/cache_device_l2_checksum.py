#!/usr/bin/python3
"""cache_device_l2_checksum: a level-2 page whose bytes the device changed
is never served, nor merged into a write.

A 32 MiB working set on a 64 MiB backend file, served through nbdkit's
delay filter (reads 2 ms: slower than the device, so fills go to the
level-2 cache), a RAM cache of 16 MiB and a cache device of 96 MiB.

  1  The working set written and FLUSHed, read twice (evictions fill the
     level-2 area), SIGTERM: the level-2 map is kept. Read from the
     device file as a start would: the superblock (format 5), the map's
     claims, and for a sample of claimed pages the CRC32C the map holds
     is that of the page's bytes, and the bytes are the export's.
  2  While the daemon is down, one byte flipped in each of 8 claimed
     pages of the area, and in one more page that a WRITE of 512 bytes
     then lands in (its block filled first).
  3  A warm start (cache-device-warm all): each flipped page read alone
     returns the backend's bytes (the model's), the 512-byte WRITE and a
     FLUSH, then the whole working set read against the model; the
     stats count the checksum errors (at least 8: a small fill goes to
     the backend one time in 256 by design), the log says which page did
     not match (rate-limited, as log.c does). After SIGTERM the backend file
     holds the model's bytes: nothing flipped reached it.

  4  A device of format 4 (the superblock, the level-2 layout and a map
     of keys alone, written here over the stopped device's, the map
     claiming 64 pages of the working set whose bytes are random): the
     start says the area is laid out again for checksums and starts cold,
     every byte reads as the model says, and after SIGTERM the device is
     of format 5 with a map whose sampled claims hold; the next start is
     warm (the export's cache-device-warm = all: nbdkit's backend cannot
     be proven unchanged), a start without that key is not.

On a daemon without page checksums (format 4, whose map is read here
too) step 3 returns the flipped bytes.
"""

import os
import random
import struct
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 64 * MIB
WORKING = 32 * MIB
BASE = 16 * MIB              # the working set: [BASE, BASE + WORKING)
DEVICE = 96 * MIB
PAGE = 4096
FLIPPED = 8
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect
SEED = int(os.environ.get("L2_SEED", "20261207"))

crc32c = nbdtest.crc32c


def superblock(dev):
    """The newer of the two superblock copies whose CRC holds."""
    best = None
    with open(dev, "rb") as f:
        for copy in range(2):
            f.seek(copy * 65536)
            b = f.read(65536)
            if b[:8] != b"\0NBDCDEV" or crc32c(b[:-4]) != struct.unpack(">I", b[-4:])[0]:
                continue
            sb = {"version": struct.unpack_from(">I", b, 8)[0],
                  "generation": struct.unpack_from(">Q", b, 32)[0],
                  "l2_offset": struct.unpack_from(">Q", b, 88)[0],
                  "l2_bytes": struct.unpack_from(">Q", b, 96)[0],
                  "l2_map_offset": struct.unpack_from(">Q", b, 104)[0],
                  "l2_map_gen": struct.unpack_from(">I", b, 112)[0],
                  "uuid": b[16:32], "copy": copy, "raw": bytearray(b)}
            if best is None or sb["generation"] > best["generation"]:
                best = sb
    require(best, "no superblock with a good CRC on %s" % dev)
    return best


def claims(dev, sb):
    """{page: (export offset, CRC32C or None)} as the map's blocks say
    (format 5: a key and a checksum per page; format 4: keys alone)."""
    entry = 16 if sb["version"] >= 5 else 8
    per = (PAGE - 32) // entry
    pages = sb["l2_bytes"] // PAGE
    out = {}
    with open(dev, "rb") as f:
        for b in range((pages + per - 1) // per):
            f.seek(sb["l2_map_offset"] + (1 + b) * PAGE)
            blk = f.read(PAGE)
            if crc32c(blk[4:]) != struct.unpack(">I", blk[:4])[0]:
                continue
            for i in range(per):
                key = struct.unpack_from(">Q", blk, 32 + entry * i)[0]
                if key:
                    crc = struct.unpack_from(">I", blk, 32 + entry * i + 8)[0] if entry == 16 \
                        else None
                    out[b * per + i] = ((key & ((1 << 48) - 1)) * PAGE, crc)
    return out


class Run:
    def __init__(self, tmp):
        self.tmp = tmp
        self.disk = os.path.join(tmp, "disk.img")
        self.dev = os.path.join(tmp, "cache.dev")
        self.rng = random.Random(SEED)
        with open(self.disk, "wb") as f:
            f.truncate(SIZE)
        nbdtest.sparse_file(self.dev, DEVICE)
        self.model = bytearray(SIZE)
        self.d = None

    def start(self, what=None, warm="cache-device-warm=all"):
        if self.d and self.d.alive():
            self.d.kill()
        work = os.path.join(self.tmp, "d%d" % len(os.listdir(self.tmp)))
        os.mkdir(work)
        extra = ["--cache-device", self.dev, "--cache-size", "16M", "--cache-mode", "writeback",
                 "--hugepages", "off"]
        backend = "nbdkit:--filter=delay file %s rdelay=2ms" % self.disk
        # (the export's own key: nothing else writes its backend)
        self.d = nbdtest.CheckedDaemon([("disk", backend, warm)], workdir=work, tcp=False,
                                       extra=extra, what=what)
        self.h = nbdtest.libnbd_handle(self.d.unix_uri("disk"))

    def l2(self):
        st = nbdtest.control_request(self.d.control, {"command": "stats"})
        dev = st["cache"].get("cache_device")
        require(dev and "l2" in dev, "stats: no cache_device.l2: %s" % sorted(st["cache"]))
        return dev["l2"]

    def settle(self):
        for _ in range(400):
            if self.l2()["staged_bytes"] == 0:
                return
            time.sleep(0.05)
        raise Failed("level-2 staging did not drain")

    def read_check(self, off, n, what):
        got = self.h.pread(n, off)
        if got != self.model[off:off + n]:
            nbdtest.require_same(got, bytes(self.model[off:off + n]), what, base=off)


def fill(r):
    r.start()
    data = r.rng.randbytes(WORKING)
    for off in range(0, WORKING, 4 * MIB):
        r.h.pwrite(data[off:off + 4 * MIB], BASE + off)
    r.model[BASE:BASE + WORKING] = data
    r.h.flush()
    for rnd in range(2):
        for off in range(BASE, BASE + WORKING, MIB):
            r.read_check(off, MIB, "pass %d" % rnd)
    r.settle()
    r.d.stop()
    with open(r.d.logpath) as f:
        require("level-2 map of" in f.read(), "the clean stop did not keep the level-2 map")
    sb = superblock(r.dev)
    m = claims(r.dev, sb)
    log("  format %d, level-2 area of %d pages at %d, the map claims %d"
        % (sb["version"], sb["l2_bytes"] // PAGE, sb["l2_offset"], len(m)))
    inside = sorted(p for p, (off, _) in m.items() if BASE <= off < BASE + WORKING)
    require(len(inside) >= 4 * (FLIPPED + 1),
            "the map claims %d pages of the working set; too few to flip" % len(inside))
    expect(sb["version"] >= 5, "format %d: the level-2 map has no page checksums"
           % sb["version"])
    bad = 0
    with open(r.dev, "rb") as f:
        for p in r.rng.sample(inside, 64):
            off, crc = m[p]
            f.seek(sb["l2_offset"] + p * PAGE)
            page = f.read(PAGE)
            if page != r.model[off:off + PAGE]:
                bad += 1
            elif crc is not None and crc != crc32c(page):
                bad += 1
    expect(bad == 0, "%d of 64 claimed pages sampled do not hold the export's bytes or "
           "their map checksum" % bad)
    return sb, m, inside


def flip_and_read(r, sb, m, inside):
    chosen = r.rng.sample(inside, FLIPPED + 1)
    with open(r.dev, "r+b") as f:
        for p in chosen:
            at = sb["l2_offset"] + p * PAGE + r.rng.randrange(PAGE)
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x5A]))
        os.fsync(f.fileno())
    log("  one byte flipped in each of %d claimed pages" % len(chosen))
    r.start(what="warm start over flipped pages")
    require("level-2 cache warm" in r.d.log_text(), "the start was not warm:\n%s"
            % r.d.log_text()[-1500:])
    for p in chosen[:FLIPPED]:
        off = m[p][0]
        r.read_check(off, PAGE, "a flipped page read alone")
    # A WRITE of 512 bytes into the last one: its block is filled first.
    off = m[chosen[FLIPPED]][0] + 1024
    data = r.rng.randbytes(512)
    r.h.pwrite(data, off)
    r.model[off:off + 512] = data
    r.h.flush()
    r.read_check(off - 1024, PAGE, "the page a 512-byte WRITE went into")
    for o in range(BASE, BASE + WORKING, MIB):
        r.read_check(o, MIB, "the working set after the warm start")
    l2 = r.l2()
    log("  level-2: hits %d, checksum errors %d" % (l2["hits"], l2.get("checksum_errors", -1)))
    expect(l2.get("checksum_errors", 0) >= FLIPPED,
           "%s checksum errors counted for %d flipped pages read (and one written into)"
           % (l2.get("checksum_errors"), FLIPPED))
    text = r.d.log_text()
    lines = [ln for ln in text.splitlines() if "does not match its checksum" in ln]
    expect(lines, "no log line names a page that did not match its checksum")
    if lines:
        log("  %s" % lines[0].split("warn: ", 1)[-1])
    r.d.stop()
    got = nbdtest.read_at(r.disk, BASE, WORKING)
    if got != r.model[BASE:BASE + WORKING]:
        nbdtest.require_same(got, bytes(r.model[BASE:BASE + WORKING]),
                             "the backend file after SIGTERM", base=BASE)


def format4(r, sb):
    """The stopped device made one of format 4 as that version wrote it:
    superblock, level-2 layout (a map of keys alone, 508 pages a block),
    the map's header and blocks, claiming 64 pages of the working set
    whose bytes in the area are random."""
    room = sb["l2_offset"] + sb["l2_bytes"] - sb["l2_map_offset"]
    per = (PAGE - 32) // 8
    pages = room // PAGE - 1
    while pages and PAGE * (1 + (pages + per - 1) // per) + pages * PAGE > room:
        pages -= 1
    l2_offset = sb["l2_map_offset"] + PAGE * (1 + (pages + per - 1) // per)
    b = sb["raw"]
    struct.pack_into(">I", b, 8, 4)
    struct.pack_into(">Q", b, 32, sb["generation"] + 1)
    struct.pack_into(">QQ", b, 88, l2_offset, pages * PAGE)
    struct.pack_into(">I", b, len(b) - 4, crc32c(b[:-4]))
    gen, uuid = sb["l2_map_gen"], sb["uuid"]
    header = bytearray(PAGE)
    header[0:8] = b"\0NBDCL2M"
    header[8:24] = uuid
    struct.pack_into(">I", header, 24, gen)
    struct.pack_into(">I", header, PAGE - 4, crc32c(header[:-4]))
    block = bytearray(PAGE)
    struct.pack_into(">I", block, 4, 0)
    block[8:24] = uuid
    struct.pack_into(">I", block, 24, gen)
    for i in range(64):
        struct.pack_into(">Q", block, 32 + 8 * i, (1 << 48) | (BASE // PAGE + i))
    struct.pack_into(">I", block, 0, crc32c(block[4:]))
    with open(r.dev, "r+b") as f:
        f.seek((sb["copy"] ^ 1) * 65536)    # the copy not holding the newest
        f.write(b)
        f.seek(sb["l2_map_offset"])
        f.write(header)
        f.write(block)
        f.write(bytes(PAGE * ((pages + per - 1) // per - 1)))
        f.seek(l2_offset)
        f.write(r.rng.randbytes(64 * PAGE))
        os.fsync(f.fileno())


def older_format(r):
    format4(r, superblock(r.dev))
    require(superblock(r.dev)["version"] == 4, "the device was not made one of format 4")
    r.start(what="a start on a format 4 device")
    text = r.d.log_text()
    expect("format 4: its level-2 map has no page checksums" in text,
           "the start did not say the format 4 area is laid out again:\n%s" % text[-1500:])
    expect("level-2 cache warm" not in text, "a format 4 map was used")
    for o in range(BASE, BASE + WORKING, MIB):
        r.read_check(o, MIB, "the working set on a format 4 device")
    r.settle()
    r.d.stop()
    sb = superblock(r.dev)
    m = claims(r.dev, sb)
    expect(sb["version"] == 5 and m, "after the stop: format %d, %d pages claimed"
           % (sb["version"], len(m)))
    bad = 0
    with open(r.dev, "rb") as f:
        for p in r.rng.sample(sorted(m), min(32, len(m))):
            off, crc = m[p]
            f.seek(sb["l2_offset"] + p * PAGE)
            page = f.read(PAGE)
            bad += page != r.model[off:off + PAGE] or crc != crc32c(page)
    expect(bad == 0, "%d claimed pages sampled do not hold their bytes and checksum" % bad)
    r.start(what="the next start")
    expect("level-2 cache warm" in r.d.log_text(), "the next start was not warm")
    r.read_check(BASE, MIB, "the first MiB of the working set")
    r.d.stop()
    # Without the export's cache-device-warm = all (nor the global one),
    # an nbdkit backend's pages are not used: nothing proves it unchanged.
    r.start(what="a start without cache-device-warm", warm="")
    text = r.d.log_text()
    expect("could not be told (not a regular file)" in text and "level-2 cache warm" not in text,
           "without cache-device-warm all the pages of an nbdkit backend were used:\n%s"
           % text[-1500:])
    r.d.stop()


def main():
    with nbdtest.tempdir() as tmp:
        r = Run(tmp)
        state = {}

        def step1():
            state["fill"] = fill(r)

        CHECKS.run("level-2 area filled, its map read from the device", step1)
        if "fill" in state:
            CHECKS.run("flipped pages never served", flip_and_read, r, *state["fill"])
            CHECKS.run("a device of format 4", older_format, r)
        if r.d and r.d.alive():
            r.d.stop()
    CHECKS.finish("cache_device_l2_checksum")


if __name__ == "__main__":
    main()
