"""The serving side: stage the checkpoints a ``DeployCheckpointsConfig`` names into the layout a
serving container reads, ``<download_folder>/<training_job_id>/rank-<N>/<checkpoint>/``
(REFERENCE.md §4; rank 0 unless a ``bt://`` reference asks for another), with the same
verification as loading."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bt_agent.catalog import Catalog
from bt_agent.errors import Problem, SpecError
from bt_agent.log import AgentLog
from bt_agent.spec.bt_uri import BadCheckpointURI, CheckpointURI, parse_checkpoint_uri
from bt_agent.staging.checkpoints import download_reporting
from bt_agent.staging.trained import resolve

DEFAULT_SERVING_FOLDER = "/tmp/training_checkpoints"


@dataclass(frozen=True)
class CheckpointList:
    download_folder: str
    checkpoints: list[CheckpointURI]


def _text(data: dict[str, Any], names: tuple[str, ...], path: str, problems: list[Problem]) -> str:
    for name in names:
        value = data.get(name)
        if isinstance(value, str) and value:
            return value
    problems.append(Problem(f"{path}.{names[0]}", "required string is missing", "add it"))
    return ""


def parse(text: str, origin: str) -> CheckpointList:
    """A ``DeployCheckpointsConfig`` (``{"checkpoint_details": ...}``) or a bare
    ``CheckpointList`` as JSON. A checkpoint is an object (``training_job_id`` and
    ``checkpoint_name``, or ``name``) or a ``bt://`` reference."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            [Problem("", f"not valid JSON: {exc.msg} at line {exc.lineno}", "fix the JSON syntax")],
            origin,
        ) from exc
    prefix = ""
    if isinstance(data, dict) and "checkpoint_details" in data:
        data, prefix = data["checkpoint_details"], "checkpoint_details."
    if not isinstance(data, dict) or not isinstance(data.get("checkpoints"), list):
        raise SpecError(
            [
                Problem(
                    f"{prefix}checkpoints",
                    "expected a list of checkpoints",
                    'give [{"training_job_id": ..., "checkpoint_name": ...}] or bt:// references',
                )
            ],
            origin,
        )
    problems: list[Problem] = []
    found = []
    for i, item in enumerate(data["checkpoints"]):
        path = f"{prefix}checkpoints[{i}]"
        if isinstance(item, str):
            try:
                found.append(parse_checkpoint_uri(item))
            except BadCheckpointURI as exc:
                problems.append(Problem(path, exc.problem, exc.hint))
            continue
        if not isinstance(item, dict):
            problems.append(
                Problem(path, "expected an object", "give training_job_id and checkpoint_name")
            )
            continue
        job_id = _text(item, ("training_job_id",), path, problems)
        name = _text(item, ("checkpoint_name", "name"), path, problems)
        found.append(CheckpointURI(job_id, name))
    if problems:
        raise SpecError(problems, origin)
    folder = data.get("download_folder") or DEFAULT_SERVING_FOLDER
    return CheckpointList(str(folder), found)


def download(
    catalog: Catalog,
    checkpoints: CheckpointList,
    folder: Path,
    log: AgentLog,
    stopping: Callable[[], bool] = lambda: False,
) -> Iterator[Path]:
    """Each checkpoint into ``folder``'s serving layout, yielded once it is whole, with
    progress lines on ``log`` while it comes. A stop requested (``stopping()``) ends it at
    once with :class:`InterruptedError`, leaving no file of the checkpoint under way."""
    for index, item in enumerate(checkpoints.checkpoints):
        if stopping():
            raise InterruptedError("stop requested")
        manifest = resolve(catalog, item, None)
        target = folder / item.job_id / f"rank-{item.rank}" / manifest.checkpoint
        download_reporting(catalog, manifest, target, f"checkpoints[{index}]", log, stopping)
        yield target
