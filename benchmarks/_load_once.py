"""One load of a committed checkpoint for benchmarks/resume.py, as a resumed job's agent makes it
before its first command, timed inside the process (after imports; the seeding of the engine's
TLS random generator started before them and few malloc arenas kept, as ``bt-agent
run`` does both). Usage:
_load_once.py STORE_URL PROJECT JOB_ID CHECKPOINT TARGET -> prints seconds and peak RSS."""

from __future__ import annotations

from bt_agent.memory import keep_few_arenas
from bt_agent.storage.tls_seed import seed_in_background

keep_few_arenas()
seed_in_background()

# ruff: noqa: E402  (the imports below load while the seeding goes on, as in the agent)

import json
import sys
import time
from pathlib import Path

from _common import vm_hwm_mib

from bt_agent.catalog import Catalog
from bt_agent.settings import Environ
from bt_agent.staging.checkpoints import download_checkpoint, find_manifest
from bt_agent.storage import open_store


def main() -> None:
    url, project, job_id, checkpoint, target = sys.argv[1:6]
    with open_store(url, Environ.current()) as store:
        catalog = Catalog(store)
        started = time.perf_counter()
        manifest = find_manifest(catalog, job_id, checkpoint)
        assert manifest.project == project, manifest.project
        download_checkpoint(catalog, manifest, Path(target))
        seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_rss_mib": vm_hwm_mib()}))


if __name__ == "__main__":
    main()
