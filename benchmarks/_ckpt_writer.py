"""The start command of benchmarks/checkpoint_upload.py: copy a prepared checkpoint into
$BT_CHECKPOINT_DIR/<name>/ as a trainer would write it, note when the last file was closed, then
wait for the benchmark's go-ahead (so that the job is still running while the sidecar uploads).

    _ckpt_writer.py SOURCE_DIR NAME RESULT_JSON GO_FILE
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path


def main() -> None:
    source, name, result, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    target = Path(os.environ["BT_CHECKPOINT_DIR"]) / name
    target.mkdir(parents=True)
    started = time.time()
    for path in sorted(source.iterdir()):
        shutil.copyfile(path, target / path.name)
    result.write_text(json.dumps({"first_write": started, "last_close": time.time()}))
    while not go.exists():
        time.sleep(0.05)


if __name__ == "__main__":
    main()
