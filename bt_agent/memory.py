"""Keep the agent's memory what its buffers need while it moves data.

Staging, checkpoint loads and the checkpoint sidecar free many multi-megabyte buffers from many
threads, the engine's and the agent's. glibc's allocator raises its mmap threshold after each
such free, so later buffers come from the heap and stay there once freed, and it gives each
thread that allocates at once an arena of its own, up to eight per core: on a machine of many
cores the agent would keep what each arena ever held. :func:`return_large_buffers` asks glibc
to serve large allocations by mmap (returned when freed) and to keep two arenas. The CLI calls
it first thing for the commands that move data, before any thread has allocated
(``benchmarks/RESULTS.md`` has what each setting saved).
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_ARENA_MAX = -8
THRESHOLD_BYTES = 1024 * 1024
ARENAS = 2


def return_large_buffers() -> bool:
    """Serve allocations of 1 MiB and more by mmap, returned to the system when freed, and
    keep at most two malloc arenas. Only this process is affected; a no-op (False) where the
    C library has no ``mallopt`` (not glibc). An arena made before the call stays."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library: nothing is loaded
    except (OSError, AttributeError):
        return False
    arenas = bool(mallopt(M_ARENA_MAX, ARENAS))
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and arenas
