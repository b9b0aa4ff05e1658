#!/usr/bin/python3
"""child_fds: an nbdkit the daemon starts (an "nbdkit:" backend) inherits
none of the daemon's sockets.

The daemon starts nbdkit again whenever the backend reconnects (a lost
connection, a resize), while clients are connected. A client's socket
inherited by that nbdkit outlives the daemon's close of it: the client
waits forever for its disconnect to be answered, and the daemon's worker
spins on an epoll registration it cannot remove.

One daemon with an nbdkit:file export; a client over the Unix socket, one
over TCP, a control socket connection and a metrics (HTTP) connection with
half a request are open when the nbdkit child
is killed (by PID) and the backend starts another:
  the new nbdkit holds no socket, pipe or file the daemon has open (its
  /proc fds against the daemon's); a FLUSH goes through the new nbdkit; each client's
  disconnect completes within 10 s; afterwards the idle daemon uses less
  than 0.3 s of CPU in 2 s (no spinning loop)
"""

import os
import re
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
CHECKS = nbdtest.Checks(catch=(nbdtest.Failed, nbd.Error))
expect = CHECKS.expect


def children(pid):
    kids = set()
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                kids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return kids


def held(pid):
    """What pid holds open past stdin, stdout and stderr: sockets and pipes
    by inode, files by device and inode (anonymous inodes, one for every
    eventfd, left out)."""
    out = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        if int(fd) <= 2:
            continue
        path = "/proc/%d/fd/%s" % (pid, fd)
        try:
            link = os.readlink(path)
            if re.match(r"(socket|pipe):\[\d+\]$", link):
                out.add(link)
            elif link.startswith("/"):
                st = os.stat(path)
                out.add("%s (%d:%d)" % (link, st.st_dev, st.st_ino))
        except OSError:
            continue
    return out


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shutdown_within(h, what, seconds=10):
    t = threading.Thread(target=h.shutdown, daemon=True)
    t.start()
    t.join(seconds)
    expect(not t.is_alive(), "%s: the disconnect was not answered within %d s" % (what, seconds))


def inherited(d, img):
    unix = nbdtest.libnbd_handle(d.unix_uri("p"))
    tcp = nbdtest.libnbd_handle(d.tcp_uri("p"))
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.connect(d.control)
    web = socket.create_connection(("127.0.0.1", d.metrics_port))
    web.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request: the connection stays
    unix.pwrite(b"\1" * 4096, 0)
    unix.flush()
    before = children(d.pid)
    expect(len(before) == 1, "nbdkit children at start: %r" % before)
    old = before.pop()
    log("  SIGKILL nbdkit (pid %d), the daemon's child" % old)
    os.kill(old, signal.SIGKILL)
    fresh = set()
    deadline = time.time() + 20
    for _ in range(400):
        fresh = children(d.pid) - {old}
        if fresh or time.time() > deadline:
            break
        time.sleep(0.05)
    expect(len(fresh) == 1, "no new nbdkit child after the old one was killed: %r" % fresh)
    new = fresh.pop()
    # Until it has exec'd nbdkit, the child is the daemon's fork and holds
    # all it holds (close-on-exec has not acted yet): wait for the exec.
    mine = os.readlink("/proc/%d/exe" % d.pid)
    for _ in range(500):
        try:
            if os.readlink("/proc/%d/exe" % new) != mine:
                break
        except OSError:
            break
        time.sleep(0.01)
    shared = held(new) & held(d.pid)
    expect(not shared, "the new nbdkit (pid %d) holds what the daemon has open: %r"
           % (new, sorted(shared)))
    unix.pwrite(b"\2" * 4096, 4096)
    unix.flush()                    # through the new nbdkit
    with open(img, "rb") as f:
        expect(f.read(8192) == b"\1" * 4096 + b"\2" * 4096, "p.img after the FLUSH")
    shutdown_within(unix, "the Unix client")
    shutdown_within(tcp, "the TCP client")
    ctl.close()
    web.close()
    time.sleep(0.5)
    c0 = cpu_seconds(d.pid)
    time.sleep(2)
    used = cpu_seconds(d.pid) - c0
    log("  idle daemon: %.2f s of CPU in 2 s" % used)
    expect(used < 0.3, "the idle daemon used %.2f s of CPU in 2 s" % used)


def main():
    with nbdtest.tempdir() as tmp:
        img = os.path.join(tmp, "p.img")
        nbdtest.sparse_file(img, 16 * MIB)
        port = nbdtest.free_port()
        with nbdtest.running_daemon([("p", "nbdkit:file " + img, "")],
                                    extra=["--cache-size", "64M",
                                           "--metrics", "127.0.0.1:%d" % port]) as d:
            d.metrics_port = port
            CHECKS.run("inherited", inherited, d, img)
            CHECKS.dump_log(d)
    CHECKS.finish("child_fds")


if __name__ == "__main__":
    main()
