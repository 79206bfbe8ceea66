"""Secrets: ``SecretReference(name)`` is the content of ``<secrets-dir>/<name>``.

This is how Kubernetes mounts secrets: one file per secret, its trailing newline stripped. A
missing secret is a spec error that names the field needing it. Values leave this module only
inside a :class:`Secrets` object, whose ``repr`` never shows them, and feed the log redactor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bt_agent.errors import Problem
from bt_agent.spec.models import SecretReference, TrainingJob

MASK = "***"


@dataclass(frozen=True)
class Secrets:
    """Resolved secret values by name. Never printed: ``repr`` shows names only."""

    values: dict[str, str] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Secrets(names={sorted(self.values)})"

    def redact(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``, longest values first."""
        for value in sorted(self.values.values(), key=len, reverse=True):
            if value:
                text = text.replace(value, MASK)
        return text


def references(job: TrainingJob) -> Iterator[tuple[str, str]]:
    """Every ``(field path, secret name)`` the job refers to."""
    for key, value in job.runtime.environment_variables.items():
        if isinstance(value, SecretReference):
            yield f"runtime.environment_variables.{key}", value.name
    for i, weights in enumerate(job.weights):
        if weights.auth_secret_name:
            yield f"weights[{i}].auth_secret_name", weights.auth_secret_name
        elif weights.auth is not None and weights.auth.auth_secret_name:
            yield f"weights[{i}].auth.auth_secret_name", weights.auth.auth_secret_name


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def _read(directory: Path, field_path: str, name: str) -> tuple[str | None, Problem | None]:
    if not _valid_name(name):
        return None, Problem(
            field_path,
            f"{name!r} is not a valid secret name",
            "use a plain name such as hf_access_token",
        )
    path = directory / name
    try:
        return path.read_text(encoding="utf-8").removesuffix("\n").removesuffix("\r"), None
    except FileNotFoundError:
        hint = f"create {path} holding its value, or point --secrets-dir at the directory"
        return None, Problem(field_path, f"secret {name!r} not found in {directory}", hint)
    except (OSError, UnicodeDecodeError) as exc:
        return None, Problem(
            field_path,
            f"secret {name!r} cannot be read ({type(exc).__name__})",
            f"check that {path} is a readable UTF-8 file",
        )


def resolve(job: TrainingJob, directory: Path) -> tuple[Secrets, list[Problem]]:
    """Read every secret the job needs; return the values and one problem per missing secret."""
    values: dict[str, str] = {}
    problems: list[Problem] = []
    for field_path, name in references(job):
        value, problem = _read(directory, field_path, name)
        if problem is not None:
            problems.append(problem)
        elif value is not None:
            values[name] = value
    return Secrets(values), problems
