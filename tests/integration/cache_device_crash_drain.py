#!/usr/bin/python3
"""cache_device_crash_drain: SIGKILL of the replay during its drain after
a crash, and a power cut of the cache device then: nothing a FLUSH or FUA
acknowledged is lost.

crash_consistency.py's trials and byte model in its "drain" mode (see its
docstring): the backend a plain file (on a faultfs of its own), the
--cache-device a file on the FUSE fault file system; the load, then
SIGKILL (and in half the trials a power loss of the device); the first
replay's daemon starts over a slow backend (every operation of the
backend's faultfs delayed 5 to 20 ms), so the drain of the live log takes
a while, and gets SIGKILL at a random point of it (in half the trials a
power loss of the device right after); a second daemon, the backend no
longer slow, drains the log and stops, and every byte of the backend file
is checked. The log says how many bytes were pending at the drain's kill.
CRASH_FAMILY_TRIALS, else CRASH_TRIALS (default 5), and CRASH_SEED as
there.
"""

import os
import sys

os.environ["CRASH_MODE"] = "drain"
# CRASH_FAMILY_TRIALS (make asan, i386 and tsan keep these short) before
# CRASH_TRIALS (make soak's), else 5 (make check).
os.environ["CRASH_TRIALS"] = (os.environ.get("CRASH_FAMILY_TRIALS") or
                              os.environ.get("CRASH_TRIALS") or "5")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_consistency  # noqa: E402

if __name__ == "__main__":
    crash_consistency.main()
