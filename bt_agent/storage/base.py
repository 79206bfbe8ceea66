"""The storage interface every backend implements."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class ObjectStore(Protocol):
    """Keys are ``/``-separated relative paths. Writes are atomic: a reader sees the old object,
    the whole new object, or nothing; never part of one."""

    url: str

    def read_bytes(self, key: str) -> bytes:
        """The object's content; raises ``RecordNotFoundError`` if it does not exist."""
        ...

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Store ``data``; with ``if_absent``, only if no object is there. True if written."""
        ...

    def upload_file(self, path: Path, key: str) -> None:
        """Store the content of a local file."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""
        ...

    def exists(self, key: str) -> bool: ...
