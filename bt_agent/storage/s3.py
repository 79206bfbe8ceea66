"""``s3://bucket/prefix`` (and ``r2://``): botocore, imported only when a store is opened.

Uploads read each file once: the whole-file sha256 and each part's checksum are computed from the
same bytes, and every request carries a checksum the service verifies: ``ChecksumSHA256`` for a
whole object, ``ChecksumCRC32`` for a part (what AWS's SDKs send by default; a third of the CPU of
a second sha256 over every byte, which the manifest's whole-file sha256 already covers). Parts are
sized so that files of hundreds of GB stay under 10,000 parts, and in-flight parts are bounded, so
memory stays at ``concurrency x part size`` whatever the file size.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import math
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bt_agent.errors import (
    AccessDeniedError,
    IntegrityError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from bt_agent.storage.base import (
    CHUNK,
    Fetched,
    Finished,
    ObjectInfo,
    ObjectStore,
    U,
    Upload,
    Wanted,
)
from bt_agent.storage.budget import ByteBudget
from bt_agent.storage.credentials import S3Keys
from bt_agent.storage.keys import join_key, relative_key
from bt_agent.storage.receive import Receiver, Span
from bt_agent.storage.s3_direct import (
    DirectS3,
    Endpoint,
    NeedsSDK,
    NetworkError,
    Reply,
    parse_listing,
    read,
)
from bt_agent.storage.sigv4 import Keys, Signer

if TYPE_CHECKING:
    from bt_agent.storage.s3_batch import Answer

MiB = 1024 * 1024
MAX_PARTS = 10_000
#: The largest object one CopyObject takes.
MAX_COPY_BYTES = 5 * 1024**3
SHA256_META = "sha256"
META_HEADER = "x-amz-meta-" + SHA256_META
READ_TIMEOUT = 60.0
T = TypeVar("T")
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
_CONFLICT = {"PreconditionFailed", "ConditionalRequestConflict"}
#: Answers that mean the request went to the wrong region: botocore knows how to follow them.
_WRONG_REGION = {
    "AuthorizationHeaderMalformed",
    "PermanentRedirect",
    "IllegalLocationConstraintException",
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

    Uploads hold ``upload_memory`` bytes of file content at most, whatever the number of
    uploads at once (the checkpoint sidecar runs beside training); ranged downloads pass
    through a small buffer per thread."""

    multipart_threshold: int = 16 * MiB  # downloads above this: parallel ranged GETs
    part_size: int = 16 * MiB  # the range of each
    upload_part_size: int = 8 * MiB  # uploads above this: multipart, in parts of this size
    concurrency: int = 8  # parts in flight per store and HTTP connections
    upload_memory: int = 32 * MiB  # file content read and not yet sent, for all uploads
    list_page_size: int = 1000
    batch_max_size: int = MiB  # objects up to this size may be fetched in batches

    def part_size_for(self, size: int, upload: bool = False) -> int:
        needed = math.ceil(size / (MAX_PARTS - 1))
        base = self.upload_part_size if upload else self.part_size
        return max(base, math.ceil(needed / MiB) * MiB)


def _precondition_failed(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in _CONFLICT or status == 412


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` with no traceback along its chain of causes: the frames would keep their
    locals alive (a request's body among them)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc


def _failed_future(future: Future[Any]) -> bool:
    return not future.cancelled() and future.exception() is not None


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class _Absent(Exception):
    """A conditional write found an object there already."""


def _object_info(key: str, headers: Mapping[str, str]) -> ObjectInfo:
    """An object's info from the headers of a direct HEAD."""
    return ObjectInfo(
        key,
        int(headers.get("content-length", 0)),
        headers.get("etag", "").strip('"'),
        headers.get(META_HEADER),
    )


def _write_chunks(target: Path, chunks: Iterable[bytes]) -> str:
    """Write ``chunks`` into ``target``; the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(target, "wb") as handle:
        for chunk in chunks:
            digest.update(chunk)
            handle.write(chunk)
    return digest.hexdigest()


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
        direct_requests: bool = True,
        ca_bundle: str | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = url or f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = endpoint_url
        self.keys = keys
        self.region = region or (keys.region if keys else None)
        self.tuning = tuning or S3Tuning()
        self.direct_requests = direct_requests
        self.ca_bundle = ca_bundle
        self._client: Any = None
        self._session: Any = None
        self._direct: DirectS3 | None = None
        self._lock = threading.RLock()  # the direct path may build the client
        self._direct_decided = False
        self._parts = ThreadPoolExecutor(self.tuning.concurrency, thread_name_prefix="bt-s3")
        # Bytes read for uploads and not yet sent, whatever the number of uploads at once.
        self._memory = ByteBudget(self.tuning.upload_memory)
        self._receivers = threading.local()

    # --- the SDK boundary --------------------------------------------------------------------

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    @property
    def direct(self) -> DirectS3 | None:
        """The direct path for single-object requests and listings, None where botocore does
        them. Where the keys and the region are known without botocore (a secret, or the
        environment), it is built without it: staging from S3 then never imports botocore,
        which costs 0.2 s of every start."""
        with self._lock:
            if not self._direct_decided:
                self._direct = self._make_direct() if self.direct_requests else None
                self._direct_decided = True
            return self._direct

    def _make_direct(self) -> DirectS3 | None:
        region = self.region or self.client.meta.region_name
        endpoint = Endpoint.for_bucket(self.endpoint_url, self.bucket, region)
        keys = self._keys_source()
        if endpoint is None or keys is None:
            return None
        return DirectS3(endpoint, Signer(keys, region), READ_TIMEOUT, self.ca_bundle)

    def _keys_source(self) -> Callable[[], Keys] | None:
        """Where the direct path gets its credentials: the keys given (a secret's, or the
        environment's), else what botocore finds (profile, instance role), refreshed when they
        expire."""
        if self.keys is not None:
            keys = Keys(
                self.keys.access_key_id, self.keys.secret_access_key, self.keys.session_token
            )
            return lambda: keys
        self.client  # noqa: B018 (its session resolves the credentials)
        credentials = self._session.get_credentials()
        if credentials is None:
            return None  # botocore says what is missing

        def current() -> Keys:
            frozen = credentials.get_frozen_credentials()
            return Keys(frozen.access_key, frozen.secret_key, frozen.token)

        return current

    def _make_client(self) -> Any:
        # botocore itself, not boto3: the same client, and 30-40 ms less to import and build,
        # which is most of a warm start.
        import botocore.session
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},  # retried above, with jitter
            max_pool_connections=self.tuning.concurrency * 4,
            connect_timeout=10,
            read_timeout=READ_TIMEOUT,
            # Checksums only where we send them: what R2 and other S3-alikes accept.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={
                # Every request with a body carries our checksum, in a signed header,
                # which the service verifies: signing the payload as well would hash each
                # byte a third time (botocore does so on plain-http endpoints).
                "payload_signing_enabled": False,
                **({"addressing_style": "path"} if self.endpoint_url else {}),
            },
        )
        keys = self.keys
        self._session = botocore.session.get_session()
        # Timestamps stay text: nothing here reads them, and parsing each listed object's
        # LastModified with dateutil costs about 0.1 ms per object.
        self._session.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=str
        )
        client = self._session.create_client(
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

    def _classify(self, key: str, code: str, status: str, message: str) -> Exception:
        """The typed error for an S3 error ``code`` and HTTP ``status``."""
        uri = self.uri(key)
        detail = f"{code or status}: {message}".rstrip(": ")
        if code in _NOT_FOUND or status == "404":
            return NotFoundError(
                f"{uri} does not exist ({detail}); check the bucket and the path", uri
            )
        if code in _DENIED or status in ("401", "403"):
            return AccessDeniedError(
                f"{uri}: access denied ({detail}); check the credentials and the bucket's policy",
                uri,
            )
        if code in _CORRUPT:
            return IntegrityError(f"{uri}: the service rejected the checksum ({detail})", uri)
        if code in _RETRY or status.startswith("5") or status == "429":
            return TransientStoreError(f"{uri}: {detail}", uri)
        return StoreError(f"{uri}: {detail}", uri)

    def _unreachable(self, key: str, why: str) -> TransientStoreError:
        where = self.endpoint_url or "the S3 endpoint"
        return TransientStoreError(f"{self.uri(key)}: cannot reach {where} ({why})", self.uri(key))

    def _error(self, exc: Exception, key: str) -> Exception:
        """The typed error for an exception of botocore or of the direct path."""
        if isinstance(exc, NetworkError):
            return self._unreachable(key, str(exc))
        from botocore import exceptions as bx

        if isinstance(exc, bx.ClientError):
            error = exc.response.get("Error", {})
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            return self._classify(
                key, str(error.get("Code", "")), status, str(error.get("Message", ""))
            )
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return AccessDeniedError(
                f"{self.uri(key)}: no credentials; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or name a secret",
                self.uri(key),
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
            return self._unreachable(key, type(exc).__name__)
        return exc

    def _failed(self, reply: Reply, key: str) -> Exception:
        """The typed error for a direct request's error answer."""
        code, message = reply.error_code()
        if code in _WRONG_REGION:
            return NeedsSDK(code)
        return self._classify(key, code, str(reply.status), message)

    def _call(self, key: str, operation: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            raise self._error(exc, key) from exc

    def _either(self, key: str, direct: Callable[[DirectS3], T], sdk: Callable[[], T]) -> T:
        """One single-object operation: the direct path where it can, else botocore; an
        answer the direct path cannot settle switches this store to botocore for good."""
        client = self.direct
        if client is not None:
            try:
                return direct(client)
            except NeedsSDK:
                self._direct = None
            except NetworkError as exc:
                raise self._error(exc, key) from exc
        return sdk()

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    # --- the core ----------------------------------------------------------------------------

    def _list(self, prefix: str) -> list[ObjectInfo]:
        under = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        return self._either(
            prefix,
            lambda client: self._list_direct(client, prefix, under),
            lambda: self._list_sdk(prefix, under),
        )

    def _list_direct(self, client: DirectS3, prefix: str, under: str) -> list[ObjectInfo]:
        found = []
        query = {
            "list-type": "2",
            "prefix": under,
            "max-keys": str(self.tuning.list_page_size),
            "encoding-type": "url",  # any key survives XML; botocore asks for the same
        }
        while True:
            reply = client.request("GET", "", query=query)
            if reply.status != 200:
                raise self._failed(reply, prefix)
            page = parse_listing(reply.body)
            found += [
                ObjectInfo(relative_key(self.prefix, key), size, etag)
                for key, size, etag in page.objects
            ]
            if page.next_token is None:
                return found
            query["continuation-token"] = page.next_token

    def _list_sdk(self, prefix: str, under: str) -> list[ObjectInfo]:
        found = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=under,
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
        def direct(client: DirectS3) -> ObjectInfo:
            reply = client.request("HEAD", self._key(key))
            if reply.status != 200:
                raise self._failed(reply, key)
            return _object_info(key, reply.headers)

        def sdk() -> ObjectInfo:
            head = self._call(key, "head_object", Key=self._key(key))
            return ObjectInfo(
                key,
                int(head["ContentLength"]),
                head["ETag"].strip('"'),
                head.get("Metadata", {}).get(SHA256_META),
            )

        return self._either(key, direct, sdk)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        span = f"bytes={start}-{start + length - 1}"

        def direct(client: DirectS3) -> bytes:
            reply = client.request("GET", self._key(key), {"range": span})
            if reply.status not in (200, 206):
                raise self._failed(reply, key)
            return reply.body

        def sdk() -> bytes:
            response = self._call(key, "get_object", Key=self._key(key), Range=span)
            try:
                return bytes(response["Body"].read())
            except Exception as exc:
                raise self._error(exc, key) from exc

        return self._either(key, direct, sdk)

    def _download(self, key: str, target: Path, size: int | None) -> Fetched:
        """One streamed GET for objects up to the multipart threshold (its response carries
        the metadata), ranged GETs in parallel above it."""
        fetched = None
        if size is None or size <= self.tuning.multipart_threshold:
            fetched = self._either(
                key,
                lambda client: self._download_direct(client, key, target),
                lambda: self._download_sdk(key, target),
            )
        if fetched is None:  # large (known from the listing, or from the GET's answer)
            info = self._stat(key)
            self._download_ranges(key, target, info.size)
            fetched = Fetched(info.sha256, None)
        return fetched

    def batch_max_size(self) -> int:
        return self.tuning.batch_max_size if self.direct is not None else 0

    def download_batch(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        from bt_agent.storage.s3_batch import BatchGet

        direct = self.direct
        if direct is None:
            raise NotImplementedError("no batch downloads through botocore")
        batch = BatchGet(
            direct,
            self._key,
            lambda item, answer: self.place(item, answer.body, answer.headers.get(META_HEADER)),
            self.tuning.batch_max_size,
        )
        batch.run(wanted, finished)

    def upload_stream(
        self,
        take: Callable[[], Sequence[U] | None],
        finished: Callable[[U, str | Exception], None],
    ) -> None:
        from bt_agent.storage.s3_batch import PutStream

        direct = self.direct
        if direct is None:
            raise NotImplementedError("no upload stream through botocore")

        def headers(sha256: str) -> dict[str, str]:
            return {"x-amz-checksum-sha256": _b64(bytes.fromhex(sha256)), META_HEADER: sha256}

        def check(item: Upload, answer: Answer) -> None:
            if answer.status != 200:
                raise self._failed(Reply(answer.status, answer.headers, answer.body), item.key)

        def told(item: U, outcome: str | Exception) -> None:
            finished(item, self._stream_error(item.key, outcome))

        stream: PutStream[U] = PutStream(
            direct, self._key, headers, check, self._memory, self.tuning.batch_max_size
        )
        stream.run(take, told)

    def _stream_error(self, key: str, outcome: str | Exception) -> str | Exception:
        """A stream's outcome with its error typed; an answer only botocore can follow turns
        the direct path (and with it the stream) off for this store."""
        if isinstance(outcome, NeedsSDK):
            self._direct = None
            return TransientStoreError(f"{self.uri(key)}: {outcome}; retried through botocore")
        return self._error(outcome, key) if isinstance(outcome, Exception) else outcome

    def _download_direct(self, client: DirectS3, key: str, target: Path) -> Fetched | None:
        with client.open("GET", self._key(key)) as response:
            if response.status != 200:
                raise self._failed(Reply(response.status, {}, read(response)), key)
            if int(response.getheader("content-length") or 0) > self.tuning.multipart_threshold:
                return None
            claimed = response.getheader(META_HEADER)
            return Fetched(claimed, _write_chunks(target, iter(lambda: read(response, CHUNK), b"")))

    def _download_sdk(self, key: str, target: Path) -> Fetched | None:
        response = self._call(key, "get_object", Key=self._key(key))
        if int(response["ContentLength"]) > self.tuning.multipart_threshold:
            response["Body"].close()
            return None
        try:
            computed = _write_chunks(target, response["Body"].iter_chunks(CHUNK))
        except OSError:
            raise
        except Exception as exc:
            raise self._error(exc, key) from exc
        return Fetched(response.get("Metadata", {}).get(SHA256_META), computed)

    def _download_ranges(self, key: str, target: Path, size: int) -> None:
        part = self.tuning.part_size_for(size)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
        futures = []
        try:
            os.ftruncate(fd, size)
            writing = threading.Lock()
            futures = [
                self._parts.submit(
                    self._fetch_range, key, fd, start, min(part, size - start), writing
                )
                for start in range(0, size, part)
            ]
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            wait(futures)  # none may write to the descriptor once it is closed
            os.close(fd)

    def _fetch_range(
        self, key: str, fd: int, start: int, length: int, writing: threading.Lock
    ) -> None:
        """One range of the object written at its offset (spliced from the socket where the
        connection is plain TCP, else through a reused buffer: no allocation of the range's
        size per request)."""
        span = Span(fd, start, length, writing)

        def direct(client: DirectS3) -> None:
            headers = {"range": f"bytes={start}-{start + length - 1}"}
            with client.open("GET", self._key(key), headers) as response:
                if response.status not in (200, 206):
                    raise self._failed(Reply(response.status, {}, read(response)), key)
                self._check_range(key, response, span)
                done = self._receiver().receive(response, span, client.splice_timeout)
            self._check_length(key, start, done, length)

        def sdk() -> None:
            data = self._read_range(key, start, length)
            self._check_length(key, start, len(data), length)
            with writing:
                os.pwrite(fd, data, start)

        self._either(key, direct, sdk)

    def _check_range(self, key: str, response: http.client.HTTPResponse, span: Span) -> None:
        """A whole object (200) answers a range only when the range is the whole object: a
        server that ignores ``Range`` must not have the object's start written at an offset."""
        if response.status == 200 and (span.offset or response.length != span.length):
            raise IntegrityError(
                f"{self.uri(key)}: asked for {span.length} bytes from {span.offset}, the server "
                "sent the whole object (it ignores Range requests)",
                self.uri(key),
            )

    def _check_length(self, key: str, start: int, got: int, length: int) -> None:
        if got != length:
            raise TransientStoreError(f"{self.uri(key)}: short read at {start}", self.uri(key))

    def _receiver(self) -> Receiver:
        """This thread's receiver of ranged bodies."""
        receiver: Receiver | None = getattr(self._receivers, "receiver", None)
        if receiver is None:
            receiver = self._receivers.receiver = Receiver()
        return receiver

    def _upload(self, path: Path, key: str) -> str:
        size = path.stat().st_size
        if size <= self.tuning.upload_part_size:
            with self._memory.holding(size):
                data = path.read_bytes()
                digest = hashlib.sha256(data).hexdigest()
                self._put_object(key, data, digest)
            return digest
        return self._upload_parts(path, key, size)

    def _upload_parts(self, path: Path, key: str, size: int) -> str:
        part_size = self.tuning.part_size_for(size, upload=True)
        upload = self._call(
            key, "create_multipart_upload", Key=self._key(key), ChecksumAlgorithm="CRC32"
        )
        upload_id = upload["UploadId"]
        whole = hashlib.sha256()
        futures: list[Future[dict[str, Any]]] = []
        taken: list[int] = []
        failed = threading.Event()  # a part failed: read no more of the file
        try:
            with open(path, "rb") as handle:
                for number in range(1, math.ceil(size / part_size) + 1):
                    taken.append(self._memory.acquire(part_size))  # backpressure
                    if failed.is_set():
                        break
                    data = handle.read(part_size)
                    whole.update(data)
                    future = self._parts.submit(
                        self._put_part, key, upload_id, number, data, taken[-1]
                    )
                    del data  # held by the part until it is sent, then by no one
                    future.add_done_callback(
                        lambda done: failed.set() if _failed_future(done) else None
                    )
                    futures.append(future)
            parts = [future.result() for future in futures]
            self._call(
                key,
                "complete_multipart_upload",
                Key=self._key(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            for future, held in zip(futures, taken, strict=False):
                if future.cancel():
                    self._memory.release(held)  # never started: its worker cannot give it back
            if len(taken) > len(futures):
                self._memory.release(taken[-1])  # read, never submitted
            wait(futures)  # parts being sent end (and give their memory back) before the abort
            self._abort(key, upload_id)
            raise
        return whole.hexdigest()

    def _put_part(
        self, key: str, upload_id: str, number: int, data: bytes, held: int
    ) -> dict[str, Any]:
        try:
            checksum = _b64(zlib.crc32(data).to_bytes(4, "big"))

            def direct(client: DirectS3) -> str:
                reply = client.request(
                    "PUT",
                    self._key(key),
                    {"x-amz-checksum-crc32": checksum},
                    data,
                    {"partNumber": str(number), "uploadId": upload_id},
                )
                if reply.status != 200:
                    raise self._failed(reply, key)
                if "etag" not in reply.headers:  # botocore knows what such a service wants
                    raise NeedsSDK("an UploadPart answer without an ETag")
                return reply.headers["etag"]

            def sdk() -> str:
                response = self._call(
                    key,
                    "upload_part",
                    Key=self._key(key),
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumCRC32=checksum,
                )
                etag: str = response["ETag"]
                return etag

            etag = self._either(key, direct, sdk)
            return {"PartNumber": number, "ETag": etag, "ChecksumCRC32": checksum}
        except BaseException as exc:
            # A failed part's bytes must not live on in its error's frames (each attempt's
            # failed parts would, for as long as the error is kept).
            del data
            raise _without_frames(exc)  # noqa: B904 (the same exception, not a new one)
        finally:
            self._memory.release(held)

    def _abort(self, key: str, upload_id: str) -> None:
        # Best effort: what an abort cannot reach, the bucket's lifecycle rule reclaims.
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id
            )

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        """A small object; ``if_absent`` uses a conditional write (``If-None-Match: *``)."""
        try:
            self._put_object(key, data, hashlib.sha256(data).hexdigest(), if_absent)
        except _Absent:
            return False
        return True

    def _put_object(self, key: str, data: bytes, sha256: str, if_absent: bool = False) -> None:
        """One PUT with the content's checksum, which the service verifies; :class:`_Absent`
        when ``if_absent`` and an object is there already."""
        checksum = _b64(bytes.fromhex(sha256))

        def direct(client: DirectS3) -> None:
            headers = {"x-amz-checksum-sha256": checksum, META_HEADER: sha256}
            if if_absent:
                headers["if-none-match"] = "*"
            reply = client.request("PUT", self._key(key), headers, data)
            if reply.status == 200:
                return
            if if_absent and (reply.status == 412 or reply.error_code()[0] in _CONFLICT):
                raise _Absent
            raise self._failed(reply, key)

        def sdk() -> None:
            extra = {"IfNoneMatch": "*"} if if_absent else {}
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    Body=data,
                    ChecksumSHA256=checksum,
                    Metadata={SHA256_META: sha256},
                    **extra,
                )
            except Exception as exc:
                if if_absent and _precondition_failed(exc):
                    raise _Absent from exc
                raise self._error(exc, key) from exc

        self._either(key, direct, sdk)

    def _copy(self, source: str, key: str) -> None:
        """CopyObject, which keeps the source's metadata (its sha256); above 5 GiB, where S3
        needs a multipart copy, the caller uploads instead."""
        if self._stat(source).size > MAX_COPY_BYTES:
            raise NotImplementedError("objects over 5 GiB are not copied")
        self._call(
            key,
            "copy_object",
            Key=self._key(key),
            CopySource={"Bucket": self.bucket, "Key": self._key(source)},
        )

    def _delete(self, key: str) -> None:
        def direct(client: DirectS3) -> None:
            reply = client.request("DELETE", self._key(key))
            if reply.status not in (200, 204):
                raise self._failed(reply, key)

        self._either(key, direct, lambda: self._call(key, "delete_object", Key=self._key(key)))
