"""Batch downloads of small S3 objects (bt_agent.storage.s3_batch), against SeaweedFS.

The batch path places what it can and hands back the rest: every object taken is told to the
caller once, placed whole and verified or not at all, and a failure stops the batch from taking
more. What the batch leaves, the one-object path fetches (covered by test_storage.py).
"""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
from test_storage import _s3

from bt_agent.errors import IntegrityError
from bt_agent.storage.base import ObjectInfo, Wanted
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
    store._call(
        "k",
        "put_object",
        Key=store._key("lying.bin"),
        Body=b"actual content",
        Metadata={"sha256": hashlib.sha256(b"other content").hexdigest()},
    )
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
