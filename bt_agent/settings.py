"""The one place that reads the process environment.

Everything else receives an :class:`Environ` (a plain mapping) so that tests pass their own and no
module reads ``os.environ`` behind the caller's back.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Node-context inputs and the environment variable that provides each (DESIGN.md §1).
CONTEXT_VARIABLES = {
    "job_id": "BT_TRAINING_JOB_ID",
    "project": "BT_TRAINING_PROJECT_NAME",
    "node_rank": "BT_NODE_RANK",
    "group_size": "BT_GROUP_SIZE",
    "leader_addr": "BT_LEADER_ADDR",
    "num_gpus": "BT_NUM_GPUS",
    "store": "BT_STORE_URL",
    "node_root": "BT_NODE_ROOT",
    "secrets_dir": "BT_SECRETS_DIR",
    "grace_period": "BT_GRACE_PERIOD_SECONDS",
}
#: The agent's own directories (container paths): its journal, its node cache. No path of a
#: job may be one of them, inside one or hold one.
AGENT_STATE_DIR = "/var/lib/bt-agent"
NODE_CACHE_CONTAINER_DIR = "/var/cache/bt-agent/node"
#: Under a node root: each project's and each team's training cache (BT_PROJECT_CACHE_DIR...).
TRAINING_CACHES_CONTAINER_DIR = "/var/cache/bt-agent"
SPEC_VARIABLE = "BT_JOB_SPEC"
CONFIG_PYTHON_VARIABLE = "BT_CONFIG_PYTHON"
RETRY_COUNT_VARIABLE = "BT_RETRY_COUNT"
NODE_CACHE_DIR_VARIABLE = "BT_NODE_CACHE_DIR"
NODE_CACHE_MAX_BYTES_VARIABLE = "BT_NODE_CACHE_MAX_BYTES"
CLUSTER_CACHE_DIR_VARIABLE = "BT_CLUSTER_CACHE_DIR"
#: A size: a number and, as Kubernetes writes quantities, a unit (``G``: 1000^3, ``Gi``: 1024^3).
_SIZE = re.compile(r"(\d+)(?:\.(\d+))?\s*(?:([KMGTP])(i?))?B?", re.IGNORECASE)
#: How long staging waits out an unreachable store (seconds).
STORE_OUTAGE_VARIABLE = "BT_STORE_OUTAGE_SECONDS"
DEFAULT_OUTAGE_SECONDS = 300.0
#: The checkpoint sidecar's tunables (seconds, counts); see bt_agent.sidecar.SidecarSettings.
METRICS_PORT_VARIABLE = "BT_METRICS_PORT"
CHECKPOINT_QUIET_VARIABLE = "BT_CHECKPOINT_QUIET_SECONDS"
UPLOAD_WORKERS_VARIABLE = "BT_UPLOAD_WORKERS"
DRAIN_TIMEOUT_VARIABLE = "BT_UPLOAD_DRAIN_SECONDS"
WATCH_POLLING_VARIABLE = "BT_WATCH_POLLING"


@dataclass(frozen=True)
class Environ:
    """A snapshot of the environment the agent was started with."""

    values: Mapping[str, str]

    @classmethod
    def current(cls) -> Environ:
        return cls(dict(os.environ))

    def get(self, name: str) -> str | None:
        value = self.values.get(name)
        return value if value not in (None, "") else None

    def number(self, name: str, default: float) -> float:
        """A numeric setting; ``default`` when unset or not a number."""
        value = self.get(name)
        try:
            return float(value) if value is not None else default
        except ValueError:
            return default

    def context_value(self, field: str) -> str | None:
        return self.get(CONTEXT_VARIABLES[field])

    @property
    def default_store_url(self) -> str:
        home = Path(self.values.get("HOME") or Path.home())
        data = Path(self.values.get("XDG_DATA_HOME") or home / ".local" / "share")
        return (data / "bt-agent" / "store").as_uri()


def parse_size(text: str) -> int:
    """The bytes that ``text`` says: a whole number of bytes, or a number and a unit as
    Kubernetes writes quantities (``500G`` is 500 x 1000^3 bytes, ``465Gi`` 465 x 1024^3; any
    case, and a final ``B``, are taken too). A :class:`ValueError` saying how to write one
    where it is none."""
    found = _SIZE.fullmatch(text.strip())
    if found is None:
        raise ValueError(
            f"{text!r} is not a size; write bytes (500000000000) or a number and a unit "
            "(500G, 465Gi)"
        )
    whole, fraction, unit, binary = found.groups()
    scale: int = (1024 if binary else 1000) ** ("KMGTP".index(unit.upper()) + 1 if unit else 0)
    parts = int(fraction) * scale // 10 ** len(fraction) if fraction else 0
    return int(whole) * scale + parts
