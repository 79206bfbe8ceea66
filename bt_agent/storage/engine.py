"""Object stores on obstore, the Python face of the Rust ``object_store`` crate (DataFusion's,
Polars', delta-rs'): signing, TLS, connection pooling, retries with backoff and multipart
uploads all happen in its core, outside the GIL. Each backend (:mod:`s3`, :mod:`azure`) says how
its engine is built and where its credentials come from; everything else is here, once.

What the engine cannot know stays here: each upload's sha256, computed once while reading and
stored as the object's ``sha256`` metadata where it is known before the first byte is sent
(below the multipart size); ranged downloads in parallel, written at their offsets; batches of
small objects, many in flight; and its errors turned into the typed errors of
:mod:`bt_agent.errors` (:mod:`engine_errors`), a certificate that cannot be trusted among them (a
clear error at once, never an outage to wait out).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from bt_agent.errors import (
    KeyRefusedError,
    StoreError,
    TransientStoreError,
)
from bt_agent.spec.urls import CONTROL
from bt_agent.storage.base import (
    Fetched,
    Finished,
    ObjectInfo,
    ObjectStore,
    U,
    Wanted,
    is_http_url,
)
from bt_agent.storage.engine_errors import answers_tls, first_line, typed_error
from bt_agent.storage.flight import (
    DaemonLoop,
    DaemonPool,
    InFlight,
    Pace,
    in_task_group,
    wait_all,
)
from bt_agent.storage.keys import join_key, relative_key
from bt_agent.storage.ranges import Ranged

if TYPE_CHECKING:
    import asyncio

    from obstore import GetOptions
    from obstore.store import ClientConfig, RetryConfig

#: One object of a batch download: its body (or why there is none) and what its answer said.
_Fetched = tuple[Wanted, memoryview | Exception, Fetched]
MiB = 1024 * 1024
WRITE_PIECE = 64 * 1024  # the most a download's one write puts into its file
MAX_PARTS = 10_000
SHA256_META = "sha256"
#: The engine's own retries of one request (ours, with their longer backoff, come on top).
ENGINE_RETRIES: RetryConfig = {
    "max_retries": 2,
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)},
    "retry_timeout": timedelta(seconds=30),
}


@dataclass(frozen=True)
class Tuning:
    """Transfer settings. Part sizes grow for very large files to stay under 10,000 parts.

    Multipart uploads hold file content in memory, a part per request in flight and one being
    read: at most ``multipart_uploads`` of them run at once per store, whatever the number of
    callers (the checkpoint sidecar uploads many files at a time, beside training), so they
    hold at most ``multipart_uploads x (upload_concurrency + 1) x upload_part_size`` bytes.
    Two uploads of fewer parts each keep the store busier than one of as many parts in all:
    one upload's parts are read and hashed one after another, and its completion waits on the
    store.

    Large downloads come in ranges of ``part_size``, ``ranges`` at once per store over all its
    downloads, each body joined by the engine into pieces of at least ``piece`` bytes (gathered
    on its threads, copied into a Python object under the interpreter's lock), each written at
    its offset as it comes. Over TLS they run on the store's event loop, where the engine reads
    the body on its own threads: a thread waiting on its sync face is woken for every piece the
    connection hands over, and over TLS that is each record of 16 KiB. Over plain HTTP the
    connection's pieces are large, and threads of the store's own, waiting on the sync face,
    cost less than the loop's one thread writing every piece. A store far away paces each
    connection and makes each request wait for its first byte, so long ranges, many at once,
    take the most from it; ranges read whole (a buffer of the range's size each) would fit in
    memory only short and few. They hold about ``ranges x 2 x piece`` bytes per store (the piece
    being written, and the engine joining the next).

    Small objects go many at once: a store far away makes each request wait on its round
    trip, not on bandwidth, so the number in flight sets the pace (:class:`Pace`). The bodies
    an upload stream holds (in flight, or read and not yet stored) stay within
    ``batch_bytes``; those of a batch download (in flight, or fetched and not yet placed)
    within ``batch_get_bytes``, half as much: a GET holds its body about twice while it comes
    (the connection's read buffer, which grows to a few hundred KiB over plain HTTP, and the
    body joined from it), and with a hundred connections at once on a machine of many cores
    that was the agent's peak memory."""

    multipart_threshold: int = 16 * MiB  # downloads above this: parallel ranged GETs
    part_size: int = 32 * MiB  # the range of each
    ranges: int = 24  # ranges at once per store, over all its downloads
    piece: int = 512 * 1024  # ... each handed over by the engine in pieces of this size
    upload_part_size: int = 8 * MiB  # uploads above this: multipart, in parts of this size
    upload_concurrency: int = 4  # parts in flight per multipart upload
    multipart_uploads: int = 2  # multipart uploads at once per store (others wait their turn)
    list_page_size: int = 1000
    batch_max_size: int = MiB  # objects up to this size may be fetched in batches
    batch_gets_from: int = 32  # GETs at once in a batch download, at first
    batch_gets: int = 128  # ... at most, while more go faster
    batch_puts_from: int = 32  # PUTs at once in an upload stream, at first
    batch_puts: int = 128  # ... at most, while more go faster
    batch_bytes: int = 32 * MiB  # bodies held at most at once by an upload stream
    batch_get_bytes: int = 16 * MiB  # ... by a batch download (each held twice as it comes)
    read_timeout: float = 60.0  # seconds an answer may go silent before its request is retried

    def part_size_for(self, size: int, base: int) -> int:
        """``base``, or more where ``size`` would need more than 10,000 parts of it."""
        needed = math.ceil(size / (MAX_PARTS - 1))
        return max(base, math.ceil(needed / MiB) * MiB)


@dataclass(frozen=True)
class Proxies:
    """The proxies of the standard variables, as curl and botocore read them: one for each
    scheme of the endpoint, and the hosts that go direct (``NO_PROXY``'s list)."""

    https: str | None = None
    http: str | None = None
    excludes: str | None = None

    def for_endpoint(self, endpoint: str | None) -> str | None:
        """The proxy for requests to ``endpoint`` (None: the service's own, over https)."""
        return self.http if endpoint and endpoint.startswith("http://") else self.https


class EngineStore(ObjectStore):
    """A store whose requests obstore makes. ``endpoint_url`` and ``ca_variable`` name, in
    errors, where requests go and how to trust its certificate."""

    #: The largest object the service copies in one request (None: no limit).
    max_copy_bytes: int | None = None
    ca_variable = "SSL_CERT_FILE"
    container_noun = "bucket"  # what the service calls the place objects are kept in
    credentials_hint = "name a secret holding them"  # where else credentials can come from
    #: Whose token the engine asks for where it was given no credentials, in errors.
    token_identity = "the machine's managed identity"
    #: Where else a container the endpoint does not hold may be (``; ...``), said where the
    #: service says it has no such container, or refuses a request (as R2 does some).
    missing_hint = ""
    #: How an object in an archive is read (S3's Glacier classes), said where a read finds one.
    archived_hint = "restore it (aws s3api restore-object) or copy it to a class read at once"

    def __init__(
        self,
        prefix: str,
        url: str,
        endpoint_url: str | None,
        tuning: Tuning | None,
        ca_bundle: str | None = None,
        proxies: Proxies | None = None,
        ca_variable: str | None = None,
    ) -> None:
        self.prefix = prefix.strip("/")
        self.url = url
        self.endpoint_url = endpoint_url
        self.ca_bundle = ca_bundle  # a PEM file of CAs trusted beside the system's
        if ca_variable:  # the variable that named it, where another than the backend's
            self.ca_variable = ca_variable
        self.proxies = proxies
        self.tuning = tuning or Tuning()
        self._engine: Any = None
        self._lock = threading.Lock()
        self._pools: dict[str, DaemonPool] = {}  # by name: batch downloads, upload streams
        self._loop: DaemonLoop | None = None  # ranged downloads
        self._uploading = threading.Condition()  # notified as a multipart upload ends, or a halt
        self._uploads = 0  # multipart uploads under way in the engine
        self._tls_only: bool | None = None  # whether the http:// endpoint takes TLS only
        self._ranged_now: dict[Path, Ranged] = {}  # by partial file: what is written, for a retry
        self._halted = threading.Event()  # the process is stopping: ranges and uploads end (halt)

    @abstractmethod
    def _make_engine(self) -> Any:
        """obstore's store for this backend (its credentials resolved)."""

    @property
    def engine(self) -> Any:
        """obstore's store, built at first use. Settings it refuses (a malformed key, an
        endpoint that is no URL) are a :class:`StoreError` naming the store: no request was
        made, and none would go better for waiting."""
        with self._lock:
            if self._engine is None:
                self._engine = self._checked_engine()
            return self._engine

    def _checked_engine(self) -> Any:
        """:meth:`_make_engine`'s store, and its endpoint checked."""
        from obstore import exceptions as engine

        try:
            made = self._make_engine()
        except (engine.BaseError, ValueError) as exc:
            raise StoreError(
                f"{self.uri()}: its settings are refused ({first_line(str(exc))}); check its "
                "credentials and endpoint",
                self.uri(),
            ) from None
        self._check_endpoint()
        return made

    def _check_endpoint(self) -> None:
        """The endpoint, once known, is an http(s) URL of a host (the engine takes any text,
        and fails each request on it as if the service were down)."""
        endpoint = self.endpoint_url
        if endpoint is None or is_http_url(endpoint):
            return
        raise StoreError(
            f"{self.uri()}: the endpoint {endpoint!r} is not an http:// or https:// URL; fix "
            "the variable or profile setting that names it (e.g. https://storage.example.com)",
            self.uri(),
        )

    @property
    def plain_http(self) -> bool:
        """Whether requests go over plain HTTP (an ``http://`` endpoint), not TLS."""
        return bool(self.endpoint_url and self.endpoint_url.startswith("http://"))

    def _client_options(self) -> ClientConfig:
        """Timeouts, plain HTTP where the endpoint asks for it, ``ca_bundle`` and the proxy. A
        connection that goes silent mid-answer (stalled: no error, no byte) is given up after
        ``Tuning.read_timeout`` and the request retried, as botocore's read timeout does,
        rather than after the whole request's limit."""
        options: ClientConfig = {
            "connect_timeout": timedelta(seconds=10),
            "read_timeout": timedelta(seconds=self.tuning.read_timeout),
            "timeout": timedelta(seconds=300),
            "allow_http": self.plain_http,
        }
        if self.ca_bundle:
            options["root_certificate"] = self._root_certificate(self.ca_bundle)
        if proxy := self.proxy():
            options["proxy_url"] = proxy
            if self.proxies and self.proxies.excludes:
                options["proxy_excludes"] = self.proxies.excludes
        return options

    def _root_certificate(self, ca_bundle: str) -> bytes:
        """The PEM file ``ca_bundle``; an error naming its variable where it cannot be read or
        holds no certificate."""
        try:
            pem = Path(ca_bundle).read_bytes()
        except OSError as exc:
            problem = f"cannot read {self.ca_variable}={ca_bundle} ({exc.strerror})"
        else:
            if b"-----BEGIN CERTIFICATE-----" in pem:
                return pem
            problem = f"{self.ca_variable}={ca_bundle} holds no PEM certificate"
        raise StoreError(
            f"{self.uri()}: {problem}; point it at the PEM file of the endpoint's CA", self.uri()
        )

    def proxy(self) -> str | None:
        """The proxy of requests to the endpoint, where one is set: a URL of a host (``host:port``
        is ``http://host:port``, as curl reads it), else an error (which does not show it: a
        proxy's URL may hold a password)."""
        proxy = self.proxies.for_endpoint(self.endpoint_url) if self.proxies else None
        if proxy and "://" not in proxy:
            proxy = f"http://{proxy}"
        if not proxy or urlsplit(proxy).hostname:
            return proxy
        raise StoreError(
            f"{self.uri()}: the proxy set for it (HTTPS_PROXY, HTTP_PROXY or ALL_PROXY) is not "
            "a URL; write it as http://proxy.example.com:3128",
            self.uri(),
        )

    def close(self) -> None:
        with self._lock:
            self._engine = None
            for pool in self._pools.values():
                pool.shutdown()
            self._pools.clear()
            if self._loop is not None:
                self._loop.shutdown()
                self._loop = None

    def halt(self) -> None:
        with self._lock:
            self._halted.set()
            if self._loop is not None:
                self._loop.cancel()
        with self._uploading:  # the uploads waiting their turn end now
            self._uploading.notify_all()

    def _check_halted(self, key: str, what: str = "download") -> None:
        if self._halted.is_set():
            raise InterruptedError(f"{self.uri(key)}: the {what} was stopped")

    @contextlib.contextmanager
    def _upload_turn(self, key: str) -> Iterator[None]:
        """A multipart upload's turn in the engine (``Tuning.multipart_uploads`` at once per
        store), counted while it is under way; one halted while it waits does not begin."""
        most = self.tuning.multipart_uploads
        with self._uploading:
            self._uploading.wait_for(lambda: self._uploads < most or self._halted.is_set())
            self._check_halted(key, "upload")
            self._uploads += 1
        try:
            yield
        finally:
            with self._uploading:
                self._uploads -= 1
                self._uploading.notify_all()

    def wait_uploads(self) -> bool:
        with self._uploading:
            were = self._uploads > 0
            self._uploading.wait_for(lambda: self._uploads == 0)
        return were

    def engine_threads(self) -> list[int]:
        """The engine's runtime (tokio's threads: one runtime per process, shared by every
        store), which Python did not start: every thread of the process it does not know of.
        Where no request has started the runtime yet, it is started here, without a request
        leaving the process, so that its threads inherit the calling thread's scheduling."""
        import obstore
        from obstore.store import MemoryStore

        with contextlib.suppress(FileNotFoundError):
            obstore.head(MemoryStore(), "runtime")
        python = {thread.native_id for thread in threading.enumerate()}
        try:
            native = [int(tid) for tid in os.listdir("/proc/self/task")]
        except OSError:  # no /proc: not Linux, where threads have no priority of their own
            return []
        return [tid for tid in native if tid not in python]

    def _event_loop(self) -> DaemonLoop:
        """The store's event loop for ranged downloads, started at first use."""
        with self._lock:
            if self._loop is None:
                self._loop = DaemonLoop("bt-ranges", self.tuning.ranges)
            return self._loop

    def _pool(self, name: str, size: int) -> DaemonPool:
        """The store's pool of ``size`` threads called ``name``, started at first use."""
        with self._lock:
            if name not in self._pools:
                self._pools[name] = DaemonPool(size, name)
            return self._pools[name]

    def _flight(self, name: str, least: int, most: int, budget: int) -> InFlight[Any]:
        """Calls on the store's pool ``name``, from ``least`` up to ``most`` at once as
        :class:`Pace` finds worth it, their objects within ``budget`` bytes."""
        pool = self._pool(name, most)
        return InFlight(pool, Pace(least, most), budget, self.tuning.batch_max_size)

    def _key(self, key: str) -> str:
        """The engine's name of ``key``; :class:`KeyRefusedError` for one it cannot send (a
        control character in it: a tab, a line break)."""
        if control := CONTROL.search(key):
            raise KeyRefusedError(
                f"refusing object key {key!r}: it holds a control character "
                f"({control.group(0)!r}), which no name in {self.uri()} may hold; rename the file",
                self.uri(key),
            )
        return join_key(self.prefix, key)

    # --- errors --------------------------------------------------------------------------------

    def _error(self, exc: Exception, key: str) -> Exception:
        """The typed error for one of the engine's (:mod:`engine_errors`)."""
        return typed_error(self, exc, key)

    def own_endpoint(self) -> str:
        """Where requests go that the engine finds itself (no ``endpoint_url``), in errors."""
        return "the service"

    def access_hint(self) -> str:
        """What to check where the service refused a request."""
        return f"check the credentials and the {self.container_noun}'s policy"

    def other_region(self, region: str | None) -> str:
        """What to do where the service says the bucket is in another region (``region``,
        where it names it)."""
        return f"the service says the bucket is in another region ({region or 'not named'})"

    def route(self, where: str) -> str:
        """``where``, and the proxy its requests go through where one is set (and no
        ``NO_PROXY`` list may exempt it), without a user or password its URL holds."""
        proxy = self.proxy()
        if not proxy or (self.proxies and self.proxies.excludes):
            return where
        parts = urlsplit(proxy)
        port = f":{parts.port}" if parts.port else ""
        return f"{where} through the proxy {parts.scheme}://{parts.hostname}{port}"

    def looked_up(self, asked: str) -> tuple[str, bool]:
        """The host name that did not resolve for a request to the URL ``asked``, and whether
        it is the proxy's (which carries the requests and looks the endpoint up itself; where
        a ``NO_PROXY`` list may have sent the request direct, the resolver is asked which)."""
        from bt_agent.storage.tls import has_no_name  # the standard library's ssl: on failure only

        host = urlsplit(asked).hostname or asked
        proxy = self.proxy()
        if not proxy or (self.proxies and self.proxies.excludes and has_no_name(host)):
            return host, False
        return urlsplit(proxy).hostname or proxy, True

    def takes_tls_only(self) -> bool:
        """Whether the endpoint, written ``http://``, is a server of TLS only: asked once, by
        a handshake of its own, where a request went wrong without a word of why (not where
        a proxy carries the requests, which the handshake would not go through)."""
        endpoint = self.endpoint_url
        if self._tls_only is None:
            direct = self.plain_http and not self.proxy()
            self._tls_only = bool(endpoint and direct and answers_tls(endpoint))
        return self._tls_only

    def _engine_call(self, key: str, call: Callable[[Any], Any]) -> Any:
        try:
            return call(self.engine)
        except Exception as exc:
            raise self._error(exc, key) from None

    # --- the core ------------------------------------------------------------------------------

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [info for page in self._list_pages(prefix) for info in page]

    def _list_pages(self, prefix: str) -> Iterator[list[ObjectInfo]]:
        """Listings go by path segments in the engine: the directory of ``prefix`` is listed
        and what does not start with it is left out. A prefix that ends inside a name starts
        the listing just before it, and ends it at the first name of that directory past it
        (names of one directory come in order, on stores that keep directories too)."""
        import obstore

        under = self._key(prefix) if prefix else ""
        directory = under.rpartition("/")[0] if not under.endswith("/") else under.rstrip("/")
        if not prefix and self.prefix:
            directory = self.prefix
        within_name = bool(under) and not under.endswith("/")
        names_from = len(directory) + 1 if directory else 0
        pages = iter(
            obstore.list(
                self.engine,
                prefix=directory or None,
                offset=under[:-1] if within_name and under[:-1] else None,
                chunk_size=self.tuning.list_page_size,
            )
        )
        while (page := self._engine_call(prefix, lambda _: next(pages, None))) is not None:
            found = []
            for item in page:
                path = item["path"]
                if path.startswith(under) and path != self.prefix:  # not the prefix's folder
                    key = relative_key(self.prefix, path)
                    found.append(ObjectInfo(key, item["size"], _version(item)))
                elif within_name and path > under and "/" not in path[names_from:]:
                    yield found
                    return  # past every name that starts with the prefix
            yield found

    def _read(self, key: str) -> bytes:
        import obstore

        result = self._engine_call(key, lambda engine: obstore.get(engine, self._key(key)))
        return bytes(self._engine_call(key, lambda _: result.bytes()))

    def _stat(self, key: str) -> ObjectInfo:
        import obstore

        head = self._engine_call(
            key, lambda engine: obstore.get(engine, self._key(key), options={"head": True})
        )
        return _info(key, head.meta, head.attributes)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        import obstore

        data = self._engine_call(
            key,
            lambda engine: obstore.get_range(engine, self._key(key), start=start, length=length),
        )
        return bytes(data)

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        """One streamed GET for objects up to the multipart threshold (its answer carries the
        metadata), ranged GETs in parallel above it; each asks for the version listed where
        there is one (``If-Match``), so another version there fails at once."""
        import obstore

        if expected is not None and expected.size > self.tuning.multipart_threshold:
            info = self._stat(key)
            self.check_version(key, expected, info.version)
            return self._download_ranges(target, info)
        options = _get_options(expected.version if expected is not None else None)
        result = self._engine_call(
            key, lambda engine: obstore.get(engine, self._key(key), options=options)
        )
        info = _info(key, result.meta, result.attributes)
        if info.size > self.tuning.multipart_threshold:
            return self._download_ranges(target, info)
        digest = hashlib.sha256()
        with open(target, "wb") as handle:
            for chunk in self._chunks(key, result):
                digest.update(chunk)
                handle.write(chunk)
        return Fetched(info.sha256, digest.hexdigest(), info.version)

    def _chunks(self, key: str, result: Any, pinned: ObjectInfo | None = None) -> Iterator[Any]:
        """The body of a GET in the pieces the engine joins (``Tuning.piece``), the engine's
        errors typed (the caller's own, writing them, pass as they are); none where the answer
        is of a version other than ``pinned``'s (a server that ignores ``If-Match``). The answer
        is let go of as it ends, however it ends (:meth:`_body_async`)."""
        found = _version(result.meta)
        stream = iter(result.stream(min_chunk_size=self.tuning.piece))
        del result
        try:
            self.check_version(key, pinned, found)
            while True:
                try:
                    chunk = next(stream)
                except StopIteration:
                    return
                except Exception as exc:
                    raise self._error(exc, key) from None
                yield chunk
        finally:
            del stream

    def _download_ranges(self, target: Path, info: ObjectInfo) -> Fetched:
        """Ranges in parallel (:class:`Tuning`), each asked of the version ``info`` names
        (``If-Match``), so all are of one, and written at its offset into ``target``, made the
        object's size first: on the store's range threads over plain HTTP, on its event loop
        over TLS. At a failure, or where the caller is interrupted, no more ranges start and
        those under way stop at their next piece; the error is raised once none is in flight
        (no request of the engine may still be out when the caller goes on, or the interpreter
        ends). Each range writes through a descriptor of its own, closed as it ends: one the
        caller stopped waiting for (a second Ctrl-C) writes nowhere else. A retry of the same
        download (the same partial file, the object at the same version), in this process or,
        by the record beside the partial file (:mod:`ranges`), in another, fetches only the
        bytes the attempts before did not write."""
        self._check_halted(info.key)
        job = self._ranged(target, info)
        if not job.begun:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, info.size)
            finally:
                os.close(fd)
        try:
            if self.plain_http:
                self._ranges_on_threads(job)
            else:
                self._ranges_on_loop(job)
        except BaseException:
            job.save()
            raise
        with self._lock:
            self._ranged_now.pop(target, None)
        return Fetched(info.sha256, None, info.version)

    def _ranged(self, target: Path, info: ObjectInfo) -> Ranged:
        """The download of ``info`` into ``target``, with what an earlier attempt at it wrote
        (the object at the same version and size, in ranges of the same size), to be kept: in
        this process, or as the record beside ``target`` says. What was kept for partial files
        now gone (their downloads ended) is let go here."""
        part = self.tuning.part_size_for(info.size, self.tuning.part_size)
        with self._lock:
            for gone in [path for path in self._ranged_now if not path.exists()]:
                del self._ranged_now[gone]
            earlier = self._ranged_now.get(target)
            if earlier is None or (earlier.info, earlier.part) != (info, part) or not info.version:
                earlier = self._ranged_now[target] = Ranged.taken_up(target, info, part)
            return earlier

    def _ranges_on_threads(self, job: Ranged) -> None:
        """Over plain HTTP the connection hands over large pieces, so threads waiting on the
        engine's sync face are woken seldom, and cost less than an event loop's one thread
        writing every piece. The pool is asked for each download: a store closed meanwhile
        starts anew."""
        pool = self._pool("bt-ranges", self.tuning.ranges)
        stop = threading.Event()
        fetch = partial(self._fetch_range, job, stop)
        wait_all([pool.submit(partial(fetch, *at)) for at in job.to_fetch()], stop.set)

    def _fetch_range(
        self, job: Ranged, stop: threading.Event, start: int, first: int, end: int
    ) -> None:
        """The range from ``start`` (``first`` up to ``end``) on a thread that waits on the
        engine's sync face for each piece; it ends at the next piece once ``stop`` is set
        (another range failed, or the caller stopped)."""
        import obstore

        if stop.is_set():
            return
        self._check_halted(job.info.key)
        options = _range_options(job, first, end)
        get = partial(obstore.get, path=self._key(job.info.key), options=options)
        answer = partial(self._engine_call, job.info.key, get)
        offset = first
        with _range_writer(job.target) as fd:
            for piece in self._chunks(job.info.key, answer(), job.info):
                if stop.is_set():
                    return
                self._check_halted(job.info.key)
                offset += _write_at(fd, memoryview(piece), offset)
                job.wrote(start, offset)
        self._whole(job, first, end, offset)

    def _ranges_on_loop(self, job: Ranged) -> None:
        """Over TLS the connection hands over each record (16 KiB): a thread waiting on the
        sync face would be woken for every one. On the store's event loop the engine joins
        them into pieces on its own threads; the loop's thread is woken once a piece."""
        engine = self.engine
        loop = self._event_loop()
        try:
            loop.run(lambda: self._fetch_ranges(engine, job, loop.room))
        except CancelledError:  # by halt
            self._check_halted(job.info.key)
            raise

    async def _fetch_ranges(self, engine: Any, job: Ranged, room: asyncio.Semaphore) -> None:
        """The ranges ``job`` lacks, as many at once as ``room`` lets the store's downloads
        have; at the first failure the others are cancelled, and its error raised once all
        have ended."""

        async def one(start: int, first: int, end: int) -> None:
            async with room:
                await self._fetch_range_async(engine, job, start, first, end)

        await in_task_group([one(*at) for at in job.to_fetch()])

    async def _fetch_range_async(
        self, engine: Any, job: Ranged, start: int, first: int, end: int
    ) -> None:
        """One range on the event loop, the engine reading its body on its own threads."""
        options = _range_options(job, first, end)
        offset = first
        with _range_writer(job.target) as fd:
            async for piece in self._body_async(engine, job.info, options):
                self._check_halted(job.info.key)
                offset += _write_at(fd, memoryview(piece), offset)
                job.wrote(start, offset)
        self._whole(job, first, end, offset)

    async def _body_async(
        self, engine: Any, pinned: ObjectInfo, options: GetOptions
    ) -> AsyncIterator[Any]:
        """:meth:`_chunks` of a GET of ``pinned`` made on the event loop. Its answer is let go
        of as it ends, however it ends: a traceback that outlives it (a stop's, a failure's)
        keeps no connection open, nor the engine's reads on it."""
        import obstore

        key = pinned.key
        try:
            result = await obstore.get_async(engine, self._key(key), options=options)
        except Exception as exc:
            raise self._error(exc, key) from None
        found = _version(result.meta)
        pieces = result.stream(min_chunk_size=self.tuning.piece).__aiter__()
        del result
        try:
            self.check_version(key, pinned, found)
            while True:
                try:
                    piece = await pieces.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    raise self._error(exc, key) from None
                yield piece
        finally:
            del pieces

    def _whole(self, job: Ranged, first: int, end: int, reached: int) -> None:
        """A range asked from ``first`` up to ``end`` and written up to ``reached``: a short
        read where that is not all of it."""
        if reached != end:
            uri = self.uri(job.info.key)
            raise TransientStoreError(f"{uri}: short read at {first}", uri)

    def _upload(self, path: Path, key: str) -> str:
        """Below the part size, one PUT with the sha256 as metadata; above, a multipart upload
        fed by a reader that hashes each part as the engine takes it."""
        import obstore

        size = path.stat().st_size
        if size <= self.tuning.upload_part_size:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            self._put_object(key, data, digest)
            return digest
        part = self.tuning.part_size_for(size, self.tuning.upload_part_size)
        whole = hashlib.sha256()

        def parts() -> Iterator[bytes]:  # raising here, the engine aborts the upload
            with open(path, "rb") as handle:
                while chunk := handle.read(part):
                    self._check_halted(key, "upload")
                    whole.update(chunk)
                    yield chunk

        with self._upload_turn(key):
            self._engine_call(
                key,
                lambda engine: obstore.put(
                    engine,
                    self._key(key),
                    parts(),
                    chunk_size=part,
                    max_concurrency=self.tuning.upload_concurrency,
                ),
            )
        return whole.hexdigest()

    def _put_object(self, key: str, data: bytes, sha256: str, if_absent: bool = False) -> bool:
        """One PUT with the sha256 as metadata; with ``if_absent`` a conditional write
        (``If-None-Match: *``), False when an object is there already."""
        import obstore
        from obstore import exceptions as engine

        try:
            obstore.put(
                self.engine,
                self._key(key),
                data,
                attributes={SHA256_META: sha256},
                mode="create" if if_absent else "overwrite",
                use_multipart=False,
            )
        except (engine.AlreadyExistsError, engine.PreconditionError):
            if if_absent:
                return False
            raise
        except Exception as exc:
            raise self._error(exc, key) from None
        return True

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        return self._put_object(key, data, hashlib.sha256(data).hexdigest(), if_absent)

    def _copy(self, source: str, key: str) -> None:
        """A copy inside the service, which keeps the source's metadata (its sha256); above
        ``max_copy_bytes`` the caller uploads instead."""
        import obstore

        limit = self.max_copy_bytes
        if limit is not None and self._stat(source).size > limit:
            raise NotImplementedError(f"objects over {limit} bytes are not copied")
        self._engine_call(
            key, lambda engine: obstore.copy(engine, self._key(source), self._key(key))
        )

    def _delete(self, key: str) -> None:
        import obstore

        self._engine_call(key, lambda engine: obstore.delete(engine, self._key(key)))

    # --- many small objects at once ----------------------------------------------------------

    def batch_max_size(self) -> int:
        return self.tuning.batch_max_size

    def download_batch(self, wanted: Iterator[Wanted], finished: Finished) -> None:
        """GETs many at once on the fetch threads (as many as :class:`Pace` finds worth it),
        each object read whole, while the bodies held stay within ``batch_get_bytes``; the bodies
        are placed from the caller's thread, one after another (threads that create files in
        one directory at once wait on its lock, and on each other, for longer than the files
        take to write). No object is taken from ``wanted`` once one has failed (the caller
        fetches the rest one by one). Returns once no GET of the batch is in flight; an error
        of taking an object or of ``finished`` is raised then."""
        tuning = self.tuning
        flight: InFlight[_Fetched] = self._flight(
            "bt-fetch", tuning.batch_gets_from, tuning.batch_gets, tuning.batch_get_bytes
        )
        failed = False
        first: BaseException | None = None

        def settle(future: Future[_Fetched]) -> bool:
            nonlocal failed, first
            try:
                item, body, said = future.result()
                outcome = body if isinstance(body, Exception) else self._placed(item, body, said)
                failed = failed or outcome is not None
                finished(item, outcome)
            except BaseException as exc:
                failed, first = True, first or exc
            return not failed

        flight.drive(wanted, self._fetch_whole, lambda item: item.expected.size, settle)
        if first is not None:
            raise first

    def _fetch_whole(self, item: Wanted) -> _Fetched:
        """One object of a batch read whole at the version listed, with the sha256 it claims
        and its version (or the typed error); the body is the engine's buffer, not a copy."""
        import obstore

        key = item.expected.key
        if item.expected.size == 0:  # listed empty: nothing to fetch
            return item, memoryview(b""), Fetched(version=item.expected.version)
        try:
            options = _get_options(item.expected.version)
            result = obstore.get(self.engine, self._key(key), options=options)
            said = Fetched(result.attributes.get(SHA256_META), None, _version(result.meta))
            return item, memoryview(result.bytes()), said
        except Exception as exc:
            return item, self._error(exc, key), Fetched()

    def _placed(self, item: Wanted, body: memoryview, said: Fetched) -> Exception | None:
        """A fetched object placed at its destination: None, or why not (the file system's
        error, or the checksum's)."""
        try:
            self.place(item, body, said)
        except Exception as exc:
            return exc
        return None

    def upload_stream(
        self,
        take: Callable[[], Sequence[U] | None],
        finished: Callable[[U, str | Exception], None],
    ) -> None:
        """Each file read whole and stored by one PUT on the batch threads, as many at once as
        :class:`Pace` finds worth it, the files in flight within ``batch_bytes``; files are
        taken on the caller's thread, each once there is room for it, and none once a call of
        ``finished`` has failed. Returns when every PUT is done, so no thread of the stream is
        inside the engine afterwards (an interpreter that ends then must not find one there);
        the first error of ``finished``, or of taking a file, is raised then."""
        tuning = self.tuning
        flight: InFlight[None] = self._flight(
            "bt-batch", tuning.batch_puts_from, tuning.batch_puts, tuning.batch_bytes
        )
        first: BaseException | None = None

        def put(item: U) -> None:
            finished(item, self._put_whole(item))

        def settle(future: Future[None]) -> bool:
            nonlocal first
            first = first or future.exception()
            return first is None

        def handed() -> Iterator[U]:
            while (batch := take()) is not None:
                yield from batch

        flight.drive(handed(), put, lambda item: _size(item.path), settle)
        if first is not None:
            raise first

    def _put_whole(self, item: U) -> str | Exception:
        """One file of an upload stream stored by one PUT: its sha256, or why not."""
        try:
            data = item.path.read_bytes()
        except OSError as exc:
            return exc
        digest = hashlib.sha256(data).hexdigest()
        try:
            self._put_object(item.key, data, digest)
        except Exception as exc:
            return exc
        return digest


def _size(path: Path) -> int:
    """``path``'s size; 0 where it cannot be read (its PUT then says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


@contextlib.contextmanager
def _range_writer(target: Path) -> Iterator[int]:
    """A descriptor of ``target`` for one range's writes, closed as the range ends."""
    fd = os.open(target, os.O_WRONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _write_at(fd: int, body: memoryview, offset: int) -> int:
    """``body`` written at ``offset``, ``WRITE_PIECE`` bytes at a time: larger writes make the
    page cache take its memory in large blocks, which cost much more system time on machines
    (virtual ones) whose free memory is handed back to their host. Returns its length."""
    length = len(body)
    while body:
        written = os.pwrite(fd, body[:WRITE_PIECE], offset)
        body, offset = body[written:], offset + written
    return length


def _info(key: str, meta: Any, attributes: Any) -> ObjectInfo:
    return ObjectInfo(key, int(meta["size"]), _version(meta), attributes.get(SHA256_META))


def _version(meta: Any) -> str:
    """The object's ETag, as listings give it (unquoted)."""
    return str(meta.get("e_tag") or "").strip('"')


def _get_options(version: str | None, start: int = 0, length: int | None = None) -> GetOptions:
    """The engine's options for a GET of the object at ``version`` (``If-Match``, the ETag
    quoted as the services answer it; listings give it unquoted here; none for a weak ETag,
    which no ``If-Match`` matches), of ``length`` bytes at ``start`` where a length is given,
    else whole."""
    options: GetOptions = {}
    if version and not version.startswith("W/"):  # a weak ETag matches no If-Match
        options["if_match"] = f'"{version}"'
    if length is not None:
        options["range"] = (start, start + length)
    return options


def _range_options(job: Ranged, first: int, end: int) -> GetOptions:
    """The options of the GET of ``job``'s bytes from ``first`` up to ``end``: a range, unless
    that is the whole object, which is asked for whole (a server that serves no ranges sends
    it so)."""
    whole = first == 0 and end == job.info.size
    return _get_options(job.info.version, first, None if whole else end - first)
