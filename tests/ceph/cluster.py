"""A throwaway single-node Ceph cluster for the tests, from Debian's packages.

One ceph-mon, one ceph-mgr and NOSDS ceph-osd (BlueStore on sparse files),
all on 127.0.0.1 (msgr2 only), cephx on, pool size 1, everything (config,
keyrings, data, logs, admin sockets) in a directory the caller owns. Each
daemon runs in the foreground as our child and is stopped by its PID.

    with Cluster(tmpdir) as c:
        c.rbd("create", "--size", "64M", "rbd/img")
        ... c.conf (the ceph.conf path), c.admin_keyring ...
"""
import os
import signal
import socket
import subprocess
import time
import uuid

CEPH_BINARIES = ("ceph-mon", "ceph-osd", "ceph-mgr", "ceph", "rbd", "monmaptool",
                 "ceph-authtool")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CephError(Exception):
    pass


class Cluster:
    def __init__(self, root, osds=1, pool="rbd", watch_timeout=8, log=print):
        self.root = os.path.abspath(root)
        self.nosds = osds
        self.pool = pool
        self.log = log
        self.fsid = str(uuid.uuid4())
        self.port = _free_port()
        self.conf = os.path.join(self.root, "ceph.conf")
        self.admin_keyring = os.path.join(self.root, "admin.keyring")
        self.procs = {}  # name -> Popen
        self.watch_timeout = watch_timeout
        os.makedirs(os.path.join(self.root, "run"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "log"), exist_ok=True)

    # ---- helpers ----
    def env(self):
        e = dict(os.environ)
        e["CEPH_CONF"] = self.conf
        return e

    def run(self, *cmd, timeout=120, check=True, input=None):
        p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, env=self.env(), input=input)
        out = p.stdout.decode(errors="replace")
        if check and p.returncode != 0:
            raise CephError("%s: exit %d: %s" % (" ".join(cmd), p.returncode, out[-2000:]))
        return out

    def ceph(self, *args, timeout=120, check=True):
        return self.run("ceph", "--connect-timeout", "20", *args, timeout=timeout,
                        check=check)

    def rbd(self, *args, timeout=120, check=True):
        return self.run("rbd", *args, timeout=timeout, check=check)

    def _spawn(self, name, cmd):
        logf = open(os.path.join(self.root, "log", name + ".out"), "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                            env=self.env(), start_new_session=True)
        logf.close()

    def _write_conf(self):
        r = self.root
        conf = """[global]
fsid = %(fsid)s
mon host = [v2:127.0.0.1:%(port)d]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind msgr2 = true
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
keyring = %(r)s/$name.keyring
run dir = %(r)s/run
admin socket = %(r)s/run/$name.asok
log file = %(r)s/log/$name.log
log to stderr = false
err to stderr = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail crit = 1
mon data avail warn = 2
osd crush chooseleaf type = 0
osd client watch timeout = %(wt)d
[mon]
mon data = %(r)s/$name
[mgr]
mgr data = %(r)s/$name
mgr initial modules =
[osd]
osd data = %(r)s/$name
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 8589934592
bluestore fsck on mount = false
bluestore fsck on mkfs = false
bluestore cache autotune = false
bluestore cache size = 268435456
osd memory target = 1073741824
osd op num shards = 2
osd op num threads per shard = 1
osd max object name len = 460
osd max object namespace len = 64
""" % {"fsid": self.fsid, "port": self.port, "r": r, "wt": self.watch_timeout}
        with open(self.conf, "w") as f:
            f.write(conf)

    # ---- start ----
    def start(self):
        t0 = time.time()
        self._write_conf()
        r = self.root
        monkr = os.path.join(r, "mon.a.keyring")
        self.run("ceph-authtool", "--create-keyring", monkr, "--gen-key", "-n", "mon.",
                 "--cap", "mon", "allow *")
        self.run("ceph-authtool", "--create-keyring", self.admin_keyring, "--gen-key",
                 "-n", "client.admin", "--cap", "mon", "allow *", "--cap", "osd", "allow *",
                 "--cap", "mgr", "allow *")
        # the admin key also as client.admin.keyring ($name.keyring)
        with open(self.admin_keyring) as f:
            admin = f.read()
        with open(os.path.join(r, "client.admin.keyring"), "w") as f:
            f.write(admin)
        self.run("ceph-authtool", monkr, "--import-keyring", self.admin_keyring)
        monmap = os.path.join(r, "monmap")
        self.run("monmaptool", "--create", "--addv", "a", "[v2:127.0.0.1:%d]" % self.port,
                 "--fsid", self.fsid, monmap)
        self.run("ceph-mon", "--conf", self.conf, "--mkfs", "-i", "a", "--monmap", monmap,
                 "--keyring", monkr)
        self._spawn("mon.a", ["ceph-mon", "-f", "--conf", self.conf, "-i", "a"])
        self.ceph("status", timeout=60)
        self.ceph("config", "set", "mon", "auth_allow_insecure_global_id_reclaim", "false")
        # mgr
        mgrdir = os.path.join(r, "mgr.x")
        os.makedirs(mgrdir, exist_ok=True)
        self.ceph("auth", "get-or-create", "mgr.x", "mon", "allow profile mgr", "osd",
                  "allow *", "mds", "allow *", "-o", os.path.join(r, "mgr.x.keyring"))
        self._spawn("mgr.x", ["ceph-mgr", "-f", "--conf", self.conf, "-i", "x"])
        for i in range(self.nosds):
            self.add_osd()
        self.ceph("osd", "pool", "create", self.pool, "16", "16")
        self.rbd("pool", "init", self.pool)
        self.wait_healthy()
        self.log("ceph: cluster up in %.1f s (%d OSD(s), mon on 127.0.0.1:%d); %s" %
                 (time.time() - t0, self.nosds, self.port, self.memory()))
        return self

    def memory(self):
        """'RSS mon.a N MiB, ...' of the running daemons (VmRSS)."""
        parts = []
        for name, p in sorted(self.procs.items()):
            try:
                with open("/proc/%d/status" % p.pid) as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                parts.append("%s %d MiB" % (name, kb // 1024))
            except (OSError, StopIteration):
                pass
        return "RSS " + ", ".join(parts)

    def add_osd(self):
        u = str(uuid.uuid4())
        osd_id = int(self.ceph("osd", "new", u).strip())
        name = "osd.%d" % osd_id
        d = os.path.join(self.root, name)
        os.makedirs(d, exist_ok=True)
        self.ceph("auth", "get-or-create", name, "mon", "allow profile osd", "osd", "allow *",
                  "mgr", "allow profile osd", "-o", os.path.join(self.root, name + ".keyring"))
        self.run("ceph-osd", "--conf", self.conf, "-i", str(osd_id), "--mkfs", "--osd-uuid", u,
                 timeout=300)
        self.start_osd(osd_id)
        return osd_id

    def start_osd(self, osd_id):
        self._spawn("osd.%d" % osd_id, ["ceph-osd", "-f", "--conf", self.conf, "-i", str(osd_id)])

    def wait_healthy(self, timeout=120):
        """Every PG active+clean."""
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            out = self.ceph("pg", "stat", check=False)
            # "16 pgs: 16 active+clean; ..."
            try:
                head = out.split(";")[0]
                total = int(head.split()[0])
                parts = head.split(":", 1)[1].strip().split(",")
                clean = sum(int(p.split()[0]) for p in parts if p.split()[1] == "active+clean")
                if total > 0 and clean == total:
                    return
            except (ValueError, IndexError):
                pass
            time.sleep(0.5)
        raise CephError("placement groups not clean within %d s: %s" % (timeout, out))

    # ---- faults ----
    def pid(self, name):
        return self.procs[name].pid

    def signal(self, name, sig):
        p = self.procs.get(name)
        if p and p.poll() is None:
            os.kill(p.pid, sig)

    def kill(self, name):
        p = self.procs.get(name)
        if p and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()

    # ---- stop ----
    def stop(self):
        if any(p.poll() is None for p in self.procs.values()):
            self.log("ceph: stopping; %s" % self.memory())
        for name in sorted(self.procs, key=lambda n: (not n.startswith("osd"), n)):
            p = self.procs[name]
            if p.poll() is not None:
                continue
            try:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGTERM)
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
            except ProcessLookupError:
                pass
        self.procs.clear()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return False

    def dump_logs(self, lines=40):
        d = os.path.join(self.root, "log")
        for n in sorted(os.listdir(d)):
            try:
                with open(os.path.join(d, n), errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                continue
            self.log("---- %s ----" % n)
            for line in tail:
                self.log(line)
