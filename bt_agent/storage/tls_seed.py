"""The object-store engine's TLS random generator, seeded on a thread while the agent starts.

The engine's TLS library (aws-lc, under rustls) seeds its random generator once per process,
when the first connection writes its first message, from the jitter of the CPU's timing: tens
of milliseconds of one core's work, which the first https request of a job would otherwise
wait for. A warm staging makes one listing per source, so most of its time was that wait.

:func:`seed_in_background` has the engine open a connection to a socket of the agent's own on
127.0.0.1, on a thread, while the agent's modules load: the engine seeds its generator to write
its first message, which is all that is waited for; the socket is then closed and the engine's
request fails at once. No other host is contacted (the connection goes direct, whatever proxy
the environment names), nothing is retried, and without the engine installed nothing happens.
The thread inside the engine is not a daemon: an interpreter that ends must not find one there,
so a command that ends at once waits the few milliseconds that thread has left.
The CLI starts it only where the command's words name a store of the engine's
(:func:`names_an_engine_store`): a job on a file store does not load the engine at all.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
from collections.abc import Iterable

from bt_agent.storage.registry import ENGINE_SCHEMES

#: How long the seeding waits for the engine's connection and its first message, at most.
WAIT_SECONDS = 2.0
#: The first byte of every TLS record that carries a handshake message.
HANDSHAKE_RECORD = 0x16
#: The most of a file named by a command's word that is looked through for a URL.
LOOKED_THROUGH = 1024 * 1024
#: A weights source of ``https://`` (``"source": "https://`` in JSON, ``source: https://`` in
#: YAML, ``source="https://`` in Python): not any URL of https:// (endpoints, mirrors, links).
_HTTPS_SOURCE = re.compile(r"""source["']?\s*[:=]\s*["']?https?://""")


def names_an_engine_store(words: Iterable[str]) -> bool:
    """Whether any of ``words`` (a command's arguments, the variables that name its spec and
    store), or the text of a file one names (a spec), holds the URL of a store the engine
    reads (``s3://`` and the like, or an ``https://`` weights source): a look before anything is
    parsed, which a URL in a comment also satisfies."""
    for word in words:
        if _holds_a_url(word):
            return True
        if os.path.isfile(word):
            try:
                with open(word, encoding="utf-8", errors="replace") as handle:
                    if _holds_a_url(handle.read(LOOKED_THROUGH)):
                        return True
            except OSError:
                continue
    return False


def _holds_a_url(text: str) -> bool:
    return any(scheme in text for scheme in ENGINE_SCHEMES) or bool(_HTTPS_SOURCE.search(text))


def seed_in_background() -> None:
    """:func:`seed` started on a daemon thread; returns at once."""
    threading.Thread(target=seed, name="bt-tls-seed", daemon=True).start()


def seed() -> bool:
    """The engine's random generator seeded through a connection to a socket of our own:
    True once its first TLS message has arrived, False where the engine is not installed or
    sent none within :data:`WAIT_SECONDS`."""
    try:
        import obstore  # noqa: F401  (imported here, on this thread, for _hello)
    except ImportError:
        return False
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(WAIT_SECONDS)
        port = listener.getsockname()[1]
        threading.Thread(target=_hello, args=(port,), name="bt-tls-seed-hello").start()
        try:
            connection, _ = listener.accept()
        except OSError:
            return False
        with connection:
            connection.settimeout(WAIT_SECONDS)
            try:
                first = connection.recv(1)
            except OSError:
                return False
    return first == bytes([HANDSHAKE_RECORD])


def _hello(port: int) -> None:
    """One request of the engine's to ``port`` over https, which fails once the socket closes.
    An explicit proxy that excludes 127.0.0.1 keeps the engine from taking the environment's."""
    import obstore
    from obstore.store import HTTPStore

    with contextlib.suppress(Exception):  # it fails, as it must; its first message was all
        store = HTTPStore.from_url(
            f"https://127.0.0.1:{port}",
            client_options={
                "timeout": f"{WAIT_SECONDS:g}s",
                "proxy_url": "http://127.0.0.1:9",
                "proxy_excludes": "127.0.0.1",
            },
            retry_config={"max_retries": 0},
        )
        obstore.head(store, "seed")
