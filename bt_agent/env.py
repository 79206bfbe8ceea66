"""The child environment: what start_commands see (DESIGN.md §4, REFERENCE.md §2).

Precedence, lowest first: the agent's own environment (less the agent's private inputs), the
torchrun defaults (``PET_*``) and ``HF_HOME``, the user's ``environment_variables``, and last the
platform's ``BT_*`` variables, which a user cannot override.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bt_agent.context import NodeContext, project_id
from bt_agent.secrets import MASK, Secrets
from bt_agent.settings import (
    CONFIG_PYTHON_VARIABLE,
    CONTEXT_VARIABLES,
    SPEC_VARIABLE,
    TRAINING_CACHES_CONTAINER_DIR,
)
from bt_agent.spec.checks import SCRATCH_DIR, SHELL_NAME, WORKING_DIR
from bt_agent.spec.models import SecretReference, TrainingJob

MASTER_PORT = 29500
#: Signals torchrun passes on to its workers: all that the agent forwards.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
#: Seconds of the grace period kept back from torchrun's own worker shutdown timeout, so that
#: torchrun is done before the agent's SIGKILL and the agent's shutdown steps still fit.
TORCHRUN_SHUTDOWN_MARGIN = 3
UNBUFFERED = "PYTHONUNBUFFERED"
#: Inputs of the agent itself that the platform would not show the user's commands.
PRIVATE_INPUTS = frozenset(
    {
        SPEC_VARIABLE,
        CONFIG_PYTHON_VARIABLE,
        CONTEXT_VARIABLES["store"],
        CONTEXT_VARIABLES["node_root"],
        CONTEXT_VARIABLES["secrets_dir"],
        CONTEXT_VARIABLES["grace_period"],
    }
)


@dataclass(frozen=True)
class JobDirs:
    """The host paths of every directory the agent manages for a job on this node."""

    working: Path
    scratch: Path
    checkpoints: Path
    loaded_checkpoints: Path
    rw_cache: Path
    project_cache: Path
    team_cache: Path
    hf_home: Path | None

    @classmethod
    def for_job(cls, job: TrainingJob, context: NodeContext) -> JobDirs:
        host = context.layout.host
        cache = job.runtime.cache
        rw_cache, team_base = _cache_bases(cache.mount_base_path, context)
        hf_home = None
        if cache.enabled:
            legacy = cache.enable_legacy_hf_mount
            hf_home = rw_cache / ("huggingface" if legacy else "user_artifacts/huggingface")
        return cls(
            working=host(WORKING_DIR),
            scratch=host(SCRATCH_DIR),
            checkpoints=host(job.runtime.checkpoint_dir),
            loaded_checkpoints=host(job.runtime.load_dir),
            rw_cache=rw_cache,
            project_cache=rw_cache / "user_artifacts",
            team_cache=team_base / "team_artifacts",
            hf_home=hf_home,
        )

    def all(self) -> list[Path]:
        paths = [
            self.working,
            self.scratch,
            self.checkpoints,
            self.loaded_checkpoints,
            self.rw_cache,
            self.project_cache,
            self.team_cache,
        ]
        return paths + ([self.hf_home] if self.hf_home is not None else [])


def _cache_bases(base: str, context: NodeContext) -> tuple[Path, Path]:
    """The host paths of the training cache's base for the project, and for its team.

    In a container both are ``base`` itself: the platform mounts the project's and the team's
    volumes there. Under a node root the agent keeps them apart as the platform would: each
    project's cache under ``/var/cache/bt-agent/projects/<project_id>``, each team's under
    ``/var/cache/bt-agent/teams/<team_id>``, so one project never sees another's files.
    """
    layout = context.layout
    if layout.node_root is None:
        return layout.host(base), layout.host(base)
    project = layout.host(f"{TRAINING_CACHES_CONTAINER_DIR}/projects/{context.project_id}/{base}")
    team = layout.host(f"{TRAINING_CACHES_CONTAINER_DIR}/teams/{project_id(context.team)}/{base}")
    return project, team


@dataclass(frozen=True)
class ChildEnvironment:
    """The full environment for start_commands, and which of its keys the agent set."""

    values: dict[str, str]
    exported: tuple[str, ...]  # keys the agent sets (not inherited), in a stable order
    secret_keys: frozenset[str]

    def export_lines(self) -> list[str]:
        """``export K=V`` lines for the keys the agent sets, secret values masked. A name no
        shell can export (``B-C``, one with a space) is shown in a comment, so that the lines
        stay what a shell can run."""
        return [self._export_line(key) for key in self.exported]

    def _export_line(self, key: str) -> str:
        value = MASK if key in self.secret_keys else self.values[key]
        if SHELL_NAME.fullmatch(key):
            return f"export {key}={shlex.quote(value)}"
        return (
            f"# {json.dumps(key)}={json.dumps(value)}: the commands get it, but no shell can "
            "export this name"
        )


def platform_variables(job: TrainingJob, context: NodeContext, dirs: JobDirs) -> dict[str, str]:
    """The 16 ``BT_*`` variables of REFERENCE.md §2 (plus the older ``BT_CHECKPOINTING_DIR``)."""
    return {
        "BT_TRAINING_JOB_ID": context.job_id,
        "BT_TRAINING_PROJECT_ID": context.project_id,
        "BT_TRAINING_JOB_NAME": job.name or context.job_id,
        "BT_TRAINING_PROJECT_NAME": context.project,
        "BT_NUM_GPUS": str(context.num_gpus),
        "BT_WORKING_DIR": str(dirs.working),
        "BT_SCRATCH_DIR": str(dirs.scratch),
        "BT_CHECKPOINT_DIR": str(dirs.checkpoints),
        "BT_CHECKPOINTING_DIR": str(dirs.checkpoints),
        "BT_LOAD_CHECKPOINT_DIR": str(dirs.loaded_checkpoints),
        "BT_PROJECT_CACHE_DIR": str(dirs.project_cache),
        "BT_TEAM_CACHE_DIR": str(dirs.team_cache),
        "BT_RW_CACHE_DIR": str(dirs.rw_cache),
        "BT_RETRY_COUNT": str(context.retry_count),
        "BT_GROUP_SIZE": str(context.group_size),
        "BT_LEADER_ADDR": context.leader_addr,
        "BT_NODE_RANK": str(context.node_rank),
    }


def torchrun_shutdown_timeout(grace_period: float) -> int:
    """torchrun's SIGTERM-to-SIGKILL wait for its workers, inside the agent's grace period."""
    return max(1, int(grace_period) - TORCHRUN_SHUTDOWN_MARGIN)


def launcher_defaults(context: NodeContext, dirs: JobDirs) -> dict[str, str]:
    """torchrun's ``PET_*`` inputs, so a bare ``torchrun train.py`` is right on every node."""
    values = {
        "PET_NNODES": str(context.group_size),
        "PET_NODE_RANK": str(context.node_rank),
        "PET_NPROC_PER_NODE": str(max(context.num_gpus, 1)),
        "PET_MASTER_ADDR": context.leader_addr,
        "PET_MASTER_PORT": str(MASTER_PORT),
        "PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS,
        "PET_SHUTDOWN_TIMEOUT": str(torchrun_shutdown_timeout(context.grace_period)),
    }
    if dirs.hf_home is not None:
        values["HF_HOME"] = str(dirs.hf_home)
    return values


def output_defaults(inherited: Mapping[str, str]) -> dict[str, str]:
    """``PYTHONUNBUFFERED=1`` unless the container sets it: the commands write into a pipe,
    where Python holds a ``print`` back until 8 KiB have gathered (a training loop's lines for
    an hour, or until it ends), as ``docker run`` without ``-t`` does."""
    return {} if UNBUFFERED in inherited else {UNBUFFERED: "1"}


def build(
    job: TrainingJob, context: NodeContext, secrets: Secrets, inherited: Mapping[str, str]
) -> ChildEnvironment:
    dirs = JobDirs.for_job(job, context)
    user: dict[str, str] = {}
    secret_keys = set()
    for key, value in job.runtime.environment_variables.items():
        if isinstance(value, SecretReference):
            user[key] = secrets.values.get(value.name, "")
            secret_keys.add(key)
        else:
            user[key] = value
    layers = [
        output_defaults(inherited),
        launcher_defaults(context, dirs),
        user,
        platform_variables(job, context, dirs),
    ]
    exported: dict[str, str] = {}
    for layer in layers:
        exported.update(layer)
    values = {k: v for k, v in inherited.items() if k not in PRIVATE_INPUTS}
    values.update(exported)
    return ChildEnvironment(values, tuple(exported), frozenset(secret_keys))
