"""Many small S3 objects moved from one thread: a few keep-alive connections driven by asyncio.

Moved a thread each, thousands of small objects cost more in hand-offs of the GIL and thread
wake-ups than in the requests themselves (5,000 x 4 KiB GETs from SeaweedFS over 8 threads of
``http.client``: 3.4 CPU-s; one thread and an event loop: 0.7 CPU-s). Only plain GETs and PUTs of
one object go this way, signed as the direct path signs them (bt_agent.storage.s3_direct).

- :class:`BatchGet` fetches a finite batch for staging. An error answer, a redirect, a body
  larger than listed or a lost connection ends the batch: the caller takes what is left through
  the one-object path, which retries, waits out outages, falls back to botocore and reports.
- :class:`PutStream` uploads files handed to it while it runs (the checkpoint sidecar's small
  files); each outcome, an error included, goes back to the caller, which retries.

A connection the server closed while idle is replaced once before a request counts as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from bt_agent.storage.base import Finished, Upload, Wanted
from bt_agent.storage.budget import ByteBudget
from bt_agent.storage.s3_direct import DirectS3, NetworkError
from bt_agent.storage.sigv4 import canonical_path

#: Connections at once: more requests in flight cost the server less CPU each.
CONNECTIONS = 16
#: What each connection's reader buffers before it stops reading the socket.
READ_BUFFER = 64 * 1024
#: How often an upload waiting for the store's memory budget asks again.
BUDGET_POLL_SECONDS = 0.005
U = TypeVar("U", bound=Upload)
T = TypeVar("T")


#: ``asyncio.timeout`` where Python has it (3.11): ``wait_for`` there wraps each request in a
#: task of its own, a cost that thousands of small requests feel.
_TIMEOUT = getattr(asyncio, "timeout", None)


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """``awaitable``'s result, or TimeoutError after ``seconds``."""
    if _TIMEOUT is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with _TIMEOUT(seconds):
        return await awaitable


class Declined(Exception):
    """An answer this path leaves to the one-object path."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class _Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False

    async def exchange(self, request: bytes, body: bytes, max_body: int) -> tuple[Answer, bool]:
        """The answer to ``request``, and whether the connection may carry another."""
        self.used = True
        self.writer.write(request + body if body else request)  # one send for small bodies
        if body:
            await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length")
        if length is None or "transfer-encoding" in headers:
            raise Declined("an answer without a Content-Length")
        if int(length) > max_body:
            raise Declined(f"an answer of {length} bytes, larger than expected")
        answer = await self.reader.readexactly(int(length))
        keep = headers.get("connection", "").lower() != "close"
        return Answer(status, headers, answer), keep

    def close(self) -> None:
        self.writer.close()


class Requests:
    """Signed single-object requests of one bucket over connections this class opens."""

    def __init__(self, direct: DirectS3, object_key: Callable[[str], str]) -> None:
        self.direct = direct
        self.object_key = object_key
        host, _, port = direct.endpoint.host.rpartition(":")
        tls = direct.endpoint.scheme == "https"
        if not host or not port.isdigit():  # no port in the host: the scheme's own
            host, port = direct.endpoint.host, ("443" if tls else "80")
        self.host, self.port, self.tls = host.strip("[]"), int(port), tls

    async def send(
        self,
        connection: _Connection | None,
        method: str,
        key: str,
        headers: dict[str, str],
        body: bytes = b"",
        max_body: int = READ_BUFFER,
    ) -> tuple[Answer, _Connection | None]:
        """The answer, and the connection to use next (None: open a new one)."""
        request = self._head(method, key, headers, body)
        for attempt in (0, 1):
            if connection is None:
                connection = await self._connect()
            try:
                answer, keep = await _within(
                    connection.exchange(request, body, max_body), self.direct.timeout
                )
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                reused = connection.used and attempt == 0
                connection.close()
                connection = None
                if not reused:
                    raise NetworkError(f"connection lost ({type(exc).__name__})") from exc
                continue
            except (OSError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError) as exc:
                connection.close()
                raise NetworkError(type(exc).__name__) from exc
            except BaseException:
                connection.close()
                raise
            if not keep:
                connection.close()
                connection = None
            return answer, connection
        raise AssertionError("unreachable")

    async def _connect(self) -> _Connection:
        context = self.direct.tls_context() if self.tls else None
        try:
            reader, writer = await _within(
                asyncio.open_connection(
                    self.host,
                    self.port,
                    ssl=context,
                    server_hostname=self.host if context else None,
                    limit=READ_BUFFER,
                ),
                self.direct.timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise NetworkError(f"cannot connect ({type(exc).__name__})") from exc
        return _Connection(reader, writer)

    def _head(self, method: str, key: str, headers: dict[str, str], body: bytes) -> bytes:
        endpoint = self.direct.endpoint
        path = canonical_path(f"{endpoint.base_path}/{self.object_key(key)}")
        signed = self.direct.signer.sign(method, endpoint.host, path, headers)
        lines = [f"{method} {path} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in signed.items()]
        if body or method == "PUT":
            lines.append(f"content-length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class _Batch:
    wanted: Iterator[Wanted]
    finished: Finished
    failed: bool = False
    errors: list[BaseException] = field(default_factory=list)

    def next(self) -> Wanted | None:
        if self.failed:
            return None
        return next(self.wanted, None)


class BatchGet:
    """GETs of many objects of one bucket, ``connections`` at a time, placed by ``place``."""

    def __init__(
        self,
        direct: DirectS3,
        object_key: Callable[[str], str],
        place: Callable[[Wanted, Answer], None],
        max_size: int,
        connections: int = CONNECTIONS,
    ) -> None:
        self.requests = Requests(direct, object_key)
        self.place = place
        self.max_size = max_size
        self.connections = connections

    def run(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        """Fetch each of ``wanted`` to its destination; see ObjectStore.download_batch."""
        batch = _Batch(wanted, finished)
        asyncio.run(self._run(batch))
        if batch.errors:
            raise batch.errors[0]

    async def _run(self, batch: _Batch) -> None:
        workers = [asyncio.ensure_future(self._worker(batch)) for _ in range(self.connections)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self, batch: _Batch) -> None:
        connection: _Connection | None = None
        try:
            while True:
                try:
                    item = batch.next()
                except BaseException as exc:  # the caller's iterator: a stop request, say
                    batch.failed = True
                    batch.errors.append(exc)
                    return
                if item is None:
                    return
                try:
                    connection = await self._fetch(item, connection)
                except asyncio.CancelledError:
                    batch.finished(item, InterruptedError("batch cancelled"))
                    raise
                except Exception as exc:
                    batch.failed = True
                    connection = None
                    batch.finished(item, exc)
                    continue
                batch.finished(item, None)
        finally:
            if connection is not None:
                connection.close()

    async def _fetch(self, item: Wanted, connection: _Connection | None) -> _Connection | None:
        """Fetch and place ``item``; the connection to use next."""
        try:
            answer, connection = await self.requests.send(
                connection, "GET", item.expected.key, {}, max_body=self.max_size
            )
        except NetworkError as exc:
            raise Declined(str(exc)) from exc
        if answer.status != 200:
            raise Declined(f"HTTP {answer.status}")
        self.place(item, answer)
        return connection


class _Handed(Generic[U]):
    """The files an upload stream has taken and not yet told of, so that a stream that fails
    tells each of them its error instead of losing it. Taken on the feed's thread; told, and
    failed, on the stream's."""

    def __init__(self, finished: Callable[[U, str | Exception], None]) -> None:
        self._finished = finished
        self._lock = threading.Lock()
        self._open: dict[int, U] = {}  # id -> file: files need not be hashable
        self._error: Exception | None = None

    def took(self, items: Sequence[U]) -> bool:
        """Record ``items`` as taken; False (each told the error) once the stream has failed."""
        with self._lock:
            error = self._error
            if error is None:
                self._open.update((id(item), item) for item in items)
                return True
        for item in items:
            self._finished(item, error)
        return False

    def tell(self, item: U, outcome: str | Exception) -> None:
        self._finished(item, outcome)  # if this raises, the file stays open: failed below
        with self._lock:
            self._open.pop(id(item), None)

    def fail(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, Exception) else RuntimeError(f"upload stream: {exc!r}")
        with self._lock:
            self._error = error
            left, self._open = list(self._open.values()), {}
        for item in left:
            with contextlib.suppress(Exception):  # the next one is told all the same
                self._finished(item, error)


class PutStream(Generic[U]):
    """Uploads of small files, ``connections`` at a time, for as long as ``take()`` (called
    on a thread of its own, blocking until it has files; None when there will be no more)
    hands files over. ``finished(upload, sha256 or error)`` is told of each, once, from the
    loop's thread (or, after the stream failed, from the thread that hit the failure); the
    file's content is held within the store's ``budget`` while it is sent."""

    def __init__(
        self,
        direct: DirectS3,
        object_key: Callable[[str], str],
        headers: Callable[[str], dict[str, str]],
        check: Callable[[Upload, Answer], None],
        budget: ByteBudget,
        max_size: int,
        connections: int = CONNECTIONS,
    ) -> None:
        self.requests = Requests(direct, object_key)
        self.headers = headers  # sha256 -> the PUT's headers (checksum, metadata)
        self.check = check  # raises the store's error for an answer that is not a success
        self.budget = budget
        self.max_size = max_size
        self.connections = connections

    def run(
        self,
        take: Callable[[], Sequence[U] | None],
        finished: Callable[[U, str | Exception], None],
    ) -> None:
        """Upload what ``take()`` hands over until it says None. Every file taken is told
        once; if the stream itself fails, the files taken and not yet told are told its
        error (the caller retries them) before the error is raised."""
        handed = _Handed(finished)
        try:
            asyncio.run(self._run(take, handed))
        except BaseException as exc:
            handed.fail(exc)
            raise

    async def _run(self, take: Callable[[], Sequence[U] | None], handed: _Handed[U]) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[U | None] = asyncio.Queue()

        def deliver(items: Sequence[U] | None) -> None:
            for item in items if items is not None else [None] * self.connections:
                inbox.put_nowait(item)

        def feed() -> None:
            while True:
                items = take()
                if not handed.took(items or ()):
                    return  # the stream failed: these were told its error
                try:
                    loop.call_soon_threadsafe(deliver, items)
                except RuntimeError:  # the loop has ended (failed): told by run()
                    return
                if items is None:
                    return

        threading.Thread(target=feed, name="bt-upload-feed", daemon=True).start()
        await asyncio.gather(*(self._worker(inbox, handed) for _ in range(self.connections)))

    async def _worker(self, inbox: asyncio.Queue[U | None], handed: _Handed[U]) -> None:
        connection: _Connection | None = None
        while (item := await inbox.get()) is not None:
            outcome: str | Exception
            try:
                outcome, connection = await self._put(item, connection)
            except Exception as exc:
                outcome, connection = exc, None
            handed.tell(item, outcome)
        if connection is not None:
            connection.close()

    async def _put(
        self, item: Upload, connection: _Connection | None
    ) -> tuple[str, _Connection | None]:
        with open(item.path, "rb") as handle:
            data = handle.read(self.max_size + 1)
        if len(data) > self.max_size:
            raise Declined(f"{item.path} grew past {self.max_size} bytes; sent another way")
        while (taken := self.budget.try_acquire(len(data))) is None:
            await asyncio.sleep(BUDGET_POLL_SECONDS)
        try:
            sha256 = hashlib.sha256(data).hexdigest()
            answer, connection = await self.requests.send(
                connection, "PUT", item.key, self.headers(sha256), data
            )
        finally:
            self.budget.release(taken)
        self.check(item, answer)
        return sha256, connection
