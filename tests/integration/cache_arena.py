#!/usr/bin/python3
# tests/run: alone (sets vm.nr_hugepages: a daemon of a test beside it could take the pages it reserves)
"""cache_arena: where the cache's memory comes from, as the user chose it.

  off       --hugepages off: plain pages (stats say arena=plain)
  auto      no hugetlb pages reserved: THP where the kernel has it enabled,
            else plain pages
  hugetlb   8 hugetlb pages reserved (as root), --hugepages require with a
            16 MiB cache: arena=hugetlb, every page allocated at start
            (HugePages_Free drops to 0 before any I/O), data round-trips through it
            and reaches the backend after FLUSH
  shortage  --hugepages require with more cache than reserved pages: the
            daemon refuses to start, exit 1, and says how to fix it

vm.nr_hugepages is restored at the end whatever happens.
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, read_at  # noqa: E402
from nbdtest import require as expect  # noqa: E402

NR = "/proc/sys/vm/nr_hugepages"
MIB = 1024 * 1024


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "never"


def hugepages_free():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    return -1


def arena_of(tmp, extra):
    path = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(path, 64 * MIB)
    with nbdtest.Daemon([("disk", path, "")], extra=extra, workdir=tmp) as d:
        return nbdtest.stats(d)["arena"]


def check_off(tmp):
    arena = arena_of(tmp, ["--cache-size", "8M", "--hugepages", "off"])
    expect(arena == "plain", "--hugepages off gave arena=%s" % arena)


def check_auto(tmp):
    arena = arena_of(tmp, ["--cache-size", "8M"])
    want = "plain" if thp_mode() == "never" else "thp"
    expect(arena == want, "auto without hugetlb pages gave arena=%s, want %s (THP %s)"
           % (arena, want, thp_mode()))


def check_hugetlb(tmp):
    path = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(path, 64 * MIB)
    data = os.urandom(4 * MIB)
    with nbdtest.Daemon([("disk", path, "")], workdir=tmp,
                        extra=["--cache-size", "16M", "--hugepages", "require"]) as d:
        st = nbdtest.stats(d)
        expect(st["arena"] == "hugetlb", "arena=%s with pages reserved" % st["arena"])
        free = hugepages_free()
        expect(free == 0, "HugePages_Free %d with the daemon up, want 0 (every page "
               "allocated at start, not at first touch)" % free)
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(data, 8 * MIB)
        expect(h.pread(len(data), 8 * MIB) == data, "read back through hugetlb pages")
        h.flush()
        expect(read_at(path, 8 * MIB, len(data)) == data, "backend after FLUSH")
        h.shutdown()


def check_shortage(tmp):
    path = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(path, 64 * MIB)
    p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--unix", os.path.join(tmp, "s"),
                        "--export", "disk=" + path, "--cache-size", "64M",
                        "--hugepages", "require"],
                       capture_output=True, text=True, timeout=30)
    expect(p.returncode == 1, "exit %d with too few hugetlb pages, want 1" % p.returncode)
    expect("nr_hugepages" in p.stderr, "no hint in: %r" % p.stderr[-300:])


def main():
    if not os.path.exists(NR):
        nbdtest.skip("the kernel has no hugetlb pages (%s missing)" % NR)
    with open(NR) as f:
        saved = int(f.read())
    checks = nbdtest.Checks()
    try:
        with open(NR, "w") as f:
            f.write("0")
        with nbdtest.tempdir() as tmp:
            checks.run("off", check_off, tmp)
        with nbdtest.tempdir() as tmp:
            checks.run("auto", check_auto, tmp)
        with open(NR, "w") as f:
            f.write("8")
        with open(NR) as f:
            got = int(f.read())
        if got < 8:
            nbdtest.skip("the kernel could not reserve 8 hugetlb pages (got %d)" % got)
        with nbdtest.tempdir() as tmp:
            checks.run("hugetlb", check_hugetlb, tmp)
        with nbdtest.tempdir() as tmp:
            checks.run("shortage", check_shortage, tmp)
    finally:
        with open(NR, "w") as f:
            f.write(str(saved))
        log("vm.nr_hugepages restored to %d" % saved)
    checks.finish("cache arena")


if __name__ == "__main__":
    main()
