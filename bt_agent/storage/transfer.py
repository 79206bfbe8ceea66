"""Whole trees between a local directory and a store, with a fixed pool of workers.

Large files are split into parts by the backend, which bounds its parts in flight; here each
worker moves one file at a time, so memory stays bounded whatever the tree's size.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bt_agent.storage.base import ObjectInfo, ObjectStore, UploadResult
from bt_agent.storage.keys import join_key, local_path, relative_key

DEFAULT_WORKERS = 16


def local_files(directory: Path) -> list[Path]:
    """Regular files under ``directory`` (symlinks and special files are not followed)."""
    found = []
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return sorted(found)


def upload_tree(
    store: ObjectStore, directory: Path, prefix: str = "", workers: int = DEFAULT_WORKERS
) -> list[UploadResult]:
    files = local_files(directory)

    def one(path: Path) -> UploadResult:
        return store.upload_file(path, join_key(prefix, path.relative_to(directory).as_posix()))

    with ThreadPoolExecutor(workers, thread_name_prefix="bt-upload") as pool:
        return list(pool.map(one, files))


def download_tree(
    store: ObjectStore,
    prefix: str,
    directory: Path,
    workers: int = DEFAULT_WORKERS,
    objects: list[ObjectInfo] | None = None,
) -> list[Path]:
    """Every object under ``prefix`` into ``directory``, keeping the relative layout."""
    listed = store.list(prefix) if objects is None else objects

    def one(info: ObjectInfo) -> Path:
        target = local_path(directory, relative_key(prefix, info.key) if prefix else info.key)
        return store.download(info.key, target, info)

    with ThreadPoolExecutor(workers, thread_name_prefix="bt-download") as pool:
        return list(pool.map(one, listed))
