"""Write checkpoints into $BT_CHECKPOINT_DIR the way real trainers do, and record in a ledger
(outside the checkpoint dir) the sha256 of every file's final content, so that a test can check
the store against what was written even after the trainer deleted old checkpoints.

    write_checkpoints.py LEDGER --style hf|inplace|shards [--steps N] [--size BYTES]
        [--files N] [--pause S] [--save-total-limit K] [--rewrite] [--hold S]

hf       HF Trainer: write tmp-checkpoint-N/, then rename it to checkpoint-N/
inplace  torch.save straight into checkpoint-N/model.pt (a tensor dict)
shards   distributed-checkpoint style: many __<i>_0.distcp shards and a .metadata file
--tmp-pause         wait this long in tmp-checkpoint-N/ before the rename
--rewrite           rewrite checkpoint-N's largest file in place right after writing it
--save-total-limit  delete the oldest checkpoints beyond K, as Trainer's save_total_limit
--hold              sleep this long at the end (a trainer still running)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path


def _write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for start in range(0, len(data), 1 << 20):
            handle.write(data[start : start + (1 << 20)])
    return hashlib.sha256(data).hexdigest()


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkpoint(
    root: Path, step: int, args: argparse.Namespace, rng: random.Random
) -> dict[str, str]:
    name = f"checkpoint-{step}"
    files: dict[str, str] = {}
    if args.style == "hf":
        tmp = root / f"tmp-{name}"
        _write(tmp / "model.safetensors", rng.randbytes(args.size))
        _write(tmp / "config.json", json.dumps({"step": step}).encode())
        _write(tmp / "optimizer.pt", rng.randbytes(max(args.size // 4, 1)))
        time.sleep(args.tmp_pause)  # still being written, as far as anyone can tell
        os.rename(tmp, root / name)
    elif args.style == "inplace":
        import torch

        state = {"step": torch.tensor(step), "w": torch.randn(max(args.size // 4, 1))}
        (root / name).mkdir(parents=True, exist_ok=True)
        torch.save(state, root / name / "model.pt")
    else:
        for index in range(args.files):
            _write(root / name / f"__{index}_0.distcp", rng.randbytes(args.size))
        _write(root / name / ".metadata", json.dumps({"shards": args.files}).encode())
    if args.rewrite:
        biggest = max((root / name).iterdir(), key=lambda p: p.stat().st_size)
        time.sleep(args.pause / 2)  # its upload is under way
        _write(biggest, rng.randbytes(biggest.stat().st_size))
    for path in sorted((root / name).rglob("*")):
        if path.is_file():
            files[path.relative_to(root / name).as_posix()] = _hash(path)
    return files


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--style", choices=["hf", "inplace", "shards"], default="hf")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--tmp-pause", type=float, default=0.0)
    parser.add_argument("--save-total-limit", type=int, default=0)
    parser.add_argument("--rewrite", action="store_true")
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args()
    root = Path(os.environ["BT_CHECKPOINT_DIR"])
    rng = random.Random(args.first)
    ledger: dict[str, dict[str, str]] = {}
    for step in range(args.first, args.first + args.steps):
        ledger[f"checkpoint-{step}"] = _checkpoint(root, step, args, rng)
        args.ledger.write_text(json.dumps(ledger))
        print(f"wrote checkpoint-{step}", flush=True)
        if args.save_total_limit:
            kept = sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            for old in kept[: -args.save_total_limit]:
                shutil.rmtree(old)
        time.sleep(args.pause)
    time.sleep(args.hold)


if __name__ == "__main__":
    main()
