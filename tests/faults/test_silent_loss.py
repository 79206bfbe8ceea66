"""Checkpoints the sidecar could lose without a word: changes its signature missed, a journal
trusted against the wrong store, rotation faster than commits, a checkpoint dir recreated, and
errors no retry can mend. Every test fails on an agent that loses them, and checks the store
against what the trainer wrote, by sha256."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from conftest import Agent, trainer_job
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
