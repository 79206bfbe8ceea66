"""``entrypoint.sh`` execs the agent (so it is PID 1 in a container), spec from $BT_JOB_SPEC.

There is no Docker engine here: the script is run directly, as the container would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, Agent, job_with


def _agent_bin(tmp_path: Path) -> Path:
    wrapper = tmp_path / "bt-agent"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m bt_agent "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _entrypoint(agent: Agent, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BT_")}
    full = {
        **base,
        "BT_AGENT_BIN": str(_agent_bin(agent.root)),
        "HOME": str(agent.root),
        "BT_NODE_ROOT": str(agent.node_root),
        "BT_STORE_URL": str(agent.store),
        **env,
    }
    return subprocess.run(
        [str(REPO / "entrypoint.sh")],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_entrypoint_runs_the_job_from_bt_job_spec(agent: Agent) -> None:
    spec = agent.spec(job_with(start_commands=["echo pid=$$ ppid=$PPID"]))
    done = _entrypoint(
        agent,
        {
            "BT_JOB_SPEC": str(spec),
            "BT_TRAINING_JOB_ID": "entry01",
            "BT_TRAINING_PROJECT_NAME": "images",
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pid=")
    record = json.loads(
        (agent.store / "projects/images/jobs/entry01/nodes/rank-0.json").read_text()
    )
    assert record["status"] == "TRAINING_JOB_COMPLETED"


def test_entrypoint_execs_so_the_agent_replaces_the_shell(agent: Agent) -> None:
    out = agent.root / "parent"
    spec = agent.spec(job_with(start_commands=[f"cat /proc/$PPID/cmdline | tr '\\0' ' ' > {out}"]))
    done = _entrypoint(agent, {"BT_JOB_SPEC": str(spec)})
    assert done.returncode == 0, done.stderr
    parent = out.read_text()
    assert "bt_agent run" in parent and "entrypoint" not in parent


def test_entrypoint_without_spec(agent: Agent) -> None:
    done = _entrypoint(agent, {})
    assert done.returncode == 2 and "BT_JOB_SPEC" in done.stderr


def test_entrypoint_passes_the_exit_code(agent: Agent) -> None:
    spec = agent.spec(job_with(start_commands=["exit 42"]))
    assert _entrypoint(agent, {"BT_JOB_SPEC": str(spec)}).returncode == 42
