"""The bt-agent side of benchmarks/transfer.py, run as its own process so that its CPU time can
be measured like a peer's. Usage: _ours.py upload DIR URL | download URL DIR

Ends by printing its peak RSS (``VmHWM``, the new program's own after ``exec``) on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from _common import vm_hwm_mib

from bt_agent.memory import keep_few_arenas, return_large_buffers
from bt_agent.storage import open_store
from bt_agent.storage.transfer import download_tree, upload_tree

PEAK_RSS = "peak RSS MiB:"


def main() -> None:
    action = sys.argv[1]
    if action == "upload":
        return_large_buffers()  # as the agent's uploads run: in its sidecar, with its allocator
        upload_tree(open_store(sys.argv[3]), Path(sys.argv[2]))
    else:
        keep_few_arenas()  # as the agent's downloads run: staging, with its allocator
        download_tree(open_store(sys.argv[2]), "", Path(sys.argv[3]))
    print(f"{PEAK_RSS} {vm_hwm_mib()}", file=sys.stderr)


if __name__ == "__main__":
    main()
