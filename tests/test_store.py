"""The file store and the catalogue of job records."""

from __future__ import annotations

from pathlib import Path

import pytest

from bt_agent.catalog import Catalog
from bt_agent.errors import NotFoundError, UnsafeKeyError, UsageError
from bt_agent.records import JobRecord, JobStatus, NodeRecord, aggregate_status
from bt_agent.storage import FileStore, open_store


def test_write_read_list(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    assert store.write_bytes("a/b/c.json", b"{}")
    store.write_bytes("a/b/d.json", b"12")
    store.write_bytes("a/x.json", b"1")
    assert store.read_bytes("a/b/d.json") == b"12"
    assert [(o.key, o.size) for o in store.list("a/b/")] == [("a/b/c.json", 2), ("a/b/d.json", 2)]
    assert [o.key for o in store.list("a/")] == ["a/b/c.json", "a/b/d.json", "a/x.json"]
    assert list(store.list("missing/")) == []


def test_if_absent_keeps_the_first(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    assert store.write_bytes("k", b"first", if_absent=True)
    assert not store.write_bytes("k", b"second", if_absent=True)
    assert store.read_bytes("k") == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["k"], "no temporary file left behind"


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../x", "a/\0b", ""])
def test_keys_that_escape_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(UnsafeKeyError, match="escape"):
        FileStore(tmp_path / "s").write_bytes(key, b"x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("key", ["a//b", "a/./b", "a/"])
def test_keys_no_file_path_keeps_are_refused_saying_why(tmp_path: Path, key: str) -> None:
    with pytest.raises(UnsafeKeyError, match=r"an empty or '\.' segment"):
        FileStore(tmp_path / "s").write_bytes(key, b"x")
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("*"))


def test_missing_object(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        FileStore(tmp_path).read_bytes("nope")


def test_open_store_schemes(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path.as_uri()), FileStore)
    with pytest.raises(UsageError):
        open_store("ftp://host/x")


def test_two_nodes_share_one_job_record(tmp_path: Path) -> None:
    catalog = Catalog(FileStore(tmp_path))
    first = catalog.create_job(JobRecord("j1", "p", "n", "2026-01-01T00:00:00Z", 2, {}))
    second = catalog.create_job(JobRecord("j1", "p", "n", "2026-01-01T00:00:09Z", 2, {}))
    assert second == first
    for rank in (0, 1):
        node = NodeRecord("j1", "p", rank)
        node.transition(JobStatus.RUNNING)
        catalog.write_node(node)
    view = catalog.view("j1")
    assert [n.node_rank for n in view.nodes] == [0, 1]
    assert view.status is JobStatus.RUNNING


def test_aggregate_status() -> None:
    job = JobRecord("j", "p", None, "t", 2, {})

    def node(rank: int, status: JobStatus) -> NodeRecord:
        record = NodeRecord("j", "p", rank)
        record.transition(status)
        return record

    done = JobStatus.COMPLETED
    assert aggregate_status(job, [node(0, done)]) is JobStatus.RUNNING, "one node still to come"
    assert aggregate_status(job, [node(0, done), node(1, done)]) is done
    assert aggregate_status(job, [node(0, done), node(1, JobStatus.FAILED)]) is JobStatus.FAILED
    assert (
        aggregate_status(job, [node(0, JobStatus.STOPPED), node(1, JobStatus.RUNNING)])
        is JobStatus.STOPPED
    )
