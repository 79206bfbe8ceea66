"""A trainer that saves checkpoints into $BT_CHECKPOINT_DIR and SIGKILLs itself at one chosen
point of its saves, as the OOM killer would: in the middle of a file, between two files of one
save, during a pause, between a rename and the removal of an older checkpoint.

    save_and_die.py LEDGER --style inplace|shards|rotate --seed N --kill K

inplace  torch.save-style: checkpoint-N/model.pt, optimizer.pt, trainer_state.json, in place
shards   distributed-checkpoint style: shards with pauses between them, .metadata last
rotate   HF Trainer: tmp-checkpoint-N/ renamed to checkpoint-N/, then the one before removed

Each step of a save is one numbered operation; at operation K (counted from 0) the trainer
kills itself (a pause is cut at a random moment). LEDGER (outside the checkpoint dir) gets,
after each completed save, every file of it with its sha256: the checkpoints that are whole.
``--count`` prints how many operations a run has, and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

CHUNK = 64 * 1024


class Saver:
    def __init__(self, root: Path, ledger: Path, seed: int, kill: int | None) -> None:
        self.root = root
        self.ledger_path = ledger
        self.rng = random.Random(seed)
        self.kill = kill
        self.ops = 0
        self.ledger: dict[str, dict[str, str]] = {}

    def op(self, pause: float = 0.0) -> None:
        """One operation: the trainer dies here if it is the chosen one."""
        if self.ops == self.kill:
            time.sleep(self.rng.uniform(0, pause))
            os.kill(os.getpid(), signal.SIGKILL)
        self.ops += 1
        if pause and self.kill is not None:
            time.sleep(pause)

    def write(self, path: Path, size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.rng.randbytes(size)
        with open(path, "wb") as handle:
            for start in range(0, size, CHUNK):
                self.op()
                handle.write(data[start : start + CHUNK])
                handle.flush()
        self.op()

    def done(self, directory: Path) -> None:
        """``directory`` is a whole checkpoint now: into the ledger."""
        self.ledger[directory.name] = {
            p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
        partial = self.ledger_path.with_suffix(".partial")
        partial.write_text(json.dumps(self.ledger))
        os.replace(partial, self.ledger_path)
        self.op()

    def inplace(self, step: int) -> None:
        where = self.root / f"checkpoint-{step}"
        self.write(where / "model.pt", self.rng.randint(100_000, 400_000))
        self.write(where / "optimizer.pt", self.rng.randint(50_000, 200_000))
        self.write(where / "trainer_state.json", 200)
        self.done(where)
        self.op(pause=self.rng.uniform(0.0, 0.6))  # training steps

    def shards(self, step: int) -> None:
        where = self.root / f"checkpoint-{step}"
        count = self.rng.randint(2, 4)
        for index in range(count):
            self.write(where / f"__{index}_0.distcp", self.rng.randint(50_000, 150_000))
            self.op(pause=self.rng.uniform(0.0, 0.6))  # gathering the next shard
        self.write(where / ".metadata", 300)
        self.done(where)
        self.op(pause=self.rng.uniform(0.0, 0.6))  # training steps

    def rotate(self, step: int) -> None:
        tmp = self.root / f"tmp-checkpoint-{step}"
        self.write(tmp / "model.safetensors", self.rng.randint(100_000, 300_000))
        self.write(tmp / "config.json", 100)
        os.rename(tmp, self.root / f"checkpoint-{step}")
        self.done(self.root / f"checkpoint-{step}")
        for older in sorted(self.root.glob("checkpoint-*"))[:-1]:  # save_total_limit=1
            self.op()
            shutil.rmtree(older)
        self.op(pause=self.rng.uniform(0.0, 0.6))  # training steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--style", choices=["inplace", "shards", "rotate"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    root = Path(os.environ.get("BT_CHECKPOINT_DIR", "/nonexistent"))
    if args.count:
        root = Path(os.environ.get("TMPDIR", "/tmp")) / f"save-and-die-count-{os.getpid()}"
    ledger = root / "ledger.json" if args.count else args.ledger
    saver = Saver(root, ledger, args.seed, None if args.count else args.kill)
    save = getattr(saver, args.style)
    root.mkdir(parents=True, exist_ok=True)
    try:
        for step in range(1, args.steps + 1):
            save(step)
    finally:
        if args.count:
            shutil.rmtree(root, ignore_errors=True)
    if args.count:
        print(saver.ops)


if __name__ == "__main__":
    main()
