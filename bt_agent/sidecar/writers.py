"""Who is writing the checkpoint dir, as the kernel tells it: ``/proc/<pid>/fd``.

A quiet period is a guess; a file open for writing is a fact. The sidecar looks at the open
files of the job's processes while checkpoints are being written (a scan costs a ``readlink``
per descriptor, so at most one per :data:`SCAN_INTERVAL`, and only while something changes), and
at the moments that decide a commit. It keeps, for each file, the processes seen writing it:
when the file is closed, they tell whether its writer closed it (the process lives on, or
exited on its own) or the file was closed because its writer ended (a signal in the exit
status of the exiting process or zombie, or the process gone), in which case the file, and its
checkpoint, may be cut short.

The link of each descriptor has the access mode in its own permission bits (``l-wx`` or
``lrwx`` when open for writing), so a ``readlink`` per descriptor and an ``lstat`` per file of
the directory is all a scan costs.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

PROC = Path("/proc")
#: Seconds between two scans while checkpoint files keep changing.
SCAN_INTERVAL = 0.5
#: How long a close event's check waits for the agent's reaper to record a writer's status.
REAPED_WAIT_SECONDS = 0.25
_DELETED = " (deleted)"
_PF_EXITING = 0x4  # the flags field of /proc/<pid>/stat: the process has begun to exit
_EXIT_CODE = 49  # field 52 of /proc/<pid>/stat (counted from the state, field 3): wait status


def all_processes() -> list[int]:
    return [int(entry) for entry in os.listdir(PROC) if entry.isdigit()]


def open_for_writing(root: str, pids: Iterable[int]) -> dict[str, set[int]]:
    """Files under ``root`` (a real path, ending with ``/``) open for writing: path -> pids.
    The calling process is left out."""
    found: dict[str, set[int]] = {}
    own = os.getpid()
    for pid in pids:
        if pid == own:
            continue
        fds = f"/proc/{pid}/fd/"
        try:
            names = os.listdir(fds)
        except OSError:  # gone, or not ours to look at
            continue
        for name in names:
            link = fds + name
            try:
                target = os.readlink(link)
                if not target.startswith(root) or target.endswith(_DELETED):
                    continue
                if not os.lstat(link).st_mode & stat.S_IWUSR:
                    continue  # open for reading only
            except OSError:
                continue
            found.setdefault(target, set()).add(pid)
    return found


def ended_while_writing(pid: int, reaped: Callable[[int], int | None] | None = None) -> bool:
    """Whether the end of ``pid`` closed its files: it is exiting or a zombie with a signal in
    its exit status (``/proc/<pid>/stat``'s ``exit_code``, set before the kernel closes its
    files), or it is gone and was killed by a signal. One that exited on its own closed its
    files, or had ``exit`` flush them, after writing them whole. Of one already gone, the agent
    knows how it ended where it reaped it (``reaped(pid)``: its own children and the orphans it
    adopts); another's parent reaped it, leaving no status to read: it counts as ended while
    writing, as a writer killed mid-file would (a file is then held back that may have been
    whole, never committed cut short)."""
    try:
        line = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return _gone_by_signal(pid, reaped)
    fields = line[line.rindex(")") + 2 :].split()
    if not (fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING):
        return False
    return len(fields) <= _EXIT_CODE or int(fields[_EXIT_CODE]) & 0x7F != 0


def _gone_by_signal(pid: int, reaped: Callable[[int], int | None] | None) -> bool:
    """How a process no longer in /proc ended, as its reaper says; True where it cannot say.
    The agent's reaper records a status just after the process leaves /proc: it is waited for
    a little."""
    if reaped is None:
        return True
    deadline = time.monotonic() + REAPED_WAIT_SECONDS
    while (code := reaped(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return code is None or code < 0


class Writers:
    """The files of one directory open for writing, and the processes seen writing each.

    :meth:`scan` runs on the sidecar's thread; :meth:`closed` on the watcher's, at the moment
    a file's close event arrives, so that a writer that closes its file and goes on is not
    mistaken for one that ended while writing."""

    def __init__(
        self,
        root: Path,
        processes: Callable[[], Iterable[int]] = all_processes,
        interval: float = SCAN_INTERVAL,
        reaped: Callable[[int], int | None] | None = None,
    ) -> None:
        self.processes = processes
        self.reaped = reaped
        self.interval = interval
        self._prefix = os.path.join(os.path.realpath(root), "")  # what the kernel's links say
        self._watched = os.path.join(os.path.abspath(root), "")  # what the watcher's events say
        self._lock = threading.Lock()
        self._open: dict[str, set[int]] = {}  # relative path -> pids, as of the last scan
        self._seen: dict[str, set[int]] = {}  # absolute path -> pids seen writing it since
        self.scanned_at = float("-inf")

    def scan(self, now: float | None = None, force: bool = False) -> dict[str, set[int]]:
        """The files open for writing now, relative to the directory -> pids; a scan younger
        than ``interval`` (``now``, ``time.monotonic()``) is reused unless ``force``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not force and now - self.scanned_at < self.interval:
                return dict(self._open)
        found = open_for_writing(self._prefix, self.processes())
        cut = len(self._prefix)
        with self._lock:
            self._open = {path[cut:]: pids for path, pids in found.items()}
            self.scanned_at = now
            for path, pids in found.items():
                self._seen.setdefault(path, set()).update(pids)
            return dict(self._open)

    def closed(self, path: str) -> bool:
        """``path`` (as the watcher names it) was just closed after writing: True when every
        process seen writing it ended while writing (:func:`ended_while_writing`: the file
        was closed by their end, not by them). A file nobody was seen writing says nothing
        (False); nor does a writer that closed it and exited on its own before this check
        (the close event comes a little after the close), while its status can be read."""
        real = self._prefix + path[len(self._watched) :] if path.startswith(self._watched) else path
        with self._lock:
            pids = self._seen.pop(real, set())
        return bool(pids) and all(ended_while_writing(pid, self.reaped) for pid in pids)
