"""Real torchrun under the agent: forwarded SIGTERM reaches every worker, and a two-node job runs
with two agents, on 127.0.0.1 and across two network namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from helpers import BIN, Agent, finish, job_with, require, wait_for

require("torch", "pip install torch==2.13.0")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TRAIN = f"{BIN}/ddp_train.py"
pytestmark = pytest.mark.slow


def test_sigterm_reaches_every_torchrun_worker(agent: Agent) -> None:
    marker = agent.root / "term"
    job = job_with(
        start_commands=[f"{TORCHRUN} --nproc-per-node=2 {TRAIN}"],
        environment_variables={
            "WAIT_FOR_SIGTERM": str(marker),
            "PET_MASTER_PORT": str(servers.free_port()),
        },
    )
    process = agent.start(job, "--grace-period", "20")
    ready = [Path(f"{marker}.ready-{rank}") for rank in (0, 1)]
    wait_for(lambda: all(p.exists() for p in ready), timeout=90, what="both workers")
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    assert finish(process, 30, agent) == 143
    for rank in (0, 1):
        handled = float(Path(f"{marker}.rank-{rank}").read_text())
        assert handled - sent < 1.0, f"worker {rank} got SIGTERM {handled - sent:.3f} s later"
    node = json.loads(next(agent.store.glob("projects/*/jobs/*/nodes/rank-0.json")).read_text())
    assert node["status"] == "TRAINING_JOB_STOPPED"
    assert re.fullmatch(
        r"stopped by SIGTERM \(the commands ended \d+\.\d s after it\)", node["error"]
    )


def _two_node_job(port: int, extra_env: dict[str, str] | None = None) -> dict[str, object]:
    job = job_with(
        start_commands=[f"{TORCHRUN} {TRAIN}"],
        environment_variables={"PET_MASTER_PORT": str(port), **(extra_env or {})},
    )
    job["compute"] = {"node_count": 2}
    return job


def _check_two_nodes(agent: Agent, job_id: str) -> None:
    view = agent.job_view(job_id)
    assert view["status"] == "TRAINING_JOB_COMPLETED", view
    assert [n["node_rank"] for n in view["nodes"]] == [0, 1]
    assert all(n["status"] == "TRAINING_JOB_COMPLETED" for n in view["nodes"])
    for rank in (0, 1):
        log = agent("jobs", "logs", job_id, "--node", str(rank), "--store", str(agent.store)).out
        assert f"rank {rank}/2 node {rank} sum 12" in log, log


def test_two_node_torchrun_on_loopback(agent: Agent) -> None:
    job = _two_node_job(servers.free_port())
    processes = [
        agent.start(
            job,
            "--job-id",
            "twonode",
            "--node-rank",
            str(rank),
            "--leader-addr",
            "127.0.0.1",
            "--node-root",
            str(agent.root / f"node{rank}"),
        )
        for rank in (0, 1)
    ]
    codes = [finish(p, 120, agent) for p in processes]
    assert codes == [0, 0], agent.output()
    _check_two_nodes(agent, "twonode")


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: ((ns, address), (ns, address))."""
    if shutil.which("ip") is None:
        pytest.fail("the network-namespace test needs iproute2: apt-get install iproute2")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    tag = f"bt{os.getpid() % 100000}"
    hosts = ((f"{tag}a", "10.231.7.1"), (f"{tag}b", "10.231.7.2"))

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for name, _ in hosts:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip(
            "link",
            "add",
            f"{tag}va",
            "netns",
            hosts[0][0],
            "type",
            "veth",
            "peer",
            "name",
            f"{tag}vb",
            "netns",
            hosts[1][0],
        )
        for (name, address), device in zip(hosts, (f"{tag}va", f"{tag}vb"), strict=True):
            ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            ip("-n", name, "link", "set", device, "up")
        yield hosts
    finally:
        for name, _ in hosts:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


def test_two_node_torchrun_across_network_namespaces(agent: Agent) -> None:
    with two_hosts() as hosts:
        leader = hosts[0][1]
        port = 29617
        processes = []
        for rank, (namespace, _) in enumerate(hosts):
            device = f"{namespace[:-1]}v{namespace[-1]}"
            job = _two_node_job(port, {"GLOO_SOCKET_IFNAME": device})
            spec = agent.spec(job, name=f"netns-{rank}.json")
            argv = [
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                "-m",
                "bt_agent",
                "run",
                str(spec),
                *agent.context_args(),
                "--job-id",
                "netns01",
                "--node-rank",
                str(rank),
                "--leader-addr",
                leader,
                "--node-root",
                str(agent.root / f"node{rank}"),
            ]
            with open(agent.root / "agent.out", "a") as out:
                processes.append(
                    subprocess.Popen(
                        argv,
                        env=agent.full_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=agent.root,
                    )
                )
        codes = [finish(p, 120, agent) for p in processes]
        assert codes == [0, 0], agent.output()
    _check_two_nodes(agent, "netns01")
    env = json.loads(next(agent.store.glob("projects/*/jobs/netns01/job.json")).read_text())
    assert env["node_count"] == 2
