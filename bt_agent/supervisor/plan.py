"""What a job is, decided before anything is created (:class:`JobPlan`), and how it ended
(:class:`Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bt_agent.context import NodeContext
from bt_agent.env import ChildEnvironment, JobDirs
from bt_agent.records import JobStatus
from bt_agent.secrets import Secrets
from bt_agent.settings import Environ
from bt_agent.spec.loader import LoadedSpec


@dataclass(frozen=True)
class JobPlan:
    """Everything decided before anything is created: a valid spec on a valid node."""

    spec: LoadedSpec
    context: NodeContext
    env: ChildEnvironment
    secrets: Secrets
    code_dir: Path | None = None  # copied into the working dir, as the platform extracts code
    environ: Environ = field(default_factory=lambda: Environ({}))

    @property
    def dirs(self) -> JobDirs:
        return JobDirs.for_job(self.spec.job, self.context)


@dataclass(frozen=True)
class Outcome:
    status: JobStatus
    exit_code: int
    reason: str | None = None
