"""Checkpoints held back from a commit: what is on disk may be cut short.

A checkpoint is held when its writer ended while writing it, when the agent had to end a
process still writing it, when it was being written while the disk was full, or when an agent
started again finds it was being written in place when the last one stopped. Committing it
would make a torn checkpoint the "latest" one a later job resumes from. A hold is kept in the
journal (it outlives the agent) and says why; it is released once every file of the checkpoint
has changed after it (the kernel's change time, which a rewrite cannot put back): the
checkpoint was written again. Until then the checkpoint is reported as not committed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from bt_agent.log import AgentLog
from bt_agent.sidecar.journal import Journal


@dataclass(frozen=True)
class Hold:
    reason: str  # "its writer ended while writing model.pt"
    since_ns: int  # released once every file has changed after this (wall clock, ns)


class Holds:
    def __init__(self, log: AgentLog, journal: Journal) -> None:
        self.log = log
        self.journal = journal
        self._held = {name: Hold(*row) for name, row in journal.holds().items()}
        self._inherited: set[str] = set()  # held by an earlier job on this node root

    def inherit(self, checkpoint: str, reason: str, since_ns: int | None) -> None:
        """Hold ``checkpoint``, still on disk as an earlier job on this node root left it
        held (or half-written). It is this job's concern only once it adds to it."""
        if checkpoint not in self._held:
            self._inherited.add(checkpoint)
            self.hold(checkpoint, reason, since_ns)

    def inherited(self, checkpoint: str, ctime_ns: int | None = None) -> bool:
        """Whether ``checkpoint`` is held as an earlier job left it (and a file of it that
        changed at ``ctime_ns`` is as that job left it too)."""
        held = self._held.get(checkpoint)
        if checkpoint not in self._inherited or held is None:
            return False
        return ctime_ns is None or ctime_ns <= held.since_ns

    def hold(self, checkpoint: str, reason: str, since_ns: int | None = None) -> None:
        """Hold ``checkpoint`` back until it is written again after ``since_ns`` (now); the
        first reason stays, a later hold only moves the time on."""
        since = time.time_ns() if since_ns is None else since_ns
        held = self._held.get(checkpoint)
        if held is None:
            self.log.error(f"checkpoints: not committing {checkpoint}: {reason}")
            held = Hold(reason, since)
        elif since <= held.since_ns:
            return
        self._held[checkpoint] = Hold(held.reason, max(since, held.since_ns))
        self.journal.record_hold(checkpoint, held.reason, self._held[checkpoint].since_ns)

    def blocks(self, checkpoint: str, ctimes_ns: Iterable[int]) -> bool:
        """Whether ``checkpoint`` (the change times of its files) must not be committed: it is
        held, and not every file has changed since."""
        held = self._held.get(checkpoint)
        if held is None:
            return False
        if min(ctimes_ns, default=0) <= held.since_ns:
            return True
        del self._held[checkpoint]
        self.journal.record_hold(checkpoint, None)
        self.log.info(f"checkpoints: {checkpoint} was written again after it was held back")
        return False

    def reason(self, checkpoint: str) -> str | None:
        held = self._held.get(checkpoint)
        return held.reason if held else None

    def __contains__(self, checkpoint: str) -> bool:
        return checkpoint in self._held

    @property
    def held(self) -> dict[str, str]:
        """Every checkpoint held back, with why."""
        return {name: held.reason for name, held in sorted(self._held.items())}
