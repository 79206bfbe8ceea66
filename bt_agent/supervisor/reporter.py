"""Keep the store's view of this node current: the node record whenever it changes, the node's
log every few seconds while it grows.

The log is stored whole each time (the store's layout holds it as one object, and object stores
cannot append), so a log that has grown large is shipped less often: after a shipment that took
``t`` seconds, the next waits ``LOG_SHARE`` times that (at least the interval). Shipping then
takes at most a share of the job's time and of the link, where a large log would have been sent
again and again for the rest of a long job.

The writes run on a thread of their own, so an unreachable store neither blocks nor fails the
job: what could not be written is written once the store is back (the newest record wins), and
the end of the job waits for that until a deadline (:meth:`StoreReporter.flush`). A terminal
record is written after the log as it was when the record was published, at once, so whoever
sees a terminal status in the store can read the whole log; another record goes without
waiting for the log's turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from bt_agent.errors import described
from bt_agent.log import AgentLog
from bt_agent.records import NodeRecord

#: How often the log is shipped while it grows, and the store tried again while it fails.
INTERVAL_SECONDS = 3.0
#: A shipment of the log that took t seconds is followed by none for LOG_SHARE x t seconds.
LOG_SHARE = 20


class StoreReporter:
    def __init__(
        self,
        write_record: Callable[[NodeRecord], None],
        log_path: Path,
        upload_log: Callable[[Path], None],
        log: AgentLog,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        self._write_record = write_record
        self._log_path = log_path
        self._upload_log = upload_log
        self._log = log
        self._interval = interval
        self._changed = threading.Condition()
        self._pending: NodeRecord | None = None  # published, not yet written
        self._busy = False  # a write is under way
        self._shipped = -1  # the log's size when last shipped
        self._failing = False
        self._closed = False
        self._flushing = False  # the end of the job waits for the whole log: ship it now
        self._next_ship = 0.0  # time.monotonic() before which the log waits (unless ending)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bt-agent-records")

    def __enter__(self) -> StoreReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def publish(self, record: NodeRecord) -> None:
        """Write ``record`` (a snapshot the caller no longer changes) as soon as possible."""
        with self._changed:
            self._pending = record
            self._changed.notify_all()

    def flush(self, deadline: Callable[[], float]) -> bool:
        """Wait until the newest record and the whole log are in the store, or ``deadline()``
        (``time.monotonic()``; asked again as it waits, since a stop signal brings it closer)
        passes; True if they are."""
        with self._changed:
            self._flushing = True
            self._changed.notify_all()
            while not self._settled():
                left = deadline() - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
            return True

    def _settled(self) -> bool:
        return not self._busy and self._pending is None and self._log_size() == self._shipped

    def _log_size(self) -> int:
        try:
            return self._log_path.stat().st_size
        except OSError:
            return self._shipped

    def _loop(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                if (self._pending is None and not self._log_due(None)) or self._failing:
                    self._changed.wait(self._interval)
                record, self._pending = self._pending, None
                self._busy = True
            try:
                self._write(record)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _write(self, record: NodeRecord | None) -> None:
        try:
            if self._log_due(record):
                self._ship_log()
            if record is not None:
                self._write_record(record)
        except Exception as exc:  # the store's errors, and any no rule reads: tried again
            said = described(exc)
            with self._changed:
                if record is not None and self._pending is None:
                    self._pending = record  # a newer one, if published meanwhile, wins
            if not self._failing:
                self._failing = True
                self._log.warning(
                    f"cannot save the node record and log to the store ({said}); "
                    f"trying again every {self._interval:g} s"
                )
            return
        if self._failing:
            self._failing = False
            self._log.info("the store is reachable again: node record and log saved")

    def _log_due(self, record: NodeRecord | None) -> bool:
        """Whether the log is to be shipped now: it grew, and its time has come (a terminal
        ``record`` or the end of the job does not wait for that)."""
        if self._log_size() == self._shipped:
            return False
        ending = self._flushing or (record is not None and record.status.terminal)
        return ending or time.monotonic() >= self._next_ship

    def _ship_log(self) -> None:
        """Store the log as it is now, and when the next shipment may go."""
        size = self._log_size()
        started = time.monotonic()
        self._upload_log(self._log_path)
        self._shipped = size
        took = time.monotonic() - started
        self._next_ship = time.monotonic() + max(self._interval, LOG_SHARE * took)
