"""Hostile file names and kinds in the checkpoint dir: a newline in a name, non-UTF-8 bytes,
0-byte files, a FIFO nobody writes to, a symlink loop. Uploaded where a store can hold them,
skipped with a warning where no store can, refused where this one cannot; never blocking, never
a crash."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path

import servers
from helpers import Agent, trainer_job

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.settings import Environ
from bt_agent.storage import open_store

MAKE = """
import os
root = os.environ["BT_CHECKPOINT_DIR"].encode()
ckpt = os.path.join(root, b"checkpoint-1")
os.makedirs(ckpt)
open(os.path.join(ckpt, b"line\\nbreak.txt"), "wb").write(b"newline")
open(os.path.join(ckpt, b"caf\\xe9-latin1.bin"), "wb").write(b"not utf-8")
open(os.path.join(ckpt, b"empty.bin"), "wb").close()
os.mkfifo(os.path.join(ckpt, b"pipe"))
os.symlink(b"loop", os.path.join(ckpt, b"loop"))
"""


def test_hostile_names_and_kinds(agent: Agent) -> None:
    result = agent.run_job(
        trainer_job(agent, MAKE),
        "--job-id",
        "host001",
        env={"BT_CHECKPOINT_QUIET_SECONDS": "0.2"},
        timeout=60,
    )
    assert result.code == 0, result.text
    assert "Traceback" not in result.err
    store = open_store(agent.store.as_uri(), Environ({}))
    (manifest,) = Catalog(store).manifests("default", "host001", 0)
    files = {f.path: f for f in manifest.files}
    assert sorted(files) == ["empty.bin", "line\nbreak.txt"]
    assert files["empty.bin"].size == 0
    prefix = checkpoint_prefix("default", "host001", 0, "checkpoint-1")
    data = store.read_bytes(f"{prefix}/line\nbreak.txt")
    assert hashlib.sha256(data).hexdigest() == files["line\nbreak.txt"].sha256
    assert "its name is not valid UTF-8" in result.err
    assert "it is a FIFO" in result.err
    assert "'checkpoint-1/loop': it cannot be read (Too many levels" in result.err


SWAP_FOR_SYMLINK = """
import os, sys
root, outside = os.environ["BT_CHECKPOINT_DIR"], sys.argv[1]
ckpt = os.path.join(root, "checkpoint-1")
os.makedirs(os.path.join(ckpt, "sub"))
open(os.path.join(ckpt, "sub", "secret.txt"), "w").write("inside")
open(os.path.join(ckpt, "model.bin"), "w").write("model")
# Before the agent looks at sub/secret.txt, sub becomes a symlink to a directory outside.
os.rename(os.path.join(ckpt, "sub"), os.path.join(ckpt, "sub.old"))
os.symlink(outside, os.path.join(ckpt, "sub"))
"""


def test_a_directory_swapped_for_a_symlink_never_leads_outside(agent: Agent) -> None:
    outside = agent.root / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("OUTSIDE-SECRET")
    result = agent.run_job(
        trainer_job(agent, SWAP_FOR_SYMLINK, str(outside)),
        "--job-id",
        "swap001",
        env={"BT_CHECKPOINT_QUIET_SECONDS": "0.3"},
    )
    assert result.code == 0, result.text
    store = open_store(agent.store.as_uri(), Environ({}))
    (manifest,) = Catalog(store).manifests("default", "swap001", 0)
    assert sorted(f.path for f in manifest.files) == ["model.bin", "sub.old/secret.txt"]
    held = b"".join(p.read_bytes() for p in agent.store.rglob("*") if p.is_file())
    assert b"OUTSIDE-SECRET" not in held, "a file outside the checkpoint dir was uploaded"
    assert "outside the dir" in result.err


def test_a_file_swapped_for_a_fifo_after_it_was_chosen_never_blocks(tmp_path: Path) -> None:
    """The file is chosen for upload (a regular file then), then replaced by a FIFO nobody
    writes to before a worker opens it: the worker must not block."""
    import io
    import threading

    from bt_agent.log import AgentLog
    from bt_agent.sidecar.files import Candidate, CheckpointDir, Skipped
    from bt_agent.sidecar.journal import Journal
    from bt_agent.sidecar.uploader import Owner, Sidecar

    root = tmp_path / "ckpt"
    (root / "checkpoint-1").mkdir(parents=True)
    path = root / "checkpoint-1" / "model.bin"
    path.write_bytes(b"weights")
    sidecar = Sidecar(
        CheckpointDir(root),
        Catalog(open_store((tmp_path / "store").as_uri(), Environ({}))),
        Owner("p", "j", 0),
        Journal(tmp_path / "journal.sqlite", "file:///store", "j", 0),
        AgentLog(io.StringIO()),
    )
    chosen = sidecar.dir.classify("checkpoint-1/model.bin")
    assert isinstance(chosen, Candidate)
    path.unlink()
    os.mkfifo(path)
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(sidecar._upload(chosen)), daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():  # unblock the stuck worker before failing
        with open(path, "wb"):
            pass
    assert outcome, "the upload worker blocked on a FIFO"
    (done,) = outcome
    assert isinstance(done.after, Skipped) and "FIFO" in done.after.reason  # type: ignore[attr-defined]
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("model.bin"))
    sidecar.journal.close()


CONTROL_NAMES = """
import os
ckpt = os.path.join(os.environ["BT_CHECKPOINT_DIR"], "checkpoint-1")
os.makedirs(ckpt)
for name in ("model.bin", "tab\\tname.bin", "line\\nbreak.txt"):
    open(os.path.join(ckpt, name), "w").write(name)
"""


def test_a_name_an_object_store_cannot_hold_ends_the_job_at_once_saying_which(
    agent: Agent, s3_server: servers.SeaweedFS
) -> None:
    """A control character in a name is what the engine of an object store cannot send: the
    file is not retried (the job would wait on it for ever), the checkpoint is not committed
    without it, and the job ends with exit 4 naming the files, quoted so that each message
    stays one line."""
    bucket = f"names{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    started = time.monotonic()
    result = agent.run_job(
        trainer_job(agent, CONTROL_NAMES),
        "--store",
        f"s3://{bucket}/store",
        env={**s3_server.client_env(), "BT_CHECKPOINT_QUIET_SECONDS": "0.2"},
        timeout=90,
    )
    assert result.code == 4, result.text
    assert time.monotonic() - started < 60, "not retried until a deadline"
    assert "'checkpoint-1/tab\\tname.bin' is not saved, and not retried" in result.err
    assert "not durable: 'checkpoint-1/line\\nbreak.txt', 'checkpoint-1/tab\\tname.bin'" in (
        result.err
    )
    assert "holds a control character" in result.err and "rename the file" in result.err
    assert not any("\t" in line or line.startswith("break.txt") for line in result.err.split("\n"))
