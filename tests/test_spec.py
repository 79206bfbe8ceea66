"""The spec loader: every SDK rule and every rule of ours, with field paths, all at once."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from spec_cases import INVALID, VALID, job

from bt_agent.errors import SpecError
from bt_agent.spec.loader import load
from bt_agent.spec.models import Accelerator, LatestCheckpoint, NamedCheckpoint, SecretReference


def _load_json(tmp_path: Path, data: Any) -> Any:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(data))
    return load(str(path))


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_specs_load(tmp_path: Path, name: str) -> None:
    loaded = _load_json(tmp_path, {"training_job": VALID[name]})
    assert loaded.job.image.base_image


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_spec_reports_its_field(tmp_path: Path, name: str) -> None:
    data, path = INVALID[name]
    with pytest.raises(SpecError) as caught:
        _load_json(tmp_path, {"training_job": data})
    paths = [p.path for p in caught.value.problems]
    assert path in paths, caught.value
    assert all(p.hint for p in caught.value.problems), "every problem says how to fix it"


@pytest.mark.parametrize(
    ("source", "said", "hint"),
    [
        (
            "hf://org/model/unet@v1",
            "names a path inside the repository ('unet')",
            "write it as hf://org/model@v1 with allow_patterns ['unet/**']",
        ),
        (
            "hf://datasets/org/data/train",
            "names a path inside the repository ('train')",
            "write it as hf://datasets/org/data with allow_patterns ['train/**']",
        ),
        (
            "azure://acct/my container/p",
            "names 'my container', which no bucket can be named",
            "write it as azure://<account>/<container>/path",
        ),
        ("s3:/bucket/model", "is missing a URI scheme", "write it as s3://bucket/model"),
        ("hf:org/model", "is missing a URI scheme", "write it as hf://org/model"),
        (
            "Qwen/Qwen3",
            "is missing a URI scheme",
            "start it with one of: azure://, bt://, cw://, gs://, hf://, https://, r2://, s3://",
        ),
    ],
)
def test_a_source_the_store_cannot_read_says_how_to_write_it(
    tmp_path: Path, source: str, said: str, hint: str
) -> None:
    data = job(weights=[{"source": source, "mount_location": "/m"}])
    with pytest.raises(SpecError) as caught:
        _load_json(tmp_path, data)
    (problem,) = caught.value.problems
    assert problem.path == "weights[0].source"
    assert said in problem.message and problem.hint == hint, problem


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    data = job(
        compute={"node_count": "2"},
        runtime={"start_commands": "x"},
        weights=[{"source": "Qwen/Qwen3", "mount_location": "rel"}],
    )
    with pytest.raises(SpecError) as caught:
        _load_json(tmp_path, data)
    assert [p.path for p in caught.value.problems] == [
        "compute.node_count",
        "runtime.start_commands",
        "weights[0].source",
        "weights[0].mount_location",
    ]


def test_reference_example_values(tmp_path: Path) -> None:
    loaded = _load_json(tmp_path, {"training_job": VALID["reference-example"]})
    job_ = loaded.job
    assert job_.compute.accelerator is not None
    assert job_.compute.accelerator.accelerator is Accelerator.H100
    assert job_.compute.gpu_count == 8
    assert job_.runtime.environment_variables["HF_TOKEN"] == SecretReference("hf_access_token")
    refs = job_.runtime.checkpoints_to_load
    assert isinstance(refs[0], LatestCheckpoint) and refs[0].project_name == "my-proj"
    assert isinstance(refs[1], NamedCheckpoint) and refs[1].checkpoint_name == "checkpoint-20"
    assert job_.weights[0].secret_name == "hf_access_token"
    assert job_.weights[1].secret_name == "r2_credentials"
    assert job_.runtime.checkpoint_dir == "/mnt/ckpts"


def test_lax_accelerator_count_is_converted(tmp_path: Path) -> None:
    loaded = _load_json(tmp_path, VALID["accelerator-count-as-string"])
    assert loaded.job.compute.gpu_count == 8


def test_enable_cache_migrates_like_the_sdk(tmp_path: Path) -> None:
    cache = _load_json(tmp_path, VALID["enable-cache-legacy"]).job.runtime.cache
    assert cache.enabled and cache.enable_legacy_hf_mount


def test_load_config_default_is_latest_of_current_project(tmp_path: Path) -> None:
    refs = _load_json(tmp_path, VALID["load-default-checkpoints"]).job.runtime.checkpoints_to_load
    assert refs == [LatestCheckpoint(job_id=None, project_name=None)]


def test_bare_and_wire_forms_agree(tmp_path: Path) -> None:
    bare = _load_json(tmp_path, VALID["reference-example"]).job
    wire = _load_json(tmp_path, {"training_job": VALID["reference-example"]}).job
    assert bare == wire


def test_wire_project_name(tmp_path: Path) -> None:
    loaded = _load_json(tmp_path, {"training_job": job(), "training_project": {"name": "p1"}})
    assert loaded.project_name == "p1"


def test_wire_unknown_top_level_key(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        _load_json(tmp_path, {"training_job": job(), "extra": 1})
    assert caught.value.problems[0].path == "extra"


def test_stdin(tmp_path: Path) -> None:
    loaded = load("-", io.StringIO(json.dumps({"training_job": job(name="from-stdin")})))
    assert loaded.job.name == "from-stdin" and loaded.origin == "<stdin>"


def test_json_syntax_error_has_position(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text('{"training_job": {"image": }')
    with pytest.raises(SpecError, match="line 1 column"):
        load(str(path))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no spec file"):
        load(str(tmp_path / "nope.json"))


def test_unknown_field_suggests_the_right_one(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        _load_json(tmp_path, job(runtime={"start_command": ["x"]}))
    assert "did you mean 'start_commands'" in str(caught.value)
