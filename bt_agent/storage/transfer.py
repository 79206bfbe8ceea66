"""Whole trees between a local directory and a store, the way the agent moves its own files:
small files through the store's batch paths where it has them (as staging and the checkpoint
sidecar do), the others with a fixed pool of workers, one file each.

Large files are split into parts by the backend, which bounds its parts in flight; so memory
stays bounded whatever the tree's size. A small file the batch could not move is moved again
one by one, with the retries of :meth:`ObjectStore.download` and :meth:`ObjectStore.upload_file`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bt_agent.storage.base import ObjectInfo, ObjectStore, Upload, UploadResult, Wanted
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
    files = {
        join_key(prefix, path.relative_to(directory).as_posix()): path
        for path in local_files(directory)
    }
    sizes = {key: path.stat().st_size for key, path in files.items()}
    done: dict[str, UploadResult] = {}
    small = [Upload(files[key], key) for key in files if store.in_batches(sizes[key])]
    if small:
        handed = iter([small])

        def stored(upload: Upload, outcome: str | Exception) -> None:
            if isinstance(outcome, str):
                done[upload.key] = UploadResult(upload.key, sizes[upload.key], outcome)

        store.upload_stream(lambda: next(handed, None), stored)
    rest = [key for key in files if key not in done]
    with ThreadPoolExecutor(workers, thread_name_prefix="bt-upload") as pool:
        for result in pool.map(lambda key: store.upload_file(files[key], key), rest):
            done[result.key] = result
    return [done[key] for key in files]


def download_tree(
    store: ObjectStore,
    prefix: str,
    directory: Path,
    workers: int = DEFAULT_WORKERS,
    objects: list[ObjectInfo] | None = None,
) -> list[Path]:
    """Every object under ``prefix`` into ``directory``, keeping the relative layout."""
    listed = store.list(prefix) if objects is None else objects
    targets = {
        info.key: local_path(directory, relative_key(prefix, info.key) if prefix else info.key)
        for info in listed
    }
    for parent in {target.parent for target in targets.values()}:
        parent.mkdir(parents=True, exist_ok=True)
    placed: set[str] = set()
    small = [Wanted(targets[info.key], info) for info in listed if store.in_batches(info.size)]
    if small:

        def finished(wanted: Wanted, error: Exception | None) -> None:
            if error is None:
                placed.add(wanted.expected.key)

        store.download_batch(iter(small), finished)
    rest = [info for info in listed if info.key not in placed]
    with ThreadPoolExecutor(workers, thread_name_prefix="bt-download") as pool:
        list(pool.map(lambda info: store.download(info.key, targets[info.key], info), rest))
    return [targets[info.key] for info in listed]
