"""Hostile and broken specs: whatever the JSON (or config.py) holds, loading it either succeeds or
raises SpecError listing problems with field paths; never a traceback, never another exception.
(That nothing is created for an invalid spec is checked through the CLI in test_cli.py.)

    BT_FUZZ_EXAMPLES=5000 python3 -m pytest tests/faults/test_hostile_specs.py   # explore more
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import Agent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bt_agent.errors import SpecError
from bt_agent.spec.loader import LoadedSpec, load

EXAMPLES = int(os.environ.get("BT_FUZZ_EXAMPLES", "300"))

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=16,
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, anything)


reference = st.fixed_dictionaries(
    {"typ": _maybe(st.sampled_from(["baseten_latest_checkpoint", "baseten_named_checkpoint"]))},
    optional={
        "project_name": _maybe(st.text(max_size=8)),
        "job_id": _maybe(st.text(max_size=8)),
        "checkpoint_name": _maybe(st.sampled_from(["checkpoint-10", ".", "../x", ""])),
    },
)
runtime = st.fixed_dictionaries(
    {},
    optional={
        "start_commands": _maybe(st.lists(st.text(max_size=20), max_size=3)),
        "environment_variables": _maybe(
            st.dictionaries(
                st.text(max_size=8),
                st.text(max_size=8) | st.fixed_dictionaries({"name": anything}),
                max_size=3,
            )
        ),
        "checkpointing_config": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "enabled": anything,
                    "checkpoint_path": _maybe(st.sampled_from(["/mnt/c", "rel", "/tmp", "/"])),
                },
            )
        ),
        "load_checkpoint_config": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "enabled": anything,
                    "checkpoints": _maybe(st.lists(reference, max_size=3)),
                    "download_folder": anything,
                },
            )
        ),
    },
)
weights = st.lists(
    st.fixed_dictionaries(
        {
            "source": _maybe(
                st.sampled_from(
                    ["hf://a/b", "s3://b/p", "gs://b", "ftp://x", "hf://", "s3://b/../.."]
                )
            ),
            "mount_location": _maybe(
                st.sampled_from(["/app/m", "rel", "/", "/mnt/ckpts/x", "/app/../etc"])
            ),
        },
        optional={
            "allow_patterns": anything,
            "ignore_patterns": anything,
            "auth_secret_name": anything,
        },
    ),
    max_size=3,
)
jobs = st.fixed_dictionaries(
    {"image": _maybe(st.fixed_dictionaries({"base_image": _maybe(st.text(max_size=10))}))},
    optional={
        "runtime": _maybe(runtime),
        "compute": _maybe(
            st.fixed_dictionaries(
                {}, optional={"node_count": anything, "cpu_count": anything, "memory": anything}
            )
        ),
        "weights": _maybe(weights),
        "name": anything,
    },
)
documents = st.one_of(
    st.fixed_dictionaries({"training_job": _maybe(jobs)}, optional={"training_project": anything}),
    jobs,
    anything,
)


def _check(path: Path) -> None:
    try:
        loaded = load(str(path))
    except SpecError as exc:
        assert exc.problems, "a SpecError names its problems"
        for problem in exc.problems:
            assert str(problem).strip(), "every problem says something"
        assert "Traceback" not in str(exc)
        return
    assert isinstance(loaded, LoadedSpec)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("BT_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(document=documents)
def test_any_json_document_loads_or_is_a_spec_error(document: Any, tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(document))
    _check(path)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("BT_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_any_bytes_load_or_are_a_spec_error(text: str, tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    _check(path)


HOSTILE_CONFIGS = {
    "syntax-error": "def (:\n",
    "raises": "raise RuntimeError('boom')\n",
    "no-project": "x = 1\n",
    "two-projects": (
        "from truss_train import definitions as d\n"
        "j = d.TrainingJob(image=d.Image(base_image='x'))\n"
        "a = d.TrainingProject(name='a', job=j)\nb = d.TrainingProject(name='b', job=j)\n"
    ),
    "exits": "import sys; sys.exit(3)\n",
    "prints-to-stdout": (
        "print('noise'); print('{\"not\": \"the payload\"}')\n"
        "from truss_train import definitions as d\n"
        "p = d.TrainingProject(name='p', job=d.TrainingJob(image=d.Image(base_image='x')))\n"
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_config_py_is_a_clean_error(name: str, agent: Agent) -> None:
    path = agent.root / "code" / "config.py"
    path.parent.mkdir(parents=True)
    path.write_text(HOSTILE_CONFIGS[name])
    result = agent("validate", str(path))
    assert "Traceback" not in result.err, result.err
    if name == "prints-to-stdout":
        assert result.code == 0, result.text  # the user's prints do not confuse the loader
        return
    assert result.code == 2, result.text
    assert "config.py" in result.err
    done = subprocess.run(
        [sys.executable, "-m", "bt_agent", "run", str(path), *agent.context_args()],
        capture_output=True,
        text=True,
        env=agent.full_env(),
        check=False,
    )
    assert done.returncode == 2 and not agent.store.exists() and not agent.node_root.exists()


# --- values the operating system refuses: refused by validation, before anything is made ----

HOSTILE_RUNTIME = {
    "env-name-with-equals": (
        {"environment_variables": {"A=B": "x"}},
        'runtime.environment_variables["A=B"]',
    ),
    "env-name-with-nul": (
        {"environment_variables": {"A\0B": "x"}},
        'runtime.environment_variables["A\\u0000B"]',
    ),
    "env-name-empty": ({"environment_variables": {"": "x"}}, 'runtime.environment_variables[""]'),
    "env-value-with-nul": (
        {"environment_variables": {"A": "x\0y"}},
        "runtime.environment_variables.A",
    ),
    "command-with-nul": ({"start_commands": ["echo a\0b"]}, "runtime.start_commands[0]"),
    "env-name-with-lone-surrogate": (
        {"environment_variables": {"A\ud800": "x"}},
        'runtime.environment_variables["A\\ud800"]',
    ),
    "command-with-lone-surrogate": (
        {"start_commands": ["echo \ud800"]},
        "runtime.start_commands[0]",
    ),
}


def _nothing_made(agent: Agent) -> bool:
    return not agent.store.exists() and not agent.node_root.exists()


@pytest.mark.parametrize("name", sorted(HOSTILE_RUNTIME))
def test_values_the_system_refuses_are_spec_errors_and_make_nothing(
    agent: Agent, name: str
) -> None:
    runtime, field = HOSTILE_RUNTIME[name]
    job = {"image": {"base_image": "x"}, "runtime": runtime}
    for result in (agent("validate", str(agent.spec(job))), agent.run_job(job)):
        assert result.code == 2, result.text
        assert "Traceback" not in result.err, result.err
        assert f"  - {field}: " in result.err, result.err
    assert _nothing_made(agent), "an invalid spec creates nothing: no record, no log object"


@pytest.mark.parametrize("where", ["top", "training_job", "stdin"])
def test_json_nested_too_deeply_is_a_spec_error(agent: Agent, where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    text = deep if where != "training_job" else '{"training_job": {"name": ' + deep + "}}"
    path = agent.root / "deep.json"
    path.write_text(text)
    results = (
        [agent("run", "-", *agent.context_args(), stdin=text)]
        if where == "stdin"
        else [agent("validate", str(path)), agent("run", str(path), *agent.context_args())]
    )
    for result in results:
        assert result.code == 2, result.text[-2000:]
        assert "Traceback" not in result.err, result.err[-2000:]
        assert "nested too deeply" in result.err, result.err
    assert _nothing_made(agent)
