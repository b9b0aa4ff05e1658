#!/usr/bin/python3
"""tls_reload: TLS credentials are replaced by SIGHUP under load; existing
connections keep theirs; a broken file is refused and the old ones serve on.

One daemon (tls on, a certificate directory of its own, a PSK file) and a
client that reads and checks the export in a loop over TLS (libnbd, x509;
bounded: it stops when told, or after 60 s), from before the first reload
to after the last. Meanwhile:

  rotate    the directory's server certificate and key are replaced by a
            new pair (os.replace), then SIGHUP: the log says "reload: tls
            on: certificates ..."; a new connection is served the new
            certificate (its DER, seen by Python's ssl), a connection made
            before the reload (held open, idle) still reads
  psk       the PSK file is replaced by one with user bob only, then SIGHUP:
            bob connects, alice no longer can (a new connection), and an
            alice connection made before the reload still reads
  broken    server-key.pem is replaced by garbage, then SIGHUP: "reload:
            tls-certificates: .../server-key.pem: <GnuTLS's reason>; the
            running TLS credentials stay"; a new connection still gets the
            second certificate and reads
The looping client must have read before and after each step, never wrong
data and never an error.
"""

import os
import re
import signal
import ssl
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402
import tlscerts  # noqa: E402

MIB = 1 << 20
SIZE = 16 * MIB


def peer_cert(d, ca):
    """The DER certificate a new STARTTLS connection is served."""
    r = raw.RawClient(d.sock)
    try:
        r.greeting()
        r.send_opt(raw.OPT_STARTTLS)
        typ, _, _ = r.opt_replies(raw.OPT_STARTTLS)
        require(typ == raw.REP_ACK, "STARTTLS: %s" % raw.rep_name(typ))
        ctx = ssl.create_default_context(cafile=ca)
        r.s = ctx.wrap_socket(r.s, server_hostname="localhost")
        return r.s.getpeercert(binary_form=True)
    finally:
        r.close()


def der(pem_path):
    with open(pem_path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


class Loop:
    """Reads the export in a loop on its own thread (bounded in time)."""

    def __init__(self, h, data):
        self.h = h
        self.data = data
        self.reads = 0
        self.errors = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        deadline = time.time() + 60
        off = 0
        while not self.stop.is_set() and time.time() < deadline:
            try:
                got = self.h.pread(256 * 1024, off)
            except Exception as e:  # noqa: BLE001 (reported by the test)
                self.errors.append(str(e))
                return
            if got != self.data[off:off + len(got)]:
                self.errors.append("other bytes at %d" % off)
                return
            self.reads += 1
            off = (off + 256 * 1024) % SIZE

    def finish(self):
        self.stop.set()
        self.t.join(30)


def handle(d, certs=None, psk=None, user=None):
    import nbd
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    if certs:
        h.set_tls_certificates(certs)
    else:
        h.set_tls_psk_file(psk)
        h.set_tls_username(user)
    h.set_export_name("disk")
    h.connect_unix(d.sock)
    return h


def reloads(d):
    return len(re.findall(r"reload: tls on: ", d.log_text()))


def refusals(d):
    return len(re.findall(r"reload: tls-\S+: .*; the running TLS credentials stay",
                          d.log_text()))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        c = tlscerts.Certs(os.path.join(tmp, "certs"))
        live = os.path.join(tmp, "live")
        os.makedirs(live)
        for f in ("ca-cert.pem", "server-cert.pem", "server-key.pem", "ca-crl.pem"):
            tlscerts.copy(os.path.join(c.server, f), os.path.join(live, f))
        psk = os.path.join(tmp, "live.psk")
        tlscerts.copy(c.psk, psk)
        bob = os.path.join(tmp, "bob.psk")
        nbdtest.run(["psktool", "-u", "bob", "-p", bob], timeout=60)
        img = nbdtest.random_file(os.path.join(tmp, "disk.img"), SIZE, seed=5)
        with open(img, "rb") as f:
            data = f.read()
        workdir = os.path.join(tmp, "d")
        os.makedirs(workdir)
        with nbdtest.running_daemon([("disk", img, "")], workdir=workdir,
                                    extra=["--tls", "on", "--tls-certificates", live,
                                           "--tls-psk", psk, "--cache-size", "64M"]) as d:
            loop = Loop(handle(d, certs=c.client), data)
            cert1 = der(os.path.join(live, "server-cert.pem"))
            old_x509 = handle(d, certs=c.client)
            old_alice = handle(d, psk=c.psk, user="alice")

            def progressed(what):
                n = loop.reads
                ok = nbdtest.wait_until(lambda: loop.reads > n + 2 or loop.errors, 10)
                require(not loop.errors, "the looping client failed %s: %s"
                        % (what, loop.errors))
                require(ok, "the looping client made no progress %s" % what)

            def rotate():
                require(peer_cert(d, c.ca[0]) == cert1, "the first certificate is not served")
                progressed("before the rotation")
                new = tlscerts.server_cert(c.work, "server2", c.ca)
                tmpc, tmpk = os.path.join(live, ".cert.new"), os.path.join(live, ".key.new")
                tlscerts.copy(new[0], tmpc)
                tlscerts.copy(new[1], tmpk)
                os.replace(tmpk, os.path.join(live, "server-key.pem"))
                os.replace(tmpc, os.path.join(live, "server-cert.pem"))
                before = reloads(d)
                os.kill(d.pid, signal.SIGHUP)
                require(nbdtest.wait_until(lambda: reloads(d) > before, 10),
                        "no \"reload: tls on\" line after SIGHUP")
                got = peer_cert(d, c.ca[0])
                require(got == der(new[0]) and got != cert1,
                        "a new connection is not served the new certificate")
                h = handle(d, certs=c.client)
                require(h.pread(65536, 0) == data[:65536], "a new connection read other bytes")
                h.shutdown()
                require(old_x509.pread(65536, MIB) == data[MIB:MIB + 65536],
                        "a connection from before the reload read other bytes")
                progressed("after the rotation")

            def psk_rotate():
                import nbd
                tmpp = psk + ".new"
                tlscerts.copy(bob, tmpp)
                os.replace(tmpp, psk)
                before = reloads(d)
                os.kill(d.pid, signal.SIGHUP)
                require(nbdtest.wait_until(lambda: reloads(d) > before, 10),
                        "no \"reload: tls on\" line after SIGHUP")
                h = handle(d, psk=bob, user="bob")
                require(h.pread(4096, 0) == data[:4096], "bob read other bytes")
                h.shutdown()
                try:
                    handle(d, psk=c.psk, user="alice")
                    raise nbdtest.Failed("alice connected after her key was removed")
                except nbd.Error as e:
                    log("  alice refused: %s" % e)
                require(old_alice.pread(4096, 2 * MIB) == data[2 * MIB:2 * MIB + 4096],
                        "alice's connection from before the reload read other bytes")
                progressed("after the PSK rotation")

            def broken():
                cert2 = peer_cert(d, c.ca[0])
                before = refusals(d)
                tlscerts.write(os.path.join(live, "server-key.pem"), "garbage, not a key\n")
                os.kill(d.pid, signal.SIGHUP)
                require(nbdtest.wait_until(lambda: refusals(d) > before, 10),
                        "a broken server-key.pem was not refused at reload")
                line = re.findall(r"reload: (tls-certificates: .*)", d.log_text())[-1]
                log("  %s" % line)
                require(re.search(r"server-key\.pem: \S.*; the running TLS credentials stay",
                                  line), "the refusal does not name the file and a reason")
                require(peer_cert(d, c.ca[0]) == cert2,
                        "after a refused reload the certificate changed")
                h = handle(d, certs=c.client)
                require(h.pread(65536, 4 * MIB) == data[4 * MIB:4 * MIB + 65536],
                        "a connection after the refused reload read other bytes")
                h.shutdown()
                progressed("after the refused reload")

            checks.run("rotate", rotate)
            checks.run("psk", psk_rotate)
            checks.run("broken", broken)
            loop.finish()
            checks.expect(not loop.errors, "the looping client: %s" % loop.errors)
            log("  the looping client read %d times" % loop.reads)
            for h in (loop.h, old_x509, old_alice):
                h.shutdown()
            checks.dump_log(d)
    checks.finish("TLS reload")


if __name__ == "__main__":
    main()
