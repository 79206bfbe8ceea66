"""The checkpoint sidecar through the real agent: writers that behave like real trainers, faults
(SIGKILL of the agent, SIGTERM during the drain, a full store; a store outage is in
tests/faults), and every test checks the store against what was written, by sha256."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import sqlite3
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import servers
from fault_proxy import FaultProxy
from helpers import (
    Agent,
    failing_inside,
    finish,
    marked_processes,
    needs_two_cpus,
    small_tmpfs,
    wait_for,
)
from sidecar_checks import FAST, WRITER, assert_store_holds, ckpt_job, manifests

from bt_agent.settings import Environ
from bt_agent.sidecar.cpus import cpu_list
from bt_agent.sidecar.stats import UploadStats
from bt_agent.storage import ObjectStore, open_store


def on_disk(checkpoint_dir: Path) -> dict[str, dict[str, str]]:
    """What the checkpoint dir holds now, in the ledger's form."""
    return {
        directory.name: {
            path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in directory.rglob("*")
            if path.is_file()
        }
        for directory in checkpoint_dir.iterdir()
        if directory.is_dir()
    }


def file_store(agent: Agent) -> ObjectStore:
    return open_store(agent.store.as_uri(), Environ({}))


def node_record(agent: Agent, job_id: str) -> dict[str, Any]:
    return dict(agent.job_view(job_id)["nodes"][0])


# --- writers like real trainers ----------------------------------------------------------


def test_watcher_says_which_changes_are_settled(tmp_path: Path) -> None:
    """A file closed after writing, or renamed into place (a file or a whole directory), is
    complete as the event comes; a write still open is not."""
    import queue

    from bt_agent.sidecar.watch import Change, Watcher

    changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
    watcher = Watcher(tmp_path, changes)
    watcher.start()
    seen: list[Change] = []
    try:
        with open(tmp_path / "open.bin", "wb") as handle:
            handle.write(b"x" * 1000)
            handle.flush()
            (tmp_path / "closed.bin").write_bytes(b"y")
            (tmp_path / "tmp-checkpoint-1").mkdir()
            (tmp_path / "tmp-checkpoint-1" / "model.bin").write_bytes(b"z")
            (tmp_path / "tmp-checkpoint-1").rename(tmp_path / "checkpoint-1")
            (tmp_path / "closed.bin").rename(tmp_path / "renamed.bin")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                c.path.endswith("renamed.bin") for c in seen
            ):
                with contextlib.suppress(queue.Empty):
                    seen.append(changes.get(timeout=0.1))
            opened = [c for c in seen if c.path == str(tmp_path / "open.bin")]
    finally:
        watcher.stop()

    def settled(name: str) -> set[bool]:
        return {c.settled for c in seen if c.path == str(tmp_path / name)}

    assert opened and not any(c.settled for c in opened), seen  # while it was open
    assert True in settled("closed.bin"), seen
    assert settled("renamed.bin") == {True}, seen
    renamed_in = Change(str(tmp_path / "checkpoint-1"), whole=True, settled=True, in_place=False)
    assert renamed_in in seen, seen


def test_watcher_flush_hands_over_every_change_made_before_it(tmp_path: Path) -> None:
    """What the drain relies on: once flush returns True, every change made before it is in
    the queue (here taken without any wait), a checkpoint renamed in and rotated away at once
    included; the marker itself is never a change, and is gone."""
    import queue

    from bt_agent.sidecar.watch import MARKER_PREFIX, Change, Watcher

    changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
    watcher = Watcher(tmp_path, changes)
    watcher.start()
    try:
        for index in range(300):
            (tmp_path / f"file-{index}.bin").write_bytes(b"x")
        (tmp_path / "tmp-checkpoint-1").mkdir()
        (tmp_path / "tmp-checkpoint-1" / "model.bin").write_bytes(b"z")
        (tmp_path / "tmp-checkpoint-1").rename(tmp_path / "checkpoint-1")
        shutil.rmtree(tmp_path / "checkpoint-1")
        assert watcher.flush(10.0)
        seen: list[Change] = []
        with contextlib.suppress(queue.Empty):
            while True:
                seen.append(changes.get_nowait())
    finally:
        watcher.stop()
    paths = {c.path for c in seen}
    assert {str(tmp_path / f"file-{index}.bin") for index in range(300)} <= paths
    renamed_in = Change(str(tmp_path / "checkpoint-1"), whole=True, settled=True, in_place=False)
    assert renamed_in in seen
    assert not [p for p in paths if MARKER_PREFIX in p]
    assert not list(tmp_path.glob(f"{MARKER_PREFIX}*"))


def test_watcher_flush_says_when_it_cannot_know(tmp_path: Path) -> None:
    """Polling sees no file that came and went between two scans; a directory that takes no
    marker cannot be flushed: both say so rather than pretend."""
    import queue

    from bt_agent.sidecar.watch import Change, Watcher

    changes: queue.SimpleQueue[Change] = queue.SimpleQueue()
    polling = Watcher(tmp_path, changes, polling=True)
    polling.start()
    try:
        assert not polling.flush(1.0)
    finally:
        polling.stop()
    gone = tmp_path / "gone"
    gone.mkdir()
    watcher = Watcher(gone, changes)
    watcher.start()
    try:
        gone.rmdir()
        assert not watcher.flush(1.0)
    finally:
        watcher.stop()


def test_settled_files_wait_the_short_period_and_open_ones_the_quiet_period(
    tmp_path: Path,
) -> None:
    from bt_agent.catalog import Catalog
    from bt_agent.log import AgentLog
    from bt_agent.sidecar.files import CheckpointDir
    from bt_agent.sidecar.journal import Journal
    from bt_agent.sidecar.state import FileStatus
    from bt_agent.sidecar.uploader import Owner, Sidecar, SidecarSettings
    from bt_agent.sidecar.watch import Change

    root = tmp_path / "ckpt"
    root.mkdir()
    settings = SidecarSettings(quiet_seconds=0.5, settle_seconds=0.1)
    sidecar = Sidecar(
        CheckpointDir(root),
        Catalog(open_store(f"file://{tmp_path / 'store'}")),
        Owner("p", "j", 0),
        Journal(tmp_path / "journal.sqlite", "file:///store", "j", 0),
        AgentLog(io.StringIO()),
        settings,
    )
    for change in [
        Change(str(root / "a.bin")),  # written, still open
        Change(str(root / "b.bin")),
        Change(str(root / "b.bin"), settled=True),  # then closed
        Change(str(root / "c.bin"), settled=True),
        Change(str(root / "c.bin")),  # closed, then written again
    ]:
        sidecar._changes.put(change)
    sidecar._take_changes(100.0)
    files = sidecar._state.files
    assert {r: f.due for r, f in files.items()} == {"a.bin": 100.5, "b.bin": 100.1, "c.bin": 100.5}
    assert {f.status for f in files.values()} == {FileStatus.WAITING}
    sidecar.journal.close()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("{root}/checkpoint-1/model.safetensors", "checkpoint-1/model.safetensors"),
        ("{root}/trainer_state.json", "trainer_state.json"),
        ("{root}/./checkpoint-1/a.bin", "checkpoint-1/a.bin"),  # not normalized: relpath
        ("{root}//checkpoint-1/a.bin", "checkpoint-1/a.bin"),
        ("{root}/checkpoint-1/../a.bin", "a.bin"),
        ("{root}/../elsewhere/a.bin", None),
        ("{root}-other/a.bin", None),  # shares the root's name as a prefix only
        ("{root}", None),
        ("{root}/", None),
        ("{root}/tmp-checkpoint-2/a.bin", None),  # work in progress (HF Trainer)
    ],
)
def test_event_paths_are_made_relative_to_the_checkpoint_dir(
    tmp_path: Path, path: str, expected: str | None
) -> None:
    from bt_agent.sidecar.files import CheckpointDir

    root = tmp_path / "ckpt"
    assert CheckpointDir(root).relative(path.format(root=root)) == expected


@pytest.mark.parametrize(
    "writer",
    [
        "--style hf --steps 4 --pause 0.6 --save-total-limit 2",
        "--style inplace --steps 3 --size 400000 --pause 0.5",
        "--style shards --steps 2 --files 40 --size 20000",
        "--style hf --steps 2 --size 30000000 --pause 0.8 --rewrite",
        "--style hf --steps 3 --pause 2.5 --save-total-limit 1 polling",
    ],
    ids=[
        "hf-trainer-rename-and-rotate",
        "torch-save-in-place",
        "many-shards",
        "rewrite-in-place",
        "polling-watcher",
    ],
)
def test_trainer_checkpoints_are_committed_exactly(agent: Agent, writer: str) -> None:
    ledger = agent.root / "ledger.json"
    env = dict(FAST)
    if writer.endswith(" polling"):  # a file system without inotify
        writer = writer.removesuffix(" polling")
        env["BT_WATCH_POLLING"] = "1"
    result = agent.run_job(ckpt_job(f"{WRITER} {ledger} {writer}"), "--job-id", "ckpt001", env=env)
    assert result.code == 0, result.text
    written = json.loads(ledger.read_text())
    committed = assert_store_holds(file_store(agent), written, "ckpt001")
    assert "tmp-checkpoint-1" not in committed
    uploads = node_record(agent, "ckpt001")["uploads"]
    assert uploads["not_durable"] == [] and uploads["backlog_files"] == 0
    assert uploads["commits"] >= len(written)
    assert "checkpoint checkpoint-1 committed:" in result.err
    if "save-total-limit 2" in writer:  # deleted locally, kept in the store
        on_disk = sorted(p.name for p in (agent.node_root / "mnt" / "ckpts").iterdir())
        assert on_disk == ["checkpoint-3", "checkpoint-4"]
    if "BT_WATCH_POLLING" in env:
        assert "(polling)" in result.err


def test_root_files_are_the_dot_checkpoint_and_load_back(agent: Agent) -> None:
    command = 'echo "step 7" > $BT_CHECKPOINT_DIR/trainer_state.txt'
    assert agent.run_job(ckpt_job(command), "--job-id", "root001", env=FAST).code == 0
    committed = manifests(file_store(agent), "default", "root001")
    assert [f.path for f in committed["."].files] == ["trainer_state.txt"]
    named = {"typ": "baseten_latest_checkpoint", "job_id": "root001"}  # "." cannot be named
    loader = {
        "image": {"base_image": "x"},
        "runtime": {
            "start_commands": ["cat $BT_LOAD_CHECKPOINT_DIR/rank-0/trainer_state.txt"],
            "load_checkpoint_config": {"enabled": True, "checkpoints": [named]},
        },
    }
    result = agent.run_job(loader)
    assert result.code == 0 and result.out == "step 7\n", result.text


def test_fifos_sockets_and_outside_symlinks_are_skipped_not_followed(agent: Agent) -> None:
    outside = agent.root / "secret-outside.txt"
    outside.write_text("not a checkpoint")
    command = (
        "cd $BT_CHECKPOINT_DIR && mkdir checkpoint-1 && mkfifo checkpoint-1/pipe && "
        f"ln -s {outside} checkpoint-1/escape && echo inside > checkpoint-1/real.txt && "
        "ln -s real.txt checkpoint-1/alias.txt && "
        f'{sys.executable} -c "import socket; s=socket.socket(socket.AF_UNIX); '
        "s.bind('checkpoint-1/sock')\""
    )
    result = agent.run_job(ckpt_job(command), "--job-id", "skip001", env=FAST, timeout=30)
    assert result.code == 0, result.text
    files = {
        f.path for f in manifests(file_store(agent), "default", "skip001")["checkpoint-1"].files
    }
    assert files == {"real.txt", "alias.txt"}
    assert "'checkpoint-1/pipe': it is a FIFO" in result.err
    assert "'checkpoint-1/sock': it is a socket" in result.err
    assert "outside the dir" in result.err


#: A trainer's save of one small checkpoint.
SAVE_ONE = "mkdir $BT_CHECKPOINT_DIR/checkpoint-1 && echo w > $BT_CHECKPOINT_DIR/checkpoint-1/a"


def test_a_step_that_keeps_failing_is_said_once_with_its_traceback(agent: Agent) -> None:
    """An error no rule reads in every step of the sidecar for two seconds
    (:func:`helpers.failing_inside`: its report of progress raising each time) does not end
    the uploads, and is said once with its traceback, then only at its 10th, 100th, ... time:
    it was a line every step (ten a second), without the traceback a report needs."""
    saved = agent.root / "saved"
    env = {**FAST, **failing_inside(agent, "bt_agent.sidecar.uploader:Sidecar._report", saved)}
    command = (
        f"{SAVE_ONE} && touch {saved} && sleep 2 && rm {saved}"  # two seconds of failing steps
    )
    result = agent.run_job(ckpt_job(command), "--job-id", "oops001", env=env)
    assert result.code == 0, result.text
    said = [line for line in result.err.splitlines() if "checkpoint sidecar: RuntimeError" in line]
    assert 1 <= len(said) <= 3 and "(10 times)" in said[1], said
    assert said[0].endswith("its traceback, to report:") and "Traceback (most recent" in result.err
    assert "checkpoint-1" in manifests(file_store(agent), "default", "oops001")


def test_uploads_go_on_where_keeping_off_the_job_s_cpus_keeps_failing(agent: Agent) -> None:
    """An error no rule reads in every step of the sidecar's placement on the CPUs (keeping
    off the job's busy ones, :func:`helpers.failing_inside`) leaves its uploads and commits
    going: it skipped them (each step's placement came first), so nothing was uploaded and
    the job's end waited for the drain's deadline."""
    env = {**FAST, **failing_inside(agent, "bt_agent.sidecar.cpus:Placement.step", agent.root)}
    env["BT_UPLOAD_DRAIN_SECONDS"] = "30"
    started = time.monotonic()
    result = agent.run_job(ckpt_job(SAVE_ONE), "--job-id", "cpus001", env=env)
    assert result.code == 0, result.text
    assert time.monotonic() - started < 15
    assert "checkpoint-1" in manifests(file_store(agent), "default", "cpus001")


def test_an_upload_that_fails_with_an_error_no_rule_reads_is_retried(agent: Agent) -> None:
    """Uploads that fail with an error no rule reads (the store's upload raising a
    ``RuntimeError`` for a second, :func:`helpers.failing_inside`) are retried as any failed
    upload is, and the checkpoint committed: each ended its worker thread, and the file, never
    said done, was left out of the drain (exit 4, not durable, after the drain's deadline)."""
    ckpt = "$BT_CHECKPOINT_DIR/checkpoint-1"
    save = f"mkdir {ckpt} && head -c 20000000 /dev/zero > {ckpt}/a"  # past the batches' size
    failing = agent.root / "failing"
    env = {
        **FAST,
        **failing_inside(agent, "bt_agent.storage.base:ObjectStore.upload_file", failing),
    }
    env["BT_UPLOAD_DRAIN_SECONDS"] = "20"
    command = f"touch {failing} && {save} && sleep 1 && rm {failing}"
    result = agent.run_job(ckpt_job(command), "--job-id", "oops002", env=env)
    assert result.code == 0, result.text
    assert "upload of checkpoint-1/a failed (attempt 1), retrying: RuntimeError: " in result.err
    assert "checkpoint-1" in manifests(file_store(agent), "default", "oops002")


def test_checkpointing_disabled_uploads_nothing_and_says_so(agent: Agent) -> None:
    job = ckpt_job("echo x > $BT_CHECKPOINT_DIR/a.bin", checkpointing_config={"enabled": False})
    result = agent.run_job(job, "--job-id", "off0001")
    assert result.code == 0, result.text
    assert "checkpointing_config.enabled is false: they were not uploaded" in result.err
    assert manifests(file_store(agent), "default", "off0001") == {}


def test_metrics_endpoint_reports_the_totals(agent: Agent) -> None:
    port = servers.free_port()
    ledger = agent.root / "ledger.json"
    process = agent.start(
        ckpt_job(f"{WRITER} {ledger} --steps 1 --hold 30"),
        "--job-id",
        "metr001",
        env={**FAST, "BT_METRICS_PORT": str(port)},
    )
    try:

        def scraped() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    return str(r.read().decode())
            except OSError:
                return ""

        wait_for(lambda: "bt_agent_checkpoint_commits_total 1" in scraped(), 30, "a commit")
        text = scraped()
        assert "bt_agent_checkpoint_uploaded_files_total 3" in text
        assert "# TYPE bt_agent_checkpoint_backlog_bytes gauge" in text
    finally:
        process.send_signal(signal.SIGTERM)
        assert finish(process, 30, agent) == 128 + signal.SIGTERM


# --- faults --------------------------------------------------------------------------------


def s3_env(server: servers.SeaweedFS) -> dict[str, str]:
    return {**FAST, **server.client_env()}


@pytest.mark.parametrize("transport", ["http", "https"])
def test_many_small_files_to_s3_are_committed_exactly(
    agent: Agent, s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Small files go through the store's upload stream (one thread, many connections), large
    ones through the worker threads: both end committed, every object as written. More small
    files are ready at once than the sidecar keeps in flight (QUEUE_FILES). Over plain HTTP and
    over TLS (the endpoint's CA trusted through AWS_CA_BUNDLE)."""
    bucket = f"ck{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    ledger = agent.root / "ledger.json"
    writer = f"{WRITER} {ledger} --style shards --steps 3 --files 600 --size 3000"
    # Renamed into place: a file that `head` closes as it exits, its shell reaping it at once,
    # cannot be told from one cut short by a kill, and its checkpoint would be held back.
    big = (
        "head -c 3000000 /dev/urandom > $BT_CHECKPOINT_DIR/checkpoint-3/.big && "
        "mv $BT_CHECKPOINT_DIR/checkpoint-3/.big $BT_CHECKPOINT_DIR/checkpoint-3/big.bin"
    )
    env = {**FAST, **s3_server.client_env(tls=transport == "https")}
    url = f"s3://{bucket}/bt"
    result = agent.run_job(
        ckpt_job(f"{writer} && {big}"), "--job-id", "small001", "--store", url, env=env
    )
    assert result.code == 0, result.text
    written = json.loads(ledger.read_text())
    written["checkpoint-3"] = on_disk(agent.node_root / "mnt" / "ckpts")["checkpoint-3"]
    assert "big.bin" in written["checkpoint-3"]
    for name, value in s3_server.client_env(tls=transport == "https").items():  # the test's own
        monkeypatch.setenv(name, value)
    assert_store_holds(open_store(url, Environ(env)), written, "small001")


class _Thread(NamedTuple):
    policy: int  # the scheduling policy
    cpus: set[int]  # the CPUs it may run on


def _threads(pid: int) -> dict[str, _Thread]:
    """Each thread of ``pid``, by its name and id: its scheduling policy and its CPUs."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            policy = int(fields[38])  # stat's 41st field
            found[f"{name}/{task.name}"] = _Thread(policy, os.sched_getaffinity(int(task.name)))
    return found


def test_the_store_engines_threads_upload_at_the_sidecars_low_priority(
    agent: Agent, s3_server: servers.SeaweedFS
) -> None:
    """The S3 engine's own threads (its runtime, started by the agent's first request, before
    training) do the uploads' requests and checksums: once the sidecar runs, they are
    SCHED_IDLE like its upload threads, so that they only take CPU time training leaves."""
    bucket = f"ck{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    go_on = agent.root / "go-on"
    command = (
        f"{BIG_CHECKPOINT} && while [ ! -e {go_on} ]; do sleep 0.05; done"  # a multipart upload
    )
    env = s3_env(s3_server)
    url = f"s3://{bucket}/bt"
    process = agent.start(ckpt_job(command), "--job-id", "prio001", "--store", url, env=env)
    try:
        store = open_store(url, Environ(env))
        wait_for(lambda: manifests(store, "default", "prio001"), 60, "checkpoint-1 committed")
        threads = _threads(process.pid)
        engine = {n: t.policy for n, t in threads.items() if n.startswith("tokio-")}
        assert engine, f"no engine threads among {sorted(threads)}"
        assert set(engine.values()) == {os.SCHED_IDLE}, engine
    finally:
        go_on.touch()
    assert finish(process, 60, agent) == 0, agent.output()


def test_uploads_keep_off_the_cpus_the_job_is_pinned_to(
    agent: Agent, s3_server: servers.SeaweedFS
) -> None:
    """A trainer pinned to a CPU owns it: while it is busy there, the sidecar's threads and the
    store engine's run on the other CPUs only; the agent's own threads, from which the job's
    commands start, stay where they were."""
    cpus = needs_two_cpus()
    bucket = f"ck{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    go_on = agent.root / "go-on"
    spin = Path(__file__).parent / "bin" / "spin_pinned.py"
    command = f"{sys.executable} {spin} {go_on} --cpus {cpus[0]} --checkpoint-mib 20"
    url = f"s3://{bucket}/bt"
    env = s3_env(s3_server)
    process = agent.start(ckpt_job(command), "--job-id", "cpus001", "--store", url, env=env)
    others = set(cpus[1:])

    def placed() -> tuple[dict[str, set[int]], dict[str, set[int]]]:
        """The CPUs of the threads at SCHED_IDLE (the sidecar's, the engine's), and the others'."""
        threads = _threads(process.pid)
        idle = {n: t.cpus for n, t in threads.items() if t.policy == os.SCHED_IDLE}
        return idle, {n: t.cpus for n, t in threads.items() if n not in idle}

    try:
        store = open_store(url, Environ(env))
        wait_for(lambda: manifests(store, "default", "cpus001"), 60, "checkpoint-1 committed")
        wait_for(
            lambda: all(a == others for a in placed()[0].values()),
            10,
            f"the sidecar's threads kept to CPUs {others}",
        )
        idle, rest = placed()
        assert any(name.startswith("tokio-") for name in idle), sorted(idle)
        assert len(idle) > 16, sorted(idle)  # the upload workers, the stream, the coordinator
        assert all(a == set(cpus) for a in rest.values()), rest
        assert any(n.endswith(f"/{process.pid}") for n in rest), sorted(rest)  # the main thread
    finally:
        go_on.touch()
    assert finish(process, 60, agent) == 0, agent.output()
    assert f"uploads keep to CPUs {cpu_list(others)}" in agent.output()


def _ledger(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _journal_rows(agent: Agent, job_id: str, table: str = "files") -> int:
    """Rows of ``job_id`` in a table of the agent's journal (``files``: uploads made durable;
    ``writing``: checkpoints seen being written in place and not yet settled)."""
    journal = agent.node_root / "var" / "lib" / "bt-agent" / "sidecar-journal.sqlite"
    if not journal.exists():
        return 0
    with contextlib.closing(sqlite3.connect(journal, timeout=5)) as db:
        try:
            row = db.execute(f"SELECT COUNT(*) FROM {table} WHERE job_id=?", (job_id,)).fetchone()
        except sqlite3.OperationalError:  # the agent has not made its tables yet
            return 0
        return int(row[0])


@pytest.fixture
def far_s3(own_s3: servers.SeaweedFS) -> Iterator[FaultProxy]:
    """The test's S3 server behind a proxy that can hold every request back (``delay``: a store
    far away)."""
    proxy = FaultProxy(own_s3.port)
    try:
        yield proxy
    finally:
        proxy.close()


def test_agent_killed_mid_upload_resumes_without_loss_or_duplicates(
    agent: Agent, own_s3: servers.SeaweedFS, far_s3: FaultProxy
) -> None:
    # Once training runs the store is far away, so the uploads of the last checkpoint are still
    # under way when the agent is killed, however busy the machine; the agent started again
    # finds it near.
    proxy = far_s3
    env = {**s3_env(own_s3), "AWS_ENDPOINT_URL": proxy.endpoint}
    ledger = agent.root / "ledger.json"
    writer = f"{WRITER} {ledger} --style shards --steps 5 --files 8 --size 6000000 --hold 60"
    args = ("--job-id", "kill001", "--store", "s3://store/bt")
    first = agent.start(ckpt_job(writer), *args, env=env)
    try:
        wait_for(lambda: _ledger(ledger), 60, "training under way")
        proxy.delay = 2.0
        wait_for(lambda: "checkpoint-5" in _ledger(ledger), 60, "the last checkpoint written")
        # Past the quiet period, and every checkpoint seen settled, so none is half-written
        # for the agent started again (one still being written would be held back:
        # tests/faults). A busy agent may take longer than the quiet period to see it.
        time.sleep(0.8)
        wait_for(lambda: not _journal_rows(agent, "kill001", "writing"), 30, "all settled")
        first.send_signal(signal.SIGKILL)  # no drain, no records: the container died
        first.wait(10)
    finally:
        proxy.delay = 0.0
        for pid in marked_processes(agent.mark):  # the orphaned trainer dies with the container
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not marked_processes(agent.mark), 10, "the trainer gone")
    before = _journal_rows(agent, "kill001")
    written = on_disk(agent.node_root / "mnt" / "ckpts")
    total_files = sum(len(files) for files in written.values())
    assert before < total_files, "the kill came too late to test a resume"
    second = agent.run_job(ckpt_job("true"), *args, env={**env, "BT_RETRY_COUNT": "1"}, timeout=180)
    assert second.code == 0, second.text
    store = open_store("s3://store/bt", Environ(env))
    assert_store_holds(store, written, "kill001")
    uploads = node_record_s3(store, "kill001")["uploads"]
    assert uploads["files"] == total_files - before, "only what was missing is uploaded again"
    assert _journal_rows(agent, "kill001") == total_files


def node_record_s3(store: ObjectStore, job_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        store.read_bytes(f"projects/default/jobs/{job_id}/nodes/rank-0.json")
    )
    return data


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Path]:
    """A file store on an 8 MiB tmpfs: records fit, a large checkpoint does not."""
    with small_tmpfs(tmp_path / "small-store", "8m") as mount:
        yield mount


BIG_CHECKPOINT = (
    "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && "
    "head -c 20000000 /dev/urandom > $BT_CHECKPOINT_DIR/checkpoint-1/model.bin"
)


def test_what_cannot_be_saved_before_the_deadline_is_exit_4(
    agent: Agent, small_store: Path
) -> None:
    result = agent.run_job(
        ckpt_job(BIG_CHECKPOINT),
        "--job-id",
        "full001",
        "--store",
        str(small_store),
        env={**FAST, "BT_UPLOAD_DRAIN_SECONDS": "3"},
        timeout=60,
    )
    assert result.code == 4, result.text
    record = json.loads(
        (small_store / "projects/default/jobs/full001/nodes/rank-0.json").read_text()
    )
    assert record["status"] == "TRAINING_JOB_FAILED"
    assert record["uploads"]["not_durable"] == ["checkpoint-1/model.bin"]
    assert "1 checkpoint file(s) not durable: checkpoint-1/model.bin" in record["error"]
    assert not list((small_store / "projects/default/jobs/full001").rglob("manifests/*/*.json"))
    leftovers = [p for p in small_store.rglob("*") if p.is_file() and "model.bin" in p.name]
    assert leftovers == [], "no partial object left in the store"


def test_sigterm_during_the_drain_ends_within_the_grace_period(
    agent: Agent, small_store: Path
) -> None:
    process = agent.start(
        ckpt_job(BIG_CHECKPOINT),
        "--job-id",
        "term001",
        "--store",
        str(small_store),
        "--grace-period",
        "4",
        env=FAST,
    )
    wait_for(lambda: "upload of checkpoint-1/model.bin failed" in agent.output(), 30, "the drain")
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = finish(process, 30, agent)
    elapsed = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, agent.output()
    assert elapsed < 4.5, f"took {elapsed:.1f} s, grace period 4 s"
    record = json.loads(
        (small_store / "projects/default/jobs/term001/nodes/rank-0.json").read_text()
    )
    assert record["status"] == "TRAINING_JOB_STOPPED"
    assert record["uploads"]["not_durable"] == ["checkpoint-1/model.bin"]


def test_stops_with_uploads_in_flight_over_tls_end_with_the_stop_s_status(
    agent: Agent, s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bt-agent run` stopped (SIGTERM) while a checkpoint's files go up over https to a store
    far away (20 ms a request piece) exits 143 every time, its grace period (3 s) ending with
    multipart uploads out on the engine's threads: the node record says which files were not
    durable, nothing is committed, and no multipart upload is left begun in the store (S3
    keeps their parts out of sight, billed, until they are aborted; the engine aborts only
    those that fail). A stop mid-download over TLS once crashed the agent on its way out
    (`test_staging`); this guards the uploads' side. Three stops at points drawn at random
    (seeded) after the checkpoint is written."""
    import random

    from far_link import FarLink

    bucket = f"ck{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    far = FarLink(s3_server.https_port, 0.02, 20e6)
    env = {
        **FAST,
        **s3_server.client_env(tls=True),
        "AWS_ENDPOINT_URL": f"https://localhost:{far.port}",
    }
    url = f"s3://{bucket}/bt"
    files = [f"checkpoint-1/part{i}.bin" for i in range(4)]
    command = (
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && for i in 0 1 2 3; do "
        "head -c 32000000 /dev/urandom > $BT_CHECKPOINT_DIR/checkpoint-1/.part$i && "
        "mv $BT_CHECKPOINT_DIR/checkpoint-1/.part$i $BT_CHECKPOINT_DIR/checkpoint-1/part$i.bin; "
        "done && touch $BT_CHECKPOINT_DIR/../written && exec sleep 600"
    )
    draw = random.Random(29)
    codes, records, left = [], [], []
    client = s3_server.client()
    for name, value in s3_server.client_env(tls=True).items():  # the test's own reads
        monkeypatch.setenv(name, value)
    store = open_store(url, Environ(env))
    try:
        for stop in range(3):
            job_id = f"tlsstop{stop}"
            written = agent.node_root / "mnt" / "written"
            written.unlink(missing_ok=True)
            process = agent.start(
                ckpt_job(command), "--job-id", job_id, "--store", url, "--grace-period", "3",
                env=env,
            )  # fmt: skip
            wait_for(written.exists, 60, "the checkpoint")
            time.sleep(draw.uniform(0.1, 1.5))
            process.send_signal(signal.SIGTERM)
            codes.append(finish(process, 30, agent))
            prefix = f"projects/default/jobs/{job_id}"
            records.append(json.loads(store.read_bytes(f"{prefix}/nodes/rank-0.json")))
            assert not store.list(f"{prefix}/manifests/"), "nothing is committed"
            begun = client.list_multipart_uploads(Bucket=bucket, Prefix=f"bt/{prefix}/")
            left.append([upload["Key"] for upload in begun.get("Uploads", [])])
    finally:
        far.close()
    assert codes == [128 + signal.SIGTERM] * 3, (codes, agent.output()[-3000:])
    assert [r["status"] for r in records] == ["TRAINING_JOB_STOPPED"] * 3
    assert left == [[]] * 3, left
    assert re.search(r"checkpoints: aborted \d+ multipart uploads? left unfinished", agent.output())
    for record in records:
        assert record["uploads"]["not_durable"], "the stop came with uploads in flight"
        assert set(record["uploads"]["not_durable"]) <= set(files)


def test_uploads_an_agent_killed_outright_left_begun_are_aborted_by_the_next(
    agent: Agent, s3_server: servers.SeaweedFS
) -> None:
    """An agent killed outright (no drain) leaves its multipart uploads begun in the store;
    the next agent on the node, finding the checkpoint dir holds files, aborts them before
    its first upload, then uploads and commits as ever. Those of another rank are left."""
    bucket = f"ck{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    ours = "bt/projects/default/jobs/left002/checkpoints/rank-0/checkpoint-1/model.bin"
    theirs = "bt/projects/default/jobs/left002/checkpoints/rank-1/checkpoint-1/model.bin"
    client = s3_server.client()
    for key in (ours, theirs):
        begun = client.create_multipart_upload(Bucket=bucket, Key=key)
        client.upload_part(
            Bucket=bucket, Key=key, UploadId=begun["UploadId"], PartNumber=1, Body=b"x" * 1024
        )
    saved = agent.node_root / "mnt" / "ckpts" / "checkpoint-1" / "model.bin"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(os.urandom(12 * 1024 * 1024))
    env = {**FAST, **s3_server.client_env()}
    result = agent.run_job(
        ckpt_job("true"), "--job-id", "left002", "--store", f"s3://{bucket}/bt", env=env
    )
    assert result.code == 0, result.text
    said = "checkpoints: aborted 1 multipart upload left unfinished in the store"
    assert said in result.err, result.err
    assert result.err.index(said) < result.err.index("checkpoint checkpoint-1 committed")
    begun = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [upload["Key"] for upload in begun] == [theirs]
    stored = client.get_object(Bucket=bucket, Key=ours)["Body"].read()
    assert stored == saved.read_bytes()


def test_uploads_left_when_the_commands_end_are_said(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """The commands end while a checkpoint's upload is held up (held 5 s on the way): the
    agent says what it still uploads and for how long at most, rather than sitting
    silent after the job's last line, then commits it. The file is written just before the
    commands end, so only a count taken then finds it (the sidecar's own count, once a
    second, would not have it yet)."""
    proxy = FaultProxy(own_s3.port, delay=5, delay_only="/checkpoint-1/model.bin")
    env = {**own_s3.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint, **FAST}
    command = (
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && "
        "head -c 3000000 /dev/urandom > $BT_CHECKPOINT_DIR/checkpoint-1/model.bin"
    )
    try:
        result = agent.run_job(
            ckpt_job(command), "--job-id", "left001", "--store", "s3://store/bt", env=env
        )
    finally:
        proxy.close()
    assert result.code == 0, result.text
    said = "checkpoints: 1 file (3.0 MB) still to upload; the job ends once they are durable"
    assert said in result.err, result.err
    assert result.err.index(said) < result.err.index("checkpoint checkpoint-1 committed")


def test_a_file_made_durable_leaves_the_backlog_at_once() -> None:
    """The backlog is counted once a second; a file made durable since leaves it at once, so
    the node record and the metrics never count files committed just before."""
    stats = UploadStats()
    stats.backlog(2, 3_000_100)
    stats.uploaded(3_000_000)
    totals = stats.totals()
    assert (totals.backlog_files, totals.backlog_bytes) == (1, 100)
    stats.uploaded(500)  # a file the last count had not seen yet
    totals = stats.totals()
    assert (totals.files, totals.backlog_files, totals.backlog_bytes) == (2, 0, 0)


def test_a_sidecar_stuck_on_a_dead_store_at_the_deadline_reports_by_its_journal(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    """The store takes the checkpoint's file, then hangs on its manifest: the coordinator is
    stuck in that request when the drain's deadline passes, so the drain tells what is lost
    from the journal and the disk (the file durable, no commit recorded): exit 4, in time."""
    proxy = FaultProxy(own_s3.port, delay=60, delay_only="/manifests/")
    env = {
        **own_s3.client_env(),
        "AWS_ENDPOINT_URL": proxy.endpoint,
        **FAST,
        "BT_UPLOAD_DRAIN_SECONDS": "3",
    }
    command = (
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo w > $BT_CHECKPOINT_DIR/checkpoint-1/w"
    )
    try:
        started = time.monotonic()
        result = agent.run_job(
            ckpt_job(command), "--job-id", "stuck01", "--store", "s3://store/bt", env=env
        )
        elapsed = time.monotonic() - started
    finally:
        proxy.close()
    assert result.code == 4, result.text
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert any("/manifests/" in line for line in proxy.lines), "the manifest was asked for"
    store = open_store("s3://store/bt", Environ(own_s3.client_env()))
    record = json.loads(store.read_bytes("projects/default/jobs/stuck01/nodes/rank-0.json"))
    assert record["uploads"]["not_durable"] == []
    assert record["uploads"]["not_committed"] == {
        "checkpoint-1": "no commit of it was recorded by the deadline"
    }


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("tmp-checkpoint-20/model.safetensors", True),  # HF Trainer, before its rename
        ("tmp_save/w.bin", True),
        (".staging/w.bin", True),
        ("checkpoint-20.tmp/w.bin", True),
        ("checkpoint-20/model.safetensors.tmp", True),
        ("checkpoint-20/w.bin.partial", True),
        ("checkpoint-20/model.safetensors", False),
        ("checkpoint-20/.metadata", False),  # torch.distributed.checkpoint's index
        ("tmp-notes.txt", False),  # a root file: checkpoint "."
        ("checkpoint-20/tmp-cache/x", False),  # only top-level directories count
    ],
)
def test_work_in_progress_is_never_uploaded(relative: str, expected: bool) -> None:
    from bt_agent.sidecar.files import transient

    assert transient(relative) is expected


def test_a_checkpoint_held_on_a_full_disk_is_released_only_once_rewritten(tmp_path: Path) -> None:
    import io

    from bt_agent.log import AgentLog
    from bt_agent.sidecar.holds import Holds
    from bt_agent.sidecar.journal import Journal
    from bt_agent.sidecar.space import FullDisk

    out = io.StringIO()
    journal = Journal(tmp_path / "journal.sqlite", "file:///store", "j", 0)
    holds = Holds(AgentLog(out), journal)
    space = FullDisk(tmp_path, AgentLog(out), holds, threshold=2**62)  # any disk is "full"
    torn = time.time_ns()  # a file written before the disk was seen full
    space.check(lambda: ["checkpoint-2"])
    assert space.full and list(holds.held) == ["checkpoint-2"]
    assert "not committing checkpoint-2: it was being written while" in out.getvalue()
    assert holds.blocks("checkpoint-2", [torn])
    assert not holds.blocks("checkpoint-1", [torn]), "not being written then"
    space.threshold = 0
    space.check(lambda: ["checkpoint-2"])
    assert not space.full and "has room again" in out.getvalue()
    later = time.time_ns() + 10**9
    assert holds.blocks("checkpoint-2", [torn, later]), "one file is still the torn one"
    assert Holds(AgentLog(out), journal).held == holds.held, "kept in the journal"
    assert not holds.blocks("checkpoint-2", [later, later]) and holds.held == {}
    assert Holds(AgentLog(out), journal).held == {}
    journal.close()
