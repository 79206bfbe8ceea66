"""The node context: what the platform knows about this node, and where container paths live.

Inputs come from flags, else their ``BT_*`` environment variables, else defaults (DESIGN.md §1).
With a node root ``R`` every absolute container path ``P`` becomes ``R/P`` (DESIGN.md §2).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import secrets as random
import string
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from bt_agent import gpus
from bt_agent.errors import Problem, UsageError
from bt_agent.settings import (
    CHECKPOINT_QUIET_VARIABLE,
    CONTEXT_VARIABLES,
    DRAIN_TIMEOUT_VARIABLE,
    NODE_CACHE_MAX_BYTES_VARIABLE,
    RETRY_COUNT_VARIABLE,
    STORE_OUTAGE_VARIABLE,
    UPLOAD_WORKERS_VARIABLE,
    Environ,
    parse_size,
)
from bt_agent.spec.urls import unreadable_url

DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_SECRETS_DIR = "/secrets"
#: Where a store can live (DESIGN.md §3). ``s3://`` honours AWS_ENDPOINT_URL, ``gs://``
#: STORAGE_EMULATOR_HOST.
STORE_SCHEMES = ("file", "s3", "r2", "cw", "gs", "azure")
#: Tunables that the modules using them read from the environment, checked here first (one
#: that is no number was taken as unset, without a word): each variable, and whether it counts
#: (a whole number, at least 1) rather than seconds (a number, at least 0).
TUNABLES = (
    (STORE_OUTAGE_VARIABLE, False),
    (CHECKPOINT_QUIET_VARIABLE, False),
    (DRAIN_TIMEOUT_VARIABLE, False),
    (UPLOAD_WORKERS_VARIABLE, True),
)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
#: How job ids and project names are written (they name the store's directories).
STORE_NAME_RULE = "letters, digits, '.', '_' and '-' (128 at most)"


def is_store_name(value: str) -> bool:
    """Whether ``value`` can be a job id or a project name (it names a store directory)."""
    return bool(_SAFE_NAME.match(value))


_ID_ALPHABET = string.ascii_lowercase + string.digits


#: The team of a project whose spec names none.
DEFAULT_TEAM = "default"


def new_job_id() -> str:
    """A fresh 7-character id, as the platform's (``gvpql31``)."""
    return "".join(random.choice(_ID_ALPHABET) for _ in range(7))


def project_id(project: str) -> str:
    """A stable 7-character id for a project name."""
    digest = int.from_bytes(hashlib.sha256(project.encode()).digest()[:8], "big")
    chars = []
    for _ in range(7):
        digest, index = divmod(digest, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[index])
    return "".join(chars)


@dataclass(frozen=True)
class Layout:
    """Maps container paths to host paths: as they are in a container, else under ``node_root``."""

    node_root: Path | None = None

    def host(self, container_path: str) -> Path:
        normal = posixpath.normpath("/" + container_path.lstrip("/"))
        if self.node_root is None:
            return Path(normal)
        return self.node_root / normal.lstrip("/")


@dataclass(frozen=True)
class ContextInputs:
    """Raw node-context values as given on the command line (``None`` = not given)."""

    job_id: str | None = None
    project: str | None = None
    node_rank: str | None = None
    group_size: str | None = None
    leader_addr: str | None = None
    num_gpus: str | None = None
    store: str | None = None
    node_root: str | None = None
    secrets_dir: str | None = None
    grace_period: str | None = None


@dataclass(frozen=True)
class NodeContext:
    job_id: str
    project: str
    node_rank: int
    group_size: int
    leader_addr: str
    num_gpus: int
    store_url: str
    layout: Layout
    secrets_dir: Path
    grace_period: float
    retry_count: int = 0
    warnings: tuple[str, ...] = field(default=())
    team: str = DEFAULT_TEAM  # the project's team_name; its caches are shared by the team
    cache_budget: int | None = None  # bytes the node cache is pruned to after staging

    @property
    def project_id(self) -> str:
        return project_id(self.project)


class _Resolver:
    """Collects every problem with the inputs before failing, like the spec validator."""

    def __init__(self, inputs: ContextInputs, environ: Environ) -> None:
        self.inputs = inputs
        self.environ = environ
        self.problems: list[Problem] = []

    def raw(self, name: str) -> tuple[str | None, str]:
        value = getattr(self.inputs, name)
        if value is not None:
            return value, "--" + name.replace("_", "-")
        return self.environ.context_value(name), CONTEXT_VARIABLES[name]

    def integer(self, name: str, default: int, minimum: int) -> int:
        value, where = self.raw(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            number = minimum - 1
        if number < minimum:
            self.problems.append(
                Problem(
                    where,
                    f"expected an integer >= {minimum}, got {value!r}",
                    f"set {where} to a whole number",
                )
            )
            return default
        return number

    def name(self, name: str, default: str) -> str:
        value, where = self.raw(name)
        if value is None:
            return default
        if not is_store_name(value):
            self.problems.append(
                Problem(where, f"{value!r} cannot name a store directory", f"use {STORE_NAME_RULE}")
            )
        return value

    def seconds(self, name: str, default: float) -> float:
        value, where = self.raw(name)
        if value is None:
            return default
        seconds = _seconds(value)
        if not seconds:  # none, or 0: a grace period or a wait must last
            self.problems.append(
                Problem(
                    where,
                    f"expected a positive number of seconds, got {value!r}",
                    f"set {where} to e.g. 30",
                )
            )
            return default
        return seconds


def resolve(
    inputs: ContextInputs,
    environ: Environ,
    node_count: int,
    gpu_request: int,
    config_project: str | None,
    config_team: str | None = None,
    needs_leader: bool = True,
) -> NodeContext:
    """The node context for a job; raises :class:`UsageError` listing every bad input.
    ``needs_leader=False`` (a spec being validated, not run) lets a job of several nodes go
    without the leader's address."""
    r = _Resolver(inputs, environ)
    group_size = r.integer("group_size", node_count, 1)
    node_rank = r.integer("node_rank", 0, 0)
    if node_rank >= group_size:
        r.problems.append(
            Problem(
                "--node-rank",
                f"node rank {node_rank} is outside a group of {group_size} node(s)",
                f"use a rank from 0 to {group_size - 1}",
            )
        )
    leader, _where = r.raw("leader_addr")
    if leader is None and group_size > 1 and needs_leader:
        r.problems.append(
            Problem(
                "--leader-addr",
                f"a {group_size}-node job needs the leader's address",
                "set --leader-addr or BT_LEADER_ADDR on every node",
            )
        )
    root_value, root_where = r.raw("node_root")
    layout = Layout(Path(root_value).absolute() if root_value else None)
    if layout.node_root is not None and (problem := _unmakeable(layout.node_root)):
        r.problems.append(Problem(root_where, problem, "give a directory this agent can write"))
    secrets_value, _ = r.raw("secrets_dir")
    store, store_where = r.raw("store")
    store_url = _store_url(store, environ, r.problems, store_where)
    given_gpus = r.integer("num_gpus", -1, 0)
    num_gpus = given_gpus if given_gpus >= 0 else gpus.detect(environ)
    context = NodeContext(
        job_id=r.name("job_id", "") or new_job_id(),
        project=r.name("project", config_project or "default"),
        node_rank=node_rank,
        group_size=group_size,
        leader_addr=leader or "127.0.0.1",
        num_gpus=num_gpus,
        store_url=store_url,
        layout=layout,
        secrets_dir=Path(secrets_value) if secrets_value else layout.host(DEFAULT_SECRETS_DIR),
        grace_period=r.seconds("grace_period", DEFAULT_GRACE_SECONDS),
        retry_count=_retry_count(environ),
        warnings=_warnings(group_size, node_count, num_gpus, gpu_request),
        team=config_team or DEFAULT_TEAM,
        cache_budget=_cache_budget(environ, r.problems),
    )
    r.problems += _tunable_problems(environ)
    if r.problems:
        raise UsageError("invalid node context:\n" + "\n".join(f"  - {p}" for p in r.problems))
    return context


def _store_url(value: str | None, environ: Environ, problems: list[Problem], where: str) -> str:
    url, problem = store_url(value, environ, where)
    problems.extend([problem] if problem else [])
    return url


#: The forms of a store's URL, as a fix for one that is not one of them.
STORE_FORMS = (
    "use file:///path (or a directory), s3://bucket/prefix, r2://account.bucket/prefix, "
    "cw://bucket/prefix, gs://bucket/prefix or azure://account/container/prefix"
)


def store_url(value: str | None, environ: Environ, where: str) -> tuple[str, Problem | None]:
    """The store's URL that ``value`` (given at ``where``: a flag or a variable) names, a
    directory's as a ``file://`` URL, None the default store; and what is wrong with it, if
    anything: another scheme, no bucket, a slash missing after the scheme, or a ``file://`` URL
    that names a host."""
    if value is None:
        return environ.default_store_url, None
    scheme, colon, rest = value.partition(":")
    if "://" not in value:
        if colon and scheme in STORE_SCHEMES:  # s3:/bucket, s3:bucket: not a directory's name
            fixed = f"{scheme}://{'/' * (scheme == 'file')}{rest.lstrip('/')}"
            return value, Problem(where, f"the store URL {value!r} lacks a slash", f"write {fixed}")
        return Path(value).absolute().as_uri(), None
    parsed = urlparse(value)
    if parsed.scheme not in STORE_SCHEMES:
        return value, Problem(where, f"unsupported store URL {value!r}", STORE_FORMS)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        problem = f"the store URL {value!r} names a host ({parsed.netloc!r}), not a directory"
        hint = f"write an absolute path after file:// (file:///{parsed.netloc}{parsed.path})"
        return value, Problem(where, problem, hint)
    if parsed.scheme != "file" and not parsed.netloc:
        return value, Problem(where, f"the store URL {value!r} names no bucket", STORE_FORMS)
    if (why := unreadable_url(value)) is not None:
        return value, Problem(where, f"the store URL {value!r} {why}", STORE_FORMS)
    return value, None


def _cache_budget(environ: Environ, problems: list[Problem]) -> int | None:
    """``BT_NODE_CACHE_MAX_BYTES``, where it is set (a size that is none is a problem)."""
    value = environ.get(NODE_CACHE_MAX_BYTES_VARIABLE)
    if not value:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        problems.append(Problem(NODE_CACHE_MAX_BYTES_VARIABLE, str(exc)))
        return None


def _unmakeable(directory: Path) -> str | None:
    """Why ``directory`` cannot be had, without making it: the nearest of it and its parents
    that is there is not a directory, or (where it must be made) cannot be written in."""
    there = directory
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        return f"{directory} cannot be made: {there} is not a directory"
    if there != directory and not os.access(there, os.W_OK | os.X_OK):
        return f"{directory} cannot be made: {there} is not writable"
    return None


def _tunable_problems(environ: Environ) -> list[Problem]:
    """What is wrong with the :data:`TUNABLES` that are set."""
    found = []
    for variable, counts in TUNABLES:
        value = environ.get(variable)
        if value is None:
            continue
        if counts and not (value.strip().isdigit() and int(value) >= 1):
            found.append(Problem(variable, f"expected a whole number, at least 1, got {value!r}"))
        elif not counts and _seconds(value) is None:
            said = f"expected a number of seconds, at least 0, got {value!r}"
            found.append(Problem(variable, said, f"set it to e.g. {DEFAULT_GRACE_SECONDS:.0f}"))
    return found


def _seconds(value: str) -> float | None:
    """``value`` as a number of seconds (finite, not below 0), else None."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def _retry_count(environ: Environ) -> int:
    value = environ.get(RETRY_COUNT_VARIABLE) or "0"
    return int(value) if value.isdigit() else 0


def _warnings(group_size: int, node_count: int, num_gpus: int, requested: int) -> tuple[str, ...]:
    found = []
    if group_size != node_count:
        found.append(f"group size {group_size} differs from compute.node_count {node_count}")
    if requested and num_gpus != requested:
        found.append(f"{num_gpus} GPU(s) visible but compute.accelerator asks for {requested}")
    return tuple(found)
