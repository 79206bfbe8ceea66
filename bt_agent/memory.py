"""Keep the agent's memory what its buffers need while it moves data.

glibc's allocator gives each thread that allocates at once an arena of its own, up to eight per
core, and keeps what each arena ever held: staging, checkpoint loads and uploads allocate from
the engine's threads and the agent's, so on a machine of many cores the agent would hold what
each of a hundred arenas once held. :func:`keep_few_arenas`, which the CLI calls first thing for
the commands that move data (before any thread has allocated), keeps two.

A long-running uploader also frees many multi-megabyte part buffers, and glibc raises its mmap
threshold after each such free, so later ones come from the heap and stay there:
:func:`return_large_buffers`, which the checkpoint sidecar calls as it starts, has them mapped
and handed back when freed. It fixes glibc's trim threshold too, at its default (a heap then
shrinks whenever a little at its top is free, and faults its pages in again), so staging and
loading, which free pieces of a few hundred KiB all along, run before it
(``benchmarks/RESULTS.md`` has what each setting saved and cost).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_ARENA_MAX = -8
THRESHOLD_BYTES = 1024 * 1024
ARENAS = 2


def keep_few_arenas() -> bool:
    """At most two malloc arenas for this process (an arena made before the call stays);
    False where the C library has no ``mallopt`` (not glibc)."""
    return _mallopt(M_ARENA_MAX, ARENAS)


def return_large_buffers() -> bool:
    """Serve allocations of 1 MiB and more by mmap, returned to the system when freed, and keep
    at most two malloc arenas; False where the C library has no ``mallopt``."""
    mapped = _mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)
    return keep_few_arenas() and mapped


def _mallopt(parameter: int, value: int) -> bool:
    try:
        mallopt: Callable[[int, int], int] = ctypes.CDLL(None).mallopt  # the process's own libc
    except (OSError, AttributeError):
        return False
    return bool(mallopt(parameter, value))
