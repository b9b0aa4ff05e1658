#!/usr/bin/python3
"""cache_device_promise: a FLUSH answered from the cache device's intent
log promises that its data survives anything short of losing the device
(issue 46). Each check writes, has a FLUSH (or a FUA write) acknowledged,
then crashes something and reads back through the daemon and on the
backend. The daemons run in writeback mode with --dirty-expire 3600: only
a FLUSH, the log or a check's own command writes anything back.

  1  Resize, then a crash: a 64 MiB backend file, 1 MiB written and
     FLUSHed (to the log); the file grown to 128 MiB (truncate) and
     `nbdcachectl resize disk`; 1 MiB written at 100 MiB and FLUSHed;
     SIGKILL. The start must succeed (the backend is the one the records
     were written for, resized), read both MiB back, and put them on the
     file once its drain is done. A start that fails says why (its error
     lines), and whether it said "every dirty block is written back and
     flushed" as it exited.
  2  The file grown by truncate, no resize command, SIGKILL: the same file
     (device and inode), longer: the start replays the FLUSHed MiB. Before
     that, a copy of the file in its place (another inode, the size
     recorded): that start is refused, saying so, and does not say
     "every dirty block is written back and flushed" (nothing was).
  3  A device that fails part way through a commit (the device a file on
     faultfs, cache-device-use log): 4 MiB FLUSHed (one full batch: the
     device writes it took are counted), then 6 MiB written and faultfs
     armed with "fail-write-after N" (N those writes) before the FLUSH:
     the commit's first batch (4 MiB) lands, its second fails; that FLUSH
     gets EIO and the log says the intent log is off and the export goes
     writethrough. New bytes written over the 6 MiB and FLUSHed (to the
     backend now: they are on the file). SIGKILL, and a start on the
     device (healed): reads, and the file after the drain, hold the new
     bytes, never the first batch of the commit that failed. Twice: the
     device healed right after the failure (that FLUSH must succeed), and
     left failing until the SIGKILL (that FLUSH may get EIO instead: the
     log cannot be voided on the device; then only the first 4 MiB are
     promised).
  4  After the device failed (a commit failing), a FUA write of 64 KiB
     over bytes that a committed record holds (a 1 MiB FLUSH before the
     failure): SIGKILL, a start on the healed device: the FUA write's
     bytes win over the record, and the rest of the MiB is as FLUSHed.
     Healed at once (the FUA write must succeed), and left failing until
     the SIGKILL (it may get EIO: then the rest of the MiB is checked).
  5  Direct writes answered from the log, then a backend that loses them:
     an NBD backend (nbdkit through the fault filter, drop-unflushed) over
     an image with random bytes; --cache-size 4M; WRITE_ZEROES of 1 MiB
     that RAM does not hold and a 6 MiB WRITE (larger than the cache: it
     goes around it), then FLUSH (a log round: its commit is counted, and
     any backend flush). The NBD server then crashes, losing every write
     no flush covered (a flush the filter fails puts the old bytes back;
     SIGKILL; a new one on the same socket), and the daemon's connections
     are seen lost and back ("backend reconnected"). A FLUSH must succeed
     (what was acknowledged is in the log, or was flushed on the
     backend), and reads through the daemon, and the image after SIGTERM,
     must hold the zeros and the 6 MiB.
  6  A CLEAN record over bytes the backend flush behind it did not cover:
     an NBD server (nbdkit's sh plugin over an image on faultfs) whose
     flush fsyncs the image at once but answers only when the test lets
     it. 64 KiB written (one entry), one block of it TRIMmed (the block
     leaves the cache); `nbdcachectl flush disk` writes the entry back and
     sends the backend flush, which is held; meanwhile WRITE_ZEROES of
     that block (a direct write the held flush does not cover) and a READ
     of it (the block filled, clean); the flush let go (the entry settles
     clean), then a FLUSH. SIGKILL; the NBD server crashes (SIGKILL, a
     faultfs power loss: the image back to its last fsync) and starts
     again, and so does the daemon: the block must read as zeros (the
     FLUSH acknowledged them), and be zeros on the image after the drain.
     (A daemon that flushes the backend before that FLUSH is answered
     leaves the crash nothing to lose; one whose WRITE_ZEROES or READ
     waits for the held flush goes on once it is let go.)
  7  The level-2 map claims only bytes the backend flushed: an NBD backend
     (drop-unflushed), a device of 96 MiB with a level-2 area,
     --cache-device-warm all; WRITE_ZEROES of 1 MiB over random bytes RAM
     does not hold, no FLUSH, then a READ of it (a fill the level-2 cache
     may be offered), the level-2 map given time to take what the ring
     wrote: none of it went to the area (its stored bytes do not move);
     SIGKILL; the NBD server crashes, losing the WRITE_ZEROES (unless a
     background flush covered them first: then it keeps them); a
     warm start: a READ of the MiB must return what the backend holds
     (the random bytes), not the lost zeros from the level-2 area. And
     the level-2 cache is at work: another MiB, read before the direct
     write (nothing unflushed on the backend then), comes back from the
     area on the warm start (its hit bytes). With cache-device-use both
     and l2.

A run by hand may name checks: `cache_device_promise.py failed_commit
l2_unflushed` runs only the checks whose function name holds one of the
words.
"""

import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import faults  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log, require  # noqa: E402

import nbd  # noqa: E402

KIB = 1024
MIB = 1 << 20
SIZE = 64 * MIB
DEVICE = 64 * MIB
L2_DEVICE = 96 * MIB    # a log of 16 MiB, a level-2 area of about 80 MiB
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect
WRONG_CLOSE = "every dirty block is written back and flushed"


class Daemon(nbdtest.Daemon):
    """A Daemon whose failure to start is a Failed naming the error lines
    of its log, never leaving it running."""

    def __init__(self, *args, what=None, **kw):
        self.what = what
        super().__init__(*args, **kw)

    def _wait_ready(self, timeout=15):
        for _ in range(int(timeout / 0.05) + 1):
            if self.proc.poll() is not None:
                break
            if os.path.exists(self.sock):
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(self.sock)
                        s.recv(8)
                    return
                except OSError:
                    pass
            time.sleep(0.05)
        self.kill()
        text = self.log_text()
        self.logf.close()
        why = [ln.split(" error: ", 1)[-1] for ln in text.splitlines() if " error: " in ln]
        said = (" (and it said \"%s\" as it exited)" % WRONG_CLOSE
                if WRONG_CLOSE in text else "")
        raise Failed("nbdcached did not start with %s (exit %s): %s%s"
                     % (self.what or "its settings", self.proc.returncode,
                        " / ".join(why) or text[-1500:], said))


def daemon(tmp, backend, dev, name="disk", extra=(), what=None):
    """nbdcached in writeback mode, nothing written back before an hour,
    the intent log on dev."""
    work = os.path.join(tmp, "d%d" % len([n for n in os.listdir(tmp) if n.startswith("d")]))
    os.mkdir(work)
    return Daemon([(name, backend, "")], workdir=work, tcp=False,
                  extra=["--cache-device", dev, "--cache-size", "32M", "--dirty-expire",
                         "3600", "--cache-mode", "writeback"] + list(extra), what=what)


def killed(d):
    """SIGKILL by PID (reaped), its log closed."""
    d.kill()
    if not d.logf.closed:
        d.logf.close()


def stop(d, what):
    """SIGTERM by PID; Failed (not an exit of the whole test) unless it
    exits with status 0 within 30 s."""
    try:
        return d.stop(expect_rc=0)
    except SystemExit:
        raise Failed("%s: nbdcached did not exit with status 0 within 30 s of SIGTERM" % what)


def refused(disk, dev, name="disk"):
    """Start with these; it must fail. Its exit status and output."""
    args = [nbdtest.NBDCACHED, "--foreground", "--control", "none", "--unix",
            os.path.join(os.path.dirname(os.path.abspath(disk)), "refused.sock"), "--export",
            "%s=%s" % (name, disk), "--cache-size", "32M", "--cache-device", dev]
    nbdtest.own_device(args)
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def cache_stats(d):
    return nbdtest.control_request(d.control, {"command": "stats"})["cache"]


def device_stats(d):
    return cache_stats(d)["cache_device"]


def drained(d, what, timeout=60):
    """Wait until the live log the daemon found at start is all on the
    backends (its drain done): its device stats then."""
    st = None
    for _ in range(int(timeout * 10)):
        st = device_stats(d)
        if st["replay_pending_bytes"] == 0 and (st["replay_drain_ns"] or
                                                not st["replay_drained_bytes"]):
            return st
        time.sleep(0.1)
    raise Failed("%s: the log found at start was not written back in %d s: %s"
                 % (what, timeout, st))


def same(got, want, what, base, older=None):
    """got must be want; when it is not and older (the bytes a crash must
    not bring back) names some of it, say which."""
    why = nbdtest.describe_diff(got, want, base)
    if not why:
        return
    for label, off, data in older or ():
        a = off - base
        if 0 <= a and got[a:a + len(data)] == data:
            why += "; the %d bytes at %d are %s" % (len(data), off, label)
    raise Failed("%s: %s" % (what, why))


def check_reads(h, want, what, older=None):
    for off, data in sorted(want.items()):
        same(h.pread(len(data), off), data, "%s: a read at %d" % (what, off), off, older)


def check_data(path, want, what, older=None):
    for off, data in sorted(want.items()):
        same(nbdtest.read_at(path, off, len(data)), data,
             "%s: the backend file at %d" % (what, off), off, older)


def flush_result(h):
    """FLUSH through h: "ok", or the error's name."""
    try:
        h.flush()
        return "ok"
    except nbd.Error as e:
        return errno.errorcode.get(e.errnum, str(e.errnum))


# ---- 1, 2: a backend whose size changed ----

def resize_then_crash(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    a, b = os.urandom(MIB), os.urandom(MIB)
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(a, MIB)
        h.flush()
        os.truncate(disk, 2 * SIZE)
        p = nbdtest.nbdcachectl(d, "resize", "disk")
        require(p.returncode == 0 and "67108864 -> 134217728" in p.stdout,
                "nbdcachectl resize disk: exit %d: %s%s" % (p.returncode, p.stdout, p.stderr))
        h2 = nbdtest.libnbd_handle(d.unix_uri("disk"))
        require(h2.get_size() == 2 * SIZE, "a new connection sees %d bytes" % h2.get_size())
        h2.pwrite(b, 100 * MIB)
        h2.flush()
        require(nbdtest.read_at(disk, MIB, MIB) != a and
                nbdtest.read_at(disk, 100 * MIB, MIB) != b,
                "the FLUSHes wrote back: the test does not show the log at work")
    finally:
        killed(d)
    want = {MIB: a, 100 * MIB: b}
    d = daemon(tmp, disk, dev, what="the resized export after SIGKILL")
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        expect(h.get_size() == 2 * SIZE, "after the restart the export has %d bytes, the "
               "file %d" % (h.get_size(), 2 * SIZE))
        check_reads(h, want, "after the resize and SIGKILL")
        drained(d, "after the resize and SIGKILL")
        check_data(disk, want, "after the resize, SIGKILL and the drain")
        h.shutdown()
    except BaseException:
        killed(d)
        raise
    stop(d, "after the resize")


def grown_then_crash(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    a = os.urandom(MIB)
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(a, MIB)
        h.flush()
        require(nbdtest.read_at(disk, MIB, MIB) != a, "the FLUSH wrote back: the test does "
                "not show the log at work")
        os.truncate(disk, 2 * SIZE)
    finally:
        killed(d)
    # Another file in its place (a copy: another inode, of the size
    # recorded): refused, and nothing said to be written back.
    os.rename(disk, disk + ".orig")
    shutil.copyfile(disk + ".orig", disk)
    os.truncate(disk, SIZE)
    rc, out = refused(disk, dev)
    lines = [ln.split(" error: ", 1)[-1] for ln in out.splitlines() if " error: " in ln]
    log("  another file in its place: exit %d: %s" % (rc, " / ".join(lines) or out[-500:]))
    expect(rc != 0 and re.search(r"whose backend is not the one they were recorded for "
                                 r"\(another file", out),
           "a start with another file in the backend's place: exit %d: %s"
           % (rc, " / ".join(lines) or out[-1000:]))
    expect(WRONG_CLOSE not in out, "a refused start (another file in the backend's place) "
           "said \"%s\"; nothing was written back" % WRONG_CLOSE)
    os.replace(disk + ".orig", disk)
    want = {MIB: a}
    d = daemon(tmp, disk, dev, what="the backend file grown by truncate, after SIGKILL")
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        log("  the grown file: the export has %d bytes after the restart" % h.get_size())
        check_reads(h, want, "the grown file, after SIGKILL")
        drained(d, "the grown file, after SIGKILL")
        check_data(disk, want, "the grown file, after SIGKILL and the drain")
        h.shutdown()
    except BaseException:
        killed(d)
        raise
    stop(d, "the grown file")


# ---- 3, 4: a device that fails ----

def device_on_faultfs(fs):
    dev = fs.path("cache.dev")
    with open(dev, "wb") as f:
        f.truncate(DEVICE)
    fs.lose_on_fsync_error(False)
    return dev


def writes_done(fs):
    return fs.counters()["writes"]


def device_failed_said(d, what):
    text = d.log_text()
    expect(re.search(r"cache device .*: writing its log: .*the intent log is off from now on",
                     text), "%s: no log line saying the device failed" % what)
    expect("writethrough from now on: its cache device failed" in text,
           "%s: the log does not say the export went writethrough" % what)


def restart_and_check(tmp, fs, disk, dev, want, older, what):
    """SIGKILLed already: heal the device, start, read, drain, stop."""
    fs.set("ok")
    d = daemon(tmp, disk, dev, what=what)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        check_reads(h, want, what, older)
        drained(d, what)
        check_data(disk, want, what + ", the drain done", older)
        h.shutdown()
    except BaseException:
        killed(d)
        raise
    stop(d, what)


def promised(heal, r, what):
    """Was the FLUSH or FUA write after the failure answered as a success
    ("ok", else the errno's name)? With the device healed it must be (the
    daemon can write it again). With the device still failing, EIO is an
    answer too: the daemon cannot void the log on it, and then promises
    nothing."""
    log("  %s: %s" % (what, r))
    if heal:
        require(r == "ok", "%s, the device healed: %s" % (what, r))
    else:
        require(r in ("ok", "EIO"), "%s, the device failing: %s" % (what, r))
    return r == "ok"


def failed_commit(tmp, heal):
    disk = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(disk, SIZE)
    a, old, new = os.urandom(4 * MIB), os.urandom(6 * MIB), os.urandom(6 * MIB)
    with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
        dev = device_on_faultfs(fs)
        d = daemon(tmp, disk, dev, extra=["--cache-device-use", "log"])
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            h.pwrite(a, 0)
            before = writes_done(fs)
            h.flush()
            per_batch = writes_done(fs) - before
            require(per_batch >= 1 and nbdtest.read_at(disk, 0, MIB) != a[:MIB],
                    "the FLUSH of 4 MiB did not go to the log (%d device writes)" % per_batch)
            log("  a commit of one full batch (4 MiB): %d writes on the device" % per_batch)
            h.pwrite(old, 8 * MIB)
            fs.set("fail-write-after %d" % per_batch)
            nbdtest.expect_nbd_error(h.flush, errno.EIO, "the FLUSH whose commit's second "
                                     "batch failed")
            device_failed_said(d, "the failed commit")
            with open(fs.source("cache.dev"), "rb") as f:
                landed = old[:64 * KIB] in f.read()
            log("  the first batch of the failed commit is on the device: %s"
                % ("yes" if landed else "no"))
            if heal:
                fs.set("ok")
            h.pwrite(new, 8 * MIB)
            ok = promised(heal, flush_result(h), "the FLUSH of new bytes over the 6 MiB")
            if ok:
                check_data(disk, {0: a, 8 * MIB: new}, "the FLUSH after the failed commit")
            st = device_stats(d)
            log("  then: device failed %s, checkpoints %d, log used %d bytes"
                % (st["failed"], st["checkpoints"], st["log_used_bytes"]))
        finally:
            killed(d)
        restart_and_check(tmp, fs, disk, dev, {0: a, 8 * MIB: new} if ok else {0: a},
                          [("the first batch of the commit that failed (older than the "
                            "FLUSHed bytes)", 8 * MIB, old[:4 * MIB])],
                          "after the failed commit and SIGKILL")


def fua_after_failure(tmp, heal):
    disk = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(disk, SIZE)
    a, b, fua = os.urandom(MIB), os.urandom(MIB), os.urandom(64 * KIB)
    with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
        dev = device_on_faultfs(fs)
        d = daemon(tmp, disk, dev, extra=["--cache-device-use", "log"])
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            h.pwrite(a, 0)
            h.flush()
            require(nbdtest.read_at(disk, 0, MIB) != a, "the FLUSH did not go to the log")
            h.pwrite(b, 8 * MIB)
            fs.set("fail-write")
            nbdtest.expect_nbd_error(h.flush, errno.EIO, "the FLUSH whose commit failed")
            device_failed_said(d, "the failed commit")
            if heal:
                fs.set("ok")
            try:
                h.pwrite(fua, 64 * KIB, nbd.CMD_FLAG_FUA)
                r = "ok"
            except nbd.Error as e:
                r = errno.errorcode.get(e.errnum, str(e.errnum))
            ok = promised(heal, r, "a FUA write of 64 KiB over the FLUSHed MiB")
            if ok:
                check_data(disk, {64 * KIB: fua}, "the FUA write")
        finally:
            killed(d)
        # Without the promise, the FUA write's bytes may be either.
        want = ({0: a[:64 * KIB] + fua + a[128 * KIB:]} if ok else
                {0: a[:64 * KIB], 128 * KIB: a[128 * KIB:]})
        restart_and_check(tmp, fs, disk, dev, want,
                          [("the record committed before the device failed (older than "
                            "the FUA write)", 64 * KIB, a[64 * KIB:128 * KIB])],
                          "after a FUA write and SIGKILL")


# ---- 5: direct writes answered from the log, then a backend loss ----

def backend_loses(kit, what):
    """The NBD server crashes and loses what no flush covered: a flush
    failed by the fault filter puts back the bytes from before every
    unflushed write (drop-unflushed), then SIGKILL and a new one on the
    same socket."""
    h = kit.handle()
    kit.set("flush")
    try:
        faults.expect_eio(h.flush, "%s: the backend's failed flush" % what)
        nbdtest.shutdown_all([h])
        del h
        kit.kill(signal.SIGKILL)
    finally:
        kit.clear()
    kit.start()


def random_image(path, runs):
    """A sparse image of SIZE bytes with runs {offset: bytes} in it."""
    nbdtest.sparse_file(path, SIZE)
    with open(path, "r+b") as f:
        for off, data in runs.items():
            f.seek(off)
            f.write(data)


def direct_then_loss(tmp):
    img = os.path.join(tmp, "disk.img")
    before = {16 * MIB: os.urandom(MIB), 32 * MIB: os.urandom(6 * MIB)}
    random_image(img, before)
    dev = os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(dev, DEVICE)
    kit = faults.NbdkitFault(tmp, img, name="backend", drop_unflushed=True)
    big = os.urandom(6 * MIB)
    want = {16 * MIB: bytes(MIB), 32 * MIB: big}
    older = [("the bytes from before the acknowledged write (lost by the backend; the log "
              "held it)", off, data) for off, data in before.items()]
    try:
        d = daemon(tmp, kit.uri(), dev, extra=["--cache-size", "4M", "--cache-device-use",
                                               "log", "--backend-timeout", "20"])
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            commits = device_stats(d)["commits"]
            h.zero(MIB, 16 * MIB)
            h.pwrite(big, 32 * MIB)
            h.flush()
            st, dst = cache_stats(d), device_stats(d)
            log("  WRITE_ZEROES and a 6 MiB WRITE, FLUSHed: %d direct write(s), %d backend "
                "flush(es), %d commit(s)" % (st["direct_writes"], st["backend_flushes"],
                                              dst["commits"] - commits))
            log("  the FLUSH went to the log: %s" % ("yes" if dst["commits"] > commits
                                                      else "no"))
            reconnected = d.log_text().count("backend reconnected")
            backend_loses(kit, "after the FLUSH")
            # The daemon sees its connections go and come back (a FLUSH
            # before it noticed could not know of the loss).
            back = nbdtest.wait_until(
                lambda: d.log_text().count("backend reconnected") > reconnected, 20)
            log("  the daemon's backend connections: %s" % (
                "lost and back" if back else "no \"backend reconnected\" line in 20 s"))
            lost = [off for off, data in before.items()
                    if nbdtest.read_at(img, off, len(data)) == data]
            # (The daemon may have flushed them on the backend before the
            # FLUSH was answered: then nothing is lost.)
            log("  the backend crashed; the acknowledged direct writes it lost (it had not "
                "flushed them): %s" % ([off for off in sorted(lost)] or "none"))
            r = flush_result(h)
            st = cache_stats(d)
            log("  the FLUSH after the loss: %s (losses %d, backend flushes %d)"
                % (r, st["losses"], st["backend_flushes"]))
            m = re.search(r"error: (cache: the backend may have lost writes that went to it "
                          r"directly[^\n]*)", d.log_text())
            if m:
                log("  the daemon said: %s" % m.group(1))
            expect(r == "ok", "the FLUSH after the backend's loss reported %s, though the "
                   "log holds every write it lost" % r)
            for off, data in sorted(want.items()):
                try:
                    same(h.pread(len(data), off), data, "a read at %d after the backend's "
                         "loss" % off, off, older)
                except Failed as e:
                    CHECKS.add(str(e))
            h.shutdown()
        except BaseException:
            killed(d)
            raise
        stop(d, "after the loss")
        for off, data in sorted(want.items()):
            try:
                check_data(img, {off: data}, "after SIGTERM", older)
            except Failed as e:
                CHECKS.add(str(e))
    finally:
        kit.stop()


# ---- 6: CLEAN records and a backend flush sent before a direct write ----

# An NBD server (nbdkit's sh plugin) over an image on faultfs: its flush
# makes durable what was written before it arrived (an fsync at once),
# then answers only once STALL is gone (bounded: EIO after 120 s). TRIM
# does nothing (what a trimmed block reads as is the server's to say).
SLOW_FLUSH = """#!/bin/bash
img=%(img)s
case "$1" in
thread_model) echo parallel ;;
get_size) stat -L -c %%s "$img" ;;
can_write|can_flush|can_trim|can_zero) exit 0 ;;
pread) exec dd if="$img" bs=1M iflag=skip_bytes,count_bytes skip=$4 count=$3 status=none ;;
pwrite) exec dd of="$img" bs=1M iflag=fullblock,count_bytes oflag=seek_bytes conv=notrunc \\
            seek=$4 count=$3 status=none ;;
zero) exec dd if=/dev/zero of="$img" bs=1M iflag=count_bytes oflag=seek_bytes conv=notrunc \\
            seek=$4 count=$3 status=none ;;
trim) exit 0 ;;
flush)
    sync "$img" || exit 1
    touch %(arrived)s
    for i in $(seq 12000); do [ -e %(stall)s ] || exit 0; sleep 0.01; done
    echo "EIO held too long" >&2; exit 1 ;;
*) exit 2 ;;
esac
"""


class HeldFlushServer(nbdtest.NbdServer):
    """nbdkit -f -U SOCK -P PIDFILE sh SLOW_FLUSH (over image), by PID."""

    def __init__(self, tmp, image):
        self.label = "nbdkit held-flush"
        self.sock = os.path.join(tmp, "held.sock")
        self.pidfile = os.path.join(tmp, "held.pid")
        self.logpath = os.path.join(tmp, "held.log")
        self.stall = os.path.join(tmp, "stall")
        self.arrived = os.path.join(tmp, "arrived")
        self.script = os.path.join(tmp, "held-flush.sh")
        with open(self.script, "w") as f:
            f.write(SLOW_FLUSH % {"img": image, "stall": self.stall, "arrived": self.arrived})
        os.chmod(self.script, 0o755)
        self.start()

    def start(self):
        for p in (self.sock, self.pidfile):
            if os.path.lexists(p):
                os.unlink(p)        # a killed nbdkit leaves its socket behind
        cmd = [faults.NBDKIT, "-f", "-U", self.sock, "-P", self.pidfile, "sh", self.script]
        return self.spawn(cmd, self._listening, "write its pidfile")

    def _listening(self):
        try:
            with open(self.pidfile) as f:
                return f.read().strip() == str(self.proc.pid)
        except OSError:
            return False

    def hold_flushes(self):
        if os.path.exists(self.arrived):
            os.unlink(self.arrived)
        open(self.stall, "w").close()

    def flush_arrived(self):
        return os.path.exists(self.arrived)

    def release_flushes(self):
        if os.path.exists(self.stall):
            os.unlink(self.stall)


_COMPLETED = set()   # (handle id, cookie): aio_command_completed retires a command


def aio_done(h, cookie, seconds):
    """Has the command completed within `seconds` (polling h)? Raises its
    nbd.Error if it failed."""
    key = (id(h), cookie)
    for _ in range(int(seconds * 20) + 1):
        if key in _COMPLETED or h.aio_command_completed(cookie):
            _COMPLETED.add(key)
            return True
        h.poll(50)
    return False


def clean_over_direct(tmp):
    x = 8 * MIB
    blk = x + 32 * KIB
    with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
        img = fs.path("disk.img")
        r = os.urandom(64 * KIB)
        with open(fs.source("disk.img"), "wb") as f:
            f.truncate(SIZE)
            f.seek(x)
            f.write(r)
        dev = os.path.join(tmp, "cache.dev")
        nbdtest.sparse_file(dev, DEVICE)
        srv = HeldFlushServer(tmp, img)
        w = os.urandom(64 * KIB)
        want = {x: w[:32 * KIB] + bytes(4 * KIB) + w[36 * KIB:]}
        older = [("the bytes from before the FLUSHed WRITE_ZEROES", blk, r[32 * KIB:36 * KIB])]
        try:
            d = daemon(tmp, srv.uri(), dev, extra=["--cache-device-use", "log"])
            ctl = None
            try:
                h = nbdtest.libnbd_handle(d.unix_uri("disk"))
                h.pwrite(w, x)
                h.trim(4 * KIB, blk)
                srv.hold_flushes()
                ctl = subprocess.Popen([nbdtest.NBDCACHECTL, "--control", d.control, "flush",
                                        "disk"], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
                require(nbdtest.wait_until(srv.flush_arrived, 20), "the round's backend "
                        "flush did not reach the server within 20 s")
                log("  the round's backend flush is in flight (held by the server)")
                zero = h.aio_zero(4 * KIB, blk)
                buf = nbd.Buffer(4 * KIB)
                if aio_done(h, zero, 5):
                    read = h.aio_pread(buf, blk)
                    read_first = aio_done(h, read, 5)
                    log("  WRITE_ZEROES of the block TRIM left uncached: done while the flush "
                        "is held; a READ of it: %s" % ("done" if read_first else "waits"))
                else:
                    read = None
                    log("  WRITE_ZEROES of the block TRIM left uncached: waits for the flush")
                srv.release_flushes()
                require(aio_done(h, zero, 60), "the WRITE_ZEROES not done 60 s after the "
                        "flush was let go")
                if read is None:
                    read = h.aio_pread(buf, blk)
                require(aio_done(h, read, 60), "the READ not done 60 s after the flush was "
                        "let go")
                expect(buf.to_bytearray() == bytes(4 * KIB), "the READ after the "
                       "WRITE_ZEROES did not return zeros")
                out, _ = ctl.communicate(timeout=60)
                ctl = None
                log("  nbdcachectl flush disk: %s" % out.strip())
                commits = device_stats(d)["commits"]
                h.flush()
                st = device_stats(d)
                log("  then a FLUSH: %d commit(s)" % (st["commits"] - commits))
            finally:
                srv.release_flushes()
                if ctl:
                    ctl.kill()
                    ctl.wait()
                killed(d)
            srv.kill(signal.SIGKILL)
            fs.power_loss()
            got = nbdtest.read_at(fs.source("disk.img"), blk, 4 * KIB)
            log("  the server crashed; the block on its image is %s" % (
                "the bytes from before the WRITE_ZEROES" if got == older[0][2]
                else "zeros" if got == bytes(4 * KIB) else "other bytes"))
            srv.start()
            what = "after SIGKILL and the server's crash"
            d = daemon(tmp, srv.uri(), dev, what=what)
            try:
                h = nbdtest.libnbd_handle(d.unix_uri("disk"))
                check_reads(h, want, what, older)
                drained(d, what)
                h.flush()
                check_data(fs.source("disk.img"), want, what + ", the drain done", older)
                h.shutdown()
            except BaseException:
                killed(d)
                raise
            stop(d, what)
        finally:
            srv.release_flushes()
            srv.stop()


# ---- 7: the level-2 map and bytes the backend has not flushed ----

def l2_settled(d, what):
    """Wait until nothing is staged for the level-2 area and its map on
    the device claims every page the ring wrote: the stats then."""
    l2 = None
    for _ in range(400):
        l2 = device_stats(d)["l2"]
        if l2["staged_bytes"] == 0 and l2["map_pending_bytes"] == 0:
            return l2
        time.sleep(0.05)
    raise Failed("%s: the level-2 map did not take what the ring wrote in 20 s: %s"
                 % (what, l2))


def l2_unflushed(tmp, use):
    img = os.path.join(tmp, "disk.img")
    y = 16 * MIB
    p = 24 * MIB  # proven: a MiB the backend has as it is (nothing direct on it)
    r, q = os.urandom(MIB), os.urandom(MIB)
    random_image(img, {y: r, p: q})
    dev = os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(dev, L2_DEVICE)
    kit = faults.NbdkitFault(tmp, img, name="backend", drop_unflushed=True)
    extra = ["--cache-device-use", use, "--cache-device-warm", "all", "--hugepages", "off"]
    try:
        d = daemon(tmp, kit.uri(), dev, extra=extra)
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            # The proven MiB first (before any direct write): offered to
            # level 2 as it is filled.
            require(h.pread(MIB, p) == q, "a read of the proven MiB")
            stored = l2_settled(d, "after the proven fill")["stored_bytes"]
            h.zero(MIB, y)
            got = h.pread(MIB, y)
            require(got == bytes(MIB), "a read after the WRITE_ZEROES: %s"
                    % nbdtest.describe_diff(got, bytes(MIB), y))
            l2 = l2_settled(d, "after the fill")
            log("  WRITE_ZEROES (no FLUSH), then a READ of it: level-2 stored %d bytes (%d "
                "before it), map written %d time(s)" % (l2["stored_bytes"], stored,
                                                      l2["map_writes"]))
            expect(l2["stored_bytes"] == stored, "cache-device-use %s: the fill of bytes a "
                   "direct write had not flushed went to the level-2 area (%d bytes stored, "
                   "%d before)" % (use, l2["stored_bytes"], stored))
        finally:
            killed(d)
        backend_loses(kit, "after SIGKILL")
        # (A background flush may have covered the WRITE_ZEROES before the
        # SIGKILL: then the backend holds the zeros, and reads must too.)
        held = nbdtest.read_at(img, y, MIB)
        require(held in (r, bytes(MIB)), "the backend holds neither the bytes from before "
                "nor the zeros")
        if held == r:
            log("  the backend crashed and lost the WRITE_ZEROES (no FLUSH had covered it)")
        else:
            log("  a background flush had covered the WRITE_ZEROES: the backend keeps them")
        r = held
        d = daemon(tmp, kit.uri(), dev, extra=extra, what="warm, after the crash")
        try:
            m = re.search(r"level-2 cache warm: [^\n]*", d.log_text())
            log("  start: %s" % (m.group(0) if m else "the level-2 cache not warm"))
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            got = h.pread(MIB, y)
            l2 = device_stats(d)["l2"]
            if got == bytes(MIB) and r != bytes(MIB):
                CHECKS.add("cache-device-use %s: a read after the backend lost the "
                           "WRITE_ZEROES returns its zeros (level-2 hits %d, %d bytes; %d "
                           "bytes loaded at start): the level-2 map claimed bytes the "
                           "backend had not flushed" % (use, l2["hits"], l2["hit_bytes"],
                                                        l2["loaded_bytes"]))
            else:
                expect(got == r, "cache-device-use %s: a read after the backend's loss: %s"
                       % (use, nbdtest.describe_diff(got, r, y)))
            # The level-2 cache is at work all the same: the proven MiB
            # comes from the area, not the backend.
            before = device_stats(d)["l2"]["hit_bytes"]
            got = h.pread(MIB, p)
            hits = device_stats(d)["l2"]["hit_bytes"] - before
            expect(got == q and hits == MIB, "cache-device-use %s: the proven MiB read warm: "
                   "%d bytes from the level-2 area (want %d), %s"
                   % (use, hits, MIB, "right" if got == q else "WRONG bytes"))
            log("  the proven MiB read warm: %d bytes from the level-2 area" % hits)
            h.shutdown()
        except BaseException:
            killed(d)
            raise
        stop(d, "the warm start")
    finally:
        kit.stop()


CASES = (
    ("1 resize, then SIGKILL: the start replays both FLUSHes", resize_then_crash),
    ("2 the backend file grown without a resize, then SIGKILL; another file refused",
     grown_then_crash),
    ("3 a commit failed after its first batch, the device healed", failed_commit, True),
    ("3 a commit failed after its first batch, the device failing", failed_commit, False),
    ("4 a FUA write after the device failed, healed", fua_after_failure, True),
    ("4 a FUA write after the device failed, failing", fua_after_failure, False),
    ("5 direct writes answered from the log, then the backend lost them", direct_then_loss),
    ("6 a CLEAN record over a block a direct write changed after the backend flush was "
     "sent", clean_over_direct),
    ("7 the level-2 map claims only what the backend flushed (cache-device-use both)",
     l2_unflushed, "both"),
    ("7 the level-2 map claims only what the backend flushed (cache-device-use l2)",
     l2_unflushed, "l2"),
)


def main():
    # Arguments (a run by hand): only the checks whose function name holds
    # one of them.
    only = sys.argv[1:]
    with nbdtest.tempdir() as tmp:
        for n, (name, fn, *args) in enumerate(CASES):
            if only and not any(o in fn.__name__ for o in only):
                continue
            sub = os.path.join(tmp, "c%d" % n)
            os.mkdir(sub)
            CHECKS.run(name, fn, sub, *args)
    CHECKS.finish("cache device promise")


if __name__ == "__main__":
    main()
