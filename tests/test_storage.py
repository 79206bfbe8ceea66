"""One conformance suite for every backend, against real servers on 127.0.0.1.

file:// (a directory), s3:// (SeaweedFS, over http and https), r2:// and cw:// (the same
SeaweedFS through the R2 endpoint override and CoreWeave's host names), gs:// (fake-gcs-server,
over http and https), azure:// (Azurite, over http and https), hf:// (olah serving local git
repositories, over http and https) and https:// (a ranged static file server with a certificate
of a test CA).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import servers
from helpers import small_tmpfs
from http_proxy import ForwardProxy

from bt_agent.errors import (
    AccessDeniedError,
    ChangedError,
    IntegrityError,
    KeyConflictError,
    KeyRefusedError,
    NotFoundError,
    StoreError,
    TransientStoreError,
    UnsafeKeyError,
    UsageError,
)
from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store
from bt_agent.storage.azure import AzureStore
from bt_agent.storage.base import ObjectInfo, Upload, Wanted, files_only
from bt_agent.storage.engine import Proxies, Tuning
from bt_agent.storage.file import SYNCFS_MIN_FILES, syncfs
from bt_agent.storage.flight import DaemonLoop, DaemonPool, in_task_group, wait_all
from bt_agent.storage.gcs import GCSStore
from bt_agent.storage.hf import HFStore
from bt_agent.storage.retry import RetryPolicy
from bt_agent.storage.s3 import S3Store
from bt_agent.storage.transfer import download_tree, upload_tree

MiB = 1024 * 1024
SMALL_TUNING = Tuning(
    multipart_threshold=5 * MiB,
    part_size=5 * MiB,
    upload_part_size=5 * MiB,
    ranges=4,
    list_page_size=50,
)


# "s3-tls" is the same SeaweedFS over https, its certificate trusted through AWS_CA_BUNDLE;
# "cw" the same again as CoreWeave (the bucket in the host, through a proxy: _s3); "gs-tls" and
# "azure-tls" are fake-gcs-server and Azurite over https (REQUESTS_CA_BUNDLE, SSL_CERT_FILE),
# "hf-tls" olah over https (SSL_CERT_FILE).
WRITABLE = ["file", "s3", "s3-tls", "r2", "cw", "gs", "gs-tls", "azure", "azure-tls"]
TREES = [*WRITABLE, "hf", "hf-tls"]  # https:// is one file per URL
ALL = [*TREES, "https"]


@dataclass
class Backend:
    """A store under test and a way to put objects in it from outside the store itself."""

    name: str
    make: Callable[[], ObjectStore]
    seed_objects: Callable[[dict[str, bytes]], None]

    def seeded(self, files: dict[str, bytes]) -> ObjectStore:
        self.seed_objects(files)
        return self.make()


def _s3(
    server: servers.SeaweedFS, name: str = "s3", request: pytest.FixtureRequest | None = None
) -> Backend:
    """SeaweedFS as ``name``: s3 (plain http), s3-tls, r2, or cw (CoreWeave's host for each
    bucket, ``<bucket>.cwobject.com``, which a proxy takes to the server's TLS port)."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    keys_json = (
        f'{{"aws_access_key_id": "{servers.ACCESS_KEY}", '
        f'"aws_secret_access_key": "{servers.SECRET_KEY}"}}'
    )
    assert server.certificates is not None
    trusted = {"AWS_CA_BUNDLE": str(server.certificates.ca)}
    url = f"s3://{bucket}/data"
    if name == "r2":
        environ = Environ({"BT_R2_ENDPOINT_URL": server.endpoint})
        url = f"r2://acct123.{bucket}/data"
    elif name == "cw":
        assert request is not None, "the proxy is closed with the test"
        proxy = ForwardProxy(upstream=("127.0.0.1", server.https_port))
        request.addfinalizer(proxy.close)
        environ = Environ({"HTTPS_PROXY": proxy.endpoint, **trusted})
        url = f"cw://{bucket}/data"
    elif name == "s3-tls":
        environ = Environ({"AWS_ENDPOINT_URL": server.https_endpoint, **trusted})
    else:
        environ = Environ({"AWS_ENDPOINT_URL": server.endpoint})

    def make() -> ObjectStore:
        store = open_store(url, environ, keys_json, "creds")
        assert isinstance(store, S3Store)
        store.tuning = SMALL_TUNING
        return store

    writer = make()
    return Backend(
        name, make, lambda files: [writer.write_bytes(k, v) for k, v in files.items()] and None
    )


def _gs(server: servers.FakeGCS, monkeypatch: pytest.MonkeyPatch | None = None) -> Backend:
    """fake-gcs-server; over https, its CA trusted as google-cloud-storage's client trusts one
    (``REQUESTS_CA_BUNDLE``, which it reads from the process's environment)."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    environ = Environ({"STORAGE_EMULATOR_HOST": server.endpoint})
    if server.tls:
        assert monkeypatch is not None, "the variable is the process's"
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(server.tls.ca))

    def make() -> ObjectStore:
        store = open_store(f"gs://{bucket}/data", environ)
        assert isinstance(store, GCSStore)
        store.chunk_size, store.list_page_size = 256 * 1024, 50
        return store

    writer = make()
    return Backend(
        "gs-tls" if server.tls else "gs",
        make,
        lambda files: [writer.write_bytes(k, v) for k, v in files.items()] and None,
    )


def _azure(server: servers.Azurite) -> Backend:
    container = f"c{uuid.uuid4().hex[:12]}"
    server.create_container(container)
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
    environ = Environ({"SSL_CERT_FILE": str(server.tls.ca)} if server.tls else {})

    def make() -> ObjectStore:
        store = open_store(url, environ, server.connection_string, "azure_creds")
        assert isinstance(store, AzureStore)
        store.tuning = SMALL_TUNING
        return store

    writer = make()
    return Backend(
        "azure-tls" if server.tls else "azure",
        make,
        lambda files: [writer.write_bytes(k, v) for k, v in files.items()] and None,
    )


def _hf(server: servers.Olah, request: pytest.FixtureRequest) -> Backend:
    """olah; over https, its CA trusted as huggingface_hub's client trusts one (``SSL_CERT_FILE``,
    read from the process's environment when the library makes its client, which it keeps: so
    the client is made again for the test, and after it). Files of 1 KiB and more are kept in
    LFS, as a repository's weights are on the Hub (listed with their sha256)."""
    repo = f"org/model-{uuid.uuid4().hex[:8]}"
    environ = Environ({"HF_ENDPOINT": server.endpoint})
    if server.tls:
        from huggingface_hub.utils import close_session

        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("SSL_CERT_FILE", str(server.tls.ca))
        close_session()
        request.addfinalizer(close_session)
    return Backend(
        "hf-tls" if server.tls else "hf",
        lambda: open_store(f"hf://{repo}", environ),
        lambda files: (
            servers.hf_repo(
                server.mirrors,
                repo,
                {key: data for key, data in files.items() if len(data) < 1024},
                lfs={key: data for key, data in files.items() if len(data) >= 1024},
            )
            and None
        ),
    )


def _https(server: servers.StaticHTTPS, monkeypatch: pytest.MonkeyPatch) -> Backend:
    monkeypatch.setenv("SSL_CERT_FILE", str(server.ca_file))
    name = f"{uuid.uuid4().hex[:8]}.bin"

    def seed(files: dict[str, bytes]) -> None:
        assert list(files) == ["model.bin"], "https:// holds one file per URL"
        (server.directory / name).write_bytes(files["model.bin"])

    def make() -> ObjectStore:
        store = open_store(server.url(name))
        store.name = "model.bin"  # type: ignore[attr-defined]
        return store

    return Backend("https", make, seed)


def _file(root: Path) -> Backend:
    url = (root / "file-store").as_uri()
    writer = open_store(url)
    return Backend(
        "file",
        lambda: open_store(url),
        lambda files: [writer.write_bytes(k, v) for k, v in files.items()] and None,
    )


@pytest.fixture
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Backend:
    name = request.param
    if name == "file":
        return _file(tmp_path)
    if name in ("s3", "s3-tls", "r2", "cw"):
        return _s3(request.getfixturevalue("s3_server"), name, request)
    if name in ("gs", "gs-tls"):
        fixture = "gcs_tls_server" if name == "gs-tls" else "gcs_server"
        return _gs(request.getfixturevalue(fixture), monkeypatch)
    if name in ("azure", "azure-tls"):
        fixture = "azure_tls_server" if name == "azure-tls" else "azure_server"
        return _azure(request.getfixturevalue(fixture))
    if name in ("hf", "hf-tls"):
        fixture = "hf_tls_server" if name == "hf-tls" else "hf_server"
        return _hf(request.getfixturevalue(fixture), request)
    return _https(request.getfixturevalue("https_server"), monkeypatch)


def payload(size: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB, not compressible
    return (block * (size // len(block) + 1))[:size]


def _one(backend: Backend, data: bytes) -> tuple[ObjectStore, str]:
    key = "model.bin" if backend.name == "https" else "dir/model.bin"
    return backend.seeded({key: data}), key


@pytest.mark.parametrize("backend", ALL, indirect=True)
@pytest.mark.parametrize("size", [0, 1000, 12 * MiB + 7], ids=["empty", "small", "multipart"])
def test_round_trip(backend: Backend, tmp_path: Path, size: int) -> None:
    data = payload(size)
    store, key = _one(backend, data)
    info = store.stat(key)
    assert info.size == size
    target = tmp_path / "out" / "model.bin"
    store.download(key, target, info)
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["model.bin"], "nothing partial left"


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_no_thread_of_a_store_holds_the_exit(backend: Backend, tmp_path: Path) -> None:
    """``bt-agent run`` ends with a plain exit, which waits for every thread that is not a
    daemon: none a store starts (for ranged downloads, say) may be one, whether the store is
    still open or closed; and a closed store still works (it opens again at its next use)."""
    started_before = set(threading.enumerate())

    def holding() -> list[str]:
        return [
            thread.name
            for thread in threading.enumerate()
            if thread not in started_before and thread.is_alive() and not thread.daemon
        ]

    data = payload(12 * MiB + 7)
    store, key = _one(backend, data)
    with store:
        store.download(key, tmp_path / "a.bin", store.stat(key))
        assert holding() == []
    store.download(key, tmp_path / "b.bin", store.stat(key))
    assert (tmp_path / "b.bin").read_bytes() == data
    store.close()
    assert holding() == []


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_closing_a_store_lets_a_download_in_flight_finish(
    s3_server: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """A store closed while another thread's large download is under way (its ranges on the
    range threads) lets that download finish whole."""
    data = os.urandom(96 * MiB + 5)
    store, key = _one(_s3(s3_server, "s3-tls" if tls else "s3"), data)
    info = store.stat(key)
    out = tmp_path / "out"
    out.mkdir()
    outcome: list[object] = []
    fetching = threading.Thread(
        target=lambda: outcome.append(store.download(key, out / "model.bin", info))
    )
    fetching.start()
    while not list(out.iterdir()):  # the partial file: the ranges have begun
        assert fetching.is_alive(), "the download ended before the store was closed"
        time.sleep(0.001)
    assert fetching.is_alive()
    store.close()
    fetching.join(timeout=60)
    assert outcome == [out / "model.bin"]
    assert (out / "model.bin").read_bytes() == data


def test_a_call_submitted_to_a_shut_pool_still_runs() -> None:
    """A store closed between a download's lookup of its range pool and a range's submission
    shuts that pool down: the range must still run (queued behind the threads' stop markers, or
    handed to a thread about to stop, it waited forever). Real threads; no store needed."""
    pool = DaemonPool(1, "test-pool")  # its one thread started; no other may start
    assert pool.submit(lambda: "before").result(timeout=10) == "before"
    time.sleep(0.05)  # its thread idle again, as a range thread between ranges
    pool.shutdown()
    late = [pool.submit(lambda n=n: n * n) for n in range(3)]
    assert [future.result(timeout=10) for future in late] == [0, 1, 4]
    for thread in threading.enumerate():  # the pool's own thread ends, as shut down
        if thread.name == "test-pool-0":
            thread.join(timeout=10)
            assert not thread.is_alive()


def test_an_interrupted_caller_of_the_event_loop_returns_once_its_task_has_ended() -> None:
    """A download's caller interrupted (Ctrl-C: KeyboardInterrupt) while its ranges run on the
    store's event loop cancels them, and returns only once they have ended: a range still
    running after it would write into a file descriptor the caller closes, or one the
    process has reused since. A real SIGINT to this thread, taken as Python takes it by default
    (a process started in the background by a shell inherits SIGINT ignored); no store needed."""
    loop = DaemonLoop("test-ranges", 2)
    steps: list[str] = []

    async def ranges() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # a range's write under way when the cancel came
            steps.append("ended")
            raise

    timer = threading.Timer(0.2, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            loop.run(ranges)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert steps == ["ended"]
    loop.shutdown()


def test_a_shut_event_loop_finishes_its_work_and_runs_what_comes_late() -> None:
    """A store closed while another thread's download runs on its event loop lets that download
    finish, and one that starts after (it looked the loop up just before) still runs; the
    loop's thread then ends. Real threads; no store needed."""
    loop = DaemonLoop("test-loop", 2)
    started = threading.Event()
    outcome: list[str] = []

    async def under_way() -> str:
        started.set()
        await asyncio.sleep(0.3)
        return "finished"

    async def late() -> str:
        return "late"

    first = threading.Thread(target=lambda: outcome.append(loop.run(under_way)))
    first.start()
    assert started.wait(timeout=10)
    loop.shutdown()
    assert loop.run(late) == "late"
    first.join(timeout=10)
    assert outcome == ["finished"]
    for thread in threading.enumerate():
        if thread.name == "test-loop":
            thread.join(timeout=10)
            assert not thread.is_alive()


def test_a_failed_call_tells_the_others_to_stop_before_they_are_waited_for() -> None:
    """A range that fails (its connection reset, the disk full) must not leave the download
    waiting on the others to come whole before its error, and the retry, can come: they are
    told to stop (each looks between its pieces), and the error comes once they have. Real
    threads; no store needed."""
    pool = DaemonPool(3, "test-abandon")
    stop = threading.Event()

    def long() -> str:  # a range of many pieces, looking for a stop between them
        for _ in range(1000):
            if stop.is_set():
                return "stopped"
            time.sleep(0.01)
        return "whole"

    def fails() -> str:
        time.sleep(0.05)
        raise OSError("no space left on device")

    futures = [pool.submit(long), pool.submit(fails), pool.submit(long)]
    began = time.monotonic()
    with pytest.raises(OSError, match="no space left"):
        wait_all(futures, stop.set)
    assert time.monotonic() - began < 5, "the error waited for the other calls to be whole"
    assert [futures[0].result(), futures[2].result()] == ["stopped", "stopped"]
    pool.shutdown()


def test_the_first_failed_task_cancels_the_others_and_is_raised_once_they_have_ended() -> None:
    """On the store's event loop, a range that fails cancels the others at once, and its error
    is raised only once they have ended (a cancelled range may be inside a write). Real
    asyncio tasks; no store needed."""
    ended: list[str] = []

    async def long(name: str) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # a write under way when the cancel came
            ended.append(name)
            raise

    async def fails() -> None:
        await asyncio.sleep(0.05)
        raise OSError("connection reset")

    async def all_three() -> None:
        with pytest.raises(OSError, match="connection reset"):
            await in_task_group([long("a"), fails(), long("b")])

    began = time.monotonic()
    asyncio.run(asyncio.wait_for(all_three(), 10))
    assert time.monotonic() - began < 5
    assert sorted(ended) == ["a", "b"]


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_an_interrupted_ranged_download_ends_at_the_next_piece(
    s3_server: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """Ctrl-C while a large object comes through a slow link (each connection paced at 1 MB/s:
    its ranges of 32 MiB would take half a minute): the download ends within a piece of each
    range, leaving no file, partial or whole, at the destination. A real SIGINT to this thread,
    taken as Python takes it by default; the store reached through a real paced link."""
    from far_link import FarLink

    backend = _s3(s3_server, "s3-tls" if tls else "s3")
    store, key = _one(backend, payload(40 * MiB, seed=3))
    listed = store.list("dir/")[0]
    far = FarLink(s3_server.https_port if tls else s3_server.port, 0.0, 1e6)
    assert s3_server.certificates is not None
    endpoint = f"https://localhost:{far.port}" if tls else far.endpoint
    environ = Environ(
        {"AWS_ENDPOINT_URL": endpoint, "AWS_CA_BUNDLE": str(s3_server.certificates.ca)}
    )
    keys = json.dumps(
        {"aws_access_key_id": servers.ACCESS_KEY, "aws_secret_access_key": servers.SECRET_KEY}
    )
    slow = open_store(store.url, environ, keys, "creds")
    target = tmp_path / "out" / "model.bin"
    target.parent.mkdir()
    caller, sent = threading.get_ident(), []

    def interrupt() -> None:
        sent.append(time.monotonic())
        signal.pthread_kill(caller, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.0, interrupt).start()
        with pytest.raises(KeyboardInterrupt):
            slow.download(key, target, listed)
        interrupted = time.monotonic() - sent[0]
    finally:
        signal.signal(signal.SIGINT, previous)
        slow.close()
        far.close()
    assert interrupted < 5, f"the download ended {interrupted:.1f} s after Ctrl-C"
    assert not list(target.parent.iterdir()), "nothing, partial or whole, at the destination"


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
@pytest.mark.parametrize("size", [0, 1000, 12 * MiB + 7], ids=["empty", "small", "multipart"])
def test_upload_returns_the_sha256(backend: Backend, tmp_path: Path, size: int) -> None:
    data = payload(size, seed=1)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    store = backend.make()
    result = store.upload_file(source, "up/loaded.bin")
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.size == size
    assert store.read_bytes("up/loaded.bin") == data


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
def test_trees_both_ways(backend: Backend, tmp_path: Path) -> None:
    """upload_tree and download_tree: small files through the batch paths where the store has
    them, a large one in parts, an empty one, nested directories; the layout kept."""
    tree = {
        "a.json": b"{}",
        "empty": b"",
        "sub/deeper/b.bin": payload(300_000, seed=1),
        "large.bin": payload(6 * MiB + 3, seed=2),
        **{f"many/{i:03d}.txt": payload(100 + i, seed=i) for i in range(40)},
    }
    source = tmp_path / "source"
    for name, data in tree.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    store = backend.make()
    uploaded = upload_tree(store, source, "tree")
    assert {u.key: u.sha256 for u in uploaded} == {
        f"tree/{name}": hashlib.sha256(data).hexdigest() for name, data in tree.items()
    }
    target = tmp_path / "target"
    placed = download_tree(backend.make(), "tree", target)
    assert sorted(p.relative_to(target).as_posix() for p in placed) == sorted(tree)
    for name, data in tree.items():
        assert (target / name).read_bytes() == data, name
    assert not [p for p in target.rglob("*") if p.name.endswith(".incomplete")]


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
def test_copy_inside_the_store(backend: Backend, tmp_path: Path) -> None:
    """A copy inside the store keeps the object's checksum; Azure's copies are not made (its
    Copy Blob may answer before the copy is done, which the engine cannot see): the caller
    uploads instead."""
    data = payload(3000, seed=2)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    store = backend.make()
    store.upload_file(source, "copy/from.bin")
    if isinstance(store, AzureStore):
        with pytest.raises(NotImplementedError, match="may end after they answer"):
            store.copy("copy/from.bin", "copy/to/here.bin")
        assert not store.exists("copy/to/here.bin")
        return
    store.copy("copy/from.bin", "copy/to/here.bin")
    assert store.read_bytes("copy/to/here.bin") == data
    target = tmp_path / "out.bin"
    store.download("copy/to/here.bin", target, store.stat("copy/to/here.bin"))
    assert target.read_bytes() == data, "verified against the copied object's checksum"
    with pytest.raises(NotFoundError):
        store.copy("copy/none.bin", "copy/nothing.bin")


@pytest.mark.parametrize("backend", TREES, indirect=True)
def test_listing_with_prefixes(backend: Backend) -> None:
    files = {
        "a/1.bin": b"1",
        "a/2.bin": b"22",
        "a/sub/3.bin": b"333",
        "ab.bin": b"4",
        "b/5.bin": b"55555",
    }
    store = backend.seeded(files)
    assert [(i.key, i.size) for i in store.list("a/")] == [
        ("a/1.bin", 1),
        ("a/2.bin", 2),
        ("a/sub/3.bin", 3),
    ]
    assert [i.key for i in store.list("a")] == ["a/1.bin", "a/2.bin", "a/sub/3.bin", "ab.bin"]
    everything = [i.key for i in store.list()]
    assert all(k in everything for k in files)
    assert all(i.version for i in store.list())


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
def test_listing_a_prefix_that_ends_inside_a_name(backend: Backend) -> None:
    """What the catalogue's index asks (``<time>~<job>~``): every key that starts with it,
    whatever sorts around it (names that share its start, a directory of that name), and a
    listing page at a time gives the same."""
    names = ["ab-x", "ab/c", "ab/d/e", "ab0", "ab~1", "ab~2", "aa", "b"]
    files = {f"d/{name}": name.encode() for name in names} | {"e/ab~3": b"3"}
    store = backend.seeded(files)
    for prefix in ("d/ab~", "d/ab-", "d/ab", "d/ab/", "d/a", "d/ab~2", "d/zz", "e/a"):
        expected = sorted(key for key in files if key.startswith(prefix))
        assert [i.key for i in store.list(prefix)] == expected, prefix
        paged = [i.key for page in store.list_pages(prefix) for i in page]
        assert sorted(paged) == expected, prefix


@pytest.mark.parametrize("backend", TREES, indirect=True)
def test_listing_many_pages(backend: Backend) -> None:
    files = {f"many/{i:04d}.txt": str(i).encode() for i in range(130)}
    store = backend.seeded(files)
    listed = list(store.list("many/"))
    assert [i.key for i in listed] == sorted(files)


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_ranged_reads(backend: Backend) -> None:
    data = payload(300_000, seed=2)
    store, key = _one(backend, data)
    for start, length in [(0, 10), (12_345, 1000), (299_990, 10), (299_990, 100), (5, 0)]:
        assert store.read_range(key, start, length) == data[start : start + length]
    assert store.read_bytes(key) == data


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
@pytest.mark.parametrize("size", [1000, 12 * MiB + 7], ids=["small", "multipart"])
def test_an_object_replaced_since_its_listing_is_not_fetched(
    backend: Backend, tmp_path: Path, size: int
) -> None:
    """Each object is fetched at the version its listing gave (ETag, generation, the file's
    own): one replaced since by other content of the same size is a ChangedError naming it,
    with nothing left at the destination, by a download (ranged, above the multipart size)
    and by a batch alike; listed again, it comes."""
    store, key = _one(backend, payload(size, seed=0))
    (listed,) = store.list("dir/")
    backend.seed_objects({key: payload(size, seed=1)})
    target = tmp_path / "out" / "model.bin"
    with pytest.raises(ChangedError, match=r"model\.bin changed after it was listed"):
        store.download(key, target, listed)
    told: list[Exception | None] = []
    if store.in_batches(size):
        wanted = Wanted(target, listed)
        store.download_batch(iter([wanted]), lambda item, error: told.append(error))
        assert [type(error) for error in told] == [ChangedError]
    assert not list(target.parent.iterdir()), "nothing, partial or whole, at the destination"
    store.download(key, target, store.list("dir/")[0])
    assert target.read_bytes() == payload(size, seed=1)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_ranges_are_all_of_the_version_they_began_with(
    s3_server: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """An object replaced while its ranges are fetched (here: just after the request that
    found its version) fails with ChangedError: each range asks for that version
    (``If-Match``), so no file is made of two versions' ranges."""
    backend = _s3(s3_server, "s3-tls" if tls else "s3")
    store, key = _one(backend, payload(12 * MiB + 7, seed=0))
    assert isinstance(store, S3Store)
    found = store._stat

    def then_replaced(stated: str) -> ObjectInfo:
        info = found(stated)
        backend.seed_objects({key: payload(12 * MiB + 7, seed=1)})
        return info

    store._stat = then_replaced  # type: ignore[method-assign]
    target = tmp_path / "out" / "model.bin"
    with pytest.raises(ChangedError, match="changed after it was listed"):
        store.download(key, target, store.list("dir/")[0])
    assert not list(target.parent.iterdir())


@pytest.mark.parametrize("backend", ALL, indirect=True)
def test_missing_object(backend: Backend, tmp_path: Path) -> None:
    store, _ = _one(backend, b"present")
    missing = "absent.bin" if backend.name != "https" else "other.bin"
    with pytest.raises(NotFoundError) as caught:
        store.download(missing, tmp_path / "x" / "absent.bin")
    assert isinstance(caught.value, FileNotFoundError)
    assert store.uri(missing) in str(caught.value) or store.url in str(caught.value)
    assert not store.exists(missing)
    assert not any((tmp_path / "x").iterdir()), "no partial file left behind"


@pytest.mark.parametrize("backend", ALL, indirect=True)
@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a/../../b", "a\0b"])
def test_keys_that_escape_are_refused(backend: Backend, tmp_path: Path, key: str) -> None:
    store = backend.make()
    with pytest.raises(UnsafeKeyError):
        store.download(key, tmp_path / "escape")
    assert not (tmp_path / "escape").exists()


def test_a_hub_out_of_reach_is_named() -> None:
    """``HF_ENDPOINT`` (a mirror, a proxy of the Hub) that does not answer: the error names it,
    and why, in the system's words."""
    hub = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    store = open_store("hf://owner/model", Environ({"HF_ENDPOINT": hub}))
    store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
    with pytest.raises(TransientStoreError) as refused:
        store.list()
    assert f"cannot reach {hub} (Connection refused)" in str(refused.value), refused.value


def test_hf_revisions_are_pinned(hf_server: servers.Olah, tmp_path: Path) -> None:
    repo = f"org/pinned-{uuid.uuid4().hex[:6]}"
    first = servers.hf_repo(hf_server.mirrors, repo, {"config.json": b'{"v": 1}'})
    servers.git(hf_server.mirrors / "models" / repo, "tag", "v1")
    second = servers.hf_repo(hf_server.mirrors, repo, {"weights.bin": b"w2"})
    dev = servers.hf_repo(hf_server.mirrors, repo, {"dev.txt": b"d"}, branch="dev")
    environ = Environ({"HF_ENDPOINT": hf_server.endpoint})

    def at(revision: str) -> HFStore:
        store = open_store(f"hf://{repo}@{revision}", environ)
        assert isinstance(store, HFStore)
        return store

    assert at("main").commit == second and at("v1").commit == first and at("dev").commit == dev
    assert [i.key for i in at("v1").list()] == ["config.json"]
    assert [i.key for i in at("main").list()] == ["config.json", "weights.bin"]
    assert at(first).read_bytes("config.json") == b'{"v": 1}'
    assert at("main").pinned_uri() == f"hf://{repo}@{second}"
    with pytest.raises(NotFoundError, match="revision 'nope'"):
        at("nope").list()


def test_a_hub_file_outside_lfs_comes_in_one_request(
    hf_server: servers.Olah, tmp_path: Path
) -> None:
    """A file the Hub keeps in git, not LFS (so never in Xet storage), is fetched by one GET,
    no metadata HEAD before it: the Hub counts every request for a file against its rate
    limits, and a dataset may hold thousands of such files."""
    repo = f"org/plain-{uuid.uuid4().hex[:6]}"
    commit = servers.hf_repo(hf_server.mirrors, repo, {"config.json": b'{"v": 1}'})
    store = open_store(f"hf://{repo}@{commit}", Environ({"HF_ENDPOINT": hf_server.endpoint}))
    store.download("config.json", tmp_path / "config.json")
    assert (tmp_path / "config.json").read_bytes() == b'{"v": 1}'
    assert _file_requests(hf_server, repo) == ["GET"]


def _file_requests(hub: servers.Olah, repo: str, last: str = "GET") -> list[str]:
    """The methods of the requests for ``repo``'s files that ``hub`` logged, once one of them is
    ``last`` (it logs a request once it has answered it)."""
    asked: list[str] = []
    deadline = time.monotonic() + 5
    while last not in asked and time.monotonic() < deadline:
        log = hub.log.read_text().splitlines()
        asked = [line.split('"')[1].split()[0] for line in log if f"/{repo}/resolve/" in line]
        time.sleep(0.05)
    return asked


@pytest.mark.parametrize("xet_disabled", [False, True])
def test_a_hub_file_in_lfs_is_listed_with_its_sha256_and_asked_where_it_is_kept(
    hf_server: servers.Olah, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, xet_disabled: bool
) -> None:
    """A file the Hub keeps in LFS is listed with its sha256, which its download is checked
    against; its metadata (a HEAD) is asked first, as it may be in Xet storage, unless Xet
    storage cannot be read (``HF_HUB_DISABLE_XET``, or no ``hf_xet``). olah keeps no file in
    Xet storage: the metadata says so, and the file comes by GET."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", xet_disabled)
    repo = f"org/lfs-{uuid.uuid4().hex[:6]}"
    weights = os.urandom(300_000)
    commit = servers.hf_repo(
        hf_server.mirrors, repo, {"config.json": b"{}"}, lfs={"model.safetensors": weights}
    )
    store = open_store(f"hf://{repo}@{commit}", Environ({"HF_ENDPOINT": hf_server.endpoint}))
    info = store.stat("model.safetensors")
    assert (info.size, info.sha256) == (len(weights), hashlib.sha256(weights).hexdigest())
    store.download("model.safetensors", tmp_path / "model.safetensors", info)
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    xet_readable = importlib.util.find_spec("hf_xet") is not None and not xet_disabled
    assert _file_requests(hf_server, repo) == (["HEAD", "GET"] if xet_readable else ["GET"])


def _in_xet(
    hf_server: servers.Olah,
    monkeypatch: pytest.MonkeyPatch,
    weights: bytes,
    transfer: Callable[..., None],
) -> tuple[ObjectStore, Any, Any, str]:
    """A repository whose ``model.safetensors`` the Hub keeps in Xet storage, opened with the
    spec's token, and the stand-in for ``xet_get`` (which ``transfer`` does) that reads it.
    Stand-ins, as no Xet server can run here: the metadata is olah's own (asked by its HEAD)
    with the Xet fields the Hub adds for such a file, and ``xet_get`` has the installed
    huggingface_hub's signature, so a call the library would refuse fails here too."""
    import huggingface_hub
    from huggingface_hub import file_download
    from huggingface_hub.utils import XetFileData

    if importlib.util.find_spec("hf_xet") is None:
        pytest.fail("hf_xet is missing: pip install 'hf_xet>=1.3'")
    repo = f"org/xet-{uuid.uuid4().hex[:6]}"
    commit = servers.hf_repo(hf_server.mirrors, repo, {}, lfs={"model.safetensors": weights})
    metadata = huggingface_hub.get_hf_file_metadata
    in_xet = XetFileData(file_hash="0" * 64, refresh_route=f"/api/models/{repo}/xet-read-token")

    def with_xet(*args: Any, **kwargs: Any) -> Any:
        return replace(metadata(*args, **kwargs), xet_file_data=in_xet)

    xet_get = mock.create_autospec(file_download.xet_get, side_effect=transfer)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", with_xet)
    monkeypatch.setattr(file_download, "xet_get", xet_get)
    environ = Environ({"HF_ENDPOINT": hf_server.endpoint})
    store = open_store(f"hf://{repo}@{commit}", environ, "hf_token_of_the_spec", "hf_access_token")
    return store, xet_get, in_xet, repo


@pytest.mark.parametrize("damaged", [False, True])
def test_a_hub_file_in_xet_storage_comes_through_hf_xet(
    hf_server: servers.Olah, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    """A file the Hub keeps in Xet storage comes through huggingface_hub's ``xet_get``, as
    ``hf download`` fetches it, into the partial file, and is checked against the listing's
    sha256 (``xet_get`` a stand-in, :func:`_in_xet`, that writes the file's content or a
    damaged copy). The spec's token goes with it: Xet storage's reads are authorised by it."""
    weights = os.urandom(100_000)

    def written(*, incomplete_path: Path, **_: Any) -> None:
        Path(incomplete_path).write_bytes(b"x" * len(weights) if damaged else weights)

    store, xet_get, in_xet, repo = _in_xet(hf_server, monkeypatch, weights, written)
    destination = tmp_path / "model.safetensors"
    if damaged:
        with pytest.raises(IntegrityError, match="does not match"):
            store.download("model.safetensors", destination)
        assert list(tmp_path.iterdir()) == []
    else:
        store.download("model.safetensors", destination)
        assert destination.read_bytes() == weights
    call = xet_get.call_args.kwargs
    assert call["xet_file_data"] is in_xet and call["expected_size"] == len(weights)
    assert call["headers"]["authorization"] == "Bearer hf_token_of_the_spec"
    assert Path(call["incomplete_path"]).parent == tmp_path
    assert _file_requests(hf_server, repo, last="HEAD") == ["HEAD"]  # its bytes: from Xet


@pytest.mark.parametrize(
    ("raised", "typed", "said"),
    [
        ("XetAuthenticationError", AccessDeniedError, "check that the token in secret"),
        ("XetObjectNotFoundError", NotFoundError, "Xet storage: gone"),
        ("RuntimeError", TransientStoreError, "Xet storage: gone"),
    ],
)
def test_a_hub_file_whose_xet_transfer_fails_says_why(
    hf_server: servers.Olah,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    raised: str,
    typed: type[Exception],
    said: str,
) -> None:
    """hf_xet's own errors, raised from ``xet_get`` (a stand-in, :func:`_in_xet`, raising
    hf_xet's real exception classes): its token refused is access denied, with the token's
    hint (it was "cannot reach" the Hub, waited out as an outage); the file gone from Xet
    storage is not found; a transfer that failed after hf_xet's own retries (a
    ``RuntimeError`` from its Rust side) an outage, waited out, where it crashed the agent."""
    import hf_xet

    kind = getattr(hf_xet, raised, RuntimeError)

    def fails(**_: Any) -> None:
        raise kind("gone")

    store, _, _, _ = _in_xet(hf_server, monkeypatch, os.urandom(1000), fails)
    store.policy = RetryPolicy(attempts=1)
    with pytest.raises(typed) as caught:
        store.download("model.safetensors", tmp_path / "model.safetensors")
    assert said in str(caught.value), caught.value
    assert "cannot reach" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_hub_file_in_lfs_that_does_not_match_its_sha256_is_refused(
    hf_server: servers.Olah, tmp_path: Path
) -> None:
    """The Hub's content of an LFS file, damaged (of the listed size, a byte changed): the
    download fails on its sha256 and leaves nothing at the destination."""
    repo = f"org/damaged-{uuid.uuid4().hex[:6]}"
    weights = os.urandom(200_000)
    commit = servers.hf_repo(hf_server.mirrors, repo, {}, lfs={"model.safetensors": weights})
    sha256 = hashlib.sha256(weights).hexdigest()
    damaged = bytearray(weights)
    damaged[1000] ^= 0xFF
    servers.lfs_object(hf_server.mirrors / "models" / repo, sha256).write_bytes(damaged)
    store = open_store(f"hf://{repo}@{commit}", Environ({"HF_ENDPOINT": hf_server.endpoint}))
    with pytest.raises(IntegrityError, match=f"does not match {sha256}"):
        store.download("model.safetensors", tmp_path / "model.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_hub_repository_not_found_says_which_secret_would_give_access(
    hf_server: servers.Olah,
) -> None:
    """The Hub answers a private or gated repository the token cannot see as one that does
    not exist: the error names the field that gives a token (auth_secret_name), or the
    secret whose token was refused, never the token."""
    environ = Environ({"HF_ENDPOINT": hf_server.endpoint})
    anonymous = open_store("hf://nobody/private-model", environ)
    with pytest.raises(NotFoundError, match=r"no repository 'nobody/private-model'") as info:
        anonymous.list()
    assert "name a secret holding a Hugging Face token" in str(info.value)
    assert "auth_secret_name" in str(info.value)
    token = "hf_" + uuid.uuid4().hex
    named = open_store("hf://nobody/private-model", environ, token, "hf_access_token")
    with pytest.raises(NotFoundError) as info:
        named.list()
    assert "the token in secret 'hf_access_token' is valid" in str(info.value)
    assert token not in str(info.value)


@pytest.mark.parametrize("backend", WRITABLE, indirect=True)
def test_keys_with_characters_that_need_encoding(backend: Backend, tmp_path: Path) -> None:
    """Keys are percent-encoded exactly as they are signed (S3 checks the signature of the
    encoded path)."""
    keys = ["a b/c+d=e&f.bin", "x/%41~y@z,;!$'()*.bin", "ünïcödé/模型.safetensors"]
    store = backend.seeded({key: key.encode() for key in keys})
    assert [info.key for info in store.list()] == sorted(keys)
    for key in keys:
        assert store.stat(key).size == len(key.encode())
        assert store.download(key, tmp_path / "out.bin").read_bytes() == key.encode()
        assert store.read_range(key, 1, 2) == key.encode()[1:3]


def _put_behind_the_store(
    request: pytest.FixtureRequest, store: ObjectStore, keys: list[str]
) -> None:
    """Empty objects under ``keys`` (of the bucket, not the store), put by another client: an
    S3 console's "create folder" (``data/sub/``), or, on Azure, a blob named for the folder,
    as a hierarchical namespace lists its directories."""
    if isinstance(store, S3Store):
        server: servers.SeaweedFS = request.getfixturevalue("s3_server")
        for key in keys:
            server.client().put_object(Bucket=store.bucket, Key=key, Body=b"")
    else:
        import obstore

        assert isinstance(store, AzureStore)
        for key in keys:
            obstore.put(store.engine, key.rstrip("/"), b"")


@pytest.mark.parametrize("backend", ["s3", "s3-tls", "azure"], indirect=True)
def test_folders_placeholders_are_no_files(
    backend: Backend, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The empty object a console leaves for a folder is listed by the engine under the
    folder's name, beside what the folder holds: it is no file (a file and a folder of one name
    cannot both be placed). One for a folder that holds nothing cannot be fetched under the
    name listed: it is placed as the empty file it is listed as, without a request."""
    store = backend.seeded({"sub/x.bin": b"x", "y.bin": b"y"})
    _put_behind_the_store(request, store, ["data/", "data/sub/", "data/empty/"])
    assert [(info.key, info.size) for info in store.list()] == [
        ("empty", 0),
        ("sub/x.bin", 1),
        ("y.bin", 1),
    ]
    placed = download_tree(store, "", tmp_path / "out")
    assert {
        path.relative_to(tmp_path / "out").as_posix(): path.read_bytes() for path in placed
    } == {
        "empty": b"",
        "sub/x.bin": b"x",
        "y.bin": b"y",
    }


def test_a_listing_leaves_out_folders_placeholders_of_every_form() -> None:
    """``name/`` as google-cloud-storage lists it, ``name`` beside ``name/...`` as obstore
    does, the listing's own folder (an empty key); an empty ``name`` nothing is under, and one
    of some bytes, stay."""
    listed = [
        ObjectInfo(key, size)
        for key, size in [
            ("", 0),
            ("a/", 0),
            ("a/b/", 0),
            ("a/b/c", 1),
            ("d", 0),
            ("d/e", 1),
            ("d.txt", 0),
            ("f", 0),
            ("g/", 3),
        ]
    ]
    assert [info.key for info in files_only(listed)] == ["a/b/c", "d/e", "d.txt", "f", "g/"]


@pytest.mark.parametrize("backend", ["s3", "azure"], indirect=True)
def test_a_name_the_engine_cannot_take_is_refused_at_once(
    backend: Backend, s3_server: servers.SeaweedFS
) -> None:
    """A control character in a key: the engine cannot send it, so writing it is refused (no
    retry can help) and a listing that meets one made by another client says which it is, at
    once: neither is an outage to wait out."""
    store = backend.make()
    with pytest.raises(KeyRefusedError, match=r"control character \('\\t'\), which no name in"):
        store.write_bytes("tab\tx.bin", b"x")
    if isinstance(store, S3Store):
        s3_server.client().put_object(Bucket=store.bucket, Key="data/line\nx.bin", Body=b"x")
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            store.list()
        assert not isinstance(caught.value, TransientStoreError)
        assert "cannot read the name of the object 'data/line\\nx.bin'" in str(caught.value)
        assert time.monotonic() - started < 5, "refused at once, not retried"


@pytest.mark.parametrize("backend", ["s3", "r2"], indirect=True)
def test_wrong_credentials(backend: Backend, s3_server: servers.SeaweedFS) -> None:
    store = backend.make()
    assert isinstance(store, S3Store)
    wrong = "not-the-secret-value-42"
    url = store.url
    environ = Environ(
        {"AWS_ENDPOINT_URL": s3_server.endpoint, "BT_R2_ENDPOINT_URL": s3_server.endpoint}
    )
    bad = open_store(
        url,
        environ,
        f'{{"aws_access_key_id": "{servers.ACCESS_KEY}", "aws_secret_access_key": "{wrong}"}}',
        "creds",
    )
    with pytest.raises(AccessDeniedError) as caught:
        list(bad.list())
    assert "access denied" in str(caught.value) and url in str(caught.value)
    said = "(403 SignatureDoesNotMatch: The request signature we calculated"  # the service's
    assert said in str(caught.value), caught.value
    assert wrong not in str(caught.value)
    assert isinstance(caught.value, PermissionError)
    for single_object in (lambda: bad.stat("any.bin"), lambda: bad.write_bytes("any.bin", b"x")):
        with pytest.raises(AccessDeniedError, match="access denied"):
            single_object()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_s3_ranges_land_at_their_offsets(
    s3_server: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """A large object comes in ranges fetched in parallel, each way they can come; the bytes
    (random: a range at a wrong offset would show) land where they belong."""
    data = os.urandom(12 * MiB + 7)
    store, key = _one(_s3(s3_server, "s3-tls" if tls else "s3"), data)
    target = tmp_path / "model.bin"
    store.download(key, target, store.stat(key))
    assert target.read_bytes() == data


@pytest.mark.parametrize("backend", ["azure", "azure-tls", "r2"], indirect=True)
def test_ranges_land_on_every_engine_backend(backend: Backend, tmp_path: Path) -> None:
    """Azure's and R2's stores fetch large objects in ranges too, each of the version listed,
    each landing at its offset."""
    data = os.urandom(12 * MiB + 7)
    store, key = _one(backend, data)
    target = tmp_path / "model.bin"
    store.download(key, target, store.list("dir/")[0])
    assert target.read_bytes() == data


PRINT_PEAK_MIB = """
status = Path("/proc/self/status").read_text()
print(next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM:")) // 1024)
"""  # the last lines of a script that reports its peak RSS (it imports Path)

MEMORY_CHECK = """
import sys, threading
from pathlib import Path
from bt_agent.settings import Environ
from bt_agent.memory import return_large_buffers
from bt_agent.storage import open_store
return_large_buffers()  # as the checkpoint sidecar does
store = open_store(sys.argv[1], Environ({"AWS_ENDPOINT_URL": sys.argv[2]}), sys.argv[3], "creds")
files = sorted(Path(sys.argv[4]).iterdir())
threads = [threading.Thread(target=store.upload_file, args=(f, f.name)) for f in files]
[t.start() for t in threads]
[t.join() for t in threads]
assert len(store.list()) == len(files)
"""  # then PRINT_PEAK_MIB


def test_s3_uploads_at_once_hold_bounded_memory(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The checkpoint sidecar uploads many large files at once: the parts the engine holds in
    memory are bounded per store, not per file (sixteen 40 MiB files at once, each a multipart
    upload of 8 MiB parts eight at a time, held several hundred MiB). The allocator settings
    are the sidecar's."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    source = tmp_path / "files"
    source.mkdir()
    for index in range(16):
        (source / f"shard-{index}.bin").write_bytes(payload(40 * MiB, seed=index))
    keys = json.dumps(
        {"aws_access_key_id": servers.ACCESS_KEY, "aws_secret_access_key": servers.SECRET_KEY}
    )
    args = [f"s3://{bucket}/m", s3_server.endpoint, keys, str(source)]
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHECK + PRINT_PEAK_MIB, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    peak_mib = int(done.stdout)
    assert peak_mib < 150, f"peak RSS {peak_mib} MiB while uploading 16 files at once"


DOWNLOAD_MEMORY_CHECK = """
import dataclasses, sys
from pathlib import Path
from bt_agent.storage import open_store
from bt_agent.storage.transfer import download_tree
with open_store(sys.argv[1]) as store:
    download_tree(store, "", Path(sys.argv[2]))
"""  # then PRINT_PEAK_MIB


def test_s3_downloads_over_tls_at_once_hold_bounded_memory(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """Over TLS the engine joins each range's body into pieces before they are written, and
    the ranges at once are bounded per store, not per download (eight 40 MiB files at once,
    as staging fetches them, would hold each file's ranges otherwise)."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    client = s3_server.client()
    files = {f"shard-{index}.bin": payload(40 * MiB, seed=index) for index in range(8)}
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=f"m/{name}", Body=data)
    target = tmp_path / "model"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            DOWNLOAD_MEMORY_CHECK + PRINT_PEAK_MIB,
            f"s3://{bucket}/m",
            str(target),
        ],
        env={**os.environ, **s3_server.client_env(tls=True)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for name, data in files.items():
        assert (target / name).read_bytes() == data, name
    peak_mib = int(done.stdout)
    assert peak_mib < 150, f"peak RSS {peak_mib} MiB while downloading 8 files at once over TLS"


EXIT_AFTER_BATCHES = """
import sys
from pathlib import Path
from bt_agent.storage import open_store
from bt_agent.storage.transfer import download_tree, upload_tree

store = open_store(sys.argv[1])
if sys.argv[2] == "upload":
    upload_tree(store, Path(sys.argv[3]))
else:
    download_tree(store, "", Path(sys.argv[3]))
"""  # and the interpreter ends at once, store open, as an agent that just drained would


def test_a_process_ends_cleanly_right_after_a_batch(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A thread still inside the engine when the interpreter ends is ended by CPython as it
    takes the GIL back, and the process aborts (SIGABRT, exit status 134, after the work
    succeeded: it happened with an earlier batch path on the engine's async face). A batch
    returns only once each of its requests is over, so a process that ends right after one,
    its store still open, ends with exit status 0."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    source = tmp_path / "small"
    source.mkdir()
    for index in range(100):
        (source / f"{index:03d}.bin").write_bytes(payload(8 * 1024, seed=index))
    env = {**os.environ, **s3_server.client_env()}
    codes = []
    for run in range(2):
        url = f"s3://{bucket}/run{run}"
        for args in (("upload", str(source)), ("download", str(tmp_path / f"back{run}"))):
            done = subprocess.run(
                [sys.executable, "-c", EXIT_AFTER_BATCHES, url, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            codes.append(done.returncode)
    assert codes == [0, 0, 0, 0], f"exit statuses {codes}"
    assert sorted(p.name for p in (tmp_path / "back1").iterdir()) == sorted(
        p.name for p in source.iterdir()
    )


EXIT_AFTER_RANGES = """
import sys
from pathlib import Path
from bt_agent.storage import open_store

store = open_store(sys.argv[1])
store.download("model.bin", Path(sys.argv[2]), store.stat("model.bin"))
"""  # and the interpreter ends at once, the store and its event loop still open


def test_a_process_ends_cleanly_right_after_ranges_over_tls(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """Over TLS a large object's ranges are read on the engine's async face, whose threads hand
    each body back to Python: the download returns only once no range is in flight, so a
    process that ends right after it (exit status 0, not SIGABRT's 134) finds none there."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    data = os.urandom(40 * MiB + 3)
    s3_server.client().put_object(Bucket=bucket, Key="m/model.bin", Body=data)
    env = {**os.environ, **s3_server.client_env(tls=True)}
    codes = []
    for run in range(3):
        done = subprocess.run(
            [sys.executable, "-c", EXIT_AFTER_RANGES, f"s3://{bucket}/m", str(tmp_path / f"{run}")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        codes.append(done.returncode)
        assert (tmp_path / f"{run}").read_bytes() == data, done.stderr
    assert codes == [0, 0, 0], f"exit statuses {codes}"


def put_lying_object(server: servers.SeaweedFS, store: S3Store, key: str) -> None:
    """An object whose sha256 metadata names other content (corruption at rest)."""
    server.client().put_object(
        Bucket=store.bucket,
        Key=store._key(key),
        Body=b"actual content",
        Metadata={"sha256": hashlib.sha256(b"other content").hexdigest()},
    )


def test_s3_download_detects_content_that_differs_from_its_sha256(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _s3(s3_server).make()
    assert isinstance(store, S3Store)
    put_lying_object(s3_server, store, "lying.bin")
    with pytest.raises(IntegrityError, match="does not match"):
        store.download("lying.bin", tmp_path / "lying.bin")
    assert not list(tmp_path.iterdir())


def test_a_batch_download_places_each_object_from_the_callers_thread(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The objects of a batch are fetched many at a time and placed one after another from
    the caller's thread; each taken is told once, and one whose content differs from its
    sha256 is told as an IntegrityError with nothing at its destination."""
    store = _s3(s3_server).make()
    assert isinstance(store, S3Store)
    contents = {f"batch/{i:02d}": payload(1000 + i, seed=i) for i in range(40)}
    for key, data in contents.items():
        store.write_bytes(key, data)
    put_lying_object(s3_server, store, "batch/lying")
    told: dict[str, tuple[Exception | None, int]] = {}

    def finished(item: Wanted, error: Exception | None) -> None:
        assert item.expected.key not in told
        told[item.expected.key] = (error, threading.get_ident())

    listed = sorted(store.list("batch/"), key=lambda info: info.key != "batch/lying")
    (tmp_path / "batch").mkdir()
    store.download_batch(iter(Wanted(tmp_path / info.key, info) for info in listed), finished)
    assert isinstance(told["batch/lying"][0], IntegrityError)
    assert not (tmp_path / "batch/lying").exists()
    assert {thread for _, thread in told.values()} == {threading.get_ident()}
    for key, (error, _) in told.items():
        if key != "batch/lying":
            assert error is None and (tmp_path / key).read_bytes() == contents[key]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".incomplete")]


def test_gcs_download_detects_corruption_at_rest(
    gcs_server: servers.FakeGCS, tmp_path: Path
) -> None:
    backend = _gs(gcs_server)
    store = backend.seeded({"dir/model.bin": b"A" * 1000})
    stored = [
        p for p in gcs_server.data.rglob("*") if p.is_file() and p.read_bytes() == b"A" * 1000
    ]
    assert stored, "fake-gcs-server's file for the object"
    stored[0].write_bytes(b"B" * 1000)  # same size, other content: only a checksum can tell
    with pytest.raises(IntegrityError):
        store.download("dir/model.bin", tmp_path / "model.bin")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("service", ["s3", "azure"])
def test_a_bucket_that_does_not_exist_is_no_missing_object(
    service: str, request: pytest.FixtureRequest
) -> None:
    """A listing or a read in a bucket (container) that does not exist says so, as an error of
    the store: not a missing object, which callers take as "not there yet" and go on."""
    if service == "s3":
        server: servers.SeaweedFS = request.getfixturevalue("s3_server")
        url = "s3://no-such-bucket-4711/p"
        environ = Environ(server.client_env())
    else:
        azure: servers.Azurite = request.getfixturevalue("azure_server")
        url = f"azure://{servers.AZURITE_ACCOUNT}/no-such-container/p"
        environ = Environ({"AZURE_STORAGE_CONNECTION_STRING": azure.connection_string})
    noun = "bucket" if service == "s3" else "container"
    with open_store(url, environ) as store:
        for attempt in (store.list, lambda: store.read_bytes("model.bin")):
            with pytest.raises(StoreError) as caught:
                attempt()
            assert not isinstance(caught.value, NotFoundError | TransientStoreError)
            assert f"the {noun} of {url} does not exist" in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("variables", "identity"),
    [
        ({}, "the machine's managed identity"),
        (
            {"AZURE_FEDERATED_TOKEN_FILE": "token"},
            "the workload identity of AZURE_CLIENT_ID and AZURE_FEDERATED_TOKEN_FILE",
        ),
        (
            {"AZURE_CLIENT_SECRET": "s3cr3t-value"},
            "the service principal of AZURE_CLIENT_ID and AZURE_CLIENT_SECRET",
        ),
    ],
    ids=["managed", "workload", "service-principal"],
)
def test_azure_without_credentials_says_where_they_come_from(
    variables: dict[str, str], identity: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No secret and no ``AZURE_STORAGE_*``: the engine asks for a token of the identity the
    variables of Azure's identity library name (AKS's workload identity, a service principal),
    else of the machine's managed identity; none is there (their endpoints here refuse
    connections). That is said at once, naming the identity and where else credentials can
    come from (it was an outage waited out, or "access denied"), never a secret's value."""
    refused = f"http://127.0.0.1:{servers.free_port()}"
    for name in ("CONNECTION_STRING", "ACCOUNT_KEY", "SAS_TOKEN"):
        monkeypatch.delenv(f"AZURE_STORAGE_{name}", raising=False)
    given = {"AZURE_MSI_ENDPOINT": f"{refused}/token", **variables}
    if variables:
        (tmp_path / "token").write_text("a-projected-token")
        given |= {"AZURE_CLIENT_ID": "client", "AZURE_TENANT_ID": "tenant"}
        given |= {"AZURE_AUTHORITY_HOST": f"https://127.0.0.1:{servers.free_port()}"}
        given |= {name: str(tmp_path / "token") for name in variables if "FILE" in name}
    for name in ("AZURE_FEDERATED_TOKEN_FILE", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():  # the engine reads the process's environment
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with (
        open_store("azure://account/models/p", Environ(given)) as store,
        pytest.raises(AccessDeniedError) as caught,
    ):
        store.list()
    message = str(caught.value)
    assert f"no credentials: {identity} gave none (cannot reach http" in message, message
    assert "/token: Connection refused)" in message, message
    assert "or set AZURE_STORAGE_CONNECTION_STRING" in message and time.monotonic() - started < 10
    assert "s3cr3t-value" not in message and "a-projected-token" not in message


def test_azure_credentials_given_come_before_those_of_the_environment(
    azure_server: servers.Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spec's secret (a SAS token here) is what requests carry, even where the process's
    environment holds an account key of its own (the store's, another account's): the engine
    reads ``AZURE_STORAGE_*`` itself, and would take a key there over the token it is given."""
    container = f"c{uuid.uuid4().hex[:12]}"
    azure_server.create_container(container)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"w" * 64).decode())
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
    secret = azure_server.sas_connection_string("racwdl")
    with open_store(url, Environ({}), secret, "azure_creds") as store:
        assert store.write_bytes("model.bin", b"weights")
        assert [info.key for info in store.list()] == ["model.bin"]


@pytest.mark.parametrize(
    ("fields", "endpoint"),
    [
        ("DefaultEndpointsProtocol=https;", "https://acct.blob.core.windows.net"),
        ("", "https://acct.blob.core.windows.net"),
        ("DefaultEndpointsProtocol=http;", "http://acct.blob.core.windows.net"),
        (
            "DefaultEndpointsProtocol=https;EndpointSuffix=core.chinacloudapi.cn;",
            "https://acct.blob.core.chinacloudapi.cn",
        ),
    ],
    ids=["global", "no-protocol", "plain-http", "china"],
)
def test_azure_requests_go_to_the_cloud_of_the_connection_string(
    fields: str, endpoint: str
) -> None:
    """A connection string's ``EndpointSuffix`` names its account's cloud (Azure China's,
    Azure Government's), where requests go; without one, Azure's global cloud; over its
    ``DefaultEndpointsProtocol``, else https. There is no Azure here: a proxy that refuses
    every connection is in the way, and the error names where the requests were for."""
    key = base64.b64encode(b"k" * 64).decode()
    secret = f"{fields}AccountName=acct;AccountKey={key}"
    proxy = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    environ = Environ({"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy})
    store = open_store("azure://acct/models/p", environ, secret, "az")
    store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
    with store, pytest.raises(TransientStoreError) as refused:
        store.list()
    said = f"cannot reach {endpoint} through the proxy {proxy} ("
    assert said in str(refused.value), refused.value
    assert key not in str(refused.value)


def test_azure_emulator_of_the_engine_s_variables(
    azure_server: servers.Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AZURE_STORAGE_USE_EMULATOR`` (object_store's variable, with ``AZURITE_BLOB_STORAGE_URL``
    for Azurite's address) is where requests go, and errors name it; with the emulator's key
    where no credentials are given, else with those given (a SAS token that allows reading
    only: a write is refused, where the engine alone would sign it with the emulator's key)."""
    container = f"c{uuid.uuid4().hex[:12]}"
    azure_server.create_container(container)
    variables = {
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURITE_BLOB_STORAGE_URL": azure_server.endpoint.rsplit("/", 1)[0],
    }
    for name, value in variables.items():  # the engine reads the process's environment too
        monkeypatch.setenv(name, value)
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
    with open_store(url, Environ(variables)) as store:
        assert isinstance(store, AzureStore) and store.endpoint_url == azure_server.endpoint
        assert store.write_bytes("model.bin", b"weights")
    read_only = azure_server.sas_connection_string("rl").split("SharedAccessSignature=")[1]
    with open_store(url, Environ(variables), read_only, "azure_sas") as store:
        assert [info.key for info in store.list()] == ["model.bin"]
        with pytest.raises(AccessDeniedError):
            store.write_bytes("other.bin", b"weights")


def test_an_azure_connection_string_of_another_account_is_refused_at_once() -> None:
    """A connection string whose ``AccountName`` is not the URL's account, in the secret or
    the variable: its key would be refused by the URL's account, which the service says only
    as a failed authentication. It is an error naming both accounts, never the key."""
    key = base64.b64encode(b"k" * 64).decode()
    connection = f"DefaultEndpointsProtocol=https;AccountName=other;AccountKey={key}"
    url = "azure://acct/models/p"
    for opening in (
        lambda: open_store(url, Environ({}), connection, "azure_creds"),
        lambda: open_store(url, Environ({"AZURE_STORAGE_CONNECTION_STRING": connection})),
    ):
        with pytest.raises(AccessDeniedError) as caught:
            opening()
        said = str(caught.value)
        assert "of the storage account 'other', not of 'acct' (the URL's)" in said, said
        assert key not in said
    same = connection.replace("AccountName=other", "AccountName=acct")
    assert isinstance(open_store(url, Environ({}), same, "azure_creds"), AzureStore)


def test_azure_connection_strings_as_azure_s_sdks_read_them(
    azure_server: servers.Azurite,
) -> None:
    """A connection string's fields in any case (Azure's SDKs read them so), and
    ``UseDevelopmentStorage=true``, the emulator's development account at its address (or its
    ``DevelopmentStorageProxyUri``'s host), as Azure's tools and docs write it for Azurite."""
    container = f"c{uuid.uuid4().hex[:12]}"
    azure_server.create_container(container)
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
    lower = (
        f"defaultendpointsprotocol=http;accountname={servers.AZURITE_ACCOUNT};"
        f"accountkey={servers.AZURITE_KEY};blobendpoint={azure_server.endpoint}"
    )
    for opening in (
        lambda: open_store(url, Environ({}), lower, "azure_creds"),
        lambda: open_store(url, Environ({"AZURE_STORAGE_CONNECTION_STRING": lower})),
    ):
        with opening() as store:
            assert store.write_bytes("model.bin", b"weights")
            assert [info.key for info in store.list()] == ["model.bin"]
    for connection, endpoint in (
        ("UseDevelopmentStorage=true", "http://127.0.0.1:10000/devstoreaccount1"),
        (
            "UseDevelopmentStorage=true;DevelopmentStorageProxyUri=http://emulator",
            "http://emulator:10000/devstoreaccount1",
        ),
    ):
        store = open_store(url, Environ({"AZURE_STORAGE_CONNECTION_STRING": connection}))
        assert isinstance(store, AzureStore) and store.endpoint_url == endpoint
        assert store.credentials.account_key == servers.AZURITE_KEY
    with pytest.raises(AccessDeniedError, match="of the storage account 'devstoreaccount1'"):
        open_store("azure://acct/c", Environ({}), "UseDevelopmentStorage=true", "azure_creds")


def test_an_azure_sas_url_gives_its_token_and_endpoint(azure_server: servers.Azurite) -> None:
    """The portal's "Blob SAS URL" as the secret, rather than the token beside it: its query is
    the token (a read-only one here: a write is refused), the URL says where requests go; a URL
    without a token is an error that does not show it."""
    container = f"c{uuid.uuid4().hex[:12]}"
    azure_server.create_container(container)
    token = azure_server.sas_connection_string("rl").split("SharedAccessSignature=")[1]
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
    sas_url = f"{azure_server.endpoint}/{container}?{token}"
    with open_store(url, Environ({}), sas_url, "azure_sas") as store:
        assert isinstance(store, AzureStore) and store.endpoint_url == azure_server.endpoint
        assert store.list() == []
        with pytest.raises(AccessDeniedError):
            store.write_bytes("model.bin", b"weights")
    bare = f"{azure_server.endpoint}/{container}?restype=container&secret-ish=4471"
    with pytest.raises(AccessDeniedError, match="is a URL that carries no SAS token") as caught:
        open_store(url, Environ({}), bare, "azure_sas")
    assert "4471" not in str(caught.value)
    cloud = "https://acct.blob.core.windows.net/models?sv=2021-08-06&sig=abc"
    store = open_store("azure://acct/models/p", Environ({}), cloud, "azure_sas")
    assert (
        isinstance(store, AzureStore) and store.endpoint_url == "https://acct.blob.core.windows.net"
    )
    with pytest.raises(AccessDeniedError, match="SAS URL of the storage account 'acct', not of"):
        open_store("azure://other/models/p", Environ({}), cloud, "azure_sas")
    for host in ("acct.privatelink.blob.core.windows.net", "files.example.com"):
        given = f"https://{host}/models?sv=2021-08-06&sig=abc"
        store = open_store("azure://acct/models/p", Environ({}), given, "azure_sas")
        assert isinstance(store, AzureStore) and store.endpoint_url == f"https://{host}"


def test_azure_account_key_from_either_variable() -> None:
    """The account key of ``AZURE_STORAGE_ACCOUNT_KEY`` (the engine's name) or, where that is
    unset, ``AZURE_STORAGE_KEY`` (the Azure CLI's); a value that is no key is an error naming
    the variable that held it, never the value."""
    key, other = base64.b64encode(b"k" * 64).decode(), base64.b64encode(b"o" * 64).decode()
    url = "azure://account/models/p"
    for given, used in (
        ({"AZURE_STORAGE_KEY": key}, key),
        ({"AZURE_STORAGE_ACCOUNT_KEY": other, "AZURE_STORAGE_KEY": key}, other),
    ):
        store = open_store(url, Environ(given))
        assert isinstance(store, AzureStore) and store.credentials.account_key == used
    with pytest.raises(AccessDeniedError, match=r"^AZURE_STORAGE_KEY is neither") as caught:
        open_store(url, Environ({"AZURE_STORAGE_KEY": "not-a-key!"}))
    assert "not-a-key" not in str(caught.value)


def test_gcs_emulator_host_as_host_and_port(gcs_server: servers.FakeGCS) -> None:
    """``STORAGE_EMULATOR_HOST=127.0.0.1:port``, as Google's Go client takes it; one that names
    no host is an error at once, not an outage to wait out."""
    bucket = f"b{uuid.uuid4().hex[:12]}"
    gcs_server.create_bucket(bucket)
    host = gcs_server.endpoint.removeprefix("http://")
    with open_store(f"gs://{bucket}/p", Environ({"STORAGE_EMULATOR_HOST": host})) as store:
        assert store.write_bytes("model.bin", b"weights")
        assert store.read_bytes("model.bin") == b"weights"
    garbled = Environ({"STORAGE_EMULATOR_HOST": "not a host"})
    with open_store(f"gs://{bucket}/p", garbled) as store, pytest.raises(StoreError) as caught:
        store.list()
    assert not isinstance(caught.value, TransientStoreError)
    assert "STORAGE_EMULATOR_HOST='not a host' is not an emulator's address" in str(caught.value)


def test_gcs_without_any_credentials_says_where_they_come_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No secret, no ``GOOGLE_APPLICATION_CREDENTIALS``, no gcloud login and no metadata server:
    google-auth finds nothing, and that is said at once (it was an outage waited out)."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    with (
        open_store("gs://bucket/p", Environ({})) as store,
        pytest.raises(AccessDeniedError) as caught,
    ):
        store.list()
    assert "gs://bucket/p: no Google credentials; name a secret" in str(caught.value)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "File {path} was not found"),
        ("{not json", "File {path} is not a valid json file"),
        (
            '{"type": "nonesuch", "private_key": "PK-9f2c"}',
            "The file {path} does not have a valid type",
        ),
    ],
    ids=["missing", "not-json", "not-a-key"],
)
def test_gcs_credentials_named_by_the_variable_that_cannot_be_loaded_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None, said: str
) -> None:
    """``GOOGLE_APPLICATION_CREDENTIALS`` names a file that is not there or is no key: the
    error says so in google-auth's words (it said "no Google credentials ... or set
    GOOGLE_APPLICATION_CREDENTIALS", which was set), and shows nothing of the file's content."""
    path = tmp_path / "key.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    with (
        open_store("gs://bucket/p", Environ({})) as store,
        pytest.raises(AccessDeniedError) as caught,
    ):
        store.list()
    message = str(caught.value)
    assert message.startswith("gs://bucket/p: the Google credentials cannot be loaded ("), message
    assert said.format(path=path) in message and "PK-9f2c" not in message, message


def test_gcs_credentials_google_refuses_are_no_outage(tmp_path: Path) -> None:
    """A service account whose key was deleted: Google's token endpoint answers
    ``invalid_grant``, and that is said at once (it was an outage waited out). Google's OAuth
    server cannot run here: a one-answer HTTP server stands in for it (the key's ``token_uri``),
    answering as Google does; the key itself is a real RSA key, signed with by google-auth."""
    refusal = b'{"error": "invalid_grant", "error_description": "Invalid JWT Signature."}'
    with servers.one_answer(400, "application/json", refusal) as address:
        key = _service_account(f"{address}/token")
        started = time.monotonic()
        store = open_store("gs://bucket/p", Environ({}), json.dumps(key), "gcs_key")
        with store, pytest.raises(AccessDeniedError) as caught:
            store.list()
    assert "Google refused the service account's credentials (invalid_grant" in str(caught.value)
    assert time.monotonic() - started < 10 and "PRIVATE KEY" not in str(caught.value)


#: What S3 answers a GET of an object in a Glacier class, and Azure of a blob in the archive tier.
ARCHIVED = {
    "s3": (
        403,
        "application/xml",
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidObjectState</Code><Message>'
        b"The operation is not valid for the object's storage class</Message><StorageClass>"
        b"GLACIER</StorageClass><RequestId>R1</RequestId></Error>",
    ),
    "azure": (
        409,
        "application/xml",
        b'<?xml version="1.0" encoding="utf-8"?><Error><Code>BlobArchived</Code><Message>This '
        b"operation is not permitted on an archived blob.\nRequestId:r1\nTime:2026-11-29T00:00:"
        b"00.0000000Z</Message></Error>",
    ),
    "s3-other": (  # a refusal of no kind the agent knows: said in the service's words
        400,
        "application/xml",
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code><Message>'
        b"Invalid argument.</Message><RequestId>R2</RequestId></Error>",
    ),
}
SAID = {
    "s3": "model.bin: the object is archived (InvalidObjectState: The operation is not valid",
    "azure": "model.bin: the object is archived (BlobArchived: This operation is not permitted",
    "s3-other": "model.bin: the service refused the request (400 InvalidArgument: Invalid arg",
}


@pytest.mark.parametrize("service", ["s3", "azure", "s3-other"])
def test_an_archived_object_or_another_refusal_is_said_in_the_service_s_words(service: str) -> None:
    """An object in an archive (S3's Glacier classes, Azure's archive tier) is read only once
    restored: said so at once, with the service's words (S3's 403 was "access denied; check the
    credentials", Azure's 409 its XML); another refusal in the service's words, not its XML.
    No archive runs here (neither SeaweedFS nor Azurite archives): a one-answer server stands in
    for the service, answering as it does."""
    with servers.one_answer(*ARCHIVED[service]) as endpoint:
        if service.startswith("s3"):
            keys = json.dumps(
                {"aws_access_key_id": "k", "aws_secret_access_key": "s", "aws_region": "us-east-1"}
            )
            store = open_store("s3://bucket/p", Environ({"AWS_ENDPOINT_URL": endpoint}), keys, "k")
        else:
            key = base64.b64encode(b"k" * 64).decode()
            secret = f"AccountName=acct;AccountKey={key};BlobEndpoint={endpoint}/acct"
            store = open_store("azure://acct/models/p", Environ({}), secret, "azure_creds")
        with store, pytest.raises(StoreError) as caught:
            store.read_bytes("model.bin")
    message = str(caught.value)
    assert not isinstance(caught.value, AccessDeniedError | TransientStoreError), message
    assert SAID[service] in message and "<" not in message, message
    hints = {"s3": "; restore it (aws s3api restore-object) or copy it to a class read at once"}
    hints["azure"] = "; rehydrate it to the hot or cool tier (az storage blob set-tier) or copy it"
    assert [said for said in hints.values() if said in message] == (
        [hints[service]] if service in hints else []
    ), message


def test_google_s_token_service_out_of_reach_is_named() -> None:
    """The token endpoint of a service account's key does not answer (here nothing listens at
    the key's ``token_uri``): the outage is said as the token service's, not GCS's, with the
    system's words for it."""
    key = _service_account(f"http://127.0.0.1:{servers.free_port()}/token")
    store = open_store("gs://bucket/p", Environ({}), json.dumps(key), "gcs_key")
    store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
    with store, pytest.raises(TransientStoreError) as caught:
        store.list()
    said = "cannot reach Google's token service (Connection refused)"
    assert said in str(caught.value), caught.value


def test_google_s_token_service_that_does_not_exist_is_a_clear_error_at_once(
    unknown_name: str,
) -> None:
    """The token endpoint of a service account's key whose host the resolver says does not
    exist (the key's ``token_uri`` mistyped, or a network without Google's public names) is an
    error at once, naming the host: it was waited out as an outage of the token service."""
    key = _service_account(f"https://{unknown_name}/token")
    store = open_store("gs://bucket/p", Environ({}), json.dumps(key), "gcs_key")
    store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
    with store, pytest.raises(StoreError) as caught:
        store.list()
    assert not isinstance(caught.value, TransientStoreError), caught.value
    assert f"the host {unknown_name} does not exist (" in str(caught.value), caught.value


def _service_account(token_uri: str) -> dict[str, str]:
    """A service account's key as Google gives it, with a real RSA key (google-auth signs with
    it) and its ``token_uri``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": "k1",
        "private_key": pem.decode(),
        "client_email": "trainer@p.iam.gserviceaccount.com",
        "token_uri": token_uri,
    }


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ({"type": "service_account"}, "client_email"),
        (
            {
                "type": "service_account",
                "client_email": "trainer@p.iam.gserviceaccount.com",
                "token_uri": "https://oauth2.googleapis.com/token",
                "private_key": "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LTQ3MTE=\n-----END "
                "PRIVATE KEY-----\n",
            },
            "key",
        ),
    ],
    ids=["fields-missing", "key-damaged"],
)
def test_a_service_account_key_google_auth_refuses_names_the_secret(
    key: dict[str, str], reason: str
) -> None:
    """A secret that is JSON but no usable key: an error naming the secret and why, at once
    and never showing the key (google-auth's exception escaped with a traceback before)."""
    store = open_store("gs://bucket/p", Environ({}), json.dumps(key), "gcs_key")
    with store, pytest.raises(AccessDeniedError) as caught:
        store.list()
    message = str(caught.value)
    assert "secret 'gcs_key' is not a usable service account key (" in message, message
    said = message.partition("(")[2]
    assert reason in said and "c2VjcmV0" not in message, message


def test_open_store_urls() -> None:
    environ = Environ({"AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
    s3 = open_store("s3://bucket/some/prefix", environ)
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    assert s3.endpoint_url == "http://127.0.0.1:1" and s3.proxies == Proxies()
    proxied = {"https_proxy": "http://p:3128", "ALL_PROXY": "http://a:1", "NO_PROXY": ".corp"}
    s3 = open_store("s3://bucket/p", Environ({**environ.values, **proxied}))
    assert isinstance(s3, S3Store) and s3.proxies == Proxies("http://p:3128", "http://a:1", ".corp")
    assert s3.proxies.for_endpoint("http://127.0.0.1:1") == "http://a:1"
    assert (
        s3.proxies.for_endpoint(None) == s3.proxies.for_endpoint("https://s3.x") == "http://p:3128"
    )
    r2 = open_store("r2://acct9.bkt/p", Environ({}))
    assert isinstance(r2, S3Store) and r2.bucket == "bkt"
    assert r2.endpoint_url == "https://acct9.r2.cloudflarestorage.com"
    hf = open_store("hf://owner/repo@v2", Environ({}))
    assert isinstance(hf, HFStore) and (hf.repo_id, hf.revision) == ("owner/repo", "v2")
    for bad in ("r2://nodot/x", "ftp://host/x"):
        with pytest.raises(Exception, match="URL"):
            open_store(bad, Environ({}))
    unreadable = {  # each a panic of the engine, or an exception of no store's, when opened
        "s3://a b/x": "which no bucket can be named",
        "azure://acct/a b/x": "which no bucket can be named",
        "gs://a?b/x": "which no bucket can be named",
        "s3://b/x/../y": "has a '.' or '..' segment in its path",
        "s3://b/x\0y": "has a control character ('\\x00') in its path",
        "https://[::1/x": "is no URL of a host",
        "https://a b/x": "is no URL of a host",
    }
    for url, why in unreadable.items():
        with pytest.raises(UsageError) as refused:
            open_store(url, environ)
        assert str(refused.value).startswith(f"invalid URL: {url!r} "), refused.value
        assert why in str(refused.value)


def test_part_size_keeps_huge_files_under_10000_parts() -> None:
    tuning = Tuning()
    for size in (1, 16 * MiB, 100 * 1024**3, 500 * 1024**3, 5 * 1024**4):
        bases = (
            tuning.part_size,
            tuning.upload_part_size,
        )
        for base in bases:
            part = tuning.part_size_for(size, base)
            assert -(-size // part) <= 10_000 and part % MiB == 0


@pytest.mark.parametrize("fillers", [0, SYNCFS_MIN_FILES], ids=["fsync-each", "one-syncfs"])
def test_a_file_stores_upload_stream_tells_each_file_apart(tmp_path: Path, fillers: int) -> None:
    """A batch of the file store's upload stream, small (a fsync per file) or large (one
    syncfs): each file is told its own outcome (a source that is gone as it is, a key that
    cannot be stored as a typed error), the others are stored whole, and no temporary file is
    left in the store."""
    store = open_store((tmp_path / "store").as_uri())
    store.write_bytes("taken", b"an object")  # so "taken/inside" cannot be a file
    source = tmp_path / "source"
    source.mkdir()
    contents = {"first": b"one" * 1000, "last": b""}
    contents |= {f"filler-{i}": payload(3000 + i, seed=i) for i in range(fillers)}
    for name, data in contents.items():
        (source / name).write_bytes(data)
    batch = [
        Upload(source / "first", "batch/first"),
        Upload(source / "gone", "batch/gone"),
        Upload(source / "first", "taken/inside"),
        Upload(source / "last", "batch/last"),
        *(Upload(source / f"filler-{i}", f"batch/filler-{i}") for i in range(fillers)),
    ]
    handed = iter([batch])
    told: dict[str, str | Exception] = {}
    store.upload_stream(
        lambda: next(handed, None), lambda u, outcome: told.update({u.key: outcome})
    )
    for name, data in contents.items():
        assert told[f"batch/{name}"] == hashlib.sha256(data).hexdigest()
        assert store.read_bytes(f"batch/{name}") == data
    gone = told["batch/gone"]
    assert isinstance(gone, FileNotFoundError) and not isinstance(gone, NotFoundError)
    assert isinstance(told["taken/inside"], KeyConflictError)
    stored = {f"batch/{name}" for name in contents} | {"taken"}
    assert {info.key for info in store.list()} == stored
    assert not [p for p in (tmp_path / "store").rglob("*") if p.name.endswith(".tmp")]


def test_syncfs_writes_out_a_file_system_or_says_it_cannot(tmp_path: Path) -> None:
    assert syncfs(tmp_path), "Linux has syncfs(2)"
    assert not syncfs(tmp_path / "missing")


def test_a_file_stores_upload_stream_on_a_full_disk_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    """Files that do not fit are told their error; nothing half-written stays in the store."""
    source = tmp_path / "source"
    source.mkdir()
    for index in range(4):
        (source / f"part-{index}").write_bytes(payload(700_000, seed=index))
    with small_tmpfs(tmp_path / "store", "1m") as root:
        store = open_store(root.as_uri())
        handed = iter([[Upload(path, f"full/{path.name}") for path in sorted(source.iterdir())]])
        told: dict[str, str | Exception] = {}

        def tell(upload: Upload, outcome: str | Exception) -> None:
            told[upload.key] = outcome

        store.upload_stream(lambda: next(handed, None), tell)
        failed = [key for key, outcome in told.items() if isinstance(outcome, Exception)]
        assert len(told) == 4 and failed, told
        assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_record_of_ranges_is_taken_up_only_for_the_same_object_version_range_size_and_boot(
    tmp_path: Path,
) -> None:
    """What a download in ranges wrote, as its record says, is taken up by a later download only
    of the same key, version, size and range size, in the same boot, into a partial file of the
    object's size; a partial file of a process's own (not one a later process may take up) gets
    no record."""
    import dataclasses

    from bt_agent.storage.base import partial_path, ranges_record, resumable_path
    from bt_agent.storage.ranges import Ranged

    partial = resumable_path(tmp_path / "model.bin")
    partial.write_bytes(bytes(4000))
    info = ObjectInfo("model.bin", 4000, "v1")
    job = Ranged(info, partial, 1024)
    job.wrote(0, 1024)  # the first write is recorded at once
    job.wrote(1024, 1536)
    job.save()
    taken = Ranged.taken_up(partial, info, 1024)
    assert taken.begun and taken.written == {0: 1024, 1024: 512}
    assert taken.to_fetch() == [(1024, 1536, 2048), (2048, 2048, 3072), (3072, 3072, 4000)]
    others = [
        dataclasses.replace(info, version="v2"),
        dataclasses.replace(info, version=None),
        dataclasses.replace(info, key="other.bin"),
        dataclasses.replace(info, size=5000),
    ]
    for other in others:
        assert Ranged.taken_up(partial, other, 1024).written == {}, other
    assert Ranged.taken_up(partial, info, 2048).written == {}, "another range size"
    record = ranges_record(partial)
    state = json.loads(record.read_text())
    record.write_text(json.dumps({**state, "boot": "an earlier boot"}))
    assert Ranged.taken_up(partial, info, 1024).written == {}, "another boot"
    record.write_text(json.dumps(state))
    partial.write_bytes(bytes(10))
    assert Ranged.taken_up(partial, info, 1024).written == {}, "a partial file of another size"
    own = partial_path(tmp_path / "model.bin")
    Ranged(info, own, 1024, {0: 1024}).save()
    assert not ranges_record(own).exists()
