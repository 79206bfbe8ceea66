"""Print a numbered line every INTERVAL seconds, COUNT times.

Usage: print_continuously.py COUNT INTERVAL
"""

import sys
import time

count, interval = int(sys.argv[1]), float(sys.argv[2])
for i in range(count):
    print(f"line {i}", flush=True)
    time.sleep(interval)
