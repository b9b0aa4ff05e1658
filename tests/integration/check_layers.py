#!/usr/bin/python3
"""check_layers: scripts/check-layers passes on the tree and catches plants.

  tree       the repository as it is: exit 0, "all one way"
  upward     a copy of the sources with one forbidden include planted at a
             time; each must exit 1 and name the planted FILE:LINE:
             proto/ including a daemon header, a backend including the
             cache, the cache index including the writeback thread's
             header, transmit.c and transmit_receive.c including
             handshake.h, the connection primitives including the
             dispatch, the compactor including the writeback thread's
             header, the cache's operations including it, the client
             including a daemon header
  unplaced   a copy with a new file in no layer: exit 1, named
  stale      a copy without daemon/host.c and host.h, which a layer and no
             other file names: exit 1, the stale rule named
"""

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(TOP, "scripts", "check-layers")
TREES = ("proto", "include", "daemon", "client")

# (file to plant in, header it must not include)
PLANTS = [
    ("proto/request.c", "daemon/log.h"),
    ("daemon/backend/file.c", "daemon/cache/cache.h"),
    ("daemon/cache/cache.c", "daemon/cache/writeback.h"),
    ("daemon/transmit.c", "daemon/handshake.h"),
    ("daemon/transmit_receive.c", "daemon/handshake.h"),
    ("daemon/conn.c", "daemon/session.h"),
    ("daemon/cache/compact.c", "daemon/cache/writeback.h"),
    ("daemon/cache/cached.c", "daemon/cache/writeback.h"),
    ("client/nbdcachectl/main.c", "daemon/options.h"),
]


def run(root):
    p = subprocess.run([sys.executable, SCRIPT, root], capture_output=True, text=True,
                       timeout=60)
    return p.returncode, p.stdout + p.stderr


def copy_tree(dst):
    for t in TREES:
        shutil.copytree(os.path.join(TOP, t), os.path.join(dst, t),
                        ignore=shutil.ignore_patterns("*.o", "*.d"))


def tree():
    rc, out = run(TOP)
    log("  " + out.strip().replace("\n", "\n  "))
    require(rc == 0 and "all one way" in out, "check-layers refuses the tree:\n" + out)


def upward(tmp):
    for k, (f, header) in enumerate(PLANTS):
        root = os.path.join(tmp, "plant%d" % k)
        copy_tree(root)
        path = os.path.join(root, f)
        require(os.path.exists(path), "test setup: %s is not in the tree" % f)
        require(os.path.exists(os.path.join(root, header)),
                "test setup: %s is not in the tree" % header)
        with open(path) as fh:
            lines = fh.read().split("\n")
        # After the file's first include line, or at the top.
        at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("#include")), 0)
        lines.insert(at, '#include "%s"' % header)
        with open(path, "w") as fh:
            fh.write("\n".join(lines))
        rc, out = run(root)
        want = "%s:%d: includes %s" % (f, at + 1, header)
        log("  planted %s in %s: exit %d, %s" % (header, f, rc,
                                                out.strip().split("\n")[0]))
        require(rc == 1 and want in out, "check-layers let %s include %s (exit %d):\n%s"
                % (f, header, rc, out))


def unplaced(tmp):
    root = os.path.join(tmp, "unplaced")
    copy_tree(root)
    with open(os.path.join(root, "daemon", "stray.c"), "w") as fh:
        fh.write('#include "daemon/log.h"\n')
    rc, out = run(root)
    log("  daemon/stray.c: exit %d, %s" % (rc, out.strip().split("\n")[0]))
    require(rc == 1 and "daemon/stray.c: in no layer" in out,
            "check-layers accepted a file in no layer (exit %d):\n%s" % (rc, out))


def stale(tmp):
    root = os.path.join(tmp, "stale")
    copy_tree(root)
    for f in ("host.c", "host.h"):
        os.unlink(os.path.join(root, "daemon", f))
    # (its includers go too, or they would name a missing file instead)
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if f.endswith((".c", ".h")):
                with open(p, errors="replace") as fh:
                    text = fh.read()
                if '#include "daemon/host.h"' in text:
                    os.unlink(p)
    rc, out = run(root)
    log("  without daemon/host.[ch]: exit %d, %s" % (rc, out.strip().split("\n")[0]))
    require(rc == 1 and "daemon/host.[ch] names no file" in out,
            "check-layers kept a rule for files that do not exist (exit %d):\n%s" % (rc, out))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(prefix="check-layers-") as tmp:
        checks.run("tree", tree)
        checks.run("upward", upward, tmp)
        checks.run("unplaced", unplaced, tmp)
        checks.run("stale", stale, tmp)
    checks.finish("layer")


if __name__ == "__main__":
    main()
