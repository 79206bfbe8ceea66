"""Start-up discipline: importing the CLI pulls in no storage SDK, torch or pydantic, and
importing any module of the package has no side effects."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import bt_agent

HEAVY = ["boto3", "botocore", "google.cloud", "huggingface_hub", "torch", "pydantic", "watchdog"]


def _modules_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    modules: list[str] = json.loads(done.stdout)
    return modules


def test_cli_imports_no_heavy_library() -> None:
    loaded = _modules_after("import bt_agent.cli.main, bt_agent.cli.commands")
    for name in HEAVY:
        assert not any(m == name or m.startswith(name + ".") for m in loaded), name


def test_every_module_imports_without_side_effects(tmp_path: Path) -> None:
    names = [
        m.name
        for m in pkgutil.walk_packages(bt_agent.__path__, "bt_agent.")
        if not m.name.endswith("_load_config")
    ]
    code = "\n".join(f"import {name}" for name in names)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    assert list(tmp_path.iterdir()) == [], "importing created files"
