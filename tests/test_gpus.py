"""GPU detection from what a container sees. There is no GPU here: device files live in a temp
dir and ``nvidia-smi`` is a stand-in script printing what the real one prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from bt_agent.gpus import detect
from bt_agent.settings import Environ


@pytest.fixture
def devices(tmp_path: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    return dev


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({"CUDA_VISIBLE_DEVICES": "3", "NVIDIA_VISIBLE_DEVICES": "all"}, 1),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}, 4),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, 0),
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, 0),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, 3),
        ({}, 3),
    ],
)
def test_sources_in_order(devices: Path, variables: dict[str, str], expected: int) -> None:
    assert detect(Environ({"PATH": "/nonexistent", **variables}), devices) == expected


def test_nvidia_smi_when_no_device_files(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)'\n"
    )
    smi.chmod(0o755)
    empty = tmp_path / "dev"
    empty.mkdir()
    assert detect(Environ({"PATH": str(bin_dir)}), empty) == 2
    assert detect(Environ({"PATH": str(tmp_path / "none")}), empty) == 0
