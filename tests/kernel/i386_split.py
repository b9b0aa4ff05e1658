#!/usr/bin/python3
"""Kernel test 2: the i386 kernel's NBD client, a 64 TiB export and its
split=32bit windows.

Debian's i386 kernel (linux-image-686's package, unpacked, never installed)
is booted three times under qemu (tests/kernel/guest.py) against one daemon
serving a 64 TiB sparse file as export `big` with split=32bit: windows
big/0 .. big/4 of W = 16 TiB - 2 MiB bytes (the last one shorter).

 boot 1: nbd-client attaching the whole 64 TiB export is refused by the
         i386 nbd-client; its message is shown (and asserted). Then window
         big/3 is attached and 4 KiB O_DIRECT writes (dd oflag=direct) of
         distinct patterns go to its first 4 KiB, its middle and its last
         4 KiB, read back in the guest with O_DIRECT.
 host:   python3-libnbd on the whole export finds each at 3*W + offset,
         and not at (3*W + offset) mod 16 TiB.
 boot 2: buffered writes (the page cache, then sync) of other patterns at
         the same three places; the host checks them the same way.
 boot 3: mkfs.ext4 on big/3, a file written, the file system unmounted,
         mounted again and the file read back; detached. After SIGTERM the
         host reads the file with debugfs from the backend at offset 3*W,
         and e2fsck -fn there is clean.
"""

import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import nbdtest  # noqa: E402

SIZE = 64 << 40
W = (16 << 40) - (2 << 20)          # split=32bit
K = 3                               # the window attached
PLACES = {"first": 0, "middle": W // 2, "last": W - 4096}
TIB16 = 16 << 40

# pattern TAG: 4 KiB, a 16-byte line "TAG" padded with dashes, 256 times.
PATTERN_SH = r"""
pattern() {
	line=$(printf '%-15.15s' "$1" | tr ' ' '-')
	i=0; : >/tmp/pat
	while [ $i -lt 256 ]; do printf '%s\n' "$line" >>/tmp/pat; i=$((i + 1)); done
}
"""


def pattern(tag):
    line = ("%-15.15s" % tag).replace(" ", "-") + "\n"
    return (line * 256).encode()


def tag(kind, place):
    return "%s-%s-w%d" % (kind, place, K)


def write_script(kind):
    """Guest: write kind's pattern at each place of big/3 (O_DIRECT for
    "direct", buffered + sync for "buffered"), read each back."""
    flag = "oflag=direct" if kind == "direct" else ""
    s = PATTERN_SH
    s += "run nbd-client 10.0.2.100 10809 /dev/nbd0 -N big/%d -b 4096 || die attach\n" % K
    s += "kv size_bytes $(( $(cat /sys/block/nbd0/size) * 512 ))\n"
    for place, off in PLACES.items():
        s += ("pattern %s\nrun dd if=/tmp/pat of=/dev/nbd0 bs=4096 count=1 seek=%d conv=notrunc %s"
              " || die 'dd %s'\n" % (tag(kind, place), off // 4096, flag, place))
    if kind == "buffered":
        s += "sync\n"
    s += "echo 3 >/proc/sys/vm/drop_caches\n"
    for place, off in PLACES.items():
        s += ("kv readback:%s $(dd if=/dev/nbd0 bs=4096 count=1 skip=%d iflag=direct 2>/dev/null"
              " | sha256sum | cut -d' ' -f1)\n" % (place, off // 4096))
    s += "run nbd-client -d /dev/nbd0 || die detach\n"
    return s


REFUSE = r"""
mark whole
nbd-client 10.0.2.100 10809 /dev/nbd0 -N big -b 4096 >/tmp/out 2>&1
rc=$?
sed 's/^/nbd-client: /' /tmp/out
kv whole_rc $rc
kv whole_msg $(sed -n 's/.*\(Error: .*\)/\1/p' /tmp/out)
kv whole_size_after $(cat /sys/block/nbd0/size)
"""

MKFS = r"""
run nbd-client 10.0.2.100 10809 /dev/nbd0 -N big/3 -b 4096 || die attach
mark mkfs
run mkfs.ext4 -F -q -E lazy_itable_init=1,lazy_journal_init=1,nodiscard -O ^resize_inode -J size=16 /dev/nbd0 || die mkfs
mark mount
run mount -t ext4 -o noinit_itable /dev/nbd0 /mnt || die mount
dd if=/dev/urandom of=/mnt/file bs=64k count=32 2>/dev/null
kv sha256 $(sha256sum /mnt/file | cut -d' ' -f1)
run umount /mnt || die umount
echo 3 >/proc/sys/vm/drop_caches
run mount -t ext4 -o ro /dev/nbd0 /mnt || die remount
kv sha256_again $(sha256sum /mnt/file | cut -d' ' -f1)
run umount /mnt
run nbd-client -d /dev/nbd0 || die detach
"""


def check_patterns(checks, d, kind):
    import nbd
    h = nbdtest.libnbd_handle(d.unix_uri("big"))
    try:
        checks.expect(h.get_size() == SIZE, "export big: %d bytes" % h.get_size())
        for place, off in PLACES.items():
            want = pattern(tag(kind, place))
            at = K * W + off
            got = h.pread(4096, at)
            checks.expect(got == want, "%s %s: not at 3*W + %d = %d (found %r...)"
                          % (kind, place, off, at, got[:16]))
            wrapped = at % TIB16
            other = h.pread(4096, wrapped)
            checks.expect(other != want, "%s %s: also at (3*W + %d) mod 16 TiB = %d"
                          % (kind, place, off, wrapped))
            nbdtest.log("%s %s: found at %d = 3*W + %d; at %d (mod 16 TiB): %r..."
                        % (kind, place, at, off, wrapped, other[:16]))
    finally:
        nbdtest.shutdown_all([h])
        del nbd


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir("nbdcached-kernel-") as tmp:
        img = guest.big_backend(tmp, SIZE)
        d = nbdtest.Daemon([("big", img, "split=32bit")], tcp=False, workdir=tmp)
        try:
            ex = nbdtest.control_request(d.control, {"command": "exports"})["exports"]
            nbdtest.log("exports: " + ", ".join("%s (%d bytes at %d)" % (e["name"], e["size"], e["offset"])
                                                for e in ex))
            win = [e for e in ex if e["name"] == "big/%d" % K]
            checks.expect(win and win[0]["size"] == W and win[0]["offset"] == K * W,
                          "big/%d is not W bytes at 3*W: %r" % (K, win))

            g = guest.run_guest("i386", REFUSE + write_script("direct"), d.sock, tmp,
                                name="direct", timeout=300)
            kv = g.kvs()
            checks.expect(g.exit_rc == 0, "boot 1 exited %r" % g.exit_rc)
            nbdtest.log("i386 nbd-client on the whole 64 TiB export: exit %s: %s"
                        % (kv.get("whole_rc"), kv.get("whole_msg")))
            checks.expect(kv.get("whole_rc") not in (None, "0"),
                          "the i386 nbd-client attached the whole 64 TiB export")
            checks.expect("too big" in kv.get("whole_msg", ""),
                          "no 'too big' in the i386 nbd-client's message %r" % kv.get("whole_msg"))
            checks.expect(kv.get("whole_size_after") == "0",
                          "nbd0 has %s sectors after the refusal" % kv.get("whole_size_after"))
            checks.expect(kv.get("size_bytes") == str(W), "big/3 seen as %s bytes, W is %d"
                          % (kv.get("size_bytes"), W))
            for place in PLACES:
                want = hashlib.sha256(pattern(tag("direct", place))).hexdigest()
                checks.expect(kv.get("readback:" + place) == want,
                              "guest O_DIRECT read back of %s differs" % place)
            check_patterns(checks, d, "direct")

            g = guest.run_guest("i386", write_script("buffered"), d.sock, tmp,
                                name="buffered", timeout=300)
            kv = g.kvs()
            checks.expect(g.exit_rc == 0, "boot 2 exited %r" % g.exit_rc)
            for place in PLACES:
                want = hashlib.sha256(pattern(tag("buffered", place))).hexdigest()
                checks.expect(kv.get("readback:" + place) == want,
                              "guest read back of buffered %s differs" % place)
            check_patterns(checks, d, "buffered")

            g = guest.run_guest("i386", MKFS, d.sock, tmp, name="mkfs", timeout=600)
            kv3 = g.kvs()
            checks.expect(g.exit_rc == 0, "boot 3 exited %r" % g.exit_rc)
            checks.expect(kv3.get("sha256") and kv3.get("sha256") == kv3.get("sha256_again"),
                          "the file read back after remounting differs")
        finally:
            d.stop()
        t1 = time.time()
        fs = "%s?offset=%d" % (img, K * W)
        if kv3.get("sha256"):
            try:
                got = hashlib.sha256(guest.debugfs_cat(fs, "/file")).hexdigest()
                checks.expect(got == kv3["sha256"], "/file on the backend at 3*W: sha256 %s, wrote %s"
                              % (got, kv3["sha256"]))
                nbdtest.log("/file: sha256 matches on the backend at offset 3*W")
            except nbdtest.Failed as e:
                checks.add(str(e))
        rc, _ = guest.e2fsck(fs)
        checks.expect(rc == 0, "e2fsck -fn at offset 3*W: exit %d" % rc)
        nbdtest.log("TIMING host checks %.1fs" % (time.time() - t1))
        guest.remove_backend(img)
    checks.finish("kernel i386 split=32bit")


if __name__ == "__main__":
    main()
