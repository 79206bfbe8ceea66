"""Start-up cost of the agent: ``bt-agent run`` of a job whose only command is ``true``, against
``sh -c true``, in one run (median of N runs each), with peak RSS.

    python benchmarks/startup.py [--runs 20]

The agent's run includes everything a real start does: validating the spec, resolving the
context, writing the job and node records (five fsynced writes), preparing the job's directories,
spawning the command through /bin/sh and saving the node log. ``python -c pass`` is shown as the
interpreter's own floor on this machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _common import compile_agent, peak_rss_mib, run_measured, summarize, table, write_json

TARGET_MS = 150.0


def _agent_command() -> list[str]:
    script = shutil.which("bt-agent")
    return [script] if script else [sys.executable, "-m", "bt_agent"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    compile_agent()
    with tempfile.TemporaryDirectory(prefix="bt-startup-") as tmp:
        base = Path(tmp)
        spec_dir = base / "spec"
        spec_dir.mkdir()
        spec = spec_dir / "job.json"
        job = {"image": {"base_image": "x"}, "runtime": {"start_commands": ["true"]}}
        spec.write_text(json.dumps({"training_job": job}))
        agent = [
            *_agent_command(),
            "run",
            str(spec),
            "--node-root",
            str(base / "node"),
            "--store",
            str(base / "store"),
            "--secrets-dir",
            str(base / "secrets"),
        ]
        contenders = {
            "sh -c true": ["/bin/sh", "-c", "true"],
            "python -c pass": [sys.executable, "-c", "pass"],
            "bt-agent run (true)": agent,
        }
        for argv in contenders.values():  # warm the page cache and .pyc files
            run_measured(argv)
        results = {}
        for _ in range(args.runs):  # interleaved, so drift hits every contender alike
            for name, argv in contenders.items():
                sample = run_measured(argv)
                if sample.returncode != 0:
                    raise SystemExit(f"{name} exited {sample.returncode}")
                results.setdefault(name, []).append(sample)
        rows = [
            {"command": name, **summarize(samples), "peak_rss_mib": peak_rss_mib(argv)}
            for (name, samples), argv in zip(results.items(), contenders.values(), strict=False)
        ]
    baseline = rows[0]["median_ms"]
    for row in rows:
        row["added_ms"] = round(row["median_ms"] - baseline, 1)
    print(table(rows, ["command", "runs", "median_ms", "p90_ms", "added_ms", "peak_rss_mib"]))
    added = rows[-1]["added_ms"]
    verdict = "meets" if added <= TARGET_MS else "MISSES"
    print(f"\nbt-agent adds {added} ms over sh -c true: {verdict} the {TARGET_MS:g} ms target")
    path = write_json("startup", {"rows": rows, "target_added_ms": TARGET_MS})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
