#!/usr/bin/python3
"""cache_device_crash: what FLUSH and FUA acknowledged from a cache
device's intent log survives a SIGKILL, and a power loss of the device.

crash_consistency.py's trials and byte model in its "device" mode (see
its docstring): the backend a plain file, --cache-device a file on the
FUSE fault file system; after the kill (and in half the trials a power
loss of the device), a new daemon replays the log and stops, and every
byte of the backend file is checked. CRASH_TRIALS (default 30) and
CRASH_SEED as there.
"""

import os
import sys

os.environ.setdefault("CRASH_MODE", "device")
os.environ.setdefault("CRASH_TRIALS", "30")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_consistency  # noqa: E402

if __name__ == "__main__":
    crash_consistency.main()
