"""Many files between a local directory and a store, the way the agent moves its own files:
small files through the store's batch paths where it has them (as staging and the checkpoint
sidecar do), the others with a fixed pool of workers, one file each: a store far away makes
each request wait on its round trip, so one after another they would take that many.

Large files are split into parts by the backend, which bounds its parts in flight; so memory
stays bounded whatever the tree's size. A small file the batch could not move is moved again
one by one, with the retries of :meth:`ObjectStore.download` and :meth:`ObjectStore.upload_file`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from bt_agent.storage.base import ObjectInfo, ObjectStore, Upload, UploadResult, Wanted
from bt_agent.storage.flight import DaemonPool, wait_all
from bt_agent.storage.keys import join_key, local_path, relative_key
from bt_agent.storage.retry import Attempt, once

T = TypeVar("T")
DEFAULT_WORKERS = 16
#: Files staging fetches at once, a thread each (a large one in parallel ranges of its own).
FETCH_WORKERS = 8
#: How often a wait for the calls under way looks whether a stop was requested.
STOP_POLL_SECONDS = 0.1
#: The longest a stop waits for the calls under way to end once halted (:func:`each`).
HALT_SECONDS = 2.0
#: Holds while a file is fetched to a path, of a size (a progress report's).
UnderWay = Callable[[Path, int], AbstractContextManager[object]]


def each(
    call: Callable[[T], object],
    items: Sequence[T],
    workers: int,
    name: str,
    stopping: Callable[[], bool] = lambda: False,
    halt: Callable[[], None] = lambda: None,
) -> None:
    """``call`` on every one of ``items``, ``workers`` at once on threads called ``name``.
    After a failure no call starts; the first error is raised once the calls under way have
    ended (none is left writing a file the caller goes on to remove). A stop requested
    (``stopping()``) is raised soon (:class:`InterruptedError`): no call starts after it,
    ``halt()`` makes those under way end (a store's downloads, at their next piece: no
    request of the engine may be out when the process ends), and they are waited for up to
    :data:`HALT_SECONDS`, each leaving at most its partial file (``*.incomplete``), never one
    in place. A large file through a slow link must not hold a stopped agent past its grace
    period."""
    if not items:
        return
    pool = DaemonPool(min(workers, len(items)), name)
    futures = [pool.submit(functools.partial(call, item)) for item in items]
    pool.shutdown()
    while True:
        done, pending = wait(futures, STOP_POLL_SECONDS, FIRST_EXCEPTION)
        if pending and stopping():  # all done: the caller's next look sees the stop
            for future in futures:
                future.cancel()
            halt()
            wait(futures, HALT_SECONDS)
            raise InterruptedError("stop requested")
        if not pending or any(f.exception() for f in done if not f.cancelled()):
            break
    wait_all(futures)


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

    def one(key: str) -> None:
        done[key] = store.upload_file(files[key], key)

    each(one, [key for key in files if key not in done], workers, "bt-upload")
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
    wanted = [
        Wanted(local_path(directory, relative_key(prefix, info.key) if prefix else info.key), info)
        for info in listed
    ]
    download_all(store, wanted, workers)
    return [item.destination for item in wanted]


def download_all(
    store: ObjectStore,
    wanted: list[Wanted],
    workers: int = DEFAULT_WORKERS,
    *,
    stopping: Callable[[], bool] = lambda: False,
    attempt: Attempt = once,
    fetched: Callable[[int], None] = lambda size: None,
    under_way: UnderWay = lambda path, size: contextlib.nullcontext(),
) -> None:
    """Each of ``wanted`` to its destination, verified as :meth:`ObjectStore.download` does:
    the small ones in one batch where the store has a batch path; the others, and any the
    batch could not place, a thread each (a large one in parallel ranges of its own), each
    made through ``attempt`` (:meth:`ObjectStore.download`) and inside
    ``under_way(path, size)``.
    ``fetched(size)`` is told of each once it is in place, from any thread. A stop requested
    (``stopping()``) ends it at once, as :func:`each` says (:class:`InterruptedError`)."""
    for parent in {item.destination.parent for item in wanted}:
        parent.mkdir(parents=True, exist_ok=True)
    batched = [item for item in wanted if store.in_batches(item.expected.size)]
    rest = [item for item in wanted if not store.in_batches(item.expected.size)]
    small = iter(batched)

    def check() -> None:
        if stopping():
            raise InterruptedError("stop requested")

    def taken() -> Iterator[Wanted]:
        for item in small:
            check()
            yield item

    def placed(item: Wanted, error: Exception | None) -> None:
        if error is None:
            fetched(item.expected.size)
        else:
            rest.append(item)  # fetched again below, retried, and its error raised there

    def one(item: Wanted) -> None:
        check()
        info = item.expected
        with under_way(item.destination, info.size):
            store.download(info.key, item.destination, info, attempt)
        fetched(info.size)

    if batched:
        store.download_batch(taken(), placed)
    each(one, rest + list(small), workers, "bt-download", stopping, store.halt)
