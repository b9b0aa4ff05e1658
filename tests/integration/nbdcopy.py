#!/usr/bin/python3
"""Interop with nbdcopy (libnbd 1.14): whole-image copies in and out.

What a user of nbdcopy relies on:
  - a 64 MiB random file copied into an export and back out to a new file
    is the same file (sha256), and after --flush it is in the backend file;
  - the same with --connections=4 --requests=64 (the export advertises
    multi-conn, so nbdcopy really opens four connections), over TCP;
  - a sparse source copied over random data: the holes read back as zeros,
    block status (base:allocation, via nbdinfo --map) reports them as zero,
    never reports data as zero, and the backend file stays sparse;
  - nbdcopy from one export of the daemon to another (data and sparse
    images, the latter steered by the source's block status).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import allocated, check, log, run, run_json  # noqa: E402
from nbdtest import sha256_file as sha  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
SIZE = 64 * MiB
# Data runs of the sparse source: (offset, length); everything else is a hole.
SPARSE_DATA = [(0, 1 * MiB), (10 * MiB, 3 * MiB), (31 * MiB + 64 * KiB, 192 * KiB),
               (SIZE - 2 * MiB, 2 * MiB)]

state = {}


def uri(name, tcp=False):
    d = state["daemon"]
    return d.tcp_uri(name) if tcp else d.unix_uri(name)


def copy_out_and_compare(name, want_sha, tcp=False, extra=()):
    out = os.path.join(state["tmp"], "out-%s.raw" % name)
    if os.path.exists(out):
        os.unlink(out)
    run(["nbdcopy"] + list(extra) + [uri(name, tcp), out])
    nbdtest.sha256_matches(out, want_sha, SIZE,
                           "export %s copied out, compared with what was copied in" % name)
    os.unlink(out)


def block_status(name):
    extents = run_json(["nbdinfo", "--map", "--json", uri(name)])
    check(sum(e["length"] for e in extents) == SIZE, "nbdinfo --map does not cover %s" % name)
    return extents


def check_sparse_copy(name):
    """Export `name` must now hold the sparse image: bytes, block status and
    backend allocation."""
    backend = state[name]
    check(sha(backend) == state["sparse_sha"],
          "backend of %s differs from the sparse source after nbdcopy --flush" % name)
    extents = block_status(name)
    data_bytes = sum(n for _, n in SPARSE_DATA)
    for e in extents:
        for off, n in SPARSE_DATA:
            if e["offset"] < off + n and off < e["offset"] + e["length"]:
                check(not e["type"] & 2,
                      "block status calls data at %d of %s zero: %r" % (off, name, e))
    zero = sum(e["length"] for e in extents if e["type"] & 2)
    log("%s: block status reports %d of %d hole bytes as zero; backend allocation %d bytes "
        "(%d bytes of data)" % (name, zero, SIZE - data_bytes, allocated(backend), data_bytes))
    check(zero >= SIZE - data_bytes - 1 * MiB,
          "block status of %s reports %d zero bytes, the source has %d bytes of holes"
          % (name, zero, SIZE - data_bytes))
    check(allocated(backend) <= data_bytes + 1 * MiB,
          "holes not preserved: backend of %s has %d bytes allocated for %d bytes of data"
          % (name, allocated(backend), data_bytes))


def t_info():
    info = run_json(["nbdinfo", "--json", uri("a")])["exports"][0]
    check(info["export-size"] == SIZE, "nbdinfo: wrong size %r" % info["export-size"])
    check(info["can_multi_conn"], "export does not advertise multi-conn")
    check("base:allocation" in info.get("contexts", []), "no base:allocation meta context")
    check(info["can_zero"] and info["can_trim"] and info["can_flush"],
          "export lacks WRITE_ZEROES, TRIM or FLUSH")


def t_copy_in_out():
    src = nbdtest.random_file(os.path.join(state["tmp"], "src1.raw"), SIZE, seed=21)
    want = sha(src)
    run(["nbdcopy", src, uri("a")])
    copy_out_and_compare("a", want)
    run(["nbdcopy", "--flush", src, uri("a", tcp=True)])
    check(sha(state["a"]) == want, "backend of a differs from the source after nbdcopy --flush")


def t_multi_conn():
    src = nbdtest.random_file(os.path.join(state["tmp"], "src2.raw"), SIZE, seed=22)
    want = sha(src)
    flags = ["--connections=4", "--requests=64"]
    run(["nbdcopy", "--flush"] + flags + [src, uri("a", tcp=True)])
    check(sha(state["a"]) == want, "backend of a differs after a 4-connection nbdcopy")
    copy_out_and_compare("a", want, extra=flags)
    copy_out_and_compare("a", want, tcp=True, extra=flags + ["--request-size=65536"])
    state["src2_sha"] = want


def t_sparse():
    s = state["s"]
    # Random data first, so the holes of the copy must really be zeroed.
    rnd = nbdtest.random_file(os.path.join(state["tmp"], "src3.raw"), SIZE, seed=23)
    run(["nbdcopy", "--flush", rnd, uri("s")])
    check(sha(s) == sha(rnd), "backend of s differs after copying random data")
    os.unlink(rnd)
    sparse = nbdtest.data_runs_file(os.path.join(state["tmp"], "sparse.raw"), SIZE, SPARSE_DATA)
    state["sparse_sha"] = sha(sparse)
    # Default sparse detection: holes become zero requests (may trim).
    run(["nbdcopy", "--flush", "--connections=4", "--requests=64", sparse, uri("s")])
    check_sparse_copy("s")
    copy_out_and_compare("s", state["sparse_sha"])


def t_between_exports():
    # Data: a -> b, one connection, Unix socket to TCP.
    run(["nbdcopy", "--flush", uri("a"), uri("b", tcp=True)])
    check(sha(state["b"]) == state["src2_sha"], "backend of b differs from a after a -> b")
    copy_out_and_compare("b", state["src2_sha"])
    # Sparse: s -> b over random data, four connections; the source's block
    # status tells nbdcopy where the holes are.
    run(["nbdcopy", "--flush", "--connections=4", "--requests=64", uri("s"), uri("b")])
    check_sparse_copy("b")
    # And back: b -> a, then a must hold the sparse image too.
    run(["nbdcopy", "--flush", uri("b", tcp=True), uri("a", tcp=True)])
    check(sha(state["a"]) == state["sparse_sha"], "backend of a differs after b -> a")


def main():
    with nbdtest.tempdir() as tmp:
        state["tmp"] = tmp
        for name in ("a", "b", "s"):
            state[name] = nbdtest.sparse_file(os.path.join(tmp, name + ".img"), SIZE)
        with nbdtest.Daemon([(n, state[n], "") for n in ("a", "b", "s")]) as d:
            state["daemon"] = d
            nbdtest.run_each((t_info, t_copy_in_out, t_multi_conn, t_sparse, t_between_exports), d)
    log("all nbdcopy checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
