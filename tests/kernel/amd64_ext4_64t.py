#!/usr/bin/python3
"""Kernel test 1: the amd64 kernel's NBD client on a 64 TiB export.

Debian's amd64 kernel, booted under qemu (tests/kernel/guest.py), attaches
a 64 TiB export (a sparse file in /dev/shm) with nbd-client -C 2 (two
connections, the daemon advertises CAN_MULTI_CONN), makes an ext4 file
system on it (lazy inode tables and journal, no resize inode, no discard at
mkfs), mounts it with -o discard, writes files and prints their sha256,
deletes one (the discard sends TRIM), syncs, unmounts and detaches.
The host stops the daemon with SIGTERM (which writes everything back) and
reads the files straight from the backend file with debugfs; e2fsck -fn is
clean. The control socket's stats show the kernel's FLUSH, FUA writes and
TRIM (its per-export request counts), as many as the daemon's debug log
(--log-level debug logs every request), and the backend flushes and direct
(FUA) writes they caused.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import nbdtest  # noqa: E402

SIZE = 64 << 40

SCRIPT = r"""
mark attach
run nbd-client 10.0.2.100 10809 /dev/nbd0 -N big -C 2 -b 4096 || die "attach"
kv size_bytes $(( $(cat /sys/block/nbd0/size) * 512 ))
mark mkfs
run mkfs.ext4 -F -q -E lazy_itable_init=1,lazy_journal_init=1,nodiscard -O ^resize_inode -J size=16 /dev/nbd0 || die "mkfs"
mark mount
run mount -t ext4 -o discard,noinit_itable /dev/nbd0 /mnt || die "mount"
df -k /mnt | tail -1
dd if=/dev/urandom of=/mnt/f1 bs=64k count=16 2>/dev/null
dd if=/dev/urandom of=/mnt/f2 bs=1M count=8 2>/dev/null
mkdir /mnt/dir
echo "a small file in a directory" >/mnt/dir/f3
dd if=/dev/urandom of=/mnt/gone bs=1M count=4 conv=fsync 2>/dev/null
sync
rm /mnt/gone
for f in f1 f2 dir/f3; do kv sha256:/$f $(sha256sum /mnt/$f | cut -d' ' -f1); done
mark sync
sync
run umount /mnt || die "umount"
mark detach
run nbd-client -d /dev/nbd0 || die "detach"
mark done
"""


def main():
    checks = nbdtest.Checks()
    os.environ["NBDCACHED_DEBUG"] = "1"
    with nbdtest.tempdir("nbdcached-kernel-") as tmp:
        img = guest.big_backend(tmp, SIZE)
        d = nbdtest.Daemon([("big", img, "")], tcp=False, workdir=tmp)
        try:
            t0 = time.time()
            g = guest.run_guest("amd64", SCRIPT, d.sock, tmp, name="ext4", timeout=480)
            log_phases(g)
            kv = g.kvs()
            checks.expect(g.exit_rc == 0, "the guest script exited %r" % g.exit_rc)
            checks.expect(kv.get("size_bytes") == str(SIZE),
                          "the kernel sees %s bytes, expected %d" % (kv.get("size_bytes"), SIZE))
            conns = guest.relay_connections(g)
            nbdtest.log("guest connections made: %d" % conns)
            checks.expect(conns >= 2, "nbd-client -C 2 made %d connection(s)" % conns)
            st = nbdtest.control_request(d.control, {"command": "stats", "export": "big"})
            ex = st["exports"][0]
            cmds = ex["commands"]
            nbdtest.log("stats: commands %s; backend_flushes=%d direct_writes=%d"
                        % (cmds, ex["backend_flushes"], st["cache"]["direct_writes"]))
            counts = guest.command_counts(d.log_text())
            nbdtest.log("requests in the debug log: %s" % counts)
            checks.expect(cmds["flush"] > 0, "stats: no FLUSH from the kernel")
            checks.expect(cmds["fua"] > 0, "stats: no FUA write from the kernel")
            checks.expect(cmds["trim"] > 0, "stats: no TRIM from the kernel (mount -o discard, rm)")
            for key, logged in (("flush", "NBD_CMD_FLUSH"), ("trim", "NBD_CMD_TRIM"),
                                ("fua", "NBD_CMD_WRITE+FUA")):
                checks.expect(cmds[key] == counts.get(logged, 0), "stats: %s %d, the log has %d %s"
                              % (key, cmds[key], counts.get(logged, 0), logged))
            checks.expect(ex["backend_flushes"] > 0, "stats: no backend flush")
            checks.expect(st["cache"]["direct_writes"] > 0, "stats: no direct (FUA) write")
            nbdtest.log("guest run %.1fs" % (time.time() - t0))
        finally:
            d.stop()
        t1 = time.time()
        files = {k[len("sha256:"):]: v for k, v in kv.items() if k.startswith("sha256:")}
        nbdtest.log("%d of %d file(s) match on the backend"
                    % (guest.check_files(checks, img, files), len(files)))
        checks.expect(sum(k.startswith("sha256:") for k in kv) == 3, "the guest reported %d files"
                      % sum(k.startswith("sha256:") for k in kv))
        rc, _ = guest.e2fsck(img)
        checks.expect(rc == 0, "e2fsck -fn exit %d" % rc)
        nbdtest.log("TIMING host checks (debugfs, e2fsck) %.1fs" % (time.time() - t1))
        guest.remove_backend(img)
    checks.finish("kernel amd64 64 TiB ext4")


def log_phases(g):
    """The guest's phases, from its uptime stamps."""
    marks = []
    for ln in g.lines:
        if ln.startswith("KTEST-MARK "):
            p = ln.split()
            marks.append((p[1], float(p[-1])))
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        nbdtest.log("TIMING phase %s: %.1fs" % (a, tb - ta))


if __name__ == "__main__":
    main()
