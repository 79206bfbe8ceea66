"""End to end: the examples under examples/ run through `bt-agent run` (and entrypoint.sh) from
spec to terminal state, checkpoint, stop, resume and run on two nodes, on the file store and on
SeaweedFS. The assertions are on the training state itself: the resumed step, and a digest of
the model's weights and the optimizer's state that must equal the one the saving job had."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import servers
from helpers import REPO, Agent, finish, run_entrypoint, run_nodes, wait_for

from bt_agent.catalog import Catalog
from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store

DDP = REPO / "examples" / "torch-ddp"
FAST = {"BT_CHECKPOINT_QUIET_SECONDS": "0.3"}
PROJECT = ("--project", "torch-ddp")


def ddp_job(
    agent: Agent,
    steps: int,
    *,
    load: list[dict[str, Any]] | None = None,
    nodes: int = 1,
    **env: str,
) -> dict[str, Any]:
    """The torch-ddp example's job, its code copied beside the spec as a user would have it."""
    job = json.loads((DDP / "job.json").read_text())["training_job"]
    runtime = job["runtime"]
    runtime["environment_variables"] |= {
        "STEPS": str(steps),
        "PET_MASTER_PORT": str(servers.free_port()),
        **env,
    }
    job["compute"]["node_count"] = nodes
    if load:
        runtime["load_checkpoint_config"] = {"enabled": True, "checkpoints": load}
    code = agent.root / "code"
    code.mkdir(parents=True, exist_ok=True)
    shutil.copy(DDP / "train.py", code / "train.py")
    return dict(job)


def digest(text: str, pattern: str) -> str:
    found = re.search(pattern + r".*state ([0-9a-f]{16})", text)
    assert found, text
    return found.group(1)


def committed(
    store: ObjectStore, job_id: str, rank: int = 0, project: str = "torch-ddp"
) -> list[str]:
    return sorted(m.checkpoint for m in Catalog(store).manifests(project, job_id, rank))


def latest(project: str = "torch-ddp") -> dict[str, Any]:
    return {"typ": "baseten_latest_checkpoint", "project_name": project}


def test_ddp_trains_checkpoints_and_resumes_latest_and_named(agent: Agent) -> None:
    store = open_store(agent.store.as_uri(), Environ({}))
    first = agent.run_job(
        ddp_job(agent, 20), *PROJECT, "--job-id", "ddp0001", env=FAST, timeout=120
    )
    assert first.code == 0, first.text
    assert committed(store, "ddp0001") == ["checkpoint-10", "checkpoint-20"]
    at_20 = digest(first.out, "done at step 20")

    second = agent.run_job(
        ddp_job(agent, 40, load=[latest()]), *PROJECT, "--job-id", "ddp0002", env=FAST, timeout=120
    )
    assert second.code == 0, second.text
    assert "loading checkpoint-20 of job ddp0001" in second.err
    assert digest(second.out, "resumed from checkpoint-20 at step 20") == at_20
    assert committed(store, "ddp0002") == ["checkpoint-30", "checkpoint-40"]

    straight = agent.run_job(
        ddp_job(agent, 40),
        *PROJECT,
        "--job-id",
        "ddp0003",
        "--node-root",
        str(agent.root / "n3"),
        env=FAST,
        timeout=120,
    )
    assert straight.code == 0, straight.text
    assert digest(second.out, "done at step 40") == digest(straight.out, "done at step 40"), (
        "a resumed run must end exactly where an uninterrupted one does"
    )

    named = {
        "typ": "baseten_named_checkpoint",
        "checkpoint_name": "checkpoint-10",
        "job_id": "ddp0001",
    }
    third = agent.run_job(
        ddp_job(agent, 20, load=[named]), *PROJECT, "--job-id", "ddp0004", env=FAST, timeout=120
    )
    assert third.code == 0, third.text
    assert "resumed from checkpoint-10 at step 10" in third.out
    assert "training from step 10 to 20" in third.out


def _s3_env(server: servers.SeaweedFS) -> dict[str, str]:
    return {**FAST, **server.client_env()}


def test_sigterm_mid_training_commits_the_newest_checkpoint_and_a_new_job_resumes(
    agent: Agent, s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"stop{os.getpid()}{int(time.time() * 1000) % 100000}"
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/bt"
    env = _s3_env(s3_server)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = ddp_job(agent, 100_000, SAVE_EVERY="1000000", STEP_SLEEP="0.02")
    process = agent.start(
        job, *PROJECT, "--job-id", "stop001", "--store", url, "--grace-period", "20", env=env
    )
    wait_for(lambda: "training from step 0" in agent.output(), 60, "training to start")
    time.sleep(1.0)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert finish(process, 30, agent) == 128 + signal.SIGTERM, agent.output()
    assert time.monotonic() - sent < 20, "within the grace period"
    store = open_store(url, Environ(env))
    stopped_at = re.search(r"stopping at step (\d+) on SIGTERM", agent.output())
    assert stopped_at, agent.output()
    step = int(stopped_at.group(1))
    assert committed(store, "stop001") == [f"checkpoint-{step}"]
    record = json.loads(store.read_bytes("projects/torch-ddp/jobs/stop001/nodes/rank-0.json"))
    assert record["status"] == "TRAINING_JOB_STOPPED" and record["uploads"]["not_durable"] == []

    # The next job starts through entrypoint.sh, as a container would, and resumes from it.
    spec = agent.spec(ddp_job(agent, step + 5, load=[latest()]), name="resume.json")
    done = run_entrypoint(
        agent,
        {
            **env,
            "BT_JOB_SPEC": str(spec),
            "BT_TRAINING_JOB_ID": "stop002",
            "BT_TRAINING_PROJECT_NAME": "torch-ddp",
            "BT_STORE_URL": url,
            "BT_NODE_ROOT": str(agent.root / "entry-node"),
        },
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from checkpoint-{step} at step {step}" in done.stdout
    assert f"done at step {step + 5}" in done.stdout


def _two_nodes(agent: Agent, job: dict[str, Any], job_id: str, tag: str) -> list[int]:
    return run_nodes(agent, job, job_id, tag, *PROJECT, env=FAST)


def test_two_nodes_checkpoint_per_rank_and_resume_each_its_own(agent: Agent) -> None:
    store = open_store(agent.store.as_uri(), Environ({}))
    assert _two_nodes(agent, ddp_job(agent, 20, nodes=2), "two0001", "a") == [0, 0], agent.output()
    for rank in (0, 1):
        assert committed(store, "two0001", rank) == ["checkpoint-10", "checkpoint-20"]
    at_20 = digest(agent.output(), "done at step 20")

    job = ddp_job(agent, 30, nodes=2, load=[latest()])
    assert _two_nodes(agent, job, "two0002", "b") == [0, 0], agent.output()
    log = agent.output()
    for rank in (0, 1):
        assert f"loading checkpoint-20 of job two0001 (project torch-ddp, rank {rank})" in log
        loaded = agent.root / f"b-node{rank}" / "tmp" / "loaded_checkpoints" / f"rank-{rank}"
        assert (loaded / "checkpoint-20" / "model.safetensors").is_file()
        assert committed(store, "two0002", rank) == ["checkpoint-30"]
    assert digest(log, "resumed from checkpoint-20 at step 20") == at_20


HF = REPO / "examples" / "hf-trainer"
TINY_MODEL = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
"""


def _hf_job(agent: Agent, steps: int, load: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    job = json.loads((HF / "job.json").read_text())["training_job"]
    job["runtime"]["environment_variables"]["STEPS"] = str(steps)
    if load:
        job["runtime"]["load_checkpoint_config"] = {"enabled": True, "checkpoints": load}
    code = agent.root / "code"
    code.mkdir(parents=True, exist_ok=True)
    shutil.copy(HF / "train.py", code / "train.py")
    return dict(job)


def test_hf_trainer_with_base_weights_from_the_hub_resumes(
    agent: Agent, hf_server: servers.Olah
) -> None:
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
        import transformers  # noqa: F401
    except ImportError:
        pytest.fail("the hf-trainer example needs transformers: pip install -e '.[test]'")
    model_dir = agent.root / "tiny"
    subprocess.run([sys.executable, "-c", TINY_MODEL, str(model_dir)], check=True)
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    job = json.loads((HF / "job.json").read_text())["training_job"]
    repo = job["weights"][0]["source"].removeprefix("hf://").split("@")[0]
    servers.hf_repo(hf_server.mirrors, repo, {**files, "README.md": b"# a model card"})
    env = {**FAST, "HF_ENDPOINT": hf_server.endpoint}
    project = ("--project", "hf-trainer")
    store = open_store(agent.store.as_uri(), Environ({}))

    first = agent.run_job(_hf_job(agent, 20), *project, "--job-id", "hft0001", env=env, timeout=240)
    assert first.code == 0, first.text
    assert "3 files" in first.err and "README" not in first.err  # allow_patterns
    assert "done at global step 20" in first.out
    assert committed(store, "hft0001", project="hf-trainer") == ["checkpoint-10", "checkpoint-20"]

    second = agent.run_job(
        _hf_job(agent, 30, load=[latest("hf-trainer")]),
        *project,
        "--job-id",
        "hft0002",
        env=env,
        timeout=240,
    )
    assert second.code == 0, second.text
    assert "loading checkpoint-20 of job hft0001" in second.err
    assert "resuming from checkpoint-20" in second.out
    assert "done at global step 30" in second.out
    assert committed(store, "hft0002", project="hf-trainer") == ["checkpoint-30"]
    state = json.loads(
        store.read_bytes(
            "projects/hf-trainer/jobs/hft0002/checkpoints/rank-0/checkpoint-30/trainer_state.json"
        )
    )
    assert state["global_step"] == 30
    logged = [entry["step"] for entry in state["log_history"] if "loss" in entry]
    assert logged == [5, 10, 15, 20, 25, 30], "the resumed run carries the first run's history"
