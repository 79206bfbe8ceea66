"""Progress of a long transfer: a line every few seconds with bytes, rate and ETA (container
logs), or one line redrawn in place on a terminal."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from bt_agent.log import AgentLog
from bt_agent.storage.base import partial_prefix, resumable_path

INTERVAL_SECONDS = 5.0


class Progress:
    """Counts bytes as they are added (:meth:`add`, from any thread) and, between ``with`` and
    its end, reports them every ``interval`` seconds; ``clock`` is what rates are timed by.
    Files being fetched (:meth:`fetching`) count by what their partial files hold, so that
    one large file shows its progress as it comes, not only once it is whole; ``written`` of
    them was there before (a stopped staging's), and counts as done but not in the rate."""

    def __init__(
        self,
        what: str,
        total: int,
        log: AgentLog,
        stream: TextIO | None = None,
        interval: float = INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        written: int = 0,
    ) -> None:
        self.what = what
        self.total = total
        self.written = written
        self.log = log
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.done = 0
        self._fetching: dict[int, tuple[Path, int]] = {}  # files under way: path, size
        self._tokens = itertools.count()
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

    @contextlib.contextmanager
    def fetching(self, destination: Path, size: int) -> Iterator[None]:
        """While it lasts, ``destination`` (``size`` bytes) is being fetched through partial
        files beside it: what they hold counts as done. The caller adds its size (:meth:`add`)
        once the file is in place."""
        with self._lock:
            token = next(self._tokens)
            self._fetching[token] = (destination, size)
        try:
            yield
        finally:
            with self._lock:
                del self._fetching[token]

    def line(self) -> str:
        with self._lock:
            under_way = list(self._fetching.values())
        done = self.done + sum(_written(path, size) for path, size in under_way)
        elapsed = max(self.clock() - self._started, 1e-6)
        rate = max(done - self.written, 0) / elapsed
        left = (self.total - done) / rate if rate > 0 else float("inf")
        eta = f"{left:,.0f} s" if left != float("inf") else "?"
        percent = 100 * done / self.total if self.total else 100.0
        return (
            f"{self.what}: {done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
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


def _written(destination: Path, size: int) -> int:
    """What this process's partial files of ``destination`` hold, and the one it takes up
    (:func:`resumable_path`), at most ``size``: a file made its full size before its ranges are
    written is sparse, so its blocks, not its size, say how much has come."""
    prefix = partial_prefix(destination)
    resumable = resumable_path(destination).name
    held = 0
    with contextlib.suppress(OSError), os.scandir(destination.parent) as entries:
        for entry in entries:
            ours = entry.name.startswith(prefix) and entry.name.endswith(".incomplete")
            if ours or entry.name == resumable:
                with contextlib.suppress(OSError):
                    found = entry.stat(follow_symlinks=False)
                    held += min(found.st_blocks * 512, found.st_size)
    return min(held, size)
