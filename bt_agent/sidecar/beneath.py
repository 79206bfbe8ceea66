"""Files of the checkpoint dir, opened without ever leaving it.

A trainer owns the checkpoint dir and may change it while the sidecar reads it: a directory on
a file's path swapped for a symlink to ``/etc``, a queued file swapped for a FIFO. Every file is
therefore reached from a descriptor of the checkpoint dir, and the kernel checks the whole
path at once: ``openat2(2)`` with ``RESOLVE_BENEATH`` refuses any component, symlinks included,
that resolves outside (``EXDEV``). A symlink that stays inside (``last.ckpt -> epoch=3.ckpt``)
is followed. Where the kernel has no ``openat2`` (before Linux 5.6, or a seccomp profile that
refuses it), the path is walked one component at a time with ``O_NOFOLLOW``, and no symlink is
followed at all.

Files are opened ``O_NONBLOCK`` (a FIFO never blocks the opener) and checked with ``fstat``:
only regular files are read. The opened file is handed on as ``/proc/self/fd/N``, a path that
names the very file opened, whatever happens to its name meanwhile, so that every store reads
exactly what was checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYS_OPENAT2 = 437  # the same number on every architecture since Linux 5.6
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
PATH_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_CLOEXEC

KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symlink",
}


class Refused(OSError):
    """The path cannot be read as a file of the checkpoint dir; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


class Kernel:
    """``openat2`` through libc's ``syscall``, until the kernel says it has none (or a caller
    sets ``available`` to False: the walk is used then, as on a kernel without it)."""

    def __init__(self) -> None:
        self.available = True
        try:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            self.available = False

    def openat2(self, directory: int, relative: bytes, flags: int) -> int:
        how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
        fd = int(
            self._syscall(
                ctypes.c_long(SYS_OPENAT2),
                ctypes.c_int(directory),
                ctypes.c_char_p(relative),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EPERM):  # too old, or refused by a seccomp profile
            self.available = False
            raise NotImplementedError
        raise OSError(code, os.strerror(code))


#: The kernel's openat2, shared by every caller.
KERNEL = Kernel()


def open_at(directory: int, relative: str, flags: int) -> int:
    """A descriptor of ``relative`` (``/``-separated, no ``.`` or ``..`` parts) under the
    directory ``directory``, opened with ``flags``, never resolved outside it."""
    name = relative.encode("utf-8", "surrogateescape")
    if KERNEL.available:
        try:
            return _refusing(lambda: KERNEL.openat2(directory, name, flags))
        except NotImplementedError:
            pass
    return _walk(directory, name, flags)


def _walk(directory: int, name: bytes, flags: int) -> int:
    """Component by component, following no symlink."""
    *parents, last = name.split(b"/")
    current = directory
    try:
        for part in parents:
            step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
            if current != directory:
                os.close(current)
            current = step
        fd = _refusing(lambda: os.open(last, flags | os.O_NOFOLLOW, dir_fd=current))
        if stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH opens the link itself
            os.close(fd)
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        return fd
    except NotADirectoryError:
        raise Refused("a part of its path is not a directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("a symlink is on its path (not followed on this system)") from None
        raise
    finally:
        if current != directory:
            os.close(current)


def _refusing(opening: Callable[[], int]) -> int:
    """``opening()``, with the errors that say the path is not a file of the dir refused."""
    try:
        fd = opening()
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise Refused("it leads outside the dir through a symlink") from None
        if exc.errno == errno.ENXIO:
            raise Refused("it is a socket") from None
        raise
    return fd


def stat_at(directory: int, relative: str) -> os.stat_result:
    """What ``relative`` is, as :func:`open_at` would reach it, without opening its content."""
    fd = open_at(directory, relative, PATH_FLAGS)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Opened:
    """A regular file, open for reading: ``path`` names it (not its name in the dir)."""

    fd: int
    info: os.stat_result

    @property
    def path(self) -> Path:
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_file(directory: int, relative: str) -> Opened:
    """``relative`` open for reading; :class:`Refused` unless it is a regular file."""
    fd = open_at(directory, relative, READ_FLAGS)
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Refused(f"it is {KINDS.get(stat.S_IFMT(info.st_mode), 'not a file')}")
    return Opened(fd, info)
