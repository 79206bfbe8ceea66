"""``hf://owner/repo[@revision]``: a Hugging Face Hub repository, read-only; a dataset as
``hf://datasets/owner/repo[@revision]``.

The revision (branch, tag or commit) is resolved to its commit once, the first time it is needed,
and everything after reads at that commit, so a branch that moves mid-staging cannot mix files
of two commits. ``HF_ENDPOINT`` points at another Hub (a mirror, or olah in the tests).

Files come down as huggingface_hub's own downloads fetch them: a file the Hub keeps in Xet
storage through ``hf_xet`` (its chunks many at once, in Rust), any other in one stream that is
taken up where it broke off; for a file kept in LFS (only those can be in Xet storage), its
metadata (a ``HEAD`` of its URL) says which.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from bt_agent.errors import AccessDeniedError, NotFoundError, StoreError, TransientStoreError
from bt_agent.storage.base import Fetched, ObjectInfo, ObjectStore, is_disk_error, is_http_url
from bt_agent.storage.keys import check_key
from bt_agent.storage.tls import connection_cause, tls_error, unknown_host

HUB = "https://huggingface.co"  # where requests go without HF_ENDPOINT
TIMEOUT_SECONDS = 60  # an answer that keeps silent this long is given up (and retried)


class HFStore(ObjectStore):
    def __init__(
        self,
        repo_id: str,
        revision: str = "main",
        token: str | None = None,
        endpoint: str | None = None,
        repo_type: str = "model",
        secret_name: str = "",
    ) -> None:
        """``secret_name``: the spec's secret holding ``token``, named in errors."""
        self.repo_id = repo_id
        self.revision = revision
        self.token = token
        self.secret_name = secret_name
        self.endpoint = endpoint
        self.repo_type = repo_type
        self.url = f"{self.repository}@{revision}"
        self._commit: str | None = None
        self._tree: dict[str, ObjectInfo] | None = None  # at the pinned commit: immutable
        self._lock = threading.Lock()
        self._api: Any = None

    @property
    def api(self) -> Any:
        """huggingface_hub's client; ``HF_ENDPOINT`` that names no http(s) host is an error at
        once (the client would fail each request on it as if the Hub were down)."""
        if self._api is None:
            from huggingface_hub import HfApi

            endpoint = self.endpoint
            if not is_http_url(endpoint or HUB):
                raise StoreError(
                    f"{self.uri()}: HF_ENDPOINT={endpoint!r} is not a Hub's URL; write it as "
                    "https://hf-mirror.example.com",
                    self.uri(),
                )
            self._api = HfApi(endpoint=endpoint, token=self.token or False)
        return self._api

    def _token_hint(self) -> str:
        """What gives access: a token the spec names, or the one it named."""
        if not self.token:
            return (
                "name a secret holding a Hugging Face token that has access to it (the "
                "source's auth_secret_name)"
            )
        named = f"in secret {self.secret_name!r} " if self.secret_name else ""
        return f"check that the token {named}is valid and its account has access to it"

    def _error(self, exc: Exception, key: str = "") -> Exception:
        from huggingface_hub import errors as hx

        uri = self.uri(key)
        if isinstance(exc, StoreError):  # said already
            return exc
        if isinstance(exc, hx.HFValidationError):  # a repository id the Hub cannot have
            return StoreError(f"{uri}: {exc}", uri)
        if isinstance(exc, hx.RevisionNotFoundError):
            return NotFoundError(
                f"{uri}: no revision {self.revision!r} in {self.repo_id}; "
                "check the branch, tag or commit",
                uri,
            )
        if isinstance(exc, hx.GatedRepoError):
            return AccessDeniedError(
                f"{uri}: the repository is gated; accept its terms on its page, then "
                f"{self._token_hint()}",
                uri,
            )
        if isinstance(exc, hx.RepositoryNotFoundError):
            return NotFoundError(
                f"{uri}: no repository {self.repo_id!r} with a revision {self.revision!r}; if "
                f"it is private, {self._token_hint()}",
                uri,
            )
        if isinstance(exc, hx.OfflineModeIsEnabled):
            return StoreError(
                f"{uri}: HF_HUB_OFFLINE is set, so the Hub cannot be asked which commit "
                f"{self.revision!r} is; unset it for the agent (each source is pinned to a commit "
                "it lists, and files it already holds come from the node cache)",
                uri,
            )
        if isinstance(exc, hx.EntryNotFoundError | hx.RemoteEntryNotFoundError):
            return NotFoundError(f"{uri} does not exist", uri)
        if isinstance(exc, hx.HfHubHTTPError):
            status = getattr(exc.response, "status_code", 0) or 0
            if status in (401, 403):
                return AccessDeniedError(
                    f"{uri}: access denied (HTTP {status}); {self._token_hint()}", uri
                )
            if status == 404:
                return NotFoundError(f"{uri} does not exist", uri)
            if status == 429 or status >= 500:
                return TransientStoreError(f"{uri}: HTTP {status}", uri)
            return StoreError(f"{uri}: {exc}", uri)
        if is_disk_error(exc):  # writing the file here: passed as it is, as the other stores do
            return exc
        if xet := self._xet_error(exc, uri):
            return xet
        if refused := tls_error(exc, uri, self.endpoint or HUB):
            return refused
        if unknown := unknown_host(exc, self.endpoint or HUB):
            return StoreError(f"{uri}: {unknown}", uri)
        if (
            isinstance(exc, OSError | ConnectionError | TimeoutError)
            or "httpx" in type(exc).__module__
        ):
            why = connection_cause(exc)
            return TransientStoreError(f"{uri}: cannot reach {self.endpoint or HUB} ({why})", uri)
        return exc

    @property
    def commit(self) -> str:
        """The commit the revision names, resolved once."""
        with self._lock:
            if self._commit is None:
                try:
                    info = self.api.repo_info(
                        self.repo_id, revision=self.revision, repo_type=self.repo_type
                    )
                except Exception as exc:
                    raise self._error(exc) from exc
                self._commit = str(info.sha)
            return self._commit

    @property
    def repository(self) -> str:
        """``hf://owner/name``, or ``hf://datasets/owner/name`` for a dataset: the repository,
        named as huggingface_hub's ``hf://`` file system names it."""
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"hf://{kind}{self.repo_id}"

    def pinned_uri(self) -> str:
        return f"{self.repository}@{self.commit}"

    def identity(self, info: ObjectInfo) -> str:
        """The repository, whatever revision was asked: its files' blob ids are their versions."""
        return self.repository

    def tree(self) -> dict[str, ObjectInfo]:
        """Every file of the repository at the pinned commit, listed once."""
        if self._tree is None:
            commit = self.commit
            try:
                entries = list(
                    self.api.list_repo_tree(
                        self.repo_id, recursive=True, revision=commit, repo_type=self.repo_type
                    )
                )
            except Exception as exc:
                raise self._error(exc) from exc
            tree = {}
            for entry in entries:
                if not hasattr(entry, "size"):
                    continue  # a folder
                lfs = getattr(entry, "lfs", None)
                tree[check_key(entry.path)] = ObjectInfo(
                    entry.path,
                    int(entry.size),
                    entry.blob_id,
                    getattr(lfs, "sha256", None) if lfs else None,
                )
            self._tree = tree
        return self._tree

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [info for key, info in self.tree().items() if key.startswith(prefix)]

    def _stat(self, key: str) -> ObjectInfo:
        info = self.tree().get(key)
        if info is None:
            raise NotFoundError(f"{self.uri(key)} does not exist", self.uri(key))
        return info

    def _xet_error(self, exc: Exception, uri: str) -> StoreError | None:
        """The error of ``hf_xet``'s own kinds, where ``exc`` is one: the Xet token refused, or
        the file gone from Xet storage (its ``ConnectionError`` and ``TimeoutError`` are the
        network's, as any client's)."""
        if type(exc).__module__ != "hf_xet":
            return None
        said = f"{uri}: Xet storage: {exc}"
        if isinstance(exc, PermissionError):
            return AccessDeniedError(f"{said}; {self._token_hint()}", uri)
        if isinstance(exc, FileNotFoundError):
            return NotFoundError(said, uri)
        return None

    def _file_url(self, key: str) -> tuple[str, dict[str, str]]:
        """The URL of ``key`` at the pinned commit, and the headers of a request for it (the
        caller has looked it up: a missing file is NotFoundError before any request)."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils._headers import build_hf_headers

        url = hf_hub_url(
            self.repo_id,
            key,
            revision=self.commit,
            repo_type=self.repo_type,
            endpoint=self.endpoint,
        )
        return url, build_hf_headers(token=self.token or False)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        from huggingface_hub import get_session, hf_raise_for_status

        self._stat(key)
        url, headers = self._file_url(key)
        ranged = {**headers, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            response = get_session().get(url, headers=ranged, timeout=TIMEOUT_SECONDS)
            hf_raise_for_status(response)
        except Exception as exc:
            raise self._error(exc, key) from exc
        data = bytes(response.content)
        return data[start : start + length] if response.status_code == 200 else data

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """The file at the pinned commit into ``target``: from Xet storage where its metadata
        says the Hub keeps it there, else in one stream. Only a file the Hub keeps in LFS (its
        listing gives its sha256) can be in Xet storage: the metadata (a ``HEAD``, a request
        the Hub counts against its rate limits like the download) is asked of those alone, and
        only where ``hf_xet`` can read them. The listing's sha256 is what the file claims: the
        download is checked against it."""
        from huggingface_hub import get_hf_file_metadata
        from huggingface_hub.file_download import http_get, xet_get

        info = self._stat(key)
        url, headers = self._file_url(key)
        try:
            xet = (
                get_hf_file_metadata(url, token=self.token or False, endpoint=self.endpoint)
                if info.sha256 and _xet_available()
                else None
            )
            if xet is not None and xet.xet_file_data is not None:
                try:
                    xet_get(
                        incomplete_path=target,
                        xet_file_data=xet.xet_file_data,
                        headers=headers,
                        expected_size=info.size,
                        displayed_filename=key,
                    )
                except RuntimeError as exc:  # hf_xet's transfer failed after its own retries
                    uri = self.uri(key)
                    raise TransientStoreError(f"{uri}: Xet storage: {exc}", uri) from exc
            else:
                with open(target, "wb") as handle:
                    http_get(url, handle, headers=headers, expected_size=info.size)
        except Exception as exc:
            raise self._error(exc, key) from exc
        return Fetched(claimed_sha256=info.sha256, version=info.version)


def _xet_available() -> bool:
    """Whether Xet storage can be read: ``hf_xet`` installed, and ``HF_HUB_DISABLE_XET`` not
    set (huggingface_hub's own test)."""
    import importlib.util

    from huggingface_hub import constants

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None
