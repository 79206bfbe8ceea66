"""The allocator's settings for moving data (bt_agent.memory): few arenas, which the CLI sets
first thing for the commands that move data, and large buffers mapped, which the checkpoint
sidecar adds; observed in real processes through glibc's own report (``malloc_info``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs ``main(argv)`` (the console script's entry) or, for ``sidecar``, what the checkpoint
#: sidecar sets as it starts; then eight threads allocate at once, and a buffer of 2 MiB is freed
#: before one of 1.5 MiB is taken, glibc's report written before and after that last one.
PROBE = """
import ctypes, sys, threading
from bt_agent.cli.main import main
from bt_agent.memory import return_large_buffers

if sys.argv[2:] == ["sidecar"]:
    return_large_buffers()
else:
    try:
        main(sys.argv[2:])
    except SystemExit:
        pass
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
together = threading.Barrier(8)

def allocate():
    together.wait()
    for _ in range(100):
        libc.free(libc.malloc(64))

threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()


def report(path):
    stream = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)


libc.free(libc.malloc(2 * 1024 * 1024))  # glibc's default raises its mmap threshold past it
report(sys.argv[1] + ".before")
kept = libc.malloc(3 * 512 * 1024)
report(sys.argv[1])
"""


def _report(tmp_path: Path, argv: list[str]) -> tuple[int, int]:
    """How many arenas the probe's process had, and whether its buffer of 1.5 MiB was mapped
    (how many more chunks it held by mmap after taking it: 1 or 0)."""
    report = tmp_path / "malloc.xml"
    subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *argv],
        check=True,
        capture_output=True,
        timeout=60,
    )
    text = report.read_text()
    arenas = len(re.findall(r'<heap nr="\d+">', text))
    return arenas, _mapped(text) - _mapped(Path(f"{report}.before").read_text())


def _mapped(text: str) -> int:
    found = re.search(r'<total type="mmap" count="(\d+)"', text)
    assert found, text
    return int(found.group(1))


def _store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.mark.parametrize("command", ["run", "stage", "checkpoints"])
def test_commands_that_move_data_keep_two_arenas(tmp_path: Path, command: str) -> None:
    argv = {
        "run": ["run", "--help"],
        "stage": ["stage", "--help"],
        "checkpoints": ["checkpoints", "list", "--store", _store(tmp_path)],
    }[command]
    arenas, mapped = _report(tmp_path, argv)
    assert arenas <= 2, f"{command}: {arenas} malloc arenas for eight threads"
    assert mapped == 0, f"{command}: large buffers mapped before the sidecar asked for it"


def test_the_sidecar_has_large_buffers_mapped(tmp_path: Path) -> None:
    arenas, mapped = _report(tmp_path, ["sidecar"])
    assert arenas <= 2, f"{arenas} malloc arenas for eight threads"
    assert mapped == 1, "a buffer of 1.5 MiB came from the heap, not by mmap"


def test_other_commands_leave_the_allocator_as_it_is(tmp_path: Path) -> None:
    """The control: without the settings the same probe sees an arena per thread and the
    buffer from the heap, so the tests above can tell them apart."""
    arenas, mapped = _report(tmp_path, ["jobs", "list", "--store", _store(tmp_path)])
    assert arenas > 2
    assert mapped == 0
