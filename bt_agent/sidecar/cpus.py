"""The sidecar's threads on the CPUs: the lowest priority, and off the cores the job claims.

Every thread of the sidecar, and the store engine's threads once the sidecar starts, run under
``SCHED_IDLE`` (nice +10 besides): they take the CPU time training leaves. Still, on a CPU that
training keeps busy the kernel gives such a thread a slice now and then (at each wake-up of an
upload's request or checksum), and a trainer loses those slices. A trainer that pins its
processes to cores (``taskset``, ``numactl``, a launcher's NUMA binding, ``sched_setaffinity``
in the script) says which cores it needs, so :class:`Placement` keeps the sidecar off them:

- once a second it looks at the job's processes that used a tenth of a CPU or more since its
  last look, or since they started (a shell or a launcher waiting for its workers does not);
- where those are all pinned within fewer CPUs than the agent may use, every thread of the
  agent at ``SCHED_IDLE`` is confined to the others;
- where one of them may run anywhere, or none is busy (between phases, during the drain),
  they may run wherever the agent may.

The agent's own threads at normal priority (signals, reaping, the job's output) are left where
they are: the job's next command is started from them and would inherit their CPUs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

#: Seconds between two looks at the job's processes.
INTERVAL = 1.0
#: A process is busy when it used at least this share of one CPU since the last look.
BUSY_SHARE = 0.1
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Fields of /proc/<pid>/stat, counted from the state (its 3rd): user and system ticks, start.
_UTIME = 11
_START = 19


def lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority (on Linux, per thread; threads it starts inherit
    it): ``SCHED_IDLE`` where the system has it, so that the uploads run on what the training
    leaves of the CPUs, and ``increment`` more niceness besides."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def share_priority(threads: list[int]) -> None:
    """Give ``threads`` (native ids) the calling thread's priority: its scheduling policy and
    its niceness. For the store's engine, whose own threads (started before the sidecar, by
    whatever asked the store first) do the uploads' requests and checksums."""
    with contextlib.suppress(OSError, AttributeError):
        policy = os.sched_getscheduler(0)
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        for thread in threads:
            with contextlib.suppress(OSError):  # one that has ended since
                os.setpriority(os.PRIO_PROCESS, thread, nice)
                os.sched_setscheduler(thread, policy, os.sched_param(0))


def keep_off(allowed: set[int], claimed: set[int]) -> set[int]:
    """Where background threads may run: the ``allowed`` CPUs that no busy process of the job
    is pinned to, or all of them where the job claims none or every one."""
    free = allowed - claimed
    return free if claimed and free else allowed


def cpu_list(cpus: set[int]) -> str:
    """CPUs as ``taskset`` and ``/proc`` write them: ``0-3,8``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


class Placement:
    """Keeps this process's ``SCHED_IDLE`` threads off the CPUs that the job's busy processes
    (of ``processes()``) are pinned to. Call :meth:`step` often; it looks once per
    ``interval``. Does nothing where the system has no CPU affinity."""

    def __init__(
        self,
        processes: Callable[[], Iterable[int]],
        on_change: Callable[[set[int], set[int]], None] = lambda cpus, claimed: None,
        interval: float = INTERVAL,
    ) -> None:
        self.processes = processes
        self.on_change = on_change  # told where the threads now run, and what the job claims
        self.interval = interval
        self.allowed: set[int] = _affinity(0) or set()  # the agent's own CPUs
        self.cpus = set(self.allowed)  # where the background threads may run now
        self._ticks: dict[int, int] = {}  # pid -> its CPU ticks at the last look
        self._looked = float("-inf")

    def step(self, now: float) -> None:
        """Look at the job's processes and move the background threads if that is due."""
        if not self.allowed or now - self._looked < self.interval:
            return
        elapsed, self._looked = now - self._looked, now
        claimed = self._claimed(elapsed)
        cpus = keep_off(self.allowed, claimed)
        if cpus != self.cpus:
            self.cpus = cpus
            self.on_change(cpus, claimed)
        confine(cpus)

    def _claimed(self, elapsed: float) -> set[int]:
        """The CPUs of the processes that were busy for the ``elapsed`` seconds since the last
        look; of one not seen before, since it started."""
        now = _uptime()
        ticks: dict[int, int] = {}
        claimed: set[int] = set()
        for pid in self.processes():
            if (used := _ticks_used(pid)) is None:
                continue
            ticks[pid] = used.ticks
            before = self._ticks.get(pid)
            span = elapsed if before is not None else now - used.started
            if span > 0 and used.ticks - (before or 0) >= BUSY_SHARE * span * _TICKS:
                claimed |= _affinity(pid) or self.allowed
        self._ticks = ticks
        return claimed


def confine(cpus: set[int]) -> None:
    """Allow every thread of this process that runs under ``SCHED_IDLE`` only ``cpus``."""
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that has ended since
            if os.sched_getscheduler(tid) == os.SCHED_IDLE and os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _affinity(pid: int) -> set[int] | None:
    try:
        return set(os.sched_getaffinity(pid))
    except (OSError, AttributeError):  # gone, or no affinity on this system
        return None


class _Used(NamedTuple):
    ticks: int  # user and system CPU ticks of every thread so far
    started: float  # seconds after boot


def _ticks_used(pid: int) -> _Used | None:
    """What ``pid`` has used of the CPUs since it started (None: gone)."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = line[line.rindex(")") + 2 :].split()
    return _Used(int(fields[_UTIME]) + int(fields[_UTIME + 1]), int(fields[_START]) / _TICKS)


def _uptime() -> float:
    """Seconds since boot, the clock of a process's start in /proc."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
