"""Loading checkpoints before the commands run: latest and named references, per-node shards,
verification and conflicts. Source jobs are committed through the catalogue (as the checkpoint
sidecar commits them); the loading job runs through the real CLI."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import servers
from fault_proxy import FaultProxy
from helpers import Agent

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.records import JobRecord, Manifest, ManifestFile
from bt_agent.settings import Environ
from bt_agent.storage import FileStore, ObjectStore, open_store


def commit(
    agent: Agent,
    project: str,
    job_id: str,
    checkpoint: str,
    files: dict[str, bytes],
    created_at: str,
    rank: int = 0,
    node_count: int = 1,
    job_created: str = "2026-01-01T00:00:00.000Z",
    store: ObjectStore | None = None,
) -> None:
    catalog = Catalog(store or FileStore(agent.store))
    catalog.create_job(JobRecord(job_id, project, None, job_created, node_count, {}))
    prefix = checkpoint_prefix(project, job_id, rank, checkpoint)
    entries = []
    for path, data in files.items():
        catalog.store.write_bytes(f"{prefix}/{path}", data)
        entries.append(ManifestFile(path, len(data), hashlib.sha256(data).hexdigest()))
    catalog.write_manifest(
        Manifest(job_id, project, rank, checkpoint, created_at, created_at, entries)
    )


def load_job(*references: dict[str, Any], command: str = "true") -> dict[str, Any]:
    return {
        "image": {"base_image": "x"},
        "runtime": {
            "start_commands": [command],
            "load_checkpoint_config": {"enabled": True, "checkpoints": list(references)},
        },
    }


def loaded(agent: Agent, rank: int = 0) -> Path:
    return agent.node_root / "tmp" / "loaded_checkpoints" / f"rank-{rank}"


def test_latest_of_a_project_is_the_most_recent_job_with_a_checkpoint(agent: Agent) -> None:
    commit(agent, "p", "old1234", "checkpoint-10", {"w.bin": b"10"}, "2026-01-01T01:00:00Z")
    commit(agent, "p", "old1234", "checkpoint-20", {"w.bin": b"20"}, "2026-01-01T02:00:00Z")
    commit(
        agent,
        "p",
        "new5678",
        "checkpoint-5",
        {"w.bin": b"5"},
        "2026-01-02T01:00:00Z",
        job_created="2026-01-02T00:00:00.000Z",
    )
    result = agent.run_job(load_job({"typ": "baseten_latest_checkpoint", "project_name": "p"}))
    assert result.code == 0, result.text
    assert (loaded(agent) / "checkpoint-5" / "w.bin").read_bytes() == b"5"
    assert "loading checkpoint-5 of job new5678" in result.err


def test_latest_of_a_job_and_natural_ties(agent: Agent) -> None:
    same = "2026-01-01T01:00:00Z"
    commit(agent, "p", "job1234", "checkpoint-9", {"a": b"9"}, same)
    commit(agent, "p", "job1234", "checkpoint-10", {"a": b"10", "sub/b": b"x"}, same)
    result = agent.run_job(load_job({"typ": "baseten_latest_checkpoint", "job_id": "job1234"}))
    assert result.code == 0, result.text
    assert (loaded(agent) / "checkpoint-10" / "sub" / "b").read_bytes() == b"x"
    assert not (loaded(agent) / "checkpoint-9").exists()


def test_no_arguments_means_the_current_project(agent: Agent) -> None:
    commit(agent, "mine", "prev123", "checkpoint-3", {"s": b"3"}, "2026-01-01T01:00:00Z")
    commit(
        agent,
        "other",
        "oth1234",
        "checkpoint-9",
        {"s": b"9"},
        "2026-01-03T01:00:00Z",
        job_created="2026-01-03T00:00:00.000Z",
    )
    result = agent.run_job(load_job({}), "--project", "mine")
    assert result.code == 0, result.text
    assert (loaded(agent) / "checkpoint-3" / "s").read_bytes() == b"3"


def test_named_checkpoint(agent: Agent) -> None:
    commit(
        agent, "p", "job1234", "checkpoint-10", {"m.safetensors": b"ten"}, "2026-01-01T01:00:00Z"
    )
    commit(
        agent, "p", "job1234", "checkpoint-20", {"m.safetensors": b"twenty"}, "2026-01-01T02:00:00Z"
    )
    ref = {
        "typ": "baseten_named_checkpoint",
        "checkpoint_name": "checkpoint-10",
        "job_id": "job1234",
    }
    command = 'cat "$BT_LOAD_CHECKPOINT_DIR/rank-0/checkpoint-10/m.safetensors"'
    result = agent.run_job(load_job(ref, command=command))
    assert result.code == 0, result.text
    assert result.out == "ten"


def test_named_checkpoint_that_does_not_exist(agent: Agent) -> None:
    commit(agent, "p", "job1234", "checkpoint-10", {"a": b"1"}, "2026-01-01T01:00:00Z")
    ran = agent.root / "ran"
    ref = {
        "typ": "baseten_named_checkpoint",
        "checkpoint_name": "checkpoint-99",
        "job_id": "job1234",
    }
    result = agent.run_job(load_job(ref, command=f"touch {ran}"))
    assert result.code == 3
    assert "no committed checkpoint 'checkpoint-99'" in result.err
    assert "committed: checkpoint-10" in result.err and not ran.exists()


def test_project_without_committed_checkpoints(agent: Agent) -> None:
    Catalog(FileStore(agent.store)).create_job(
        JobRecord("empty12", "lonely", None, "2026-01-01T00:00:00Z", 1, {})
    )
    result = agent.run_job(load_job({"typ": "baseten_latest_checkpoint", "project_name": "lonely"}))
    assert result.code == 3
    assert "project 'lonely' has no committed checkpoints; its jobs are: empty12" in result.err
    assert (
        agent.job_view(
            next(p.stem for p in (agent.store / "jobs").glob("*.json") if p.stem != "empty12")
        )["status"]
        == "TRAINING_JOB_DEPLOY_FAILED"
    )


def test_each_node_loads_its_own_shard(agent: Agent) -> None:
    for rank in (0, 1):
        commit(
            agent,
            "p",
            "multi12",
            "checkpoint-4",
            {"shard.bin": f"rank{rank}".encode()},
            "2026-01-01T01:00:00Z",
            rank=rank,
            node_count=2,
        )
    ref = {"typ": "baseten_latest_checkpoint", "job_id": "multi12"}
    args = ["--group-size", "2", "--node-rank", "1", "--leader-addr", "127.0.0.1"]
    result = agent.run_job(load_job(ref), *args)
    assert result.code == 0, result.text
    assert (loaded(agent, 1) / "checkpoint-4" / "shard.bin").read_bytes() == b"rank1"


def test_a_node_beyond_the_source_jobs_nodes_loads_rank_0(agent: Agent) -> None:
    commit(agent, "p", "single1", "checkpoint-4", {"w": b"rank0"}, "2026-01-01T01:00:00Z")
    ref = {"typ": "baseten_latest_checkpoint", "job_id": "single1"}
    args = ["--group-size", "2", "--node-rank", "1", "--leader-addr", "127.0.0.1"]
    result = agent.run_job(load_job(ref), *args)
    assert result.code == 0, result.text
    assert "node 1 loads rank 0's checkpoint" in result.err
    assert (loaded(agent, 1) / "checkpoint-4" / "w").read_bytes() == b"rank0"


def test_corrupted_file_is_refused_and_nothing_partial_is_left(agent: Agent) -> None:
    commit(
        agent, "p", "job1234", "checkpoint-1", {"a": b"good", "b": b"fine"}, "2026-01-01T01:00:00Z"
    )
    stored = agent.store / checkpoint_prefix("p", "job1234", 0, "checkpoint-1") / "b"
    stored.write_bytes(b"evil")  # same size, other content
    result = agent.run_job(load_job({"typ": "baseten_latest_checkpoint", "job_id": "job1234"}))
    assert result.code == 3 and "sha256" in result.err
    base = loaded(agent)
    leftovers = list(base.rglob("*")) if base.exists() else []
    assert leftovers == [], "no partial checkpoint left in the load dir"


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_disk_that_refuses_a_loaded_file_fails_the_deploy_naming_it(
    agent: Agent, own_s3: servers.SeaweedFS, kind: str
) -> None:
    """A file of the checkpoint that this machine's disk refuses (the agent's file size limit
    below its size: ``EFBIG``, as a full disk gives ``ENOSPC``) fails the deploy with the
    disk's error and the path it was written to, nothing left in the load dir. From an object
    store it crashed the agent (its node record left DEPLOYING); from a file store it was said
    as the store's error, naming the stored file."""
    env = own_s3.client_env() if kind == "s3" else {}
    where = ["--store", "s3://store/bt"] if kind == "s3" else []
    with (
        open_store("s3://store/bt", Environ(env)) if kind == "s3" else FileStore(agent.store)
    ) as store:
        commit(
            agent,
            "p",
            "job1234",
            "checkpoint-1",
            {"big": os.urandom(3_000_000)},
            "2026-01-01T01:00Z",
            store=store,
        )
    ran = agent.root / "ran"
    job = load_job(
        {"typ": "baseten_latest_checkpoint", "job_id": "job1234"}, command=f"touch {ran}"
    )
    result = agent(
        "run", str(agent.spec(job)), *agent.context_args(), *where, env=env, file_size_limit=10**6
    )
    assert result.code == 3, result.text
    said = "checkpoint-1 of job job1234 (project p, rank 0): [Errno 27] File too large: "
    assert said in result.err and f"'{loaded(agent)}/" in result.err, result.err
    assert "the agent failed" not in result.err and not ran.exists()
    base = loaded(agent)
    assert not (list(base.rglob("*")) if base.exists() else []), "nothing left in the load dir"


def test_two_references_landing_on_one_path(agent: Agent) -> None:
    commit(agent, "p", "aaa1111", "checkpoint-7", {"a": b"1"}, "2026-01-01T01:00:00Z")
    commit(agent, "p", "bbb2222", "checkpoint-7", {"a": b"2"}, "2026-01-01T02:00:00Z")
    result = agent.run_job(
        load_job(
            {"typ": "baseten_latest_checkpoint", "job_id": "aaa1111"},
            {"typ": "baseten_latest_checkpoint", "job_id": "bbb2222"},
        )
    )
    assert result.code == 3 and "would land at the same path" in result.err


def test_serving_download_of_a_deploy_checkpoints_config(agent: Agent) -> None:
    import json

    commit(
        agent,
        "p",
        "job1234",
        "checkpoint-20",
        {"adapter_model.safetensors": b"lora", "adapter_config.json": b'{"r": 16}'},
        "2026-01-01T01:00:00Z",
    )
    config = agent.root / "deploy.json"
    config.write_text(
        json.dumps(
            {
                "model_name": "m",
                "checkpoint_details": {
                    "download_folder": "/tmp/training_checkpoints",
                    "checkpoints": [
                        {"training_job_id": "job1234", "checkpoint_name": "checkpoint-20"}
                    ],
                },
            }
        )
    )
    args = ["--store", str(agent.store), "--node-root", str(agent.node_root)]
    result = agent("checkpoints", "download", str(config), *args)
    assert result.code == 0, result.text
    target = agent.node_root / "tmp/training_checkpoints/job1234/rank-0/checkpoint-20"
    assert result.out.strip() == str(target)
    assert (target / "adapter_config.json").read_bytes() == b'{"r": 16}'
    config.write_text(json.dumps({"checkpoints": [{"training_job_id": "job1234"}]}))
    bad = agent("checkpoints", "download", str(config), *args)
    assert bad.code == 2 and "checkpoints[0].checkpoint_name" in bad.err


def test_a_checkpoint_of_many_files_is_fetched_many_at_once(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """A sharded checkpoint from a store far away (each request held 0.2 s on the way): its
    files, small (one batch) and large (a thread each), go many at once, not one after another
    (which took a round trip per file before the commands could start), and each arrives
    verified."""
    proxy = FaultProxy(own_s3.port, delay=0.2, delay_only="/checkpoints/")
    env = {**own_s3.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    files = {f"shards/{i:03}.bin": os.urandom(4096) for i in range(40)}
    files |= {f"model-{i}.safetensors": os.urandom(2 << 20) for i in range(6)}
    try:
        with open_store("s3://store/bt", Environ(env)) as store:
            commit(
                agent, "p", "big1234", "checkpoint-3", files, "2026-01-01T01:00:00Z", store=store
            )
        result = agent.run_job(
            load_job({"typ": "baseten_latest_checkpoint", "job_id": "big1234"}),
            "--store",
            "s3://store/bt",
            env=env,
        )
    finally:
        proxy.close()
    assert result.code == 0, result.text
    target = loaded(agent) / "checkpoint-3"
    assert {p: (target / p).read_bytes() for p in files} == files
    assert proxy.most_waiting >= 8, f"at most {proxy.most_waiting} file request(s) at once"


def test_a_corrupted_file_among_many_is_refused_on_an_object_store(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """The batch of small files verifies each against the manifest as the one-by-one path
    does: a file whose content changed in the store fails the load, nothing left behind."""
    files = {f"shards/{i:03}.bin": os.urandom(4096) for i in range(20)}
    env = own_s3.client_env()
    with open_store("s3://store/bt", Environ(env)) as store:
        commit(agent, "p", "bad1234", "checkpoint-1", files, "2026-01-01T01:00:00Z", store=store)
        key = checkpoint_prefix("p", "bad1234", 0, "checkpoint-1") + "/shards/007.bin"
        store.write_bytes(key, os.urandom(4096))  # same size, other content
    result = agent.run_job(
        load_job({"typ": "baseten_latest_checkpoint", "job_id": "bad1234"}),
        "--store",
        "s3://store/bt",
        env=env,
    )
    assert result.code == 3 and "sha256" in result.err and "shards/007.bin" in result.err
    base = loaded(agent)
    assert not base.exists() or list(base.rglob("*")) == [], "no partial checkpoint left"


def test_a_stopped_checkpoint_download_ends_at_once_and_leaves_nothing_behind(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """Ctrl-C (SIGINT) or SIGTERM while `bt-agent checkpoints download` fetches a checkpoint
    through a slow link (the whole would take over half a minute): it ends at once, says so,
    exits 128+N, and leaves no file in the download folder, partial or whole, once it has
    ended. What one killed outright (SIGKILL) left is removed by the next download of the
    checkpoint, which completes."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from far_link import FarLink
    from helpers import finish, wait_for

    files = {f"shards/{i:03}.bin": os.urandom(4096) for i in range(300)}
    files["model.safetensors"] = os.urandom(32 << 20)
    with open_store("s3://store/bt", Environ(own_s3.client_env())) as store:
        commit(agent, "p", "far1234", "checkpoint-3", files, "2026-01-01T01:00:00Z", store=store)
    config = agent.root / "deploy.json"
    wanted = [{"training_job_id": "far1234", "checkpoint_name": "checkpoint-3"}]
    config.write_text(json.dumps({"checkpoints": wanted, "download_folder": "/dl"}))
    folder = agent.node_root / "dl"
    command = ["checkpoints", "download", str(config), "--store", "s3://store/bt"]
    command += ["--node-root", str(agent.node_root)]
    far = FarLink(own_s3.port, 0.0, 1e6)
    try:
        slow = agent.full_env({**own_s3.client_env(), "AWS_ENDPOINT_URL": far.endpoint})
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            process = subprocess.Popen(
                [sys.executable, "-m", "bt_agent", *command],
                env=slow,
                stderr=open(agent.root / "agent.err", "w"),  # noqa: SIM115 (closed with it)
                stdout=subprocess.DEVNULL,
            )
            wait_for(lambda: any(folder.rglob("*.incomplete")), 30, "the download")
            sent = time.monotonic()
            process.send_signal(number)
            if number == signal.SIGKILL:
                assert process.wait(10) == -signal.SIGKILL
                killed = [path for path in folder.rglob("*") if ".loading-" in str(path)]
                assert any(path.is_file() for path in killed), "SIGKILL left its files"
                break
            assert finish(process, 30, agent) == 128 + number, agent.output()
            assert time.monotonic() - sent < 5, "the stop waited on the download"
            said = (agent.root / "agent.err").read_text()
            assert f"stopped by {signal.Signals(number).name} before it was done" in said, said
            left = [path for path in folder.rglob("*") if not path.is_dir()]
            assert left == [], f"{signal.Signals(number).name} left {left[:3]}"
    finally:
        far.close()
    result = agent(*command, env=own_s3.client_env())
    assert result.code == 0, result.text
    target = folder / "far1234/rank-0/checkpoint-3"
    assert (target / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert sorted(p.name for p in folder.rglob("*") if p.name.startswith(".")) == []
