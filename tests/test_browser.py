"""The interactive checkpoint browser: driven by textual's own harness (``App.run_test`` and its
pilot) over checkpoints the real sidecar committed to SeaweedFS, reached through a proxy that
counts the requests; and the real command in a real pseudo-terminal, its screen read with
pyte."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import servers
from fault_proxy import FaultProxy
from helpers import Agent, require, trainer_job
from textual.pilot import Pilot
from textual.widgets import ProgressBar, Tree

from bt_agent.browse import CheckpointBrowser
from bt_agent.browse.app import SHOWN, CheckpointList, CheckpointsApp, CheckpointView
from bt_agent.catalog import Catalog
from bt_agent.records import JobRecord, Manifest, ManifestFile
from bt_agent.settings import Environ
from bt_agent.storage import FileStore, open_store

pexpect = require("pexpect", "pip install -e '.[test]'")
pyte = require("pyte", "pip install -e '.[test]'")

GiB = 1024**3
TRAINER = """
import json, os, torch
from safetensors.torch import save_file
root = os.environ["BT_CHECKPOINT_DIR"]
full = os.path.join(root, "checkpoint-10")
os.makedirs(full)
save_file({"model.embed.weight": torch.zeros(100, 16), "model.norm.weight": torch.ones(16)},
          os.path.join(full, "model.safetensors"))
json.dump({"_name_or_path": "Qwen/Qwen3-0.6B"}, open(os.path.join(full, "config.json"), "w"))
lora = os.path.join(root, "checkpoint-20")
os.makedirs(os.path.join(lora, "logs"))
save_file({"base_model.q_proj.lora_A.weight": torch.zeros(8, 64, dtype=torch.bfloat16)},
          os.path.join(lora, "adapter_model.safetensors"))
json.dump({"base_model_name_or_path": "meta-llama/Llama-3.1-8B", "r": 8},
          open(os.path.join(lora, "adapter_config.json"), "w"))
with open(os.path.join(lora, "logs", "train.log"), "wb") as f:  # 1 GiB, mostly a hole
    f.write(b"step 1 loss 2.5\\nstep 2 loss 2.1\\n")
    f.truncate(GIB)
""".replace("GIB", str(GiB))


class Store:
    """A SeaweedFS bucket behind a request-counting proxy, holding one job's checkpoints."""

    def __init__(self, url: str, env: dict[str, str], proxy: FaultProxy) -> None:
        self.url, self.env, self.proxy = url, env, proxy

    def browser(self) -> CheckpointBrowser:
        return CheckpointBrowser(Catalog(open_store(self.url, Environ(self.env))))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A SeaweedFS of this module's own (its 1 GiB object would take the shared server's last
    free volumes), stopped and removed at the end."""
    root = tmp_path_factory.mktemp("browse")
    server = servers.seaweedfs(root / "s3")
    proxy = FaultProxy(server.port)
    try:
        server.create_bucket("browse")
        env = {**server.client_env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        url = "s3://browse/bt"
        (root / "agent").mkdir()
        agent = Agent(root / "agent", env=env)
        job = trainer_job(agent, TRAINER)
        result = agent.run_job(
            job, "--store", url, "--job-id", "brws001", "--project", "p", timeout=240
        )
        assert result.code == 0, result.text
        yield Store(url, env, proxy)
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def until(pilot: Pilot[int], predicate: Callable[[], bool], what: str) -> None:
    for _ in range(200):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"the browser did not show {what}")


def listed(app: CheckpointsApp) -> CheckpointList:
    screen = app.screen
    assert isinstance(screen, CheckpointList)
    return screen


async def open_file(pilot: Pilot[int], app: CheckpointsApp, path: str) -> str:
    """Move the tree's cursor to ``path``, press Enter, and return the preview once shown."""
    view = app.screen
    assert isinstance(view, CheckpointView)
    tree = view.query_one("#files", Tree)
    for _ in range(20):
        node = tree.cursor_node
        if node is not None and node.data is not None and node.data.path == path:
            break
        await pilot.press("down")
    else:
        raise AssertionError(f"{path} is not in the tree")
    await pilot.press("enter")
    preview = view.query_one("#preview")
    shown = lambda: str(preview.render())  # noqa: E731
    await until(pilot, lambda: "reading..." not in shown() and path in shown(), path)
    return shown()


def test_typing_narrows_the_list_and_quitting_returns_0(store: Store) -> None:
    async def scenario() -> CheckpointsApp:
        app = CheckpointsApp(store.browser(), project="p")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: len(listed(app).shown) == 2, "two checkpoints")
            await until(pilot, lambda: not listed(app).loading, "the end of the listing")
            await pilot.press(*"ck20")
            assert [m.checkpoint for m in listed(app).shown] == ["checkpoint-20"]
            await pilot.press("backspace", "backspace", "1")
            assert listed(app).shown[0].checkpoint == "checkpoint-10"
            await pilot.press("down", "q")
        return app

    app = asyncio.run(scenario())
    assert app.return_code == 0 and app.return_value == 0


def test_opening_a_safetensors_file_shows_its_tensors(store: Store) -> None:
    async def scenario() -> str:
        app = CheckpointsApp(store.browser(), job_id="brws001")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: len(listed(app).shown) == 2, "two checkpoints")
            await pilot.press(*"checkpoint-10", "enter")
            await until(pilot, lambda: isinstance(app.screen, CheckpointView), "the checkpoint")
            text = await open_file(pilot, app, "model.safetensors")
            await pilot.press("escape")
            assert isinstance(app.screen, CheckpointList)
            await pilot.press("down", "q")
        return text

    text = asyncio.run(scenario())
    assert "2 tensors, 1,616 parameters" in text
    assert "model.embed.weight" in text and "100x16" in text and "F32" in text


def test_a_1_gib_file_is_previewed_with_one_ranged_read(store: Store) -> None:
    async def scenario() -> tuple[str, list[str]]:
        app = CheckpointsApp(store.browser(), job_id="brws001")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: len(listed(app).shown) == 2, "two checkpoints")
            await pilot.press(*"checkpoint-20", "enter")
            await until(pilot, lambda: isinstance(app.screen, CheckpointView), "the checkpoint")
            before = len(store.proxy.lines)
            text = await open_file(pilot, app, "logs/train.log")
            asked = store.proxy.lines[before:]
            await pilot.press("q")
        return text, asked

    text, asked = asyncio.run(scenario())
    assert "1.1 GB" in text and "(the first 65.5 KB)" in text
    assert "step 1 loss 2.5\nstep 2 loss 2.1" in text
    assert len(asked) == 1 and asked[0].startswith("GET "), asked
    assert "logs/train.log" in asked[0] and asked[0].endswith("bytes=0-65535"), asked


def test_the_command_draws_in_a_terminal_and_quits_cleanly(store: Store, tmp_path: Path) -> None:
    columns, rows = 120, 30
    child = pexpect.spawn(
        sys.executable,
        ["-m", "bt_agent", "checkpoints", "list", "--store", store.url, "--project", "p"],
        env={**os.environ, **store.env, "TERM": "xterm-256color", "COLUMNS": str(columns)},
        dimensions=(rows, columns),
        cwd=str(tmp_path),
        timeout=60,
    )
    screen = pyte.Screen(columns, rows)
    stream = pyte.ByteStream(screen)

    def shows(*texts: str) -> bool:
        shown = "\n".join(screen.display)
        return all(text in shown for text in texts)

    def read_until(*texts: str) -> None:
        while not shows(*texts):
            try:
                stream.feed(child.read_nonblocking(65536, timeout=30))
            except pexpect.TIMEOUT:
                raise AssertionError("\n".join(screen.display)) from None

    read_until("checkpoint-10", "checkpoint-20", "brws001", "2 committed checkpoints")
    child.send("\x1b[B")  # down: from the search box to the list
    child.send("q")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def test_without_a_terminal_the_tables_are_printed(store: Store, tmp_path: Path) -> None:
    agent = Agent(tmp_path, env=store.env)
    listing = agent("checkpoints", "list", "--store", store.url, "--project", "p", "-o", "jsonl")
    assert listing.code == 0, listing.text
    rows = [json.loads(line) for line in listing.out.splitlines() if line]
    assert sorted(row["checkpoint"] for row in rows) == ["checkpoint-10", "checkpoint-20"]
    files = agent(
        "checkpoints", "files", "--store", store.url, "--job-id", "brws001", "-o", "jsonl"
    )
    assert files.code == 0 and len(files.out.strip().splitlines()) == 5, files.text
    browse = agent("checkpoints", "browse", "--store", store.url)
    assert browse.code == 2 and "needs a terminal" in browse.err


def test_thousands_of_checkpoints_load_in_pages_and_narrow_as_typed(tmp_path: Path) -> None:
    catalog = Catalog(FileStore(tmp_path / "store"))
    for j in range(300):
        job = f"job{j:05d}"
        created = f"2026-01-01T{j // 60:02d}:{j % 60:02d}:00Z"
        catalog.create_job(JobRecord(job, "big", None, created, 1, {}))
        for c in range(10):
            files = [ManifestFile("model.safetensors", 10, "0" * 64)]
            catalog.write_manifest(
                Manifest(job, "big", 0, f"checkpoint-{c}", created, created, files)
            )

    async def scenario() -> None:
        app = CheckpointsApp(CheckpointBrowser(catalog), project="big")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: not listed(app).loading, "the end of the listing")
            screen = listed(app)
            assert len(screen.manifests) == 3000 and len(screen.shown) == SHOWN
            assert screen.shown[0].job_id == "job00299", "newest job first"
            status = str(screen.query_one("#status").render())
            assert f"3000 committed checkpoints; {SHOWN} shown, type to narrow" in status
            await pilot.press(*"job00123")
            assert {m.job_id for m in screen.shown[:10]} == {"job00123"}
            await pilot.press("down", "q")

    asyncio.run(scenario())


def test_a_checkpoint_is_downloaded_into_the_current_directory(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "brws001" / "rank-0" / "checkpoint-10"

    async def scenario() -> list[str]:
        app = CheckpointsApp(store.browser(), job_id="brws001")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: len(listed(app).shown) == 2, "two checkpoints")
            await pilot.press(*"checkpoint-10", "enter")
            await until(pilot, lambda: isinstance(app.screen, CheckpointView), "the checkpoint")
            await pilot.press("d")
            view = app.screen
            assert isinstance(view, CheckpointView)
            said = lambda: view.said  # noqa: E731
            await until(pilot, lambda: any("downloaded" in m for m in said()), "the download")
            bar = app.screen.query_one("#progress", ProgressBar)
            assert bar.progress == bar.total
            await pilot.press("d")
            await until(pilot, lambda: any("already exists" in m for m in said()), "a refusal")
            await pilot.press("q")
            return said()

    said = asyncio.run(scenario())
    assert "downloaded to brws001/rank-0/checkpoint-10" in said
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((target / "config.json").read_text()) == {"_name_or_path": "Qwen/Qwen3-0.6B"}


def test_quitting_while_a_download_runs_ends_the_command_at_once(
    store: Store, tmp_path: Path
) -> None:
    """q while a checkpoint comes down through a slow link (each connection paced at 1 MB/s:
    its 1 GiB file would take most of a minute): the real command, in a real terminal, ends
    at once with 0, rather than once the download is whole, and leaves no checkpoint in
    place."""
    import time

    from far_link import FarLink

    far = FarLink(store.proxy.port, 0.0, 1e6)
    columns, rows = 120, 30
    try:
        child = pexpect.spawn(
            sys.executable,
            ["-m", "bt_agent", "checkpoints", "list", "--store", store.url, "--job-id", "brws001"],
            env={
                **os.environ,
                **store.env,
                "AWS_ENDPOINT_URL": far.endpoint,
                "TERM": "xterm-256color",
                "COLUMNS": str(columns),
            },
            dimensions=(rows, columns),
            cwd=str(tmp_path),
            timeout=60,
        )
        screen = pyte.Screen(columns, rows)
        stream = pyte.ByteStream(screen)

        def read_until(text: str) -> None:
            deadline = time.monotonic() + 60
            while text not in "\n".join(screen.display):
                assert time.monotonic() < deadline, "\n".join(screen.display)
                with contextlib.suppress(pexpect.TIMEOUT):
                    stream.feed(child.read_nonblocking(65536, timeout=1))

        read_until("2 committed checkpoints")
        child.send("checkpoint-20")
        read_until("1 of 2 committed checkpoints match")
        child.send("\r")
        read_until("adapter_config.json")
        child.send("d")
        deadline = time.monotonic() + 30
        while not any(path.is_file() for path in tmp_path.rglob("*")):  # the download began
            assert time.monotonic() < deadline, "\n".join(screen.display)
            time.sleep(0.05)
        time.sleep(0.5)
        quit_at = time.monotonic()
        child.send("q")
        child.expect(pexpect.EOF, timeout=120)
        took = time.monotonic() - quit_at
        child.close()
    finally:
        far.close()
    assert took < 10, f"the command ended {took:.1f} s after q"
    assert child.exitstatus == 0, child.before
    assert not (tmp_path / "brws001" / "rank-0" / "checkpoint-20").exists(), "none in place"
