"""Job and node records: pure data, serialised as JSON in the store (DESIGN.md §3)."""

from __future__ import annotations

import enum
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any


class JobStatus(str, enum.Enum):
    """A node's lifecycle (REFERENCE.md §3)::

    CREATED -> DEPLOYING -> RUNNING -> COMPLETED | FAILED | STOPPED
                   |
                   +-> DEPLOY_FAILED        (and STOPPED from any phase on a stop signal)
    """

    CREATED = "TRAINING_JOB_CREATED"
    DEPLOYING = "TRAINING_JOB_DEPLOYING"
    RUNNING = "TRAINING_JOB_RUNNING"
    COMPLETED = "TRAINING_JOB_COMPLETED"
    FAILED = "TRAINING_JOB_FAILED"
    DEPLOY_FAILED = "TRAINING_JOB_DEPLOY_FAILED"
    STOPPED = "TRAINING_JOB_STOPPED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def short(self) -> str:
        return self.value.removeprefix("TRAINING_JOB_")


TERMINAL = frozenset(
    {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.DEPLOY_FAILED, JobStatus.STOPPED}
)
# When nodes disagree, the job shows the first of these that any node has.
_AGGREGATE_ORDER = (
    JobStatus.FAILED,
    JobStatus.DEPLOY_FAILED,
    JobStatus.STOPPED,
    JobStatus.CREATED,
    JobStatus.DEPLOYING,
    JobStatus.RUNNING,
    JobStatus.COMPLETED,
)


def now_iso(timestamp: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if timestamp is None else timestamp, timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Transition:
    status: JobStatus
    at: str


@dataclass
class CommandResult:
    index: int
    command: str
    exit_code: int
    started_at: str
    ended_at: str


@dataclass
class UploadTotals:
    """The checkpoint sidecar's totals on a node: what is durable, what waits, what failed."""

    files: int = 0
    bytes: int = 0
    commits: int = 0
    failures: int = 0  # upload attempts that failed (each was retried)
    backlog_files: int = 0
    backlog_bytes: int = 0
    last_committed: str | None = None
    not_durable: list[str] = field(default_factory=list)  # at the end: what could not be saved
    not_committed: dict[str, str] = field(default_factory=dict)  # at the end: checkpoint -> why

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UploadTotals:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class NodeRecord:
    """One node's view of a job: status history, commands, exit code and the precise reason."""

    job_id: str
    project: str
    node_rank: int
    hostname: str = ""
    history: list[Transition] = field(default_factory=list)
    commands: list[CommandResult] = field(default_factory=list)
    exit_code: int | None = None
    error: str | None = None
    uploads: UploadTotals | None = None

    @property
    def status(self) -> JobStatus:
        return self.history[-1].status if self.history else JobStatus.CREATED

    def transition(self, status: JobStatus, at: str | None = None) -> None:
        self.history.append(Transition(status, at or now_iso()))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeRecord:
        return cls(
            job_id=data["job_id"],
            project=data["project"],
            node_rank=int(data["node_rank"]),
            hostname=data.get("hostname", ""),
            history=[Transition(JobStatus(t["status"]), t["at"]) for t in data.get("history", [])],
            commands=[CommandResult(**c) for c in data.get("commands", [])],
            exit_code=data.get("exit_code"),
            error=data.get("error"),
            uploads=UploadTotals.from_dict(data["uploads"]) if data.get("uploads") else None,
        )


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    project: str
    name: str | None
    created_at: str
    node_count: int
    spec: dict[str, Any]  # {"training_job": ...} with secret references only, never values

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        return cls(
            job_id=data["job_id"],
            project=data["project"],
            name=data.get("name"),
            created_at=data["created_at"],
            node_count=int(data.get("node_count", 1)),
            spec=data.get("spec", {}),
        )


def aggregate_status(record: JobRecord, nodes: list[NodeRecord]) -> JobStatus:
    """The job's status from its nodes': any failure wins; COMPLETED only when every node is."""
    statuses = {node.status for node in nodes}
    if len(nodes) < record.node_count and statuses <= {JobStatus.COMPLETED}:
        return JobStatus.RUNNING if nodes else JobStatus.CREATED
    return next((s for s in _AGGREGATE_ORDER if s in statuses), JobStatus.CREATED)


@dataclass(frozen=True)
class Claim:
    """Which agent runs one node of a job: one agent per job id and node rank. ``token`` names
    the node it runs on (kept on the node's disk, so that an agent started again there, as a
    restarted container is, knows the claim for its own)."""

    token: str
    hostname: str
    pid: int
    node_root: str
    started_at: str
    retry: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Claim:
        return cls(
            token=str(data["token"]),
            hostname=str(data.get("hostname", "")),
            pid=int(data.get("pid", 0)),
            node_root=str(data.get("node_root", "")),
            started_at=str(data.get("started_at", "")),
            retry=int(data.get("retry", 0)),
        )


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative to the checkpoint's directory
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: written last, once every file it names is durable in the store.

    ``created_at`` is the newest modification time among its files (DESIGN.md §3)."""

    job_id: str
    project: str
    node_rank: int
    checkpoint: str
    created_at: str
    committed_at: str
    files: list[ManifestFile]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            job_id=data["job_id"],
            project=data["project"],
            node_rank=int(data["node_rank"]),
            checkpoint=data["checkpoint"],
            created_at=data["created_at"],
            committed_at=data["committed_at"],
            files=[ManifestFile(**f) for f in data["files"]],
        )


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """``checkpoint-10`` sorts after ``checkpoint-9``."""
    return [
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    ]


def latest_manifest(manifests: list[Manifest]) -> Manifest | None:
    """The greatest ``created_at``; ties go to the name that sorts last in natural order."""
    if not manifests:
        return None
    return max(manifests, key=lambda m: (m.created_at, natural_key(m.checkpoint)))
