#!/usr/bin/python3
"""same_file: one file under two names is one backend and one cache
(issue 40, defect 7; nbdcached(8), --export and WINDOWS).

Exports over one file or block device, whatever the path that names it
(DIR/x.img, DIR/./x.img, a symbolic link, a hard link; a block device's
node and another node of the same device number), share one backing and
so one cache: what one writes is read at once through every other. On
main each path was a backend of its own with a cache of its own, and a
reader kept serving what its cache held.

  start         five exports over x.img (four names) and one over another
                file; a, c and d read the first MiB (cached), b writes it
                and FLUSHes: a, c and d read b's bytes. Then a writes
                without FLUSH: b, c and d read a's bytes (one cache). The
                other file is untouched; after the stop x.img holds the
                last bytes. The log says which export shares which one's
                backend. On main: a read its own cache's old bytes.
  block_device  a loop device under its own node and a node made here with
                its device number: the same checks (skipped, said in the
                log, when the machine has no loop device or mknod fails).
  check_config  --check-config says "one cache with export 'a'" for every
                other name of x.img (on main: nothing).
  disagree      the names of one file must agree on what the cache holds
                per backend: block-size 4096 and 65536 on two names is
                refused at start and by --check-config, naming both
                exports and both paths (on main: served, two caches).
  reload        a reload that adds a second name of a served file puts it
                on the live backing: a read through a, a write and FLUSH
                through the new name b, and a reads b's bytes (on main: the
                old ones). Naming a's file by another path in a later
                reload is no change of backend (not refused), and a third
                name that disagrees on block-size is refused with both
                names.
"""
import os
import stat
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 8 * MIB

CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, nbd.Error))
expect = CHECKS.expect


def names_of(tmp, img):
    """x.img under four names: itself, with "/./", a symbolic link, a hard link."""
    link = os.path.join(tmp, "link.img")
    hard = os.path.join(tmp, "hard.img")
    os.symlink(img, link)
    os.link(img, hard)
    return [img, os.path.join(tmp, ".", os.path.basename(img)), link, hard]


def handles(d, names):
    return {n: nbdtest.libnbd_handle(d.unix_uri(n)) for n in names}


def seen_through(hs, writer, readers, data, flush, what):
    """writer writes data at 0 (and FLUSHes when flush); every reader must
    read it back."""
    hs[writer].pwrite(data, 0)
    if flush:
        hs[writer].flush()
    for r in readers:
        got = hs[r].pread(len(data), 0)
        expect(got == data, "%s: export '%s' reads %s, not what '%s' wrote%s"
               % (what, r, "its old bytes" if got != data else "?", writer,
                  " and FLUSHed" if flush else ""))


def one_file_many_names(d, hs, names, readers, writer, other=None, other_bytes=None):
    # Readers cache the first MiB first.
    for r in readers:
        hs[r].pread(MIB, 0)
    new = os.urandom(MIB)
    seen_through(hs, writer, readers, new, True, "a FLUSHed write")
    again = os.urandom(MIB)
    seen_through(hs, readers[0], [writer] + readers[1:], again, False, "a write")
    hs[readers[0]].flush()
    if other:
        expect(hs[other].pread(MIB, 0) == other_bytes,
               "the export over another file changed")
    return again


def start(tmp):
    img = nbdtest.random_file(os.path.join(tmp, "x.img"), SIZE, seed=1)
    other = nbdtest.random_file(os.path.join(tmp, "other.img"), SIZE, seed=2)
    other_bytes = nbdtest.read_at(other, 0, MIB)
    paths = names_of(tmp, img)
    exports = [(n, p, "") for n, p in zip("abcd", paths)] + [("e", other, "")]
    with nbdtest.running_daemon(exports) as d:
        hs = handles(d, "abcde")
        last = one_file_many_names(d, hs, "abcde", ["a", "c", "d"], "b", "e", other_bytes)
        text = d.log_text()
        for n, p in zip("bcd", paths[1:]):
            expect("export '%s': %s is the same file as %s (export 'a')" % (n, p, img) in text,
                   "the log does not say that export '%s' (%s) shares export 'a''s backend"
                   % (n, p))
        for h in hs.values():
            h.shutdown()
    expect(nbdtest.read_at(img, 0, MIB) == last, "x.img does not hold the last bytes written")


def block_device(tmp):
    backing = nbdtest.sparse_file(os.path.join(tmp, "backing.img"), SIZE)
    p = subprocess.run(["losetup", "-f", "--show", backing], capture_output=True, text=True)
    if p.returncode != 0:
        log("  skipped: no loop device (%s)" % p.stderr.strip())
        return
    dev = p.stdout.strip()
    try:
        node = os.path.join(tmp, "node")
        try:
            os.mknod(node, stat.S_IFBLK | 0o600, os.stat(dev).st_rdev)
            with open(node, "rb"):
                pass
        except OSError as e:
            log("  skipped: cannot make a second node of %s: %s" % (dev, e))
            return
        with nbdtest.running_daemon([("a", dev, ""), ("b", node, "")]) as d:
            hs = handles(d, "ab")
            last = one_file_many_names(d, hs, "ab", ["a"], "b")
            expect("export 'b': %s is the same file as %s (export 'a')" % (node, dev)
                   in d.log_text(), "the log does not say that b shares a's backend")
            for h in hs.values():
                h.shutdown()
        expect(nbdtest.read_at(backing, 0, MIB) == last,
               "the loop device does not hold the last bytes written")
    finally:
        subprocess.run(["losetup", "-d", dev])


def run_check_config(args):
    p = subprocess.run([nbdtest.NBDCACHED, "--check-config"] + args, capture_output=True,
                       text=True, timeout=60)
    log("  --check-config: exit %d\n%s%s" % (p.returncode, p.stdout, p.stderr))
    return p


def check_config(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "x.img"), SIZE)
    paths = names_of(tmp, img)
    args = []
    for n, p in zip("abcd", paths):
        args += ["--export", "%s=%s" % (n, p)]
    p = run_check_config(args)
    expect(p.returncode == 0, "--check-config refused four names of one file")
    for n in "bcd":
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("export '%s'" % n)),
                    "")
        expect("one cache with export 'a'" in line,
               "--check-config does not say that export '%s' shares a's cache: %r" % (n, line))


def disagree(tmp):
    img = nbdtest.sparse_file(os.path.join(tmp, "x.img"), SIZE)
    dotted = os.path.join(tmp, ".", "x.img")
    args = ["--export", "a=%s,block-size=4096" % img,
            "--export", "b=%s,block-size=65536" % dotted]

    def names_both(text):
        return ("'a'" in text and "'b'" in text and img in text and dotted in text
                and "block-size" in text)

    p = run_check_config(args)
    expect(p.returncode == 2 and names_both(p.stderr),
           "--check-config: two names of one file with two block sizes not refused naming "
           "both exports and both paths (exit %d)" % p.returncode)
    sock = os.path.join(tmp, "s.sock")
    cmd = [nbdtest.NBDCACHED, "--foreground", "--unix", sock, "--control", "none"] + args
    log("+ " + " ".join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        rc, err = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        rc, err = None, "(it served: killed after 20 s)"
    log("  start: exit %s: %s" % (rc, err.strip()[-600:]))
    expect(rc == 2 and names_both(err),
           "a start with two names of one file and two block sizes was not refused "
           "naming both exports and both paths (exit %s)" % rc)


def write_config(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.rename(path + ".new", path)


def reload(tmp):
    img = nbdtest.random_file(os.path.join(tmp, "x.img"), SIZE, seed=3)
    paths = names_of(tmp, img)
    conf = os.path.join(tmp, "nbdcached.conf")
    generic = "[generic]\ncache-size = 64M\ndirty-expire = 3600\n\n"
    write_config(conf, generic + "[a]\nbackend = %s\n" % img)
    with nbdtest.running_daemon([], extra=["--config", conf]) as d:
        ha = nbdtest.libnbd_handle(d.unix_uri("a"))
        ha.pread(MIB, 0)
        write_config(conf, generic + "[a]\nbackend = %s\n\n[b]\nbackend = %s\n"
                     % (img, paths[1]))
        r = nbdtest.control_request(d.control, {"command": "reload"})
        log("  reload adding b (%s): %r" % (paths[1], r))
        expect(r.get("ok") and r.get("added") == ["b"] and not r.get("refused"),
               "the reload adding b: %r" % r)
        hb = nbdtest.libnbd_handle(d.unix_uri("b"))
        hs = {"a": ha, "b": hb}
        seen_through(hs, "b", ["a"], os.urandom(MIB), True, "after the reload, a FLUSHed write")
        seen_through(hs, "a", ["b"], os.urandom(MIB), False, "after the reload, a write")
        expect("export 'b': %s is the same file as %s (export 'a')" % (paths[1], img)
               in d.log_text(), "the log does not say that b shares a's backend")

        # a named by its link: the same file, so no change of backend.
        write_config(conf, generic + "[a]\nbackend = %s\n\n[b]\nbackend = %s\n"
                     % (paths[2], paths[1]))
        r = nbdtest.control_request(d.control, {"command": "reload"})
        log("  reload naming a's file by its link: %r" % r)
        expect(r.get("ok") and not r.get("refused") and not r.get("removed"),
               "a's file named by another path refused as a new backend: %r" % r)

        # A third name that wants another block size: the reload is refused.
        write_config(conf, generic + "[a]\nbackend = %s\n\n[b]\nbackend = %s\n\n"
                     "[c]\nbackend = %s\nblock-size = 65536\n" % (paths[2], paths[1], paths[3]))
        r = nbdtest.control_request(d.control, {"command": "reload"})
        log("  reload adding c (%s, block-size 65536): %r" % (paths[3], r))
        msg = r.get("error") or r.get("message") or str(r)
        expect(not r.get("ok") and "'c'" in msg and "block-size" in msg,
               "a third name of a's file with another block size was not refused naming it: %r"
               % r)
        ex = nbdtest.control_request(d.control, {"command": "exports"})["exports"]
        expect(sorted(e["name"] for e in ex) == ["a", "b"],
               "exports after the refused reload: %r" % [e["name"] for e in ex])
        for h in (ha, hb):
            h.shutdown()


def main():
    for name, fn in (("start", start), ("block_device", block_device),
                     ("check_config", check_config), ("disagree", disagree),
                     ("reload", reload)):
        with nbdtest.tempdir() as tmp:
            CHECKS.run(name, fn, tmp)
    CHECKS.finish("same_file")


if __name__ == "__main__":
    main()
