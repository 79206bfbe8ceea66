"""The bt-agent side of benchmarks/transfer.py, run as its own process so that its CPU time can
be measured like a peer's. Usage: _ours.py upload DIR URL | download URL DIR"""

from __future__ import annotations

import sys
from pathlib import Path

from bt_agent.storage import open_store
from bt_agent.storage.transfer import download_tree, upload_tree


def main() -> None:
    action = sys.argv[1]
    if action == "upload":
        upload_tree(open_store(sys.argv[3]), Path(sys.argv[2]))
    else:
        download_tree(open_store(sys.argv[2]), "", Path(sys.argv[3]))


if __name__ == "__main__":
    main()
