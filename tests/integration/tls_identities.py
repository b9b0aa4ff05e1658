#!/usr/bin/python3
"""tls_identities: allow-identities, the TLS identities an export (or the
whole server) takes, and what "connections" shows of TLS.

Daemon A (tls = on, verify-peer, x509 and PSK credentials; config file):
  open      no rules
  dn        allow-identities = CN=client1,O=nbdcached tests (a DN: commas)
  psk       allow-identities = alice

  x509      a raw client with client1's certificate (Python ssl): LIST shows
            open and dn, not psk; INFO and GO psk get NBD_REP_ERR_UNKNOWN;
            GO dn works; one log line names the identity and the rule
  plain     no TLS: LIST shows only open; GO dn gets NBD_REP_ERR_UNKNOWN
            ("no TLS identity")
  psk       libnbd as alice: psk reads; dn is refused
  conns     "connections" while an x509 and a PSK client are open: tls true,
            tls_version, tls_cipher, tls_peer = the DN / alice; a plaintext
            one tls false and nulls; nbdcachectl connections' TLS column
Daemon B: allow-identities = alice globally (command line): the x509
client gets UNKNOWN for every export and an empty LIST; alice opens open.
check-config: the identities printed (one per key, " | " between); an
empty identity is refused with FILE:LINE.
"""

import os
import ssl
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402
import tlscerts  # noqa: E402

MIB = 1 << 20
SIZE = 4 * MIB


def ssl_client(certs):
    ctx = ssl.create_default_context(cafile=os.path.join(certs.client, "ca-cert.pem"))
    ctx.load_cert_chain(os.path.join(certs.client, "client-cert.pem"),
                        os.path.join(certs.client, "client-key.pem"))
    return ctx


def tls_raw(d, certs):
    """A RawClient that did STARTTLS with client1's certificate."""
    r = raw.RawClient(d.sock)
    r.greeting()
    r.send_opt(raw.OPT_STARTTLS)
    typ, items, _ = r.opt_replies(raw.OPT_STARTTLS)
    require(typ == raw.REP_ACK, "STARTTLS: %s" % raw.rep_name(typ))
    r.s = ssl_client(certs).wrap_socket(r.s, server_hostname="localhost")
    return r


def listed(r):
    return sorted(raw.parse_server_reply(p)[0] for _, p in r.option(raw.OPT_LIST))


def psk_handle(d, certs, export):
    import nbd
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_psk_file(certs.psk)
    h.set_tls_username("alice")
    h.set_export_name(export)
    h.connect_unix(d.sock)
    return h


def main():
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    with nbdtest.tempdir() as tmp:
        certs = tlscerts.Certs(os.path.join(tmp, "certs"))
        img = nbdtest.random_file(os.path.join(tmp, "d.img"), SIZE, seed=31)
        imgs = {n: nbdtest.random_file(os.path.join(tmp, n + ".img"), SIZE, seed=k)
                for k, n in enumerate(("dn", "psk"), 32)}
        conf = os.path.join(tmp, "a.conf")
        with open(conf, "w") as f:
            f.write("[generic]\ntls = on\ntls-certificates = %s\ntls-psk = %s\n"
                    "tls-verify-peer = true\n"
                    "[open]\nbackend = %s\n"
                    "[dn]\nbackend = %s\nallow-identities = %s\n"
                    "[psk]\nbackend = %s\nallow-identities = alice\n"
                    % (certs.server, certs.psk, img, imgs["dn"], tlscerts.CLIENT_DN,
                       imgs["psk"]))

        def check_config():
            p = nbdtest.run([nbdtest.NBDCACHED, "--check-config", "--config", conf,
                             "--allow-identities", "bob", "--allow-identities", "CN=x,O=y"])
            require("  access: allow-identities %s" % tlscerts.CLIENT_DN in p.stdout and
                    "global access: allow-identities bob | CN=x,O=y" in p.stdout,
                    "check-config: %s" % p.stdout)
            bad = os.path.join(tmp, "bad.conf")
            with open(bad, "w") as f:
                f.write("[x]\nbackend = %s\nallow-identities =   \n" % img)
            p = nbdtest.run([nbdtest.NBDCACHED, "--check-config", "--config", bad],
                            check_rc=False)
            require(p.returncode == 2 and "%s:3:" % bad in p.stderr and
                    "empty identity" in p.stderr, "an empty identity: %d %r"
                    % (p.returncode, p.stderr))
        checks.run("check-config", check_config)

        work = os.path.join(tmp, "a")
        os.mkdir(work)
        with nbdtest.running_daemon([], extra=["--config", conf, "--cache-size", "32M"],
                                    workdir=work) as d:
            def x509():
                r = tls_raw(d, certs)
                try:
                    got = listed(r)
                    require(got == ["dn", "open"], "LIST as client1: %s" % got)
                    for opt in (raw.OPT_INFO, raw.OPT_GO):
                        r.option(opt, raw.go_payload("psk"), want=raw.REP_ERR_UNKNOWN)
                    r.go("dn")
                    require(r.size == SIZE, "GO dn as client1: size %r" % r.size)
                finally:
                    r.close()
                lines = [ln for ln in d.log_text().splitlines() if "refused" in ln and
                         "identity 'CN=client1,O=nbdcached tests' not in allow-identities"
                         in ln]
                require(len(lines) == 1 and "export 'psk'" in lines[0],
                        "the refusal's log line: %s" % lines)

            def plain():
                r = raw.RawClient(d.sock)
                try:
                    r.greeting()
                    got = listed(r)
                    require(got == ["open"], "LIST without TLS: %s" % got)
                    r.option(raw.OPT_GO, raw.go_payload("dn"), want=raw.REP_ERR_UNKNOWN)
                    r.go("open")
                finally:
                    r.close()
                require("no TLS identity (allow-identities)" in d.log_text(),
                        "no log line for the plaintext refusal")

            def psk():
                import nbd
                h = psk_handle(d, certs, "psk")
                require(h.pread(4096, 0) == nbdtest.read_at(imgs["psk"], 0, 4096),
                        "alice read other bytes from psk")
                h.shutdown()
                try:
                    psk_handle(d, certs, "dn")
                except nbd.Error as e:
                    log("  alice on dn: %s" % e)
                    return
                raise nbdtest.Failed("alice opened dn")

            def conns():
                r = tls_raw(d, certs)
                r.go("dn")
                h = psk_handle(d, certs, "psk")
                p = nbdtest.libnbd_handle(d.unix_uri("open"))
                try:
                    rep = nbdtest.control_request(d.control, {"command": "connections"})
                    by_export = {c["export"]: c for c in rep["connections"]
                                 if c["phase"] == "transmitting"}
                    log("  %s" % {k: (v["tls"], v["tls_version"], v["tls_cipher"],
                                      v["tls_peer"]) for k, v in by_export.items()})
                    x, a, o = by_export["dn"], by_export["psk"], by_export["open"]
                    require(x["tls"] and x["tls_peer"] == tlscerts.CLIENT_DN and
                            x["tls_version"].startswith("TLS1.") and x["tls_cipher"],
                            "the x509 connection: %s" % x)
                    require(a["tls"] and a["tls_peer"] == "alice" and a["tls_cipher"],
                            "the PSK connection: %s" % a)
                    require(o["tls"] is False and o["tls_version"] is None and
                            o["tls_peer"] is None, "the plaintext connection: %s" % o)
                    out = nbdtest.run([nbdtest.NBDCACHECTL, "--control", d.control,
                                       "connections"]).stdout
                    require(out.splitlines()[0].split()[-1] == "TLS" and
                            " alice" in out and tlscerts.CLIENT_DN in out,
                            "nbdcachectl connections:\n%s" % out)
                finally:
                    r.close()
                    nbdtest.shutdown_all([h, p])

            for name, fn in (("x509", x509), ("plain", plain), ("psk", psk),
                             ("conns", conns)):
                checks.run(name, fn)
            checks.dump_log(d)

        work = os.path.join(tmp, "b")
        os.mkdir(work)
        with nbdtest.running_daemon(
                [("open", img, "")], workdir=work,
                extra=["--tls", "on", "--tls-certificates", certs.server, "--tls-psk",
                       certs.psk, "--tls-verify-peer", "--allow-identities", "alice"]) as b:
            def global_rule():
                r = tls_raw(b, certs)
                try:
                    require(listed(r) == [], "LIST as client1 under a global alice-only rule")
                    r.option(raw.OPT_GO, raw.go_payload("open"), want=raw.REP_ERR_UNKNOWN)
                finally:
                    r.close()
                h = psk_handle(b, certs, "open")
                require(h.pread(4096, 0) == nbdtest.read_at(img, 0, 4096), "alice on open")
                h.shutdown()
            checks.run("global", global_rule)
            checks.dump_log(b)
    checks.finish("TLS identity")


if __name__ == "__main__":
    main()
