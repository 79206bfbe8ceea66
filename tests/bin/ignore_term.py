"""Ignore SIGTERM, say so in the file given as the first argument, then sleep forever."""

import signal
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1]).write_text("ready")
while True:
    time.sleep(1)
