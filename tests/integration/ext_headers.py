#!/usr/bin/python3
"""ext_headers: extended headers (64-bit effect lengths), three ways.

a. nbdcache-io (our client, proto/ codec) against nbdcached serving a
   64 TiB sparse file on /dev/shm:
     - info reports extended=1 (structured=1), the size; --no-extended
       gives compact headers, --no-structured simple replies;
     - write/read round trips above 2^32, across 2^40 and at the last
       bytes, in all three header modes, each read back in all three; a
       40 MiB + 1 write/read (split by the 32 MiB maximum payload);
     - one TRIM of 2^40 bytes and one WRITE_ZEROES of 2^45 bytes (single
       requests, as the client's --debug trace shows), read back as zeros
       at a few windows while the neighbours keep their bytes; the same in
       compact form (split at 2^32 - 4096) and with simple replies;
     - CACHE of 2^40 bytes;
     - BLOCK_STATUS over the 2^45 zeroed bytes: one hole extent of 2^45
       bytes (impossible with 32-bit descriptors); REQ_ONE; compact status
       capped at 32 bits;
     - errors: write/zero past the end NBD_ENOSPC, read/trim/cache/status
       past the end NBD_EINVAL, in every mode.
b. qemu-io (qemu 10) against nbdcached: write/read -P, discard, write -z,
   a 2 TiB write -z in one request; read back with nbdcache-io too; the
   daemon log shows extended=1 for qemu's connection.
c. qemu-nbd as the server (a peer implementation): the same script as (a)
   through nbdcache-io, with the same results (reads, extents, errors; the
   only tolerated difference is EINVAL for writes past the end, which the
   spec recommends be ENOSPC). That cross-checks our codec against qemu's.
The sparse files are removed at the end; their allocated size is checked
after each part so that no fallback can fill /dev/shm.
"""

import os
import random
import re
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import check, fail, log  # noqa: E402

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
HUGE = 64 * TiB
COMPACT_STEP = 2**32 - 4096  # how the client splits effect lengths in compact mode
HOLE = 3                     # NBD_STATE_HOLE | NBD_STATE_ZERO
MAX_ALLOCATED = 512 * MiB    # what the sparse files may really use on tmpfs

EXTENDED, COMPACT, SIMPLE = (), ("--no-extended",), ("--no-structured",)
MODES = (("extended", EXTENDED), ("compact", COMPACT), ("simple", SIMPLE))

# Round trips: (offset, length), outside the trim and zero regions.
ROUND_TRIPS = [
    (2**32 - 2048, 4096),        # straddles 4 GiB
    (2**32 + 12345, 70000),
    (TiB - 1, 2),                # straddles 2^40
    (48 * TiB + 7, 100000),
    (HUGE - 8192, 4096),
    (HUGE - 1, 1),               # the last byte
]
BIG_WRITE = (44 * TiB + 3, 40 * MiB + 1)  # more than one maximum payload

# The trim region (2^40 bytes) and the zero region (2^45 bytes), each with a
# 4 KiB sentinel just before and just after, and data written inside first.
TRIM = (2 * TiB, 2**40)
ZERO = (8 * TiB, 2**45)


def inside(region):
    off, n = region
    return [(off, 64 * KiB), (off + n // 2 + 12345, 5000), (off + n - 64 * KiB, 64 * KiB)]


def sentinels(region):
    off, n = region
    return [(off - 4096, 4096), (off + n, 4096)]


# ---------------------------------------------------------------------------
# nbdcache-io


def io(target, mode, command, *args, data=None, timeout=180):
    cmd = [nbdtest.NBDCACHE_IO] + list(target) + list(mode) + [command] + [str(a) for a in args]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, input=data, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail("timed out after %ds: %s" % (timeout, " ".join(cmd)))
    err = p.stderr.decode(errors="replace")
    log("+ %s -> exit %d (%.2fs)" % (" ".join(cmd), p.returncode, time.time() - t0))
    if err and "--debug" not in args:
        log("  " + err.rstrip().replace("\n", "\n  ")[-2000:])
    p.err = err
    return p


def ok(target, mode, command, *args, data=None):
    p = io(target, mode, command, *args, data=data)
    check(p.returncode == 0, "%s %s %s: exit %d: %s"
          % (" ".join(mode) or "extended", command, args, p.returncode, p.err.strip()))
    return p.stdout


def nbd_error(target, mode, command, *args, data=None):
    """Run a command that must fail with an NBD error; return the error's name."""
    p = io(target, mode, command, *args, data=data)
    last = p.err.strip().splitlines()[-1] if p.err.strip() else ""
    m = re.fullmatch(r"nbdcache-io: %s: (NBD_E\w+)" % command, last)
    check(p.returncode == 1 and m, "%s %s %s: exit %d, stderr %r; expected an NBD error"
          % (" ".join(mode) or "extended", command, args, p.returncode, last))
    return m.group(1)


def info(target, mode=EXTENDED):
    out = ok(target, mode, "info").decode()
    return dict(line.split("=", 1) for line in out.splitlines())


def status(target, mode, off, n, *flags):
    out = ok(target, mode, "status", off, n, *flags).decode()
    return [tuple(int(x) for x in line.split()) for line in out.splitlines()]


def requests(trace, command):
    """(offset, length) of every request of one type in a --debug trace."""
    return [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
        r"-> NBD_CMD_%s flags=0x[0-9a-f]+ offset=(\d+) length=(\d+)" % command, trace)]


def clip(extents, off, n):
    """Extents cut at the end of the request (the last one may run past it)."""
    out = []
    for o, ln, f in extents:
        if o < off + n:
            out.append((o, min(ln, off + n - o), f))
    return out


def check_allocated(path):
    used = nbdtest.allocated(path)
    check(used < MAX_ALLOCATED, "%s uses %d MiB of tmpfs: some request allocated its range"
          % (path, used >> 20))


class Script:
    """The request script of part (a), run against one server.

    Every result that a server decides (bytes read, extents, error names) is
    collected in self.results, so two servers can be compared at the end.
    """

    def __init__(self, name, target, write_past_end_errors, cache_length):
        self.name = name
        self.target = target
        self.write_errors = write_past_end_errors
        self.cache_length = cache_length  # the CACHE request of t_cache
        self.model = []  # (offset, bytes) written, in order, over zeros
        self.rng = random.Random(20261203)  # the same data for every server
        self.results = {}

    def write(self, mode, off, data, *flags):
        ok(self.target, mode, "write", off, len(data), *flags, data=data)
        self.model.append((off, data))

    def verify(self, mode, off, n, what):
        got = ok(self.target, mode, "read", off, n)
        want = nbdtest.model_bytes(self.model, off, n)
        if got != want:
            i = nbdtest.first_diff(got, want)
            fail("%s: %s: read %s [%d, +%d) differs at %d (got %d bytes)"
                 % (self.name, what, mode or "extended", off, n, off + i, len(got)))
        self.results["read %s %d %d" % (" ".join(mode), off, n)] = got

    def t_info(self):
        for label, mode in MODES:
            i = info(self.target, mode)
            check(i.get("size") == str(HUGE), "%s: size %r" % (self.name, i.get("size")))
            want = {"extended": ("1", "1"), "compact": ("0", "1"), "simple": ("0", "0")}[label]
            check((i.get("extended"), i.get("structured")) == want,
                  "%s %s: extended=%r structured=%r, expected %r" %
                  (self.name, label, i.get("extended"), i.get("structured"), want))
            self.results["info " + label] = (i["size"], i["extended"], i["structured"])

    def t_round_trips(self):
        for label, mode in MODES:
            for off, n in ROUND_TRIPS:
                self.write(mode, off, self.rng.randbytes(n), *(("--fua",) if n == 1 else ()))
            for _, read_mode in MODES:
                for off, n in ROUND_TRIPS:
                    self.verify(read_mode, max(0, off - 100), min(n + 200, HUGE - off + 100),
                                "round trip written %s" % label)
        off, n = BIG_WRITE
        self.write(EXTENDED, off, self.rng.randbytes(n))
        self.verify(COMPACT, off, n, "40 MiB write")
        self.write(COMPACT, off + MiB, self.rng.randbytes(n))
        self.verify(EXTENDED, off - 1, n + MiB + 2, "40 MiB compact write")
        ok(self.target, EXTENDED, "flush")

    def fill(self, region):
        """Data inside `region` and sentinels around it."""
        for off, n in inside(region) + sentinels(region):
            self.write(EXTENDED, off, self.rng.randbytes(n))

    def check_cleared(self, region, mode, what):
        for off, n in inside(region):
            self.model.append((off, bytes(n)))
        for off, n in inside(region) + sentinels(region):
            self.verify(mode, off, n, what)

    def cleared_by(self, command, region, mode, label):
        """One trim/zero over `region`; its requests, from the --debug trace."""
        off, n = region
        self.fill(region)
        p = io(self.target, mode, command, off, n, "--debug")
        check(p.returncode == 0, "%s: %s %s %d %d: exit %d: %s" % (
            self.name, label, command, off, n, p.returncode, p.err[-2000:]))
        sent = requests(p.err, {"trim": "TRIM", "zero": "WRITE_ZEROES"}[command])
        if mode == EXTENDED:
            check(sent == [(off, n)], "%s: extended %s of %d bytes went out as %r"
                  % (self.name, command, n, sent[:4]))
        else:
            check(len(sent) == -(-n // COMPACT_STEP) and sum(ln for _, ln in sent) == n
                  and all(ln < 2**32 for _, ln in sent),
                  "%s: %s %s of %d bytes: %d requests" % (self.name, label, command, n, len(sent)))
        log("  %s %s of %d bytes: %d request(s)" % (label, command, n, len(sent)))
        self.check_cleared(region, EXTENDED if mode != EXTENDED else COMPACT,
                           "%s %s" % (label, command))

    def t_trim_zero(self):
        for label, mode in MODES:
            self.cleared_by("trim", TRIM, mode, label)
            self.cleared_by("zero", ZERO, mode, label)
        ok(self.target, EXTENDED, "zero", ZERO[0], ZERO[1], "--fast")
        self.verify(EXTENDED, ZERO[0] + ZERO[1] - 4096, 8192, "fast zero")
        ok(self.target, EXTENDED, "flush")

    def t_status(self):
        zoff, zlen = ZERO
        r = {}
        # The whole 2^45 zeroed range: one extent, far beyond 32 bits.
        r["ext"] = status(self.target, EXTENDED, zoff, zlen)
        check(r["ext"] == [(zoff, zlen, HOLE)], "%s: extended status of the zeroed 2^45 "
              "bytes: %r, expected one hole extent" % (self.name, r["ext"][:4]))
        r["ext one"] = status(self.target, EXTENDED, zoff, zlen, "--req-one")
        check(r["ext one"] == [(zoff, zlen, HOLE)], "%s: REQ_ONE status: %r"
              % (self.name, r["ext one"]))
        # REQ_ONE: one extent, never longer than the request.
        r["one short"] = status(self.target, EXTENDED, zoff, MiB, "--req-one")
        check(r["one short"] == [(zoff, MiB, HOLE)], "%s: REQ_ONE status over 1 MiB of "
              "hole: %r" % (self.name, r["one short"]))
        r["one data"] = status(self.target, EXTENDED, zoff - 4096, zlen, "--req-one")
        check(r["one data"] == [(zoff - 4096, 4096, 0)], "%s: REQ_ONE status from the "
              "sentinel: %r" % (self.name, r["one data"]))
        # Around the sentinels (the last extent may run past the request).
        for label, mode in MODES[:2]:
            got = clip(status(self.target, mode, zoff - 4096, 8192), zoff - 4096, 8192)
            check(got == [(zoff - 4096, 4096, 0), (zoff, 4096, HOLE)],
                  "%s: %s status across the sentinel: %r" % (self.name, label, got))
            got = clip(status(self.target, mode, zoff + zlen - 4096, 8192), zoff + zlen - 4096,
                       8192)
            check(got == [(zoff + zlen - 4096, 4096, HOLE), (zoff + zlen, 4096, 0)],
                  "%s: %s status across the end sentinel: %r" % (self.name, label, got))
            r["sentinel " + label] = got
        # Compact: the request is clamped to 32 bits, and so is the extent.
        r["compact"] = status(self.target, COMPACT, zoff, zlen)
        check(len(r["compact"]) == 1 and r["compact"][0][0] == zoff and
              r["compact"][0][2] == HOLE and COMPACT_STEP <= r["compact"][0][1] < 2**32,
              "%s: compact status of 2^45 bytes of hole: %r" % (self.name, r["compact"]))
        r["compact one"] = status(self.target, COMPACT, zoff, zlen, "--req-one")
        check(r["compact one"] == [(zoff, COMPACT_STEP, HOLE)], "%s: compact REQ_ONE: %r"
              % (self.name, r["compact one"]))
        for k, v in r.items():
            self.results["status " + k] = v

    def t_cache(self):
        for label, mode in MODES:
            ok(self.target, mode, "cache", 0, self.cache_length)
        ok(self.target, EXTENDED, "cache", HUGE - MiB, MiB)

    def t_errors(self):
        end = HUGE
        for label, mode in MODES:
            e = {
                "write": nbd_error(self.target, mode, "write", end - 4096, 8192,
                                   data=bytes(8192)),
                "zero": nbd_error(self.target, mode, "zero", end - 4096, 8192),
                "zero 2^45": nbd_error(self.target, mode, "zero", end - 4096, 2**45),
                "read": nbd_error(self.target, mode, "read", end - 1, 2),
                "trim": nbd_error(self.target, mode, "trim", end - 4096, 2**40),
                "cache": nbd_error(self.target, mode, "cache", end - 4096, 8192),
            }
            if mode != SIMPLE:
                e["status"] = nbd_error(self.target, mode, "status", end, 1)
            for what, got in e.items():
                want = self.write_errors if what.startswith(("write", "zero")) else ("NBD_EINVAL",)
                check(got in want, "%s: %s %s past the end: %s, expected %s"
                      % (self.name, label, what, got, " or ".join(want)))
                self.results["error %s %s" % (label, what)] = got
            # The connection is still good after an error: a read at the end works.
            self.verify(mode, end - 4096, 4096, "read after errors")

    def run(self):
        nbdtest.run_each((self.t_info, self.t_round_trips, self.t_trim_zero, self.t_status,
                          self.t_cache, self.t_errors), prefix=self.name + ": ")


# ---------------------------------------------------------------------------
# qemu


def negotiated(text):
    return re.findall(r'export "(\w*)" negotiated structured=(\d) extended=(\d) meta=(\d)', text)


def part_qemu_io(d, target):
    """qemu-io on export "q"; target is nbdcache-io's address of the same daemon."""
    uri = d.unix_uri("q")
    before = d.log_text()
    cmds = [
        "write -P 0x5a %d %d" % (2**32 - 4096, 64 * KiB),          # straddles 4 GiB
        "write -P 0x6b %d %d" % (HUGE - 64 * KiB, 64 * KiB),       # the last 64 KiB
        "write -P 0x7c %d %d" % (16 * TiB + 512, 4096),            # unaligned, at 2^44
        "write -P 0x8d %d %d" % (9 * TiB, 64 * KiB),               # inside the 2 TiB below
        "write -P 0x9e %d %d" % (10 * TiB, 4096),                  # just after it
        "flush",
        "read -P 0x5a %d %d" % (2**32 - 4096, 64 * KiB),
        "read -P 0x6b %d %d" % (HUGE - 64 * KiB, 64 * KiB),
        "read -P 0x7c %d %d" % (16 * TiB + 512, 4096),
        "discard %d %d" % (16 * TiB, 64 * KiB),                    # TRIM
        "read -P 0 %d %d" % (16 * TiB, 64 * KiB),
        "write -z %d %d" % (HUGE - 64 * KiB, 32 * KiB),            # WRITE_ZEROES, NO_HOLE
        "read -P 0 %d %d" % (HUGE - 64 * KiB, 32 * KiB),
        "read -P 0x6b %d %d" % (HUGE - 32 * KiB, 32 * KiB),
        "write -z -u -n %d %d" % (8 * TiB, 2 * TiB),               # one 2 TiB WRITE_ZEROES
        "read -P 0 %d %d" % (9 * TiB, 64 * KiB),
        "read -P 0x9e %d %d" % (10 * TiB, 4096),
    ]
    nbdtest.qemu_io(uri, cmds, failure_words=("failed", "error", "cannot"))
    new = d.log_text()[len(before):]
    conns = negotiated(new)
    log("  qemu-io negotiated: %r" % conns)
    check(conns and all(c[:3] == ("q", "1", "1") for c in conns),
          "qemu-io's connection did not negotiate extended headers: %r" % conns)
    # qemu sent the 2 TiB zero as one request (a 64-bit effect length).
    check(re.search(r"NBD_CMD_WRITE_ZEROES flags 0x[0-9a-f]+ offset %d length %d"
                    % (8 * TiB, 2 * TiB), new),
          "no single 2 TiB WRITE_ZEROES from qemu-io in the daemon log")
    # Our client reads what qemu wrote.
    for off, n, fill in ((2**32 - 4096, 64 * KiB, 0x5a), (HUGE - 64 * KiB, 32 * KiB, 0),
                         (HUGE - 32 * KiB, 32 * KiB, 0x6b), (16 * TiB, 64 * KiB, 0),
                         (9 * TiB, 64 * KiB, 0), (10 * TiB, 4096, 0x9e)):
        for label, mode in MODES:
            got = ok(target, mode, "read", off, n, "--export", "q")
            check(got == bytes([fill]) * n, "nbdcache-io %s reads [%d, +%d) written by qemu-io"
                  " as something other than 0x%02x" % (label, off, n, fill))
    st = status(target, EXTENDED, 8 * TiB, 2 * TiB, "--export", "q")
    check(st == [(8 * TiB, 2 * TiB, HOLE)], "status after qemu's 2 TiB zero: %r" % st)


class QemuNbd:
    """qemu-nbd serving a raw file on a Unix socket; stopped by its PID.

    --discard=unmap: with the default (ignore) qemu-nbd neither punches on
    TRIM nor on WRITE_ZEROES; on tmpfs, which cannot ZERO_RANGE, it would
    then allocate the zeroed range (terabytes here).
    """

    def __init__(self, sock, path):
        self.sock = sock
        args = ["qemu-nbd", "-k", sock, "-f", "raw", "-t", "--discard=unmap", path]
        log("+ " + " ".join(args))
        self.logpath = sock + ".log"
        self.logf = open(self.logpath, "w")
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT)
        deadline = time.time() + 15
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                fail("qemu-nbd did not start: %s" % open(self.logpath).read()[-2000:])
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def compare(a, b, tolerated):
    keys = sorted(set(a.results) | set(b.results))
    differ = [k for k in keys if a.results.get(k) != b.results.get(k)]
    for k in differ:
        log("  %s: %s %r, %s %r" % (k, a.name, a.results.get(k), b.name, b.results.get(k)))
    bad = [k for k in differ if not tolerated(k, a.results.get(k), b.results.get(k))]
    check(not bad, "%s and %s differ on %s" % (a.name, b.name, ", ".join(bad)))
    log("  %d results compared, %d identical, %d tolerated differences"
        % (len(keys), len(keys) - len(differ), len(differ)))


def main():
    shm = nbdtest.shm_dir()
    if shm is None:
        nbdtest.skip("no tmpfs at /dev/shm for 64 TiB sparse files")
    # The daemon logs every command at debug: part (b) finds qemu's there.
    os.environ["NBDCACHED_DEBUG"] = "1"
    with nbdtest.tempdir(prefix="nbdcached-ext-", base=shm) as stmp:
        files = {n: nbdtest.sparse_file(os.path.join(stmp, n + ".img"), HUGE)
                 for n in ("huge", "q", "peer")}
        with nbdtest.Daemon([("huge", files["huge"], ""), ("q", files["q"], "")]) as d:
            target = ("--unix", d.sock)
            ours = Script("nbdcached", target, ("NBD_ENOSPC",), cache_length=2**40)
            ours.run()
            # The same over TCP.
            tcp = ("--tcp", "127.0.0.1:%d" % d.port)
            i = info(tcp)
            check((i.get("size"), i.get("extended")) == (str(HUGE), "1"), "TCP info: %r" % i)
            for mode in (EXTENDED, COMPACT):
                check(ok(tcp, mode, "read", HUGE - 8192, 8192) ==
                      nbdtest.model_bytes(ours.model, HUGE - 8192, 8192),
                      "TCP read of the last 8 KiB")
            check_allocated(files["huge"])
            log("=== qemu-io against nbdcached")
            part_qemu_io(d, target)
            check_allocated(files["q"])
            log("ok qemu-io against nbdcached")
            check(d.alive(), "nbdcached died")
        # qemu-nbd: write past the end is EINVAL there (the spec: SHOULD be
        # ENOSPC); CACHE is capped at its 32 MiB maximum, so a small one.
        peer = QemuNbd(os.path.join(stmp, "peer.sock"), files["peer"])
        try:
            theirs = Script("qemu-nbd", ("--unix", peer.sock), ("NBD_ENOSPC", "NBD_EINVAL"),
                            cache_length=32 * MiB)
            theirs.run()
            check_allocated(files["peer"])
            check(peer.proc.poll() is None, "qemu-nbd died")
        finally:
            peer.stop()
        log("=== nbdcached and qemu-nbd give the same results")
        compare(ours, theirs, lambda k, a, b: k.startswith(("error", "status compact"))
                and (k.startswith("status") or (a, b) == ("NBD_ENOSPC", "NBD_EINVAL")))
        for f in files.values():
            os.unlink(f)
    log("all extended-header checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
