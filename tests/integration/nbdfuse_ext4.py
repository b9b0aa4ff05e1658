#!/usr/bin/python3
"""A real filesystem on nbdcached: ext4 over loop over nbdfuse over NBD.

  nbdfuse (multi-conn: 4 connections) exposes the export as FUSEDIR/disk,
  losetup turns that file into /dev/loopN, mkfs.ext4 and mount, a tree of
  random and sparse files is copied in, synced and checksummed, and
  everything is torn down (umount, losetup -d, fusermount3 -u). The
  unmounts flush down the whole stack, so e2fsck -fn on the backend file
  itself must pass. Then the daemon is restarted with the export read-only
  and the stack is built again read-only: e2fsck -fn passes on the loop
  device and every file has its checksum, size and contents.

Skips (77) when /dev/fuse or loop devices are missing. Every mount, loop
device and FUSE mount is undone in finally blocks, in reverse order.
"""

import contextlib
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import check, fail, log, run  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
SIZE = 256 * MiB


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def require_kernel_features():
    if not os.path.exists("/dev/fuse"):
        nbdtest.skip("/dev/fuse is missing (no FUSE in this kernel/container)")
    try:
        p = subprocess.run(["losetup", "-f"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        nbdtest.skip("losetup does not work: %s" % e)
    if p.returncode != 0 or not p.stdout.strip().startswith("/dev/loop"):
        nbdtest.skip("no loop devices: losetup -f: %s" % (p.stderr.strip() or p.stdout.strip()))


class Stack:
    """nbdfuse + loop device + ext4 mount; stop() undoes whatever was done."""

    def __init__(self, tmp, uri, readonly):
        self.fusedir = os.path.join(tmp, "fuse")
        self.mnt = os.path.join(tmp, "mnt")
        self.pidfile = os.path.join(tmp, "nbdfuse.pid")
        os.makedirs(self.fusedir, exist_ok=True)
        os.makedirs(self.mnt, exist_ok=True)
        self.uri, self.readonly = uri, readonly
        self.fuse_proc = None
        self.loop = None
        self.fs_mounted = False

    @property
    def file(self):
        return os.path.join(self.fusedir, "disk")

    def start_fuse(self):
        if os.path.exists(self.pidfile):
            os.unlink(self.pidfile)
        args = ["nbdfuse", "-P", self.pidfile] + (["-r"] if self.readonly else [])
        args += [self.file, self.uri]
        log("+ " + " ".join(args))
        self.fuse_proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.fuse_proc.poll() is not None:
                fail("nbdfuse exited early with %d" % self.fuse_proc.returncode)
            if os.path.exists(self.pidfile) and mounted(self.fusedir) and os.path.exists(self.file):
                break
            time.sleep(0.1)
        else:
            fail("nbdfuse did not come up within 30s")
        check(os.path.getsize(self.file) == SIZE,
              "nbdfuse file has size %d, expected %d" % (os.path.getsize(self.file), SIZE))

    def attach_loop(self):
        p = run(["losetup", "-f", "--show"] + (["-r"] if self.readonly else []) + [self.file])
        self.loop = p.stdout.strip()
        check(self.loop.startswith("/dev/loop"), "losetup printed %r" % self.loop)

    def mount(self):
        opts = "ro,noload" if self.readonly else "rw"
        run(["mount", "-t", "ext4", "-o", opts, self.loop, self.mnt])
        self.fs_mounted = True

    def umount(self):
        if self.fs_mounted or mounted(self.mnt):
            p = run(["umount", self.mnt], check_rc=False, timeout=120)
            if p.returncode != 0:
                run(["umount", "-l", self.mnt], check_rc=False)
            self.fs_mounted = False

    def detach_loop(self):
        if self.loop:
            run(["losetup", "-d", self.loop], check_rc=False, timeout=120)
            self.loop = None

    def stop_fuse(self):
        if self.fuse_proc is None:
            return
        if mounted(self.fusedir):
            p = run(["fusermount3", "-u", self.fusedir], check_rc=False, timeout=120)
            if p.returncode != 0:
                run(["fusermount3", "-u", "-z", self.fusedir], check_rc=False)
        try:
            rc = self.fuse_proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log("nbdfuse (pid %d) did not exit after unmount; killing it" % self.fuse_proc.pid)
            self.fuse_proc.kill()
            rc = self.fuse_proc.wait()
        self.fuse_proc = None
        return rc

    def stop(self):
        """Undo everything, in reverse order; safe to call twice."""
        try:
            self.umount()
        finally:
            try:
                self.detach_loop()
            finally:
                self.stop_fuse()

    def tear_down(self):
        """The orderly teardown (umount, losetup -d, fusermount3 -u): nbdfuse
        must then exit 0."""
        self.umount()
        self.detach_loop()
        rc = self.stop_fuse()
        check(rc == 0, "nbdfuse exited with %r after fusermount3 -u" % rc)


@contextlib.contextmanager
def loop_on_nbdfuse(tmp, d, uri, readonly, phase):
    """A Stack with nbdfuse up and the loop device attached; stopped whatever
    happens, and then the daemon must still be alive."""
    stack = Stack(tmp, uri, readonly)
    try:
        stack.start_fuse()
        stack.attach_loop()
        yield stack
    finally:
        stack.stop()
    check(d.alive(), "nbdcached died during %s" % phase)


def make_tree(root):
    """Random files of awkward sizes in nested directories, and sparse files."""
    sizes = [0, 1, 511, 4095, 4096, 4097, 65537, 1 * MiB, 3 * MiB + 123]
    files = []
    for d in ("", "a", "a/b", "a/b/c", "d"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for i, n in enumerate(sizes):
        rel = os.path.join(("", "a", "a/b", "a/b/c", "d")[i % 5], "rand%d.bin" % i)
        nbdtest.random_file(os.path.join(root, rel), n, seed=100 + i)
        files.append(rel)
    sparse = [("d/sparse-middle.img", 16 * MiB, [(5 * MiB, 64 * KiB)]),
              ("d/sparse-empty.img", 8 * MiB, []),
              ("a/sparse-ends.img", 12 * MiB, [(0, 4 * KiB), (12 * MiB - 100, 100)]),
              ("a/b/sparse-many.img", 32 * MiB, [(k * MiB + 17, 3000) for k in range(0, 32, 3)])]
    for rel, n, runs in sparse:
        nbdtest.data_runs_file(os.path.join(root, rel), n, runs)
        files.append(rel)
    return files


def checksums(root, files):
    return {rel: (os.path.getsize(os.path.join(root, rel)),
                  nbdtest.sha256_file(os.path.join(root, rel))) for rel in files}


def main():
    require_kernel_features()
    with nbdtest.tempdir() as tmp:
        backend = nbdtest.sparse_file(os.path.join(tmp, "ext4.img"), SIZE)
        src = os.path.join(tmp, "src")
        files = make_tree(src)
        want = checksums(src, files)
        log("source tree: %d files, %d bytes"
            % (len(files), sum(size for size, _ in want.values())))

        log("=== phase 1: mkfs.ext4, mount, copy in, checksum, tear down")
        with nbdtest.Daemon([("ext4", backend, "")]) as d:
            with loop_on_nbdfuse(tmp, d, d.unix_uri("ext4"), False, "phase 1") as stack:
                run(["mkfs.ext4", "-q", "-F", stack.loop], timeout=300)
                stack.mount()
                tree = os.path.join(stack.mnt, "tree")
                run(["cp", "-a", "--sparse=always", src + "/.", tree + "/"], timeout=300)
                run(["sync", "-f", tree])
                got = checksums(tree, files)
                check(got == want, "checksums differ right after copying into ext4")
                stack.tear_down()
            log("info: nbdfuse opened %d NBD connection(s) (multi-conn)"
                % d.log_text().count("negotiated"))
            # The unmounts flushed down to NBD FLUSH: the backend file itself
            # holds a consistent filesystem.
            run(["e2fsck", "-fn", backend], timeout=300)

        log("=== phase 2: restart the daemon (read-only export), mount read-only, verify")
        with nbdtest.Daemon([("ext4", backend, "readonly")]) as d:
            with loop_on_nbdfuse(tmp, d, d.tcp_uri("ext4"), True, "phase 2") as stack:
                run(["e2fsck", "-fn", stack.loop], timeout=300)
                stack.mount()
                got = checksums(os.path.join(stack.mnt, "tree"), files)
                for rel in files:
                    check(got[rel] == want[rel], "%s: size/sha256 %r, expected %r"
                          % (rel, got[rel], want[rel]))
                stack.tear_down()
    log("all nbdfuse/ext4 checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
