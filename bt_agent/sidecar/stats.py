"""The sidecar's running totals: what the node record, the log and the metrics endpoint show."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from bt_agent.records import UploadTotals


@dataclass
class _Counts:
    files: int = 0
    bytes: int = 0
    commits: int = 0
    failures: int = 0
    backlog_files: int = 0
    backlog_bytes: int = 0
    last_committed: str | None = None
    last_commit_time: float | None = None
    not_durable: list[str] = field(default_factory=list)
    not_committed: dict[str, str] = field(default_factory=dict)


class UploadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = _Counts()

    def uploaded(self, size: int) -> None:
        """A file durable: counted, and out of the backlog counted last (which the next count
        sets right, should it not have held the file)."""
        with self._lock:
            counts = self._counts
            counts.files += 1
            counts.bytes += size
            counts.backlog_files = max(counts.backlog_files - 1, 0)
            counts.backlog_bytes = max(counts.backlog_bytes - size, 0)

    def failed(self) -> None:
        with self._lock:
            self._counts.failures += 1

    def committed(self, checkpoint: str, at: float) -> None:
        with self._lock:
            self._counts.commits += 1
            self._counts.last_committed = checkpoint
            self._counts.last_commit_time = at

    def backlog(self, files: int, size: int) -> None:
        with self._lock:
            self._counts.backlog_files = files
            self._counts.backlog_bytes = size

    def lost(self, paths: list[str], checkpoints: dict[str, str]) -> None:
        """At the end: the files not saved, and the checkpoints not committed with why."""
        with self._lock:
            self._counts.not_durable = sorted(paths)
            self._counts.not_committed = dict(checkpoints)

    def totals(self) -> UploadTotals:
        with self._lock:
            c = replace(self._counts)
        return UploadTotals(
            files=c.files,
            bytes=c.bytes,
            commits=c.commits,
            failures=c.failures,
            backlog_files=c.backlog_files,
            backlog_bytes=c.backlog_bytes,
            last_committed=c.last_committed,
            not_durable=list(c.not_durable),
            not_committed=dict(c.not_committed),
        )

    def prometheus(self) -> str:
        """The totals in Prometheus' text exposition format."""
        with self._lock:
            c = replace(self._counts)
        metrics = [
            ("uploaded_files_total", "counter", "Checkpoint files made durable", c.files),
            ("uploaded_bytes_total", "counter", "Checkpoint bytes made durable", c.bytes),
            ("commits_total", "counter", "Checkpoint manifests written", c.commits),
            ("upload_failures_total", "counter", "Upload attempts that failed", c.failures),
            ("backlog_files", "gauge", "Files waiting to be uploaded", c.backlog_files),
            ("backlog_bytes", "gauge", "Bytes waiting to be uploaded", c.backlog_bytes),
            (
                "last_commit_timestamp_seconds",
                "gauge",
                "When the last checkpoint was committed (Unix time)",
                c.last_commit_time or 0,
            ),
        ]
        lines = []
        for name, kind, text, value in metrics:
            full = f"bt_agent_checkpoint_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}", f"{full} {value}"]
        return "\n".join(lines) + "\n"
