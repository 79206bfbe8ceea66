"""A TCP proxy in front of a real S3 server that misbehaves on demand, for what the server does
not do when asked: answer ``503 SlowDown``, let a request body be corrupted on the way, or
hold each request back (the latency of a store far away). It counts the requests it sees.

It forwards bytes unchanged (a SigV4 signature covers the Host header the client sent, which the
server checks as it receives it), so every request it does not touch reaches the server as the
client made it. Plain HTTP only: a body cannot be corrupted inside TLS without breaking TLS.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: 114\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Reduce your request rate</Message></Error>"
)


class Listener:
    """Listens on 127.0.0.1 (any free port) once :meth:`_listen` is called; each connection it
    takes is served by :meth:`_serve` on a thread of its own, until :meth:`close`."""

    _server: socket.socket

    def _listen(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.close()


@dataclass
class FaultProxy(Listener):
    """Listens on 127.0.0.1; the first ``slow_down`` requests are answered 503 SlowDown, and
    the body of the first ``corrupt`` requests that carry one (after ``spare`` such requests
    passed untouched) has a byte flipped; every request
    (or only those whose request line holds ``delay_only``) waits ``delay`` seconds before it
    is passed on, one after another where ``serial``."""

    upstream_port: int
    slow_down: int = 0
    corrupt: int = 0
    spare: int = 0
    delay: float = 0.0
    delay_only: str = ""
    requests: int = 0  # requests seen
    lines: list[str] = field(
        default_factory=list
    )  # their request lines: "GET /bucket/key HTTP/1.1"
    heads: list[bytes] = field(default_factory=list)  # their heads: the line and the headers
    serial: bool = False  # the delay holds one request at a time (a store answering one by one)
    waiting: int = 0  # requests held by the delay now
    most_waiting: int = 0  # the most held at once
    answered: int = 0  # requests answered 503 by the proxy itself
    corrupted: int = 0
    bodies: int = 0  # requests with a body seen
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _turn: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._listen()

    def _take(self, what: str) -> bool:
        with self._lock:
            if what == "slow_down" and self.answered < self.slow_down:
                self.answered += 1
                return True
            if what == "corrupt":
                self.bodies += 1
                if self.bodies > self.spare and self.corrupted < self.corrupt:
                    self.corrupted += 1
                    return True
            return False

    def _hold(self) -> None:
        with self._lock:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        with self._turn if self.serial else contextlib.nullcontext():
            time.sleep(self.delay)
        with self._lock:
            self.waiting -= 1

    def _arrived(self, head: bytes) -> None:
        """A request counted, and held for the delay where it applies."""
        line = _request_line(head)
        with self._lock:
            self.requests += 1
            self.lines.append(line)
            self.heads.append(head)
        if self.delay and self.delay_only in line:
            self._hold()

    def _pass_on_continued(
        self, client: socket.socket, upstream: socket.socket, head: bytes, length: int, got: bytes
    ) -> bytes:
        """A request that waits for the server's ``100 Continue`` before its body (as botocore's
        PUTs do): its head passed on (after the delay), then its body as it comes; returns what
        the client sent past the body."""
        self._arrived(head)
        upstream.sendall(head + b"\r\n\r\n")
        while length:
            if not got and not (got := client.recv(65536)):
                return b""
            body, got = got[:length], got[length:]
            upstream.sendall(body)
            length -= len(body)
        return got

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(ConnectionError):  # a client killed mid-request, as tests do
            self._relay(client)

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
            buffer = b""
            while True:  # one request at a time: head, then its body
                while b"\r\n\r\n" not in buffer:
                    data = client.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = _content_length(head)
                if _header(head, b"expect") == b"100-continue":  # the client waits for "100"
                    buffer = self._pass_on_continued(client, upstream, head, length, buffer)
                    continue
                while len(buffer) < length:
                    data = client.recv(65536)
                    if not data:
                        return
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                self._arrived(head)
                if self._take("slow_down"):
                    client.sendall(SLOW_DOWN)
                    return
                if body and self._take("corrupt"):
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                upstream.sendall(head + b"\r\n\r\n" + body)


def _header(head: bytes, wanted: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == wanted:
            return value.strip()
    return None


def _content_length(head: bytes) -> int:
    return int(_header(head, b"content-length") or 0)


def _request_line(head: bytes) -> str:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    asked = _header(head, b"range")
    return f"{line} {asked.decode('latin-1')}" if asked else line


def pipe(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)
