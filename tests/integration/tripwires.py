#!/usr/bin/python3
"""tripwires: an invariant broken on purpose is seen (daemon/check.h).

  broken    a daemon started with NBDCACHED_DEBUG_HOOKS=1: a 4 KiB WRITE
            and READ at 0 leave an idle entry there; the debug hook
            "debug-unpin" unpins it without a pin: the pin invariant's
            NEVER in cache_entry_unpin fires. The stats' and the metrics'
            invariant_violations go from 0 to 1, the log names the
            invariant, its file and line, and the daemon goes on serving
            (the entry's data reads back; the unpin was undone). Twenty
            more: counted exactly (21), the lines rate-limited (at most
            10 of them, then a line counting the rest).
  gated     without NBDCACHED_DEBUG_HOOKS the command does not exist.

In make asan's build (NBDCACHED_CHECKS) the same holds: ALWAYS and NEVER
count and go on in every build; DCHECK is what aborts there.
"""

import os
import re
import sys
import time
import urllib.request

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import Failed, log  # noqa: E402

import nbd  # noqa: E402

MIB = 1 << 20
CHECKS = nbdtest.Checks(catch=(Failed, nbd.Error))
expect = CHECKS.expect


def violations(d):
    return nbdtest.control_request(d.control, {"command": "stats"})["invariant_violations"]


def broken(tmp):
    disk = os.path.join(tmp, "disk.img")
    nbdtest.sparse_file(disk, 16 * MIB)
    port = nbdtest.free_port()
    work = os.path.join(tmp, "hooks")
    os.mkdir(work)
    d = nbdtest.CheckedDaemon([("disk", disk, "")], workdir=work, tcp=False,
                              extra=["--metrics", "127.0.0.1:%d" % port],
                              env=dict(os.environ, NBDCACHED_DEBUG_HOOKS="1"))
    try:
        h = nbdtest.libnbd_handle(d.unix_uri("disk"))
        data = os.urandom(4096)
        h.pwrite(data, 0)
        expect(h.pread(4096, 0) == data, "read back before")
        h.flush()
        expect(violations(d) == 0, "violations before: %s" % violations(d))
        began = time.monotonic()
        # (the entry idle: no reply or writeback holds it any more)
        for _ in range(100):
            r = nbdtest.control_request(d.control, {"command": "debug-unpin", "export": "disk",
                                                    "offset": 0})
            if r.get("unpinned"):
                break
            time.sleep(0.05)
        log("  debug-unpin: %s" % r)
        expect(r.get("ok") and r.get("unpinned") is True, "debug-unpin: %s" % r)
        expect(violations(d) == 1, "violations after one: %s" % violations(d))
        text = d.log_text()
        m = re.search(r"internal error: (NEVER\(.*\)) at (daemon/cache/cache\.c:\d+) does not "
                      r"hold", text)
        expect(m, "no log line names the invariant:\n%s" % text[-1500:])
        if m:
            log("  the log: %s at %s" % (m.group(1), m.group(2)))
        page = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read()
        expect(b"\nnbdcached_invariant_violations_total 1\n" in page,
               "metrics: no nbdcached_invariant_violations_total 1")
        expect(h.pread(4096, 0) == data, "read back after the violation")
        h.pwrite(data[::-1], 4096)
        h.flush()
        done = 1
        for _ in range(200):
            if done == 21:
                break
            r = nbdtest.control_request(d.control, {"command": "debug-unpin", "export": "disk",
                                                    "offset": 0})
            done += bool(r.get("unpinned"))
        expect(violations(d) == done == 21, "violations after %d: %s" % (done, violations(d)))
        span = time.monotonic() - began
        # The limiter's count is said by the next line of its kind or by
        # the control thread's tick once its interval is over: wait for it.
        for _ in range(100):
            text = d.log_text()
            if "invariant violations:" in text:
                break
            time.sleep(0.1)
        lines = text.count("internal error: NEVER(")
        log("  21 violations: %d lines; %s" % (lines, next(
            (ln.split(": ", 2)[-1] for ln in text.splitlines()
             if "invariant violations:" in ln), "no count line")))
        # 10 lines a 5 s interval (LOG_LIMIT_BURST, LOG_LIMIT_INTERVAL_NS),
        # in each interval the 21 touched: one here (a few milliseconds),
        # more only if a busy machine stretched them; logged each, 21.
        bound = 10 * (1 + int(span / 5))
        expect(lines <= bound, "%d lines for 21 violations in %.2f s (at most %d): not "
               "rate-limited" % (lines, span, bound))
        expect(re.search(r"invariant violations: \d+ similar lines suppressed", text),
               "no line counts the suppressed ones")
        expect(h.pread(8192, 0) == data + data[::-1], "the daemon serves on")
        h.shutdown()
    finally:
        d.stop()


def gated(tmp):
    disk = os.path.join(tmp, "disk2.img")
    nbdtest.sparse_file(disk, MIB)
    work = os.path.join(tmp, "nohooks")
    os.mkdir(work)
    env = dict(os.environ)
    env.pop("NBDCACHED_DEBUG_HOOKS", None)
    d = nbdtest.CheckedDaemon([("disk", disk, "")], workdir=work, tcp=False, env=env)
    try:
        r = nbdtest.control_request(d.control, {"command": "debug-unpin", "export": "disk"})
        log("  without the variable: %s" % r)
        expect(not r.get("ok") and "unknown command" in r.get("error", ""),
               "debug-unpin without NBDCACHED_DEBUG_HOOKS: %s" % r)
    finally:
        d.stop()


def main():
    with nbdtest.tempdir() as tmp:
        CHECKS.run("broken", broken, tmp)
        CHECKS.run("gated", gated, tmp)
    CHECKS.finish("tripwires")


if __name__ == "__main__":
    main()
