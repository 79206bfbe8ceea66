"""Staging one large ``https://`` weights file: the agent against ``curl`` (one stream) and
``rclone copyto`` (ranges on 16 streams), in one run.

    python benchmarks/https_source.py [--gib 1] [--far-ms 20 [--far-mbps 90]]

The file is served over https by the tests' static file server (``tests/bin/range_http_server.py``:
ranges, ETags, ``If-Match``; Python, so its own pace on a small machine is part of the near
row), its certificate signed by a CA of the run's own that every client trusts
(``SSL_CERT_FILE``, ``--cacert``, ``--ca-cert``). The agent is timed inside its process (the
DEPLOYING phase, after imports: ``_stage_once.py``), the peers as whole commands. Three rounds,
the order rotating; medians. ``--far-ms`` runs the rounds again through a link to a server far
away (``tests/far_link.py``): each request held that long, each connection's answers paced at
``--far-mbps``, as a CDN or a cloud store paces one connection. ``agent_vs_best`` is the
best peer's seconds over the agent's (above 1: the agent is faster). On a machine of few cores
the server, the link and the clients share them: the near row is as much the server's pace as
any client's.
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import add_far_arguments, compile_agent, evict, table, write_json
from staging import stage_once

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402
from far_link import FarLink  # noqa: E402

MiB = 1024 * 1024
ROUNDS = 3
RCLONE_STREAMS = 16
WHO = ("agent", "curl", "rclone")


def _timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def _runners(
    url: str, ca: Path, spec: Path, env: dict[str, str]
) -> dict[str, Callable[[Path], float]]:
    """Each client's run into a directory of its own, returning its seconds."""
    base, _, name = url.rpartition("/")

    def agent(out: Path) -> float:
        return stage_once(spec, out, {**env, "BT_NODE_CACHE_DIR": str(out / "cache")}).seconds

    def curl(out: Path) -> float:
        return _timed(["curl", "-sSf", "--cacert", str(ca), "-o", str(out / name), url], env)

    def rclone(out: Path) -> float:
        argv = ["rclone", "copyto", f":http:{name}", str(out / name), "--http-url", f"{base}/"]
        argv += ["--ca-cert", str(ca), "--multi-thread-streams", str(RCLONE_STREAMS)]
        return _timed([*argv, "--multi-thread-cutoff", "16M"], env)

    return {"agent": agent, "curl": curl, "rclone": rclone}


def _rounds(work: Path, runners: dict[str, Callable[[Path], float]], label: str) -> dict[str, Any]:
    """``ROUNDS`` rounds of every client, the order rotating each round; the row of medians."""
    seconds: dict[str, list[float]] = {who: [] for who in WHO}
    for attempt in range(ROUNDS):
        for who in WHO[attempt % len(WHO) :] + WHO[: attempt % len(WHO)]:
            out = work / f"{label}-{who}-{attempt}"
            out.mkdir()
            os.sync()
            seconds[who].append(runners[who](out))
            evict(out)
            shutil.rmtree(out)
    row: dict[str, Any] = {"link": label}
    for who in WHO:
        row[f"{who}_s"] = round(statistics.median(seconds[who]), 2)
    best = min(row["curl_s"], row["rclone_s"])
    row["agent_vs_best"] = round(best / row["agent_s"], 2)
    for who in WHO:
        row[f"{who}_runs_s"] = "-".join(f"{s:.2f}" for s in sorted(seconds[who]))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the file's size")
    add_far_arguments(parser, "run the rounds")
    args = parser.parse_args()
    for tool in ("curl", "rclone"):
        if shutil.which(tool) is None:
            how = "pip install -e '.[bench]'" if tool == "rclone" else "apt install curl"
            raise SystemExit(f"{tool} is missing: {how}")
    compile_agent()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bt-https-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.static_https(work / "server")
        far: FarLink | None = None
        try:
            source = server.directory / "model.safetensors"
            block = os.urandom(MiB)
            with open(source, "wb") as handle:
                for _ in range(int(args.gib * 1024)):
                    handle.write(block)
            env = {**os.environ, "SSL_CERT_FILE": str(server.ca_file)}
            links = {"near": server.port}
            if args.far_ms:
                far = FarLink(server.port, args.far_ms / 1000, args.far_mbps * 1e6)
                links["far"] = far.port
            for label, port in links.items():
                url = f"https://localhost:{port}/{source.name}"
                spec = work / f"spec-{label}.json"
                weights = [{"source": url, "mount_location": "/app/model"}]
                job = {"image": {"base_image": "x"}, "weights": weights}
                spec.write_text(json.dumps({"training_job": job}))
                rows.append(_rounds(work, _runners(url, server.ca_file, spec, env), label))
        finally:
            if far is not None:
                far.close()
            server.stop()
    columns = ["link", *(f"{who}_s" for who in WHO), "agent_vs_best"]
    print(table(rows, [*columns, *(f"{who}_runs_s" for who in WHO)]))
    far_link = {"far_ms": args.far_ms, "far_mbps": args.far_mbps} if args.far_ms else {}
    path = write_json("https_source", {"gib": args.gib, **far_link, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
