"""The direct S3 path (bt_agent.storage.s3_direct): its signatures, its fallback, its connections.

Its requests against a real server are covered by the conformance suite of test_storage.py
("s3" and "r2" use it, "s3-sdk" does not). Here: the signature against botocore's own signer,
and two answers SeaweedFS does not give on demand, played by a small local HTTP server (a
stand-in, said so in each test): AWS's redirect of a bucket in another region, and a server that
closes a keep-alive connection between requests, for single requests and for batches.
"""

from __future__ import annotations

import calendar
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bt_agent.errors import IntegrityError
from bt_agent.storage.base import ObjectInfo, Wanted
from bt_agent.storage.credentials import S3Keys
from bt_agent.storage.retry import RetryPolicy
from bt_agent.storage.s3 import S3Store
from bt_agent.storage.s3_batch import BatchGet, Declined
from bt_agent.storage.s3_direct import Endpoint, Listing, NeedsSDK, parse_listing
from bt_agent.storage.sigv4 import Keys, Signer, canonical_path


@pytest.mark.parametrize("token", [None, "session-token-value"])
@pytest.mark.parametrize("key", ["model.safetensors", "a b/ünï+c=d&e.bin"])
def test_signature_is_the_one_botocore_computes(token: str | None, key: str) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config
    from botocore.credentials import Credentials

    host = "bucket.s3.eu-west-1.amazonaws.com"
    path = canonical_path(f"/{key}")
    headers = {"x-amz-checksum-sha256": "n4bQgYhMfWWaL+qgxVrQFaO/TxsrC4Is0V1sFbDwCgg="}
    request = AWSRequest("PUT", f"https://{host}{path}", headers=dict(headers), data=b"content")
    request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret", token), "s3", "eu-west-1").add_auth(request)
    stamp = request.headers["X-Amz-Date"]
    at = calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ"))

    ours = Signer(lambda: Keys("AKIDEXAMPLE", "secret", token), "eu-west-1", clock=lambda: at)
    signed = ours.sign("PUT", host, path, headers)

    assert request.headers["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"
    assert signed["authorization"] == request.headers["Authorization"]


def test_endpoints() -> None:
    assert Endpoint.for_bucket("http://127.0.0.1:8333", "b", "us-east-1") == Endpoint(
        "http", "127.0.0.1:8333", "/b"
    )
    assert Endpoint.for_bucket(None, "models", "eu-west-1") == Endpoint(
        "https", "models.s3.eu-west-1.amazonaws.com", ""
    )
    # Names that cannot be a host name, and no region: botocore's rules decide.
    assert Endpoint.for_bucket(None, "my.models", "eu-west-1") is None
    assert Endpoint.for_bucket(None, "models", "aws-global") is None


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``answer`` (status, XML body, close the connection after?)."""

    protocol_version = "HTTP/1.1"
    answer: tuple[int, bytes, bool] = (200, b"", False)
    seen: list[str] = []

    def _reply(self) -> None:
        self.seen.append(f"{self.command} {self.headers.get('User-Agent', '')}")
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        status, body, close = self.answer
        if "Botocore" in self.headers.get("User-Agent", ""):
            status, body = 200, b""  # the SDK, after a redirect: where the bucket is
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"etag"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()
        if close:  # without saying so: the client finds out when it reuses the connection
            self.close_connection = True

    do_GET = do_PUT = do_HEAD = _reply

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[tuple[type[_Recorder], str]]:
    handler = type("Handler", (_Recorder,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _store(endpoint: str) -> S3Store:
    store = S3Store("bucket", "p", endpoint_url=endpoint, keys=S3Keys("id", "secret", "us-east-1"))
    store.policy = RetryPolicy(attempts=1)  # no retry above: what happens is this path's own
    return store


def test_a_redirect_hands_the_store_to_botocore(stub: tuple[type[_Recorder], str]) -> None:
    """Stand-in for AWS answering a request sent to the bucket's wrong region (301 and
    PermanentRedirect) and answering botocore, which follows redirects, where it is: the store
    goes on through botocore."""
    handler, endpoint = stub
    handler.answer = (301, b"<Error><Code>PermanentRedirect</Code></Error>", False)
    store = _store(endpoint)
    assert store.direct is not None
    assert store.stat("model.bin").version == "etag"
    assert store.direct is None
    assert store.write_bytes("other.bin", b"data")
    assert "Botocore" not in handler.seen[0]
    assert all("Botocore" in line for line in handler.seen[1:]), handler.seen


def test_a_connection_closed_by_the_server_is_reopened(
    stub: tuple[type[_Recorder], str], tmp_path: Path
) -> None:
    """Stand-in for a server that drops idle keep-alive connections: the next request on the
    dropped connection fails to send or gets no answer; it is sent again on a new one."""
    handler, endpoint = stub
    handler.answer = (200, b"", True)
    store = _store(endpoint)
    for name in ("a.bin", "b.bin", "c.bin"):
        assert store.write_bytes(name, b"data")
    assert store.stat("a.bin").version == "etag"
    assert [line.split()[0] for line in handler.seen] == ["PUT", "PUT", "PUT", "HEAD"]
    assert not any("Botocore" in line for line in handler.seen)


def _batch(store: S3Store, items: list[Wanted]) -> dict[str, Exception | None]:
    """One connection, so that each request after the first reuses it."""
    assert store.direct is not None
    told: dict[str, Exception | None] = {}
    batch = BatchGet(
        store.direct,
        store._key,
        lambda item, answer: store.place(item, answer.body, None),
        store.batch_max_size(),
        connections=1,
    )
    batch.run(iter(items), lambda item, error: told.__setitem__(item.expected.key, error))
    return told


def test_a_batch_reopens_a_connection_closed_by_the_server(
    stub: tuple[type[_Recorder], str], tmp_path: Path
) -> None:
    """Stand-in for a server that drops idle keep-alive connections, as above, for the batch
    path: each GET after the first finds its connection closed and is sent again."""
    handler, endpoint = stub
    handler.answer = (200, b"body", True)
    items = [Wanted(tmp_path / n, ObjectInfo(n, 4, "etag")) for n in ("a", "b", "c")]
    assert _batch(_store(endpoint), items) == {"a": None, "b": None, "c": None}
    assert [p.read_bytes() for p in sorted(tmp_path.iterdir())] == [b"body"] * 3
    assert len(handler.seen) == 3


def test_a_batch_leaves_a_redirect_to_the_one_object_path(
    stub: tuple[type[_Recorder], str], tmp_path: Path
) -> None:
    """Stand-in for AWS's redirect of a bucket in another region, as above: the batch declines
    the object and takes no other."""
    handler, endpoint = stub
    handler.answer = (301, b"<Error><Code>PermanentRedirect</Code></Error>", False)
    items = [Wanted(tmp_path / n, ObjectInfo(n, 4, "etag")) for n in ("a", "b")]
    told = _batch(_store(endpoint), items)
    assert list(told) == ["a"] and isinstance(told["a"], Declined)
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_ignores_ranges_fails_the_download(
    stub: tuple[type[_Recorder], str], tmp_path: Path
) -> None:
    """Stand-in for a server that answers a ranged GET with the whole object (200): its start
    must not be written at a range's offset; the download fails and leaves nothing."""
    handler, endpoint = stub
    size = 20 * 1024 * 1024  # above the multipart threshold: ranged GETs
    handler.answer = (200, bytes(range(256)) * (size // 256), False)
    store = _store(endpoint)
    target = tmp_path / "model.bin"
    with pytest.raises(IntegrityError, match="ignores Range"):
        store.download("model.bin", target, ObjectInfo("model.bin", size, "etag"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            b'<?xml version="1.0" encoding="UTF-8"?>'
            b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<IsTruncated>true</IsTruncated><EncodingType>url</EncodingType>"
            b"<Contents><Key>a+b/c%2Bd%20e.bin</Key><Size>12</Size><ETag>&quot;x1&quot;</ETag>"
            b"</Contents><Contents><Key>%E6%A8%A1.bin</Key><Size>0</Size><ETag>x2</ETag>"
            b"</Contents><NextContinuationToken>t/1==</NextContinuationToken>"
            b"</ListBucketResult>",
            Listing([("a b/c+d e.bin", 12, "x1"), ("\u6a21.bin", 0, "x2")], "t/1=="),
        ),
        (
            b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>",
            Listing([], None),
        ),
    ],
    ids=["a page of a longer listing, keys decoded as botocore does", "the last page"],
)
def test_listing_pages_are_parsed(body: bytes, expected: Listing) -> None:
    assert parse_listing(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        b"<html>a proxy's page",
        b"<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
    ],
    ids=["not XML", "truncated without a token"],
)
def test_a_listing_the_direct_path_cannot_follow_goes_to_botocore(body: bytes) -> None:
    with pytest.raises(NeedsSDK):
        parse_listing(body)
