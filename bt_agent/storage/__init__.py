"""One small interface over the places bytes are kept; each backend imports its SDK lazily."""

from __future__ import annotations

from bt_agent.storage.base import ObjectInfo, ObjectStore, UploadResult
from bt_agent.storage.file import FileStore
from bt_agent.storage.registry import open_store

__all__ = ["FileStore", "ObjectInfo", "ObjectStore", "UploadResult", "open_store"]
