"""Checks the SDK does not make: directories that collide, references bt-agent cannot load.

Every directory the agent manages (checkpoint dir, load dir, scratch, working dir, the cache) and
every ``mount_location`` must be absolute, distinct and not nested in one another, or one would
silently shadow another: a ``download_folder`` inside the checkpoint dir would upload loaded
checkpoints again as new ones; a mount inside the working dir would hide the user's code.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from bt_agent.errors import Problem
from bt_agent.settings import AGENT_STATE_DIR, NODE_CACHE_CONTAINER_DIR
from bt_agent.spec.bt_uri import checkpoint_name_problem
from bt_agent.spec.models import (
    LoopsCheckpoint,
    NamedCheckpoint,
    TrainingJob,
)
from bt_agent.spec.schema import join, valid_text
from bt_agent.spec.urls import unreadable_url

SCRATCH_DIR = "/mnt/bt-scratch"
WORKING_DIR = "/b10/workspace"
RESERVED_ROOTS = ("/proc", "/sys", "/dev", "/etc", "/bin", "/sbin", "/usr", "/lib", "/lib64")
AGENT_DIRS = (AGENT_STATE_DIR, posixpath.dirname(NODE_CACHE_CONTAINER_DIR))
#: How a source is written where it is not ``<scheme>://<bucket>/path``.
_FORMS = {
    "azure": "azure://<account>/<container>/path",
    "r2": "r2://<account_id>.<bucket>/path",
    "https": "https://hostname/path",
}
#: A name a POSIX shell can ``export``, and passes on to what it runs.
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class _Dir:
    path: str  # normalised container path
    field: str  # where it comes from, for messages
    label: str


def _normal(path: str) -> str:
    return posixpath.normpath(path) if path.startswith("/") else path


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def managed_dirs(job: TrainingJob) -> list[_Dir]:
    """The directories the agent creates and owns, as container paths."""
    runtime = job.runtime
    dirs = [
        _Dir(
            _normal(runtime.checkpoint_dir),
            "runtime.checkpointing_config.checkpoint_path",
            "the checkpoint dir",
        ),
        _Dir(
            _normal(runtime.load_dir),
            "runtime.load_checkpoint_config.download_folder",
            "the loaded-checkpoint dir",
        ),
        _Dir(SCRATCH_DIR, "", "the scratch dir"),
        _Dir(WORKING_DIR, "", "the working dir"),
    ]
    if runtime.cache.enabled:
        dirs.append(
            _Dir(
                _normal(runtime.cache.mount_base_path),
                "runtime.cache_config.mount_base_path",
                "the training cache",
            )
        )
    return dirs


def _absolute_dirs(dirs: list[_Dir]) -> list[Problem]:
    return [
        Problem(
            d.field,
            f"{d.label} must be an absolute path, got {d.path!r}",
            f"write it as /{d.path.lstrip('./')}",
        )
        for d in dirs
        if d.field and not d.path.startswith("/")
    ]


def _bad_characters(job: TrainingJob) -> list[Problem]:
    paths = [(d.field, d.path) for d in managed_dirs(job) if d.field]
    paths += [(f"weights[{i}].mount_location", w.mount_location) for i, w in enumerate(job.weights)]
    return [
        Problem(field, "contains a NUL or newline character", "use a plain path")
        for field, path in paths
        if any(c in path for c in "\0\n\r")
    ]


def _environment_problems(job: TrainingJob) -> list[Problem]:
    """Names and values the operating system refuses in an environment (``=`` or NUL in a
    name, an empty name, NUL in a value), and NUL in a command: caught here, not by a
    traceback once the job has started."""
    problems = []
    base = "runtime.environment_variables"
    for name, value in job.runtime.environment_variables.items():
        field = join(base, name)
        if not name or "=" in name or "\0" in name or not valid_text(name):
            problems.append(
                Problem(
                    field,
                    "is not a valid environment variable name",
                    "use letters, digits and underscores",
                )
            )
        elif isinstance(value, str) and "\0" in value:
            problems.append(Problem(field, "contains a NUL character", "remove it"))
    problems += [
        Problem(f"runtime.start_commands[{i}]", "contains a NUL character", "remove it")
        for i, command in enumerate(job.runtime.start_commands)
        if "\0" in command
    ]
    return problems


def shell_drops(job: TrainingJob) -> list[str]:
    """Warnings for variables no shell may pass on to what it runs (``B-C``, ``my.var``): the
    system takes them, but ``start_commands`` run in ``/bin/sh``, and dash (Debian's and
    Ubuntu's) drops them before the command starts; bash keeps them."""
    base = "runtime.environment_variables"
    return [
        f"{join(base, name)}: the shell that runs start_commands may drop this name (dash, "
        "/bin/sh on Debian and Ubuntu, does) before the command starts; name it with letters, "
        "digits and underscores"
        for name in job.runtime.environment_variables
        if not SHELL_NAME.fullmatch(name)
    ]


def _forbidden(path: str) -> str | None:
    """Why a job's directory may not be at ``path`` (normalised, absolute), if it may not."""
    if path == "/" or any(_inside(path, root) for root in RESERVED_ROOTS):
        return f"{path!r} is a system directory"
    for own in AGENT_DIRS:
        if _inside(path, own) or _inside(own, path):
            return f"{path!r} overlaps the agent's own directory {own!r}"
    return None


def _forbidden_dirs(dirs: list[_Dir]) -> list[Problem]:
    problems = []
    for d in dirs:
        reason = _forbidden(d.path) if d.field else None
        if reason:
            problems.append(
                Problem(d.field, reason, f"choose a directory of its own for {d.label}")
            )
    return problems


def _overlapping_managed_dirs(dirs: list[_Dir]) -> list[Problem]:
    problems = []
    for i, first in enumerate(dirs):
        for second in dirs[i + 1 :]:
            if _inside(first.path, second.path) or _inside(second.path, first.path):
                field = second.field or first.field
                problems.append(
                    Problem(
                        field,
                        f"{second.label} {second.path!r} overlaps {first.label} {first.path!r}",
                        "choose separate directories, neither inside the other",
                    )
                )
    return problems


def _mount_problems(job: TrainingJob, dirs: list[_Dir]) -> list[Problem]:
    problems: list[Problem] = []
    seen: list[tuple[int, str]] = []
    for i, weights in enumerate(job.weights):
        field = f"weights[{i}].mount_location"
        mount = _normal(weights.mount_location)
        if not mount.startswith("/"):
            continue  # already reported by the SDK rule
        reason = _forbidden(mount)
        if reason:
            problems.append(
                Problem(
                    field, reason, "mount weights under a directory of their own, e.g. /app/models"
                )
            )
            continue
        for d in dirs:
            if _inside(mount, d.path) or _inside(d.path, mount):
                problems.append(
                    Problem(
                        field,
                        f"{mount!r} overlaps {d.label} {d.path!r}",
                        "mount weights outside the directories the agent manages",
                    )
                )
        for j, other in seen:
            relation = (
                "is the same as"
                if mount == other
                else (
                    "is inside"
                    if _inside(mount, other)
                    else "contains"
                    if _inside(other, mount)
                    else ""
                )
            )
            if relation:
                problems.append(
                    Problem(
                        field,
                        f"{mount!r} {relation} weights[{j}].mount_location {other!r}",
                        "give each source its own directory",
                    )
                )
        seen.append((i, mount))
    return problems


def _source_problems(job: TrainingJob) -> list[Problem]:
    """Sources whose URL lacks a part its store needs to be reached (the SDK takes any path),
    an Azure container, an R2 account id, or names one that no bucket can have."""
    problems: list[Problem] = []
    for i, weights in enumerate(job.weights):
        scheme, _, rest = weights.source.partition("://")
        host, _, path = rest.partition("/")
        form = _FORMS.get(scheme, f"{scheme}://<bucket>/path")
        what = None
        if scheme == "azure" and not path.partition("/")[0]:
            what = "names no container"
        elif scheme == "r2" and not all(host.partition(".")[::2]):
            what = "lacks its account id or bucket"
        elif (why := unreadable_url(weights.source)) is not None:
            what = why
        elif scheme == "hf" and (inside := _hf_path(rest)) is not None:
            repository, path = inside
            what = f"names a path inside the repository ({path!r})"
            form = f"hf://{repository} with allow_patterns ['{path}/**']"
        if what is not None:
            problems.append(_source_problem(i, weights.source, what, form))
    return problems


def _hf_path(rest: str) -> tuple[str, str] | None:
    """The repository (with its revision) and the path inside it that an ``hf://`` source
    names after ``owner/repo`` (``datasets/owner/repo``), if it names one."""
    named, at, revision = rest.partition("@")
    parts = named.strip("/").split("/")
    keep = 3 if parts[0] == "datasets" else 2
    if len(parts) <= keep:
        return None
    return "/".join(parts[:keep]) + at + revision, "/".join(parts[keep:])


def _source_problem(index: int, source: str, what: str, form: str) -> Problem:
    return Problem(f"weights[{index}].source", f"{source!r} {what}", f"write it as {form}")


def _reference_problems(job: TrainingJob) -> list[Problem]:
    problems: list[Problem] = []
    config = job.runtime.load_checkpoint_config
    if config is None:
        return problems
    named: dict[tuple[str, str], int] = {}
    for i, ref in enumerate(config.checkpoints):
        field = f"runtime.load_checkpoint_config.checkpoints[{i}]"
        if isinstance(ref, LoopsCheckpoint):
            problems.append(
                Problem(
                    f"{field}.typ",
                    "loops_checkpoint is not supported by bt-agent",
                    "use baseten_latest_checkpoint or baseten_named_checkpoint",
                )
            )
        if isinstance(ref, NamedCheckpoint):
            name = ref.checkpoint_name
            bad_name = checkpoint_name_problem(name)
            if bad_name is not None:
                problems.append(
                    Problem(
                        f"{field}.checkpoint_name",
                        bad_name,
                        "give the top-level directory name, e.g. checkpoint-20",
                    )
                )
            key = (ref.job_id, name)
            if key in named:
                problems.append(
                    Problem(
                        field,
                        f"loads the same checkpoint as checkpoints[{named[key]}]",
                        "remove one of the two",
                    )
                )
            named.setdefault(key, i)
    return problems


def _compute_problems(job: TrainingJob) -> list[Problem]:
    if job.compute.node_count >= 1:
        return []
    return [
        Problem(
            "compute.node_count",
            f"must be at least 1, got {job.compute.node_count}",
            "use 1 for a single-node job",
        )
    ]


def semantic_problems(job: TrainingJob) -> list[Problem]:
    """Everything wrong with a job that the SDK's own validation lets through."""
    dirs = managed_dirs(job)
    absolute = [d for d in dirs if d.path.startswith("/")]
    return [
        *_compute_problems(job),
        *_environment_problems(job),
        *_absolute_dirs(dirs),
        *_bad_characters(job),
        *_forbidden_dirs(absolute),
        *_overlapping_managed_dirs(absolute),
        *_mount_problems(job, absolute),
        *_source_problems(job),
        *_reference_problems(job),
    ]
