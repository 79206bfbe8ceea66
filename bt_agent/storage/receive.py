"""A response body received into a file at an offset, the way ranged downloads need it.

Over plain HTTP on Linux the body goes socket -> pipe -> file with ``splice(2)``: the kernel
passes the socket's pages to the pipe and copies them once, into the page cache, so no byte
passes through Python and one call moves up to a pipe's worth (1 MiB). Reading into a buffer
and writing it out costs a second copy of every byte and a pair of system calls (each a trip
through the GIL) per 64 KiB: about half the agent's CPU time for a large download. Over TLS,
or where ``splice`` is missing, the body is read into a reused buffer and written with
``pwrite``.

Failures keep their side: the network's are :class:`NetworkError` (retried), the file's stay
``OSError`` (a full disk is not a network fault).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import io
import os
import select
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from bt_agent.storage.s3_direct import NetworkError, read_into

#: The buffer of the read-and-write path: small enough to stay in the CPU's cache between the
#: socket's copy into it and the copy into the page cache.
BUFFER_BYTES = 64 * 1024
#: What one ``splice`` from the socket may move; the pipe is asked to hold as much.
PIPE_BYTES = 1024 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; fcntl names it from 3.10
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_SPLICE = hasattr(os, "splice")  # Linux, Python 3.10+


@dataclass(frozen=True)
class Span:
    """Where a body goes: ``length`` bytes of ``fd`` from ``offset``, written under
    ``writing`` (one writer per file: the kernel's inode lock spins)."""

    fd: int
    offset: int
    length: int
    writing: threading.Lock


class _Pipe:
    """A pipe's two ends, closed when it is dropped."""

    def __init__(self) -> None:
        self.out, self.into = os.pipe()
        weakref.finalize(self, _close, self.out, self.into)
        with contextlib.suppress(OSError):  # over the user's pipe quota: the default size
            fcntl.fcntl(self.into, _F_SETPIPE_SZ, PIPE_BYTES)
        self.size = min(PIPE_BYTES, fcntl.fcntl(self.into, _F_GETPIPE_SZ))


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Receiver:
    """One thread's means of receiving bodies: its buffer and, where splicing works, its
    pipe (kept between bodies; dropped after a failure, which may leave bytes in it)."""

    def __init__(self) -> None:
        self._buffer = memoryview(bytearray(BUFFER_BYTES))
        self._pipe: _Pipe | None = None

    def receive(
        self, response: http.client.HTTPResponse, span: Span, splice_timeout: float | None
    ) -> int:
        """Up to ``span.length`` bytes of ``response``'s body written where ``span`` says; the
        count written. ``splice_timeout`` is the connection's read timeout where it is plain
        TCP, None where its bytes cannot be spliced (TLS)."""
        if splice_timeout is not None and _SPLICE and response.length == span.length:
            return self._splice(response, span, splice_timeout)
        return self._copy(response, span)

    def _copy(self, response: http.client.HTTPResponse, span: Span) -> int:
        view = self._buffer
        done = 0
        while done < span.length:
            got = read_into(response, view[: min(len(view), span.length - done)])
            if not got:
                break
            with span.writing:
                os.pwrite(span.fd, view[:got], span.offset + done)
            done += got
        return done

    def _splice(self, response: http.client.HTTPResponse, span: Span, timeout: float) -> int:
        head = _buffered(response.fp, span.length)  # read ahead with the headers
        if head:
            with span.writing:
                os.pwrite(span.fd, head, span.offset)
        done = len(head)
        with self._pipe_in_use() as pipe:
            source = response.fp.fileno()
            while done < span.length:
                moved = _from_socket(source, pipe, span.length - done, timeout)
                if not moved:
                    break  # the server closed early: a short body
                with span.writing:
                    _to_file(pipe, span.fd, span.offset + done, moved)
                done += moved
        if done == span.length:
            response.length = 0
            response.read()  # the body is consumed: the connection may carry the next request
        return done

    @contextlib.contextmanager
    def _pipe_in_use(self) -> Iterator[_Pipe]:
        if self._pipe is None:
            self._pipe = _Pipe()
        try:
            yield self._pipe
        except BaseException:
            self._pipe = None  # it may hold bytes of a body that is given up
            raise


def _buffered(stream: io.BufferedReader, length: int) -> bytes:
    """The body's first bytes, those ``stream`` holds already (after the headers it read),
    taken from its buffer and no further."""
    try:
        ahead = len(stream.peek(1))
        return stream.read(min(ahead, length))
    except (OSError, http.client.HTTPException) as exc:
        raise NetworkError(type(exc).__name__) from exc


def _from_socket(source: int, pipe: _Pipe, wanted: int, timeout: float) -> int:
    """Bytes moved from the socket into the (empty) pipe, waiting up to ``timeout`` seconds
    for each; 0 at the end of the stream."""
    while True:
        try:
            return os.splice(source, pipe.into, min(pipe.size, wanted))
        except BlockingIOError:  # the socket is non-blocking, as Python sets it for a timeout
            if not _readable(source, timeout):
                raise NetworkError("TimeoutError: no data within the read timeout") from None
        except OSError as exc:
            raise NetworkError(type(exc).__name__) from exc


def _to_file(pipe: _Pipe, fd: int, offset: int, count: int) -> None:
    """All ``count`` bytes in the pipe written to ``fd`` at ``offset``."""
    while count:
        written = os.splice(pipe.out, fd, count, offset_dst=offset)
        if not written:
            raise OSError("splice wrote nothing into the file")
        offset += written
        count -= written


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
