"""Transient failures: a store that goes away mid-transfer is retried with backoff, and either
comes back (the transfer completes) or ends in a clear error naming the URI."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import servers
from fault_proxy import FaultProxy

from bt_agent.errors import IntegrityError, TransientStoreError
from bt_agent.settings import Environ
from bt_agent.storage import open_store
from bt_agent.storage.base import Upload, Wanted
from bt_agent.storage.engine import Tuning
from bt_agent.storage.flight import Pace
from bt_agent.storage.keys import join_key, relative_key
from bt_agent.storage.retry import OutageWait, RetryPolicy, retry, retry_for
from bt_agent.storage.s3 import S3Store

MiB = 1024 * 1024
T = TypeVar("T")


def _store(
    server: servers.SeaweedFS,
    policy: RetryPolicy,
    tls: bool = False,
    bucket: str = "",
    endpoint: str = "",
) -> S3Store:
    """A store of a new bucket on ``server`` (of ``bucket``, where named), its requests to
    ``endpoint`` where one is given (a link in front of the server)."""
    if not bucket:
        bucket = f"f{uuid.uuid4().hex[:10]}"
        server.create_bucket(bucket)
    store = open_store(*_settings(server, tls, bucket, endpoint))
    assert isinstance(store, S3Store)
    store.tuning = Tuning(**TUNING)
    store.policy = policy
    return store


#: Small parts, few at once: a download of tens of MiB is many ranges, some whole early.
TUNING = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB, "upload_part_size": 5 * MiB}
TUNING["ranges"] = 2


def _settings(
    server: servers.SeaweedFS, tls: bool, bucket: str, endpoint: str
) -> tuple[str, Environ, str, str]:
    """:func:`open_store`'s arguments for ``bucket`` on ``server``, requests to ``endpoint``
    where one is given: the URL, the environment, the secret holding the keys and its name."""
    secret = (
        f'{{"aws_access_key_id": "{servers.ACCESS_KEY}", '
        f'"aws_secret_access_key": "{servers.SECRET_KEY}"}}'
    )
    environ = {**server.client_env(tls), "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    if endpoint:
        environ["AWS_ENDPOINT_URL"] = endpoint
    return f"s3://{bucket}/x", Environ(environ), secret, "creds"


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


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_store_killed_mid_download_gives_a_clear_error_and_leaves_nothing(
    own_s3: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """A store that dies while a large object comes in ranges: each attempt ends once none
    of its ranges is in flight, the last in a clear error naming the URI, and neither the
    destination nor a partial file is left."""
    policy = RetryPolicy(attempts=3, base_seconds=0.05, cap_seconds=0.2)
    store = _store(own_s3, policy, tls)
    store.upload_file(_big_file(tmp_path, 400 * MiB), "model.bin")
    info = store.stat("model.bin")
    out = tmp_path / "out"
    out.mkdir()
    outcome: list[BaseException] = []

    def download() -> None:
        try:
            store.download("model.bin", out / "model.bin", info)
        except BaseException as exc:
            outcome.append(exc)

    fetching = threading.Thread(target=download)
    fetching.start()
    deadline = time.monotonic() + 30
    while not any(path.stat().st_blocks for path in out.iterdir()):  # a range has landed
        assert time.monotonic() < deadline and fetching.is_alive(), outcome
        time.sleep(0.005)
    own_s3.stop(sig=signal.SIGKILL)
    fetching.join(timeout=60)
    assert not fetching.is_alive()
    [error] = outcome
    assert isinstance(error, TransientStoreError), repr(error)
    assert "gave up after 3 attempts" in str(error) and store.uri("model.bin") in str(error)
    assert list(out.iterdir()) == [], "no partial file is left"


@pytest.mark.parametrize("waited", [False, True], ids=["store-retries", "outage-wait"])
@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_download_retried_after_an_outage_fetches_only_the_bytes_it_lacked(
    own_s3: servers.SeaweedFS, tmp_path: Path, tls: bool, waited: bool
) -> None:
    """A store that goes away while a large object comes in ranges, and is back: the retry
    fetches only the bytes the attempts before did not write, each range from where it stopped
    (the bytes through the link say so: the object's size within 2%, not that and what came
    before the outage, nor the parts of ranges under way when it began), and the file
    is whole and right. Back within the store's own retries, or only once they were spent and
    the caller's outage wait (``attempt``, as staging's) made the download again. The store
    reached through a real paced link (10 MB/s a connection), the server killed and started
    again."""
    from far_link import FarLink

    if waited:  # spent long before the store is back: the wait above them brings it
        policy, outage = RetryPolicy(attempts=2, base_seconds=0.05, cap_seconds=0.1), 4.0
    else:
        policy, outage = RetryPolicy(attempts=12, base_seconds=0.5, cap_seconds=2.0), 1.0
    near = _store(own_s3, policy, tls)
    source = _big_file(tmp_path, 100 * MiB)
    near.upload_file(source, "model.bin")
    far = FarLink(own_s3.https_port if tls else own_s3.port, 0.0, 10e6)
    endpoint = f"https://localhost:{far.port}" if tls else far.endpoint
    store = _store(own_s3, policy, tls, bucket=near.url.split("/")[2], endpoint=endpoint)
    out = tmp_path / "out" / "model.bin"
    outcome: list[BaseException] = []
    waits: list[TransientStoreError] = []

    def attempt(call: Callable[[], T]) -> T:
        return retry_for(call, 120.0, on_failure=lambda exc, left: waits.append(exc))

    def download() -> None:
        try:
            store.download("model.bin", out, store.stat("model.bin"), attempt)
        except BaseException as exc:
            outcome.append(exc)

    fetching = threading.Thread(target=download)
    try:
        fetching.start()
        deadline = time.monotonic() + 60
        while far.passed < 40 * MiB:  # some ranges whole, most to come
            assert time.monotonic() < deadline and fetching.is_alive(), outcome
            time.sleep(0.01)
        own_s3.stop(sig=signal.SIGKILL)
        time.sleep(outage)
        own_s3.start()
        fetching.join(timeout=120)
    finally:
        far.close()
    assert not fetching.is_alive() and not outcome, outcome
    assert bool(waits) == waited, waits
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()
    assert far.passed < 1.02 * 100 * MiB, f"{far.passed / MiB:.1f} MiB came for 100 MiB"
    assert [path.name for path in out.parent.iterdir()] == ["model.bin"], "no partial file is left"


#: A process that downloads an object as staging fills the node cache (``resumable``).
_RESUMABLE_DOWNLOAD = """
import json, sys
from pathlib import Path
from bt_agent.settings import Environ
from bt_agent.storage import open_store
from bt_agent.storage.engine import Tuning
url, environ, secret, tuning, key, destination = json.loads(sys.argv[1])
store = open_store(url, Environ(environ), secret, "creds")
store.tuning = Tuning(**tuning)
store.download(key, Path(destination), store.stat(key), resumable=True)
"""


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_download_killed_mid_way_is_taken_up_by_the_next_process(
    own_s3: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """A process downloading a large object in ranges into a partial file that a later one may
    take up (as staging fills the node cache) is killed (SIGKILL: nothing of it runs after)
    mid-way; the partial file and its record stay, and the next download, in this process,
    fetches only about what the first had not written (the bytes through a real paced link,
    10 MB/s a connection, say so). The file is whole and right; nothing partial is left."""
    import json
    import subprocess
    import sys

    from far_link import FarLink

    from bt_agent.storage.base import ranges_record, resumable_path

    size = 60 * MiB
    source = _big_file(tmp_path, size)
    near = _store(own_s3, RetryPolicy(), tls)
    near.upload_file(source, "model.bin")
    bucket = near.url.split("/")[2]
    far = FarLink(own_s3.https_port if tls else own_s3.port, 0.0, 10e6)
    endpoint = f"https://localhost:{far.port}" if tls else far.endpoint
    url, environ, secret, _ = _settings(own_s3, tls, bucket, endpoint)
    out = tmp_path / "out" / "model.bin"
    argument = [url, dict(environ.values), secret, TUNING, "model.bin", str(out)]
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _RESUMABLE_DOWNLOAD, json.dumps(argument)]
        )
        deadline = time.monotonic() + 60
        while far.passed < 30 * MiB:  # half of it come
            assert time.monotonic() < deadline and process.poll() is None, process.returncode
            time.sleep(0.01)
        process.kill()
        assert process.wait(timeout=30) == -signal.SIGKILL
        partial = resumable_path(out)
        assert partial.exists() and ranges_record(partial).exists(), list(out.parent.iterdir())
        before = far.passed
        store = _store(own_s3, RetryPolicy(), tls, bucket=bucket, endpoint=endpoint)
        store.download("model.bin", out, store.stat("model.bin"), resumable=True)
        again = far.passed - before
    finally:
        far.close()
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()
    assert again < 0.6 * size, f"{again / MiB:.1f} MiB came again for {size / MiB:.0f} MiB"
    assert [path.name for path in out.parent.iterdir()] == ["model.bin"], "nothing partial is left"


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("size", [8 * MiB, 24 * MiB], ids=["streamed", "ranged"])
def test_an_answer_that_stalls_mid_body_is_given_up_and_fetched_again(
    own_s3: servers.SeaweedFS, tmp_path: Path, tls: bool, size: int
) -> None:
    """A connection that goes silent mid-answer (open, no error, no byte: the first one
    through the link stops after 1 MiB) is given up after the read timeout (1 s here; 60 s by
    default) and the rest fetched again, for one streamed GET and for ranged GETs alike:
    without it the download waited for the whole request's limit (300 s)."""
    from far_link import FarLink

    source = _big_file(tmp_path, size)
    near = _store(own_s3, RetryPolicy(), tls)
    near.upload_file(source, "model.bin")
    far = FarLink(own_s3.https_port if tls else own_s3.port, 0.0, 1e9, stall_after=MiB)
    endpoint = f"https://localhost:{far.port}" if tls else far.endpoint
    store = _store(own_s3, RetryPolicy(), tls, bucket=near.bucket, endpoint=endpoint)
    store.tuning = Tuning(**{**TUNING, "multipart_threshold": 16 * MiB, "read_timeout": 1.0})
    out = tmp_path / "model.bin.out"
    began = time.monotonic()
    done = threading.Thread(
        target=store.download, args=("model.bin", out, near.stat("model.bin")), daemon=True
    )
    try:
        done.start()
        done.join(30)
    finally:
        far.close()
    assert not done.is_alive(), "the download still waits on the stalled connection"
    assert time.monotonic() - began < 15
    assert far.connections >= 2 and far.passed >= size
    assert out.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_halted_store_ends_its_downloads_at_once_and_keeps_what_they_wrote(
    own_s3: servers.SeaweedFS, tmp_path: Path, tls: bool
) -> None:
    """``halt()``, as a stopping process calls it: a large download under way through a slow
    link ends at once with :class:`InterruptedError` (its requests ended: nothing more comes
    through the link), the partial file and its record kept for a later process, and no
    download starts after it."""
    from far_link import FarLink

    from bt_agent.storage.base import ranges_record, resumable_path

    near = _store(own_s3, RetryPolicy(), tls)
    near.upload_file(_big_file(tmp_path, 40 * MiB), "model.bin")
    far = FarLink(own_s3.https_port if tls else own_s3.port, 0.0, 4e6)
    endpoint = f"https://localhost:{far.port}" if tls else far.endpoint
    store = _store(own_s3, RetryPolicy(), tls, bucket=near.url.split("/")[2], endpoint=endpoint)
    out = tmp_path / "out" / "model.bin"
    info = store.stat("model.bin")
    outcome: list[str] = []  # not the error: its traceback would hold what it ended

    def download() -> None:
        try:
            store.download("model.bin", out, info, resumable=True)
        except BaseException as exc:
            outcome.append(type(exc).__name__)

    fetching = threading.Thread(target=download)
    try:
        fetching.start()
        deadline = time.monotonic() + 30
        while far.passed < 4 * MiB:
            assert time.monotonic() < deadline and fetching.is_alive(), outcome
            time.sleep(0.01)
        halted = time.monotonic()
        store.halt()
        fetching.join(timeout=10)
        ended = time.monotonic() - halted
        passed = far.passed
        time.sleep(1.0)
        after = far.passed - passed
    finally:
        far.close()
    assert not fetching.is_alive() and ended < 1.0, f"{ended:.2f} s"
    assert outcome == ["InterruptedError"], outcome
    assert after < MiB, f"{after} bytes came after the halt"
    partial = resumable_path(out)
    assert partial.exists() and ranges_record(partial).exists()
    with pytest.raises(InterruptedError):
        store.download("model.bin", out, info, resumable=True)


def test_a_checkpoint_source_halts_the_store_it_reads(
    own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A committed checkpoint staged as weights (``bt://``) reads through the job's store: a
    stop halts that store's downloads too."""
    from bt_agent.records import Manifest, ManifestFile
    from bt_agent.staging.trained import CheckpointSource

    store = _store(own_s3, RetryPolicy())
    manifest = Manifest(
        "job1", "p", 0, "checkpoint-1", "", "", [ManifestFile("a.bin", 6 * MiB, "")]
    )
    source = CheckpointSource(store, manifest)
    store.upload_file(_big_file(tmp_path, 6 * MiB), f"{source.prefix}/a.bin")
    source.halt()
    with pytest.raises(InterruptedError, match="stopped"):
        store.download(
            f"{source.prefix}/a.bin", tmp_path / "a.bin", store.stat(f"{source.prefix}/a.bin")
        )


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


def test_the_engine_s_variables_for_encryption_and_request_payer_reach_each_write(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """object_store's own variables, which the engine reads from the process's environment, are
    honoured: ``AWS_SERVER_SIDE_ENCRYPTION`` (a bucket whose policy requires encryption refuses
    each write without its header) and ``AWS_REQUEST_PAYER`` (a requester-pays bucket). A PUT,
    a multipart upload's start and a copy carry them (the proxy in front of the server sees
    them; the server stores what it is sent)."""
    monkeypatch.setenv("AWS_SERVER_SIDE_ENCRYPTION", "AES256")
    monkeypatch.setenv("AWS_REQUEST_PAYER", "true")
    proxy = FaultProxy(s3_server.port)
    try:
        store = _store(s3_server, RetryPolicy(attempts=1), endpoint=proxy.endpoint)
        big = _big_file(tmp_path, 12 * MiB)
        with store:
            store.write_bytes("small.bin", b"weights")
            store.upload_file(big, "big.bin")
            store.copy("small.bin", "copy.bin")
            assert store.read_bytes("copy.bin") == b"weights"
    finally:
        proxy.close()
    writes = [head for head in proxy.heads if head.startswith((b"PUT", b"POST"))]
    starts = [head for head in writes if b"?uploads" in head.split(b"\r\n", 1)[0]]
    whole = [head for head in writes if b"?" not in head.split(b"\r\n", 1)[0]]
    assert len(starts) == 1 and len(whole) == 2, proxy.lines  # small.bin, copy.bin
    for head in starts + whole:
        assert b"\r\nx-amz-server-side-encryption: AES256" in head, head
    assert all(b"\r\nx-amz-request-payer: requester" in head for head in proxy.heads)


def test_retry_gives_up_and_says_so() -> None:
    def always() -> None:
        raise TransientStoreError("s3://b/k: cannot reach the endpoint", "s3://b/k")

    with pytest.raises(TransientStoreError, match="gave up after 2 attempts") as caught:
        retry(always, RetryPolicy(attempts=2), sleep=lambda s: None)
    assert caught.value.uri == "s3://b/k"
    with pytest.raises(TransientStoreError) as once:  # one attempt: nothing given up
        retry(always, RetryPolicy(attempts=1), sleep=lambda s: None)
    assert str(once.value) == "s3://b/k: cannot reach the endpoint"


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
    waited: list[float] = []
    assert retry_for(flaky, 60, sleep=sleep, clock=clock, on_back=waited.append) == "ok"
    assert now[0] < back_at + 12, "retried soon after the store came back"
    assert waited == [now[0]], "told how long it waited, once it got through"
    assert retry_for(lambda: "ok", 60, on_back=waited.append) == "ok" and len(waited) == 1

    now[0] = 0.0
    with pytest.raises(InterruptedError):
        retry_for(down, 60, stopping=lambda: now[0] > 5, sleep=sleep, clock=clock)
    assert now[0] < 6, "a stop request ends the wait"


def test_an_outage_is_said_once_per_label_and_so_is_its_end() -> None:
    """Threads that share a label wait out one outage: it is said once, its end once (by the
    first call through), and a second outage is said again."""
    said: list[str] = []
    down = threading.Event()
    down.set()
    wait = OutageWait(60, lambda: False, "the source", said.append, said.append)

    def fetch() -> str:
        if down.is_set():
            raise TransientStoreError("cannot reach s3://b/k", "s3://b/k")
        return "ok"

    def call() -> None:
        assert wait.call("weights[0]", fetch) == "ok"

    for _ in range(2):  # two outages
        callers = [threading.Thread(target=call) for _ in range(4)]
        for caller in callers:
            caller.start()
        deadline = time.monotonic() + 10
        while len(said) % 2 == 0:  # until this outage is said
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # every caller has failed once
        down.clear()
        for caller in callers:
            caller.join(timeout=30)
        down.set()
    assert [line.split(" (")[0].split(" after")[0] for line in said] == [
        "weights[0]: the source is unreachable",
        "weights[0]: the source is reachable again",
    ] * 2, said
    assert said[0].endswith("retrying for up to 60 s") and said[1].endswith(" s"), said


# --- answers and damage a real server gives on no demand: a proxy in front of it --------------


def _through(proxy: FaultProxy, server: servers.SeaweedFS) -> S3Store:
    store = _store(server, RetryPolicy(attempts=3, base_seconds=0.01, cap_seconds=0.02))
    store.endpoint_url = proxy.endpoint
    return store


def test_slow_down_answers_are_retried(s3_server: servers.SeaweedFS, tmp_path: Path) -> None:
    """503 SlowDown (S3's request-rate answer) is retried with backoff, for a small PUT and for
    the parts of a multipart upload alike; the upload completes."""
    proxy = FaultProxy(s3_server.port, slow_down=4)
    try:
        store = _through(proxy, s3_server)
        assert store.write_bytes("small.bin", b"weights")
        source = _big_file(tmp_path, 12 * MiB)
        proxy.slow_down += 2
        result = store.upload_file(source, "model.bin")
    finally:
        proxy.close()
    assert proxy.answered == 6
    assert result.sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    assert store.read_bytes("model.bin") == source.read_bytes()
    assert store.read_bytes("small.bin") == b"weights"


def test_a_body_damaged_on_the_way_is_refused_by_the_service(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """Every request with a body carries its checksum, which the service verifies: a byte
    flipped on the way (a whole object, or one part of a multipart upload) is refused, and
    nothing is stored: not the object, nor the multipart upload the failure ended."""
    proxy = FaultProxy(s3_server.port, corrupt=1)
    try:
        store = _through(proxy, s3_server)
        with pytest.raises(IntegrityError, match="checksum"):
            store.write_bytes("small.bin", b"weights" * 100)
        proxy.corrupt += 1
        with pytest.raises(IntegrityError, match="checksum"):
            store.upload_file(_big_file(tmp_path, 12 * MiB), "model.bin")
    finally:
        proxy.close()
    assert proxy.corrupted == 2
    assert not store.exists("small.bin") and not store.exists("model.bin")
    assert _begun_uploads(s3_server, store) == []


def test_a_multipart_upload_that_fails_after_parts_landed_is_aborted(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A multipart upload whose first part landed and whose second is refused (a byte flipped
    on the way) fails, and leaves no upload begun behind it (its landed parts kept, and
    billed, out of sight): the engine aborts it."""
    proxy = FaultProxy(s3_server.port, corrupt=1, spare=1)
    try:
        store = _through(proxy, s3_server)
        store.tuning = Tuning(**{**TUNING, "upload_concurrency": 1})
        with pytest.raises(IntegrityError, match="checksum"):
            store.upload_file(_big_file(tmp_path, 12 * MiB), "model.bin")
    finally:
        proxy.close()
    assert (proxy.bodies, proxy.corrupted) == (2, 1)
    assert _begun_uploads(s3_server, store) == []
    assert not store.exists("model.bin")


def _begun_uploads(server: servers.SeaweedFS, store: S3Store) -> list[str]:
    """The keys of ``store`` (under its prefix) with multipart uploads begun and never
    completed, as the server lists them."""
    listed = server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return sorted(relative_key(store.prefix, u["Key"]) for u in listed.get("Uploads", []))


def _uploading_parts(server: servers.SeaweedFS, store: S3Store) -> list[str]:
    """The keys of :func:`_begun_uploads` with a part stored already."""
    client = server.client()
    listed = client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return sorted(
        relative_key(store.prefix, u["Key"])
        for u in listed.get("Uploads", [])
        if client.list_parts(Bucket=store.bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
    )


def test_multipart_uploads_left_under_a_prefix_are_aborted(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """What a process killed mid-upload leaves (multipart uploads begun, some parts sent) is
    aborted by prefix, over plain HTTP and TLS alike; the stores' other uploads are kept."""
    for tls in (False, True):
        store = _store(s3_server, RetryPolicy(), tls=tls)
        client = s3_server.client()
        for key in ("jobs/a/rank-0/x.bin", "jobs/a/rank-0/y.bin", "jobs/b/rank-0/x.bin"):
            name = join_key(store.prefix, key)
            begun = client.create_multipart_upload(Bucket=store.bucket, Key=name)
            client.upload_part(
                Bucket=store.bucket, Key=name, UploadId=begun["UploadId"], PartNumber=1, Body=b"x"
            )
        assert store.abort_uploads("jobs/a/rank-0/x") == 1
        assert store.abort_uploads("jobs/a/") == 1
        assert _begun_uploads(s3_server, store) == ["jobs/b/rank-0/x.bin"]
        assert store.abort_uploads("jobs/a/") == 0


def test_a_halt_ends_the_uploads_under_way_and_begins_none_of_those_waiting(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A process that stops with uploads under way (the sidecar, as its drain ends) halts its
    store and aborts what is left: the two multipart uploads under way take no more parts and
    the third, waiting its turn (two at once per store), does not begin behind the abort. Their
    parts on their way (a file's last parts all go at once) are waited for, and what they left
    aborted again (S3 may keep a part that lands after its upload's abort), so a process that
    ends then leaves none begun, and no object stored. Through a far link, so the uploads are
    slow enough to be caught."""
    from far_link import FarLink
    from helpers import wait_for

    far = FarLink(s3_server.port, 0.05, 1e9)
    outcomes: dict[str, BaseException | None] = {}

    def upload(path: Path) -> None:
        try:
            store.upload_file(path, path.name)
            outcomes[path.name] = None
        except Exception as exc:
            outcomes[path.name] = exc

    try:
        store = _store(s3_server, RetryPolicy(), endpoint=far.endpoint)
        names = [f"part{i}.bin" for i in range(3)]
        block = hashlib.sha256(b"x").digest() * 32768  # 1 MiB
        for name in names:  # four parts each, all sent at once; the last, of 1 MiB, lands first
            (tmp_path / name).write_bytes(block * 16)
        threads = [threading.Thread(target=upload, args=(tmp_path / n,)) for n in names]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(_uploading_parts(s3_server, store)) == 2, 30, "two with a part")
        under_way = _begun_uploads(s3_server, store)
        store.halt()
        assert store.abort_uploads("") == 2
        assert store.wait_uploads()
        still_under_way = [thread.name for thread in threads if thread.is_alive()]
        store.abort_uploads("")
        for thread in threads:
            thread.join(60)
    finally:
        far.close()
    assert still_under_way == []
    (waiting,) = set(names) - set(under_way)
    assert isinstance(outcomes[waiting], InterruptedError), outcomes
    assert all(outcomes[name] is not None for name in under_way), outcomes
    assert _begun_uploads(s3_server, store) == []
    assert store.list("") == []


@pytest.mark.parametrize(
    ("size", "budget", "serial", "most"),
    [
        (1024, 16 * MiB, False, 128),
        (1024, 16 * MiB, True, 64),
        (MiB, 4 * MiB, False, 4),
        (256 * 1024, None, False, 61),
    ],
    ids=["far-store", "one-request-at-a-time", "bodies-bound", "bodies-bound-by-default"],
)
def test_a_batch_keeps_as_many_gets_waiting_as_fetch_faster(
    s3_server: servers.SeaweedFS,
    tmp_path: Path,
    size: int,
    budget: int | None,
    serial: bool,
    most: int,
) -> None:
    """A store far away (a proxy holds each request a while): a batch download starts with 32
    GETs waiting on it at once and doubles them, up to 128, while each doubling fetches
    faster; from a store that answers one request at a time a doubling does not, and the
    batch stays at 64 (the first doubling is always tried). Where the bodies would hold more
    than the batch's bytes, fewer are asked for at once: by default 16 MiB, room for 61 objects
    of 256 KiB beside the 1 MiB kept for the largest (a GET holds its body about twice while
    it comes)."""
    direct = _store(s3_server, RetryPolicy(attempts=1))
    # each level's rate is measured over 3 x its GETs; the last level is given several rounds
    # of its GETs, so that one of them finds them all waiting at once on a loaded machine
    count = 320 if serial else 6 * most
    for index in range(count):
        direct.write_bytes(f"small/{index:03d}", bytes([index % 256]) * size)
    proxy = FaultProxy(s3_server.port, delay=0.01 if serial else 0.3, serial=serial)
    environ = {**s3_server.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        with open_store(direct.url, Environ(environ)) as far:
            assert isinstance(far, S3Store)
            if budget is not None:
                far.tuning = Tuning(batch_get_bytes=budget)
            listed = far.list("small/")
            told: list[Exception | None] = []
            far.download_batch(
                iter(Wanted(tmp_path / info.key.replace("/", "-"), info) for info in listed),
                lambda _, error: told.append(error),
            )
        assert told == [None] * count
        assert proxy.most_waiting == most, proxy.most_waiting
        assert (tmp_path / "small-007").read_bytes() == bytes([7]) * size
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("doubled", "most"), [(1.0, 64), (2.0, 128)], ids=["near-store", "far-store"]
)
def test_a_level_is_judged_once_its_connections_are_open(doubled: float, most: int) -> None:
    """Each level's first calls wait on the connections it opens (50 ms of handshakes here, and
    30 ms more for the process's first: its TLS library seeds its random generator), then calls
    end at a steady rate. A level's rate is taken after those, so a doubling that keeps the
    steady rate (a near store: this machine is the bound) is not worth a second, and one that
    doubles it (a far store) is. (Counting the opening in the rate made the first level look
    slow and every batch go to 128.) The clock is a fake one: only the pace's arithmetic is
    under test here; the tests above run it against a real proxy."""
    now = [0.0]
    pace = Pace(32, 128, clock=lambda: now[0])
    level, since_change = pace.limit, 0
    for index in range(2000):
        rate = 1000.0 * doubled ** (level // 32 - 1)  # calls a second once connected
        now[0] += 1 / rate + (0.050 / level if since_change < level else 0.0)
        now[0] += 0.030 if index == 0 else 0.0
        pace.arrived()
        since_change += 1
        if pace.limit != level:
            level, since_change = pace.limit, 0
    assert (pace.limit, pace.most) == (most, most)


def test_an_upload_stream_keeps_as_many_puts_waiting_as_go_faster(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """The same for the small files of an upload stream (the checkpoint sidecar's): from 32
    PUTs waiting on a store far away at once up to 128, each file stored once."""
    direct = _store(s3_server, RetryPolicy(attempts=1))
    files = []
    # as for the GETs above: the last level is given several rounds of its PUTs (after 96 at 32
    # and 192 at 64), so that one of them finds them all waiting at once on a loaded machine
    for index in range(6 * 128):
        path = tmp_path / f"{index:03d}.bin"
        path.write_bytes(bytes([index % 256]) * 1024)
        files.append(Upload(path, f"small/{index:03d}"))
    proxy = FaultProxy(s3_server.port, delay=0.3)
    environ = {**s3_server.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        with open_store(direct.url, Environ(environ)) as far:
            handed = iter([files])
            told: dict[str, str | Exception] = {}
            far.upload_stream(
                lambda: next(handed, None),
                lambda upload, outcome: told.__setitem__(upload.key, outcome),
            )
        assert sorted(told) == [upload.key for upload in files]
        assert all(isinstance(outcome, str) for outcome in told.values()), told
        assert proxy.most_waiting == 128, proxy.most_waiting
        assert direct.read_bytes("small/007") == bytes([7]) * 1024
    finally:
        proxy.close()
