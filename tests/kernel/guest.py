"""The kernel test harness: a real Linux NBD client (Debian's kernel and
nbd-client) booted under qemu with TCG, against the real nbdcached.

The machine has neither KVM nor an nbd module, so each test boots one of
Debian 12's own kernels in qemu (TCG): linux-image-amd64 (installed by
tests/kernel/deps) or the i386 kernel behind linux-image-686 (unpacked into
$BUILD/kernel/i386-debs/ by tests/kernel/deps, never installed).

The guest runs a busybox initramfs built here, in $BUILD/kernel/ARCH/:
busybox-static, nbd-client and e2fsprogs of that architecture with their
shared libraries and loader, and the kernel modules the tests need (nbd,
loaded with nbds_max=4; ext4 and what it needs; virtio-net), each with the
modules `modinfo -F depends` names. Its /init mounts /proc, /sys, /dev,
loads the modules, brings up eth0 and runs /test.sh, a test's guest script,
carried by a second cpio archive appended to the first. It prints
"KTEST-EXIT RC" on the serial console and powers off.

The network is qemu's user networking with restrict=on: the guest reaches
nothing but 10.0.2.100:10809, a guestfwd whose every connection runs
tests/kernel/relay.py, which joins it to the daemon's Unix socket (one
relay per connection, so nbd-client -C N gets N connections, and a
connection made while the daemon is down fails at once).

Every qemu run has a deadline and is killed by its PID when it overruns;
nothing else is killed. The serial console is read line by line as it
comes (Guest.wait_for lets the host act on a guest's marker). Lines the
guest prints:
    KTEST-BOOTED UPTIME     /init started (boot time)
    KTEST-MARK NAME         a point the host may wait for
    KTEST-KV KEY VALUE      a result for the host to check
    KTEST-EXIT RC           the script's exit code
"""

import atexit
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = nbdtest.TOP
BUILD = os.path.join(TOP, nbdtest.BUILD)
KDIR = os.path.join(BUILD, "kernel")
I386_ROOT = os.path.join(KDIR, "i386-debs", "root")

log = nbdtest.log


def _terminated(signum, frame):
    """SIGTERM (tests/run's timeout) unwinds like an error: the with-blocks
    kill qemu by PID and stop the daemon, atexit removes the backends."""
    raise SystemExit("terminated by signal %d" % signum)


signal.signal(signal.SIGTERM, _terminated)

# The guest's view: 10.0.2.100:10809 is the daemon.
NBD_HOST = "10.0.2.100"
NBD_PORT = 10809

ARCHES = {
    "amd64": {
        "qemu": "qemu-system-x86_64",
        "root": "/",
        "kernel": "boot/vmlinuz-*-amd64",
        "libdirs": ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"],
    },
    "i386": {
        "qemu": "qemu-system-i386",
        "root": I386_ROOT,
        "kernel": "boot/vmlinuz-*-686",
        "libdirs": ["lib/i386-linux-gnu", "usr/lib/i386-linux-gnu"],
    },
}

# Programs in the guest (busybox provides the rest), found under the root.
PROGRAMS = {
    "nbd-client": ["usr/sbin/nbd-client", "sbin/nbd-client"],
    "mke2fs": ["usr/sbin/mke2fs", "sbin/mke2fs"],
    "e2fsck": ["usr/sbin/e2fsck", "sbin/e2fsck"],
    "debugfs": ["usr/sbin/debugfs", "sbin/debugfs"],
}
BUSYBOX = ["usr/bin/busybox", "bin/busybox"]
# Modules, loaded in this order, after what each depends on. crc32c is
# named because ext4 and jbd2 ask for it by name (request_module), which a
# guest without modprobe's database cannot answer.
MODULES = ["crc32c_generic", "crc16", "ext4", "virtio_pci", "virtio_net", "nbd"]
MODULE_PARAMS = {"nbd": "nbds_max=4"}

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /mnt /mnt2 /usr/bin /usr/sbin /sbin
/bin/busybox mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t tmpfs tmp /tmp
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LD_LIBRARY_PATH=/lib
echo "KTEST-BOOTED $(cut -d' ' -f1 /proc/uptime)"
while read m params; do
	insmod /modules/$m.ko $params || echo "KTEST-INSMOD-FAILED $m"
done </modules/order
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
echo "KTEST-MARK ready $(cut -d' ' -f1 /proc/uptime)"
sh /test.sh
rc=$?
echo "KTEST-EXIT $rc $(cut -d' ' -f1 /proc/uptime)"
sync
poweroff -f
sleep 2
reboot -f
"""

# Helpers for the guest scripts (sourced as /lib/ktest.sh).
KTEST_SH = r"""
mark() { echo "KTEST-MARK $* $(cut -d' ' -f1 /proc/uptime)"; }
kv() { echo "KTEST-KV $*"; }
die() { echo "KTEST-FAIL $*"; exit 1; }
# run CMD...: echo it, run it, echo its exit code as "-> rc N"
run() { echo "+ $*"; "$@"; r=$?; echo "-> rc $r"; return $r; }
"""


def find_under(root, candidates):
    for c in candidates:
        p = os.path.join(root, c)
        if os.path.lexists(p):
            return p
    raise RuntimeError("none of %s under %s" % (candidates, root))


def real(root, path):
    """path (inside root) with its symlinks resolved inside root."""
    for _ in range(40):
        if not os.path.islink(path):
            return path
        t = os.readlink(path)
        if t.startswith("/"):
            path = os.path.join(root, t.lstrip("/"))
        else:
            path = os.path.join(os.path.dirname(path), t)
        path = os.path.normpath(path)
    raise RuntimeError("symlink loop at " + path)


def elf_info(path):
    """(interpreter or None, [NEEDED names]) from readelf."""
    out = subprocess.run(["readelf", "-d", "-l", "-W", path], capture_output=True,
                         text=True, check=True).stdout
    interp = None
    m = re.search(r"\[Requesting program interpreter: ([^\]]+)\]", out)
    if m:
        interp = m.group(1)
    return interp, re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def kernel_version(arch):
    a = ARCHES[arch]
    ks = sorted(glob.glob(os.path.join(a["root"], a["kernel"])))
    if not ks:
        raise RuntimeError("no %s kernel %s under %s (run tests/kernel/deps)"
                           % (arch, a["kernel"], a["root"]))
    k = ks[-1]
    return k, os.path.basename(k)[len("vmlinuz-"):]


def module_files(root, ver, names):
    """[(name, path, params)] in load order: each module after its depends."""
    mdir = os.path.join(root, "lib", "modules", ver)
    if not os.path.isdir(mdir):
        mdir = os.path.join(root, "usr", "lib", "modules", ver)
    paths = {}
    # The module files themselves (an unpacked kernel has no modules.dep).
    for d, _, files in os.walk(os.path.join(mdir, "kernel")):
        for fn in files:
            m = re.match(r"(.*)\.ko(\.[gx]z|\.zst)?$", fn)
            if m:
                paths[m.group(1).replace("-", "_")] = os.path.join(d, fn)
    order = []

    def add(n, stack=()):
        n = n.replace("-", "_")
        if n in order or not n:
            return
        if n not in paths:
            return          # built in (modules.builtin) or absent: nothing to load
        if n in stack:
            raise RuntimeError("module dependency loop at " + n)
        deps = subprocess.run(["modinfo", "-F", "depends", paths[n]], capture_output=True,
                              text=True, check=True).stdout.strip()
        for d in deps.split(","):
            add(d.strip(), stack + (n,))
        order.append(n)

    for n in names:
        if n.replace("-", "_") not in paths and n not in ("crc32c_generic", "crc16"):
            raise RuntimeError("module %s not in %s" % (n, mdir))
        add(n)
    return [(n, paths[n], MODULE_PARAMS.get(n, "")) for n in order]


def build_initramfs(arch):
    """$BUILD/kernel/ARCH/base.cpio (built when missing or older than this
    file); returns (kernel path, cpio path)."""
    a = ARCHES[arch]
    root = a["root"]
    kernel, ver = kernel_version(arch)
    out = os.path.join(KDIR, arch)
    cpio = os.path.join(out, "base.cpio")
    if os.path.exists(cpio) and os.path.getmtime(cpio) > os.path.getmtime(__file__):
        return kernel, cpio
    t0 = time.time()
    tree = os.path.join(out, "tree")
    shutil.rmtree(tree, ignore_errors=True)
    for d in ("bin", "lib", "usr/sbin", "modules", "etc"):
        os.makedirs(os.path.join(tree, d))
    shutil.copy2(real(root, find_under(root, BUSYBOX)), os.path.join(tree, "bin", "busybox"))
    libs_needed = []
    interps = set()
    for prog, cands in PROGRAMS.items():
        src = real(root, find_under(root, cands))
        dst = os.path.join(tree, "usr", "sbin", prog)
        shutil.copy2(src, dst)
        libs_needed.append(src)
    for link, prog in (("mkfs.ext4", "mke2fs"), ("fsck.ext4", "e2fsck")):
        os.symlink(prog, os.path.join(tree, "usr", "sbin", link))
    # Shared libraries, breadth first, all into /lib (LD_LIBRARY_PATH=/lib).
    seen = set()
    todo = list(libs_needed)
    while todo:
        p = todo.pop()
        interp, needed = elf_info(p)
        if interp:
            interps.add(interp)
        for n in needed:
            if n in seen:
                continue
            seen.add(n)
            src = None
            for d in a["libdirs"]:
                c = os.path.join(root, d, n)
                if os.path.lexists(c):
                    src = real(root, c)
                    break
            if src is None:
                raise RuntimeError("%s: library %s not found under %s" % (arch, n, root))
            shutil.copy2(src, os.path.join(tree, "lib", n))
            todo.append(src)
    for i in interps:
        dst = os.path.join(tree, i.lstrip("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            shutil.copy2(real(root, os.path.join(root, i.lstrip("/"))), dst)
    conf = os.path.join(root, "etc", "mke2fs.conf")
    if os.path.exists(conf):
        shutil.copy2(conf, os.path.join(tree, "etc", "mke2fs.conf"))
    with open(os.path.join(tree, "modules", "order"), "w") as f:
        for n, p, params in module_files(root, ver, MODULES):
            dst = os.path.join(tree, "modules", n + ".ko")
            if p.endswith(".xz"):
                with open(dst, "wb") as o:
                    subprocess.run(["xz", "-dc", p], stdout=o, check=True)
            elif p.endswith(".zst"):
                with open(dst, "wb") as o:
                    subprocess.run(["zstd", "-dc", p], stdout=o, check=True)
            else:
                shutil.copy2(p, dst)
            f.write("%s %s\n" % (n, params))
    with open(os.path.join(tree, "init"), "w") as f:
        f.write(INIT)
    os.chmod(os.path.join(tree, "init"), 0o755)
    with open(os.path.join(tree, "lib", "ktest.sh"), "w") as f:
        f.write(KTEST_SH)
    make_cpio(tree, cpio)
    log("initramfs %s: %s (%d KiB, %s modules) built in %.1fs"
        % (arch, cpio, os.path.getsize(cpio) // 1024, ver, time.time() - t0))
    return kernel, cpio


def make_cpio(tree, path):
    """A newc cpio archive of the tree, owned by root."""
    files = subprocess.run(["find", "."], cwd=tree, capture_output=True, text=True,
                           check=True).stdout
    with open(path + ".tmp", "wb") as o:
        subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=tree,
                       input=files.encode(), stdout=o, check=True)
    os.replace(path + ".tmp", path)


class Guest:
    """One qemu run: Guest(arch, script, sock, workdir).start(), then
    wait_for(...) / wait(); every line of the serial console is kept in
    self.lines and written to WORKDIR/ARCH-NAME.console."""

    def __init__(self, arch, script, sock, workdir, name="guest", mem=1024, timeout=600):
        self.arch = arch
        self.script = script
        self.sock = sock
        self.workdir = workdir
        self.name = name
        self.mem = mem
        self.timeout = timeout
        self.lines = []
        self.cond = threading.Condition()
        self.proc = None
        self.exit_rc = None
        self.t_start = self.t_booted = self.t_ready = self.t_end = None

    def start(self):
        kernel, base = build_initramfs(self.arch)
        tdir = os.path.join(self.workdir, self.name + "-script")
        shutil.rmtree(tdir, ignore_errors=True)
        os.makedirs(tdir)
        with open(os.path.join(tdir, "test.sh"), "w") as f:
            f.write(". /lib/ktest.sh\n" + self.script)
        tcpio = os.path.join(self.workdir, self.name + "-script.cpio")
        make_cpio(tdir, tcpio)
        self.initrd = os.path.join(self.workdir, self.name + "-initrd.cpio")
        with open(self.initrd, "wb") as o:
            for p in (base, tcpio):
                with open(p, "rb") as i:
                    shutil.copyfileobj(i, o)
        relay = os.path.join(HERE, "relay.py")
        for p in (relay, self.sock):
            if "," in p:
                raise RuntimeError("a comma in %s breaks qemu's option syntax" % p)
        self.relay_log = os.path.join(self.workdir, self.name + "-relay.log")
        netdev = ("user,id=n0,restrict=on,guestfwd=tcp:%s:%d-cmd:%s %s %s %s"
                  % (NBD_HOST, NBD_PORT, sys.executable, relay, self.sock, self.relay_log))
        cmd = ["nice", "-n", "10", ARCHES[self.arch]["qemu"],
               "-accel", "tcg", "-m", str(self.mem), "-smp", "1",
               "-nodefaults", "-no-reboot", "-display", "none", "-monitor", "none",
               "-serial", "stdio",
               "-kernel", kernel, "-initrd", self.initrd,
               "-append", "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init",
               "-netdev", netdev, "-device", "virtio-net-pci,netdev=n0"]
        self.console_path = os.path.join(self.workdir, "%s-%s.console" % (self.arch, self.name))
        self.console = open(self.console_path, "w")
        log("+ " + " ".join(cmd))
        self.t_start = time.time()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            now = time.time()
            self.console.write(line + "\n")
            self.console.flush()
            print("  [%s %6.1f] %s" % (self.arch, now - self.t_start, line), flush=True)
            with self.cond:
                if line.startswith("KTEST-BOOTED") and self.t_booted is None:
                    self.t_booted = now
                elif line.startswith("KTEST-MARK ready") and self.t_ready is None:
                    self.t_ready = now
                elif line.startswith("KTEST-EXIT "):
                    self.exit_rc = int(line.split()[1])
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def _deadline(self):
        return self.t_start + self.timeout

    def wait_for(self, prefix, timeout=None):
        """The first console line starting with prefix (waits for it, at most
        `timeout` s and never past the run's deadline); None if it never came
        (the guest ended or the time ran out)."""
        end = self._deadline() if timeout is None else min(self._deadline(), time.time() + timeout)
        with self.cond:
            while True:
                for ln in self.lines:
                    if ln.startswith(prefix):
                        return ln
                if self.proc.poll() is not None and not self.reader.is_alive():
                    return None
                left = end - time.time()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 1.0))

    def wait(self):
        """Wait for qemu to end, killing it by PID at the deadline; returns
        the guest script's exit code (None when it never printed one)."""
        left = self._deadline() - time.time()
        try:
            self.proc.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            log("qemu (%s %s) overran its %ds: killed (pid %d)"
                % (self.arch, self.name, self.timeout, self.proc.pid))
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)
        self.t_end = time.time()
        self.console.close()
        self.report_times()
        return self.exit_rc

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def report_times(self):
        def d(a, b):
            return "%.1fs" % (b - a) if a and b else "n/a"
        log("TIMING %s %s: boot to /init %s, to network up %s, script %s, total %s"
            % (self.arch, self.name, d(self.t_start, self.t_booted),
               d(self.t_start, self.t_ready), d(self.t_ready, self.t_end),
               d(self.t_start, self.t_end)))

    def kvs(self):
        """The KTEST-KV lines as a dict (the last value of each key)."""
        out = {}
        for ln in self.lines:
            if ln.startswith("KTEST-KV "):
                parts = ln.split(None, 2)
                out[parts[1]] = parts[2] if len(parts) > 2 else ""
        return out

    def text(self):
        return "\n".join(self.lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        return False


# A guest script's writing loop (its %(seconds)d filled in by the test):
# files /mnt/w0, /mnt/w1, ... of 256 KiB from /dev/urandom, each with dd
# conv=fsync, 0.2 s apart, for that many seconds; each one's sha256 as
# "KTEST-KV written:/wN SHA", or its failure as "KTEST-KV write_error:/wN".
FSYNC_WRITES = r"""end=$(( $(cut -d. -f1 /proc/uptime) + %(seconds)d ))
i=0
mark writing
while [ $(cut -d. -f1 /proc/uptime) -lt $end ]; do
	if dd if=/dev/urandom of=/mnt/w$i bs=64k count=4 conv=fsync 2>/tmp/dd.err; then
		kv written:/w$i $(sha256sum /mnt/w$i | cut -d' ' -f1)
	else
		kv write_error:/w$i $(tail -1 /tmp/dd.err)
	fi
	i=$((i + 1))
	sleep 0.2
done
mark written
"""


def run_guest(arch, script, sock, workdir, name="guest", timeout=600, **kw):
    """Boot, run the script, wait for the end: the Guest (rc in .exit_rc)."""
    g = Guest(arch, script, sock, workdir, name=name, timeout=timeout, **kw)
    with g:
        g.start()
        g.wait()
    return g


# ---- Host side helpers shared by the tests. ----

def big_backend(workdir, size, name="big.img"):
    """A sparse file of `size` bytes: in /dev/shm (tmpfs takes 64 TiB; ext4
    caps a file at 16 TiB) when there is one, else in workdir."""
    base = nbdtest.shm_dir() or workdir
    d = os.path.join(base, "nbdcached-kernel-%d" % os.getpid())
    os.makedirs(d, exist_ok=True)
    atexit.register(shutil.rmtree, d, True)
    path = os.path.join(d, name)
    try:
        nbdtest.sparse_file(path, size)
    except OSError as e:
        raise RuntimeError("cannot make a %d-byte sparse file in %s: %s" % (size, d, e))
    return path


def remove_backend(path):
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def command_counts(daemon_log):
    """From a daemon log at --log-level debug: how many of each NBD command
    the clients sent, WRITEs with FUA counted apart ("NBD_CMD_WRITE+FUA")."""
    counts = {}
    for m in re.finditer(r"conn \d+: (NBD_CMD_\w+) flags 0x([0-9a-f]+) offset", daemon_log):
        name = m.group(1)
        if name == "NBD_CMD_WRITE" and int(m.group(2), 16) & 1:
            name += "+FUA"
        counts[name] = counts.get(name, 0) + 1
    return counts


def relay_connections(guest):
    """How many guest connections reached the daemon (relay log lines)."""
    try:
        with open(guest.relay_log) as f:
            text = f.read()
    except OSError:
        return 0
    return text.count(": connected")


def debugfs_cat(image, path):
    """The bytes of `path` in the ext4 file system on `image` (debugfs)."""
    p = subprocess.run(["debugfs", "-R", "cat " + path, image], capture_output=True, timeout=300)
    if p.returncode != 0:
        raise nbdtest.Failed("debugfs cat %s on %s: exit %d: %s"
                             % (path, image, p.returncode, p.stderr.decode()[-500:]))
    return p.stdout


def check_files(checks, image, files):
    """Each {path: sha256} of files, as the guest printed it, read back
    from the ext4 on image (debugfs) and compared; the matches counted."""
    import hashlib
    good = 0
    for path, want in sorted(files.items()):
        try:
            got = hashlib.sha256(debugfs_cat(image, path)).hexdigest()
        except nbdtest.Failed as e:
            checks.add(str(e))
            continue
        if checks.expect(got == want, "%s: sha256 %s on the backend, the guest wrote %s"
                         % (path, got, want)):
            good += 1
    return good


def e2fsck(image, timeout=600):
    """e2fsck -fn on the image: (exit code, output)."""
    t0 = time.time()
    p = subprocess.run(["e2fsck", "-fn", image], capture_output=True, text=True, timeout=timeout)
    log("+ e2fsck -fn %s: exit %d in %.1fs" % (image, p.returncode, time.time() - t0))
    log((p.stdout + p.stderr).rstrip()[-3000:])
    return p.returncode, p.stdout + p.stderr
