"""The serving side: stage the checkpoints a ``DeployCheckpointsConfig`` names into the layout a
serving container reads, ``<download_folder>/<training_job_id>/rank-0/<checkpoint>/``
(REFERENCE.md §4), with the same verification as loading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bt_agent.catalog import Catalog
from bt_agent.errors import Problem, SpecError
from bt_agent.staging.checkpoints import download_checkpoint, find_manifest

DEFAULT_SERVING_FOLDER = "/tmp/training_checkpoints"


@dataclass(frozen=True)
class ServingCheckpoint:
    job_id: str
    name: str


@dataclass(frozen=True)
class CheckpointList:
    download_folder: str
    checkpoints: list[ServingCheckpoint]


def _text(data: dict[str, Any], names: tuple[str, ...], path: str, problems: list[Problem]) -> str:
    for name in names:
        value = data.get(name)
        if isinstance(value, str) and value:
            return value
    problems.append(Problem(f"{path}.{names[0]}", "required string is missing", "add it"))
    return ""


def parse(text: str, origin: str) -> CheckpointList:
    """A ``DeployCheckpointsConfig`` (``{"checkpoint_details": ...}``) or a bare
    ``CheckpointList`` as JSON. A checkpoint's name is ``checkpoint_name`` (or ``name``)."""
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
                    'give [{"training_job_id": ..., "checkpoint_name": ...}]',
                )
            ],
            origin,
        )
    problems: list[Problem] = []
    found = []
    for i, item in enumerate(data["checkpoints"]):
        path = f"{prefix}checkpoints[{i}]"
        if not isinstance(item, dict):
            problems.append(
                Problem(path, "expected an object", "give training_job_id and checkpoint_name")
            )
            continue
        job_id = _text(item, ("training_job_id",), path, problems)
        name = _text(item, ("checkpoint_name", "name"), path, problems)
        found.append(ServingCheckpoint(job_id, name))
    if problems:
        raise SpecError(problems, origin)
    folder = data.get("download_folder") or DEFAULT_SERVING_FOLDER
    return CheckpointList(str(folder), found)


def download(catalog: Catalog, checkpoints: CheckpointList, folder: Path) -> list[Path]:
    targets = []
    for item in checkpoints.checkpoints:
        manifest = find_manifest(catalog, item.job_id, item.name, 0)
        target = folder / item.job_id / "rank-0" / item.name
        download_checkpoint(catalog, manifest, target)
        targets.append(target)
    return targets
