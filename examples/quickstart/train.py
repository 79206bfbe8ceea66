"""A tiny real training job: fit y = 3x + 2 by SGD, in pure Python.

It reads the platform's environment like any job on the platform: it writes a checkpoint every
few steps under $BT_CHECKPOINT_DIR/checkpoint-<step>/ and, when a checkpoint was loaded into
$BT_LOAD_CHECKPOINT_DIR, resumes from it.
"""

import json
import os
import random
from pathlib import Path

STEPS = int(os.environ.get("STEPS", "20"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
LEARNING_RATE = 0.05


def latest_loaded_checkpoint():
    loaded = Path(os.environ.get("BT_LOAD_CHECKPOINT_DIR", "/nonexistent"))
    found = sorted(
        loaded.glob("rank-*/checkpoint-*/state.json"),
        key=lambda p: int(p.parent.name.split("-")[1]),
    )
    return found[-1] if found else None


def save(state, step):
    directory = Path(os.environ["BT_CHECKPOINT_DIR"]) / f"checkpoint-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.rename(directory / "state.json")
    print(f"saved {directory}", flush=True)


def main():
    print(
        f"job {os.environ['BT_TRAINING_JOB_ID']} in project "
        f"{os.environ['BT_TRAINING_PROJECT_NAME']}, node {os.environ['BT_NODE_RANK']} of "
        f"{os.environ['BT_GROUP_SIZE']}, {os.environ['BT_NUM_GPUS']} GPU(s)",
        flush=True,
    )
    state = {"step": 0, "w": 0.0, "b": 0.0}
    resume = latest_loaded_checkpoint()
    if resume is not None:
        state = json.loads(resume.read_text())
        print(f"resumed from {resume.parent.name} at step {state['step']}", flush=True)
    rng = random.Random(state["step"])
    while state["step"] < STEPS:
        x = rng.uniform(-1, 1)
        error = state["w"] * x + state["b"] - (3 * x + 2)
        state["w"] -= LEARNING_RATE * error * x
        state["b"] -= LEARNING_RATE * error
        state["step"] += 1
        if state["step"] % SAVE_EVERY == 0:
            save(state, state["step"])
    print(f"done at step {state['step']}: w={state['w']:.3f} b={state['b']:.3f}", flush=True)


if __name__ == "__main__":
    main()
