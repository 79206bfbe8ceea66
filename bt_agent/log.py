"""The agent's own log lines: ``bt-agent: ...`` on stderr, secrets masked, copied to the node log.

Child output does not pass through here (see ``supervisor.output``); this is for what the agent
itself says about the job.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import IO, TextIO

Redact = Callable[[str], str]


class AgentLog:
    """Thread-safe writer of the agent's messages to a stream and an optional copy."""

    def __init__(self, stream: TextIO | None = None, redact: Redact = lambda text: text) -> None:
        self.stream = stream or sys.stderr
        self.redact = redact
        self.copy: IO[str] | None = None
        self._lock = threading.Lock()

    def _emit(self, level: str, message: str) -> None:
        line = self.redact(f"bt-agent: {level}{message}") + "\n"
        with self._lock:
            write_through(self.stream, line)
            if self.copy is not None:
                self.copy.write(line)
                self.copy.flush()

    def info(self, message: str) -> None:
        self._emit("", message)

    def warning(self, message: str) -> None:
        self._emit("warning: ", message)

    def error(self, message: str) -> None:
        self._emit("error: ", message)


def write_through(stream: TextIO, text: str) -> None:
    """``text`` written to ``stream`` and flushed; where no one reads it any more (a closed
    pipe: ``bt-agent run ... | head``, a log collector gone), the stream's descriptor is pointed
    at /dev/null instead, so that the job goes on (its output is in the node log all the same)
    and no later write fails, the interpreter's last flush among them."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


def format_bytes(size: float) -> str:
    """``512 B``, ``6.7 KB``, ``2.1 GB`` (decimal units, like transfer rates)."""
    if size < 1000:
        return f"{size:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1000
        if size < 1000 or unit == "TB":
            break
    return f"{size:,.1f} {unit}"


def shown(name: str) -> str:
    """A file's ``name`` as a log line can show it: as it is, or quoted with its control
    characters escaped (``'nl\\nx.bin'``) where it holds any, which would break the line."""
    return repr(name) if any(ord(c) < 32 or ord(c) == 127 for c in name) else name


def counted(count: int, noun: str, plural: str = "s") -> str:
    """``1 file``, ``3 files``; ``counted(2, "process", "es")`` is ``2 processes``."""
    return f"{count} {noun}{plural * (count != 1)}"
