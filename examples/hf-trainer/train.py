"""The transformers Trainer on a tiny causal language model, the way the platform's docs show it.

The base weights come through the job's `weights`: the agent stages an `hf://` repo at
BASE_MODEL_DIR (its `mount_location`) before this runs, so nothing is downloaded here. The
Trainer writes `checkpoint-<step>/` into $BT_CHECKPOINT_DIR (`output_dir`), which the agent
uploads; when a checkpoint was loaded into $BT_LOAD_CHECKPOINT_DIR, training resumes from the
last one with `get_last_checkpoint`.

Environment: BASE_MODEL_DIR (default: the `/app/base` mount, found relative to $BT_WORKING_DIR
so that the same code runs in a container and under `bt-agent run --node-root`), STEPS (20),
SAVE_STEPS (10).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

WORKING_DIR = Path(os.environ.get("BT_WORKING_DIR", "/b10/workspace"))
BASE = os.environ.get("BASE_MODEL_DIR") or str(WORKING_DIR / "../../app/base")
STEPS = int(os.environ.get("STEPS", "20"))
SAVE_STEPS = int(os.environ.get("SAVE_STEPS", "10"))


class Sequences(torch.utils.data.Dataset):
    """Deterministic token sequences: the same data whether the run was resumed or not."""

    def __init__(self, vocab: int, count: int = 256, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def loaded_checkpoint() -> str | None:
    loaded = Path(os.environ.get("BT_LOAD_CHECKPOINT_DIR", "/nonexistent"))
    mine = loaded / f"rank-{os.environ.get('BT_NODE_RANK', '0')}"
    return get_last_checkpoint(str(mine)) if mine.is_dir() else None


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(BASE)
    args = TrainingArguments(
        output_dir=os.environ["BT_CHECKPOINT_DIR"],
        max_steps=STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=5,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(model.config.vocab_size))
    resume = loaded_checkpoint()
    if resume:
        print(f"resuming from {Path(resume).name}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    print(f"done at global step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
