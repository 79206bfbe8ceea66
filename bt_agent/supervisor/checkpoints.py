"""The supervisor's side of the checkpoint sidecar: start it before the commands, drain it after
them within the deadline, and turn what could not be saved into the job's outcome (exit 4 when
the commands had succeeded, DESIGN.md §5)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bt_agent.catalog import Catalog
from bt_agent.context import NodeContext
from bt_agent.errors import StagingError
from bt_agent.log import AgentLog, format_bytes
from bt_agent.records import UploadTotals
from bt_agent.settings import METRICS_PORT_VARIABLE, Environ
from bt_agent.supervisor import tree

if TYPE_CHECKING:
    from bt_agent.sidecar import Sidecar, SidecarSettings
    from bt_agent.sidecar.metrics import MetricsServer


class CheckpointUploads:
    """The checkpoint sidecar as a job's phases see it: started before the commands, told of
    the processes that end, drained at the end. ``enabled``: the spec's
    ``checkpointing_config.enabled``; ``directory``: the checkpoint dir on this node."""

    def __init__(
        self,
        enabled: bool,
        directory: Path,
        context: NodeContext,
        environ: Environ,
        catalog: Catalog,
        log: AgentLog,
        on_commit: Callable[[], None],
        reaped: Callable[[int], int | None] | None = None,
    ) -> None:
        self.enabled = enabled
        self.directory = directory
        self.context = context
        self.environ = environ
        self.reaped = reaped
        self.catalog = catalog
        self.log = log
        self.on_commit = on_commit
        self.sidecar: Sidecar | None = None
        self._metrics: MetricsServer | None = None
        self._settings: SidecarSettings | None = None

    def totals(self) -> UploadTotals | None:
        return self.sidecar.stats.totals() if self.sidecar is not None else None

    def start(self) -> None:
        """Watch the checkpoint dir (when checkpointing is enabled) before any command runs."""
        if not self.enabled:
            return
        from bt_agent.memory import return_large_buffers
        from bt_agent.sidecar import Sidecar, SidecarSettings
        from bt_agent.sidecar.files import CheckpointDir
        from bt_agent.sidecar.journal import JOURNAL_CONTAINER_PATH, Journal
        from bt_agent.sidecar.uploader import Owner

        ctx = self.context
        self._settings = SidecarSettings.from_environ(self.environ)
        return_large_buffers()
        try:
            journal = Journal(
                ctx.layout.host(JOURNAL_CONTAINER_PATH),
                self.catalog.store.url,
                ctx.job_id,
                ctx.node_rank,
            )
            sidecar = Sidecar(
                CheckpointDir(self.directory),
                self.catalog,
                Owner(ctx.project, ctx.job_id, ctx.node_rank),
                journal,
                self.log,
                self._settings,
                self.on_commit,
                tree.descendants,
                self.reaped,
            )
            sidecar.start()
        except Exception as exc:  # OSError, ImportError, sqlite3.Error: the same for the user
            raise StagingError(f"cannot start the checkpoint uploads: {exc}") from exc
        self.sidecar = sidecar
        self._serve_metrics(sidecar)

    def _serve_metrics(self, sidecar: Sidecar) -> None:
        port = self.environ.get(METRICS_PORT_VARIABLE)
        if port is None:
            return
        from bt_agent.sidecar.metrics import MetricsServer

        try:
            metrics = MetricsServer(int(port), sidecar.stats.prometheus).start()
        except (OSError, ValueError) as exc:
            self.log.warning(f"cannot serve metrics on port {port}: {exc}")
            return
        self._metrics = metrics
        self.log.info(f"checkpoint metrics on http://0.0.0.0:{metrics.port}/metrics")

    def open_files(self) -> dict[str, set[int]]:
        """Checkpoint files open for writing now -> pids (none when checkpointing is off)."""
        return self.sidecar.open_files() if self.sidecar is not None else {}

    def before_signals(self) -> None:
        """The agent is about to signal the job's processes: what they closed is whole."""
        if self.sidecar is not None:
            self.sidecar.before_signals()

    def ending_writers(self, why: str) -> None:
        """The agent is about to end the job's processes: what they still write is torn."""
        if self.sidecar is not None:
            self.sidecar.ending_writers(why)

    def process_killed(self, how: str) -> None:
        if self.sidecar is not None:
            self.sidecar.process_killed(how)

    def default_deadline(self) -> float:
        seconds = self._settings.drain_seconds if self._settings is not None else 0.0
        return time.monotonic() + seconds

    def drain(self, deadline: Callable[[], float]) -> str | None:
        """Make what remains durable; return what could not be, or None."""
        sidecar = self.sidecar
        if sidecar is None:
            self._warn_unsaved()
            return None
        limit = deadline()  # fixed now, unless a stop signal brings it closer
        report = sidecar.drain(lambda: min(limit, deadline()))
        if self._metrics is not None:
            with contextlib.suppress(OSError):
                self._metrics.close()
        totals = sidecar.stats.totals()
        if report.complete:
            self.log.info(
                f"checkpoints: every file durable ({totals.files} uploaded, "
                f"{format_bytes(totals.bytes)}; {totals.commits} commit(s))"
            )
            return None
        what = report.describe()
        self.log.error(f"checkpoints: {what}")
        return what

    def tidy(self, until: float) -> None:
        """Wait, until ``until`` (``time.monotonic()``) at most, for the abort of the uploads
        that the drain abandoned (:mod:`bt_agent.sidecar.leftovers`)."""
        if self.sidecar is not None:
            self.sidecar.leftovers.wait(until)

    def _warn_unsaved(self) -> None:
        if self.enabled:
            return
        directory = self.directory
        with contextlib.suppress(OSError):
            if directory.is_dir() and any(directory.iterdir()):
                self.log.warning(
                    f"{directory} holds files, but checkpointing_config.enabled is false: "
                    "they were not uploaded"
                )
