"""A budget of bytes held in memory at once, shared by every transfer of a store."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ByteBudget:
    """At most ``limit`` bytes held at once. A holder of more than the limit takes all of it
    (and waits until it is all free), so every request is eventually served."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._held = 0
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        return self._held

    def acquire(self, size: int) -> int:
        """Wait until ``size`` bytes fit; the amount taken, to give back to :meth:`release`."""
        taken = min(max(size, 1), self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self._held + taken <= self.limit)
            self._held += taken
        return taken

    def try_acquire(self, size: int) -> int | None:
        """:meth:`acquire` if ``size`` bytes fit now, else None (for callers that must not
        block: an event loop)."""
        taken = min(max(size, 1), self.limit)
        with self._changed:
            if self._held + taken > self.limit:
                return None
            self._held += taken
        return taken

    def release(self, taken: int) -> None:
        with self._changed:
            self._held -= taken
            self._changed.notify_all()

    @contextmanager
    def holding(self, size: int) -> Iterator[None]:
        taken = self.acquire(size)
        try:
            yield
        finally:
            self.release(taken)
