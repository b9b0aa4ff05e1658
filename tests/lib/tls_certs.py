"""tls_certs: X.509 certificates and PSK files for TLS tests, made with
GnuTLS's certtool and psktool (Debian package gnutls-bin) in a directory of
the test's.

Directory layouts are the ones nbdkit, qemu and libnbd read:
  server dir: ca-cert.pem, server-cert.pem, server-key.pem [, ca-crl.pem]
  client dir: ca-cert.pem, client-cert.pem, client-key.pem

    ca = Authority(os.path.join(tmp, "ca"), "Test CA")
    ca.server_dir(os.path.join(tmp, "server"))
    ca.client_dir(os.path.join(tmp, "client"), "alice")
    psk_file(os.path.join(tmp, "keys.psk"), "alice")
"""

import os
import shutil
import subprocess

CERTTOOL = "certtool"
PSKTOOL = "psktool"


def _run(cmd, cwd):
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode,
                                                     (p.stderr or p.stdout)[-600:]))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _key(path):
    _run([CERTTOOL, "--generate-privkey", "--key-type=ecdsa", "--outfile", path],
         os.path.dirname(path))


class Authority:
    """A certificate authority: its key and self-signed certificate in dir."""

    def __init__(self, dir, cn):
        os.makedirs(dir, exist_ok=True)
        self.dir = dir
        self.key = os.path.join(dir, "ca-key.pem")
        self.cert = os.path.join(dir, "ca-cert.pem")
        _key(self.key)
        tpl = os.path.join(dir, "ca.info")
        _write(tpl, 'cn = "%s"\nca\ncert_signing_key\ncrl_signing_key\n'
               'expiration_days = 3650\n' % cn)
        _run([CERTTOOL, "--generate-self-signed", "--load-privkey", self.key,
              "--template", tpl, "--outfile", self.cert], dir)
        self.serial = 1

    def _sign(self, dir, stem, template):
        os.makedirs(dir, exist_ok=True)
        key = os.path.join(dir, stem + "-key.pem")
        cert = os.path.join(dir, stem + "-cert.pem")
        _key(key)
        self.serial += 1
        tpl = os.path.join(dir, stem + ".info")
        _write(tpl, template + "serial = %d\n" % self.serial)
        _run([CERTTOOL, "--generate-certificate", "--load-ca-certificate", self.cert,
              "--load-ca-privkey", self.key, "--load-privkey", key, "--template", tpl,
              "--outfile", cert], dir)
        os.unlink(tpl)
        shutil.copyfile(self.cert, os.path.join(dir, "ca-cert.pem"))
        return cert

    def server_dir(self, dir, cn="localhost"):
        """A server's directory: its certificate for localhost, 127.0.0.1
        and ::1, its key, and this CA's certificate."""
        self._sign(dir, "server",
                   'organization = "nbdcached tests"\ncn = "%s"\ndns_name = "localhost"\n'
                   'ip_address = "127.0.0.1"\nip_address = "::1"\ntls_www_server\n'
                   'encryption_key\nsigning_key\nexpiration_days = 3650\n' % cn)
        return dir

    def client_dir(self, dir, cn, expired=False):
        """A client's directory: a certificate for cn (expired in 2001 when
        expired), its key, and this CA's certificate. Returns the cert path."""
        dates = ('activation_date = "2000-01-01 00:00:00"\n'
                 'expiration_date = "2001-01-01 00:00:00"\n' if expired
                 else "expiration_days = 3650\n")
        return self._sign(dir, "client",
                          'organization = "nbdcached tests"\ncn = "%s"\ntls_www_client\n'
                          'encryption_key\nsigning_key\n%s' % (cn, dates))

    def crl(self, path, revoked_certs):
        """A CRL (PEM) signed by this CA revoking the given certificates."""
        tpl = os.path.join(self.dir, "crl.info")
        _write(tpl, "crl_next_update = 365\ncrl_number = %d\n" % self.serial)
        cmd = [CERTTOOL, "--generate-crl", "--load-ca-privkey", self.key,
               "--load-ca-certificate", self.cert, "--template", tpl, "--outfile", path]
        if revoked_certs:
            bundle = os.path.join(self.dir, "revoked.pem")
            with open(bundle, "w") as out:
                for c in revoked_certs:
                    with open(c) as f:
                        out.write(f.read())
            cmd += ["--load-certificate", bundle]
        _run(cmd, self.dir)
        return path


def psk_file(path, *users):
    """A psktool key file (username:hexkey lines) with a key per user."""
    for u in users:
        _run([PSKTOOL, "-u", u, "-p", path], os.path.dirname(path) or ".")
    return path


def available():
    """Are certtool and psktool installed?"""
    return shutil.which(CERTTOOL) is not None and shutil.which(PSKTOOL) is not None
