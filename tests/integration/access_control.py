#!/usr/bin/python3
"""access_control: who may connect (nbdcached(8), ACCESS CONTROL).

One daemon on 127.0.0.1, [::1] and a Unix socket, its rules in a config
file (so that a reload changes them): [generic] allow = 127.0.0.0/8 ::1,
deny = 127.0.0.2, allow-users = root; export "disk" without rules, export
"secret" with deny = 127.0.0.3.

  global_deny    a client bound to 127.0.0.2 is closed at accept, before
                 the greeting; one log line names it and "deny 127.0.0.2";
                 stats counts it in clients.refused_access
  allowed        127.0.0.1 and ::1 get the greeting and GO "disk"
  export_deny    from 127.0.0.3: LIST shows "disk" only; INFO and GO
                 "secret" get NBD_REP_ERR_UNKNOWN (as a missing export
                 does), so do LIST_META_CONTEXT
                 and SET_META_CONTEXT (and the connection goes on: GO
                 "disk" then works); EXPORT_NAME "secret" closes; one
                 log line per connection; from 127.0.0.1 LIST shows both
  unix_user      a user made for the test (useradd --system) connecting to
                 the Unix socket is closed at accept ("not in allow-users /
                 allow-groups"); root is served
  reload         allow-groups = that user's group, allow = fd00::/8: the
                 user is served now (group rule), ::1 and 127.0.0.1 are
                 closed at accept (v6 CIDR, and IPv4 outside it), the Unix
                 socket's root client still served (address rules do not
                 apply to Unix clients)
  reload_limit   a reload sets max-connections-per-client = 1: a second
                 connection from 127.0.0.4 is closed at accept while
                 127.0.0.5 is served; a reload without it lifts the limit
  bad_reload     a config with allow = 10.0.0.1/8 is refused by the reload
                 with FILE:LINE, and the rules in force stay
  check_config   --check-config shows the rules; it names FILE:LINE for a bad CIDR, an unknown
                 user, an unknown group (exit 2)
  per_client     another daemon with --max-connections-per-client 2: two
                 connections from 127.0.0.2 negotiate, a third is closed at
                 accept (logged; 30 more, at most 10 lines in 5 s; stats
                 counts 31 in clients.refused_per_client), 127.0.0.1 is still served, and once one
                 of the two closes 127.0.0.2 gets in again; on the Unix
                 socket the same uid gets two, not three
"""
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402

MIB = 1 << 20
TEST_USER = "nbdcached-acl-test"


def client(sock):
    """A RawClient on an already connected socket."""
    return raw.RawClient(sock=sock)


def tcp(port, source="127.0.0.1", host="127.0.0.1"):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect((host, port))
    return client(s)


def unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return client(s)


def closed_at_accept(r, what):
    """The server closes without sending even the greeting."""
    got = r.wait_closed(timeout=5)
    r.close()
    require(got == b"", "%s: the server sent %r before closing (expected nothing)"
            % (what, got[:32]))


def served(r, what, export="disk"):
    try:
        r.open(export)
        data = r.command(raw.CMD_READ, 0, 4096)
        require(data.error == 0, "%s: READ failed: %d" % (what, data.error))
    finally:
        r.close()


def list_names(r):
    items = r.option(raw.OPT_LIST)
    return sorted(raw.parse_server_reply(p)[0] for _, p in items)


def log_lines(d, pattern, count=1, timeout=5):
    lines = []

    def enough():
        lines[:] = [line for line in d.log_text().splitlines() if re.search(pattern, line)]
        return len(lines) >= count
    nbdtest.wait_until(enough, timeout, step=0.05)
    return lines


def write_config(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def as_user(uid, gid, path):
    """Connect to the Unix socket as uid:gid in a child: "closed" or "greeted"."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        answer = b"error"
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(path)
            got = b""
            while len(got) < 18:
                chunk = s.recv(18 - len(got))
                if not chunk:
                    break
                got += chunk
            answer = b"greeted" if got.startswith(b"NBDMAGIC") else b"closed"
        except ConnectionResetError:
            answer = b"closed"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            answer = ("error %s" % e).encode()
        os.write(wr, answer)
        os._exit(0)
    os.close(wr)
    out = b""
    while True:
        chunk = os.read(rd, 256)
        if not chunk:
            break
        out += chunk
    os.close(rd)
    os.waitpid(pid, 0)
    return out.decode()


def main():
    if os.geteuid() != 0:
        nbdtest.skip("needs root (useradd, setuid)")
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed))
    subprocess.run(["userdel", TEST_USER], stderr=subprocess.DEVNULL)
    subprocess.run(["groupdel", TEST_USER], stderr=subprocess.DEVNULL)
    nbdtest.run(["useradd", "--system", "--user-group", "--no-create-home",
                 "--shell", "/usr/sbin/nologin", TEST_USER])
    try:
        pw = pwd.getpwnam(TEST_USER)
        with nbdtest.tempdir() as tmp:
            os.chmod(tmp, 0o755)  # the test user reaches the socket
            img = nbdtest.random_file(os.path.join(tmp, "disk.img"), 4 * MIB, seed=5)
            secret = nbdtest.random_file(os.path.join(tmp, "secret.img"), 4 * MIB, seed=6)
            conf = os.path.join(tmp, "nbdcached.conf")
            base = ("[generic]\nallow = 127.0.0.0/8 ::1\ndeny = 127.0.0.2\n"
                    "allow-users = root\n\n[secret]\nbackend = %s\ndeny = 127.0.0.3\n" % secret)
            write_config(conf, base)
            port6 = nbdtest.free_port()
            d = nbdtest.CheckedDaemon([("disk", img, "")], workdir=tmp,
                                      extra=["--config", conf, "--cache-size", "16M",
                                             "--listen", "[::1]:%d" % port6])
            try:
                os.chmod(d.sock, 0o777)

                def global_deny():
                    r = tcp(d.port, source="127.0.0.2")
                    closed_at_accept(r, "a client from 127.0.0.2")
                    lines = log_lines(d, r"refused 127\.0\.0\.2:\d+: deny 127\.0\.0\.2 "
                                         r"\(global access rules\); closed at accept")
                    log("  " + lines[0])
                    require(len(lines) == 1, "one log line for the refusal: %s" % lines)
                    st = nbdtest.control_request(d.control, {"command": "stats"})
                    require(st["clients"]["refused_access"] == 1,
                            "stats clients.refused_access: %s" % st["clients"])

                def allowed():
                    served(tcp(d.port), "127.0.0.1")
                    served(tcp(port6, source="::1", host="::1"), "::1")

                def export_deny():
                    r = tcp(d.port, source="127.0.0.3")
                    r.greeting()
                    names = list_names(r)
                    require(names == ["disk"], "LIST from 127.0.0.3 shows %s" % names)
                    r.option(raw.OPT_INFO, raw.go_payload("secret"), want=raw.REP_ERR_UNKNOWN)
                    r.option(raw.OPT_GO, raw.go_payload("secret"), want=raw.REP_ERR_UNKNOWN)
                    r.option(raw.OPT_STRUCTURED_REPLY)
                    r.structured = True
                    r.option(raw.OPT_LIST_META_CONTEXT,
                             raw.meta_payload("secret", ["base:allocation"]),
                             want=raw.REP_ERR_UNKNOWN)
                    r.option(raw.OPT_SET_META_CONTEXT,
                             raw.meta_payload("secret", ["base:allocation"]),
                             want=raw.REP_ERR_UNKNOWN)
                    r.go("disk")  # the connection goes on
                    require(r.command(raw.CMD_READ, 0, 4096).error == 0, "READ after refusal")
                    r.close()
                    lines = log_lines(d, r"refused 127\.0\.0\.3:\d+ export 'secret': "
                                         r"deny 127\.0\.0\.3 \(the export's access rules\)")
                    log("  " + lines[0])
                    require(len(lines) == 1, "one log line per connection: %s" % lines)
                    r = tcp(d.port, source="127.0.0.3")
                    r.greeting()
                    r.send_opt(raw.OPT_EXPORT_NAME, b"secret")
                    got = r.wait_closed()
                    r.close()
                    require(got == b"", "EXPORT_NAME secret got %r before the close" % got)
                    log_lines(d, r"refused 127\.0\.0\.3:\d+ export 'secret'", count=2)
                    r = tcp(d.port)
                    r.greeting()
                    names = list_names(r)
                    r.close()
                    require(names == ["disk", "secret"], "LIST from 127.0.0.1 shows %s" % names)

                def unix_user():
                    got = as_user(pw.pw_uid, pw.pw_gid, d.sock)
                    require(got == "closed", "user %s on the Unix socket: %s"
                            % (TEST_USER, got))
                    lines = log_lines(d, r"refused unix uid %d pid \d+: uid %d gid %d not "
                                         r"in allow-users / allow-groups \(global access rules\)"
                                      % (pw.pw_uid, pw.pw_uid, pw.pw_gid))
                    log("  " + lines[0])
                    served(unix(d.sock), "root on the Unix socket")

                def reload():
                    write_config(conf, base.replace("allow = 127.0.0.0/8 ::1", "allow = fd00::/8")
                                 .replace("allow-users = root",
                                          "allow-users = root\nallow-groups = %s" % TEST_USER))
                    reply = nbdtest.control_request(d.control, {"command": "reload"})
                    require(reply.get("ok") and reply.get("refused_settings") == [],
                            "reload: %s" % reply)
                    got = as_user(pw.pw_uid, pw.pw_gid, d.sock)
                    require(got == "greeted", "user %s (its group allowed): %s"
                            % (TEST_USER, got))
                    closed_at_accept(tcp(port6, source="::1", host="::1"), "::1 after reload")
                    log_lines(d, r"refused \[::1\]:\d+: not in allow list \(first: fd00::/8\)")
                    closed_at_accept(tcp(d.port), "127.0.0.1 after reload")
                    served(unix(d.sock), "root on the Unix socket after reload")
                    # Back, by SIGHUP this time.
                    write_config(conf, base)
                    os.kill(d.pid, signal.SIGHUP)
                    # The line each reload ends with (a reload logs others too).
                    nbdtest.wait_until(lambda: len(re.findall(r"reload: \d+ export\(s\) added",
                                                              d.log_text())) >= 2, 10)
                    served(tcp(d.port), "127.0.0.1 after the second reload")
                    got = as_user(pw.pw_uid, pw.pw_gid, d.sock)
                    require(got == "closed", "user %s after the second reload: %s"
                            % (TEST_USER, got))

                def reload_limit():
                    write_config(conf, base.replace("[generic]\n",
                                                    "[generic]\nmax-connections-per-client = 1\n"))
                    reply = nbdtest.control_request(d.control, {"command": "reload"})
                    require(reply.get("ok") and reply.get("refused_settings") == [],
                            "reload: %s" % reply)
                    first = tcp(d.port, source="127.0.0.4")
                    first.greeting()
                    closed_at_accept(tcp(d.port, source="127.0.0.4"), "a second from 127.0.0.4")
                    served(tcp(d.port, source="127.0.0.5"), "127.0.0.5 meanwhile")
                    write_config(conf, base)
                    reply = nbdtest.control_request(d.control, {"command": "reload"})
                    require(reply.get("ok"), "reload: %s" % reply)
                    served(tcp(d.port, source="127.0.0.4"), "a second from 127.0.0.4, no limit")
                    first.close()

                def bad_reload():
                    write_config(conf, base.replace("deny = 127.0.0.2", "deny = 10.0.0.1/8"))
                    reply = nbdtest.control_request(d.control, {"command": "reload"})
                    log("  %s" % reply)
                    require(not reply.get("ok") and
                            "%s:3: deny: '10.0.0.1/8' is not an address or CIDR" % conf
                            in reply.get("error", ""), "bad reload: %s" % reply)
                    closed_at_accept(tcp(d.port, source="127.0.0.2"), "127.0.0.2, rules kept")
                    served(tcp(d.port), "127.0.0.1, rules kept")
                    write_config(conf, base)

                def check_config():
                    p = subprocess.run([nbdtest.NBDCACHED, "--config", conf, "--check-config"],
                                       capture_output=True, text=True, timeout=30)
                    log("  " + p.stdout.strip().replace("\n", "\n  "))
                    require(p.returncode == 0 and
                            "global access: allow 127.0.0.0/8 ::1; deny 127.0.0.2; allow-users "
                            "root\n" in p.stdout and "  access: deny 127.0.0.3\n" in p.stdout,
                            "--check-config shows the rules: %r" % p.stdout)
                    for text, line, want in (
                            ("[generic]\nallow = 127.0.0.1 300.0.0.0/8\n", 2,
                             "allow: '300.0.0.0/8' is not an address or CIDR"),
                            ("[generic]\n[x]\nbackend = %s\nallow-users = nobody-xyz\n" % img, 4,
                             "allow-users: no such user 'nobody-xyz'"),
                            ("[generic]\nallow-groups = root, nogroup-xyz\n", 2,
                             "allow-groups: no such group 'nogroup-xyz'"),
                            ("[x]\nbackend = %s\ndeny = ::1/129\n" % img, 3,
                             "deny: '::1/129' is not an address or CIDR")):
                        bad = os.path.join(tmp, "bad.conf")
                        write_config(bad, text)
                        p = subprocess.run([nbdtest.NBDCACHED, "--config", bad, "--check-config"],
                                           capture_output=True, text=True, timeout=30)
                        log("  %s" % p.stderr.strip())
                        require(p.returncode == 2 and "%s:%d: %s" % (bad, line, want) in p.stderr,
                                "--check-config: exit %d, %r" % (p.returncode, p.stderr))

                for name, fn in (("global_deny", global_deny), ("allowed", allowed),
                                 ("export_deny", export_deny), ("unix_user", unix_user),
                                 ("reload", reload), ("reload_limit", reload_limit),
                                 ("bad_reload", bad_reload),
                                 ("check_config", check_config)):
                    checks.run(name, fn)
                require(d.alive(), "the daemon is alive")
            finally:
                d.stop()

            def per_client():
                os.makedirs(os.path.join(tmp, "d2"))
                d2 = nbdtest.CheckedDaemon([("disk", img, "")], workdir=os.path.join(tmp, "d2"),
                                           extra=["--cache-size", "16M",
                                                  "--max-connections-per-client", "2"])
                try:
                    held = []
                    for _ in range(2):
                        r = tcp(d2.port, source="127.0.0.2")
                        r.greeting()  # negotiating: counted
                        held.append(r)
                    closed_at_accept(tcp(d2.port, source="127.0.0.2"), "a third from 127.0.0.2")
                    lines = log_lines(d2, r"refused 127\.0\.0\.2:\d+: it has 2 connections "
                                          r"\(--max-connections-per-client\); closed at accept")
                    log("  " + lines[0])
                    # A flood (bounded: 30) from the same address: each closed,
                    # the log says so at most 10 times in 5 s (log.h's limit).
                    t0 = time.monotonic()
                    for _ in range(30):
                        closed_at_accept(tcp(d2.port, source="127.0.0.2"), "flood")
                    secs = time.monotonic() - t0
                    time.sleep(0.2)
                    n = len([line for line in d2.log_text().splitlines()
                             if re.search(r"refused 127\.0\.0\.2:\d+: it has 2", line)])
                    log("  31 refused in %.2f s, %d log line(s)" % (secs, n))
                    st = nbdtest.control_request(d2.control, {"command": "stats"})
                    require(st["clients"]["refused_per_client"] == 31,
                            "stats clients.refused_per_client: %s" % st["clients"])
                    require(n <= 10 * (1 + int(secs / 5)), "%d log lines for 31 refusals in %.2f s"
                            % (n, secs))
                    served(tcp(d2.port), "127.0.0.1 while 127.0.0.2 is at its limit")
                    held.pop().close()

                    def third_gets_in():
                        r = tcp(d2.port, source="127.0.0.2")
                        try:
                            r.greeting()
                            held.append(r)
                            return True
                        except (raw.Closed, raw.Mismatch):
                            r.close()
                            return False
                    require(nbdtest.wait_until(third_gets_in, 5, step=0.1) is not False,
                            "127.0.0.2 got no connection after one of its two closed")
                    for r in held:
                        r.close()
                    # Unix clients count per uid. (An interval of the log's
                    # rate limit later: the flood's refusals used its lines.)
                    time.sleep(5.1)
                    held = []
                    for _ in range(2):
                        r = unix(d2.sock)
                        r.greeting()
                        held.append(r)
                    closed_at_accept(unix(d2.sock), "a third from uid 0 on the Unix socket")
                    lines = log_lines(d2, r"refused unix uid 0 pid \d+: it has 2 connections")
                    require(lines, "no log line for the Unix refusal")
                    log("  " + lines[0])
                    for r in held:
                        r.close()
                finally:
                    d2.stop()
            checks.run("per_client", per_client)
    finally:
        subprocess.run(["userdel", TEST_USER], stderr=subprocess.DEVNULL)
        subprocess.run(["groupdel", TEST_USER], stderr=subprocess.DEVNULL)
    checks.finish("access control")


if __name__ == "__main__":
    main()
