#!/usr/bin/python3
"""An rbd: export on a node with a cache device (issue 40, item 1): what a
FLUSH acknowledged is on the OSDs, where a node that takes the image over
finds it, and the old node's device never puts its bytes back over the new
owner's.

1. Failover. The image starts with known bytes (`rbd import`). Node A
   serves it with --cache-device (write-back, --dirty-expire 3600: nothing
   is written back on its own; --cache-device-warm all, an 8 MiB memory
   cache). A reads [1, 15) MiB twice, so that clean pages of the image go
   to its level-2 cache; a client WRITEs 1 MiB of random data at 0 and
   FLUSH succeeds; `rbd export` must then show it (the FLUSH's promise).
   A is SIGKILLed. Node B (rbd-takeover = wait, no cache device) takes the
   image over once Ceph has blocklisted A and must read A's FLUSHed MiB.
   B WRITEs and FLUSHes new data over [0, 5) MiB (A's logged MiB and the
   pages A's level 2 holds) and stops cleanly (SIGTERM). A starts again on
   its device: it must serve B's bytes there (neither a log replay of its
   old MiB nor its level-2 pages from before the restart), and after its
   SIGTERM the image must still be B's bytes.
2. A device from an earlier version. A build from before the fix
   (NBDCACHED_OLD, which answered an rbd: export's FLUSH from the log)
   serves an image with a cache device: 1 MiB WRITE + FLUSH, SIGKILL; its
   log holds that MiB. The daemon under test, started on that device with
   the same export, must refuse to start with a message naming the
   export, the image and the bytes, and leave the image as it was. With
   --cache-device-discard-dirty img it starts, says it threw the bytes
   away, serves the image's own bytes, and the image is unchanged after
   its SIGTERM; the next start on the device needs no option. Without
   NBDCACHED_OLD this case is skipped (said in the log): it needs a
   binary from before commit eaf5b69 (e.g. a build of eaf5b69^).

Everything on 127.0.0.1 and Unix sockets; every daemon is started here and
stopped by its PID.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, HERE)
import nbd  # noqa: E402
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402
from cluster import Cluster  # noqa: E402
from rbd_owner import Node, image_bytes  # noqa: E402

MiB = 1 << 20
IMAGE_SIZE = 16 * MiB
DEVICE_SIZE = 128 * MiB
WATCH_TIMEOUT = 8  # the cluster's osd client watch timeout (as rbd_owner.py)
OLD = os.environ.get("NBDCACHED_OLD")


def device(root, name):
    """A fresh cache device file: sparse (zeros: formatted at start),
    readable by its owner alone."""
    path = os.path.join(root, name)
    with open(path, "wb") as f:
        f.truncate(DEVICE_SIZE)
    os.chmod(path, 0o600)
    return path


def dev_stats(node):
    st = nbdtest.control_request(node.control, {"command": "stats"})
    return st["cache"].get("cache_device") or {}


def same(got, want):
    """'' or where got first differs from want, and what it holds there."""
    if got == want:
        return ""
    i = nbdtest.first_diff(got, want)
    return " (first difference at byte %s)" % i


def describe(got, named):
    """Which of the named byte strings got is, for the log."""
    for name, want in named:
        if got == want:
            return name
    if got == bytes(len(got)):
        return "zeros"
    return "none of %s" % ", ".join(n for n, _ in named)


def failover(c, checks, root):
    image = "cd1"
    spec = "rbd:rbd/%s?conf=%s" % (image, c.conf)
    initial = os.urandom(IMAGE_SIZE)
    src = os.path.join(root, "cd1.src")
    with open(src, "wb") as f:
        f.write(initial)
    c.rbd("import", "--no-progress", src, "rbd/" + image)
    os.unlink(src)
    dev = device(root, "a.dev")
    # 8 MiB of memory: 1 MiB dirty stays under the dirty-low mark (25%), so
    # nothing is written back before the FLUSH; reads of 14 MiB evict.
    dev_args = ["--cache-device", dev, "--cache-mode", "writeback", "--cache-size", "8M",
                "--cache-device-warm", "all"]
    pa = os.urandom(MiB)
    pb = os.urandom(5 * MiB)
    a = Node(root, "a", spec, extra=dev_args)
    b = a2 = None
    try:
        a.wait_log("ready:", 60)
        h = a.handle()
        # Clean pages of the image through 8 MiB of memory: [1, 15) MiB
        # twice, the first ones evicted to level 2.
        for _ in range(2):
            for off in range(MiB, 15 * MiB, MiB):
                checks.expect(h.pread(MiB, off) == initial[off:off + MiB],
                              "A read wrong bytes at %d" % off)
        h.pwrite(pa, 0)
        h.flush()
        st = dev_stats(a)
        log("A: 1 MiB written at 0 and FLUSHed; its cache device logged %d bytes in %d "
            "record(s)" % (st.get("bytes_logged", -1), st.get("records", -1)))
        on_osds = image_bytes(c, image, MiB)
        checks.expect(on_osds == pa,
                      "A answered the FLUSH but the image (rbd export) does not hold the MiB "
                      "it covered: it holds %s" % describe(on_osds, (
                          ("the image's initial bytes", initial[:MiB]),)))
        nbdtest.wait_until(lambda: dev_stats(a).get("l2", {}).get("staged_bytes", 1) == 0,
                           10, step=0.1)
        l2 = dev_stats(a).get("l2", {})
        log("A: level 2 holds %d bytes (%d stored, %d staged)" % (
            l2.get("used_bytes", -1), l2.get("stored_bytes", -1), l2.get("staged_bytes", -1)))
        b = Node(root, "b", spec, takeover="wait")
        b.wait_log("waiting for the image's exclusive lock", 60)
        t0 = time.time()
        a.kill()
        log("A killed (SIGKILL) after its FLUSH was answered")
        b.wait_log("took the image's exclusive lock", WATCH_TIMEOUT * 4 + 30)
        b.wait_log("ready:", 30)
        hb = b.handle()
        got = hb.pread(MiB, 0)
        log("B took over %.1f s after A died; [0, 1 MiB) on B is %s" % (
            time.time() - t0, describe(got, (("A's FLUSHed MiB", pa),
                                             ("the image's initial bytes", initial[:MiB])))))
        checks.expect(got == pa, "B does not serve the MiB whose FLUSH A answered: it reads "
                      "%s" % describe(got, (("the image's initial bytes", initial[:MiB]),)))
        hb.pwrite(pb, 0)
        hb.flush()
        hb.shutdown()
        rc = b.stop()
        checks.expect(rc == 0, "B exited with %s" % rc)
        now = image_bytes(c, image, 5 * MiB)
        checks.expect(now == pb, "B's FLUSHed [0, 5 MiB) is not on the image%s" % same(now, pb))
        log("B wrote and FLUSHed [0, 5 MiB), stopped (exit %s)" % rc)

        a2 = Node(root, "a-again", spec, extra=dev_args)
        a2.wait_log("ready:", 60)
        st = dev_stats(a2)
        l2 = st.get("l2", {})
        log("A started again on its device: replayed %d bytes from its log; level 2 loaded "
            "%d bytes" % (st.get("replay_bytes", -1), l2.get("loaded_bytes", -1)))
        h2 = a2.handle()
        served = h2.pread(MiB, 0)
        checks.expect(served == pb[:MiB],
                      "A, started again, serves %s at [0, 1 MiB), not B's FLUSHed bytes" %
                      describe(served, (("its own old MiB (its log replayed over B's data)",
                                         pa),)))
        served = b"".join(h2.pread(MiB, off) for off in range(MiB, 5 * MiB, MiB))
        checks.expect(served == pb[MiB:],
                      "A, started again, serves %s at [1, 5 MiB), not B's FLUSHed bytes%s" % (
                          describe(served, (("the image's initial bytes (its level-2 pages "
                                             "from before the restart)", initial[MiB:5 * MiB]),
                                            )), same(served, pb[MiB:])))
        l2 = dev_stats(a2).get("l2", {})
        log("A (again): level-2 hits %d (%d bytes)" % (l2.get("hits", -1),
                                                        l2.get("hit_bytes", -1)))
        h2.shutdown()
        rc = a2.stop()
        checks.expect(rc == 0, "A (again) exited with %s" % rc)
        now = image_bytes(c, image, 5 * MiB)
        checks.expect(now[:MiB] == pb[:MiB],
                      "after A's restart the image's [0, 1 MiB) is %s, not B's FLUSHed "
                      "data" % describe(now[:MiB], (("A's old MiB (its log replayed over "
                                                     "B's data)", pa),)))
        checks.expect(now == pb, "after A's restart the image's [0, 5 MiB) is not B's "
                      "FLUSHed data%s" % same(now, pb))
        log("after A's restart and SIGTERM the image's [0, 1 MiB) is %s" % describe(
            now[:MiB], (("B's data", pb[:MiB]), ("A's old MiB", pa))))
    finally:
        for n in (a, b, a2):
            if n:
                n.kill()


def old_device_refused(c, checks, root):
    if not OLD:
        log("not run here: old_device_refused: NBDCACHED_OLD (a build from before commit eaf5b69, "
            "which logged an rbd: export's FLUSHes) is not set")
        return
    image = "cd2"
    spec = "rbd:rbd/%s?conf=%s" % (image, c.conf)
    c.rbd("create", "--size", str(IMAGE_SIZE // MiB), "rbd/" + image)
    dev = device(root, "old.dev")
    dev_args = ["--cache-device", dev, "--cache-mode", "writeback"]
    pa = os.urandom(MiB)
    nodes = []

    def node(name, **kw):
        n = Node(root, name, spec, **kw)
        nodes.append(n)
        return n

    try:
        old = node("old", binary=OLD, extra=dev_args)
        old.wait_log("ready:", 60)
        h = old.handle()
        h.pwrite(pa, 0)
        h.flush()
        logged = dev_stats(old).get("bytes_logged", 0)
        if not logged:
            raise Failed("NBDCACHED_OLD=%s logged nothing for the FLUSH of an rbd: export: "
                         "not a build from before the fix" % OLD)
        old.kill()
        before = image_bytes(c, image, 2 * MiB)
        log("the old build (%s) logged %d bytes for a 1 MiB WRITE + FLUSH; SIGKILLed; the "
            "image's [0, 1 MiB) is %s" % (OLD, logged, describe(
                before[:MiB], (("that MiB", pa),))))

        t0 = time.time()
        new = node("new-refused", takeover="wait", extra=dev_args)
        # It waits for the dead owner's lock (its watch expires), then
        # refuses, or (before the fix) replays the log and is ready.
        nbdtest.wait_until(lambda: new.proc.poll() is not None or "ready:" in new.log_text(),
                           WATCH_TIMEOUT * 4 + 60, step=0.1)
        rc = new.proc.poll()
        text = new.log_text()
        if rc is None:
            ready = "ready:" in text
            new.kill()
            replay = [ln for ln in text.splitlines() if "to write back" in ln or
                      "written back in" in ln]
            log("its log:\n" + text[-3000:])
            raise Failed("the daemon under test %s on a device holding %d bytes of an rbd: "
                         "export's records instead of refusing; it said: %s" % (
                             "started and served" if ready else "did not exit", logged,
                             " / ".join(ln.split(": ", 1)[-1].split(";")[0] for ln in replay) or "nothing"))
        line = next((ln for ln in text.splitlines() if "cache-device-discard-dirty" in ln),
                    text.strip().splitlines()[-1] if text.strip() else "")
        log("refused (exit %s, %.1f s after start): %s" % (rc, time.time() - t0, line))
        checks.expect(rc != 0, "exit 0 on a device holding an rbd: export's records")
        for what, words in (("the export", 'export "img"'), ("the image", "rbd:rbd/%s" % image),
                            ("the bytes", "%d bytes" % MiB)):
            checks.expect(words in line, "the refusal does not name %s (%r): %s" % (
                what, words, line or text[-1500:]))
        now = image_bytes(c, image, 2 * MiB)
        checks.expect(now == before, "the image changed during the refused start%s" %
                      same(now, before))

        d = node("new-discard", takeover="wait",
                 extra=dev_args + ["--cache-device-discard-dirty", "img"])
        d.wait_log("ready:", WATCH_TIMEOUT * 4 + 60)
        line = next((ln for ln in d.log_text().splitlines() if "throwing away" in ln), "")
        log("with --cache-device-discard-dirty img: %s" % (line or "(no line says so)"))
        checks.expect("%d bytes" % MiB in line and '"img"' in line,
                      "the start with --cache-device-discard-dirty img does not say it threw "
                      "away the export's %d bytes:\n%s" % (MiB, d.log_text()[-1500:]))
        hd = d.handle()
        got = hd.pread(2 * MiB, 0)
        checks.expect(got == before, "with the records thrown away the daemon serves %s, "
                      "not the image's bytes" % describe(got[:MiB], (("the old MiB", pa),)))
        hd.shutdown()
        rc = d.stop()
        checks.expect(rc == 0, "the daemon with --cache-device-discard-dirty exited %s" % rc)
        now = image_bytes(c, image, 2 * MiB)
        checks.expect(now == before, "the image changed after the records were thrown "
                      "away%s" % same(now, before))
        again = node("new-again", extra=dev_args)
        again.wait_log("ready:", 60)
        rc = again.stop()
        checks.expect(rc == 0, "the next start on the device exited %s" % rc)
        log("the next start on the device, without the option: ready, exit %s" % rc)
    finally:
        for n in nodes:
            n.kill()


def main():
    checks = nbdtest.Checks()
    with nbdtest.tempdir(prefix="nbdcached-ceph-") as tmp:
        with Cluster(os.path.join(tmp, "ceph"), watch_timeout=WATCH_TIMEOUT, log=log) as c:
            for t in (failover, old_device_refused):
                checks.run(t.__name__, t, c, checks, tmp, catch=(Failed, nbd.Error, OSError))
    checks.finish("rbd cache device")


if __name__ == "__main__":
    main()
