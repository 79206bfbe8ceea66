"""Keep the agent's memory what its buffers need: a long-running uploader frees many
multi-megabyte part buffers from many threads, and glibc's allocator, which raises its mmap
threshold after each such free, would otherwise keep them in per-thread arenas (measured: a
1 GB upload left the agent at 400 MB RSS, 225 MB with this alone). The upload threads also
share two arenas instead of one each: sixteen workers' arenas cost 25 MB more than four."""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_ARENA_MAX = -8
THRESHOLD_BYTES = 1024 * 1024
ARENAS = 2


def return_large_buffers() -> bool:
    """Serve allocations of 1 MiB and more by mmap, returned to the system when freed, and
    keep at most two malloc arenas. Only this process is affected; a no-op (False) where the
    C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        arenas = bool(libc.mallopt(M_ARENA_MAX, ARENAS))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and arenas
    except (OSError, AttributeError):
        return False
