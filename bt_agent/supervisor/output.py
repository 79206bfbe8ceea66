"""Copy a child's stdout and stderr to the agent's own, line by line, and to the node log."""

from __future__ import annotations

import threading
from typing import IO, BinaryIO, TextIO

from bt_agent.log import Redact

MAX_LINE = 64 * 1024


class OutputPump:
    """One thread per child stream; each line is redacted, written through and logged."""

    def __init__(self, log_file: IO[str], redact: Redact) -> None:
        self.log_file = log_file
        self.redact = redact
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def attach(self, source: BinaryIO, sink: TextIO) -> None:
        thread = threading.Thread(
            target=self._pump, args=(source, sink), daemon=True, name="bt-agent-output"
        )
        thread.start()
        self._threads.append(thread)

    def _pump(self, source: BinaryIO, sink: TextIO) -> None:
        with source:
            while True:
                chunk = source.readline(MAX_LINE)
                if not chunk:
                    return
                self._write(self.redact(chunk.decode("utf-8", errors="replace")), sink)

    def _write(self, text: str, sink: TextIO) -> None:
        with self._lock:
            sink.write(text)
            sink.flush()
            self.log_file.write(text)
            self.log_file.flush()

    def join(self, timeout: float) -> None:
        """Wait for the streams to close (a leftover grandchild may hold them open)."""
        for thread in self._threads:
            thread.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]
