"""Start-up discipline: importing the CLI pulls in no storage SDK, torch or pydantic, and
importing any module of the package has no side effects. Structure: no two modules import
each other, even only for type checking."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import bt_agent

HEAVY = [
    "boto3",
    "botocore",
    "google.cloud",
    "huggingface_hub",
    "torch",
    "pydantic",
    "watchdog",
    "textual",
]


def _modules_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    modules: list[str] = json.loads(done.stdout)
    return modules


def test_cli_imports_no_heavy_library() -> None:
    loaded = _modules_after("import bt_agent.cli.main, bt_agent.cli.commands")
    for name in HEAVY:
        assert not any(m == name or m.startswith(name + ".") for m in loaded), name


def test_a_job_on_a_file_store_imports_only_what_it_uses(tmp_path: Path) -> None:
    spec = tmp_path / "job.json"
    job = {"image": {"base_image": "x"}, "runtime": {"start_commands": ["true"]}}
    spec.write_text(json.dumps({"training_job": job}))
    flags = [f"--{name}={tmp_path / name}" for name in ("node-root", "store", "secrets-dir")]
    probe = (
        "import atexit, json, sys\n"
        "atexit.register(lambda: print(json.dumps(sorted(sys.modules))))\n"
        "from bt_agent.cli.main import main\n"
        f"main({['run', str(spec), *flags]!r})"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert "bt_agent.supervisor.job" in loaded
    for name in ("bt_agent.browse", "bt_agent.storage.engine", "obstore", "concurrent.futures"):
        assert name not in loaded, f"{name} is imported by a run that never uses it"


def test_the_engine_s_stores_import_no_client_of_the_standard_library() -> None:
    """The engine speaks HTTP and TLS in its own core: the stores on it, and staging, import
    neither the standard library's ``ssl`` nor its HTTP client (tens of milliseconds of every
    start); what reads their errors imports them after a failure only."""
    stores = "bt_agent.storage.s3, bt_agent.storage.azure, bt_agent.storage.web"
    loaded = _modules_after(f"import {stores}, bt_agent.storage.registry, bt_agent.staging.weights")
    for name in ("ssl", "http.client", "urllib.request"):
        assert name not in loaded, f"{name} is imported with the engine's stores"


def test_commands_run_with_the_collector_on() -> None:
    probe = (
        "import gc\n"
        "from bt_agent.cli import commands\n"
        "def probe(args, out, err):\n"
        "    print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "    return 0\n"
        "commands.validate = probe\n"
        "from bt_agent.cli.main import main\n"
        "main(['validate', 'job.json'])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "True True\n"), done.stderr


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


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (lazily, or for type checking)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bt_agent"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else str(node.module))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    root = Path(bt_agent.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph.get(name, ()))
        return False

    cycles = sorted(
        f"{name} -> {other}"
        for name, imported in graph.items()
        for other in imported
        if other in graph and reaches(other, name)
    )
    assert not cycles, cycles
