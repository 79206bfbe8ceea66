"""A tiny DDP job for torchrun (gloo on CPU): a few all-reduce steps, a barrier, a clean exit.

With WAIT_FOR_SIGTERM=FILE each worker instead records the SIGTERM it receives into FILE.rank-N
and exits 0 from its handler.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def wait_for_sigterm(prefix: str, rank: int) -> None:
    def handle(number, frame):
        Path(f"{prefix}.rank-{rank}").write_text(f"{time.time():.6f}\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, handle)
    Path(f"{prefix}.ready-{rank}").write_text("ready")
    while True:
        time.sleep(0.01)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = os.environ.get("WAIT_FOR_SIGTERM")
    if marker:
        wait_for_sigterm(marker, rank)
    value = torch.ones(4) * (rank + 1)
    for _ in range(3):
        dist.all_reduce(value)
    print(
        f"rank {rank}/{world} node {os.environ['BT_NODE_RANK']} sum {value[0].item():g}", flush=True
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is saved and every rank has left the process group: leave without the
    # interpreter's teardown, where torch's gloo threads now and then abort a finished process
    # (SIGABRT, "terminate called without an active exception"; seen on a busy 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
