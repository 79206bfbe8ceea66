"""``bt-agent``: run, validate and inspect training jobs.

Importing this module is cheap: no storage SDK, no torch, no pydantic (start-up time is a
feature of a PID 1). Every error becomes one message and the exit code its type declares.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from bt_agent import __version__
from bt_agent.errors import BtAgentError, SpecError

DEFAULT_LIMIT = 50  # rows of a listing unless --limit or --all
#: The commands that stage weights and checkpoints: their first https request would wait for
#: the engine to seed its TLS random generator, which they start while their modules load.
SEEDING_COMMANDS = ("run", "stage")
#: The commands that move data: their process keeps few malloc arenas (:mod:`bt_agent.memory`),
#: set before any thread allocates.
MOVING_COMMANDS = ("run", "stage", "checkpoints")

EPILOG = """\
spec: a job JSON file ({"training_job": {...}} or a bare TrainingJob), a config.py that
defines one TrainingProject (needs the truss package), or - for stdin; default $BT_JOB_SPEC.

exit codes of `run`: 0 success; the failing start_command's own code; 128+N killed by or
stopped with signal N; 2 invalid spec or arguments; 3 staging failed or the store unusable (no
command ran); 4 checkpoints not durable; 1 the agent itself failed while the commands ran
(its traceback is in the log).

examples:
  bt-agent validate config.py
  bt-agent env job.json --node-root /tmp/node
  bt-agent run examples/quickstart/job.json --node-root ./.bt-node
  bt-agent jobs view JOB_ID -o json
  bt-agent checkpoints list --project my-project
  bt-agent checkpoints inspect --job-id JOB_ID --checkpoint checkpoint-20
"""

CONTEXT_HELP = {
    "job_id": ("BT_TRAINING_JOB_ID", "job id (default: a new 7-character id)"),
    "project": ("BT_TRAINING_PROJECT_NAME", "project name (default: the config's, else 'default')"),
    "node_rank": ("BT_NODE_RANK", "this node's rank, 0 = leader (default 0)"),
    "group_size": ("BT_GROUP_SIZE", "number of nodes (default: compute.node_count)"),
    "leader_addr": ("BT_LEADER_ADDR", "address of node 0 (default 127.0.0.1 on one node)"),
    "num_gpus": ("BT_NUM_GPUS", "GPUs on this node (default: detected)"),
    "store": ("BT_STORE_URL", "store URL (default file://~/.local/share/bt-agent/store)"),
    "node_root": ("BT_NODE_ROOT", "map every container path P to NODE_ROOT/P (local runs)"),
    "secrets_dir": ("BT_SECRETS_DIR", "directory with one file per secret (default /secrets)"),
    "grace_period": ("BT_GRACE_PERIOD_SECONDS", "seconds between SIGTERM and SIGKILL (default 30)"),
}


def _add_spec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", help="job JSON, config.py or - (default $BT_JOB_SPEC)")
    group = parser.add_argument_group("node context (flag, else environment variable)")
    for name, (variable, text) in CONTEXT_HELP.items():
        group.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar=variable, help=f"{text} [${variable}]"
        )


def _add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="URL", help="store URL [$BT_STORE_URL]")


def _store_name(value: str) -> str:
    """A job id or project name as the store's directories are named, else argparse's error."""
    from bt_agent.context import STORE_NAME_RULE, is_store_name  # not on every command's path

    if not is_store_name(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} names no job or project: they are named with {STORE_NAME_RULE}"
        )
    return value


def _add_node_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-root",
        metavar="BT_NODE_ROOT",
        help="the node root of a local layout [$BT_NODE_ROOT]",
    )


def _add_format(
    parser: argparse.ArgumentParser, default: str | None = "table", listing: bool = False
) -> None:
    from bt_agent.cli.output import FORMATS, LISTING_FORMATS

    parser.add_argument(
        "-o",
        "--output",
        choices=LISTING_FORMATS if listing else FORMATS,
        default=default,
        help=f"output format (default {default})" if default else "output format",
    )


def _add_limit(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"the newest N {what} (default {DEFAULT_LIMIT})",
    )
    parser.add_argument("--all", action="store_true", help=f"every {what[:-1]}, however many")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bt-agent",
        description="The in-container runtime for ML training jobs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"bt-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run a job to a terminal state (the container's PID 1)",
        description="Validate, create records, prepare the job's "
        "directories, run start_commands in order, record the outcome.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_spec(run)
    run.add_argument(
        "--code-dir",
        metavar="DIR",
        help="copy this directory into the working dir before the commands run "
        "(default with --node-root: the spec's directory; else nothing); a .btignore file "
        "there names what to leave out, in .gitignore syntax",
    )

    validate = commands.add_parser(
        "validate",
        help="check a spec; print every problem at once",
        description="Check a spec exactly as the SDK does, plus what "
        "the SDK misses. Exit 0 if valid, 2 with every problem if not.",
    )
    _add_spec(validate)
    validate.add_argument(
        "--skip-secrets", action="store_true", help="do not check that referenced secrets exist"
    )
    validate.add_argument("-o", "--output", choices=("text", "json"), default="text")

    stage = commands.add_parser(
        "stage",
        help="stage the weights only, through the node cache (pre-warm a node)",
        description="Plan and fetch every weights source into the node cache and mount it, "
        "as the DEPLOYING phase of `run` does, without running anything or writing records.",
    )
    _add_spec(stage)

    cache = commands.add_parser("cache", help="inspect or prune the node cache")
    cache_commands = cache.add_subparsers(dest="cache_command", metavar="SUBCOMMAND", required=True)
    for name, text in (
        ("summarize", "entries, sizes and last use"),
        (
            "prune",
            "evict least recently used entries no job has mounted; remove partial files "
            "that stopped stagings left",
        ),
    ):
        sub = cache_commands.add_parser(name, help=text)
        _add_node_root(sub)
        if name == "prune":
            sub.add_argument(
                "--max-bytes",
                type=_size,
                default=None,
                metavar="SIZE",
                help="budget to prune to: bytes, or with a unit (500G, 465Gi) "
                "(default $BT_NODE_CACHE_MAX_BYTES, else 0)",
            )
        else:
            _add_format(sub)

    checkpoints = commands.add_parser("checkpoints", help="committed checkpoints in the store")
    checkpoint_commands = checkpoints.add_subparsers(
        dest="checkpoints_command", metavar="SUBCOMMAND", required=True
    )
    fetch = checkpoint_commands.add_parser(
        "download",
        help="stage a DeployCheckpointsConfig's checkpoints for serving",
        description="Download the checkpoints a DeployCheckpointsConfig (or CheckpointList) "
        "names, as JSON, into <download_folder>/<training_job_id>/rank-0/<checkpoint>/, each "
        "file verified against its manifest.",
    )
    fetch.add_argument("config", help="DeployCheckpointsConfig or CheckpointList JSON")
    _add_store(fetch)
    _add_node_root(fetch)
    _add_checkpoint_browsing(checkpoint_commands)

    env = commands.add_parser(
        "env",
        help="print the start_commands' environment as export lines",
        description="Print the variables the agent sets for start_commands "
        "(BT_*, PET_*, HF_HOME, the user's) as `export K=V`; secrets masked.",
    )
    _add_spec(env)

    jobs = commands.add_parser("jobs", help="read job records from the store")
    jobs_commands = jobs.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND", required=True)
    listing = jobs_commands.add_parser("list", help="jobs, newest first")
    _add_store(listing)
    listing.add_argument("--project", type=_store_name, help="only this project's jobs")
    _add_limit(listing, "jobs")
    _add_format(listing, listing=True)
    view = jobs_commands.add_parser("view", help="one job with every node's record")
    view.add_argument("job_id", type=_store_name)
    _add_store(view)
    _add_format(view)
    logs = jobs_commands.add_parser("logs", help="a node's saved output")
    logs.add_argument("job_id", type=_store_name)
    logs.add_argument("--node", type=int, default=0, help="node rank (default 0)")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new output until the node's job ends",
    )
    _add_store(logs)

    store = commands.add_parser("store", help="maintain a store")
    store_commands = store.add_subparsers(dest="store_command", metavar="SUBCOMMAND", required=True)
    reindex = store_commands.add_parser(
        "reindex",
        help="build the index of a store written before bt-agent kept one",
        description="Write the index entries of every job and committed checkpoint in the "
        "store, then mark the index complete, so that `jobs list`, `checkpoints list` and "
        "resuming from a project's latest checkpoint read a page of it instead of every job. "
        "Safe to run again, and while jobs run.",
    )
    _add_store(reindex)
    return parser


def _add_checkpoint_browsing(commands: Any) -> None:
    from bt_agent.catalog import CHECKPOINT_SORTS

    listing = commands.add_parser(
        "list",
        help="committed checkpoints: an interactive browser on a terminal, else a table",
        description="Committed checkpoints, newest first; the type (full or lora) and the base "
        "model are detected from the files. On a terminal, without -o or --no-interactive, "
        "this opens the checkpoint browser (as `checkpoints browse` does).",
    )
    listing.add_argument("--project", type=_store_name, help="only this project's jobs")
    listing.add_argument("--job-id", type=_store_name, help="only this job's checkpoints")
    _add_limit(listing, "checkpoints")
    listing.add_argument(
        "--sort",
        choices=CHECKPOINT_SORTS,
        default="created",
        help="created and size: largest first; name and job: in natural order",
    )
    listing.add_argument(
        "--no-interactive",
        action="store_true",
        help="print the table even on a terminal (as -o does, and as a pipe gets)",
    )
    browse = commands.add_parser(
        "browse",
        help="browse checkpoints interactively: search, open, preview, download",
        description="A full-screen browser of the committed checkpoints: type to filter "
        "(fuzzy), Enter opens a checkpoint's files, Enter on a file previews it (text and "
        "JSON: the first 64 KiB; .safetensors: its tensors; else size and sha256), c copies "
        "the store URL, d downloads the checkpoint into ./<job>/rank-<N>/<checkpoint>, Escape "
        "goes back, q quits. Needs a terminal.",
    )
    browse.add_argument("--project", type=_store_name, help="only this project's jobs")
    browse.add_argument("--job-id", type=_store_name, help="only this job's checkpoints")
    _add_store(browse)
    files = commands.add_parser(
        "files", help="a job's checkpoint files: path, node, size, sha256, store URL"
    )
    files.add_argument("--job-id", type=_store_name, required=True)
    files.add_argument("--checkpoint", help="only this checkpoint (default: all)")
    inspect = commands.add_parser(
        "inspect",
        help="tensor summary of .safetensors files (header only, ranged reads)",
        description="Names, dtypes, shapes and parameter counts of a checkpoint's "
        ".safetensors files (or of FILE), read from the header alone: two small ranged reads "
        "per file, whatever its size, from any store.",
    )
    inspect.add_argument("--job-id", type=_store_name, required=True)
    inspect.add_argument("--checkpoint", required=True)
    inspect.add_argument("--node", type=int, default=0, help="node rank (default 0)")
    inspect.add_argument(
        "file", nargs="?", help="one file of the checkpoint (default: all .safetensors)"
    )
    for sub in (listing, files, inspect):
        _add_store(sub)
    _add_format(listing, default=None, listing=True)
    _add_format(files, listing=True)
    _add_format(inspect)


Handler = Callable[[argparse.Namespace, TextIO, TextIO], int]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the console script: runs a command and exits with its code."""
    words = sys.argv[1:] if argv is None else argv
    _set_allocator(words)
    _seed_tls(words)
    gc.disable()  # what start-up makes, modules and classes, lives as long as the process:
    handlers = _handlers()
    gc.freeze()  # no collection walks it again, the last ones at exit included
    gc.enable()
    args = build_parser().parse_args(argv)
    try:
        code = handlers[args.command](args, sys.stdout, sys.stderr)
    except SpecError as exc:
        print(f"bt-agent: {exc}", file=sys.stderr)
        code = exc.exit_code
    except BtAgentError as exc:
        print(f"bt-agent: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _seed_tls(argv: Sequence[str]) -> None:
    """For a command of :data:`SEEDING_COMMANDS` whose words name a store of the engine's, its
    TLS random generator seeded on a thread while the command's modules load
    (:mod:`bt_agent.storage.tls_seed`)."""
    if _command(argv) not in SEEDING_COMMANDS:
        return
    from bt_agent.settings import CONTEXT_VARIABLES, SPEC_VARIABLE, Environ
    from bt_agent.storage import tls_seed

    environ = Environ.current()
    variables = [environ.get(name) or "" for name in (SPEC_VARIABLE, CONTEXT_VARIABLES["store"])]
    if tls_seed.names_an_engine_store([*argv, *variables]):
        tls_seed.seed_in_background()


def _set_allocator(argv: Sequence[str]) -> None:
    """For a command of :data:`MOVING_COMMANDS`, few malloc arenas
    (:func:`bt_agent.memory.keep_few_arenas`)."""
    if _command(argv) in MOVING_COMMANDS:
        from bt_agent.memory import keep_few_arenas

        keep_few_arenas()


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, before it is parsed: its first word that is no option."""
    return next((word for word in argv if not word.startswith("-")), None)


def _handlers() -> dict[str, Handler]:
    """What carries out each command, the modules they use imported."""
    from bt_agent.cli import commands

    return {
        "run": commands.run,
        "validate": commands.validate,
        "env": commands.env,
        "jobs": commands.jobs,
        "stage": commands.stage,
        "cache": commands.cache,
        "checkpoints": commands.checkpoints,
        "store": commands.store,
    }


def _size(text: str) -> int:
    """An argument that is a size (:func:`bt_agent.settings.parse_size`)."""
    from bt_agent.settings import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
