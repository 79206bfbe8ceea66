"""The store's layout (DESIGN.md §3): where each record, file and index entry lives.

::

    projects/<project>/jobs/<job_id>/job.json
    projects/<project>/jobs/<job_id>/nodes/rank-<N>.json
    projects/<project>/jobs/<job_id>/logs/rank-<N>.log
    projects/<project>/jobs/<job_id>/checkpoints/rank-<N>/<checkpoint>/<relpath>
    projects/<project>/jobs/<job_id>/manifests/rank-<N>/<checkpoint>.json   the commit, written last
    projects/<project>/jobs/<job_id>/claims/rank-<N>.json   the agent running that node
    jobs/<job_id>.json                                       {"project": ...}

The index (read newest first, a page at a time; see docs/store.md):

    index/format.json                                        {"version": 1}: the index is complete
    index/jobs/<job time>~<project>~<job_id>.json            every job
    projects/<project>/index/jobs/<job time>~<job_id>.json   the project's jobs
    projects/<project>/index/checkpoints/<job time>~<job_id>~rank-<N>~<time>~<checkpoint>.json
                                             one per commit, written after the manifest

A ``<time>`` is 9,999,999,999,999 minus the milliseconds since the epoch, 13 digits, so that
keys sort newest first; ``<job time>`` is the job's ``created_at``, ``<time>`` the checkpoint's.
Each index is one flat level of keys (``~`` is in no project or job id): a listing's first page
is the newest entries, without walking a directory per job on stores that keep directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from bt_agent.errors import StoreError

INDEX_FORMAT_KEY = "index/format.json"
SEP = "~"
INDEX_VERSION = 1
_LAST_MS = 9_999_999_999_999


def job_prefix(project: str, job_id: str) -> str:
    return f"projects/{project}/jobs/{job_id}"


def job_key(project: str, job_id: str) -> str:
    return f"{job_prefix(project, job_id)}/job.json"


def lookup_key(job_id: str) -> str:
    return f"jobs/{job_id}.json"


def checkpoint_prefix(project: str, job_id: str, rank: int, checkpoint: str) -> str:
    """Where a checkpoint's files are; the root checkpoint ``.`` is the rank's directory."""
    base = f"{job_prefix(project, job_id)}/checkpoints/rank-{rank}"
    return base if checkpoint == "." else f"{base}/{checkpoint}"


def checkpoint_file_key(project: str, job_id: str, rank: int, relative: str) -> str:
    """A file's key from its path relative to the checkpoint dir (``<checkpoint>/<path>``)."""
    return f"{job_prefix(project, job_id)}/checkpoints/rank-{rank}/{relative}"


def claim_key(project: str, job_id: str, rank: int) -> str:
    return f"{job_prefix(project, job_id)}/claims/rank-{rank}.json"


def manifest_key(project: str, job_id: str, rank: int, checkpoint: str) -> str:
    return f"{job_prefix(project, job_id)}/manifests/rank-{rank}/{checkpoint}.json"


# --- the index ---------------------------------------------------------------------------------


def newest_first(created_at: str) -> str:
    """A key segment for ``created_at`` (ISO 8601) that sorts the newest first."""
    try:
        moment = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        raise StoreError(f"not a time a record can hold: {created_at!r}") from None
    return f"{_LAST_MS - round(moment.timestamp() * 1000):013d}"


def jobs_index(project: str | None = None) -> str:
    """The prefix of every job's entry, or of one project's jobs."""
    return "index/jobs/" if project is None else f"projects/{project}/index/jobs/"


def job_entry_keys(project: str, job_id: str, created_at: str) -> list[str]:
    at = newest_first(created_at)
    return [
        f"{jobs_index()}{at}{SEP}{project}{SEP}{job_id}.json",
        f"{jobs_index(project)}{at}{SEP}{job_id}.json",
    ]


def commits_index(project: str) -> str:
    return f"projects/{project}/index/checkpoints/"


def commits_of_rank(project: str, job_id: str, job_created_at: str, rank: int) -> str:
    """The prefix of the entries of one node's commits."""
    at = newest_first(job_created_at)
    return f"{commits_index(project)}{at}{SEP}{job_id}{SEP}rank-{rank}{SEP}"


def commit_entry_key(
    project: str, job_id: str, job_created_at: str, rank: int, checkpoint: str, created_at: str
) -> str:
    base = commits_of_rank(project, job_id, job_created_at, rank)
    return f"{base}{newest_first(created_at)}{SEP}{checkpoint}.json"


@dataclass(frozen=True)
class JobEntry:
    project: str
    job_id: str


@dataclass(frozen=True)
class CommitEntry:
    job_id: str
    rank: int
    checkpoint: str
    at: str  # the checkpoint's <time>: smaller is newer


def parse_job_entry(key: str, project: str | None = None) -> JobEntry | None:
    """A job's entry under :func:`jobs_index` (``project``'s, or every job's); None for a key
    that is not one."""
    name = key.removeprefix(jobs_index(project))
    if "/" in name or not name.endswith(".json"):
        return None
    parts = name.removesuffix(".json").split(SEP)
    if project is None and len(parts) == 3:
        return JobEntry(parts[1], parts[2])
    if project is not None and len(parts) == 2:
        return JobEntry(project, parts[1])
    return None


def parse_commit_entry(key: str, project: str) -> tuple[str, CommitEntry] | None:
    """The ``<job time>~<job_id>`` group and the entry of a commit under
    :func:`commits_index`; None for a key that is not one."""
    name = key.removeprefix(commits_index(project))
    parts = name.split(SEP, 4)
    if "/" in name or len(parts) != 5 or not parts[4].endswith(".json"):
        return None
    try:
        rank = int(parts[2].removeprefix("rank-"))
    except ValueError:
        return None
    entry = CommitEntry(parts[1], rank, parts[4].removesuffix(".json"), parts[3])
    return f"{parts[0]}{SEP}{parts[1]}", entry
