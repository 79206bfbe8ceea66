"""The HTTP client the Hugging Face backend downloads through (standard library only), and
the errors of TLS connections made by clients of the standard library's ``ssl``.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from http.client import HTTPResponse
from pathlib import Path
from urllib.parse import urlparse

from bt_agent.errors import AccessDeniedError, NotFoundError, StoreError, TransientStoreError
from bt_agent.storage.base import (
    CHUNK,
    Refusal,
    speaks_no_tls,
    untrusted_certificate,
)

TIMEOUT_SECONDS = 60
#: OpenSSL's verification errors (``X509_V_ERR_*``) that another CA would not mend.
_CERTIFICATE_KINDS: dict[int, Refusal] = {
    9: "expired",
    10: "expired",
    62: "other-host",
    64: "other-host",
}
#: What OpenSSL says of a first answer that is no TLS record (3.0 and 3.1; 3.2 and later).
_NOT_TLS = ("wrong version number", "record layer failure")


def _error(exc: Exception, uri: str) -> StoreError:
    if isinstance(exc, urllib.error.HTTPError):
        code = exc.code
        if code == 404:
            return NotFoundError(f"{uri} does not exist (HTTP 404); check the URL", uri)
        if code in (401, 403):
            return AccessDeniedError(f"{uri}: access denied (HTTP {code}); check the token", uri)
        if code == 429 or code >= 500:
            return TransientStoreError(f"{uri}: HTTP {code} {exc.reason}", uri)
        return StoreError(f"{uri}: HTTP {code} {exc.reason}", uri)
    return tls_error(exc, uri) or TransientStoreError(f"{uri}: cannot connect ({exc})", uri)


def tls_error(
    exc: BaseException, uri: str, url: str = "", variable: str = "SSL_CERT_FILE"
) -> StoreError | None:
    """The error for a TLS connection to ``url`` (by default ``uri``) that no wait would mend,
    where ``exc`` or what caused it says so: a certificate refused (what to do: ``variable``
    trusts another CA in the client that refused it), or a server that speaks no TLS there."""
    found = _ssl_cause(exc)
    if found is None:
        return None
    where = f"https://{urlparse(url or uri).netloc}"
    if isinstance(found, ssl.SSLCertVerificationError):
        kind = _CERTIFICATE_KINDS.get(found.verify_code, "untrusted")
        said = found.verify_message.rstrip(".")
        return StoreError(f"{uri}: {untrusted_certificate(where, kind, said, variable)}", uri)
    said = str(found.reason or found).lower().replace("_", " ")
    if any(words in said for words in _NOT_TLS):
        return StoreError(f"{uri}: {speaks_no_tls(where, said)}", uri)
    return None


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error that ``exc`` is, or that caused it, if any."""
    found: BaseException | None = exc
    seen: set[int] = set()  # a chain of causes that turns back on itself ends there
    while found is not None and not isinstance(found, ssl.SSLError):
        seen.add(id(found))
        reason = getattr(found, "reason", None)  # urllib's URLError, urllib3's MaxRetryError
        found = (
            reason if isinstance(reason, BaseException) else found.__cause__ or found.__context__
        )
        found = None if found is not None and id(found) in seen else found
    return found


def request(
    url: str, headers: Mapping[str, str] | None = None, method: str = "GET", uri: str = ""
) -> HTTPResponse:
    """Open ``url`` (redirects followed), translating failures into typed errors."""
    req = urllib.request.Request(url, headers=dict(headers or {}), method=method)
    try:
        response: HTTPResponse = urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS)
    except (TimeoutError, urllib.error.URLError, OSError) as exc:
        raise _error(exc, uri or url) from exc
    return response


def read_range(
    url: str, start: int, length: int, headers: Mapping[str, str] | None = None, uri: str = ""
) -> bytes:
    ranged = {**(headers or {}), "Range": f"bytes={start}-{start + length - 1}"}
    with request(url, ranged, uri=uri) as response:
        try:
            data = response.read()
        except OSError as exc:
            raise _error(exc, uri or url) from exc
    if response.status == 200:  # the server ignored the range
        data = data[start : start + length]
    return data


def download(
    url: str, target: Path, headers: Mapping[str, str] | None = None, uri: str = ""
) -> str:
    """Stream ``url`` into ``target``; return the sha256 of what was written."""
    digest = hashlib.sha256()
    with request(url, headers, uri=uri) as response, open(target, "wb") as handle:
        try:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                handle.write(chunk)
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, (ConnectionError, socket.timeout, TimeoutError)):
                raise _error(exc, uri or url) from exc
            raise
    return digest.hexdigest()
