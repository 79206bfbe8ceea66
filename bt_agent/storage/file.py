"""``file://``: a directory on a local or mounted file system.

Nothing is put in place before its bytes are on disk: a file is written under a temporary name
beside its key, made durable, then renamed. One file is made durable by its ``fsync``; a batch
of small files (the sidecar's stream of them, a tree's upload) by one ``syncfs(2)`` of the
store's file system, as ``cp -r`` followed by ``sync`` would, where Linux offers it and the
batch is large enough to be worth flushing whatever else the file system holds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bt_agent.errors import AccessDeniedError, KeyConflictError, NotFoundError, StoreError
from bt_agent.storage.base import (
    Fetched,
    Finished,
    ObjectInfo,
    ObjectStore,
    U,
    Upload,
    Wanted,
    is_disk_error,
    sha256_file,
)
from bt_agent.storage.keys import local_path

#: Files up to this size go through the batch paths (:meth:`FileStore.upload_stream`,
#: :meth:`FileStore.download_batch`).
BATCH_MAX_SIZE = 1024 * 1024
#: Threads that make a batch durable: enough for the file system to commit fsyncs together.
SYNC_THREADS = 8
#: A batch of at least this many files is made durable by one syncfs instead of a fsync each.
SYNCFS_MIN_FILES = 32


class FileStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = self.root.absolute().as_uri()

    def path(self, key: str) -> Path:
        return local_path(self.root, key)

    def _error(self, exc: OSError, key: str) -> StoreError:
        uri = self.uri(key)
        if isinstance(exc, FileNotFoundError | NotADirectoryError):
            return NotFoundError(f"{uri} does not exist", uri)
        if isinstance(exc, PermissionError):
            return AccessDeniedError(f"{uri}: permission denied; check the directory's owner", uri)
        return StoreError(f"{uri}: {exc.strerror or exc}", uri)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.path(directory) if directory else self.root
        found = []
        for dirpath, _, filenames in os.walk(start):
            for name in filenames:
                if name.startswith(".") and name.endswith((".tmp", ".incomplete")):
                    continue  # another writer's file in progress
                full = Path(dirpath, name)
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    found.append(self._info(key, full))
        return found

    @staticmethod
    def _info(key: str, path: Path) -> ObjectInfo:
        stat = path.stat()
        return ObjectInfo(key, stat.st_size, _version(stat))

    def _stat(self, key: str) -> ObjectInfo:
        path = self.path(key)
        try:
            if not path.is_file():
                raise FileNotFoundError(key)
            return self._info(key, path)
        except OSError as exc:
            raise self._error(exc, key) from exc

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self.path(key), "rb") as handle:
                handle.seek(start)
                return handle.read(length)
        except OSError as exc:
            raise self._error(exc, key) from exc

    def _read(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except OSError as exc:
            raise self._error(exc, key) from exc

    def _read_as_of(self, key: str) -> tuple[bytes, Fetched]:
        """The file's bytes, and the version of the file they were read from."""
        try:
            with open(self.path(key), "rb") as handle:
                return handle.read(), Fetched(version=_version(os.fstat(handle.fileno())))
        except OSError as exc:
            raise self._error(exc, key) from exc

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """The file copied by the kernel. Its version is read before the copy (another than
        the one listed fails at once) and after it, for the caller's check: files are replaced
        by renames, so one version at both ends is the file that was copied."""
        path = self.path(key)
        try:
            self.check_version(key, expected, self._info(key, path).version)
            shutil.copyfile(path, target)
            return Fetched(version=self._info(key, path).version)
        except OSError as exc:
            if is_disk_error(exc):  # writing the copy: this machine's disk refused it
                raise
            raise self._error(exc, key) from exc

    def _upload(self, path: Path, key: str) -> str:
        """Copied by the kernel (``shutil.copyfile``), then hashed from the copy: the sha256 is
        of exactly the bytes stored. Copying through a buffer of ours wrote in large pieces,
        for which the page cache takes large blocks of memory, much slower on virtual machines
        that hand their free memory back to the host (benchmarks/RESULTS.md)."""
        digests: list[str] = []

        def copy(tmp: Path) -> None:
            shutil.copyfile(path, tmp)
            digests.append(sha256_file(tmp))

        self._place(key, copy, if_absent=False)
        return digests[0]

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        return self._place(key, lambda tmp: tmp.write_bytes(data), if_absent)

    def _copy(self, source: str, key: str) -> None:
        """A hard link where the file system allows (objects are replaced by rename, never
        changed in place, so the two names can share the bytes), else a copy."""
        origin = self.path(source)
        if not origin.is_file():
            raise NotFoundError(f"{self.uri(source)} does not exist", self.uri(source))

        def fill(tmp: Path) -> None:
            tmp.unlink()
            try:
                os.link(origin, tmp)
            except OSError:
                shutil.copyfile(origin, tmp)

        self._place(key, fill, if_absent=False)

    def _delete(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error(exc, key) from exc

    def _make_parents(self, target: Path, key: str) -> None:
        """The directories of ``target``; an object whose key is one of their names is in
        the way (a file system cannot hold both ``a`` and ``a/b``)."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            parent = target.parent
            while parent != self.root and not parent.is_file():
                parent = parent.parent
            raise self._conflict(key, parent.relative_to(self.root).as_posix()) from None

    def _conflict(self, key: str, blocking: str) -> KeyConflictError:
        what = "a directory of other objects" if blocking == key else "an object"
        return KeyConflictError(
            f"{self.uri(key)} cannot be stored: {self.uri(blocking)} is {what}, and a file "
            "system cannot hold both a path and paths under it",
            self.uri(key),
        )

    def _temp_for(self, key: str, data: bytes = b"") -> tuple[Path, Path]:
        """The path of ``key`` and a new temporary file beside it holding ``data`` (created
        exclusively, readable by its owner only, as ``mkstemp`` makes them): one open."""
        target = self.path(key)
        self._make_parents(target, key)
        while True:
            tmp = target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            break
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: no temporary file left behind
            raise
        finally:
            os.close(fd)
        return target, tmp

    def _into_place(
        self, tmp: Path, target: Path, key: str, if_absent: bool, synced: bool = False
    ) -> bool:
        """fsync ``tmp`` (unless it is ``synced`` already), then rename it into place (or
        hard-link it, which fails if the target exists, for ``if_absent``); the temporary name
        is gone after."""
        try:
            if not synced:
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
            if not if_absent:
                if target.is_dir():
                    raise self._conflict(key, key)
                os.replace(tmp, target)
                return True
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _place(self, key: str, fill: Callable[[Path], object], if_absent: bool) -> bool:
        """Write a unique temporary file beside the target, fsync, then put it in place."""
        try:
            target, tmp = self._temp_for(key)
            try:
                fill(tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return self._into_place(tmp, target, key, if_absent)
        except OSError as exc:
            raise self._error(exc, key) from exc

    # --- many small files at once ---------------------------------------------------------------

    def batch_max_size(self) -> int:
        return BATCH_MAX_SIZE

    def download_batch(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        """One file after another from one thread (many threads would spend their time
        waiting for each other on files this small)."""
        for item in wanted:
            try:
                self.place(item, *self._read_as_of(item.expected.key))
            except Exception as exc:
                finished(item, exc)
                return
            finished(item, None)

    def upload_stream(
        self,
        take: Callable[[], Sequence[U] | None],
        finished: Callable[[U, str | Exception], None],
    ) -> None:
        """Each batch is written to temporary files from this thread, made durable (one
        syncfs for a large batch; else a fsync each, from a few threads at once so that the
        file system commits them together), then renamed into place."""
        from concurrent.futures import ThreadPoolExecutor  # imports logging: not at start-up

        with ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="bt-fsync") as pool:
            while (batch := take()) is not None:
                written = [self._write_temp(item) for item in batch]
                synced = len(batch) >= SYNCFS_MIN_FILES and syncfs(self.root)
                settle = functools.partial(self._settle, synced=synced)
                outcomes = (
                    map(settle, batch, written) if synced else pool.map(settle, batch, written)
                )
                for item, outcome in zip(batch, outcomes, strict=True):
                    finished(item, outcome)

    def _write_temp(self, item: Upload) -> tuple[Path, Path, str] | Exception:
        """``item`` copied to a temporary file beside its key: (target, temporary file,
        sha256), or why not (an error of the source file as it is: the caller tells a file
        that is gone from a store that failed)."""
        try:
            data = item.path.read_bytes()
        except OSError as exc:
            return exc
        try:
            target, tmp = self._temp_for(item.key, data)
        except StoreError as exc:
            return exc
        except OSError as exc:
            return self._error(exc, item.key)
        return target, tmp, hashlib.sha256(data).hexdigest()

    def _settle(
        self, item: Upload, written: tuple[Path, Path, str] | Exception, synced: bool
    ) -> str | Exception:
        if isinstance(written, Exception):
            return written
        target, tmp, digest = written
        try:
            self._into_place(tmp, target, item.key, if_absent=False, synced=synced)
        except StoreError as exc:
            return exc
        except OSError as exc:
            return self._error(exc, item.key)
        return digest


def _version(stat: os.stat_result) -> str:
    """A file's version: another file renamed into its place has another (its inode differs
    even where the clock gave both the same time)."""
    return f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}"


@functools.cache
def _syncfs_call() -> Callable[[int], int] | None:
    found: Callable[[int], int] | None = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    return found


def syncfs(directory: Path) -> bool:
    """Write out every dirty page of the file system holding ``directory`` (Linux's
    ``syncfs(2)``, which reports a write-back error since 5.8); False where it is not there
    or fails, and the caller makes each file durable itself."""
    call = _syncfs_call()
    if call is None:
        return False
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return bool(call(fd) == 0)
    finally:
        os.close(fd)
