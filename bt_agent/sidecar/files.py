"""What the checkpoint dir holds, file by file: which checkpoint a file belongs to, whether it
may be uploaded, and a signature that tells when it changed.

A checkpoint is a top-level directory of the checkpoint dir; files at its root belong to the
checkpoint named ``.`` (REFERENCE.md §4). Work in progress is never uploaded: a top-level
directory named like a temporary one (``tmp-checkpoint-20``, as HF Trainer writes before its
rename, ``tmp_*``, hidden ``.*``, ``*.tmp``) and files ending ``.tmp``, ``.partial`` or
``.incomplete``; after a crash such leftovers would otherwise be committed as checkpoints.
Only regular files are uploaded, and symlinks that resolve to one inside the checkpoint dir;
FIFOs, sockets, devices and any path that leads outside through a symlink are skipped, never
read (see :mod:`bt_agent.sidecar.beneath`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bt_agent.sidecar.beneath import KINDS, PATH_FLAGS, Opened, Refused, open_file, stat_at

ROOT_CHECKPOINT = "."
TEMPORARY_DIR_PREFIXES = ("tmp-", "tmp_", ".")
TEMPORARY_SUFFIXES = (".tmp", ".partial", ".incomplete")


def transient(relative: str) -> bool:
    """Whether ``relative`` is work in progress: under a temporary top-level directory, or a
    file with a temporary suffix."""
    head, sep, _ = relative.partition("/")
    if sep and transient_dir(head):
        return True
    return relative.endswith(TEMPORARY_SUFFIXES)


def transient_dir(name: str) -> bool:
    """Whether a top-level directory ``name`` holds work in progress (``tmp-checkpoint-20``)."""
    return name.startswith(TEMPORARY_DIR_PREFIXES) or name.endswith(TEMPORARY_SUFFIXES)


@dataclass(frozen=True)
class FileSig:
    """Size, modification and change times, and inode: any write or replacement changes one of
    them. The change time is the kernel's own: a rewrite that puts the old modification time
    back (``cp -p``, ``os.utime``) still moves it."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, result: os.stat_result) -> FileSig:
        return cls(result.st_size, result.st_mtime_ns, result.st_ctime_ns, result.st_ino)


@dataclass(frozen=True)
class Candidate:
    """A file that may be uploaded, as it is now."""

    relative: str
    sig: FileSig


@dataclass(frozen=True)
class Skipped:
    relative: str
    reason: str


def checkpoint_of(relative: str) -> str:
    head, sep, _ = relative.partition("/")
    return head if sep else ROOT_CHECKPOINT


def within_checkpoint(relative: str) -> str:
    """The path relative to its checkpoint's directory."""
    checkpoint = checkpoint_of(relative)
    return relative if checkpoint == ROOT_CHECKPOINT else relative[len(checkpoint) + 1 :]


class CheckpointDir:
    """The checkpoint dir: its files named relative to it, and reached only through a
    descriptor of the directory (opened at first use)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._prefix = os.path.join(os.path.abspath(root), "")
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.root, PATH_FLAGS | os.O_DIRECTORY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def open(self, relative: str) -> Opened:
        """``relative`` open for reading (:class:`~bt_agent.sidecar.beneath.Refused` unless a
        regular file of the dir); the caller closes it."""
        return open_file(self.fd, relative)

    def relative(self, path: str) -> str | None:
        """``path`` relative to the root, or None when outside it or work in progress."""
        relative = self._under_prefix(path)
        if relative is None:
            try:
                relative = os.path.relpath(path, self.root)
            except ValueError:
                return None
            if relative == "." or relative.startswith(".." + os.sep) or relative == "..":
                return None
            relative = relative.replace(os.sep, "/")
        return None if transient(relative) else relative

    def _under_prefix(self, path: str) -> str | None:
        """The common case, three times per file written, without ``relpath``'s two
        ``abspath``: an absolute path under the root with no ``.``, ``..`` or empty part."""
        if os.sep != "/" or not path.startswith(self._prefix):
            return None
        relative = path[len(self._prefix) :]
        parts = relative.split("/")
        return None if "" in parts or "." in parts or ".." in parts else relative

    def classify(self, relative: str) -> Candidate | Skipped | None:
        """What ``relative`` is now: a candidate, a skipped entry, or None (gone, or a
        directory)."""
        try:
            relative.encode("utf-8")
        except UnicodeEncodeError:
            return Skipped(relative, "its name is not valid UTF-8, which no store accepts")
        try:
            info = stat_at(self.fd, relative)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Refused as exc:
            return Skipped(relative, exc.reason)
        except OSError as exc:
            return Skipped(relative, f"it cannot be read ({exc.strerror})")
        if stat.S_ISREG(info.st_mode):
            return Candidate(relative, FileSig.of(info))
        if stat.S_ISDIR(info.st_mode):
            return None
        return Skipped(relative, f"it is {KINDS.get(stat.S_IFMT(info.st_mode), 'not a file')}")

    def exists(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` (a top-level directory, or ``.``) is still there."""
        if checkpoint == ROOT_CHECKPOINT:
            return True
        try:
            return stat.S_ISDIR(stat_at(self.fd, checkpoint).st_mode)
        except OSError:
            return False

    def changed_since(self, since_ns: int) -> dict[str, int]:
        """Checkpoints with a file changed after ``since_ns`` (the kernel's change times, which
        no write can put back), with their newest change."""
        found: dict[str, int] = {}
        with os.scandir(self.root) as entries:
            top = list(entries)
        root_files = [
            e for e in top if not e.is_dir(follow_symlinks=False) and self.relative(e.path)
        ]
        newest = _newest_change(e.path for e in root_files)
        if newest > since_ns:
            found[ROOT_CHECKPOINT] = newest
        for entry in top:
            if not entry.is_dir(follow_symlinks=False) or transient_dir(entry.name):
                continue
            newest = _newest_change(
                os.path.join(d, name) for d, _, names in os.walk(entry.path) for name in names
            )
            if newest > since_ns:
                found[entry.name] = newest
        return found

    def walk(self, under: str = "") -> Iterator[str]:
        """Every non-directory entry under ``under`` (relative), not following directory
        symlinks."""
        start = self.root / under if under else self.root
        for directory, dirnames, filenames in os.walk(start, followlinks=False):
            base = Path(directory)
            for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
                relative = self.relative(str(base / name))
                if relative is not None:
                    yield relative


def _newest_change(paths: Iterable[str]) -> int:
    """The newest change time (ns) among ``paths``; 0 for none."""
    newest = 0
    for path in paths:
        try:
            newest = max(newest, os.lstat(path).st_ctime_ns)
        except OSError:
            continue
    return newest
