"""The event loop the engine's async calls run on (imported only by the batch paths).

The engine completes each awaited future from a thread of its own (a Rust runtime thread)
through ``loop.call_soon_threadsafe``. The future can be done, and the loop's work over, while
that thread is still inside the call: it wakes the loop with a write to its self-pipe, which
releases the GIL, and then waits to take the GIL back. If the interpreter is finalizing by
then, CPython ends that foreign thread with ``pthread_exit`` and the process aborts (SIGABRT,
exit status 134, after the work succeeded). :func:`run` therefore counts the threads inside
``call_soon_threadsafe`` and, once the coroutine is done, waits for them to leave before the
loop is closed and the caller goes on (towards an exit, perhaps).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: How long :func:`run` waits for the engine's threads to leave the loop once its work is done.
SETTLE_SECONDS = 5.0


class _EngineLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._inside = 0
        self._inside_lock = threading.Lock()

    def call_soon_threadsafe(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        with self._inside_lock:
            self._inside += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with self._inside_lock:
                self._inside -= 1

    def settle(self, seconds: float = SETTLE_SECONDS) -> None:
        """Return once no other thread is inside :meth:`call_soon_threadsafe`."""
        deadline = time.monotonic() + seconds
        while self._inside and time.monotonic() < deadline:
            time.sleep(0.001)  # the GIL is free meanwhile: the thread takes it and leaves


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)`` on a loop that the engine's threads have left when it returns."""
    loop = _EngineLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.settle()
            loop.close()


async def in_daemon_thread(call: Callable[[], T]) -> T:
    """``call()`` on a daemon thread of its own: one that blocks for good (a stream nobody
    ends) must not hold the interpreter's exit, as an executor's thread would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(outcome: Callable[[Any], None], value: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(outcome, value)

    def work() -> None:
        try:
            result = call()
        except Exception as exc:
            deliver(future.set_exception, exc)
        else:
            deliver(future.set_result, result)

    threading.Thread(target=work, name="bt-s3-take", daemon=True).start()
    return await future
