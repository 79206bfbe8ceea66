"""Transient failures: a store that goes away mid-transfer is retried with backoff, and either
comes back (the transfer completes) or ends in a clear error naming the URI."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import servers

from bt_agent.errors import TransientStoreError
from bt_agent.settings import Environ
from bt_agent.storage import open_store
from bt_agent.storage.budget import ByteBudget
from bt_agent.storage.retry import RetryPolicy, retry
from bt_agent.storage.s3 import S3Store, S3Tuning
from bt_agent.storage.s3_direct import DirectS3, Reply

MiB = 1024 * 1024


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[servers.SeaweedFS]:
    server = servers.seaweedfs(tmp_path)
    yield server
    server.stop()


def _store(server: servers.SeaweedFS, policy: RetryPolicy) -> S3Store:
    bucket = f"f{uuid.uuid4().hex[:10]}"
    server.create_bucket(bucket)
    secret = (
        f'{{"aws_access_key_id": "{servers.ACCESS_KEY}", '
        f'"aws_secret_access_key": "{servers.SECRET_KEY}"}}'
    )
    store = open_store(
        f"s3://{bucket}/x", Environ({"AWS_ENDPOINT_URL": server.endpoint}), secret, "creds"
    )
    assert isinstance(store, S3Store)
    store.tuning = S3Tuning(
        multipart_threshold=5 * MiB, part_size=5 * MiB, upload_part_size=5 * MiB, concurrency=2
    )
    store.policy = policy
    return store


def _big_file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "big.bin"
    block = hashlib.sha256(b"x").digest() * 32768  # 1 MiB
    path.write_bytes(block * (size // len(block)))
    return path


def test_store_killed_mid_upload_gives_a_clear_error(
    own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(own_s3, RetryPolicy(attempts=3, base_seconds=0.05, cap_seconds=0.2))
    source = _big_file(tmp_path, 200 * MiB)
    killer = threading.Timer(0.5, own_s3.stop, kwargs={"sig": signal.SIGKILL})
    killer.start()
    started = time.monotonic()
    with pytest.raises(TransientStoreError) as caught:
        store.upload_file(source, "model.bin")
    killer.join()
    message = str(caught.value)
    assert "gave up after 3 attempts" in message and store.uri("model.bin") in message
    assert time.monotonic() - started < 60
    # Every part's memory is given back, those cancelled before they started included: the
    # next upload must not wait for bytes nobody holds.
    deadline = time.monotonic() + 30
    while store._memory.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store._memory.held == 0


def test_store_back_within_the_retries_completes_the_upload(
    own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    store = _store(own_s3, RetryPolicy(attempts=12, base_seconds=0.5, cap_seconds=2.0))
    source = _big_file(tmp_path, 24 * MiB)
    own_s3.stop()

    def restart() -> None:
        time.sleep(1.5)
        own_s3.start()

    reviver = threading.Thread(target=restart)
    reviver.start()
    result = store.upload_file(source, "model.bin")
    reviver.join()
    assert result.sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    assert store.read_bytes("model.bin") == source.read_bytes()


def _intercept_parts(
    monkeypatch: pytest.MonkeyPatch,
    answer: Callable[[Callable[[], Reply], Mapping[str, str]], Reply],
) -> None:
    """The direct path's UploadPart requests answered by ``answer(send, query)`` (``send()``
    makes the real request), a stand-in for answers SeaweedFS gives on no demand; every other
    request goes through as it is."""
    request = DirectS3.request

    def intercepted(
        self: DirectS3,
        method: str,
        key: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        query: Mapping[str, str] | None = None,
    ) -> Reply:
        def send() -> Reply:
            return request(self, method, key, headers, body, query)

        return answer(send, query) if query and "partNumber" in query else send()

    monkeypatch.setattr(DirectS3, "request", intercepted)


def test_a_part_answer_the_direct_path_cannot_read_goes_through_botocore(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service that answers an UploadPart without an ETag (a stand-in for the answer, at the
    direct path's request): the store turns to botocore for good and the upload completes."""
    store = _store(s3_server, RetryPolicy(attempts=3, base_seconds=0.01, cap_seconds=0.02))
    source = _big_file(tmp_path, 12 * MiB)

    def without_etag(send: Callable[[], Reply], query: Mapping[str, str]) -> Reply:
        reply = send()
        reply.headers.pop("etag", None)
        return reply

    _intercept_parts(monkeypatch, without_etag)
    result = store.upload_file(source, "model.bin")
    assert store.direct is None  # botocore from now on
    assert result.sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    assert store.read_bytes("model.bin") == source.read_bytes()


def test_a_failed_multipart_upload_stops_reading_and_keeps_no_part(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every part answered with InternalError (a stand-in for the answer, at the direct path's
    request: SeaweedFS gives no such answer on demand; the upload's own code, the answer's
    parsing included, runs as is). The upload reads no further than the parts already in
    flight, and the error, kept by whoever reports it, holds no part's bytes: a 64 MiB file
    retried three times once held every part of every attempt."""
    store = _store(s3_server, RetryPolicy(attempts=3, base_seconds=0.01, cap_seconds=0.02))
    source = _big_file(tmp_path, 64 * MiB)
    sent: list[str] = []
    internal = b"<Error><Code>InternalError</Code><Message>internal error</Message></Error>"

    def failing(send: Callable[[], Reply], query: Mapping[str, str]) -> Reply:
        sent.append(query["partNumber"])
        time.sleep(0.02)
        return Reply(500, {}, internal)

    _intercept_parts(monkeypatch, failing)
    assert not store.exists("model.bin")  # the client built (its models: 11 MiB) before measuring
    tracemalloc.start()
    try:
        with pytest.raises(TransientStoreError, match="gave up after 3 attempts") as caught:
            store.upload_file(source, "model.bin")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value is not None  # the error is alive while memory is measured
    parts_per_attempt = 64 // 5 + 1
    assert len(sent) < 3 * parts_per_attempt / 2, sent
    assert held < 4 * 5 * MiB, f"{held / MiB:.0f} MiB held after the failure"
    assert store._memory.held == 0


def test_byte_budget_bounds_what_is_held_at_once() -> None:
    budget = ByteBudget(10)
    peak = 0
    lock = threading.Lock()

    def hold(size: int) -> None:
        nonlocal peak
        with budget.holding(size):
            with lock:
                peak = max(peak, budget.held)
            time.sleep(0.01)

    threads = [threading.Thread(target=hold, args=(size,)) for size in [3, 4, 5, 6, 1, 2] * 5]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert 6 <= peak <= 10 and budget.held == 0
    with budget.holding(1000):  # more than the whole budget: takes all of it, still served
        assert budget.held == 10
    assert budget.held == 0


def test_retry_backs_off_with_capped_jitter() -> None:
    slept: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise TransientStoreError("blip", "s3://b/k")
        return "ok"

    policy = RetryPolicy(attempts=5, base_seconds=1.0, cap_seconds=3.0)
    assert retry(flaky, policy, sleep=slept.append) == "ok"
    assert len(slept) == 3
    assert all(0 <= s <= min(3.0, 2**i) for i, s in enumerate(slept))


def test_retry_gives_up_and_says_so() -> None:
    def always() -> None:
        raise TransientStoreError("s3://b/k: cannot reach the endpoint", "s3://b/k")

    with pytest.raises(TransientStoreError, match="gave up after 2 attempts") as caught:
        retry(always, RetryPolicy(attempts=2), sleep=lambda s: None)
    assert caught.value.uri == "s3://b/k"


def test_retry_for_waits_out_an_outage_then_gives_up_or_stops() -> None:
    from bt_agent.errors import TransientStoreError
    from bt_agent.storage.retry import retry_for

    now = [0.0]
    calls: list[float] = []

    def clock() -> float:
        return now[0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    def down() -> None:
        calls.append(now[0])
        raise TransientStoreError("cannot reach the store")

    told: list[float] = []
    with pytest.raises(TransientStoreError):
        retry_for(
            down, 60, on_failure=lambda exc, left: told.append(left), sleep=sleep, clock=clock
        )
    assert calls[-1] >= 60 and len(calls) > 3, "kept trying for the whole window"
    assert told[0] == 60

    back_at = 25.0

    def flaky() -> str:
        if now[0] < back_at:
            raise TransientStoreError("cannot reach the store")
        return "ok"

    now[0] = 0.0
    assert retry_for(flaky, 60, sleep=sleep, clock=clock) == "ok"
    assert now[0] < back_at + 12, "retried soon after the store came back"

    now[0] = 0.0
    with pytest.raises(InterruptedError):
        retry_for(down, 60, stopping=lambda: now[0] > 5, sleep=sleep, clock=clock)
    assert now[0] < 6, "a stop request ends the wait"
