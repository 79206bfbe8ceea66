"""The catalogue's index: the newest jobs and commits of a workspace in a few requests, written
after each manifest, rebuilt by `bt-agent store reindex` for a store written before it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import servers
from fault_proxy import FaultProxy
from helpers import Agent
from sidecar_checks import FAST, WRITER, ckpt_job, indexed_checkpoints

from bt_agent.catalog import Catalog
from bt_agent.catalog.index import concurrently
from bt_agent.catalog.layout import commits_index, manifest_key, parse_commit_entry
from bt_agent.errors import TransientStoreError
from bt_agent.records import JobRecord, Manifest, ManifestFile
from bt_agent.settings import Environ
from bt_agent.storage import FileStore, ObjectStore, open_store

START = datetime(2026, 3, 1, tzinfo=timezone.utc)


def _at(seconds: float) -> str:
    return (START + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def _job(catalog: Catalog, index: int, project: str = "ws", nodes: int = 1) -> JobRecord:
    record = JobRecord(f"job{index:05d}", project, None, _at(index * 60), nodes, {})
    return catalog.create_job(record)


def _commit(catalog: Catalog, record: JobRecord, name: str, second: float, rank: int = 0) -> None:
    catalog.write_manifest(
        Manifest(
            record.job_id,
            record.project,
            rank,
            name,
            _at(second),
            _at(second + 1),
            [ManifestFile("model.bin", 1, "0" * 64)],
        )
    )


def _workspace(catalog: Catalog, jobs: int, project: str = "ws", first: int = 0) -> None:
    """``jobs`` jobs a minute apart (numbered from ``first``), each with checkpoint-1 and
    checkpoint-2 (the second written last); the first job alone, so that a new store starts
    indexed."""

    def one(index: int) -> None:
        record = _job(catalog, index, project)
        _commit(catalog, record, "checkpoint-1", index * 60 + 10)
        _commit(catalog, record, "checkpoint-2", index * 60 + 20)

    one(first)
    concurrently(one, range(first + 1, first + jobs), workers=16)


@pytest.fixture
def proxied(own_s3: servers.SeaweedFS) -> Iterator[tuple[ObjectStore, FaultProxy]]:
    """The test's S3 store reached through a proxy that counts requests."""
    proxy = FaultProxy(own_s3.port)
    env = {**own_s3.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        with open_store("s3://store/ws", Environ(env)) as store:
            yield store, proxy
    finally:
        proxy.close()


def test_latest_of_a_busy_project_takes_three_requests(
    proxied: tuple[ObjectStore, FaultProxy],
) -> None:
    store, proxy = proxied
    _workspace(Catalog(store), 300)
    _workspace(Catalog(store), 3, "other", first=1000)  # another project's newer jobs
    catalog = Catalog(store)
    before = proxy.requests
    latest = catalog.latest("ws", rank=0)
    assert proxy.requests - before <= 3
    assert latest is not None and (latest.job_id, latest.checkpoint) == ("job00299", "checkpoint-2")
    resumed = catalog.latest("ws", rank=0, but="job00299")  # the current job is never a source
    assert resumed is not None and (resumed.job_id, resumed.checkpoint) == (
        "job00298",
        "checkpoint-2",
    )
    before = proxy.requests
    page = catalog.jobs("ws", limit=50)
    assert [v.job.job_id for v in page] == [f"job{i:05d}" for i in range(299, 249, -1)]
    assert proxy.requests - before <= 2 + 50 * 2, "one page of the index, then each job"


def test_latest_follows_the_rules_of_the_manifests(tmp_path: Path) -> None:
    """The newest job with a commit on this node's rank; in it, the greatest created_at, ties
    to the name that sorts last naturally; an entry whose manifest is gone is skipped."""
    catalog = Catalog(FileStore(tmp_path))
    old = _job(catalog, 1)
    _commit(catalog, old, "checkpoint-5", 100)
    new = _job(catalog, 2, nodes=2)
    _commit(catalog, new, "checkpoint-9", 200)
    _commit(catalog, new, "checkpoint-10", 200)  # same time: the later name wins
    _commit(catalog, new, "checkpoint-3", 150)
    _job(catalog, 3)  # newest, nothing committed
    latest = catalog.latest("ws", rank=0)
    assert latest is not None and latest.checkpoint == "checkpoint-10"
    (tmp_path / manifest_key("ws", new.job_id, 0, "checkpoint-10")).unlink()
    latest = catalog.latest("ws", rank=0)
    assert latest is not None and latest.checkpoint == "checkpoint-9"
    # Rank 1 of a 2-node job loads rank 1's, which the newest job lacks; the older job had
    # one node, so rank 1 loads its rank 0's.
    latest = catalog.latest("ws", rank=1)
    assert latest is not None and (latest.job_id, latest.node_rank) == (old.job_id, 0)
    _commit(catalog, new, "checkpoint-9", 200, rank=1)
    latest = catalog.latest("ws", rank=1)
    assert latest is not None and (latest.job_id, latest.node_rank) == (new.job_id, 1)


class FailingIndex(FileStore):
    """A file store whose next write to the index fails as a store outage would (what a
    SIGKILL between the manifest and its entry leaves is the same: a manifest, no entry)."""

    failures = 1

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        if "/index/checkpoints/" in key and self.failures:
            self.failures -= 1
            raise TransientStoreError(f"{key}: injected outage")
        return super()._put(key, data, if_absent)


def test_a_commit_is_done_only_once_its_entry_is_written(tmp_path: Path) -> None:
    store = FailingIndex(tmp_path)
    store.policy = store.policy.__class__(attempts=1)
    catalog = Catalog(store)
    record = _job(catalog, 1)
    with pytest.raises(TransientStoreError):
        _commit(catalog, record, "checkpoint-1", 100)
    assert (tmp_path / manifest_key("ws", record.job_id, 0, "checkpoint-1")).exists()
    assert indexed_checkpoints(store, "ws", record.job_id) == []
    _commit(catalog, record, "checkpoint-1", 100)  # the sidecar commits it again
    assert indexed_checkpoints(store, "ws", record.job_id) == ["checkpoint-1"]
    latest = catalog.latest("ws", rank=0)
    assert latest is not None and latest.checkpoint == "checkpoint-1"


def test_a_withdrawn_commit_leaves_the_index(tmp_path: Path) -> None:
    catalog = Catalog(FileStore(tmp_path))
    record = _job(catalog, 1)
    _commit(catalog, record, "checkpoint-1", 100)
    _commit(catalog, record, "checkpoint-2", 200)
    catalog.delete_manifest("ws", record.job_id, 0, "checkpoint-2")
    assert indexed_checkpoints(catalog.store, "ws", record.job_id) == ["checkpoint-1"]
    _commit(catalog, record, "checkpoint-2", 300)  # written again, committed again, newer
    assert indexed_checkpoints(catalog.store, "ws", record.job_id) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    latest = catalog.latest("ws", rank=0)
    assert latest is not None and latest.created_at == _at(300)


def test_each_commit_of_a_job_is_indexed_once_after_its_manifest(agent: Agent) -> None:
    ledger = agent.root / "ledger.json"
    writer = f"{WRITER} {ledger} --style hf --steps 3 --size 200000"
    result = agent.run_job(ckpt_job(writer), "--job-id", "idx001", env=FAST)
    assert result.code == 0, result.text
    store = FileStore(agent.store)
    committed = sorted(m.checkpoint for m in Catalog(store).manifests("default", "idx001"))
    assert committed == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert indexed_checkpoints(store, "default", "idx001") == committed
    for info in store.list(commits_index("default")):
        parsed = parse_commit_entry(info.key, "default")
        assert parsed is not None, info.key
        name = parsed[1].checkpoint
        manifest = agent.store / manifest_key("default", "idx001", 0, name)
        entry = agent.store / info.key
        assert entry.stat().st_mtime_ns >= manifest.stat().st_mtime_ns, f"{name}: entry first"


def test_two_jobs_committing_at_once(agent: Agent) -> None:
    """Two jobs of one project commit at the same time on one store: each commit indexed
    once; a third job resumes from the latest of the job created last."""
    env = {**FAST}
    runs = []
    for job_id in ("two001", "two002"):
        ledger = agent.root / f"{job_id}.json"
        writer = f"{WRITER} {ledger} --style shards --steps 3 --files 2 --size 100000"
        node = agent.root / f"node-{job_id}"
        args = ("--job-id", job_id, "--node-root", str(node))
        runs.append(agent.start(ckpt_job(writer), *args, env=env))
    for process in runs:
        assert process.wait(120) == 0, agent.output()
    store = FileStore(agent.store)
    catalog = Catalog(store)
    for job_id in ("two001", "two002"):
        committed = sorted(m.checkpoint for m in catalog.manifests("default", job_id))
        assert committed == ["checkpoint-1", "checkpoint-2", "checkpoint-3"], job_id
        assert indexed_checkpoints(store, "default", job_id) == committed, job_id
    created = {job_id: catalog.job("default", job_id).created_at for job_id in ("two001", "two002")}
    newer = max(created, key=lambda job_id: created[job_id])
    latest = catalog.latest("default", rank=0, but="two003")
    assert latest is not None and latest.job_id == newer


def _cli_json(agent: Agent, *args: str) -> tuple[list[dict[str, object]], str]:
    result = agent(*args, "--store", str(agent.store), "-o", "json")
    assert result.code == 0, result.text
    rows: list[dict[str, object]] = json.loads(result.out)
    return rows, result.err


def test_reindex_restores_the_index_of_an_older_store(agent: Agent) -> None:
    store = FileStore(agent.store)
    _workspace(Catalog(store), 6)
    _workspace(Catalog(store), 2, "other", first=1000)
    indexed = sorted(info.key for info in store.list() if "index/" in info.key)
    for info in store.list():
        if "index/" in info.key:
            store.delete(info.key)  # as a store written by an agent before the index
    rows, warning = _cli_json(agent, "jobs", "list", "--project", "ws")
    assert len(rows) == 6, "a store without an index still answers"
    assert "bt-agent store reindex" in warning
    result = agent("store", "reindex", "--store", str(agent.store))
    assert result.code == 0, result.text
    assert "indexed 8 jobs and 16 committed checkpoints" in result.out
    assert sorted(info.key for info in store.list() if "index/" in info.key) == indexed
    again = agent("store", "reindex", "--store", str(agent.store))
    assert again.code == 0 and "indexed 8 jobs" in again.out, again.text
    assert sorted(info.key for info in store.list() if "index/" in info.key) == indexed
    rows, warning = _cli_json(agent, "jobs", "list", "--project", "ws")
    assert [r["job_id"] for r in rows] == [f"job{i:05d}" for i in range(5, -1, -1)]
    assert warning == ""


def test_an_empty_store_lists_nothing_without_a_warning(agent: Agent) -> None:
    """A store no job has used yet has no index either, but nothing to read job by job: it is
    not one "written before bt-agent kept one", and nothing is said of reindexing it."""
    agent.store.mkdir(parents=True, exist_ok=True)
    for command in (("jobs", "list"), ("checkpoints", "list", "--project", "p")):
        rows, warning = _cli_json(agent, *command)
        assert rows == [] and "reindex" not in warning, warning


def test_a_store_directory_that_does_not_exist_is_said(agent: Agent) -> None:
    """A file store whose directory is not there (a typo in --store, or no job ran with it
    yet) lists nothing, and says so, naming where the URL came from."""
    assert not agent.store.exists()
    rows, warning = _cli_json(agent, "jobs", "list")
    said = f"warning: {agent.store.as_uri()} does not exist: no job has used this store; check"
    assert rows == [] and said in warning and "--store" in warning, warning
    agent.store.mkdir(parents=True)
    assert _cli_json(agent, "jobs", "list") == ([], "")


def test_listings_show_the_newest_page(agent: Agent) -> None:
    _workspace(Catalog(FileStore(agent.store)), 8)
    rows, note = _cli_json(agent, "jobs", "list", "--limit", "3")
    assert [r["job_id"] for r in rows] == ["job00007", "job00006", "job00005"]
    assert "the newest 3 jobs; --limit N or --all for more" in note
    rows, note = _cli_json(agent, "jobs", "list", "--all")
    assert len(rows) == 8 and note == ""
    rows, note = _cli_json(agent, "checkpoints", "list", "--project", "ws", "--limit", "4")
    assert [(r["job_id"], r["checkpoint"]) for r in rows] == [
        ("job00007", "checkpoint-2"),
        ("job00007", "checkpoint-1"),
        ("job00006", "checkpoint-2"),
        ("job00006", "checkpoint-1"),
    ]
    assert "the newest 4 checkpoints" in note
    rows, _ = _cli_json(agent, "checkpoints", "list", "--all")
    assert len(rows) == 16
    refused = agent("jobs", "list", "--limit", "0", "--store", str(agent.store))
    assert refused.code == 2 and "--limit 0" in refused.err, refused.text
