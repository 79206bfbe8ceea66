"""Retrying transient failures with capped exponential backoff and full jitter."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from bt_agent.errors import TransientStoreError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_seconds: float = 0.2
    cap_seconds: float = 5.0

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt))."""
        return float(rng() * min(self.cap_seconds, self.base_seconds * (2**attempt)))


DEFAULT_POLICY = RetryPolicy()


class Attempt(Protocol):
    """How a caller has a call made: ``attempt(call)`` returns what ``call()`` returned, and
    may make it again after a failure (:meth:`OutageWait.attempts`)."""

    def __call__(self, call: Callable[[], T], /) -> T: ...


def once(call: Callable[[], T]) -> T:
    """The call made once: the :class:`Attempt` of a caller that waits out nothing."""
    return call()


def retry(
    call: Callable[[], T],
    policy: RetryPolicy = DEFAULT_POLICY,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, again after each :class:`TransientStoreError` until the attempts are spent;
    the last error says how many attempts were made."""
    for attempt in range(policy.attempts):
        try:
            return call()
        except TransientStoreError as exc:
            if attempt + 1 >= policy.attempts:
                raise TransientStoreError(
                    f"{exc} (gave up after {policy.attempts} attempts)", exc.uri
                ) from exc
            sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


def retry_for(
    call: Callable[[], T],
    seconds: float,
    stopping: Callable[[], bool] = lambda: False,
    on_failure: Callable[[TransientStoreError, float], None] = lambda exc, left: None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``call()`` (itself retried a few times by the store) again and again while it fails
    transiently, for up to ``seconds`` after the first failure: an outage of the store outlasts
    a few quick retries. ``on_failure(error, seconds_left)`` is told of each failure; a stop
    request ends the waiting with :class:`InterruptedError`."""
    give_up: float | None = None
    attempt = 0
    while True:
        try:
            return call()
        except TransientStoreError as exc:
            now = clock()
            give_up = now + seconds if give_up is None else give_up
            if stopping():
                raise InterruptedError("stop requested") from exc
            if now >= give_up:
                raise
            on_failure(exc, give_up - now)
            attempt += 1
            wake = min(give_up, now + 1.0 + random.random() * min(10.0, 2.0**attempt))
            while clock() < wake and not stopping():  # a stop request is heard within 0.1 s
                sleep(0.1)


class OutageWait:
    """Calls that wait out an unreachable store (:func:`retry_for`), saying so once per
    ``label`` through ``warn(label, error, seconds_left)``; safe to share between threads."""

    def __init__(
        self,
        seconds: float,
        stopping: Callable[[], bool],
        warn: Callable[[str, TransientStoreError, float], None],
    ) -> None:
        self.seconds = seconds
        self.stopping = stopping
        self._warn = warn
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def call(self, label: str, call: Callable[[], T]) -> T:
        def failed(exc: TransientStoreError, left: float) -> None:
            with self._lock:
                if label in self._warned:
                    return
                self._warned.add(label)
            self._warn(label, exc, left)

        return retry_for(call, self.seconds, self.stopping, failed)

    def attempts(self, label: str) -> Attempt:
        """:meth:`call` under ``label``, as an :class:`Attempt` to hand to a store's download
        (which then keeps its partial file, and what is whole of it, across the wait)."""

        def attempt(call: Callable[[], T]) -> T:
            return self.call(label, call)

        return attempt
