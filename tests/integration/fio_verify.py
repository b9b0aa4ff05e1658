#!/usr/bin/python3
"""fio (ioengine=nbd, i.e. libnbd) writing and verifying through nbdcached.

Each workload writes blocks carrying a crc32c header and reads every one back
to verify it (verify=crc32c, verify_fatal=1), once over the Unix socket and
once over TCP, each transport on its own region of a 2 GiB export:
  - 4 KiB random writes, iodepth 16;
  - 1 MiB sequential writes, iodepth 8;
  - 4 KiB random read/write mix, iodepth 32, two jobs (two connections), each
    on its own region (offset_increment);
  - the same with request sizes from 512 bytes to 256 KiB, not aligned to
    4 KiB (bs_unaligned), iodepth 64, four jobs.
Then every workload is verified again (verify_only) over the other
transport, and once more after the daemon is restarted on the same backend:
the data was on the backend, not only in the daemon. fio must exit 0 and
every job must report error 0 and no verify failure in its output.

FIO_VERIFY_MIB (default and at most 64) is the MiB each job writes, the
sequential job four times that: 704 MiB a transport, 1408 MiB for both,
more than the daemon's default 1 GiB cache. Below 64 (make asan and make
i386: SHORT_REPEATS in the Makefile) --cache-size shrinks in proportion,
so that the data still outgrows the cache.
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import nbdtest  # noqa: E402
from nbdtest import check, fail, log  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SIZE = 2 * GiB
JOB_MIB = int(os.environ.get("FIO_VERIFY_MIB", "64"))
# The daemon's default cache (1 GiB) at 64 MiB a job; in proportion below.
DAEMON_EXTRA = [] if JOB_MIB >= 64 else ["--cache-size", "%dM" % (1024 * JOB_MIB // 64)]

# name -> (fio options, bytes written per job, jobs); the offset is added
# per transport (Unix socket: 0, TCP: 1 GiB).
WORKLOADS = {
    "randwrite4k": (["--rw=randwrite", "--bs=4k", "--size=%dm" % JOB_MIB, "--iodepth=16"],
                    JOB_MIB * MiB, 1),
    "seqwrite1m": (["--rw=write", "--bs=1m", "--size=%dm" % (4 * JOB_MIB), "--iodepth=8"],
                   4 * JOB_MIB * MiB, 1),
    "randrw4k": (["--rw=randrw", "--rwmixread=50", "--bs=4k", "--size=%dm" % JOB_MIB,
                  "--iodepth=32", "--numjobs=2", "--offset_increment=64m"], None, 2),
    "randrw-mixedbs": (["--rw=randrw", "--rwmixread=50", "--bsrange=512-256k", "--bs_unaligned",
                        "--size=%dm" % JOB_MIB, "--iodepth=64", "--numjobs=4",
                        "--offset_increment=64m"],
                       None, 4),
}
REGION = {"randwrite4k": 0, "seqwrite1m": 128 * MiB, "randrw4k": 512 * MiB,
          "randrw-mixedbs": 640 * MiB}
VERIFY_FAILURES = ("verify failed", "bad magic", "verify type mismatch", "bad header",
                   "verify: ")

state = {}


def fio(name, uri, base, extra):
    opts, _, jobs = WORKLOADS[name]
    out = os.path.join(state["tmp"], "fio-%s.json" % name)
    args = ["fio", "--output-format=json", "--output=" + out, "--name=" + name,
            "--ioengine=nbd", "--uri=" + uri, "--offset=%d" % (base + REGION[name]),
            "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
            "--runtime=60", "--group_reporting=0"]
    args += opts + list(extra)
    # cwd: fio may drop files (verify state) in its working directory.
    p = nbdtest.run(args, timeout=180, check_rc=False, stdin=subprocess.DEVNULL,
                    cwd=state["tmp"])
    text = open(out).read() if os.path.exists(out) else ""
    for bad in VERIFY_FAILURES:
        if bad in text or bad in p.stderr:
            log(text[-3000:])
            fail("fio %s on %s: verify failure (%r)" % (name, uri, bad))
    try:
        result = json.loads(text)
    except ValueError:
        log(text[-3000:])
        fail("fio %s on %s: no JSON output (exit %d)" % (name, uri, p.returncode))
    check(p.returncode == 0, "fio %s on %s exited %d" % (name, uri, p.returncode))
    check(len(result["jobs"]) == jobs, "fio %s: %d jobs reported" % (name, len(result["jobs"])))
    for j in result["jobs"]:
        check(j["error"] == 0, "fio %s on %s: job error %d" % (name, uri, j["error"]))
        log("  %s: read %d bytes, wrote %d bytes, error %d"
            % (name, j["read"]["io_bytes"], j["write"]["io_bytes"], j["error"]))
    return result["jobs"]


def write_and_verify(uri, base):
    for name, (_, written, _) in WORKLOADS.items():
        jobs = fio(name, uri, base, ["--do_verify=1"])
        for j in jobs:
            check(j["write"]["io_bytes"] > 0, "fio %s wrote nothing" % name)
            # The verify pass reads back at least every byte written.
            check(j["read"]["io_bytes"] >= j["write"]["io_bytes"],
                  "fio %s read back less than it wrote" % name)
            if written is not None:
                check(j["write"]["io_bytes"] == written, "fio %s wrote %d bytes, expected %d"
                      % (name, j["write"]["io_bytes"], written))


def verify_only(uri, base):
    for name in WORKLOADS:
        for j in fio(name, uri, base, ["--verify_only=1"]):
            check(j["read"]["io_bytes"] > 0, "fio %s verify_only read nothing" % name)


def main():
    if not 1 <= JOB_MIB <= 64:      # the regions above are laid out for 64
        fail("FIO_VERIFY_MIB=%d: 1 to 64" % JOB_MIB)
    with nbdtest.tempdir() as tmp:
        state["tmp"] = tmp
        backend = nbdtest.sparse_file(os.path.join(tmp, "f.img"), SIZE)
        with nbdtest.Daemon([("f", backend, "")], extra=DAEMON_EXTRA) as d:
            unix, tcp = d.unix_uri("f"), d.tcp_uri("f")
            log("=== write + verify over the Unix socket")
            write_and_verify(unix, 0)
            log("=== write + verify over TCP")
            write_and_verify(tcp, 1 * GiB)
            log("=== verify_only over the other transport")
            verify_only(tcp, 0)
            verify_only(unix, 1 * GiB)
            check(d.alive(), "nbdcached died")
        log("=== verify_only after a daemon restart on the same backend")
        with nbdtest.Daemon([("f", backend, "")], extra=DAEMON_EXTRA) as d:
            verify_only(d.unix_uri("f"), 0)
            verify_only(d.tcp_uri("f"), 1 * GiB)
    log("all fio checks passed")
    sys.exit(0)


if __name__ == "__main__":
    main()
