"""The store stopped for 20 s while a job stages its weights from it: the agent waits it out,
the job completes with every file mounted and intact. (The same outage during checkpoint
uploads is in tests/test_sidecar.py.)"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from conftest import Agent, finish, wait_for


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[servers.SeaweedFS]:
    server = servers.seaweedfs(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop()


def test_store_down_for_20_seconds_during_staging(agent: Agent, own_s3: servers.SeaweedFS) -> None:
    bucket = f"out{uuid.uuid4().hex[:8]}"
    own_s3.create_bucket(bucket)
    client = own_s3.client()
    files = {f"shard-{i}.bin": os.urandom(300_000) for i in range(4)}
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=f"model/{name}", Body=data)
    own_s3.stop()  # down before the job starts: listing and fetching must wait
    env = {
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": own_s3.endpoint,
    }
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
