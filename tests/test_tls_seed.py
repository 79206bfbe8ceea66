"""The engine's TLS random generator seeded while the agent starts: through a connection to a
socket of the agent's own, which the engine opens with a real TLS message and nothing else
sees; started by the commands that stage, only where a store of the engine's is named."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bt_agent.cli import main as cli
from bt_agent.storage import tls_seed


def _seed_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bt-tls-seed")]


def test_the_engine_writes_its_first_tls_message_to_our_socket_and_the_seeding_ends() -> None:
    assert tls_seed.seed() is True
    deadline = time.monotonic() + tls_seed.WAIT_SECONDS
    while _seed_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _seed_threads() == [], "the engine's request outlived the socket it was sent to"


def test_a_program_that_ends_at_once_waits_for_no_more_than_the_seeding_itself(
    tmp_path: Path,
) -> None:
    """An interpreter ending while a thread is inside the engine may abort; the seeding's is
    waited for, and it ends with its connection, long before its timeout."""
    probe = (
        "from bt_agent.storage.tls_seed import seed_in_background\n"
        "seed_in_background()\n"
        "import time; time.sleep(0.02)\n"  # the engine's thread started, the seeding under way
    )
    for _ in range(3):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (0, "")
        assert time.monotonic() - started < tls_seed.WAIT_SECONDS


def test_the_seeding_goes_direct_whatever_proxy_the_environment_names() -> None:
    """In a process of its own, with a proxy on 127.0.0.2: the variables are that process's
    only, and no client of another test, still trying a server's old port on 127.0.0.1, can
    reach the proxy and be taken for the seeding."""
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.2", 0))
        proxy.listen(1)
        proxy.settimeout(0.5)
        url = f"http://127.0.0.2:{proxy.getsockname()[1]}"
        environment = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
        environment.update(
            dict.fromkeys(("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "ALL_PROXY"), url)
        )
        probe = "from bt_agent.storage.tls_seed import seed; print(seed())"
        done = subprocess.run(
            [sys.executable, "-c", probe], env=environment, capture_output=True, text=True
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")
        with pytest.raises(TimeoutError):
            connection, _ = proxy.accept()  # the proxy was never asked for anything
            with connection:
                connection.settimeout(1)
                pytest.fail(f"the seeding went through the proxy: {connection.recv(200)!r}")


def test_without_the_engine_the_seeding_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # what an image without it imports
    assert tls_seed.seed() is False


def _spec(tmp_path: Path, source: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "job.json"
    weights = [{"source": source, "mount_location": "/app/model"}]
    job = {"image": {"base_image": "x"}, "weights": weights}
    spec.write_text(json.dumps({"training_job": job}))
    return spec


def test_an_engines_store_is_named_by_a_word_a_spec_file_or_neither(tmp_path: Path) -> None:
    assert tls_seed.names_an_engine_store(["run", "--store=s3://bucket/bt"])
    assert tls_seed.names_an_engine_store(["stage", str(_spec(tmp_path / "a", "azure://a/c/m"))])
    assert tls_seed.names_an_engine_store(["stage", str(_spec(tmp_path / "c", "https://h/m.bin"))])
    yaml = tmp_path / "job.yaml"
    yaml.write_text("weights:\n  - source: https://h/m.bin\n    mount_location: /app/m\n")
    assert tls_seed.names_an_engine_store(["run", str(yaml)])
    for other in ("gs://bucket/model", "hf://org/model"):
        # stores of google-cloud-storage and huggingface_hub
        assert not tls_seed.names_an_engine_store(["run", str(_spec(tmp_path / "b", other))])
    elsewhere = tmp_path / "other.yaml"  # a URL of https:// that is no weights source
    elsewhere.write_text("environment_variables:\n  HF_ENDPOINT: https://mirror.example.com\n")
    assert not tls_seed.names_an_engine_store(["run", str(elsewhere)])
    assert not tls_seed.names_an_engine_store(["run", str(tmp_path / "missing.json"), "-"])


@pytest.mark.parametrize(
    ("argv", "variables", "seeded"),
    [
        (["stage", "{spec}", "--node-root", "{root}"], {}, True),
        (["run", "-", "--node-root", "{root}"], {"BT_STORE_URL": "r2://bucket/bt"}, True),
        (["run", "--node-root", "{root}"], {"BT_JOB_SPEC": "{spec}"}, True),
        (["validate", "{spec}"], {}, False),
        (["run", "{file_spec}", "--node-root", "{root}"], {}, False),
    ],
    ids=["stage-s3-weights", "run-r2-store", "run-spec-variable", "validate", "run-file-only"],
)
def test_the_commands_that_stage_start_the_seeding_where_an_engines_store_is_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    variables: dict[str, str],
    seeded: bool,
) -> None:
    names = {
        "spec": str(_spec(tmp_path / "s3", "s3://bucket/model")),
        "file_spec": str(_spec(tmp_path / "file", "/models/local")),
        "root": str(tmp_path / "root"),
    }
    for name in ("BT_STORE_URL", "BT_JOB_SPEC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(**names))
    started: list[bool] = []
    monkeypatch.setattr(tls_seed, "seed_in_background", lambda: started.append(True))
    cli._seed_tls([word.format(**names) for word in argv])
    assert started == ([True] if seeded else [])
