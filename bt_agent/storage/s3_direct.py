"""Single-object S3 requests (GET, HEAD, PUT, DELETE) straight over ``http.client``.

botocore spends about 1.6 ms of CPU on each request (parameter validation, endpoint rules, a
dozen event hooks, response parsing); this path spends about 0.3 ms, which is what decides the
rate of many small files. It covers only what needs no SDK logic: one object, one request, an
endpoint and a region known in advance. Listings, multipart uploads and anything this path
cannot settle (a redirect to another region, say) stay with botocore: :class:`NeedsSDK` tells the
caller to fall back.

Each thread keeps one keep-alive connection per store. A connection found closed by the server
when reused is reopened once before the request counts as failed.
"""

from __future__ import annotations

import contextlib
import http.client
import ssl
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_plus, urlsplit
from xml.etree import ElementTree

from bt_agent.storage.sigv4 import Signer, canonical_path, canonical_query

_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class NetworkError(Exception):
    """The request did not get a whole answer: no connection, a reset, a timeout. Not an
    ``OSError``, so that it is never taken for a local file's error."""


class NeedsSDK(Exception):
    """An answer this path does not handle (a redirect, a region mismatch): use botocore."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # names in lower case
    body: bytes

    def error_code(self) -> tuple[str, str]:
        """The S3 error's code and message from an XML error body (empty for HEAD)."""
        return _tag(self.body, b"Code"), _tag(self.body, b"Message")


def _tag(body: bytes, name: bytes) -> str:
    start = body.find(b"<" + name + b">")
    end = body.find(b"</" + name + b">")
    if start < 0 or end < start:
        return ""
    return body[start + len(name) + 2 : end].decode(errors="replace")


@dataclass(frozen=True)
class Endpoint:
    """Where a bucket's objects are: scheme, host (with a non-default port) and path prefix."""

    scheme: str
    host: str
    base_path: str  # "/bucket" for path-style addressing, "" for virtual-hosted

    @classmethod
    def for_bucket(cls, endpoint_url: str | None, bucket: str, region: str) -> Endpoint | None:
        """Path-style against an explicit endpoint; virtual-hosted on AWS when the bucket's
        name allows it; None where only the SDK knows the way."""
        if endpoint_url:
            parts = urlsplit(endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                return None
            prefix = parts.path.rstrip("/")
            return cls(parts.scheme, parts.netloc, f"{prefix}/{bucket}")
        if not region or region == "aws-global" or "." in bucket or bucket.lower() != bucket:
            return None
        return cls("https", f"{bucket}.s3.{region}.amazonaws.com", "")


class DirectS3:
    """One bucket's single-object requests, signed by ``signer``."""

    def __init__(
        self,
        endpoint: Endpoint,
        signer: Signer,
        timeout: float = 60.0,
        ca_file: str | None = None,  # None: botocore's own trust store, as botocore would use
    ) -> None:
        self.endpoint = endpoint
        self.signer = signer
        self.timeout = timeout
        self.ca_file = ca_file
        self._local = threading.local()
        self._tls_lock = threading.Lock()
        self._tls_context: ssl.SSLContext | None = None

    @property
    def splice_timeout(self) -> float | None:
        """The read timeout where bodies may be spliced from the socket (plain TCP), None
        where they cannot (TLS)."""
        return self.timeout if self.endpoint.scheme == "http" else None

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        existing: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if existing is not None:
            return existing, True
        connection: http.client.HTTPConnection
        if self.endpoint.scheme == "https":
            connection = http.client.HTTPSConnection(
                self.endpoint.host, timeout=self.timeout, context=self.tls_context()
            )
        else:
            connection = http.client.HTTPConnection(self.endpoint.host, timeout=self.timeout)
        self._local.connection = connection
        return connection, False

    def tls_context(self) -> ssl.SSLContext:
        """Built at the first HTTPS connection, not with the store (loading the trust store
        takes tens of milliseconds a warm start need not spend)."""
        with self._tls_lock:
            if self._tls_context is None:
                cafile = self.ca_file or _default_ca_bundle()
                self._tls_context = ssl.create_default_context(cafile=cafile)
            return self._tls_context

    def _discard(self) -> None:
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()

    def _send(
        self,
        method: str,
        key: str,
        headers: Mapping[str, str],
        body: bytes | None,
        query: Mapping[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        path = canonical_path(f"{self.endpoint.base_path}/{key}")
        params = canonical_query(query) if query else ""
        signed = self.signer.sign(method, self.endpoint.host, path, headers, params)
        target = f"{path}?{params}" if params else path
        for attempt in (0, 1):
            connection, reused = self._connection()
            try:
                connection.request(method, target, body=body, headers=signed)
                return connection.getresponse()
            except _STALE as exc:
                self._discard()
                if not reused or attempt or "if-none-match" in signed:
                    raise NetworkError(type(exc).__name__) from exc
            except (OSError, http.client.HTTPException) as exc:
                self._discard()
                raise NetworkError(type(exc).__name__) from exc
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def open(
        self,
        method: str,
        key: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[http.client.HTTPResponse]:
        """The response, its body left to read; redirects raise :class:`NeedsSDK`. The
        connection is kept for the next request only if the body was read to its end."""
        response = self._send(method, key, headers or {}, body, query)
        try:
            if 300 <= response.status < 400:
                raise NeedsSDK(f"HTTP {response.status}")
            yield response
        finally:
            if not response.isclosed():
                self._discard()

    def request(
        self,
        method: str,
        key: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        query: Mapping[str, str] | None = None,
    ) -> Reply:
        """The whole answer to one request."""
        with self.open(method, key, headers, body, query) as response:
            data = read(response)
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)


def _default_ca_bundle() -> str:
    """botocore's trust store (certifi's where it is installed): what botocore itself trusts."""
    from botocore.httpsession import DEFAULT_CA_BUNDLE

    bundle: str = DEFAULT_CA_BUNDLE
    return bundle


@dataclass(frozen=True)
class Listing:
    """One page of a ListObjectsV2 answer asked with ``encoding-type=url``."""

    objects: list[tuple[str, int, str]]  # key (decoded), size, ETag (unquoted)
    next_token: str | None  # where the next page starts; None after the last


def parse_listing(body: bytes) -> Listing:
    """A ListObjectsV2 page, its keys URL-decoded as botocore decodes them; a page this cannot
    follow (not XML, say, from a proxy) raises :class:`NeedsSDK`."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        raise NeedsSDK(f"a listing that is not XML ({exc})") from None
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    objects = [
        (
            unquote_plus(item.findtext(f"{ns}Key") or ""),
            int(item.findtext(f"{ns}Size") or 0),
            (item.findtext(f"{ns}ETag") or "").strip('"'),
        )
        for item in root.iter(f"{ns}Contents")
    ]
    if (root.findtext(f"{ns}IsTruncated") or "").lower() != "true":
        return Listing(objects, None)
    token = root.findtext(f"{ns}NextContinuationToken")
    if not token:
        raise NeedsSDK("a truncated listing without a continuation token")
    return Listing(objects, token)


@contextlib.contextmanager
def _network() -> Iterator[None]:
    """Socket and protocol failures as :class:`NetworkError`."""
    try:
        yield
    except (OSError, http.client.HTTPException) as exc:
        raise NetworkError(type(exc).__name__) from exc


def read(response: http.client.HTTPResponse, size: int = -1) -> bytes:
    """Up to ``size`` bytes of the body (all of it with -1)."""
    with _network():
        return response.read() if size < 0 else response.read(size)


def read_into(response: http.client.HTTPResponse, view: memoryview) -> int:
    """Fill ``view`` from the body as far as it goes; the count (0 at its end)."""
    with _network():
        return response.readinto(view)
