"""Record every signal received in a file; exit 0 on SIGTERM or SIGINT, or after N seconds.

Usage: record_signals.py FILE [SECONDS]. Writes "ready" first, then one signal name per line.
"""

import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
limit = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0


def handle(number, frame):
    with out.open("a") as f:
        f.write(f"{signal.Signals(number).name} {time.time():.6f}\n")
    if number in (signal.SIGTERM, signal.SIGINT):
        sys.exit(0)


for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), handle)
out.write_text("ready\n")
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    time.sleep(0.01)
