#!/usr/bin/python3
"""Kernel test 5: five live upgrades (nbdcachectl upgrade) under a mounted
ext4 that Debian 12's amd64 kernel keeps writing to.

The guest attaches the export with nbd-client (netlink, -timeout 30),
makes an ext4 on it, mounts it and writes files one after the other with
dd conv=fsync, printing each file's sha256, for WRITE_SECONDS. Once it has
written a few, the host upgrades the daemon five times, a few seconds
apart; the third upgrade goes to a different build of the daemon (the
clang build, else the ASan one). Then:

  * every upgrade is answered with a new PID and the one connection moved;
  * the guest's dmesg has no I/O error, no aborted journal, no ext4 error
    and no dead connection; no dd failed; the file system unmounts;
  * the guest connected exactly once (the relay saw one connection) and
    the daemons' log says it was handed over five times;
  * after the last daemon's SIGTERM, e2fsck -fn on the backend is clean
    and every file reads back (debugfs) with the sha256 the guest printed.

amd64_restart.py asserts what a plain SIGTERM and start do instead.
"""

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
import nbdtest  # noqa: E402

SIZE = 1 << 30
WRITE_SECONDS = 40
FILES_BEFORE = 4
UPGRADES = 5
DIFFERENT = 3  # which upgrade goes to another build

SCRIPT = r"""
run nbd-client 10.0.2.100 10809 /dev/nbd0 -N vol -b 4096 -t 30 || die attach
run mkfs.ext4 -F -q -E nodiscard /dev/nbd0 || die mkfs
run mount -t ext4 /dev/nbd0 /mnt || die mount
%(writes)ssync
dmesg | grep -iE 'nbd|I/O error|JBD2|Aborting|EXT4-fs' | sed 's/^/dmesg: /' | head -20
kv io_errors $(dmesg | grep -ciE 'I/O error|Aborting journal|EXT4-fs error|Dead connection|timed out')
run umount /mnt || die umount
run nbd-client -d /dev/nbd0
"""


def other_build():
    """A different build of the daemon: clang's, else ASan's, else made."""
    for b in ("build-clang", "build-asan"):
        p = os.path.join(nbdtest.TOP, b, "nbdcached")
        if os.access(p, os.X_OK) and os.path.realpath(p) != os.path.realpath(nbdtest.NBDCACHED):
            return p
    nbdtest.log("+ make BUILD=build-clang CC=clang programs")
    subprocess.run(["make", "-C", nbdtest.TOP, "BUILD=build-clang", "CC=clang", "programs"],
                   check=True, stdout=subprocess.DEVNULL, timeout=900)
    return os.path.join(nbdtest.TOP, "build-clang", "nbdcached")


def pid_of(d):
    return nbdtest.pidfile_pid(d.pidfile)


def upgrade(checks, d, n, binary, keep):
    before = pid_of(d)
    args = [nbdtest.NBDCACHECTL, "--control", d.control, "--json", "upgrade"]
    if binary:
        args += ["--binary", binary]
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    took = time.time() - t0
    nbdtest.reap_children(keep)
    if not checks.expect(p.returncode == 0, "upgrade %d: exit %d: %s"
                         % (n, p.returncode, p.stderr.strip())):
        return
    r = json.loads(p.stdout)
    nbdtest.wait_until(lambda: pid_of(d) == r["pid"], 10)
    nbdtest.log("upgrade %d%s: pid %d -> %d, %d moved, %d closed, paused %d ms (%.2f s in all)"
                % (n, " to " + binary if binary else "", before, r["pid"], r["moved"],
                   r["closed"], r["pause_ms"], took))
    checks.expect(r["moved"] == 1 and r["closed"] == 0,
                  "upgrade %d: %d moved, %d closed (the guest's one connection)"
                  % (n, r["moved"], r["closed"]))
    checks.expect(pid_of(d) == r["pid"] != before, "upgrade %d: the pidfile says %d"
                  % (n, pid_of(d)))


def run(checks, tmp):
    # Each new daemon is orphaned when its predecessor exits: ours to reap.
    nbdtest.subreaper()
    other = other_build()
    img = os.path.join(tmp, "vol.img")
    nbdtest.sparse_file(img, SIZE)
    d = nbdtest.Daemon([("vol", img, "")], tcp=False, workdir=tmp)
    g = guest.Guest("amd64", SCRIPT % {"writes": guest.FSYNC_WRITES % {"seconds": WRITE_SECONDS}}, d.sock, tmp, name="upgrade",
                    timeout=400)
    done = 0
    try:
        with g:
            g.start()
            if g.wait_for("KTEST-KV written:/w%d " % (FILES_BEFORE - 1), timeout=300):
                for n in range(1, UPGRADES + 1):
                    upgrade(checks, d, n, other if n == DIFFERENT else None, {g.proc.pid})
                    done += 1
                    time.sleep(3)
            g.wait()
    finally:
        try:
            rc = nbdtest.stop_pid(pid_of(d)) or 0
        except Exception:  # noqa: BLE001 - the daemon is killed; the failure is reported
            for pid in {pid_of(d), d.pid}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            raise
    text = d.log_text()
    checks.expect(rc == 0, "the last daemon exited %d" % rc)
    checks.expect(done == UPGRADES, "%d upgrades done (the guest never wrote?)" % done)
    checks.expect(g.exit_rc == 0, "the guest script exited %r" % g.exit_rc)
    kv = g.kvs()
    written = {k[len("written:"):]: v for k, v in kv.items() if k.startswith("written:")}
    errors = {k[len("write_error:"):]: v for k, v in kv.items() if k.startswith("write_error:")}
    conns = guest.relay_connections(g)
    moved = text.count("handed over to the new daemon")
    nbdtest.log("%d file(s) written and fsync'ed, %d write(s) failed, %d connection(s), "
                "handed over %d time(s), %s I/O error line(s) in the guest's dmesg"
                % (len(written), len(errors), conns, moved, kv.get("io_errors")))
    checks.expect(len(written) > FILES_BEFORE + UPGRADES, "only %d file(s) written" % len(written))
    checks.expect(not errors, "writes failed: %s" % errors)
    checks.expect(kv.get("io_errors") == "0", "the guest's dmesg has %s I/O error line(s)"
                  % kv.get("io_errors"))
    checks.expect(conns == 1, "%d connections (expected 1: never reconnected)" % conns)
    checks.expect(moved == UPGRADES, "the log says the connection was handed over %d times"
                  % moved)
    checks.expect("Sanitizer" not in text, "a sanitizer report in the daemons' log")
    rc, out = guest.e2fsck(img)
    checks.expect(rc == 0, "e2fsck -fn on the backend: exit %d" % rc)
    good = guest.check_files(checks, img, written)
    nbdtest.log("%d of the %d fsync'ed files read back intact" % (good, len(written)))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir("nbdcached-kernel-") as tmp:
        checks.run("five upgrades under a mounted ext4", run, checks, tmp)
    checks.finish("kernel upgrade")


if __name__ == "__main__":
    main()
