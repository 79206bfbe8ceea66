"""Hostile file names and kinds in the checkpoint dir: a newline in a name, non-UTF-8 bytes,
0-byte files, a FIFO nobody writes to, a symlink loop. Uploaded where a store can hold them,
skipped with a warning where not; never blocking, never a crash."""

from __future__ import annotations

import hashlib

from conftest import Agent, trainer_job

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
