"""The start command of benchmarks/checkpoint_upload.py's step-time comparison: optionally write
a large checkpoint into $BT_CHECKPOINT_DIR (which the sidecar then uploads while training goes
on), then train an MLP (on the CPU, or a GPU) and record every step's time.

    _train_loop.py RESULT_JSON --seconds S [--checkpoint-mib N] [--threads T]
        [--device cpu|cuda] [--width W] [--batch B] [--cpu N] [--return-memory]

The loop keeps the memory it frees, as a tuned CPU trainer does (jemalloc or tcmalloc, or these
glibc settings; on a GPU, torch's caching allocator): with glibc's defaults every step hands its
16 MiB gradient buffers back to the kernel and faults them in again, so that a quarter of the
step is page faults and identical runs spread from 59 to 91 ms here (kept: 50.6 to 52.7 ms).
``--return-memory`` keeps glibc's defaults.

On ``cuda`` the matrix products use TF32, as trainers do, and each step ends with a
synchronize so that its time is the GPU's too.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import time
from pathlib import Path

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit


def keep_freed_memory() -> None:
    """Allocate buffers up to 32 MiB from the heap and never trim it (glibc's mallopt)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    ):
        raise SystemExit("mallopt refused; run with --return-memory")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--checkpoint-mib", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cpu", type=int, help="run on this CPU only")
    parser.add_argument("--return-memory", action="store_true", help="glibc's malloc defaults")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if not args.return_memory:
        keep_freed_memory()
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(args.batch, width, device=device)
    if args.checkpoint_mib:
        directory = Path(os.environ["BT_CHECKPOINT_DIR"]) / "checkpoint-0"
        directory.mkdir(parents=True, exist_ok=True)
        block = os.urandom(1 << 20)
        for shard in range(8):
            with open(directory / f"shard-{shard}.bin", "wb") as handle:
                for _ in range(args.checkpoint_mib // 8):
                    handle.write(block)
    steps: list[float] = []
    starts: list[float] = []  # wall clock, to compare with a manifest's committed_at
    on_cpu: list[float] = []  # the step's time on a CPU: less than its wall time if preempted
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        starts.append(time.time())
        start, start_cpu = time.perf_counter(), time.thread_time()
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
        on_cpu.append(time.thread_time() - start_cpu)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.result.write_text(
        json.dumps({"steps": steps, "starts": starts, "on_cpu": on_cpu, "device": name})
    )


if __name__ == "__main__":
    main()
