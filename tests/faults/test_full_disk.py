"""Full disks (small tmpfs mounts; mounting needs root, as CI has).

The node cache too small for the weights: DEPLOY_FAILED with a clear error, no cache entry,
nothing mounted. The checkpoint dir's file system running full while a trainer saves into
place: the cut-short checkpoint is never committed, the earlier and later ones are, and the
agent says why in its log and in the node record."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from helpers import Agent, small_tmpfs, trainer_job

from bt_agent.catalog import Catalog
from bt_agent.settings import Environ
from bt_agent.storage import open_store

MiB = 1024 * 1024
TRAINER = """
import os, sys, time
root = os.environ["BT_CHECKPOINT_DIR"]
MiB = 1024 * 1024

def save(name, size):
    os.makedirs(os.path.join(root, name), exist_ok=True)
    with open(os.path.join(root, name, "model.bin"), "wb") as f:  # in place, as torch.save does
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))

save("checkpoint-1", 3 * MiB)
deadline = time.monotonic() + 30  # the disk fills once checkpoint-1 is committed, however slow
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
try:
    save("checkpoint-2", 20 * MiB)
except OSError as exc:
    print(f"checkpoint-2 failed: {exc.strerror}", flush=True)
time.sleep(1.5)
if sys.argv[1] == "crash":
    sys.exit(1)
# "recover": make room, save the next checkpoint, and exit 0 without a word about step 2
import shutil
shutil.rmtree(os.path.join(root, "checkpoint-1"))
save("checkpoint-3", 1 * MiB)
time.sleep(1.5)
"""


def test_a_node_cache_too_small_is_deploy_failed_with_nothing_partial(
    agent: Agent, own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    client = own_s3.client()
    client.put_object(Bucket="store", Key="model/big.bin", Body=bytes(3 * MiB))
    client.put_object(Bucket="store", Key="model/small.bin", Body=b"s")
    ran = agent.root / "ran"
    job = {
        "image": {"base_image": "x"},
        "weights": [{"source": "s3://store/model", "mount_location": "/app/model"}],
        "runtime": {"start_commands": [f"touch {ran}"]},
    }
    with small_tmpfs(tmp_path / "small-disk", "2m") as disk:
        env = {**own_s3.client_env(), "BT_NODE_CACHE_DIR": str(disk / "cache")}
        result = agent.run_job(job, env=env)
        cache = disk / "cache"
        entries = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert result.code == 3, result.text
    assert "not enough disk space in the node cache" in result.err
    assert not ran.exists() and not (agent.node_root / "app" / "model").exists()
    assert entries == [], "no partial or corrupt cache entry"


@pytest.fixture
def full_dir(agent: Agent) -> Iterator[Path]:
    (agent.node_root / "mnt").mkdir(parents=True)
    with small_tmpfs(agent.node_root / "mnt" / "ckpts", "10m") as mount:
        yield mount


@pytest.mark.parametrize(
    ("mode", "code", "committed"),
    [
        ("crash", 1, ["checkpoint-1"]),  # the trainer dies of the full disk
        ("recover", 4, ["checkpoint-1", "checkpoint-3"]),  # it exits 0, a torn checkpoint left
    ],
)
def test_a_checkpoint_cut_short_by_a_full_disk_is_never_committed(
    agent: Agent, full_dir: Path, mode: str, code: int, committed: list[str]
) -> None:
    job_id = f"full{mode[:3]}"
    manifest = agent.store / f"projects/default/jobs/{job_id}/manifests/rank-0/checkpoint-1.json"
    result = agent.run_job(
        trainer_job(agent, TRAINER, f"{mode} {manifest}"),
        "--job-id",
        job_id,
        env={"BT_CHECKPOINT_QUIET_SECONDS": "0.3"},
    )
    assert result.code == code, result.text
    assert "checkpoint-2 failed: No space left on device" in result.out
    assert (full_dir / "checkpoint-2" / "model.bin").stat().st_size < 20 * MiB, "it is torn"
    assert "is full" in result.err, result.err
    assert "not committing checkpoint-2: it was being written while" in result.err, result.err

    store = open_store(agent.store.as_uri(), Environ({}))
    manifests = Catalog(store).manifests("default", job_id, 0)
    assert sorted(m.checkpoint for m in manifests) == committed
    for manifest in manifests:
        assert [(f.path, f.size) for f in manifest.files] == [
            ("model.bin", (3 if manifest.checkpoint == "checkpoint-1" else 1) * MiB)
        ]
    record = json.loads(store.read_bytes(f"projects/default/jobs/{job_id}/nodes/rank-0.json"))
    assert (
        "not committed: checkpoint-2, it was being written while the checkpoint dir's file "
        "system was full" in record["error"]
    ), record["error"]
