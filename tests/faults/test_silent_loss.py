"""Checkpoints the sidecar could lose without a word: changes its signature missed, a journal
trusted against the wrong store, rotation faster than commits, a checkpoint dir recreated, and
errors no retry can mend. Every test fails on an agent that loses them, and checks the store
against what the trainer wrote, by sha256."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from helpers import Agent, trainer_job
from sidecar_checks import FAST, ckpt_job, manifests

from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store


def _store(path: Path) -> ObjectStore:
    return open_store(path.as_uri(), Environ({}))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record(store: ObjectStore, job_id: str) -> dict[str, Any]:
    key = f"projects/default/jobs/{job_id}/nodes/rank-0.json"
    return dict(json.loads(store.read_bytes(key)))


REWRITE_KEEPING_MTIME = """
import os, sys, time
path = os.path.join(os.environ["BT_CHECKPOINT_DIR"], "checkpoint-1", "model.bin")
os.makedirs(os.path.dirname(path))
with open(path, "wb") as f:
    f.write(b"A" * 4096)
before = os.stat(path)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
with open(path, "r+b") as f:   # the same size, in place: the same inode
    f.write(b"B" * 4096)
os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))   # as cp -p does
time.sleep(1)
"""


def test_a_rewrite_that_restores_the_old_mtime_is_uploaded_again(agent: Agent) -> None:
    manifest = agent.store / "projects/default/jobs/ctim001/manifests/rank-0/checkpoint-1.json"
    job = trainer_job(agent, REWRITE_KEEPING_MTIME, str(manifest))
    result = agent.run_job(job, "--job-id", "ctim001", env=FAST)
    assert result.code == 0, result.text
    (entry,) = manifests(_store(agent.store), "default", "ctim001")["checkpoint-1"].files
    assert entry.sha256 == _sha(b"B" * 4096), "the manifest names the content before the rewrite"
    stored = agent.store / "projects/default/jobs/ctim001/checkpoints/rank-0/checkpoint-1"
    assert (stored / "model.bin").read_bytes() == b"B" * 4096


SAVE = "cd $BT_CHECKPOINT_DIR && mkdir checkpoint-1 && echo weights > checkpoint-1/w"


def test_the_journal_is_not_trusted_for_another_store(agent: Agent) -> None:
    first = agent.run_job(ckpt_job(SAVE), "--job-id", "jour001", env=FAST)
    assert first.code == 0, first.text
    other = agent.root / "other-store"
    again = agent.run_job(ckpt_job("true"), "--job-id", "jour001", "--store", str(other), env=FAST)
    assert again.code == 0, again.text
    committed = manifests(_store(other), "default", "jour001")
    assert [f.path for f in committed["checkpoint-1"].files] == ["w"], again.err
    assert _record(_store(other), "jour001")["uploads"]["files"] == 1


def test_objects_that_vanished_from_the_store_are_uploaded_again(agent: Agent) -> None:
    first = agent.run_job(ckpt_job(SAVE), "--job-id", "jour002", env=FAST)
    assert first.code == 0, first.text
    job_dir = agent.store / "projects/default/jobs/jour002"
    shutil.rmtree(job_dir / "checkpoints")
    shutil.rmtree(job_dir / "manifests")
    again = agent.run_job(ckpt_job("true"), "--job-id", "jour002", env=FAST)
    assert again.code == 0, again.text
    (entry,) = manifests(_store(agent.store), "default", "jour002")["checkpoint-1"].files
    stored = job_dir / "checkpoints/rank-0/checkpoint-1/w"
    assert stored.read_bytes() == b"weights\n" and entry.sha256 == _sha(b"weights\n")


def test_rotation_faster_than_commits_loses_nothing(agent: Agent) -> None:
    """HF Trainer's save_total_limit: each checkpoint renamed into place, then the one before
    removed, before the (long) quiet period lets it be committed: each is committed from what
    was uploaded."""
    from sidecar_checks import WRITER, assert_store_holds

    ledger = agent.root / "ledger.json"
    writer = f"{WRITER} {ledger} --style hf --steps 6 --tmp-pause 0.3 --pause 0.3"
    result = agent.run_job(
        ckpt_job(f"{writer} --save-total-limit 1"),
        "--job-id",
        "rota001",
        env={"BT_CHECKPOINT_QUIET_SECONDS": "3"},
    )
    assert result.code == 0, result.text
    on_disk = sorted(p.name for p in (agent.node_root / "mnt/ckpts").iterdir())
    assert on_disk == ["checkpoint-6"]
    assert_store_holds(_store(agent.store), json.loads(ledger.read_text()), "rota001")
    assert "deleted locally since, committed from its uploads" in result.err


DELETED_UNSAVED = """
import os, shutil, time
root = os.environ["BT_CHECKPOINT_DIR"]
os.makedirs(f"{root}/checkpoint-1")
with open(f"{root}/checkpoint-1/model.bin", "wb") as f:   # open, so never yet uploaded
    f.write(os.urandom(1 << 20))
    f.flush()
    time.sleep(0.5)
shutil.rmtree(f"{root}/checkpoint-1")
time.sleep(0.5)
"""


def test_a_checkpoint_deleted_before_its_upload_is_reported(agent: Agent) -> None:
    job = trainer_job(agent, DELETED_UNSAVED)
    result = agent.run_job(job, "--job-id", "rota002", env={"BT_CHECKPOINT_QUIET_SECONDS": "3"})
    assert result.code == 4, result.text
    error = _record(_store(agent.store), "rota002")["error"]
    assert "not committed: checkpoint-1, it was deleted" in error, error


EMPTIED = """
import os, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
if sys.argv[1] == "renamed-in":  # complete when it arrives: uploaded within the settle time
    os.makedirs(f"{root}/tmp-checkpoint-1")
    for name in ("model.bin", "config.json"):
        with open(f"{root}/tmp-checkpoint-1/{name}", "wb") as f:
            f.write(name.encode() * 1000)
    os.rename(f"{root}/tmp-checkpoint-1", f"{root}/checkpoint-1")
    time.sleep(1.5)  # long before the quiet period ends
    for name in ("model.bin", "config.json"):
        os.remove(f"{root}/checkpoint-1/{name}")  # a removal caught half way: the directory left
else:  # written in place, and still open: not uploaded before the quiet period ends
    os.makedirs(f"{root}/checkpoint-1")
    with open(f"{root}/checkpoint-1/model.bin", "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        time.sleep(1.5)
        os.remove(f"{root}/checkpoint-1/model.bin")
time.sleep(4)
"""


def test_a_checkpoint_emptied_of_its_uploaded_files_is_committed_from_its_uploads(
    agent: Agent,
) -> None:
    """A removal (rotation) the commit catches half way, every file deleted and the directory
    not yet: the checkpoint is deleted whole, so committed from what was uploaded, as one whose
    directory is gone is (it was committed from nothing, which dropped it without a word)."""
    job = trainer_job(agent, EMPTIED, "renamed-in")
    result = agent.run_job(job, "--job-id", "rota003", env={"BT_CHECKPOINT_QUIET_SECONDS": "3"})
    assert result.code == 0, result.text
    committed = manifests(_store(agent.store), "default", "rota003")
    assert {f.path for f in committed["checkpoint-1"].files} == {"model.bin", "config.json"}
    assert "deleted locally since, committed from its uploads" in result.err


def test_a_checkpoint_emptied_before_its_files_were_uploaded_is_reported(agent: Agent) -> None:
    """Written in place and emptied within the quiet period, before its file went (it was
    dropped without a word, and the job reported every file durable)."""
    job = trainer_job(agent, EMPTIED, "open")
    result = agent.run_job(job, "--job-id", "rota004", env={"BT_CHECKPOINT_QUIET_SECONDS": "3"})
    assert result.code == 4, result.text
    error = _record(_store(agent.store), "rota004")["error"]
    assert "not committed: checkpoint-1, it was deleted before" in error, error


RECREATE_DIR = """
import os, shutil, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
def save(name):
    os.makedirs(f"{root}/{name}")
    with open(f"{root}/{name}/model.bin", "wb") as f:
        f.write(name.encode())
def committed(name):
    path = f"{sys.argv[1]}/{name}.json"
    deadline = time.monotonic() + 20
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)
save("checkpoint-1")
print("checkpoint-1 committed while running:", committed("checkpoint-1"), flush=True)
shutil.rmtree(root)   # overwrite_output_dir
os.makedirs(root)
save("checkpoint-2")
print("checkpoint-2 committed while running:", committed("checkpoint-2"), flush=True)
"""


def test_a_recreated_checkpoint_dir_is_watched_again(agent: Agent) -> None:
    manifests_dir = agent.store / "projects/default/jobs/recr001/manifests/rank-0"
    job = trainer_job(agent, RECREATE_DIR, str(manifests_dir))
    result = agent.run_job(job, "--job-id", "recr001", env=FAST)
    assert result.code == 0, result.text
    assert "checkpoint-1 committed while running: True" in result.out
    assert "checkpoint-2 committed while running: True" in result.out, result.text
    committed = manifests(_store(agent.store), "default", "recr001")
    assert sorted(committed) == ["checkpoint-1", "checkpoint-2"]


LONG_KEY = """
import os
root = os.environ["BT_CHECKPOINT_DIR"]
deep = os.path.join(root, "checkpoint-1", *["d" * 200] * 6)
os.makedirs(deep)
open(os.path.join(deep, "weights.bin"), "w").write("too deep for any store")
open(os.path.join(root, "checkpoint-1", "config.json"), "w").write("{}")
os.makedirs(os.path.join(root, "checkpoint-2"))
open(os.path.join(root, "checkpoint-2", "model.bin"), "w").write("fine")
"""

FILE_THEN_DIRECTORY = """
import os, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
open(f"{root}/best", "w").write("a root file first")
deadline = time.monotonic() + 20
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
os.remove(f"{root}/best")
os.makedirs(f"{root}/best")
open(f"{root}/best/model.bin", "w").write("then a directory of that name")
"""


def test_keys_no_retry_can_store_are_reported_at_once(agent: Agent) -> None:
    env = {**FAST, "BT_UPLOAD_DRAIN_SECONDS": "120"}
    started = time.monotonic()
    result = agent.run_job(trainer_job(agent, LONG_KEY), "--job-id", "perm001", env=env)
    assert time.monotonic() - started < 30, "retried until the drain's deadline"
    assert result.code == 4, result.text
    assert "is not saved, and not retried" in result.err and "1,024" in result.err
    committed = manifests(_store(agent.store), "default", "perm001")
    assert sorted(committed) == ["checkpoint-2"], result.text
    error = _record(_store(agent.store), "perm001")["error"]
    assert "not committed: checkpoint-1, the store refused" in error, error

    marker = agent.store / "projects/default/jobs/perm002/manifests/rank-0/..json"
    started = time.monotonic()
    job = trainer_job(agent, FILE_THEN_DIRECTORY, str(marker))
    result = agent.run_job(job, "--job-id", "perm002", env=env)
    assert time.monotonic() - started < 30, "retried until the drain's deadline"
    assert result.code == 4, result.text
    committed = manifests(_store(agent.store), "default", "perm002")
    assert [f.path for f in committed["."].files] == ["best"]
    assert "best" not in committed
    error = _record(_store(agent.store), "perm002")["error"]
    assert "not committed: best, the store refused model.bin" in error, error
