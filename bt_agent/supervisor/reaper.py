"""Reaping: collect the exit status of every child, orphans included.

As PID 1 the agent inherits every orphan in the container; elsewhere it asks to (a child
subreaper), so tests and local runs behave the same. Once the reaper has collected a child,
``Popen.wait()`` can only say 0, so the reaper keeps the statuses of the pids it is asked to watch.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process. True if it worked (Linux)."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Reaper:
    """Reaps with ``waitpid(-1, WNOHANG)`` until nothing is left to reap; ``ended`` hears of
    every process reaped (pid, returncode)."""

    def __init__(self, ended: Callable[[int, int], None] = lambda pid, code: None) -> None:
        self.watched: set[int] = set()
        self.statuses: dict[int, int] = {}  # pid -> returncode (negative: killed by that signal)
        self.reaped = 0
        self.ended = ended

    def watch(self, pid: int) -> None:
        self.watched.add(pid)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if pid == 0:
                return
            self.reaped += 1
            code = os.waitstatus_to_exitcode(status)
            if pid in self.watched:
                self.statuses[pid] = code
            self.ended(pid, code)

    def status_of(self, pid: int) -> int | None:
        return self.statuses.get(pid)
