"""The agent's own log lines: ``bt-agent: ...`` on stderr, secrets masked, copied to the node log.

Child output does not pass through here (see ``supervisor.output``); this is for what the agent
itself says about the job.
"""

from __future__ import annotations

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
            self.stream.write(line)
            self.stream.flush()
            if self.copy is not None:
                self.copy.write(line)
                self.copy.flush()

    def info(self, message: str) -> None:
        self._emit("", message)

    def warning(self, message: str) -> None:
        self._emit("warning: ", message)

    def error(self, message: str) -> None:
        self._emit("error: ", message)
