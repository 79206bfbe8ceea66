"""Browsing committed checkpoints in the store: what ``checkpoints list|files|inspect`` show.

Only committed checkpoints (a manifest exists) are shown. The type (full or LoRA) and the base
model are detected from the files, as the platform does: an ``adapter_config.json`` or
``adapter_model.*`` makes a LoRA, whose base model its config names; a full checkpoint's base
model is its ``config.json``'s ``_name_or_path`` when that names a Hub model. Tensor summaries
read a ``.safetensors`` file's header only, with two ranged reads, from any store.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.catalog.index import concurrently
from bt_agent.errors import RecordNotFoundError, StoreError, UsageError
from bt_agent.records import Manifest, natural_key

#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class CheckpointRow:
    job_id: str
    project: str
    checkpoint: str
    node: int
    type: str
    base_model: str | None
    size: int
    files: int
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FileRow:
    checkpoint: str
    path: str
    node: int
    size: int
    sha256: str
    url: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: list[int]

    @property
    def parameters(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "parameters": self.parameters}


@dataclass(frozen=True)
class TensorSummary:
    file: str
    tensors: list[Tensor]
    metadata: dict[str, str]

    @property
    def parameters(self) -> int:
        return sum(t.parameters for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "parameters": self.parameters,
            "metadata": self.metadata,
            "tensors": [t.to_dict() for t in self.tensors],
        }


def checkpoint_type(manifest: Manifest) -> str:
    """``lora`` when an adapter's files are there, else ``full``."""
    names = {f.path for f in manifest.files}
    return "lora" if any(name in names for name in LORA_FILES) else "full"


def object_key(manifest: Manifest, path: str) -> str:
    """The store key of one file of a committed checkpoint."""
    m = manifest
    return f"{checkpoint_prefix(m.project, m.job_id, m.node_rank, m.checkpoint)}/{path}"


class CheckpointBrowser:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.store = catalog.store

    # --- list --------------------------------------------------------------------------------

    def rows(
        self,
        project: str | None = None,
        job_id: str | None = None,
        sort: str = "created",
        limit: int | None = None,
    ) -> list[CheckpointRow]:
        """The committed checkpoints of one job, or of the newest jobs (at most ``limit``:
        those of the newest jobs first), in ``sort`` order."""
        if job_id is not None:
            found = self.catalog.project_of(job_id)
            if project is not None and project != found:
                raise RecordNotFoundError(f"job {job_id} belongs to project {found!r}")
            manifests = self.catalog.manifests(found, job_id)
            manifests = sorted(manifests, key=lambda m: m.created_at, reverse=True)[:limit]
        else:
            manifests = self.catalog.recent_manifests(project, limit)
        return _sorted(concurrently(self._row, manifests), sort)

    def manifest_pages(self, project: str | None, job_id: str | None) -> Iterator[list[Manifest]]:
        """The committed checkpoints of one job, or of the newest jobs, newest first, a page at
        a time (each read only once the one before is taken)."""
        if job_id is None:
            yield from self.catalog.manifest_pages(project)
            return
        manifests = self.catalog.manifests(self.catalog.project_of(job_id), job_id)
        yield sorted(manifests, key=lambda m: m.created_at, reverse=True)

    def _row(self, manifest: Manifest) -> CheckpointRow:
        names = {f.path for f in manifest.files}
        lora = checkpoint_type(manifest) == "lora"
        return CheckpointRow(
            job_id=manifest.job_id,
            project=manifest.project,
            checkpoint=manifest.checkpoint,
            node=manifest.node_rank,
            type=checkpoint_type(manifest),
            base_model=self._base_model(manifest, names, lora),
            size=manifest.size,
            files=len(manifest.files),
            created_at=manifest.created_at,
        )

    def _base_model(self, manifest: Manifest, names: set[str], lora: bool) -> str | None:
        source, field = (
            ("adapter_config.json", "base_model_name_or_path")
            if lora
            else ("config.json", "_name_or_path")
        )
        if source not in names:
            return None
        config = self._small_json(manifest, source)
        value = config.get(field) if isinstance(config, dict) else None
        if not isinstance(value, str) or not value or value.startswith(("/", ".")):
            return None  # a local path says nothing to someone else
        return value

    def _small_json(self, manifest: Manifest, path: str) -> Any:
        try:
            return json.loads(self.store.read_bytes(object_key(manifest, path)))
        except (StoreError, ValueError):
            return None

    # --- files -------------------------------------------------------------------------------

    def files(self, job_id: str, checkpoint: str | None = None) -> list[FileRow]:
        manifests = self._manifests(job_id, checkpoint)
        rows = []
        for m in manifests:
            for entry in m.files:
                url = self.store.uri(object_key(m, entry.path))
                rows.append(
                    FileRow(m.checkpoint, entry.path, m.node_rank, entry.size, entry.sha256, url)
                )
        return rows

    def _manifests(
        self, job_id: str, checkpoint: str | None, node: int | None = None
    ) -> list[Manifest]:
        project = self.catalog.project_of(job_id)
        manifests = self.catalog.manifests(project, job_id, node)
        if checkpoint is not None:
            chosen = [m for m in manifests if m.checkpoint == checkpoint]
            if not chosen:
                names = ", ".join(sorted({m.checkpoint for m in manifests}, key=natural_key))
                raise RecordNotFoundError(
                    f"job {job_id} has no committed checkpoint {checkpoint!r}"
                    + (f" on node {node}" if node is not None else "")
                    + f"; committed: {names or 'none'}"
                )
            manifests = chosen
        return sorted(manifests, key=lambda m: (natural_key(m.checkpoint), m.node_rank))

    # --- inspect -----------------------------------------------------------------------------

    def inspect(
        self, job_id: str, checkpoint: str, file: str | None = None, node: int = 0
    ) -> list[TensorSummary]:
        (manifest,) = self._manifests(job_id, checkpoint, node)
        paths = [f.path for f in manifest.files]
        if file is not None:
            if file not in paths:
                raise RecordNotFoundError(
                    f"{checkpoint} of job {job_id} has no file {file!r}; see `bt-agent "
                    f"checkpoints files --job-id {job_id} --checkpoint {checkpoint}`"
                )
            chosen = [file]
        else:
            chosen = [p for p in paths if p.endswith(".safetensors")]
            if not chosen:
                raise RecordNotFoundError(f"{checkpoint} of job {job_id} has no .safetensors file")
        return [self.summary(object_key(manifest, path), path) for path in chosen]

    def summary(self, key: str, label: str) -> TensorSummary:
        """The tensors of a ``.safetensors`` object, from its header alone."""
        head = self.store.read_range(key, 0, 8)
        if len(head) < 8:
            raise UsageError(f"{label} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise UsageError(f"{label} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(self.store.read_range(key, 8, length))
            return _summary(label, header)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{label} is not a safetensors file ({exc})") from exc


def _summary(label: str, header: dict[str, Any]) -> TensorSummary:
    metadata = header.pop("__metadata__", None) or {}
    tensors = [
        Tensor(name, str(info["dtype"]), [int(x) for x in info["shape"]])
        for name, info in header.items()
    ]
    return TensorSummary(label, sorted(tensors, key=lambda t: natural_key(t.name)), metadata)


def _sorted(rows: list[CheckpointRow], sort: str) -> list[CheckpointRow]:
    if sort == "size":
        return sorted(rows, key=lambda r: r.size, reverse=True)
    if sort == "name":
        return sorted(rows, key=lambda r: (natural_key(r.checkpoint), r.job_id, r.node))
    if sort == "job":
        return sorted(rows, key=lambda r: (r.job_id, natural_key(r.checkpoint), r.node))
    return sorted(rows, key=lambda r: (r.created_at, natural_key(r.checkpoint)), reverse=True)
