"""Secrets: ``SecretReference(name)`` is the content of ``<secrets-dir>/<name>``.

This is how Kubernetes mounts secrets: one file per secret, its trailing newline stripped. A
missing secret is a spec error that names the field needing it. Values leave this module only
inside a :class:`Secrets` object, whose ``repr`` never shows them, and feed the log redactor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bt_agent.errors import Problem
from bt_agent.spec.models import SecretReference, TrainingJob
from bt_agent.spec.urls import HIDDEN

MASK = HIDDEN  # what a URL's hidden parts are shown as too: one mask
#: Parts of a value (its lines, the strings inside a JSON value) shorter than this are not
#: masked on their own: too little of the secret to matter, and too common ("{", "true").
MIN_FRAGMENT = 8


class Redactor:
    """Replaces secret values in text with ``***``: each value whole, and, since a trainer
    prints what it holds in many shapes, each line of a multi-line value (a PEM key), each
    string inside a JSON value (a service-account key) and each line of those, every one
    also as JSON and Python write it escaped. Longest first, in one pass."""

    def __init__(self, values: Iterable[str]) -> None:
        fragments = {f for value in values if value for f in _fragments(value)}
        ordered = sorted(fragments, key=len, reverse=True)
        self.longest = len(ordered[0]) if ordered else 0
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def __call__(self, text: str) -> str:
        return self._pattern.sub(MASK, text) if self._pattern is not None else text


def _fragments(value: str) -> set[str]:
    """What of ``value`` is masked: the value itself where it is one line, its lines and
    the strings of its JSON form, each with its escaped forms."""
    parts = {value} if "\n" not in value and "\r" not in value else set()
    parts |= _lines(value)
    for text in _json_strings(value):
        parts |= {text} | _lines(text) if len(text) >= MIN_FRAGMENT else set()
    escaped = {form for part in parts for form in _escaped(part)}
    return {part for part in parts | escaped if part}


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= MIN_FRAGMENT}


def _escaped(text: str) -> set[str]:
    return {json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1], repr(text)[1:-1]}


def _json_strings(value: str) -> list[str]:
    """The strings inside ``value`` read as JSON (none when it is not JSON)."""
    if not value.lstrip().startswith(("{", "[")):
        return []
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        return []
    found: list[str] = []
    _collect(data, found)
    return found


def _collect(data: Any, found: list[str]) -> None:
    if isinstance(data, str):
        found.append(data)
    elif isinstance(data, dict):
        for item in data.values():
            _collect(item, found)
    elif isinstance(data, list):
        for item in data:
            _collect(item, found)


@dataclass(frozen=True)
class Secrets:
    """Resolved secret values by name. Never printed: ``repr`` shows names only."""

    values: dict[str, str] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Secrets(names={sorted(self.values)})"

    @cached_property
    def redact(self) -> Redactor:
        """Call it on text to have every secret value in it replaced by ``***``."""
        return Redactor(self.values.values())


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
