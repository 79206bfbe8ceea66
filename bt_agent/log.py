"""The agent's own log lines: ``bt-agent: ...`` on stderr, secrets masked, copied to the node log.

Child output does not pass through here (see ``supervisor.output``); this is for what the agent
itself says about the job.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

Redact = Callable[[str], str]


class AgentLog:
    """Thread-safe writer of the agent's messages to a stream and an optional copy."""

    def __init__(self, stream: TextIO | None = None, redact: Redact = lambda text: text) -> None:
        self.stream = stream or sys.stderr
        self.redact = redact
        self.copy: NodeLog | None = None
        self._lock = threading.Lock()

    def _emit(self, level: str, message: str) -> None:
        line = self.redact(f"bt-agent: {level}{message}") + "\n"
        with self._lock:
            write_through(self.stream, line)
            if self.copy is not None:
                self.copy.write(line)

    def info(self, message: str) -> None:
        self._emit("", message)

    def warning(self, message: str) -> None:
        self._emit("warning: ", message)

    def error(self, message: str) -> None:
        self._emit("error: ", message)

    def unexpected(self, message: str, exc: BaseException) -> None:
        """``message`` about ``exc``, an error no rule of the agent's reads, with its traceback
        (for a report: it is a bug of the agent's, or a library's error it does not know)."""
        trace = "".join(traceback.format_exception(exc)).rstrip()
        self._emit("error: ", f"{message}; its traceback, to report:\n{trace}")


class NodeLog:
    """The node's log on disk, a temporary file the store gets copies of: the agent's messages
    and the commands' output, each written through as it comes. Where the disk refuses a write
    (full, over a quota or the file size limit), the log ends there, said once on ``stream``,
    and nothing else fails: the commands' output still reaches the agent's stdout and stderr
    (a reader of their pipes that stopped would stop them), the job goes on, and what the file
    holds is still saved."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        fd, name = tempfile.mkstemp(prefix="bt-agent-", suffix=".log")
        self.path = Path(name)
        self._fd = fd  # unbuffered: nothing left to write when a write is refused, or at close
        self.refused: OSError | None = None

    def __enter__(self) -> NodeLog:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    def write(self, text: str) -> None:
        if self.refused is not None:
            return
        data = memoryview(text.encode("utf-8", "replace"))
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            self.refused = exc
            write_through(
                self.stream,
                f"bt-agent: error: the node log cannot be written ({exc.strerror or exc}): it "
                "ends here; the commands' output goes on to stdout and stderr only\n",
            )


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
