"""The node's log and record shipped to the store: a log that has grown is not sent again
every few seconds for the rest of the job, and the end of a job still finds the whole log in
the store before its terminal record.

The store here is two functions the reporter is given (it takes them so): one that copies the
log aside, as slowly as a large object goes to a store far away, and one that keeps records.
"""

from __future__ import annotations

import copy
import io
import shutil
import threading
import time
from pathlib import Path

from bt_agent.log import AgentLog
from bt_agent.records import JobStatus, NodeRecord
from bt_agent.supervisor.reporter import LOG_SHARE, StoreReporter

UPLOAD_SECONDS = 0.05  # each shipment of the log, as a store far away takes it
INTERVAL = 0.05


class Store:
    """What the reporter writes, in order: ``("log", size)`` and ``("record", status)``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def upload_log(self, path: Path) -> None:
        time.sleep(UPLOAD_SECONDS)
        shutil.copyfile(path, self.root / "stored.log")
        with self.lock:
            self.events.append(("log", (self.root / "stored.log").stat().st_size))

    def write_record(self, record: NodeRecord) -> None:
        with self.lock:
            self.events.append(("record", record.status))

    def shipments(self) -> int:
        with self.lock:
            return sum(1 for kind, _ in self.events if kind == "log")


def _grow(log: Path, stop: threading.Event) -> None:
    with open(log, "a") as handle:
        while not stop.is_set():
            handle.write("step loss=0.123\n" * 50)
            handle.flush()
            time.sleep(0.005)


def test_a_growing_log_is_shipped_within_its_share_and_whole_at_the_end(tmp_path: Path) -> None:
    log = tmp_path / "node.log"
    log.write_text("")
    store = Store(tmp_path)
    record = NodeRecord("job1234", "p", 0)
    record.transition(JobStatus.RUNNING)
    stop = threading.Event()
    writer = threading.Thread(target=_grow, args=(log, stop))
    agent_log = AgentLog(io.StringIO())
    with StoreReporter(store.write_record, log, store.upload_log, agent_log, INTERVAL) as reporter:
        writer.start()
        time.sleep(3.0)
        shipped = store.shipments()
        # each shipment takes 0.05 s and is followed by none for 20 times that: at most 3 s /
        # 1.05 s + 1 of them; every 0.1 s (the interval and the upload) before
        assert 1 <= shipped <= 3 / (INTERVAL + LOG_SHARE * UPLOAD_SECONDS) + 1, store.events
        reporter.publish(copy.deepcopy(record))  # not terminal: written without the log
        deadline = time.monotonic() + 1.0
        while ("record", JobStatus.RUNNING) not in store.events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.events[-1] == ("record", JobStatus.RUNNING), store.events
        assert store.shipments() == shipped, "a record that is not the last waits for no log"
        stop.set()
        writer.join()
        record.transition(JobStatus.COMPLETED)
        reporter.publish(copy.deepcopy(record))
        assert reporter.flush(lambda: time.monotonic() + 10)
    assert store.events[-2:] == [("log", log.stat().st_size), ("record", JobStatus.COMPLETED)]
    assert (tmp_path / "stored.log").read_bytes() == log.read_bytes()
