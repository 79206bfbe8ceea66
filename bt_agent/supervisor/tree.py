"""The agent's descendants, found through /proc: every process whose parent chain leads here.

Process groups are not enough: torchrun starts each worker in a session of its own, so a signal
to torchrun's group never reaches them. Walking the tree does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


def _parent_of(stat_line: str) -> int | None:
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    try:
        return int(stat_line[stat_line.rindex(")") + 2 :].split()[1])
    except (ValueError, IndexError):
        return None


def parents(proc: Path = PROC) -> dict[int, int]:
    """pid -> parent pid for every process visible now."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = _parent_of((entry / "stat").read_text())
        except OSError:
            continue  # exited while we looked
        if parent is not None:
            found[int(entry.name)] = parent
    return found


def descendants(root: int | None = None, proc: Path = PROC) -> list[int]:
    """Every living descendant of ``root`` (default: this process), parents before children."""
    if root is None:
        if not has_children():
            return []  # every descendant is reached through a child
        root = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, parent in parents(proc).items():
        children.setdefault(parent, []).append(pid)
    order, frontier = [], list(children.get(root, []))
    while frontier:
        pid = frontier.pop(0)
        order.append(pid)
        frontier.extend(children.get(pid, []))
    return order


def has_children() -> bool:
    """Whether this process has a child, running or a zombie, found without reaping it."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def signal_all(pids: list[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, number)


class Ended(NamedTuple):
    terminated: int  # descendants sent SIGTERM
    killed: list[int]  # those still alive at the timeout, sent SIGKILL


def terminate_descendants(
    timeout: float, reap: Callable[[], object], sleep: Callable[[float], None] = time.sleep
) -> Ended:
    """SIGTERM every descendant, wait up to ``timeout`` (reaping), SIGKILL what is left."""
    found = living(descendants())
    signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap()
        if not living(descendants()):
            return Ended(len(found), [])
        sleep(0.02)
    left = living(descendants())
    signal_all(left, signal.SIGKILL)
    _wait_gone(reap, sleep)
    return Ended(len(found), left)


def living(pids: list[int]) -> list[int]:
    """Drop zombies: they are dead and only wait to be reaped."""
    alive = []
    for pid in pids:
        try:
            state = (PROC / str(pid) / "stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2 :].split()[0] != "Z":
            alive.append(pid)
    return alive


def _wait_gone(reap: Callable[[], object], sleep: Callable[[float], None]) -> None:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        reap()
        if not descendants():
            return
        sleep(0.01)
