"""Bodies received into a file at an offset: spliced from plain TCP sockets, copied otherwise.

A real server on 127.0.0.1 (a thread with a listening socket) answers each request with a
scripted HTTP response: the whole body, a body cut short, a body that stalls. The client is
http.client, as the store's direct path uses it."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from conftest import small_tmpfs

from bt_agent.storage import receive
from bt_agent.storage.receive import Receiver, Span
from bt_agent.storage.s3_direct import NetworkError

MiB = 1024 * 1024
#: A script answers one request on the connection; it gets the socket and sends what it likes.
Script = Callable[[socket.socket], None]


def _head(length: int) -> bytes:
    return f"HTTP/1.1 206 Partial Content\r\nContent-Length: {length}\r\n\r\n".encode()


def whole(body: bytes) -> Script:
    def send(connection: socket.socket) -> None:
        connection.sendall(_head(len(body)) + body)

    return send


def cut_short(body: bytes, sent: int) -> Script:
    def send(connection: socket.socket) -> None:
        connection.sendall(_head(len(body)) + body[:sent])
        connection.shutdown(socket.SHUT_WR)

    return send


def stalled(body: bytes, sent: int) -> Script:
    def send(connection: socket.socket) -> None:
        connection.sendall(_head(len(body)) + body[:sent])
        time.sleep(2)  # longer than the client's timeout

    return send


@pytest.fixture
def server() -> Iterator[Callable[[list[Script]], int]]:
    """``serve(scripts)``: a port whose one connection answers request i with scripts[i]."""
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def answer(scripts: list[Script]) -> None:
        connection, _ = listener.accept()
        with connection, connection.makefile("rb") as requests, suppress(ConnectionError):
            for script in scripts:  # (a client that gave up resets the connection)
                while requests.readline() not in (b"\r\n", b""):
                    pass  # the request's head; these requests have no body
                script(connection)

    def serve(scripts: list[Script]) -> int:
        thread = threading.Thread(target=answer, args=(scripts,), daemon=True)
        thread.start()
        threads.append(thread)
        port: int = listener.getsockname()[1]
        return port

    yield serve
    listener.close()
    for thread in threads:
        thread.join(5)


def _get(connection: http.client.HTTPConnection) -> http.client.HTTPResponse:
    connection.request("GET", "/object", headers={"range": "bytes=0-"})
    return connection.getresponse()


def test_a_body_is_spliced_at_its_offset_and_the_connection_kept(
    server: Callable[[list[Script]], int], tmp_path: Path, spliced: list[int]
) -> None:
    first, second = os.urandom(3 * MiB + 12345), os.urandom(100_001)
    port = server([whole(first), whole(second)])
    target = tmp_path / "object.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    receiver, writing = Receiver(), threading.Lock()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        got = receiver.receive(_get(connection), Span(fd, 7, len(first), writing), 5.0)
        assert got == len(first)
        response = _get(connection)  # the same connection: the first body was consumed
        offset = 7 + len(first)
        assert receiver.receive(response, Span(fd, offset, len(second), writing), 5.0) == len(
            second
        )
        assert response.isclosed()
    finally:
        os.close(fd)
        connection.close()
    assert target.read_bytes() == bytes(7) + first + second
    assert sum(spliced) > len(first), "most bytes went through the pipe"
    assert max(spliced) <= receive.PIPE_BYTES


def test_without_splice_the_body_is_copied(
    server: Callable[[list[Script]], int], tmp_path: Path, spliced: list[int]
) -> None:
    """What a TLS connection gets (splice_timeout None): the read-and-write path."""
    body = os.urandom(MiB + 3)
    port = server([whole(body)])
    target = tmp_path / "object.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        span = Span(fd, 0, len(body), threading.Lock())
        assert Receiver().receive(_get(connection), span, None) == len(body)
    finally:
        os.close(fd)
        connection.close()
    assert target.read_bytes() == body and spliced == []


@pytest.mark.parametrize("splice_timeout", [5.0, None], ids=["spliced", "copied"])
def test_a_body_cut_short_is_counted_short(
    server: Callable[[list[Script]], int], tmp_path: Path, splice_timeout: float | None
) -> None:
    body = os.urandom(2 * MiB)
    port = server([cut_short(body, MiB + 5)])
    fd = os.open(tmp_path / "object.bin", os.O_WRONLY | os.O_CREAT)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        span = Span(fd, 0, len(body), threading.Lock())
        assert Receiver().receive(_get(connection), span, splice_timeout) == MiB + 5
    finally:
        os.close(fd)
        connection.close()
    assert (tmp_path / "object.bin").read_bytes() == body[: MiB + 5]


def test_a_stalled_body_is_a_network_error_within_the_timeout(
    server: Callable[[list[Script]], int], tmp_path: Path
) -> None:
    body = os.urandom(2 * MiB)
    port = server([stalled(body, MiB)])
    fd = os.open(tmp_path / "object.bin", os.O_WRONLY | os.O_CREAT)
    receiver = Receiver()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=0.3)
    started = time.monotonic()
    try:
        with pytest.raises(NetworkError, match="TimeoutError"):
            receiver.receive(_get(connection), Span(fd, 0, len(body), threading.Lock()), 0.3)
    finally:
        os.close(fd)
        connection.close()
    assert time.monotonic() - started < 1.5
    assert receiver._pipe is None, "a pipe that may hold a given-up body's bytes is dropped"


def test_a_full_disk_stays_an_os_error(
    server: Callable[[list[Script]], int], tmp_path: Path
) -> None:
    """The file's failure is not the network's: a full disk is not retried as a network fault."""
    body = os.urandom(4 * MiB)
    port = server([whole(body)])
    with small_tmpfs(tmp_path / "small", "1m") as disk:
        fd = os.open(disk / "object.bin", os.O_WRONLY | os.O_CREAT)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            with pytest.raises(OSError) as caught:
                Receiver().receive(_get(connection), Span(fd, 0, len(body), threading.Lock()), 5.0)
        finally:
            os.close(fd)
            connection.close()
    assert not isinstance(caught.value, NetworkError)
    assert "No space left" in str(caught.value)
