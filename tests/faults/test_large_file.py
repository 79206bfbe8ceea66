"""A checkpoint file over S3's 5 GiB single-PUT limit (a sparse file, so the test needs little
disk of its own), through the sidecar to SeaweedFS: uploaded in parts within the part-count
limit, committed with the right size and sha256, and readable back at both ends."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import servers
from helpers import Agent, trainer_job

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.settings import Environ
from bt_agent.storage import open_store

GiB = 1024**3
SIZE = 5 * GiB + 512 * 1024**2  # past the 5 GiB limit of a single PUT
HEAD, TAIL = b"first bytes of a large checkpoint", b"last bytes of a large checkpoint"
WRITER = f"""
with open(__import__("os").environ["BT_CHECKPOINT_DIR"] + "/checkpoint-1/model.bin", "wb") as f:
    f.truncate({SIZE})
    f.write({HEAD!r})
    f.seek({SIZE - len(TAIL)})
    f.write({TAIL!r})
"""


def _sha256_of_the_sparse_file() -> str:
    digest = hashlib.sha256(HEAD)
    zeros = memoryview(bytes(64 * 1024**2))
    left = SIZE - len(HEAD) - len(TAIL)
    while left:
        step = min(left, len(zeros))
        digest.update(zeros[:step])
        left -= step
    digest.update(TAIL)
    return digest.hexdigest()


def test_a_sparse_file_over_5_gib_is_uploaded_in_parts_and_committed(
    agent: Agent, own_s3: servers.SeaweedFS
) -> None:
    if shutil.disk_usage(agent.root).free < SIZE + 2 * GiB:
        pytest.fail(f"needs {(SIZE + 2 * GiB) / GiB:.1f} GiB free for the store's copy")
    job = trainer_job(agent, WRITER, before='mkdir -p "$BT_CHECKPOINT_DIR/checkpoint-1"')
    url = "s3://store/bt"
    result = agent.run_job(job, "--job-id", "large01", "--store", url, timeout=600)
    assert result.code == 0, result.text

    store = open_store(url, Environ.current())
    (manifest,) = Catalog(store).manifests("default", "large01", 0)
    (entry,) = manifest.files
    assert (entry.path, entry.size) == ("model.bin", SIZE)
    assert entry.sha256 == _sha256_of_the_sparse_file()
    key = f"bt/{checkpoint_prefix('default', 'large01', 0, 'checkpoint-1')}/model.bin"
    head = own_s3.client().head_object(Bucket="store", Key=key)
    assert head["ContentLength"] == SIZE
    parts = int(head["ETag"].strip('"').rsplit("-", 1)[1])
    assert 1 < parts <= 10_000, f"{parts} parts"
    client = own_s3.client()
    first = client.get_object(Bucket="store", Key=key, Range=f"bytes=0-{len(HEAD) - 1}")
    last = client.get_object(Bucket="store", Key=key, Range=f"bytes={SIZE - len(TAIL)}-")
    assert first["Body"].read() == HEAD and last["Body"].read() == TAIL
