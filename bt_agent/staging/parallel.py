"""Files fetched a thread each, a few at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: Files fetched at once, a thread each (a large one in parallel ranges of its own).
FETCH_WORKERS = 8


def each(call: Callable[[T], object], items: Sequence[T], name: str) -> None:
    """``call`` on every one of ``items``, :data:`FETCH_WORKERS` at once on threads called
    ``name``. After a failure no call starts; the first error is raised once the calls under
    way have ended (none is left writing a file the caller goes on to remove)."""
    if not items:
        return
    with ThreadPoolExecutor(min(FETCH_WORKERS, len(items)), thread_name_prefix=name) as pool:
        futures = [pool.submit(call, item) for item in items]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
