"""``gs://bucket/prefix``: google-cloud-storage, imported only when a store is opened.

Uploads send crc32c, which the service verifies; downloads are checked against it by the
library. ``STORAGE_EMULATOR_HOST`` points at an emulator (anonymous credentials there). Its
client is requests', which trusts the CA of ``REQUESTS_CA_BUNDLE`` (a TLS-inspecting proxy's);
every request is tried once by the library, and retried by the caller's policy.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bt_agent.errors import (
    AccessDeniedError,
    IntegrityError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from bt_agent.storage.base import Fetched, HashingReader, ObjectInfo, ObjectStore, is_http_url
from bt_agent.storage.keys import join_key, relative_key
from bt_agent.storage.tls import connection_cause, tls_error, unknown_host

MiB = 1024 * 1024
GCS_ENDPOINT = "https://storage.googleapis.com"
TOKEN_URI = "https://oauth2.googleapis.com/token"  # where a key that names none gets its tokens
CA_VARIABLE = "REQUESTS_CA_BUNDLE"  # the CAs requests trusts, where not its own (certifi's)


class GCSStore(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        service_account: dict[str, Any] | None = None,
        secret_name: str = "",
        emulator_host: str | None = None,
        chunk_size: int = 16 * MiB,
        list_page_size: int = 1000,
    ) -> None:
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.service_account = service_account
        self.secret_name = secret_name  # the spec's secret holding ``service_account``
        self.emulator_host = emulator_host
        self.chunk_size = chunk_size
        self.list_page_size = list_page_size
        self._bucket: Any = None
        self._lock = threading.Lock()

    @property
    def bucket(self) -> Any:
        with self._lock:
            if self._bucket is None:
                self._bucket = self._make_client().bucket(self.bucket_name)
            return self._bucket

    def close(self) -> None:
        with self._lock:
            if self._bucket is not None:
                self._bucket.client.close()
                self._bucket = None

    def _make_client(self) -> Any:
        from google.cloud import storage

        if self.emulator_host:
            from google.auth.credentials import AnonymousCredentials

            anonymous = AnonymousCredentials()  # type: ignore[no-untyped-call]
            return storage.Client(
                project="bt-agent",
                credentials=anonymous,
                client_options={"api_endpoint": self.endpoint},
            )
        if self.service_account is not None:
            return storage.Client(
                project=self.service_account.get("project_id"),
                credentials=self._service_account_credentials(self.service_account),
            )
        return storage.Client()

    @property
    def endpoint(self) -> str:
        """Where requests go: the emulator's address, else Google's."""
        return self._emulator_url(self.emulator_host) if self.emulator_host else GCS_ENDPOINT

    def _emulator_url(self, host: str) -> str:
        """``STORAGE_EMULATOR_HOST`` as a URL (``host:port`` is ``http://host:port``, as
        Google's Go client reads it); an error at once where it names no host."""
        url = host if "://" in host else f"http://{host}"
        if is_http_url(url):
            return url
        raise StoreError(
            f"{self.uri()}: STORAGE_EMULATOR_HOST={host!r} is not an emulator's address; write "
            "it as http://localhost:4443",
            self.uri(),
        )

    def _service_account_credentials(self, info: dict[str, Any]) -> Any:
        """The credentials of a service account's JSON key; an error naming the secret (never
        its content) where google-auth cannot use it."""
        from google.auth import exceptions as auth
        from google.oauth2 import service_account

        try:
            load = service_account.Credentials.from_service_account_info
            return load(info)  # type: ignore[no-untyped-call]
        except (ValueError, KeyError, auth.GoogleAuthError) as exc:
            reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc).split(".")[0]
            raise AccessDeniedError(
                f"{self.uri()}: secret {self.secret_name!r} is not a usable service account key "
                f"({reason}); give the JSON key file that Google Cloud's console downloads",
                self.uri(),
            ) from None

    def _error(self, exc: Exception, key: str) -> Exception:
        from google.api_core import exceptions as gx
        from google.auth.exceptions import DefaultCredentialsError, RefreshError
        from google.resumable_media.common import DataCorruption

        uri = self.uri(key)
        if isinstance(exc, gx.NotFound):
            return NotFoundError(f"{uri} does not exist; check the bucket and the path", uri)
        if isinstance(exc, gx.Forbidden | gx.Unauthorized):
            return AccessDeniedError(
                f"{uri}: access denied ({exc.code}); check the service "
                "account and the bucket's permissions",
                uri,
            )
        if isinstance(exc, DataCorruption):
            return IntegrityError(f"{uri}: checksum mismatch ({exc})", uri)
        if isinstance(exc, gx.TooManyRequests | gx.ServerError | gx.RetryError):
            return TransientStoreError(f"{uri}: {exc}", uri)
        if isinstance(exc, gx.GoogleAPICallError):
            return StoreError(f"{uri}: {exc}", uri)
        if isinstance(exc, RefreshError) and not exc.retryable:  # the key, not the network
            said = exc.args[0] if exc.args and isinstance(exc.args[0], str) else "no reason given"
            return AccessDeniedError(
                f"{uri}: Google refused the service account's credentials ({said.rstrip('.')}); "
                "check that its key is current (not deleted or disabled)",
                uri,
            )
        if refused := tls_error(exc, uri, self.endpoint, CA_VARIABLE):
            return refused
        if isinstance(exc, DefaultCredentialsError):  # nothing to wait for
            said = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
            if said and not said.startswith("Your default credentials were not found"):
                return AccessDeniedError(  # a key file named: google-auth says what is wrong
                    f"{uri}: the Google credentials cannot be loaded ({said.rstrip('.')}); point "
                    "GOOGLE_APPLICATION_CREDENTIALS at a service account's JSON key, or name a "
                    "secret holding one (auth_secret_name)",
                    uri,
                )
            return AccessDeniedError(
                f"{uri}: no Google credentials; name a secret holding a service account's JSON "
                "key (auth_secret_name), or set GOOGLE_APPLICATION_CREDENTIALS",
                uri,
            )
        if isinstance(exc, ConnectionError | TimeoutError) or type(exc).__module__.startswith(
            ("requests", "urllib3", "google.auth.exceptions")
        ):
            auth = type(exc).__module__.startswith("google.auth")  # a token asked for, not GCS
            token_uri = (self.service_account or {}).get("token_uri", TOKEN_URI)
            if unknown := unknown_host(exc, token_uri if auth else self.endpoint):
                return StoreError(f"{uri}: {unknown}", uri)
            where = "Google's token service" if auth else self.endpoint
            why = connection_cause(exc)
            return TransientStoreError(f"{uri}: cannot reach {where} ({why})", uri)
        return exc

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        full = self._key(prefix)  # the prefix with its slash, for ""
        try:
            blobs = list(
                self.bucket.client.list_blobs(
                    self.bucket_name, prefix=full, page_size=self.list_page_size, retry=None
                )
            )
        except Exception as exc:
            raise self._error(exc, prefix) from exc
        return [
            ObjectInfo(
                relative_key(self.prefix, b.name),
                int(b.size),
                str(b.generation),
                (b.metadata or {}).get("sha256"),
            )
            for b in blobs
        ]

    def _blob(self, key: str) -> Any:
        try:
            blob = self.bucket.get_blob(self._key(key), retry=None)
        except Exception as exc:
            raise self._error(exc, key) from exc
        if blob is None:
            raise NotFoundError(f"{self.uri(key)} does not exist", self.uri(key))
        return blob

    def _stat(self, key: str) -> ObjectInfo:
        blob = self._blob(key)
        return ObjectInfo(
            key, int(blob.size), str(blob.generation), (blob.metadata or {}).get("sha256")
        )

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        blob = self.bucket.blob(self._key(key))
        try:
            return bytes(
                blob.download_as_bytes(
                    start=start, end=start + length - 1, checksum=None, retry=None
                )
            )
        except Exception as exc:
            raise self._error(exc, key) from exc

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """The object's current generation, which must be the one listed, read whole."""
        blob = self._blob(key)
        self.check_version(key, expected, str(blob.generation))
        try:
            blob.download_to_filename(str(target), checksum="crc32c", retry=None)
        except Exception as exc:
            raise self._error(exc, key) from exc
        return Fetched((blob.metadata or {}).get("sha256"), None, str(blob.generation))

    def _upload(self, path: Path, key: str) -> str:
        blob = self.bucket.blob(self._key(key), chunk_size=self.chunk_size)
        try:
            with open(path, "rb") as handle:
                reader = HashingReader(handle)
                blob.upload_from_file(
                    reader, size=path.stat().st_size, checksum="crc32c", retry=None
                )
        except Exception as exc:
            raise self._error(exc, key) from exc
        return reader.digest.hexdigest()

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        from google.api_core import exceptions as gx

        blob = self.bucket.blob(self._key(key))
        try:
            blob.upload_from_string(
                data, checksum="crc32c", retry=None, if_generation_match=0 if if_absent else None
            )
        except gx.PreconditionFailed:
            return False
        except Exception as exc:
            raise self._error(exc, key) from exc
        return True

    def _copy(self, source: str, key: str) -> None:
        try:
            self.bucket.copy_blob(self._blob(source), self.bucket, self._key(key), retry=None)
        except Exception as exc:
            raise self._error(exc, source) from exc

    def _delete(self, key: str) -> None:
        try:
            self.bucket.blob(self._key(key)).delete(retry=None)
        except Exception as exc:
            error = self._error(exc, key)
            if not isinstance(error, NotFoundError):
                raise error from exc
