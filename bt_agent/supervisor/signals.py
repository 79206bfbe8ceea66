"""Signals the agent receives: recorded by the handler, forwarded and acted on by the main loop.

The handler only records (the first stop signal and its time, and the signal in a queue); it
never blocks, never raises and never signals anyone. Nothing here blocks signals, so children
never inherit a blocked mask. A wake-up pipe (``signal.set_wakeup_fd``) lets the main loop sleep
in ``select`` and wake the moment any signal, SIGCHLD included, arrives; :meth:`SignalRelay.wait`
then forwards what was recorded, in order.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections import deque
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
    """Installs handlers for :data:`FORWARDED` and SIGCHLD; ``forward`` is called from the main
    loop (:meth:`wait`, :meth:`deliver`) for each forwarded signal, once, in the order they
    came; ``stop_signal`` and ``stop_time`` record the first stop as it arrives."""

    def __init__(self) -> None:
        self.forward: Callable[[int], None] | None = None
        self.stop_signal: int | None = None
        self.stop_time: float | None = None
        self._received: deque[int] = deque()
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
        """Sleep until a signal arrives or ``timeout`` passes, then forward what came."""
        self.deliver()
        ready, _, _ = select.select([self._read_fd], [], [], max(timeout, 0))
        if ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read_fd, 512):
                    pass
        self.deliver()

    def deliver(self) -> None:
        """Forward the signals received since the last call, in order."""
        while self._received:
            number = self._received.popleft()
            if self.forward is not None:
                self.forward(number)

    def _wake(self, number: int, frame: FrameType | None) -> None:
        """SIGCHLD: nothing to do here; the wake-up pipe already woke the main loop."""

    def _handle(self, number: int, frame: FrameType | None) -> None:
        """Record only: the main loop, woken by the pipe, forwards."""
        if number in STOPPING and self.stop_signal is None:
            self.stop_signal = number
            self.stop_time = time.monotonic()
        self._received.append(number)
