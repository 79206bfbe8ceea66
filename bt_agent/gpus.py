"""How many GPUs this container can see, without importing torch or calling CUDA."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from bt_agent.settings import Environ

_DEVICE = re.compile(r"^nvidia[0-9]+$")


def _device_files(dev_dir: Path) -> int:
    try:
        return sum(1 for p in dev_dir.iterdir() if _DEVICE.match(p.name))
    except OSError:
        return 0


def _listed(value: str) -> int:
    items = [item.strip() for item in value.split(",") if item.strip()]
    return 0 if items in ([], ["-1"]) else len(items)


def _nvidia_smi(path: str | None) -> int:
    """GPUs that ``nvidia-smi -L`` lists; 0 when it is missing or fails."""
    if path is None:
        return 0
    try:
        done = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def detect(environ: Environ, dev_dir: Path = Path("/dev")) -> int:
    """GPUs visible here, from the first source that says: ``CUDA_VISIBLE_DEVICES``,
    ``NVIDIA_VISIBLE_DEVICES`` (a list; ``none``/``void`` = 0), the ``/dev/nvidia<N>`` device
    files, then ``nvidia-smi -L``. ``NVIDIA_VISIBLE_DEVICES=all``, what the NVIDIA container
    runtime sets, defers to the devices."""
    cuda = environ.values.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None:
        return _listed(cuda)
    nvidia = environ.values.get("NVIDIA_VISIBLE_DEVICES")
    if nvidia is not None and nvidia.strip() not in ("all", ""):
        return 0 if nvidia.strip() in ("none", "void") else _listed(nvidia)
    devices = _device_files(dev_dir)
    if devices:
        return devices
    return _nvidia_smi(shutil.which("nvidia-smi", path=environ.values.get("PATH")))
