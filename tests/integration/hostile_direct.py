#!/usr/bin/python3
"""hostile_direct: a WRITE_ZEROES or TRIM of nearly 2^63 bytes holds nothing
but the step it is on, stops when its client goes, and stops with the daemon.

One daemon (--cache-size 64M), exports of SIZE = 2^63 - 1 MiB bytes:
    nbd    nbd+unix:// to an nbdkit started here (memory plugin, log filter)
    kit    nbdkit:--filter=log memory ... (the daemon starts it)
    none   the same with cache-mode=none (nothing cached: TRIM and
           WRITE_ZEROES still go in steps there)
    file   a sparse file of SIZE bytes on tmpfs (/dev/shm)
    probe  a 64 MiB file on tmpfs: nbdtest.ServedProbe's own export
The nbdkit log filter writes a line per request: the backend requests of
an operation are counted there. The hostile client is nbdcache-io (extended
headers: 64-bit lengths, which libnbd 1.14 lacks), `zero 0 SIZE` or
`trim 0 SIZE`, killed by its PID to disconnect.

For nbd and kit, each with WRITE_ZEROES then TRIM, and none with
WRITE_ZEROES:
  1  acknowledged writes first, not flushed: BEHIND at offset 0 (the first
     step covers it) and AHEAD at 2^62 (no step gets there in the test)
  2  the hostile operation starts: the backend sees its requests coming
  3  a FLUSH on another connection of the export is answered while the
     hostile operation still runs (it waits for no more than the step in
     flight, not for the operation: that would take hours), and AHEAD
     reads back; on nbd, nbdkit itself holds AHEAD after it
  4  the hostile client is killed (RUN s after it started, still waiting
     for its reply): the daemon logs its connection's end (a connection
     ends once its last request is gone: the operation has stopped), and
     from then on the backend's count of its requests does not move (the
     same over QUIET s)
  5  BEHIND reads as zeros through the daemon (and on nbd, on nbdkit
     itself after a FLUSH: no stale copy written back over the zeros);
     AHEAD still reads back, and a FLUSH succeeds
Then on kit a raw client pipelines PIPELINED such WRITE_ZEROES (more than
the 128 a connection may have in flight: the daemon stops reading it) and
closes its socket: the backend's count stops growing as in 4.
Meanwhile the probe (connect, 4 KiB WRITE, FLUSH, READ, on its own export
of the same daemon and cache) is served in every round within a quarter
of the time it ran (nbdtest.ServedProbe).
On file, a WRITE_ZEROES of all SIZE bytes completes within FILE_LIMIT s: a
file takes any range in one fallocate, so its steps grow to 2^62 bytes
(with NBD's 64 GiB at most, 2^63 bytes would be 2^27 steps, hours), and
bytes written at 2^62 before it read as zeros after it.
Then SIGTERM with a WRITE_ZEROES in progress on nbd and file and a TRIM on
kit: the daemon exits 0 within STOP_LIMIT s (a step aims at 100 ms; the
whole operation would take hours), the clients of the ops in progress on
nbd and kit get NBD_ESHUTDOWN, the file's a reply (ESHUTDOWN, or success
if it was done), and the daemon's nbdkit is gone.
Every wait is bounded in count and time; failures are listed at the end.
No bound is a wall-clock figure a busy machine could miss: what is
asserted is an order (a FLUSH answered while the operation runs; no
request after the connection's end) or a bound hundreds of times what a
working daemon takes and a tiny part of what a broken one would (hours).

HOSTILE_DIRECT_RUN (default 2) and HOSTILE_DIRECT_QUIET (default 2) set RUN
and QUIET, in seconds (make asan and make i386: 1 each; the backend takes
several hundred of an operation's requests a second, so that one still
running shows in either).
"""

import os
import re
import shutil
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
import bad_input as raw  # noqa: E402  (RawClient: extended headers, which libnbd 1.14 lacks)

import nbd  # noqa: E402

MIB = 1 << 20
SIZE = (1 << 63) - MIB
AHEAD = 1 << 62
# How long a FLUSH on the export under the hostile operation, the end of a
# connection whose client went, and the exit after SIGTERM may take: each
# waits for a step at most (a step aims at 100 ms of backend time,
# daemon/cache/direct.c), never for the operation (hours).
FLUSH_LIMIT = 30.0
END_LIMIT = 30.0
STOP_LIMIT = 30.0
# once the connection has ended, the backend's count must not move for this long
QUIET = float(os.environ.get("HOSTILE_DIRECT_QUIET", "2"))
GROW_LIMIT = 30.0    # for the backend to show the hostile requests (hundreds a second)
# how long a hostile operation runs before its client goes
RUN = float(os.environ.get("HOSTILE_DIRECT_RUN", "2"))
PIPELINED = 140      # WRITE_ZEROES sent at once (a connection has at most 128 in flight)
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error, raw.Mismatch, raw.Closed))
expect = CHECKS.expect
REQUEST = re.compile(rb" (Zero|Trim) id=")


class RequestLog:
    """The requests an nbdkit log filter logged, counted as the file grows."""

    def __init__(self, path):
        self.path, self.pos, self.rest = path, 0, b""
        self.counts = {b"Zero": 0, b"Trim": 0}

    def count(self, what):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            data = b""
        self.pos += len(data)
        data = self.rest + data
        cut = data.rfind(b"\n") + 1
        self.rest = data[cut:]
        for m in REQUEST.finditer(data[:cut]):
            self.counts[m.group(1)] += 1
        return self.counts[what]

    def wait_growth(self, what, before, n, limit):
        """The count of `what` at least before + n within limit seconds."""
        deadline = time.time() + limit
        for _ in range(int(limit / 0.05) + 1):
            got = self.count(what)
            if got >= before + n or time.time() > deadline:
                return got
            time.sleep(0.05)
        return self.count(what)


# A few dozen steps (0.02 s here); in steps of 64 GiB it would be hours.
FILE_LIMIT = 60


def file_whole_zero(d):
    h = nbdtest.libnbd_handle(d.unix_uri("file"))
    try:
        h.pwrite(b"\xaa" * 4096, 1 << 62)
    finally:
        h.shutdown()
    p = hostile(d, "file", "zero")
    t0 = time.time()
    try:
        p.wait(timeout=FILE_LIMIT)
    except subprocess.TimeoutExpired:
        kill(p)
        raise Failed("a WRITE_ZEROES of 2^63 - 1 MiB bytes on a sparse file took over %d s"
                     % FILE_LIMIT)
    took = time.time() - t0
    require(p.returncode == 0, "WRITE_ZEROES on file: exit %d: %s"
            % (p.returncode, p.stderr.read().decode(errors="replace")))
    h = nbdtest.libnbd_handle(d.unix_uri("file"))
    try:
        got = h.pread(4096, 1 << 62)
    finally:
        h.shutdown()
    require(got == bytes(4096), "bytes at 2^62 not zeros after the WRITE_ZEROES")
    log("  file: WRITE_ZEROES of 2^63 - 1 MiB bytes in %.2f s" % took)


def hostile(d, name, command):
    """nbdcache-io COMMAND 0 SIZE on export name, in the background."""
    cmd = [nbdtest.NBDCACHE_IO, "--unix", d.sock, "--export", name, command, "0", str(SIZE)]
    log("+ " + " ".join(cmd) + " &")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def require_running(proc, what):
    """Failed, with what the client said, if it has ended."""
    if proc.poll() is not None:
        raise Failed("%s: the client ended (exit %d): %s"
                     % (what, proc.returncode, proc.stderr.read().decode(errors="replace")))


def kill(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def timed_flush(uri, limit, what):
    """FLUSH on a new connection, in a thread: answered within limit seconds
    (else a failure is recorded, and the test goes on). True if answered."""
    h = nbdtest.libnbd_handle(uri)
    result = []

    def run():
        try:
            h.flush()
            result.append(None)
        except nbd.Error as e:
            result.append(e)
    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    took = time.monotonic() - t0
    # A FLUSH still waiting leaves its handle to the thread (never closed).
    if not expect(result, "%s: FLUSH not answered within %g s" % (what, limit)):
        return False
    expect(result[0] is None, "%s: FLUSH failed: %s" % (what, result[0]))
    log("  %s: FLUSH answered in %.3f s" % (what, took))
    nbdtest.shutdown_all([h])
    return True


NEGOTIATED = re.compile(r'conn (\d+): export "([^"]+)" negotiated \S+ extended=1')


def hostile_conn(d, name, mark):
    """The id of the connection with extended headers to export `name` that
    negotiated after `mark` (a length of the daemon's log): the hostile
    client's (nbdcache-io and RawClient ask for extended headers, libnbd
    1.14 cannot)."""
    found = []

    def look():
        found[:] = [m.group(1) for m in NEGOTIATED.finditer(d.log_text()[mark:])
                    if m.group(2) == name]
        return found
    require(nbdtest.wait_until(look, 10), "test setup: the daemon did not log the hostile "
            "connection to %s negotiating (extended=1)" % name)
    require(len(found) == 1, "test setup: %d connections with extended headers to %s"
            % (len(found), name))
    return found[0]


def one_op(d, name, command, reqlog, nbdkit_direct):
    what = "%s %s" % (name, command)
    key = b"Zero" if command == "zero" else b"Trim"
    pattern = (b"ahead-%s-%s-" % (name.encode(), command.encode())) * 512
    pattern = pattern[:4096]
    w = nbdtest.libnbd_handle(d.unix_uri(name))
    try:
        w.pwrite(b"\xbe" * 4096, 0)
        w.pwrite(pattern, AHEAD)
    finally:
        nbdtest.shutdown_all([w])
    before = reqlog.count(key)
    mark = len(d.log_text())
    proc = hostile(d, name, command)
    started = time.monotonic()
    try:
        got = reqlog.wait_growth(key, before, 20, GROW_LIMIT)
        require(got >= before + 20, "%s: the backend saw %d of its requests in %g s"
                % (what, got - before, GROW_LIMIT))
        conn = hostile_conn(d, name, mark)
        require_running(proc, what)
        if timed_flush(d.unix_uri(name), FLUSH_LIMIT, what + ", while it runs"):
            # The order, not the time: answered while the operation still
            # runs, so it did not wait for it (nor for its client to go).
            during = reqlog.count(key)
            expect(proc.poll() is None and nbdtest.wait_until(
                lambda: reqlog.count(key) > during, GROW_LIMIT),
                "%s: the FLUSH beside it was answered only once the operation had ended"
                % what)
        r = nbdtest.libnbd_handle(d.unix_uri(name))
        try:
            expect(r.pread(4096, AHEAD) == pattern,
                   "%s: the acknowledged write ahead of the steps does not read back" % what)
        finally:
            nbdtest.shutdown_all([r])
        if nbdkit_direct:
            expect(nbdkit_direct.pread(4096, AHEAD) == pattern,
                   "%s: nbdkit does not hold the write ahead after FLUSH" % what)
        time.sleep(max(0.0, RUN - (time.monotonic() - started)))
        require_running(proc, what)
    finally:
        kill(proc)
    expect_quiet(d, conn, reqlog, key, before, what)
    r = nbdtest.libnbd_handle(d.unix_uri(name))
    try:
        expect(r.pread(4096, 0) == bytes(4096),
               "%s: offset 0 (passed by the first step) does not read as zeros" % what)
        expect(r.pread(4096, AHEAD) == pattern,
               "%s: the write ahead of the steps is gone after the stop" % what)
    finally:
        nbdtest.shutdown_all([r])
    timed_flush(d.unix_uri(name), FLUSH_LIMIT, what + ", after the stop")
    if nbdkit_direct:
        expect(nbdkit_direct.pread(4096, 0) == bytes(4096),
               "%s: nbdkit holds other bytes than zeros at offset 0 after FLUSH" % what)


def expect_quiet(d, conn, reqlog, key, before, what):
    """The client has gone: the daemon logs its connection's end, which
    comes after its last request is freed (transmit.c: each holds the
    connection), so after the operation's last step; from then on, QUIET s
    without a request of key. An operation that goes on without its
    client never lets the connection end."""
    gone = time.monotonic()
    ended = nbdtest.wait_until(lambda: ("conn %s: ended after" % conn) in d.log_text(),
                               END_LIMIT)
    took = time.monotonic() - gone
    c1 = reqlog.count(key)
    if not expect(ended, "%s: its connection (conn %s) has not ended %g s after its client "
                  "went (%d backend requests since): the operation goes on"
                  % (what, conn, END_LIMIT, c1 - before)):
        return
    time.sleep(QUIET)
    c2 = reqlog.count(key)
    log("  %s: %d backend requests in all; the connection ended %.2f s after its client "
        "went, %d requests in the %g s after that" % (what, c2 - before, took, c2 - c1, QUIET))
    expect(c1 == c2, "%s: the backend got %d more of its requests in the %g s after its "
           "connection (conn %s) had ended" % (what, c2 - c1, QUIET, conn))


def pipelined(d, name, reqlog):
    what = "%s: %d WRITE_ZEROES pipelined" % (name, PIPELINED)
    before = reqlog.count(b"Zero")
    mark = len(d.log_text())
    r = raw.RawClient(d.sock)
    try:
        r.open(name, extended=True)
        for _ in range(PIPELINED):
            r.request(raw.CMD_WRITE_ZEROES, 0, SIZE)
        got = reqlog.wait_growth(b"Zero", before, 20, GROW_LIMIT)
        require(got >= before + 20, "%s: the backend saw %d of their requests in %g s"
                % (what, got - before, GROW_LIMIT))
        conn = hostile_conn(d, name, mark)
        time.sleep(RUN)
    finally:
        r.close()
    expect_quiet(d, conn, reqlog, b"Zero", before, what)


def sigterm(d):
    kids = [p for p in os.listdir("/proc") if p.isdigit() and parent_of(int(p)) == d.pid]
    procs = {name: hostile(d, name, cmd)
             for name, cmd in (("nbd", "zero"), ("kit", "trim"), ("file", "zero"))}
    try:
        time.sleep(1.0)
        for name, p in procs.items():
            if name != "file":
                require_running(p, "%s, before SIGTERM" % name)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            rc = d.proc.wait(timeout=STOP_LIMIT)
        except subprocess.TimeoutExpired:
            raise Failed("nbdcached did not exit within %g s of SIGTERM with operations of "
                         "2^63 bytes in progress; its threads: %s; its children: %s"
                         % (STOP_LIMIT, thread_states(d.pid),
                            ", ".join(proc_state(int(k)) for k in kids) or "none"))
        log("  the daemon exited %d, %.3f s after SIGTERM" % (rc, time.monotonic() - t0))
        expect(rc == 0, "nbdcached exited with %d after SIGTERM" % rc)
        for name, p in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                CHECKS.add("the %s client got no reply and no end 30 s after the daemon (%s; "
                           "processes holding its peer: %s)"
                           % (name, proc_state(p.pid), socket_holders(p.pid)))
                continue
            err = p.stderr.read().decode(errors="replace")
            log("  %s client: exit %d: %s" % (name, p.returncode, err.strip().replace("\n", " | ")))
            if name == "file":
                expect(p.returncode == 0 or "NBD_ESHUTDOWN" in err,
                       "the file client: neither success nor NBD_ESHUTDOWN: %s" % err)
            else:
                expect("NBD_ESHUTDOWN" in err, "the %s client was not answered NBD_ESHUTDOWN: %s"
                       % (name, err))
    finally:
        for p in procs.values():
            kill(p)
    deadline = time.time() + 30
    for _ in range(1200):
        left = [k for k in kids if os.path.exists("/proc/%s" % k) and parent_of(int(k)) == d.pid]
        if not left or time.time() > deadline:
            break
        time.sleep(0.05)
    expect(not left, "children of the daemon still run 30 s after it: %s"
           % ", ".join("%s (%s)" % (k, proc_state(int(k))) for k in left))


def proc_state(pid):
    """What /proc says a process is doing (for a failure's message)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open("/proc/%d/wchan" % pid) as f:
            wchan = f.read().strip()
        with open("/proc/%d/stat" % pid) as f:
            st = f.read()
        return "pid %d %s, state %s, waiting in %s" % (
            pid, cmd[:80], st[st.rindex(")") + 2:].split()[0], wchan or "-")
    except OSError as e:
        return "pid %d: %s" % (pid, e)


def thread_states(pid):
    """Each thread of pid: its name, state, where it waits, and the top of
    its kernel stack where readable (for a failure's message)."""
    out = []
    try:
        tids = sorted(os.listdir("/proc/%d/task" % pid), key=int)
    except OSError as e:
        return str(e)
    for tid in tids:
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            with open(base + "comm") as f:
                comm = f.read().strip()
            with open(base + "stat") as f:
                st = f.read()
            with open(base + "wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        line = "%s %s %s %s" % (tid, comm, st[st.rindex(")") + 2:].split()[0], wchan or "-")
        try:
            with open(base + "stack") as f:
                frames = [fr.split()[-1] for fr in f.read().splitlines()[:4] if fr.split()]
            line += " [%s]" % " < ".join(frames)
        except OSError:
            pass
        out.append(line)
    return "; ".join(out)


def socket_holders(pid):
    """Who holds the other end of pid's Unix sockets (ss -xp): a leaked
    descriptor keeps a connection open after its daemon has gone."""
    try:
        out = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return "ss: %s" % e
    rows = [line.split() for line in out.splitlines()[1:]]
    peers = {r[7] for r in rows if len(r) > 8 and ("pid=%d," % pid) in r[-1]}
    held = ["%s %s" % (r[5], r[-1]) for r in rows if len(r) > 8 and r[5] in peers]
    return "; ".join(held) or "nobody (peer inodes %s)" % (sorted(peers) or "none")


def parent_of(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])


def main():
    if shutil.which("nbdkit") is None:
        nbdtest.fail("nbdkit not found (install nbdkit)")
    shm = nbdtest.shm_dir()
    require(shm, "no tmpfs directory for the sparse files")
    t0 = time.time()
    with nbdtest.tempdir() as tmp, nbdtest.tempdir(base=shm) as stmp:
        kitlog = os.path.join(tmp, "kit.log")
        nonelog = os.path.join(tmp, "none.log")
        peers = []
        nk = nbdtest.Nbdkit(tmp, "nbd", ["--filter=log", "memory", "size=%d" % SIZE,
                                         "logfile=%s" % os.path.join(tmp, "nbd.log")],
                            peers=peers)
        big = os.path.join(stmp, "big.img")
        probe_img = os.path.join(stmp, "probe.img")
        nbdtest.sparse_file(big, SIZE)
        nbdtest.sparse_file(probe_img, 64 * MIB)
        exports = [("nbd", nk.uri(), ""),
                   ("kit", "nbdkit:--filter=log memory size=%d logfile=%s" % (SIZE, kitlog), ""),
                   ("none", "nbdkit:--filter=log memory size=%d logfile=%s" % (SIZE, nonelog),
                    "cache-mode=none"),
                   ("file", big, ""),
                   ("probe", probe_img, "")]
        d = nbdtest.CheckedDaemon(exports, extra=["--cache-size", "64M"], ready_timeout=30,
                                  what="its nbdkit exports")
        direct = nbdtest.libnbd_handle(nk.uri())
        try:
            logs = {"nbd": RequestLog(os.path.join(tmp, "nbd.log")), "kit": RequestLog(kitlog),
                    "none": RequestLog(nonelog)}
            with nbdtest.ServedProbe(d.unix_uri("probe")) as probe:
                for name, commands in (("nbd", ("zero", "trim")), ("kit", ("zero", "trim")),
                                       ("none", ("zero",))):
                    for command in commands:
                        CHECKS.run("%s: %s of 2^63 - 1 MiB bytes, its client killed"
                                   % (name, command), one_op, d, name, command, logs[name],
                                   direct if name == "nbd" else None)
                CHECKS.run("kit: %d WRITE_ZEROES of 2^63 - 1 MiB bytes pipelined, the client "
                           "gone" % PIPELINED, pipelined, d, "kit", logs["kit"])
                CHECKS.run("file: a WRITE_ZEROES of 2^63 - 1 MiB bytes, whole",
                           file_whole_zero, d)
            CHECKS.run("another client served throughout (a quarter of the time at most)",
                       probe.check, "beside the hostile operations")
            CHECKS.run("SIGTERM with operations of 2^63 bytes in progress", sigterm, d)
            text = d.log_text()
            expect("Sanitizer" not in text and "runtime error:" not in text,
                   "a sanitizer report in the daemon's log")
        finally:
            nbdtest.shutdown_all([direct])
            if CHECKS.failures:
                d.dump_log()
            d.discard()
            for p in peers:
                p.stop()
    log("total %.1fs" % (time.time() - t0))
    CHECKS.finish("hostile direct")


if __name__ == "__main__":
    main()
