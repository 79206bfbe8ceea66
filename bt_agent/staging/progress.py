"""Progress of a long transfer: a line every few seconds with bytes, rate and ETA (container
logs), or one line redrawn in place on a terminal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TextIO

from bt_agent.log import AgentLog

INTERVAL_SECONDS = 5.0


class Progress:
    """Counts bytes as they are added (:meth:`add`, from any thread) and, between ``with`` and
    its end, reports them every ``interval`` seconds; ``clock`` is what rates are timed by."""

    def __init__(
        self,
        what: str,
        total: int,
        log: AgentLog,
        stream: TextIO | None = None,
        interval: float = INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = total
        self.log = log
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.done = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = clock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bt-progress")

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self._tty:
            assert self.stream is not None
            self.stream.write("\n")

    @property
    def _tty(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def add(self, size: int) -> None:
        with self._lock:
            self.done += size

    def line(self) -> str:
        elapsed = max(self.clock() - self._started, 1e-6)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left:,.0f} s" if left != float("inf") else "?"
        percent = 100 * self.done / self.total if self.total else 100.0
        return (
            f"{self.what}: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
            f"({percent:.0f}%), {rate / 1e6:,.1f} MB/s, ETA {eta}"
        )

    def _loop(self) -> None:
        interval = 0.5 if self._tty else self.interval
        while not self._stop.wait(interval):
            if self._tty:
                assert self.stream is not None
                self.stream.write("\r" + self.line())
                self.stream.flush()
            else:
                self.log.info(self.line())
