"""The store (records, logs) on s3://, gs:// and azure://, through the real CLI, as on the file
store."""

from __future__ import annotations

import base64
import uuid

import pytest
import servers
from helpers import Agent, job_with
from sidecar_checks import FAST, ckpt_job, manifests

from bt_agent.settings import Environ
from bt_agent.storage import open_store


def _run_and_view(agent: Agent, store: str, env: dict[str, str]) -> None:
    spec = agent.spec(job_with(start_commands=["echo stored-remotely", "exit 4"]))
    args = ["--node-root", str(agent.node_root), "--secrets-dir", str(agent.secrets_dir)]
    result = agent("run", str(spec), *args, "--store", store, "--job-id", "remote1", env=env)
    assert result.code == 4, result.text
    view = agent("jobs", "view", "remote1", "--store", store, "-o", "json", env=env)
    assert view.code == 0, view.text
    assert '"status": "TRAINING_JOB_FAILED"' in view.out
    logs = agent("jobs", "logs", "remote1", "--store", store, env=env)
    assert "stored-remotely" in logs.out
    listing = agent("jobs", "list", "--store", store, "-o", "csv", env=env)
    assert "remote1" in listing.out


def test_store_on_s3(agent: Agent, s3_server: servers.SeaweedFS) -> None:
    bucket = f"store{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    _run_and_view(agent, f"s3://{bucket}/bt", env)


def test_store_on_gcs(agent: Agent, gcs_server: servers.FakeGCS) -> None:
    bucket = f"store{uuid.uuid4().hex[:8]}"
    gcs_server.create_bucket(bucket)
    _run_and_view(agent, f"gs://{bucket}/bt", {"STORAGE_EMULATOR_HOST": gcs_server.endpoint})


def test_store_on_azure(agent: Agent, azure_server: servers.Azurite) -> None:
    container = f"store{uuid.uuid4().hex[:8]}"
    azure_server.create_container(container)
    store = f"azure://{servers.AZURITE_ACCOUNT}/{container}/bt"
    _run_and_view(agent, store, {"AZURE_STORAGE_CONNECTION_STRING": azure_server.connection_string})


def test_an_earlier_job_s_files_are_uploaded_again_to_azure(
    agent: Agent, azure_server: servers.Azurite
) -> None:
    """On a reused node root, a checkpoint the new job adds to names the earlier job's files
    too: copied inside the store on the others (tests/faults/test_torn_commits.py), uploaded
    again to Azure, whose copies may end after they answer. Each is committed with what the
    node's file holds."""
    container = f"store{uuid.uuid4().hex[:8]}"
    azure_server.create_container(container)
    store = f"azure://{servers.AZURITE_ACCOUNT}/{container}/bt"
    connection = {"AZURE_STORAGE_CONNECTION_STRING": azure_server.connection_string}
    saves = (
        "cd $BT_CHECKPOINT_DIR && mkdir -p checkpoint-1 && echo a > checkpoint-1/a",
        "echo c > $BT_CHECKPOINT_DIR/checkpoint-1/c",
    )
    args = [*agent.context_args()[:2], "--store", store]
    for job_id, command in zip(("earl001", "earl002"), saves, strict=True):
        spec = str(agent.spec(ckpt_job(command)))
        result = agent("run", spec, *args, "--job-id", job_id, env={**FAST, **connection})
        assert result.code == 0, result.text
    said = "not uploaded again, except into checkpoints this job adds to (the store copies"
    assert "were already saved by job earl001" in result.err and said in result.err, result.err
    opened = open_store(store, Environ(connection))
    with opened:
        [manifest] = manifests(opened, "default", "earl002").values()
        assert sorted(f.path for f in manifest.files) == ["a", "c"]
        for name, text in (("a", b"a\n"), ("c", b"c\n")):
            key = f"projects/default/jobs/earl002/checkpoints/rank-0/checkpoint-1/{name}"
            assert opened.read_bytes(key) == text


@pytest.mark.parametrize("scheme", ["s3", "gs", "azure"])
def test_unreachable_store_is_a_clear_error(agent: Agent, scheme: str) -> None:
    """Where the requests were for, and why they did not get there in the system's words (not
    the engine's first line, nor the client library's type of error)."""
    key = base64.b64encode(b"k" * 64).decode()
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9",
        "AZURE_STORAGE_CONNECTION_STRING": (
            f"AccountName=nowhere;AccountKey={key};BlobEndpoint=http://127.0.0.1:9/nowhere"
        ),
    }
    where = "http://127.0.0.1:9/nowhere" if scheme == "azure" else "http://127.0.0.1:9"
    result = agent("jobs", "list", "--store", f"{scheme}://nowhere/bt", env=env, timeout=120)
    assert result.code == 1
    assert f"{scheme}://nowhere/bt" in result.err, result.err
    assert f"cannot reach {where} (Connection refused)" in result.err, result.err
    assert "Traceback" not in result.err and key not in result.err


@pytest.mark.parametrize("store", ["unreachable", "refused"])
def test_a_store_that_cannot_be_used_before_the_commands_is_a_failed_deploy(
    agent: Agent, s3_server: servers.SeaweedFS, store: str
) -> None:
    """The store is down past ``BT_STORE_OUTAGE_SECONDS``, or refuses the keys, when the node
    is claimed: no record can say why, so the exit code does, a failed deploy's (3), which no
    command ran to give (it was 1, what a failing command most often exits with)."""
    bucket = f"store{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9" if store == "unreachable" else s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": "not-the-key",
        "AWS_DEFAULT_REGION": "us-east-1",
        "BT_STORE_OUTAGE_SECONDS": "1",
    }
    ran = agent.root / "ran"
    spec = agent.spec(job_with(start_commands=[f"touch {ran}"]))
    args = ["--node-root", str(agent.node_root), "--secrets-dir", str(agent.secrets_dir)]
    result = agent("run", str(spec), *args, "--store", f"s3://{bucket}/bt", env=env, timeout=120)
    assert result.code == 3, result.text
    said = "cannot reach http://127.0.0.1:9" if store == "unreachable" else "access denied"
    assert said in result.err and "the job did not start (no command ran)" in result.err
    assert not ran.exists()
