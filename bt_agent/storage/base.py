"""The storage interface: a small core per backend, everything else derived here once.

A backend implements listing, stat, ranged reads, whole-object download into a given file and,
when writable, upload, small writes and delete; it turns its SDK's errors into the typed errors
of :mod:`bt_agent.errors` at that boundary. This class adds retries, atomic placement (a
process-unique ``*.incomplete`` file beside the destination, or one of the destination's own that
a later process may take up, renamed into place), size and checksum verification, and key
safety.
"""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeGuard, TypeVar
from urllib.parse import urlsplit

from bt_agent.errors import ChangedError, IntegrityError, NotFoundError, StoreError
from bt_agent.storage.keys import check_key, join_key
from bt_agent.storage.retry import DEFAULT_POLICY, Attempt, RetryPolicy, once, retry

CHUNK = 1024 * 1024
#: How the name of a partial file that a later process may take up ends (:func:`resumable_path`).
RESUMABLE = ".resumable.incomplete"
#: ... and that of its record of what is written (:func:`ranges_record`).
RANGES_RECORD = ".ranges"
#: What writing a file on this machine's disk fails with: the disk's errors, never a store's,
#: and no wait for a store mends them.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
_partials = itertools.count()  # names this process's partial files apart (with its pid)
U = TypeVar("U", bound="Upload")
S = TypeVar("S", bound="ObjectStore")


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (relative to the store's root), size, version and, when the backend
    knows it, the sha256 of its content."""

    key: str
    size: int
    version: str | None = None  # etag, generation or commit-pinned blob id
    sha256: str | None = None


@dataclass(frozen=True)
class UploadResult:
    key: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Fetched:
    """What a backend's download learned on the way: the sha256 the object claims (metadata),
    the one computed from the bytes written, when it computed one, and the version (ETag,
    generation) the bytes are of, where the backend knows it."""

    claimed_sha256: str | None = None
    computed_sha256: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class Wanted:
    """One object of a batch download (:meth:`ObjectStore.download_batch`): where it goes, and
    what the listing said of it."""

    destination: Path
    expected: ObjectInfo
    mode: int = 0o644  # the placed file's permissions


@dataclass(frozen=True)
class Upload:
    """One file of an upload stream (:meth:`ObjectStore.upload_stream`)."""

    path: Path
    key: str


#: Told once of each object a batch download took: None when it is in place, else why not.
Finished = Callable[[Wanted, Exception | None], None]


Page = list[ObjectInfo]  # one page of a listing


def partial_path(destination: Path) -> Path:
    """A name beside ``destination``, unique to this process and call, for its partial file."""
    return destination.with_name(f"{partial_prefix(destination)}{next(_partials)}.incomplete")


def partial_prefix(destination: Path) -> str:
    """How the names of this process's partial files of ``destination`` begin."""
    return f".{destination.name}.{os.getpid()}."


def resumable_path(destination: Path) -> Path:
    """The partial file of ``destination`` that a later process may take up, where the caller
    alone writes ``destination`` (a node cache entry, under its lock)."""
    return destination.with_name(f".{destination.name}{RESUMABLE}")


def is_resumable(partial: Path) -> bool:
    """Whether ``partial`` is a partial file that a later process may take up."""
    return partial.name.endswith(RESUMABLE)


def ranges_record(partial: Path) -> Path:
    """Where a download in ranges into ``partial`` records what of it is written."""
    return partial.with_name(f"{partial.name}{RANGES_RECORD}")


def _remove_partial(partial: Path) -> None:
    """``partial`` and its record of ranges, where there are."""
    partial.unlink(missing_ok=True)
    ranges_record(partial).unlink(missing_ok=True)


def files_only(found: Iterable[ObjectInfo]) -> list[ObjectInfo]:
    """``found`` without folders' placeholders: the empty objects a console's "create folder"
    leaves (``name/``), which some engines list without their ``/``, as ``name``, beside what
    the folder holds, and the one of the listing's own folder (its key empty). An empty
    ``name`` nothing is listed under stays a file."""
    found = list(found)
    folders = {info.key[: at + 1] for info in found for at in _slashes(info.key)}
    return [
        info
        for info in found
        if not (
            info.size == 0 and (not info.key or info.key.endswith("/") or f"{info.key}/" in folders)
        )
    ]


def _slashes(key: str) -> Iterator[int]:
    """Where ``key`` has a ``/``, before its end."""
    at = key.find("/")
    while 0 <= at < len(key) - 1:
        yield at
        at = key.find("/", at + 1)


def is_disk_error(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` is this machine's disk refusing a write (full, over a quota or the file
    size limit, read-only): none of a store's errors is one."""
    return isinstance(exc, OSError) and not isinstance(exc, StoreError) and exc.errno in DISK_ERRNOS


def is_http_url(url: str) -> bool:
    """Whether ``url`` is an ``http://`` or ``https://`` URL of a host (an endpoint's setting)."""
    parts = urlsplit(url)
    spaced = any(character.isspace() for character in url)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not spaced


class HashingReader:
    """Wraps a file: every byte read passes through sha256 once."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.position = 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        self.position += len(data)
        return data

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Only a no-op seek: going back would hash bytes twice (a retry starts anew)."""
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self.position + offset}.get(whence)
        if target != self.position:
            raise io.UnsupportedOperation("a hashing reader reads forward only")
        return self.position


def sha256_file(path: Path) -> str:
    """The file's sha256, read through one reused buffer (no fresh memory per chunk)."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


class ObjectStore(ABC):
    """Keys are ``/``-separated paths relative to the store's root (``url``)."""

    url: str
    policy: RetryPolicy = DEFAULT_POLICY
    #: Why the store copies nothing inside itself (:meth:`copy` refuses, the caller uploads
    #: instead); empty where it copies.
    copy_refused = ""

    # --- the core, per backend ---------------------------------------------------------------

    @abstractmethod
    def _list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def _stat(self, key: str) -> ObjectInfo:
        """The object's info; :class:`NotFoundError` if there is none."""

    @abstractmethod
    def _read_range(self, key: str, start: int, length: int) -> bytes: ...

    def _list_pages(self, prefix: str) -> Iterator[Page]:
        """What :meth:`_list` finds, a page at a time, each fetched only once the one before
        is taken (by default, one page)."""
        yield self._list(prefix)

    def _read(self, key: str) -> bytes:
        """A whole object, in one request where the backend can (by default, its size first)."""
        info = self._stat(key)
        data = self._read_range(key, 0, info.size) if info.size else b""
        if len(data) != info.size:
            raise IntegrityError(
                f"{self.uri(key)}: read {len(data)} of {info.size} bytes", self.uri(key)
            )
        return data

    @abstractmethod
    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """Write the whole object into ``target``, creating it or replacing what an earlier
        attempt left there. ``expected`` is what the caller knows of it (from a listing: its
        size, and the version a backend that can should ask for), else None."""

    def _upload(self, path: Path, key: str) -> str:
        """Store the file's content, sending a checksum the service verifies where it can;
        return its sha256, computed while reading."""
        raise self._read_only_error(key)

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        raise self._read_only_error(key)

    def _delete(self, key: str) -> None:
        raise self._read_only_error(key)

    def _copy(self, source: str, key: str) -> None:
        """Copy the object ``source`` to ``key`` within the store, without the bytes passing
        through here; :class:`NotImplementedError` where the store cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy objects")

    def batch_max_size(self) -> int:
        """Objects up to this size may go through :meth:`download_batch`; 0 where this store
        has no batch path."""
        return 0

    def in_batches(self, size: int) -> bool:
        """Whether an object or file of ``size`` bytes goes through this store's batch paths
        (:meth:`download_batch`, :meth:`upload_stream`): never where it has none."""
        limit = self.batch_max_size()
        return limit > 0 and size <= limit

    def download_batch(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        """Fetch many small objects as :meth:`download` would, without its retries: the caller
        takes whatever is not in place through :meth:`download`. Each object taken from
        ``wanted`` is told to ``finished`` once; after a failure no more are taken."""
        raise NotImplementedError(f"{type(self).__name__} has no batch downloads")

    def upload_stream(
        self,
        take: Callable[[], Sequence[U] | None],
        finished: Callable[[U, str | Exception], None],
    ) -> None:
        """Upload files of at most :meth:`batch_max_size` bytes as :meth:`upload_file` would,
        without its retries, for as long as ``take()`` (called on a thread of its own; it
        blocks until it has files) hands some over; None ends the stream. ``finished`` is told
        of each: the sha256 of what was stored, or the typed error."""
        raise NotImplementedError(f"{type(self).__name__} has no upload stream")

    def engine_threads(self) -> list[int]:
        """The native ids of threads outside Python that make this store's requests (none for
        most backends): the checkpoint sidecar gives them the low priority of its own."""
        return []

    def close(self) -> None:  # noqa: B027 (most backends hold nothing to let go of)
        """Let go of connections and threads; the store is not used after."""

    def halt(self) -> None:  # noqa: B027 (most backends' transfers end with their call)
        """For a process that is stopping: the downloads in ranges under way end at their next
        piece (:class:`InterruptedError`, their partial files left as a failure leaves them),
        and none starts after, so that no request of the engine is out when the process
        ends (an interpreter that ends with one there may crash on the way out); multipart
        uploads under way take no more parts (one with more to send fails, and the engine
        aborts it) and none begins after, so that none is begun behind :meth:`abort_uploads`."""

    def wait_uploads(self) -> bool:
        """Wait until none of this store's multipart uploads is under way; whether any was.
        After :meth:`halt` each ends once the parts on their way are answered (a file's last
        parts all go at once): what a stopping process leaves begun after that is all that
        :meth:`abort_uploads` has to take (one whose beginning was on its way as it listed
        them; a part that landed after its upload's abort, which S3 may keep)."""
        return False

    def abort_uploads(self, prefix: str) -> int:
        """Uploads begun under ``prefix`` that were never completed and whose parts the store
        keeps, aborted; how many. Only S3's multipart uploads are kept so (Azure drops
        uncommitted blocks, and GCS resumable sessions, after a week): the others have none."""
        return 0

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- derived once -----------------------------------------------------------------------

    def uri(self, key: str = "") -> str:
        return join_key(self.url.rstrip("/"), key) if key else self.url

    def pinned_uri(self) -> str:
        """The source as its listing reads it: by default :meth:`uri`; a store of revisions
        names the one it pinned (``hf://owner/repo@<commit>``)."""
        return self.uri()

    def identity(self, info: ObjectInfo) -> str:
        """What, with its key, version and size, names the content of the object ``info``
        lists (a node cache's entry): by default the store's URL."""
        return self.url

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix``, in key order, without folders' placeholders."""
        found = retry(lambda: self._list(prefix), self.policy)
        return sorted(files_only(found), key=lambda info: info.key)

    def stat(self, key: str) -> ObjectInfo:
        check_key(key)
        return retry(lambda: self._stat(key), self.policy)

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except NotFoundError:
            return False
        return True

    def read_range(self, key: str, start: int, length: int) -> bytes:
        check_key(key)
        if length <= 0:
            return b""
        return retry(lambda: self._read_range(key, start, length), self.policy)

    def list_pages(self, prefix: str = "") -> Iterator[Page]:
        """The objects under ``prefix`` in key order, a page at a time, each asked of the store
        only once the one before is used up: a caller that stops early makes fewer requests.
        Not retried (a caller that needs every object and retries uses :meth:`list`); folders'
        placeholders left out as there, those of one page."""
        for page in self._list_pages(prefix):
            yield sorted(files_only(page), key=lambda info: info.key)

    def read_bytes(self, key: str) -> bytes:
        check_key(key)
        return retry(lambda: self._read(key), self.policy)

    def download(
        self,
        key: str,
        destination: Path,
        expected: ObjectInfo | None = None,
        attempt: Attempt = once,
        resumable: bool = False,
    ) -> Path:
        """Fetch ``key`` to ``destination`` atomically: a unique ``*.incomplete`` file beside it,
        verified (size always; sha256 when known), then renamed into place. The store's own
        retries are made through ``attempt`` (which may make them again, as an outage is
        waited out) into the same partial file, so each attempt fetches only what the ones
        before did not bring whole where the backend can tell.

        ``resumable``, where the caller alone writes ``destination``: the partial file has a
        name of its own (:func:`resumable_path`), and one that a download stopped or failed
        in ranges leaves, with its record of what is written, is taken up by the next download
        of the same object at the same version, in this process or another."""
        check_key(key)
        if not destination.parent.is_dir():
            destination.parent.mkdir(parents=True, exist_ok=True)
        partial = resumable_path(destination) if resumable else partial_path(destination)
        try:
            if expected is not None and expected.size == 0:  # listed empty: nothing to fetch
                partial.touch()
                fetched = Fetched(version=expected.version)
            else:
                fetched = attempt(
                    lambda: retry(lambda: self._download(key, partial, expected), self.policy)
                )
        except BaseException as exc:
            if not (resumable and ranges_record(partial).exists()):
                _remove_partial(partial)
            if is_disk_error(exc) and exc.filename is None:  # which disk refused it
                exc.filename = str(partial)
            raise
        try:
            self._verify(key, partial, expected, fetched)
            os.replace(partial, destination)
        finally:
            _remove_partial(partial)
        return destination

    def _verify(self, key: str, path: Path, expected: ObjectInfo | None, fetched: Fetched) -> None:
        self._check(
            key,
            path.stat().st_size,
            expected,
            fetched,
            lambda: fetched.computed_sha256 or sha256_file(path),
        )

    def _check(
        self,
        key: str,
        size: int,
        expected: ObjectInfo | None,
        fetched: Fetched,
        actual_sha256: Callable[[], str],
    ) -> None:
        """The version and size the listing gave, and the sha256 it or the object's metadata
        gave."""
        self.check_version(key, expected, fetched.version)
        if expected is not None and size != expected.size:
            raise IntegrityError(
                f"{self.uri(key)}: got {size} bytes, expected {expected.size}", self.uri(key)
            )
        wanted = (expected.sha256 if expected else None) or fetched.claimed_sha256
        if wanted is None:
            return
        actual = actual_sha256()
        if actual != wanted:
            raise IntegrityError(
                f"{self.uri(key)}: sha256 {actual} does not match {wanted}, the one the source "
                "gives for it: its copy, or what came of it, is damaged (nothing of it was kept)",
                self.uri(key),
            )

    def check_version(self, key: str, expected: ObjectInfo | None, found: str | None) -> None:
        """:class:`ChangedError` where the store has ``found``, a version other than the one
        listed (``expected``'s): the object was replaced since."""
        pinned = expected.version if expected is not None else None
        if pinned and found and found != pinned:
            raise self.changed(key, pinned, found)

    def changed(self, key: str, pinned: str = "", now: str = "") -> ChangedError:
        """The error for ``key`` found at a version other than ``pinned``, the listed one."""
        versions = f" (listed at version {pinned}, now {now})" if pinned and now else ""
        return ChangedError(
            f"{self.uri(key)} changed after it was listed{versions}: something is rewriting "
            "the source; run again once it is complete",
            self.uri(key),
        )

    def place(self, wanted: Wanted, body: bytes | memoryview, fetched: Fetched) -> None:
        """Put a whole object's ``body``, fetched by a batch, at its destination, verified
        first (``fetched``: what its answer claimed), then written to a partial file renamed
        into place."""
        key = wanted.expected.key
        self._check(
            key, len(body), wanted.expected, fetched, lambda: hashlib.sha256(body).hexdigest()
        )
        partial = partial_path(wanted.destination)
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, wanted.mode)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(partial, wanted.destination)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    def upload_file(self, path: Path, key: str) -> UploadResult:
        check_key(key)
        size = path.stat().st_size
        digest = retry(lambda: self._upload(path, key), self.policy)
        return UploadResult(key, size, digest)

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Store ``data``; with ``if_absent`` only where no object is (True if written)."""
        check_key(key)
        return retry(lambda: self._put(key, data, if_absent), self.policy)

    def delete(self, key: str) -> None:
        check_key(key)
        retry(lambda: self._delete(key), self.policy)

    def copy(self, source: str, key: str) -> None:
        """Copy ``source`` to ``key`` inside the store (:class:`NotFoundError` if ``source``
        is not there; :class:`NotImplementedError` where the store cannot copy)."""
        check_key(source)
        check_key(key)
        if self.copy_refused:
            raise NotImplementedError(self.copy_refused)
        retry(lambda: self._copy(source, key), self.policy)

    def _read_only_error(self, key: str) -> StoreError:
        return StoreError(f"{self.uri(key)}: this source is read-only", self.uri(key))
