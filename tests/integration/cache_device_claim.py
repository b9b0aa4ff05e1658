#!/usr/bin/python3
"""cache_device_claim: a cache device belongs to one daemon, and to nobody
who could read it (issue 40, item 4).

  1  A device file others can read (mode 0644, as truncate leaves it under
     umask 022): the start is refused, and --check-config too (exit 1),
     with the mode and the chmod that fixes it; 0640 likewise (its group);
     after chmod 600 the daemon starts.
  2  A device file in use: daemon A serves with it; a second daemon on the
     same device is refused, naming A's PID, and so is --check-config,
     while A runs; A's FLUSHed data is untouched by the refused ones. A is
     SIGKILLed (the kernel drops its lock): a new daemon starts on the
     device and replays what A's log held.
  3  A block device (a loop device over a file; skipped when the machine
     has none): daemon A on it; a second daemon and --check-config are
     refused (O_EXCL and the lock) while A runs.
"""

import os
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = 64 * MIB
DEVICE = 64 * MIB
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def start(tmp, disk, dev, what):
    work = os.path.join(tmp, "d%d" % len(os.listdir(tmp)))
    os.mkdir(work)
    # (nbdtest.Daemon makes a device file 0600: not here, where the mode
    # is what is tested; the caller sets it.)
    return nbdtest.CheckedDaemon([("disk", disk, "")], workdir=work, tcp=False,
                                 extra=["--cache-device", dev, "--cache-size", "32M",
                                        "--dirty-expire", "3600", "--cache-mode", "writeback"],
                                 what=what)


def second(tmp, disk, dev):
    """A second daemon on dev (it must be refused): exit status and output;
    one that serves instead (its socket appears) is stopped by its PID,
    and said so (exit status 0)."""
    sock = os.path.join(tmp, "second.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    out = os.path.join(tmp, "second.log")
    args = [nbdtest.NBDCACHED, "--foreground", "--control", "none", "--unix", sock,
            "--export", "disk=%s" % disk, "--cache-size", "32M", "--cache-device", dev]
    with open(out, "w") as f:
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    served = False
    for _ in range(1200):
        if p.poll() is not None:
            break
        if os.path.exists(sock):
            served = True
            break
        time.sleep(0.05)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM if served else signal.SIGKILL)
        p.wait(timeout=60)
    with open(out) as f:
        text = f.read()
    if served:
        return 0, text + "\n(the second daemon started and served)"
    return p.returncode, text


def check_config(disk, dev):
    p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--export", "disk=%s" % disk,
                        "--cache-device", dev], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def refused_both(tmp, disk, dev, what, pattern):
    for kind, (rc, out) in (("a second daemon", second(tmp, disk, dev)),
                            ("--check-config", check_config(disk, dev))):
        line = [ln for ln in out.splitlines() if "cache device" in ln]
        log("  %s, %s: exit %d: %s" % (what, kind, rc, line[-1] if line else out[-300:]))
        expect(rc != 0 and re.search(pattern, out), "%s: %s: exit %d, output does not say "
               "%r:\n%s" % (what, kind, rc, pattern, out[-2000:]))


def mode(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    for m, who in ((0o644, "users other than its owner can read"),
                   (0o640, "users other than its owner can read"),
                   (0o602, "users other than its owner can write")):
        os.chmod(dev, m)
        pattern = r"mode %04o: %s it.*chmod go-rwx %s" % (m, who, re.escape(dev))
        refused_both(tmp, disk, dev, "mode %04o" % m, pattern)
    os.chmod(dev, 0o600)
    d = start(tmp, disk, dev, "the device with mode 0600")
    d.stop()


def in_use(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    os.chmod(dev, 0o600)
    data = os.urandom(2 * MIB)
    a = start(tmp, disk, dev, "daemon A")
    try:
        h = nbdtest.libnbd_handle(a.unix_uri("disk"))
        h.pwrite(data, 4 * MIB)
        h.flush()                       # answered from A's log
        refused_both(tmp, disk, dev, "while daemon A runs",
                     r"in use by another daemon: nbdcached \(PID %d\)" % a.proc.pid)
        expect(h.pread(len(data), 4 * MIB) == data, "A reads back what it FLUSHed after the "
               "refused starts")
    finally:
        a.kill()
        a.logf.close()
    require(nbdtest.read_at(disk, 4 * MIB, len(data)) != data, "the data reached the backend "
            "file before the kill: the test does not show A's log replayed")
    b = start(tmp, disk, dev, "a daemon after A's SIGKILL")
    try:
        h = nbdtest.libnbd_handle(b.unix_uri("disk"))
        nbdtest.require_same(h.pread(len(data), 4 * MIB), data, "read after A's log was "
                             "replayed", base=4 * MIB)
        h.shutdown()
    finally:
        b.stop()
    nbdtest.require_same(nbdtest.read_at(disk, 4 * MIB, len(data)), data,
                         "the backend file after the replay", base=4 * MIB)


def block_device(tmp):
    backing = os.path.join(tmp, "dev.img")
    disk = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(backing, DEVICE)
    nbdtest.sparse_file(disk, SIZE)
    p = subprocess.run(["losetup", "-f", "--show", backing], capture_output=True, text=True)
    if p.returncode != 0:
        log("  no loop device (%s): the block device case is not run" % p.stderr.strip())
        return
    dev = p.stdout.strip()
    try:
        os.chmod(dev, 0o660)
        a = start(tmp, disk, dev, "daemon A on %s" % dev)
        try:
            refused_both(tmp, disk, dev, "%s while daemon A runs" % dev,
                         r"cache device %s: in use" % re.escape(dev))
        finally:
            a.stop()
    finally:
        subprocess.run(["losetup", "-d", dev])


def main():
    if not os.path.exists("/dev/loop-control"):
        log("no /dev/loop-control: the block device case logs why it is not run")
    with nbdtest.tempdir() as tmp:
        for name, fn in (("1 a device file others can read is refused", mode),
                         ("2 a device in use by another daemon is refused", in_use),
                         ("3 a block device in use is refused", block_device)):
            sub = os.path.join(tmp, fn.__name__)
            os.mkdir(sub)
            CHECKS.run(name, fn, sub)
    CHECKS.finish("cache device claim")


if __name__ == "__main__":
    main()
