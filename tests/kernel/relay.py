#!/usr/bin/env python3
"""relay.py SOCKET LOG: one guest connection joined to the daemon's Unix
socket. qemu's guestfwd runs it once per connection the guest opens, with
that connection as stdin, stdout and stderr; so nothing is ever printed
(messages go to LOG). When the daemon is not listening it exits at once and
the guest's connection is closed, as a refused connection would be."""

import os
import select
import socket
import sys
import time


def main():
    path, logpath = sys.argv[1], sys.argv[2]
    logf = open(logpath, "a")
    os.dup2(logf.fileno(), 2)
    t0 = time.time()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as e:
        print("%.3f relay %d: connect %s: %s" % (t0, os.getpid(), path, e), file=logf, flush=True)
        return 1
    print("%.3f relay %d: connected" % (t0, os.getpid()), file=logf, flush=True)
    guest_open = True
    why = "?"
    while True:
        fds = [s] + ([0] if guest_open else [])
        r, _, _ = select.select(fds, [], [], None if guest_open else 30)
        if not r:
            why = "guest closed, daemon silent for 30 s"
            break
        if 0 in r:
            b = os.read(0, 1 << 20)
            if not b:
                guest_open = False
                s.shutdown(socket.SHUT_WR)
                why = "guest closed"
            else:
                s.sendall(b)
        if s in r:
            try:
                b = s.recv(1 << 20)
            except OSError as e:
                b = b""
                why = "daemon side: %s" % e
            if not b:
                if why == "?":
                    why = "daemon closed"
                break
            view = memoryview(b)
            while view:
                n = os.write(1, view)
                view = view[n:]
    print("%.3f relay %d: done after %.1fs (%s)" % (time.time(), os.getpid(), time.time() - t0, why),
          file=logf, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
