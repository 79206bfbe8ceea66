"""Typed errors, each carrying the exit code the CLI turns it into.

::

    BtAgentError                 exit 1   anything the agent cannot do
    ├── UsageError               exit 2   bad arguments or node context
    ├── SpecError                exit 2   the job spec is invalid (every problem, with field paths)
    ├── StoreError               exit 1   the store cannot be read or written
    │   └── RecordNotFoundError  exit 1   a job or record that does not exist
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
    """The store could not be read or written."""


class RecordNotFoundError(StoreError):
    """A job, node record or checkpoint that the store does not hold."""


class StagingError(BtAgentError):
    """Staging failed: the job is DEPLOY_FAILED and no start_command ran."""

    exit_code = 3


class DurabilityError(BtAgentError):
    """Some checkpoint files could not be made durable before the deadline."""

    exit_code = 4
