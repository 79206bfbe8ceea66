"""SIGTERM in every phase of a job, each where the agent waits on something (an unreachable
store, a running command, an upload drain, the last records): the right terminal state and exit
code, within the grace period. Each phase is held open on purpose: the store is stopped, or the
command waits, so the signal lands exactly there."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass

import pytest
import servers
from helpers import BIN, Agent, finish, marked_processes, wait_for

# Long enough for a stop during staging, which is heard only between the store's own quick
# retries (up to about 4 s against a source that refuses connections; see RELIABILITY.md).
GRACE = 10.0
SLACK = 1.0  # process start-up and exit, on top of the grace period
STOPPED = 128 + signal.SIGTERM


@dataclass(frozen=True)
class Phase:
    name: str
    marker: str  # a line of the agent's output that says the job is in the phase
    store_down: bool  # the store is stopped once the job is in the phase (or before it starts)
    exit_code: int
    status: str | None  # the node record's terminal status, when the store can be read after


PHASES = [
    # The store is down from the start: the agent waits to create the job's records.
    Phase("creating", "the store is unreachable", True, STOPPED, None),
    # A weights source that is down: staging waits it out.
    Phase("staging", "weights[0]: the source is unreachable", False, STOPPED, "STOPPED"),
    Phase("running", "training step", False, STOPPED, "STOPPED"),
    # A checkpoint written, the store down: the drain retries until the signal.
    Phase("draining", "upload of checkpoint-1/", True, STOPPED, None),
    # The commands are done, the store down: the last record waits for it.
    Phase("recording", "cannot save the node record", True, 0, None),
]


def _job(phase: Phase, agent: Agent) -> dict[str, object]:
    if phase.name == "running":
        command = "while true; do echo training step; sleep 0.2; done"
    elif phase.name == "draining":
        command = (
            f"sleep 1 && {sys.executable} {BIN / 'write_checkpoints.py'} "
            f"{agent.root / 'ledger.json'} --steps 1 --size 3000000"
        )
    else:
        command = "sleep 1; echo trained"
    job: dict[str, object] = {
        "image": {"base_image": "x"},
        "runtime": {"start_commands": [command], "checkpointing_config": {"enabled": True}},
    }
    if phase.name == "staging":  # an R2 endpoint where nothing listens
        job["weights"] = [{"source": "r2://acct.gone/model", "mount_location": "/app/model"}]
    return job


@pytest.mark.parametrize("phase", PHASES, ids=[p.name for p in PHASES])
def test_sigterm_in_each_phase(agent: Agent, own_s3: servers.SeaweedFS, phase: Phase) -> None:
    env = {
        **own_s3.client_env(),
        "BT_CHECKPOINT_QUIET_SECONDS": "0.2",
        "BT_R2_ENDPOINT_URL": f"http://127.0.0.1:{servers.free_port()}",
    }
    url = "s3://store/bt"
    if phase.name == "creating":
        own_s3.stop()
    process = agent.start(
        _job(phase, agent),
        "--job-id",
        f"stop{phase.name[:3]}",
        "--store",
        url,
        "--grace-period",
        f"{GRACE:g}",
        env=env,
    )
    if phase.name in ("draining", "recording"):  # the store goes while the command sleeps
        wait_for(lambda: "start_commands[0]" in agent.output(), 60, "the commands to start")
        own_s3.stop()
    wait_for(lambda: phase.marker in agent.output(), 90, f"the {phase.name} phase")
    time.sleep(0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = finish(process, 60, agent)
    elapsed = time.monotonic() - sent
    print(f"SIGTERM while {phase.name}: exit {code} after {elapsed:.2f} s")
    assert code == phase.exit_code, agent.output()
    assert elapsed < GRACE + SLACK, f"{phase.name}: took {elapsed:.1f} s, grace {GRACE:g} s"
    assert marked_processes(agent.mark) == []
    if phase.status is not None:
        from bt_agent.settings import Environ
        from bt_agent.storage import open_store

        store = open_store(url, Environ(env))
        key = f"projects/default/jobs/stop{phase.name[:3]}/nodes/rank-0.json"
        record = json.loads(store.read_bytes(key))
        assert record["status"] == f"TRAINING_JOB_{phase.status}", record
