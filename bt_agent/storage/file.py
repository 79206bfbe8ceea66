"""``file://``: a directory on a local or mounted file system."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from bt_agent.errors import RecordNotFoundError, StoreError
from bt_agent.storage.base import ObjectInfo


def _safe_parts(key: str) -> list[str]:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise StoreError(f"refusing object key {key!r}: it would escape the store")
    return parts


class FileStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = self.root.absolute().as_uri()

    def path(self, key: str) -> Path:
        return self.root.joinpath(*_safe_parts(key))

    def read_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise RecordNotFoundError(f"{self.url}/{key} does not exist") from None
        except OSError as exc:
            raise StoreError(f"cannot read {self.url}/{key}: {exc.strerror}") from exc

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        target = self.path(key)
        return self._place(target, lambda tmp: tmp.write_bytes(data), if_absent)

    def upload_file(self, path: Path, key: str) -> None:
        self._place(self.path(key), lambda tmp: shutil.copyfile(path, tmp), False)

    def _place(self, target: Path, fill: Callable[[Path], object], if_absent: bool) -> bool:
        """Write into a unique temporary file beside ``target``, fsync, then rename (or link,
        which fails if ``target`` exists, for ``if_absent``)."""
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            tmp = Path(name)
            try:
                fill(tmp)
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                if not if_absent:
                    os.replace(tmp, target)
                    return True
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    return False
                return True
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc.strerror or exc}") from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        start = base.joinpath(*_safe_parts(prefix.rsplit("/", 1)[0])) if "/" in prefix else base
        found = []
        for dirpath, _, filenames in os.walk(start):
            for name in filenames:
                if name.startswith(".") and name.endswith(".tmp"):
                    continue  # another writer's file in progress
                full = Path(dirpath, name)
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    found.append(ObjectInfo(key, full.stat().st_size))
        yield from sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()
