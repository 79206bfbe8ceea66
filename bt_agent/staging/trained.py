"""``bt://`` weights sources: a committed checkpoint of an earlier training job, resolved through
the catalogue and staged like any other source (node cache, patterns, warm start by hard links).

The reference is resolved once, to a manifest; the source's listing is the manifest's files, each
pinned to its sha256, and every download is verified against it. Only committed checkpoints
count (a manifest exists), and the current job is never a source (REFERENCE.md §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.errors import NotFoundError, StagingError
from bt_agent.records import Manifest, latest_manifest, natural_key
from bt_agent.spec.bt_uri import CheckpointURI, parse_checkpoint_uri
from bt_agent.staging.checkpoints import find_manifest, job_project
from bt_agent.storage.base import Fetched, Finished, ObjectInfo, ObjectStore, Wanted
from bt_agent.storage.retry import Attempt, once


def resolve(catalog: Catalog, reference: CheckpointURI, current_job: str | None) -> Manifest:
    """The committed manifest ``reference`` names; :class:`StagingError` names the job's
    committed checkpoints when it names none of them."""
    if reference.job_id == current_job:
        raise StagingError(
            f"{reference} refers to this job's own checkpoints; a job cannot load them as weights"
        )
    if reference.checkpoint is not None:
        return find_manifest(catalog, reference.job_id, reference.checkpoint, reference.rank)
    project = job_project(catalog, reference.job_id)
    latest = latest_manifest(catalog.manifests(project, reference.job_id, reference.rank))
    if latest is None:
        ranks = sorted({m.node_rank for m in catalog.manifests(project, reference.job_id)})
        elsewhere = f"; ranks with commits: {', '.join(map(str, ranks))}" if ranks else ""
        raise StagingError(
            f"job {reference.job_id} has no committed checkpoint on rank {reference.rank}"
            + elsewhere
        )
    return latest


class CheckpointSource(ObjectStore):
    """One committed checkpoint seen as a read-only store: keys are the manifest's paths."""

    def __init__(self, store: ObjectStore, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        m = manifest
        self.prefix = checkpoint_prefix(m.project, m.job_id, m.node_rank, m.checkpoint)
        #: what names the content (node cache entries): the resolved reference, never "latest"
        self.url = str(CheckpointURI(m.job_id, m.checkpoint, m.node_rank))
        self._files = {
            f.path: ObjectInfo(f.path, f.size, f.sha256, f.sha256)
            for f in sorted(m.files, key=lambda f: natural_key(f.path))
        }

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def uri(self, key: str = "") -> str:
        return self.store.uri(self._full(key)) if key else self.url

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [info for path, info in self._files.items() if path.startswith(prefix)]

    def _stat(self, key: str) -> ObjectInfo:
        if key not in self._files:
            raise NotFoundError(f"{self.url} has no file {key!r}", self.uri(key))
        return self._files[key]

    def _in_store(self, info: ObjectInfo) -> ObjectInfo:
        """What the store holds under the file's key: the manifest's size and sha256 pin its
        content (the version here names the content to the node cache, not the store's)."""
        return dataclasses.replace(info, key=self._full(info.key), version=None)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        return self.store.read_range(self._full(key), start, length)

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        self.download(key, target)
        return Fetched(computed_sha256=self._stat(key).sha256)

    def download(
        self,
        key: str,
        destination: Path,
        expected: ObjectInfo | None = None,
        attempt: Attempt = once,
        resumable: bool = False,
    ) -> Path:
        """The store's download of the file, verified against the manifest's size and sha256."""
        return self.store.download(
            self._full(key),
            destination,
            self._in_store(expected or self._stat(key)),
            attempt,
            resumable,
        )

    def batch_max_size(self) -> int:
        return self.store.batch_max_size()

    def download_batch(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        """The store's batch, each object under its key in the store; ``finished`` is told of
        the objects as they were handed over."""
        handed: dict[Path, Wanted] = {}

        def inner() -> Iterator[Wanted]:
            for item in wanted:
                handed[item.destination] = item
                yield dataclasses.replace(item, expected=self._in_store(item.expected))

        self.store.download_batch(
            inner(), lambda item, error: finished(handed.pop(item.destination), error)
        )

    def close(self) -> None:
        self.store.close()

    def halt(self) -> None:
        self.store.halt()


def open_checkpoint_source(
    url: str, store: ObjectStore, current_job: str | None
) -> CheckpointSource:
    """The source ``url`` (``bt://...``) names, resolved in ``store``'s catalogue; ``store`` is
    closed with the source (and at once when the reference cannot be resolved)."""
    try:
        manifest = resolve(Catalog(store), parse_checkpoint_uri(url), current_job)
    except BaseException:
        store.close()
        raise
    return CheckpointSource(store, manifest)
