"""Our validator against the real SDK (truss 0.18.35): the same verdict on every spec.

The SDK is pydantic; bt-agent mirrors it without pydantic (start-up time). These tests hold the
mirror to the original: every case the SDK rejects, we reject; every case it accepts, we accept
unless one of our own extra checks (``OURS_ONLY``) applies; the SDK refuses our extensions
(``EXTENSIONS``: ``bt://`` weights sources).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_cases import EXTENSIONS, FULL_EXAMPLE, INVALID, OURS_ONLY, VALID

from bt_agent.errors import Problem
from bt_agent.spec.checks import semantic_problems
from bt_agent.spec.loader import load
from bt_agent.spec.models import TRAINING_JOB
from bt_agent.spec.schema import INVALID as BAD

definitions = require("truss_train.definitions", "pip install -e '.[test]'")


def sdk_accepts(data: Any) -> bool:
    """The SDK's verdict. ``runtime.artifacts`` exists only on the wire (the deploy step adds
    it; the SDK model rejects it), so it is taken out first."""
    runtime = data.get("runtime") if isinstance(data, dict) else None
    if isinstance(runtime, dict) and "artifacts" in runtime:
        data = {**data, "runtime": {k: v for k, v in runtime.items() if k != "artifacts"}}
    try:
        definitions.TrainingJob.model_validate_json(json.dumps(data))
    except Exception:  # pydantic.ValidationError, or the SDK's own ValueError/TypeError
        return False
    return True


def ours(data: Any) -> tuple[bool, bool]:
    """(schema accepts, semantic checks pass)."""
    problems: list[Problem] = []
    job = TRAINING_JOB(data, "", problems)
    if job is BAD:
        return False, False
    return True, not semantic_problems(job)


@pytest.mark.parametrize("name", sorted(VALID))
def test_sdk_accepts_our_valid_cases(name: str) -> None:
    assert sdk_accepts(VALID[name]) == (name not in EXTENSIONS)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_sdk_agrees_on_invalid_cases(name: str) -> None:
    data, _ = INVALID[name]
    assert sdk_accepts(data) == (name in OURS_ONLY)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.floats(allow_nan=False, width=16)
    | st.sampled_from(
        [
            "",
            "x",
            "2",
            "H100",
            "H100:2",
            "/abs",
            "rel",
            "hf://a/b",
            "s3://b/p",
            "s3://b@v",
            "custom_secret",
            "AWS_OIDC",
            "spot",
            "on_demand",
            "baseten_named_checkpoint",
            "loops_checkpoint",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(
            st.sampled_from(
                [
                    "name",
                    "typ",
                    "count",
                    "accelerator",
                    "source",
                    "mount_location",
                    "enabled",
                    "auth_method",
                    "job_id",
                    "checkpoint_name",
                    "zz",
                ]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index))
    return found


def _replace(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy_ = copy.deepcopy(data)
    target = copy_
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy_


@settings(
    max_examples=int(os.environ.get("BT_PARITY_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_mutated_specs_get_the_sdk_verdict(data: st.DataObject) -> None:
    paths = [p for p in _paths(FULL_EXAMPLE)[1:] if p[:2] != ("runtime", "artifacts")]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(JSON_VALUES)
    spec = _replace(FULL_EXAMPLE, path, value)
    schema_ok, semantics_ok = ours(spec)
    assert schema_ok == sdk_accepts(spec), (path, value)
    if not schema_ok:
        assert not semantics_ok


CONFIG = """
import truss_train
from truss_train import definitions

job = definitions.TrainingJob(
    image=definitions.Image(base_image="pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime"),
    compute=definitions.Compute(node_count=2, accelerator="H100:8"),
    runtime=definitions.Runtime(
        start_commands=["torchrun train.py"],
        environment_variables={"HF_TOKEN": definitions.SecretReference(name="hf_access_token"),
                               "MODE": "fast"},
        enable_cache=True,
        checkpointing_config=definitions.CheckpointingConfig(enabled=True),
        load_checkpoint_config=definitions.LoadCheckpointConfig(
            enabled=True,
            checkpoints=[definitions.BasetenCheckpoint.from_named_checkpoint(
                checkpoint_name="checkpoint-20", job_id="gvpql31")],
        ),
    ),
    weights=[truss_train.WeightsSource(source="hf://Qwen/Qwen3-0.6B@main",
                                       mount_location="/app/models/qwen",
                                       allow_patterns=["*.safetensors"])],
)
project = definitions.TrainingProject(name="from-config", job=job)
"""


def test_config_py_through_the_real_sdk(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    loaded = load(str(path))
    assert loaded.project_name == "from-config"
    job = loaded.job
    assert job.compute.node_count == 2 and job.compute.gpu_count == 8
    assert job.runtime.cache.enabled and job.runtime.cache.enable_legacy_hf_mount
    assert job.weights[0].allow_patterns == ["*.safetensors"]
    assert job.runtime.checkpoints_to_load[0].typ == "baseten_named_checkpoint"
    assert loaded.code_dir == tmp_path


def test_config_py_with_two_projects(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(CONFIG + "\nother = definitions.TrainingProject(name='b', job=job)\n")
    with pytest.raises(Exception, match="defines 2 TrainingProject"):
        load(str(path))


def test_config_py_that_the_sdk_rejects(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(
        "import truss_train\ntruss_train.WeightsSource(source='Qwen/Qwen3', mount_location='/m')\n"
    )
    with pytest.raises(Exception, match="missing a URI scheme"):
        load(str(path))


def test_config_py_without_truss(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    with pytest.raises(Exception, match="needs the truss package"):
        load(str(path), config_python=_python_without_truss(tmp_path))


def _python_without_truss(tmp_path: Path) -> str:
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")
