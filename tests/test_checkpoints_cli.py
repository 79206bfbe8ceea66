"""``checkpoints list|files|inspect`` on checkpoints committed by the real sidecar: a full model
and a LoRA adapter saved with safetensors, on the file store and on SeaweedFS."""

from __future__ import annotations

import csv
import hashlib
import io
import json

import pytest
import servers
from helpers import Agent, trainer_job

FAST = {"BT_CHECKPOINT_QUIET_SECONDS": "0.3"}

TRAINER = """
import json, os, torch
from safetensors.torch import save_file
root = os.environ["BT_CHECKPOINT_DIR"]
full = os.path.join(root, "checkpoint-10")
os.makedirs(full)
save_file({"model.embed.weight": torch.zeros(100, 16), "model.norm.weight": torch.ones(16)},
          os.path.join(full, "model.safetensors"), metadata={"format": "pt"})
json.dump({"_name_or_path": "Qwen/Qwen3-0.6B"}, open(os.path.join(full, "config.json"), "w"))
lora = os.path.join(root, "checkpoint-20")
os.makedirs(lora)
save_file({"base_model.q_proj.lora_A.weight": torch.zeros(8, 64, dtype=torch.bfloat16)},
          os.path.join(lora, "adapter_model.safetensors"))
json.dump({"base_model_name_or_path": "meta-llama/Llama-3.1-8B", "r": 8},
          open(os.path.join(lora, "adapter_config.json"), "w"))
"""


def _browse(agent: Agent, store: str, *args: str, env: dict[str, str] | None = None) -> str:
    result = agent("checkpoints", *args, "--store", store, env=env)
    assert result.code == 0, result.text
    return result.out


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_list_files_and_inspect(
    agent: Agent, backend: str, s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dict(FAST)
    store = str(agent.store)
    if backend == "s3":
        bucket = f"ckpt{backend}{abs(hash(agent.mark)) % 10**8}"
        s3_server.create_bucket(bucket)
        store = f"s3://{bucket}/bt"
        env |= {
            "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": s3_server.endpoint,
        }
    result = agent.run_job(
        trainer_job(agent, TRAINER),
        "--job-id",
        "brws001",
        "--project",
        "lm",
        "--store",
        store,
        env=env,
    )
    assert result.code == 0, result.text

    listed = json.loads(_browse(agent, store, "list", "--project", "lm", "-o", "json", env=env))
    by_name = {row["checkpoint"]: row for row in listed}
    assert by_name["checkpoint-10"]["type"] == "full"
    assert by_name["checkpoint-10"]["base_model"] == "Qwen/Qwen3-0.6B"
    assert by_name["checkpoint-20"]["type"] == "lora"
    assert by_name["checkpoint-20"]["base_model"] == "meta-llama/Llama-3.1-8B"
    assert [row["checkpoint"] for row in listed] == ["checkpoint-20", "checkpoint-10"]

    by_size = _browse(agent, store, "list", "--sort", "size", "-o", "csv", env=env)
    rows = list(csv.DictReader(io.StringIO(by_size)))
    assert [r["checkpoint"] for r in rows] == ["checkpoint-10", "checkpoint-20"]
    assert int(rows[0]["size"]) > int(rows[1]["size"])
    table = _browse(agent, store, "list", "--job-id", "brws001", env=env)
    assert table.splitlines()[0].split() == [
        "JOB",
        "ID",
        "CHECKPOINT",
        "NODE",
        "TYPE",
        "BASE",
        "MODEL",
        "SIZE",
        "CREATED",
        "AT",
    ]

    files = json.loads(
        _browse(
            agent,
            store,
            "files",
            "--job-id",
            "brws001",
            "--checkpoint",
            "checkpoint-10",
            "-o",
            "json",
            env=env,
        )
    )
    disk = agent.node_root / "mnt" / "ckpts" / "checkpoint-10"
    assert {f["path"] for f in files} == {"model.safetensors", "config.json"}
    for entry in files:
        data = (disk / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["size"] == len(data) and entry["node"] == 0
        assert entry["url"].endswith(f"/checkpoints/rank-0/checkpoint-10/{entry['path']}")

    summary = _browse(
        agent, store, "inspect", "--job-id", "brws001", "--checkpoint", "checkpoint-10", env=env
    )
    assert "model.safetensors: 2 tensors, 1,616 parameters" in summary
    assert "model.embed.weight  F32    100x16  1600" in summary
    detail = json.loads(
        _browse(
            agent,
            store,
            "inspect",
            "--job-id",
            "brws001",
            "--checkpoint",
            "checkpoint-20",
            "adapter_model.safetensors",
            "-o",
            "json",
            env=env,
        )
    )
    assert detail[0]["tensors"] == [
        {
            "name": "base_model.q_proj.lora_A.weight",
            "dtype": "BF16",
            "shape": [8, 64],
            "parameters": 512,
        }
    ]


def test_unknown_names_get_a_clear_error(agent: Agent) -> None:
    assert agent.run_job(trainer_job(agent, TRAINER), "--job-id", "brws002", env=FAST).code == 0
    store = str(agent.store)
    missing = agent(
        "checkpoints", "files", "--job-id", "brws002", "--checkpoint", "nope", "--store", store
    )
    assert missing.code == 1
    assert "no committed checkpoint 'nope'; committed: checkpoint-10, checkpoint-20" in missing.err
    not_tensors = agent(
        "checkpoints",
        "inspect",
        "--job-id",
        "brws002",
        "--checkpoint",
        "checkpoint-10",
        "config.json",
        "--store",
        store,
    )
    assert not_tensors.code == 2 and "config.json is not a safetensors file" in not_tensors.err
    no_job = agent("checkpoints", "list", "--job-id", "zzz9999", "--store", store)
    assert no_job.code == 1 and "no job 'zzz9999'" in no_job.err
