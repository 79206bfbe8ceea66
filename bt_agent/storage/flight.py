"""Calls in flight on threads of a store's own: how many at once (:class:`Pace`, which finds
how many are worth it), within a budget of bytes held (:class:`InFlight`), on daemon threads
(:class:`DaemonPool`) that a stopped agent never waits for. The engine's stores
(:mod:`bt_agent.storage.engine`) run their batches and upload streams on them, and their ranged
downloads on an event loop of their own (:class:`DaemonLoop`), on a daemon thread too."""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future
from concurrent.futures import wait as wait_for
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import asyncio

T = TypeVar("T")
R = TypeVar("R")  # what the calls of an :class:`InFlight` return
A = TypeVar("A")  # what they are called with
#: The calls an :class:`InFlight` holds at most (queued, in flight, ended and not yet taken
#: back), in multiples of those its pace allows at once.
LOOKAHEAD = 2


def wait_all(futures: Sequence[Future[Any]], abandon: Callable[[], None] = lambda: None) -> None:
    """``futures`` waited for until all have ended or one has failed. At a failure, or where the
    wait is interrupted (KeyboardInterrupt), ``abandon()`` tells those running to stop, those
    not started are cancelled, and the error is raised once none is running (none may still
    write to what the caller goes on to close or remove)."""
    try:
        wait_for(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()
    except BaseException:
        abandon()
        raise
    finally:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()


async def in_task_group(calls: Sequence[Coroutine[Any, Any, Any]]) -> None:
    """``calls`` run at once, as tasks. At the first failure, or where the caller is cancelled,
    the others are cancelled, and the error is raised once all have ended (none may still
    write to what the caller goes on to close or remove): ``asyncio.TaskGroup`` (Python 3.11
    on, and raising a group of errors rather than the first)."""
    import asyncio

    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class InFlight(Generic[R]):
    """Calls on ``pool``'s threads, as many at once as ``pace`` allows while what their objects
    hold stays within ``budget`` bytes (room for one more is room for one as large as
    ``largest``), each taken back as it ends.

    The caller's thread takes the items and settles the calls; the pool's threads (one for
    each call ``pace`` allows at once) each take the next call from a queue that the caller
    keeps ahead of them, by up to as many calls again, so that a thread goes from one call to
    the next without waiting to be handed it. (Handing each call to a thread as another ended
    put both threads to sleep and woke them again for every call, a cost the size of a small
    object's own.) A second drive on the same pool while one goes on gets its threads as the
    first's end."""

    def __init__(self, pool: DaemonPool, pace: Pace, budget: int, largest: int) -> None:
        self._count = 0  # calls queued, in flight, or ended and not yet taken back
        self._workers = 0  # the pool's threads taking calls from the queue
        self._pool, self._pace = pool, pace
        self._budget, self._largest = budget, largest
        self._held = 0
        self._todo: queue.SimpleQueue[tuple[Callable[[], R], int] | None] = queue.SimpleQueue()
        self._ended: queue.SimpleQueue[tuple[Future[R], int]] = queue.SimpleQueue()

    def drive(
        self,
        items: Iterator[A],
        call: Callable[[A], R],
        size: Callable[[A], int],
        settle: Callable[[Future[R]], bool],
    ) -> None:
        """``call`` on each of ``items``, each taken once there is room for it (its object of
        ``size(item)`` bytes); ``settle`` told of each call as it ends, on this thread (False:
        take no more). Returns once no call is in flight."""
        going = True
        try:
            while going:
                if not self._room():
                    going = settle(self._next_ended())
                elif (item := next(items, None)) is not None:
                    self._start(functools.partial(call, item), size(item))
                else:
                    break
        finally:
            try:
                while self._count:
                    settle(self._next_ended())
            finally:
                for _ in range(self._workers):
                    self._todo.put(None)
                self._workers = 0

    def _room(self) -> bool:
        """Whether one more call may be queued."""
        fits = self._held + self._largest <= self._budget
        return self._count == 0 or (self._count < LOOKAHEAD * self._pace.limit and fits)

    def _start(self, call: Callable[[], R], size: int) -> None:
        """``call`` queued for the pool's threads, its object of ``size`` bytes; one more
        thread taking calls where ``pace`` allows another at once."""
        self._todo.put((call, size))
        self._count, self._held = self._count + 1, self._held + size
        if self._workers < min(self._pace.limit, self._count):
            self._pool.submit(self._work)
            self._workers += 1

    def _work(self) -> None:
        """One thread's calls, each as the queue gives it, until it gives None."""
        while (job := self._todo.get()) is not None:
            call, size = job
            future: Future[R] = Future()
            _run(future, call)
            self._ended.put((future, size))

    def _next_ended(self) -> Future[R]:
        """The next call to end (waiting for one), taken back."""
        future, size = self._ended.get()
        self._count, self._held = self._count - 1, self._held - size
        self._pace.arrived()
        return future


class Pace:
    """How many calls a batch keeps in flight. From a store far away each small object waits on
    its round trip, and more in flight move them sooner; from a near one this machine is the
    bound, and each further connection only costs its TLS handshake. So a batch starts with
    ``least`` and doubles, up to ``most``, for as long as the last doubling raised the rate at
    which calls end by a quarter (the first is always tried). Each rate is measured over twice
    as many calls as are allowed in flight, once the first that many have ended: those waited
    on the connections their level added being opened."""

    def __init__(self, least: int, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.most = least, max(least, most)
        self._rate = 0.0
        self._clock = clock
        self._level()

    def _level(self) -> None:
        """A new limit: its first ``limit`` calls to end are not counted."""
        self._count, self._since = -self.limit, self._clock()

    def arrived(self) -> None:
        """One more call has ended."""
        if self.limit >= self.most:
            return
        self._count += 1
        if self._count == 0:
            self._since = self._clock()
        if self._count < 2 * self.limit:
            return
        rate = self._count / max(self._clock() - self._since, 1e-9)
        if rate >= 1.25 * self._rate:
            self.limit = min(self.most, 2 * self.limit)
        else:
            self.most = self.limit  # more did not go faster: stay
        self._rate = rate
        self._level()


class DaemonPool:
    """Threads for the calls of a store, up to ``size``, each started when a call finds none
    idle (a batch that keeps 32 in flight starts 32, not ``size``). Daemons, unlike an
    executor's (which the interpreter joins at exit): one waiting on an unreachable store must
    not keep a stopped agent alive. A call submitted after :meth:`shutdown` (a store closed
    while another thread's download starts its ranges) still runs, on a thread of its own."""

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._started = 0
        self._closed = False
        self._idle = threading.Semaphore(0)  # released by each thread done with a call
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:  # not across a shutdown: a call queued behind its markers never runs
            if self._closed:
                self._thread(functools.partial(_run, future, call), "late")
                return future
            self._jobs.put((future, call))
            if not self._idle.acquire(blocking=False) and self._started < self._size:
                self._thread(self._work, str(self._started))
                self._started += 1
        return future

    def shutdown(self) -> None:
        """The threads end once the work already submitted is done (or cancelled)."""
        with self._lock:
            self._closed = True
            for _ in range(self._started):
                self._jobs.put(None)

    def _thread(self, target: Callable[[], None], suffix: str) -> None:
        name = f"{self._name}-{suffix}"
        threading.Thread(target=target, name=name, daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            _run(*job)
            self._idle.release()


def _run(future: Future[T], call: Callable[[], T]) -> None:
    """``call``'s outcome set on ``future``, unless it was cancelled before it could start."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(call())
        except BaseException as exc:  # the caller's to raise, from future.result()
            future.set_exception(exc)


class DaemonLoop:
    """An event loop on a daemon thread of its own, for calls on the engine's async face: there
    the engine reads each body on its own threads, while a thread blocked on its sync face is
    woken for every piece the connection hands over (each TLS record). ``room`` bounds what the
    callers' tasks hold at once. :meth:`shutdown` stops the loop once the tasks on it have
    ended; a call after it runs on a loop of its own, stopped once it is done."""

    def __init__(self, name: str, room: int) -> None:
        import asyncio

        self._name, self._room = name, room
        self._loop = asyncio.new_event_loop()
        self.room = asyncio.Semaphore(room)
        self._tasks = 0  # running on the loop (counted on its thread)
        self._closing = False
        self._lock = threading.Lock()  # a call's start is queued before a shutdown, or not at all
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def run(self, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``work()``'s result, run as a task on the loop. A caller interrupted meanwhile
        (KeyboardInterrupt) cancels the task and returns only once it has ended: none of its
        steps may touch what the caller goes on to close."""
        ended: Future[T] = Future()
        tasks: list[asyncio.Task[T]] = []
        with self._lock:
            closing = self._closing
            if not closing:
                self._loop.call_soon_threadsafe(self._start, work, ended, tasks)
        if closing:  # shut down meanwhile (a store closed as another thread's download began)
            late = DaemonLoop(f"{self._name}-late", self._room)
            try:
                return late.run(work)
            finally:
                late.shutdown()
        try:
            return ended.result()
        except BaseException:
            if not ended.done():
                self._loop.call_soon_threadsafe(lambda: tasks[0].cancel())  # after _start
                wait_for([ended])
            raise

    def cancel(self) -> None:
        """Every task on the loop cancelled (each caller's :meth:`run` raises then)."""
        self._loop.call_soon_threadsafe(self._cancel_all)

    def _cancel_all(self) -> None:
        import asyncio

        for task in asyncio.all_tasks(self._loop):
            task.cancel()

    def shutdown(self) -> None:
        """The loop stops once no task is left on it."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._loop.call_soon_threadsafe(self._stop_if_idle)

    def _start(
        self, work: Callable[[], Coroutine[Any, Any, T]], ended: Future[T], tasks: list[Any]
    ) -> None:
        task = self._loop.create_task(work())
        tasks.append(task)
        self._tasks += 1
        task.add_done_callback(lambda done: self._settle(done, ended))

    def _settle(self, done: asyncio.Task[T], ended: Future[T]) -> None:
        self._tasks -= 1
        if done.cancelled():  # set, not cancelled: a cancel would not wake wait_for's waiter
            ended.set_exception(CancelledError())
        elif (error := done.exception()) is not None:
            ended.set_exception(error)
        else:
            ended.set_result(done.result())
        self._stop_if_idle()

    def _stop_if_idle(self) -> None:
        if self._closing and not self._tasks:
            self._loop.stop()

    def _serve(self) -> None:
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()
