"""The sidecar's coordinator: what to upload when, commits, retries and the drain.

One coordinator thread owns all the state; watchdog's thread only enqueues changed paths, and a
fixed pool of daemon worker threads only uploads (a daemon, so that an upload stuck on a dead
store never holds the agent past its deadline). Never on the training process.

- A file is uploaded once it has been quiet (no event) for ``quiet_seconds``, or for
  ``settle_seconds`` when its last event said it was complete (closed after writing, or renamed
  into place); if it changed during its upload (size, mtime or inode differ after the read) it
  is uploaded again.
- A failed upload is retried with capped backoff for as long as the job runs; never dropped.
- A checkpoint is committed (its manifest written, last) when every file in it is durable and it
  has been quiet; one that changes after its commit is committed again. A committed file about to
  be overwritten in the store first loses its manifest, so a manifest never names an object whose
  content differs from what it says.
- The drain rescans, then uploads what remains, newest checkpoint first, until the deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bt_agent.catalog import Catalog, checkpoint_file_key
from bt_agent.errors import BtAgentError
from bt_agent.log import AgentLog, counted, format_bytes
from bt_agent.records import Manifest, ManifestFile, now_iso
from bt_agent.settings import (
    CHECKPOINT_QUIET_VARIABLE,
    DRAIN_TIMEOUT_VARIABLE,
    UPLOAD_WORKERS_VARIABLE,
    WATCH_POLLING_VARIABLE,
    Environ,
)
from bt_agent.sidecar.beneath import Opened, Refused
from bt_agent.sidecar.files import (
    Candidate,
    CheckpointDir,
    FileSig,
    Skipped,
    checkpoint_of,
    within_checkpoint,
)
from bt_agent.sidecar.journal import Journal
from bt_agent.sidecar.space import FullDisk
from bt_agent.sidecar.stats import UploadStats
from bt_agent.sidecar.watch import Change, Watcher
from bt_agent.storage.base import Upload

TICK = 0.1
#: The shortest time between two coordinator steps: each completion wakes it, and a step costs
#: time proportional to the files waiting, so many small uploads must not mean as many steps.
MIN_STEP = 0.02
MiB = 1024 * 1024
#: At most this many files queued for upload, and QUEUE_BYTES per worker (see Sidecar._room).
QUEUE_FILES = 512
QUEUE_BYTES = 16 * MiB


@dataclass(frozen=True)
class SidecarSettings:
    quiet_seconds: float = 0.5  # no change for this long: a file is ready, a checkpoint complete
    settle_seconds: float = 0.1  # a file closed after writing (or renamed in): ready after this
    workers: int = 16  # uploads at a time; memory is bounded by the store, not by this
    backlog_interval: float = 30.0  # seconds between backlog lines while uploads wait
    retry_cap: float = 30.0  # longest wait between two attempts of a failed upload
    drain_seconds: float = 1800.0  # the drain's limit when the commands end on their own
    polling: bool = False  # watch by polling (file systems without inotify)
    nice: int = 10  # the upload threads yield the CPU to training (Linux: per-thread priority)

    @classmethod
    def from_environ(cls, environ: Environ) -> SidecarSettings:
        default = cls()
        return cls(
            quiet_seconds=environ.number(CHECKPOINT_QUIET_VARIABLE, default.quiet_seconds),
            workers=max(1, int(environ.number(UPLOAD_WORKERS_VARIABLE, default.workers))),
            drain_seconds=environ.number(DRAIN_TIMEOUT_VARIABLE, default.drain_seconds),
            polling=environ.get(WATCH_POLLING_VARIABLE) in ("1", "true", "yes"),
        )


@dataclass(frozen=True)
class Owner:
    project: str
    job_id: str
    rank: int


@dataclass(frozen=True)
class DrainReport:
    not_durable: list[str]  # files (relative to the checkpoint dir) not saved in time
    uncommitted: list[str]  # checkpoints whose manifest could not be written
    seconds: float
    held: list[str] = field(default_factory=list)  # written while the disk was full

    @property
    def complete(self) -> bool:
        return not self.not_durable and not self.uncommitted and not self.held

    def describe(self) -> str:
        shown = ", ".join(self.not_durable[:10]) + (" ..." if len(self.not_durable) > 10 else "")
        parts = []
        if self.not_durable:
            parts.append(f"{len(self.not_durable)} checkpoint file(s) not durable: {shown}")
        if self.uncommitted:
            parts.append(f"checkpoint(s) not committed: {', '.join(self.uncommitted)}")
        if self.held:
            parts.append(
                "checkpoint(s) written while the checkpoint dir was full, not committed: "
                + ", ".join(self.held)
            )
        return "; ".join(parts)


@dataclass(frozen=True)
class _Done:
    file: Candidate
    after: Candidate | Skipped | None = None
    sha256: str | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class _Streamed(Upload):
    """A small file handed to the store's upload stream, open until the stream tells."""

    file: Candidate
    opened: Opened


@dataclass
class _Round:
    """One checkpoint's uploads since its last commit: for the commit's log line."""

    started: float
    files: int = 0
    bytes: int = 0


@dataclass
class _State:
    pending: dict[str, float] = field(default_factory=dict)  # file -> when it may go
    in_flight: dict[str, int] = field(default_factory=dict)  # file -> its size
    in_flight_bytes: int = 0
    durable: dict[str, tuple[FileSig, str]] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    touched: dict[str, float] = field(default_factory=dict)  # checkpoint -> last change
    dirty: set[str] = field(default_factory=set)  # checkpoints with new durable content
    commits: dict[str, str] = field(default_factory=dict)  # checkpoint -> signature
    newest: dict[str, int] = field(default_factory=dict)  # checkpoint -> newest mtime seen
    rounds: dict[str, _Round] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # file -> size when last looked at
    commit_retry: dict[str, float] = field(default_factory=dict)

    def busy(self) -> set[str]:
        return {checkpoint_of(r) for r in (*self.pending, *self.in_flight)}


class Sidecar:
    def __init__(
        self,
        directory: CheckpointDir,
        catalog: Catalog,
        owner: Owner,
        journal: Journal,
        log: AgentLog,
        settings: SidecarSettings | None = None,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self.dir = directory
        self.catalog = catalog
        self.owner = owner
        self.journal = journal
        self.log = log
        self.settings = settings or SidecarSettings()
        self.on_commit = on_commit
        self.stats = UploadStats()
        self._state = _State()
        self._changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[Candidate | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        # Small files go to the store's upload stream, where it has one (one thread, many
        # connections), a list per coordinator step; the rest to the worker threads.
        self._stream_in: queue.SimpleQueue[list[_Streamed] | None] = queue.SimpleQueue()
        self._to_stream: list[_Streamed] = []
        self._stream_limit = 0  # set by the stream's thread once the store says it has one
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._draining = False
        self._warned: set[str] = set()
        self._earlier: set[str] = set()
        self._last_report = time.monotonic()
        self._last_backlog = 0.0
        self.watcher = Watcher(directory.root, self._changes, self.settings.polling)
        self.space = FullDisk(directory.root, log)
        self._threads: list[threading.Thread] = []

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Pick up what an earlier agent on this checkpoint dir left, then watch."""
        _allow_open_files(QUEUE_FILES * 4)
        state = self._state
        state.durable, state.commits = self._what_the_store_holds()
        state.dirty = {checkpoint_of(r) for r in state.durable}
        now = time.monotonic()
        for relative in self.dir.walk():
            self._mark(relative, now, 0.0)
        self.watcher.start()
        self.log.info(
            f"checkpoints: watching {self.dir.root} ({self.watcher.method}); "
            f"uploading to {self.catalog.store.url}"
        )
        # The first step here, before the commands start: what is already in the dir is sorted
        # out (and said) in the same order on every run.
        self._step(now)
        for index in range(self.settings.workers):
            self._spawn(self._worker, f"bt-upload-{index}")
        self._spawn(self._stream, "bt-upload-stream")
        self._spawn(self._loop, "bt-sidecar")

    def _what_the_store_holds(self) -> tuple[dict[str, tuple[FileSig, str]], dict[str, str]]:
        """What the journal says this job made durable and committed in this store, as far as
        the store confirms it (one listing each): what an earlier run recorded may have
        vanished since. A store that cannot be listed now confirms nothing."""
        durable, commits = self.journal.durable(), self.journal.commits()
        if not durable and not commits:
            return durable, commits
        owner = self.owner
        try:
            stored = self.catalog.stored_checkpoint_files(owner.project, owner.job_id, owner.rank)
            names = self.catalog.committed_names(owner.project, owner.job_id, owner.rank)
        except (BtAgentError, OSError) as exc:
            self.log.warning(f"checkpoints: cannot list the store ({exc}); uploading again")
            stored, names = {}, set()
        missing = [r for r, (sig, _) in durable.items() if stored.get(r) != sig.size]
        if missing:
            self.log.warning(
                f"checkpoints: {counted(len(missing), 'file')} recorded as uploaded "
                f"{'is' if len(missing) == 1 else 'are'} not in {self.catalog.store.url}: "
                "uploading again"
            )
            self.journal.forget_uploads(missing)
        for checkpoint in set(commits) - names:
            self.journal.record_commit(checkpoint, "")
        kept = {r: entry for r, entry in durable.items() if r not in set(missing)}
        return kept, {c: sig for c, sig in commits.items() if c in names}

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def drain(self, deadline: Callable[[], float]) -> DrainReport:
        """Stop watching, rescan, and upload and commit what remains, newest checkpoint first,
        until everything is durable or ``deadline()`` (``time.monotonic()``; asked again as
        the drain goes, since a stop signal shortens it) passes."""
        started = time.monotonic()
        self.watcher.stop()
        self._changes.put(Change(str(self.dir.root), whole=True))
        self._draining = True
        self._idle.clear()
        self._wake.set()
        while not self._idle.wait(min(max(deadline() - time.monotonic(), 0), 0.5)):
            if time.monotonic() >= deadline():
                break
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            if thread.name == "bt-sidecar":
                thread.join(0.5)  # a step stuck on a dead store must not hold the deadline
        for _ in range(self.settings.workers):
            self._work.put(None)
        self._stream_in.put(None)
        report = self._report_lost(time.monotonic() - started)
        self.journal.close()
        return report

    def _report_lost(self, seconds: float) -> DrainReport:
        state = self._state
        # Snapshots (each taken at once under the GIL): the coordinator may still be in a step.
        waiting = list(state.pending) + list(state.in_flight)
        left = sorted(r for r in set(waiting) if isinstance(self.dir.classify(r), Candidate))
        held = set(self.space.held) & set(state.dirty)
        uncommitted = sorted((set(state.dirty) - held) | {checkpoint_of(r) for r in left})
        self.stats.lost(left)
        self.stats.backlog(len(left), 0)
        return DrainReport(left, uncommitted, seconds, sorted(held))

    # --- the coordinator ---------------------------------------------------------------------

    def _loop(self) -> None:
        _lower_priority(self.settings.nice)
        while not self._stop.is_set():
            try:
                self._step(time.monotonic())
            except Exception as exc:  # never let one surprise end the uploads
                self.log.error(f"checkpoint sidecar: {type(exc).__name__}: {exc}")
            time.sleep(MIN_STEP)
            self._wake.wait(TICK)
            self._wake.clear()

    def _step(self, now: float) -> None:
        self._take_changes(now)
        self.space.check(self._being_written)
        self._collect(now)
        self._submit(now)
        self._hand_over()  # whatever way _submit ended: a file counted in flight must go
        self._commit_ready(now)
        self._report(now)
        state = self._state
        held = set(self.space.held)
        if self._draining and not (state.pending or state.in_flight or state.dirty - held):
            self._idle.set()

    def _being_written(self) -> set[str]:
        state = self._state
        return state.busy() | state.dirty

    def _mark(self, relative: str, now: float, wait: float, settled: bool = False) -> None:
        """``relative`` changed: upload it once ``wait`` has passed without another change (a
        settled file's wait replaces the longer one of the writes before its close)."""
        state = self._state
        if self._draining and relative not in state.attempts:
            state.pending[relative] = now  # the writers are gone: no quiet period to wait for
        elif settled:
            state.pending[relative] = now + wait
        else:
            state.pending[relative] = max(now + wait, state.pending.get(relative, 0.0))
        state.touched[checkpoint_of(relative)] = now

    def _changed(self, relative: str, now: float, settled: bool = False) -> None:
        wait = self.settings.settle_seconds if settled else self.settings.quiet_seconds
        self._mark(relative, now, wait, settled)

    def _take_changes(self, now: float) -> None:
        while True:
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                return
            path = change.path
            if change.whole:  # a directory that appeared (or the whole dir, at the drain)
                under = self.dir.relative(path) if path != str(self.dir.root) else ""
                if under is not None:
                    for inner in self.dir.walk(under):
                        self._changed(inner, now, change.settled)
                continue
            relative = self.dir.relative(path)
            if relative is not None:
                self._changed(relative, now, change.settled)

    def _submit(self, now: float) -> None:
        state = self._state
        if not self._room(share=2):
            return  # looking costs time in proportion to the files waiting: not for each upload
        ready = [r for r, due in state.pending.items() if due <= now and r not in state.in_flight]
        while ready and self._room():
            # Only as many as the queue takes, in "newest checkpoint first" order: a full sort
            # per step would cost more than the uploads of many small files.
            batch = heapq.nsmallest(QUEUE_FILES - len(state.in_flight), ready, key=self._priority)
            chosen = set(batch)
            ready = [r for r in ready if r not in chosen]
            for relative in batch:
                if not self._room():
                    return
                self._consider(relative, now)

    def _hand_over(self) -> None:
        """Give the upload stream the small files this step chose, in one list."""
        if self._to_stream:
            self._stream_in.put(self._to_stream)
            self._to_stream = []

    def _room(self, share: int = 1) -> bool:
        """Whether the queue takes another file: always while a worker could be idle, then
        up to QUEUE_FILES files and QUEUE_BYTES per worker (divided by ``share``: the coordinator
        looks for files only once the queue is down to half). A queue of many small files keeps
        the workers busy between the coordinator's steps; a short one in bytes keeps "newest
        checkpoint first" meaningful for large files."""
        state = self._state
        workers = self.settings.workers
        if len(state.in_flight) < 2 * workers:
            return True
        return (
            len(state.in_flight) < QUEUE_FILES // share
            and state.in_flight_bytes < QUEUE_BYTES * workers // share
        )

    def _priority(self, relative: str) -> tuple[int, str]:
        return (-self._state.newest.get(checkpoint_of(relative), 0), relative)

    def _consider(self, relative: str, now: float) -> None:
        """Upload a due file, unless it is gone, skipped, unchanged or saved by an earlier job."""
        state = self._state
        found = self.dir.classify(relative)
        if found is None or isinstance(found, Skipped):
            del state.pending[relative]
            if isinstance(found, Skipped):
                self._warn_once(relative, f"checkpoints: skipping {relative!r}: {found.reason}")
            return
        checkpoint = checkpoint_of(relative)
        state.sizes[relative] = found.sig.size
        state.newest[checkpoint] = max(state.newest.get(checkpoint, 0), found.sig.mtime_ns)
        known = state.durable.get(relative)
        if known is not None and known[0] == found.sig:
            del state.pending[relative]  # unchanged since it was uploaded
            return
        if known is None and self._saved_by_earlier_job(found):
            del state.pending[relative]
            return
        if known is not None and checkpoint in state.commits:
            self._uncommit(checkpoint)  # its manifest would name content about to change
        del state.pending[relative]
        state.in_flight[relative] = found.sig.size
        state.in_flight_bytes += found.sig.size
        state.rounds.setdefault(checkpoint, _Round(now))
        if self._stream_limit > 0 and found.sig.size <= self._stream_limit:
            self._stream_file(found)
        else:
            self._work.put(found)

    def _stream_file(self, found: Candidate) -> None:
        """Hand ``found`` to the upload stream, opened now (it is read later, by the stream)."""
        try:
            opened = self.dir.open(found.relative)
        except OSError as exc:
            self._done.put(self._unreadable(found, exc))
            return
        streamed = _Streamed(opened.path, self._key(found.relative), found, opened)
        self._to_stream.append(streamed)

    def _saved_by_earlier_job(self, found: Candidate) -> bool:
        earlier = self.journal.earlier_owner(found.relative, found.sig)
        if earlier is None:
            return False
        owner = earlier[0]
        if owner not in self._earlier:
            self._earlier.add(owner)
            self.log.info(
                f"checkpoints: files in {self.dir.root} were already saved by job {owner} "
                "(an earlier job on this node); they are not uploaded again"
            )
        return True

    def _collect(self, now: float) -> None:
        """Take finished uploads; the journal records the durable ones in one transaction."""
        state = self._state
        durable: list[tuple[str, FileSig, str]] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            relative = done.file.relative
            state.in_flight_bytes -= state.in_flight.pop(relative, 0)
            if done.error is not None:
                self._failed(done, now)
            elif not isinstance(done.after, Candidate):
                continue  # gone (deleted, renamed away) while it was uploading
            elif done.after.sig != done.file.sig:
                self._changed(relative, now)  # changed during the upload: upload again
            else:
                assert done.sha256 is not None
                durable.append((relative, done.file.sig, done.sha256))
                self._durable(relative, done.file.sig, done.sha256, now)
        if durable:
            self.journal.record_uploads(durable)

    def _durable(self, relative: str, sig: FileSig, sha256: str, now: float) -> None:
        state = self._state
        state.durable[relative] = (sig, sha256)
        state.attempts.pop(relative, None)
        self.stats.uploaded(sig.size)
        checkpoint = checkpoint_of(relative)
        state.dirty.add(checkpoint)
        round_ = state.rounds.setdefault(checkpoint, _Round(now))
        round_.files += 1
        round_.bytes += sig.size

    def _failed(self, done: _Done, now: float) -> None:
        state = self._state
        relative = done.file.relative
        if not isinstance(self.dir.classify(relative), Candidate):
            return  # deleted locally meanwhile: nothing left to save
        attempt = state.attempts.get(relative, 0) + 1
        state.attempts[relative] = attempt
        self.stats.failed()
        delay = random.uniform(0, min(self.settings.retry_cap, 2.0**attempt))
        state.pending[relative] = now + delay
        if attempt == 1 or attempt % 10 == 0:
            self.log.warning(
                f"checkpoints: upload of {relative} failed (attempt {attempt}), "
                f"retrying: {done.error}"
            )

    def _worker(self) -> None:
        _lower_priority(self.settings.nice)  # threads it starts (S3 parts) inherit it
        while (file := self._work.get()) is not None:
            self._done.put(self._upload(file))
            self._wake.set()

    def _upload(self, file: Candidate) -> _Done:
        """Upload ``file`` from a descriptor opened beneath the checkpoint dir: the store reads
        what was checked to be a regular file of the dir, whatever its name leads to now."""
        try:
            with self.dir.open(file.relative) as opened:
                now = FileSig.of(opened.info)
                if now != file.sig:  # changed since it was chosen: look at it again
                    return _Done(file, Candidate(file.relative, now))
                result = self.catalog.store.upload_file(opened.path, self._key(file.relative))
        except (BtAgentError, OSError) as exc:
            return self._unreadable(file, exc)
        return _Done(file, self.dir.classify(file.relative), result.sha256)

    @staticmethod
    def _unreadable(file: Candidate, exc: Exception) -> _Done:
        """The outcome of an upload that failed: a file that is gone or no longer a regular
        file of the dir is not retried (the watcher tells what it became); anything else is."""
        if isinstance(exc, Refused):
            return _Done(file, Skipped(file.relative, exc.reason))
        if isinstance(exc, FileNotFoundError | NotADirectoryError) and not isinstance(
            exc, BtAgentError
        ):
            return _Done(file)
        return _Done(file, error=exc)

    def _key(self, relative: str) -> str:
        return checkpoint_file_key(self.owner.project, self.owner.job_id, self.owner.rank, relative)

    def _stream(self) -> None:
        """Upload small files through the store's upload stream, where it has one."""
        _lower_priority(self.settings.nice)
        store = self.catalog.store
        self._stream_limit = store.batch_max_size()
        if not self._stream_limit:
            return
        try:
            store.upload_stream(self._stream_in.get, self._streamed)
        except Exception as exc:  # files keep going, one per thread
            self._stream_limit = 0
            self.log.error(
                f"checkpoint sidecar: upload stream stopped: {type(exc).__name__}: {exc}"
            )
            while True:
                try:
                    handed = self._stream_in.get_nowait()
                except queue.Empty:
                    break
                for upload in handed or []:
                    self._streamed(upload, exc)

    def _streamed(self, upload: _Streamed, outcome: str | Exception) -> None:
        file = upload.file
        upload.opened.close()
        if isinstance(outcome, Exception):
            done = _Done(file, error=outcome)
            self._stream_limit = self.catalog.store.batch_max_size()  # 0: the stream is off
        else:
            done = _Done(file, self.dir.classify(file.relative), outcome)
        self._done.put(done)
        self._wake.set()

    # --- commits -----------------------------------------------------------------------------

    def _commit_ready(self, now: float) -> None:
        state = self._state
        quiet = self.settings.quiet_seconds
        eligible = [
            c
            for c in sorted(state.dirty)
            if (self._draining or now >= state.touched.get(c, 0.0) + quiet)
            and now >= state.commit_retry.get(c, 0.0)
        ]
        if not eligible:
            return
        busy = state.busy()
        for checkpoint in eligible:
            if checkpoint not in busy:
                self._commit(checkpoint, now)

    def _commit(self, checkpoint: str, now: float) -> None:
        state = self._state
        files: list[tuple[str, FileSig, str]] = []
        for relative in sorted(r for r in state.durable if checkpoint_of(r) == checkpoint):
            sig, sha256 = state.durable[relative]
            found = self.dir.classify(relative)
            if not isinstance(found, Candidate):
                continue  # deleted locally: no longer part of the checkpoint
            if found.sig != sig:
                self._changed(relative, now)  # changed since its upload: not complete yet
                return
            files.append((relative, sig, sha256))
        if not files:
            state.dirty.discard(checkpoint)
            return
        signature = _signature(files)
        if state.commits.get(checkpoint) == signature:
            state.dirty.discard(checkpoint)
            return
        if self.space.holds(checkpoint, (sig.mtime_ns for _, sig, _ in files)):
            return  # stays dirty: committed only once written again with room
        manifest = Manifest(
            job_id=self.owner.job_id,
            project=self.owner.project,
            node_rank=self.owner.rank,
            checkpoint=checkpoint,
            created_at=now_iso(max(sig.mtime_ns for _, sig, _ in files) / 1e9),
            committed_at=now_iso(),
            files=[ManifestFile(within_checkpoint(r), sig.size, sha) for r, sig, sha in files],
        )
        try:
            self.catalog.write_manifest(manifest)
        except (BtAgentError, OSError) as exc:
            self.stats.failed()
            state.commit_retry[checkpoint] = now + min(self.settings.retry_cap, 2.0)
            self.log.warning(f"checkpoints: commit of {checkpoint} failed, retrying: {exc}")
            return
        self.journal.record_commit(checkpoint, signature)
        state.commits[checkpoint] = signature
        state.dirty.discard(checkpoint)
        state.commit_retry.pop(checkpoint, None)
        self.stats.committed(checkpoint, time.time())
        self._log_commit(manifest, state.rounds.pop(checkpoint, None), now)
        self.on_commit()

    def _log_commit(self, manifest: Manifest, round_: _Round | None, now: float) -> None:
        uploaded = round_.bytes if round_ else 0
        seconds = max(now - round_.started, 1e-3) if round_ else 0.0
        rate = f" ({format_bytes(uploaded / seconds)}/s)" if uploaded >= 1_000_000 else ""
        count = len(manifest.files)
        self.log.info(
            f"checkpoint {manifest.checkpoint} committed: {counted(count, 'file')}, "
            f"{format_bytes(manifest.size)}; uploaded {format_bytes(uploaded)} in "
            f"{seconds:.1f} s{rate}"
        )

    def _uncommit(self, checkpoint: str) -> None:
        state = self._state
        try:
            self.catalog.delete_manifest(
                self.owner.project, self.owner.job_id, self.owner.rank, checkpoint
            )
        except BtAgentError as exc:
            self.log.warning(f"checkpoints: could not withdraw {checkpoint}'s manifest: {exc}")
        state.commits.pop(checkpoint, None)
        self.journal.record_commit(checkpoint, "")
        self.log.info(f"checkpoint {checkpoint} changed after its commit: committing it again")

    # --- visibility --------------------------------------------------------------------------

    def _report(self, now: float) -> None:
        if now - self._last_backlog < 1.0:
            return
        self._last_backlog = now
        state = self._state
        waiting = [*state.pending, *state.in_flight]
        self.stats.backlog(len(waiting), sum(state.sizes.get(r, 0) for r in waiting))
        if not waiting or now - self._last_report < self.settings.backlog_interval:
            return
        self._last_report = now
        totals = self.stats.totals()
        self.log.info(
            f"checkpoints: {len(waiting)} file(s) waiting to upload, {len(state.in_flight)} "
            f"in flight; {totals.files} uploaded ({format_bytes(totals.bytes)}), "
            f"{totals.failures} failed attempt(s) retried"
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority (on Linux, per thread; threads it starts inherit
    it): ``SCHED_IDLE`` where the system has it, so that the uploads run on what the training
    leaves of the CPUs, and ``increment`` more niceness besides."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _allow_open_files(wanted: int) -> None:
    """Raise the soft limit on open files to ``wanted`` where it is lower (and the hard limit
    allows): files queued for the upload stream stay open until sent."""
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < ceiling:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))


def _signature(files: list[tuple[str, FileSig, str]]) -> str:
    digest = hashlib.sha256()
    for relative, sig, sha256 in files:
        digest.update(f"{relative}\0{sig.size}\0{sha256}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()
