#!/usr/bin/python3
"""nbd_backend_tls: nbds:// backends, x509 and PSK, through libnbd.

The backend is nbdkit's file plugin with --tls=require (certificates and
keys made here with certtool and psktool); nbdcached reaches it with the
credentials in the backend URI (tls-certificates=DIR; tls-psk-file=FILE with
the PSK username as the URI's user, nbds+unix://alice@/?socket=...), as
libnbd reads them.

  x509        nbdkit --tls-verify-peer over a Unix socket: 4 MiB of random
              writes through nbdcached, FLUSH, the file holds them; the
              clean cache dropped, reads through the daemon (from the backend
              over TLS) give them back
  x509-tcp    the same over nbds://127.0.0.1:PORT (the server certificate
              names 127.0.0.1)
  psk         nbdkit --tls-psk: the same with tls-psk-file= and the user
              alice
  refused     the daemon does not start, and says which backend and why:
              a client certificate from another CA (the server verifies
              its peers); a PSK user the server does not know; a plaintext
              nbd+unix:// URI to a --tls=require server

Certificates and keys: tests/lib/tlscerts.py.
"""

import os
import random
import socket
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import tlscerts  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZE = 16 * MIB


class TcpNbdkit(nbdtest.NbdServer):
    """nbdkit -f -i 127.0.0.1 -p PORT ARGS..., started and stopped by PID."""

    def __init__(self, tmp, port, args, peers):
        self.label = "nbdkit on 127.0.0.1:%d" % port
        self.sock = None
        self.logpath = os.path.join(tmp, "tcp-nbdkit.log")
        peers.append(self)

        def listening():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        self.spawn(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port)] + list(args),
                   listening, "listen")


def roundtrip(tmp, backend_uri, img, seed):
    """Writes through nbdcached to an nbds:// backend reach the file, and
    come back from it once the cache is dropped."""
    rnd = random.Random(seed)
    model = bytearray(nbdtest.read_at(img, 0, SIZE))
    work = os.path.join(tmp, "daemon-%d" % seed)  # removed when the daemon stops
    os.mkdir(work)
    with nbdtest.running_daemon([("t", backend_uri, "")], workdir=work,
                                extra=["--cache-size", "8M"]) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("t"))
        for _ in range(64):
            off = rnd.randrange(0, SIZE - 64 * KIB) & ~511
            data = rnd.randbytes(64 * KIB)
            h.pwrite(data, off)
            model[off:off + len(data)] = data
        h.flush()
        require(nbdtest.read_at(img, 0, SIZE) == model,
                "after FLUSH the backend file does not hold the writes")
        rep = nbdtest.control_request(d.control, {"command": "drop-clean", "export": "t"})
        require(rep.get("ok"), "drop-clean: %s" % rep)
        got = bytearray()
        for off in range(0, SIZE, MIB):
            got += h.pread(MIB, off)
        require(got == model, "reads through the daemon after drop-clean differ at %s"
                % nbdtest.first_diff(got, model))
        s = nbdtest.control_request(d.control, {"command": "stats", "export": "t"})
        misses = s["exports"][0]["misses"]
        require(misses > 0, "no read reached the backend after drop-clean: %s"
                % s["exports"][0])
        h.shutdown()


def refused(tmp, backend_uri, words):
    """nbdcached with this backend exits non-zero, naming the backend, with
    every one of words in its output."""
    try:
        p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--control", "none",
                            "--unix", os.path.join(tmp, "refused.sock"), "--cache-size", "8M",
                            "--export", "t=" + backend_uri],
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # it started: killed by the timeout
        raise nbdtest.Failed("backend %s: the daemon started and served" % backend_uri)
    out = p.stdout + p.stderr
    log("  exit %d: %s" % (p.returncode, out.strip().splitlines()[-1:] if out else ""))
    require(p.returncode != 0 and "cannot open " + backend_uri in out and
            all(w in out for w in words),
            "backend %s: exit %d, want an error with %s: %r"
            % (backend_uri, p.returncode, words, out[-600:]))


def main():
    for tool in ("certtool", "psktool"):
        if nbdtest.run(["which", tool], check_rc=False).returncode != 0:
            nbdtest.fail("%s is not installed (gnutls-bin: scripts/deps)" % tool)
    checks = nbdtest.Checks()
    with nbdtest.tempdir() as tmp:
        certs = tlscerts.Certs(os.path.join(tmp, "certs"))
        server, client, stranger = certs.server, certs.client, certs.other_ca_client
        psk, unknown = certs.psk, certs.other_psk
        img = nbdtest.random_file(os.path.join(tmp, "backend.img"), SIZE, seed=21)
        peers = []
        try:
            x509 = nbdtest.Nbdkit(tmp, "x509", ["--tls=require", "--tls-certificates=" + server,
                                                "--tls-verify-peer", "file", img], peers=peers)
            port = nbdtest.free_port()
            TcpNbdkit(tmp, port, ["--tls=require", "--tls-certificates=" + server,
                                  "file", img], peers)
            pskd = nbdtest.Nbdkit(tmp, "psk", ["--tls=require", "--tls-psk=" + psk,
                                               "file", img], peers=peers)
            x509_uri = "nbds+unix:///?socket=%s&tls-certificates=%s" % (x509.sock, client)
            tcp_uri = "nbds://127.0.0.1:%d/?tls-certificates=%s" % (port, client)
            psk_uri = "nbds+unix://alice@/?socket=%s&tls-psk-file=%s" % (
                pskd.sock, psk)
            checks.run("x509", roundtrip, tmp, x509_uri, img, 1)
            checks.run("x509-tcp", roundtrip, tmp, tcp_uri, img, 2)
            checks.run("psk", roundtrip, tmp, psk_uri, img, 3)

            def refusals():
                refused(tmp, "nbds+unix:///?socket=%s&tls-certificates=%s"
                        % (x509.sock, stranger), ["gnutls"])
                refused(tmp, "nbds+unix://mallory@/?socket=%s&tls-psk-file=%s"
                        % (pskd.sock, unknown), ["gnutls"])
                refused(tmp, "nbd+unix:///?socket=%s" % x509.sock, [])
            checks.run("refused", refusals)
        finally:
            for p in peers:
                p.stop()
    checks.finish("nbds backend")


if __name__ == "__main__":
    main()
