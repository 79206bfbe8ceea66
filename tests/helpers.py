"""What the tests share: the real ``bt-agent`` run in a subprocess against a temporary node and
store (:class:`Agent`), waiting without sleeping blindly, processes found by their mark, small
jobs, and modules a test needs (a missing one fails saying how to install it, never skips)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(__file__).resolve().parent / "bin"
MARK = "BTTEST_MARK"
MINIMAL_JOB: dict[str, Any] = {"image": {"base_image": "python:3.11-slim"}}


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


@dataclass
class Agent:
    """Runs ``python -m bt_agent`` with an isolated HOME, node root, store and secrets dir."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def node_root(self) -> Path:
        return self.root / "node"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def secrets_dir(self) -> Path:
        return self.root / "secrets"

    def secret(self, name: str, value: str) -> None:
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        (self.secrets_dir / name).write_text(value + "\n")

    def spec(self, job: dict[str, Any], name: str = "job.json", wire: bool = True) -> Path:
        directory = self.root / "code"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.write_text(json.dumps({"training_job": job} if wire else job))
        return path

    def context_args(self) -> list[str]:
        return [
            "--node-root",
            str(self.node_root),
            "--store",
            str(self.store),
            "--secrets-dir",
            str(self.secrets_dir),
        ]

    def full_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        full = {k: v for k, v in os.environ.items() if not k.startswith("BT_")}
        full.update({"HOME": str(self.root / "home"), MARK: self.mark, **self.env, **(env or {})})
        return full

    def __call__(
        self,
        *args: str,
        timeout: float = 60,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        file_size_limit: int | None = None,
    ) -> Result:
        """``bt-agent ARGS``; with ``file_size_limit``, no file it writes may grow past that many
        bytes (``RLIMIT_FSIZE``: a write beyond fails with ``EFBIG``, as one to a full disk
        fails with ``ENOSPC``; Python ignores the kernel's ``SIGXFSZ``)."""

        def limited() -> None:
            if file_size_limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

        done = subprocess.run(
            [sys.executable, "-m", "bt_agent", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.full_env(env),
            input=stdin,
            cwd=self.root,
            check=False,
            preexec_fn=limited,
        )
        return Result(done.returncode, done.stdout, done.stderr)

    def start(
        self, job: dict[str, Any], *extra: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start ``bt-agent run`` in the background (stdout and stderr to files in root)."""
        spec = self.spec(job, name=f"job-{uuid.uuid4().hex[:6]}.json")
        with open(self.root / "agent.out", "a") as out, open(self.root / "agent.err", "a") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "bt_agent", "run", str(spec), *self.context_args(), *extra],
                env=self.full_env(env),
                cwd=self.root,
                stdout=out,
                stderr=err,
                text=True,
            )

    def output(self) -> str:
        names = ("agent.out", "agent.err")
        return "".join((self.root / n).read_text() for n in names if (self.root / n).exists())

    def run_job(self, job: dict[str, Any], *extra: str, **kwargs: Any) -> Result:
        return self("run", str(self.spec(job)), *self.context_args(), *extra, **kwargs)

    def job_view(self, job_id: str) -> dict[str, Any]:
        result = self("jobs", "view", job_id, "--store", str(self.store), "-o", "json")
        assert result.code == 0, result.text
        data: dict[str, Any] = json.loads(result.out)
        return data

    def only_job_id(self) -> str:
        ids = [p.stem for p in (self.store / "jobs").glob("*.json")]
        assert len(ids) == 1, ids
        return ids[0]


def run_nodes(
    agent: Agent,
    job: dict[str, Any],
    job_id: str,
    tag: str,
    *extra: str,
    env: dict[str, str] | None = None,
    nodes: int = 2,
    timeout: float = 180,
) -> list[int]:
    """Run ``job`` as one job on ``nodes`` agents at once (ranks 0.., the leader on 127.0.0.1),
    each with its node root ``<tag>-node<rank>``; their exit codes."""
    processes = [
        agent.start(
            job,
            *extra,
            "--job-id",
            job_id,
            "--node-rank",
            str(rank),
            "--leader-addr",
            "127.0.0.1",
            "--node-root",
            str(agent.root / f"{tag}-node{rank}"),
            env=env,
        )
        for rank in range(nodes)
    ]
    return [finish(p, timeout, agent) for p in processes]


def marked_processes(mark: str) -> list[int]:
    """Living processes (zombies excluded) whose environment carries ``mark``."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2 :].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def process_tree(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        lines.append(f"{pid}: {cmd}")
    return "\n".join(lines)


def needs_two_cpus() -> list[int]:
    """The CPUs this process may use; skips a test that keeps one for training and needs
    another for the uploads where there is only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("this machine has one CPU: there is no other to keep the sidecar on")
    return cpus


def wait_for(predicate: Any, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def finish(process: subprocess.Popen[str], timeout: float, agent: Agent) -> int:
    """Wait for a background agent; on a hang, fail with its process tree, never wait forever."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        tree = process_tree(marked_processes(agent.mark))
        process.kill()
        process.wait()
        raise AssertionError(
            f"agent still running after {timeout} s:\n{tree}\n{agent.output()}"
        ) from None


def run_entrypoint(
    agent: Agent, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``entrypoint.sh`` as a container would, the agent found through ``BT_AGENT_BIN``;
    node root and store default to the agent's, ``env`` may override them."""
    wrapper = agent.root / "bt-agent"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m bt_agent "$@"\n')
    wrapper.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("BT_")}
    full = {
        **base,
        "BT_AGENT_BIN": str(wrapper),
        "HOME": str(agent.root),
        "BT_NODE_ROOT": str(agent.node_root),
        "BT_STORE_URL": str(agent.store),
        MARK: agent.mark,
        **env,
    }
    return subprocess.run(
        [str(REPO / "entrypoint.sh")],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``2m``) at ``where``, for full-disk tests. Mounting needs root:
    CI runs as root; elsewhere the test is skipped and says why."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def trainer_job(agent: Agent, source: str, args: str = "", before: str = "") -> dict[str, Any]:
    """A job with checkpointing on whose one command runs the Python ``source`` (saved in the
    test's directory) with ``args``, after the shell command ``before`` if given."""
    script = agent.root / f"trainer-{uuid.uuid4().hex[:8]}.py"
    script.write_text(source)
    command = f"{sys.executable} {script} {args}".rstrip()
    return {
        "image": {"base_image": "x"},
        "runtime": {
            "start_commands": [f"{before} && {command}" if before else command],
            "checkpointing_config": {"enabled": True},
        },
    }


#: Loaded into the agent's interpreter (``sitecustomize``, by ``PYTHONPATH``): makes a function
#: of the agent's (``FAIL_INSIDE``: ``module:Class.method``) raise an error no rule of the
#: agent's reads, once ``FAIL_INSIDE_WHEN`` names a file that exists. It stands in for a bug,
#: or a library's error the agent does not know (hf_xet's ``RuntimeError`` from Xet storage,
#: which no server here serves): neither can be had on purpose.
_FAIL_INSIDE = """
import importlib
import os
from pathlib import Path

_module, _, _name = os.environ["FAIL_INSIDE"].partition(":")
_owner, _, _method = _name.rpartition(".")
_class = getattr(importlib.import_module(_module), _owner)
_when = Path(os.environ["FAIL_INSIDE_WHEN"])
_real = getattr(_class, _method)


def _failing(self, *args, **kwargs):
    if _when.exists():
        raise RuntimeError("Data processing error: CAS service error (token sk-live-123)")
    return _real(self, *args, **kwargs)


setattr(_class, _method, _failing)
"""


def failing_inside(agent: Agent, target: str, when: Path) -> dict[str, str]:
    """The environment that has ``target`` (``module:Class.method``) of the agent raise a
    ``RuntimeError`` once ``when`` exists (:data:`_FAIL_INSIDE`)."""
    patch = agent.root / "fail-inside"
    patch.mkdir(exist_ok=True)
    (patch / "sitecustomize.py").write_text(_FAIL_INSIDE)
    return {"PYTHONPATH": str(patch), "FAIL_INSIDE": target, "FAIL_INSIDE_WHEN": str(when)}


def job_with(**runtime: Any) -> dict[str, Any]:
    """A minimal valid job with these runtime fields."""
    return {**MINIMAL_JOB, "runtime": runtime}


def require(module: str, install: str) -> ModuleType:
    """``module`` imported, or the test fails at collection saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"this test needs {module}: {install}", pytrace=False)
