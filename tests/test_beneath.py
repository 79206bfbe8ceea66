"""Opening files of the checkpoint dir without leaving it, with the kernel's ``openat2`` and
with the component-by-component walk used where the kernel has none."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from bt_agent.sidecar import beneath


@pytest.fixture(params=["openat2", "walk"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "walk":  # a kernel without openat2
        monkeypatch.setattr(beneath.KERNEL, "available", False)
    else:
        assert beneath.KERNEL.available, "this kernel has openat2 (Linux 5.6 or newer)"
    yield str(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[int]:
    root = tmp_path / "ckpt"
    (root / "checkpoint-1" / "sub").mkdir(parents=True)
    (root / "checkpoint-1" / "sub" / "model.bin").write_bytes(b"inside")
    (root / "checkpoint-1" / "alias.bin").symlink_to("sub/model.bin")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside")
    (root / "checkpoint-1" / "escape").symlink_to(outside)
    (root / "checkpoint-1" / "absolute.txt").symlink_to(outside / "secret.txt")
    (root / "checkpoint-1" / "up.txt").symlink_to("../../outside/secret.txt")
    os.mkfifo(root / "checkpoint-1" / "pipe")
    fd = os.open(root, beneath.PATH_FLAGS | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_regular_files_open_and_name_the_file_opened(kernel: str, tree: int) -> None:
    with beneath.open_file(tree, "checkpoint-1/sub/model.bin") as opened:
        assert opened.path.read_bytes() == b"inside"
        assert stat.S_ISREG(opened.info.st_mode)


@pytest.mark.parametrize("relative", ["checkpoint-1/escape/secret.txt", "checkpoint-1/up.txt"])
def test_nothing_outside_is_reached(kernel: str, tree: int, relative: str) -> None:
    with pytest.raises(beneath.Refused):
        beneath.open_file(tree, relative)
    with pytest.raises(beneath.Refused):
        beneath.stat_at(tree, relative)


def test_an_absolute_symlink_is_refused(kernel: str, tree: int) -> None:
    with pytest.raises(beneath.Refused):
        beneath.open_file(tree, "checkpoint-1/absolute.txt")


def test_a_symlink_inside_is_followed_only_by_openat2(kernel: str, tree: int) -> None:
    if kernel == "openat2":
        with beneath.open_file(tree, "checkpoint-1/alias.bin") as opened:
            assert opened.path.read_bytes() == b"inside"
    else:
        with pytest.raises(beneath.Refused, match="symlink"):
            beneath.open_file(tree, "checkpoint-1/alias.bin")


def test_a_fifo_is_refused_without_blocking(kernel: str, tree: int) -> None:
    with pytest.raises(beneath.Refused, match="a FIFO"):
        beneath.open_file(tree, "checkpoint-1/pipe")
    assert stat.S_ISFIFO(beneath.stat_at(tree, "checkpoint-1/pipe").st_mode)


def test_missing_files_are_file_not_found(kernel: str, tree: int) -> None:
    with pytest.raises(FileNotFoundError):
        beneath.open_file(tree, "checkpoint-1/nothing.bin")
