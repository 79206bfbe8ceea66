"""``https://host/path`` (and ``http://``): one file behind a URL, read-only, on obstore
(:mod:`bt_agent.storage.engine`).

Its key is the URL's file name. A large file comes down as the object stores' do: ranges in
parallel, each asking for the version the server's ``HEAD`` named (``If-Match`` on its ETag),
taken up where an earlier attempt stopped; a server that does not serve ranges sends it whole,
in one stream. A URL presigned for GET only (S3's, GCS's: its ``HEAD`` is refused), or a server
that allows no ``HEAD``, is sized by a GET of its first byte. ``SSL_CERT_FILE`` (or
``REQUESTS_CA_BUNDLE``) names a private CA; the proxy variables are honoured.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bt_agent.errors import AccessDeniedError, NotFoundError, StoreError
from bt_agent.spec.urls import shown_url
from bt_agent.storage.base import Fetched, ObjectInfo, ranges_record
from bt_agent.storage.engine import ENGINE_RETRIES, EngineStore, Proxies, Tuning, _info

#: How the engine says the server answered a ranged GET with the whole file.
_NO_RANGES = "Range request not supported"
#: How the engine says the server's answer gave no size.
_NO_LENGTH = "Content-Length Header missing"
#: How the engine says the server refused the request's method (a HEAD, here).
_NO_METHOD = "status code: 405"


#: A secret that is a whole ``Authorization`` value: a scheme's name, a space, its credentials.
_HEADER_VALUE = re.compile(r"^(?:Bearer|Basic|token|Token) \S+$")


def _authorization(token: str) -> str:
    """The ``Authorization`` value of the secret ``token``: as it is where it names its scheme,
    else a bearer token's."""
    token = token.strip()
    return token if _HEADER_VALUE.match(token) else f"Bearer {token}"


class RangesRefusedError(StoreError):
    """The server sends the file whole, whatever range is asked of it."""


class HeadRefusedError(StoreError):
    """The server answers no ``HEAD`` (405: the method is not allowed)."""


class HTTPStore(EngineStore):
    """A single file: its key is the URL's file name. ``token``: the secret the spec names for
    it, sent as ``Authorization: Bearer <token>`` (or as it is, where it is a whole header
    value: ``Basic ...``, ``token ...``), to the URL's host only: a redirect elsewhere (a
    CDN's presigned URL, as the Hub's) goes without it."""

    container_noun = "server"

    def __init__(
        self,
        url: str,
        *,
        tuning: Tuning | None = None,
        ca_bundle: str | None = None,
        proxies: Proxies | None = None,
        ca_variable: str | None = None,
        token: str | None = None,
        secret_name: str = "",
    ) -> None:
        parts = urlsplit(url)
        endpoint = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"  # no user, no password
        super().__init__("", url, endpoint, tuning, ca_bundle, proxies, ca_variable)
        self.name = posixpath.basename(parts.path) or "index"
        self.token = token
        self.secret_name = secret_name

    def access_hint(self) -> str:
        if self.token:
            return f"check that the secret {self.secret_name!r} holds a token the server takes"
        return "check the URL, and the token or signature it carries"

    def _make_engine(self) -> Any:
        from obstore.store import HTTPStore as Engine

        options = self._client_options()
        if self.token:
            options["default_headers"] = {"Authorization": _authorization(self.token)}
        return Engine.from_url(self.url, client_options=options, retry_config=ENGINE_RETRIES)

    def uri(self, key: str = "") -> str:
        """The URL as errors and logs show it: its query's values hidden (a presigned URL's
        signature is a credential)."""
        return shown_url(self.url)

    def identity(self, info: ObjectInfo) -> str:
        """The file's place (the URL without its query) where the server names its version
        (an ETag): a URL presigned again, its query new, is the same file; else the URL."""
        return self.url.partition("?")[0] if info.version else self.url

    def _key(self, key: str) -> str:
        """The engine's name of the file (the URL itself: none)."""
        if key != self.name:
            raise NotFoundError(f"{self.uri()} holds only {self.name!r}, not {key!r}", self.uri())
        return ""

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [self._stat(self.name)] if self.name.startswith(prefix) else []

    def _list_pages(self, prefix: str) -> Iterator[list[ObjectInfo]]:
        yield self._list(prefix)

    def _stat(self, key: str) -> ObjectInfo:
        """The server's ``HEAD``; where that is refused (a URL presigned for GET only, as S3's
        and GCS's are; a server that allows no HEAD), a GET of the first byte (or, from a server
        that serves no ranges, of the file, let go of once its headers are in), whose answer
        gives its size and ETag."""
        import obstore

        try:
            return super()._stat(key)
        except (AccessDeniedError, HeadRefusedError):
            pass  # a URL signed for GET, or a server that refuses the GET too (said below)
        get = partial(obstore.get, path=self._key(key))
        try:
            answer = self._engine_call(key, partial(get, options={"range": (0, 1)}))
        except RangesRefusedError:
            answer = self._engine_call(key, get)
        return _info(key, answer.meta, answer.attributes)

    def _error(self, exc: Exception, key: str) -> Exception:
        if _NO_RANGES in str(exc):
            return RangesRefusedError(f"{self.uri()}: the server does not serve ranges", self.uri())
        if _NO_METHOD in str(exc):
            return HeadRefusedError(f"{self.uri()}: the server allows no HEAD", self.uri())
        if _NO_LENGTH in str(exc):  # an answer no retry would change
            return StoreError(
                f"{self.uri()}: the server gives no Content-Length (the file's size), which a "
                "source needs; use a URL whose server gives it",
                self.uri(),
            )
        return super()._error(exc, key)

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """In ranges, or in one range that is the whole file (asked for whole) where the server
        turns out to send only the whole file: from then on, every download of this store."""
        try:
            return super()._download(key, target, expected)
        except RangesRefusedError:
            ranges_record(target).unlink(missing_ok=True)  # nothing of it is written
            self.tuning = dataclasses.replace(self.tuning, part_size=sys.maxsize)
            return super()._download(key, target, expected)

    def _upload(self, path: Path, key: str) -> str:
        raise self._read_only_error(key)

    def _put_object(self, key: str, data: bytes, sha256: str, if_absent: bool = False) -> bool:
        raise self._read_only_error(key)

    def _delete(self, key: str) -> None:
        raise self._read_only_error(key)

    def _copy(self, source: str, key: str) -> None:
        raise NotImplementedError("a URL's file is not copied")
