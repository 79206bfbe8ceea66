"""A small model trained with DistributedDataParallel under a bare `torchrun train.py`.

The platform's environment is all it needs: torchrun finds the nodes, ranks and leader through
the PET_* variables the agent sets; gloo on CPU, NCCL when GPUs are present. Every SAVE_EVERY
steps local rank 0 of each node writes checkpoint-<step>/ (model and optimizer as safetensors,
trainer_state.json) into $BT_CHECKPOINT_DIR, through a temporary directory renamed into place,
and the agent uploads it. When a checkpoint was loaded into $BT_LOAD_CHECKPOINT_DIR it resumes
from it: weights, optimizer state and step. On SIGTERM every rank agrees to stop at the next
step, saves, and exits 0 within the grace period.

Environment: STEPS (total, default 40), SAVE_EVERY (10), STEP_SLEEP (seconds, 0), WIDTH (64).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel

STEPS = int(os.environ.get("STEPS", "40"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
WIDTH = int(os.environ.get("WIDTH", "64"))

stop_requested = False


def request_stop(number: int, frame: object) -> None:
    global stop_requested
    stop_requested = True


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, 1)
    )


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step on one rank: the same whether the run was resumed or not."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, WIDTH, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return x.to(device), y.to(device)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A fingerprint of the whole training state, printed after a resume."""
    digest = hashlib.sha256()
    tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()}}
    tensors |= {f"optimizer.{k}": v for k, v in optimizer_tensors(optimizer).items()}
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, loss: float) -> None:
    root = Path(os.environ["BT_CHECKPOINT_DIR"])
    final = root / f"checkpoint-{step}"
    if final.exists():
        return
    tmp = root / f"tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    save_file(optimizer_tensors(optimizer), str(tmp / "optimizer.safetensors"))
    state = {"step": step, "loss": loss, "world_size": dist.get_world_size()}
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    os.rename(tmp, final)
    print(f"node {os.environ['BT_NODE_RANK']}: saved checkpoint-{step}", flush=True)


def latest_loaded() -> Path | None:
    """The newest checkpoint the agent loaded for this node, if any."""
    loaded = Path(os.environ.get("BT_LOAD_CHECKPOINT_DIR", "/nonexistent"))
    mine = loaded / f"rank-{os.environ.get('BT_NODE_RANK', '0')}"
    found = [p for p in mine.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


def resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    checkpoint = latest_loaded()
    if checkpoint is None:
        return 0
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors"), device=str(device)))
    saved = load_file(str(checkpoint / "optimizer.safetensors"))
    state = optimizer.state_dict()
    for key, value in saved.items():
        index, name = key.split(".", 1)
        slot = state["state"].setdefault(int(index), {})
        slot[name] = value if name == "step" else value.to(device)
    optimizer.load_state_dict(state)
    step = int(json.loads((checkpoint / "trainer_state.json").read_text())["step"])
    if dist.get_rank() == 0:
        print(
            f"resumed from {checkpoint.name} at step {step}, state "
            f"{state_digest(model, optimizer)}",
            flush=True,
        )
    return step


def main() -> None:
    signal.signal(signal.SIGTERM, request_stop)
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    model = build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = resume(model, optimizer, device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if gpu else None)
    loss = torch.tensor(0.0)
    if rank == 0:
        print(
            f"training from step {step} to {STEPS} on {dist.get_world_size()} rank(s)", flush=True
        )
    while step < STEPS:
        x, y = batch(step, rank, device)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        stop = torch.tensor(float(stop_requested), device=device)
        dist.all_reduce(stop)  # every rank stops at the same step
        if local_rank == 0 and (step % SAVE_EVERY == 0 or stop.item()):
            save(model, optimizer, step, loss.item())
        if stop.item():
            if rank == 0:
                print(f"stopping at step {step} on SIGTERM", flush=True)
            break
    if rank == 0:
        print(
            f"done at step {step}: loss {loss.item():.4f}, state {state_digest(model, optimizer)}",
            flush=True,
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
