#!/usr/bin/python3
"""upgrade_device: `nbdcachectl upgrade` with a cache device, in each
cache-device-use mode, keeps every client and every FLUSHed byte.

The old daemon detaches the device before it starts the new one (the log
takes no more records, every export on it is written back and flushed
until the log is empty, the superblock says clean), closes it and drops
its lock; the new daemon opens it as a start does, with nothing to
replay, and logs (and fills its level-2 cache) from then on.

For each mode (both, log, l2), one daemon (--config: one export on a
64 MiB file, a 16 MiB cache in writeback, the device a 96 MiB file):

  1  Under load, UPGRADES_DEVICE upgrades in a row: CLIENTS libnbd clients
     (upgrade.py's: up to QD random commands in flight, READ checked
     against a byte model, WRITE some with FUA, TRIM, WRITE_ZEROES, FLUSH,
     BLOCK_STATUS) go on through every upgrade on the same connection: no
     command fails, no byte differs, no connection is dropped. After each,
     the new daemon has the device attached (not detached, not failed),
     the old one's log says it released it, the new one's that it
     replayed nothing; with the log, FLUSHes after the upgrade are
     answered from it (its commits grow); with level 2, evictions after
     the upgrade are stored there again.
  2  Roll-backs. A new daemon that exits at once (/bin/false) never said
     HELLO: the device was never detached, FLUSH is logged on. One that
     fails after the release (its backend is gone from the new config):
     the old daemon serves on without its device (said in its log; FLUSH
     goes to the backend, the device's commits do not grow), and the next
     upgrade gives the device to a new daemon again.
  3  A SIGKILL of the old or of the new daemon at a random moment of an
     upgrade (CRASH_TRIALS_DEVICE trials, the device in the given mode, a
     writer flushing every few writes): a fresh start with the same
     configuration (the device's log replayed if it holds one) reads every
     block as its last FLUSHed value or one written after it, never older.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402
import upgrade as up  # noqa: E402  (its Service and Client)

MIB = 1 << 20
DEVICE_SIZE = 96 * MIB
UPGRADES_DEVICE = int(os.environ.get("UPGRADES_DEVICE", "4"))
CRASH_TRIALS_DEVICE = int(os.environ.get("CRASH_TRIALS_DEVICE", "4"))
MODES = os.environ.get("UPGRADE_DEVICE_MODES", "both,log,l2").split(",")
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, OSError, subprocess.SubprocessError))
expect = CHECKS.expect


def setup(tmp, mode):
    disk = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(disk, up.SIZE)
    dev = os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(dev, DEVICE_SIZE)
    os.chmod(dev, 0o600)
    conf = os.path.join(tmp, "nbdcached.conf")
    with open(conf, "w") as f:
        f.write("[generic]\ncache-size = 16M\ncache-device = %s\ncache-device-use = %s\n\n"
                "[disk]\nbackend = %s\n" % (dev, mode, disk))
    return disk, dev, conf


def device_stats(svc):
    return nbdtest.control_request(svc.control, {"command": "stats"})["cache"]["cache_device"]


def upgrade(svc, binary=None):
    args = ["--json", "upgrade"] + (["--binary", binary] if binary else up.BINARY)
    r = svc.ctl(*args)
    svc.reap()
    return r


def check_attached(svc, mode, what):
    st = device_stats(svc)
    expect(st and not st["detached"] and not st["detaching"] and not st["failed"],
           "%s: the new daemon's device: %s" % (what, st))
    if "l2" in mode or mode == "both":
        expect(st["l2"]["on"], "%s: the new daemon's level-2 cache is off: %s" % (what, st))
    return st


def under_load(svc, mode):
    clients = [up.Client(svc, i, 2000 + i) for i in range(up.CLIENTS)]
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    try:
        for n in range(UPGRADES_DEVICE):
            time.sleep(0.5)
            text_before = len(svc.log_text())
            reply = up.upgraded(svc, n + 1, expect)
            if not reply:
                continue
            expect(reply["moved"] >= up.CLIENTS, "upgrade %d: %d connections moved"
                   % (n + 1, reply["moved"]))
            text = svc.log_text()[text_before:]
            expect("released (closed, its lock dropped)" in text,
                   "upgrade %d: the old daemon's log does not say it released the device"
                   % (n + 1))
            expect("in use by another daemon" not in text,
                   "upgrade %d: the new daemon found the device locked" % (n + 1))
            st = check_attached(svc, mode, "upgrade %d" % (n + 1))
            expect(st["replay_records"] == 0,
                   "upgrade %d: the new daemon replayed %d records of a device handed "
                   "over clean" % (n + 1, st["replay_records"]))
            # The new daemon uses it: FLUSHes go to its log, evictions to
            # its level 2 (the clients keep writing and reading meanwhile).
            if mode in ("both", "log"):
                expect(nbdtest.wait_until(lambda: device_stats(svc)["commits"] > 0, 20),
                       "upgrade %d: no FLUSH was logged by the new daemon: %s"
                       % (n + 1, device_stats(svc)))
            if mode in ("both", "l2"):
                expect(nbdtest.wait_until(
                    lambda: device_stats(svc)["l2"]["stored_bytes"] > 0, 20),
                    "upgrade %d: the new daemon stored nothing in its level 2: %s"
                    % (n + 1, device_stats(svc)))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    for c in clients:
        for e in c.errors[:5]:
            CHECKS.add("client %d: %s" % (c.index, e))
        log("  client %d: %s" % (c.index, ", ".join("%d %s" % (v, k) for k, v in c.done.items())))
        expect(sum(c.done.values()) > UPGRADES_DEVICE * 10, "client %d did too little" % c.index)
        got = c.h.pread(up.REGION, c.base)
        nbdtest.require_same(bytes(got), bytes(c.model), "client %d's region" % c.index,
                             base=c.base)
    return clients


def rollback(svc, mode, clients, conf, disk):
    h = clients[0].h
    base = clients[0].base

    def flush_new(off):
        data = os.urandom(8192)
        h.pwrite(data, base + off)
        h.flush()
        clients[0].model[off:off + 8192] = data
        return data

    # A new daemon that never says HELLO: the device was never detached.
    commits = device_stats(svc)["commits"]
    r = upgrade(svc, "/bin/false")
    expect(r.returncode != 0, "an upgrade to /bin/false succeeded")
    st = device_stats(svc)
    expect(not st["detached"] and not st["detaching"],
           "after an upgrade to /bin/false the device is detached: %s" % st)
    flush_new(0)
    if mode in ("both", "log"):
        expect(device_stats(svc)["commits"] > commits,
               "a FLUSH after the upgrade to /bin/false was not logged")
    # One that fails after the release (its backend is gone): this daemon
    # serves on without the device, and says so.
    with open(conf) as f:
        good = f.read()
    with open(conf, "w") as f:
        f.write(good.replace(disk, disk + ".gone"))
    r = upgrade(svc)
    with open(conf, "w") as f:
        f.write(good)
    expect(r.returncode != 0, "an upgrade to a daemon without its backend succeeded")
    expect("without its cache device" in svc.log_text(),
           "the roll-back after the release does not say the device is gone: %s"
           % (r.stderr + r.stdout).strip())
    st = device_stats(svc)
    expect(st["detached"], "after the roll-back the device is not detached: %s" % st)
    commits = st["commits"]
    flush_new(8192)
    expect(device_stats(svc)["commits"] == commits,
           "a FLUSH after the roll-back went to the released device")
    # The next upgrade gives it to the new daemon.
    if up.upgraded(svc, 0, expect):
        check_attached(svc, mode, "the upgrade after the roll-back")
    got = h.pread(16384, base)
    expect(bytes(got) == bytes(clients[0].model[0:16384]),
           "the blocks written around the roll-backs read otherwise")


class Writer:
    """Writes random blocks of a region, FLUSHes every few; keeps, per
    block, the value the last acknowledged FLUSH covers and those written
    since (any of which a crash may leave)."""

    BLOCKS = 512

    def __init__(self, uri, seed):
        self.rng = random.Random(seed)
        self.h = nbdtest.libnbd_handle(uri)
        self.durable = {}   # block -> bytes covered by an acknowledged FLUSH
        self.since = {}     # block -> [bytes written after it]
        self.errors = 0

    def run(self, stop):
        deadline = time.time() + 120
        try:
            while not stop.is_set() and time.time() < deadline:
                pending = {}
                for _ in range(6):
                    b = self.rng.randrange(self.BLOCKS)
                    data = os.urandom(4096)
                    self.since.setdefault(b, []).append(data)
                    self.h.pwrite(data, b * 4096)
                    pending[b] = data
                self.h.flush()
                for b, data in pending.items():
                    self.durable[b] = data
                    self.since[b] = []
        except (nbd.Error, OSError):
            self.errors += 1  # the daemon was killed: expected


def kill_daemons():
    """SIGKILL every nbdcached this process is the parent of, by PID, and
    wait for each to be gone (a dying one still holds the device's lock,
    which the next start would find taken)."""
    for pid in nbdtest.children_of(os.getpid()):
        try:
            with open("/proc/%d/comm" % pid) as f:
                if f.read().strip() != "nbdcached":
                    continue
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
    nbdtest.reap_children(up.PEERS)


def crash_trials(tmp, mode):
    rng = random.Random("%s-%s" % (os.environ.get("CRASH_SEED", "4242"), mode))
    replayed = 0
    for trial in range(CRASH_TRIALS_DEVICE):
        sub = os.path.join(tmp, "crash%d" % trial)
        os.mkdir(sub)
        disk, dev, conf = setup(sub, mode)
        svc = up.Service(sub, conf)
        victim = "old" if trial % 2 == 0 else "new"
        delay = rng.uniform(0.0, 1.2)
        try:
            w = Writer(svc.uri(), 77 + trial)
            stop = threading.Event()
            t = threading.Thread(target=w.run, args=(stop,), daemon=True)
            t.start()
            time.sleep(0.5)
            old = svc.pid_file()
            cmd = [nbdtest.NBDCACHECTL, "--control", svc.control, "upgrade"] + up.BINARY
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            end = time.time() + delay
            new = None
            while time.time() < end:
                kids = nbdtest.children_of(old)
                new = kids[0] if kids else new
                time.sleep(0.01)
            if victim == "new":
                kids = nbdtest.children_of(old)
                new = kids[0] if kids else new
            pid = old if victim == "old" or not new else new
            log("  trial %d: SIGKILL of the %s daemon (pid %d) %.2f s into the upgrade"
                % (trial, "old" if pid == old else "new", pid, delay))
            os.kill(pid, signal.SIGKILL)
            p.communicate(timeout=120)
            time.sleep(0.3)
            stop.set()
            t.join(60)
        finally:
            # Whatever daemon is left dies now (the new one, orphaned, is
            # this process's child: it is a subreaper).
            svc.kill_all()
            kill_daemons()
        # A start with the same configuration.
        os.rename(svc.logpath, svc.logpath + ".upgrade")
        try:
            svc2 = up.Service(sub, conf)
        except Failed:
            for path in (svc.logpath + ".upgrade", svc.logpath):
                with open(path) as f:
                    log("%s:\n%s" % (path, f.read()[-3000:]))
            raise
        try:
            h = nbdtest.libnbd_handle(svc2.uri())
            bad = 0
            for b, data in w.durable.items():
                got = bytes(h.pread(4096, b * 4096))
                if got != data and got not in w.since.get(b, []):
                    bad += 1
            expect(bad == 0, "trial %d (%s killed): %d of %d FLUSHed blocks read older data "
                   "after the restart" % (trial, victim, bad, len(w.durable)))
            st = device_stats(svc2)
            replayed += st["replay_records"] > 0
            log("  trial %d: %d FLUSHed blocks checked after the restart (it replayed %d "
                "records of the log)" % (trial, len(w.durable), st["replay_records"]))
            require(len(w.durable) > 0, "trial %d: nothing was FLUSHed" % trial)
            text = svc2.log_text()
            expect("Sanitizer" not in text and "runtime error:" not in text,
                   "a sanitizer report in the daemons' log")
            nbdtest.shutdown_all([h])
        finally:
            svc2.kill_all()
            kill_daemons()
    # The trials reached the log: some restarts had records to replay.
    if mode != "l2" and CRASH_TRIALS_DEVICE >= 4:
        expect(replayed > 0, "%s: no restart replayed a record: the kills missed the log"
               % mode)


def other_holder(svc, tmp, conf):
    """The new configuration names a device a third daemon holds: the new
    daemon waits only for its parent (the old one), so it is refused at
    once with the holder named, not left waiting until the timeout."""
    other = os.path.join(tmp, "other.dev")
    nbdtest.sparse_file(other, DEVICE_SIZE)
    os.chmod(other, 0o600)
    img = os.path.join(tmp, "other.img")
    nbdtest.sparse_file(img, 16 * MIB)
    os.mkdir(os.path.join(tmp, "b"))
    b = nbdtest.CheckedDaemon([("b", img, "")], workdir=os.path.join(tmp, "b"), tcp=False,
                              extra=["--cache-device", other])
    with open(conf) as f:
        good = f.read()
    try:
        with open(conf, "w") as f:
            f.write("\n".join("cache-device = %s" % other
                              if line.startswith("cache-device =") else line
                              for line in good.split("\n")))
        text_before = len(svc.log_text())
        r = upgrade(svc, None)
        said = (r.stderr + r.stdout).strip()
        log("  %s" % said)
        expect(r.returncode != 0, "an upgrade to a device another daemon holds succeeded")
        expect("in use by another daemon" in said and "PID %d" % b.pid in said,
               "the refusal does not name the holder (PID %d): %s" % (b.pid, said))
        expect("waiting up to" not in svc.log_text()[text_before:],
               "the new daemon waited for a device its parent does not hold")
    finally:
        with open(conf, "w") as f:
            f.write(good)
        b.stop()


def one_mode(mode):
    with nbdtest.tempdir() as tmp:
        disk, dev, conf = setup(tmp, mode)
        svc = up.Service(tmp, conf)
        try:
            clients = []
            ok = CHECKS.run("%s: %d upgrades under load" % (mode, UPGRADES_DEVICE),
                            lambda: clients.extend(under_load(svc, mode)))
            if ok and clients:
                CHECKS.run("%s: a roll-back keeps serving without the device" % mode,
                           rollback, svc, mode, clients, conf, disk)
                nbdtest.shutdown_all([c.h for c in clients])
                if mode == MODES[0]:
                    CHECKS.run("%s: a device another daemon holds is refused, not waited for"
                               % mode, other_holder, svc, tmp, conf)
            rc = svc.stop()
            expect(rc == 0, "%s: the last daemon exited %d" % (mode, rc))
            svc.reap()
            if ok and clients:
                with open(disk, "rb") as f:
                    for c in clients:
                        f.seek(c.base)
                        nbdtest.require_same(f.read(up.REGION), bytes(c.model),
                                             "the file, client %d's region" % c.index,
                                             base=c.base)
            text = svc.log_text()
            expect("Sanitizer" not in text and "runtime error:" not in text,
                   "a sanitizer report in the daemons' log")
        finally:
            if CHECKS.failures:
                log(svc.log_text()[-6000:])
            svc.kill_all()
        CHECKS.run("%s: SIGKILL during an upgrade, %d trials" % (mode, CRASH_TRIALS_DEVICE),
                   crash_trials, tmp, mode)


def main():
    nbdtest.subreaper()
    t0 = time.time()
    for mode in MODES:
        one_mode(mode)
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("upgrade_device")


if __name__ == "__main__":
    main()
