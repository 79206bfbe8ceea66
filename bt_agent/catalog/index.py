"""The catalogue's index: entries whose keys sort newest first, so that the newest jobs and
commits of a project are one listing page away, whatever the number of jobs (layout in
:mod:`bt_agent.catalog.layout`).

An entry only points: the record it names decides. A commit's entry is written after its
manifest, so an entry whose manifest is missing (a crash between a withdrawal's two deletes, or
an entry left behind) is skipped by the readers, and a manifest whose entry is missing (a crash
between a commit's two writes) is committed again, entry included, by the agent that resumes.
``index/format.json`` says the index covers every job: it is written with a store's first job,
or by ``bt-agent store reindex`` for a store written before the index.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from bt_agent.catalog.layout import (
    INDEX_FORMAT_KEY,
    INDEX_VERSION,
    SEP,
    CommitEntry,
    JobEntry,
    commit_entry_key,
    commits_index,
    commits_of_rank,
    job_entry_keys,
    jobs_index,
    manifest_key,
    parse_commit_entry,
    parse_job_entry,
)
from bt_agent.records import JobRecord, Manifest, natural_key
from bt_agent.storage import ObjectStore

T = TypeVar("T")
R = TypeVar("R")

#: Requests in flight at once when the catalogue reads or writes many records.
IN_FLIGHT = 32


def concurrently(call: Callable[[T], R], items: Iterable[T], workers: int = IN_FLIGHT) -> list[R]:
    """``call`` on every item, at most ``workers`` at once; the results in the items' order."""
    chosen = list(items)
    if len(chosen) <= 1:
        return [call(item) for item in chosen]
    # imported where it is used: it imports logging, which starting a job never needs
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(workers, len(chosen)), thread_name_prefix="bt-catalog") as pool:
        return list(pool.map(call, chosen))


def encode(data: Any) -> bytes:
    return json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"


class Index:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._complete = False

    # --- the format marker -------------------------------------------------------------------

    def complete(self) -> bool:
        """Whether the index covers every job of the store (asked once, then remembered)."""
        if not self._complete:
            self._complete = self.store.exists(INDEX_FORMAT_KEY)
        return self._complete

    def mark_complete(self) -> None:
        self.store.write_bytes(INDEX_FORMAT_KEY, encode({"version": INDEX_VERSION}))
        self._complete = True

    def started_with(self, job_id: str) -> None:
        """Mark a store whose first job is ``job_id`` as indexed from the start; a store that
        already holds other jobs stays unmarked until it is reindexed."""
        if self.complete():
            return
        first = next(self.store.list_pages("jobs/"), [])
        if all(info.key == f"jobs/{job_id}.json" for info in first):
            self.mark_complete()

    # --- writes ------------------------------------------------------------------------------

    def add_job(self, record: JobRecord) -> None:
        body = encode(
            {"project": record.project, "job_id": record.job_id, "created_at": record.created_at}
        )
        for key in job_entry_keys(record.project, record.job_id, record.created_at):
            self.store.write_bytes(key, body)

    def add_commit(self, manifest: Manifest, job_created_at: str) -> None:
        m = manifest
        key = commit_entry_key(
            m.project, m.job_id, job_created_at, m.node_rank, m.checkpoint, m.created_at
        )
        body = {
            "manifest": manifest_key(m.project, m.job_id, m.node_rank, m.checkpoint),
            "created_at": m.created_at,
        }
        self.store.write_bytes(key, encode(body))

    def remove_commit(
        self, project: str, job_id: str, job_created_at: str, rank: int, checkpoint: str
    ) -> None:
        prefix = commits_of_rank(project, job_id, job_created_at, rank)
        for info in self.store.list(prefix):
            at, _, name = info.key.removeprefix(prefix).partition(SEP)
            if name == f"{checkpoint}.json" and at.isdigit():
                self.store.delete(info.key)

    # --- reads, newest first -----------------------------------------------------------------

    def jobs(self, project: str | None) -> Iterator[JobEntry]:
        """The jobs of ``project`` or of the whole store, newest first, listed as they are
        taken."""
        seen: set[JobEntry] = set()
        for page in self.store.list_pages(jobs_index(project)):
            for info in page:
                entry = parse_job_entry(info.key, project)
                if entry is not None and entry not in seen:
                    seen.add(entry)
                    yield entry

    def commits(self, project: str) -> Iterator[tuple[str, list[CommitEntry]]]:
        """Each job of ``project`` that committed a checkpoint, newest job first, with the
        entries of its commits (every node's, newest first within a node)."""
        group: str | None = None
        entries: list[CommitEntry] = []
        for page in self.store.list_pages(commits_index(project)):
            for info in page:
                parsed = parse_commit_entry(info.key, project)
                if parsed is None:
                    continue
                name, entry = parsed
                if name != group and entries:
                    yield entries[0].job_id, entries
                    entries = []
                group = name
                entries.append(entry)
        if entries:
            yield entries[0].job_id, entries


def newest(entries: list[CommitEntry]) -> list[CommitEntry]:
    """``entries`` best first by the rule for "latest" (DESIGN.md §3): the greatest
    ``created_at``, ties to the name that sorts last in natural order."""
    by_name = sorted(entries, key=lambda e: natural_key(e.checkpoint), reverse=True)
    return sorted(by_name, key=lambda e: e.at)
