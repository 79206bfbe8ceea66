"""Many small S3 objects from one thread (bt_agent.storage.s3_batch), against SeaweedFS.

Batch downloads place what they can and hand back the rest: every object taken is told to the
caller once, placed whole and verified or not at all, and a failure stops the batch from taking
more. What the batch leaves, the one-object path fetches (covered by test_storage.py). The
upload stream tells each file's outcome, an error included, and goes on.
"""

from __future__ import annotations

import hashlib
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from test_storage import _s3, put_lying_object

from bt_agent.errors import IntegrityError, TransientStoreError
from bt_agent.settings import Environ
from bt_agent.storage import open_store
from bt_agent.storage.base import ObjectInfo, Upload, Wanted
from bt_agent.storage.s3 import S3Store
from bt_agent.storage.s3_batch import CONNECTIONS, Declined


def _store(server: servers.SeaweedFS, r2: bool = False) -> S3Store:
    store = _s3(server, r2=r2).make()
    assert isinstance(store, S3Store)
    return store


class _Told:
    """The ``finished`` callback: what the batch said of each object it took."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Exception | None] = {}

    def __call__(self, wanted: Wanted, error: Exception | None) -> None:
        assert wanted.expected.key not in self.outcomes, "told twice"
        self.outcomes[wanted.expected.key] = error


def _wanted(store: S3Store, target: Path, mode: int = 0o644) -> list[Wanted]:
    return [Wanted(target / info.key, info, mode) for info in store.list()]


@pytest.mark.parametrize("r2", [False, True], ids=["s3", "r2"])
def test_a_batch_places_every_object_verified(
    s3_server: servers.SeaweedFS, tmp_path: Path, r2: bool
) -> None:
    store = _store(s3_server, r2)
    files = {f"f{i:03d}.bin": hashlib.sha256(bytes([i])).digest() * i for i in range(60)}
    files["a b+ü=&.json"] = b"{}"  # a key that needs encoding
    for key, data in files.items():
        store.write_bytes(key, data)
    assert store.batch_max_size() > 0
    told = _Told()
    store.download_batch(iter(_wanted(store, tmp_path, 0o444)), told)
    assert told.outcomes == dict.fromkeys(files)
    for key, data in files.items():
        assert (tmp_path / key).read_bytes() == data
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o444
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files), "no partial file left"


def test_a_failure_stops_the_batch_and_is_told(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(s3_server)
    for i in range(200):
        store.write_bytes(f"f{i:03d}.bin", b"x" * 100)
    wanted = _wanted(store, tmp_path)
    missing = Wanted(tmp_path / "gone.bin", ObjectInfo("gone.bin", 5, "etag"))
    items = iter([missing, *wanted])
    told = _Told()
    store.download_batch(items, told)
    assert isinstance(told.outcomes["gone.bin"], Declined)
    assert "404" in str(told.outcomes["gone.bin"])
    assert not (tmp_path / "gone.bin").exists()
    left = list(items)
    assert left, "no more objects are taken after a failure"
    assert len(told.outcomes) + len(left) == 201
    assert len(told.outcomes) <= 2 * CONNECTIONS
    for key, error in told.outcomes.items():
        assert (tmp_path / key).exists() == (error is None)


def test_content_that_differs_from_its_sha256_is_not_placed(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(s3_server)
    put_lying_object(store, "lying.bin")
    told = _Told()
    store.download_batch(iter(_wanted(store, tmp_path)), told)
    assert isinstance(told.outcomes["lying.bin"], IntegrityError)
    assert list(tmp_path.iterdir()) == []


def test_an_object_larger_than_listed_is_left_to_the_one_object_path(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The listing said small; the object was replaced by a large one since: the batch does
    not buffer it."""
    store = _store(s3_server)
    store.write_bytes("grew.bin", bytes(store.batch_max_size() + 1))
    told = _Told()
    item = Wanted(tmp_path / "grew.bin", ObjectInfo("grew.bin", 10, "old-etag"))
    store.download_batch(iter([item]), told)
    assert isinstance(told.outcomes["grew.bin"], Declined)
    assert list(tmp_path.iterdir()) == []


def test_a_stop_request_ends_the_batch(s3_server: servers.SeaweedFS, tmp_path: Path) -> None:
    store = _store(s3_server)
    for i in range(100):
        store.write_bytes(f"f{i:03d}.bin", b"y" * 10)
    wanted = _wanted(store, tmp_path)

    def until_stopped() -> Iterator[Wanted]:
        yield from wanted[:30]
        raise InterruptedError("stop requested")

    told = _Told()
    with pytest.raises(InterruptedError):
        store.download_batch(until_stopped(), told)
    assert len(told.outcomes) == 30, "every object taken is told, placed or not"
    placed = {p.name for p in tmp_path.iterdir()}
    assert placed == {key for key, error in told.outcomes.items() if error is None}


def test_no_batch_path_through_botocore(s3_server: servers.SeaweedFS) -> None:
    store = _store(s3_server)
    store.direct_requests = False
    assert store.batch_max_size() == 0


# --- the upload stream ------------------------------------------------------------------------


class _Feed:
    """``take`` for an upload stream: hands over the lists given, then ends it."""

    def __init__(self, *lists: list[Upload]) -> None:
        self.lists: list[list[Upload] | None] = [*lists, None]
        self.outcomes: dict[str, str | Exception] = {}

    def take(self) -> list[Upload] | None:
        return self.lists.pop(0)

    def finished(self, upload: Upload, outcome: str | Exception) -> None:
        assert upload.key not in self.outcomes, "told twice"
        self.outcomes[upload.key] = outcome


def _files(root: Path, count: int) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    files = {
        f"ckpt/f{i:03d}.bin": hashlib.sha256(str(i).encode()).digest() * i for i in range(count)
    }
    for key, data in files.items():
        (root / key.replace("/", "_")).write_bytes(data)
    return files


def _uploads(root: Path, keys: list[str]) -> list[Upload]:
    return [Upload(root / key.replace("/", "_"), key) for key in keys]


def test_an_upload_stream_stores_each_file_with_its_sha256(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(s3_server)
    files = _files(tmp_path / "src", 80)
    keys = list(files)
    feed = _Feed(_uploads(tmp_path / "src", keys[:30]), _uploads(tmp_path / "src", keys[30:]))
    store.upload_stream(feed.take, feed.finished)
    assert feed.outcomes == {key: hashlib.sha256(data).hexdigest() for key, data in files.items()}
    for key, data in files.items():
        assert store.read_bytes(key) == data
        assert store.stat(key).sha256 == hashlib.sha256(data).hexdigest(), "the metadata"
    assert store._memory.held == 0, "every byte taken from the budget is given back"


def test_an_upload_stream_reports_a_missing_file_and_goes_on(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(s3_server)
    files = _files(tmp_path / "src", 5)
    gone = Upload(tmp_path / "src" / "deleted.bin", "ckpt/deleted.bin")
    feed = _Feed([gone, *_uploads(tmp_path / "src", list(files))])
    store.upload_stream(feed.take, feed.finished)
    assert isinstance(feed.outcomes.pop("ckpt/deleted.bin"), FileNotFoundError)
    assert feed.outcomes == {key: hashlib.sha256(data).hexdigest() for key, data in files.items()}
    assert not store.exists("ckpt/deleted.bin")


def test_an_upload_stream_outlives_a_store_outage(
    own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    """Files handed over while the store is down are told unreachable (the sidecar retries
    them); once it is back, the same stream stores the next ones on new connections."""
    store = open_store("s3://store/up", Environ(own_s3.client_env()))
    assert isinstance(store, S3Store)
    files = _files(tmp_path / "src", 12)
    keys = list(files)
    before, during, after = keys[:4], keys[4:8], keys[8:]
    outcomes: dict[str, str | Exception] = {}
    steps = [before, during, after]
    handed: list[str] = []

    def told(count: int) -> None:  # outcomes come from the stream's own thread
        deadline = time.monotonic() + 120
        while len(outcomes) < count:
            assert time.monotonic() < deadline, outcomes
            time.sleep(0.01)

    def take() -> list[Upload] | None:
        told(len(handed))
        if not steps:
            return None
        step = steps.pop(0)
        if step is during:
            own_s3.stop()
        elif step is after:
            own_s3.start()
        handed.extend(step)
        return _uploads(tmp_path / "src", step)

    def finished(upload: Upload, outcome: str | Exception) -> None:
        outcomes[upload.key] = outcome

    store.upload_stream(take, finished)
    for key in before + after:
        assert outcomes[key] == hashlib.sha256(files[key]).hexdigest(), key
        assert store.read_bytes(key) == files[key]
    for key in during:
        assert isinstance(outcomes[key], TransientStoreError), outcomes[key]
        assert "cannot reach" in str(outcomes[key])


def test_an_upload_stream_that_fails_tells_every_file_it_took(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The stream itself failing (a stand-in: the caller's own ``finished`` raising once, an
    error the stream's workers do not expect) loses no file it took: each is told once, the
    files not yet sent with the stream's error, so that the sidecar uploads them again."""
    store = _store(s3_server)
    files = _files(tmp_path / "src", 40)
    keys = list(files)
    lists: list[list[str] | None] = [keys[:20], keys[20:], None]
    taken: list[str] = []
    outcomes: dict[str, str | Exception] = {}
    broken = [True]

    def take() -> list[Upload] | None:
        step = lists.pop(0) if lists else None
        if step is None:
            return None
        taken.extend(step)
        return _uploads(tmp_path / "src", step)

    def finished(upload: Upload, outcome: str | Exception) -> None:
        if broken.pop() if broken else False:
            raise RuntimeError("a bug in the caller's bookkeeping")
        assert upload.key not in outcomes, "told twice"
        outcomes[upload.key] = outcome

    with pytest.raises(RuntimeError, match="bookkeeping"):
        store.upload_stream(take, finished)
    for thread in threading.enumerate():  # the feed may still be taking the second list
        if thread.name == "bt-upload-feed":
            thread.join(10)
    assert sorted(outcomes) == sorted(taken) and taken, "every file taken was told"
    for key, outcome in outcomes.items():
        assert outcome == hashlib.sha256(files[key]).hexdigest() or (
            isinstance(outcome, RuntimeError) and "bookkeeping" in str(outcome)
        ), (key, outcome)
    assert any(isinstance(outcome, RuntimeError) for outcome in outcomes.values())
