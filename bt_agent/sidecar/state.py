"""What the sidecar knows, owned by its coordinator thread: the files waiting, uploading and
durable, and a record per checkpoint.

A checkpoint's record says which files it was last seen to hold (a file that disappears stays
listed until a commit of the checkpoint as it is on disk drops it, so that a checkpoint deleted
whole can still be committed from what was uploaded, or reported as lost), whether it has
content not yet in a commit (``dirty``), what its manifest in the store says (``committed``),
and whether it is being written in place (``writing``, kept in the journal until it settles).
"""

from __future__ import annotations

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


@dataclass
class State:
    pending: dict[str, float] = field(default_factory=dict)  # file -> when it may go
    in_flight: dict[str, int] = field(default_factory=dict)  # file -> its size
    in_flight_bytes: int = 0
    durable: dict[str, tuple[FileSig, str]] = field(default_factory=dict)  # -> sha256
    attempts: dict[str, int] = field(default_factory=dict)
    unstorable: dict[str, tuple[FileSig, str]] = field(default_factory=dict)  # -> why
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)

    def checkpoint(self, name: str) -> Checkpoint:
        found = self.checkpoints.get(name)
        if found is None:
            found = self.checkpoints[name] = Checkpoint(name)
        return found

    def of(self, relative: str) -> Checkpoint:
        """The record of the checkpoint ``relative`` belongs to."""
        return self.checkpoint(checkpoint_of(relative))

    def durable_as(self, relative: str, sig: FileSig) -> str | None:
        """The sha256 of ``relative`` in the store, if what is there is the file as ``sig``."""
        known = self.durable.get(relative)
        return known[1] if known is not None and known[0] == sig else None

    def busy(self) -> set[str]:
        """Checkpoints with files waiting or uploading."""
        return {checkpoint_of(r) for r in (*self.pending, *self.in_flight)}
