"""AWS Signature Version 4 for S3 requests whose payload is protected by its own checksum.

The payload is declared ``UNSIGNED-PAYLOAD``: every body the agent sends carries its checksum
(``x-amz-checksum-sha256``, or ``-crc32`` for a multipart part), a signed header the service
verifies, so signing the payload too would hash each byte again. The signing key is derived once
per day and region and cached.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Keys:
    """One set of credentials as of now (refreshable credentials are frozen per request)."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def canonical_path(path: str) -> str:
    """The request path as sent and as signed: every byte but unreserved ones and ``/``
    percent-encoded (S3 does not normalize paths, so the two are the same)."""
    return quote(path, safe="/~")


def canonical_query(params: Mapping[str, str]) -> str:
    """A query string as sent and as signed: sorted by name, every byte but unreserved ones
    percent-encoded."""
    return "&".join(
        f"{quote(name, safe='-_.~')}={quote(value, safe='-_.~')}"
        for name, value in sorted(params.items())
    )


class Signer:
    """Signs requests for one service and region with credentials from ``keys()``."""

    def __init__(
        self,
        keys: Callable[[], Keys],
        region: str,
        service: str = "s3",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = keys
        self.region = region
        self.service = service
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[str, str, bytes] | None = None  # (day, secret, signing key)

    def _signing_key(self, day: str, secret: str) -> bytes:
        with self._lock:
            cached = self._cached
            if cached is not None and cached[0] == day and cached[1] == secret:
                return cached[2]
            key = _hmac(("AWS4" + secret).encode(), day)
            for part in (self.region, self.service, "aws4_request"):
                key = _hmac(key, part)
            self._cached = (day, secret, key)
            return key

    def sign(
        self, method: str, host: str, path: str, headers: Mapping[str, str], query: str = ""
    ) -> dict[str, str]:
        """``headers`` plus the ones that sign them (``path`` already canonical, ``query``
        already canonical: sorted and encoded)."""
        keys = self._keys()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        day = stamp[:8]
        signed = {name.lower(): str(value).strip() for name, value in headers.items()}
        signed["host"] = host
        signed["x-amz-date"] = stamp
        signed["x-amz-content-sha256"] = UNSIGNED_PAYLOAD
        if keys.session_token:
            signed["x-amz-security-token"] = keys.session_token
        names = sorted(signed)
        canonical = "\n".join(
            [
                method,
                path,
                query,
                "".join(f"{name}:{signed[name]}\n" for name in names),
                ";".join(names),
                UNSIGNED_PAYLOAD,
            ]
        )
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(
            [ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signature = hmac.new(
            self._signing_key(day, keys.secret_access_key), to_sign.encode(), hashlib.sha256
        ).hexdigest()
        signed["authorization"] = (
            f"{ALGORITHM} Credential={keys.access_key_id}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return signed
