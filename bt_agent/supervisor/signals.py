"""Signals the agent receives, recorded by the handler and acted on by the main loop.

The handler only records and forwards (it never blocks): SIGTERM and SIGINT also mark the job as
stopping. Nothing here blocks signals, so children never inherit a blocked mask.
"""

from __future__ import annotations

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
    """Installs handlers for :data:`FORWARDED`; forwards each signal to ``target``."""

    def __init__(self) -> None:
        self.target: Callable[[int], None] | None = None
        self.stop_signal: int | None = None
        self.stop_time: float | None = None
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> SignalRelay:
        for number in FORWARDED:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if number in STOPPING and self.stop_signal is None:
            self.stop_signal = number
            self.stop_time = time.monotonic()
        if self.target is not None:
            self.target(number)
