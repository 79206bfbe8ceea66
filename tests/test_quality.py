"""The code base stays ruff-clean and mypy-strict; these run the real tools."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO


def _tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", name, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_ruff_clean() -> None:
    done = _tool("ruff", "check", "bt_agent", "tests", "benchmarks", "examples")
    assert done.returncode == 0, done.stdout + done.stderr + "\n(pip install -e '.[test]')"


def test_mypy_strict() -> None:
    done = _tool("mypy")
    assert done.returncode == 0, done.stdout + done.stderr + "\n(pip install -e '.[test]')"
