"""Seeded random kill points.

SIGKILL of the agent at random points of a job that writes several checkpoints, then the agent
started again on the same node (the container restarted): nothing lost, nothing uploaded twice,
no manifest that names anything but durable objects with matching sha256, no checkpoint
committed that was not complete on disk.

SIGKILL of the trainer at random points of its saves (in place, sharded with pauses, rotated):
no torn commit, and every checkpoint it finished committed or reported.

    BT_FAULT_POINTS=200 BT_FAULT_SEED=7 python3 -m pytest tests/faults   # more points
    (BT_FAULT_POINTS agent kills, ten times as many trainer kills)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import servers
from helpers import BIN, Agent, marked_processes, wait_for
from sidecar_checks import indexed_checkpoints

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.records import Manifest
from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store

POINTS = int(os.environ.get("BT_FAULT_POINTS", "20"))
SEED = int(os.environ.get("BT_FAULT_SEED", "1"))
ENV = {"BT_CHECKPOINT_QUIET_SECONDS": "0.2"}
WRITER = (
    f"{sys.executable} {BIN / 'write_checkpoints.py'} /dev/null --style hf --steps 4 "
    "--size 1500000 --pause 0.1 --tmp-pause 0.2"
)


def _job(command: str) -> dict[str, object]:
    return {
        "image": {"base_image": "x"},
        "runtime": {"start_commands": [command], "checkpointing_config": {"enabled": True}},
    }


def _complete_on_disk(directory: Path) -> dict[str, dict[str, str]]:
    """The checkpoints a trainer finished: HF-style, those renamed into place."""
    if not directory.is_dir():
        return {}
    return {
        ckpt.name: {
            p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in ckpt.rglob("*")
            if p.is_file()
        }
        for ckpt in directory.iterdir()
        if ckpt.is_dir() and ckpt.name.startswith("checkpoint-")
    }


def _journal_files(node: Path, job_id: str) -> int:
    journal = node / "var" / "lib" / "bt-agent" / "sidecar-journal.sqlite"
    if not journal.exists():
        return 0
    with closing(sqlite3.connect(journal, timeout=5)) as db:
        try:
            row = db.execute("SELECT COUNT(*) FROM files WHERE job_id=?", (job_id,)).fetchone()
        except sqlite3.OperationalError:
            return 0
        return int(row[0])


def _assert_objects_hold(store: ObjectStore, job_id: str, manifest: Manifest, where: str) -> None:
    """Every object ``manifest`` names holds the bytes it says (by sha256)."""
    prefix = checkpoint_prefix("default", job_id, 0, manifest.checkpoint)
    for entry in manifest.files:
        data = store.read_bytes(f"{prefix}/{entry.path}")
        assert hashlib.sha256(data).hexdigest() == entry.sha256, f"{where}: {manifest.checkpoint}"


def _node_record(store: ObjectStore, job_id: str) -> dict[str, Any]:
    return dict(json.loads(store.read_bytes(f"projects/default/jobs/{job_id}/nodes/rank-0.json")))


def _kill_everything(agent: Agent) -> None:
    """The container died: the agent and every process of the job."""
    for pid in marked_processes(agent.mark):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not marked_processes(agent.mark), 10, "the job's processes to die")


@pytest.mark.parametrize("transport", ["file", "https"])
def test_sigkill_at_random_points_then_restart_loses_nothing(
    agent: Agent, transport: str, request: pytest.FixtureRequest
) -> None:
    """On the embedded file store, and on S3 over TLS (SeaweedFS's https port, its CA trusted
    through AWS_CA_BUNDLE; half the points there, each point's requests are many more)."""
    env, points, url = dict(ENV), POINTS, agent.store.as_uri()
    if transport == "https":
        server: servers.SeaweedFS = request.getfixturevalue("s3_server")
        bucket = f"kill{SEED}{os.getpid()}"
        server.create_bucket(bucket)
        env.update(server.client_env(tls=True))
        points, url = max(POINTS // 2, 1), f"s3://{bucket}/bt"
    store = open_store(url, Environ(env))
    catalog = Catalog(store)
    outcomes: list[str] = []
    rng = random.Random(SEED)
    for point in range(points):
        job_id = f"kil{point:04d}"
        node = agent.root / f"node{point}"
        delay = rng.uniform(0.2, 1.8)  # the writer is done after about 1.5 s
        process = agent.start(
            _job(WRITER), "--job-id", job_id, "--node-root", str(node), "--store", url, env=env
        )
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        _kill_everything(agent)
        before = _journal_files(node, job_id)
        on_disk = _complete_on_disk(node / "mnt" / "ckpts")
        expected_files = sum(len(files) for files in on_disk.values())

        again = agent.run_job(
            _job("true"),
            "--job-id",
            job_id,
            "--node-root",
            str(node),
            "--store",
            url,
            env={**env, "BT_RETRY_COUNT": "1"},
            timeout=60,
        )
        where = f"kill point {point} at {delay:.2f} s"
        assert again.code == 0, f"{where}: {again.text}"
        committed = {m.checkpoint: m for m in catalog.manifests("default", job_id, 0)}
        assert sorted(committed) == sorted(on_disk), f"{where}: {sorted(committed)}"
        indexed = indexed_checkpoints(store, "default", job_id)
        assert indexed == sorted(committed), f"{where}: index {indexed}, committed {committed}"
        for name, files in on_disk.items():
            manifest = committed[name]
            assert {f.path: f.sha256 for f in manifest.files} == files, f"{where}: {name}"
            _assert_objects_hold(store, job_id, manifest, where)
        record = _node_record(store, job_id)
        uploaded_again = record["uploads"]["files"]
        assert record["uploads"]["not_durable"] == []
        assert uploaded_again <= expected_files - min(before, expected_files), (
            f"{where}: {uploaded_again} uploaded again, {before} were durable already"
        )
        outcomes.append(f"{delay:.2f}s:{len(on_disk)}ckpt/{before}pre/{uploaded_again}re")
    print(f"{points} kill points on {transport} (seed {SEED}): " + " ".join(outcomes))


# --- the trainer killed (SIGKILL, as by the OOM killer) at random points of its saves -------

TRAINER_POINTS = 10 * POINTS  # 200 per CI run
SAVE_AND_DIE = BIN / "save_and_die.py"
STYLES = ("inplace", "shards", "rotate")


def _operations(style: str, seed: int) -> int:
    done = subprocess.run(
        [
            sys.executable,
            str(SAVE_AND_DIE),
            "/dev/null",
            "--style",
            style,
            "--seed",
            str(seed),
            "--count",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


@pytest.mark.timeout(900)  # 67 jobs with pauses: a loaded machine must not cut the campaign
@pytest.mark.parametrize("style", STYLES)
def test_trainer_killed_at_random_points_of_its_saves(agent: Agent, style: str) -> None:
    """No torn commit: every manifest names a checkpoint the trainer finished, file by file
    (by sha256), and every object it names holds those bytes. No silent loss: every finished
    checkpoint is committed, or named with why in the node record."""
    rng = random.Random(SEED * 1000 + STYLES.index(style))
    store = open_store(agent.store.as_uri(), Environ({}))
    catalog = Catalog(store)
    points = TRAINER_POINTS // len(STYLES) + (STYLES.index(style) < TRAINER_POINTS % len(STYLES))
    tally: Counter[str] = Counter()
    for point in range(points):
        job_id = f"{style[:3]}{point:04d}"
        seed = rng.randrange(1 << 30)
        kill = rng.randrange(_operations(style, seed))
        ledger = agent.root / f"ledger-{job_id}.json"
        command = (
            f"{sys.executable} {SAVE_AND_DIE} {ledger} --style {style} --seed {seed} --kill {kill}"
        )
        node = agent.root / f"node-{job_id}"
        result = agent.run_job(
            _job(command), "--job-id", job_id, "--node-root", str(node), env=ENV, timeout=60
        )
        where = f"{style} kill point {point} (seed {seed}, operation {kill})"
        assert result.code == 128 + signal.SIGKILL, f"{where}: {result.text}"
        finished = json.loads(ledger.read_text()) if ledger.exists() else {}
        committed = {m.checkpoint: m for m in catalog.manifests("default", job_id, 0)}
        for name, manifest in committed.items():
            files = {f.path: f.sha256 for f in manifest.files}
            assert files == finished.get(name), f"{where}: torn commit of {name}: {result.text}"
            _assert_objects_hold(store, job_id, manifest, where)
        record = _node_record(store, job_id)
        reported = record["uploads"]["not_committed"]
        for name in finished:
            assert name in committed or name in reported, f"{where}: {name} lost: {result.text}"
        tally["committed"] += len(committed)
        for name in set(finished) - set(committed):  # why, in short
            tally[" ".join(reported[name].split()[:4])] += 1
        shutil.rmtree(node, ignore_errors=True)
    print(f"{points} trainer kill points ({style}, seed {SEED}): {dict(tally)}")
