"""The catalogue at workspace scale: a store of many jobs with several committed checkpoints
each, on SeaweedFS, read as a resuming job and the CLI read it, with the index and without it
(the same store, its index marker hidden), on loopback and with latency added to every request
by a proxy (a store far away). Then `bt-agent store reindex` of the whole store, on loopback
and with the latency added.

    python benchmarks/catalog.py [--jobs 10000] [--checkpoints 5] [--latency-ms 20]

Requests are counted by the proxy. "resume latest" is the lookup a job with
``from_latest_checkpoint`` makes before its first command (in this process, as the agent makes
it); the listings are `bt-agent jobs list` and `checkpoints list --project` as a user runs them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from _common import compile_agent, table, write_json

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402  (the same server fixtures the tests use)
from fault_proxy import FaultProxy  # noqa: E402

from bt_agent.catalog import Catalog  # noqa: E402
from bt_agent.catalog.index import concurrently  # noqa: E402
from bt_agent.catalog.layout import INDEX_FORMAT_KEY  # noqa: E402
from bt_agent.records import JobRecord, Manifest, ManifestFile  # noqa: E402
from bt_agent.settings import Environ  # noqa: E402
from bt_agent.storage import ObjectStore, open_store  # noqa: E402

PROJECT = "ws"
STORE = "s3://catalog/bt"
START = datetime(2026, 1, 1, tzinfo=timezone.utc)
TARGETS = {"resume latest": 0.2, "jobs list": 1.0, "checkpoints list --project": 1.0}


def _at(seconds: float) -> str:
    return (START + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def populate(store: ObjectStore, jobs: int, checkpoints: int) -> float:
    """``jobs`` jobs a minute apart, each with ``checkpoints`` commits; the store's rate."""
    catalog = Catalog(store)

    def one(index: int) -> None:
        record = catalog.create_job(
            JobRecord(f"job{index:06d}", PROJECT, None, _at(index * 60), 1, {})
        )
        for step in range(1, checkpoints + 1):
            at = index * 60 + step
            files = [ManifestFile("model.safetensors", 1 << 30, "0" * 64)]
            manifest = Manifest(
                record.job_id, PROJECT, 0, f"checkpoint-{step}", _at(at), _at(at), files
            )
            catalog.write_manifest(manifest)

    started = time.perf_counter()
    one(0)  # alone: the store starts indexed
    done = 1
    for first in range(1, jobs, 1000):
        concurrently(one, range(first, min(first + 1000, jobs)))
        done = min(first + 1000, jobs)
        print(f"  {done:,} of {jobs:,} jobs written", file=sys.stderr, flush=True)
    return jobs / (time.perf_counter() - started)


def _agent(env: dict[str, str], *args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bt_agent", *args, "--store", STORE, "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"bt-agent {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def measure(
    proxy: FaultProxy, what: str, call: Callable[[], object], runs: int = 3
) -> tuple[float, int]:
    """Median wall and the requests of one run of ``call``."""
    walls, counts = [], []
    for _ in range(runs):
        before = proxy.requests
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
        counts.append(proxy.requests - before)
    return sorted(walls)[len(walls) // 2], max(counts)


def rows_for(
    server: servers.SeaweedFS, base_env: dict[str, str], latency_ms: float, indexed: bool
) -> list[dict[str, Any]]:
    proxy = FaultProxy(server.port, delay=latency_ms / 1000)
    env = {**base_env, "AWS_ENDPOINT_URL": proxy.endpoint}
    store = open_store(STORE, Environ(env))
    checks: dict[str, Callable[[], object]] = {
        "resume latest": lambda: Catalog(store).latest(PROJECT, 0, but="new-job"),
        "jobs list": lambda: _agent(env, "jobs", "list"),
        "checkpoints list --project": lambda: _agent(
            env, "checkpoints", "list", "--project", PROJECT
        ),
    }
    rows = []
    try:
        for what, call in checks.items():
            runs = 3 if indexed else 1
            wall, requests = measure(proxy, what, call, runs)
            rows.append(
                {
                    "added_latency_ms": latency_ms,
                    "index": "yes" if indexed else "no",
                    "read": what,
                    "wall_s": round(wall, 3),
                    "requests": requests,
                }
            )
            print(table(rows[-1:], list(rows[-1])), file=sys.stderr, flush=True)
    finally:
        proxy.close()
        store.close()
    return rows


def reindex(server: servers.SeaweedFS, env: dict[str, str], latency_ms: float, jobs: int) -> float:
    """Remove the index, then time `bt-agent store reindex` (through the delaying proxy when
    ``latency_ms``): jobs per second."""
    store = open_store(STORE, Environ(env))
    keys = [
        i.key for prefix in ("index/", f"projects/{PROJECT}/index/") for i in store.list(prefix)
    ]
    concurrently(store.delete, keys)
    store.close()
    proxy = FaultProxy(server.port, delay=latency_ms / 1000) if latency_ms else None
    if proxy is not None:
        env = {**env, "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "bt_agent", "store", "reindex", "--store", STORE],
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
    finally:
        if proxy is not None:
            proxy.close()
    if done.returncode != 0:
        raise SystemExit(f"bt-agent store reindex failed: {done.stderr[-2000:]}")
    return jobs / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--checkpoints", type=int, default=5, help="commits per job")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    compile_agent()
    with tempfile.TemporaryDirectory(prefix="bt-catalog-", dir=os.environ.get("BENCH_DIR")) as t:
        server = servers.seaweedfs(Path(t) / "server")
        try:
            server.create_bucket("catalog")
            env = {**os.environ, **server.client_env()}
            env.pop("AWS_CA_BUNDLE", None)
            store = open_store(STORE, Environ(env))
            print(f"writing {args.jobs:,} jobs x {args.checkpoints} commits", file=sys.stderr)
            rate = populate(store, args.jobs, args.checkpoints)
            rows = []
            for latency in (0.0, args.latency_ms):
                rows += rows_for(server, env, latency, indexed=True)
            marker = store.read_bytes(INDEX_FORMAT_KEY)
            store.delete(INDEX_FORMAT_KEY)  # a store written before the index: every job read
            rows += rows_for(server, env, 0.0, indexed=False)
            store.write_bytes(INDEX_FORMAT_KEY, marker)
            reindexed = {
                latency: reindex(server, env, latency, args.jobs)
                for latency in (0.0, args.latency_ms)
            }
        finally:
            server.stop()
    shape = f"{args.jobs:,} jobs x {args.checkpoints} checkpoints"
    print(f"\n{shape}, written at {rate:,.0f} jobs/s\n")
    print(table(rows, ["added_latency_ms", "index", "read", "wall_s", "requests"]))
    verdicts = []
    for row in rows:
        target = TARGETS[row["read"]]
        if row["index"] == "yes" and (row["added_latency_ms"] or row["read"] == "resume latest"):
            verdicts.append(
                f"{row['read']} (+{row['added_latency_ms']:.0f} ms): {row['wall_s']} s "
                f"(target <= {target} s)"
                + (f", {row['requests']} requests (target <= 3)" if "resume" in row["read"] else "")
            )
    verdicts.append(f"store reindex: {reindexed[0.0]:,.0f} jobs/s on loopback (target >= 200)")
    verdicts.append(
        f"store reindex (+{args.latency_ms:.0f} ms): {reindexed[args.latency_ms]:,.0f} jobs/s"
    )
    print("\n" + "\n".join(verdicts))
    path = write_json(
        "catalog",
        {
            "shape": shape,
            "rows": rows,
            "reindex_jobs_per_s": {str(ms): round(rate) for ms, rate in reindexed.items()},
            "verdicts": verdicts,
        },
    )
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
