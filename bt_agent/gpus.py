"""How many GPUs this container can see, without importing torch or calling CUDA."""

from __future__ import annotations

import re
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


def detect(environ: Environ, dev_dir: Path = Path("/dev")) -> int:
    """GPUs visible here: ``CUDA_VISIBLE_DEVICES``, else ``NVIDIA_VISIBLE_DEVICES``, else /dev.

    ``NVIDIA_VISIBLE_DEVICES=all`` (what the NVIDIA container runtime sets) counts device files;
    ``none`` and ``void`` mean no GPU.
    """
    cuda = environ.values.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None:
        return _listed(cuda)
    nvidia = environ.values.get("NVIDIA_VISIBLE_DEVICES")
    if nvidia is not None and nvidia.strip() not in ("all", ""):
        return 0 if nvidia.strip() in ("none", "void") else _listed(nvidia)
    return _device_files(dev_dir)
