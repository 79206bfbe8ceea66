"""Torn or wrong commits: trainers that die while saving, writers still running when the commands
end, saves with pauses, two agents on one job and rank, and files an earlier job saved. Each
test fails on an agent that commits a checkpoint cut short (which a later job would resume
from), and checks that what is not committed is said in the node record and the log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import Agent, finish, marked_processes, trainer_job, wait_for
from sidecar_checks import FAST, manifests

from bt_agent.settings import Environ
from bt_agent.sidecar import writers as writers_module
from bt_agent.sidecar.writers import Writers
from bt_agent.storage import ObjectStore, open_store

MiB = 1024 * 1024


def _store(agent: Agent) -> ObjectStore:
    return open_store(agent.store.as_uri(), Environ({}))


def _record(agent: Agent, job_id: str) -> dict[str, Any]:
    path = agent.store / f"projects/default/jobs/{job_id}/nodes/rank-0.json"
    return dict(json.loads(path.read_text()))


def _committed(agent: Agent, job_id: str) -> dict[str, list[tuple[str, int]]]:
    return {
        name: sorted((f.path, f.size) for f in manifest.files)
        for name, manifest in manifests(_store(agent), "default", job_id).items()
    }


def _manifest_path(agent: Agent, job_id: str, checkpoint: str) -> Path:
    return agent.store / f"projects/default/jobs/{job_id}/manifests/rank-0/{checkpoint}.json"


# A trainer saving in place, as torch.save does: checkpoint-1 whole, then checkpoint-2's
# model.pt cut short, and its optimizer.pt never written.
SAVE_AND_DIE = """
import os, signal, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
MiB = 1024 * 1024

def write(path, size, pause=0.0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for i in range(size // MiB):
            f.write(os.urandom(MiB))
            f.flush()
            if i == 1:
                time.sleep(pause)  # a slow device-to-host copy, half way

write(f"{root}/checkpoint-1/model.pt", 4 * MiB)
write(f"{root}/checkpoint-1/optimizer.pt", 2 * MiB)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
path = f"{root}/checkpoint-2/model.pt"
os.makedirs(os.path.dirname(path))
f = open(path, "wb")
f.write(os.urandom(2 * MiB))
f.flush()
time.sleep(float(sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)   # the OOM killer
"""


def _assert_not_committed(agent: Agent, job_id: str, text: str, checkpoint: str) -> str:
    error = _record(agent, job_id)["error"] or ""
    assert f"not committed: {checkpoint}, " in error, error
    assert f"not committed: {checkpoint}, " in text, text
    return error


def test_a_trainer_killed_mid_save_leaves_its_checkpoint_uncommitted(agent: Agent) -> None:
    for job_id, pause in (("oom0001", "0.0"), ("oom0002", "1.2")):  # missed by a scan, or seen
        marker = _manifest_path(agent, job_id, "checkpoint-1")
        job = trainer_job(agent, SAVE_AND_DIE, f"{marker} {pause}")
        node = str(agent.root / f"node-{job_id}")
        result = agent.run_job(job, "--job-id", job_id, "--node-root", node, env=FAST)
        assert result.code == 128 + signal.SIGKILL, result.text
        assert _committed(agent, job_id) == {
            "checkpoint-1": [("model.pt", 4 * MiB), ("optimizer.pt", 2 * MiB)]
        }, result.text
        error = _assert_not_committed(agent, job_id, result.err, "checkpoint-2")
        if pause != "0.0":  # its writer was seen holding model.pt open; the agent reaped it
            # The first to tell wins: the file's close, or the reaper's news of the kill.
            said = ("its writer ended while writing model.pt", "was killed by SIGKILL")
            assert any(why in error for why in said), error


SLOW_WRITER = """
import os, signal, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.makedirs(f"{root}/checkpoint-1")
with open(f"{root}/checkpoint-1/model.pt", "wb") as f:
    for _ in range(int(sys.argv[2])):
        f.write(os.urandom(1024 * 1024))
        f.flush()
        time.sleep(float(sys.argv[3]))
"""


def test_a_stop_that_ends_a_writer_mid_file_commits_nothing(agent: Agent) -> None:
    """SIGTERM to the agent while a 512 MiB file is written in place; the trainer has no
    handler and dies of it."""
    job = trainer_job(agent, SLOW_WRITER, "default 512 0.002")
    process = agent.start(job, "--job-id", "term001", env=FAST)
    target = agent.node_root / "mnt/ckpts/checkpoint-1/model.pt"
    wait_for(lambda: target.exists() and target.stat().st_size > 64 * MiB, 60, "the write")
    time.sleep(0.6)  # the sidecar has looked at who writes
    process.send_signal(signal.SIGTERM)
    code = finish(process, 60, agent)
    assert code == 128 + signal.SIGTERM, agent.output()
    assert target.stat().st_size < 512 * MiB, "the trainer died before the end"
    assert _committed(agent, "term001") == {}, agent.output()
    _assert_not_committed(agent, "term001", agent.output(), "checkpoint-1")


def test_the_grace_period_sigkill_of_a_writer_commits_nothing(agent: Agent) -> None:
    job = trainer_job(agent, SLOW_WRITER, "ignore 100000 0.05")
    process = agent.start(job, "--job-id", "kill001", "--grace-period", "3", env=FAST)
    target = agent.node_root / "mnt/ckpts/checkpoint-1/model.pt"
    wait_for(lambda: target.exists() and target.stat().st_size > 4 * MiB, 60, "the write")
    process.send_signal(signal.SIGTERM)
    code = finish(process, 30, agent)
    assert code == 128 + signal.SIGTERM, agent.output()
    assert _committed(agent, "kill001") == {}, agent.output()
    error = _assert_not_committed(agent, "kill001", agent.output(), "checkpoint-1")
    assert "model.pt" in error, error  # still open for writing, or its writer ended with it


def test_a_checkpoint_half_written_when_the_container_died_waits_for_a_rewrite(
    agent: Agent,
) -> None:
    job = trainer_job(agent, SLOW_WRITER, "default 100000 0.05")
    process = agent.start(job, "--job-id", "rest001", env=FAST)
    target = agent.node_root / "mnt/ckpts/checkpoint-1/model.pt"
    wait_for(lambda: target.exists() and target.stat().st_size > 4 * MiB, 60, "the write")
    time.sleep(0.5)
    process.send_signal(signal.SIGKILL)  # the container died: the agent and the trainer
    process.wait(10)
    for pid in marked_processes(agent.mark):
        signal_pid(pid)
    wait_for(lambda: not marked_processes(agent.mark), 10, "the trainer gone")

    other = agent.run_job(trainer_job(agent, "pass"), "--job-id", "rest002", env=FAST)
    assert other.code == 0, other.text  # another job on the node root: not its concern...
    assert _committed(agent, "rest002") == {}, other.text  # ...nor its checkpoint

    again = agent.run_job(trainer_job(agent, "pass"), "--job-id", "rest001", env=FAST)
    assert again.code == 4, again.text
    assert _committed(agent, "rest001") == {}, again.text
    error = _assert_not_committed(agent, "rest001", again.err, "checkpoint-1")
    assert "it was being written in place when the agent last stopped" in error, error

    rewrite = "import os; open(os.environ['BT_CHECKPOINT_DIR'] + '/checkpoint-1/model.pt', 'wb')"
    third = agent.run_job(trainer_job(agent, rewrite + ".write(b'whole')"), "--job-id", "rest001")
    assert third.code == 0, third.text
    assert _committed(agent, "rest001") == {"checkpoint-1": [("model.pt", 5)]}, third.text


def signal_pid(pid: int) -> None:
    import contextlib
    import os

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# The trainer exits 0 and leaves a background writer still saving (an async checkpointer).
BACKGROUND_WRITER = """
import os, subprocess, sys
root = os.environ["BT_CHECKPOINT_DIR"]
os.makedirs(f"{root}/checkpoint-1")
code = (
    "import os, time\\n"
    f"with open('{root}/checkpoint-1/model.pt', 'wb') as f:\\n"
    f"    for _ in range({sys.argv[1]}):\\n"
    "        f.write(os.urandom(1024 * 1024)); f.flush(); time.sleep(0.05)\\n"
)
subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
while not os.path.exists(f"{root}/checkpoint-1/model.pt"):  # it has begun: this one is done
    pass
"""


def test_writers_left_running_are_waited_for_within_the_grace_period(agent: Agent) -> None:
    job = trainer_job(agent, BACKGROUND_WRITER, "40")  # about 2 s of writing
    result = agent.run_job(job, "--job-id", "bgw0001", "--grace-period", "20", env=FAST)
    assert result.code == 0, result.text
    assert "still being written (checkpoint-1/model.pt" in result.err, result.err
    assert _committed(agent, "bgw0001") == {"checkpoint-1": [("model.pt", 40 * MiB)]}


def test_a_writer_ended_after_the_grace_period_is_not_committed(agent: Agent) -> None:
    job = trainer_job(agent, BACKGROUND_WRITER, "100000")
    result = agent.run_job(job, "--job-id", "bgw0002", "--grace-period", "2", env=FAST)
    assert result.code == 4, result.text
    assert _committed(agent, "bgw0002") == {}, result.text
    error = _assert_not_committed(agent, "bgw0002", result.err, "checkpoint-1")
    assert "model.pt" in error, error  # still open for writing, or its writer ended with it
    assert _record(agent, "bgw0002")["status"] == "TRAINING_JOB_FAILED"


# A sharded save: shard 0, then shard 1 written in two halves with a long pause between (a
# slow gather), then the index. Every manifest seen must name the three files.
PAUSED_SHARDS = """
import os, time
root = os.environ["BT_CHECKPOINT_DIR"]
os.makedirs(f"{root}/checkpoint-1")
with open(f"{root}/checkpoint-1/shard-0.distcp", "wb") as f:
    f.write(os.urandom(1024 * 1024))
with open(f"{root}/checkpoint-1/shard-1.distcp", "wb") as f:
    f.write(os.urandom(512 * 1024))
    f.flush()
    time.sleep(1.5)
    f.write(os.urandom(512 * 1024))
with open(f"{root}/checkpoint-1/.metadata", "w") as f:
    f.write("index")
time.sleep(1)
"""


def test_a_file_open_for_writing_keeps_its_checkpoint_from_a_commit(agent: Agent) -> None:
    process = agent.start(trainer_job(agent, PAUSED_SHARDS), "--job-id", "shrd001", env=FAST)
    manifest = _manifest_path(agent, "shrd001", "checkpoint-1")
    seen: list[list[str]] = []
    deadline = time.monotonic() + 30
    while process.poll() is None and time.monotonic() < deadline:
        if manifest.exists():
            with contextlib.suppress(ValueError):
                seen.append(sorted(f["path"] for f in json.loads(manifest.read_text())["files"]))
        time.sleep(0.02)
    assert finish(process, 30, agent) == 0, agent.output()
    whole = [".metadata", "shard-0.distcp", "shard-1.distcp"]
    assert seen and all(files == whole for files in seen), seen


EARLIER = (
    "cd $BT_CHECKPOINT_DIR && mkdir -p checkpoint-0 checkpoint-1 && echo zero > checkpoint-0/z"
    " && echo a > checkpoint-1/a && echo b > checkpoint-1/b"
)


def test_files_an_earlier_job_saved_are_in_the_new_jobs_manifest(agent: Agent) -> None:
    """On a reused node root, a checkpoint the new job adds to names the earlier job's files
    too (copied in the store); one the new job leaves as it was stays the earlier job's."""
    from sidecar_checks import ckpt_job

    first = agent.run_job(ckpt_job(EARLIER), "--job-id", "earl001", env=FAST)
    assert first.code == 0, first.text
    second = agent.run_job(
        ckpt_job("echo c > $BT_CHECKPOINT_DIR/checkpoint-1/c"), "--job-id", "earl002", env=FAST
    )
    assert second.code == 0, second.text
    assert _committed(agent, "earl002") == {"checkpoint-1": [("a", 2), ("b", 2), ("c", 2)]}
    stored = agent.store / "projects/default/jobs/earl002/checkpoints/rank-0/checkpoint-1"
    assert {p.name: p.read_text() for p in stored.iterdir()} == {"a": "a\n", "b": "b\n", "c": "c\n"}
    assert _record(agent, "earl002")["uploads"]["files"] == 3


HOLD = "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo a > $BT_CHECKPOINT_DIR/checkpoint-1/a"


def test_a_second_agent_on_the_same_job_and_rank_is_refused(agent: Agent) -> None:
    first = agent.start(
        trainer_job(agent, "import time; time.sleep(4)", before=HOLD),
        "--job-id",
        "twin001",
        env=FAST,
    )
    try:
        wait_for(
            lambda: (agent.store / "projects/default/jobs/twin001/job.json").exists(), 30, "job"
        )
        second = agent.run_job(
            trainer_job(agent, "print('must not run')", before=HOLD),
            "--job-id",
            "twin001",
            "--node-root",
            str(agent.root / "other-node"),
            env=FAST,
        )
        assert second.code == 2, second.text
        assert "already run by another agent" in second.err, second.err
        assert "must not run" not in second.out
        assert not (agent.root / "other-node" / "mnt").exists(), "it made nothing"
    finally:
        assert finish(first, 60, agent) == 0, agent.output()
    assert _committed(agent, "twin001") == {"checkpoint-1": [("a", 2)]}
    record = _record(agent, "twin001")
    assert record["status"] == "TRAINING_JOB_COMPLETED" and record["exit_code"] == 0
    # Given up at the end: the same job id and rank may run again, here or elsewhere.
    third = agent.run_job(
        trainer_job(agent, "pass"), "--job-id", "twin001", "--node-root", str(agent.root / "n3")
    )
    assert third.code == 0, third.text


# --- the close event comes after the close: whose end closed the file ----------------------

HOLD_OPEN = """
import os, sys, time
handle = open(sys.argv[1], "wb")
handle.write(b"x" * 1000)
handle.flush()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
handle.write(b"y" * 1000)
handle.close()
if len(sys.argv) > 3:  # say it is closed, then live on until a signal ends it
    open(sys.argv[3], "w").close()
    time.sleep(60)
"""


def _zombie(process: subprocess.Popen[bytes]) -> None:
    """Wait until ``process`` has ended without reaping it (its status stays readable)."""

    def ended() -> bool:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0] == "Z"
        return False

    wait_for(ended, 10, "the writer to end")


@contextlib.contextmanager
def _two_writers(
    directory: Path, *seeing: Writers
) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two writers of ``directory`` holding ``finished.pt`` and ``killed.pt`` open, seen by
    every one of ``seeing``; then the first finishes its file and exits on its own, the other
    is SIGKILLed mid-file (both left unreaped)."""
    finished, killed = directory / "finished.pt", directory / "killed.pt"
    go = directory / "go"
    clean = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, str(finished), str(go)])
    cut = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, str(killed), str(directory / "no")])
    try:
        wait_for(lambda: finished.exists() and killed.exists(), 10, "the writers to open")
        for writers in seeing:
            wait_for(partial(_sees, writers, {"finished.pt", "killed.pt"}), 10, "writers seen")
        go.touch()
        cut.send_signal(signal.SIGKILL)
        yield clean, cut
    finally:
        for process in (clean, cut):
            process.kill()
            process.wait()


def _sees(writers: Writers, paths: set[str]) -> bool:
    return paths <= set(writers.scan(force=True))


def test_a_writer_that_closes_and_exits_at_once_is_not_torn(tmp_path: Path) -> None:
    """A trainer's last save: it closes the file and exits, and the close event reaches the
    sidecar after the exit. A file closed by its writer and one closed by a signal's end look
    alike then but for the exit status, which decides."""
    writers = Writers(tmp_path)
    with _two_writers(tmp_path, writers) as (clean, cut):
        _zombie(clean)
        _zombie(cut)
        assert (tmp_path / "finished.pt").stat().st_size == 2000
        closed = writers.closed(str(tmp_path / "finished.pt"))
        assert closed is False, "closed by its writer, which then exited"
        assert writers.closed(str(tmp_path / "killed.pt")) is True, (
            "closed by the end SIGKILL brought"
        )


def test_a_writer_a_signal_ends_after_it_closed_its_file_is_not_torn(tmp_path: Path) -> None:
    """A writer closes its file (a trainer's last save, an async checkpointer) and lives on
    for a moment: its interpreter's teardown. The agent, seeing nothing open any more, ends
    what the commands left behind (or passes on a stop) before the close event reaches the
    sidecar, which is slow on a busy node, and the signal ends the writer. The agent tells
    the sidecar before it signals: the file was closed by its writer. A file still open then
    is cut short by the signal, as before."""
    writers = Writers(tmp_path)
    whole, cut, go, closed = (tmp_path / name for name in ("whole.pt", "cut.pt", "go", "closed"))
    closing = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, whole, go, closed])
    holding = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, cut, tmp_path / "no", go])
    try:
        wait_for(lambda: whole.exists() and cut.exists(), 10, "the writers to open")
        wait_for(partial(_sees, writers, {"whole.pt", "cut.pt"}), 10, "the writers seen")
        go.touch()
        wait_for(closed.exists, 10, "the first writer to close its file")
        writers.before_signals()
        for process in (closing, holding):
            process.send_signal(signal.SIGTERM)
            _zombie(process)
        assert writers.closed(str(whole)) is False, "closed by its writer before the signal"
        assert writers.closed(str(cut)) is True, "closed by the end the signal brought"
    finally:
        for process in (closing, holding):
            process.kill()
            process.wait()
    writers.close()
    assert not writers._pidfds, "none held once judged"


def test_a_writer_reaped_before_its_close_is_seen_is_judged_by_its_reaper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same last save on a busy node: the agent has reaped the writer (its own child, or
    an orphan it adopted) before the close event is seen, so /proc has no status left; the
    reaper's does (recorded a moment after the process leaves /proc). On a system whose pidfds
    keep no status (here: none opened), a writer reaped by another parent, whose status nobody
    here knows, still counts as ended while writing."""
    monkeypatch.setattr(writers_module, "open_pidfd", lambda pid: None)
    statuses: dict[int, int] = {}
    writers = Writers(tmp_path, reaped=statuses.get)
    unknown = Writers(tmp_path)
    finished, killed = str(tmp_path / "finished.pt"), str(tmp_path / "killed.pt")
    with _two_writers(tmp_path, writers, unknown) as (clean, cut):
        codes = {process.pid: process.wait(10) for process in (clean, cut)}  # reaped: gone
        assert codes[clean.pid] == 0 and codes[cut.pid] == -signal.SIGKILL
        statuses[cut.pid] = codes[cut.pid]
        recorder = threading.Timer(0.1, lambda: statuses.update({clean.pid: 0}))
        recorder.start()  # the reaper records the clean one's status a little later
        assert writers.closed(finished) is False, "its reaper says it exited on its own"
        assert writers.closed(killed) is True, "its reaper says a signal ended it"
        assert unknown.closed(finished) is True, "gone, and no status to read"


def _kernel_keeps_exit_status() -> bool:
    """Whether a pidfd keeps the exit status of its process once it is reaped (Linux 6.15)."""
    process = subprocess.Popen(["true"])
    pidfd = os.pidfd_open(process.pid)
    try:
        process.wait()
        return writers_module.reaped_status(pidfd) == 0
    finally:
        os.close(pidfd)


def test_a_writer_another_process_reaped_is_judged_by_the_status_the_kernel_kept(
    tmp_path: Path,
) -> None:
    """A `cp` into the checkpoint dir that its shell waits for: the shell reaps it the moment
    it ends, before the close event is seen, and the agent's reaper never hears of it. The
    pidfd opened when a scan saw it writing still tells how it ended."""
    if not _kernel_keeps_exit_status():
        pytest.skip(f"this kernel ({os.uname().release}) keeps no exit status in pidfds (6.15+)")
    writers = Writers(tmp_path)  # no reaper of its own: the test reaps them
    with _two_writers(tmp_path, writers) as (clean, cut):
        assert clean.wait(10) == 0 and cut.wait(10) == -signal.SIGKILL
        assert not Path(f"/proc/{clean.pid}").exists(), "reaped"
        assert writers.closed(str(tmp_path / "finished.pt")) is False, "it exited on its own"
        assert writers.closed(str(tmp_path / "killed.pt")) is True, "a signal ended it"
    writers.close()
    assert writers.scan(force=True) == {} and not writers._pidfds, "none held once judged"


# A shell that waits for a command writing a checkpoint file (its children write it, each
# exiting on its own): every writer is reaped by the shell, never by the agent.
SHELL_WRITES = (
    'mkdir -p "$BT_CHECKPOINT_DIR/final" && (head -c 1000000 /dev/urandom; sleep 1; '
    'head -c 1000000 /dev/urandom) > "$BT_CHECKPOINT_DIR/final/model.bin"'
)
# A writer the shell starts, kills mid-file and reaps, the shell going on to succeed.
WRITE_AND_HOLD = """
import os, sys, time
with open(os.path.join(os.environ["BT_CHECKPOINT_DIR"], "final", "model.bin"), "wb") as f:
    f.write(os.urandom(1_000_000))
    f.flush()
    time.sleep(30)
"""


def _shell_kills_its_writer(agent: Agent) -> str:
    script = agent.root / "write_and_hold.py"
    script.write_text(WRITE_AND_HOLD)
    return (
        f'mkdir -p "$BT_CHECKPOINT_DIR/final" && {{ {sys.executable} {script} & }}; '
        "sleep 1.5; kill -KILL $!; wait $!; true"
    )


@pytest.mark.parametrize("torn", [False, True], ids=["exits-on-its-own", "killed"])
def test_a_file_a_shell_waits_for_is_judged_by_how_its_writer_ended(
    agent: Agent, torn: bool
) -> None:
    """A checkpoint written by a command of a shell (`... > $BT_CHECKPOINT_DIR/final/x`,
    `cp`): committed when its writers exit on their own, held back when one is killed
    mid-file. The first was held back as torn in most runs: the shell had reaped the writer
    before its close was seen, and nothing could say how it ended."""
    if not torn and not _kernel_keeps_exit_status():
        pytest.skip(f"this kernel ({os.uname().release}) keeps no exit status in pidfds (6.15+)")
    command = _shell_kills_its_writer(agent) if torn else SHELL_WRITES
    for run in range(3):  # the close and the shell's reaping race: each run is another draw
        job_id = f"shell{run}{int(torn)}"
        job = {
            "image": {"base_image": "x"},
            "runtime": {
                "start_commands": [command],
                "checkpointing_config": {"enabled": True},
            },
        }
        result = agent.run_job(job, "--job-id", job_id, env=FAST)
        if torn:
            assert result.code == 4, result.text
            assert _committed(agent, job_id) == {}, result.text
            _assert_not_committed(agent, job_id, result.err, "final")
        else:
            assert result.code == 0, result.text
            assert _committed(agent, job_id) == {"final": [("model.bin", 2_000_000)]}
