"""A link to a store far away, in front of a real server on 127.0.0.1: what the client sends
arrives ``delay`` seconds later, and each connection's answers come at most ``rate`` bytes a
second, as a cloud store paces each connection. Bytes pass unchanged, so TLS goes through it
end to end.

It is for the benchmarks' downloads (what the client sends is held piece by piece, so uploads
would be slowed by more than the delay), on Linux (the answers are spliced from socket to
socket, not copied through Python).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from fault_proxy import Listener

#: The most of an answer passed on at once (the pace is kept to within one of these).
PIECE = 256 * 1024


@dataclass
class FarLink(Listener):
    upstream_port: int
    delay: float  # seconds each piece the client sends is held before it is passed on
    rate: float  # bytes a second each connection's answers come at, at most
    connections: int = 0  # connections made through it
    passed: int = 0  # bytes of answers passed on, over all its connections
    stall_after: int | None = None  # the first connection's answers stop after this many bytes

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._listen()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:  # the server is down: the client finds the connection closed
            client.close()
            return
        with client, upstream:
            for end in (client, upstream):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stall = self.stall_after if self.connections == 1 else None
            ended = threading.Event()  # the client is done sending: its connection closes
            answers = threading.Thread(
                target=self._answers, args=(upstream, client, stall, ended), daemon=True
            )
            answers.start()
            self._requests(client, upstream)
            ended.set()
            answers.join()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """What the client sends, each piece held ``delay`` before it is passed on: a request's
        head, a TLS handshake's messages (a body sent in many pieces would wait for each)."""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                time.sleep(self.delay)
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _answers(
        self,
        upstream: socket.socket,
        client: socket.socket,
        stall: int | None,
        ended: threading.Event,
    ) -> None:
        """The server's answers, spliced through a pipe, paced at ``rate``; with ``stall``,
        none past that many bytes: the connection is held open, silent, as a stalled one is,
        until the client closes it (``ended``)."""
        read_end, write_end = os.pipe()
        due = time.monotonic()
        try:
            while count := os.splice(upstream.fileno(), write_end, _most(stall)):
                left = count
                while left:
                    left -= os.splice(read_end, client.fileno(), left)
                with self._lock:
                    self.passed += count
                if stall is not None and not (stall := stall - count):
                    ended.wait()
                    return
                now = time.monotonic()
                due = max(due, now) + count / self.rate
                time.sleep(max(0.0, due - now))
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(write_end)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)


def _most(stall: int | None) -> int:
    """The most bytes the next splice may take: a piece, or what is left before a stall."""
    return PIECE if stall is None else min(PIECE, stall)
