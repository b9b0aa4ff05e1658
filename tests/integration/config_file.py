#!/usr/bin/python3
# tests/run: alone (asserts times or rates that a test beside it would disturb)
"""The config file (nbdcached.conf(5)): the examples in configs/ load; every
kind of bad input is refused with FILE:LINE and a reason; an nbd-server
style config is served as it says (read-only, connection limit); the command
line wins over the file for what it gives, stall-timeout included (a client
that reads none of its replies is reset after the file's value, or the
command line's when it gives one), and negotiation-timeout likewise (a
client that never finishes negotiating is dropped after the file's value,
or the command line's)."""
import errno
import os
import select
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402
import bad_input as raw  # noqa: E402  (RawClient)

MIB = 1 << 20
CHECKS = nbdtest.Checks()
LONG = ("a long description, " * 150).strip()
LONG_NAME = "export-with-a-name-longer-than-inih-keeps-" + "x" * 100
expect = CHECKS.expect


def check_config(path, *extra):
    p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--config", path, *extra],
                       capture_output=True, text=True, errors="replace", timeout=30)
    return p.returncode, p.stdout, p.stderr


def examples(tmp):
    confs = sorted(f for f in os.listdir(os.path.join(nbdtest.TOP, "configs"))
                   if f.endswith(".conf"))
    expect(len(confs) >= 3, "expected at least 3 example configs, found %r" % confs)
    for name in confs:
        rc, out, err = check_config(os.path.join(nbdtest.TOP, "configs", name))
        log("  %s: exit %d, %s" % (name, rc, out.strip().splitlines()[-1] if out else err))
        expect(rc == 0 and "config OK" in out, "%s does not load: %s%s" % (name, out, err))


# (file text, the line the error must name, words the message must hold)
BAD = [
    ("[generic]\ncache-size = 1G\nfrobnicate = 3\n", 3, "unknown key 'frobnicate'"),
    ("[generic]\n\n[a]\nbackend = /tmp/x\nspeed = fast\n", 5, "unknown key 'speed' in export [a]"),
    ("[generic]\ncache-size = lots\n", 2, "cache-size lots"),
    ("[a]\nbackend = /tmp/x\nreadonly = maybe\n", 3, "readonly maybe: expected true or false"),
    ("[a]\nbackend = /tmp/x\ncache-device-warm = often\n", 3,
     "cache-device-warm often: expected files or all"),
    ("[a]\nbackend = /tmp/x\ncache-device-warm = all\ncache-device-warm = files\n", 4,
     "cache-device-warm"),
    ("[a]\nbackend = /tmp/x\n[b]\nbackend = /tmp/y\n[a]\nbackend = /tmp/z\n", 6,
     "export 'a' defined twice"),
    ("cache-size = 1G\n[a]\nbackend = /tmp/x\n", 1, "outside a section"),
    ("[generic]\nthis line is not ini\n", 2, "syntax error"),
    ("[a]\nexportname = /tmp/x\ncopyonwrite = true\n", 3,
     "nbd-server key 'copyonwrite' is not supported"),
    ("[a]\ndescription = no backend here\n[b]\nbackend = /tmp/y\n", 1,
     "export 'a' has no backend"),
    ("[a]\nbackend = /tmp/x\nblock-size = 3000\n", 3, "power of two"),
    ("[a]\nbackend = /tmp/x\ncache-mode = turbo\n", 3, "cache-mode turbo"),
    ("[a]\nbackend = /tmp/x\nbackend = /tmp/y\n", 3, "'backend' given twice"),
    ("[generic]\nport = 99999\n[a]\nbackend = /tmp/x\n", 2, "port 99999"),
    ("[generic]\nlisten = nowhere\n[a]\nbackend = /tmp/x\n", 2, "listen nowhere"),
    ("[a]\nbackend = /tmp/x\nflush = false\n", 3, "flush cannot be turned off"),
    ("[a]\nbackend = /tmp/x\nmaxconnections = -2\n", 3, "maxconnections -2"),
    ("[a]\nbackend = /tmp/x\ndescription = " + "d" * 9000 + "\n", 3, "line longer than 8192"),
    ("[a]\nbackend = /tmp/x\n" + "k" * 300 + " = 1\n", 3, "key name longer than"),
    ("[generic]\ndirty-high = 0x10\n[a]\nbackend = /tmp/x\n", 2, "dirty-high 0x10"),
    ("[generic]\ncompact = maybe\n[a]\nbackend = /tmp/x\n", 2, "compact maybe: expected on or off"),
    ("[generic]\nmax-reply-memory = 1M\n[a]\nbackend = /tmp/x\n", 2, "max-reply-memory 1M"),
    ("[generic]\nmax-clients = -1\n[a]\nbackend = /tmp/x\n", 2, "max-clients -1"),
    ("[generic]\nmax-pinned-replies = some\n[a]\nbackend = /tmp/x\n", 2,
     "max-pinned-replies some"),
    ("[generic]\nstall-timeout = 0\n[a]\nbackend = /tmp/x\n", 2,
     "stall-timeout 0: expected 1..3600 seconds"),
    ("[generic]\nstall-timeout = 3601\n[a]\nbackend = /tmp/x\n", 2,
     "stall-timeout 3601: expected 1..3600 seconds"),
    ("[generic]\nstall-timeout = 5\nstall-timeout = 6\n[a]\nbackend = /tmp/x\n", 3,
     "'stall-timeout' given twice"),
    ("[generic]\nnegotiation-timeout = 0\n[a]\nbackend = /tmp/x\n", 2,
     "negotiation-timeout 0: expected 1..3600 seconds"),
    ("[generic]\nnegotiation-timeout = 3601\n[a]\nbackend = /tmp/x\n", 2,
     "negotiation-timeout 3601: expected 1..3600 seconds"),
    ("[generic]\nnegotiation-timeout = 1m\n[a]\nbackend = /tmp/x\n", 2,
     "negotiation-timeout 1m: expected 1..3600 seconds"),
    ("[generic]\nnegotiation-timeout = 5\nnegotiation-timeout = 6\n[a]\nbackend = /tmp/x\n", 3,
     "'negotiation-timeout' given twice"),
    ("[generic]\nmetrics = 9109\n[a]\nbackend = /tmp/x\n", 2,
     "metrics 9109: expected HOST:PORT"),
    ("[generic]\nmetrics-export-names = some\n[a]\nbackend = /tmp/x\n", 2,
     "metrics-export-names some: expected listed or all"),
    ("[generic]\nmetrics-export-names = all\nmetrics-export-names = listed\n"
     "[a]\nbackend = /tmp/x\n", 3, "'metrics-export-names' given twice"),
]


def bad_input(tmp):
    path = os.path.join(tmp, "bad.conf")
    for text, line, words in BAD:
        with open(path, "w") as f:
            f.write(text)
        rc, out, err = check_config(path)
        first = err.strip().splitlines()[0] if err.strip() else ""
        log("  exit %d: %s" % (rc, first[:150]))
        expect(rc == 2, "exit %d (want 2) for %r" % (rc, text[:60]))
        expect(first.startswith("nbdcached: %s:%d: " % (path, line)) and words in first,
               "want '%s:%d: ...%s...', got %r" % (path, line, words, first[:200]))
    # Values that are each fine but not together: named by export and line.
    with open(path, "w") as f:
        f.write("[generic]\ncache-size = 64M\n\n[a]\nbackend = /tmp/x\ndirty-high = 10\n"
                "dirty-low = 20\n")
    rc, out, err = check_config(path)
    log("  exit %d: %s" % (rc, err.strip()))
    expect(rc == 2 and "export 'a' at %s:4" % path in err and "dirty-low 20" in err,
           "dirty-low above dirty-high: %r" % err)
    # A name in the file and on the command line.
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\n")
    rc, out, err = check_config(path, "--export", "a=/tmp/y")
    expect(rc == 2 and "export 'a' is defined at %s:1 and on the command line" % path in err,
           "duplicate with the command line: %r" % err)
    # One file behind two exports (a read-only view, a window): one backend,
    # one cache, so they must agree on what the cache holds per backend.
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\n[b]\nbackend = /tmp/x\nreadonly = true\n"
                "offset = 1M\nsize = 2M\n")
    rc, out, err = check_config(path)
    expect(rc == 0 and "export 'b': /tmp/x, cache writeback, block size 4096, read-only, "
           "bytes 1048576 to 3145727, one cache with export 'a'" in out,
           "a shared backend is one cache: %r %r" % (out, err))
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\n[b]\nbackend = /tmp/x\nblock-size = 512\n")
    rc, out, err = check_config(path)
    expect(rc == 2 and "exports 'a' and 'b' share the backend /tmp/x, and so one cache: "
           "their block-size must be the same" in err,
           "exports over one backend with different block sizes: %r" % err)
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\nsplit = 32bit\noffset = 6000\n")
    rc, out, err = check_config(path)
    expect(rc == 2 and "export 'a' at %s:1: offset, size and split must be multiples of its "
           "block size 4096" % path in err, "a window off the block size: %r" % err)
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\nsplit = 32bit\n[a/1]\nbackend = /tmp/y\n")
    rc, out, err = check_config(path)
    expect(rc == 2 and "export 'a/1' is named like a window of export 'a'" in err,
           "a name taken by a split window: %r" % err)
    with open(path, "w") as f:
        f.write("[a]\nbackend = /tmp/x\nsplit = 0\n")
    rc, out, err = check_config(path)
    expect(rc == 2 and "%s:3: split 0: expected a size above 0, or 32bit" % path in err,
           "split = 0: %r" % err)
    rc, out, err = check_config(os.path.join(tmp, "missing.conf"))
    expect(rc == 2 and "missing.conf: No such file or directory" in err,
           "a missing file: %r" % err)


def nbd_server_style(tmp):
    """An nbd-server config with the shared keys, served for real."""
    rw = os.path.join(tmp, "rw.img")
    ro = os.path.join(tmp, "ro.img")
    nbdtest.random_file(rw, 4 * MIB, seed=3)
    nbdtest.random_file(ro, 4 * MIB, seed=4)
    port = nbdtest.free_port()
    conf = os.path.join(tmp, "nbd-server.conf")
    with open(conf, "w") as f:
        f.write("""# written as for nbd-server
[generic]
    listenaddr = 127.0.0.1
    port = %d
    cache_size = 32M

[disk]
    exportname = %s
    readonly = false
    maxconnections = 2
    flush = true
    fua = true

[ro]
    exportname = %s
    readonly = true
    trim = true
""" % (port, rw, ro))
    # Started by hand: the test helper's --unix would replace the file's
    # listen address (the command line wins).
    ctl = os.path.join(tmp, "control.sock")
    logf = open(os.path.join(tmp, "log"), "w")
    proc = subprocess.Popen([nbdtest.NBDCACHED, "--foreground", "--config", conf,
                             "--control", ctl], stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 15
        while not os.path.exists(ctl) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        if not os.path.exists(ctl):
            raise nbdtest.Failed("nbdcached did not start: %s" % open(logf.name).read())
        uri = "nbd://127.0.0.1:%d/" % port
        h1 = nbdtest.libnbd_handle(uri + "disk")
        h2 = nbdtest.libnbd_handle(uri + "disk")
        expect(not h1.is_read_only(), "disk must be writable")
        h1.pwrite(b"\x5a" * 4096, 8192)
        h1.flush()
        expect(nbdtest.read_at(rw, 8192, 4096) == b"\x5a" * 4096, "the write reached the file")
        # maxconnections = 2: a third client is refused at GO.
        try:
            nbdtest.libnbd_handle(uri + "disk")
            expect(False, "a third connection to 'disk' was accepted (maxconnections = 2)")
        except Exception as e:  # nbd.Error
            log("  third connection refused: %s" % e)
            expect("maximum number of connections" in str(e) or "policy" in str(e).lower(),
                   "refusal reason: %s" % e)
        h2.shutdown()
        del h2
        time.sleep(0.3)  # the daemon sees the disconnect
        h3 = nbdtest.libnbd_handle(uri + "disk")  # room again
        h3.shutdown()
        hr = nbdtest.libnbd_handle(uri + "ro")
        expect(hr.is_read_only(), "ro must be read-only")
        expect(hr.pread(4096, 0) == nbdtest.read_at(ro, 0, 4096), "ro reads its file")
        nbdtest.expect_nbd_error(lambda: hr.pwrite(b"x" * 512, 0), errno.EPERM,
                                 "a write to a read-only export")
        st = nbdtest.control_request(ctl, {"command": "status"})
        expect(st["cache_bytes"] == 32 * MIB, "cache_size = 32M from the file: %r" % st)
        expect(st["listen"] == [{"type": "tcp", "address": "127.0.0.1", "port": port}],
               "listenaddr and port from the file: %r" % st["listen"])
        h1.shutdown()
        hr.shutdown()
    finally:
        proc.terminate()
        expect(proc.wait(30) == 0, "exit status %s" % proc.returncode)
        logf.close()


def command_line_wins(tmp):
    img = os.path.join(tmp, "a.img")
    nbdtest.sparse_file(img, 4 * MIB)
    img3 = os.path.join(tmp, "long.img")
    nbdtest.sparse_file(img3, 2 * MIB)
    conf = os.path.join(tmp, "c.conf")
    with open(conf, "w") as f:
        f.write("[generic]\ncache-size = 64M\ncache-mode = writethrough\n"
                "dirty-high = 010\ndirty-low = 5\nmax-clients = 7\nmax-reply-memory = 100M\n"
                "\n[a]\nbackend = %s\n"
                "description = %s\n\n[%s]\nbackend = %s\n" % (img, LONG, LONG_NAME, img3))
    img2 = os.path.join(tmp, "b.img")
    nbdtest.sparse_file(img2, 4 * MIB)
    d = nbdtest.CheckedDaemon([("b", img2, "")], extra=["--config", conf, "--cache-size", "16M",
                                                         "--max-clients", "9"])
    try:
        st = nbdtest.control_request(d.control, {"command": "status"})
        expect(st["cache_bytes"] == 16 * MIB, "--cache-size 16M wins over the file's 64M")
        cl = nbdtest.control_request(d.control, {"command": "stats"})["clients"]
        expect(cl["max_clients"] == 9, "--max-clients 9 wins over the file's 7: %r" % cl)
        expect(cl["max_reply_bytes"] == 100 * MIB, "the file's max-reply-memory: %r" % cl)
        expect(cl["max_pinned_reply_bytes"] == 2 * MIB,
               "max-pinned-replies defaults to 1/8 of the cache size in force: %r" % cl)
        ex = nbdtest.control_request(d.control, {"command": "exports"})["exports"]
        names = [e["name"] for e in ex]
        expect(names == ["a", LONG_NAME, "b"],
               "the file's exports first, then the command line's: %r" % names)
        expect(ex[0]["dirty_high"] == 10, "dirty-high = 010 is ten: %r" % ex[0]["dirty_high"])
        hl = nbdtest.libnbd_handle(d.unix_uri(LONG_NAME))
        expect(hl.get_size() == 2 * MIB, "the export with a %d-byte name" % len(LONG_NAME))
        hl.shutdown()
        expect(ex[0]["description"] == LONG, "a %d-byte description survives" % len(LONG))
        modes = {e["name"]: e["cache_mode"] for e in ex}
        expect(modes == {"a": "writethrough", "b": "writethrough", LONG_NAME: "writethrough"},
               "the file's cache-mode applies to both: %r" % modes)
        h = nbdtest.libnbd_handle(d.unix_uri(""))  # "" is the first export: a
        expect(h.get_size() == 4 * MIB, "default export")
        h.shutdown()
    finally:
        d.stop()


def stalled_after(d):
    """Seconds from sending 100 x 1 MiB READs (more than the daemon buffers
    for one connection) until the daemon resets the client, which reads
    none of the replies; None if it is still connected after 20 s."""
    r = raw.RawClient(d.sock)
    try:
        r.open("s")
        wire = b"".join(r.encode_request(raw.CMD_READ, 0, MIB)[1] for _ in range(100))
        r.s.setblocking(False)
        sent = 0
        t0 = time.monotonic()
        while sent < len(wire) and time.monotonic() - t0 < 5:
            try:
                sent += r.s.send(wire[sent:])
            except BlockingIOError:
                time.sleep(0.01)
        p = select.poll()
        p.register(r.s, select.POLLHUP | select.POLLRDHUP | select.POLLERR)
        while time.monotonic() - t0 < 20:
            if p.poll(100):
                return time.monotonic() - t0
        return None
    finally:
        r.close()


def deadline_from_file(tmp, key, name, seed, measure, what, why):
    """KEY = 2 in the file's [generic] applies; --KEY 4 wins over it (one
    export, NAME).
    measure(d) gives the seconds until the daemon ended a client (what:
    "reset" or "dropped"), and the log (at debug) must name the deadline
    in force: why % seconds."""
    img = os.path.join(tmp, "%s.img" % key)
    nbdtest.random_file(img, MIB, seed=seed)
    conf = os.path.join(tmp, "%s.conf" % key)
    with open(conf, "w") as f:
        f.write("[generic]\ncache-size = 16M\n%s = 2\n\n[%s]\nbackend = %s\n" % (key, name, img))
    for extra, want in (([], 2), (["--" + key, "4"], 4)):
        d = nbdtest.CheckedDaemon([], extra=["--config", conf, "--log-level", "debug"] + extra)
        try:
            took = measure(d)
            log("  %s = 2 in the file%s: %s after %s"
                % (key, ", --%s 4" % key if extra else "", what,
                   "%.1f s" % took if took is not None else "never"))
            # Not before the deadline in force; which one it was, the log
            # line below says (a busy machine may take longer, not less).
            expect(took is not None and want - 0.5 <= took,
                   "%s: the client was %s after %s (want %d s)"
                   % (key, what, "%.1f s" % took if took is not None else "never", want))
            nbdtest.wait_until(lambda: why % want in d.log_text(), 2, step=0.1)
            expect(why % want in d.log_text(), "the log does not say '%s'" % (why % want))
        finally:
            d.stop()


def stall_timeout(tmp):
    """stall-timeout from the file applies; --stall-timeout wins over it: a
    client that reads no reply is reset, and the reason (logged at debug)
    names the deadline in force."""
    deadline_from_file(tmp, "stall-timeout", "s", 7, stalled_after, "reset",
                       "client has not read its replies for %d s")


def dropped_after(d):
    """Seconds from connecting until the daemon drops a client that reads
    the greeting and then sends nothing; None if still connected after 20 s."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(d.sock)
        t0 = time.monotonic()
        greeting = b""
        while len(greeting) < 18:
            c = s.recv(18 - len(greeting))
            if not c:
                return time.monotonic() - t0
            greeting += c
        p = select.poll()
        p.register(s, select.POLLIN | select.POLLHUP | select.POLLRDHUP | select.POLLERR)
        while time.monotonic() - t0 < 20:
            if p.poll(100):
                return time.monotonic() - t0
        return None
    finally:
        s.close()


def negotiation_timeout(tmp):
    """negotiation-timeout from the file applies; --negotiation-timeout wins."""
    deadline_from_file(tmp, "negotiation-timeout", "n", 8, dropped_after, "dropped",
                       "negotiation did not finish in %d s")


def drop_privileges(tmp):
    """user / group from the config: the daemon serves as that user."""
    import pwd
    import grp
    nobody = pwd.getpwnam("nobody")
    nogroup = grp.getgrnam("nogroup")
    os.chmod(tmp, 0o755)
    img = os.path.join(tmp, "u.img")
    nbdtest.random_file(img, MIB, seed=5)
    os.chmod(img, 0o666)
    conf = os.path.join(tmp, "u.conf")
    with open(conf, "w") as f:
        f.write("[generic]\ncache-size = 16M\nuser = nobody\ngroup = nogroup\n\n"
                "[u]\nbackend = %s\n" % img)
    d = nbdtest.CheckedDaemon([], extra=["--config", conf])
    try:
        status = open("/proc/%d/status" % d.pid).read()
        uid = [l.split()[1:] for l in status.splitlines() if l.startswith("Uid:")][0]
        gid = [l.split()[1:] for l in status.splitlines() if l.startswith("Gid:")][0]
        log("  Uid: %s Gid: %s" % (uid, gid))
        expect(set(map(int, uid)) == {nobody.pw_uid}, "uid after start-up: %r" % uid)
        expect(set(map(int, gid)) == {nogroup.gr_gid}, "gid after start-up: %r" % gid)
        h = nbdtest.libnbd_handle(d.unix_uri("u"))
        h.pwrite(b"\x11" * 4096, 0)
        h.flush()
        expect(nbdtest.read_at(img, 0, 4096) == b"\x11" * 4096, "served as nobody")
        h.shutdown()
    finally:
        d.stop()


def main():
    checks = CHECKS
    for name, fn in (("examples", examples), ("bad_input", bad_input),
                     ("nbd_server_style", nbd_server_style),
                     ("command_line_wins", command_line_wins),
                     ("stall_timeout", stall_timeout),
                     ("negotiation_timeout", negotiation_timeout),
                     ("drop_privileges", drop_privileges)):
        with nbdtest.tempdir() as tmp:
            checks.run(name, fn, tmp)
    checks.finish("config")


if __name__ == "__main__":
    main()
