"""The store stopped and started again while a job stages its weights, while it loads earlier
checkpoints, while the sidecar uploads, when the job starts and when it ends: the agent waits
it out, the job completes with every file intact, and its records and log reach the store once
it is back."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import servers
from helpers import Agent, finish, wait_for
from sidecar_checks import FAST, WRITER, assert_store_holds, ckpt_job, manifests

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.records import JobRecord, Manifest, ManifestFile
from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store
from bt_agent.storage.registry import R2_ENDPOINT_VARIABLE


def _node_record(store: ObjectStore, job_id: str) -> dict[str, Any]:
    return dict(json.loads(store.read_bytes(f"projects/default/jobs/{job_id}/nodes/rank-0.json")))


def test_store_down_for_20_seconds_during_staging(agent: Agent, own_s3: servers.SeaweedFS) -> None:
    bucket = f"out{uuid.uuid4().hex[:8]}"
    own_s3.create_bucket(bucket)
    client = own_s3.client()
    files = {f"shard-{i}.bin": os.urandom(300_000) for i in range(4)}
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=f"model/{name}", Body=data)
    own_s3.stop()  # down before the job starts: listing and fetching must wait
    env = own_s3.client_env()
    job = {
        "image": {"base_image": "x"},
        "weights": [{"source": f"s3://{bucket}/model", "mount_location": "/app/model"}],
        "runtime": {"start_commands": ["ls $BT_WORKING_DIR/../../app/model"]},
    }
    process = agent.start(job, "--job-id", "outs001", env=env)
    wait_for(lambda: "the source is unreachable" in agent.output(), 60, "the agent to notice")
    restart = threading.Timer(20, own_s3.start)
    started = time.monotonic()
    restart.start()
    try:
        assert finish(process, 180, agent) == 0, agent.output()
    finally:
        restart.join()
    assert time.monotonic() - started >= 19
    mount = agent.node_root / "app" / "model"
    for name, data in files.items():
        assert hashlib.sha256((mount / name).read_bytes()).digest() == hashlib.sha256(data).digest()
    assert "retrying for up to" in agent.output()
    assert "weights[0]: the source is reachable again after" in agent.output()


def _commit(store: ObjectStore, job_id: str, files: dict[str, bytes]) -> None:
    """A committed checkpoint, as the sidecar of an earlier job leaves it."""
    catalog = Catalog(store)
    catalog.create_job(JobRecord(job_id, "default", None, "2026-01-01T00:00:00.000Z", 1, {}))
    prefix = checkpoint_prefix("default", job_id, 0, "checkpoint-7")
    for path, data in files.items():
        store.write_bytes(f"{prefix}/{path}", data)
    entries = [ManifestFile(p, len(d), hashlib.sha256(d).hexdigest()) for p, d in files.items()]
    at = "2026-01-01T01:00:00.000Z"
    catalog.write_manifest(Manifest(job_id, "default", 0, "checkpoint-7", at, at, entries))


def test_store_down_for_20_seconds_while_checkpoints_load(
    agent: Agent, own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The store stops between staging and loading: the weights come from a second server,
    down until the test has stopped the store, so the outage begins at a known point."""
    url = "s3://store/bt"
    env = own_s3.client_env()
    files = {f"shard-{i}.safetensors": os.urandom(200_000) for i in range(3)}
    _commit(open_store(url, Environ(env)), "src0001", files)
    weights = servers.seaweedfs(tmp_path / "weights")
    try:
        weights.create_bucket("wts")
        weights.client().put_object(Bucket="wts", Key="base/config.json", Body=b"{}")
        weights.stop()
        job = {
            "image": {"base_image": "x"},
            # An R2 source has an endpoint of its own (s3:// sources share the store's).
            "weights": [{"source": "r2://acct.wts/base", "mount_location": "/app/base"}],
            "runtime": {
                "start_commands": ["ls $BT_LOAD_CHECKPOINT_DIR/rank-0/checkpoint-7"],
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [{"typ": "baseten_latest_checkpoint", "job_id": "src0001"}],
                },
            },
        }
        env[R2_ENDPOINT_VARIABLE] = weights.endpoint
        process = agent.start(job, "--job-id", "outl001", "--store", url, env=env)
        wait_for(lambda: "weights[0]: the source is unreachable" in agent.output(), 60, "waiting")
        own_s3.stop()
        weights.start()
        stopped = time.monotonic()
        wait_for(
            lambda: "checkpoints[0]: the store is unreachable" in agent.output(), 60, "the loader"
        )
        time.sleep(max(0.0, 20 - (time.monotonic() - stopped)))
        own_s3.start()
        assert finish(process, 180, agent) == 0, agent.output()
    finally:
        weights.stop()
    assert "checkpoints[0]: the store is reachable again after" in agent.output()
    loaded = agent.node_root / "tmp" / "loaded_checkpoints" / "rank-0" / "checkpoint-7"
    assert {p.name: p.read_bytes() for p in loaded.iterdir()} == files
    assert _node_record(open_store(url, Environ(env)), "outl001")["status"] == (
        "TRAINING_JOB_COMPLETED"
    )


def test_store_down_when_the_job_starts_and_when_it_ends(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """The job waits for the store to create its record, having said what it runs first (a
    store far away or down kept the first line back); the commands' end is recorded, with the
    whole log, once the store is back, and the exit code is the job's."""
    url = "s3://store/bt"
    env = own_s3.client_env()
    flag = agent.root / "go"
    job = {
        "image": {"base_image": "x"},
        "runtime": {"start_commands": [f"while [ ! -e {flag} ]; do sleep 0.1; done; echo trained"]},
    }
    own_s3.stop()
    process = agent.start(job, "--job-id", "oute001", "--store", url, env=env)
    wait_for(lambda: "the store is unreachable" in agent.output(), 60, "the agent to wait")
    first = agent.output().splitlines()[0]
    assert first.startswith("bt-agent: job oute001 (project default), node 0 of 1"), first
    time.sleep(8)
    own_s3.start()
    wait_for(lambda: "start_commands[0]" in agent.output(), 60, "the commands to start")
    assert "the store is reachable again after" in agent.output()  # the record created
    own_s3.stop()
    flag.touch()  # the commands end while the store is down
    wait_for(lambda: "COMPLETED (exit 0)" in agent.output(), 30, "the commands to end")
    time.sleep(8)
    assert process.poll() is None, "the agent waits to write its records"
    own_s3.start()
    assert finish(process, 120, agent) == 0, agent.output()
    store = open_store(url, Environ(env))
    assert _node_record(store, "oute001")["status"] == "TRAINING_JOB_COMPLETED"
    log = store.read_bytes("projects/default/jobs/oute001/logs/rank-0.log").decode()
    assert "trained" in log and "job oute001 COMPLETED (exit 0)" in log
    assert "the store is reachable again" in agent.output()


@pytest.mark.parametrize("ending", ["stopped", "ended"])
def test_records_the_store_never_took_are_said_with_what_ended_the_wait(
    agent: Agent, own_s3: servers.SeaweedFS, ending: str
) -> None:
    """The store goes down for good while the commands run. Stopped (SIGTERM, a grace period
    of 3 s), the agent ends within the grace period and says the records could not be saved
    before it ended (it said the store "stayed unreachable", having waited 3 s, not the
    outage wait); ending on its own, it waits out the outage (here 3 s) and says so. Either
    way the exit code is the job's."""
    import signal

    env = {**own_s3.client_env(), "BT_STORE_OUTAGE_SECONDS": "3"}
    flag = agent.root / "go"
    job = {
        "image": {"base_image": "x"},
        "runtime": {"start_commands": [f"while [ ! -e {flag} ]; do sleep 0.1; done"]},
    }
    process = agent.start(
        job, "--job-id", "outr001", "--store", "s3://store/bt", "--grace-period", "3", env=env
    )
    wait_for(lambda: "start_commands[0]" in agent.output(), 60, "the commands to start")
    own_s3.stop()
    if ending == "stopped":
        process.send_signal(signal.SIGTERM)
    else:
        flag.touch()
    sent = time.monotonic()
    code = finish(process, 60, agent)
    took = time.monotonic() - sent
    if ending == "stopped":
        assert code == 143 and took < 3.5, (took, agent.output())
        why = "before the 3 s grace period ended"
    else:
        assert code == 0 and took >= 3, (took, agent.output())
        why = "while the store stayed unreachable (3 s)"
    status = "STOPPED" if ending == "stopped" else "COMPLETED"
    said = (
        f"the node record ({status}) and log could not be saved {why}; the exit code is the job's"
    )
    assert said in agent.output(), agent.output()


@pytest.mark.parametrize("transport", ["http", "https"])
def test_store_outage_of_20_seconds_loses_nothing(
    agent: Agent, own_s3: servers.SeaweedFS, transport: str
) -> None:
    """The store down for 20 s while checkpoints are written: every upload is retried until it
    is back, over plain HTTP and over TLS alike."""
    env = {**FAST, **own_s3.client_env(tls=transport == "https")}
    ledger = agent.root / "ledger.json"
    flag = agent.root / "go"
    command = (
        f"{WRITER} {ledger} --steps 1 --size 2000000 && "
        f"while [ ! -e {flag} ]; do sleep 0.1; done && "
        f"{WRITER} {ledger}.2 --first 2 --steps 2 --size 3000000"
    )
    process = agent.start(
        ckpt_job(command), "--job-id", "outg001", "--store", "s3://store/bt", env=env
    )
    store = open_store("s3://store/bt", Environ(env))
    try:
        wait_for(lambda: "checkpoint-1" in manifests(store, "default", "outg001"), 60, "commit 1")
        own_s3.stop()
        flag.touch()  # the trainer writes two more checkpoints while the store is down
        time.sleep(20)
        own_s3.start()
        assert finish(process, 180, agent) == 0, agent.output()
    finally:
        if process.poll() is None:
            process.kill()
    written = {**json.loads(ledger.read_text()), **json.loads(Path(f"{ledger}.2").read_text())}
    assert_store_holds(store, written, "outg001")
    uploads = json.loads(store.read_bytes("projects/default/jobs/outg001/nodes/rank-0.json"))[
        "uploads"
    ]
    assert uploads["failures"] > 0 and uploads["not_durable"] == []
    assert "upload of checkpoint-2/" in agent.output() and "retrying" in agent.output()
