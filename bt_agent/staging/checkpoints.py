"""Loaded checkpoints: resolve each reference through the store's catalogue, then download its
files into ``$BT_LOAD_CHECKPOINT_DIR/rank-<node_rank>/<checkpoint>/``, verified against the
manifest's sha256, before the first command runs.

Rules (REFERENCE.md §4, DESIGN.md §3): only committed checkpoints (a manifest exists) count; the
current job is never a source; "latest" is the most recent job (by ``created_at``) that has a
committed checkpoint, and its checkpoint with the greatest ``created_at`` (ties: the name that
sorts last naturally). A node loads its own rank's checkpoint when the source job had that many
nodes, else rank 0, and says which.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.context import NodeContext
from bt_agent.errors import NotFoundError, StagingError, StoreError
from bt_agent.log import AgentLog, counted, format_bytes
from bt_agent.records import Manifest, latest_manifest, natural_key
from bt_agent.settings import DEFAULT_OUTAGE_SECONDS
from bt_agent.spec.models import CheckpointReference, LatestCheckpoint, NamedCheckpoint
from bt_agent.staging.progress import Progress
from bt_agent.storage import ObjectInfo
from bt_agent.storage.base import Wanted
from bt_agent.storage.retry import Attempt, OutageWait, once
from bt_agent.storage.transfer import FETCH_WORKERS, UnderWay, download_all

JOBS_NAMED = 20  # the newest jobs an error names


@dataclass(frozen=True)
class Resolved:
    index: int
    manifest: Manifest

    @property
    def label(self) -> str:
        m = self.manifest
        return f"{m.checkpoint} of job {m.job_id} (project {m.project}, rank {m.node_rank})"


class CheckpointLoader:
    def __init__(
        self,
        catalog: Catalog,
        context: NodeContext,
        load_dir: Path,
        log: AgentLog,
        stopping: Callable[[], bool] = lambda: False,
        outage_seconds: float = DEFAULT_OUTAGE_SECONDS,
    ) -> None:
        self.catalog = catalog
        self.context = context
        self.load_dir = load_dir
        self.log = log
        self.stopping = stopping
        self.outage = OutageWait(
            outage_seconds, stopping, "the store", self.log.warning, self.log.info
        )

    def load(self, references: list[CheckpointReference]) -> list[Resolved]:
        """Resolve every reference, then download each; an unreachable store is waited out."""
        resolved = [self.resolve(i, ref) for i, ref in enumerate(references)]
        self._refuse_collisions(resolved)
        for item in resolved:
            self._download(item)
        return resolved

    # --- resolution ------------------------------------------------------------------------

    def resolve(self, index: int, ref: CheckpointReference) -> Resolved:
        where = f"runtime.load_checkpoint_config.checkpoints[{index}]"
        try:
            manifest = self.outage.call(f"checkpoints[{index}]", lambda: self._find(ref))
        except (StagingError, StoreError) as exc:
            raise StagingError(f"{where}: {exc}") from exc
        item = Resolved(index, manifest)
        self.log.info(f"checkpoints[{index}]: loading {item.label}")
        return item

    def _find(self, ref: CheckpointReference) -> Manifest:
        if isinstance(ref, NamedCheckpoint):
            return self._named(ref)
        if isinstance(ref, LatestCheckpoint):
            return self._latest(ref)
        raise StagingError(f"{ref.typ} references cannot be loaded by bt-agent")

    def _project_of(self, job_id: str, project: str | None) -> str:
        found = job_project(self.catalog, job_id)
        if project is not None and project != found:
            raise StagingError(f"job {job_id!r} belongs to project {found!r}, not {project!r}")
        return found

    def _rank_for(self, job_id: str, project: str) -> int:
        """This node's rank when the source job had that many nodes, else rank 0."""
        return self._said_rank(
            job_id, self.catalog.rank_in(job_id, self.context.node_rank, project)
        )

    def _said_rank(self, job_id: str, rank: int) -> int:
        if rank != self.context.node_rank:
            self.log.info(
                f"job {job_id} ran on fewer than {self.context.node_rank + 1} nodes: node "
                f"{self.context.node_rank} loads rank {rank}'s checkpoint"
            )
        return rank

    def _named(self, ref: NamedCheckpoint) -> Manifest:
        if ref.job_id == self.context.job_id:
            raise StagingError("a job cannot load its own checkpoints")
        project = self._project_of(ref.job_id, None)
        rank = self._rank_for(ref.job_id, project)
        return find_manifest(self.catalog, ref.job_id, ref.checkpoint_name, rank)

    def _latest(self, ref: LatestCheckpoint) -> Manifest:
        if ref.job_id:
            if ref.job_id == self.context.job_id:
                raise StagingError("a job cannot load its own checkpoints")
            project = self._project_of(ref.job_id, ref.project_name)
            manifests = self.catalog.manifests(
                project, ref.job_id, self._rank_for(ref.job_id, project)
            )
            latest = latest_manifest(manifests)
            if latest is None:
                raise StagingError(f"job {ref.job_id} has no committed checkpoints")
            return latest
        project = ref.project_name or self.context.project
        latest = self.catalog.latest(project, self.context.node_rank, but=self.context.job_id)
        if latest is None:
            views = self.catalog.jobs(project, limit=JOBS_NAMED)
            jobs = [v.job.job_id for v in views if v.job.job_id != self.context.job_id]
            raise StagingError(
                f"project {project!r} has no committed checkpoints; its jobs are: "
                f"{', '.join(jobs) or 'none'}"
            )
        self._said_rank(latest.job_id, latest.node_rank)
        return latest

    def _refuse_collisions(self, resolved: list[Resolved]) -> None:
        seen: dict[str, Resolved] = {}
        for item in resolved:
            name = item.manifest.checkpoint
            if name in seen:
                raise StagingError(
                    f"runtime.load_checkpoint_config.checkpoints[{item.index}] ({item.label}) "
                    f"would land at the same path as checkpoints[{seen[name].index}] "
                    f"({seen[name].label}): rank-{self.context.node_rank}/{name}; load only one"
                )
            seen[name] = item

    # --- download --------------------------------------------------------------------------

    def _download(self, item: Resolved) -> None:
        target = self.load_dir / f"rank-{self.context.node_rank}" / item.manifest.checkpoint
        label = f"checkpoints[{item.index}]"
        try:
            download_reporting(
                self.catalog,
                item.manifest,
                target,
                label,
                self.log,
                self.stopping,
                self.outage.attempts(label),
            )
        except (StoreError, OSError) as exc:  # OSError: the load dir's disk
            raise StagingError(f"checkpoints[{item.index}] {item.label}: {exc}") from exc
        m = item.manifest
        files = counted(len(m.files), "file")
        self.log.info(f"checkpoints[{item.index}]: {files}, {format_bytes(m.size)} -> {target}")


def download_checkpoint(
    catalog: Catalog,
    manifest: Manifest,
    target: Path,
    stopping: Callable[[], bool] = lambda: False,
    attempt: Attempt = once,
    fetched: Callable[[int], None] = lambda size: None,
    under_way: UnderWay = lambda path, size: contextlib.nullcontext(),
) -> None:
    """Every file of a committed checkpoint into ``target``, each verified against the
    manifest's size and sha256; the directory appears, complete, only at the end. Each file's
    download (:func:`download_all`) is made through ``attempt`` (which may retry it);
    ``fetched(size)`` is told of each file once it is in place, from any thread, and
    ``under_way(path, size)`` (:meth:`Progress.fetching`) holds while a file is fetched one by
    one."""
    partial = target.with_name(f"{_loading_prefix(target)}{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    _clear_abandoned(target)
    m = manifest
    prefix = checkpoint_prefix(m.project, m.job_id, m.node_rank, m.checkpoint)
    wanted = [
        Wanted(
            partial.joinpath(*entry.path.split("/")),
            ObjectInfo(f"{prefix}/{entry.path}", entry.size, None, entry.sha256),
        )
        for entry in m.files
    ]
    try:
        download_all(
            catalog.store,
            wanted,
            FETCH_WORKERS,
            stopping=stopping,
            attempt=attempt,
            fetched=fetched,
            under_way=under_way,
        )
        if target.exists():
            shutil.rmtree(target)
        partial.mkdir(parents=True, exist_ok=True)  # a checkpoint may hold no file
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _loading_prefix(target: Path) -> str:
    """How the name of a directory a checkpoint is downloaded into before ``target`` begins
    (the downloading process's pid follows)."""
    return f".{target.name}.loading-"


def _clear_abandoned(target: Path) -> None:
    """Remove what downloads of ``target`` by processes that are gone left (killed outright:
    SIGKILL, the container's end); those of a process still running are its own."""
    prefix = _loading_prefix(target)
    for stale in target.parent.glob(f"{glob.escape(prefix)}*"):
        pid = stale.name[len(prefix) :]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def download_reporting(
    catalog: Catalog,
    manifest: Manifest,
    target: Path,
    label: str,
    log: AgentLog,
    stopping: Callable[[], bool] = lambda: False,
    attempt: Attempt = once,
) -> None:
    """:func:`download_checkpoint`, with progress lines called ``label`` on ``log`` while it
    goes."""
    with Progress(label, manifest.size, log, log.stream) as progress:
        download_checkpoint(
            catalog, manifest, target, stopping, attempt, progress.add, progress.fetching
        )


def job_project(catalog: Catalog, job_id: str) -> str:
    """The project of ``job_id``; :class:`StagingError` when the store has no such job."""
    try:
        return catalog.project_of(job_id)
    except NotFoundError:
        raise StagingError(f"no job {job_id!r} in the store {catalog.store.url}") from None


def find_manifest(catalog: Catalog, job_id: str, checkpoint: str, rank: int = 0) -> Manifest:
    """A committed checkpoint by name; the error lists the ones that exist."""
    project = job_project(catalog, job_id)
    manifests = catalog.manifests(project, job_id, rank)
    for manifest in manifests:
        if manifest.checkpoint == checkpoint:
            return manifest
    names = ", ".join(sorted((m.checkpoint for m in manifests), key=natural_key)) or "none"
    raise StagingError(
        f"job {job_id} has no committed checkpoint {checkpoint!r} on rank "
        f"{rank}; committed: {names}"
    )
