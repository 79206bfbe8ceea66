"""What the sidecar tests check a store against: a writer's ledger (what it wrote, by sha256)
and the committed manifests."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from helpers import BIN

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.catalog.layout import commits_index, parse_commit_entry
from bt_agent.records import Manifest
from bt_agent.storage import ObjectStore

FAST = {"BT_CHECKPOINT_QUIET_SECONDS": "0.3"}
WRITER = f"{sys.executable} {BIN / 'write_checkpoints.py'}"


def ckpt_job(command: str, **runtime: Any) -> dict[str, Any]:
    return {
        "image": {"base_image": "x"},
        "runtime": {
            "start_commands": [command],
            "checkpointing_config": {"enabled": True},
            **runtime,
        },
    }


def manifests(store: ObjectStore, project: str, job_id: str, rank: int = 0) -> dict[str, Manifest]:
    return {m.checkpoint: m for m in Catalog(store).manifests(project, job_id, rank)}


def assert_store_holds(
    store: ObjectStore,
    ledger: dict[str, dict[str, str]],
    job_id: str,
    project: str = "default",
    rank: int = 0,
) -> dict[str, Manifest]:
    """Every checkpoint the writer wrote is committed, its manifest names exactly the files
    written with their sha256, and every object in the store hashes to that sha256."""
    committed = manifests(store, project, job_id, rank)
    assert sorted(committed) == sorted(ledger), (sorted(committed), sorted(ledger))
    for name, files in ledger.items():
        manifest = committed[name]
        assert {f.path: f.sha256 for f in manifest.files} == files, name
        prefix = checkpoint_prefix(project, job_id, rank, name)
        for entry in manifest.files:
            data = store.read_bytes(f"{prefix}/{entry.path}")
            assert len(data) == entry.size
            assert hashlib.sha256(data).hexdigest() == entry.sha256, f"{name}/{entry.path}"
    return committed


def indexed_checkpoints(store: ObjectStore, project: str, job_id: str, rank: int = 0) -> list[str]:
    """The checkpoints of one node that have an entry in the catalogue's index, one name per
    entry (a checkpoint indexed twice shows twice)."""
    found = []
    for info in store.list(commits_index(project)):
        parsed = parse_commit_entry(info.key, project)
        if parsed is not None and (parsed[1].job_id, parsed[1].rank) == (job_id, rank):
            found.append(parsed[1].checkpoint)
    return sorted(found)
