#!/usr/bin/python3
"""cache_device_crash_backend: an NBD backend that loses what it did not
flush, during the load and at the crash: nothing a FLUSH or FUA
acknowledged is lost.

crash_consistency.py's trials and byte model in its "backend-loss" mode
(see its docstring): the backend nbdkit (file plugin) over an image file
on the FUSE fault file system, a small cache, --cache-device a file on
another; direct writes (WRITE_ZEROES, TRIM, FUA, writes of 1 to 3 MiB);
at random moments a power cut of the backend (nbdkit SIGKILLed, its file
rolled back to its last fsync, nbdkit started again); then SIGKILL of
the daemon, a power cut of the backend, in half the trials a power loss
of the device; a new daemon replays the log and stops, and every byte of
the backend file is checked. A request answered EIO after a cut during
the load guarantees nothing. CRASH_FAMILY_TRIALS, else CRASH_TRIALS
(default 5), and CRASH_SEED as there.
"""

import os
import sys

os.environ["CRASH_MODE"] = "backend-loss"
# CRASH_FAMILY_TRIALS (make asan, i386 and tsan keep these short) before
# CRASH_TRIALS (make soak's), else 5 (make check).
os.environ["CRASH_TRIALS"] = (os.environ.get("CRASH_FAMILY_TRIALS") or
                              os.environ.get("CRASH_TRIALS") or "5")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_consistency  # noqa: E402

if __name__ == "__main__":
    crash_consistency.main()
