#!/usr/bin/python3
# tests/run: alone (asserts times or rates that a test beside it would disturb)
"""systemd_units: the daemon as systemd runs it.

  activation  systemd-socket-activate hands nbdcached a TCP and a Unix
              listening socket (LISTEN_FDS); the daemon serves both and
              binds nothing itself (its default address stays free)
  notify      with NOTIFY_SOCKET and WATCHDOG_USEC set, the daemon sends
              READY=1 (with STATUS=) once serving, WATCHDOG=1 at half the
              interval, and STOPPING=1 on SIGTERM
  verify      systemd-analyze verify accepts systemd/nbdcached.service and
              nbdcached.socket (ExecStart pointed at this build); a Unix
              socket the socket unit listens on inside the service's
              RuntimeDirectory needs RuntimeDirectoryPreserve=yes (else
              stopping the service deletes it under the listening unit)
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
from nbdtest import require as expect  # noqa: E402

MIB = 1024 * 1024


def wait_file(path, seconds, nonempty=False):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if os.path.exists(path) and (not nonempty or os.path.getsize(path) > 0):
            return True
        time.sleep(0.05)
    return False


def gone(pid):
    """Exited (a zombie counts: systemd-socket-activate execs the daemon, so
    it is this test's own child until reaped)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def stop_pid(pid, what):
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(300):
        if gone(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise nbdtest.Failed("%s (pid %d) did not exit within 30 s of SIGTERM" % (what, pid))


def activation(tmp):
    if not shutil.which("systemd-socket-activate"):
        raise nbdtest.Failed("systemd-socket-activate is missing (scripts/deps installs systemd)")
    img = os.path.join(tmp, "disk.img")
    nbdtest.random_file(img, 8 * MIB, seed=7)
    usock = os.path.join(tmp, "act.sock")
    pidfile = os.path.join(tmp, "nbdcached.pid")
    port = nbdtest.free_port()
    logf = open(os.path.join(tmp, "act.log"), "w")
    cmd = ["systemd-socket-activate", "-l", "127.0.0.1:%d" % port, "-l", usock,
           nbdtest.NBDCACHED, "--foreground", "--pidfile", pidfile, "--threads", "2",
           "--export", "disk=" + img]
    log("+ " + " ".join(cmd))
    act = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    daemon_pid = None
    try:
        expect(wait_file(usock, 10), "systemd-socket-activate did not create %s" % usock)
        # The first connection starts the daemon, which takes both sockets.
        want = open(img, "rb").read()
        for uri in ("nbd://127.0.0.1:%d/disk" % port, "nbd+unix:///disk?socket=" + usock):
            h = nbdtest.libnbd_handle(uri)
            expect(h.pread(MIB, 3 * MIB) == want[3 * MIB:4 * MIB], "wrong bytes from " + uri)
            h.shutdown()
        expect(wait_file(pidfile, 10, nonempty=True), "the daemon wrote no pidfile")
        daemon_pid = int(open(pidfile).read())
        text = open(os.path.join(tmp, "act.log")).read()
        expect(text.count("(socket activation)") == 2,
               "the daemon did not take both sockets from systemd:\n" + text[-2000:])
        expect("listening on 127.0.0.1:10809" not in text,
               "the daemon bound its default address despite socket activation")
        stop_pid(daemon_pid, "nbdcached")
        daemon_pid = None
    finally:
        if daemon_pid:
            os.kill(daemon_pid, signal.SIGKILL)
        act.send_signal(signal.SIGTERM)
        try:
            act.wait(10)
        except subprocess.TimeoutExpired:
            act.kill()
            act.wait()
        logf.close()


def notify(tmp):
    nsock = os.path.join(tmp, "notify.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(nsock)
    rx.settimeout(0.2)
    img = os.path.join(tmp, "n.img")
    nbdtest.sparse_file(img, 8 * MIB)
    env = dict(os.environ, NOTIFY_SOCKET=nsock, WATCHDOG_USEC="400000")
    got = []

    def drain(until, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                got.append(rx.recv(4096).decode())
            except socket.timeout:
                pass
            if any(until in m for m in got):
                return True
        return False

    try:
        d = nbdtest.Daemon([("n", img, "")], workdir=tmp, env=env)
        try:
            expect(drain("READY=1", 10), "no READY=1 from the daemon: %r" % got)
            ready = [m for m in got if "READY=1" in m][0]
            expect("STATUS=" in ready and "MAINPID=%d" % d.pid in ready,
                   "READY message without STATUS/MAINPID: %r" % ready)
            got.clear()
            expect(drain("WATCHDOG=1", 2), "no WATCHDOG=1 within 2 s (WATCHDOG_USEC=400000)")
            n_wd = sum("WATCHDOG=1" in m for m in got)
            log("  READY=1, then %d WATCHDOG=1 message(s) within 2 s" % n_wd)
            got.clear()
            d.proc.send_signal(signal.SIGHUP)
            expect(drain("RELOADING=1", 10), "no RELOADING=1 after SIGHUP: %r" % got)
            got[:] = got[[i for i, m in enumerate(got) if "RELOADING=1" in m][0] + 1:]
            expect(drain("READY=1", 10), "no READY=1 after the reload: %r" % got)
            log("  SIGHUP: RELOADING=1, then READY=1")
            d.proc.send_signal(signal.SIGTERM)
            expect(drain("STOPPING=1", 10), "no STOPPING=1 after SIGTERM: %r" % got)
            expect(d.proc.wait(30) == 0, "exit status %s" % d.proc.returncode)
        finally:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
    finally:
        rx.close()


def verify(tmp):
    if not shutil.which("systemd-analyze"):
        raise nbdtest.Failed("systemd-analyze is missing (scripts/deps installs systemd)")
    units = os.path.join(nbdtest.TOP, "systemd")
    for name in ("nbdcached.service", "nbdcached.socket"):
        text = open(os.path.join(units, name)).read()
        text = text.replace("/usr/local/sbin/nbdcached", nbdtest.NBDCACHED)
        text = text.replace("/etc/nbdcached/nbdcached.conf", os.path.join(tmp, "nbdcached.conf"))
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    p = subprocess.run(["systemd-analyze", "verify", "--man=no",
                        os.path.join(tmp, "nbdcached.service"),
                        os.path.join(tmp, "nbdcached.socket")],
                       capture_output=True, text=True, timeout=60)
    out = (p.stdout + p.stderr).strip()
    log("  systemd-analyze verify: exit %d%s" % (p.returncode, (": " + out) if out else ""))
    expect(p.returncode == 0, "systemd-analyze verify failed: " + out)
    # A Unix socket the socket unit listens on inside the service's
    # RuntimeDirectory is deleted with it when the service stops, unless
    # the directory is preserved: socket activation would then stop working.
    service = open(os.path.join(units, "nbdcached.service")).read().splitlines()
    sock = open(os.path.join(units, "nbdcached.socket")).read().splitlines()
    runtime = [l.split("=", 1)[1].split() for l in service if l.startswith("RuntimeDirectory=")]
    preserve = [l.split("=", 1)[1].strip() for l in service
                if l.startswith("RuntimeDirectoryPreserve=")]
    paths = [l.split("=", 1)[1].strip() for l in sock if l.startswith("ListenStream=/")]
    inside = [p for p in paths for d in sum(runtime, [])
              if p.startswith("/run/%s/" % d)]
    log("  Unix sockets in the service's RuntimeDirectory: %s; RuntimeDirectoryPreserve=%s"
        % (inside or "none", preserve or "unset"))
    expect(not inside or (preserve and preserve[-1] == "yes"),
           "nbdcached.socket listens on %s inside the service's RuntimeDirectory, which "
           "systemd deletes when the service stops (RuntimeDirectoryPreserve=%s)"
           % (inside, preserve or "unset"))


def journal(tmp):
    """Under systemd (JOURNAL_STREAM names stderr) lines carry syslog
    priorities for the journal and no timestamp of their own."""
    img = os.path.join(tmp, "j.img")
    nbdtest.sparse_file(img, 8 * MIB)
    logpath = os.path.join(tmp, "nbdcached.log")
    # The Daemon helper opens this path for the daemon's stderr: learn its
    # inode first by creating it, then name it in JOURNAL_STREAM.
    open(logpath, "w").close()
    st = os.stat(logpath)
    env = dict(os.environ, JOURNAL_STREAM="%d:%d" % (st.st_dev, st.st_ino))
    d = nbdtest.Daemon([("j", img, "")], workdir=tmp, env=env)
    try:
        expect(os.stat(logpath).st_ino == st.st_ino, "the log file was replaced")
        d.stop()
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
    lines = [l for l in open(logpath).read().splitlines() if l]
    log("  first lines: %r" % lines[:2])
    expect(any(l.startswith("<6>info: ready:") for l in lines),
           "no '<6>info: ready:' line in %r" % lines[:5])
    expect(all(l[0] == "<" and l[2] == ">" for l in lines),
           "a line without a priority prefix: %r" % [l for l in lines if l[:1] != "<"][:3])
    # Without JOURNAL_STREAM (or with one naming another file): timestamps.
    d = nbdtest.Daemon([("j", img, "")], workdir=tmp,
                       env=dict(os.environ, JOURNAL_STREAM="1:1"))
    d.stop()
    first = open(logpath).read().splitlines()[0]
    expect(first[:2] == "20" and "nbdcached[" in first, "plain line expected: %r" % first)


def main():
    checks = nbdtest.Checks()
    for name, fn in (("activation", activation), ("notify", notify), ("verify", verify),
                     ("journal", journal)):
        with nbdtest.tempdir() as tmp:
            checks.run(name, fn, tmp)
    checks.finish("systemd")


if __name__ == "__main__":
    main()
