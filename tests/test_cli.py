"""The CLI through a real subprocess: validate, env, run, jobs."""

from __future__ import annotations

import csv
import io
import json
import os
import socket

import pytest
from helpers import Agent, finish, job_with, wait_for
from spec_cases import INVALID, job

from bt_agent.log import format_bytes
from bt_agent.supervisor.code import MAX_CODE_FILES


def test_validate_reports_three_mistakes_with_paths(agent: Agent) -> None:
    spec = agent.spec(
        job(
            compute={"node_count": "2"},
            runtime={"start_commands": "python x.py"},
            weights=[{"source": "hf://a/b", "mount_location": "models"}],
        )
    )
    result = agent("validate", str(spec), *agent.context_args())
    assert result.code == 2
    for path in ("compute.node_count", "runtime.start_commands", "weights[0].mount_location"):
        assert f"  - {path}: " in result.err
    assert "(3 problems)" in result.err


def test_validate_json_output(agent: Agent) -> None:
    spec = agent.spec(job(priority="high"))
    result = agent("validate", str(spec), "-o", "json", "--skip-secrets")
    assert result.code == 2
    data = json.loads(result.out)
    assert data["valid"] is False and data["problems"][0]["path"] == "priority"


def test_validate_ok(agent: Agent) -> None:
    result = agent("validate", str(agent.spec(job())), "--skip-secrets")
    assert result.code == 0 and "valid" in result.out


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_spec_creates_nothing(agent: Agent, name: str) -> None:
    data, path = INVALID[name]
    result = agent.run_job(data)
    assert result.code == 2, result.text
    assert f"  - {path}: " in result.err
    assert not agent.node_root.exists() and not agent.store.exists()


def test_run_success_records_completed(agent: Agent) -> None:
    result = agent.run_job(job_with(start_commands=["echo one", "echo two >&2"]))
    assert result.code == 0, result.text
    assert result.out == "one\n" and "two\n" in result.err
    view = agent.job_view(agent.only_job_id())
    assert view["status"] == "TRAINING_JOB_COMPLETED"
    node = view["nodes"][0]
    assert [h["status"] for h in node["history"]] == [
        "TRAINING_JOB_CREATED",
        "TRAINING_JOB_DEPLOYING",
        "TRAINING_JOB_RUNNING",
        "TRAINING_JOB_COMPLETED",
    ]
    assert node["exit_code"] == 0 and node["error"] is None
    assert [c["exit_code"] for c in node["commands"]] == [0, 0]


def test_run_passes_through_the_failing_exit_code(agent: Agent) -> None:
    result = agent.run_job(job_with(start_commands=["true", "exit 7", "echo never"]))
    assert result.code == 7
    assert "never" not in result.out
    node = agent.job_view(agent.only_job_id())["nodes"][0]
    assert node["status"] == "TRAINING_JOB_FAILED" and node["exit_code"] == 7
    assert node["error"] == "start_commands[1] 'exit 7' exited with code 7"


def test_run_command_not_found_is_127(agent: Agent) -> None:
    result = agent.run_job(job_with(start_commands=["no-such-program-xyz"]))
    assert result.code == 127
    node = agent.job_view(agent.only_job_id())["nodes"][0]
    assert "was not found (exit 127)" in node["error"]


def test_run_command_not_executable_is_126(agent: Agent) -> None:
    script = agent.root / "code" / "script.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = agent.run_job(job_with(start_commands=["./script.sh"]))
    assert result.code == 126


def test_run_killed_by_signal_is_128_plus_n(agent: Agent) -> None:
    result = agent.run_job(job_with(start_commands=["kill -KILL $$"]))
    assert result.code == 137
    node = agent.job_view(agent.only_job_id())["nodes"][0]
    assert "killed by SIGKILL" in node["error"]


def test_run_missing_secret_is_a_spec_error(agent: Agent) -> None:
    result = agent.run_job(job_with(environment_variables={"HF_TOKEN": {"name": "hf_tok"}}))
    assert result.code == 2
    assert "runtime.environment_variables.HF_TOKEN: secret 'hf_tok' not found" in result.err
    assert not agent.store.exists()


def test_run_copies_the_code_dir_into_the_working_dir(agent: Agent) -> None:
    (agent.root / "code").mkdir(parents=True)
    (agent.root / "code" / "train.py").write_text("print('trained')\n")
    result = agent.run_job(job_with(start_commands=["python train.py", "pwd"]))
    assert result.code == 0, result.text
    assert result.out.splitlines() == ["trained", str(agent.node_root / "b10" / "workspace")]


def test_the_code_copy_leaves_out_what_is_not_code(agent: Agent) -> None:
    """Beside the spec: a named pipe and a socket, the secrets dir, a file store, another
    node's root, an earlier run's file store and a .git dir. Only the code reaches the working
    dir, and the log says what was copied and what special files were left out."""
    code = agent.root / "code"
    (code / "sub").mkdir(parents=True)
    (code / "train.py").write_text("print('trained')\n")
    (code / "sub" / "data.txt").write_text("12345")
    os.mkfifo(code / "pipe")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(code / "agent.sock"))
        (code / "secrets").mkdir()
        (code / "secrets" / "hf_tok").write_text("hf_secret_value\n")
        (code / "other-node" / "var" / "lib" / "bt-agent").mkdir(parents=True)
        (code / "old-store" / "index").mkdir(parents=True)  # an earlier run's --store
        (code / "old-store" / "index" / "format.json").write_text('{"version": 1}')
        (code / "old-store" / "jobs").mkdir()
        (code / "old-store" / "jobs" / "j1.json").write_text("{}")
        (code / ".git").mkdir()
        (code / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        spec = job_with(
            start_commands=["python train.py", "find . -type f -o -type l -o -type p -o -type s"]
        )
        args = ("--secrets-dir", str(code / "secrets"), "--store", str(code / "store"))
        result = agent.run_job(spec, *args)
    assert result.code == 0, result.text
    lines = result.out.splitlines()
    assert lines[0] == "trained"
    assert sorted(lines[1:]) == ["./job.json", "./sub/data.txt", "./train.py"]
    size = sum((code / name).stat().st_size for name in ("job.json", "sub/data.txt", "train.py"))
    assert "code: left out 2 special files" in result.err
    assert f"code: copied 3 files, {format_bytes(size)}" in result.err
    assert (code / "store" / "projects").is_dir(), "the store was there to be left out"


def test_a_second_run_on_a_node_root_in_use_is_refused(agent: Agent) -> None:
    """Two local runs with one ``--node-root`` would share the working, checkpoint and scratch
    dirs: the second is refused with exit 2 naming the first, before it writes anything; once
    the first has ended, the node root is free again."""
    first = agent.start(job_with(start_commands=["sleep 3"]), "--job-id", "first01")
    try:
        wait_for(lambda: (agent.store / "jobs" / "first01.json").exists(), 30, "the first job")
        second = agent.run_job(job_with(start_commands=["echo must not run"]))
        assert second.code == 2, second.text
        assert f"the node root {agent.node_root} is in use by job first01 (pid {first.pid})" in (
            second.err
        )
        assert "give this run a node root of its own (--node-root)" in second.err
        assert "must not run" not in second.out
        assert [p.name for p in (agent.store / "jobs").iterdir()] == ["first01.json"]
    finally:
        assert finish(first, 30, agent) == 0, agent.output()
    again = agent.run_job(job_with(start_commands=["echo ran"]))
    assert again.code == 0 and again.out == "ran\n", again.text


def test_the_code_dirs_ignore_file_is_honoured(agent: Agent) -> None:
    """``.btignore`` in the code dir (``.gitignore`` syntax, negation included) leaves out what
    it names, before the size limit is judged: a data dir of more files than a code dir may
    hold is refused until the ignore file names it."""
    code = agent.root / "code"
    (code / "data").mkdir(parents=True)
    for index in range(MAX_CODE_FILES + 1):
        (code / "data" / f"{index}.bin").touch()
    (code / "train.py").write_text("print('trained')\n")
    (code / "last.ckpt").write_text("x")
    (code / "keep.ckpt").write_text("y")
    spec = job_with(start_commands=["find . -type f"])
    refused = agent.run_job(spec)
    assert refused.code == 3, refused.text
    assert f"more than {MAX_CODE_FILES} files" in refused.err and ".btignore" in refused.err
    (code / ".btignore").write_text("# data is staged, not pushed\ndata/\n*.ckpt\n!keep.ckpt\n")
    result = agent.run_job(spec)
    assert result.code == 0, result.text
    found = sorted(result.out.splitlines())
    assert found == ["./.btignore", "./job.json", "./keep.ckpt", "./train.py"]
    assert "(2 paths left out by .btignore)" in result.err


def test_run_from_stdin_and_job_spec_variable(agent: Agent) -> None:
    text = json.dumps({"training_job": job_with(start_commands=["echo stdin"])})
    result = agent("run", "-", *agent.context_args(), stdin=text)
    assert result.code == 0 and result.out == "stdin\n"
    spec = agent.spec(job_with(start_commands=["echo env"]), name="other.json")
    result = agent("run", *agent.context_args(), env={"BT_JOB_SPEC": str(spec)})
    assert result.code == 0 and result.out == "env\n"


def test_run_without_spec_is_a_usage_error(agent: Agent) -> None:
    result = agent("run", *agent.context_args())
    assert result.code == 2 and "BT_JOB_SPEC" in result.err


def test_bad_node_context_lists_every_problem(agent: Agent) -> None:
    result = agent(
        "run",
        str(agent.spec(job())),
        *agent.context_args(),
        "--node-rank",
        "3",
        "--grace-period",
        "soon",
        "--job-id",
        "../x",
        "--store",
        "ftp://host/bt",
    )
    assert result.code == 2
    for where in ("--node-rank", "--grace-period", "--job-id", "--store"):
        assert f"  - {where}: " in result.err
    assert (
        "r2://account.bucket/prefix, cw://bucket/prefix, gs://bucket/prefix or azure://"
        in result.err
    )
    assert not agent.store.exists()


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("s3://", "the store URL 's3://' names no bucket; use file:///path"),
        ("gs:///prefix", "the store URL 'gs:///prefix' names no bucket; use file:///path"),
        ("s3:/bucket/bt", "the store URL 's3:/bucket/bt' lacks a slash; write s3://bucket/bt"),
        ("file:/srv/bt", "the store URL 'file:/srv/bt' lacks a slash; write file:///srv/bt"),
        (
            "file://srv/bt",
            "the store URL 'file://srv/bt' names a host ('srv'), not a directory; write an "
            "absolute path after file:// (file:///srv/bt)",
        ),
        ("hf://org/model", "unsupported store URL 'hf://org/model'; use file:///path"),
        (
            "s3://my bucket/bt",
            "the store URL 's3://my bucket/bt' names 'my bucket', which no bucket can be named "
            "(only letters, digits, '.', '-' and '_'); use file:///path",
        ),
        (
            "s3://bucket/a/../bt",
            "the store URL 's3://bucket/a/../bt' has a '.' or '..' segment in its path",
        ),
    ],
)
@pytest.mark.parametrize("command", ["run", "jobs"])
def test_a_store_url_that_names_no_store_is_refused(
    agent: Agent, store: str, said: str, command: str
) -> None:
    """Every command refuses such a store URL, saying how to write it, before it reads or
    writes anything: ``s3:/bucket`` ran the job on a store in a directory ``s3:`` of the working
    directory, ``s3://`` asked for credentials, ``hf://`` was a traceback in ``jobs``."""
    if command == "run":
        args: tuple[str, ...] = ("run", str(agent.spec(job())), *agent.context_args())
    else:
        args = ("jobs", "list")
    made = {path.name for path in agent.root.iterdir()}
    result = agent(*args, "--store", store)  # the last --store given is the one taken
    assert result.code == 2, result.err
    assert f"--store: {said}" in result.err
    assert {path.name for path in agent.root.iterdir()} == made, "nothing made where it runs"
    assert not agent.store.exists()


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "view", "../x"),
        ("jobs", "logs", "a/b"),
        ("jobs", "list", "--project", "../p"),
        ("checkpoints", "list", "--job-id", "../../x"),
        ("checkpoints", "list", "--project", "a/b", "-o", "json"),
    ],
)
def test_a_job_id_or_project_that_names_no_store_directory_is_a_usage_error(
    agent: Agent, args: tuple[str, ...]
) -> None:
    """Where the store would have refused the key (``refusing object key 'jobs/../x.json'``)
    or found nothing, the argument is refused, named, with how ids and names are written."""
    result = agent(*args, "--store", str(agent.store))
    assert result.code == 2, result.text
    assert "names no job or project: they are named with letters, digits" in result.err
    assert "refusing object key" not in result.err


def test_tunables_that_are_no_number_are_refused_before_the_job_starts(agent: Agent) -> None:
    """A drain of ``10m``, no upload workers, a negative outage, a quiet time of ``nan``: each
    named, all at once, exit 2, nothing created (each was taken as unset, without a word: a
    drain raised to keep checkpoints fell back to its default); so is a grace period of
    ``inf`` (it was taken)."""
    wrong = {
        "BT_UPLOAD_DRAIN_SECONDS": "10m",
        "BT_UPLOAD_WORKERS": "0",
        "BT_STORE_OUTAGE_SECONDS": "-1",
        "BT_CHECKPOINT_QUIET_SECONDS": "nan",
    }
    args = (*agent.context_args(), "--grace-period", "inf")  # a SIGKILL that never comes
    result = agent("run", str(agent.spec(job())), *args, env=wrong)
    assert result.code == 2, result.text
    for variable, value in {**wrong, "--grace-period": "inf"}.items():
        assert f"  - {variable}: expected a " in result.err and repr(value) in result.err
    assert not agent.store.exists()
    fine = {"BT_UPLOAD_DRAIN_SECONDS": "600", "BT_UPLOAD_WORKERS": "8"}
    assert agent("run", str(agent.spec(job())), *agent.context_args(), env=fine).code == 0


def test_a_node_root_that_cannot_be_made_is_refused(agent: Agent) -> None:
    """``--node-root`` below a file: a node-context error naming it, nothing created (it was a
    traceback when the node was claimed)."""
    blocker = agent.root / "a-file"
    blocker.write_text("not a directory")
    args = ["--node-root", str(blocker / "node"), "--store", str(agent.store)]
    result = agent("run", str(agent.spec(job())), *args)
    assert result.code == 2, result.text
    said = f"  - --node-root: {blocker / 'node'} cannot be made: {blocker} is not a directory"
    assert said in result.err and "Traceback" not in result.err, result.err
    assert not agent.store.exists()


def test_multinode_needs_a_leader(agent: Agent) -> None:
    result = agent("run", str(agent.spec(job(compute={"node_count": 2}))), *agent.context_args())
    assert result.code == 2 and "--leader-addr" in result.err


def test_a_multinode_spec_validates_without_a_leader(agent: Agent) -> None:
    """``validate`` judges the spec on a laptop: no leader needed; a rank given that does
    not fit the spec's nodes is still reported."""
    spec = str(agent.spec(job(compute={"node_count": 2})))
    result = agent("validate", spec, "--skip-secrets")
    assert result.code == 0, result.text
    assert "2 node(s)" in result.out
    wrong = agent("validate", spec, "--skip-secrets", "--node-rank", "2")
    assert wrong.code == 2 and "  - --node-rank: " in wrong.err


def test_jobs_list_and_view_formats(agent: Agent) -> None:
    for name in ("first", "second"):
        spec = job(name=name, runtime={"start_commands": ["true"]})
        assert agent.run_job(spec, "--project", "proj").code == 0
    listing = agent("jobs", "list", "--store", str(agent.store), "-o", "csv")
    rows = list(csv.DictReader(io.StringIO(listing.out)))
    assert [r["name"] for r in rows] == ["second", "first"]
    assert {r["status"] for r in rows} == {"COMPLETED"} and {r["project"] for r in rows} == {"proj"}
    table = agent("jobs", "list", "--store", str(agent.store))
    assert table.out.splitlines()[0].split()[:3] == ["JOB", "ID", "PROJECT"]
    data = json.loads(agent("jobs", "list", "--store", str(agent.store), "-o", "json").out)
    view = agent("jobs", "view", data[0]["job_id"], "--store", str(agent.store))
    assert "COMPLETED" in view.out and "second" in view.out


def test_jobs_view_unknown_job(agent: Agent) -> None:
    result = agent("jobs", "view", "nope123", "--store", str(agent.store))
    assert result.code == 1 and "no job 'nope123'" in result.err


def test_jobs_logs_shows_the_commands_output(agent: Agent) -> None:
    assert agent.run_job(job_with(start_commands=["echo logged-line"])).code == 0
    result = agent("jobs", "logs", agent.only_job_id(), "--store", str(agent.store))
    assert "logged-line" in result.out and "COMPLETED" in result.out


def test_store_layout(agent: Agent) -> None:
    assert (
        agent.run_job(
            job_with(start_commands=["true"]), "--project", "p", "--job-id", "abc1234"
        ).code
        == 0
    )
    base = agent.store / "projects" / "p" / "jobs" / "abc1234"
    assert json.loads((agent.store / "jobs" / "abc1234.json").read_text()) == {"project": "p"}
    record = json.loads((base / "job.json").read_text())
    assert record["node_count"] == 1 and record["spec"]["training_job"]["runtime"]
    assert (base / "nodes" / "rank-0.json").is_file() and (base / "logs" / "rank-0.log").is_file()


def test_help_teaches(agent: Agent) -> None:
    result = agent("run", "--help")
    assert result.code == 0
    assert "BT_NODE_RANK" in result.out and "exit codes" in result.out
