"""The interactive checkpoint browser (``bt-agent checkpoints browse``, and ``checkpoints list``
on a terminal), built on textual.

The first screen lists the committed checkpoints, newest first, loaded a page at a time on a
worker thread, and filtered as you type (fuzzy, best match first). Enter opens a checkpoint: its
directory tree beside a preview pane. A preview never fetches a whole file: text and JSON show
their first :data:`PREVIEW_BYTES` from one ranged read, ``.safetensors`` files the tensors of
their header, anything else its size and sha256. Imported only by those commands: textual costs
start-up time that ``bt-agent run`` must not pay.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.fuzzy import Matcher
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Input, ProgressBar, Static, Tree
from textual.widgets.tree import TreeNode
from textual.worker import get_current_worker

from bt_agent.browse import CheckpointBrowser, checkpoint_type, object_key
from bt_agent.catalog import checkpoint_prefix
from bt_agent.errors import BtAgentError
from bt_agent.log import format_bytes
from bt_agent.records import Manifest, ManifestFile, natural_key
from bt_agent.staging.checkpoints import download_checkpoint

PREVIEW_BYTES = 64 * 1024
TEXT_SUFFIXES = frozenset(
    {".json", ".jsonl", ".txt", ".md", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv", ".log"}
    | {".py", ".sh", ".jinja", ".tokenizer", ".vocab", ".merges"}
)
COLUMNS = ("job", "checkpoint", "node", "type", "size", "created")
SHOWN = 200  # rows in the table at once: the newest, or the best matches (typing narrows)
REFILTER_SECONDS = 0.2  # while pages arrive under a query, the list is re-ranked this often


# --- what the screens show, apart from the screens ---------------------------------------------


def haystack(manifest: Manifest) -> str:
    """What a query is matched against."""
    m = manifest
    return f"{m.job_id} {m.checkpoint} rank-{m.node_rank} {checkpoint_type(m)} {m.project}"


def ranked(manifests: list[Manifest], query: str) -> list[Manifest]:
    """``manifests`` that match ``query`` (fuzzy: its letters in order), best match first,
    newest first among equals; every one, in order, for an empty query."""
    if not query.strip():
        return manifests
    matcher = Matcher(query.strip())
    scored = [(matcher.match(haystack(m)), i, m) for i, m in enumerate(manifests)]
    return [m for score, _, m in sorted(scored, key=lambda s: (-s[0], s[1])) if score > 0]


def row(manifest: Manifest) -> tuple[str, ...]:
    m = manifest
    created = m.created_at.replace("T", " ")[:19]
    size = format_bytes(m.size)
    return (m.job_id, m.checkpoint, str(m.node_rank), checkpoint_type(m), size, created)


def preview(browser: CheckpointBrowser, manifest: Manifest, entry: ManifestFile) -> str:
    """What the preview pane shows of one file (read with ranged reads only)."""
    key = object_key(manifest, entry.path)
    facts = f"{entry.path}\n{format_bytes(entry.size)}, sha256\n{entry.sha256}\n\n"
    suffix = PurePosixPath(entry.path).suffix.lower()
    if suffix == ".safetensors":
        summary = browser.summary(key, entry.path)
        lines = [f"{len(summary.tensors)} tensors, {summary.parameters:,} parameters"]
        width = max((len(t.name) for t in summary.tensors), default=0)
        for tensor in summary.tensors:
            shape = "x".join(map(str, tensor.shape)) or "scalar"
            lines.append(f"  {tensor.name.ljust(width)}  {tensor.dtype:>5}  {shape}")
        if summary.metadata:
            lines.append(f"metadata: {json.dumps(summary.metadata, sort_keys=True)}")
        return facts + "\n".join(lines)
    if suffix not in TEXT_SUFFIXES:
        return facts + "(no preview for this kind of file)"
    data = browser.store.read_range(key, 0, min(entry.size, PREVIEW_BYTES))
    text = data.decode("utf-8", errors="replace")
    if suffix == ".json" and entry.size <= PREVIEW_BYTES:
        with contextlib.suppress(ValueError):  # else shown as it is
            text = json.dumps(json.loads(text), indent=2)
    cut = f"(the first {format_bytes(len(data))})\n" if entry.size > len(data) else ""
    return facts + cut + text


def file_tree(files: Iterable[ManifestFile]) -> dict[str, Any]:
    """Nested dicts of directory names, with each file at its name."""
    root: dict[str, Any] = {}
    for entry in sorted(files, key=lambda f: natural_key(f.path)):
        *folders, name = entry.path.split("/")
        node = root
        for folder in folders:
            node = node.setdefault(folder + "/", {})
        node[name] = entry
    return root


@dataclass(frozen=True)
class Download:
    """Where the download key puts a checkpoint: ``./<job>/rank-<N>/<checkpoint>``, the
    serving layout, under the directory the browser was started in."""

    manifest: Manifest
    base: Path

    @property
    def target(self) -> Path:
        m = self.manifest
        return self.base / m.job_id / f"rank-{m.node_rank}" / m.checkpoint

    def shown(self) -> str:
        return os.path.relpath(self.target, self.base)


# --- the screens ---------------------------------------------------------------------------------


class CheckpointList(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "search", "Search"),
        Binding("enter", "open", "Open", priority=True),
        Binding("down", "to_table", "List", show=False),
        Binding("escape", "to_table", "List"),
        Binding("c", "copy", "Copy URL"),
        Binding("d", "download", "Download"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, browser: CheckpointBrowser, project: str | None, job_id: str | None):
        super().__init__()
        self.browser = browser
        self.project = project
        self.job_id = job_id
        self.manifests: list[Manifest] = []
        self.shown: list[Manifest] = []
        self.matches = 0
        self.loading = True
        self._pending: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="type to filter (job, checkpoint, rank, type)", id="search")
        table: DataTable[str] = DataTable(id="checkpoints", cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        yield table
        yield Static("loading...", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.app.sub_title = self.browser.store.url
        self.load()

    @work(thread=True, exit_on_error=False)
    def load(self) -> None:
        """Every page of checkpoints, each added as it arrives."""
        try:
            for page in self.browser.manifest_pages(self.project, self.job_id):
                self.app.call_from_thread(self.add, page)
        except BtAgentError as exc:
            self.app.call_from_thread(self.say, f"cannot list the checkpoints: {exc}")
            return
        finally:
            self.loading = False
        self.app.call_from_thread(self.say_count)

    def add(self, page: list[Manifest]) -> None:
        """A page that arrived: shown at once without a query (newest first, as listed), else
        ranked with the rest a moment later, so that a long listing costs few redraws."""
        self.manifests.extend(page)
        if self.query_one("#search", Input).value.strip():
            if self._pending is None:
                self._pending = self.set_timer(REFILTER_SECONDS, self.refilter)
            return
        new = page[: max(SHOWN - len(self.shown), 0)]
        self.shown.extend(new)
        self.matches = len(self.manifests)
        self.query_one("#checkpoints", DataTable).add_rows(row(m) for m in new)
        self.say_count()

    def say(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    def say_count(self) -> None:
        """How many are listed, and what the keys do where the search box takes letters."""
        total = len(self.manifests)
        said = f"{self.matches} of {total} committed checkpoints match"
        if self.matches == total:
            said = f"{total} committed checkpoints"
        if len(self.shown) < self.matches:
            said += f"; {len(self.shown)} shown, type to narrow"
        said += " (loading more)" if self.loading else ""
        if self.query_one("#search", Input).has_focus:
            said += "  ·  Enter opens; Esc or Down goes to the list (c copy, d download, q quit)"
        self.say(said)

    def refilter(self) -> None:
        self._pending = None
        matching = ranked(self.manifests, self.query_one("#search", Input).value)
        self.matches = len(matching)
        self.shown = matching[:SHOWN]
        table = self.query_one("#checkpoints", DataTable)
        table.clear()
        table.add_rows(row(m) for m in self.shown)
        self.say_count()

    def on_descendant_focus(self) -> None:
        self.say_count()

    @on(Input.Changed, "#search")
    def _typed(self) -> None:
        self.refilter()

    def selected(self) -> Manifest | None:
        table = self.query_one("#checkpoints", DataTable)
        if not self.shown:
            return None
        return self.shown[min(max(table.cursor_row, 0), len(self.shown) - 1)]

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_to_table(self) -> None:
        self.query_one("#checkpoints", DataTable).focus()

    def action_open(self) -> None:
        manifest = self.selected()
        if manifest is not None:
            self.app.push_screen(CheckpointView(self.browser, manifest))

    def action_copy(self) -> None:
        manifest = self.selected()
        if manifest is not None:
            copy_url(self.app, self.browser, manifest, None)

    def action_download(self) -> None:
        manifest = self.selected()
        if manifest is not None:
            self.app.push_screen(CheckpointView(self.browser, manifest, download=True))


class CheckpointView(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
        Binding("c", "copy", "Copy URL"),
        Binding("d", "download", "Download"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, browser: CheckpointBrowser, manifest: Manifest, download: bool = False):
        super().__init__()
        self.browser = browser
        self.manifest = manifest
        self.start_download = download
        self.file: ManifestFile | None = None
        self.said: list[str] = []  # what this screen told its user, oldest first

    def compose(self) -> ComposeResult:
        m = self.manifest
        yield Header()
        yield Static(
            f"{m.checkpoint} of job {m.job_id} (project {m.project}, rank {m.node_rank}): "
            f"{checkpoint_type(m)}, {len(m.files)} files, {format_bytes(m.size)}, "
            f"committed {m.created_at}",
            id="about",
        )
        tree: Tree[ManifestFile | None] = Tree(f"{m.checkpoint}/", id="files")
        _grow(tree.root, file_tree(m.files))
        tree.root.expand_all()
        with Horizontal():
            yield tree
            with VerticalScroll(id="pane"):
                yield Static("Enter on a file shows it here.", id="preview", markup=False)
        yield ProgressBar(total=max(m.size, 1), id="progress", show_eta=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#progress", ProgressBar).display = False
        self.query_one("#files", Tree).focus()
        if self.start_download:
            self.action_download()

    @on(Tree.NodeSelected, "#files")
    def _chosen(self, event: Tree.NodeSelected[ManifestFile | None]) -> None:
        entry = event.node.data
        if entry is None:
            return
        self.file = entry
        self.query_one("#preview", Static).update(f"{entry.path}\nreading...")
        self.show(entry)

    @work(thread=True, exclusive=True, exit_on_error=False, group="preview")
    def show(self, entry: ManifestFile) -> None:
        try:
            text = preview(self.browser, self.manifest, entry)
        except BtAgentError as exc:
            text = f"{entry.path}\ncannot preview it: {exc}"
        self.app.call_from_thread(self._shown, entry, text)

    def _shown(self, entry: ManifestFile, text: str) -> None:
        if self.file == entry:
            self.query_one("#preview", Static).update(text)
            self.query_one("#pane", VerticalScroll).scroll_home(animate=False)

    def tell(self, message: str, error: bool = False) -> None:
        self.said.append(message)
        self.notify(message, severity="error" if error else "information")

    def action_copy(self) -> None:
        copy_url(self.app, self.browser, self.manifest, self.file)

    def action_download(self) -> None:
        job = Download(self.manifest, Path.cwd())
        if job.target.exists():
            self.tell(f"{job.shown()} already exists; move it first", error=True)
            return
        bar = self.query_one("#progress", ProgressBar)
        bar.display = True
        bar.update(progress=0)
        self.app.run_worker(
            partial(self.download, job, bar), thread=True, group="download", exit_on_error=False
        )

    def download(self, job: Download, bar: ProgressBar) -> None:
        """``job`` on a worker of the app's, not of this view's: it goes on when the view is
        left, and ends at once when the browser quits (which cancels the app's workers), the
        files under way left to end with the process, none in place."""
        worker = get_current_worker()

        def advance(size: int) -> None:
            if not worker.is_cancelled:  # the app's loop may be gone: nothing would answer
                self.app.call_from_thread(bar.advance, size)

        try:
            download_checkpoint(
                self.browser.catalog,
                job.manifest,
                job.target,
                stopping=lambda: worker.is_cancelled,
                fetched=advance,
            )
        except InterruptedError:  # the browser quit meanwhile
            return
        except (BtAgentError, OSError) as exc:
            self.app.call_from_thread(self.tell, f"download failed: {exc}", True)
            return
        self.app.call_from_thread(self.tell, f"downloaded to {job.shown()}")


def _grow(node: TreeNode[ManifestFile | None], items: dict[str, Any]) -> None:
    for name, item in items.items():
        if isinstance(item, dict):
            _grow(node.add(name, data=None), item)
        else:
            node.add_leaf(f"{name}  ({format_bytes(item.size)})", data=item)


def copy_url(
    app: App[Any], browser: CheckpointBrowser, m: Manifest, file: ManifestFile | None
) -> None:
    if file is None:
        url = browser.store.uri(checkpoint_prefix(m.project, m.job_id, m.node_rank, m.checkpoint))
    else:
        url = browser.store.uri(object_key(m, file.path))
    app.copy_to_clipboard(url)
    app.notify(f"copied {url}")


class CheckpointsApp(App[int]):
    """Browse a store's committed checkpoints; returns 0 when quit."""

    TITLE = "bt-agent checkpoints"
    CSS = """
    #status { height: 1; color: $text-muted; }
    #about { height: auto; padding: 0 1; }
    #files { width: 34%; }
    #pane { width: 66%; border-left: solid $primary; padding: 0 1; }
    #progress { height: 1; }
    """

    def __init__(
        self, browser: CheckpointBrowser, project: str | None = None, job_id: str | None = None
    ) -> None:
        super().__init__()
        self.browser = browser
        self.project = project
        self.job_id = job_id

    def on_mount(self) -> None:
        self.push_screen(CheckpointList(self.browser, self.project, self.job_id))

    async def action_quit(self) -> None:
        self.exit(0)
