"""Ship the node's log file to the store every few seconds while the job runs, and at the end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

FLUSH_SECONDS = 3.0


class LogShipper:
    """A background thread that calls ``upload(path)`` whenever the file has grown."""

    def __init__(
        self, path: Path, upload: Callable[[Path], None], interval: float = FLUSH_SECONDS
    ) -> None:
        self.path = path
        self.upload = upload
        self.interval = interval
        self._stop = threading.Event()
        self._shipped = -1
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bt-agent-logs")

    def __enter__(self) -> LogShipper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ship()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.ship()

    def ship(self) -> None:
        with self._lock:
            size = self.path.stat().st_size
            if size != self._shipped:
                self.upload(self.path)
                self._shipped = size
