"""Fixtures: an isolated agent per test, and real servers on 127.0.0.1 (one of each per session,
or a test's own), each stopped by pid. What tests share beyond fixtures is in ``helpers``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from helpers import Agent, marked_processes, process_tree


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """An isolated agent; afterwards no process it started may still be alive."""
    instance = Agent(tmp_path)
    yield instance
    deadline = time.monotonic() + 5
    while (left := marked_processes(instance.mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # do not let one leak break the tests after this one
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "processes survived the test:\n" + process_tree(left)


# --- real servers on 127.0.0.1, one of each per test session, stopped by pid -------------


@pytest.fixture
def own_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[servers.SeaweedFS]:
    """A SeaweedFS of the test's own, which the test may stop and start again, with a bucket
    ``store``; the test's own S3 clients find its credentials in the environment, as the
    agent's do. Its data is removed at the end."""
    server = servers.seaweedfs(tmp_path / "own-s3")
    try:
        server.create_bucket("store")
        for name, value in server.client_env().items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp_path / "own-s3", ignore_errors=True)


@pytest.fixture(scope="session")
def server_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def s3_server(server_root: Path) -> Iterator[servers.SeaweedFS]:
    server = servers.seaweedfs(server_root / "shared")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_server(server_root: Path) -> Iterator[servers.Azurite]:
    server = servers.azurite(server_root)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_tls_server(server_root: Path) -> Iterator[servers.Azurite]:
    server = servers.azurite(server_root, tls=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(server_root: Path) -> Iterator[servers.FakeGCS]:
    server = servers.fake_gcs(server_root)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_tls_server(server_root: Path) -> Iterator[servers.FakeGCS]:
    server = servers.fake_gcs(server_root, tls=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_server(server_root: Path) -> Iterator[servers.Olah]:
    mirrors = server_root / "mirrors"
    mirrors.mkdir()
    server = servers.olah(server_root, mirrors)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_tls_server(server_root: Path) -> Iterator[servers.Olah]:
    mirrors = server_root / "mirrors-tls"
    mirrors.mkdir()
    server = servers.olah(server_root, mirrors, tls=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def https_server(server_root: Path) -> Iterator[servers.StaticHTTPS]:
    server = servers.static_https(server_root)
    yield server
    server.stop()


#: A host name no resolver knows: RFC 6761 keeps ``.invalid`` out of the DNS.
NO_SUCH_HOST = "no-such-host.invalid"


@pytest.fixture
def unknown_name() -> str:
    """:data:`NO_SUCH_HOST`, where this machine's resolver says it does not exist (one out of
    reach says it cannot tell for the moment: an outage, which these tests are not about)."""
    try:
        socket.getaddrinfo(NO_SUCH_HOST, 443)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_NONAME:
            return NO_SUCH_HOST
        pytest.skip(f"the resolver here cannot tell whether {NO_SUCH_HOST} exists: {exc}")
    pytest.skip(f"the resolver here gives {NO_SUCH_HOST} an address (it answers every name)")
