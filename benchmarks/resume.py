"""Resuming: loading a committed checkpoint from SeaweedFS, as a resumed job's agent does before
its first command, against ``s5cmd cp`` of the same objects, in one run.

    python benchmarks/resume.py [--small-count 500] [--shards 4] [--shard-mib 256] [--tls]
        [--far-ms 20 [--far-mbps 90]]

The checkpoint is a sharded one: ``--small-count`` files of 256 KiB (a sharded optimizer's state,
a distributed checkpoint's pieces) and ``--shards`` files of ``--shard-mib`` MiB, committed
through the catalogue as the sidecar commits (its manifest naming each file's sha256). The
agent's load is timed inside its process (after imports: finding the manifest, then every file
fetched, verified and the directory renamed into place); ``s5cmd`` as a whole command. Each row
is the median of three rounds, the two taking turns (which goes first alternates), every output
evicted from the page cache. With ``--tls`` the store is SeaweedFS's TLS port (its certificate
trusted through ``AWS_CA_BUNDLE``). ``--far-ms`` loads it again through a link to a store far
away (``tests/far_link.py``: each request held that long, each connection's answers paced at
``--far-mbps``). Target: the load at least 1.0x ``s5cmd``'s throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (
    add_far_arguments,
    compile_agent,
    evict,
    require_s5cmd,
    s5cmd_copy,
    table,
    taking_turns,
    via,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402
from far_link import FarLink  # noqa: E402

from bt_agent.catalog import Catalog, checkpoint_prefix  # noqa: E402
from bt_agent.records import JobRecord, Manifest, ManifestFile  # noqa: E402
from bt_agent.settings import Environ  # noqa: E402
from bt_agent.storage import open_store  # noqa: E402

MiB = 1024 * 1024
ROUNDS = 3
STORE = "s3://store/bt"
PROJECT, JOB_ID, CHECKPOINT = "resume", "saved01", "checkpoint-100"
NOW = "2026-01-01T00:00:00.000Z"


def _checkpoint(root: Path, small: int, shards: int, shard_size: int) -> Path:
    """The checkpoint's files: ``small`` of 256 KiB under ``optimizer/``, ``shards`` large."""
    (root / "optimizer").mkdir(parents=True)
    for i in range(small):
        (root / "optimizer" / f"{i:05d}.pt").write_bytes(os.urandom(256 * 1024))
    block = os.urandom(MiB)
    for i in range(shards):
        with open(root / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as handle:
            for _ in range(shard_size // MiB):
                handle.write(block)
    return root


def _commit(source: Path, env: dict[str, str]) -> str:
    """``source`` uploaded (by ``s5cmd``) under the checkpoint's prefix and committed; returns
    the prefix's URL."""
    prefix = checkpoint_prefix(PROJECT, JOB_ID, 0, CHECKPOINT)
    url = f"{STORE}/{prefix}"
    subprocess.run(
        ["s5cmd", "--endpoint-url", env["AWS_ENDPOINT_URL"], "cp", f"{source}/*", f"{url}/"],
        env=env,
        check=True,
        capture_output=True,
    )
    files = []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        files.append(ManifestFile(path.relative_to(source).as_posix(), path.stat().st_size, digest))
    with open_store(STORE, Environ(env)) as store:
        catalog = Catalog(store)
        catalog.create_job(JobRecord(JOB_ID, PROJECT, None, NOW, 1, {}))
        catalog.write_manifest(Manifest(JOB_ID, PROJECT, 0, CHECKPOINT, NOW, NOW, files))
    return url


def _load(target: Path, env: dict[str, str]) -> tuple[float, float]:
    """One load by the agent's code in a process of its own: seconds and peak RSS (MiB)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "_load_once.py"), STORE, PROJECT, JOB_ID]
    done = subprocess.run(
        [*argv, CHECKPOINT, str(target)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    said = json.loads(done.stdout)
    return float(said["seconds"]), float(said["peak_rss_mib"])


def _rounds(work: Path, url: str, env: dict[str, str], shape: str, size: int) -> dict[str, object]:
    """``ROUNDS`` rounds of ``s5cmd`` and the agent taking turns; one row of medians."""
    peers: list[float] = []
    loads: list[tuple[float, float]] = []
    for attempt, who in taking_turns(ROUNDS):
        output = work / f"{who}-{attempt}"
        os.sync()  # no run pays for the writeback of what ran before it
        if who == "s5cmd":
            peers.append(s5cmd_copy(env["AWS_ENDPOINT_URL"], env, url, output))
        else:
            loads.append(_load(output, env))
        evict(output)
    for attempt in range(ROUNDS):
        for who in ("s5cmd", "agent"):
            shutil.rmtree(work / f"{who}-{attempt}", ignore_errors=True)
    peer, load = statistics.median(peers), statistics.median(s for s, _ in loads)
    return {
        "shape": shape,
        "MB": round(size / 1e6),
        "s5cmd_s": round(peer, 2),
        "load_s": round(load, 2),
        "load_vs_s5cmd": round(peer / load, 2),
        "s5cmd_runs_s": "-".join(f"{p:.2f}" for p in sorted(peers)),
        "load_runs_s": "-".join(f"{s:.2f}" for s, _ in sorted(loads)),
        "peak_rss_mib": max(rss for _, rss in loads),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-count", type=int, default=500)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--tls", action="store_true", help="load over https")
    add_far_arguments(parser, "load it")
    args = parser.parse_args()
    compile_agent()
    require_s5cmd()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bt-resume-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.seaweedfs(work / "server")
        env = {**os.environ, **server.client_env(tls=args.tls)}
        far: FarLink | None = None
        try:
            server.create_bucket("store")
            source = _checkpoint(
                work / "source", args.small_count, args.shards, args.shard_mib * MiB
            )
            size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
            url = _commit(source, env)
            shutil.rmtree(source)
            shape = (
                f"{args.small_count} x 256 KiB + {args.shards} x {args.shard_mib} MiB"
                f" ({'https' if args.tls else 'http'})"
            )
            rows.append(_rounds(work, url, env, shape, size))
            if args.far_ms:
                port = server.https_port if args.tls else server.port
                far = FarLink(port, args.far_ms / 1000, args.far_mbps * 1e6)
                through = {**env, "AWS_ENDPOINT_URL": via(env["AWS_ENDPOINT_URL"], far.port)}
                rows.append(_rounds(work, url, through, f"{shape}, far", size))
        finally:
            if far is not None:
                far.close()
            server.stop()
    columns = [
        "shape",
        "MB",
        "s5cmd_s",
        "load_s",
        "load_vs_s5cmd",
        "s5cmd_runs_s",
        "load_runs_s",
        "peak_rss_mib",
    ]
    print(table(rows, columns))
    print("\ntarget: load_vs_s5cmd >= 1.0 (throughput ratio)")
    settings = {"far_ms": args.far_ms, "far_mbps": args.far_mbps} if args.far_ms else {}
    path = write_json("resume_tls" if args.tls else "resume", {**settings, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
