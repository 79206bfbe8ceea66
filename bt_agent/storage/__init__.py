"""One small interface over the places bytes are kept; each backend imports its SDK lazily."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from bt_agent.errors import UsageError
from bt_agent.storage.base import ObjectInfo, ObjectStore
from bt_agent.storage.file import FileStore

__all__ = ["FileStore", "ObjectInfo", "ObjectStore", "open_store"]


def open_store(url: str) -> ObjectStore:
    """The store behind ``url``. Only ``file://`` is built in so far."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStore(unquote(parsed.path))
    raise UsageError(f"unsupported store URL {url!r}: use file:///path")
