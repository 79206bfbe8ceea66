"""Every path field of a spec, set to values that try to climb out of the node root, land on a
system directory or on the agent's own state: either the spec is refused (exit 2, the field
named) or the job runs with everything it writes inside the node root, and nothing the agent
or the user keeps there is lost."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest
import servers
from helpers import Agent

# Field path in the spec -> where the value goes in the job.
FIELDS = {
    "weights[0].mount_location": ("weights", 0, "mount_location"),
    "runtime.checkpointing_config.checkpoint_path": (
        "runtime",
        "checkpointing_config",
        "checkpoint_path",
    ),
    "runtime.load_checkpoint_config.download_folder": (
        "runtime",
        "load_checkpoint_config",
        "download_folder",
    ),
    "runtime.cache_config.mount_base_path": ("runtime", "cache_config", "mount_base_path"),
}
# Values every field must refuse.
REFUSED = [
    "/",
    "/..",
    "/etc",
    "/usr/lib/models",
    "/var",
    "/var/lib/bt-agent",
    "/var/cache/bt-agent/node",
    "relative/path",
    "../outside",
]
# Values that stay inside the node root once normalised: allowed, but must not escape.
CLIMBING = ["/../../outside", "/a/../../../outside", "//outside", "/./x/../outside"]


def _job(bucket: str) -> dict[str, Any]:
    return {
        "image": {"base_image": "x"},
        "weights": [{"source": f"s3://{bucket}/model", "mount_location": "/app/model"}],
        "runtime": {
            "start_commands": ["true"],
            "checkpointing_config": {"enabled": True, "checkpoint_path": "/mnt/ckpts"},
            "load_checkpoint_config": {
                "enabled": True,
                "checkpoints": [],
                "download_folder": "/tmp/loaded_checkpoints",
            },
            "cache_config": {"enabled": True, "mount_base_path": "/root/.cache"},
        },
    }


def _with(job: dict[str, Any], where: tuple[Any, ...], value: str) -> dict[str, Any]:
    job = copy.deepcopy(job)
    target: Any = job
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return job


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def bucket(s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"hostile{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(name)
    s3_server.client().put_object(Bucket=name, Key="model/config.json", Body=b"{}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", servers.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", servers.SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return name


@pytest.mark.parametrize("field", list(FIELDS))
def test_path_fields_cannot_leave_the_node_root_or_touch_what_it_keeps(
    agent: Agent, bucket: str, field: str
) -> None:
    kept = {
        "var/lib/bt-agent/keep.txt": "agent state",
        "var/cache/bt-agent/node/keep.txt": "node cache",
        "home/user/keep.txt": "the user's file",
    }
    for relative, text in kept.items():
        path = agent.node_root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sandbox = agent.root.parent
    before = {p.name for p in sandbox.iterdir()} | {p.name for p in agent.root.iterdir()}
    job = _job(bucket)

    for value in REFUSED:
        result = agent.run_job(_with(job, FIELDS[field], value))
        assert result.code == 2, f"{field}={value!r} was not refused:\n{result.text}"
        assert field in result.text, f"{field}={value!r}: the error does not name it"
        assert "Traceback" not in result.text

    # The user's own directory: a load dir there loses nothing that is not the loader's.
    values = [*CLIMBING] + ([] if field.startswith("weights") else ["/home/user"])
    for value in values:
        result = agent.run_job(_with(job, FIELDS[field], value))
        assert result.code == 0, f"{field}={value!r}:\n{result.text}"

    after = {p.name for p in sandbox.iterdir()} | {p.name for p in agent.root.iterdir()}
    assert after - before <= {"store", "code", "home"}, f"written outside: {after - before}"
    assert not Path("/outside").exists()
    assert list(agent.node_root.rglob("outside")), "the climbing values land inside the root"
    for relative, text in kept.items():
        assert (agent.node_root / relative).read_text() == text, relative
