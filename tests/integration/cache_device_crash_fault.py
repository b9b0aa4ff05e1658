#!/usr/bin/python3
"""cache_device_crash_fault: a cache device that fails part way through a
commit, then SIGKILL: nothing a FLUSH or FUA acknowledged is lost.

crash_consistency.py's trials and byte model in its "device-fault" mode
(see its docstring): the backend a plain file, --cache-device a file on
the FUSE fault file system, set at a random moment of the load to
"fail-write-after N" (N 0 to 3), so that a commit lands in part and the
export goes writethrough; the load goes on, then SIGKILL (and in half the
trials a power loss of the device); a new daemon on the healed device
replays the log and stops, and every byte of the backend file is checked.
A FLUSH (or any request) answered EIO after the fault guarantees nothing.
CRASH_FAMILY_TRIALS, else CRASH_TRIALS (default 5), and CRASH_SEED as
there.
"""

import os
import sys

os.environ["CRASH_MODE"] = "device-fault"
# CRASH_FAMILY_TRIALS (make asan, i386 and tsan keep these short) before
# CRASH_TRIALS (make soak's), else 5 (make check).
os.environ["CRASH_TRIALS"] = (os.environ.get("CRASH_FAMILY_TRIALS") or
                              os.environ.get("CRASH_TRIALS") or "5")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_consistency  # noqa: E402

if __name__ == "__main__":
    crash_consistency.main()
