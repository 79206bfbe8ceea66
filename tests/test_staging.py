"""Staging BDN weights: plans, patterns, the node cache and mounts, against real servers."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import servers
from fault_proxy import FaultProxy
from helpers import Agent, wait_for
from http_proxy import ForwardProxy

from bt_agent.errors import StagingError, UnsafeKeyError
from bt_agent.log import AgentLog
from bt_agent.settings import NODE_CACHE_CONTAINER_DIR, Environ, parse_size
from bt_agent.spec.models import WeightsSource
from bt_agent.staging.cache import NodeCache, entry_id
from bt_agent.staging.patterns import selected
from bt_agent.staging.weights import SourcePlan, WeightsStager, plan_source
from bt_agent.storage import open_store
from bt_agent.storage.base import Fetched, ObjectInfo, ObjectStore


@pytest.mark.parametrize(
    ("path", "allow", "ignore", "expected"),
    [
        ("model.safetensors", ["*.safetensors"], None, True),
        ("sub/model.safetensors", ["*.safetensors"], None, False),  # * does not cross /
        ("sub/model.safetensors", ["**/*.safetensors"], None, True),
        ("model.safetensors", ["**/*.safetensors"], None, True),
        ("README.md", None, ["*.md"], False),
        ("config.json", ["*.json"], ["config.*"], False),  # ignore wins
        ("tokenizer.json", ["tokenizer.*", "*.safetensors"], None, True),
        ("a/b/c.bin", ["a/**"], None, True),
        ("x.bin", None, None, True),
    ],
)
def test_patterns(
    path: str, allow: list[str] | None, ignore: list[str] | None, expected: bool
) -> None:
    assert selected(path, allow, ignore) is expected


def _seed_s3(server: servers.SeaweedFS, files: dict[str, bytes]) -> str:
    bucket = f"w{uuid.uuid4().hex[:10]}"
    server.create_bucket(bucket)
    client = server.client()
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda k: client.put_object(Bucket=bucket, Key=f"data/{k}", Body=files[k]), files
            )
        )
    return f"s3://{bucket}/data"


_KEYS = {"AWS_ACCESS_KEY_ID": servers.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY}


def _seeded(
    source: str, files: dict[str, bytes], s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> dict[str, object]:
    """A weights source (``hf`` or ``s3``, read with the secret :func:`_env` gives) holding
    ``files``, mounted at ``/m``."""
    if source == "hf":
        repo = f"org/seeded-{uuid.uuid4().hex[:6]}"
        servers.hf_repo(hf_server.mirrors, repo, files)
        return {"source": f"hf://{repo}@main", "mount_location": "/m"}
    return {
        "source": _seed_s3(s3_server, files),
        "mount_location": "/m",
        "auth_secret_name": "s3_creds",
    }


def _job(weights: list[dict[str, object]], command: str) -> dict[str, object]:
    return {
        "image": {"base_image": "x"},
        "weights": weights,
        "runtime": {"start_commands": [command]},
    }


def _env(agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah) -> dict[str, str]:
    agent.secret(
        "s3_creds",
        json.dumps(
            {"aws_access_key_id": servers.ACCESS_KEY, "aws_secret_access_key": servers.SECRET_KEY}
        ),
    )
    return {"AWS_ENDPOINT_URL": s3_server.endpoint, "HF_ENDPOINT": hf_server.endpoint}


def test_job_reads_hf_and_s3_mounts(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    repo = f"org/tiny-{uuid.uuid4().hex[:6]}"
    model = {"config.json": b'{"hidden": 8}\n', "README.md": b"# card"}
    servers.hf_repo(hf_server.mirrors, repo, model, lfs={"model.safetensors": b"w" * 5000})
    data_url = _seed_s3(s3_server, {"train/0.jsonl": b'{"x": 1}\n', "train/1.jsonl": b"{}\n"})
    weights = [
        {
            "source": f"hf://{repo}@main",
            "mount_location": "/app/models/tiny",
            "ignore_patterns": ["*.md"],
        },
        {"source": data_url, "mount_location": "/app/data", "auth_secret_name": "s3_creds"},
    ]
    check = (
        "cat $M/config.json && wc -c < $M/model.safetensors && "
        "test ! -e $M/README.md && cat $D/train/0.jsonl && ls $D/train"
    )
    env = _env(agent, s3_server, hf_server)
    node = agent.node_root
    command = check.replace("$M", str(node / "app/models/tiny")).replace(
        "$D", str(node / "app/data")
    )
    result = agent.run_job(_job(weights, command), env=env)
    assert result.code == 0, result.text
    assert result.out.split() == ['{"hidden":', "8}", "5000", '{"x":', "1}", "0.jsonl", "1.jsonl"]
    assert "0 in the node cache, 2 to fetch" in result.err  # README.md ignored
    mounted = node / "app/models/tiny/model.safetensors"
    assert mounted.stat().st_mode & 0o222 == 0, "mounts are read-only"

    warm = agent.run_job(_job(weights, "true"), env=env)
    assert warm.code == 0, warm.text
    assert "2 in the node cache, 0 to fetch" in warm.err and "fetched" not in warm.err
    assert mounted.stat().st_nlink >= 2, "mounted by hard link from the cache"


def test_a_hub_dataset_is_staged_apart_from_a_model_of_its_name(
    hf_server: servers.Olah, tmp_path: Path
) -> None:
    """``hf://datasets/owner/name`` (huggingface_hub's own form) is the dataset, not a model
    of that name, pinned to its commit and cached as its own; ``hf://owner/name`` the model."""
    repo = f"org/both-{uuid.uuid4().hex[:6]}"
    servers.hf_repo(hf_server.mirrors, repo, {"config.json": b"model"})
    commit = servers.hf_repo(hf_server.mirrors, repo, {"train.jsonl": b"data"}, kind="datasets")
    environ = Environ({"HF_ENDPOINT": hf_server.endpoint})
    log = io.StringIO()
    where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
    stager = WeightsStager(NodeCache(tmp_path / "cache"), AgentLog(log), environ, {}, where)
    dataset, model = stager.stage(
        [
            WeightsSource(source=f"hf://datasets/{repo}", mount_location="/data"),
            WeightsSource(source=f"hf://{repo}@main", mount_location="/model"),
        ]
    )
    assert dataset.pinned == f"hf://datasets/{repo}@{commit}"
    assert [p.name for p in (tmp_path / "node" / "data").iterdir()] == ["train.jsonl"]
    assert (tmp_path / "node" / "data" / "train.jsonl").read_bytes() == b"data"
    assert (tmp_path / "node" / "model" / "config.json").read_bytes() == b"model"
    assert dataset.files[0].entry != model.files[0].entry


@pytest.mark.parametrize("source", ["hf", "s3"])
def test_empty_files_are_staged(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah, source: str
) -> None:
    """An empty file (a package's ``__init__.py``, an empty ``added_tokens.json``) is staged
    like any other, from a store with a batch path for small files (s3) and one without (hf)."""
    files = {"__init__.py": b"", "config.json": b"{}\n"}
    weights = _seeded(source, files, s3_server, hf_server)
    mount = agent.node_root / "m"
    result = agent.run_job(
        _job([weights], f"wc -c < {mount}/__init__.py && cat {mount}/config.json"),
        env=_env(agent, s3_server, hf_server),
    )
    assert result.code == 0, result.text
    assert result.out.split() == ["0", "{}"]


@pytest.mark.parametrize("source", ["hf", "s3"])
def test_a_disk_that_refuses_the_file_fails_staging_at_once(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah, source: str
) -> None:
    """Writing a weights file that this machine's disk refuses (the agent's file size limit,
    ``RLIMIT_FSIZE``, below the file's size: the kernel's ``EFBIG``, as a full disk gives
    ``ENOSPC``) fails staging at once, naming the disk's error: it is no outage of the source
    to wait out (the Hub's client raised it through its download, and it was said as the Hub
    out of reach, retried for ``BT_STORE_OUTAGE_SECONDS``)."""
    weights = _seeded(source, {"weights.bin": os.urandom(3_000_000)}, s3_server, hf_server)
    spec = agent.spec(_job([weights], "true"))
    env = {**_env(agent, s3_server, hf_server), "BT_STORE_OUTAGE_SECONDS": "300"}
    started = time.monotonic()
    done = agent(
        "stage", str(spec), *agent.context_args(), env=env, timeout=120, file_size_limit=10**6
    )
    assert done.code == 3, done.err
    assert time.monotonic() - started < 30
    assert f"File too large: '{agent.node_root}" in done.err, done.err
    assert "cannot reach" not in done.err and "retrying" not in done.err, done.err
    assert not list((agent.node_root / "m").glob("*")), "nothing mounted"


def test_missing_source_is_deploy_failed(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    env = _env(agent, s3_server, hf_server)
    url = _seed_s3(s3_server, {"x.bin": b"x"})
    ran = agent.root / "ran"
    weights = [
        {"source": url + "-nope", "mount_location": "/app/data", "auth_secret_name": "s3_creds"}
    ]
    result = agent.run_job(_job(weights, f"touch {ran}"), env=env)
    assert result.code == 3, result.text
    assert "weights[0]" in result.err and "no file matches" in result.err
    view = agent.job_view(agent.only_job_id())
    assert view["status"] == "TRAINING_JOB_DEPLOY_FAILED"
    assert not ran.exists() and not (agent.node_root / "app/data").exists()


def test_patterns_that_select_nothing_say_what_is_there(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A source whose patterns leave no file fails naming how many files are under it, a few of
    their keys and the patterns; an empty source says nothing is there. Nothing is mounted."""
    url = _seed_s3(s3_server, {"config.json": b"{}", "model.safetensors": b"w"})
    environ = Environ({"AWS_ENDPOINT_URL": s3_server.endpoint, **_KEYS})
    where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
    stager = WeightsStager(
        NodeCache(tmp_path / "cache"), AgentLog(io.StringIO()), environ, {}, where
    )
    bins = WeightsSource(source=url, mount_location="/app/model", allow_patterns=["*.bin"])
    with pytest.raises(StagingError) as raised:
        stager.stage([bins])
    assert str(raised.value) == (
        f"weights[0] {url}: no file matches: 2 under the source (such as config.json, "
        "model.safetensors), none selected by allow_patterns ['*.bin']; check the patterns "
        "(matched against each key under the source)"
    )
    empty = WeightsSource(source=url + "-nope", mount_location="/app/model")
    with pytest.raises(StagingError, match=r"nothing is under the source; check its path$"):
        stager.stage([empty])
    assert not (tmp_path / "node").exists()


def _one_folder(
    service: str, request: pytest.FixtureRequest, files: dict[str, bytes]
) -> tuple[str, Environ]:
    """A folder of ``files`` in the service's server, and what reaches it."""
    if service == "s3":
        server: servers.SeaweedFS = request.getfixturevalue("s3_server")
        return _seed_s3(server, files), Environ({"AWS_ENDPOINT_URL": server.endpoint, **_KEYS})
    if service == "gs":
        gcs: servers.FakeGCS = request.getfixturevalue("gcs_server")
        bucket = f"b{uuid.uuid4().hex[:12]}"
        gcs.create_bucket(bucket)
        url, environ = f"gs://{bucket}/data", Environ({"STORAGE_EMULATOR_HOST": gcs.endpoint})
    else:
        azure: servers.Azurite = request.getfixturevalue("azure_server")
        container = f"c{uuid.uuid4().hex[:12]}"
        azure.create_container(container)
        url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/data"
        environ = Environ({"AZURE_STORAGE_CONNECTION_STRING": azure.connection_string})
    with open_store(url, environ) as writer:
        for key, data in files.items():
            writer.write_bytes(key, data)
    return url, environ


@pytest.mark.parametrize("service", ["s3", "gs", "azure"])
def test_a_source_that_names_one_object_stages_that_file(
    service: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``s3://bucket/models/model.safetensors``: nothing is under it as a folder, so it is the
    one object it names, mounted as the file of an ``https://`` source is (in the mount, under
    its name) and cached as any other; a neighbour whose name begins the same is not taken."""
    files = {"model.safetensors": b"w" * 100, "model.safetensors.index.json": b"{}"}
    url, environ = _one_folder(service, request, files)
    log = io.StringIO()
    where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
    stager = WeightsStager(NodeCache(tmp_path / "cache"), AgentLog(log), environ, {}, where)
    source = WeightsSource(source=f"{url}/model.safetensors", mount_location="/app/model")
    for _ in range(2):
        (plan,) = stager.stage([source])
        assert plan.pinned == source.source
        mount = tmp_path / "node" / "app" / "model"
        assert {p.name: p.read_bytes() for p in mount.iterdir()} == {
            "model.safetensors": b"w" * 100
        }
    said = log.getvalue()
    assert f"weights[0] {source.source}: 1 file, 100 B; 0 in the node cache, 1 to fetch" in said
    assert "1 in the node cache, 0 to fetch" in said


def test_patterns_that_stop_at_a_slash_say_what_they_leave_in_subdirectories(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A diffusers-like layout with ``allow_patterns=["*.json", "*.safetensors"]``, as a user
    of huggingface_hub (whose ``*`` crosses ``/``) writes them: the files in subdirectories are
    left out, as the patterns' rules say, and the agent says which and how to take them; where
    that leaves nothing, the error says it."""
    url = _seed_s3(
        s3_server,
        {
            "model_index.json": b"{}",
            "unet/config.json": b"{}",
            "unet/diffusion_pytorch_model.safetensors": b"w",
            "vae/diffusion_pytorch_model.safetensors": b"v",
        },
    )
    environ = Environ({"AWS_ENDPOINT_URL": s3_server.endpoint, **_KEYS})
    log = io.StringIO()
    where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
    stager = WeightsStager(NodeCache(tmp_path / "cache"), AgentLog(log), environ, {}, where)
    allow = ["*.json", "*.safetensors"]
    (plan,) = stager.stage([WeightsSource(url, "/pipe", allow_patterns=allow)])
    assert [f.relative for f in plan.files] == ["model_index.json"]
    assert (
        f"warning: weights[0] {url}: allow_patterns ['*.json', '*.safetensors'] leave out 3 "
        "files in subdirectories that they match by name (such as unet/config.json, "
        "unet/diffusion_pytorch_model.safetensors, vae/diffusion_pytorch_model.safetensors): "
        "here * stops at /; write ['**/*.json', '**/*.safetensors'] to take them too"
    ) in log.getvalue()
    deep = ["**/*.json", "**/*.safetensors"]
    stager.stage([WeightsSource(url, "/all", allow_patterns=deep)])
    assert len(list((tmp_path / "node" / "all").rglob("*.*"))) == 4
    assert log.getvalue().count("warning:") == 1, "patterns that take them say nothing"
    with pytest.raises(StagingError) as raised:
        stager.stage([WeightsSource(url, "/none", allow_patterns=["*.safetensors"])])
    assert str(raised.value).endswith(
        "; * stops at /: ['**/*.safetensors'] would take 2 files in subdirectories (such as "
        "unet/diffusion_pytorch_model.safetensors)"
    )


def test_a_damaged_hub_file_fails_staging_and_is_never_mounted(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """The Hub's content of an LFS file that does not match the sha256 its listing gives: the
    job is DEPLOY_FAILED, saying so, and neither the node cache nor the mount holds the file."""
    repo = f"org/damaged-{uuid.uuid4().hex[:6]}"
    weights = b"w" * 5000
    servers.hf_repo(hf_server.mirrors, repo, {}, lfs={"model.safetensors": weights})
    sha256 = hashlib.sha256(weights).hexdigest()
    servers.lfs_object(hf_server.mirrors / "models" / repo, sha256).write_bytes(b"x" * 5000)
    job = _job([{"source": f"hf://{repo}@main", "mount_location": "/app/m"}], "true")
    result = agent.run_job(job, env=_env(agent, s3_server, hf_server))
    assert result.code == 3, result.text
    assert f"does not match {sha256}" in result.err
    assert not (agent.node_root / "app/m/model.safetensors").exists()
    objects = agent.node_root / NODE_CACHE_CONTAINER_DIR.lstrip("/") / "objects"
    assert objects.is_dir(), "the node cache is under the node root"
    assert [path for path in objects.rglob("*") if path.is_file()] == []


def test_unknown_hf_revision_is_deploy_failed(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    repo = f"org/rev-{uuid.uuid4().hex[:6]}"
    servers.hf_repo(hf_server.mirrors, repo, {"a.txt": b"a"})
    weights = [{"source": f"hf://{repo}@no-such-tag", "mount_location": "/m"}]
    result = agent.run_job(_job(weights, "true"), env=_env(agent, s3_server, hf_server))
    assert result.code == 3 and "no-such-tag" in result.err


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set, so the Hub cannot be asked"),
        ({"HF_ENDPOINT": "hf-mirror.internal"}, "HF_ENDPOINT='hf-mirror.internal' is not a Hub's"),
    ],
    ids=["offline", "endpoint-no-url"],
)
def test_hub_settings_that_forbid_staging_fail_at_once(
    agent: Agent,
    s3_server: servers.SeaweedFS,
    hf_server: servers.Olah,
    setting: dict[str, str],
    said: str,
) -> None:
    """Settings under which no request to the Hub can succeed are an error that says which, at
    once: not an unreachable Hub waited out for ``BT_STORE_OUTAGE_SECONDS``."""
    weights = [{"source": "hf://org/model", "mount_location": "/m"}]
    env = {**_env(agent, s3_server, hf_server), **setting, "BT_STORE_OUTAGE_SECONDS": "120"}
    started = time.monotonic()
    result = agent.run_job(_job(weights, "true"), env=env)
    assert result.code == 3 and said in result.err, result.text
    assert time.monotonic() - started < 60


def test_cache_fills_once_under_concurrency(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache")
    calls = []
    entry = entry_id("src", "key", "v1", "3")

    def fill(path: Path) -> None:
        calls.append(1)
        partial = path.with_name(".partial")
        partial.write_bytes(b"abc")
        partial.rename(path)

    threads = [threading.Thread(target=cache.ensure, args=(entry, 3, fill)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and cache.path(entry).read_bytes() == b"abc"


def test_an_entry_claim_excludes_other_holders_of_that_entry_only(tmp_path: Path) -> None:
    """A claim holds one entry: against another claim of this process and another process's
    lock, not against entries that share its first hex digits; no file is made per entry."""
    cache = NodeCache(tmp_path / "cache")
    entry = "abc" + "0" * 61
    neighbour = "abc" + "1" * 61  # the same lock stripe where stripes are used
    held = cache.claim(entry)
    assert held is not None
    assert cache.claim(entry) is None
    other = cache.claim(neighbour)
    assert other is not None, "an entry's lock must not hold its neighbours"
    other.release()
    odd = cache.claim("an entry of any name")  # e.g. a stray file that eviction comes upon
    assert odd is not None
    odd.release()
    waiter = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from bt_agent.staging.cache import NodeCache; "
            "c = NodeCache(Path(sys.argv[1])); sys.exit(c.claim(sys.argv[2]) is None)",
            str(cache.root),
            entry,
        ],
        check=False,
    )
    assert waiter.returncode == 1, "another process took an entry this one holds"
    held.release()
    again = cache.claim(entry)
    assert again is not None
    again.release()
    if hasattr(fcntl, "F_OFD_SETLK"):
        assert [p.name for p in (cache.root / "locks").iterdir()] == ["entries.lock"]


def test_without_range_locks_entries_lock_their_stripe_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where open file description locks are missing (not Linux), a claim locks its entry's
    stripe file whole."""
    monkeypatch.setattr("bt_agent.staging.cache._RANGE_LOCKS", False)
    cache = NodeCache(tmp_path / "cache")
    entry = "abc" + "0" * 61
    held = cache.claim(entry)
    assert held is not None and cache.claim(entry) is None
    assert (cache.root / "locks" / "abc.lock").is_file()
    held.release()
    again = cache.claim(entry)
    assert again is not None
    again.release()


def test_two_agents_staging_one_source_fetch_each_file_once(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """Two processes stage the same source at once through one node cache: each file is
    fetched by one of them (the small ones in batches, the large one in ranges), and both
    mounts are whole."""
    env = {
        **_env(agent, s3_server, hf_server),
        "BT_NODE_CACHE_DIR": str(agent.root / "shared-cache"),
    }
    files = {f"small/{i:04d}.json": str(i).encode() * 40 for i in range(600)}
    files["big.bin"] = bytes(range(256)) * 8192  # 2 MiB: above the batch limit
    url = _seed_s3(s3_server, files)
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    spec = agent.spec(_job(weights, "true"))

    def stage(node: str) -> tuple[int, str]:
        args = ["--node-root", str(agent.root / node), "--secrets-dir", str(agent.secrets_dir)]
        result = agent("stage", str(spec), *args, env=env)
        assert result.code == 0, result.text
        fetched = re.search(r"fetched [\d.,]+ [KMGT]?B \((\d+) files?", result.err)
        return (int(fetched.group(1)) if fetched else 0), result.err

    with ThreadPoolExecutor(2) as pool:
        (first, first_log), (second, second_log) = pool.map(stage, ["n1", "n2"])
    assert first + second == len(files), first_log + second_log
    for node in ("n1", "n2"):
        for key, data in files.items():
            assert (agent.root / node / "d" / key).read_bytes() == data


def test_eviction_keeps_entries_in_use(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache")
    paths = []
    for i in range(4):
        entry = entry_id(str(i))
        path, _ = cache.ensure(entry, 1000, lambda p, i=i: p.write_bytes(bytes(1000)))
        paths.append(path)
    (tmp_path / "mount").mkdir()
    (tmp_path / "mount" / "in-use").hardlink_to(paths[0])  # the oldest, but mounted
    removed = cache.evict(max_bytes=2000)
    assert paths[0].exists(), "an entry a job has mounted is never evicted"
    assert [e.path for e in removed] == [paths[1], paths[2]]
    assert paths[3].exists()


def test_partial_files_no_fill_is_making_are_cleared_and_those_under_way_kept(
    tmp_path: Path,
) -> None:
    """A staging stopped or killed mid-file leaves a partial file of its entry; the next fill
    of that entry removes it, but one never staged again kept it for good, counted by no
    budget. ``clear_abandoned`` (``cache prune``, and staging with a budget) removes those
    whose entry's lock is free, and leaves the partial file of a fill under way (its lock
    held)."""
    cache = NodeCache(tmp_path / "cache")
    whole, _ = cache.ensure(entry_id("whole"), 10, lambda p: p.write_bytes(bytes(10)))
    left, busy = entry_id("left"), entry_id("busy")
    cache.prepare([left, busy])
    abandoned = cache.path(left).with_name(f".{left}.99999.1.incomplete")
    copied = cache.path(left).with_name(f".{left}.99999.7.tmp")  # from the cluster tier
    under_way = cache.path(busy).with_name(f".{busy}.{os.getpid()}.1.incomplete")
    for path in (abandoned, copied, under_way):
        path.write_bytes(bytes(3000))
    claim = cache.claim(busy)
    assert claim is not None
    try:
        removed = cache.clear_abandoned()
    finally:
        claim.release()
    assert sorted(e.path for e in removed) == sorted([abandoned, copied])
    assert sum(e.size for e in removed) == 6000
    assert under_way.exists() and whole.exists()


def test_a_partial_file_that_a_staging_can_take_up_is_kept_for_it(tmp_path: Path) -> None:
    """The partial file of a download in ranges that a stop left, with its record of what is
    written, is kept by the entry's next fill (which takes it up) and by the staging's clearing
    of abandoned partial files, but not where its record is of another boot of the machine
    (the page cache that held its bytes is gone), nor by ``cache prune``, which asks for the
    space."""
    from bt_agent.storage.base import ranges_record, resumable_path
    from bt_agent.storage.ranges import Ranged

    cache = NodeCache(tmp_path / "cache")
    fresh, stale, other = entry_id("fresh"), entry_id("stale"), entry_id("other")
    cache.prepare([fresh, stale, other])
    partials = {}
    for entry in (fresh, stale, other):
        partial = partials[entry] = resumable_path(cache.path(entry))
        partial.write_bytes(bytes(4096))
        job = Ranged(ObjectInfo("model.bin", 4096, "etag-1"), partial, 1024, {0: 1024})
        job.save()
        assert Ranged.taken_up(partial, job.info, 1024).written == {0: 1024}
    record = ranges_record(partials[stale])
    record.write_text(record.read_text().replace('"boot": "', '"boot": "another-'))
    assert Ranged.taken_up(partials[stale], job.info, 1024).written == {}
    beside = cache.path(other).with_name(f".{other}.99999.1.incomplete")
    beside.write_bytes(bytes(10))

    filled: list[bool] = []
    cache.ensure(
        other, 5, lambda path: (filled.append(partials[other].exists()), path.write_bytes(b"12345"))
    )
    assert filled == [True] and not beside.exists(), "the fill finds it, and only it"

    removed = cache.clear_abandoned(keep_resumable=True)
    assert sorted(e.path for e in removed) == sorted([partials[stale], record])
    assert partials[fresh].exists() and ranges_record(partials[fresh]).exists()
    removed = cache.clear_abandoned()
    assert partials[fresh] in [e.path for e in removed] and not partials[fresh].exists()


def test_cluster_tier_serves_a_second_node(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    env = {**_env(agent, s3_server, hf_server), "BT_CLUSTER_CACHE_DIR": str(agent.root / "cluster")}
    url = _seed_s3(s3_server, {"a.bin": b"a" * 100, "b.bin": b"b" * 200})
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    first = agent.run_job(_job(weights, "true"), "--node-root", str(agent.root / "n1"), env=env)
    assert first.code == 0, first.text
    assert "from the cluster cache" not in first.err
    second = agent.run_job(
        _job(weights, "cat $BT_WORKING_DIR/../../d/b.bin"),
        "--node-root",
        str(agent.root / "n2"),
        env=env,
    )
    assert second.code == 0, second.text
    assert "2 from the cluster cache" in second.err
    assert second.out == "b" * 200


def test_nodes_starting_together_fetch_each_file_once(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """Four nodes of a cluster stage the same weights at the same time: each file comes from
    the store once (counted by a proxy in front of it), the others wait for it in the cluster
    tier and copy it from there."""
    files = {f"shard-{i}.bin": bytes([i]) * 300_000 for i in range(3)}
    url = _seed_s3(s3_server, files)
    proxy = FaultProxy(s3_server.port, delay=0.3)  # each fetch outlasts the nodes' starts
    env = {
        **_env(agent, s3_server, hf_server),
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "BT_CLUSTER_CACHE_DIR": str(agent.root / "cluster"),
    }
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    spec = agent.spec(_job(weights, "true"))
    try:
        stage = [sys.executable, "-m", "bt_agent", "stage", str(spec)]
        stage += ["--secrets-dir", str(agent.secrets_dir), "--node-root"]
        nodes = [
            subprocess.Popen(
                [*stage, str(agent.root / f"node{rank}")],
                env=agent.full_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(4)
        ]
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        proxy.close()
    assert [node.returncode for node in nodes] == [0] * 4, outputs
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    for name, data in files.items():
        gets = [line for line in proxy.lines if line.startswith(f"GET /{bucket}/{prefix}/{name} ")]
        assert len(gets) == 1, f"{name}: {gets}"
        for rank in range(4):
            assert (agent.root / f"node{rank}" / "d" / name).read_bytes() == data
    assert sum("from the cluster cache" in err for _, err in outputs) >= 1


def test_stage_and_cache_commands(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    env = _env(agent, s3_server, hf_server)
    url = _seed_s3(s3_server, {f"f{i}.bin": bytes([i]) * 1000 for i in range(3)})
    spec = agent.spec(
        _job([{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}], "true")
    )
    staged = agent("stage", str(spec), *agent.context_args(), env=env)
    assert staged.code == 0, staged.text
    assert "3 to fetch" in staged.err and (agent.node_root / "d" / "f2.bin").is_file()
    assert not agent.store.exists(), "stage writes no job records"
    node = ["--node-root", str(agent.node_root)]
    summary = agent("cache", "summarize", *node, "-o", "json")
    entries = json.loads(summary.out)
    assert len(entries) == 3 and all(e["in_use"] and e["size"] == 1000 for e in entries)
    table = agent("cache", "summarize", *node).out.splitlines()  # for people: sizes, yes/no
    assert table[0].split() == ["ENTRY", "SIZE", "LAST", "USED", "IN", "USE"], table
    assert all(row.split()[1:3] == ["1.0", "KB"] and row.endswith("yes") for row in table[1:4])
    assert table[4].startswith("3 entries, 3.0 KB, 3 in use, in "), table
    pruned = agent("cache", "prune", *node, "--max-bytes", "0")
    assert "evicted 0 entries (0 B)" in pruned.out, "mounted entries are kept"
    for path in (agent.node_root / "d").iterdir():
        path.unlink()
    objects = agent.node_root / "var/cache/bt-agent/node/objects"
    entry = next(objects.glob("*/*"))  # a killed staging of it left its partial file
    entry.with_name(f".{entry.name}.99999.1.incomplete").write_bytes(bytes(500))
    pruned = agent("cache", "prune", *node, "--max-bytes", "1500")
    assert "evicted 2 entries (2.0 KB)" in pruned.out
    assert "removed 1 partial file (500 B) that stopped downloads left" in pruned.out
    assert not list(objects.glob("*/.*")), pruned.text
    elsewhere = agent("cache", "summarize", "--node-root", str(agent.root / "no-node"))
    assert elsewhere.code == 0 and "0 entries" in elsewhere.out, elsewhere.text
    said = "no-node/var/cache/bt-agent/node does not exist: no staging has used this cache; "
    assert said + "check --node-root (or $BT_NODE_ROOT)" in elsewhere.err, elsewhere.err


def test_an_entry_written_to_through_a_mount_is_fetched_again(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """A job running as root writes through its read-only mount into the node cache's file (the
    same inode): in place, the size kept, and over another file, truncating it. The next job
    on the node is not given what it wrote: both entries are fetched again, the third is
    mounted from the cache as it was."""
    env = _env(agent, s3_server, hf_server)
    files = {f"f{i}.bin": bytes([i + 1]) * 1000 for i in range(3)}
    url = _seed_s3(s3_server, files)
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    spec = agent.spec(_job(weights, "true"))
    first = agent("stage", str(spec), *agent.context_args(), env=env)
    assert first.code == 0 and "3 to fetch" in first.err, first.text
    mount = agent.node_root / "d"
    for name in ("f0.bin", "f1.bin"):
        (mount / name).chmod(0o644)  # what root need not do
    with open(mount / "f0.bin", "r+b") as handle:
        handle.write(b"tampered")
    (mount / "f1.bin").write_bytes(b"saved over")
    again = agent("stage", str(spec), *agent.context_args(), env=env)
    assert again.code == 0, again.text
    assert "1 in the node cache, 2 to fetch" in again.err, again.err
    assert {path.name: path.read_bytes() for path in mount.iterdir()} == files
    third = agent("stage", str(spec), *agent.context_args(), env=env)
    assert "3 in the node cache, 0 to fetch" in third.err, third.err


@pytest.mark.parametrize(
    ("text", "size"),
    [("1500", 1500), ("2K", 2000), ("2KiB", 2048), ("1.5Gi", 3 * 2**29), ("500g", 500 * 10**9)],
)
def test_sizes_are_read_as_kubernetes_writes_quantities(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["-5", "10X", "G", "1.5.2", ""])
def test_what_is_no_size_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size; write bytes .* or a number and a unit"):
        parse_size(text)


def test_the_cache_budget_takes_a_unit_and_refuses_what_is_no_size(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """``BT_NODE_CACHE_MAX_BYTES=2K`` prunes the cache to 2,000 bytes after staging (a value
    with a unit was ignored, the cache left to grow without a word); one that is no size stops
    the job before anything is staged, naming the variable, and ``cache prune`` says the same
    (it failed with a traceback)."""
    env = _env(agent, s3_server, hf_server)

    def spec(files: dict[str, bytes]) -> str:
        url = _seed_s3(s3_server, files)
        weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
        return str(agent.spec(_job(weights, "true"), name=f"{url.split('/')[2]}.json"))

    first = spec({f"f{i}.bin": bytes([i]) * 1000 for i in range(3)})
    assert agent("stage", first, *agent.context_args(), env=env).code == 0
    entry = next(agent.node_root.glob("var/cache/bt-agent/node/objects/*/*"))
    entry.with_name(f".{entry.name}.99999.1.incomplete").write_bytes(bytes(5000))  # killed
    budget = {**env, "BT_NODE_CACHE_MAX_BYTES": "2K"}
    second = agent("stage", spec({"g.bin": bytes(1000)}), *agent.context_args(), env=budget)
    assert second.code == 0, second.text  # the first source's mount is gone: evictable
    said = "node cache: removed 1 partial file (5.0 KB) that stopped downloads left"
    assert said in second.err, second.err
    assert "node cache: evicted 2 least recently used entries" in second.err, second.err
    wrong = {**env, "BT_NODE_CACHE_MAX_BYTES": "lots"}
    said = "BT_NODE_CACHE_MAX_BYTES: 'lots' is not a size; write bytes"
    refused = agent("stage", first, *agent.context_args(), env=wrong)
    assert refused.code == 2 and said in refused.err, refused.text
    prune = agent("cache", "prune", "--node-root", str(agent.node_root), env=wrong)
    assert prune.code == 2 and said in prune.err, prune.text


@pytest.mark.parametrize(
    ("tier", "variable"),
    [("node", "BT_NODE_CACHE_DIR"), ("cluster", "BT_CLUSTER_CACHE_DIR")],
)
def test_a_cache_dir_that_cannot_be_made_names_its_variable(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah, tier: str, variable: str
) -> None:
    """The node cache (or the cluster tier) set below a file: a failed deploy naming the
    directory and the variable that moves it (the node cache's was a traceback, exit 1)."""
    env = _env(agent, s3_server, hf_server)
    url = _seed_s3(s3_server, {"f.bin": bytes(1000)})
    spec = agent.spec(
        _job([{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}], "true")
    )
    blocker = agent.root / "a-file"
    blocker.write_text("not a directory")
    result = agent(
        "stage", str(spec), *agent.context_args(), env={**env, variable: str(blocker / "cache")}
    )
    assert result.code == 3, result.text
    said = f"cannot make the {tier} cache {blocker / 'cache'} (Not a directory); set {variable} to"
    assert said in result.err and "Traceback" not in result.err, result.err


def test_sigterm_while_staging(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    import signal

    from helpers import finish, wait_for

    env = _env(agent, s3_server, hf_server)
    # Enough files that staging takes a while even in batches.
    url = _seed_s3(s3_server, {f"part-{i:04d}.bin": bytes(2000) for i in range(3000)})
    ran = agent.root / "ran"
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    process = agent.start(_job(weights, f"touch {ran}"), env=env)
    wait_for(lambda: "to fetch" in agent.output(), what="staging to start")
    process.send_signal(signal.SIGTERM)
    assert finish(process, 30, agent) == 143
    node = json.loads(next(agent.store.glob("projects/*/jobs/*/nodes/rank-0.json")).read_text())
    assert node["status"] == "TRAINING_JOB_STOPPED"
    assert not ran.exists() and not (agent.node_root / "d").exists()


def _over(tls: bool, s3_server: servers.SeaweedFS, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the store reached over https where ``tls`` (its CA trusted as users do)."""
    return {**env, **s3_server.client_env(tls)} if tls else env


def _link(tls: bool, far: Any) -> str:
    """The endpoint of the store through the link ``far``, over https where ``tls``."""
    return f"https://localhost:{far.port}" if tls else far.endpoint


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_stop_ends_staging_at_once_mid_file_and_the_next_staging_goes_on_from_there(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah, tls: bool
) -> None:
    """A stop signal while a large file comes through a slow link (the whole would take over
    half a minute): `bt-agent stage` (SIGINT, a user's Ctrl-C) and `bt-agent run` (SIGTERM,
    the platform's) end at once rather than when the file is whole, `run` recording STOPPED
    within its grace period. Nothing is mounted; the partial file in the node cache is kept,
    and each staging after takes it up where the one before stopped: the last, through a link
    that counts what passes, fetches only what the stopped ones did not write."""
    import signal

    from far_link import FarLink
    from helpers import finish

    size = 32 * 1024 * 1024
    env = _over(tls, s3_server, _env(agent, s3_server, hf_server))
    url = _seed_s3(s3_server, {"model.bin": bytes(range(256)) * (size // 256)})
    port = s3_server.https_port if tls else s3_server.port
    slow, counted = FarLink(port, 0.0, 1e6), FarLink(port, 0.0, 1e9)
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "s3_creds"}]
    spec = agent.spec(_job(weights, "true"))
    objects = agent.node_root / "var/cache/bt-agent/node/objects"
    try:
        for command, number in (("stage", signal.SIGINT), ("run", signal.SIGTERM)):
            agent.root.joinpath("agent.err").unlink(missing_ok=True)
            process = subprocess.Popen(
                [sys.executable, "-m", "bt_agent", command, str(spec), *agent.context_args()],
                env=agent.full_env({**env, "AWS_ENDPOINT_URL": _link(tls, slow)}),
                stderr=open(agent.root / "agent.err", "w"),  # noqa: SIM115 (closed with it)
                stdout=subprocess.DEVNULL,
            )
            until = slow.passed + 4 * 1024 * 1024  # some of the file has come
            wait_for(lambda until=until: slow.passed > until, 30, "the download")
            sent = time.monotonic()
            process.send_signal(number)
            assert finish(process, 30, agent) == 128 + number, agent.output()
            assert time.monotonic() - sent < 5, f"{command}: the stop waited on the download"
            assert not (agent.node_root / "d").exists(), agent.output()
        node = json.loads(next(agent.store.glob("projects/*/jobs/*/nodes/rank-0.json")).read_text())
        assert node["status"] == "TRAINING_JOB_STOPPED"
        assert node["error"] == "stopped by SIGTERM before any command ran", node["error"]
        [kept] = objects.glob("*/.*.resumable.incomplete")
        written = kept.stat().st_blocks * 512
        # more than either stop's download brought: the second took up what the first wrote
        assert 5 * 1024 * 1024 <= written < size, f"the stops wrote {written} bytes"
        staged = agent(
            "stage",
            str(spec),
            *agent.context_args(),
            env={**env, "AWS_ENDPOINT_URL": _link(tls, counted)},
        )
    finally:
        slow.close()
        counted.close()
    assert staged.code == 0, staged.text
    plan = f"1 to fetch (33.6 MB, {written / 1e6:.1f} MB of it written by a staging that stopped)"
    assert plan in staged.err, staged.err
    assert (agent.node_root / "d" / "model.bin").read_bytes() == bytes(range(256)) * (size // 256)
    assert counted.passed < size - written + 1024 * 1024, f"{counted.passed} bytes came again"
    assert not list(objects.glob("*/.*")), "nothing partial is left"


def test_stops_mid_download_over_tls_end_the_process_cleanly_every_time(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    """`bt-agent stage` stopped (SIGTERM) while large files come over https exits 143 every
    time. Over TLS the engine reads the bodies on threads of its own that hand them to the
    store's event loop; a process that ended with those requests still out crashed on its way
    out (SIGSEGV or SIGABRT, about one stop in four here), so a stop ends them at their next
    piece (``ObjectStore.halt``) and waits for them first. Six stops at points drawn at random
    (seeded) in a download of 16 ranges at once through a link to a store far away (20 ms a
    request, 20 MB/s a connection)."""
    import random
    import signal

    from far_link import FarLink
    from helpers import finish

    env = _over(True, s3_server, _env(agent, s3_server, hf_server))
    shard = bytes(range(256)) * (128 * 1024 * 1024 // 256)
    url = _seed_s3(s3_server, {f"model-{i}.safetensors": shard for i in range(4)})
    far = FarLink(s3_server.https_port, 0.02, 20e6)
    spec = agent.spec(_job([{"source": url, "mount_location": "/d"}], "true"))
    draw = random.Random(17)
    codes = []
    try:
        for stop in range(6):
            cache = {"BT_NODE_CACHE_DIR": str(agent.root / f"cache-{stop}")}
            process = subprocess.Popen(
                [sys.executable, "-m", "bt_agent", "stage", str(spec), *agent.context_args()],
                env=agent.full_env({**env, **cache, "AWS_ENDPOINT_URL": _link(True, far)}),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            until = far.passed + draw.uniform(20, 400) * 1e6
            wait_for(lambda until=until: far.passed > until, 30, "the download")
            process.send_signal(signal.SIGTERM)
            codes.append(finish(process, 30, agent))
    finally:
        far.close()
    assert codes == [128 + signal.SIGTERM] * 6, codes
    assert not (agent.node_root / "d").exists()


def test_progress_lines_say_bytes_rate_and_eta() -> None:
    import io

    from bt_agent.log import AgentLog
    from bt_agent.staging.progress import Progress

    now = [100.0]
    buffer = io.StringIO()
    progress = Progress("weights[0]", 100_000_000, AgentLog(buffer), None, clock=lambda: now[0])
    progress.add(40_000_000)
    now[0] += 4
    assert progress.line() == "weights[0]: 40.0 of 100.0 MB (40%), 10.0 MB/s, ETA 6 s"
    # 20 MB of it written before (a stopped staging's): done, but not fetched at that rate
    resumed = Progress(
        "weights[0]", 100_000_000, AgentLog(buffer), None, clock=lambda: now[0], written=20_000_000
    )
    resumed.add(40_000_000)
    now[0] += 4
    assert resumed.line() == "weights[0]: 40.0 of 100.0 MB (40%), 5.0 MB/s, ETA 12 s"
    with Progress("weights[1]", 100, AgentLog(buffer), None, interval=0.01) as reporting:
        reporting.add(50)
        wait_for(lambda: "weights[1]: " in buffer.getvalue(), 10, "a progress line")
    lines = buffer.getvalue().splitlines()
    assert all(line.startswith("bt-agent: weights[1]: ") for line in lines)


def test_progress_of_one_large_file_shows_as_it_comes(
    own_s3: servers.SeaweedFS, tmp_path: Path
) -> None:
    """One file of a model can take minutes (a consolidated checkpoint, a GGUF): its progress
    counts what its partial file holds as the ranges arrive (the file is made its full size
    at once, so its blocks say what has come), not 0% until it is whole. Through a link that
    paces each connection at 16 MB/s."""
    from far_link import FarLink

    from bt_agent.staging.progress import Progress
    from bt_agent.storage import open_store

    size = 48 * 1024 * 1024
    own_s3.client().put_object(Bucket="store", Key="big.bin", Body=b"\1" * size)
    far = FarLink(own_s3.port, 0.0, 16e6)
    buffer = io.StringIO()
    env = {**own_s3.client_env(), "AWS_ENDPOINT_URL": far.endpoint}
    try:
        with open_store("s3://store", Environ(env)) as store:
            info = store.stat("big.bin")
            target = tmp_path / "big.bin"
            with Progress("weights[0]", size, AgentLog(buffer), None, interval=0.1) as progress:
                with progress.fetching(target, size):
                    store.download("big.bin", target, info)
                progress.add(size)
    finally:
        far.close()
    shares = [int(share) for share in re.findall(r"\((\d+)%\)", buffer.getvalue())]
    assert any(0 < share < 100 for share in shares), buffer.getvalue()
    assert shares == sorted(shares), "never more than what has come"
    assert target.read_bytes() == b"\1" * size


def test_progress_counts_the_blocks_of_a_partial_file_made_its_full_size(
    tmp_path: Path,
) -> None:
    """A ranged download makes its partial file the object's size first, then writes ranges
    at their offsets: what has come is the blocks written, not the size; of a partial file
    that this process's download takes up, likewise."""
    from bt_agent.staging.progress import Progress
    from bt_agent.storage.base import partial_path, resumable_path

    for partial in (partial_path(tmp_path / "model.bin"), resumable_path(tmp_path / "model.bin")):
        with open(partial, "wb") as handle:
            handle.truncate(64 * 1024 * 1024)
            handle.seek(8 * 1024 * 1024)
            handle.write(b"x" * (4 * 1024 * 1024))
        progress = Progress("weights[0]", 64 * 1024 * 1024, AgentLog(io.StringIO()), None)
        with progress.fetching(tmp_path / "model.bin", 64 * 1024 * 1024):
            assert "4.2 of 67.1 MB (6%)" in progress.line(), progress.line()
        assert "0.0 of 67.1 MB (0%)" in progress.line(), "a file no longer under way counts nothing"
        partial.unlink()


def test_gs_r2_cw_and_https_sources(
    agent: Agent,
    s3_server: servers.SeaweedFS,
    hf_server: servers.Olah,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each kind of source in one job. The cw:// one goes to CoreWeave's LOTA endpoint
    (``http://<bucket>.cwlota.com``): a proxy takes those connections to SeaweedFS, which finds
    the bucket in the host; the other servers are reached directly (``NO_PROXY``)."""
    gcs = servers.fake_gcs(tmp_path / "gcs")
    https = servers.static_https(tmp_path / "https")
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.port))
    try:
        gcs.create_bucket("gbucket")
        from bt_agent.settings import Environ
        from bt_agent.storage import open_store

        gstore = open_store("gs://gbucket/ds", Environ({"STORAGE_EMULATOR_HOST": gcs.endpoint}))
        gstore.write_bytes("a/train.jsonl", b"gs-data\n")
        gstore.write_bytes("a/skip.md", b"no")
        (https.directory / "vocab.txt").write_bytes(b"https-data\n")
        r2_url = _seed_s3(s3_server, {"r2.bin": b"r2-data\n"}).replace("s3://", "r2://acct.")
        cw_url = _seed_s3(s3_server, {"cw.bin": b"cw-data\n"}).replace("s3://", "cw://")
        env = {
            **_env(agent, s3_server, hf_server),
            "STORAGE_EMULATOR_HOST": gcs.endpoint,
            "BT_R2_ENDPOINT_URL": s3_server.endpoint,
            "BT_CW_ENDPOINT_URL": "http://cwlota.com",
            "HTTP_PROXY": proxy.endpoint,
            "NO_PROXY": "127.0.0.1,localhost",
            "SSL_CERT_FILE": str(https.ca_file),
        }
        weights = [
            {"source": "gs://gbucket/ds", "mount_location": "/g", "ignore_patterns": ["**.md"]},
            {"source": r2_url, "mount_location": "/r", "auth_secret_name": "s3_creds"},
            {"source": cw_url, "mount_location": "/c", "auth_secret_name": "s3_creds"},
            {"source": https.url("vocab.txt"), "mount_location": "/h"},
        ]
        node = agent.node_root
        files = ("g/a/train.jsonl", "r/r2.bin", "c/cw.bin", "h/vocab.txt")
        command = "cat " + " ".join(f"{node}/{name}" for name in files)
        result = agent.run_job(_job(weights, command), env=env)
        assert result.code == 0, result.text
        assert result.out == "gs-data\nr2-data\ncw-data\nhttps-data\n"
        assert not (node / "g" / "a" / "skip.md").exists()
        bucket = cw_url.removeprefix("cw://").split("/")[0]
        assert set(proxy.targets) == {f"{bucket}.cwlota.com"}, proxy.targets
    finally:
        proxy.close()
        gcs.stop()
        https.stop()


def test_azure_weights_with_patterns_through_the_node_cache(
    agent: Agent, azure_server: servers.Azurite
) -> None:
    """azure://account/container/path (the platform's form) with allow and ignore patterns and
    the connection string as the spec's secret; a second job on the node takes it from the
    node cache, pinned to the blobs' ETags (nothing fetched again)."""
    from bt_agent.settings import Environ
    from bt_agent.storage import open_store

    container = f"w{uuid.uuid4().hex[:10]}"
    azure_server.create_container(container)
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/model"
    seeding = open_store(url, Environ({}), azure_server.connection_string, "seed")
    files = {"model.safetensors": b"w" * 300_000, "config.json": b"{}", "README.md": b"no"}
    for name, data in files.items():
        seeding.write_bytes(name, data)
    agent.secret("azure_creds", azure_server.connection_string)
    weights = [
        {
            "source": url,
            "mount_location": "/app/model",
            "auth_secret_name": "azure_creds",
            "allow_patterns": ["*.safetensors", "*.json"],
            "ignore_patterns": ["README*"],
        }
    ]
    mounted = agent.node_root / "app" / "model"
    for _ in range(2):
        result = agent.run_job(_job(weights, "true"))
        assert result.code == 0, result.text
        assert {p.name: p.read_bytes() for p in mounted.iterdir()} == {
            k: v for k, v in files.items() if k != "README.md"
        }
    assert "2 in the node cache, 0 to fetch" in result.text, result.text


def test_azure_weights_through_a_sas_token_that_must_allow_listing(
    azure_server: servers.Azurite, tmp_path: Path
) -> None:
    """The secret a SAS token's connection string, as the portal gives one: one that allows
    read and list stages the source; one that allows read only is refused by the listing,
    and the error says what the token must allow, never the token."""
    container = f"w{uuid.uuid4().hex[:10]}"
    azure_server.create_container(container)
    url = f"azure://{servers.AZURITE_ACCOUNT}/{container}/model"
    with open_store(url, Environ({}), azure_server.connection_string, "seed") as seeding:
        seeding.write_bytes("model.safetensors", b"w" * 300_000)
        seeding.write_bytes("config.json", b"{}")
    where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
    readable, read_only = (azure_server.sas_connection_string(p) for p in ("rl", "r"))
    secrets = {"sas": readable, "sas_read_only": read_only}
    stager = WeightsStager(
        NodeCache(tmp_path / "cache"), AgentLog(io.StringIO()), Environ({}), secrets, where
    )
    stager.stage([WeightsSource(url, "/model", auth_secret_name="sas")])
    assert sorted(p.name for p in (tmp_path / "node" / "model").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    with pytest.raises(StagingError) as refused:
        stager.stage([WeightsSource(url, "/other", auth_secret_name="sas_read_only")])
    said = str(refused.value)
    assert (
        "access denied (403 AuthorizationPermissionMismatch: This request is not authorized "
        in said
    )
    assert "); check that the SAS token has not expired and allows" in said
    assert "read and list for weights" in said
    assert "sig=" not in said and read_only.split("sig=")[1][:20] not in said


def test_bad_credentials_are_deploy_failed(
    agent: Agent, s3_server: servers.SeaweedFS, hf_server: servers.Olah
) -> None:
    env = _env(agent, s3_server, hf_server)
    agent.secret(
        "wrong",
        json.dumps(
            {"aws_access_key_id": servers.ACCESS_KEY, "aws_secret_access_key": "wrong-secret-987"}
        ),
    )
    url = _seed_s3(s3_server, {"x.bin": b"x"})
    weights = [{"source": url, "mount_location": "/d", "auth_secret_name": "wrong"}]
    result = agent.run_job(_job(weights, "true"), env=env)
    assert result.code == 3 and "access denied" in result.err
    assert "wrong-secret-987" not in result.text


def test_an_azure_secret_of_no_known_form_is_deploy_failed(agent: Agent) -> None:
    """A secret that is no account key (base64), SAS token or connection string: the job fails
    to deploy naming the secret and the forms it may take, never its content (the engine
    refused it with a traceback before)."""
    agent.secret("azure_creds", "paste the key here 4711")
    weights = [
        {
            "source": f"azure://{servers.AZURITE_ACCOUNT}/models/m",
            "mount_location": "/app/model",
            "auth_secret_name": "azure_creds",
        }
    ]
    result = agent.run_job(_job(weights, "true"))
    assert result.code == 3, result.text
    assert "secret 'azure_creds' is neither a storage account key (base64)" in result.err
    assert "Traceback" not in result.text and "4711" not in result.text


class _ListingStore(ObjectStore):
    """Stands in for a store that lists hostile keys. No server here can hold one: SeaweedFS
    refuses ``..`` keys and fake-gcs-server normalises them away, while real GCS and S3 accept
    them. Only listing is needed: the plan must refuse before anything is fetched."""

    url = "s3://hostile/weights"

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def _list(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(key, 1, "v1") for key in self.keys]

    def _stat(self, key: str) -> ObjectInfo:
        raise AssertionError("the plan must not stat")

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        raise AssertionError("the plan must not read")

    def _download(self, key: str, target: Path, expected: ObjectInfo | None) -> Fetched:
        raise AssertionError("the plan must not download")


@pytest.mark.parametrize(
    "key", ["../../etc/cron.d/x", "a/../../x", "/etc/passwd", "a\0b", "a//b", "x/" + "y" * 1100]
)
def test_a_key_that_would_escape_the_mount_fails_the_plan(key: str, tmp_path: Path) -> None:
    store = _ListingStore(["config.json", key])
    weights = WeightsSource(source=store.url, mount_location="/app/model")
    with pytest.raises(UnsafeKeyError, match="refusing object key"):
        plan_source(0, weights, store, tmp_path / "mount")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("transport", ["http", "https"])
def test_staging_from_s3_with_keys_in_the_environment_imports_no_botocore(
    agent: Agent, s3_server: servers.SeaweedFS, transport: str
) -> None:
    """Start-up time: with the keys and the region in the standard variables, the engine is
    built from them, and botocore (0.2 s to import and build a client) is never loaded while
    listing and fetching (ranged GETs included), nor for a shared config file that names no
    setting of the endpoint."""
    files = {"model.safetensors": bytes(range(256)) * 4096 * 17, "config.json": b"{}"}  # 17 MiB
    config = agent.root / "home" / ".aws" / "config"
    config.parent.mkdir(parents=True)
    config.write_text("[default]\nregion = us-east-1\noutput = json\n")
    url = _seed_s3(s3_server, files)
    spec = agent.spec(_job([{"source": url, "mount_location": "/app/model"}], "true"))
    seen = agent.root / "modules.json"
    probe = (
        "import json, runpy, sys\n"
        f"sys.argv = ['bt-agent', 'stage', {str(spec)!r}, *{agent.context_args()!r}]\n"
        "try:\n    runpy.run_module('bt_agent', run_name='__main__')\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        f"open({str(seen)!r}, 'w').write(json.dumps([code, sorted(sys.modules)]))\n"
    )
    env = {**agent.full_env(), **s3_server.client_env(tls=transport == "https")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    code, modules = json.loads(seen.read_text())
    assert code in (0, None), done.stderr
    mounted = agent.node_root / "app" / "model"
    assert {p.name: p.read_bytes() for p in mounted.iterdir()} == files
    assert not [m for m in modules if m.split(".")[0] in ("botocore", "boto3")], done.stderr


class _ReplacedAfterThePlan(WeightsStager):
    """Staging in which the source's objects are replaced (``replace``) once the plan is made
    and said, before anything is fetched: a model uploaded again while a job starts."""

    def __init__(self, replace: Callable[[], None], *args: Any) -> None:
        super().__init__(*args)
        self.replace = replace

    def _say_plan(self, plan: SourcePlan) -> Any:
        misses = super()._say_plan(plan)
        self.replace()
        return misses


@pytest.mark.parametrize("size", [1000, 20 * 1024 * 1024], ids=["batch", "ranges"])
def test_a_source_replaced_while_staged_fails_and_mixes_nothing(
    s3_server: servers.SeaweedFS, tmp_path: Path, size: int
) -> None:
    """Two files listed at one version, one of them replaced (other bytes, the same size) before
    it is fetched: staging fails naming it, nothing is mounted, and the node cache holds no
    entry for it under the version it was listed at; staged again, the new version comes."""
    files = {"a.bin": b"a" * size, "b.bin": b"b" * size}
    url = _seed_s3(s3_server, files)
    bucket = url.removeprefix("s3://").split("/")[0]

    def replace() -> None:
        s3_server.client().put_object(Bucket=bucket, Key="data/b.bin", Body=b"c" * size)

    environ = Environ({"AWS_ENDPOINT_URL": s3_server.endpoint, **_KEYS})
    cache, log = NodeCache(tmp_path / "cache"), AgentLog(io.StringIO())
    weights = [WeightsSource(source=url, mount_location="/app/model")]
    mount = tmp_path / "node" / "app" / "model"

    def stager(replace: Callable[[], None]) -> WeightsStager:
        where = lambda location: tmp_path / "node" / location.lstrip("/")  # noqa: E731
        return _ReplacedAfterThePlan(replace, cache, log, environ, {}, where)

    with pytest.raises(StagingError, match=r"data/b\.bin changed after it was listed"):
        stager(replace).stage(weights)
    assert not mount.exists()
    assert all(entry.path.read_bytes() != b"c" * size for entry in cache.entries())
    stager(lambda: None).stage(weights)
    assert {p.name: p.read_bytes() for p in mount.iterdir()} == {**files, "b.bin": b"c" * size}
