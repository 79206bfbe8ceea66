"""A full checkpoint dir: what was being written then is not committed.

A trainer that saves into place and hits ENOSPC leaves files that look finished to the sidecar
(quiet, readable) but are cut short; committing them would make a torn checkpoint the "latest"
one a later job resumes from. So the sidecar looks at the free space on every step: a checkpoint
that was being written (or waited for its commit) while the file system was full is held back
(:mod:`bt_agent.sidecar.holds`), uploaded but not committed, until each of its files has been
written again after the file system had room; the drain reports it, and the job ends with exit 4
if its commands succeeded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from bt_agent.log import AgentLog, format_bytes
from bt_agent.sidecar.holds import Holds

#: Below this many free bytes the checkpoint dir's file system counts as full.
FULL_BELOW_BYTES = 1024 * 1024
FULL_REASON = "it was being written while the checkpoint dir's file system was full"


def free_bytes(path: Path) -> int | None:
    """Bytes this process may still write under ``path`` (root may use the reserved blocks)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    blocks = stat.f_bfree if os.geteuid() == 0 else stat.f_bavail
    return blocks * stat.f_frsize


class FullDisk:
    def __init__(
        self, root: Path, log: AgentLog, holds: Holds, threshold: int = FULL_BELOW_BYTES
    ) -> None:
        self.root = root
        self.log = log
        self.holds = holds
        self.threshold = threshold
        self.full = False

    def check(self, writing: Callable[[], Iterable[str]]) -> None:
        """Look at the free space; while it is short, each checkpoint being ``writing()``
        (files waiting, uploading or not yet committed; asked only then) is held back."""
        free = free_bytes(self.root)
        full = free is not None and free < self.threshold
        if full != self.full:
            self._say(full, free or 0)
        self.full = full
        if not full:
            return
        for checkpoint in writing():
            self.holds.hold(checkpoint, FULL_REASON)

    def _say(self, full: bool, free: int) -> None:
        if full:
            self.log.error(
                f"checkpoints: the file system of {self.root} is full ({format_bytes(free)} "
                "free): checkpoints written now are not committed; free space or save less"
            )
        else:
            self.log.info(f"checkpoints: {self.root} has room again")
