#!/usr/bin/python3
"""An rbd: export against a byte model, on a real (throwaway) Ceph cluster.

For each cache mode (writeback, writethrough, writearound, none), an image of
64 MiB served as rbd:rbd/IMAGE with a 16 MiB cache (so entries are evicted
and read again from the image): random READ / WRITE (some FUA) / TRIM /
WRITE_ZEROES / FLUSH from three connections, every READ checked against the
model; then a FLUSH, the whole export read back, block status's zero ranges
checked against the model, and the image read with `rbd export` while the
daemon still serves it: it must be the model, byte for byte (FLUSH put it
on the OSDs). One mode runs as a cephx user of its own (id= and keyring=,
with the 'profile rbd' caps an admin would give).

Then the writeback image is served by qemu-nbd's own rbd driver (Debian's
qemu-block-extra) and read whole: our bytes are Ceph's.

Also: the export's kind is "rbd" in `nbdcachectl exports`, a snapshot
(rbd:POOL/IMAGE@SNAP) is served read-only with the bytes it had, an image
in a namespace (rbd:POOL/NAMESPACE/IMAGE) is that one, `nbdcachectl
resize` grows and cuts the image and follows an admin's `rbd resize`, a bad
spec is refused by --check-config with a message naming what is wrong, and
an image without the exclusive-lock feature is refused unless readonly.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402
from cluster import Cluster  # noqa: E402
from model import Model, MiB  # noqa: E402

SIZE = 64 * MiB
OPS = int(os.environ.get("RBD_MODEL_OPS", "1500"))
MODES = ("writeback", "writethrough", "writearound", "none")


def spec(c, image, user=None):
    s = "rbd:rbd/%s?conf=%s" % (image, c.conf)
    if user:
        s += "&id=%s&keyring=%s" % (user, os.path.join(c.root, "client.%s.keyring" % user))
    return s


def model_run(c, mode, seed, checks):
    image = "m-" + mode
    c.rbd("create", "--size", str(SIZE // MiB), "rbd/" + image)
    user = "nbd" if mode == "writethrough" else None
    m = Model(SIZE, seed)
    t0 = time.time()
    with nbdtest.running_daemon([(image, spec(c, image, user), "cache-mode=" + mode)],
                                extra=["--cache-size", "16M"], ready_timeout=60) as d:
        hs = [nbdtest.libnbd_handle(d.unix_uri(image), meta=True) for _ in range(3)]
        m.run(hs, OPS)
        for h in hs:
            h.flush()
        m.check_bytes(nbdtest.read_whole(hs[0], SIZE), "%s: the export read whole" % mode)
        # Whole objects zeroed are freed: block status says so (through
        # the cache, whatever it holds of them).
        hs[1].zero(8 * MiB, 32 * MiB)
        m.data[32 * MiB:40 * MiB] = bytes(8 * MiB)
        hs[1].flush()
        zero = m.check_zero_extents(hs[0], "%s: block status" % mode)
        checks.expect(zero >= 8 * MiB, "%s: block status called only %d bytes zero after "
                      "8 MiB of whole objects were zeroed" % (mode, zero))
        out = os.path.join(c.root, image + ".img")
        c.rbd("export", "--no-progress", "rbd/" + image, out)
        with open(out, "rb") as f:
            m.check_bytes(f.read(), "%s: rbd export after FLUSH" % mode)
        os.unlink(out)
        ex = nbdtest.control_request(d.control, {"command": "exports"})["exports"]
        kinds = [e["kind"] for e in ex]
        checks.expect(kinds == ["rbd"], "%s: exports says kind %s" % (mode, kinds))
        for h in hs:
            h.shutdown()
    log("%s: %d ops (%s), %d bytes checked, %d bytes block status called zero, %.1f s" %
        (mode, OPS, ", ".join("%s %d" % kv for kv in sorted(m.counts.items())), m.checked,
         zero, time.time() - t0))
    return m


def qemu_nbd_reads(c, image, m):
    sock = os.path.join(c.root, "qemu-nbd.sock")
    logpath = os.path.join(c.root, "qemu-nbd.log")
    cmd = ["qemu-nbd", "--read-only", "--format=raw", "--socket=" + sock, "--persistent",
           "rbd:rbd/%s:conf=%s" % (image, c.conf)]
    log("+ " + " ".join(cmd))
    with open(logpath, "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
    try:
        nbdtest.wait_until(lambda: os.path.exists(sock) or p.poll() is not None, 60)
        if p.poll() is not None:
            raise Failed("qemu-nbd exited with %d: %s" % (p.returncode, open(logpath).read()))
        h = nbdtest.libnbd_handle("nbd+unix:///?socket=" + sock)
        m.check_bytes(nbdtest.read_whole(h, SIZE), "qemu-nbd rbd:%s read whole" % image)
        h.shutdown()
        log("qemu-nbd rbd: reads the %s image as the model says" % image)
    finally:
        p.terminate()
        p.wait()


def snapshot_readonly(c, checks):
    c.rbd("create", "--size", "8", "rbd/snapimg")
    with nbdtest.running_daemon([("s", spec(c, "snapimg"), "")], ready_timeout=60) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("s"))
        h.pwrite(b"\x5a" * 65536, 0)
        h.flush()
        h.shutdown()
    c.rbd("snap", "create", "rbd/snapimg@one")
    snap = "rbd:rbd/snapimg@one?conf=%s" % c.conf
    with nbdtest.running_daemon([("s", snap, "")], ready_timeout=60) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("s"))
        checks.expect(h.is_read_only() == 1, "a snapshot export is read-only")
        checks.expect(h.pread(65536, 0) == b"\x5a" * 65536, "the snapshot has its bytes")
        h.shutdown()


def namespace_image(c, checks):
    """rbd:POOL/NAMESPACE/IMAGE reaches the image in that namespace."""
    c.rbd("namespace", "create", "rbd/tenant")
    c.rbd("create", "--size", "8", "rbd/tenant/img")
    c.rbd("create", "--size", "8", "rbd/img")  # same name, default namespace
    data = os.urandom(65536)
    with nbdtest.running_daemon([("t", "rbd:rbd/tenant/img?conf=%s" % c.conf, "")],
                                ready_timeout=60) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("t"))
        h.pwrite(data, 4096)
        h.flush()
        h.shutdown()
    for image, want in (("rbd/tenant/img", data), ("rbd/img", bytes(65536))):
        out = os.path.join(c.root, "ns.img")
        c.rbd("export", "--no-progress", image, out)
        with open(out, "rb") as f:
            f.seek(4096)
            checks.expect(f.read(65536) == want, "%s does not hold what it should" % image)
        os.unlink(out)


def image_size(c, image):
    return json.loads(c.rbd("info", "--format", "json", "rbd/" + image))["size"]


def resize_image(c, checks):
    """nbdcachectl resize grows and cuts the image itself (rbd_resize2), and
    picks up an `rbd resize` an admin ran while the daemon owns the image
    (librbd hands that to the owner)."""
    c.rbd("create", "--size", "8", "rbd/rs")
    with nbdtest.running_daemon([("r", "rbd:rbd/rs?conf=%s" % c.conf, "")],
                                ready_timeout=60) as d:
        steps = (("16M", None, 16 * MiB), (None, "32M", 32 * MiB), ("8M", None, 8 * MiB))
        for ours, admins, want in steps:
            if admins:
                c.rbd("resize", "--size", admins, "rbd/rs", timeout=60)
                time.sleep(1)  # the owner's header refresh
            p = nbdtest.nbdcachectl(d, "resize", "r", *([ours] if ours else []))
            if not checks.expect(p.returncode == 0 and d.alive(),
                                 "resize %s: exit %d %s (daemon %s)" %
                                 (ours or "(follow)", p.returncode, p.stderr.strip(),
                                  "alive" if d.alive() else "dead")):
                return
            got = (image_size(c, "rs"), nbdtest.export_size(d, "r"))
            checks.expect(got == (want, want), "after resize %s: image %d, export %d bytes, "
                          "wanted %d" % (ours or admins, got[0], got[1], want))
        log("resize: grown to 16 MiB, followed the admin's 32 MiB, cut to 8 MiB")


def refusals(c, checks):
    bad = [("rbd:rbd", "expected rbd:POOL/IMAGE"),
           ("rbd:rbd/x?user=y", "unknown key 'user'"),
           ("rbd:rbd/x@", "bad snapshot name")]
    for s, words in bad:
        p = subprocess.run([nbdtest.NBDCACHED, "--check-config", "--export", "x=" + s],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        checks.expect(p.returncode != 0 and words in p.stdout,
                     "--check-config %s: exit %d, %r (wanted %r)" % (s, p.returncode,
                                                                     p.stdout.strip(), words))
    c.rbd("create", "--size", "8", "--image-feature", "layering", "rbd/nolock")
    with nbdtest.running_daemon([("n", spec(c, "nolock"), "readonly")], ready_timeout=60) as d:
        h = nbdtest.libnbd_handle(d.unix_uri("n"))
        checks.expect(h.is_read_only() == 1, "the image without exclusive-lock, readonly")
        h.shutdown()
    p = subprocess.run([nbdtest.NBDCACHED, "--foreground", "--unix",
                        os.path.join(c.root, "x.sock"), "--export", "n=" + spec(c, "nolock")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    checks.expect(p.returncode != 0 and "exclusive-lock" in p.stdout,
                 "without exclusive-lock: exit %d, says %r" % (p.returncode, p.stdout[-400:]))


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(prefix="nbdcached-ceph-") as tmp:
        with Cluster(os.path.join(tmp, "ceph"), log=log) as c:
            c.ceph("auth", "get-or-create", "client.nbd", "mon", "profile rbd", "osd",
                   "profile rbd pool=rbd", "-o", os.path.join(c.root, "client.nbd.keyring"))
            models = {}
            for i, mode in enumerate(MODES):
                try:
                    models[mode] = model_run(c, mode, 1000 + i, checks)
                except Exception as e:  # Mismatch, Failed, nbd.Error
                    checks.expect(False, "%s: %s" % (mode, e))
            if "writeback" in models:
                try:
                    qemu_nbd_reads(c, "m-writeback", models["writeback"])
                except Exception as e:
                    checks.expect(False, "qemu-nbd: %s" % e)
            for t in (snapshot_readonly, namespace_image, resize_image, refusals):
                try:
                    t(c, checks)
                except Exception as e:
                    checks.expect(False, "%s: %s" % (t.__name__, e))
    checks.finish("rbd model")


if __name__ == "__main__":
    main()
