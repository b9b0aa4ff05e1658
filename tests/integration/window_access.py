#!/usr/bin/python3
"""window_access: every access rule holds alike for a whole export, a
window made by hand (offset=, size=) and a split window (split=), for LIST,
INFO, GO and EXPORT_NAME; and a refused export is answered as a missing
one is (nbdcached(8), ACCESS CONTROL).

One daemon (tls = on, x509 and PSK credentials, a config file) with, for
each rule R below, a 4 MiB file and three exports over it: "w-R" (whole),
"h-R" (offset = 1M, size = 1M: a window of its own) and "s-R" (split = 1M:
windows s-R/0 .. s-R/3); R's rule is on w-R, h-R and s-R (never on the
windows: theirs are s-R's). The targets are w-R, h-R and s-R/1.

  rule        refused client                     allowed client
  allow       127.0.0.1 (allow = 127.0.0.5)      127.0.0.5
  deny        127.0.0.3 (deny = 127.0.0.3)       127.0.0.1
  users       a test user on the Unix socket     root on the Unix socket
              (allow-users = root)
  groups      the test user (allow-groups =      the test user with that
              a group made for the test)         group as a supplementary one
  identities  plaintext, and libnbd as PSK user  client1's certificate
              bob (allow-identities = alice,     (Python ssl); libnbd as alice
              and client1's DN)
  tls         plaintext (tls = require)          client1's certificate

A refused client: LIST shows none of the export's names (s-R and its
windows alike), INFO and GO get NBD_REP_ERR_UNKNOWN, as a name that does
not exist does ("nosuch" is asked too, and must answer the same), and
EXPORT_NAME is closed without a reply. For tls = require the answer is
NBD_REP_ERR_TLS_REQD (the export is not secret, its TLS is). An allowed
client sees the names in LIST, INFO and GO succeed, READ returns the
target's bytes, and EXPORT_NAME opens it.

  maxconn     max-connections = 1 on w-R, h-R and s-R: one client holds the
              target, a second one still sees it in LIST and gets INFO,
              its GO gets NBD_REP_ERR_POLICY and its EXPORT_NAME is closed; for the split export one connection
              to s-R/1 keeps out s-R, s-R/0 and s-R/3 (one limit for the
              export and its windows), and the same held on s-R keeps out
              s-R/2; once it closes, s-R/2 is served.
"""
import grp
import os
import pwd
import socket
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402
import tlscerts  # noqa: E402

MIB = 1 << 20
SIZE = 4 * MIB
TEST_USER = "nbdcached-wa-test"
TEST_GROUP = "nbdcached-wa-grp"
KINDS = (("whole", "w-%s", 0), ("hand", "h-%s", MIB), ("split", "s-%s/1", MIB))


def raw_client(sock):
    return raw.RawClient(sock=sock)


def tcp_from(port, source):
    def connect():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        r = raw_client(s)
        r.greeting()
        return r
    return connect


def unix_at(path):
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        r = raw_client(s)
        r.greeting()
        return r
    return connect


def x509_at(path, certs):
    def connect():
        r = unix_at(path)()
        r.send_opt(raw.OPT_STARTTLS)
        typ, _, _ = r.opt_replies(raw.OPT_STARTTLS)
        require(typ == raw.REP_ACK, "STARTTLS: %s" % raw.rep_name(typ))
        r.s = certs.ssl_context(certs.client).wrap_socket(r.s, server_hostname="localhost")
        return r
    return connect


def reply(r, opt, name):
    r.send_opt(opt, raw.go_payload(name))
    typ, _, _ = r.opt_replies(opt)
    return raw.rep_name(typ)


def outcome(connect, target, names):
    """What a client gets for target: LIST (which of names it shows), INFO
    and GO of target and of "nosuch", READ after GO, EXPORT_NAME."""
    out = {}
    r = connect()
    try:
        listed = [raw.parse_server_reply(p)[0] for _, p in r.option(raw.OPT_LIST)]
        out["list"] = sorted(n for n in listed if n in names)
        out["info"] = reply(r, raw.OPT_INFO, target)
        out["info nosuch"] = reply(r, raw.OPT_INFO, "nosuch")
        out["go nosuch"] = reply(r, raw.OPT_GO, "nosuch")
        out["go"] = reply(r, raw.OPT_GO, target)
        if out["go"] == "ACK":
            rep = r.command(raw.CMD_READ, 0, 4096)
            out["read"] = rep.data.hex() if rep.error == 0 else "error %d" % rep.error
    finally:
        r.close()
    r = connect()
    try:
        r.send_opt(raw.OPT_EXPORT_NAME, target.encode())
        try:
            r.recv_exact(10)  # size and flags (no zeroes): it is open
            out["export_name"] = "open"
        except raw.Closed as e:
            out["export_name"] = "closed (%s)" % e
    finally:
        r.close()
    return out


def as_user(uid, gid, groups, fn):
    """fn() in a child running as uid:gid with these supplementary groups:
    its result (JSON)."""
    answer = nbdtest.in_child_as(uid, gid, groups, fn)
    require("error" not in answer, "child as uid %d: %s" % (uid, answer.get("error")))
    return answer["result"]


def psk_outcome(d, certs, user, target, names):
    """LIST, INFO and GO through libnbd as a PSK user (opt mode)."""
    import nbd
    out = {}
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_psk_file(certs.psk)
    h.set_tls_username(user)
    h.set_opt_mode(True)
    h.connect_unix(d.sock)
    try:
        got = []
        h.opt_list(lambda name, desc: got.append(name) or 0)
        out["list"] = sorted(n for n in got if n in names)
        for what, name in (("info", target), ("info nosuch", "nosuch")):
            h.set_export_name(name)
            try:
                h.opt_info()
                out[what] = "ACK"
            except nbd.Error as e:
                out[what] = "errno %s" % e.errno
        h.set_export_name(target)
        try:
            h.opt_go()
            out["go"] = "ACK"
            out["read"] = h.pread(4096, 0).hex()
        except nbd.Error as e:
            out["go"] = "errno %s" % e.errno
    finally:
        try:
            if h.aio_is_negotiating():
                h.opt_abort()
            else:
                h.shutdown()
        except nbd.Error:
            pass
        del h
    return out


def main():
    if os.geteuid() != 0:
        nbdtest.skip("needs root (useradd, setuid)")
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    for cmd in (["userdel", TEST_USER], ["groupdel", TEST_USER], ["groupdel", TEST_GROUP]):
        subprocess.run(cmd, stderr=subprocess.DEVNULL)
    nbdtest.run(["useradd", "--system", "--user-group", "--no-create-home",
                 "--shell", "/usr/sbin/nologin", TEST_USER])
    nbdtest.run(["groupadd", "--system", TEST_GROUP])
    try:
        pw = pwd.getpwnam(TEST_USER)
        extra_gid = grp.getgrnam(TEST_GROUP).gr_gid
        with nbdtest.tempdir() as tmp:
            os.chmod(tmp, 0o755)  # the test user reaches the socket
            certs = tlscerts.Certs(os.path.join(tmp, "certs"))
            nbdtest.run(["psktool", "-u", "bob", "-p", certs.psk], timeout=60)
            rules = {
                "allow": "allow = 127.0.0.5",
                "deny": "deny = 127.0.0.3",
                "users": "allow-users = root",
                "groups": "allow-groups = %s" % TEST_GROUP,
                "identities": "allow-identities = alice\nallow-identities = %s"
                              % tlscerts.CLIENT_DN,
                "tls": "tls = require",
                "maxconn": "max-connections = 1",
            }
            files = {}
            conf = ["[generic]\ntls = on\ntls-certificates = %s\ntls-psk = %s\n"
                    "tls-verify-peer = true\n" % (certs.server, certs.psk)]
            for k, (rule, text) in enumerate(sorted(rules.items())):
                files[rule] = nbdtest.random_file(os.path.join(tmp, rule + ".img"), SIZE,
                                                  seed=40 + k)
                for name, place in (("w-" + rule, ""), ("h-" + rule, "offset = 1M\nsize = 1M\n"),
                                    ("s-" + rule, "split = 1M\n")):
                    conf.append("[%s]\nbackend = %s\n%s%s\n" % (name, files[rule], place, text))
            conf_path = os.path.join(tmp, "nbdcached.conf")
            with open(conf_path, "w") as f:
                f.write("\n".join(conf))
            work = os.path.join(tmp, "d")
            os.mkdir(work)
            os.chmod(work, 0o755)
            d = nbdtest.CheckedDaemon([], workdir=work,
                                      extra=["--config", conf_path, "--cache-size", "64M"])
            try:
                os.chmod(d.sock, 0o777)

                def names_of(rule, kind):
                    if kind == "split":
                        return ["s-%s" % rule] + ["s-%s/%d" % (rule, k) for k in range(4)]
                    return [("w-%s" if kind == "whole" else "h-%s") % rule]

                def data_at(rule, offset):
                    return nbdtest.read_at(files[rule], offset, 4096).hex()

                def refused(got, names, what, tls=False):
                    want_err = "ERR_TLS_REQD" if tls else "ERR_UNKNOWN"
                    log("  %s: %s" % (what, {k: v for k, v in got.items() if k != "read"}))
                    require(got["list"] == [], "%s: LIST shows %s" % (what, got["list"]))
                    require(got["info"] == want_err and got["go"] == want_err,
                            "%s: INFO %s, GO %s (want %s)" % (what, got["info"], got["go"],
                                                              want_err))
                    require(got["info nosuch"] == "ERR_UNKNOWN" and
                            got["go nosuch"] == "ERR_UNKNOWN",
                            "%s: a missing export: %s" % (what, got))
                    require(got["export_name"].startswith("closed") and
                            "after 0 of 10 bytes" in got["export_name"],
                            "%s: EXPORT_NAME %s" % (what, got["export_name"]))

                def allowed(got, names, want, what):
                    log("  %s: %s" % (what, {k: v for k, v in got.items() if k != "read"}))
                    require(got["list"] == sorted(names), "%s: LIST shows %s of %s"
                            % (what, got["list"], names))
                    require(got["info"] == "ACK" and got["go"] == "ACK",
                            "%s: INFO %s, GO %s" % (what, got["info"], got["go"]))
                    require(got.get("read") == want, "%s: READ returned other bytes" % what)
                    if "export_name" in got:
                        require(got["export_name"] == "open",
                                "%s: EXPORT_NAME %s" % (what, got["export_name"]))

                def rule_check(rule, deny_connect, allow_connect, tls=False, extra=None):
                    """One check per kind of export: (name, fn) pairs."""
                    def one(kind, pattern, offset):
                        target = pattern % rule
                        names = names_of(rule, kind)
                        refused(deny_connect(target, names), names,
                                "%s %s refused" % (rule, kind), tls=tls)
                        allowed(allow_connect(target, names), names,
                                data_at(rule, offset), "%s %s allowed" % (rule, kind))
                        if extra:
                            extra(rule, kind, target, names, offset)
                    return [("%s %s" % (rule, k), lambda k=k, p=p, o=o: one(k, p, o))
                            for k, p, o in KINDS]

                def via(connect):
                    return lambda target, names: outcome(connect, target, names)

                def as_test_user(groups):
                    return lambda target, names: as_user(
                        pw.pw_uid, pw.pw_gid, groups,
                        lambda: outcome(unix_at(d.sock), target, names))

                def identities_extra(rule, kind, target, names, offset):
                    bob = psk_outcome(d, certs, "bob", target, names)
                    log("  identities %s bob: %s" % (kind, bob))
                    require(bob["list"] == [] and bob["info"] == bob["info nosuch"] and
                            bob["go"] == bob["info nosuch"] and bob["go"] != "ACK",
                            "identities %s: PSK user bob: %s" % (kind, bob))
                    alice = psk_outcome(d, certs, "alice", target, names)
                    require(alice["list"] == sorted(names) and alice["go"] == "ACK" and
                            alice["read"] == data_at(rule, offset),
                            "identities %s: alice: %s" % (kind, alice))

                cases = (
                    rule_check("allow", via(tcp_from(d.port, "127.0.0.1")),
                               via(tcp_from(d.port, "127.0.0.5"))) +
                    rule_check("deny", via(tcp_from(d.port, "127.0.0.3")),
                               via(tcp_from(d.port, "127.0.0.1"))) +
                    rule_check("users", as_test_user([]), via(unix_at(d.sock))) +
                    rule_check("groups", as_test_user([]), as_test_user([extra_gid])) +
                    rule_check("identities", via(unix_at(d.sock)), via(x509_at(d.sock, certs)),
                               extra=identities_extra) +
                    rule_check("tls", via(tcp_from(d.port, "127.0.0.1")),
                               via(x509_at(d.sock, certs)), tls=True))

                connect = tcp_from(d.port, "127.0.0.1")

                def maxconn(kind, pattern):
                    target = pattern % "maxconn"
                    held = connect()
                    held.go(target)
                    try:
                        second = connect()
                        try:
                            listed = [raw.parse_server_reply(p)[0]
                                      for _, p in second.option(raw.OPT_LIST)]
                            require(target in listed, "maxconn %s: LIST %s" % (kind, listed))
                            got = reply(second, raw.OPT_INFO, target)
                            require(got == "ACK", "maxconn %s: INFO: %s" % (kind, got))
                            got = reply(second, raw.OPT_GO, target)
                            require(got == "ERR_POLICY",
                                    "maxconn %s: a second GO: %s" % (kind, got))
                            if kind == "split":
                                for other in ("s-maxconn", "s-maxconn/0", "s-maxconn/3"):
                                    got = reply(second, raw.OPT_GO, other)
                                    log("  GO %s while s-maxconn/1 is held: %s" % (other, got))
                                    require(got == "ERR_POLICY",
                                            "maxconn: GO %s while s-maxconn/1 is held: %s"
                                            % (other, got))
                        finally:
                            second.close()
                        third = connect()
                        third.send_opt(raw.OPT_EXPORT_NAME, target.encode())
                        got = third.wait_closed(timeout=5)
                        third.close()
                        require(got == b"", "maxconn %s: EXPORT_NAME got %r" % (kind, got))
                    finally:
                        held.close()
                    if kind != "split":
                        return
                    # The daemon counts s-maxconn/1's connection until it has
                    # seen it close: GO s-maxconn until that has happened.
                    taken = []

                    def take():
                        c = connect()
                        if reply(c, raw.OPT_GO, "s-maxconn") == "ACK":
                            taken.append(c)
                            return True
                        c.close()
                        return False
                    require(nbdtest.wait_until(take, 5, step=0.1),
                            "s-maxconn not served once s-maxconn/1 closed")
                    held = taken[0]
                    try:
                        other = connect()
                        got = reply(other, raw.OPT_GO, "s-maxconn/2")
                        other.close()
                        require(got == "ERR_POLICY",
                                "maxconn: GO s-maxconn/2 while s-maxconn is held: %s" % got)
                    finally:
                        held.close()

                    def served():
                        r = connect()
                        try:
                            return reply(r, raw.OPT_GO, "s-maxconn/2") == "ACK"
                        finally:
                            r.close()
                    require(nbdtest.wait_until(served, 5, step=0.1),
                            "s-maxconn/2 not served once s-maxconn closed")

                cases += tuple(("maxconn %s" % k, lambda k=k, p=p: maxconn(k, p))
                               for k, p, _ in KINDS)
                for name, fn in cases:
                    checks.run(name, fn)
                require(d.alive(), "the daemon is alive")
            finally:
                checks.dump_log(d)
                d.stop()
    finally:
        for cmd in (["userdel", TEST_USER], ["groupdel", TEST_USER], ["groupdel", TEST_GROUP]):
            subprocess.run(cmd, stderr=subprocess.DEVNULL)
    checks.finish("window access")


if __name__ == "__main__":
    main()
