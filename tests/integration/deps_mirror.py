#!/usr/bin/python3
"""deps_mirror: scripts/deps installs what it needs with a broken index.

apt runs on a configuration of the test's own (APT_CONFIG): the machine's
real Debian sources, plus a local file:// repository whose Packages index is
truncated after its Release file was written (apt-get update fails on it,
as it does on a mirror caught mid-sync: "File has unexpected size"). The
lists directory is the test's copy of apt's, so the machine's own indexes
are not touched.

  broken_index   apt-get update alone exits non-zero on that configuration
                 (the plant works), and scripts/deps, asked for one more
                 small package that is not installed (DEPS_EXTRA), still
                 installs it and exits 0, saying it went on
  named          a package no source has: scripts/deps exits non-zero and
                 its last words name that package (after one retry)

The package installed is purged again at the end.
"""

import glob
import hashlib
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import log, require  # noqa: E402

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DEPS = os.path.join(TOP, "scripts", "deps")
# Small packages of bookworm main with no dependencies beyond libc.
CANDIDATES = ("hello", "sl", "cowsay", "figlet", "toilet")
MISSING = "nbdcached-no-such-package"

ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                      text=True, check=True).stdout.strip()


def installed(pkg):
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg],
                       capture_output=True, text=True)
    return r.returncode == 0 and "ok installed" in r.stdout


def broken_repo(d):
    """A file:// repository whose index is shorter than its Release says."""
    repo = os.path.join(d, "repo")
    sub = os.path.join(repo, "dists", "broken", "main", "binary-%s" % ARCH)
    os.makedirs(sub)
    stanzas = "".join(
        "Package: nbdcached-probe-%d\nVersion: 1.0\nArchitecture: %s\n"
        "Maintainer: nbdcached tests <tests@invalid>\nInstalled-Size: 1\n"
        "Filename: pool/p%d.deb\nSize: 1000\nSHA256: %s\n"
        "Description: a package that is not there\n\n"
        % (i, ARCH, i, "0" * 64) for i in range(200))
    data = stanzas.encode()
    with open(os.path.join(sub, "Packages"), "wb") as f:
        f.write(data)
    rel = ("Origin: nbdcached-test\nLabel: nbdcached-test\nSuite: broken\n"
           "Codename: broken\nDate: Sat, 05 Dec 2026 00:00:00 UTC\n"
           "Architectures: %s\nComponents: main\n"
           "MD5Sum:\n %s %d main/binary-%s/Packages\n"
           "SHA256:\n %s %d main/binary-%s/Packages\n"
           % (ARCH, hashlib.md5(data).hexdigest(), len(data), ARCH,
              hashlib.sha256(data).hexdigest(), len(data), ARCH))
    with open(os.path.join(repo, "dists", "broken", "Release"), "w") as f:
        f.write(rel)
    # The mirror mid-sync: the index is cut short after Release was written.
    with open(os.path.join(sub, "Packages"), "wb") as f:
        f.write(data[:len(data) // 3])
    return repo


def apt_config(d):
    """An apt configuration: the machine's sources plus the broken one."""
    parts = os.path.join(d, "sources.list.d")
    lists = os.path.join(d, "lists")
    os.makedirs(os.path.join(lists, "partial"))
    os.makedirs(parts)
    n = 0
    for src in glob.glob("/etc/apt/sources.list.d/*.sources") + \
            glob.glob("/etc/apt/sources.list.d/*.list"):
        shutil.copy(src, parts)
        n += 1
    main_list = os.path.join(d, "sources.list")
    text = ""
    if os.path.exists("/etc/apt/sources.list"):
        with open("/etc/apt/sources.list") as f:
            text = f.read()
        n += 1
    require(n > 0, "the machine has no apt source to build on")
    text += "\ndeb [trusted=yes] file:%s broken main\n" % broken_repo(d)
    with open(main_list, "w") as f:
        f.write(text)
    # apt's indexes as they are now: update then only revalidates them.
    for f in glob.glob("/var/lib/apt/lists/*"):
        if os.path.isfile(f) and not f.endswith("/lock"):
            shutil.copy(f, lists)
    conf = os.path.join(d, "apt.conf")
    with open(conf, "w") as f:
        f.write('Dir::Etc::sourcelist "%s";\n' % main_list)
        f.write('Dir::Etc::sourceparts "%s";\n' % parts)
        f.write('Dir::State::lists "%s/";\n' % lists)
        f.write('Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')
    return conf


def test_all():
    pkg = next((p for p in CANDIDATES if not installed(p)), None)
    require(pkg is not None, "every candidate package (%s) is installed already: "
            "nothing left to prove an install with" % ", ".join(CANDIDATES))
    with nbdtest.tempdir() as d:
        env = dict(os.environ, APT_CONFIG=apt_config(d))
        try:
            log("=== broken_index (installing %s)" % pkg)
            r = subprocess.run(["apt-get", "update", "-qq"], env=env,
                               capture_output=True, text=True, timeout=300)
            log("plain apt-get update: exit %d: %s" % (r.returncode, r.stderr.strip()[-300:]))
            require(r.returncode != 0 and "%s/repo/dists/broken" % d in r.stderr,
                    "apt-get update did not fail on the broken index: the plant does not work")
            r = subprocess.run([DEPS], env=dict(env, DEPS_EXTRA=pkg),
                               capture_output=True, text=True, timeout=600)
            log("scripts/deps: exit %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
            require(r.returncode == 0, "scripts/deps exited %d with one broken index" % r.returncode)
            require(installed(pkg), "scripts/deps exited 0 but %s is not installed" % pkg)
            require("going on with the indexes apt has" in r.stderr,
                    "scripts/deps did not say it went on past the broken index")
            log("ok broken_index")

            log("=== named")
            r = subprocess.run([DEPS], env=dict(env, DEPS_EXTRA=MISSING, APT_UPDATE_TRIES="1"),
                               capture_output=True, text=True, timeout=600)
            log("scripts/deps: exit %d\n%s%s" % (r.returncode, r.stdout, r.stderr))
            require(r.returncode != 0, "scripts/deps exited 0 though %s cannot be installed" % MISSING)
            last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
            require(MISSING in last, "the last line does not name %s: %r" % (MISSING, last))
            require("trying once more" in r.stderr, "the install was not retried")
            log("ok named")
        finally:
            if installed(pkg):
                subprocess.run(["apt-get", "purge", "-y", "-qq", pkg],
                               env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
                               capture_output=True, timeout=300)


if __name__ == "__main__":
    try:
        test_all()
    except nbdtest.Failed as e:
        print("FAIL: %s" % e)
        sys.exit(1)
    print("all checks passed")
