"""What each subcommand does, once its arguments are parsed."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from bt_agent.catalog import Catalog, JobView
from bt_agent.cli.output import render
from bt_agent.context import ContextInputs, Layout, NodeContext, resolve, store_url
from bt_agent.env import build
from bt_agent.errors import NotFoundError, RecordNotFoundError, SpecError, UsageError
from bt_agent.log import counted, format_bytes
from bt_agent.secrets import Secrets
from bt_agent.secrets import resolve as resolve_secrets
from bt_agent.settings import CONFIG_PYTHON_VARIABLE, CONTEXT_VARIABLES, SPEC_VARIABLE, Environ
from bt_agent.spec.checks import shell_drops
from bt_agent.spec.loader import load
from bt_agent.storage import open_store
from bt_agent.supervisor.claim import node_lock
from bt_agent.supervisor.job import JobRunner
from bt_agent.supervisor.plan import JobPlan

if TYPE_CHECKING:
    from bt_agent.browse import CheckpointBrowser
    from bt_agent.log import AgentLog

FOLLOW_INTERVAL_SECONDS = 0.5
PROGRESS_SECONDS = 1.0  # between the lines of `store reindex`'s progress


def _plan(
    args: argparse.Namespace, environ: Environ, check_secrets: bool = True, running: bool = True
) -> JobPlan:
    """Load and check everything a job needs; raise before anything is created. A spec only
    being judged (``running=False``) needs no node context beyond what flags give."""
    source = args.spec or environ.get(SPEC_VARIABLE)
    if not source:
        raise UsageError(f"no spec given: pass a path (or -) or set ${SPEC_VARIABLE}")
    spec = load(source, sys.stdin, environ.get(CONFIG_PYTHON_VARIABLE))
    inputs = ContextInputs(**{f.name: getattr(args, f.name) for f in fields(ContextInputs)})
    job = spec.job
    context = resolve(
        inputs,
        environ,
        job.compute.node_count,
        job.compute.gpu_count,
        spec.project_name,
        spec.team_name,
        needs_leader=running,
    )
    secrets, problems = (
        resolve_secrets(job, context.secrets_dir) if check_secrets else (Secrets(), [])
    )
    if problems:
        raise SpecError(problems, spec.origin)
    env = build(job, context, secrets, environ.values)
    code_dir = _code_dir(args, spec.code_dir, context)
    return JobPlan(spec, context, env, secrets, code_dir, environ)


def _code_dir(args: argparse.Namespace, spec_dir: Path | None, context: NodeContext) -> Path | None:
    """The user's code: ``--code-dir``, else the spec's directory on a local (node-root) run.
    In a real container the platform has already put the code in the working dir."""
    given = getattr(args, "code_dir", None)
    if given:
        path = Path(given)
        if not path.is_dir():
            raise UsageError(f"--code-dir {given}: not a directory")
        return path
    return spec_dir if context.layout.node_root is not None else None


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    plan = _plan(args, Environ.current())
    with node_lock(plan.context), open_store(plan.context.store_url) as store:
        return JobRunner(plan, Catalog(store), out, err).run()


def validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        plan = _plan(args, Environ.current(), check_secrets=not args.skip_secrets, running=False)
    except SpecError as exc:
        if args.output != "json":
            raise
        _json(
            {"valid": False, "origin": exc.source, "problems": [p.as_dict() for p in exc.problems]},
            out,
        )
        return exc.exit_code
    job = plan.spec.job
    for warning in shell_drops(job):
        _warn(warning, err)
    summary = {
        "valid": True,
        "origin": plan.spec.origin,
        "project": plan.context.project,
        "start_commands": len(job.runtime.start_commands),
        "weights": len(job.weights),
        "checkpoints_to_load": len(job.runtime.checkpoints_to_load),
        "nodes": job.compute.node_count,
    }
    if args.output == "json":
        _json(summary, out)
    else:
        out.write(
            f"{plan.spec.origin}: valid ({summary['start_commands']} start_commands, "
            f"{summary['weights']} weights, {summary['nodes']} node(s), project "
            f"{plan.context.project})\n"
        )
    return 0


def stage(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from bt_agent.log import AgentLog
    from bt_agent.staging.weights import stage_job_weights

    plan = _plan(args, Environ.current())
    log = AgentLog(err, plan.secrets.redact)

    def work(stopping: Callable[[], bool]) -> int:
        ctx, environ, secrets = plan.context, plan.environ, plan.secrets
        plans = stage_job_weights(plan.spec.job, ctx, environ, secrets, log, stopping)
        out.write(f"staged {len(plans)} weights source(s)\n")
        return 0

    return _stoppable("staging", log, work)


def _stoppable(what: str, log: AgentLog, work: Callable[[Callable[[], bool]], int]) -> int:
    """``work(stopping)``'s exit code; SIGINT (Ctrl-C) or SIGTERM make ``stopping()`` true,
    and the :class:`InterruptedError` the work then raises at once is said on ``log`` and
    ends the command with 128+N, as ``run`` does."""
    from bt_agent.supervisor.process import signal_name
    from bt_agent.supervisor.signals import SignalRelay

    with SignalRelay() as relay:
        try:
            return work(lambda: relay.stopping)
        except InterruptedError:
            number = relay.stop_signal or signal.SIGINT
            log.info(f"{what} stopped by {signal_name(number)} before it was done")
            return 128 + number


def cache(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from bt_agent.records import now_iso
    from bt_agent.settings import (
        NODE_CACHE_DIR_VARIABLE,
        NODE_CACHE_MAX_BYTES_VARIABLE,
        parse_size,
    )
    from bt_agent.staging.cache import NodeCache, left_by_stops

    environ = Environ.current()
    given = environ.get(NODE_CACHE_DIR_VARIABLE)
    node_cache = NodeCache.for_node(_layout(args, environ).host, given)
    if not node_cache.root.exists():  # a typo, or the node root of a local run left out
        where = (
            f"${NODE_CACHE_DIR_VARIABLE}"
            if given
            else f"--node-root (or ${CONTEXT_VARIABLES['node_root']})"
        )
        _warn(
            f"{node_cache.root} does not exist: no staging has used this cache; check {where}", err
        )
    if args.cache_command == "prune":
        budget = args.max_bytes
        if budget is None:
            try:
                budget = parse_size(environ.get(NODE_CACHE_MAX_BYTES_VARIABLE) or "0")
            except ValueError as exc:
                raise UsageError(f"{NODE_CACHE_MAX_BYTES_VARIABLE}: {exc}") from None
        abandoned = node_cache.clear_abandoned()
        removed = node_cache.evict(budget)
        freed = sum(e.size for e in removed)
        out.write(
            f"evicted {_entries(len(removed))} ({format_bytes(freed)}) from {node_cache.root}\n"
        )
        if abandoned:
            out.write(f"removed {left_by_stops(abandoned)}\n")
        return 0
    entries = sorted(node_cache.entries(), key=lambda e: e.last_used, reverse=True)
    table = args.output == "table"  # sizes and flags for people; bytes and booleans otherwise
    rows = [
        {
            "entry": e.path.name[:16],
            "size": format_bytes(e.size) if table else e.size,
            "last_used": now_iso(e.last_used),
            "in_use": ("yes" if e.in_use else "no") if table else e.in_use,
        }
        for e in entries
    ]
    out.write(render(rows, ("entry", "size", "last_used", "in_use"), args.output) + "\n")
    if table:
        total = sum(e.size for e in entries)
        out.write(
            f"{_entries(len(entries))}, {format_bytes(total)}, "
            f"{sum(e.in_use for e in entries)} in use, in {node_cache.root}\n"
        )
    return 0


def _entries(count: int) -> str:
    return f"{count} {'entry' if count == 1 else 'entries'}"


def env(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    plan = _plan(args, Environ.current())
    out.write("\n".join(plan.env.export_lines()) + "\n")
    return 0


def _layout(args: argparse.Namespace, environ: Environ) -> Layout:
    root = args.node_root or environ.context_value("node_root")
    return Layout(Path(root).absolute() if root else None)


def _catalog(args: argparse.Namespace, environ: Environ, err: TextIO) -> Catalog:
    where = "--store" if args.store else f"${CONTEXT_VARIABLES['store']}"
    url, problem = store_url(args.store or environ.context_value("store"), environ, where)
    if problem:
        raise UsageError(str(problem))
    from bt_agent.storage.file import FileStore

    store = open_store(url, environ)
    if isinstance(store, FileStore) and not store.root.exists():  # a typo, or no job ran yet
        _warn(f"{store.url} does not exist: no job has used this store; check {where}", err)
    return Catalog(store, lambda text: _warn(text, err))


def _warn(text: str, err: TextIO) -> None:
    err.write(f"bt-agent: warning: {text}\n")


def checkpoints(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.checkpoints_command == "download":
        return _download_for_serving(args, out, err)
    from bt_agent.browse import CheckpointBrowser

    browser = CheckpointBrowser(_catalog(args, Environ.current(), err))
    if args.checkpoints_command == "browse" or _interactive(args, out):
        return _browse(browser, args, out)
    if args.checkpoints_command == "list":
        limit = _limit(args)
        output = args.output or "table"
        rows = [r.to_dict() for r in browser.rows(args.project, args.job_id, args.sort, limit)]
        _say_if_cut(len(rows), limit, "checkpoints", err)
        for row in rows:
            row["size"] = format_bytes(row["size"]) if output == "table" else row["size"]
        listed = ("job_id", "checkpoint", "node", "type", "base_model", "size", "created_at")
        out.write(render(rows, listed, output) + "\n")
    elif args.checkpoints_command == "files":
        rows = [r.to_dict() for r in browser.files(args.job_id, args.checkpoint)]
        columns = ("checkpoint", "path", "node", "size", "sha256", "url")
        out.write(render(rows, columns, args.output) + "\n")
    else:
        summaries = browser.inspect(args.job_id, args.checkpoint, args.file, args.node)
        _tensors(summaries, args.output, out)
    return 0


def _interactive(args: argparse.Namespace, out: TextIO) -> bool:
    """``checkpoints list`` on a terminal, unless told to print (``-o``, ``--no-interactive``)."""
    if args.checkpoints_command != "list" or args.output or args.no_interactive:
        return False
    return _on_a_terminal(out)


def _on_a_terminal(out: TextIO) -> bool:
    return sys.stdin.isatty() and out.isatty()


def _browse(browser: CheckpointBrowser, args: argparse.Namespace, out: TextIO) -> int:
    if not _on_a_terminal(out):
        raise UsageError(
            "the checkpoint browser needs a terminal; use `bt-agent checkpoints list -o "
            "table|json|jsonl|csv` to print the checkpoints instead"
        )
    from bt_agent.browse.app import CheckpointsApp

    code = CheckpointsApp(browser, args.project, args.job_id).run()
    return code or 0


def _tensors(summaries: list[Any], fmt: str, out: TextIO) -> None:
    if fmt == "json":
        _json([s.to_dict() for s in summaries], out)
        return
    columns = ("file", "name", "dtype", "shape", "parameters")
    rows = [
        {**t.to_dict(), "file": s.file, "shape": "x".join(map(str, t.shape)) or "scalar"}
        for s in summaries
        for t in s.tensors
    ]
    if fmt == "csv":
        out.write(render(rows, columns, fmt) + "\n")
        return
    for summary in summaries:
        tensors = [r for r in rows if r["file"] == summary.file]
        out.write(
            f"{summary.file}: {len(summary.tensors)} tensors, {summary.parameters:,} parameters\n"
        )
        out.write(render(tensors, columns[1:], "table") + "\n\n")


def _download_for_serving(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from bt_agent.log import AgentLog
    from bt_agent.staging import serving

    environ = Environ.current()
    try:
        text = Path(args.config).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {args.config}: {exc.strerror}") from exc
    wanted = serving.parse(text, args.config)
    folder = _layout(args, environ).host(wanted.download_folder)
    catalog = _catalog(args, environ, err)
    log = AgentLog(err)

    def work(stopping: Callable[[], bool]) -> int:
        for target in serving.download(catalog, wanted, folder, log, stopping):
            out.write(f"{target}\n")
            out.flush()
        return 0

    return _stoppable("the download", log, work)


def jobs(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    catalog = _catalog(args, Environ.current(), err)
    if args.jobs_command == "list":
        limit = _limit(args)
        views = catalog.jobs(args.project, limit)
        rows = [_job_row(v) for v in views]
        _say_if_cut(len(rows), limit, "jobs", err)
        columns = ("job_id", "project", "name", "status", "nodes", "created_at")
        out.write(render(rows, columns, args.output) + "\n")
        return 0
    if args.jobs_command == "view":
        return _view(catalog.view(args.job_id), args.output, out)
    return _logs(catalog, args.job_id, args.node, args.follow, out)


def _limit(args: argparse.Namespace) -> int | None:
    if args.all:
        return None
    if args.limit < 1:
        raise UsageError(f"--limit {args.limit}: give a number of rows, at least 1 (or --all)")
    return int(args.limit)


def _say_if_cut(shown: int, limit: int | None, what: str, err: TextIO) -> None:
    if limit is not None and shown >= limit:
        err.write(f"bt-agent: the newest {limit} {what}; --limit N or --all for more\n")


def store(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``store reindex``: the index of every job and commit, with progress."""
    catalog = _catalog(args, Environ.current(), err)
    started = time.monotonic()
    said = started

    def progress(jobs: int, total: int) -> None:
        nonlocal said
        if time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            err.write(f"bt-agent: reindexed {jobs:,} of {counted(total, 'job')}\n")
            err.flush()

    done = catalog.reindex(progress)
    seconds = time.monotonic() - started
    out.write(
        f"indexed {counted(done.jobs, 'job')} and {counted(done.commits, 'committed checkpoint')}"
        f" of {catalog.store.url} in {seconds:.1f} s\n"
    )
    return 0


def _logs(catalog: Catalog, job_id: str, rank: int, follow: bool, out: TextIO) -> int:
    """Print a node's saved log; with ``follow``, keep printing until the node has ended."""
    project = catalog.project_of(job_id)
    shown = 0
    while True:
        ended = not follow or _node_ended(catalog, job_id, rank)
        try:
            data = catalog.read_log(project, job_id, rank)
        except NotFoundError:
            if not follow:
                raise RecordNotFoundError(f"node {rank} of job {job_id} has no saved log") from None
            data = b""
        out.write(data[shown:].decode("utf-8", errors="replace"))
        out.flush()
        shown = max(shown, len(data))
        if ended:
            return 0
        time.sleep(FOLLOW_INTERVAL_SECONDS)


def _node_ended(catalog: Catalog, job_id: str, rank: int) -> bool:
    nodes = {node.node_rank: node for node in catalog.view(job_id).nodes}
    return rank in nodes and nodes[rank].status.terminal


def _job_row(view: JobView) -> dict[str, Any]:
    job = view.job
    return {
        "job_id": job.job_id,
        "project": job.project,
        "name": job.name,
        "status": view.status.short,
        "nodes": f"{len(view.nodes)}/{job.node_count}",
        "created_at": job.created_at,
    }


def _view(view: JobView, fmt: str, out: TextIO) -> int:
    if fmt == "json":
        _json(view.to_dict(), out)
        return 0
    rows = [
        {
            "node": n.node_rank,
            "status": n.status.short,
            "exit_code": n.exit_code,
            "host": n.hostname,
            "started_at": n.history[0].at if n.history else None,
            "ended_at": n.history[-1].at if n.status.terminal else None,
            "reason": n.error,
        }
        for n in view.nodes
    ]
    columns = ("node", "status", "exit_code", "host", "started_at", "ended_at", "reason")
    if fmt == "csv":
        out.write(render(rows, columns, fmt) + "\n")
        return 0
    job = view.job
    out.write(
        f"job {job.job_id}  project {job.project}  name {job.name or '-'}  "
        f"status {view.status.short}  created {job.created_at}\n\n"
    )
    out.write(render(rows, columns, "table") + "\n")
    return 0


def _json(data: Any, out: TextIO) -> None:
    out.write(json.dumps(data, indent=2) + "\n")
