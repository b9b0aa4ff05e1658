"""tlscerts: certificates and PSK keys for the TLS tests, made with certtool
and psktool (Debian package gnutls-bin) into a temporary directory.

  CA            "Test CA", signs everything below unless said otherwise
  server        CN localhost, SAN localhost and 127.0.0.1
  client        CN client1 (DN "CN=client1,O=nbdcached tests")
  expired       a client certificate valid only in 2020
  revoked       a client certificate listed in the CA's CRL (ca-crl.pem)
  CA2           a second CA, and a client certificate signed by it
  keys.psk      alice's key; other.psk: mallory's (unknown to the server)

Directory layouts, as nbdkit, qemu and libnbd want them:

  server/       ca-cert.pem server-cert.pem server-key.pem ca-crl.pem
  client/       ca-cert.pem client-cert.pem client-key.pem   (the good one)
  expired/, revoked/, other-ca-client/   the same with that client cert
  wrong-ca/     CA2's ca-cert.pem with the good client cert (the client
                cannot verify the server)
  psk/keys.psk  for qemu's tls-creds-psk (dir= with keys.psk)

RSA keys: qemu refuses an ECDSA certificate whose usage lacks key
encipherment.
"""

import os
import subprocess

import nbdtest

CLIENT_DN = "CN=client1,O=nbdcached tests"


def certtool(*args):
    nbdtest.run(["certtool"] + [str(a) for a in args], timeout=120,
                stdin=subprocess.DEVNULL)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def key(path):
    certtool("--generate-privkey", "--key-type=rsa", "--bits=2048", "--outfile", path)


def signed(work, name, ca, template):
    """name-key.pem and name-cert.pem in work, signed by ca (cert, key)."""
    k = os.path.join(work, name + "-key.pem")
    c = os.path.join(work, name + "-cert.pem")
    t = os.path.join(work, name + ".info")
    key(k)
    write(t, template)
    certtool("--generate-certificate", "--load-ca-certificate", ca[0],
             "--load-ca-privkey", ca[1], "--load-privkey", k, "--template", t,
             "--outfile", c)
    return c, k


def make_ca(work, name, cn):
    k = os.path.join(work, name + "-key.pem")
    c = os.path.join(work, name + "-cert.pem")
    t = os.path.join(work, name + ".info")
    key(k)
    write(t, "cn = %s\nca\ncert_signing_key\ncrl_signing_key\nexpiration_days = 365\n" % cn)
    certtool("--generate-self-signed", "--load-privkey", k, "--template", t, "--outfile", c)
    return c, k


SERVER_TEMPLATE = ("organization = nbdcached tests\ncn = localhost\ndns_name = localhost\n"
                   "ip_address = 127.0.0.1\ntls_www_server\nencryption_key\nsigning_key\n"
                   "expiration_days = 365\n")
CLIENT_TEMPLATE = ("organization = nbdcached tests\ncn = %s\ntls_www_client\n"
                   "encryption_key\nsigning_key\n%s")


def server_cert(work, name, ca):
    """A new server certificate (and key) from ca: (cert, key)."""
    return signed(work, name, ca, SERVER_TEMPLATE)


def copy(src, dst):
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data)


def client_dir(path, ca_cert, cert, key_):
    os.makedirs(path, exist_ok=True)
    copy(ca_cert, os.path.join(path, "ca-cert.pem"))
    copy(cert, os.path.join(path, "client-cert.pem"))
    copy(key_, os.path.join(path, "client-key.pem"))
    return path


class Certs:
    def __init__(self, top):
        self.top = top
        work = os.path.join(top, "work")
        os.makedirs(work)
        self.ca = make_ca(work, "ca", "Test CA")
        self.ca2 = make_ca(work, "ca2", "Other CA")
        srv = server_cert(work, "server", self.ca)
        good = signed(work, "client", self.ca, CLIENT_TEMPLATE % ("client1", "expiration_days = 365\n"))
        expired = signed(work, "expired", self.ca, CLIENT_TEMPLATE % (
            "expired1", 'activation_date = "2020-01-01 00:00:00"\n'
            'expiration_date = "2020-06-01 00:00:00"\n'))
        revoked = signed(work, "revoked", self.ca, CLIENT_TEMPLATE % ("revoked1", "expiration_days = 365\n"))
        other = signed(work, "other", self.ca2, CLIENT_TEMPLATE % ("other1", "expiration_days = 365\n"))
        crl_t = os.path.join(work, "crl.info")
        write(crl_t, "crl_next_update = 365\ncrl_number = 1\n")
        self.server = os.path.join(top, "server")
        os.makedirs(self.server)
        copy(self.ca[0], os.path.join(self.server, "ca-cert.pem"))
        copy(srv[0], os.path.join(self.server, "server-cert.pem"))
        copy(srv[1], os.path.join(self.server, "server-key.pem"))
        certtool("--generate-crl", "--load-ca-privkey", self.ca[1], "--load-ca-certificate",
                 self.ca[0], "--load-certificate", revoked[0], "--template", crl_t,
                 "--outfile", os.path.join(self.server, "ca-crl.pem"))
        self.work = work
        self.client = client_dir(os.path.join(top, "client"), self.ca[0], *good)
        self.expired = client_dir(os.path.join(top, "expired"), self.ca[0], *expired)
        self.revoked = client_dir(os.path.join(top, "revoked"), self.ca[0], *revoked)
        self.other_ca_client = client_dir(os.path.join(top, "other-ca-client"), self.ca[0], *other)
        self.wrong_ca = client_dir(os.path.join(top, "wrong-ca"), self.ca2[0], *good)
        psk_dir = os.path.join(top, "psk")
        os.makedirs(psk_dir)
        self.psk = os.path.join(psk_dir, "keys.psk")
        nbdtest.run(["psktool", "-u", "alice", "-p", self.psk], timeout=60)
        self.other_psk = os.path.join(top, "other.psk")
        nbdtest.run(["psktool", "-u", "mallory", "-p", self.other_psk], timeout=60)
        self.psk_dir = psk_dir

    def ssl_context(self, client_dir_=None, ca=None):
        """A Python ssl client context trusting ca (default: the CA), with
        the client certificate of client_dir_ (default: the good one)."""
        import ssl
        d = client_dir_ or self.client
        ctx = ssl.create_default_context(cafile=ca or self.ca[0])
        ctx.load_cert_chain(os.path.join(d, "client-cert.pem"), os.path.join(d, "client-key.pem"))
        return ctx
