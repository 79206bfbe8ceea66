"""Run as a script by ``bt_agent.spec.loader`` in a separate Python process.

It imports a user's ``config.py`` with the real ``truss`` package and prints one JSON object on
stdout. It runs user code, which is why it never runs inside the agent's own process, and it
imports nothing from ``bt_agent``, so any Python with ``truss`` installed can run it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any


def _emit(**payload: Any) -> None:
    sys.stdout.write("\n" + json.dumps(payload))
    sys.stdout.flush()


def main(path: str) -> None:
    try:
        from truss_train import definitions  # type: ignore[import-untyped]
    except ImportError as exc:
        return _emit(ok=False, kind="truss_missing", message=str(exc))
    spec = importlib.util.spec_from_file_location("config", path)
    if spec is None or spec.loader is None:
        return _emit(ok=False, kind="config_error", message=f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # user code: report whatever it raised
        return _emit(ok=False, kind="config_error", message=f"{type(exc).__name__}: {exc}")
    found = [v for v in vars(module).values() if isinstance(v, definitions.TrainingProject)]
    if len(found) != 1:
        return _emit(ok=False, kind="project_count", message=str(len(found)))
    project = found[0]
    return _emit(
        ok=True,
        project=project.name,
        team=project.team_name,
        training_job=project.job.model_dump(mode="json"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
