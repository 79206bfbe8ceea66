"""Reaping: collect the exit status of every child, orphans included.

As PID 1 the agent inherits every orphan in the container; elsewhere it asks to (a child
subreaper), so tests and local runs behave the same. Once the reaper has collected a child,
``Popen.wait()`` can only say 0, so the reaper keeps the statuses of the pids it is asked to watch.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import OrderedDict
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


#: Processes whose exit status is kept after they are reaped, the latest first out last.
RECENT = 4096


class Reaper:
    """Reaps with ``waitpid(-1, WNOHANG)`` until nothing is left to reap; ``ended`` hears of
    every process reaped (pid, returncode)."""

    def __init__(self, ended: Callable[[int, int], None] = lambda pid, code: None) -> None:
        self.watched: set[int] = set()
        self.statuses: dict[int, int] = {}  # pid -> returncode (negative: killed by that signal)
        self._recent: OrderedDict[int, int] = OrderedDict()  # of every process, the latest
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
            self._recent[pid] = code
            self._recent.move_to_end(pid)
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            self.ended(pid, code)

    def status_of(self, pid: int) -> int | None:
        return self.statuses.get(pid)

    def recent_status(self, pid: int) -> int | None:
        """How ``pid`` ended, if this reaper reaped it lately (None if not, or not yet). Any
        thread may ask."""
        return self._recent.get(pid)
