"""Start-up cost of the agent: ``bt-agent run`` of a job whose only command is ``true``, against
``sh -c true``, in one run (median of N runs each), with peak RSS.

    python benchmarks/startup.py [--runs 20]

The agent's run includes everything a real start does: validating the spec, resolving the
context, writing the job and node records (five fsynced writes), preparing the job's directories,
spawning the command through /bin/sh and saving the node log. ``python -c pass`` is shown as the
interpreter's own floor on this machine. The agent runs twice: from this checkout's installation,
and installed as the image installs it (a virtual environment of its own, from a wheel of the
checkout), which none of this machine's ``.pth`` files or editable-install finders reach.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import AGENT, compile_agent, peak_rss_mib, run_measured, summarize, table, write_json

TARGET_MS = 150.0


def _agent_command() -> list[str]:
    script = shutil.which("bt-agent")
    return [script] if script else [sys.executable, "-m", "bt_agent"]


def _own_venv(base: Path) -> Path:
    """The agent installed as the Dockerfile installs it, in a virtual environment under
    ``base``; without its dependencies, which a run on a file store does not import."""
    source, wheels, venv = base / "src", base / "wheels", base / "venv"
    shutil.copytree(AGENT, source / AGENT.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(AGENT.parent / name, source)
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", *wheels.glob("*.whl")], check=True
    )
    return venv / "bin"


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
        run_args = ["run", str(spec)] + [
            f"--{name}={base / name}" for name in ("node-root", "store", "secrets-dir")
        ]
        venv = _own_venv(base / "install")
        contenders = {
            "sh -c true": ["/bin/sh", "-c", "true"],
            "python -c pass": [sys.executable, "-c", "pass"],
            "bt-agent run (true)": [*_agent_command(), *run_args],
            "python -c pass, own venv": [str(venv / "python"), "-c", "pass"],
            "bt-agent run (true), own venv": [str(venv / "bt-agent"), *run_args],
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
    print()
    for row in rows[2::2]:  # the agent's rows
        verdict = "meets" if row["added_ms"] <= TARGET_MS else "MISSES"
        print(f"{row['command']}: {row['added_ms']} ms over sh -c true, {verdict} {TARGET_MS:g} ms")
    path = write_json("startup", {"rows": rows, "target_added_ms": TARGET_MS})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
