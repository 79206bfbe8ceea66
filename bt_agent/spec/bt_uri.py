"""``bt://`` references to training checkpoints, as a ``weights[].source`` or in a serving
checkpoint list (our extension: the platform's documents name the scheme without its form, and
the SDK's ``WeightsSource`` refuses it)::

    bt://<job_id>/<checkpoint>[?rank=N]    a committed checkpoint by name
    bt://<job_id>/latest[?rank=N]          the job's latest committed checkpoint

``rank`` picks a node's shard of a multinode job (rank 0 by default). ``latest`` always means the
latest committed checkpoint, never one named ``latest``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

SCHEME = "bt://"
LATEST = "latest"
FORM = "bt://<job_id>/<checkpoint>[?rank=N] or bt://<job_id>/latest"


class BadCheckpointURI(ValueError):
    """A ``bt://`` reference that cannot be read: what is wrong, and how to write it."""

    def __init__(self, problem: str, hint: str = f"write it as {FORM}") -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True)
class CheckpointURI:
    job_id: str
    checkpoint: str | None  # None: the job's latest committed checkpoint
    rank: int = 0

    def __str__(self) -> str:
        rank = f"?rank={self.rank}" if self.rank else ""
        return f"{SCHEME}{self.job_id}/{self.checkpoint or LATEST}{rank}"


def checkpoint_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a checkpoint's name (a top-level directory of the checkpoint
    dir), or None."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        return f"{name!r} is not a checkpoint name"
    return None


def parse_checkpoint_uri(value: str) -> CheckpointURI:
    """The reference ``value`` names; :class:`BadCheckpointURI` says what is wrong with it."""
    if not value.startswith(SCHEME):
        raise BadCheckpointURI(f"{value!r} is not a bt:// reference")
    parts = urlsplit(value)
    if parts.fragment:
        raise BadCheckpointURI(f"{value!r} has a #fragment", "remove it")
    job_id, checkpoint = parts.netloc, parts.path.removeprefix("/")
    if not job_id or not checkpoint:
        raise BadCheckpointURI(f"{value!r} names no job and checkpoint")
    problem = checkpoint_name_problem(checkpoint)
    if problem is not None:
        raise BadCheckpointURI(
            f"{value!r}: {problem}",
            "give the checkpoint's top-level directory name (e.g. checkpoint-20) or latest",
        )
    rank = _rank(value, parts.query)
    return CheckpointURI(job_id, None if checkpoint == LATEST else checkpoint, rank)


def _rank(value: str, query: str) -> int:
    bad_rank = BadCheckpointURI(
        f"{value!r}: rank must be one node rank (0, 1, ...)", "write ?rank=1, for example"
    )
    try:
        fields = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise bad_rank from None
    unknown = sorted(set(fields) - {"rank"})
    if unknown:
        raise BadCheckpointURI(
            f"{value!r}: unknown parameter {unknown[0]!r}", "the only parameter is ?rank=N"
        )
    ranks = fields.get("rank", ["0"])
    if len(ranks) != 1 or not ranks[0].isascii() or not ranks[0].isdigit():
        raise bad_rank
    return int(ranks[0])
