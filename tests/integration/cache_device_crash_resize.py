#!/usr/bin/python3
"""cache_device_crash_resize: an export grown during the load, SIGKILL
before, during or after the resize: nothing a FLUSH or FUA acknowledged
is lost, and the grown part holds zeros or what was written there.

crash_consistency.py's trials and byte model in its "resize" mode (see
its docstring): the backend a plain file, --cache-device a file on the
FUSE fault file system; at a random moment the file is grown (os.truncate
then `nbdcachectl resize disk`, or `nbdcachectl resize disk NEWSIZE`) and
a new connection writes in the grown part too; SIGKILL at a random moment
or at a step of the resize (and in half the trials a power loss of the
device); a new daemon replays the log and stops, and every byte of the
backend file is checked. CRASH_FAMILY_TRIALS, else CRASH_TRIALS (default 5), and CRASH_SEED as
there.
"""

import os
import sys

os.environ["CRASH_MODE"] = "resize"
# CRASH_FAMILY_TRIALS (make asan, i386 and tsan keep these short) before
# CRASH_TRIALS (make soak's), else 5 (make check).
os.environ["CRASH_TRIALS"] = (os.environ.get("CRASH_FAMILY_TRIALS") or
                              os.environ.get("CRASH_TRIALS") or "5")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_consistency  # noqa: E402

if __name__ == "__main__":
    crash_consistency.main()
