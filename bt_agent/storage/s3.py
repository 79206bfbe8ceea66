"""``s3://bucket/prefix`` (and ``r2://``): botocore, imported only when a store is opened.

Uploads read each file once: the whole-file sha256 and each part's sha256 are computed from the
same bytes, and every request carries ``ChecksumSHA256``, which the service verifies. Parts are
sized so that files of hundreds of GB stay under 10,000 parts, and in-flight parts are bounded,
so memory stays at ``concurrency x part size`` whatever the file size.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bt_agent.errors import (
    AccessDeniedError,
    IntegrityError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from bt_agent.storage.base import CHUNK, Fetched, ObjectInfo, ObjectStore
from bt_agent.storage.credentials import S3Keys
from bt_agent.storage.keys import join_key, relative_key

MiB = 1024 * 1024
MAX_PARTS = 10_000
SHA256_META = "sha256"
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
_CORRUPT = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"}
_RETRY = {
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "RequestTimeTooSkewed",
    "500",
    "502",
    "503",
    "504",
}


@dataclass(frozen=True)
class S3Tuning:
    """Transfer settings. Part sizes grow for very large files to stay under 10,000 parts.

    Uploads hold ``concurrency x upload_part_size`` in memory at most (64 MiB by default: the
    checkpoint sidecar runs beside training), downloads ``concurrency x part_size``."""

    multipart_threshold: int = 16 * MiB  # downloads above this: parallel ranged GETs
    part_size: int = 16 * MiB  # the range of each
    upload_part_size: int = 8 * MiB  # uploads above this: multipart, in parts of this size
    concurrency: int = 8  # parts in flight per store (bounds memory) and HTTP connections
    list_page_size: int = 1000

    def part_size_for(self, size: int, upload: bool = False) -> int:
        needed = math.ceil(size / (MAX_PARTS - 1))
        base = self.upload_part_size if upload else self.part_size
        return max(base, math.ceil(needed / MiB) * MiB)


def _precondition_failed(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        endpoint_url: str | None = None,
        keys: S3Keys | None = None,
        region: str | None = None,
        tuning: S3Tuning | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = url or f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = endpoint_url
        self.keys = keys
        self.region = region or (keys.region if keys else None)
        self.tuning = tuning or S3Tuning()
        self._client: Any = None
        self._lock = threading.Lock()
        self._parts = ThreadPoolExecutor(self.tuning.concurrency, thread_name_prefix="bt-s3")
        self._in_flight = threading.BoundedSemaphore(self.tuning.concurrency)

    # --- the SDK boundary --------------------------------------------------------------------

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        # botocore itself, not boto3: the same client, and 30-40 ms less to import and build,
        # which is most of a warm start.
        import botocore.session
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},  # retried above, with jitter
            max_pool_connections=self.tuning.concurrency * 4,
            connect_timeout=10,
            read_timeout=60,
            # Checksums only where we send them (SHA256): what R2 and other S3-alikes accept.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={
                # Every request with a body carries our ChecksumSHA256, in a signed header,
                # which the service verifies: signing the payload as well would hash each
                # byte a third time (botocore does so on plain-http endpoints).
                "payload_signing_enabled": False,
                **({"addressing_style": "path"} if self.endpoint_url else {}),
            },
        )
        keys = self.keys
        client = botocore.session.get_session().create_client(
            "s3",
            region_name=self.region,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=keys.access_key_id if keys else None,
            aws_secret_access_key=keys.secret_access_key if keys else None,
            aws_session_token=keys.session_token if keys else None,
            config=config,
        )
        # No "Expect: 100-continue": botocore asks for it on every body it can read (ours are
        # bytes it wraps), which costs a round trip per PUT, up to a second where a server never
        # answers it, and, seen with SeaweedFS, a response read as headerless that then hangs
        # the request until the read timeout.
        from botocore.handlers import add_expect_header

        client.meta.events.unregister("before-call.s3", add_expect_header)
        return client

    def _error(self, exc: Exception, key: str) -> Exception:
        from botocore import exceptions as bx

        uri = self.uri(key)
        if isinstance(exc, bx.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            detail = f"{code or status}: {error.get('Message', '')}".rstrip(": ")
            if code in _NOT_FOUND or status == "404":
                return NotFoundError(
                    f"{uri} does not exist ({detail}); check the bucket and the path", uri
                )
            if code in _DENIED or status in ("401", "403"):
                return AccessDeniedError(
                    f"{uri}: access denied ({detail}); check the "
                    "credentials and the bucket's policy",
                    uri,
                )
            if code in _CORRUPT:
                return IntegrityError(f"{uri}: the service rejected the checksum ({detail})", uri)
            if code in _RETRY or status.startswith("5") or status == "429":
                return TransientStoreError(f"{uri}: {detail}", uri)
            return StoreError(f"{uri}: {detail}", uri)
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return AccessDeniedError(
                f"{uri}: no credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or name a secret",
                uri,
            )
        if isinstance(
            exc,
            bx.EndpointConnectionError
            | bx.ConnectionClosedError
            | bx.ReadTimeoutError
            | bx.ConnectTimeoutError
            | bx.ResponseStreamingError
            | ConnectionError
            | TimeoutError,
        ):
            where = self.endpoint_url or "the S3 endpoint"
            return TransientStoreError(f"{uri}: cannot reach {where} ({type(exc).__name__})", uri)
        return exc

    def _call(self, key: str, operation: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            raise self._error(exc, key) from exc

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    # --- the core ----------------------------------------------------------------------------

    def _list(self, prefix: str) -> list[ObjectInfo]:
        found = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else ""),
                PaginationConfig={"PageSize": self.tuning.list_page_size},
            )
            for page in pages:
                for item in page.get("Contents", []):
                    key = relative_key(self.prefix, item["Key"])
                    found.append(ObjectInfo(key, int(item["Size"]), item["ETag"].strip('"')))
        except Exception as exc:
            raise self._error(exc, prefix) from exc
        return found

    def _stat(self, key: str) -> ObjectInfo:
        head = self._call(key, "head_object", Key=self._key(key))
        return ObjectInfo(
            key,
            int(head["ContentLength"]),
            head["ETag"].strip('"'),
            head.get("Metadata", {}).get(SHA256_META),
        )

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        response = self._call(
            key, "get_object", Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
        )
        try:
            return bytes(response["Body"].read())
        except Exception as exc:
            raise self._error(exc, key) from exc

    def _download(self, key: str, target: Path, size: int | None) -> Fetched:
        """One streamed GET for objects up to the multipart threshold (its response carries
        the metadata), ranged GETs in parallel above it."""
        if size is not None and size > self.tuning.multipart_threshold:
            head = self._call(key, "head_object", Key=self._key(key))
            self._download_ranges(key, target, int(head["ContentLength"]))
            return Fetched(head.get("Metadata", {}).get(SHA256_META), None)
        response = self._call(key, "get_object", Key=self._key(key))
        total = int(response["ContentLength"])
        if total > self.tuning.multipart_threshold:  # the size was not known: go parallel
            response["Body"].close()
            self._download_ranges(key, target, total)
            return Fetched(response.get("Metadata", {}).get(SHA256_META), None)
        digest = hashlib.sha256()
        try:
            with open(target, "wb") as handle:
                for chunk in response["Body"].iter_chunks(CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
        except OSError:
            raise
        except Exception as exc:
            raise self._error(exc, key) from exc
        return Fetched(response.get("Metadata", {}).get(SHA256_META), digest.hexdigest())

    def _download_ranges(self, key: str, target: Path, size: int) -> None:
        part = self.tuning.part_size_for(size)
        fd = os.open(target, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            futures = [
                self._parts.submit(self._fetch_range, key, fd, start, min(part, size - start))
                for start in range(0, size, part)
            ]
            for future in futures:
                future.result()
        finally:
            os.close(fd)

    def _fetch_range(self, key: str, fd: int, start: int, length: int) -> None:
        data = self._read_range(key, start, length)
        if len(data) != length:
            raise TransientStoreError(f"{self.uri(key)}: short read at {start}", self.uri(key))
        os.pwrite(fd, data, start)

    def _upload(self, path: Path, key: str) -> str:
        size = path.stat().st_size
        if size <= self.tuning.upload_part_size:
            data = path.read_bytes()
            digest = hashlib.sha256(data)
            self._call(
                key,
                "put_object",
                Key=self._key(key),
                Body=data,
                ChecksumSHA256=_b64(digest.digest()),
                Metadata={SHA256_META: digest.hexdigest()},
            )
            return digest.hexdigest()
        return self._upload_parts(path, key, size)

    def _upload_parts(self, path: Path, key: str, size: int) -> str:
        part_size = self.tuning.part_size_for(size, upload=True)
        upload = self._call(
            key, "create_multipart_upload", Key=self._key(key), ChecksumAlgorithm="SHA256"
        )
        upload_id = upload["UploadId"]
        whole = hashlib.sha256()
        futures: list[Future[dict[str, Any]]] = []
        try:
            with open(path, "rb") as handle:
                for number in range(1, math.ceil(size / part_size) + 1):
                    self._in_flight.acquire()  # backpressure: bounded memory
                    data = handle.read(part_size)
                    whole.update(data)
                    futures.append(self._parts.submit(self._put_part, key, upload_id, number, data))
            parts = [future.result() for future in futures]
            self._call(
                key,
                "complete_multipart_upload",
                Key=self._key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            for future in futures:
                future.cancel()
            self._abort(key, upload_id)
            raise
        return whole.hexdigest()

    def _put_part(self, key: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        try:
            checksum = _b64(hashlib.sha256(data).digest())
            response = self._call(
                key,
                "upload_part",
                Key=self._key(key),
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ChecksumSHA256=checksum,
            )
            return {"PartNumber": number, "ETag": response["ETag"], "ChecksumSHA256": checksum}
        finally:
            self._in_flight.release()

    def _abort(self, key: str, upload_id: str) -> None:
        # Best effort: what an abort cannot reach, the bucket's lifecycle rule reclaims.
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id
            )

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        """A small object; ``if_absent`` uses a conditional write (``If-None-Match: *``)."""
        digest = hashlib.sha256(data)
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                ChecksumSHA256=_b64(digest.digest()),
                Metadata={SHA256_META: digest.hexdigest()},
                **extra,
            )
        except Exception as exc:
            if if_absent and _precondition_failed(exc):
                return False
            raise self._error(exc, key) from exc
        return True

    def _delete(self, key: str) -> None:
        self._call(key, "delete_object", Key=self._key(key))
