"""What the sidecar knows, owned by its coordinator thread: a record per file and a record per
checkpoint.

A file's record says whether it is waiting to go (``due``), being uploaded (``uploading``), what
of it is durable in the store (``stored``: the file as it was, and its sha256) or refused by
the store for good (``refused``), and how many attempts failed since its last success. Its
status is the first of those that holds (a file stored before may be waiting again). The state
keeps the names of the files waiting and uploading apart, so that a step costs time in
proportion to the work, not to every file ever seen.

A checkpoint's record says which files it was last seen to hold (a file that disappears stays
listed until a commit of the checkpoint as it is on disk drops it, so that a checkpoint deleted
whole can still be committed from what was uploaded, or reported as lost), whether it has
content not yet in a commit (``dirty``), what its manifest in the store says (``committed``),
and whether it is being written in place (``writing``, kept in the journal until it settles).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from bt_agent.sidecar.files import FileSig, checkpoint_of


@dataclass
class Round:
    """One checkpoint's uploads since its last commit: for the commit's log line."""

    started: float
    files: int = 0
    bytes: int = 0


@dataclass
class Checkpoint:
    name: str
    files: dict[str, FileSig] = field(default_factory=dict)  # path -> as last seen on disk
    touched: float = 0.0  # monotonic time of the last change seen
    newest: int = 0  # newest modification time seen (ns): "newest checkpoint first"
    dirty: bool = False  # content seen or uploaded that no commit names yet
    committed: str | None = None  # the signature of its manifest in the store
    writing: bool = False  # written in place, not yet settled (in the journal too)
    renamed_in: bool = False  # arrived whole, renamed into place, and not written since
    blocked: str | None = None  # why it cannot be committed as it is (till it changes)
    open_file: str | None = None  # a file of it open for writing, at the last look
    adopt: bool = False  # it holds new content: files an earlier job saved are copied in too
    vanished: set[str] = field(default_factory=set)  # files gone before they were uploaded
    round: Round | None = None
    retry_at: float = 0.0  # a failed commit is tried again after this


class FileStatus(enum.Enum):
    UPLOADING = "uploading"
    WAITING = "waiting"
    REFUSED = "refused"
    DURABLE = "durable"
    SEEN = "seen"  # nothing to do: gone, skipped, or an earlier job's


@dataclass
class FileRecord:
    relative: str
    due: float | None = None  # waiting: may go at this monotonic time
    uploading: int | None = None  # the size of the version being uploaded
    stored: tuple[FileSig, str] | None = None  # durable: the file as it was, and its sha256
    refused: tuple[FileSig, str] | None = None  # the store refuses its key: as it was, and why
    attempts: int = 0  # failed attempts since the last success

    @property
    def status(self) -> FileStatus:
        if self.uploading is not None:
            return FileStatus.UPLOADING
        if self.due is not None:
            return FileStatus.WAITING
        if self.refused is not None:
            return FileStatus.REFUSED
        if self.stored is not None:
            return FileStatus.DURABLE
        return FileStatus.SEEN

    def unchanged_since_done(self, sig: FileSig) -> bool:
        """Whether the file as ``sig`` is what was stored, or what the store refused."""
        return _as(self.stored, sig) is not None or _as(self.refused, sig) is not None


def _as(done: tuple[FileSig, str] | None, sig: FileSig) -> str | None:
    """What ``done`` says (a sha256, or why the store refused) if it was done to ``sig``."""
    return done[1] if done is not None and done[0] == sig else None


@dataclass
class State:
    files: dict[str, FileRecord] = field(default_factory=dict)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    uploading_bytes: int = 0
    _waiting: set[str] = field(default_factory=set)
    _uploading: set[str] = field(default_factory=set)

    # --- files -------------------------------------------------------------------------------

    def file(self, relative: str) -> FileRecord:
        found = self.files.get(relative)
        if found is None:
            found = self.files[relative] = FileRecord(relative)
        return found

    def wait(self, relative: str, due: float) -> None:
        """``relative`` goes once ``due`` has passed."""
        self.file(relative).due = due
        self._waiting.add(relative)

    def unwait(self, record: FileRecord) -> None:
        record.due = None
        self._waiting.discard(record.relative)

    def start_upload(self, record: FileRecord, size: int) -> None:
        self.unwait(record)
        record.uploading = size
        self._uploading.add(record.relative)
        self.uploading_bytes += size

    def end_upload(self, relative: str) -> FileRecord:
        record = self.file(relative)
        self.uploading_bytes -= record.uploading or 0
        record.uploading = None
        self._uploading.discard(relative)
        return record

    def stored(self, record: FileRecord, sig: FileSig, sha256: str) -> None:
        record.stored = (sig, sha256)
        record.attempts = 0

    def due(self, now: float) -> list[str]:
        """Files whose wait is over and that are not being uploaded."""
        return [
            relative
            for relative in self._waiting
            if relative not in self._uploading and (self.files[relative].due or 0.0) <= now
        ]

    def waiting(self) -> set[str]:
        return set(self._waiting)

    def uploading(self) -> set[str]:
        return set(self._uploading)

    def uploading_count(self) -> int:
        return len(self._uploading)

    def has_work(self) -> bool:
        """Whether any file is waiting or uploading."""
        return bool(self._waiting or self._uploading)

    def unsaved(self) -> set[str]:
        """Files waiting, uploading, or refused by the store: not durable as they are."""
        refused = {r for r, f in self.files.items() if f.status is FileStatus.REFUSED}
        return self._waiting | self._uploading | refused

    def durable(self) -> Iterator[tuple[str, FileSig, str]]:
        for relative, record in self.files.items():
            if record.stored is not None:
                yield relative, *record.stored

    def durable_as(self, relative: str, sig: FileSig) -> str | None:
        """The sha256 of ``relative`` in the store, if what is there is the file as ``sig``."""
        record = self.files.get(relative)
        return _as(record.stored if record is not None else None, sig)

    def refused_as(self, relative: str, sig: FileSig) -> str | None:
        """Why the store refused ``relative``, if it refused the file as ``sig``."""
        record = self.files.get(relative)
        return _as(record.refused if record is not None else None, sig)

    # --- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, name: str) -> Checkpoint:
        found = self.checkpoints.get(name)
        if found is None:
            found = self.checkpoints[name] = Checkpoint(name)
        return found

    def of(self, relative: str) -> Checkpoint:
        """The record of the checkpoint ``relative`` belongs to."""
        return self.checkpoint(checkpoint_of(relative))

    def busy(self) -> set[str]:
        """Checkpoints with files waiting or uploading."""
        return {checkpoint_of(r) for r in (*self._waiting, *self._uploading)}
