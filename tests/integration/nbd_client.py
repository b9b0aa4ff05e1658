#!/usr/bin/python3
"""nbd_client: nbd-client(8)'s negotiation against the daemon, without nbd.ko.

No /dev/nbd* device is ever attached. The modes used:

  nbd-client -l HOST PORT          NBD_OPT_LIST: prints "name[: description]"
  nbd-client -u -l SOCKET          the same over the Unix socket
  nbd-client -L -N NAME HOST PORT FILE
                                   "nonetlink" mode with a *regular file* as the
                                   device: nbd-client negotiates (NBD_OPT_GO),
                                   prints "size = NMB", then fails at its first
                                   NBD ioctl on the file (ENOTTY). Safe on any
                                   machine, module or not.
  ... -g                           the same through NBD_OPT_EXPORT_NAME
  ... -N nope                      an unknown export: GO fails (ERR_UNKNOWN);
                                   with -g nbd-client fails (the daemon sends
                                   nothing and closes: checked on a raw socket)
  nbd-client -x -l HOST PORT       STARTTLS: the daemon has TLS off and answers
                                   ERR_POLICY; nbd-client gives up cleanly
  nbd-client -C 3 -N NAME HOST PORT (netlink mode, no device): negotiates three
                                   connections, then fails to find the nbd
                                   netlink family. Only run when the nbd module
                                   is absent, so that nothing can be attached.

After each, the daemon must still be alive and serving (libnbd reads a known
pattern), and each negotiation must appear in its log.
"""

import os
import re
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

MIB = 1 << 20
EXPORTS = [
    # name, size, options, description
    ("alpha", 5 * MIB, "description=first export", "first export"),
    ("beta", 7 * MIB + 123, "", ""),
    ("gamma", 3 * MIB, "readonly,description=read only third", "read only third"),
]
CHECKS = nbdtest.Checks()
expect = CHECKS.expect   # records the failure and carries on


def nbd_client(*args, timeout=60):
    return nbdtest.run(["nbd-client"] + list(args), timeout=timeout, check_rc=False,
                       stdin=subprocess.DEVNULL)


OPTS_MAGIC = 0x49484156454F5054     # "IHAVEOPT"
OPT_EXPORT_NAME = 1


def recv_exactly(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def listed(stdout):
    """The export lines nbd-client -l prints after "Negotiation: .."."""
    out = {}
    for line in stdout.splitlines():
        line = line.strip()
        if not line or line.startswith("Negotiation:"):
            continue
        name, _, desc = line.partition(": ")
        out[name] = desc
    return out


def nbd_module_present():
    return os.path.exists("/sys/module/nbd") or any(
        n.startswith("nbd") and n[3:].isdigit() for n in os.listdir("/dev"))


class World:
    def __init__(self, d, files):
        self.d = d
        self.files = files
        self.live = nbdtest.libnbd_handle(d.unix_uri("alpha"))
        with open(files["alpha"], "rb") as f:
            self.alpha = f.read()

    def still_serving(self, after):
        nbdtest.check(self.d.alive(), "daemon died after %s" % after)
        got = self.live.pread(len(self.alpha), 0)
        nbdtest.check(got == self.alpha, "live client read wrong data after %s" % after)

    def negotiated_count(self):
        return len(re.findall(r"negotiated structured=0 extended=0 meta=0", self.d.log_text()))

    def wait_negotiated(self, before, n, what):
        deadline = time.time() + 5
        while time.time() < deadline and self.negotiated_count() < before + n:
            time.sleep(0.05)
        expect(self.negotiated_count() >= before + n,
               "%s: the daemon did not log %d 'negotiated structured=0 extended=0 meta=0'"
               % (what, n))


def t_list(w):
    want = {name: desc for name, _, _, desc in EXPORTS}
    p = nbd_client("-l", "127.0.0.1", w.d.port)
    expect(p.returncode == 0, "nbd-client -l exited %d" % p.returncode)
    expect(p.stdout.startswith("Negotiation: .."), "nbd-client -l output %r" % p.stdout[:80])
    got = listed(p.stdout)
    expect(got == want, "nbd-client -l listed %r, expected %r" % (got, want))
    w.still_serving("nbd-client -l")
    p = nbd_client("-u", "-l", w.d.sock)
    expect(p.returncode == 0, "nbd-client -u -l exited %d" % p.returncode)
    got = listed(p.stdout)
    expect(got == want, "nbd-client -u -l listed %r, expected %r" % (got, want))
    w.still_serving("nbd-client -u -l")


def t_negotiate_to_fake_device(w, tmp):
    """-L (no netlink) with a regular file as the device: negotiation runs,
    the first NBD ioctl fails on the file, nothing is attached."""
    fake = os.path.join(tmp, "not-a-device")
    open(fake, "w").close()
    for name, size, _, _ in EXPORTS:
        for extra in ([], ["-g"]):
            before = w.negotiated_count()
            p = nbd_client("-L", *extra, "-N", name, "127.0.0.1", w.d.port, fake)
            what = "nbd-client -L %s-N %s" % (" ".join(extra) + " " if extra else "", name)
            expect(p.returncode != 0, "%s succeeded on a regular file?" % what)
            expect("size = %dMB" % (size >> 20) in p.stdout,
                   "%s: negotiation did not report size = %dMB: %r" % (what, size >> 20, p.stdout))
            expect("Ioctl" in p.stderr or "blocksize" in p.stderr,
                   "%s: did not get as far as the device ioctls: %r" % (what, p.stderr))
            if not extra:
                w.wait_negotiated(before, 1, what)
            w.still_serving(what)
    # The default export ("" -> the first one).
    p = nbd_client("-L", "-N", "", "127.0.0.1", w.d.port, fake)
    expect("size = %dMB" % (EXPORTS[0][1] >> 20) in p.stdout,
           "nbd-client -N \"\": %r" % p.stdout)
    # Over the Unix socket.
    p = nbd_client("-L", "-u", "-N", "beta", w.d.sock, fake)
    expect("size = %dMB" % (EXPORTS[1][1] >> 20) in p.stdout, "nbd-client -u -N beta: %r" % p.stdout)
    expect(os.path.getsize(fake) == 0, "the fake device file was written to")
    w.still_serving("nbd-client -L on a regular file")


def t_unknown_export(w, tmp):
    fake = os.path.join(tmp, "not-a-device")
    open(fake, "a").close()
    p = nbd_client("-L", "-N", "nope", "127.0.0.1", w.d.port, fake)
    expect(p.returncode != 0, "unknown export accepted")
    expect("size =" not in p.stdout, "unknown export got a size: %r" % p.stdout)
    expect("Unknown error returned by server" in p.stderr,
           "unknown export: nbd-client did not see an option error: %r" % p.stderr)
    w.still_serving("nbd-client on an unknown export")
    # Through NBD_OPT_EXPORT_NAME the daemon can only close the connection.
    # nbd-client -g (3.24) does not check that read: it prints whatever its
    # size variable held (0 on one machine, a pointer-like number on
    # another), so only its failure is asserted; that the daemon sends
    # nothing and closes is checked on a raw socket, and in its log.
    p = nbd_client("-L", "-g", "-N", "nope", "127.0.0.1", w.d.port, fake)
    expect(p.returncode != 0, "unknown export via -g accepted")
    s = socket.create_connection(("127.0.0.1", w.d.port), timeout=10)
    greeting = recv_exactly(s, 18)
    expect(greeting[:8] == b"NBDMAGIC", "greeting: %r" % greeting)
    s.sendall(struct.pack(">I", 1))     # fixed newstyle, NBD_FLAG_C_NO_ZEROES unset
    s.sendall(struct.pack(">QII", OPTS_MAGIC, OPT_EXPORT_NAME, 4) + b"nope")
    after = b""
    for _ in range(100):
        chunk = s.recv(4096)
        if not chunk:
            break
        after += chunk
    s.close()
    expect(after == b"", "after EXPORT_NAME of an unknown export the daemon sent %r" % after)
    expect(nbdtest.wait_until(lambda: "EXPORT_NAME of an unknown export" in w.d.log_text(), 5),
           "the daemon's log does not say why it closed the EXPORT_NAME connection")
    w.still_serving("nbd-client -g on an unknown export")


def t_starttls_unsupported(w):
    p = nbd_client("-x", "-l", "127.0.0.1", w.d.port)
    expect(p.returncode != 0, "nbd-client -x -l succeeded without TLS on the server")
    expect("NBD_REP_ACK" in p.stderr or "TLS" in p.stderr,
           "nbd-client -x: unexpected failure %r" % p.stderr)
    w.still_serving("nbd-client -x")


def t_netlink_multiconn(w):
    if nbd_module_present():
        log("  the nbd module is present: netlink mode could attach a device, not run")
        return
    before = w.negotiated_count()
    p = nbd_client("-C", "3", "-N", "alpha", "127.0.0.1", w.d.port)
    expect(p.returncode != 0, "netlink mode succeeded without the nbd module?")
    expect(p.stdout.count("size = 5MB") == 3,
           "-C 3: expected three negotiations, got %r" % p.stdout)
    expect("netlink" in p.stderr, "-C 3: unexpected failure %r" % p.stderr)
    w.wait_negotiated(before, 3, "nbd-client -C 3")
    w.still_serving("nbd-client -C 3")


def main():
    if subprocess.run(["which", "nbd-client"], capture_output=True).returncode != 0:
        nbdtest.fail("nbd-client is not installed (Debian package nbd-client)")
    with nbdtest.tempdir() as tmp:
        files = {}
        exports = []
        for i, (name, size, opts, _) in enumerate(EXPORTS):
            files[name] = nbdtest.random_file(os.path.join(tmp, name + ".img"), size, seed=i + 1)
            exports.append((name, files[name], opts))
        with nbdtest.Daemon(exports) as d:
            w = World(d, files)
            for name, fn, args in (("list", t_list, ()),
                                   ("negotiate to a regular file", t_negotiate_to_fake_device, (tmp,)),
                                   ("unknown export", t_unknown_export, (tmp,)),
                                   ("STARTTLS unsupported", t_starttls_unsupported, ()),
                                   ("netlink multi-connection", t_netlink_multiconn, ())):
                CHECKS.run(name, fn, w, *args)
            w.live.shutdown()
            CHECKS.dump_log(d)
    CHECKS.finish("nbd-client")


if __name__ == "__main__":
    main()
