"""``entrypoint.sh`` execs the agent (so it is PID 1 in a container), spec from $BT_JOB_SPEC.

There is no Docker engine here: the script is run directly, as the container would run it.
"""

from __future__ import annotations

import json

from helpers import Agent, job_with, run_entrypoint


def test_entrypoint_runs_the_job_from_bt_job_spec(agent: Agent) -> None:
    spec = agent.spec(job_with(start_commands=["echo pid=$$ ppid=$PPID"]))
    done = run_entrypoint(
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
    done = run_entrypoint(agent, {"BT_JOB_SPEC": str(spec)})
    assert done.returncode == 0, done.stderr
    parent = out.read_text()
    assert "bt_agent run" in parent and "entrypoint" not in parent


def test_entrypoint_without_spec(agent: Agent) -> None:
    done = run_entrypoint(agent, {})
    assert done.returncode == 2 and "BT_JOB_SPEC" in done.stderr


def test_entrypoint_passes_the_exit_code(agent: Agent) -> None:
    spec = agent.spec(job_with(start_commands=["exit 42"]))
    assert run_entrypoint(agent, {"BT_JOB_SPEC": str(spec)}).returncode == 42
