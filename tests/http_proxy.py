"""An HTTP proxy on 127.0.0.1, as a corporate network puts between a job and its store: it
tunnels ``CONNECT host:port`` (https, TLS end to end) and forwards requests in absolute form
(``GET http://host:port/path``, plain http) to the host they name. It remembers where each
connection it took went, so a test can tell which requests went through it. Given an
``upstream``, it takes every connection there, whatever host it names (as a resolver that
points a service's names at a test server would).

Written here because no proxy server is among the tools the tests may install; it speaks only
the two forms a client uses, each connection to one destination, the bytes passed unchanged.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

from fault_proxy import Listener, pipe


class ForwardProxy(Listener):
    def __init__(self, upstream: tuple[str, int] | None = None) -> None:
        self.targets: list[str] = []  # "host:port" of each connection taken
        self.upstream = upstream
        self._listen()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    return
                head += data
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            where = target if method == "CONNECT" else urlsplit(target).netloc
            self.targets.append(where)
            host, _, port = where.rpartition(":")
            with socket.create_connection(self.upstream or (host, int(port))) as upstream:
                if method == "CONNECT":
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    head = head.partition(b"\r\n\r\n")[2]
                upstream.sendall(head)
                threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
                pipe(client, upstream)
