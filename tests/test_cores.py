"""The cores the agent may use: its affinity, capped by the control group's CPU quota, read
from files laid out as the kernel's (v2 and v1) in a temporary directory, and from this
machine's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bt_agent.cores import usable_cores

ALLOWED = len(os.sched_getaffinity(0))


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "100000 100000"}, 1),
        ({"cpu.max": "150000 100000"}, min(ALLOWED, 2)),  # one and a half cores: two at once
        ({"cpu.max": "max 100000"}, ALLOWED),
        ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, ALLOWED),
        ({"cpu.max": "garbled"}, ALLOWED),
        ({}, ALLOWED),
    ],
    ids=["v2-one", "v2-fraction", "v2-none", "v1-one", "v1-none", "unreadable", "no-cgroup"],
)
def test_the_quota_caps_the_affinity(tmp_path: Path, files: dict[str, str], expected: int) -> None:
    assert usable_cores(_cgroup(tmp_path, files), tmp_path / "absent") == expected


def test_the_group_named_in_proc_is_the_one_read(tmp_path: Path) -> None:
    """Without a namespace of its own, the process's v2 group is a path under the mount (as
    /proc/self/cgroup names it); that group's quota counts, not the root's."""
    root = _cgroup(tmp_path / "fs", {"kubepods/pod1/c1/cpu.max": "100000 100000"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/c1\n")
    assert usable_cores(root, proc) == 1
    proc.write_text("0::/\n")  # a namespace of its own: its group is the mount's root
    assert usable_cores(root, proc) == ALLOWED


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path: Path) -> None:
    quota = f"{(ALLOWED + 8) * 100000} 100000"
    assert usable_cores(_cgroup(tmp_path, {"cpu.max": quota}), tmp_path / "absent") == ALLOWED


def test_this_machine() -> None:
    """Whatever this machine's control group says, the answer is within the affinity."""
    assert 1 <= usable_cores() <= ALLOWED
