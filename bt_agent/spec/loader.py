"""Read a job spec from a file, stdin or ``$BT_JOB_SPEC`` and validate it completely.

Accepted forms (DESIGN.md §1): the wire JSON ``{"training_job": {...}}`` (optionally with
``"training_project": {"name": ...}`` beside it, as ``TrainingProject.model_dump()`` gives), a bare
TrainingJob object, or a ``config.py`` defining exactly one ``TrainingProject``. A ``config.py`` is
user code: it is imported in a separate Python process that has ``truss`` installed, never here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from bt_agent.errors import Problem, SpecError
from bt_agent.spec.checks import semantic_problems
from bt_agent.spec.models import TRAINING_JOB, TrainingJob
from bt_agent.spec.schema import INVALID, describe

CONFIG_TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class LoadedSpec:
    """A valid job and where it came from."""

    job: TrainingJob
    wire: dict[str, Any]  # the TrainingJob object as given (secret references only)
    origin: str  # a path, or "<stdin>"
    project_name: str | None = None  # from a config.py's TrainingProject, or the wire JSON
    team_name: str | None = None  # the same project's team_name
    code_dir: Path | None = None  # the directory holding the spec file: the user's code


def load(source: str, stdin: TextIO | None = None, config_python: str | None = None) -> LoadedSpec:
    """Load and validate ``source`` (a path, or ``-`` for stdin). Raises :class:`SpecError`."""
    if source == "-":
        text = (stdin or sys.stdin).read()
        return _from_json_text(text, "<stdin>", None)
    path = Path(source)
    if not path.is_file():
        raise SpecError(
            [
                Problem(
                    "",
                    f"no spec file at {source}",
                    "give the path of a job JSON file or a config.py, or - for stdin",
                )
            ]
        )
    if path.suffix == ".py":
        payload = _run_config(path, config_python or sys.executable)
        project = _Project(payload.get("project"), payload.get("team"))
        return _validated(payload["training_job"], str(path), project, path.parent)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem("", f"cannot read {source}: {exc}", "check the file")]) from exc
    return _from_json_text(text, str(path), path.resolve().parent)


def _from_json_text(text: str, origin: str, code_dir: Path | None) -> LoadedSpec:
    try:
        data = json.loads(text)
    except RecursionError:
        raise SpecError(
            [Problem("", "the JSON is nested too deeply to be a job spec", "check the file")],
            origin,
        ) from None
    except json.JSONDecodeError as exc:
        raise SpecError(
            [
                Problem(
                    "",
                    f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                    "fix the JSON syntax",
                )
            ],
            origin,
        ) from exc
    job, project = _unwrap(data, origin)
    return _validated(job, origin, project, code_dir)


@dataclass(frozen=True)
class _Project:
    name: str | None = None
    team: str | None = None


def _unwrap(data: Any, origin: str) -> tuple[Any, _Project]:
    """The TrainingJob object and its project, from either JSON form."""
    if not isinstance(data, dict) or "training_job" not in data:
        return data, _Project()
    problems = [
        Problem(key, "unknown top-level field", "keep only training_job and training_project")
        for key in data
        if key not in ("training_job", "training_project")
    ]
    project = data.get("training_project")
    name = project.get("name") if isinstance(project, dict) else None
    team = project.get("team_name") if isinstance(project, dict) else None
    if project is not None and not isinstance(name, str):
        problems.append(
            Problem(
                "training_project.name",
                f"expected a string, got {describe(name)}",
                'write {"name": "<project>"}',
            )
        )
    if team is not None and not isinstance(team, str):
        problems.append(
            Problem(
                "training_project.team_name",
                f"expected a string or null, got {describe(team)}",
                'write {"name": "<project>", "team_name": "<team>"}',
            )
        )
    if problems:
        raise SpecError(problems, origin)
    return data["training_job"], _Project(name, team)


def _validated(raw: Any, origin: str, project: _Project, code_dir: Path | None) -> LoadedSpec:
    problems: list[Problem] = []
    job = TRAINING_JOB(raw, "", problems)
    if job is not INVALID:
        problems.extend(semantic_problems(job))
    if problems:
        raise SpecError(problems, origin)
    return LoadedSpec(
        job=job,
        wire=raw,
        origin=origin,
        project_name=project.name,
        team_name=project.team,
        code_dir=code_dir,
    )


def _run_config(path: Path, python: str) -> dict[str, Any]:
    script = Path(__file__).with_name("_load_config.py")
    try:
        done = subprocess.run(
            [python, str(script), str(path.resolve())],
            capture_output=True,
            text=True,
            timeout=CONFIG_TIMEOUT_SECONDS,
            cwd=path.resolve().parent,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecError(
            [
                Problem(
                    "",
                    f"could not load {path} with {python}: {exc}",
                    "check BT_CONFIG_PYTHON, or give the job as JSON",
                )
            ]
        ) from exc
    try:
        payload: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecError(
            [
                Problem(
                    "",
                    f"loading {path} failed: {detail}",
                    "run it with python to see the full error",
                )
            ],
            str(path),
        ) from None
    if not payload.get("ok"):
        raise SpecError([_config_problem(payload, path, python)], str(path))
    return payload


def _config_problem(payload: dict[str, Any], path: Path, python: str) -> Problem:
    kind, message = payload.get("kind"), str(payload.get("message", ""))
    if kind == "truss_missing":
        return Problem(
            "",
            f"loading a config.py needs the truss package, which {python} lacks",
            "pip install truss (or set BT_CONFIG_PYTHON to a Python that has it), "
            "or give the job as JSON",
        )
    if kind == "project_count":
        return Problem(
            "",
            f"{path} defines {message} TrainingProject objects; exactly one is needed",
            "define one TrainingProject(name=..., job=...) at module level",
        )
    return Problem(
        "",
        f"{path} raised {message}",
        f"fix the config (`{python} {path}` shows the whole traceback)",
    )
