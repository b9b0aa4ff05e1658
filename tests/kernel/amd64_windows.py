#!/usr/bin/python3
"""Kernel test 3: windows of one backend, attached side by side.

One daemon serves a 64 TiB sparse file as `big` with split=32bit (windows
big/0 .. big/4 of W = 16 TiB - 2 MiB) and, over the same backend, `ov`, an
explicit window offset=2W-2MiB,size=4MiB that straddles the boundary
between big/1 and big/2. Debian's amd64 kernel (tests/kernel/guest.py)
attaches four devices in one guest: nbd0 = big/1, nbd1 = big/2, nbd2 = ov,
nbd3 = the whole export big. Writes go one after the other:

  1. nbd0 (big/1): pattern A over its last MiB (O_DIRECT);
  2. nbd1 (big/2): pattern B over its first MiB (O_DIRECT);
     ov read with O_DIRECT is then zeros, A, B, zeros;
  3. nbd2 (ov): pattern C over ov's [1.5 MiB, 2.5 MiB), across the
     boundary, buffered with fsync;
     then big/1's last 2 MiB, big/2's first 2 MiB, the whole export around
     2W and ov are read with O_DIRECT: each shows A, C and B at the right
     place and zeros next to them.

The host checks the same bytes with python3-libnbd through big, big/1,
big/2 and ov, and after SIGTERM in the backend file itself, whose only
data (SEEK_DATA) is [2W - 1 MiB, 2W + 1 MiB): the neighbours stay
untouched.
"""

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import nbdtest  # noqa: E402

SIZE = 64 << 40
W = (16 << 40) - (2 << 20)
MIB = 1 << 20
BASE = 2 * W                 # the boundary between big/1 and big/2
OV_OFF = BASE - 2 * MIB
OV_SIZE = 4 * MIB


def pattern(tag):
    line = ("%-15.15s" % tag).replace(" ", "-") + "\n"
    return (line * 256).encode() * 256          # 1 MiB


A, B, C = pattern("A-big1-last"), pattern("B-big2-first"), pattern("C-ov-across")
Z = bytes(MIB)
HALF = MIB // 2

# The model: the 4 MiB of ov, i.e. [2W - 2 MiB, 2W + 2 MiB) of the backend.
AFTER_AB = Z + A + B + Z
FINAL = Z + A[:HALF] + C + B[HALF:] + Z

SCRIPT = r"""
pattern() {
	line=$(printf '%%-15.15s' "$1" | tr ' ' '-')
	i=0; : >/tmp/pat
	while [ $i -lt 256 ]; do printf '%%s\n' "$line" >>/tmp/pat; i=$((i + 1)); done
	: >/tmp/$2
	for i in $(seq 256); do cat /tmp/pat >>/tmp/$2; done
}
pattern A-big1-last A
pattern B-big2-first B
pattern C-ov-across C
run nbd-client 10.0.2.100 10809 /dev/nbd0 -N big/1 -b 4096 || die attach0
run nbd-client 10.0.2.100 10809 /dev/nbd1 -N big/2 -b 4096 || die attach1
run nbd-client 10.0.2.100 10809 /dev/nbd2 -N ov -b 4096 || die attach2
run nbd-client 10.0.2.100 10809 /dev/nbd3 -N big -b 4096 || die attach3
for n in 0 1 2 3; do kv size:nbd$n $(( $(cat /sys/block/nbd$n/size) * 512 )); done
# rd DEV SKIP COUNT: sha256 of COUNT 512 KiB blocks from SKIP, O_DIRECT
rd() { dd if=$1 bs=512k skip=$2 count=$3 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1; }
mark step1
run dd if=/tmp/A of=/dev/nbd0 bs=512k seek=%(w1_last)d count=2 oflag=direct conv=notrunc || die step1
mark step2
run dd if=/tmp/B of=/dev/nbd1 bs=512k seek=0 count=2 oflag=direct conv=notrunc || die step2
kv after_ab:ov $(rd /dev/nbd2 0 8)
mark step3
run dd if=/tmp/C of=/dev/nbd2 bs=512k seek=3 count=2 conv=notrunc,fsync || die step3
kv final:big1 $(rd /dev/nbd0 %(w1_last2)d 4)
kv final:big2 $(rd /dev/nbd1 0 4)
kv final:big $(rd /dev/nbd3 %(big_at)d 8)
kv final:ov $(rd /dev/nbd2 0 8)
for n in 0 1 2 3; do run nbd-client -d /dev/nbd$n; done
"""


def sha(b):
    return hashlib.sha256(b).hexdigest()


def main():
    checks = nbdtest.Checks()
    want = {
        "after_ab:ov": sha(AFTER_AB),
        "final:big1": sha(Z + A[:HALF] + C[:HALF]),
        "final:big2": sha(C[HALF:] + B[HALF:] + Z),
        "final:big": sha(FINAL),
        "final:ov": sha(FINAL),
    }
    script = SCRIPT % {"w1_last": (W - MIB) // HALF, "w1_last2": (W - 2 * MIB) // HALF,
                       "big_at": OV_OFF // HALF}
    with nbdtest.tempdir("nbdcached-kernel-") as tmp:
        img = guest.big_backend(tmp, SIZE)
        d = nbdtest.Daemon([("big", img, "split=32bit"),
                            ("ov", img, "offset=%d,size=%d" % (OV_OFF, OV_SIZE))],
                           tcp=False, workdir=tmp)
        try:
            g = guest.run_guest("amd64", script, d.sock, tmp, name="windows", timeout=300)
            kv = g.kvs()
            checks.expect(g.exit_rc == 0, "the guest script exited %r" % g.exit_rc)
            for n, size in enumerate((W, W, OV_SIZE, SIZE)):
                checks.expect(kv.get("size:nbd%d" % n) == str(size), "nbd%d: %s bytes, expected %d"
                              % (n, kv.get("size:nbd%d" % n), size))
            for key, w in want.items():
                checks.expect(kv.get(key) == w, "guest read %s: sha256 %s, expected %s"
                              % (key, kv.get(key), w))
            h = {name: nbdtest.libnbd_handle(d.unix_uri(name)) for name in ("big", "big/1", "big/2", "ov")}
            try:
                for name, off, n, expect in (
                        ("big", OV_OFF, OV_SIZE, FINAL),
                        ("ov", 0, OV_SIZE, FINAL),
                        ("big/1", W - 2 * MIB, 2 * MIB, FINAL[:2 * MIB]),
                        ("big/2", 0, 2 * MIB, FINAL[2 * MIB:]),
                        ("big", W - MIB, 2 * MIB, bytes(2 * MIB)),          # big/0 | big/1
                        ("big", 3 * W - MIB, 2 * MIB, bytes(2 * MIB)),      # big/2 | big/3
                        ("big", BASE % (16 << 40) - 2 * MIB, 4 * MIB, bytes(4 * MIB))):
                    d_ = nbdtest.describe_diff(h[name].pread(n, off), expect, off)
                    checks.expect(not d_, "libnbd %s at %d: %s" % (name, off, d_))
                    if not d_:
                        nbdtest.log("libnbd %s [%d, %d): as expected" % (name, off, off + n))
            finally:
                nbdtest.shutdown_all(h.values())
        finally:
            d.stop()
        got = nbdtest.read_at(img, OV_OFF, OV_SIZE)
        d_ = nbdtest.describe_diff(got, FINAL, OV_OFF)
        checks.expect(not d_, "the backend around 2W: " + d_)
        layout = [s for s in nbdtest.file_layout(img, SIZE) if s[2] == 0]
        nbdtest.log("the backend's data: %s" % ["[%d, %d)" % (s, e) for s, e, _ in layout])
        checks.expect(all(s >= BASE - MIB and e <= BASE + MIB for s, e, _ in layout) and layout,
                      "data outside [2W - 1 MiB, 2W + 1 MiB): %r" % layout)
        guest.remove_backend(img)
    checks.finish("kernel windows")


if __name__ == "__main__":
    main()
