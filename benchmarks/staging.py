"""Staging BDN weights from SeaweedFS: cold against ``s5cmd cp`` of the same prefix, and warm
(node cache filled, fresh mount) for models of two sizes and for many small files, in one run.

    python benchmarks/staging.py [--model-gib 2] [--large-gib 8] [--small-count 5000] [--tls]
        [--store-http2] [--far-ms 20 [--far-mbps 90]]

Cold and warm staging are timed inside the agent process (the DEPLOYING phase itself, after
imports); cold is the median of three runs from an empty cache, each beside an s5cmd run (whose
median it is compared with; which of the two goes first alternates); warm is the median of
three fresh mounts; s5cmd is timed as a whole command.
With ``--tls`` the store is SeaweedFS's TLS port (its certificate signed by a CA of the run's
own, trusted by both through ``AWS_CA_BUNDLE``), speaking HTTP/1.1 as AWS S3 and R2 do
(``--store-http2``: offering HTTP/2 too).
``--far-ms`` stages each model again, cold, through a link to a store far away (rows ", far";
``tests/far_link.py``): each request held that long, each connection's answers paced at
``--far-mbps``, as a cloud store paces one connection, so that how many ranges are in flight,
and how large, shows as it would there.
Each row gives the agent's peak RSS (the largest of its runs).
Targets: cold at least 1.0x s5cmd's throughput; warm at most 0.05 s for either model; peak RSS
at most 150 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from _common import (
    STORE_HTTP2_HELP,
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

MiB = 1024 * 1024
#: Warm starts per shape; the median is reported (the first after a large cold run may find
#: the agent's own modules pushed out of the page cache by the model's bytes).
WARM_RUNS = 3
#: Cold runs per shape, each interleaved with an s5cmd run; the medians are compared (single
#: cold runs of the same build spread by up to 2x on this shared machine).
COLD_RUNS = 3
#: Every run's output (and node cache) is evicted from the page cache after the run and kept
#: on disk until its shape's rounds are done (see ``_common.evict``; the far rounds come after
#: the near ones are deleted): the disk must hold six copies of the largest shape.


def write_model(
    root: Path, shards: int, shard_size: int, small: int = 3, small_size: int = 2048
) -> Path:
    root.mkdir(parents=True)
    block = os.urandom(MiB)
    for i in range(shards):
        with open(root / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as handle:
            for _ in range(shard_size // MiB):
                handle.write(block)
    for i in range(small):
        (root / f"config-{i}.json").write_bytes(os.urandom(small_size))
    return root


def upload_model(endpoint: str, env: dict[str, str], source: Path, url: str) -> None:
    subprocess.run(
        ["s5cmd", "--endpoint-url", endpoint, "cp", f"{source}/*", f"{url}/"],
        env=env,
        check=True,
        capture_output=True,
    )


class Staged(NamedTuple):
    """One staging by the agent: its seconds (the DEPLOYING phase) and its peak RSS."""

    seconds: float
    peak_rss_mib: float


def stage_once(spec: Path, node_root: Path, env: dict[str, str]) -> Staged:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "_stage_once.py"),
            str(spec),
            str(node_root),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    said = json.loads(done.stdout)
    return Staged(float(said["seconds"]), float(said["peak_rss_mib"]))


#: What one shape's cold rounds measured: ``s5cmd``'s seconds and the agent's runs.
Cold = tuple[list[float], list[Staged]]


def _cold_rounds(work: Path, spec: Path, url: str, env: dict[str, str], run: str) -> Cold:
    """``COLD_RUNS`` rounds, each from an empty cache, of ``s5cmd`` and the agent, taking turns
    (which goes first alternates). Each run's output is named after ``run`` and the round,
    evicted from the page cache and left on disk."""
    env = dict(env)
    endpoint = env["AWS_ENDPOINT_URL"]
    peers: list[float] = []
    colds: list[Staged] = []
    for attempt, who in taking_turns(COLD_RUNS):
        label = f"{run}-{attempt}"
        output = work / (f"s5-{label}" if who == "s5cmd" else f"cache-{label}")
        env["BT_NODE_CACHE_DIR"] = str(work / f"cache-{label}")
        os.sync()  # no run pays for the writeback of what ran before it
        if who == "s5cmd":
            peers.append(s5cmd_copy(endpoint, env, url, output))
        else:
            colds.append(stage_once(spec, work / f"cold-{label}", env))
        evict(output)
    return peers, colds


def _row(
    shape: str,
    size: int,
    peers: list[float],
    runs: list[Staged],
    warms: Sequence[Staged] = (),
) -> dict[str, object]:
    """One line of the table: medians, each run's seconds, and the agent's peak RSS (the
    largest of its runs, cold and warm)."""
    colds = [run.seconds for run in runs]
    peer, cold = statistics.median(peers), statistics.median(colds)
    row: dict[str, object] = {"shape": shape, "MB": round(size / 1e6), "s5cmd_s": round(peer, 2)}
    row["cold_s"] = round(cold, 2)
    if warms:
        row["warm_s"] = round(statistics.median(run.seconds for run in warms), 3)
        row["warm_runs_s"] = "-".join(f"{run.seconds:.3f}" for run in sorted(warms))
    row["cold_vs_s5cmd"] = round(peer / cold, 2)
    row["cold_runs_s"] = "-".join(f"{c:.2f}" for c in sorted(colds))
    row["s5cmd_runs_s"] = "-".join(f"{p:.2f}" for p in sorted(peers))
    row["peak_rss_mib"] = max(run.peak_rss_mib for run in [*runs, *warms])
    return row


def _clear(paths: Iterable[Path]) -> None:
    """``paths`` deleted, and the deletions written back: the runs after do not pay for them."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-gib", type=int, default=2)
    parser.add_argument("--large-gib", type=int, default=8)
    parser.add_argument("--small-count", type=int, default=5000)
    parser.add_argument("--tls", action="store_true", help="stage over https")
    parser.add_argument("--store-http2", action="store_true", help=STORE_HTTP2_HELP)
    add_far_arguments(parser, "stage each model, cold,")
    args = parser.parse_args()
    compile_agent()
    require_s5cmd()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bt-staging-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.seaweedfs(work / "server", http2=args.store_http2)
        env = {**os.environ, **server.client_env(tls=args.tls)}
        endpoint = env["AWS_ENDPOINT_URL"]
        far: FarLink | None = None
        try:
            server.create_bucket("weights")
            if args.far_ms:
                port = server.https_port if args.tls else server.port
                far = FarLink(port, args.far_ms / 1000, args.far_mbps * 1e6)
            small = f"{args.small_count} small files"
            model, large = args.model_gib * 256 * MiB, args.large_gib * 256 * MiB  # a shard's
            shapes = {
                f"{args.model_gib} GiB model": write_model(work / "m", 4, model),
                f"{args.large_gib} GiB model": write_model(work / "l", 4, large),
                small: write_model(work / "s", 0, 0, args.small_count, 4096),
            }
            for index, (shape, source) in enumerate(shapes.items()):
                url = f"s3://weights/shape{index}"
                upload_model(endpoint, env, source, url)
                evict(source)  # only the store's copy is read from here on
                size = sum(p.stat().st_size for p in source.iterdir())
                spec = work / f"spec{index}.json"
                spec.write_text(
                    json.dumps(
                        {
                            "training_job": {
                                "image": {"base_image": "x"},
                                "weights": [{"source": url, "mount_location": "/app/model"}],
                            }
                        }
                    )
                )
                peers, colds = _cold_rounds(work, spec, url, env, str(index))
                env["BT_NODE_CACHE_DIR"] = str(work / f"cache-{index}-0")  # the warm runs'
                warms = []
                for attempt in range(WARM_RUNS):  # each a fresh mount from the filled cache
                    warms.append(stage_once(spec, work / f"warm-{index}-{attempt}", env))
                rows.append(_row(shape, size, peers, colds, warms))
                _clear(work.glob(f"*-{index}-*"))  # outputs and caches: room for the far runs
                if far is not None and shape != small:
                    through = {**env, "AWS_ENDPOINT_URL": via(endpoint, far.port)}
                    cold = _cold_rounds(work, spec, url, through, f"{index}-far")
                    rows.append(_row(f"{shape}, far", size, *cold))
                    _clear(work.glob(f"*-{index}-*"))
                _clear([source])
        finally:
            if far is not None:
                far.close()
            server.stop()
    columns = [
        "shape",
        "MB",
        "s5cmd_s",
        "cold_s",
        "cold_vs_s5cmd",
        "s5cmd_runs_s",
        "cold_runs_s",
        "warm_s",
        "warm_runs_s",
        "peak_rss_mib",
    ]
    print(table(rows, columns))
    print(
        "\ntargets: cold_vs_s5cmd >= 1.0 (throughput ratio); warm_s <= 0.05 for both models; "
        "peak_rss_mib <= 143 (150 MB)"
    )
    path = write_json(
        "staging_tls" if args.tls else "staging",
        {
            "store_http2": args.store_http2,
            **({"far_ms": args.far_ms, "far_mbps": args.far_mbps} if args.far_ms else {}),
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
