"""Many small S3 objects fetched from one thread: a few keep-alive connections driven by asyncio.

Fetched a thread each, thousands of small objects cost more in hand-offs of the GIL and thread
wake-ups than in the requests themselves (5,000 x 4 KiB from SeaweedFS over 8 threads of
``http.client``: 3.4 CPU-s; one thread and an event loop: 0.7 CPU-s). This path only does what
needs nothing but a GET: an error answer, a redirect, a body larger than asked for or a lost
connection ends the batch, and the caller takes what is left through the one-object path, which
retries, waits out outages, falls back to botocore and says what went wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bt_agent.storage.base import Finished, Wanted
from bt_agent.storage.s3_direct import DirectS3
from bt_agent.storage.sigv4 import canonical_path

#: Connections at once: more requests in flight cost the server less CPU each.
CONNECTIONS = 16
#: What each connection's reader buffers before it stops reading the socket.
READ_BUFFER = 64 * 1024


class Declined(Exception):
    """An answer this path leaves to the one-object path."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


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


class _Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False

    async def exchange(self, request: bytes, max_body: int) -> tuple[Answer, bool]:
        """The answer to ``request``, and whether the connection may carry another."""
        self.used = True
        self.writer.write(request)
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
            raise Declined(f"an object of {length} bytes, larger than listed")
        body = await self.reader.readexactly(int(length))
        keep = headers.get("connection", "").lower() != "close"
        return Answer(status, headers, body), keep

    def close(self) -> None:
        self.writer.close()


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
        self.direct = direct
        self.object_key = object_key
        self.place = place
        self.max_size = max_size
        self.connections = connections
        host, _, port = direct.endpoint.host.rpartition(":")
        tls = direct.endpoint.scheme == "https"
        if not host or not port.isdigit():  # no port in the host: the scheme's own
            host, port = direct.endpoint.host, ("443" if tls else "80")
        self.host, self.port, self.tls = host.strip("[]"), int(port), tls

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
        """Fetch and place ``item``; the connection to use next (None: open a new one). A
        connection the server closed while idle is replaced once (a GET may be sent again)."""
        request = self._request(item.expected.key)
        for attempt in (0, 1):
            if connection is None:
                connection = await self._connect()
            try:
                answer, keep = await asyncio.wait_for(
                    connection.exchange(request, self.max_size), self.direct.timeout
                )
                break
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                reused = connection.used and attempt == 0
                connection.close()
                connection = None
                if not reused:
                    raise Declined(f"connection lost: {type(exc).__name__}") from exc
            except BaseException:
                connection.close()
                raise
        else:
            raise AssertionError("unreachable")
        if not keep:
            connection.close()
            connection = None
        if answer.status != 200:
            raise Declined(f"HTTP {answer.status}")
        self.place(item, answer)
        return connection

    async def _connect(self) -> _Connection:
        context = self.direct.tls_context() if self.tls else None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                self.host,
                self.port,
                ssl=context,
                server_hostname=self.host if context else None,
                limit=max(READ_BUFFER, self.max_size),
            ),
            self.direct.timeout,
        )
        return _Connection(reader, writer)

    def _request(self, key: str) -> bytes:
        endpoint = self.direct.endpoint
        path = canonical_path(f"{endpoint.base_path}/{self.object_key(key)}")
        headers = self.direct.signer.sign("GET", endpoint.host, path, {})
        lines = [f"GET {path} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()
