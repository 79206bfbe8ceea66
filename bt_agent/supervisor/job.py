"""A job on one node, phase by phase: CREATED -> DEPLOYING -> RUNNING -> terminal.

The agent is PID 1 (or a child subreaper): it reaps every process, forwards signals, and on a stop
signal gives the commands the grace period, SIGKILLs whatever is left, and still writes its
records before the platform's own SIGKILL. Every transition is written to the node record as it
happens, with the precise reason for the end; the exit code follows DESIGN.md §5.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from bt_agent.catalog import Catalog
from bt_agent.errors import (
    BtAgentError,
    DurabilityError,
    StagingError,
    StoreError,
    StoreUnusableError,
    TransientStoreError,
    described,
)
from bt_agent.log import AgentLog, NodeLog, counted, format_bytes
from bt_agent.records import CommandResult, JobRecord, JobStatus, NodeRecord, now_iso
from bt_agent.settings import DEFAULT_OUTAGE_SECONDS, STORE_OUTAGE_VARIABLE
from bt_agent.spec.checks import shell_drops
from bt_agent.spec.urls import shown_spec
from bt_agent.storage.retry import retry_for
from bt_agent.supervisor import tree
from bt_agent.supervisor.checkpoints import CheckpointUploads
from bt_agent.supervisor.claim import NodeClaim
from bt_agent.supervisor.code import IGNORE_FILE, copy_code
from bt_agent.supervisor.output import OutputPump
from bt_agent.supervisor.plan import JobPlan, Outcome
from bt_agent.supervisor.process import Child, describe_exit, exit_status, signal_name
from bt_agent.supervisor.reaper import Reaper, become_subreaper
from bt_agent.supervisor.reporter import StoreReporter
from bt_agent.supervisor.signals import FORWARDED, STOPPING, SignalRelay

#: Seconds kept from the grace period for the shutdown steps after the commands are gone.
SHUTDOWN_RESERVE_SECONDS = 2.0
#: How long leftover processes get between SIGTERM and SIGKILL when the job ends normally.
CLEANUP_SECONDS = 2.0
#: Seconds kept from the grace period after the upload drain, to write the records and the log.
RECORDS_RESERVE_SECONDS = 1.0
#: The last records are written until this long before the grace period ends.
RECORDS_MARGIN_SECONDS = 0.3
#: The longest wait, after the records, for the abort of uploads the drain abandoned.
TIDY_SECONDS = 10.0
_RANK_DIR = re.compile(r"rank-\d+")


class StopRequested(Exception):
    """A stop signal arrived during a phase that checks for it (DEPLOYING)."""


class JobRunner:
    def __init__(
        self, plan: JobPlan, catalog: Catalog, out: TextIO | None = None, err: TextIO | None = None
    ) -> None:
        self.plan = plan
        self.catalog = catalog
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.log = AgentLog(self.err, plan.secrets.redact)
        catalog.warn = self.log.warning
        ctx = plan.context
        self.node = NodeRecord(ctx.job_id, ctx.project, ctx.node_rank, os.uname().nodename)
        self.relay = SignalRelay()
        self.reaper = Reaper(self._reaped)
        self.killed_after_grace = False
        self._ending = False  # the agent is ending the job's processes itself
        self._child: Child | None = None
        self._pumps: list[OutputPump] = []
        self._checkpoints = CheckpointUploads(
            plan.spec.job.runtime.checkpointing_config.enabled,
            plan.dirs.checkpoints,
            plan.context,
            plan.environ,
            catalog,
            self.log,
            self._write_node,
            self.reaper.recent_status,
        )
        self._claim = NodeClaim(catalog, plan.context)
        self._record_lock = threading.Lock()
        self._reporter: StoreReporter | None = None
        self._outage_seconds = plan.environ.number(STORE_OUTAGE_VARIABLE, DEFAULT_OUTAGE_SECONDS)

    # --- the phases ------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to a terminal state and return the agent's exit code."""
        if not become_subreaper():
            self.log.warning("cannot become a child subreaper: orphans will not be reaped here")
        with (
            self.relay,
            NodeLog(self.log.stream) as log_file,
        ):
            self.log.copy = log_file
            self._say_what_runs()  # before the store is asked anything: it may be far or down
            try:
                self._before_commands(self._claim.take)
            except InterruptedError:
                return self._stopped_outcome().exit_code
            return self._run_claimed(log_file)

    def _say_what_runs(self) -> None:
        ctx = self.plan.context
        self.log.info(
            f"job {ctx.job_id} (project {ctx.project}), node {ctx.node_rank} of "
            f"{ctx.group_size}, store {ctx.store_url}"
        )
        for warning in ctx.warnings:
            self.log.warning(warning)

    def _before_commands(self, call: Callable[[], object]) -> None:
        """``call()``, an outage of the store waited out, before any command runs: a store that
        cannot be used then fails the job as a deploy does (:class:`StoreUnusableError`)."""
        try:
            self._wait_out_the_store(call)
        except StoreError as exc:
            raise StoreUnusableError(f"{exc}; the job did not start (no command ran)") from exc

    def _run_claimed(self, log_file: NodeLog) -> int:
        with StoreReporter(
            self.catalog.write_node, log_file.path, self._upload_log, self.log
        ) as self._reporter:
            self.relay.forward = self._forward
            try:
                outcome = self._phases(log_file)
            except Exception as exc:  # an error no rule of the agent's reads: a bug, or a library's
                outcome = self._failed_inside(exc)
            self._wait_for_writers()
            self._cleanup()
            unsaved = self._checkpoints.drain(self._drain_deadline)
            if self.relay.stopping and outcome.status is JobStatus.COMPLETED:
                outcome = self._stopped_outcome()  # the stop came while the uploads drained
            outcome = self._with_uploads(outcome, unsaved)
            self._finish(outcome, self._reporter)
        self._checkpoints.tidy(self._records_deadline(time.monotonic() + TIDY_SECONDS))
        return outcome.exit_code

    def _phases(self, log_file: NodeLog) -> Outcome:
        ctx, job = self.plan.context, self.plan.spec.job
        record = JobRecord(
            ctx.job_id,
            ctx.project,
            job.name,
            now_iso(),
            job.compute.node_count,
            {"training_job": shown_spec(self.plan.spec.wire)},
        )
        try:
            self._before_commands(lambda: self.catalog.create_job(record))
        except InterruptedError:
            return self._stopped_outcome()
        self._enter(JobStatus.CREATED)
        self._enter(JobStatus.DEPLOYING)
        try:
            self._deploy()
        except StagingError as exc:
            return Outcome(JobStatus.DEPLOY_FAILED, exc.exit_code, str(exc))
        except StopRequested:
            return self._stopped_outcome()
        if self.relay.stopping:
            return self._stopped_outcome()
        self._enter(JobStatus.RUNNING)
        return self._run_commands(log_file)

    def _failed_inside(self, exc: Exception) -> Outcome:
        """The end of a job where the agent itself failed, with an error it has no rule for (a
        bug of its own, or a library's error it does not know): said with its traceback in the
        log, the commands (where they run) given the grace period after a SIGTERM, as a stop
        gives it; then the job ends as any failure does, its leftover processes ended, its
        checkpoint files drained, its terminal state recorded. Never a crash that leaves the
        node record DEPLOYING or RUNNING and the uploads undone."""
        said = self.log.redact(described(exc))
        self.log.unexpected(
            f"the agent failed with an error it has no rule for ({said}); the job ends as a "
            "failure does",
            exc,
        )
        if self.node.status is not JobStatus.RUNNING:
            return Outcome(
                JobStatus.DEPLOY_FAILED, StagingError.exit_code, f"the agent failed: {said}"
            )
        if self._child is not None:
            self._forward(signal.SIGTERM)
            deadline = time.monotonic() + self.plan.context.grace_period
            # a stop signal that comes meanwhile brings its own deadline, which may be sooner
            while tree.living(tree.descendants()) and time.monotonic() < min(
                deadline, self._kill_deadline()
            ):
                self.reaper.reap()
                self.relay.wait(0.1)
        return Outcome(JobStatus.FAILED, BtAgentError.exit_code, f"the agent failed: {said}")

    def _enter(self, status: JobStatus) -> None:
        self.node.transition(status)
        self._write_node()

    def _write_node(self) -> None:
        """Have the node record written (from the main thread, and from the sidecar on each
        commit); the store's being unreachable delays the write, never the job."""
        with self._record_lock:
            self.node.uploads = self._checkpoints.totals()
            snapshot = copy.deepcopy(self.node)
        if self._reporter is not None:
            self._reporter.publish(snapshot)

    def _wait_out_the_store(self, call: Callable[[], object]) -> None:
        """``call()`` until it gets through, waiting out an unreachable store (a stop signal
        ends the wait with :class:`InterruptedError`)."""
        retry_for(
            call,
            self._outage_seconds,
            lambda: self.relay.stopping,
            self._store_unreachable,
            on_back=self._store_back,
        )

    def _store_unreachable(self, exc: TransientStoreError, left: float) -> None:
        self.log.warning(f"the store is unreachable ({exc}); retrying for up to {left:.0f} s")

    def _store_back(self, waited: float) -> None:
        self.log.info(f"the store is reachable again after {waited:.0f} s")

    def _finish(self, outcome: Outcome, reporter: StoreReporter) -> None:
        """Record the end. The log is complete in the store before the terminal status is, so
        whoever sees the status (``jobs logs --follow``) can read the whole log."""
        self.node.exit_code = outcome.exit_code
        self.node.error = outcome.reason
        self._clear_scratch()
        summary = (
            f"job {self.plan.context.job_id} {outcome.status.short} (exit {outcome.exit_code})"
        )
        self.log.info(summary + (f": {outcome.reason}" if outcome.reason else ""))
        self._enter(outcome.status)
        patience = time.monotonic() + self._outage_seconds
        if reporter.flush(lambda: self._records_deadline(patience)):
            self._claim.release()  # the store is there: no wait on it past the deadline
            return
        if self._records_deadline(patience) < patience:  # a stop's grace period ended first
            why = f"before the {self.plan.context.grace_period:g} s grace period ended"
        else:
            why = f"while the store stayed unreachable ({self._outage_seconds:g} s)"
        self.log.error(
            f"the node record ({outcome.status.short}) and log could not be saved {why}; "
            "the exit code is the job's"
        )

    # --- DEPLOYING -------------------------------------------------------------------------

    def _deploy(self) -> None:
        dirs = self.plan.dirs
        try:
            for path in dirs.all():
                path.mkdir(parents=True, exist_ok=True)
            self._copy_code(dirs.working)
        except OSError as exc:
            raise StagingError(
                f"cannot prepare {exc.filename or 'the job directories'}: {exc.strerror or exc}"
            ) from exc
        self._stage_weights()
        self._load_checkpoints()
        self._checkpoints.start()

    def _load_checkpoints(self) -> None:
        # What an earlier job on this node root loaded must not pass for this job's checkpoints
        # (in a container the load dir starts empty; on a reused --node-root it would not).
        # Only what the loader makes goes: the dir may be one the image also uses.
        if _empty(self.plan.dirs.loaded_checkpoints, _is_rank_dir):
            self.log.info("removed what an earlier job had loaded into $BT_LOAD_CHECKPOINT_DIR")
        references = self.plan.spec.job.runtime.checkpoints_to_load
        if not references:
            return
        from bt_agent.staging.checkpoints import CheckpointLoader

        loader = CheckpointLoader(
            self.catalog,
            self.plan.context,
            self.plan.dirs.loaded_checkpoints,
            self.log,
            lambda: self.relay.stopping,
            self.plan.environ.number(STORE_OUTAGE_VARIABLE, DEFAULT_OUTAGE_SECONDS),
        )
        try:
            loader.load(references)
        except InterruptedError:
            raise StopRequested from None

    def _stage_weights(self) -> None:
        if not self.plan.spec.job.weights:
            return
        from bt_agent.staging.weights import stage_job_weights

        try:
            stage_job_weights(
                self.plan.spec.job,
                self.plan.context,
                self.plan.environ,
                self.plan.secrets,
                self.log,
                lambda: self.relay.stopping,
            )
        except InterruptedError:
            raise StopRequested from None

    def _copy_code(self, working: Path) -> None:
        """Put the user's code in the working dir, as the platform extracts it there."""
        code = self.plan.code_dir
        if code is None or not self.plan.spec.job.enable_baseten_workdir:
            return
        if code.resolve() == working.resolve():
            return
        ctx = self.plan.context
        skip = [working, ctx.secrets_dir, *([ctx.layout.node_root] if ctx.layout.node_root else [])]
        if ctx.store_url.startswith("file://"):
            skip.append(Path(ctx.store_url.removeprefix("file://")))
        try:
            copied = copy_code(code, working, skip, lambda: self.relay.stopping)
        except InterruptedError:
            raise StopRequested from None
        if copied.special:
            first = copied.special[0]
            self.log.warning(
                f"code: left out {counted(len(copied.special), 'special file')} (named pipes, "
                f"sockets, devices), {first} among them"
            )
        ignored = f" ({counted(copied.ignored, 'path')} left out by {IGNORE_FILE})"
        self.log.info(
            f"code: copied {counted(copied.files, 'file')}, {format_bytes(copied.bytes)} from "
            f"{code} into the working dir{ignored if copied.ignored else ''}"
        )

    # --- RUNNING ---------------------------------------------------------------------------

    def _run_commands(self, log_file: NodeLog) -> Outcome:
        commands = self.plan.spec.job.runtime.start_commands
        if not commands:
            self.log.warning("runtime.start_commands is empty: nothing to run")
        for warning in shell_drops(self.plan.spec.job):
            self.log.warning(warning)
        for index, command in enumerate(commands):
            started = now_iso()
            self.log.info(f"start_commands[{index}]: {command}")
            status = self._run_one(index, command, log_file)
            self.node.commands.append(CommandResult(index, command, status, started, now_iso()))
            if self.relay.stopping:
                return self._stopped_outcome()
            if status != 0:
                what = f"start_commands[{index}] {command!r} {describe_exit(status)}"
                return Outcome(JobStatus.FAILED, status, what)
        return Outcome(JobStatus.COMPLETED, 0)

    def _run_one(self, index: int, command: str, log_file: NodeLog) -> int:
        self.relay.deliver()  # what came before has gone to whom it could reach
        stopped_before = self.relay.stop_signal  # what comes after goes to the command
        try:
            child = Child.spawn(command, self.plan.env.values, self.plan.dirs.working)
        except OSError as exc:
            self.log.error(f"cannot start /bin/sh: {exc.strerror}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        self.reaper.watch(child.pid)
        self._child = child
        pump = OutputPump(log_file, self.plan.secrets.redact)
        assert child.process.stdout is not None and child.process.stderr is not None
        pump.attach(child.process.stdout, self.out)  # type: ignore[arg-type]
        pump.attach(child.process.stderr, self.err)  # type: ignore[arg-type]
        self._pumps.append(pump)
        if stopped_before is not None:  # a stop arrived while it was starting
            self._forward(stopped_before)
        code = self._wait_for(child)
        self._child = None
        status = exit_status(code)
        if code > 128 and self._violent(code - 128):  # the shell tells a child's death so
            self._checkpoints.process_killed(f"start_commands[{index}] {describe_exit(status)}")
        return status

    def _reaped(self, pid: int, returncode: int) -> None:
        """A process of the job ended: one killed may have cut short what it was writing."""
        if returncode < 0 and self._violent(-returncode):
            self._checkpoints.process_killed(
                f"a process of the job (pid {pid}) was killed by {signal_name(-returncode)}"
            )

    def _violent(self, number: int) -> bool:
        """Whether death by signal ``number`` is one nobody in the job asked for: not SIGPIPE
        (a pipeline's reader said it was done), nor a stop signal the agent forwarded (a
        trainer that dies of it while writing is caught by its open files instead), nor the
        agent's own ending of processes (it looks at their open files first)."""
        if number == signal.SIGPIPE or self._ending:  # what the agent ends, it looked at
            return False
        return not (self.relay.stopping and number in FORWARDED)

    def _wait_for(self, child: Child) -> int:
        """Wait for the command's main process, reaping every child meanwhile."""
        while True:
            self.reaper.reap()
            code = self.reaper.status_of(child.pid)
            if code is not None:
                child.process.returncode = code  # so Popen never waits on a reused pid
                break
            self._enforce_deadline()
            self.relay.wait(min(self._kill_deadline() - time.monotonic(), 1.0))
        if self.relay.stopping:
            self._wait_for_every_process()
        return code

    def _wait_for_every_process(self) -> None:
        """After a stop, the grace period is for every process, not only the command's main
        one: a wrapper shell may die at once while the program it started saves its state."""
        give_up = self._kill_deadline() + SHUTDOWN_RESERVE_SECONDS / 2
        while tree.living(tree.descendants()) and time.monotonic() < give_up:
            self._enforce_deadline()
            self.reaper.reap()
            self.relay.wait(min(self._kill_deadline() - time.monotonic(), 0.05))
        self.reaper.reap()

    def _enforce_deadline(self) -> None:
        if time.monotonic() >= self._kill_deadline() and not self.killed_after_grace:
            self._kill_everything()

    def _kill_deadline(self) -> float:
        if self.relay.stop_time is None:
            return float("inf")
        budget = max(self.plan.context.grace_period - SHUTDOWN_RESERVE_SECONDS, 0.5)
        return self.relay.stop_time + budget

    @staticmethod
    def _with_uploads(outcome: Outcome, unsaved: str | None) -> Outcome:
        """Exit 4 when the commands succeeded but checkpoint files could not be saved."""
        if unsaved is None:
            return outcome
        if outcome.status is JobStatus.COMPLETED:
            return Outcome(JobStatus.FAILED, DurabilityError.exit_code, unsaved)
        reason = f"{outcome.reason}; {unsaved}" if outcome.reason else unsaved
        return Outcome(outcome.status, outcome.exit_code, reason)

    def _drain_deadline(self) -> float:
        """Until when checkpoint uploads may go on: the grace period (less the time to write
        the records) after a stop signal, else the sidecar's own drain limit."""
        if self.relay.stop_time is not None:
            grace = self.plan.context.grace_period
            return self.relay.stop_time + max(grace - RECORDS_RESERVE_SECONDS, 0.5)
        return self._checkpoints.default_deadline()

    def _records_deadline(self, patience: float) -> float:
        """Until when the last record and log may be written: ``patience`` (as long as an
        outage of the store is waited out), or the end of the grace period after a stop."""
        if self.relay.stop_time is None:
            return patience
        grace_end = self.relay.stop_time + self.plan.context.grace_period
        return min(patience, grace_end - RECORDS_MARGIN_SECONDS)

    def _kill_everything(self) -> None:
        self.killed_after_grace = True
        self._ending = True
        grace = self.plan.context.grace_period
        self.log.warning(
            f"processes still running at the end of the {grace:g} s grace period: sending SIGKILL"
        )
        self._checkpoints.ending_writers(f"when the {grace:g} s grace period ended")
        if self._child is not None:
            self._child.signal_group(signal.SIGKILL)
        tree.signal_all(tree.descendants(), signal.SIGKILL)

    def _forward(self, number: int) -> None:
        """Pass a signal on: to the command's process group, and for a stop signal to every
        descendant too (torchrun's workers live in sessions of their own). What they had
        closed before it is told to the sidecar first: a writer the signal ends after it
        closed its file is not mistaken for one that ended while writing."""
        self._checkpoints.before_signals()
        child = self._child
        if child is not None:
            child.signal_group(number)
        if number in STOPPING:
            tree.signal_all(tree.descendants(), number)

    def _stopped_outcome(self) -> Outcome:
        number = self.relay.stop_signal or signal.SIGTERM
        name = signal_name(number)
        if self.killed_after_grace:
            reason = (
                f"killed by SIGKILL after the {self.plan.context.grace_period:g} s grace "
                f"period (stopped by {name})"
            )
        elif not self.node.commands:  # while the agent claimed, staged or loaded
            reason = f"stopped by {name} before any command ran"
        else:
            elapsed = time.monotonic() - (self.relay.stop_time or time.monotonic())
            reason = f"stopped by {name} (the commands ended {elapsed:.1f} s after it)"
        return Outcome(JobStatus.STOPPED, 128 + number, reason)

    # --- shutdown --------------------------------------------------------------------------

    def _wait_for_writers(self) -> None:
        """Processes the commands left behind that still write checkpoint files get the grace
        period to finish before they are ended (what is ended while writing is not
        committed)."""
        if self.relay.stopping or not (writing := self._checkpoints.open_files()):
            return
        grace = self.plan.context.grace_period
        first = min(writing)
        self.log.info(
            f"the commands have ended; waiting up to {grace:g} s for "
            f"{counted(len(writing), 'checkpoint file')} still being written ({first}, "
            f"pid {min(writing[first])})"
        )
        deadline = time.monotonic() + grace
        while writing and time.monotonic() < deadline and not self.relay.stopping:
            self.reaper.reap()
            self.relay.wait(0.1)
            writing = self._checkpoints.open_files()

    def _cleanup(self) -> None:
        """End whatever the commands left behind, reap it, and drain their output."""
        self._checkpoints.ending_writers("when the agent ended the processes left behind")
        self._ending = True
        if self.relay.stop_time is not None:
            left = self._kill_deadline() + SHUTDOWN_RESERVE_SECONDS / 2 - time.monotonic()
            budget = min(CLEANUP_SECONDS, max(left, 0.1))
        else:
            budget = CLEANUP_SECONDS
        ended = tree.terminate_descendants(budget, self.reaper.reap)
        if ended.killed:
            self.log.warning(f"killed {len(ended.killed)} leftover process(es) with SIGKILL")
        elif ended.terminated:
            self.log.info(f"ended {counted(ended.terminated, 'leftover process', 'es')}")
        self.reaper.reap()
        for pump in self._pumps:
            pump.join(1.0)

    def _clear_scratch(self) -> None:
        _empty(self.plan.dirs.scratch)

    def _upload_log(self, path: Path) -> None:
        ctx = self.plan.context
        self.catalog.upload_log(ctx.project, ctx.job_id, ctx.node_rank, path)


def _is_rank_dir(name: str) -> bool:
    return _RANK_DIR.fullmatch(name) is not None


def _empty(directory: Path, only: Callable[[str], bool] = lambda name: True) -> bool:
    """Remove everything inside ``directory`` (kept itself) whose name passes ``only``; True
    if there was anything."""
    if not directory.is_dir():
        return False
    found = False
    for entry in directory.iterdir():
        if not only(entry.name):
            continue
        found = True
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return found
