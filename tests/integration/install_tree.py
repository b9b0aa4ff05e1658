#!/usr/bin/python3
"""`make install DESTDIR=... PREFIX=/usr` lays out a tree the daemon runs
from: binaries, units (pointing at PREFIX), the service's account
(sysusers.d) and the block-device drop-in, the config and its example, man
pages in sections 5 and 8, the control-socket schema header; the installed
nbdcached checks the installed config, and a second install keeps an edited
config."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log  # noqa: E402

CHECKS = nbdtest.Checks()
expect = CHECKS.expect

WANT = [
    "usr/sbin/nbdcached",
    "usr/bin/nbdcachectl",
    "usr/share/man/man8/nbdcached.8",
    "usr/share/man/man8/nbdcachectl.8",
    "usr/share/man/man5/nbdcached.conf.5",
    "usr/include/nbdcached/control.h",
    "usr/share/doc/nbdcached/nbdcached.conf",
    "lib/systemd/system/nbdcached.service",
    "lib/systemd/system/nbdcached.socket",
    "usr/lib/sysusers.d/nbdcached.conf",
    "usr/share/doc/nbdcached/nbdcached.service.d/block-device.conf",
    "usr/share/doc/nbdcached/prometheus/nbdcached-alerts.yml",
    "usr/share/doc/nbdcached/prometheus/nbdcached-alerts.test.yml",
    "usr/share/doc/nbdcached/prometheus/grafana-nbdcached.json",
    "etc/nbdcached/nbdcached.conf",
    "etc/nbdcached/nbdcached.conf.example",
]


def install(dest):
    build = os.environ.get("BUILD", "build")
    p = subprocess.run(["make", "-s", "-C", nbdtest.TOP, "BUILD=" + build, "install",
                        "DESTDIR=" + dest, "PREFIX=/usr"],
                       capture_output=True, text=True, timeout=600)
    expect(p.returncode == 0, "make install failed: %s%s" % (p.stdout[-2000:], p.stderr[-2000:]))


def tree(tmp):
    dest = os.path.join(tmp, "root")
    install(dest)
    for rel in WANT:
        expect(os.path.isfile(os.path.join(dest, rel)), "not installed: " + rel)
    for rel in ("usr/sbin/nbdcached", "usr/bin/nbdcachectl"):
        expect(os.access(os.path.join(dest, rel), os.X_OK), rel + " is not executable")
    unit = open(os.path.join(dest, "lib/systemd/system/nbdcached.service")).read()
    expect("ExecStart=/usr/sbin/nbdcached " in unit and "/usr/local" not in unit,
           "the unit names PREFIX's binary")
    conf = os.path.join(dest, "etc/nbdcached/nbdcached.conf")
    sbin = os.path.join(dest, "usr/sbin/nbdcached")
    p = subprocess.run([sbin, "--check-config", "--config", conf],
                       capture_output=True, text=True, timeout=30)
    log("  %s --check-config: exit %d: %s" % (sbin, p.returncode, p.stdout.strip()))
    expect(p.returncode == 0 and "config OK" in p.stdout,
           "the installed daemon rejects the installed config: %s%s" % (p.stdout, p.stderr))
    p = subprocess.run([os.path.join(dest, "usr/bin/nbdcachectl"), "--help"],
                       capture_output=True, text=True, timeout=30)
    expect(p.returncode == 0 and "flush" in p.stdout + p.stderr,
           "installed nbdcachectl --help: %d %s%s" % (p.returncode, p.stdout, p.stderr))
    # An operator's edit survives a second install; the example is refreshed.
    with open(conf, "a") as f:
        f.write("\n[mine]\nbackend = /srv/mine.img\n")
    install(dest)
    expect("[mine]" in open(conf).read(), "make install overwrote the operator's config")
    p = subprocess.run([sbin, "--check-config", "--config", conf],
                       capture_output=True, text=True, timeout=30)
    expect(p.returncode == 0 and "2 export(s)" in p.stdout, "edited config: %s" % p.stdout)


def main():
    with nbdtest.tempdir() as tmp:
        CHECKS.run("tree", tree, tmp)
    CHECKS.finish("install")


if __name__ == "__main__":
    main()
