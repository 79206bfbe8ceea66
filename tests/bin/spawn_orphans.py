"""Fork N grandchildren that outlive this process (orphans), then exit at once.

Each orphan sleeps for the given seconds and exits, so whoever inherits it must reap it.
Usage: spawn_orphans.py N SECONDS
"""

import os
import sys
import time

count, seconds = int(sys.argv[1]), float(sys.argv[2])
for _ in range(count):
    if os.fork() == 0:
        time.sleep(seconds)
        os._exit(0)
print(f"spawned {count} orphans", flush=True)
os._exit(0)
