#!/usr/bin/python3
"""nbdinfo: what a user sees with nbdinfo(1) on the daemon's URIs.

  - the exact size in bytes (--size), for every export and for "" (the first)
  - --list: every export, with its description (human and --json output)
  - --map: matches the backend's real data/hole layout (SEEK_DATA/SEEK_HOLE),
    human and --json output, and --totals
  - --json: export-size, block sizes, is_read_only and every can_* field as
    the contract promises, for a writable, a readonly and a block-size= export
  - the real size of a 64 TiB sparse file on /dev/shm (ext4 caps a file at
    16 TiB), and its map (data islands at 0, 2^40 and the last 4 KiB)
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
TIB = 1024 ** 4
HUGE = 64 * TIB
HOLE_ZERO = nbdtest.HOLE_ZERO

# data islands of the "disk" export; everything else is a hole
DISK_SIZE = 16 * MIB
DISK_DATA = [(0, 4 * MIB), (8 * MIB, 10 * MIB), (12 * MIB, 12 * MIB + 4 * KIB),
             (12 * MIB + 64 * KIB, 12 * MIB + 192 * KIB), (DISK_SIZE - 4 * KIB, DISK_SIZE)]
HUGE_DATA = [(0, 4 * KIB), (1 << 40, (1 << 40) + 64 * KIB), (HUGE - 4 * KIB, HUGE)]
ODD_SIZE = 1000001

CHECKS = nbdtest.Checks()
expect = CHECKS.expect   # records the failure and carries on


def nbdinfo(*args, rc=0):
    p = nbdtest.run(["nbdinfo"] + list(args), check_rc=False)
    if rc is not None and p.returncode != rc:
        expect(False, "nbdinfo %s exited %d, expected %d: %s"
               % (" ".join(map(str, args)), p.returncode, rc, p.stderr.strip()[-500:]))
    return p


def write_islands(path, size, islands, seed):
    nbdtest.data_runs_file(path, size, [(s, e - s) for s, e in islands], seed)


def file_map(path, size):
    """(offset, length, type) from SEEK_DATA/SEEK_HOLE: type 0 data, 3 hole."""
    return [(s, e - s, f) for s, e, f in nbdtest.file_layout(path, size)]


def merge(entries):
    out = []
    for off, ln, typ in entries:
        if out and out[-1][2] == typ and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + ln, typ)
        else:
            out.append((off, ln, typ))
    return out


def islands_map(size, islands):
    out = []
    pos = 0
    for s, e in islands:
        if s > pos:
            out.append((pos, s - pos, HOLE_ZERO))
        out.append((s, e - s, 0))
        pos = e
    if pos < size:
        out.append((pos, size - pos, HOLE_ZERO))
    return out


def parse_map_text(text):
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3:
            continue
        rows.append((int(parts[0]), int(parts[1]), int(parts[2]),
                     parts[3].strip() if len(parts) > 3 else ""))
    return rows


def check_map(uri, path, size, want, what):
    expect(file_map(path, size) == want, "%s: test setup: the file's layout is %r"
           % (what, file_map(path, size)[:8]))
    p = nbdinfo("--map", uri)
    rows = parse_map_text(p.stdout)
    got = merge([(o, ln, t) for o, ln, t, _ in rows])
    expect(got == want, "%s: nbdinfo --map %r, file %r" % (what, got[:8], want[:8]))
    descs = {t: d for _, _, t, d in rows}
    expect(descs.get(0, "data") == "data" and descs.get(3, "hole,zero") == "hole,zero",
           "%s: map descriptions %r" % (what, descs))
    p = nbdinfo("--map", "--json", uri)
    try:
        js = json.loads(p.stdout)
        got = merge([(e["offset"], e["length"], e["type"]) for e in js])
        expect(got == want, "%s: nbdinfo --map --json %r" % (what, got[:8]))
    except (ValueError, KeyError, TypeError) as e:
        expect(False, "%s: --map --json output unparsable: %s" % (what, e))
    p = nbdinfo("--map", "--totals", uri)
    totals = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            totals[int(parts[2])] = int(parts[0])
    data = sum(ln for _, ln, t in want if t == 0)
    expect(totals.get(0, 0) == data and totals.get(3, 0) == size - data,
           "%s: --totals %r, expected data %d hole %d" % (what, totals, data, size - data))


def contract_json(export, readonly, preferred=4096):
    """The fields nbdinfo --json must show, per the daemon contract."""
    want = {
        "is_read_only": readonly,
        "can_cache": True, "can_df": True, "can_flush": True, "can_fua": True,
        "can_multi_conn": True,
        "can_trim": not readonly, "can_zero": not readonly, "can_fast_zero": not readonly,
        "block_size_minimum": 1, "block_size_preferred": preferred,
        "block_size_maximum": 32 * MIB,
    }
    return want


def check_json(uri, name, size, desc, readonly, preferred=4096):
    p = nbdinfo("--json", uri)
    try:
        js = json.loads(p.stdout)
    except ValueError as e:
        expect(False, "%s: --json unparsable: %s" % (name, e))
        return
    expect(js.get("protocol") == "newstyle-fixed", "%s: protocol %r" % (name, js.get("protocol")))
    expect(js.get("structured") is True, "%s: structured replies not negotiated" % name)
    exps = js.get("exports", [])
    if not expect(len(exps) == 1, "%s: %d exports in --json" % (name, len(exps))):
        return
    e = exps[0]
    expect(e.get("export-size") == size, "%s: export-size %r, expected %d"
           % (name, e.get("export-size"), size))
    expect(e.get("export-name") == name, "%s: export-name %r" % (name, e.get("export-name")))
    expect(e.get("description", "") == desc, "%s: description %r, expected %r"
           % (name, e.get("description"), desc))
    expect("base:allocation" in e.get("contexts", []), "%s: contexts %r" % (name, e.get("contexts")))
    for k, v in contract_json(name, readonly, preferred).items():
        expect(e.get(k) == v, "%s: %s is %r, expected %r" % (name, k, e.get(k), v))


def main():
    shm = nbdtest.shm_dir()
    if shm is None:
        nbdtest.skip("no tmpfs at /dev/shm for the 64 TiB sparse file")
    with nbdtest.tempdir() as tmp, nbdtest.tempdir(prefix="nbdcached-nbdinfo-", base=shm) as stmp:
        disk = os.path.join(tmp, "disk.img")
        write_islands(disk, DISK_SIZE, DISK_DATA, 1)
        ro = nbdtest.random_file(os.path.join(tmp, "ro.img"), 3 * MIB, seed=2)
        odd = nbdtest.random_file(os.path.join(tmp, "odd.img"), ODD_SIZE, seed=3)
        bs = nbdtest.sparse_file(os.path.join(tmp, "bs.img"), 2 * MIB)
        huge = os.path.join(stmp, "huge.img")
        write_islands(huge, HUGE, HUGE_DATA, 4)
        exports = [
            ("disk", disk, "description=main disk"),
            ("ro", ro, "readonly,description=read only copy"),
            ("odd", odd, ""),
            ("bs", bs, "block-size=65536,description=big blocks"),
            ("huge", huge, "description=sixty-four tebibytes"),
        ]
        descs = {"disk": "main disk", "ro": "read only copy", "odd": "",
                 "bs": "big blocks", "huge": "sixty-four tebibytes"}
        sizes = {"disk": DISK_SIZE, "ro": 3 * MIB, "odd": ODD_SIZE, "bs": 2 * MIB, "huge": HUGE}
        with nbdtest.Daemon(exports) as d:
            # --size, exact bytes, over TCP and Unix.
            for name, size in sizes.items():
                for uri in (d.tcp_uri(name), d.unix_uri(name)):
                    p = nbdinfo("--size", uri)
                    expect(p.stdout.strip() == str(size), "--size %s: %r, expected %d"
                           % (uri, p.stdout.strip(), size))
            p = nbdinfo("--size", d.tcp_uri(""))
            expect(p.stdout.strip() == str(DISK_SIZE), "--size of \"\" (first export): %r"
                   % p.stdout.strip())

            # --list, human and JSON.
            p = nbdinfo("--list", d.tcp_uri())
            for name, desc in descs.items():
                expect('export="%s":' % name in p.stdout, "--list does not name %s" % name)
                if desc:
                    expect("description: %s" % desc in p.stdout,
                           "--list lacks description %r" % desc)
            listed = [ln.split('"')[1] for ln in p.stdout.splitlines() if ln.startswith("export=")]
            expect(sorted(listed) == sorted(descs), "--list exports %r" % listed)
            p = nbdinfo("--list", "--json", d.unix_uri())
            try:
                js = json.loads(p.stdout)
                got = {e["export-name"]: (e.get("description", ""), e.get("export-size"))
                       for e in js["exports"]}
                want = {n: (descs[n], sizes[n]) for n in descs}
                expect(got == want, "--list --json %r, expected %r" % (got, want))
            except (ValueError, KeyError, TypeError) as e:
                expect(False, "--list --json unparsable: %s" % e)

            # --json per export.
            check_json(d.tcp_uri("disk"), "disk", DISK_SIZE, "main disk", False)
            check_json(d.unix_uri("ro"), "ro", 3 * MIB, "read only copy", True)
            check_json(d.tcp_uri("bs"), "bs", 2 * MIB, "big blocks", False, preferred=65536)
            check_json(d.tcp_uri("odd"), "odd", ODD_SIZE, "", False)
            check_json(d.tcp_uri("huge"), "huge", HUGE, "sixty-four tebibytes", False)

            # --is / --can, the way scripts use them (exit status).
            for args, rc in ((("--is", "readonly"), 0), (("--can", "trim"), 2)):
                p = nbdinfo(*args, d.tcp_uri("ro"), rc=None)
                expect(p.returncode == rc, "nbdinfo %s on ro: exit %d, expected %d"
                       % (" ".join(args), p.returncode, rc))
            p = nbdinfo("--is", "readonly", d.tcp_uri("disk"), rc=None)
            expect(p.returncode == 2, "--is readonly on disk: exit %d" % p.returncode)

            # --map against the real layout.
            check_map(d.tcp_uri("disk"), disk, DISK_SIZE, islands_map(DISK_SIZE, DISK_DATA), "disk")
            check_map(d.unix_uri("odd"), odd, ODD_SIZE, file_map(odd, ODD_SIZE), "odd")
            check_map(d.tcp_uri("bs"), bs, 2 * MIB, [(0, 2 * MIB, HOLE_ZERO)], "bs (all hole)")
            check_map(d.unix_uri("huge"), huge, HUGE, islands_map(HUGE, HUGE_DATA), "huge")

            # An unknown export: nbdinfo fails, the daemon carries on.
            p = nbdinfo("--size", d.tcp_uri("nope"), rc=None)
            expect(p.returncode != 0, "nbdinfo on an unknown export succeeded")
            nbdtest.check(d.alive(), "daemon died")
            p = nbdinfo("--size", d.tcp_uri("disk"))
            expect(p.stdout.strip() == str(DISK_SIZE), "daemon not serving after the unknown export")
            CHECKS.dump_log(d)
    CHECKS.finish("nbdinfo")


if __name__ == "__main__":
    main()
