"""The node cache: content-addressed files shared by every job on the node.

An entry is filled only by an atomic rename (the storage layer's download), under a lock of its
own, so two agents staging the same source fetch it once and neither sees a partial file. On
Linux an entry's lock is one byte of a single lock file (an open file description lock at an
offset its name gives): no inode is created per entry, whose creation costs as much as a small
file's. Elsewhere entries share striped lock files (those whose ids begin with the same three hex
digits share one of 4,096) locked whole with ``flock``.
Mounts are hard links to entries: an entry whose link count is above one is mounted by some job
and is never evicted. Least recently used entries (by access time, which a use sets) go first when
the cache is over its budget.

An entry and its mounts are one file, read-only, but a job that runs as root can write to it all
the same (a base model's ``config.json`` saved over in place): every later job on the node would
mount what it wrote. So a placed entry is sealed with a modification time no write leaves
(:data:`SEALED_MTIME_NS`), and one whose size or modification time differs is not held: it is
fetched again, into place by a rename, and mounted from there.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bt_agent.log import counted, format_bytes
from bt_agent.settings import NODE_CACHE_CONTAINER_DIR
from bt_agent.storage.base import RANGES_RECORD, is_resumable, ranges_record, resumable_path
from bt_agent.storage.ranges import may_take_up

#: Where ``F_OFD_SETLK`` is missing: hex digits of an entry id that pick its lock file.
LOCK_STRIPE_DIGITS = 3
#: The single lock file of the entries, where byte-range locks of open file descriptions exist.
LOCK_FILE = "entries.lock"
#: Hex digits of the sha256 of an entry's name that give its byte of ``LOCK_FILE`` (< 2**63).
LOCK_OFFSET_DIGITS = 15
_RANGE_LOCKS = hasattr(fcntl, "F_OFD_SETLK")
_FLOCK = struct.Struct("hhqqixxxx")  # struct flock: type, whence, start, len, pid (must be 0)
_HELD = (errno.EAGAIN, errno.EACCES)  # another description holds the lock
#: Entries are read-only: mounts are hard links to them.
ENTRY_MODE = 0o444
#: The modification time of every placed entry (1980-01-01, the epoch of reproducible builds):
#: any write to the file since sets its own.
SEALED_MTIME_NS = 315_532_800 * 10**9
#: How the names of partial files end: a download's, a copy's from the cluster tier, and the
#: record of a download in ranges. They begin with a dot and the entry's id
#: (``.<entry>.<pid>.<n>.incomplete``, ``.<entry>.resumable.incomplete``).
PARTIAL_SUFFIXES = (".incomplete", ".tmp", RANGES_RECORD)
#: How long the partial file of a download in ranges, stopped, is kept for a later staging to
#: take up where it stopped (on the same boot of the machine).
KEEP_RESUMABLE_SECONDS = 24 * 3600


def copy_atomic(source: Path, target: Path) -> None:
    """Copy through a unique temporary file beside ``target``, then rename into place."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _take(fd: int, entry: str, wait: bool) -> None:
    """Lock ``entry`` through ``fd``: its byte of the lock file, or the whole stripe file."""
    if _RANGE_LOCKS:
        offset = int(hashlib.sha256(entry.encode()).hexdigest()[:LOCK_OFFSET_DIGITS], 16)
        command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        fcntl.fcntl(fd, command, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    else:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))


def entry_id(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class Claim:
    """A held entry lock (:meth:`NodeCache.claim`)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    last_used: float
    in_use: bool


def left_by_stops(partials: list[Entry]) -> str:
    """What :meth:`NodeCache.clear_abandoned` removed, in words."""
    size = format_bytes(sum(e.size for e in partials))
    return f"{counted(len(partials), 'partial file')} ({size}) that stopped downloads left"


class NodeCache:
    @classmethod
    def for_node(cls, host: Callable[[str], Path], given: str | None) -> NodeCache:
        """``BT_NODE_CACHE_DIR`` when given, else the container path under the node root."""
        return cls(Path(given) if given else host(NODE_CACHE_CONTAINER_DIR))

    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.locks = root / "locks"
        self._objects, self._locks = str(self.objects), str(self.locks)

    def path(self, entry: str) -> Path:
        return Path(self._where(entry))

    def _where(self, entry: str) -> str:
        """The entry's path as text: staging asks for thousands (no Path built for each)."""
        return f"{self._objects}/{entry[:2]}/{entry}"

    def _open_lock(self, name: str) -> int:
        path = f"{self._locks}/{name}"
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            self.locks.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _lock(self, entry: str, wait: bool) -> int | None:
        """A new descriptor that holds the entry's lock (closing it lets go), or None when
        another holds it and ``wait`` is False. Each descriptor is its own lock holder, so a
        lock is held by one thread of one process at a time."""
        fd = self._open_lock(LOCK_FILE if _RANGE_LOCKS else f"{entry[:LOCK_STRIPE_DIGITS]}.lock")
        try:
            _take(fd, entry, wait)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _HELD and not wait:
                return None
            raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _locked(self, entry: str) -> Iterator[None]:
        fd = self._lock(entry, wait=True)
        assert fd is not None
        try:
            yield
        finally:
            os.close(fd)  # releases the lock

    def claim(self, entry: str) -> Claim | None:
        """The entry's lock if no one holds it now, else None (:meth:`ensure` waits for it).
        The holder fills the entry atomically, then releases the claim."""
        fd = self._lock(entry, wait=False)
        return None if fd is None else Claim(fd)

    def prepare(self, entries: Iterable[str]) -> None:
        """Create the directories that ``entries`` will go in."""
        for prefix in {entry[:2] for entry in entries}:
            (self.objects / prefix).mkdir(parents=True, exist_ok=True)

    def has(self, entry: str, size: int) -> bool:
        """Whether the entry is there as it was placed: ``size`` bytes, sealed."""
        return self._sealed(self._where(entry), size) is not None

    def written(self, entry: str) -> int:
        """What a stopped fill of the entry wrote that its next fill goes on from (bytes of
        its partial file kept for that, :meth:`_resumable`); 0 where there is none."""
        partial = resumable_path(self.path(entry))
        try:
            blocks = partial.stat().st_blocks
        except OSError:
            return 0
        return blocks * 512 if self._resumable(partial) else 0

    @staticmethod
    def _sealed(path: str | Path, size: int) -> os.stat_result | None:
        """``path``'s status where it is a sealed file of ``size`` bytes, else None (absent, or
        written to since it was placed)."""
        try:
            found = os.stat(path)
        except OSError:  # absent; or unreadable, which filling it says more of
            return None
        sealed = found.st_mtime_ns == SEALED_MTIME_NS and stat.S_ISREG(found.st_mode)
        return found if sealed and found.st_size == size else None

    def ensure(self, entry: str, size: int, fill: Callable[[Path], object]) -> tuple[Path, bool]:
        """The entry's path, filling it with ``fill(path)`` (which must place the file
        atomically, in place of any there) unless it holds ``size`` bytes, sealed. Returns
        ``(path, hit)``."""
        path = self.path(entry)
        if self._sealed(path, size) is not None:
            self.touch(path)
            return path, True
        with self._locked(entry):
            if self._sealed(path, size) is not None:  # another agent filled it meanwhile
                self.touch(path)
                return path, True
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
            self._clear_partials(path)
            fill(path)
            self.seal(path)
        return path, False

    @staticmethod
    def _clear_partials(path: Path) -> None:
        """Remove what fills of the entry at ``path`` left unfinished (an agent stopped or
        killed mid-download), but for the partial file that its download takes up
        (:func:`resumable_path`): with the entry's lock held, no one else is writing them."""
        resumable = resumable_path(path)
        for partial in path.parent.glob(f".{glob.escape(path.name)}.*"):
            if partial.name.endswith(PARTIAL_SUFFIXES) and partial not in (
                resumable,
                ranges_record(resumable),
            ):
                partial.unlink(missing_ok=True)

    def clear_abandoned(self, keep_resumable: bool = False) -> list[Entry]:
        """Remove the partial files no fill is making any more (their entry's lock is free):
        those a staging stopped or killed left of an entry never staged again, which no
        budget counts. With ``keep_resumable``, those that a staging of the entry could take
        up where it stopped are kept, for :data:`KEEP_RESUMABLE_SECONDS`. Returns the removed."""
        removed: list[Entry] = []
        if not self.objects.is_dir():
            return removed
        for partial in self.objects.glob("*/.*"):
            if not partial.name.endswith(PARTIAL_SUFFIXES):
                continue
            if keep_resumable and self._resumable(partial):
                continue
            claim = self.claim(partial.name[1:].split(".", 1)[0])
            if claim is None:
                continue  # being filled now
            try:
                status = partial.stat()
                partial.unlink()
            except FileNotFoundError:
                continue
            finally:
                claim.release()
            removed.append(Entry(partial, status.st_size, status.st_atime, False))
        return removed

    @staticmethod
    def _resumable(partial: Path) -> bool:
        """Whether ``partial`` is the partial file of a download in ranges, or its record,
        that a later download could take up."""
        taken_up = partial.with_name(partial.name.removesuffix(RANGES_RECORD))
        return is_resumable(taken_up) and may_take_up(taken_up, KEEP_RESUMABLE_SECONDS)

    @staticmethod
    def seal(path: Path) -> None:
        """Mark a file just placed as an entry: read-only, sealed, used now."""
        os.chmod(path, ENTRY_MODE)
        os.utime(path, ns=(time.time_ns(), SEALED_MTIME_NS))

    @staticmethod
    def touch(path: Path) -> None:
        """Mark the entry used now (its access time), its modification time left as it is."""
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))

    def entries(self) -> list[Entry]:
        found: list[Entry] = []
        if not self.objects.is_dir():
            return found
        for path in self.objects.glob("*/*"):
            if path.name.startswith("."):
                continue  # a download in progress
            status = path.stat()
            found.append(Entry(path, status.st_size, status.st_atime, status.st_nlink > 1))
        return found

    def evict(self, max_bytes: int) -> list[Entry]:
        """Remove least recently used entries not in use until the cache fits ``max_bytes``."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        removed = []
        for entry in entries:
            if total <= max_bytes:
                break
            if entry.in_use:
                continue
            with self._locked(entry.path.name):
                entry.path.unlink(missing_ok=True)
            total -= entry.size
            removed.append(entry)
        return removed
