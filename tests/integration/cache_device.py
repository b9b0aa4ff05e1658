#!/usr/bin/python3
"""cache_device: --cache-device, the intent log on a local device.

  1  A FLUSH answered from the log: 4 MiB written and FLUSHed (writeback
     mode, no expiry: the backend file does not have it), SIGKILL; the
     next start replays the log (its log line says so), the backend file
     and a read both have every byte, and the stats (control socket,
     nbdcachectl stats, the SIGUSR1 line) count commits, bytes logged and
     the replay; a SIGTERM then closes the device clean.
  2  Refusals, each with its message (and the same from --check-config,
     exit 1, which otherwise says what a start would replay) and nothing
     replayed, then a start
     with the right setting that replays every byte: another file in its
     place (a copy: another inode), the
     export not configured any more, the device truncated (another
     geometry), a device that is not one (garbage in its superblocks), one
     too small, one written by the earlier format (1) and not closed
     clean; and a corrupt superblock copy (the older one, as a torn
     write leaves it): reported, the other copy used. A backend file of
     another size is not refused: --check-config says it would be
     replayed (a resize a crash caught). One of format 1 or 2
     closed clean holds nothing: it is formatted again (said). Last,
     --cache-device-discard-dirty: the export's records thrown away, what
     was thrown away logged, the daemon serving without them.
  3  Device faults (the device a file on faultfs): writes failing, then
     fsyncs failing: the FLUSH whose commit failed gets EIO, the log says
     the export goes writethrough; the next FLUSH gets EIO too while the
     log cannot be emptied on the device (said), and once it can (the
     fault cleared) a FLUSH succeeds with the data on the backend file; the daemon stops with status 0 and a new one on
     the healed device replays nothing older over it.
  4  nbdcachectl cache-device flush: what the log held is written back
     (the backend file has it) and the log is empty; detach: the same,
     then the device is not used (stats say detached, a FLUSH is not
     logged and puts the data on the backend file), a second detach and
     an unknown action are refused with their messages, and a restart on
     the device finds nothing to replay.
  5  A log round copies what was written since the round before, not
     everything still dirty: 1024 blocks written apart and FLUSHed, then
     rounds of two writes (one new block, one of the 1024 again) and a
     FLUSH each: the stats count at most 4 entries visited per round
     (device_log_round_entries), not the 1024 still dirty; a 2 MiB range
     written block by block (a FLUSH half way) collapsed into one entry
     (compact), then a FLUSH; SIGKILL, and the start replays every block
     as last written.
  7  A torn or corrupt batch ends the replay at the last good one: two
     commits (1 MiB, FLUSH, 1 MiB, FLUSH), SIGKILL, then one byte of a
     batch's data changed on the device. The last batch (a torn commit):
     --check-config says 1 batch to replay; the start replays the first
     alone, its log line saying where the log ended and why (the data
     CRC), and the backend file has the first MiB, not the second. The
     first batch: nothing is replayed, the log line says so, and neither
     reaches the backend file.
  6  What writes back writes back with a device too (a FLUSH from a
     client is answered from the log; these are not): nbdcachectl flush
     EXPORT puts the data on the backend file; a reload that removes an
     export has its data written back and its backend closed within
     seconds (not at --dirty-expire). An export a later reload adds
     again is logged as before: a FLUSH after that is answered from the
     log (commits counted, the backend file without the data), and a
     start after SIGKILL replays it. A removed export's records are never
     replayed over what its backend got since: a WRITE_ZEROES (a ZERO
     record) FLUSHed, the export removed and its backend closed, new
     bytes written into the backend file by another writer, SIGKILL: a
     start without the export is not refused for its records, and one with
     the export configured leaves the file with the new bytes.
"""

import errno
import json
import os
import re
import shutil
import signal
import struct
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

MIB = 1 << 20
SIZE = 64 * MIB
DEVICE = 64 * MIB
SB = 64 * 1024
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def daemon(tmp, disk, dev, name="disk", extra=(), what=None):
    work = os.path.join(tmp, "d%d" % len(os.listdir(tmp)))
    os.mkdir(work)
    return nbdtest.CheckedDaemon([(name, disk, "")], workdir=work, tcp=False,
                                 extra=["--cache-device", dev, "--cache-size", "32M",
                                        "--dirty-expire", "3600", "--cache-mode",
                                        "writeback"] + list(extra), what=what)


def refused(disk, dev, name="disk"):
    """Start with these; it must fail. Its exit status and output."""
    args = [nbdtest.NBDCACHED, "--foreground", "--control", "none", "--unix",
            os.path.join(os.path.dirname(dev), "refused.sock"), "--export",
            "%s=%s" % (name, disk), "--cache-size", "32M", "--cache-device", dev]
    nbdtest.own_device(args)
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def check_config(disk, dev, name="disk"):
    """nbdcached --check-config with the device: its exit status and output."""
    args = [nbdtest.NBDCACHED, "--check-config", "--export", "%s=%s" % (name, disk),
            "--cache-device", dev]
    nbdtest.own_device(args)
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def write_and_kill(tmp, disk, dev):
    """4 MiB written and FLUSHed, 64 KiB with FUA, then SIGKILL: what the
    log holds that the backend file does not."""
    data = os.urandom(4 * MIB)
    fua = os.urandom(64 * 1024)
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(data, 8 * MIB)
        h.pwrite(fua, 20 * MIB, nbd.CMD_FLAG_FUA)
        h.flush()
    finally:
        d.kill()
        d.logf.close()
    on_file = nbdtest.read_at(disk, 8 * MIB, len(data))
    require(on_file != data, "the data reached the backend file before the kill: the test "
            "does not show the log at work")
    return {8 * MIB: data, 20 * MIB: fua}


crc32c = nbdtest.crc32c


def earlier_device(path, clean, version=1):
    """A device as an earlier format (version 1 or 2) leaves it: one good
    superblock copy, no exports, clean or not."""
    sb = bytearray(SB)
    struct.pack_into(">QII16sQQQQQQII", sb, 0, 0x4e424443444556, version, 1 if clean else 0,
                     b"\x01" * 16, 5, DEVICE, 2 * SB, DEVICE - 2 * SB, 0, 1, 0, 0)
    struct.pack_into(">I", sb, SB - 4, crc32c(bytes(sb[:SB - 4])))
    with open(path, "wb") as f:
        f.write(sb)
        f.truncate(DEVICE)


def drained(d, what, timeout=60):
    """Wait until the live log the daemon found at start is all on the
    backends (its drain done): its device stats then."""
    st = None
    for _ in range(int(timeout * 10)):
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        # (nothing drained: the live log had no bytes to write back)
        if st["replay_pending_bytes"] == 0 and (st["replay_drain_ns"] or
                                                not st["replay_drained_bytes"]):
            return st
        time.sleep(0.1)
    raise Failed("%s: the log found at start was not written back in %d s: %s"
                 % (what, timeout, st))


START_LINE = (r"(\d+) batch\(es\), (\d+) record\(s\), (\d+) bytes of data to write back, "
              r"planned in ([0-9.]+) s")


def check_data(disk, want, what):
    for off, data in want.items():
        nbdtest.require_same(nbdtest.read_at(disk, off, len(data)), data,
                             "%s: the backend file at %d" % (what, off), base=off)


def replay_after_kill(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    want = write_and_kill(tmp, disk, dev)
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        got = h.pread(4 * MIB, 8 * MIB)
        nbdtest.require_same(got, want[8 * MIB], "read after the replay", base=8 * MIB)
        drained(d, "after SIGKILL")
        check_data(disk, want, "after the replay")
        text = d.log_text()
        m = re.search(START_LINE, text)
        require(m, "no replay line in the log")
        log("  %s" % m.group(0))
        expect(int(m.group(3)) >= 4 * MIB, "replayed %s bytes, 4 MiB were FLUSHed" % m.group(3))
        h.pwrite(b"\x5a" * 65536, 30 * MIB)
        h.flush()
        st = nbdtest.control_request(d.control, {"command": "stats"})
        dev_st = st["cache"].get("cache_device")
        require(dev_st, "stats: no cache_device: %s" % sorted(st["cache"]))
        log("  stats: %s" % {k: dev_st[k] for k in ("commits", "bytes_logged", "records",
                                                     "replay_bytes", "log_used_bytes")})
        expect(dev_st["commits"] >= 1 and dev_st["bytes_logged"] >= 65536,
               "stats: %s" % dev_st)
        expect(dev_st["replay_bytes"] == int(m.group(3)), "stats: replay_bytes %d, the log "
               "said %s" % (dev_st["replay_bytes"], m.group(3)))
        r = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, "stats"])
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("cache device")]
        expect(line, "nbdcachectl stats has no cache device line:\n%s" % r.stdout)
        log("  nbdcachectl: %s" % (line[0] if line else ""))
        usr1 = nbdtest.stats(d)
        expect(usr1.get("device_commits", 0) >= 1, "SIGUSR1 line: %s" % usr1)
        r = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, "cache-device"])
        expect(r.returncode == 0 and dev in r.stdout and "cache device log" in r.stdout,
               "nbdcachectl cache-device: exit %d:\n%s%s" % (r.returncode, r.stdout, r.stderr))
        r = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control, "--json",
                         "cache-device"])
        expect(r.returncode == 0 and json.loads(r.stdout)["cache_device"]["commits"] >= 1,
               "nbdcachectl --json cache-device: %s" % r.stdout)
    finally:
        d.stop()
    text = open(d.logpath).read()
    expect("closed clean" in text, "the device was not closed clean at SIGTERM")


def refusals(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    want = write_and_kill(tmp, disk, dev)
    cases = []

    def case(what, pattern, **kw):
        args = (kw.get("disk", disk), kw.get("dev", dev), kw.get("name", "disk"))
        crc, cout = check_config(*args)
        expect(crc == 1 and re.search(pattern, cout), "%s: --check-config exit %d, output does "
               "not say %r:\n%s" % (what, crc, pattern, cout[-2000:]))
        rc, out = refused(*args)
        line = [ln for ln in out.splitlines() if "error:" in ln]
        log("  %s: exit %d: %s" % (what, rc, line[0].split("error: ", 1)[-1] if line else out))
        expect(rc != 0 and re.search(pattern, out), "%s: exit %d, output does not say %r:\n%s"
               % (what, rc, pattern, out[-2000:]))
        cases.append(what)

    # Another size is no other backend (a resize a crash caught): it would
    # be replayed (cache_device_promise.py starts one), not refused.
    os.truncate(disk, SIZE + MIB)
    rc, out = check_config(disk, dev)
    expect(rc == 0 and re.search(r'batch\(es\) to replay; export "disk": \d+ bytes', out),
           "backend file grown: --check-config exit %d (a size is no identity):\n%s"
           % (rc, out[-2000:]))
    os.truncate(disk, SIZE)
    os.rename(disk, disk + ".orig")
    shutil.copyfile(disk + ".orig", disk)
    case("another file in its place", r'export "disk", whose backend is not the one .*another '
         r'file \(device \d+ inode \d+, recorded device \d+ inode \d+\)')
    os.replace(disk + ".orig", disk)
    case("export not configured", r'holds \d+ bytes in \d+ record\(s\) not yet written back for '
         r'export "disk" \(backend .*\), which is not configured', name="other")
    shutil.copyfile(dev, dev + ".orig")
    os.truncate(dev, DEVICE - 16 * MIB)
    case("device truncated", r"formatted for 67108864 bytes, it has 50331648 now \(another "
         r"geometry\)")
    os.replace(dev + ".orig", dev)
    junk = os.path.join(tmp, "junk.dev")
    with open(junk, "wb") as f:
        f.write(os.urandom(256 * 1024))
        f.truncate(DEVICE)
    case("not a cache device", r"no usable superblock \(copy A: no nbdcached superblock", dev=junk)
    small = os.path.join(tmp, "small.dev")
    nbdtest.sparse_file(small, MIB)
    case("too small", r"1048576 bytes; a cache device needs at least 16908288", dev=small)
    old = os.path.join(tmp, "earlier.dev")
    for version in (1, 2):
        earlier_device(old, clean=False, version=version)
        case("format %d, not closed clean" % version, r"written by an earlier version "
             r"\(format %d\) and not closed clean" % version, dev=old)
        earlier_device(old, clean=True, version=version)
        d = daemon(tmp, disk, old, what="a device of format %d closed clean" % version)
        try:
            expect("(format %d) and closed clean: it holds nothing; formatted again" % version
                   in d.log_text(),
                   "a clean device of format %d was not said to be formatted again" % version)
        finally:
            d.kill()
            d.logf.close()
    check_data(disk, {8 * MIB: b"\0" * 16}, "after the refusals (nothing replayed)")
    rc, out = check_config(disk, dev)
    m = re.search(r'\d+ batch\(es\) to replay; export "disk": (\d+) bytes in \d+ record', out)
    expect(rc == 0 and m and int(m.group(1)) >= 4 * MIB, "--check-config with the right "
           "settings: exit %d:\n%s" % (rc, out[-2000:]))
    log("  --check-config: %s" % (m.group(0) if m else "-"))
    # A torn superblock write damages the copy not holding the newest.
    with open(dev, "r+b") as f:
        gens = []
        for copy in range(2):
            f.seek(copy * SB + 32)
            gens.append(struct.unpack(">Q", f.read(8))[0])
        older = 0 if gens[0] < gens[1] else 1
        f.seek(older * SB + 5000)
        f.write(b"\xff" * 100)
    d = daemon(tmp, disk, dev, what="a device with a corrupt superblock copy")
    try:
        text = d.log_text()
        m = re.search(r"superblock copy ([AB]) is bad \(superblock CRC32C", text)
        expect(m and m.group(1) == "AB"[older], "the log does not say copy %s is bad"
               % "AB"[older])
        log("  corrupt copy %s (generations %s): %s" % ("AB"[older], gens,
                                                        m.group(0) if m else "-"))
        drained(d, "after the refusals")
        check_data(disk, want, "replayed after the refusals")
    finally:
        d.stop()
    log("  %d refusals, then every byte replayed" % len(cases))
    # cache-device-discard-dirty: the records of the export named are
    # thrown away (logged), and the daemon starts without it.
    before = nbdtest.read_at(disk, 8 * MIB, 4 * MIB)
    want = write_and_kill(tmp, disk, dev)
    d = daemon(tmp, disk, dev, name="other", extra=["--cache-device-discard-dirty", "x,disk"],
               what="cache-device-discard-dirty")
    try:
        text = d.log_text()
        m = re.search(r'throwing away (\d+) bytes in \d+ record\(s\) not yet written back for '
                      r'export "disk"', text)
        expect(m and int(m.group(1)) >= 4 * MIB, "the log does not say what was thrown away")
        log("  discard: %s" % (m.group(0) if m else "-"))
        expect(nbdtest.read_at(disk, 8 * MIB, 4 * MIB) == before,
               "the records thrown away were written back all the same")
        check_data(disk, {20 * MIB: want[20 * MIB]}, "the FUA write (on the backend already)")
    finally:
        d.stop()


def device_faults(tmp):
    for fault in ("fail-write", "fail-fsync"):
        log("  --- %s" % fault)
        work = os.path.join(tmp, fault)
        os.mkdir(work)
        disk = os.path.join(work, "disk.img")
        nbdtest.sparse_file(disk, SIZE)
        with faults.FaultFS(os.path.join(work, "faultfs")) as fs:
            dev = fs.path("cache.dev")
            with open(dev, "wb") as f:
                f.truncate(DEVICE)
            fs.lose_on_fsync_error(False)
            d = daemon(work, disk, dev)
            try:
                h = nbdtest.libnbd_handle(d.unix_uri("disk"))
                a, b = os.urandom(MIB), os.urandom(MIB)
                h.pwrite(a, 0)
                h.flush()
                fs.set(fault)
                h.pwrite(b, MIB)
                nbdtest.expect_nbd_error(h.flush, errno.EIO, "a FLUSH whose commit failed (%s)"
                                         % fault)
                text = d.log_text()
                expect(re.search(r"cache device .*: writing its log: .*the intent log is off "
                                 r"from now on", text), "no log line for the failed commit")
                expect("writethrough from now on: its cache device failed" in text,
                       "the log does not say the export went writethrough")
                # While the log cannot be emptied on the device (voided), a
                # start could replay it over what a FLUSH through the
                # backend acknowledges: that FLUSH fails, and says why.
                nbdtest.expect_nbd_error(h.flush, errno.EIO, "a FLUSH while the failed device "
                                         "cannot be emptied (%s)" % fault)
                expect("its log cannot be emptied after its failure" in d.log_text(),
                       "no log line for the log that cannot be emptied")
                fs.set("ok")
                h.flush()  # the log emptied on the device, the data to the backend
                check_data(disk, {0: a, MIB: b}, "after the FLUSH that followed")
                exports = nbdtest.control_request(d.control, {"command": "exports"})
                modes = [e.get("cache_mode") for e in exports.get("exports", [])]
                expect(modes == ["writethrough"], "exports say %s" % modes)
                c = os.urandom(MIB)
                h.pwrite(c, 2 * MIB)
                h.flush()
                check_data(disk, {2 * MIB: c}, "a write after the fault")
                nbdtest.shutdown_all([h])
            finally:
                rc = d.stop(expect_rc=None)
            expect(rc == 0, "%s: the daemon exited %d" % (fault, rc))
            d2 = daemon(work, disk, dev, what="the healed device")
            try:
                drained(d2, "the healed device")
                check_data(disk, {0: a, MIB: b, 2 * MIB: c}, "after a restart on the healed "
                           "device")
            finally:
                d2.stop()


def healed_during_attempt(tmp):
    """After a failure, a FLUSH is answered by an attempt to empty the log
    begun after it came, not by the failure of one already under way:
    the device heals while an attempt runs (each operation on it slowed
    to 400 ms; its next fsync fails once, then it is healthy). A FLUSH of
    export "disk" starts that attempt (and gets EIO from it); a FLUSH of
    export "other" (a round of its own) comes during it, and must be
    answered by the next attempt: success."""
    disk = os.path.join(tmp, "disk.img")
    other = os.path.join(tmp, "other.img")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(other, SIZE)
    with faults.FaultFS(os.path.join(tmp, "faultfs")) as fs:
        dev = fs.path("cache.dev")
        with open(dev, "wb") as f:
            f.truncate(DEVICE)
        fs.lose_on_fsync_error(False)
        d = daemon(tmp, disk, dev, extra=["--export", "other=" + other])
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            h2 = nbdtest.libnbd_handle(d.unix_uri("other"))
            a, b = os.urandom(MIB), os.urandom(MIB)
            h.pwrite(a, 0)
            h.flush()
            fs.set("fail-write")
            h.pwrite(b, MIB)
            nbdtest.expect_nbd_error(h.flush, errno.EIO, "a FLUSH whose commit failed")
            fs.set("fail-fsync-once")
            fs.set("delay-ms 400")
            first = h.aio_flush()
            time.sleep(0.2)  # the attempt it started is in its first write now
            t0 = time.monotonic()
            h2.flush()
            log("  the FLUSH sent during the attempt: answered in %.2f s"
                % (time.monotonic() - t0))
            how = "still in flight"
            for _ in range(600):
                try:
                    if h.aio_command_completed(first):
                        how = "answered 0"
                        break
                except nbd.Error as e:
                    how = "answered %s" % e
                    break
                h.poll(100)
            log("  the FLUSH sent before it: %s" % how)
            check_data(disk, {0: a, MIB: b}, "after the FLUSH answered by the next attempt")
            fs.set("ok")
            nbdtest.shutdown_all([h, h2])
        except nbd.Error as e:
            fs.set("ok")
            raise Failed("a FLUSH sent while an attempt to empty the log ran, after the "
                         "device healed: %s" % e)
        finally:
            d.stop(expect_rc=None)


def stop_while_drain_fails(tmp):
    """A stop while the drain of the log found at start fails (its backend
    refuses writes) says so, every 5 s (the log stays on the device for the
    next start), instead of only that it waits for the drain; once the
    backend takes writes again the drain ends and the stop with it (exit
    0, no second signal), and the file holds what the FLUSH
    acknowledged."""
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    kit = faults.NbdkitFault(tmp, disk, name="backend")
    try:
        d = daemon(tmp, kit.uri(), dev)
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            data = os.urandom(MIB)
            h.pwrite(data, 0)
            h.flush()  # answered from the log
        finally:
            d.kill()
            d.logf.close()
        kit.set("write")
        d = daemon(tmp, kit.uri(), dev, what="a start whose drain fails")
        try:
            d.proc.send_signal(signal.SIGTERM)
            said = nbdtest.wait_until(lambda: "not on the backends yet: writing it back fails"
                                      in d.log_text(), 20, step=0.1)
            text = d.log_text()
            log("  while the drain fails: %s" % next(
                (ln.split("error: ", 1)[-1] for ln in text.splitlines()
                 if "not on the backends yet" in ln), "no error line"))
            expect(said, "a stop while the drain fails does not say so:\n%s" % text[-1500:])
            expect(d.alive(), "the daemon exited while its log was not on the backend")
            kit.clear()
            try:
                rc = d.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rc = None
            expect(rc == 0, "exit %s once the backend took writes again" % rc)
            expect("every dirty block is written back" in d.log_text(),
                   "the stop did not end with everything written back")
        finally:
            d.kill()
        check_data(disk, {0: data}, "after the drain that failed, then ended")
    finally:
        kit.stop()


def ctl(d, *args):
    r = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control] + list(args),
                    check_rc=False)
    return r.returncode, r.stdout + r.stderr


def flush_and_detach(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        a, b, c = os.urandom(MIB), os.urandom(MIB), os.urandom(MIB)
        h.pwrite(a, 2 * MIB)
        h.flush()
        require(nbdtest.read_at(disk, 2 * MIB, MIB) != a, "the FLUSH wrote back: the log "
                "was not used")
        rc, out = ctl(d, "cache-device", "flush")
        log("  flush: %s" % out.splitlines()[0] if out else "")
        expect(rc == 0 and "written back and flushed" in out, "cache-device flush: exit %d: "
               "%s" % (rc, out))
        check_data(disk, {2 * MIB: a}, "after cache-device flush")
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        expect(st["log_used_bytes"] == 0, "the log holds %d bytes after the flush" %
               st["log_used_bytes"])
        h.pwrite(b, 4 * MIB)
        h.flush()
        rc, out = ctl(d, "cache-device", "detach")
        expect(rc == 0 and "not used until a restart" in out, "cache-device detach: exit %d: "
               "%s" % (rc, out))
        check_data(disk, {4 * MIB: b}, "after cache-device detach")
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        expect(st["detached"] and not st["l2"]["on"], "stats after detach: %s" % st)
        commits = st["commits"]
        h.pwrite(c, 6 * MIB)
        h.flush()
        check_data(disk, {6 * MIB: c}, "a FLUSH after the detach")
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        expect(st["commits"] == commits, "a FLUSH after the detach was logged: %s" % st)
        rc, out = ctl(d, "cache-device", "detach")
        expect(rc == 1 and "detached already" in out, "a second detach: exit %d: %s" % (rc, out))
        rc, out = ctl(d, "cache-device", "trim")
        expect(rc == 1 and "status, flush or detach" in out, "an unknown action: exit %d: %s"
               % (rc, out))
    finally:
        d.stop()
    d = daemon(tmp, disk, dev, what="after the detach")
    try:
        text = d.log_text()
        expect("to write back" not in text, "a start after the detach replayed something")
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        for off, data in ((2 * MIB, a), (4 * MIB, b), (6 * MIB, c)):
            nbdtest.require_same(h.pread(MIB, off), data, "read after the restart", base=off)
    finally:
        d.stop()


def round_cost(tmp):
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    stride, blocks, rounds = 16384, 1024, 24
    want = {}
    d = daemon(tmp, disk, dev, extra=["--cache-device-use", "log"])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        for i in range(blocks):
            want[i * stride] = os.urandom(4096)
            h.pwrite(want[i * stride], i * stride)
        h.flush()

        def device_stats():
            st = nbdtest.control_request(d.control, {"command": "stats"})
            return st["cache"]["cache_device"]
        before = device_stats()
        for r in range(rounds):
            new = (blocks + r) * stride
            again = (r * 37 % blocks) * stride
            for off in (new, again):
                want[off] = os.urandom(4096)
                h.pwrite(want[off], off)
            h.flush()
        after = device_stats()
        n = after["log_rounds"] - before["log_rounds"]
        visited = after["log_round_entries"] - before["log_round_entries"]
        log("  %d FLUSHes: %d log rounds visited %d entries (%.1f a round)"
            % (rounds, n, visited, visited / max(n, 1)))
        expect(n >= rounds // 2, "only %d of %d FLUSHes were log rounds: %s"
               % (n, rounds, after))
        expect(visited <= 4 * n, "%d log rounds visited %d entries: each should visit what "
               "was written since the one before (2 writes), not every dirty entry"
               % (n, visited))
        # A 2 MiB range written block by block, half of it FLUSHed before
        # the rest: its entries collapse into one (compact), which takes
        # their places on the unlogged list; then a write into it and a
        # FLUSH (nothing written since the collapse: the round copies what
        # it must only because the new entry took the old ones' places),
        # and the replay below must find every block.
        region = 48 * MIB
        for b in range(512):
            off = region + b * 4096
            want[off] = os.urandom(4096)
            h.pwrite(want[off], off)
            if b == 255:
                h.flush()
        st = nbdtest.control_request(d.control, {"command": "compact"})
        expect(st.get("ok"), "compact: %r" % st)
        collapses = nbdtest.control_request(d.control, {"command": "stats"})[
            "cache"]["arena"]["compact_collapses"]
        log("  compact: %d collapse(s)" % collapses)
        expect(collapses >= 1, "the 2 MiB range written block by block did not collapse: "
               "the check below shows nothing about a collapse")
        h.flush()  # the half not FLUSHed yet: the collapsed entry's to copy
    finally:
        d.kill()
        d.logf.close()
    d = daemon(tmp, disk, dev)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        bad = [off for off, data in sorted(want.items()) if h.pread(4096, off) != data]
        expect(not bad, "after SIGKILL and the replay, %d of %d blocks differ from what was "
               "last written and FLUSHed, first at %s" % (len(bad), len(want),
                                                          bad[0] if bad else None))
        drained(d, "after the collapse")
        check_data(disk, {off: want[off] for off in sorted(want)[:64]}, "after the replay")
    finally:
        d.stop()


def log_batches(dev):
    """The live log's batches on a device file: (offset in the file,
    seq, data blocks), oldest first."""
    with open(dev, "rb") as f:
        copies = []
        for c in range(2):
            f.seek(c * SB)
            sb = f.read(SB)
            if sb[:8] == struct.pack(">Q", 0x4E424443444556) and \
                    struct.unpack(">I", sb[-4:])[0] == crc32c(sb[:-4]):
                copies.append(sb)
        require(copies, "no valid superblock copy on %s" % dev)
        sb = max(copies, key=lambda b: struct.unpack_from(">Q", b, 32)[0])
        log_offset, log_bytes, off, seq = struct.unpack_from(">QQQQ", sb, 48)
        out = []
        for _ in range(100000):
            f.seek(log_offset + off)
            hdr = f.read(4096)
            if hdr[:8] != struct.pack(">Q", 0x4E4244434C4F47) or \
                    struct.unpack_from(">Q", hdr, 24)[0] != seq or \
                    struct.unpack(">I", hdr[-4:])[0] != crc32c(hdr[:-4]):
                return out
            flags, _, blocks = struct.unpack_from(">III", hdr, 32)
            if flags & 1:
                off, seq = 0, seq + 1
                continue
            out.append((log_offset + off, seq, blocks))
            off, seq = off + (blocks + 1) * 4096, seq + 1
        return out


def flip_byte(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def uncommit(dev, batch):
    """Rewrite a batch header on the device file as if it had been written
    in one commit with the batch before it: its committed mark 0."""
    with open(dev, "r+b") as f:
        f.seek(batch[0])
        hdr = bytearray(f.read(4096))
        struct.pack_into(">Q", hdr, COMMITTED, 0)
        struct.pack_into(">I", hdr, 4092, crc32c(bytes(hdr[:4092])))
        f.seek(batch[0])
        f.write(hdr)


# Where a batch header's committed mark is (device_format.h).
COMMITTED = 48 + 167 * 24 + 8


def torn_tail(tmp):
    """A torn batch ends the log: "last", the last commit's; "first", the
    first of a commit of two (the second's header says nothing was
    committed before them). A committed batch corrupt on the device:
    the drain writes the rest back and fails reads of its bytes."""
    first, second = os.urandom(MIB), os.urandom(MIB)
    for case in ("last", "first", "committed"):
        disk = os.path.join(tmp, case + ".img")
        dev = os.path.join(tmp, case + ".dev")
        nbdtest.sparse_file(disk, SIZE)
        nbdtest.sparse_file(dev, DEVICE)
        d = daemon(tmp, disk, dev, extra=["--cache-device-use", "log"])
        try:
            h = nbdtest.libnbd_handle(d.unix_uri("disk"))
            h.pwrite(first, 0)
            h.flush()
            h.pwrite(second, 8 * MIB)
            h.flush()
        finally:
            d.kill()
            d.logf.close()
        batches = log_batches(dev)
        log("  %s: batches (file offset, seq, data blocks): %s" % (case, batches))
        require(len(batches) == 2 and batches[0][2] >= 256 and batches[1][2] >= 256,
                "expected two batches of 1 MiB of data each: %s" % (batches,))
        bad = batches[1] if case == "last" else batches[0]
        flip_byte(dev, bad[0] + 4096 + 12345)
        if case == "first":
            uncommit(dev, batches[1])
        why = (r"batch %d: data CRC32C 0x[0-9a-f]+, computed 0x[0-9a-f]+ \(torn or corrupt\)"
               % bad[1])
        if case == "committed":
            corrupt_committed(tmp, disk, dev, bad, why, second)
            continue
        replayed = 1 if case == "last" else 0
        rc, out = check_config(disk, dev)
        expect(rc == 0 and "%d batch(es) to replay" % replayed in out,
               "--check-config with the %s batch torn: exit %d:\n%s" % (case, rc, out))
        d = daemon(tmp, disk, dev)
        try:
            if replayed:
                drained(d, "the first commit")
            text = d.log_text()
            if replayed:
                m = re.search(START_LINE + r".*the log ended at offset \d+, batch %d: %s"
                              % (bad[1], why), text)
                expect(m and m.group(1) == "1", "the start did not say it writes back the "
                       "first batch alone")
            else:
                m = re.search(r"nothing to replay: the log ends at its checkpoint.*" + why, text)
                expect("to write back" not in text, "a batch was replayed from before a "
                       "torn one that ends the log")
            expect(m, "no log line saying the log ended at batch %d and why:\n%s"
                   % (bad[1], text[-2000:]))
            if m:
                log("  %s: %s" % (case, m.group(0)))
            if replayed:
                check_data(disk, {0: first}, "after the replay of the first commit")
            else:
                expect(nbdtest.read_at(disk, 0, MIB) != first, "a torn batch was written back")
            expect(nbdtest.read_at(disk, 8 * MIB, MIB) != second,
                   "a batch after the end of the log was written back")
        finally:
            d.stop()


def corrupt_committed(tmp, disk, dev, bad, why, second):
    """A committed batch the device corrupted: --check-config refuses it; a
    start writes back the batch after it, says what the corrupt one held
    is lost (the backend keeps its bytes there), and lets the log go."""
    rc, out = check_config(disk, dev)
    expect(rc != 0 and "was committed, but now" in out and re.search(why, out),
           "--check-config with a committed batch corrupt: exit %d:\n%s" % (rc, out))
    d = daemon(tmp, disk, dev, what="a committed batch corrupt")
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        nbdtest.require_same(h.pread(MIB, 8 * MIB), second, "the batch after the corrupt one, "
                             "read", base=8 * MIB)
        st = drained(d, "a committed batch corrupt")
        expect(st["replay_drained_bytes"] == MIB and st["replay_lost_bytes"] == MIB,
               "stats with a corrupt committed batch: %s" % st)
        # The drain lets the log go at the checkpoint after it: wait for
        # that before the SIGKILL (else the next start finds it again,
        # rightly).
        for _ in range(300):
            if nbdtest.control_request(d.control, {"command": "stats"})[
                    "cache"]["cache_device"]["log_used_bytes"] == 0:
                break
            time.sleep(0.05)
        expect(h.pread(4096, 0) == b"\0" * 4096, "the corrupt batch's bytes are not the "
               "backend's")
        check_data(disk, {8 * MIB: second}, "the batch after the corrupt one")
        text = d.log_text()
        m = re.search(r"batch %d of its log \(at offset \d+\) was committed, but now %s: the "
                      r"device corrupted it. 1048576 bytes of export \"disk\" at 0 that it "
                      r"held are lost" % (bad[1], why), text)
        expect(m, "no log line saying what batch %d held is lost:\n%s" % (bad[1], text[-2000:]))
        if m:
            log("  committed: %s" % m.group(0))
    finally:
        d.kill()
        d.logf.close()
    d = daemon(tmp, disk, dev, what="after the corrupt batch was said lost")
    try:
        expect("to write back" not in d.log_text(), "the log was found again after the drain")
        nbdtest.require_same(nbdtest.libnbd_handle(d.unix_uri("disk")).pread(MIB, 8 * MIB),
                             second, "after a restart", base=8 * MIB)
    finally:
        d.stop()


def lazy_replay(tmp):
    """After SIGKILL, the live log is served at once: its bytes stay dirty
    in the log and a drain writes them back in the background (over a
    backend that takes 300 ms for each write, one at a time, it takes
    seconds). A read of bytes not written back yet waits for their batch
    (and at most the group of 8 MiB being written), not for the whole
    log; a write over them wins; a SIGKILL in the middle of the drain
    loses nothing (the next start finds the old log and the batches
    written after it, an epoch apart)."""
    disk, dev = os.path.join(tmp, "disk.img"), os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(dev, DEVICE)
    backend = "nbdkit:--threads=1 --filter=delay file %s wdelay=300ms" % disk
    big = ["--cache-size", "128M"]  # 20 MiB dirty stays under the dirty limits
    want = {}
    d = daemon(tmp, backend, dev, extra=big)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        for i in range(20):
            want[i * 2 * MIB] = os.urandom(MIB)
            h.pwrite(want[i * 2 * MIB], i * 2 * MIB)
            h.flush()
    finally:
        d.kill()
        d.logf.close()
    on_file = [off for off, data in want.items() if nbdtest.read_at(disk, off, MIB) == data]
    require(len(on_file) <= 2, "%d of 20 MiB reached the backend file before the kill: the "
            "test does not show the log at work" % len(on_file))
    t0 = time.monotonic()
    d = daemon(tmp, backend, dev, extra=big, what="served while the log drains")
    started = time.monotonic() - t0
    try:
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        log("  served %.2f s after the start (the log planned in %.3f s), %d bytes not on the "
            "backend yet" % (started, st["replay_ns"] / 1e9, st["replay_pending_bytes"]))
        expect(st["replay_pending_bytes"] >= 12 * MIB, "the start waited for the log to be "
               "written back: %d bytes left" % st["replay_pending_bytes"])
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        last = max(want)
        t1 = time.monotonic()
        got = h.pread(MIB, last)
        took = time.monotonic() - t1
        nbdtest.require_same(got, want[last], "a read of the last batch while the log drains",
                             base=last)
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        log("  the last batch read in %.3f s; then %d bytes left, %d request(s) waited"
            % (took, st["replay_pending_bytes"], st["replay_waits"]))
        expect(st["replay_pending_bytes"] > 0 and st["replay_waits"] >= 1, "the read of the "
               "last batch did not wait for it alone: %s" % st)
        # A write over bytes still in the log, FLUSHed (answered from it).
        off = sorted(want)[-2]
        patch = os.urandom(8192)
        h.pwrite(patch, off + 4096)
        h.flush()
        want[off] = want[off][:4096] + patch + want[off][4096 + 8192:]
        nbdtest.require_same(h.pread(MIB, off), want[off], "a write over the log's bytes",
                             base=off)
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        require(st["replay_pending_bytes"] > 0, "the drain was over before the kill: nothing "
                "shows a crash in the middle of it")
        log("  SIGKILL with %d bytes not written back" % st["replay_pending_bytes"])
    finally:
        d.kill()
        d.logf.close()
    d = daemon(tmp, backend, dev, extra=big, what="after a SIGKILL during the drain")
    try:
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        expect(st["replay_batches"] >= 21, "the start after the SIGKILL found %d batch(es): "
               "not the old log and the write after it" % st["replay_batches"])
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        for o in sorted(want):
            nbdtest.require_same(h.pread(MIB, o), want[o], "read after a SIGKILL during the "
                                 "drain", base=o)
        st = drained(d, "after a SIGKILL during the drain")
        log("  then: %d batch(es) found, %d bytes written back in %.2f s while served"
            % (st["replay_batches"], st["replay_drained_bytes"], st["replay_drain_ns"] / 1e9))
        expect("the live log found at start is on the backends" in d.log_text(), "no line "
               "saying the drain is done")
    finally:
        d.stop()
    check_data(disk, want, "after the drain")


def held_log(tmp):
    """While the log found at start is not all on the backends, it stays:
    a full round's FLUSH (nbdcachectl flush) of one export is answered only
    once the drain of every export let it go, else a SIGKILL then would
    have the next start write that export's older records over what the
    round wrote. And a reload that removes an export whose bytes the log
    still holds writes them back before it closes the backend."""
    disk, slow_img = os.path.join(tmp, "disk.img"), os.path.join(tmp, "slow.img")
    dev = os.path.join(tmp, "cache.dev")
    for f in (disk, slow_img):
        nbdtest.sparse_file(f, SIZE)
    nbdtest.own_device(nbdtest.sparse_file(dev, DEVICE))
    slow = "nbdkit:--threads=1 --filter=delay file %s wdelay=300ms" % slow_img
    conf = os.path.join(tmp, "nbdcached.conf")
    base = ("[generic]\ncache-size = 128M\ncache-device = %s\ndirty-expire = 3600\n"
            "cache-mode = writeback\n\n[disk]\nbackend = %s\n" % (dev, disk))

    def start(text, name):
        with open(conf, "w") as f:
            f.write(text)
        work = os.path.join(tmp, name)
        os.mkdir(work)
        return nbdtest.CheckedDaemon([], workdir=work, tcp=False, extra=["--config", conf],
                                     what=name)

    both = base + "\n[slow]\nbackend = %s\n" % slow

    def write_and_kill(name, disk_data=None):
        """12 MiB into "slow" (and disk_data at 0 of "disk"), each FLUSHed
        (logged), then SIGKILL: what "slow" was given."""
        data = {i * MIB: os.urandom(MIB) for i in range(12)}
        d = start(both, name)
        try:
            if disk_data:
                h = nbdtest.libnbd_handle(d.unix_uri("disk"))
                h.pwrite(disk_data, 0)
                h.flush()
            hs = nbdtest.libnbd_handle(d.unix_uri("slow"))
            for off, b in sorted(data.items()):
                hs.pwrite(b, off)
                hs.flush()
        finally:
            d.kill()
            d.logf.close()
        return data

    old, new = os.urandom(MIB), os.urandom(MIB)
    write_and_kill("first", old)
    d = start(both, "second")
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(new, 0)
        t0 = time.monotonic()
        rc, out = ctl(d, "flush", "disk")
        took = time.monotonic() - t0
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        log("  nbdcachectl flush disk while the log drains: exit %d in %.2f s; then %d bytes "
            "not written back" % (rc, took, st["replay_pending_bytes"]))
        expect(rc == 0, "nbdcachectl flush disk: exit %d: %s" % (rc, out))
    finally:
        d.kill()
        d.logf.close()
    d = start(both, "third")
    try:
        got = nbdtest.libnbd_handle(d.unix_uri("disk")).pread(MIB, 0)
        nbdtest.require_same(got, new, "what nbdcachectl flush answered for, after SIGKILL and "
                             "a start (the older record from the log found at the start "
                             "before was written over it)")
    finally:
        d.stop()
    # A reload removes "slow" while the log still holds bytes of it.
    slow_data = write_and_kill("fourth")
    d = start(both, "fifth")
    try:
        st = nbdtest.control_request(d.control, {"command": "stats"})["cache"]["cache_device"]
        with open(conf, "w") as f:
            f.write(base)
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok"), "reload removing slow: %r" % r)
        closed = False
        for _ in range(300):
            if "removed backend %s: written back and closed" % slow in d.log_text():
                closed = True
                break
            time.sleep(0.1)
        log("  reload removing an export with %d bytes in the log not written back: %s"
            % (st["replay_pending_bytes"], "written back and closed" if closed else
               "not closed in 30 s"))
        expect(closed, "the removed export was not written back and closed in 30 s")
    finally:
        d.stop()
    check_data(slow_img, slow_data, "the removed export's backend")
    check_data(disk, {0: new}, "after the drain")


def readded_export(tmp):
    disk, other = os.path.join(tmp, "disk.img"), os.path.join(tmp, "other.img")
    dev = os.path.join(tmp, "cache.dev")
    nbdtest.sparse_file(disk, SIZE)
    nbdtest.sparse_file(other, SIZE)
    nbdtest.own_device(nbdtest.sparse_file(dev, DEVICE))
    conf = os.path.join(tmp, "nbdcached.conf")
    base = ("[generic]\ncache-size = 32M\ncache-device = %s\ndirty-expire = 3600\n"
            "cache-mode = writeback\n\n[other]\nbackend = %s\n" % (dev, other))
    with_disk = base + "\n[disk]\nbackend = %s\n" % disk

    def write_config(text):
        with open(conf + ".new", "w") as f:
            f.write(text)
        os.rename(conf + ".new", conf)

    def reload(what):
        r = nbdtest.control_request(d.control, {"command": "reload"})
        expect(r.get("ok"), "reload %s: %r" % (what, r))

    write_config(with_disk)
    data = os.urandom(MIB)
    work = os.path.join(tmp, "first")
    os.mkdir(work)
    d = nbdtest.CheckedDaemon([], workdir=work, tcp=False, extra=["--config", conf])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        first = os.urandom(MIB)
        h.pwrite(first, 0)
        h.flush()
        rc, out = ctl(d, "flush", "disk")
        expect(rc == 0, "nbdcachectl flush disk: exit %d: %s" % (rc, out))
        expect(nbdtest.read_at(disk, 0, MIB) == first, "nbdcachectl flush disk returned, "
               "and the backend file does not have what was written")
        h.pwrite(os.urandom(MIB), MIB)
        h.flush()
        h.shutdown()
        write_config(base)
        reload("removing disk")
        closed = False
        for _ in range(100):
            if "removed backend %s: written back and closed" % disk in d.log_text():
                closed = True
                break
            time.sleep(0.1)
        require(closed, "the removed export's backend was not written back and closed "
                "in 10 s; the log ends:\n%s" % "\n".join(d.log_text().splitlines()[-15:]))
        write_config(with_disk)
        reload("adding disk again")
        commits = nbdtest.control_request(d.control, {"command": "stats"})[
            "cache"]["cache_device"]["commits"]
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(data, 4 * MIB)
        h.flush()
        after = nbdtest.control_request(d.control, {"command": "stats"})[
            "cache"]["cache_device"]["commits"]
        log("  the FLUSH after the export came back: device commits %d -> %d"
            % (commits, after))
        expect(after > commits, "the FLUSH after the reload added the export again did not go "
               "to the log (device commits %d before, %d after)" % (commits, after))
        expect(nbdtest.read_at(disk, 4 * MIB, MIB) != data, "the FLUSH after the reload "
               "put the data on the backend file: the export is not on the log")
    finally:
        d.kill()
        d.logf.close()
    d = daemon(tmp, disk, dev)
    try:
        drained(d, "after SIGKILL")
        check_data(disk, {4 * MIB: data}, "after SIGKILL and the replay")
    finally:
        d.stop()
    # A removed export's records are not replayed over its backend's later
    # bytes: a ZERO record FLUSHed, the export removed (written back and
    # closed), another writer's bytes in the file, SIGKILL, a start.
    # Writeback after a second: a background round flushes the backend
    # (the direct WRITE_ZEROES too), so the reaper finds nothing unflushed
    # and retires the export without a round of its own.
    quick = base.replace("dirty-expire = 3600", "dirty-expire = 1")
    write_config(quick + "\n[disk]\nbackend = %s\n" % disk)
    work = os.path.join(tmp, "removed")
    os.mkdir(work)
    d = nbdtest.CheckedDaemon([], workdir=work, tcp=False, extra=["--config", conf])
    outside = os.urandom(MIB)
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(os.urandom(65536), 20 * MIB)
        h.zero(MIB, 12 * MIB)
        h.flush()
        h.shutdown()
        for _ in range(100):
            st = nbdtest.stats(d)
            if st["dirty_bytes"] == 0 and st.get("unstable_bytes", 0) == 0:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        write_config(quick)
        reload("removing disk")
        closed = False
        for _ in range(100):
            if d.log_text().count("removed backend %s: written back and closed" % disk):
                closed = True
                break
            time.sleep(0.1)
        require(closed, "the removed export's backend was not written back and closed")
        with open(disk, "r+b") as f:
            f.seek(12 * MIB)
            f.write(outside)
            f.flush()
            os.fsync(f.fileno())
    finally:
        d.kill()
        d.logf.close()
    # Its records are no one's now: a start without the export is not
    # refused for them (a copy of the device, as the crash left it).
    dev2 = os.path.join(tmp, "removed.dev")
    shutil.copyfile(dev, dev2)
    d = daemon(tmp, other, dev2, name="other",
               what="the device of a removed export, the export not configured")
    d.stop()
    d = daemon(tmp, disk, dev)
    try:
        drained(d, "the removed export's device")
        expect(nbdtest.read_at(disk, 12 * MIB, MIB) == outside, "a removed export's record "
               "(a WRITE_ZEROES) was replayed over what another writer put in its backend "
               "file after the export was written back and closed")
    finally:
        d.stop()
    # The name given another backend by reloads while the old one cannot
    # be written back and closed yet (a connection to it stays open): the
    # new one is not logged, and the log says so.
    other2 = os.path.join(tmp, "other2.img")
    nbdtest.sparse_file(other2, SIZE)
    write_config(with_disk)
    work = os.path.join(tmp, "otherbackend")
    os.mkdir(work)
    d = nbdtest.CheckedDaemon([], workdir=work, tcp=False, extra=["--config", conf])
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        h.pwrite(os.urandom(MIB), 0)
        h.flush()
        write_config(base)
        reload("removing disk")
        write_config(base + "\n[disk]\nbackend = %s\n" % other2)
        reload("adding disk over another backend")
        text = d.log_text()
        expect("its earlier backend is still being written back; until a restart its "
               "FLUSHes go to the backend, not the log" in text,
               "no warning that the export's new backend is not logged:\n%s" % text[-3000:])
        h2 = nbdtest.libnbd_handle(d.unix_uri("disk"))
        more = os.urandom(MIB)
        h2.pwrite(more, 2 * MIB)
        h2.flush()
        expect(nbdtest.read_at(other2, 2 * MIB, MIB) == more, "a FLUSH on the export's new "
               "backend, which is not logged, did not put the data on it")
        h2.shutdown()
        h.shutdown()
    finally:
        d.stop()


def main():
    with nbdtest.tempdir() as tmp:
        for name, fn in (("a FLUSH answered from the log, replayed after SIGKILL",
                          replay_after_kill),
                         ("refusals", refusals),
                         ("device faults", device_faults),
                         ("a FLUSH is answered by an attempt begun after it",
                          healed_during_attempt),
                         ("cache-device flush and detach", flush_and_detach),
                         ("a log round costs what was written since the last",
                          round_cost),
                         ("an export removed and added again by reloads is logged",
                          readded_export),
                         ("a torn or corrupt batch ends the replay at the last good one",
                          torn_tail),
                         ("the log is served at once and drains in the background",
                          lazy_replay),
                         ("the log found at start stays until it is drained", held_log),
                         ("a stop while the drain fails says so", stop_while_drain_fails)):
            sub = os.path.join(tmp, fn.__name__)
            os.mkdir(sub)
            CHECKS.run(name, fn, sub)
    CHECKS.finish("cache device")


if __name__ == "__main__":
    main()
