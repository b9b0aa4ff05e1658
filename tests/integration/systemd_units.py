#!/usr/bin/python3
"""systemd_units: the daemon as systemd runs it.

  activation  systemd-socket-activate hands nbdcached a TCP and a Unix
              listening socket (LISTEN_FDS); the daemon serves both and
              binds nothing itself (its default address stays free)
  notify      with NOTIFY_SOCKET and WATCHDOG_USEC set, the daemon sends
              READY=1 (with STATUS=) once serving, WATCHDOG=1 again and
              again (at half the interval: twice at least within 10 x the
              interval, a bound a busy machine does not reach), and
              STOPPING=1 on SIGTERM
  verify      systemd-analyze verify accepts systemd/nbdcached.service and
              nbdcached.socket (ExecStart pointed at this build); a Unix
              socket the socket unit listens on inside the service's
              RuntimeDirectory needs RuntimeDirectoryPreserve=yes (else
              stopping the service deletes it under the listening unit);
              so does it with the block-device drop-in beside it
  hardening   the service runs as the nbdcached account (declared in
              systemd/nbdcached.sysusers, in group disk) with the sandbox
              directives nbdcached(8), SYSTEMD lists; systemd-analyze
              security rates its exposure below 4, with and without the
              block-device drop-in
  sandbox     the daemon as an unprivileged user in group disk, with no
              capabilities, no_new_privs and the kernel's MDWE (what
              NoNewPrivileges=, CapabilityBoundingSet= and
              MemoryDenyWriteExecute= give), serves a file, a loop device
              (its node group disk, 0660, as udev makes it), an nbdkit
              plugin (nbdkit runs in the same sandbox) and an NBD server,
              in plain text and TLS (PSK), under strace -f: every system
              call it and nbdkit made is one the unit's SystemCallFilter=
              allows (resolved by systemd-analyze syscall-filter), every
              socket of a family RestrictAddressFamilies= allows
"""

import ctypes
import grp
import os
import re
import shutil
import signal
import socket
import stat
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
    watchdog_usec = 400000
    env = dict(os.environ, NOTIFY_SOCKET=nsock, WATCHDOG_USEC=str(watchdog_usec))
    got = []

    def drain(until, seconds, count=1):
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                got.append(rx.recv(4096).decode())
            except socket.timeout:
                pass
            if sum(until in m for m in got) >= count:
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
            # Every 0.2 s (half the interval): two of them within 10 x the
            # interval, 4 s (it repeats; a busy machine only delays them).
            limit = 10 * watchdog_usec / 1e6
            t0 = time.time()
            expect(drain("WATCHDOG=1", limit, count=2), "fewer than 2 WATCHDOG=1 within %g s "
                   "(WATCHDOG_USEC=%d): %r" % (limit, watchdog_usec, got))
            n_wd = sum("WATCHDOG=1" in m for m in got)
            log("  READY=1, then %d WATCHDOG=1 message(s) in %.2f s" % (n_wd, time.time() - t0))
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
    # The documented drop-in, where systemd finds it: beside the unit.
    dropin = os.path.join(tmp, "nbdcached.service.d")
    os.mkdir(dropin)
    expect(os.path.exists(os.path.join(units, "block-device.conf")),
           "no systemd/block-device.conf (the drop-in for a block device export)")
    shutil.copy(os.path.join(units, "block-device.conf"), dropin)
    p = subprocess.run(["systemd-analyze", "verify", "--man=no",
                        os.path.join(tmp, "nbdcached.service"),
                        os.path.join(tmp, "nbdcached.socket")],
                       capture_output=True, text=True, timeout=60)
    out = (p.stdout + p.stderr).strip()
    log("  systemd-analyze verify (with block-device.conf): exit %d%s"
        % (p.returncode, (": " + out) if out else ""))
    expect(p.returncode == 0, "systemd-analyze verify failed: " + out)
    expect("ignoring" not in out, "systemd-analyze verify ignored a line: " + out)
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


def unit_lines(name):
    """(key, value) for each setting line of systemd/NAME's [Service]
    section, in order."""
    lines, section = [], None
    for line in open(os.path.join(nbdtest.TOP, "systemd", name)).read().splitlines():
        if line.startswith("["):
            section = line.strip()
        elif section == "[Service]" and "=" in line and line[:1] not in ("#", ";"):
            key, value = line.split("=", 1)
            lines.append((key.strip(), value.strip()))
    return lines


# What nbdcached(8), SYSTEMD promises of the service's sandbox.
HARDENING = {
    "User": "nbdcached", "Group": "nbdcached",
    "RuntimeDirectory": "nbdcached", "StateDirectory": "nbdcached", "UMask": "0077",
    "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "PrivateDevices": "yes", "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "ProtectClock": "yes",
    "ProtectHostname": "yes", "ProtectProc": "invisible", "ProcSubset": "pid",
    "NoNewPrivileges": "yes", "RestrictNamespaces": "yes", "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes", "MemoryDenyWriteExecute": "yes", "LockPersonality": "yes",
    "RemoveIPC": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "CapabilityBoundingSet": "", "AmbientCapabilities": "",
    "SystemCallArchitectures": "native", "SystemCallErrorNumber": "EPERM",
}


def exposure(unit_path):
    """systemd-analyze security's overall exposure of the unit file, which
    it reads offline (no systemd needs to run) with the drop-ins beside it."""
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        unit_path], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", p.stdout)
    expect(m is not None, "systemd-analyze security printed no exposure (exit %d): %s%s"
           % (p.returncode, p.stdout[-1000:], p.stderr[-1000:]))
    return float(m.group(1)), [l.strip() for l in p.stdout.splitlines() if l.startswith("✗")]


def hardening(tmp):
    if not shutil.which("systemd-analyze"):
        raise nbdtest.Failed("systemd-analyze is missing (scripts/deps installs systemd)")
    alone = os.path.join(tmp, "alone")
    with_dropin = os.path.join(tmp, "dropin")
    dropin = os.path.join(nbdtest.TOP, "systemd", "block-device.conf")
    for d in (alone, with_dropin):
        os.makedirs(d)
        shutil.copy(os.path.join(nbdtest.TOP, "systemd", "nbdcached.service"), d)
    os.mkdir(os.path.join(with_dropin, "nbdcached.service.d"))
    if os.path.exists(dropin):
        shutil.copy(dropin, os.path.join(with_dropin, "nbdcached.service.d"))
    for d, what in ((alone, "the unit"), (with_dropin, "with block-device.conf")):
        level, exposed = exposure(os.path.join(d, "nbdcached.service"))
        log("  systemd-analyze security, %s: exposure %.1f; exposed: %s"
            % (what, level, "; ".join(" ".join(e.split()[:2]) for e in exposed)))
        expect(level < 4, "%s: exposure %.1f, not below 4 (exposed: %s)"
               % (what, level, ", ".join(e.split()[1] for e in exposed)))
        expect(os.path.exists(dropin),
               "no systemd/block-device.conf (the drop-in for a block device export)")
    settings = {}
    for key, value in unit_lines("nbdcached.service"):
        settings[key] = value
    wrong = ["%s=%s (want %r)" % (k, settings.get(k, "<unset>"), v)
             for k, v in HARDENING.items() if settings.get(k) != v]
    expect(not wrong, "nbdcached.service: " + ", ".join(wrong))
    filters = [v for k, v in unit_lines("nbdcached.service") if k == "SystemCallFilter"]
    expect(filters and filters[0].split()[0] == "@system-service"
           and {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= set(filters[0].split()),
           "SystemCallFilter= is not @system-service with io_uring: %r" % filters)
    # The account the unit names is the one the package declares, in disk.
    path = os.path.join(nbdtest.TOP, "systemd", "nbdcached.sysusers")
    expect(os.path.exists(path), "no systemd/nbdcached.sysusers (the service's account)")
    sysusers = [l.split() for l in open(path) if l.strip() and not l.startswith("#")]
    expect(any(f[:2] == ["u", HARDENING["User"]] for f in sysusers),
           "systemd/nbdcached.sysusers declares no user %s: %r" % (HARDENING["User"], sysusers))
    expect(["m", HARDENING["User"], "disk"] in sysusers,
           "systemd/nbdcached.sysusers does not put %s in group disk" % HARDENING["User"])


def syscall_groups():
    """systemd's system-call groups: name -> members (names or @groups)."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    groups, current = {}, None
    for line in out.splitlines():
        word = line.split("#")[0].strip()
        if not word:
            continue
        if line.startswith("@"):
            current = groups.setdefault(word, [])
        elif current is not None:
            current.append(word)
    return groups


def filter_allows(lines):
    """The system calls a unit's SystemCallFilter= lines allow: the first is
    an allow-list, each "~" line takes its calls away again."""
    groups = syscall_groups()

    def expand(name, seen):
        if not name.startswith("@"):
            return {name}
        if name in seen:
            return set()
        seen.add(name)
        expect(name in groups, "systemd knows no system-call group " + name)
        return set().union(*(expand(m, seen) for m in groups[name]))

    allowed = None
    for value in lines:
        deny = value.startswith("~")
        names = set().union(*(expand(n, set()) for n in value.lstrip("~").split()))
        if allowed is None:
            expect(not deny, "the first SystemCallFilter= is a deny-list: not an allow-list")
            allowed = names
        elif deny:
            allowed -= names
        else:
            allowed |= names
    return allowed or set()


PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
NOBODY = 65534


PR_GET_MDWE = 66


def deny_write_execute():
    """preexec_fn: the kernel's MemoryDenyWriteExecute (Linux 6.3; kept
    across fork and exec), so nbdkit and its plugin run under it as well."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        os._exit(100 + ctypes.get_errno())


def mdwe_supported():
    return ctypes.CDLL(None, use_errno=True).prctl(PR_GET_MDWE, 0, 0, 0, 0) >= 0


def tls_round(usock, psk, export):
    """64 KiB written and read back over TLS (PSK, user alice)."""
    import nbd
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_psk_file(psk)
    h.set_tls_username("alice")
    h.set_export_name(export)
    h.connect_unix(usock)
    data = os.urandom(64 * 1024)
    h.pwrite(data, 0)
    h.flush()
    got = h.pread(len(data), 0)
    h.shutdown()
    expect(got == data, "export %s over TLS: the bytes read back differ" % export)


def sandbox(tmp):
    for tool in ("strace", "setpriv", "nbdkit", "systemd-analyze", "psktool"):
        if not shutil.which(tool):
            raise nbdtest.Failed(tool + " is missing (scripts/deps installs it)")
    allowed = filter_allows([v for k, v in unit_lines("nbdcached.service")
                             if k == "SystemCallFilter"])
    expect(len(allowed) > 100, "the unit's filter resolves to %d calls" % len(allowed))
    # The daemon's own directory: it runs as nobody.
    home = os.path.join(tmp, "svc")
    os.mkdir(home, 0o755)
    os.chmod(tmp, 0o755)
    img = os.path.join(home, "file.img")
    nbdtest.sparse_file(img, 64 * MIB)
    os.chown(home, NOBODY, NOBODY)
    os.chown(img, NOBODY, NOBODY)
    usock, ctl, pidfile = (os.path.join(home, n) for n in ("nbd.sock", "control.sock", "pid"))
    census = os.path.join(home, "strace.out")
    psk = os.path.join(home, "keys.psk")
    nbdtest.run(["psktool", "-u", "alice", "-p", psk], timeout=60)
    os.chown(psk, NOBODY, NOBODY)
    port, remote_port = nbdtest.free_port(), nbdtest.free_port()
    remote_log = open(os.path.join(tmp, "remote.log"), "w")
    remote = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(remote_port),
                               "memory", "size=64M"], stdout=remote_log, stderr=subprocess.STDOUT)

    def remote_listening():
        try:
            socket.create_connection(("127.0.0.1", remote_port), timeout=1).close()
            return True
        except OSError:
            return False

    if not nbdtest.wait_until(remote_listening, 15):
        remote.kill()
        remote.wait()
        raise nbdtest.Failed("nbdkit (the NBD backend) did not listen on port %d" % remote_port)
    # A block device as the unit reaches one: a loop device whose node (made
    # here, as udev would make it) has group disk, mode 0660, and the daemon
    # in group disk, as systemd/nbdcached.sysusers puts nbdcached.
    disk_gid = grp.getgrnam("disk").gr_gid
    loopdev, exports = None, ["file", "kit", "remote"]
    if os.path.exists("/dev/loop-control"):
        backing = os.path.join(tmp, "loop.img")
        nbdtest.sparse_file(backing, 64 * MIB)
        p = subprocess.run(["losetup", "-f", "--show", backing], capture_output=True, text=True,
                           timeout=60)
        if p.returncode != 0:
            remote.kill()
            remote.wait()
            raise nbdtest.Failed("losetup: " + p.stderr.strip())
        loopdev = p.stdout.strip()
        node = os.path.join(home, "disk")
        os.mknod(node, 0o660 | stat.S_IFBLK, os.stat(loopdev).st_rdev)
        os.chown(node, 0, disk_gid)
        os.chmod(node, 0o660)
        exports.append("disk")
    else:
        log("  no loop devices in this kernel: no block device export")
    mdwe = mdwe_supported()
    log("  MDWE (the kernel's MemoryDenyWriteExecute): %s"
        % ("applied" if mdwe else "not in this kernel, not applied"))
    daemon_log = open(os.path.join(tmp, "daemon.log"), "w")
    cmd = ["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--groups=%d" % disk_gid,
           "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--",
           "strace", "-f", "-qq", "-o", census,
           nbdtest.NBDCACHED, "--foreground", "--threads", "2", "--cache-size", "64M",
           "--listen", "127.0.0.1:%d" % port, "--unix", usock, "--control", ctl,
           "--pidfile", pidfile, "--hugepages", "auto", "--tls", "on", "--tls-psk", psk,
           "--export", "file=" + img, "--export", "kit=nbdkit:memory size=64M",
           "--export", "remote=nbd://127.0.0.1:%d" % remote_port]
    cmd += ["--export", "disk=" + os.path.join(home, "disk")] if loopdev else []
    log("+ " + " ".join(cmd))
    env = dict(os.environ)
    if "ASAN_OPTIONS" in env:
        # make asan: LeakSanitizer cannot run under ptrace (strace), and
        # says so with a fatal error at exit; ASan itself still checks.
        env["ASAN_OPTIONS"] += ":detect_leaks=0"
    proc = subprocess.Popen(cmd, stdout=daemon_log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=deny_write_execute if mdwe else None)
    io = [nbdtest.NBDCACHE_IO, "--unix", usock, "--export"]
    try:
        expect(nbdtest.wait_until(lambda: os.path.exists(pidfile) and os.path.getsize(pidfile)
                                  and os.path.exists(ctl), 30),
               "the daemon did not start: exit %s\n%s"
               % (proc.poll(), open(os.path.join(tmp, "daemon.log")).read()[-3000:]))
        pid = int(open(pidfile).read())
        for name in exports:
            data = os.urandom(MIB)
            subprocess.run(io + [name, "write", str(MIB), str(MIB)], input=data, check=True,
                           timeout=60)
            subprocess.run(io + [name, "flush"], check=True, timeout=60)
            got = subprocess.run(io + [name, "read", str(MIB), str(MIB)], capture_output=True,
                                 check=True, timeout=60).stdout
            expect(got == data, "export %s: the bytes read back differ" % name)
            for op in (["trim", "0", "64K"], ["zero", "64K", "64K"], ["status", "0", "64M"]):
                subprocess.run(io + [name] + op, check=True, timeout=60, capture_output=True)
            tcp = subprocess.run([nbdtest.NBDCACHE_IO, "--tcp", "127.0.0.1:%d" % port,
                                  "--export", name, "read", str(MIB), "4096"],
                                 capture_output=True, check=True, timeout=60).stdout
            expect(tcp == data[:4096], "export %s over TCP: the bytes read back differ" % name)
            tls_round(usock, psk, name)
            log("  %s: 1 MiB written, flushed, read back (Unix and TCP); 64 KiB over TLS" % name)
        for sub in ("status", "stats"):
            subprocess.run([nbdtest.NBDCACHECTL, "--control", ctl, sub], check=True, timeout=60,
                           capture_output=True)
        os.kill(pid, signal.SIGUSR1)
        os.kill(pid, signal.SIGHUP)
        expect(nbdtest.wait_until(lambda: "reload:" in open(os.path.join(tmp, "daemon.log")).read(),
                                  15), "no reload after SIGHUP")
        os.kill(pid, signal.SIGTERM)
        rc = proc.wait(60)
        text = open(os.path.join(tmp, "daemon.log")).read()
        expect(rc == 0, "exit status %d:\n%s" % (rc, text[-3000:]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remote.terminate()
        remote.wait(30)
        remote_log.close()
        if loopdev:
            subprocess.run(["losetup", "-d", loopdev], timeout=60)
        daemon_log.close()
    arena = [l for l in text.splitlines() if "cache:" in l and "bytes in" in l]
    log("  as uid %d: %s" % (NOBODY, arena[0].split("info: ", 1)[-1] if arena else "?"))
    used, families = set(), set()
    for line in open(census, errors="replace"):
        # "PID name(args...) = result", "PID name(args <unfinished ...>",
        # "PID <... name resumed>...": every call is on a line of the first
        # two kinds.
        m = re.match(r"\d+\s+([a-z_0-9]+)\((.*)", line)
        if m:
            used.add(m.group(1))
            if m.group(1) in ("socket", "socketpair"):
                families.add(m.group(2).split(",")[0])
    log("  %d system calls seen: %s" % (len(used), " ".join(sorted(used))))
    # The census is worth something only if it saw the I/O paths and nbdkit.
    expect({"io_uring_setup", "io_uring_enter", "execve", "memfd_create"} <= used,
           "the census missed io_uring, nbdkit or the arena: %s" % sorted(used))
    expect(used <= allowed, "system calls the unit's SystemCallFilter= refuses: %s"
           % " ".join(sorted(used - allowed)))
    restricted = set(dict(unit_lines("nbdcached.service")).get("RestrictAddressFamilies",
                                                              "").split())
    log("  socket families: %s; RestrictAddressFamilies=%s"
        % (" ".join(sorted(families)), " ".join(sorted(restricted))))
    expect(families and families <= restricted,
           "socket families the unit's RestrictAddressFamilies= refuses: %s"
           % " ".join(sorted(families - restricted)))


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
                     ("hardening", hardening), ("sandbox", sandbox), ("journal", journal)):
        with nbdtest.tempdir() as tmp:
            checks.run(name, fn, tmp)
    checks.finish("systemd")


if __name__ == "__main__":
    main()
