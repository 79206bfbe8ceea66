"""Copy a child's stdout and stderr to the agent's own, line by line, and to the node log."""

from __future__ import annotations

import codecs
import threading
from typing import IO, BinaryIO, TextIO

from bt_agent.secrets import Redactor

MAX_LINE = 64 * 1024


class OutputPump:
    """One thread per child stream; each line is redacted, written through and logged."""

    def __init__(self, log_file: IO[str], redact: Redactor) -> None:
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
        """Lines of up to MAX_LINE bytes; a longer line comes in pieces, and the end of each
        piece that a secret value could start in waits for the next one, so that no value
        passes unmasked across the cut (nor a character's bytes, decoded across it)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        held = ""
        with source:
            while True:
                chunk = source.readline(MAX_LINE)
                text = self.redact(held + decoder.decode(chunk, final=not chunk))
                held = ""
                if chunk and not text.endswith("\n"):
                    cut = max(len(text) - max(self.redact.longest - 1, 0), 0)
                    text, held = text[:cut], text[cut:]
                if text:
                    self._write(text, sink)
                if not chunk:
                    return

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
