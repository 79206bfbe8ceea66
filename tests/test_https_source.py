"""``https://`` weights on the engine, against a real file server on https (its CA trusted
through ``SSL_CERT_FILE``): a large file comes in ranges, each pinned to the ETag the server
named; a server that serves no ranges sends it whole; a file replaced since it was listed is an
error, never a mix of two files; the source is read-only."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import servers
from helpers import Agent

from bt_agent.errors import ChangedError, StoreError, TransientStoreError
from bt_agent.settings import Environ
from bt_agent.spec.urls import shown_url
from bt_agent.storage import ObjectStore, open_store
from bt_agent.storage.base import ObjectInfo
from bt_agent.storage.retry import RetryPolicy
from bt_agent.storage.web import _authorization

MiB = 1024 * 1024
SIZE = 72 * MiB + 3  # three ranges of the engine's 32 MiB


@pytest.fixture(params=["on", "off"], ids=["ranges", "no-ranges"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[servers.StaticHTTPS]:
    started = servers.static_https(tmp_path, RANGES=request.param)
    yield started
    started.stop()


def _source(server: servers.StaticHTTPS, name: str, query: str = "") -> ObjectStore:
    return open_store(server.url(name) + query, Environ({"SSL_CERT_FILE": str(server.ca_file)}))


def _fetched(
    server: servers.StaticHTTPS, data: bytes, tmp_path: Path, query: str = ""
) -> tuple[bytes, ObjectInfo]:
    """``data`` served as model.bin, listed and downloaded through its ``https://`` source:
    what was downloaded, and what the listing said."""
    (server.directory / "model.bin").write_bytes(data)
    with _source(server, "model.bin", query) as source:
        [info] = source.list()
        target = source.download("model.bin", tmp_path / "out" / "model.bin", info)
    assert [path.name for path in target.parent.iterdir()] == ["model.bin"]
    return target.read_bytes(), info


def _gets(server: servers.StaticHTTPS) -> list[list[str]]:
    """The GETs the server has had: [path, Range, If-Match] each."""
    return [line.split()[1:] for line in server.log.read_text().splitlines() if line[:4] == "GET "]


def test_a_large_file_comes_in_ranges_pinned_to_its_etag_or_whole(
    server: servers.StaticHTTPS, tmp_path: Path
) -> None:
    data = os.urandom(SIZE)
    fetched, info = _fetched(server, data, tmp_path)
    assert fetched == data
    gets = _gets(server)
    assert {(path, pinned) for path, _, pinned in gets} == {("/model.bin", f'"{info.version}"')}
    ranges = ["bytes=0-33554431", "bytes=33554432-67108863", f"bytes=67108864-{SIZE - 1}"]
    asked = [asked for _, asked, _ in gets]
    if server.env.get("RANGES") != "off":
        assert sorted(asked) == ranges
    else:  # the ranges asked first (one at least: they end at the first refusal), then whole
        assert asked[-1] == "None" and 1 <= len(asked) - 1 <= 3, asked
        assert set(asked[:-1]) <= set(ranges), asked


def test_a_server_that_serves_no_ranges_is_asked_for_none_again(tmp_path: Path) -> None:
    server = servers.static_https(tmp_path, RANGES="off")
    try:
        data = os.urandom(SIZE)
        (server.directory / "model.bin").write_bytes(data)
        with _source(server, "model.bin") as source:
            [info] = source.list()
            source.download("model.bin", tmp_path / "first" / "model.bin", info)
            before = len(_gets(server))
            again = source.download("model.bin", tmp_path / "again" / "model.bin", info)
        assert again.read_bytes() == data
        assert [asked for _, asked, _ in _gets(server)[before:]] == ["None"]
    finally:
        server.stop()


@pytest.mark.parametrize("size", [1000, SIZE], ids=["small", "large"])
def test_a_file_replaced_since_it_was_listed_is_an_error(
    server: servers.StaticHTTPS, tmp_path: Path, size: int
) -> None:
    """The version listed is asked for (``If-Match``; above the range size, also the server's
    ``HEAD`` first): another file there fails at once, and nothing is put in place."""
    (server.directory / "model.bin").write_bytes(b"a" * size)
    with _source(server, "model.bin") as source:
        [info] = source.list()
        os.utime(server.directory / "model.bin", ns=(0, 10**9))  # another ETag
        with pytest.raises(ChangedError):
            source.download("model.bin", tmp_path / "model.bin", info)
    assert list(tmp_path.glob("*model.bin*")) == []


def test_an_https_source_is_read_only(https_server: servers.StaticHTTPS, tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"x")
    with _source(https_server, "model.bin") as source:
        for write in (
            lambda: source.upload_file(tmp_path / "x", "model.bin"),
            lambda: source.write_bytes("model.bin", b"x"),
            lambda: source.delete("model.bin"),
        ):
            with pytest.raises(StoreError, match="this source is read-only"):
                write()


def test_a_server_that_gives_no_size_is_a_clear_error(tmp_path: Path) -> None:
    """A file sent chunked, its size unsaid: an error that says so at once, not an outage
    waited out."""

    class Chunked(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = open_store(f"http://127.0.0.1:{server.server_port}/model.bin")
        with source, pytest.raises(StoreError) as caught:
            source.list()
    finally:
        server.shutdown()
        server.server_close()
    assert not isinstance(caught.value, TransientStoreError)
    assert "the server gives no Content-Length" in str(caught.value)


def test_a_file_replaced_under_a_server_that_ignores_if_match_is_still_an_error(
    tmp_path: Path,
) -> None:
    """The file is replaced just after the ``HEAD`` that precedes a large file's ranges, on a
    server that ignores ``If-Match``: each range's answer names its ETag, and another one there
    fails the download rather than writing a file of two."""
    server = servers.static_https(tmp_path, IF_MATCH="off")
    path = server.directory / "model.bin"
    try:
        path.write_bytes(b"a" * SIZE)
        with _source(server, "model.bin") as source:
            [info] = source.list()
            headed = source._stat  # type: ignore[attr-defined]

            def replaced_after(key: str) -> ObjectInfo:
                found = headed(key)
                path.write_bytes(b"b" * SIZE)
                os.utime(path, ns=(0, 10**9))  # another ETag, whatever the clock's grain
                return found  # type: ignore[no-any-return]

            source._stat = replaced_after  # type: ignore[attr-defined]
            with pytest.raises(ChangedError):
                source.download("model.bin", tmp_path / "out" / "model.bin", info)
        assert list((tmp_path / "out").iterdir()) == []
        assert {pinned for _, _, pinned in _gets(server)} == {f'"{info.version}"'}
    finally:
        server.stop()


@pytest.mark.parametrize("size", [1000, SIZE], ids=["small", "large"])
def test_a_server_of_weak_etags_is_asked_without_if_match(tmp_path: Path, size: int) -> None:
    """A weak ETag (``W/"..."``) matches no ``If-Match``: asking with it would fail every
    download, so none is asked (the answers' ETags are still compared with the listing's)."""
    server = servers.static_https(tmp_path, ETAGS="weak")
    try:
        data = os.urandom(size)
        fetched, info = _fetched(server, data, tmp_path)
        assert fetched == data
        assert info.version and info.version.startswith("W/")
        assert {pinned for _, _, pinned in _gets(server)} == {"None"}
    finally:
        server.stop()


@pytest.mark.parametrize(
    "behaviour",
    [{"SIGNED": "GET"}, {"SIGNED": "GET", "RANGES": "off"}, {"HEAD": "refused"}],
    ids=["signed", "signed-no-ranges", "no-head"],
)
def test_a_url_presigned_for_get_only_is_read_without_a_head(
    tmp_path: Path, behaviour: dict[str, str]
) -> None:
    """A presigned URL (S3's, GCS's) is signed for GET: its ``HEAD`` is refused (403), so the
    file's size and ETag come from a GET of its first byte (of the file, where the server
    serves no ranges); every request keeps the URL's query, its signature. A server that allows
    no HEAD (405) is met the same way."""
    server = servers.static_https(tmp_path, **behaviour)
    try:
        data = os.urandom(SIZE)
        query = "?X-Amz-Expires=3600&X-Amz-Signature=0123abcd"
        fetched, info = _fetched(server, data, tmp_path, query)
        assert fetched == data
        assert (info.key, info.size) == ("model.bin", SIZE)
        assert {path for path, _, _ in _gets(server)} == {f"/model.bin{query}"}
    finally:
        server.stop()


def test_a_presigned_source_s_signature_is_never_shown(agent: Agent, tmp_path: Path) -> None:
    """A job staging a presigned ``https://`` file, and one whose file is gone: the plan line
    and the error name the URL with its query's values hidden, in the agent's output, its log,
    its node's record and the job's record (its copy of the spec)."""
    server = servers.static_https(tmp_path / "https", SIGNED="GET")
    signature = uuid.uuid4().hex
    query = f"?X-Amz-Credential=AKIA{signature[:8]}&X-Amz-Signature={signature}"
    env = {"SSL_CERT_FILE": str(server.ca_file)}
    try:
        (server.directory / "model.bin").write_bytes(b"weights\n")
        found = {"source": server.url("model.bin") + query, "mount_location": "/h"}
        staged = agent.run_job(_job(found, f"cat {agent.node_root}/h/model.bin"), env=env)
        gone = {"source": server.url("gone.bin") + query, "mount_location": "/g"}
        failed = agent.run_job(_job(gone, "true"), env=env)
    finally:
        server.stop()
    assert staged.code == 0, staged.text
    assert staged.out == "weights\n"
    shown = server.url("model.bin") + "?X-Amz-Credential=***&X-Amz-Signature=***"
    assert shown in staged.err, staged.err
    assert failed.code == 3, failed.text
    assert server.url("gone.bin") + "?X-Amz-Credential=***" in failed.err, failed.err
    kept = [path for path in agent.store.rglob("*") if path.is_file()]
    written = [path.read_bytes() for path in kept]
    assert any(path.suffix == ".log" for path in kept)
    recorded = [json.loads(path.read_text()) for path in kept if path.name == "job.json"]
    sources = {job["spec"]["training_job"]["weights"][0]["source"] for job in recorded}
    assert sources == {shown, server.url("gone.bin") + "?X-Amz-Credential=***&X-Amz-Signature=***"}
    for text in [staged.text.encode(), failed.text.encode(), *written]:
        assert signature.encode() not in text and signature[:8].encode() not in text


def test_a_token_secret_goes_to_the_url_s_host_only(agent: Agent, tmp_path: Path) -> None:
    """A source whose server asks for a token (an artifact server's, the Hub's ``resolve``
    URLs) is given the secret its ``auth_secret_name`` names, as a bearer token, and the
    server's redirect to another host (a CDN's presigned URL, which refuses any other
    credentials, as S3's does) goes without it. Without the secret, or with a wrong one, the
    job fails to deploy naming the secret, never its value."""
    tls = servers.certificates(tmp_path / "tls")
    cdn = servers.static_https(tmp_path / "cdn", tls, AUTHORIZATION="refused")
    token = f"tok-{uuid.uuid4().hex}"
    origin = servers.static_https(
        tmp_path / "origin", tls, BEARER=token, REDIRECT=f"https://127.0.0.1:{cdn.port}"
    )
    env = {"SSL_CERT_FILE": str(tls.ca)}
    try:
        (cdn.directory / "model.bin").write_bytes(b"w" * (20 * MiB))  # in ranges
        weights = {"source": origin.url("model.bin"), "mount_location": "/h"}
        agent.secret("artifact_token", token)
        given = {**weights, "auth_secret_name": "artifact_token"}
        staged = agent.run_job(_job(given, f"wc -c < {agent.node_root}/h/model.bin"), env=env)
        without = agent.run_job(_job(weights, "true"), env=env)
        agent.secret("artifact_token", "tok-wrong-7781")
        wrong = agent.run_job(_job(given, "true"), env=env)
    finally:
        cdn.stop()
        origin.stop()
    assert staged.code == 0, staged.text
    assert staged.out.strip() == str(20 * MiB)
    assert without.code == 3 and "access denied (401" in without.err, without.text
    assert wrong.code == 3, wrong.text
    assert "check that the secret 'artifact_token' holds a token the server takes" in wrong.err
    for result in (staged, without, wrong):
        assert token not in result.text and "tok-wrong-7781" not in result.text


@pytest.mark.parametrize(
    ("secret", "sent"),
    [
        ("hf_abc123", "Bearer hf_abc123"),
        (" hf_abc123\n", "Bearer hf_abc123"),
        ("Basic dXNlcjpwdw==", "Basic dXNlcjpwdw=="),
        ("token ghp_abc", "token ghp_abc"),
    ],
)
def test_a_token_secret_is_a_bearer_token_unless_it_names_its_scheme(
    secret: str, sent: str
) -> None:
    assert _authorization(secret) == sent


def test_a_password_in_the_url_is_never_in_an_error() -> None:
    """A URL carrying a user and password: a server out of reach is named without them."""
    port = servers.free_port()
    with open_store(f"https://user:pw-4471@127.0.0.1:{port}/m.bin", Environ({})) as source:
        source.policy = RetryPolicy(attempts=1)
        with pytest.raises(TransientStoreError) as caught:
            source.list()
    said = str(caught.value)
    assert f"cannot reach https://127.0.0.1:{port} (" in said and "pw-4471" not in said, said


def _job(weights: dict[str, str], command: str) -> dict[str, object]:
    return {
        "image": {"base_image": "x"},
        "weights": [weights],
        "runtime": {"start_commands": [command]},
    }


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://h/m.bin?X-Goog-Signature=ab&v=2", "https://h/m.bin?X-Goog-Signature=***&v=***"),
        ("https://user:pw@h:8443/m.bin", "https://user:***@h:8443/m.bin"),
        ("https://h/m.bin", "https://h/m.bin"),
        ("s3://bucket/m.bin", "s3://bucket/m.bin"),
    ],
)
def test_a_url_is_shown_without_what_it_carries_of_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.parametrize("etags", ["strong", "none"])
def test_a_file_presigned_again_is_found_in_the_node_cache(
    agent: Agent, tmp_path: Path, etags: str
) -> None:
    """The same file behind a URL presigned again (its query new) is the node cache's entry
    where the server names its version (an ETag); where it names none, only the same URL is."""
    server = servers.static_https(tmp_path / "https", SIGNED="GET", ETAGS=etags)
    env = {"SSL_CERT_FILE": str(server.ca_file)}
    try:
        (server.directory / "model.bin").write_bytes(b"weights\n")
        said = []
        for signature in ("first", "second"):
            url = server.url("model.bin") + f"?X-Amz-Signature={signature}"
            job = _job({"source": url, "mount_location": "/h"}, "true")
            result = agent.run_job(job, env=env)
            assert result.code == 0, result.text
            said.append(result.err)
    finally:
        server.stop()
    assert "0 in the node cache, 1 to fetch" in said[0], said[0]
    again = "1 in the node cache, 0 to fetch" if etags == "strong" else "0 in the node cache"
    assert again in said[1], said[1]
