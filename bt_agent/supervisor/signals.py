"""Signals the agent receives: recorded and forwarded by the handler, acted on by the main loop.

The handler only records and forwards; it never blocks and never raises. Nothing here blocks
signals, so children never inherit a blocked mask. A wake-up pipe (``signal.set_wakeup_fd``) lets
the main loop sleep in ``select`` and wake the moment any signal, SIGCHLD included, arrives.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable
from types import FrameType

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
STOPPING = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], object] | int | None


class SignalRelay:
    """Installs handlers for :data:`FORWARDED` and SIGCHLD; ``forward`` is called for each
    forwarded signal, ``stop_signal`` and ``stop_time`` record the first stop."""

    def __init__(self) -> None:
        self.forward: Callable[[int], None] | None = None
        self.stop_signal: int | None = None
        self.stop_time: float | None = None
        self._previous: dict[int, Handler] = {}
        self._previous_wakeup = -1
        self._read_fd = self._write_fd = -1

    def __enter__(self) -> SignalRelay:
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for number in FORWARDED:
            self._previous[number] = signal.signal(number, self._handle)
        self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._wake)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def wait(self, timeout: float) -> None:
        """Sleep until a signal arrives or ``timeout`` passes."""
        ready, _, _ = select.select([self._read_fd], [], [], max(timeout, 0))
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read_fd, 512):
                    pass

    def _wake(self, number: int, frame: FrameType | None) -> None:
        """SIGCHLD: nothing to do here; the wake-up pipe already woke the main loop."""

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if number in STOPPING and self.stop_signal is None:
            self.stop_signal = number
            self.stop_time = time.monotonic()
        if self.forward is not None:
            self.forward(number)
