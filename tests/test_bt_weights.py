"""``bt://`` weights sources: checkpoints that an earlier job trained and the real sidecar
committed (two nodes, on the file store and on SeaweedFS), staged as weights through the node
cache, read by the next job's command, and warm on the run after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import servers
from helpers import Agent, run_nodes

from bt_agent.settings import NODE_CACHE_CONTAINER_DIR

FAST = {"BT_CHECKPOINT_QUIET_SECONDS": "0.3"}
PROJECT = ["--project", "bt-refs"]

# Each node saves two checkpoints of its own shard, then ends: every save is committed.
SAVES = (
    'for step in 1 2; do d="$BT_CHECKPOINT_DIR/checkpoint-$step"; mkdir -p "$d/sub"; '
    'echo "rank $BT_NODE_RANK step $step" > "$d/shard.txt"; '
    'echo "{\\"step\\": $step}" > "$d/sub/state.json"; echo notes > "$d/notes.md"; done'
)


def _trained(agent: Agent, job_id: str, store: str | None = None) -> None:
    job = {
        "image": {"base_image": "x"},
        "compute": {"node_count": 2},
        "runtime": {"start_commands": [SAVES], "checkpointing_config": {"enabled": True}},
    }
    store_args = ("--store", store or str(agent.store))
    codes = run_nodes(agent, job, job_id, "train", *PROJECT, *store_args, env=FAST, timeout=120)
    assert codes == [0, 0], agent.output()


def _weights_job(*sources: tuple[str, str], command: str, **extra: Any) -> dict[str, Any]:
    return {
        "image": {"base_image": "x"},
        "weights": [{"source": s, "mount_location": m, **extra} for s, m in sources],
        "runtime": {"start_commands": [command]},
    }


def _store(
    agent: Agent, backend: str, request: pytest.FixtureRequest
) -> tuple[str, dict[str, str]]:
    """The job store of ``backend``: the agent's directory, a bucket or an Azure container."""
    if backend == "file":
        return str(agent.store), {}
    bucket = f"btrefs{abs(hash(agent.mark)) % 10**8}"
    if backend == "azure":
        azure: servers.Azurite = request.getfixturevalue("azure_server")
        azure.create_container(bucket)
        account = servers.AZURITE_ACCOUNT
        return f"azure://{account}/{bucket}/bt", {
            "AZURE_STORAGE_CONNECTION_STRING": azure.connection_string
        }
    s3: servers.SeaweedFS = request.getfixturevalue("s3_server")
    s3.create_bucket(bucket)
    return f"s3://{bucket}/bt", {
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3.endpoint,
    }


@pytest.mark.parametrize("backend", ["file", "s3", "azure"])
def test_a_jobs_checkpoints_staged_as_weights_of_the_next(
    agent: Agent, backend: str, request: pytest.FixtureRequest
) -> None:
    store, env = _store(agent, backend, request)
    agent.env |= env
    _trained(agent, "trn0001", store)
    latest, shard = agent.node_root / "app/latest", agent.node_root / "app/shard"
    job = _weights_job(
        ("bt://trn0001/latest", "/app/latest"),
        ("bt://trn0001/checkpoint-1?rank=1", "/app/shard"),
        command=f"cat {latest}/shard.txt {latest}/sub/state.json {shard}/shard.txt",
        ignore_patterns=["*.md"],
    )
    args = ["--store", store, *PROJECT, "--job-id", "use0001"]
    first = agent("run", str(agent.spec(job)), *agent.context_args()[:2], *args, env=FAST)
    assert first.code == 0, first.text
    assert first.out.splitlines() == ["rank 0 step 2", '{"step": 2}', "rank 1 step 1"]
    assert "weights[0] bt://trn0001/checkpoint-2: 2 files" in first.err, first.err
    assert "weights[1] bt://trn0001/checkpoint-1?rank=1: 2 files" in first.err
    assert "0 in the node cache, 2 to fetch" in first.err
    assert not (latest / "notes.md").exists(), "ignore_patterns apply"

    args[-1] = "use0002"
    warm = agent("run", str(agent.spec(job)), *agent.context_args()[:2], *args, env=FAST)
    assert warm.code == 0, warm.text
    assert warm.out == first.out
    assert warm.err.count("2 in the node cache, 0 to fetch") == 2, warm.err
    objects = agent.node_root / NODE_CACHE_CONTAINER_DIR.lstrip("/") / "objects"
    cache = {p.stat().st_ino for p in objects.rglob("*") if p.is_file()}
    assert (latest / "shard.txt").stat().st_ino in cache, "a warm start links the cache's file"


def test_a_missing_checkpoint_fails_the_deploy_naming_the_committed_ones(agent: Agent) -> None:
    _trained(agent, "trn0002")
    ran = agent.root / "ran"
    for source, said in (
        ("bt://trn0002/checkpoint-9", "committed: checkpoint-1, checkpoint-2"),
        (
            "bt://trn0002/latest?rank=5",
            "no committed checkpoint on rank 5; ranks with commits: 0, 1",
        ),
        ("bt://nosuch1/latest", "no job 'nosuch1' in the store"),
    ):
        result = agent.run_job(_weights_job((source, "/w"), command=f"touch {ran}"), *PROJECT)
        assert result.code == 3, result.text
        assert f"weights[0] {source}: " in result.err and said in result.err, result.err
        assert not ran.exists() and not (agent.node_root / "w").exists()
    ids = [p.stem for p in (agent.store / "jobs").glob("*.json") if p.stem != "trn0002"]
    failed = [agent.job_view(job_id)["status"] for job_id in ids]
    assert failed == ["TRAINING_JOB_DEPLOY_FAILED"] * 3


def test_a_reference_to_the_current_job_is_refused(agent: Agent) -> None:
    _trained(agent, "trn0003")
    job = _weights_job(("bt://trn0003/latest", "/w"), command="true")
    result = agent.run_job(job, *PROJECT, "--job-id", "trn0003", "--node-rank", "0")
    assert result.code == 3, result.text
    assert "refers to this job's own checkpoints" in result.err, result.err


def test_serving_download_of_bt_references(agent: Agent, tmp_path: Path) -> None:
    _trained(agent, "trn0004")
    config = tmp_path / "deploy.json"
    config.write_text(
        json.dumps(
            {
                "checkpoint_details": {
                    "download_folder": "/srv/ckpts",
                    "checkpoints": ["bt://trn0004/latest?rank=1", "bt://trn0004/checkpoint-1"],
                }
            }
        )
    )
    result = agent(
        "checkpoints",
        "download",
        str(config),
        "--store",
        str(agent.store),
        *agent.context_args()[:2],
    )
    assert result.code == 0, result.text
    folder = agent.node_root / "srv/ckpts/trn0004"
    assert (folder / "rank-1/checkpoint-2/shard.txt").read_text() == "rank 1 step 2\n"
    assert (folder / "rank-0/checkpoint-1/shard.txt").read_text() == "rank 0 step 1\n"
