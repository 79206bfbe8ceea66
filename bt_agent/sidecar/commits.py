"""Commits: when a checkpoint may be committed, its manifest, and what keeps one from it.

A checkpoint is committed (its manifest written, last) when every file in it is durable, it
has been quiet for the quiet period, no file of it is open for writing (a scan of the job's
processes says so, whatever the clock says), it is not held back (:mod:`holds`) and no file of
it was refused by the store for good. One that changes after its commit is committed again; a
committed file about to be overwritten in the store first loses its manifest, so a manifest
never names an object whose content differs from what it says.

A checkpoint deleted whole (rotation; every file of it deleted, its directory removed or not
yet) is committed from what was uploaded, if every file it was last seen to hold is durable as
last seen and it was not being written; otherwise it is reported as lost, never dropped without
a word. A checkpoint torn by its writer's end loses a commit it already had.

Everything here runs on the sidecar's coordinator thread.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from bt_agent.catalog import Catalog
from bt_agent.errors import BtAgentError
from bt_agent.log import AgentLog, counted, format_bytes, shown
from bt_agent.records import Manifest, ManifestFile, now_iso
from bt_agent.sidecar.files import (
    Candidate,
    CheckpointDir,
    FileSig,
    checkpoint_of,
    transient,
    within_checkpoint,
)
from bt_agent.sidecar.holds import Holds
from bt_agent.sidecar.journal import Journal
from bt_agent.sidecar.state import Checkpoint, Round, State
from bt_agent.sidecar.stats import UploadStats
from bt_agent.sidecar.writers import Writers

#: How long a failed manifest write waits before the next attempt.
COMMIT_RETRY_SECONDS = 2.0
#: How often a checkpoint kept from a commit (held back, a file refused) is looked at again.
BLOCKED_RECHECK_SECONDS = 1.0
Files = list[tuple[str, FileSig, str]]  # (path, signature, sha256)


@dataclass(frozen=True)
class Owner:
    project: str
    job_id: str
    rank: int


class Committer:
    def __init__(
        self,
        state: State,
        directory: CheckpointDir,
        catalog: Catalog,
        owner: Owner,
        journal: Journal,
        holds: Holds,
        writers: Writers,
        log: AgentLog,
        stats: UploadStats,
        changed: Callable[[str, float], None],
        on_commit: Callable[[], None],
    ) -> None:
        self.state = state
        self.dir = directory
        self.catalog = catalog
        self.owner = owner
        self.journal = journal
        self.holds = holds
        self.writers = writers
        self.log = log
        self.stats = stats
        self.changed = changed  # a file must be looked at again (uploaded as it is now)
        self.on_commit = on_commit

    # --- what is ready ------------------------------------------------------------------------

    def step(self, now: float, quiet: float, draining: bool) -> None:
        """Settle and commit what has been quiet (draining: whatever the clock says)."""
        busy = self.state.busy()
        ready = [  # a checkpoint still uploading waits: no need to look who writes it yet
            c
            for c in self.state.checkpoints.values()
            if (c.writing or (c.dirty and c.name not in busy))
            and (draining or now >= c.touched + quiet)
            and now >= c.retry_at
        ]
        if not ready:
            return
        open_now = self._open(ready, now)
        for checkpoint in ready:
            checkpoint.open_file = open_now.get(checkpoint.name)
            if checkpoint.open_file is not None:
                continue  # not quiet, whatever the clock says
            if checkpoint.writing:
                self._settled(checkpoint)
            if checkpoint.dirty and checkpoint.name not in busy:
                self._commit(checkpoint, now)

    def _open(self, ready: list[Checkpoint], now: float) -> dict[str, str]:
        """Checkpoints among ``ready`` with a file open for writing: name -> that file. The scan
        must be younger than their last change (a file opened since would be missed)."""
        force = self.writers.scanned_at < max(c.touched for c in ready)
        found: dict[str, str] = {}
        for relative in sorted(self.writers.scan(now, force=force)):
            if not transient(relative):
                found.setdefault(checkpoint_of(relative), relative)
        return found

    def _settled(self, checkpoint: Checkpoint) -> None:
        """Quiet and closed: no longer being written (an agent started again after this finds
        it complete, not half-written)."""
        checkpoint.writing = False
        self.journal.record_writing(checkpoint.name, False)

    # --- commits ------------------------------------------------------------------------------

    def _commit(self, checkpoint: Checkpoint, now: float) -> None:
        checkpoint.blocked = None
        if not self.dir.exists(checkpoint.name):
            self._commit_deleted(checkpoint, now)
            return
        files: Files = []
        earlier: list[str] = []  # saved by an earlier job on this node, and not uploaded
        present: dict[str, FileSig] = {}
        for relative in sorted(checkpoint.files):
            found = self.dir.classify(relative)
            if not isinstance(found, Candidate):
                continue  # deleted (or no longer a file): no longer part of the checkpoint
            present[relative] = found.sig
            refused = self.state.refused_as(relative, found.sig)
            if refused is not None:
                what = within_checkpoint(relative)
                checkpoint.blocked = f"the store refused {shown(what)}: {refused}"
                checkpoint.retry_at = now + BLOCKED_RECHECK_SECONDS
                return
            sha256 = self.state.durable_as(relative, found.sig)
            if sha256 is not None:
                files.append((relative, found.sig, sha256))
            elif not checkpoint.adopt and self.journal.earlier_owner(relative, found.sig):
                earlier.append(relative)
            else:
                self.changed(relative, now)  # not uploaded as it is now: not complete yet
                return
        if not present and (checkpoint.files or checkpoint.vanished):
            self._commit_deleted(checkpoint, now)  # every file deleted, the directory left (or
            return  # not yet removed: a removal under way): deleted whole
        if earlier and files:  # this job added to it: its manifest names the earlier files too
            checkpoint.adopt = True
            for relative in earlier:
                self.changed(relative, now)
            return
        checkpoint.files = present
        checkpoint.vanished.clear()  # files deleted from a checkpoint still there: not its own
        self._write(checkpoint, files, now)

    def _commit_deleted(self, checkpoint: Checkpoint, now: float) -> None:
        """A checkpoint deleted whole since it was seen (its directory gone, or left empty of
        every file it held): committed from what was uploaded if that is all it held, else
        reported."""
        seen = checkpoint.files.items()
        missing = sorted(
            {r for r, sig in seen if self.state.durable_as(r, sig) is None} | checkpoint.vanished
        )
        if checkpoint.writing or missing or not seen:
            if checkpoint.writing:
                what = "it was deleted while being written"
            elif missing:
                what = (
                    f"it was deleted before {counted(len(missing), 'file')} "
                    f"({within_checkpoint(missing[0])}) could be uploaded"
                )
            else:
                what = "it was deleted before its files could be read"
            self.log.error(f"checkpoints: not committing {checkpoint.name}: {what}")
            checkpoint.blocked = what
            checkpoint.dirty = False
            return
        files = [(r, sig, self.state.durable_as(r, sig) or "") for r, sig in sorted(seen)]
        self._write(checkpoint, files, now, "deleted locally since, committed from its uploads")

    def _write(self, checkpoint: Checkpoint, files: Files, now: float, note: str = "") -> None:
        """Commit ``files`` as ``checkpoint``: its manifest, unless one like it is there, or it
        is held back."""
        if not files:
            checkpoint.dirty = False
            return
        if self.holds.blocks(checkpoint.name, (sig.ctime_ns for _, sig, _ in files)):
            checkpoint.retry_at = now + BLOCKED_RECHECK_SECONDS
            return  # stays dirty: committed only once written again
        signature = _signature(files)
        if checkpoint.committed == signature:
            checkpoint.dirty = False
            return
        manifest = Manifest(
            job_id=self.owner.job_id,
            project=self.owner.project,
            node_rank=self.owner.rank,
            checkpoint=checkpoint.name,
            created_at=now_iso(max(sig.mtime_ns for _, sig, _ in files) / 1e9),
            committed_at=now_iso(),
            files=[ManifestFile(within_checkpoint(r), sig.size, sha) for r, sig, sha in files],
        )
        try:
            self.catalog.write_manifest(manifest)
        except (BtAgentError, OSError) as exc:
            self.stats.failed()
            checkpoint.retry_at = now + COMMIT_RETRY_SECONDS
            self.log.warning(f"checkpoints: commit of {checkpoint.name} failed, retrying: {exc}")
            return
        self.journal.record_commit(checkpoint.name, signature)
        checkpoint.committed = signature
        checkpoint.dirty = False
        self.stats.committed(checkpoint.name, time.time())
        self._log_commit(manifest, checkpoint.round, now, note)
        checkpoint.round = None
        self.on_commit()

    def _log_commit(self, manifest: Manifest, round_: Round | None, now: float, note: str) -> None:
        uploaded = round_.bytes if round_ else 0
        seconds = max(now - round_.started, 1e-3) if round_ else 0.0
        rate = f" ({format_bytes(uploaded / seconds)}/s)" if uploaded >= 1_000_000 else ""
        count = len(manifest.files)
        self.log.info(
            f"checkpoint {manifest.checkpoint} committed: {counted(count, 'file')}, "
            f"{format_bytes(manifest.size)}; uploaded {format_bytes(uploaded)} in "
            f"{seconds:.1f} s{rate}" + (f" ({note})" if note else "")
        )

    def withdraw(self, checkpoint: Checkpoint, why: str) -> None:
        """Delete ``checkpoint``'s manifest: ``why`` it no longer says what is true."""
        try:
            self.catalog.delete_manifest(
                self.owner.project, self.owner.job_id, self.owner.rank, checkpoint.name
            )
        except BtAgentError as exc:
            self.log.warning(f"checkpoints: could not withdraw {checkpoint.name}: {exc}")
        checkpoint.committed = None
        self.journal.record_commit(checkpoint.name, "")
        self.log.info(f"checkpoint {checkpoint.name} withdrawn: {why}")

    def tear(self, name: str, reason: str) -> None:
        """``name`` may be cut short (``reason``): held back, and withdrawn if committed."""
        self.holds.hold(name, reason)
        checkpoint = self.state.checkpoint(name)
        checkpoint.dirty = True
        if checkpoint.committed is not None:
            self.withdraw(checkpoint, reason)

    # --- what could not be committed ----------------------------------------------------------

    def not_committed(self, not_durable: list[str]) -> dict[str, str]:
        """Every checkpoint left without a commit of what it holds, with why."""
        checkpoints = self.state.checkpoints
        reasons = {  # one an earlier job left is this job's only if this job added to it
            name: why
            for name, why in self.holds.held.items()
            if not self.holds.inherited(name) or (name in checkpoints and checkpoints[name].dirty)
        }
        short = {self.state.of(r).name for r in not_durable}
        for name, checkpoint in sorted(self.state.checkpoints.items()):
            if name in reasons:
                continue
            if checkpoint.open_file is not None and (checkpoint.dirty or checkpoint.writing):
                what = within_checkpoint(checkpoint.open_file)
                reasons[name] = f"{what} is still open for writing"
            elif checkpoint.blocked is not None and (checkpoint.dirty or not checkpoint.committed):
                reasons[name] = checkpoint.blocked
            elif name in short:
                reasons[name] = "some of its files were not durable in time"
            elif checkpoint.dirty:
                reasons[name] = "its manifest could not be written in time"
        return dict(sorted(reasons.items()))


def _signature(files: Files) -> str:
    digest = hashlib.sha256()
    for relative, sig, sha256 in files:
        digest.update(f"{relative}\0{sig.size}\0{sha256}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()
