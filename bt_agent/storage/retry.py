"""Retrying transient failures with capped exponential backoff and full jitter."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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
