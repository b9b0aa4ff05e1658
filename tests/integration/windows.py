#!/usr/bin/python3
"""windows: window exports (offset=, size=) and split= over one backend.

One 64 MiB backend file is served as
  big       the whole file, split=10M: big/0 .. big/6 (the last one 4 MiB)
  mid       offset=4M,size=8M (overlaps big/0 and big/1)
  tail      offset=60M (to the end: 4 MiB, the same bytes as big/6)
  rotail    the same window as tail, read-only
all in one cache export. A sparse 16 MiB file is served as sp (split=4M).

  model       400 seeded random WRITE / WRITE_ZEROES / READ through python
              libnbd on any of the windows and the whole export, checked
              against one byte model of the backend: a write through one is
              read at once through every overlapping one, at its place
  flush       a write through big/3 and a FLUSH on mid: the backend file
              holds the bytes (one cache export, one durability)
  bounds      raw requests at each window's end: READ of its last byte ok;
              READ and WRITE one byte past it EINVAL / ENOSPC; a write to
              rotail EPERM; the neighbouring bytes are untouched
  status      block status on sp/2 and on mid is relative to the window,
              covers it, and stops at its end (the backend goes on)
  sparse      a structured READ across a hole of sp/2 gets OFFSET_HOLE and
              OFFSET_DATA chunks at window offsets
  odd         a backend of 10 MiB + 512 bytes split=4M: the last window,
              odd/2, is 2 MiB + 512 bytes and ends with the file
  list        NBD_OPT_LIST / nbdinfo: every window with its description,
              size of each; control "exports" gives offset, split, window_of
  ctl         nbdcachectl windows big (table and --json), attach big/3
  reload      split=10M -> 16M by SIGHUP-style reload: big/4 .. big/6 go,
              the rest get new sizes; a connection on old big/6 keeps its
              window until it closes
  refused     a window past the backend's end stops the daemon with the
              export, bytes and reason; too many windows likewise
"""

import errno
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * MIB
SPLIT = 10 * MIB
# name -> (offset in the backend, size)
WINDOWS = {"big": (0, SIZE), "mid": (4 * MIB, 8 * MIB), "tail": (60 * MIB, 4 * MIB),
           "rotail": (60 * MIB, 4 * MIB)}
for k in range(7):
    WINDOWS["big/%d" % k] = (k * SPLIT, min(SPLIT, SIZE - k * SPLIT))
NBDCACHECTL = nbdtest.NBDCACHECTL


def main():
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    with nbdtest.tempdir() as tmp:
        img = nbdtest.random_file(os.path.join(tmp, "disk.img"), SIZE, seed=5)
        with open(img, "rb") as f:
            model = bytearray(f.read())
        sparse = nbdtest.sparse_file(os.path.join(tmp, "sparse.img"), 16 * MIB)
        with open(sparse, "r+b") as f:
            f.seek(9 * MIB)  # sp/2 offset 1 MiB
            f.write(b"D" * 8 * KIB)
        odd = nbdtest.random_file(os.path.join(tmp, "odd.img"), 10 * MIB + 512, seed=6)
        conf = os.path.join(tmp, "nbdcached.conf")

        def write_conf(split):
            with open(conf, "w") as f:
                f.write("[big]\nbackend = %s\nsplit = %s\n"
                        "[mid]\nbackend = %s\noffset = 4M\nsize = 8M\n"
                        "[tail]\nbackend = %s\noffset = 60M\n"
                        "[rotail]\nbackend = %s\noffset = 60M\nreadonly = true\n"
                        "[sp]\nbackend = %s\nsplit = 4M\n"
                        "[odd]\nbackend = %s\nsplit = 4M\n"
                        % (img, split, img, img, img, sparse, odd))
        write_conf("10M")
        d = nbdtest.CheckedDaemon([], workdir=tmp,
                                  extra=["--config", conf, "--cache-size", "32M"])
        handles = {}

        def h(name):
            if name not in handles:
                handles[name] = nbdtest.libnbd_handle(d.unix_uri(name))
            return handles[name]

        try:
            def model_check():
                rnd = random.Random(11)
                names = sorted(n for n in WINDOWS if n != "rotail")
                for i in range(400):
                    name = rnd.choice(names)
                    base, size = WINDOWS[name]
                    length = rnd.choice((1, 512, 4096, 5000, 65536, 300 * KIB))
                    length = min(length, size)
                    off = rnd.randrange(0, size - length + 1)
                    if rnd.random() < 0.1:  # near the window's end
                        off = size - length
                    op = rnd.random()
                    if op < 0.4:
                        data = rnd.randbytes(length)
                        h(name).pwrite(data, off)
                        model[base + off:base + off + length] = data
                    elif op < 0.5:
                        h(name).zero(length, off)
                        model[base + off:base + off + length] = bytes(length)
                    else:
                        got = h(name).pread(length, off)
                        want = model[base + off:base + off + length]
                        require(got == want, "op %d: READ %s [%d,+%d) (backend %d): first "
                                "difference at %s" % (i, name, off, length, base + off,
                                                      nbdtest.first_diff(got, want)))
                # Every window agrees with the model everywhere (1 MiB steps).
                for name, (base, size) in sorted(WINDOWS.items()):
                    for off in range(0, size, MIB):
                        n = min(MIB, size - off)
                        require(h(name).pread(n, off) == model[base + off:base + off + n],
                                "%s [%d,+%d) differs from the model" % (name, off, n))

            def flush():
                h("big/3").pwrite(b"F" * 8192, 4096)
                model[3 * SPLIT + 4096:3 * SPLIT + 4096 + 8192] = b"F" * 8192
                h("mid").flush()
                got = nbdtest.read_at(img, 3 * SPLIT + 4096, 8192)
                require(got == b"F" * 8192, "after FLUSH on mid the file does not hold the "
                        "write through big/3")
                s = nbdtest.control_request(d.control, {"command": "stats"})
                dirty = [e["dirty_bytes"] for e in s["exports"] if e["name"] in ("big", "mid")]
                require(dirty == [0, 0], "dirty bytes after the FLUSH: %s (one cache "
                        "export: both 0)" % dirty)

            def bounds():
                for name, (base, size) in sorted(WINDOWS.items()):
                    r = raw.RawClient(d.sock)
                    r.open(name, structured=True)
                    rep = r.command(raw.CMD_READ, size - 1, 1)
                    require(rep.error == 0 and rep.data == model[base + size - 1:base + size],
                            "%s: READ of its last byte: error %s" % (name, rep.error))
                    rep = r.command(raw.CMD_READ, size - 512, 1024)
                    require(rep.error == raw.EINVAL, "%s: READ across its end: %s, want EINVAL"
                            % (name, raw.err_name(rep.error)))
                    rep = r.command(raw.CMD_READ, size, 1)
                    require(rep.error == raw.EINVAL, "%s: READ at its end: %s, want EINVAL"
                            % (name, raw.err_name(rep.error)))
                    want = raw.EPERM if name == "rotail" else raw.ENOSPC
                    rep = r.command(raw.CMD_WRITE, size - 512, 1024, payload=b"X" * 1024)
                    require(rep.error == want, "%s: WRITE across its end: %s, want %s"
                            % (name, raw.err_name(rep.error), raw.err_name(want)))
                    if name == "rotail":
                        rep = r.command(raw.CMD_WRITE, 0, 512, payload=b"X" * 512)
                        require(rep.error == raw.EPERM, "rotail: WRITE %s, want EPERM"
                                % raw.err_name(rep.error))
                    r.disconnect()
                # Nothing moved: the bytes after every window's end are the model's.
                for name, (base, size) in sorted(WINDOWS.items()):
                    if base + size < SIZE:
                        got = h("big").pread(4096, base + size)
                        require(got == model[base + size:base + size + 4096],
                                "the bytes after %s changed" % name)

            def status():
                r = raw.RawClient(d.sock)
                r.open("sp/2", extended=True, meta=["base:allocation"])
                rep = r.command(raw.CMD_BLOCK_STATUS, 0, 4 * MIB)
                log("  sp/2 extents: %s" % (rep.extents,))
                require(rep.error == 0 and sum(n for n, _ in rep.extents) <= 4 * MIB,
                        "sp/2 block status runs past the window: %s" % (rep.extents,))
                pos, data_at = 0, []
                for n, flags in rep.extents:
                    if not flags & 1:
                        data_at.append((pos, pos + n))
                    pos += n
                require(pos == 4 * MIB and data_at and data_at[0][0] <= MIB and
                        data_at[0][1] >= MIB + 8 * KIB and
                        all(a >= MIB - 64 * KIB and b <= MIB + 72 * KIB for a, b in data_at),
                        "sp/2: data at %s, want about [1 MiB, 1 MiB + 8 KiB) of 4 MiB"
                        % data_at)
                rep = r.command(raw.CMD_BLOCK_STATUS, 3 * MIB, MIB)
                require(rep.error == 0 and sum(n for n, _ in rep.extents) == MIB and
                        all(f & 1 for _, f in rep.extents),
                        "sp/2 [3 MiB, 4 MiB): %s (a hole up to the window's end)"
                        % (rep.extents,))
                r.disconnect()
                r = raw.RawClient(d.sock)
                r.open("mid", structured=True, meta=["base:allocation"])
                rep = r.command(raw.CMD_BLOCK_STATUS, 6 * MIB, 2 * MIB)
                require(rep.error == 0 and sum(n for n, _ in rep.extents) == 2 * MIB,
                        "mid's last 2 MiB: %s (all of it and not past its end)"
                        % (rep.extents,))
                r.disconnect()

            def sparse_read():
                r = raw.RawClient(d.sock)
                r.open("sp/2", structured=True)
                rep = r.command(raw.CMD_READ, 512 * KIB, MIB)
                log("  holes %s" % (rep.holes,))
                want = bytes(512 * KIB) + b"D" * 8 * KIB + bytes(MIB - 520 * KIB)
                require(rep.error == 0 and rep.data == want and rep.holes and
                        all(512 * KIB <= o and o + n <= 1536 * KIB for o, n in rep.holes),
                        "sp/2 READ across its hole: holes %s, data %s"
                        % (rep.holes, "ok" if rep.data == want else "wrong"))
                r.disconnect()

            def odd_end():
                # A backend of 10 MiB + 512 bytes: its last window ends with it.
                w = nbdtest.libnbd_handle(d.unix_uri("odd/2"))
                want = nbdtest.read_at(odd, 8 * MIB, 2 * MIB + 512)
                require(w.get_size() == 2 * MIB + 512 and w.pread(2 * MIB + 512, 0) == want,
                        "odd/2: size %d, or its bytes differ from the file's last ones"
                        % w.get_size())
                w.shutdown()

            def listing():
                out = subprocess.run(["nbdinfo", "--list", "--json", d.unix_uri()],
                                     capture_output=True, text=True, timeout=60)
                require(out.returncode == 0, "nbdinfo --list: %s" % out.stderr)
                got = {e["export-name"]: e for e in json.loads(out.stdout)["exports"]}
                for name, (base, size) in WINDOWS.items():
                    require(name in got and got[name]["export-size"] == size,
                            "nbdinfo: %s: %s" % (name, got.get(name)))
                require(got["big/6"].get("description") ==
                        "bytes 62914560 to 67108863 of export 'big'",
                        "big/6's description: %r" % got["big/6"].get("description"))
                require(sorted(n for n in got if n.startswith("sp/")) == ["sp/%d" % k
                                                                         for k in range(4)],
                        "sp's windows: %s" % sorted(got))
                ex = {e["name"]: e for e in
                      nbdtest.control_request(d.control, {"command": "exports"})["exports"]}
                require(ex["big/3"]["offset"] == 3 * SPLIT and ex["big/3"]["window_of"] == "big"
                        and ex["big"]["split"] == SPLIT and ex["big"]["window_of"] is None and
                        ex["tail"]["offset"] == 60 * MIB and ex["tail"]["size"] == 4 * MIB,
                        "control exports: %s %s %s" % (ex["big/3"], ex["big"], ex["tail"]))

            def ctl():
                out = nbdtest.run([NBDCACHECTL, "--control", d.control, "--json", "windows",
                                   "big"]).stdout
                got = json.loads(out)
                want = [{"name": "big/%d" % k, "first": k * SPLIT,
                         "last": k * SPLIT + WINDOWS["big/%d" % k][1] - 1,
                         "size": WINDOWS["big/%d" % k][1]} for k in range(7)]
                require(got == {"export": "big", "windows": want},
                        "nbdcachectl --json windows big: %s" % out)
                out = nbdtest.run([NBDCACHECTL, "--control", d.control, "windows", "big"]).stdout
                lines = out.splitlines()
                require(lines[0].split() == ["NAME", "FIRST", "LAST", "SIZE", "BYTES"] and
                        lines[7].split()[:3] == ["big/6", "62914560", "67108863"],
                        "nbdcachectl windows big:\n%s" % out)
                p = nbdtest.run([NBDCACHECTL, "--control", d.control, "windows", "mid"],
                                check_rc=False)
                require(p.returncode == 1 and "export mid has no windows" in p.stderr,
                        "windows of an export without split: %d %r" % (p.returncode, p.stderr))
                out = nbdtest.run([NBDCACHECTL, "--control", d.control, "attach", "big/3"]).stdout
                require("-N big/3 " in out, "attach big/3: %s" % out)

            def reload():
                old6 = nbdtest.libnbd_handle(d.unix_uri("big/6"))
                write_conf("16M")
                rep = nbdtest.control_request(d.control, {"command": "reload"})
                log("  reload: %s" % {k: rep.get(k) for k in ("added", "changed", "removed")})
                require(rep.get("ok") and sorted(rep["removed"]) == ["big/4", "big/5", "big/6"]
                        and sorted(rep["changed"]) == ["big", "big/0", "big/1", "big/2", "big/3"]
                        and rep["added"] == [], "reload to split=16M: %s" % rep)
                ex = {e["name"]: e for e in
                      nbdtest.control_request(d.control, {"command": "exports"})["exports"]}
                require(ex["big/3"]["size"] == 16 * MIB and ex["big/3"]["offset"] == 48 * MIB
                        and "big/4" not in ex, "after the reload: %s" % sorted(ex))
                # The connection made before keeps big/6 = [60 MiB, 64 MiB).
                require(old6.get_size() == 4 * MIB and
                        old6.pread(4096, 0) == model[60 * MIB:60 * MIB + 4096],
                        "a connection on the removed big/6 lost its window")
                old6.shutdown()
                n3 = nbdtest.libnbd_handle(d.unix_uri("big/3"))
                require(n3.get_size() == 16 * MIB and
                        n3.pread(4096, 12 * MIB) == model[60 * MIB:60 * MIB + 4096],
                        "the new big/3 does not end with the file's last 4 MiB")
                n3.shutdown()
                nbdtest.expect_nbd_error(
                    lambda: nbdtest.libnbd_handle(d.unix_uri("big/6")), errno.ENOENT,
                    "opening the removed big/6")

            for name, fn in (("model", model_check), ("flush", flush), ("bounds", bounds),
                             ("status", status), ("sparse", sparse_read), ("odd", odd_end),
                             ("list", listing),
                             ("ctl", ctl), ("reload", reload)):
                checks.run(name, fn)
            for x in handles.values():
                x.shutdown()
            handles.clear()
        finally:
            checks.dump_log(d)
            d.stop()

        def refused():
            for spec, want in (
                    ("w=%s,offset=60M,size=8M" % img,
                     "export 'w': bytes 62914560 to 71303167 of %s (67108864 bytes): the "
                     "window runs past the end of its backend" % img),
                    ("w=%s,offset=64M" % img, "the window runs past the end of its backend"),
                    ("w=%s,split=8K" % img, "split makes more than 4096 windows")):
                p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--control", "none",
                                    "--unix", os.path.join(tmp, "r.sock"), "--cache-size", "16M",
                                    "--export", spec], capture_output=True, text=True,
                                   timeout=30)
                require(p.returncode != 0 and want in p.stdout + p.stderr,
                        "--export %s: exit %d, %r" % (spec, p.returncode,
                                                       (p.stdout + p.stderr)[-400:]))
        checks.run("refused", refused)
    checks.finish("window export")


if __name__ == "__main__":
    main()
