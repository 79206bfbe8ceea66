"""Staging again after a stop: a model staged from SeaweedFS through a link to a store far away
is stopped (SIGTERM, as the platform stops a job) once part of it has come, then staged again
on the same node, against a cold staging of the whole and ``s5cmd cp`` of the same prefix (which,
stopped, starts over: its run again is a whole copy).

    python benchmarks/staging_restart.py [--model-gib 2] [--stop-at 0.5] [--tls]
        [--far-ms 20] [--far-mbps 20]

Each of three rounds, the order rotating: ``s5cmd cp`` of the whole; the agent's cold staging
(the DEPLOYING phase, timed inside the process as ``staging.py`` times it); the agent stopped
once the node cache holds ``--stop-at`` of the model (files placed, and the partial files a
later staging takes up), then its staging again, timed the same way, with the bytes that came
through the link for it. Medians.
Expected: the staging again takes about what was left, ``1 - stop_at`` of a cold staging (plus
what each staging costs whatever it fetches: the listing, the plan), and fetches about what was
left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    compile_agent,
    evict,
    require_s5cmd,
    s5cmd_copy,
    table,
    via,
    write_json,
)
from staging import stage_once, upload_model, write_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402
from far_link import FarLink  # noqa: E402

ROUNDS = 3


def _kept(cache: Path) -> int:
    """Bytes a later staging need not fetch again: the entries placed in ``cache`` and what its
    partial files that such a staging takes up hold."""
    held = 0
    for path in cache.glob("objects/*/*"):  # pathlib's * takes names with a dot first too
        placed = not path.name.startswith(".")
        if placed or path.name.endswith(".resumable.incomplete"):
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                held += path.stat().st_blocks * 512
    return held


def _stopped(spec: Path, node_root: Path, env: dict[str, str], cache: Path, bytes_: int) -> int:
    """``bt-agent stage`` stopped by SIGTERM once ``bytes_`` are in the cache, placed or in
    partial files; what it left there."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bt_agent", "stage", str(spec), "--node-root", str(node_root)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while _kept(cache) < bytes_:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the staging to stop ended first ({process.returncode})")
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    if process.wait(timeout=60) != 128 + signal.SIGTERM and process.returncode != -signal.SIGTERM:
        raise SystemExit(f"the stopped staging exited {process.returncode}")
    return _kept(cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-gib", type=int, default=2)
    parser.add_argument("--stop-at", type=float, default=0.5, help="share written at the stop")
    parser.add_argument("--tls", action="store_true", help="stage over https")
    parser.add_argument("--far-ms", type=float, default=20, help="each request held this long")
    parser.add_argument("--far-mbps", type=float, default=20, help="each connection's pace")
    args = parser.parse_args()
    compile_agent()
    require_s5cmd()
    with tempfile.TemporaryDirectory(prefix="bt-restart-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.seaweedfs(work / "server")
        far: FarLink | None = None
        try:
            server.create_bucket("weights")
            env = {**os.environ, **server.client_env(tls=args.tls)}
            near = env["AWS_ENDPOINT_URL"]
            source = write_model(work / "m", 4, args.model_gib * 256 * 1024 * 1024)
            size = sum(path.stat().st_size for path in source.iterdir())
            upload_model(near, env, source, "s3://weights/m")
            evict(source)
            port = server.https_port if args.tls else server.port
            far = FarLink(port, args.far_ms / 1000, args.far_mbps * 1e6)
            env["AWS_ENDPOINT_URL"] = via(near, far.port)
            spec = work / "spec.json"
            spec.write_text(
                '{"training_job": {"image": {"base_image": "x"}, "weights": '
                '[{"source": "s3://weights/m", "mount_location": "/app/model"}]}}'
            )
            runs: dict[str, list[float]] = {"s5cmd": [], "cold": [], "again": [], "came": []}
            kept: list[int] = []
            for turn in range(ROUNDS):
                order = ["s5cmd", "cold", "again"]
                for who in order[turn:] + order[:turn]:
                    label = f"{who}-{turn}"
                    cache = work / f"cache-{label}"
                    run_env = {**env, "BT_NODE_CACHE_DIR": str(cache)}
                    os.sync()
                    if who == "s5cmd":
                        runs["s5cmd"].append(
                            s5cmd_copy(env["AWS_ENDPOINT_URL"], env, "s3://weights/m", cache)
                        )
                    elif who == "cold":
                        runs["cold"].append(stage_once(spec, work / label, run_env).seconds)
                    else:
                        stop = int(args.stop_at * size)
                        kept.append(_stopped(spec, work / f"{label}-stopped", run_env, cache, stop))
                        before = far.passed
                        runs["again"].append(stage_once(spec, work / label, run_env).seconds)
                        runs["came"].append(far.passed - before)
                    evict(cache)
                    subprocess.run(["rm", "-rf", str(cache), str(work / label)], check=True)
        finally:
            if far is not None:
                far.close()
            server.stop()
    cold, again = statistics.median(runs["cold"]), statistics.median(runs["again"])
    row = {
        "shape": f"{args.model_gib} GiB model, {'https' if args.tls else 'http'}, far",
        "MB": round(size / 1e6),
        "s5cmd_s": round(statistics.median(runs["s5cmd"]), 2),
        "cold_s": round(cold, 2),
        "kept_at_stop_MB": round(statistics.median(kept) / 1e6),
        "again_s": round(again, 2),
        "again_vs_cold": round(again / cold, 2),
        "came_again_MB": round(statistics.median(runs["came"]) / 1e6),
        "again_runs_s": "-".join(f"{s:.2f}" for s in sorted(runs["again"])),
        "cold_runs_s": "-".join(f"{s:.2f}" for s in sorted(runs["cold"])),
    }
    print(table([row], list(row)))
    print(f"\nexpected: again_vs_cold near {1 - args.stop_at:.2f}; came_again_MB near the rest")
    name = "staging_restart_tls" if args.tls else "staging_restart"
    far_settings = {"far_ms": args.far_ms, "far_mbps": args.far_mbps, "stop_at": args.stop_at}
    print(f"wrote {write_json(name, {**far_settings, 'rows': [row]})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
