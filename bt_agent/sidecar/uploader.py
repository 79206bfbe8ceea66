"""The sidecar's coordinator: what to upload when, retries, and the drain.

One coordinator thread owns all the state (:mod:`state`); watchdog's thread only enqueues
changed paths, and a fixed pool of daemon worker threads only uploads (a daemon, so that an
upload stuck on a dead store never holds the agent past its deadline). Never on the training
process.

- A file is uploaded once it has been quiet (no event) for ``quiet_seconds``, or for
  ``settle_seconds`` when its last event said it was complete (closed after writing, or renamed
  into place); if it changed during its upload (its signature differs after the read) it is
  uploaded again. It is read through a descriptor opened beneath the checkpoint dir
  (:mod:`beneath`): nothing outside is ever read, and only regular files.
- A failed upload is retried with capped backoff for as long as the job runs; never dropped. A
  key the store refuses for good (too long; an object in the way) is reported at once and
  keeps only its own checkpoint from a commit.
- A file an earlier job on this node root already made durable in this store is copied in the
  store instead of uploaded: the new job's manifest names every file of its checkpoint.
- Commits are :mod:`commits`'. A checkpoint whose writer ended while writing it, or that was
  being written when a process of the job was killed, is held back (:mod:`holds`).
- The drain rescans, then uploads what remains, newest checkpoint first, until the deadline.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bt_agent.catalog import Catalog, checkpoint_file_key
from bt_agent.errors import BtAgentError, KeyRefusedError, NotFoundError, described
from bt_agent.log import AgentLog, counted, format_bytes, shown
from bt_agent.settings import (
    CHECKPOINT_QUIET_VARIABLE,
    DRAIN_TIMEOUT_VARIABLE,
    UPLOAD_WORKERS_VARIABLE,
    WATCH_POLLING_VARIABLE,
    Environ,
)
from bt_agent.sidecar.beneath import Opened, Refused
from bt_agent.sidecar.commits import Committer, Owner
from bt_agent.sidecar.cpus import Placement, cpu_list, lower_priority, share_priority
from bt_agent.sidecar.files import (
    Candidate,
    CheckpointDir,
    FileSig,
    Skipped,
    checkpoint_of,
    within_checkpoint,
)
from bt_agent.sidecar.holds import Holds
from bt_agent.sidecar.journal import Journal
from bt_agent.sidecar.leftovers import Leftovers
from bt_agent.sidecar.report import DrainReport
from bt_agent.sidecar.space import FullDisk
from bt_agent.sidecar.state import Round, State
from bt_agent.sidecar.stats import UploadStats
from bt_agent.sidecar.watch import Change, Watcher
from bt_agent.sidecar.writers import Writers, all_processes
from bt_agent.storage.base import Upload

__all__ = ["DrainReport", "Owner", "Sidecar", "SidecarSettings"]

TICK = 0.1
#: The shortest time between two coordinator steps: each completion wakes it, and a step costs
#: time proportional to the files waiting, so many small uploads must not mean as many steps.
MIN_STEP = 0.02
MiB = 1024 * 1024
#: At most this many files queued for upload, and QUEUE_BYTES per worker (see Sidecar._room).
QUEUE_FILES = 512
QUEUE_BYTES = 16 * MiB
#: How long the drain waits for the watch to hand over the changes it still holds.
FLUSH_SECONDS = 2.0
#: A drain that takes longer says what it still uploads (a shorter one is not worth a line).
SAY_LEFT_AFTER = 1.0
#: How long the drain waits for the coordinator to say what is lost, once stopped.
ANSWER_SECONDS = 0.5
HALF_WRITTEN = "it was being written in place when the agent last stopped"


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
    # A checkpoint written in place this shortly before a process of the job was killed may be
    # cut short (a pause between two files of one save looks quiet): it is not committed.
    kill_window: float = 2.0

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
class _Done:
    file: Candidate
    after: Candidate | Skipped | None = None
    sha256: str | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class _Copy(Candidate):
    """A file an earlier job on this node made durable: copied from its object in the store."""

    source: str  # the earlier object's key
    sha256: str


@dataclass(frozen=True)
class _Streamed(Upload):
    """A small file handed to the store's upload stream, open until the stream tells."""

    file: Candidate
    opened: Opened


@dataclass(frozen=True)
class _Killed:
    """A process of the job was killed (``how``) at ``at_ns`` (wall clock)."""

    at_ns: int
    how: str


#: Checkpoints to hold back at once, with why (the agent is ending processes still writing).
_Tears = dict[str, str]
#: Files not durable, and checkpoints left without a commit with why.
_Lost = tuple[list[str], dict[str, str]]


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
        processes: Callable[[], Iterable[int]] = all_processes,
        reaped: Callable[[int], int | None] | None = None,
    ) -> None:
        """``processes`` lists the job's processes; ``reaped(pid)`` says how one the agent
        reaped ended (a writer gone when its file's close is seen may have closed it itself)."""
        self.dir = directory
        self.catalog = catalog
        self.owner = owner
        self.journal = journal
        self.log = log
        self.settings = settings or SidecarSettings()
        self.stats = UploadStats()
        self._state = State()
        self._changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
        self._notices: queue.SimpleQueue[_Killed | _Tears] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[Candidate | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[_Lost] = queue.SimpleQueue()  # the drain's question
        # Small files go to the store's upload stream, where it has one (one thread, many
        # connections), a list per coordinator step; the rest to the worker threads.
        self._stream_in: queue.SimpleQueue[list[_Streamed] | None] = queue.SimpleQueue()
        self._to_stream: list[_Streamed] = []
        self._stream_limit = 0  # set by the stream's thread once the store says it has one
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._draining = False
        self._deadline: Callable[[], float] = time.monotonic  # the drain's, once it begins
        self._drain_began = 0.0
        self._said_left = False
        self._warned: set[str] = set()
        self._surprises: dict[str, int] = {}  # each error of a step no rule reads: how often
        self._earlier: set[str] = set()
        self._last_report = time.monotonic()
        self._last_backlog = 0.0
        self.writers = Writers(directory.root, processes, reaped=reaped)
        self.holds = Holds(log, journal)
        self.commits = Committer(
            self._state,
            directory,
            catalog,
            owner,
            journal,
            self.holds,
            self.writers,
            log,
            self.stats,
            self._changed,
            on_commit,
        )
        self.watcher = Watcher(
            directory.root, self._changes, self.settings.polling, self.writers.closed
        )
        self.space = FullDisk(directory.root, log, self.holds)
        self.leftovers = Leftovers(catalog, owner, log)
        self.placement = Placement(processes, self._placed)
        self._threads: list[threading.Thread] = []

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Pick up what an earlier agent on this checkpoint dir left, then watch."""
        _allow_open_files(QUEUE_FILES * 4)
        self._resume()
        now = time.monotonic()
        earlier = False  # files an earlier agent on this node may have been uploading
        for relative in self.dir.walk():
            found = self.dir.classify(relative)
            if isinstance(found, Candidate):
                self._state.of(relative).files[relative] = found.sig
                earlier = True
            self._mark(relative, now, 0.0, in_place=False)
        if earlier:  # what it left begun, if it was killed, goes before this agent's own
            self.leftovers.abort()
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

    def _resume(self) -> None:
        """What an earlier agent of this job left in the journal: its uploads and commits (as
        far as the store confirms them), and the checkpoints it saw being written in place
        and never saw settle, which may be cut short."""
        state = self._state
        durable, commits = self._what_the_store_holds()
        for relative, (sig, sha256) in durable.items():
            state.stored(state.file(relative), sig, sha256)
            checkpoint = state.of(relative)
            checkpoint.files[relative] = sig
            checkpoint.dirty = True
        for name, signature in commits.items():
            state.checkpoint(name).committed = signature
        for name in sorted(self.journal.writing()):
            self.journal.record_writing(name, False)
            self.commits.tear(name, HALF_WRITTEN)
        for name, (reason, since) in sorted(self.journal.earlier_holds().items()):
            if self.dir.exists(name):
                self.holds.inherit(name, reason, since)

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
        missing = {r for r, (sig, _) in durable.items() if stored.get(r) != sig.size}
        if missing:
            self.log.warning(
                f"checkpoints: {counted(len(missing), 'file')} recorded as uploaded "
                f"{'is' if len(missing) == 1 else 'are'} not in {self.catalog.store.url}: "
                "uploading again"
            )
            self.journal.forget_uploads(missing)
        for checkpoint in set(commits) - names:
            self.journal.record_commit(checkpoint, "")
        kept = {r: entry for r, entry in durable.items() if r not in missing}
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
        self.watcher.flush(min(FLUSH_SECONDS, max(deadline() - started, 0.0)))
        self.watcher.stop()
        self._idle.clear()
        self._changes.put(Change(str(self.dir.root), whole=True, in_place=False))
        self._deadline, self._drain_began = deadline, started
        self._draining = True  # after the rescan is queued: a step that sees it takes it
        self._wake.set()
        while not self._idle.wait(min(max(deadline() - time.monotonic(), 0), 0.5)):
            if time.monotonic() >= deadline():
                break
        self._stop.set()
        self._wake.set()
        try:  # a step stuck on a dead store must not hold the deadline
            left, reasons = self._answers.get(timeout=ANSWER_SECONDS)
        except queue.Empty:
            left, reasons = self._lost_by_the_journal()
        for _ in range(self.settings.workers):
            self._work.put(None)
        self._stream_in.put(None)
        self.stats.lost(left, reasons)
        self.stats.backlog(len(left), 0)
        if left:  # their uploads under way would be abandoned with the process
            self.leftovers.abandon()
        report = DrainReport(left, reasons, time.monotonic() - started)
        self.journal.close()
        self.dir.close()
        self.writers.close()
        return report

    def _what_is_lost(self) -> _Lost:
        """The coordinator's last word: the files not durable as they are, and every
        checkpoint left without a commit, with why."""
        unsaved = self._state.unsaved()
        left = sorted(r for r in unsaved if isinstance(self.dir.classify(r), Candidate))
        return left, self.commits.not_committed(left)

    def _lost_by_the_journal(self) -> _Lost:
        """What is lost, as the journal and the disk tell it, for when the coordinator cannot
        answer (stuck in a step on a dead store): every file not recorded durable as it is,
        and every checkpoint with one of them or without a recorded commit."""
        durable, commits = self.journal.durable(), self.journal.commits()
        reasons: dict[str, str] = {}
        left = []
        for relative in self.dir.walk():
            name = checkpoint_of(relative)
            if not commits.get(name):
                reasons[name] = "no commit of it was recorded by the deadline"
            found = self.dir.classify(relative)
            if isinstance(found, Candidate) and durable.get(relative, (None, ""))[0] != found.sig:
                left.append(relative)
        reasons |= {checkpoint_of(r): "some of its files were not durable in time" for r in left}
        return sorted(left), dict(sorted(reasons.items()))

    # --- what the supervisor tells -------------------------------------------------------------

    def process_killed(self, how: str, at_ns: int | None = None) -> None:
        """A process of the job was killed (``how``: "pid 12 was killed by SIGKILL"): what it
        was writing in place may be cut short. Thread-safe."""
        self._notices.put(_Killed(time.time_ns() if at_ns is None else at_ns, how))
        self._wake.set()

    def open_files(self) -> dict[str, set[int]]:
        """Files of the checkpoint dir open for writing now -> pids. Thread-safe."""
        return self.writers.scan(force=True)

    def before_signals(self) -> None:
        """The agent is about to pass a signal to the job's processes: a file their writers
        have closed is judged whole now, before the signal can end them. Thread-safe."""
        self.writers.before_signals()

    def ending_writers(self, why: str) -> dict[str, set[int]]:
        """The agent is about to end every process of the job (``why``): each checkpoint with a
        file still open for writing is held back. Returns those files. Thread-safe."""
        found = self.open_files()
        self.writers.before_signals()
        tears: _Tears = {}
        for relative, pids in sorted(found.items()):
            if self.dir.relative(str(self.dir.root / relative)) is None:
                continue  # work in progress: never uploaded anyway
            pid = min(pids)
            tears.setdefault(
                checkpoint_of(relative),
                f"{within_checkpoint(relative)} was still open for writing (pid {pid}) {why}",
            )
        if tears:
            self._notices.put(tears)
            self._wake.set()
        return found

    # --- the coordinator ---------------------------------------------------------------------

    def _loop(self) -> None:
        lower_priority(self.settings.nice)
        share_priority(self.catalog.store.engine_threads())
        while not self._stop.is_set():
            now = time.monotonic()
            for step in (self.placement.step, self._step):  # where it runs, then what it does
                try:
                    step(now)
                except Exception as exc:  # never let one surprise end the uploads
                    self._surprised(exc)
            time.sleep(MIN_STEP)
            self._wake.wait(TICK)
            self._wake.clear()
        self._answers.put(self._what_is_lost())

    def _surprised(self, exc: Exception) -> None:
        """An error of a coordinator's step that no rule reads (the next step goes on): said
        with its traceback the first time, for a report; the same one again only at its 10th,
        100th, ... time, counted, so that a step that keeps failing does not fill the log."""
        said = described(exc)
        count = self._surprises[said] = self._surprises.get(said, 0) + 1
        if count == 1:
            self.log.unexpected(f"checkpoint sidecar: {said}", exc)
        elif math.log10(count).is_integer():
            self.log.error(f"checkpoint sidecar: {said} ({count} times)")

    def _step(self, now: float) -> None:
        draining = self._draining  # only a step begun draining has taken the drain's rescan
        self._rearm()
        self._take_changes(now)
        self._take_notices()
        self.space.check(self._being_written)
        self._collect(now)
        self._submit(now)
        self._hand_over()  # whatever way _submit ended: a file counted in flight must go
        if draining:
            self._say_what_is_left(now)
        self.commits.step(now, self.settings.quiet_seconds, self._draining)
        self._report(now)
        if draining and self._finished():
            self._idle.set()

    def _finished(self) -> bool:
        """Nothing left that waiting could still save."""
        state = self._state
        if state.has_work():
            return False
        return all(
            c.name in self.holds or c.blocked or c.open_file
            for c in state.checkpoints.values()
            if c.dirty or c.writing
        )

    def _rearm(self) -> None:
        """The checkpoint dir replaced (removed and made anew): watch the new one, and look at
        all it holds; what the old one held is committed or reported as deleted."""
        if self._draining or not self.watcher.rearm():
            return
        self.dir.close()
        self.log.warning(f"checkpoints: {self.dir.root} was replaced; watching the new one")
        self._changes.put(Change(str(self.dir.root), whole=True, in_place=False))

    def _being_written(self) -> set[str]:
        """Checkpoints written, or with content not yet committed (a committed one looked at
        again, by a rescan, is neither)."""
        state = self._state
        busy = state.busy()
        return {
            c.name
            for c in state.checkpoints.values()
            if c.dirty or c.writing or (c.name in busy and c.committed is None)
        }

    def _mark(
        self,
        relative: str,
        now: float,
        wait: float,
        settled: bool = False,
        in_place: bool = True,
    ) -> None:
        """``relative`` changed: upload it once ``wait`` has passed without another change (a
        settled file's wait replaces the longer one of the writes before its close). A change
        ``in_place`` (a write where the file is) marks its checkpoint as being written."""
        state = self._state
        record = state.file(relative)
        if self._draining and not record.attempts:
            state.wait(relative, now)  # the writers are gone: no quiet period to wait for
        elif settled:
            state.wait(relative, now + wait)
        else:
            state.wait(relative, max(now + wait, record.due or 0.0))
        checkpoint = state.of(relative)
        checkpoint.touched = now
        if in_place:
            checkpoint.renamed_in = False
        if in_place and not checkpoint.writing:
            checkpoint.writing = True
            self.journal.record_writing(checkpoint.name, True)

    def _changed(
        self, relative: str, now: float, settled: bool = False, in_place: bool = False
    ) -> None:
        wait = self.settings.settle_seconds if settled else self.settings.quiet_seconds
        self._mark(relative, now, wait, settled, in_place)

    def _take_changes(self, now: float) -> None:
        writes = False
        while True:
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                break
            path = change.path
            if change.whole:  # a directory that appeared (or the whole dir, at the drain)
                under = self.dir.relative(path) if path != str(self.dir.root) else ""
                if under is None:
                    continue
                for inner in self.dir.walk(under):
                    self._changed(inner, now, change.settled, change.in_place)
                if under and "/" not in under and change.settled and not change.in_place:
                    self._renamed_in(under)
                continue
            relative = self.dir.relative(path)
            if relative is None:
                continue
            if change.writer_ended:
                self.commits.tear(
                    checkpoint_of(relative),
                    f"its writer ended while writing {within_checkpoint(relative)}",
                )
            self._changed(relative, now, change.settled, change.in_place)
            writes = writes or (change.in_place and not change.settled)
        if writes:
            self.writers.scan(now)  # who writes: a file closed by its writer's end is torn

    def _renamed_in(self, name: str) -> None:
        """Checkpoint ``name`` was renamed into place whole (complete when it arrived). One
        already gone again (rotated away at once) is known only by its name: kept, so that it
        is reported rather than forgotten."""
        checkpoint = self._state.checkpoint(name)
        checkpoint.renamed_in = True
        if not checkpoint.files and not self.dir.exists(name):
            checkpoint.dirty = True

    def _take_notices(self) -> None:
        while True:
            try:
                notice = self._notices.get_nowait()
            except queue.Empty:
                return
            torn = self._killed_while_writing(notice) if isinstance(notice, _Killed) else notice
            for name, why in torn.items():
                self.commits.tear(name, why)

    def _killed_while_writing(self, killed: _Killed) -> dict[str, str]:
        """What a process of the job was writing when it was killed: checkpoints written in
        place and not yet settled, and the one written last if that was within
        ``kill_window`` (a pause between two files of one save looks settled), unless it was
        renamed into place whole. One the trainer went on from to write another is not among
        them: that save was over."""
        since = killed.at_ns - int(self.settings.kill_window * 1e9)
        checkpoints = self._state.checkpoints
        recent = {  # one renamed into place whole (HF Trainer's tmp-checkpoint-N) was complete
            name: newest
            for name, newest in self.dir.changed_since(since).items()
            if not (name in checkpoints and checkpoints[name].renamed_in)
        }
        names = {c.name for c in checkpoints.values() if c.writing}
        if recent:
            names.add(max(recent, key=lambda name: recent[name]))
        return {name: f"{killed.how} while it was being written" for name in sorted(names)}

    def _submit(self, now: float) -> None:
        state = self._state
        if not self._room(share=2):
            return  # looking costs time in proportion to the files waiting: not for each upload
        ready = state.due(now)
        while ready and self._room():
            # Only as many as the queue takes, in "newest checkpoint first" order: a full sort
            # per step would cost more than the uploads of many small files.
            room = QUEUE_FILES - state.uploading_count()
            batch = heapq.nsmallest(room, ready, key=self._priority)
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
        uploading = state.uploading_count()
        if uploading < 2 * workers:
            return True
        return (
            uploading < QUEUE_FILES // share
            and state.uploading_bytes < QUEUE_BYTES * workers // share
        )

    def _priority(self, relative: str) -> tuple[int, str]:
        return (-self._state.of(relative).newest, relative)

    def _consider(self, relative: str, now: float) -> None:
        """Upload a due file, unless it is gone, skipped, unchanged or refused for good; copy it
        in the store where an earlier job saved it."""
        state = self._state
        found = self.dir.classify(relative)
        checkpoint = state.of(relative)
        record = state.file(relative)
        if found is None or isinstance(found, Skipped):
            state.unwait(record)
            if isinstance(found, Skipped):
                self._warn_once(relative, f"checkpoints: skipping {relative!r}: {found.reason}")
            elif record.stored is None:  # gone: lost, if its checkpoint went with it
                checkpoint.vanished.add(relative)
                checkpoint.dirty = True
            return
        checkpoint.files[relative] = found.sig
        checkpoint.newest = max(checkpoint.newest, found.sig.mtime_ns)
        if record.unchanged_since_done(found.sig):
            state.unwait(record)  # unchanged since it was uploaded (or refused)
            return
        if self.holds.inherited(checkpoint.name, found.sig.ctime_ns):
            state.unwait(record)  # as an earlier job left it, cut short: not this job's
            return
        earlier = self._saved_by_earlier_job(found) if record.stored is None else None
        if earlier is not None and not checkpoint.adopt:
            state.unwait(record)  # the earlier job's, unless this job adds to it
            return
        checkpoint.dirty = True
        if record.stored is not None and checkpoint.committed is not None:
            # Its manifest would name content about to change.
            self.commits.withdraw(checkpoint, "it changed after its commit; committing it again")
        state.start_upload(record, found.sig.size)
        if checkpoint.round is None:
            checkpoint.round = Round(now)
        if earlier is not None:
            self._work.put(earlier)
        elif self._stream_limit > 0 and found.sig.size <= self._stream_limit:
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

    def _saved_by_earlier_job(self, found: Candidate) -> _Copy | None:
        earlier = self.journal.earlier_owner(found.relative, found.sig)
        if earlier is None:
            return None
        owner, sha256 = earlier
        if owner not in self._earlier:
            self._earlier.add(owner)
            added = (
                "and copied in the store into checkpoints this job adds to"
                if not self.catalog.store.copy_refused
                else "except into checkpoints this job adds to (the store copies nothing)"
            )
            self.log.info(
                f"checkpoints: files in {self.dir.root} were already saved by job {owner} "
                f"(an earlier job on this node): not uploaded again, {added}"
            )
        source = checkpoint_file_key(self.owner.project, owner, self.owner.rank, found.relative)
        return _Copy(found.relative, found.sig, source, sha256)

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
            state.end_upload(relative)
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
        state.stored(state.file(relative), sig, sha256)
        self.stats.uploaded(sig.size)
        checkpoint = state.of(relative)
        checkpoint.dirty = True
        if checkpoint.round is None:
            checkpoint.round = Round(now)
        checkpoint.round.files += 1
        checkpoint.round.bytes += sig.size

    def _failed(self, done: _Done, now: float) -> None:
        state = self._state
        relative = done.file.relative
        if not isinstance(self.dir.classify(relative), Candidate):
            return  # deleted locally meanwhile: nothing left to save
        self.stats.failed()
        record = state.file(relative)
        if isinstance(done.error, KeyRefusedError):  # no retry can help
            record.refused = (done.file.sig, str(done.error))
            self.log.error(
                f"checkpoints: {shown(relative)} is not saved, and not retried: {done.error}"
            )
            return
        record.attempts += 1
        attempt = record.attempts
        delay = random.uniform(0, min(self.settings.retry_cap, 2.0**attempt))
        state.wait(relative, now + delay)
        if attempt == 1 or attempt % 10 == 0:
            self.log.warning(
                f"checkpoints: upload of {relative} failed (attempt {attempt}), "
                f"retrying: {done.error}"
            )

    # --- the workers -------------------------------------------------------------------------

    def _worker(self) -> None:
        lower_priority(self.settings.nice)  # threads it starts (S3 parts) inherit it
        while (file := self._work.get()) is not None:
            self.leftovers.wait()  # an earlier agent's, before this one's own
            if self._stop.is_set():  # the drain has ended: an upload begun now is abandoned
                return
            try:
                done = self._copy(file) if isinstance(file, _Copy) else self._upload(file)
            except Exception as exc:  # an error no rule reads: retried as any failure is
                done = _Done(file, error=RuntimeError(described(exc)))
            self._done.put(done)
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

    def _copy(self, file: _Copy) -> _Done:
        """Copy the earlier job's object; where the store cannot, or it is gone, upload."""
        try:
            self.catalog.store.copy(file.source, self._key(file.relative))
        except (NotImplementedError, NotFoundError):
            return self._upload(Candidate(file.relative, file.sig))
        except BtAgentError as exc:
            return _Done(file, error=exc)
        return _Done(file, self.dir.classify(file.relative), file.sha256)

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
        lower_priority(self.settings.nice)
        store = self.catalog.store
        self._stream_limit = store.batch_max_size()
        if not self._stream_limit:
            return
        try:
            store.upload_stream(self._stream_in.get, self._streamed)
        except Exception as exc:  # files keep going, one per thread
            self._stream_limit = 0
            self.log.error(f"checkpoint sidecar: upload stream stopped: {described(exc)}")
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

    # --- visibility --------------------------------------------------------------------------

    def _backlog(self) -> tuple[set[str], int]:
        """The files waiting or uploading, and their bytes."""
        state = self._state
        waiting = state.waiting() | state.uploading()
        sizes = {r: sig.size for c in state.checkpoints.values() for r, sig in c.files.items()}
        return waiting, sum(sizes.get(r, 0) for r in waiting)

    def _say_what_is_left(self, now: float) -> None:
        """Once, when the drain has gone on for ``SAY_LEFT_AFTER`` with files still to upload:
        why the job goes on after its commands ended, those files (counted now, after the
        drain's rescan, not as the last periodic count had them) and until when at most."""
        if self._said_left or now - self._drain_began < SAY_LEFT_AFTER:
            return
        self._said_left = True  # the rescan is taken: no file joins the backlog after this
        waiting, size = self._backlog()
        if not waiting:
            return
        left = max(self._deadline() - time.monotonic(), 0.0)
        self.log.info(
            f"checkpoints: {counted(len(waiting), 'file')} ({format_bytes(size)}) still to "
            f"upload; the job ends once they are durable (at most {left:,.0f} s)"
        )

    def _report(self, now: float) -> None:
        if now - self._last_backlog < 1.0:
            return
        self._last_backlog = now
        waiting, size = self._backlog()
        uploading = self._state.uploading()
        self.stats.backlog(len(waiting), size)
        if not waiting or now - self._last_report < self.settings.backlog_interval:
            return
        self._last_report = now
        totals = self.stats.totals()
        self.log.info(
            f"checkpoints: {len(waiting)} file(s) waiting to upload, {len(uploading)} "
            f"in flight; {totals.files} uploaded ({format_bytes(totals.bytes)}), "
            f"{totals.failures} failed attempt(s) retried"
        )

    def _placed(self, cpus: set[int], claimed: set[int]) -> None:
        if cpus != self.placement.allowed:
            self.log.info(
                f"checkpoints: the job's busy processes are pinned to CPUs {cpu_list(claimed)}; "
                f"uploads keep to CPUs {cpu_list(cpus)}"
            )
        else:
            self.log.info("checkpoints: uploads may run on every CPU of the agent again")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)


def _allow_open_files(wanted: int) -> None:
    """Raise the soft limit on open files to ``wanted`` where it is lower (and the hard limit
    allows): files queued for the upload stream stay open until sent."""
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < ceiling:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
