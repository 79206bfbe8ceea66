"""The checkpoint sidecar: watch ``$BT_CHECKPOINT_DIR``, upload while training runs, commit each
checkpoint with a manifest written last, and drain within the supervisor's deadline."""

from bt_agent.sidecar.report import DrainReport
from bt_agent.sidecar.uploader import Sidecar, SidecarSettings

__all__ = ["DrainReport", "Sidecar", "SidecarSettings"]
