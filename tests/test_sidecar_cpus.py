"""Where the sidecar's threads run: off the CPUs the job's busy processes are pinned to, with
real processes (a pinned spinner, an unpinned one, a sleeping parent) and real affinity."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import needs_two_cpus

from bt_agent.sidecar.cpus import Placement, cpu_list, keep_off, lower_priority

SPIN = Path(__file__).parent / "bin" / "spin_pinned.py"
CPUS = sorted(os.sched_getaffinity(0))


def test_keep_off_leaves_the_claimed_cpus_where_others_remain() -> None:
    assert keep_off({0, 1, 2, 3}, {0, 1}) == {2, 3}
    assert keep_off({0, 1, 2, 3}, set()) == {0, 1, 2, 3}  # nobody busy
    assert keep_off({0, 1}, {0, 1, 2}) == {0, 1}  # every CPU claimed: share them all
    assert keep_off({2, 3}, {0}) == {2, 3}  # claimed elsewhere: nothing to leave
    assert cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


class Background:
    """A thread of this process at ``SCHED_IDLE``, as the sidecar's are, waiting to end."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.done = threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _run(self) -> None:
        lower_priority(0)
        self.tid = threading.get_native_id()
        self.ready.set()
        self.done.wait(60)

    def cpus(self) -> set[int]:
        return set(os.sched_getaffinity(self.tid))

    def end(self) -> None:
        self.done.set()
        self.thread.join(5)


@pytest.fixture
def background() -> Iterator[Background]:
    thread = Background()
    try:
        yield thread
    finally:
        thread.end()


class Spinners:
    """Stand-in trainers that keep a CPU busy (pinned to the CPUs given, or not) until
    :meth:`stop`."""

    def __init__(self, go_on: Path) -> None:
        self.go_on = go_on
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, cpus: str | None) -> subprocess.Popen[bytes]:
        pinned = ["--cpus", cpus] if cpus else []
        self.started.append(subprocess.Popen([sys.executable, str(SPIN), str(self.go_on), *pinned]))
        return self.started[-1]

    def stop(self) -> None:
        self.go_on.touch()
        for process in self.started:
            process.wait(10)


@pytest.fixture
def spinners(tmp_path: Path) -> Iterator[Spinners]:
    needs_two_cpus()
    started = Spinners(tmp_path / "go-on")
    try:
        yield started
    finally:
        started.stop()


def look(placement: Placement, after: float = 0.5) -> None:
    """One look, ``after`` seconds from now: who was busy since the last look, or since they
    started."""
    time.sleep(after)
    placement.step(time.monotonic())


def test_background_threads_leave_the_cpu_a_busy_process_is_pinned_to(
    background: Background, spinners: Spinners
) -> None:
    pinned = spinners.start(str(CPUS[0]))
    parent = subprocess.Popen(["sleep", "30"])  # waits, may run anywhere: claims nothing
    pids = [pinned.pid, parent.pid]
    told: list[tuple[set[int], set[int]]] = []
    placement = Placement(lambda: pids, lambda cpus, claimed: told.append((cpus, claimed)), 0.0)
    own = os.sched_getaffinity(0)
    try:
        look(placement)  # the first look at a process judges it since it started
        assert background.cpus() == set(CPUS[1:])
        assert os.sched_getaffinity(0) == own  # threads at normal priority stay where they are
        assert told == [(set(CPUS[1:]), {CPUS[0]})]
        look(placement)  # the next judges it since the last look
        assert background.cpus() == set(CPUS[1:])
        spinners.stop()
        look(placement)  # nobody busy any more: every CPU again
        assert background.cpus() == set(CPUS)
        assert told[-1] == (set(CPUS), set())
    finally:
        parent.kill()
        parent.wait(10)


def test_a_busy_process_that_may_run_anywhere_claims_every_cpu(
    background: Background, spinners: Spinners
) -> None:
    pids = [spinners.start(str(CPUS[0])).pid, spinners.start(None).pid]
    look(Placement(lambda: pids, interval=0.0))
    assert background.cpus() == set(CPUS)
