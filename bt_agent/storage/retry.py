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
    the last error says how many attempts were made (where there were more than one)."""
    for attempt in range(policy.attempts):
        try:
            return call()
        except TransientStoreError as exc:
            if attempt + 1 >= policy.attempts:
                if policy.attempts == 1:
                    raise
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
    on_back: Callable[[float], None] = lambda waited: None,
) -> T:
    """``call()`` (itself retried a few times by the store) again and again while it fails
    transiently, for up to ``seconds`` after the first failure: an outage of the store outlasts
    a few quick retries. ``on_failure(error, seconds_left)`` is told of each failure, and
    ``on_back(seconds_waited)`` of a call that got through after one; a stop request ends the
    waiting with :class:`InterruptedError`."""
    first: float | None = None
    attempt = 0
    while True:
        try:
            result = call()
        except TransientStoreError as exc:
            now = clock()
            first = now if first is None else first
            if stopping():
                raise InterruptedError("stop requested") from exc
            if now >= first + seconds:
                raise
            on_failure(exc, first + seconds - now)
            attempt += 1
            wake = min(first + seconds, now + 1.0 + random.random() * min(10.0, 2.0**attempt))
            while clock() < wake and not stopping():  # a stop request is heard within 0.1 s
                sleep(0.1)
            continue
        if first is not None:
            on_back(clock() - first)
        return result


class OutageWait:
    """Calls that wait out an unreachable store (:func:`retry_for`), saying once per ``label``
    through ``warn`` that ``what`` (the source, the store) is unreachable and, once a call
    under it gets through again, through ``tell`` that it is back (a later outage is said
    again); safe to share between threads."""

    def __init__(
        self,
        seconds: float,
        stopping: Callable[[], bool],
        what: str,
        warn: Callable[[str], None],
        tell: Callable[[str], None],
    ) -> None:
        self.seconds = seconds
        self.stopping = stopping
        self.what = what
        self._warn = warn
        self._tell = tell
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def call(self, label: str, call: Callable[[], T]) -> T:
        def failed(exc: TransientStoreError, left: float) -> None:
            with self._lock:
                if label in self._warned:
                    return
                self._warned.add(label)
            unreachable = f"{label}: {self.what} is unreachable ({exc})"
            self._warn(f"{unreachable}; retrying for up to {left:.0f} s")

        def back(waited: float) -> None:
            with self._lock:
                if label not in self._warned:
                    return  # said by another call under the label
                self._warned.discard(label)
            self._tell(f"{label}: {self.what} is reachable again after {waited:.0f} s")

        return retry_for(call, self.seconds, self.stopping, failed, on_back=back)

    def attempts(self, label: str) -> Attempt:
        """:meth:`call` under ``label``, as an :class:`Attempt` to hand to a store's download
        (which then keeps its partial file, and what is whole of it, across the wait)."""

        def attempt(call: Callable[[], T]) -> T:
            return self.call(label, call)

        return attempt
