"""Copy a child's stdout and stderr to the agent's own, line by line, and to the node log.

A line ends at ``\n`` or at ``\r``: a progress bar (tqdm's, the Hugging Face Trainer's) redraws
itself with ``\r`` alone, and would otherwise show nothing until the bar is done, hours later.
"""

from __future__ import annotations

import codecs
import threading
from typing import BinaryIO, TextIO

from bt_agent.log import NodeLog, write_through
from bt_agent.secrets import Redactor

MAX_LINE = 64 * 1024


class OutputPump:
    """One thread per child stream; each line is redacted, written through and logged."""

    def __init__(self, log_file: NodeLog, redact: Redactor) -> None:
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
        """What the child writes, as it comes, up to its last line end (``\n`` or ``\r``);
        the rest waits for its end. A line longer than MAX_LINE comes in pieces, and the end
        of each piece that a secret value could start in waits for the next one, so that no
        value passes unmasked across the cut (nor a character's bytes, decoded across it)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""  # after the last line end: not yet written
        read = getattr(source, "read1", source.read)  # what is there, not a full buffer
        with source:
            while True:
                chunk = read(MAX_LINE)
                text = self.redact(pending + decoder.decode(chunk, final=not chunk))
                end = max(text.rfind("\n"), text.rfind("\r")) + 1 if chunk else len(text)
                if not end and len(text) >= MAX_LINE:
                    end = max(len(text) - max(self.redact.longest - 1, 0), 0)
                text, pending = text[:end], text[end:]
                if text:
                    self._write(text, sink)
                if not chunk:
                    return

    def _write(self, text: str, sink: TextIO) -> None:
        with self._lock:
            write_through(sink, text)
            self.log_file.write(text)

    def join(self, timeout: float) -> None:
        """Wait for the streams to close (a leftover grandchild may hold them open)."""
        for thread in self._threads:
            thread.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]
