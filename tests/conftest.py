"""Shared fixtures: run the real ``bt-agent`` in a subprocess against a temporary node and store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
MINIMAL_JOB: dict[str, Any] = {"image": {"base_image": "python:3.11-slim"}}


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@dataclass
class Agent:
    """Runs ``python -m bt_agent`` with an isolated HOME, node root, store and secrets dir."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def node_root(self) -> Path:
        return self.root / "node"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def secrets_dir(self) -> Path:
        return self.root / "secrets"

    def secret(self, name: str, value: str) -> None:
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        (self.secrets_dir / name).write_text(value + "\n")

    def spec(self, job: dict[str, Any], name: str = "job.json", wire: bool = True) -> Path:
        directory = self.root / "code"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.write_text(json.dumps({"training_job": job} if wire else job))
        return path

    def context_args(self) -> list[str]:
        return [
            "--node-root",
            str(self.node_root),
            "--store",
            str(self.store),
            "--secrets-dir",
            str(self.secrets_dir),
        ]

    def __call__(
        self,
        *args: str,
        timeout: float = 60,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Result:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("BT_")}
        full_env.update({"HOME": str(self.root / "home"), **self.env, **(env or {})})
        done = subprocess.run(
            [sys.executable, "-m", "bt_agent", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            input=stdin,
            cwd=self.root,
            check=False,
        )
        return Result(done.returncode, done.stdout, done.stderr)

    def run_job(self, job: dict[str, Any], *extra: str, **kwargs: Any) -> Result:
        return self("run", str(self.spec(job)), *self.context_args(), *extra, **kwargs)

    def job_view(self, job_id: str) -> dict[str, Any]:
        result = self("jobs", "view", job_id, "--store", str(self.store), "-o", "json")
        assert result.code == 0, result.text
        data: dict[str, Any] = json.loads(result.out)
        return data

    def only_job_id(self) -> str:
        ids = [p.stem for p in (self.store / "jobs").glob("*.json")]
        assert len(ids) == 1, ids
        return ids[0]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    yield Agent(tmp_path)


def job_with(**runtime: Any) -> dict[str, Any]:
    """A minimal valid job with these runtime fields."""
    return {**MINIMAL_JOB, "runtime": runtime}
