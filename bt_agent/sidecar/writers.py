"""Who is writing the checkpoint dir, as the kernel tells it: ``/proc/<pid>/fd``.

A quiet period is a guess; a file open for writing is a fact. The sidecar looks at the open
files of the job's processes while checkpoints are being written (a scan costs a ``readlink``
per descriptor, so at most one per :data:`SCAN_INTERVAL`, and only while something changes), and
at the moments that decide a commit. It keeps, for each file, the processes seen writing it:
when the file is closed, they tell whether its writer closed it (the process lives on, or
exited on its own) or the file was closed because its writer ended (a signal in its exit
status), in which case the file, and its checkpoint, may be cut short. The status is read where
the kernel keeps it: ``/proc/<pid>/stat`` while the process is exiting or a zombie; once another
process reaped it (a shell reaps the ``cp`` it waits for at once), the pidfd the sidecar opened
when it first saw the process writing (``PIDFD_GET_INFO``'s ``PIDFD_INFO_EXIT``, Linux 6.15);
of the agent's own children, what its reaper recorded.

The link of each descriptor has the access mode in its own permission bits (``l-wx`` or
``lrwx`` when open for writing), so a ``readlink`` per descriptor and an ``lstat`` per file of
the directory is all a scan costs.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
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
#: ``ioctl(pidfd, PIDFD_GET_INFO)`` on the first version of ``struct pidfd_info`` (64 bytes: the
#: mask first, the wait status of a reaped process at byte 60), asking for ``PIDFD_INFO_EXIT``.
_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(0xFF, 11, ...)
_PIDFD_INFO_EXIT = 1 << 3
_INFO_EXIT_CODE_AT = 60
#: Pidfds held at most at once (one per process seen writing, until its file's close is judged).
MAX_PIDFDS = 256


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


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``: it keeps the process's exit status readable once another reaps it
    (:func:`reaped_status`). None where the process is gone or the system has none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone; or no pidfds (not Linux, or before 5.3)
        return None


def reaped_status(pidfd: int) -> int | None:
    """The wait status the kernel kept of the process of ``pidfd`` when it was reaped, by
    whatever parent; None while it is not reaped, or where the kernel keeps none (before
    Linux 6.15: ``ESRCH`` once reaped, ``ENOTTY`` before 6.13)."""
    info = bytearray(_INFO_SIZE)
    struct.pack_into("=Q", info, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
    except OSError:
        return None
    if not struct.unpack_from("=Q", info, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    status: int = struct.unpack_from("=i", info, _INFO_EXIT_CODE_AT)[0]
    return status


def ended_while_writing(
    pid: int, reaped: Callable[[int], int | None] | None = None, pidfd: int | None = None
) -> bool:
    """Whether the end of ``pid`` closed its files: it is exiting or a zombie with a signal in
    its exit status (``/proc/<pid>/stat``'s ``exit_code``, set before the kernel closes its
    files), or it is gone and was killed by a signal. One that exited on its own closed its
    files, or had ``exit`` flush them, after writing them whole. Of one already gone, the
    status is the one the kernel kept for ``pidfd`` (a pidfd opened while it lived), else the
    one the agent's reaper recorded (``reaped(pid)``: its own children and the orphans it
    adopts). One whose status nobody kept (reaped by another parent, on a kernel that keeps
    none) counts as ended while writing, as a writer killed mid-file would: a file is then held
    back that may have been whole, never committed cut short."""
    if (fields := _stat(pid)) is None:
        return _gone_by_signal(pid, reaped, pidfd)
    if not _ending(fields):
        return False
    return len(fields) <= _EXIT_CODE or int(fields[_EXIT_CODE]) & 0x7F != 0


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on; None once the process is gone."""
    try:
        line = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return line[line.rindex(")") + 2 :].split()


def _ending(fields: list[str]) -> bool:
    """Whether the process of these stat fields is exiting or a zombie."""
    return fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING != 0


def _running(pid: int) -> bool:
    """Whether ``pid`` lives and has not begun to exit."""
    return (fields := _stat(pid)) is not None and not _ending(fields)


def _gone_by_signal(
    pid: int, reaped: Callable[[int], int | None] | None, pidfd: int | None
) -> bool:
    """How a process no longer in /proc ended, as the kernel kept it for ``pidfd`` (recorded
    before the process leaves /proc), else as the agent's reaper says (it records a status just
    after: it is waited for a little); True where neither can say."""
    if pidfd is not None and (status := reaped_status(pidfd)) is not None:
        return status & 0x7F != 0
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
    mistaken for one that ended while writing; :meth:`before_signals` on the agent's, just
    before it signals the job's processes, so that one ended by the signal after it closed its
    file is not mistaken either. A pidfd is held for each process seen writing
    (at most :data:`MAX_PIDFDS`) until every file it was seen writing has been judged, so that
    its exit status can be read after another process reaped it; :meth:`close` lets go of
    them."""

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
        self._pidfds: dict[int, int] = {}  # pid seen writing -> a pidfd of it
        self._closed_by_writer: set[str] = set()  # absolute paths judged before their event
        self._closed = False
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
                self._hold(pids)
            return dict(self._open)

    def _hold(self, pids: set[int]) -> None:
        """A pidfd of each of ``pids`` not held yet (under the lock). The process is the one
        just seen writing: its pid is not used again before another process has cycled through
        every pid."""
        for pid in pids - self._pidfds.keys():
            if self._closed or len(self._pidfds) >= MAX_PIDFDS:
                return
            if (pidfd := open_pidfd(pid)) is not None:
                self._pidfds[pid] = pidfd

    def closed(self, path: str) -> bool:
        """``path`` (as the watcher names it) was just closed after writing: True when every
        process seen writing it ended while writing (:func:`ended_while_writing`: the file
        was closed by their end, not by them). A file nobody was seen writing says nothing
        (False); nor does a writer that closed it and exited on its own before this check
        (the close event comes a little after the close), while its status can be read."""
        real = self._prefix + path[len(self._watched) :] if path.startswith(self._watched) else path
        with self._lock:
            if real in self._closed_by_writer:  # judged before the agent signalled its writer
                self._closed_by_writer.discard(real)
                return False
            pids = self._seen.pop(real, set())
            pidfds = {pid: self._pidfds[pid] for pid in pids if pid in self._pidfds}
        try:
            return bool(pids) and all(
                ended_while_writing(pid, self.reaped, pidfds.get(pid)) for pid in pids
            )
        finally:
            self._let_go(pidfds)

    def before_signals(self) -> None:
        """The agent is about to signal the job's processes (a stop it forwards, the end of
        what is left behind): each file seen written that none of its writers holds open any
        more, while every one of them still runs, was closed by them, whatever the signal
        then does to them; that is kept for its close event, which may come after. Only the
        processes seen writing are looked at, so that a stop is passed on without delay."""
        with self._lock:
            seen = {path: set(pids) for path, pids in self._seen.items()}
        if not seen:
            return
        still_open = open_for_writing(self._prefix, set().union(*seen.values()))
        judged: set[int] = set()
        with self._lock:
            for path, pids in seen.items():
                if path in still_open or self._seen.get(path) != pids:
                    continue  # open, or judged or written again meanwhile: its event decides
                if all(_running(pid) for pid in pids):
                    del self._seen[path]
                    self._closed_by_writer.add(path)
                    judged |= pids
            pidfds = {pid: self._pidfds[pid] for pid in judged if pid in self._pidfds}
        self._let_go(pidfds)

    def _let_go(self, pidfds: dict[int, int]) -> None:
        """Close those of ``pidfds`` whose process is not seen writing another file."""
        with self._lock:
            writing = set().union(*self._seen.values())
            for pid, pidfd in pidfds.items():
                if pid not in writing and self._pidfds.get(pid) == pidfd:
                    os.close(self._pidfds.pop(pid))

    def close(self) -> None:
        """Let go of every pidfd held; no more are opened."""
        with self._lock:
            self._closed = True
            for pidfd in self._pidfds.values():
                os.close(pidfd)
            self._pidfds.clear()
