#!/usr/bin/python3
"""Interop with qemu 10: qemu-img and qemu-io as NBD clients of nbdcached.

What a qemu user relies on, checked byte for byte:
  - qemu-img info reports the export size (Unix socket and TCP);
  - qemu-img convert -n copies a raw file into the export and the export out
    to a new file, and qemu-img compare agrees both ways (also with 16
    coroutines writing out of order, -W -m 16, and for a source with holes
    written over old data: the holes must read back as zeros);
  - qemu-io write -P / read -P at many offsets of a 6 GiB sparse export,
    including ranges that straddle 2 GiB and 4 GiB, the last bytes, a 40 MiB
    request (split by the advertised maximum) and unaligned reads, seen
    from a second connection and present in the backend file after flush;
  - qemu-io write -z (with and without -u) reads back as zeros; discard
    (qemu-io -d unmap) punches a hole in the backend and leaves its
    neighbours intact;
  - qemu-img map never calls written data "zero", and reports a never
    written range of the sparse export as a hole;
  - many requests in flight at once (aio_write / aio_read / aio_flush).
Extended headers have their own test; here the daemon's "negotiated" log
lines are only printed, to show what qemu 10 negotiated.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import check, log, qemu_io, run, run_json  # noqa: E402
from nbdtest import read_at as backend_bytes  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DISK_SIZE = 64 * MiB
BIG_SIZE = 6 * GiB + 3 * MiB  # not a power of two, above 4 GiB

# (offset, length, pattern) written on the big export with qemu-io.
BIG_WRITES = [
    (0, 64 * KiB, 0x11),
    (3 * MiB + 512, 1536, 0x22),  # unaligned: qemu pads as the server asks
    (2 * GiB - 4 * KiB, 8 * KiB, 0x23),  # straddles 2^31
    (4 * GiB - 4 * KiB, 8 * KiB, 0x33),  # straddles 2^32
    (4 * GiB + 1 * MiB, 128 * KiB, 0x44),
    (5 * GiB + 12345 * 4 * KiB, 4 * KiB, 0x55),
    (BIG_SIZE - 64 * KiB, 64 * KiB, 0x66),  # the very last bytes
]
# Large requests, which qemu splits by the server's advertised maximum.
BIG_LARGE = (4 * GiB + 64 * MiB + 4 * KiB, 40 * MiB, 0x99)
# Ranges of the big export nobody writes: must read as zeros.
BIG_UNWRITTEN = [
    (64 * KiB, 64 * KiB),
    (4 * GiB + 4 * KiB, 64 * KiB),
    (4 * GiB + 512 * MiB, 1 * MiB),
]
# The zero / discard area, 1 MiB aligned so a punched hole is visible.
ZD_BASE = 4 * GiB + 16 * MiB
ZD_LEN = 5 * MiB

state = {}


def backend_is_hole(path, offset, length):
    """True when [offset, offset+length) has no data extent in the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after offset
            return True
        return data >= offset + length
    finally:
        os.close(fd)


def uris(name):
    d = state["daemon"]
    return d.unix_uri(name), d.tcp_uri(name)


def t_info():
    # The empty export name selects the first export ("disk").
    for name, size in (("disk", DISK_SIZE), ("big", BIG_SIZE), ("", DISK_SIZE)):
        for uri in uris(name):
            info = run_json(["qemu-img", "info", "--output=json", "-f", "raw", uri])
            check(info.get("virtual-size") == size,
                  "qemu-img info %s: virtual-size %r, expected %d"
                  % (uri, info.get("virtual-size"), size))


def t_convert():
    tmp = state["tmp"]
    unix, tcp = uris("disk")
    src = nbdtest.random_file(os.path.join(tmp, "src.raw"), DISK_SIZE, seed=11)
    out = os.path.join(tmp, "out.raw")
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, unix])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, unix])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", tcp, src])
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", tcp, out])
    want = nbdtest.sha256_file(src)
    nbdtest.sha256_matches(out, want, DISK_SIZE, "export converted out, compared with the source")
    # qemu-img flushes before it closes the export: the bytes are on the backend.
    check(nbdtest.sha256_file(state["disk"]) == want,
          "backend file differs from what qemu-img convert wrote")
    # The comparison really looks at the bytes: one changed byte is seen.
    with open(out, "r+b") as f:
        f.seek(DISK_SIZE // 2 + 7)
        b = f.read(1)
        f.seek(DISK_SIZE // 2 + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    p = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", out, unix], check_rc=False)
    check(p.returncode == 1, "qemu-img compare missed a changed byte (exit %d)" % p.returncode)
    os.unlink(out)
    # Out-of-order writes from 16 coroutines (-W -m 16), over TCP.
    src2 = nbdtest.random_file(os.path.join(tmp, "src2.raw"), DISK_SIZE, seed=12)
    run(["qemu-img", "convert", "-n", "-W", "-m", "16", "-f", "raw", "-O", "raw", src2, tcp])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src2, unix])
    check(nbdtest.sha256_file(state["disk"]) == nbdtest.sha256_file(src2),
          "backend file differs after qemu-img convert -W -m 16")
    os.unlink(src2)


def t_convert_sparse():
    """Holes in the source written over random data must read back as zeros."""
    tmp = state["tmp"]
    unix, tcp = uris("disk")
    src = os.path.join(tmp, "sparse-src.raw")
    nbdtest.sparse_file(src, DISK_SIZE)
    with open(src, "r+b") as f:
        for i, off in enumerate((0, 5 * MiB, 17 * MiB + 4 * KiB, DISK_SIZE - MiB)):
            f.seek(off)
            f.write(bytes([0xA0 + i]) * (256 * KiB))
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, tcp])
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, unix])
    check(nbdtest.sha256_file(state["disk"]) == nbdtest.sha256_file(src),
          "backend file differs from the sparse source after qemu-img convert")


def t_io_big():
    unix, tcp = uris("big")
    cmds = ["write -P 0x%02x %d %d" % (p, off, n) for off, n, p in BIG_WRITES]
    off, n, p = BIG_LARGE
    cmds.append("write -P 0x%02x %d %d" % (p, off, n))
    cmds.append("flush")
    cmds += ["read -P 0x%02x %d %d" % (p, off, n) for off, n, p in BIG_WRITES]
    cmds += ["read -P 0 %d %d" % (off, n) for off, n in BIG_UNWRITTEN]
    cmds.append("read -P 0x%02x %d %d" % (p, off, n))
    # Unaligned reads (qemu pads them to the server's minimum block size).
    cmds.append("read -P 0x22 %d %d" % (3 * MiB + 513, 3))
    cmds.append("read -P 0x33 %d %d" % (4 * GiB - 1, 2))
    qemu_io(unix, cmds)
    check(backend_bytes(state["big"], off, n) == bytes([p]) * n,
          "backend file lacks the %d-byte write at %d" % (n, off))
    # A second connection, over TCP, sees the same bytes.
    cmds = ["read -P 0x%02x %d %d" % (p, off, n) for off, n, p in BIG_WRITES]
    cmds += ["read -P 0 %d %d" % (off, n) for off, n in BIG_UNWRITTEN]
    qemu_io(tcp, cmds)
    # After flush the bytes are in the backend file, at the right offsets.
    for off, n, p in BIG_WRITES:
        check(backend_bytes(state["big"], off, n) == bytes([p]) * n,
              "backend file lacks pattern 0x%02x at offset %d" % (p, off))
    for off, n in BIG_UNWRITTEN:
        check(backend_bytes(state["big"], off, n) == bytes(n),
              "backend file has non-zero bytes at unwritten offset %d" % off)
    check(os.path.getsize(state["big"]) == BIG_SIZE, "backend file changed size")


def t_zero_discard():
    unix, tcp = uris("big")
    z, zu, d = ZD_BASE + 1 * MiB, ZD_BASE + 2 * MiB, ZD_BASE + 3 * MiB
    qemu_io(unix, [
        "write -P 0x88 %d %d" % (ZD_BASE, ZD_LEN),
        "flush",
        "write -z %d %d" % (z, MiB),  # WRITE_ZEROES, no unmap
        "write -z -u %d %d" % (zu, MiB),  # WRITE_ZEROES, may unmap
        "discard %d %d" % (d, MiB),  # TRIM
        "read -P 0 %d %d" % (z, MiB),
        "read -P 0 %d %d" % (zu, MiB),
        "read -P 0x88 %d %d" % (ZD_BASE, MiB),
        "read -P 0x88 %d %d" % (ZD_BASE + 4 * MiB, MiB),
        "flush",
    ], extra=["-d", "unmap"])
    qemu_io(tcp, [
        "read -P 0 %d %d" % (z, MiB),
        "read -P 0 %d %d" % (zu, MiB),
        "read -P 0x88 %d %d" % (ZD_BASE, MiB),
        "read -P 0x88 %d %d" % (ZD_BASE + 4 * MiB, MiB),
    ])
    big = state["big"]
    check(backend_bytes(big, z, MiB) == bytes(MiB), "write -z: backend not zero")
    check(backend_bytes(big, zu, MiB) == bytes(MiB), "write -z -u: backend not zero")
    check(backend_bytes(big, ZD_BASE, MiB) == b"\x88" * MiB, "zero/discard hit a neighbour")
    check(backend_bytes(big, ZD_BASE + 4 * MiB, MiB) == b"\x88" * MiB,
          "zero/discard hit a neighbour")
    # TRIM leaves the contents unspecified by the protocol, but nbdcached
    # punches a hole: the space is given back and the backend reads zeros.
    check(backend_is_hole(big, d, MiB), "discard did not punch a hole in the backend file")
    check(backend_bytes(big, d, MiB) == bytes(MiB), "discarded range not zero in backend")
    log("info: write -z -u left a hole in the backend: %s" % backend_is_hole(big, zu, MiB))
    p = run(["qemu-io", "-f", "raw", "-c", "read -P 0 %d %d" % (d, MiB), unix], check_rc=False)
    log("info: discarded range reads as zeros over NBD: %s" % (p.returncode == 0))


def t_map():
    """base:allocation as qemu sees it."""
    unix, _ = uris("big")
    extents = run_json(["qemu-img", "map", "--output=json", "-f", "raw", unix], timeout=600)
    check(sum(e["length"] for e in extents) == BIG_SIZE, "qemu-img map does not cover the export")

    def overlapping(off, n):
        return [e for e in extents if e["start"] < off + n and off < e["start"] + e["length"]]

    # Correctness: data never claims to be zero.
    for off, n, _ in BIG_WRITES + [BIG_LARGE, (ZD_BASE, MiB, 0), (ZD_BASE + 4 * MiB, MiB, 0)]:
        for e in overlapping(off, n):
            check(not e["zero"], "qemu-img map says written range at %d reads as zero: %r" % (off, e))
    # Sparseness: a never written 1 MiB range of a sparse backend is a hole.
    off, n = 4 * GiB + 512 * MiB, MiB
    for e in overlapping(off, n):
        check(e["zero"] and not e["data"],
              "qemu-img map reports unwritten range at %d as data: %r" % (off, e))
    log("qemu-img map: %d extents" % len(extents))


def t_aio():
    """128 writes in flight, some FUA, then 128 reads in flight."""
    unix, tcp = uris("disk")
    n, size, stride = 128, 64 * KiB, 256 * KiB
    cmds = []
    for i in range(n):
        fua = "-f " if i % 8 == 0 else ""
        cmds.append("aio_write %s-P 0x%02x %d %d" % (fua, i % 250 + 1, i * stride, size))
    cmds += ["aio_flush", "flush"]
    for i in range(n):
        cmds.append("aio_read -P 0x%02x %d %d" % (i % 250 + 1, i * stride, size))
    cmds.append("aio_flush")
    out = qemu_io(unix, cmds)
    check(out.count("wrote %d/%d bytes" % (size, size)) == n, "not every aio_write completed")
    check(out.count("read %d/%d bytes" % (size, size)) == n, "not every aio_read completed")
    # The same from TCP with many synchronous commands in one session.
    out = qemu_io(tcp, ["read -P 0x%02x %d %d" % (i % 250 + 1, i * stride, size)
                        for i in range(0, n, 3)])
    for i in range(n):
        check(backend_bytes(state["disk"], i * stride, size) == bytes([i % 250 + 1]) * size,
              "aio_write %d not in the backend file after flush" % i)


def t_negotiation_log():
    lines = [l for l in state["daemon"].log_text().splitlines() if "negotiated" in l]
    log("daemon negotiation lines (%d):" % len(lines))
    for l in sorted(set(l.split("negotiated", 1)[1] for l in lines)):
        log("  negotiated%s" % l)
    log("info: qemu 10 negotiated extended headers (extended=1): %s"
        % any("extended=1" in l for l in lines))


def main():
    with nbdtest.tempdir() as tmp:
        state["tmp"] = tmp
        state["disk"] = nbdtest.sparse_file(os.path.join(tmp, "disk.img"), DISK_SIZE)
        state["big"] = nbdtest.sparse_file(os.path.join(tmp, "big.img"), BIG_SIZE)
        with nbdtest.Daemon([("disk", state["disk"], ""), ("big", state["big"], "")]) as d:
            state["daemon"] = d
            nbdtest.run_each((t_info, t_convert, t_convert_sparse, t_io_big, t_zero_discard,
                              t_map, t_aio, t_negotiation_log), d)
    log("all qemu checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
