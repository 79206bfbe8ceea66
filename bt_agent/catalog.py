"""The store's layout (DESIGN.md §3): where job records, node records and logs live.

::

    projects/<project>/jobs/<job_id>/job.json
    projects/<project>/jobs/<job_id>/nodes/rank-<N>.json
    projects/<project>/jobs/<job_id>/logs/rank-<N>.log
    projects/<project>/jobs/<job_id>/checkpoints/rank-<N>/<checkpoint>/<relpath>
    projects/<project>/jobs/<job_id>/manifests/rank-<N>/<checkpoint>.json   written last
    projects/<project>/jobs/<job_id>/claims/rank-<N>.json   the agent running that node
    jobs/<job_id>.json                                   {"project": ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bt_agent.errors import NotFoundError, RecordNotFoundError, StoreError
from bt_agent.records import (
    Claim,
    JobRecord,
    JobStatus,
    Manifest,
    NodeRecord,
    aggregate_status,
)
from bt_agent.storage import ObjectStore


def job_prefix(project: str, job_id: str) -> str:
    return f"projects/{project}/jobs/{job_id}"


def checkpoint_prefix(project: str, job_id: str, rank: int, checkpoint: str) -> str:
    """Where a checkpoint's files are; the root checkpoint ``.`` is the rank's directory."""
    base = f"{job_prefix(project, job_id)}/checkpoints/rank-{rank}"
    return base if checkpoint == "." else f"{base}/{checkpoint}"


def checkpoint_file_key(project: str, job_id: str, rank: int, relative: str) -> str:
    """A file's key from its path relative to the checkpoint dir (``<checkpoint>/<path>``)."""
    return f"{job_prefix(project, job_id)}/checkpoints/rank-{rank}/{relative}"


def _claim_key(project: str, job_id: str, rank: int) -> str:
    return f"{job_prefix(project, job_id)}/claims/rank-{rank}.json"


def _manifest_key(project: str, job_id: str, rank: int, checkpoint: str) -> str:
    return f"{job_prefix(project, job_id)}/manifests/rank-{rank}/{checkpoint}.json"


@dataclass(frozen=True)
class JobView:
    """A job with every node's record, as ``jobs view`` shows it."""

    job: JobRecord
    nodes: list[NodeRecord]

    @property
    def status(self) -> JobStatus:
        return aggregate_status(self.job, self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.job.to_dict(),
            "status": self.status.value,
            "nodes": [node.to_dict() for node in self.nodes],
        }


class Catalog:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def _read_json(self, key: str) -> Any:
        raw = self.store.read_bytes(key)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise StoreError(f"{self.store.url}/{key} is not valid JSON: {exc.msg}") from exc

    def _write_json(self, key: str, data: Any, *, if_absent: bool = False) -> bool:
        payload = json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"
        return self.store.write_bytes(key, payload, if_absent=if_absent)

    def create_job(self, record: JobRecord) -> JobRecord:
        """Write ``job.json`` and the id lookup unless another node already did; return the
        record that is in the store."""
        key = f"{job_prefix(record.project, record.job_id)}/job.json"
        if not self._write_json(key, record.to_dict(), if_absent=True):
            record = JobRecord.from_dict(self._read_json(key))
        self._write_json(f"jobs/{record.job_id}.json", {"project": record.project}, if_absent=True)
        return record

    def claim(self, project: str, job_id: str, rank: int, claim: Claim, take: bool) -> Claim:
        """Claim a node of a job for ``claim``'s agent: written where no claim is (or over
        one, with ``take``); returns the claim in the store, which may be another's."""
        key = _claim_key(project, job_id, rank)
        if self._write_json(key, claim.to_dict(), if_absent=not take):
            return claim
        return Claim.from_dict(self._read_json(key))

    def release(self, project: str, job_id: str, rank: int, token: str) -> None:
        """Give a node's claim up, if it is still the one with ``token``."""
        key = _claim_key(project, job_id, rank)
        try:
            held = Claim.from_dict(self._read_json(key))
        except NotFoundError:
            return
        if held.token == token:
            self.store.delete(key)

    def write_node(self, node: NodeRecord) -> None:
        prefix = job_prefix(node.project, node.job_id)
        self._write_json(f"{prefix}/nodes/rank-{node.node_rank}.json", node.to_dict())

    def upload_log(self, project: str, job_id: str, rank: int, path: Path) -> None:
        self.store.upload_file(path, f"{job_prefix(project, job_id)}/logs/rank-{rank}.log")

    def read_log(self, project: str, job_id: str, rank: int) -> bytes:
        return self.store.read_bytes(f"{job_prefix(project, job_id)}/logs/rank-{rank}.log")

    def project_of(self, job_id: str) -> str:
        try:
            return str(self._read_json(f"jobs/{job_id}.json")["project"])
        except NotFoundError:
            raise RecordNotFoundError(
                f"no job {job_id!r} in {self.store.url}; see `bt-agent jobs list`"
            ) from None

    def view(self, job_id: str) -> JobView:
        project = self.project_of(job_id)
        prefix = job_prefix(project, job_id)
        record = JobRecord.from_dict(self._read_json(f"{prefix}/job.json"))
        nodes = [
            NodeRecord.from_dict(self._read_json(info.key))
            for info in self.store.list(f"{prefix}/nodes/")
            if info.key.endswith(".json")
        ]
        return JobView(record, sorted(nodes, key=lambda n: n.node_rank))

    def jobs(self, project: str | None = None) -> list[JobView]:
        """Every job in the store (or one project), newest first."""
        ids = [
            info.key.removeprefix("jobs/").removesuffix(".json")
            for info in self.store.list("jobs/")
            if info.key.count("/") == 1
        ]
        views = [self.view(job_id) for job_id in ids]
        chosen = [v for v in views if project is None or v.job.project == project]
        return sorted(chosen, key=lambda v: v.job.created_at, reverse=True)

    def write_manifest(self, manifest: Manifest) -> None:
        """Commit a checkpoint. Call only once every file it names is durable in the store."""
        m = manifest
        self._write_json(_manifest_key(m.project, m.job_id, m.node_rank, m.checkpoint), m.to_dict())

    def delete_manifest(self, project: str, job_id: str, rank: int, checkpoint: str) -> None:
        """Withdraw a commit (its files are about to change); the files stay."""
        self.store.delete(_manifest_key(project, job_id, rank, checkpoint))

    def stored_checkpoint_files(self, project: str, job_id: str, rank: int) -> dict[str, int]:
        """What one node's checkpoint files in the store are: path relative to the checkpoint
        dir (``<checkpoint>/<path>``) -> size. Listed, not read."""
        prefix = checkpoint_file_key(project, job_id, rank, "")
        return {info.key[len(prefix) :]: info.size for info in self.store.list(prefix)}

    def committed_names(self, project: str, job_id: str, rank: int) -> set[str]:
        """The checkpoints of one node that have a manifest. Listed, not read."""
        prefix = _manifest_key(project, job_id, rank, "").removesuffix(".json")
        return {
            info.key[len(prefix) :].removesuffix(".json")
            for info in self.store.list(prefix)
            if info.key.endswith(".json")
        }

    def manifests(self, project: str, job_id: str, rank: int | None = None) -> list[Manifest]:
        """The committed checkpoints of a job (one node's, or every node's)."""
        prefix = f"{job_prefix(project, job_id)}/manifests/"
        if rank is not None:
            prefix += f"rank-{rank}/"
        return [
            Manifest.from_dict(self._read_json(info.key))
            for info in self.store.list(prefix)
            if info.key.endswith(".json")
        ]
