"""A stand-in trainer that owns its cores: pins itself to the CPUs given (none: stays where it
may run), optionally writes a checkpoint into $BT_CHECKPOINT_DIR, then keeps a CPU busy until
the file GO_ON exists.

    spin_pinned.py GO_ON [--cpus 0,1] [--checkpoint-mib N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("go_on", type=Path)
    parser.add_argument("--cpus", help="comma-separated CPUs to pin this process to")
    parser.add_argument("--checkpoint-mib", type=int, default=0)
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.cpus.split(",")})
    if args.checkpoint_mib:
        checkpoint = Path(os.environ["BT_CHECKPOINT_DIR"]) / "checkpoint-1"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "model.bin").write_bytes(os.urandom(args.checkpoint_mib << 20))
    spins = 0
    while not args.go_on.exists():
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            spins += 1


if __name__ == "__main__":
    main()
