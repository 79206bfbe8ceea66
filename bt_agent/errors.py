"""Typed errors, each carrying the exit code the CLI turns it into.

::

    BtAgentError                 exit 1   anything the agent cannot do
    ├── UsageError               exit 2   bad arguments or node context
    ├── SpecError                exit 2   the job spec is invalid (every problem, with field paths)
    ├── StoreError               exit 1   a store or source cannot be read or written
    │   ├── NotFoundError                 no object there (also a FileNotFoundError)
    │   │   └── RecordNotFoundError       a job or record that does not exist
    │   ├── AccessDeniedError             wrong or missing credentials (also a PermissionError)
    │   ├── TransientStoreError           worth retrying: timeouts, 5xx, connection resets
    │   ├── IntegrityError                content differs from its size or checksum
    │   │   └── ChangedError              the object is no longer the version listed
    │   └── KeyRefusedError               no retry can store an object under this key
    │       ├── UnsafeKeyError            a key that would escape its destination, or too long
    │       └── KeyConflictError          another object is in the way (``a`` and ``a/b``)
    ├── StagingError             exit 3   DEPLOY_FAILED: weights or checkpoints could not be staged
    └── DurabilityError          exit 4   checkpoint files not durable before the deadline

Only ``bt_agent.cli`` turns these into ``sys.exit``; every other layer raises.
Messages never contain secret values: callers pass names, never contents.
"""

from __future__ import annotations

from dataclasses import dataclass


class BtAgentError(Exception):
    """Base of every error the agent reports to a user."""

    exit_code: int = 1


def described(exc: BaseException) -> str:
    """``exc`` in words: its own where it is one of the agent's errors or the system's (they
    say what failed), else with its type before them (``RuntimeError: ...``): an error no rule
    of the agent's reads, whose words alone may not say what it is."""
    if isinstance(exc, BtAgentError | OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class UsageError(BtAgentError):
    """Invalid command-line arguments or node context."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text}; {self.hint}" if self.hint else text

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message, "hint": self.hint}


class SpecError(BtAgentError):
    """The spec is invalid. Carries every problem found, not only the first."""

    exit_code = 2

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        count = len(self.problems)
        head = f"invalid job spec {source}".rstrip() + f" ({count} problem{'s' * (count != 1)})"
        super().__init__("\n".join([head + ":", *(f"  - {p}" for p in self.problems)]))


class StoreError(BtAgentError):
    """A store or source could not be read or written. ``uri`` names the object."""

    def __init__(self, message: str, uri: str = "") -> None:
        super().__init__(message)
        self.uri = uri


class NotFoundError(StoreError, FileNotFoundError):
    """No object at that key, or no such bucket, repository or revision."""


class RecordNotFoundError(NotFoundError):
    """A job, node record or checkpoint that the store does not hold."""


class AccessDeniedError(StoreError, PermissionError):
    """The credentials were refused, or are missing."""


class TransientStoreError(StoreError):
    """A failure worth retrying: a timeout, a 5xx, a dropped connection."""


class IntegrityError(StoreError):
    """What arrived differs from the size or checksum it should have."""


class ChangedError(IntegrityError):
    """The object was replaced after it was listed: its version (ETag, generation) is not the
    one the listing pinned. Retrying cannot help; listing again can."""


class KeyRefusedError(StoreError):
    """The store can never hold an object under this key: retrying cannot help."""


class UnsafeKeyError(KeyRefusedError):
    """An object key that would escape its destination (``..``, absolute, NUL), or that is
    longer than stores accept."""


class KeyConflictError(KeyRefusedError):
    """Another object is in the way: on a file system, ``a`` and ``a/b`` cannot both exist."""


class StagingError(BtAgentError):
    """Staging failed: the job is DEPLOY_FAILED and no start_command ran."""

    exit_code = 3


class StoreUnusableError(BtAgentError):
    """The store could not be used before any command ran (the node's claim, the job's
    record): no record there can say why, so the exit code is a failed deploy's, never one a
    command could have exited with."""

    exit_code = 3


class DurabilityError(BtAgentError):
    """Some checkpoint files could not be made durable before the deadline."""

    exit_code = 4
