"""The catalogue: the store's records (jobs, nodes, manifests, logs, claims) read and written
in the layout of :mod:`bt_agent.catalog.layout`, and the index that finds the newest of them
without reading them all (:mod:`bt_agent.catalog.index`).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bt_agent.catalog.index import IN_FLIGHT, Index, concurrently, encode, newest
from bt_agent.catalog.layout import (
    JobEntry,
    checkpoint_file_key,
    checkpoint_prefix,
    claim_key,
    job_key,
    job_prefix,
    lookup_key,
    manifest_key,
)
from bt_agent.errors import NotFoundError, RecordNotFoundError, StoreError
from bt_agent.records import (
    Claim,
    JobRecord,
    JobStatus,
    Manifest,
    NodeRecord,
    aggregate_status,
    latest_manifest,
)
from bt_agent.storage import ObjectStore

if TYPE_CHECKING:
    from concurrent.futures import Executor

__all__ = [
    "CHECKPOINT_SORTS",
    "Catalog",
    "JobView",
    "checkpoint_file_key",
    "checkpoint_prefix",
    "job_prefix",
]

#: The orders a listing of checkpoints comes in (``checkpoints list --sort``).
CHECKPOINT_SORTS = ("created", "size", "name", "job")

NO_INDEX = (
    "{url} has no index (it holds jobs from before bt-agent kept one), so every job is read; "
    "run `bt-agent store reindex --store {url}` once to make this fast"
)


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


@dataclass(frozen=True)
class Reindexed:
    jobs: int
    commits: int


def _quiet(message: str) -> None:
    """Where a catalogue's warnings go unless its user says (the CLI prints them)."""


class Catalog:
    def __init__(self, store: ObjectStore, warn: Callable[[str], None] = _quiet) -> None:
        self.store = store
        self.warn = warn
        self.index = Index(store)
        self._created: dict[str, str] = {}  # job id -> its created_at (the index's job time)
        self._warned = False

    def _read_json(self, key: str) -> Any:
        raw = self.store.read_bytes(key)
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise StoreError(f"{self.store.url}/{key} is not valid JSON: {exc.msg}") from exc

    def _write_json(self, key: str, data: Any, *, if_absent: bool = False) -> bool:
        return self.store.write_bytes(key, encode(data), if_absent=if_absent)

    # --- jobs --------------------------------------------------------------------------------

    def create_job(self, record: JobRecord) -> JobRecord:
        """Write ``job.json``, the id lookup and the index entries unless another node already
        did; return the record that is in the store."""
        key = job_key(record.project, record.job_id)
        if not self._write_json(key, record.to_dict(), if_absent=True):
            record = JobRecord.from_dict(self._read_json(key))
        self._write_json(lookup_key(record.job_id), {"project": record.project}, if_absent=True)
        self._created[record.job_id] = record.created_at
        self.index.add_job(record)
        self.index.started_with(record.job_id)
        return record

    def job(self, project: str, job_id: str) -> JobRecord:
        record = JobRecord.from_dict(self._read_json(job_key(project, job_id)))
        self._created[job_id] = record.created_at
        return record

    def _job_created_at(self, project: str, job_id: str) -> str:
        if job_id not in self._created:
            self.job(project, job_id)
        return self._created[job_id]

    def project_of(self, job_id: str) -> str:
        try:
            return str(self._read_json(lookup_key(job_id))["project"])
        except NotFoundError:
            raise RecordNotFoundError(
                f"no job {job_id!r} in {self.store.url}; see `bt-agent jobs list`"
            ) from None

    def view(self, job_id: str, project: str | None = None) -> JobView:
        project = project or self.project_of(job_id)
        prefix = job_prefix(project, job_id)
        record = self.job(project, job_id)
        keys = [info.key for info in self.store.list(f"{prefix}/nodes/")]
        nodes = concurrently(
            lambda key: NodeRecord.from_dict(self._read_json(key)),
            [key for key in keys if key.endswith(".json")],
        )
        return JobView(record, sorted(nodes, key=lambda n: n.node_rank))

    def jobs(self, project: str | None = None, limit: int | None = None) -> list[JobView]:
        """The newest ``limit`` jobs (every one with None) of the store or of one project,
        newest first."""
        if not self._indexed():
            views = self._every_view(project)
            return views if limit is None else views[:limit]
        entries = itertools.islice(self.index.jobs(project), limit)
        return self._views(entries)

    def _views(self, entries: Iterable[JobEntry]) -> list[JobView]:
        views: list[JobView | None] = concurrently(
            lambda e: self._view_if_there(e.project, e.job_id), entries
        )
        return [view for view in views if view is not None]

    def _view_if_there(self, project: str, job_id: str) -> JobView | None:
        try:
            return self.view(job_id, project)
        except NotFoundError:
            return None  # an entry whose job was deleted

    def _every_view(self, project: str | None) -> list[JobView]:
        """Every job, read one by one (a store without an index)."""
        ids = [
            info.key.removeprefix("jobs/").removesuffix(".json")
            for info in self.store.list("jobs/")
            if info.key.count("/") == 1
        ]
        if ids and not self._warned:  # an empty store has no index yet and loses nothing
            self._warned = True
            self.warn(NO_INDEX.format(url=self.store.url))
        views = concurrently(self.view, ids)
        chosen = [v for v in views if project is None or v.job.project == project]
        return sorted(chosen, key=lambda v: v.job.created_at, reverse=True)

    def _indexed(self) -> bool:
        """Whether the index can be read (else every job is, which warns once)."""
        return self.index.complete()

    # --- claims, nodes, logs -----------------------------------------------------------------

    def claim(self, project: str, job_id: str, rank: int, claim: Claim, take: bool) -> Claim:
        """Claim a node of a job for ``claim``'s agent: written where no claim is (or over
        one, with ``take``); returns the claim in the store, which may be another's."""
        key = claim_key(project, job_id, rank)
        if self._write_json(key, claim.to_dict(), if_absent=not take):
            return claim
        return Claim.from_dict(self._read_json(key))

    def release(self, project: str, job_id: str, rank: int, token: str) -> None:
        """Give a node's claim up, if it is still the one with ``token``."""
        key = claim_key(project, job_id, rank)
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

    # --- commits -----------------------------------------------------------------------------

    def write_manifest(self, manifest: Manifest) -> None:
        """Commit a checkpoint: its manifest, then its index entry. Call only once every file
        it names is durable in the store; a commit is done when this returns."""
        m = manifest
        self._write_json(manifest_key(m.project, m.job_id, m.node_rank, m.checkpoint), m.to_dict())
        self.index.add_commit(m, self._job_created_at(m.project, m.job_id))

    def delete_manifest(self, project: str, job_id: str, rank: int, checkpoint: str) -> None:
        """Withdraw a commit (its files are about to change); the files stay."""
        self.store.delete(manifest_key(project, job_id, rank, checkpoint))
        created_at = self._job_created_at(project, job_id)
        self.index.remove_commit(project, job_id, created_at, rank, checkpoint)

    def stored_checkpoint_files(self, project: str, job_id: str, rank: int) -> dict[str, int]:
        """What one node's checkpoint files in the store are: path relative to the checkpoint
        dir (``<checkpoint>/<path>``) -> size. Listed, not read."""
        prefix = checkpoint_file_key(project, job_id, rank, "")
        return {info.key[len(prefix) :]: info.size for info in self.store.list(prefix)}

    def committed_names(self, project: str, job_id: str, rank: int) -> set[str]:
        """The checkpoints of one node that have a manifest. Listed, not read."""
        prefix = manifest_key(project, job_id, rank, "").removesuffix(".json")
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
        keys = [info.key for info in self.store.list(prefix) if info.key.endswith(".json")]
        return self._read_manifests(keys)

    def _manifest_if_there(self, key: str) -> Manifest | None:
        try:
            return Manifest.from_dict(self._read_json(key))
        except NotFoundError:
            return None  # withdrawn since it was listed

    # --- the newest commits ------------------------------------------------------------------

    def latest(self, project: str, rank: int, but: str | None = None) -> Manifest | None:
        """The latest committed checkpoint of ``project`` (DESIGN.md §3) for a node of rank
        ``rank``, from any job but ``but``: from the index, a listing page and a manifest."""
        if not self._indexed():
            return self._latest_by_reading_every_job(project, rank, but)
        for job_id, entries in self.index.commits(project):
            if job_id == but:
                continue
            source = rank if any(e.rank == rank for e in entries) else self.rank_in(job_id, rank)
            for entry in newest([e for e in entries if e.rank == source]):
                key = manifest_key(project, job_id, source, entry.checkpoint)
                manifest = self._manifest_if_there(key)
                if manifest is not None:
                    return manifest
        return None

    def rank_in(self, job_id: str, rank: int, project: str | None = None) -> int:
        """The rank whose checkpoints a node of rank ``rank`` loads from ``job_id``: its own
        when that job had that many nodes, else rank 0."""
        if rank == 0:
            return 0
        nodes = self.job(project or self.project_of(job_id), job_id).node_count
        return rank if rank < nodes else 0

    def _latest_by_reading_every_job(
        self, project: str, rank: int, but: str | None
    ) -> Manifest | None:
        for view in self._every_view(project):
            job_id = view.job.job_id
            if job_id == but:
                continue
            source = rank if rank < view.job.node_count else 0
            latest = latest_manifest(self.manifests(project, job_id, source))
            if latest is not None:
                return latest
        return None

    def recent_manifests(self, project: str | None, limit: int | None) -> list[Manifest]:
        """The commits of the newest jobs (of ``project``, or of the store), newest job
        first, at most ``limit`` of them (every one with None)."""
        found: list[Manifest] = []
        for page in self.manifest_pages(project, limit or IN_FLIGHT):
            found.extend(page)
            if limit is not None and len(found) >= limit:
                return found[:limit]
        return found

    def manifest_pages(
        self, project: str | None, size: int = IN_FLIGHT
    ) -> Iterator[list[Manifest]]:
        """The commits of the newest jobs, newest job first, a page at a time (about ``size``
        commits from a project's index; else a few jobs' commits), each page read only once
        the one before is taken."""
        if project is not None and self._indexed():
            yield from self._pages_in_project(project, size)
            return
        for jobs in self._job_batches(project):
            page: list[Manifest] = []
            for manifests in concurrently(
                lambda v: self.manifests(v.job.project, v.job.job_id), jobs
            ):
                page.extend(sorted(manifests, key=lambda m: m.created_at, reverse=True))
            yield page

    def _pages_in_project(self, project: str, size: int) -> Iterator[list[Manifest]]:
        keys: list[str] = []
        for job_id, entries in self.index.commits(project):
            keys.extend(manifest_key(project, job_id, e.rank, e.checkpoint) for e in entries)
            while len(keys) >= size:
                yield self._read_manifests(keys[:size])
                keys = keys[size:]
        if keys:
            yield self._read_manifests(keys)

    def _read_manifests(self, keys: list[str]) -> list[Manifest]:
        found = concurrently(self._manifest_if_there, keys)
        return [manifest for manifest in found if manifest is not None]

    def _job_batches(self, project: str | None) -> Iterator[list[JobView]]:
        """The jobs newest first, a few at a time (every one, without an index)."""
        if not self._indexed():
            yield self._every_view(project)
            return
        entries = self.index.jobs(project)
        while batch := list(itertools.islice(entries, IN_FLIGHT)):
            yield self._views(batch)

    # --- the index of a store written before it ----------------------------------------------

    def reindex(self, progress: Callable[[int, int], None] = lambda done, total: None) -> Reindexed:
        """Write the index entries of every job and commit in the store, then mark the index
        complete; ``progress(jobs done, jobs)`` as it goes. Running it again rewrites the same
        entries.

        Jobs are read :data:`IN_FLIGHT` at a time, each along its chain (lookup, record,
        manifests' listing); its writes and manifest reads go to a second pool, all at once,
        so a job costs five round trips of latency rather than one per request."""
        ids = [
            info.key.removeprefix("jobs/").removesuffix(".json")
            for info in self.store.list("jobs/")
            if info.key.count("/") == 1 and info.key.endswith(".json")
        ]
        lock = threading.Lock()
        done = 0

        from concurrent.futures import ThreadPoolExecutor  # see index.concurrently

        with ThreadPoolExecutor(2 * IN_FLIGHT, thread_name_prefix="bt-reindex") as writes:

            def one(job_id: str) -> int:
                nonlocal done
                commits = self._reindex_job(job_id, writes)
                with lock:
                    done += 1
                    progress(done, len(ids))
                return commits

            commits = sum(concurrently(one, ids))
        self.index.mark_complete()
        return Reindexed(len(ids), commits)

    def _reindex_job(self, job_id: str, writes: Executor) -> int:
        """One job's entries, written on ``writes``; the number of its commits."""
        try:
            project = self.project_of(job_id)
            record = self.job(project, job_id)
        except NotFoundError:
            return 0  # a lookup left by a job whose records were deleted
        prefix = f"{job_prefix(project, job_id)}/manifests/"
        keys = [info.key for info in self.store.list(prefix) if info.key.endswith(".json")]
        job = writes.submit(self.index.add_job, record)
        commits = [writes.submit(self._reindex_commit, key, record.created_at) for key in keys]
        job.result()
        return sum(commit.result() for commit in commits)

    def _reindex_commit(self, key: str, job_created_at: str) -> bool:
        """The entry of the manifest at ``key``; False where it is gone."""
        manifest = self._manifest_if_there(key)
        if manifest is not None:
            self.index.add_commit(manifest, job_created_at)
        return manifest is not None
