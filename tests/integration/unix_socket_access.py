#!/usr/bin/python3
"""unix_socket_access: Unix socket clients and their rules (nbdcached(8),
--unix and ACCESS CONTROL).

  groups40   export "g" with allow-groups = 61039: a client (uid 65534)
             in 40 supplementary groups 61000..61039 opens g (the rule's
             group is its 40th: every group is read, not the first 32);
             with only the first 39 it gets NBD_REP_ERR_UNKNOWN, as for
             an export that does not exist
  mode       --unix PATH,mode=0660,group=GROUP (GROUP made for the test)
             and a config file's "unix = PATH2,mode=0600": stat shows
             those modes and that group; a client as uid 65534 in GROUP
             opens "open" on PATH, one not in it gets EACCES at connect
  bad        --unix PATH,mode=0999 and --unix PATH,group=<no such group>
             stop nbdcached at start (exit 2) with the reason, on the
             command line and in a config file (with FILE:LINE)
"""
import grp
import os
import stat
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402
import bad_input as raw  # noqa: E402

MIB = 1 << 20
NOBODY = 65534
GROUPS = list(range(61000, 61040))
TEST_GROUP = "nbdcached-ux-grp"


def go(path, name):
    """INFO then GO of name over the socket at path, and a READ: the
    replies' names."""
    r = raw.RawClient(path)
    try:
        r.greeting()
        out = []
        for opt in (raw.OPT_INFO, raw.OPT_GO):
            r.send_opt(opt, raw.go_payload(name))
            typ, _, _ = r.opt_replies(opt)
            out.append(raw.rep_name(typ))
        if out[-1] == "ACK":
            out.append("READ error %d" % r.command(raw.CMD_READ, 0, 4096).error)
        return out
    finally:
        r.close()


def main():
    if os.geteuid() != 0:
        nbdtest.skip("needs root (setgroups, setuid, groupadd)")
    checks = nbdtest.Checks(catch=(nbdtest.Failed, raw.Mismatch, raw.Closed, OSError))
    subprocess.run(["groupdel", TEST_GROUP], stderr=subprocess.DEVNULL)
    nbdtest.run(["groupadd", "--system", TEST_GROUP])
    try:
        gid = grp.getgrnam(TEST_GROUP).gr_gid
        with nbdtest.tempdir() as tmp:
            os.chmod(tmp, 0o755)
            img = nbdtest.random_file(os.path.join(tmp, "d.img"), 4 * MIB, seed=81)

            def groups40():
                work = os.path.join(tmp, "g")
                os.mkdir(work)
                os.chmod(work, 0o755)
                with nbdtest.running_daemon([("open", img, ""),
                                             ("g", img, "allow-groups=%d" % GROUPS[-1])],
                                            workdir=work, extra=["--cache-size", "16M"]) as d:
                    os.chmod(d.sock, 0o777)
                    got = nbdtest.in_child_as(NOBODY, NOBODY, GROUPS, lambda: go(d.sock, "g"))
                    log("  40 groups: %s" % got)
                    require(got.get("result") == ["ACK", "ACK", "READ error 0"],
                            "a client in 40 groups, the rule's the 40th: %s" % got)
                    got = nbdtest.in_child_as(NOBODY, NOBODY, GROUPS[:-1], lambda: go(d.sock, "g"))
                    log("  39 groups: %s" % got)
                    require(got.get("result") == ["ERR_UNKNOWN", "ERR_UNKNOWN"],
                            "a client without the rule's group: %s" % got)
                    got = nbdtest.in_child_as(NOBODY, NOBODY, GROUPS[:-1], lambda: go(d.sock, "nosuch"))
                    require(got.get("result") == ["ERR_UNKNOWN", "ERR_UNKNOWN"],
                            "a missing export: %s" % got)

            def mode():
                work = os.path.join(tmp, "m")
                os.mkdir(work)
                os.chmod(work, 0o755)
                a = os.path.join(work, "a.sock")
                with nbdtest.running_daemon(
                        [("open", img, "")], workdir=work,
                        extra=["--cache-size", "16M",
                               "--unix", "%s,mode=0660,group=%s" % (a, TEST_GROUP)]):
                    sa = os.stat(a)
                    log("  %s: %o gid %d" % (a, stat.S_IMODE(sa.st_mode), sa.st_gid))
                    require(stat.S_ISSOCK(sa.st_mode) and stat.S_IMODE(sa.st_mode) == 0o660 and
                            sa.st_gid == gid, "--unix %s,mode=0660,group=%s: %o gid %d"
                            % (a, TEST_GROUP, stat.S_IMODE(sa.st_mode), sa.st_gid))
                    got = nbdtest.in_child_as(NOBODY, NOBODY, [gid], lambda: go(a, "open"))
                    require(got.get("result") == ["ACK", "ACK", "READ error 0"],
                            "uid 65534 in %s on %s: %s" % (TEST_GROUP, a, got))
                    got = nbdtest.in_child_as(NOBODY, NOBODY, [], lambda: go(a, "open"))
                    log("  not in the group: %s" % got)
                    require("PermissionError" in got.get("error", ""),
                            "uid 65534 outside %s on %s: %s" % (TEST_GROUP, a, got))
                # The config file's unix key (the harness's --unix would
                # replace the file's sockets: a daemon of its own).
                work = os.path.join(tmp, "m2")
                os.mkdir(work)
                b = os.path.join(work, "b.sock")
                conf = os.path.join(work, "m.conf")
                with open(conf, "w") as f:
                    f.write("[generic]\nunix = %s,mode=0600\ncontrol = none\n"
                            "[open]\nbackend = %s\n" % (b, img))
                with open(os.path.join(work, "b.log"), "w") as logf:
                    p = subprocess.Popen([nbdtest.NBDCACHED, "--foreground", "--config", conf,
                                          "--cache-size", "16M"], stdout=logf,
                                         stderr=subprocess.STDOUT)
                try:
                    require(nbdtest.wait_until(lambda: os.path.exists(b), 10),
                            "no socket %s from the config file" % b)
                    # The socket is bound, then given its mode (0 until then,
                    # as tight as it gets): wait for the mode, not the name.
                    nbdtest.wait_until(
                        lambda: stat.S_IMODE(os.stat(b).st_mode) == 0o600, 10)
                    sb = os.stat(b)
                    log("  %s: %o" % (b, stat.S_IMODE(sb.st_mode)))
                    require(stat.S_ISSOCK(sb.st_mode) and stat.S_IMODE(sb.st_mode) == 0o600,
                            "config unix = %s,mode=0600: %o" % (b, stat.S_IMODE(sb.st_mode)))
                    h = nbdtest.libnbd_handle("nbd+unix:///open?socket=%s" % b)
                    require(h.pread(4096, 0) == nbdtest.read_at(img, 0, 4096), "root on %s" % b)
                    h.shutdown()
                finally:
                    p.terminate()
                    p.wait(30)

            def bad():
                sock = os.path.join(tmp, "bad.sock")
                for value, why in (("%s,mode=0999" % sock, "mode '0999' is not an octal mode"),
                                   ("%s,group=no-such-group-xyz" % sock,
                                    "no such group 'no-such-group-xyz'")):
                    p = subprocess.Popen([nbdtest.NBDCACHED, "--foreground", "--control", "none",
                                          "--unix", value, "--export", "x=%s" % img],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
                    try:
                        p.stdout, p.stderr = p.communicate(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.communicate()
                        raise nbdtest.Failed("nbdcached started with --unix %s" % value)
                    log("  --unix %s: exit %d, %s" % (value, p.returncode, p.stderr.strip()))
                    require(p.returncode == 2 and "--unix %s: %s" % (value, why) in p.stderr,
                            "--unix %s: exit %d, %r" % (value, p.returncode, p.stderr))
                    require(not os.path.exists(sock) and not os.path.exists(value),
                            "a socket was made for --unix %s" % value)
                    conf = os.path.join(tmp, "bad.conf")
                    with open(conf, "w") as f:
                        f.write("[generic]\nunix = %s\n[x]\nbackend = %s\n" % (value, img))
                    p = subprocess.run([nbdtest.NBDCACHED, "--config", conf, "--check-config"],
                                       capture_output=True, text=True, timeout=30)
                    log("  config: exit %d, %s" % (p.returncode, p.stderr.strip()))
                    require(p.returncode == 2 and "%s:2:" % conf in p.stderr and why in p.stderr,
                            "config unix = %s: exit %d, %r" % (value, p.returncode, p.stderr))

            for name, fn in (("groups40", groups40), ("mode", mode), ("bad", bad)):
                checks.run(name, fn)
    finally:
        subprocess.run(["groupdel", TEST_GROUP], stderr=subprocess.DEVNULL)
    checks.finish("Unix socket access")


if __name__ == "__main__":
    main()
