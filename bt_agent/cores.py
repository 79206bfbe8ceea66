"""How many CPU cores this process may use: the CPUs its affinity allows, fewer where its
control group's CPU quota allows less (a container started with ``--cpus 4``, a pod's CPU
limit, which leave the affinity at every core of the node)."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Where the control group file system is mounted (v2 at its root; v1 with a ``cpu`` tree).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's control groups (v2's line is ``0::<path>``).
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may run on at once, at least 1."""
    if hasattr(os, "sched_getaffinity"):
        allowed = len(os.sched_getaffinity(0))
    else:
        allowed = os.cpu_count() or 1
    quota = _quota(cgroup_root, _own_group(proc_cgroup))
    return max(1, min(allowed, math.ceil(quota))) if quota else allowed


def _own_group(proc_cgroup: Path) -> str:
    """This process's v2 group, relative to the mount (empty in a container that has a
    namespace of its own, where the mount's root is its group)."""
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            return line[3:].strip("/")
    return ""


def _quota(root: Path, group: str) -> float | None:
    """The control group's CPU quota in cores (v2's ``cpu.max`` of ``group``, else v1's CFS
    quota and period), or None where there is none or it cannot be read."""
    v2 = _read(root / group / "cpu.max")
    if v2 is not None:
        share, _, period = v2.partition(" ")
        return _cores(share, period or "100000")
    v1 = root / "cpu"
    share_v1, period_v1 = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
    if share_v1 is None or period_v1 is None:
        return None
    return _cores(share_v1, period_v1)


def _cores(quota: str, period: str) -> float | None:
    try:
        share, length = int(quota), int(period)
    except ValueError:
        return None  # "max": no quota
    return share / length if share > 0 and length > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
