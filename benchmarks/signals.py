"""Signal latency and reaping, in one run.

    python benchmarks/signals.py [--runs 10] [--orphans 1000]

1. SIGTERM to the agent running a bare ``torchrun --nproc-per-node=2`` job, until each worker's
   handler runs (median over runs and workers), side by side with SIGTERM sent to a bare torchrun
   with no agent.
2. Zombies left when a start_command spawns N orphans that exit while the job goes on: the agent
   against a naive PID 1 (``subprocess.run`` as a child subreaper, no reaping loop).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import compile_agent, table, write_json

from bt_agent.supervisor import tree

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / "tests" / "bin"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
LATENCY_TARGET_MS = 50.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _agent_run(spec: Path, work: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bt_agent",
        "run",
        str(spec),
        "--node-root",
        str(work / "node"),
        "--store",
        str(work / "store"),
    ]


def _wait(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the job to start")
        time.sleep(0.005)


def _latencies(work: Path, with_agent: bool) -> list[float]:
    marker = work / f"term-{time.monotonic_ns()}"
    env = {**os.environ, "WAIT_FOR_SIGTERM": str(marker), "PET_MASTER_PORT": str(_free_port())}
    command = f"{TORCHRUN} --nproc-per-node=2 {BIN}/ddp_train.py"
    if with_agent:
        spec = work / "job.json"
        spec.write_text(
            json.dumps(
                {
                    "training_job": {
                        "image": {"base_image": "x"},
                        "runtime": {
                            "start_commands": [command],
                            "environment_variables": {
                                "WAIT_FOR_SIGTERM": str(marker),
                                "PET_MASTER_PORT": env["PET_MASTER_PORT"],
                            },
                        },
                    }
                }
            )
        )
        argv = [
            *_agent_run(spec, work),
            "--grace-period",
            "20",
        ]
    else:
        argv = command.split()
        env.update({"PET_NNODES": "1", "PET_MASTER_ADDR": "127.0.0.1"})
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready = [Path(f"{marker}.ready-{rank}") for rank in (0, 1)]
    _wait(lambda: all(p.exists() for p in ready), 120)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    process.wait(60)
    return [(float(Path(f"{marker}.rank-{r}").read_text()) - sent) * 1000 for r in (0, 1)]


def latency_rows(runs: int) -> list[dict[str, object]]:
    results: dict[str, list[float]] = {"bare torchrun": [], "bt-agent + torchrun": []}
    with tempfile.TemporaryDirectory(prefix="bt-signals-") as tmp:
        for _ in range(runs):
            results["bare torchrun"] += _latencies(Path(tmp), with_agent=False)
            results["bt-agent + torchrun"] += _latencies(Path(tmp), with_agent=True)
    return [
        {
            "sigterm_to_worker": name,
            "samples": len(values),
            "median_ms": round(statistics.median(values), 2),
            "max_ms": round(max(values), 2),
        }
        for name, values in results.items()
    ]


def _zombies_of(pid: int) -> int:
    children = [child for child, parent in tree.parents().items() if parent == pid]
    return len(children) - len(tree.living(children))


NAIVE_PID1 = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)   # child subreaper, as the agent
sys.exit(subprocess.run(["/bin/sh", "-c", sys.argv[1]]).returncode)
"""


def zombie_rows(orphans: int) -> list[dict[str, object]]:
    command = f"{sys.executable} {BIN}/spawn_orphans.py {orphans} 0.3 && sleep 3"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bt-zombies-") as tmp:
        spec = Path(tmp) / "job.json"
        spec.write_text(
            json.dumps(
                {
                    "training_job": {
                        "image": {"base_image": "x"},
                        "runtime": {"start_commands": [command]},
                    }
                }
            )
        )
        contenders = {
            "naive PID 1 (subprocess.run)": [sys.executable, "-c", NAIVE_PID1, command],
            "bt-agent run": [
                *_agent_run(spec, Path(tmp)),
            ],
        }
        for name, argv in contenders.items():
            process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2.0)  # the orphans have exited; the job is still sleeping
            zombies = _zombies_of(process.pid)
            process.wait(30)
            rows.append({"pid_1": name, "orphans": orphans, "zombies_after_exit": zombies})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--orphans", type=int, default=1000)
    args = parser.parse_args()
    compile_agent()
    latency = latency_rows(args.runs)
    print(table(latency, ["sigterm_to_worker", "samples", "median_ms", "max_ms"]))
    zombies = zombie_rows(args.orphans)
    print()
    print(table(zombies, ["pid_1", "orphans", "zombies_after_exit"]))
    agent_ms = float(latency[-1]["median_ms"])  # type: ignore[arg-type]
    print(
        f"\nSIGTERM to worker through the agent: {agent_ms} ms median "
        f"({'meets' if agent_ms <= LATENCY_TARGET_MS else 'MISSES'} the "
        f"{LATENCY_TARGET_MS:g} ms target); zombies left by the agent: "
        f"{zombies[-1]['zombies_after_exit']} (target 0)"
    )
    path = write_json(
        "signals", {"latency": latency, "zombies": zombies, "target_latency_ms": LATENCY_TARGET_MS}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
