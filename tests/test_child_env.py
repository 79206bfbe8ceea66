"""What start_commands see (DESIGN.md §4), and that secret values never leave the child."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import Agent, finish, job_with, wait_for

from bt_agent.context import project_id

BT_VARIABLES = [
    "BT_TRAINING_JOB_ID",
    "BT_TRAINING_PROJECT_ID",
    "BT_TRAINING_JOB_NAME",
    "BT_TRAINING_PROJECT_NAME",
    "BT_NUM_GPUS",
    "BT_WORKING_DIR",
    "BT_SCRATCH_DIR",
    "BT_CHECKPOINT_DIR",
    "BT_LOAD_CHECKPOINT_DIR",
    "BT_PROJECT_CACHE_DIR",
    "BT_TEAM_CACHE_DIR",
    "BT_RW_CACHE_DIR",
    "BT_RETRY_COUNT",
    "BT_GROUP_SIZE",
    "BT_LEADER_ADDR",
    "BT_NODE_RANK",
]
PATH_VARIABLES = [v for v in BT_VARIABLES if v.endswith("_DIR")]
DUMP = 'python -c \'import json,os; json.dump(dict(os.environ), open("{out}", "w"))\''
SECRET = "hf_sEcReT-value-123"


def _child_env(
    agent: Agent, *extra: str, env: dict[str, str] | None = None, **runtime: Any
) -> dict[str, str]:
    out = agent.root / "env.json"
    result = agent.run_job(
        job_with(start_commands=[DUMP.format(out=out)], **runtime), *extra, env=env
    )
    assert result.code == 0, result.text
    data: dict[str, str] = json.loads(out.read_text())
    return data


def test_every_bt_variable_with_a_real_directory(agent: Agent) -> None:
    env = _child_env(agent, "--project", "proj", "--job-id", "job1234", "--num-gpus", "0")
    for name in BT_VARIABLES:
        assert name in env, name
    for name in PATH_VARIABLES:
        path = Path(env[name])
        assert path.is_dir(), name
        assert path.is_relative_to(agent.node_root), name
    assert env["BT_TRAINING_JOB_ID"] == "job1234"
    assert env["BT_TRAINING_PROJECT_NAME"] == "proj"
    assert len(env["BT_TRAINING_PROJECT_ID"]) == 7
    assert env["BT_CHECKPOINT_DIR"] == str(agent.node_root / "mnt" / "ckpts")
    assert env["BT_LOAD_CHECKPOINT_DIR"] == str(agent.node_root / "tmp" / "loaded_checkpoints")
    assert (env["BT_NODE_RANK"], env["BT_GROUP_SIZE"], env["BT_LEADER_ADDR"]) == (
        "0",
        "1",
        "127.0.0.1",
    )
    assert env["BT_NUM_GPUS"] == "0" and env["BT_RETRY_COUNT"] == "0"


def test_torchrun_variables(agent: Agent) -> None:
    env = _child_env(
        agent,
        "--node-rank",
        "1",
        "--group-size",
        "2",
        "--leader-addr",
        "10.1.2.3",
        "--num-gpus",
        "4",
    )
    assert {k: env[k] for k in env if k.startswith("PET_")} == {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_MASTER_ADDR": "10.1.2.3",
        "PET_MASTER_PORT": "29500",
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        "PET_SHUTDOWN_TIMEOUT": "27",
    }
    assert env["BT_LEADER_ADDR"] == "10.1.2.3" and env["BT_NODE_RANK"] == "1"


def test_cpu_node_runs_one_process(agent: Agent) -> None:
    env = _child_env(agent, "--num-gpus", "0")
    assert env["PET_NPROC_PER_NODE"] == "1"


def test_hf_home_with_the_cache(agent: Agent) -> None:
    env = _child_env(agent, "--project", "p", cache_config={"enabled": True})
    project = agent.node_root / f"var/cache/bt-agent/projects/{project_id('p')}/root/.cache"
    assert env["BT_RW_CACHE_DIR"] == str(project)
    assert env["HF_HOME"] == str(project / "user_artifacts/huggingface")
    assert Path(env["HF_HOME"]).is_dir()
    legacy = _child_env(agent, "--project", "p", enable_cache=True)
    assert legacy["HF_HOME"] == str(project / "huggingface")


def _cache_dirs(agent: Agent, spec: dict[str, Any], project: str) -> tuple[Path, Path]:
    out = agent.root / "env.json"
    spec["training_job"]["runtime"]["start_commands"] = [DUMP.format(out=out)]
    result = agent(
        "run", str(agent.spec(spec, wire=False)), "--project", project, *agent.context_args()
    )
    assert result.code == 0, result.text
    env = json.loads(out.read_text())
    return Path(env["BT_PROJECT_CACHE_DIR"]), Path(env["BT_TEAM_CACHE_DIR"])


def test_each_project_and_each_team_has_its_own_cache_on_one_node_root(agent: Agent) -> None:
    """Under a node root the agent keeps caches apart as the platform's volumes do: what one
    project writes to its cache another project does not see; a team's cache is shared by
    the team's projects only."""

    def spec(team: str | None) -> dict[str, Any]:
        job = job_with(start_commands=["true"], cache_config={"enabled": True})
        return {"training_job": job, "training_project": {"name": "x", "team_name": team}}

    a_project, a_team = _cache_dirs(agent, spec("red"), "alpha")
    (a_project / "tokenizer.json").write_text("alpha's")
    (a_team / "shared.bin").write_text("red team's")
    b_project, b_team = _cache_dirs(agent, spec("red"), "beta")
    c_project, c_team = _cache_dirs(agent, spec(None), "gamma")
    again, _ = _cache_dirs(agent, spec("red"), "alpha")
    assert len({a_project, b_project, c_project}) == 3
    assert (
        not (b_project / "tokenizer.json").exists() and not (c_project / "tokenizer.json").exists()
    )
    assert (again / "tokenizer.json").read_text() == "alpha's", "a project keeps its cache"
    assert b_team == a_team and (b_team / "shared.bin").read_text() == "red team's"
    assert c_team != a_team and not (c_team / "shared.bin").exists()
    for path in (a_project, b_project, c_project, a_team, c_team):
        assert path.is_relative_to(agent.node_root)


def test_no_hf_home_without_the_cache(agent: Agent) -> None:
    env = _child_env(agent, env={"HF_HOME": "/inherited/hf"})
    assert env["HF_HOME"] == "/inherited/hf", "the agent leaves HF_HOME alone without the cache"


def test_user_variables_and_precedence(agent: Agent) -> None:
    env = _child_env(
        agent, environment_variables={"LR": "0.1", "PET_MASTER_PORT": "29400", "BT_NODE_RANK": "9"}
    )
    assert env["LR"] == "0.1"
    assert env["PET_MASTER_PORT"] == "29400", "users may change torchrun's defaults"
    assert env["BT_NODE_RANK"] == "0", "platform variables cannot be overridden"


def test_agent_inputs_are_not_passed_to_the_child(agent: Agent) -> None:
    env = _child_env(agent, env={"BT_GRACE_PERIOD_SECONDS": "12"})
    assert "BT_GRACE_PERIOD_SECONDS" not in env and "BT_STORE_URL" not in env


def _everything_produced(agent: Agent, *texts: str) -> str:
    parts = list(texts)
    for path in agent.store.rglob("*"):
        if path.is_file():
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def test_secret_reaches_the_child_and_nothing_else(agent: Agent) -> None:
    agent.secret("hf_access_token", SECRET)
    out = agent.root / "env.json"
    runtime = {
        "environment_variables": {"HF_TOKEN": {"name": "hf_access_token"}},
        "start_commands": [
            DUMP.format(out=out),
            "echo token=$HF_TOKEN",
            "echo $HF_TOKEN >&2",
            "exit 3",
        ],
    }
    spec = agent.spec(job_with(**runtime))
    run = agent("run", str(spec), *agent.context_args())
    assert run.code == 3
    assert json.loads(out.read_text())["HF_TOKEN"] == SECRET
    assert "token=***" in run.out
    env = agent("env", str(spec), *agent.context_args())
    assert "export HF_TOKEN='***'" in env.out
    validate = agent("validate", str(spec), *agent.context_args())
    view = agent("jobs", "view", agent.only_job_id(), "--store", str(agent.store), "-o", "json")
    produced = _everything_produced(
        agent, run.out, run.err, env.out, env.err, validate.out, view.out
    )
    assert "hf_access_token" in produced  # the reference is kept...
    assert SECRET not in produced  # ...the value never


def test_secret_trailing_newline_is_stripped(agent: Agent) -> None:
    agent.secret("tok", "value")  # written with a trailing newline
    out = agent.root / "env.json"
    runtime = {
        "environment_variables": {"T": {"name": "tok"}},
        "start_commands": [DUMP.format(out=out)],
    }
    assert agent.run_job(job_with(**runtime)).code == 0
    assert json.loads(out.read_text())["T"] == "value"


def test_weights_secret_must_exist(agent: Agent) -> None:
    spec = {
        "image": {"base_image": "x"},
        "weights": [{"source": "hf://a/b", "mount_location": "/m", "auth_secret_name": "hf_tok"}],
    }
    result = agent("validate", str(agent.spec(spec)), *agent.context_args())
    assert result.code == 2 and "weights[0].auth_secret_name: secret 'hf_tok'" in result.err


def test_env_command_prints_exports(agent: Agent) -> None:
    result = agent(
        "env",
        str(agent.spec(job_with(environment_variables={"A": "b c"}))),
        *agent.context_args(),
        "--job-id",
        "abc1234",
    )
    assert result.code == 0
    lines = result.out.splitlines()
    assert "export A='b c'" in lines and "export BT_TRAINING_JOB_ID=abc1234" in lines
    assert all(line.startswith("export ") for line in lines)
    assert not agent.node_root.exists(), "env creates nothing"


def test_env_command_keeps_names_no_shell_can_export_out_of_its_exports(agent: Agent) -> None:
    """The commands get every name the spec gives; a shell cannot export ``B-C`` or ``A B``
    (``export A B=v`` exports two others), nor a name across two lines: those are shown as
    comments, and what ``env`` prints runs in a shell as it is."""
    names = {"B-C": "v", "SP A": "w", "A\nB": "x", "OK_1": "y"}
    spec = agent.spec(job_with(environment_variables=names))
    result = agent("env", str(spec), *agent.context_args())
    assert result.code == 0, result.text
    assert "export OK_1=y" in result.out.splitlines()
    for name, value in names.items():
        if name != "OK_1":
            assert f"# {json.dumps(name)}={json.dumps(value)}: " in result.out, result.out
    shell = subprocess.run(
        ["sh", "-e", "-c", result.out + '\necho "$OK_1 $BT_NODE_RANK"'],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (shell.returncode, shell.stdout, shell.stderr) == (0, "y 0\n", "")


def test_names_the_shell_may_drop_are_warned_of(agent: Agent) -> None:
    """``/bin/sh`` runs start_commands, and dash drops ``B-C`` and ``my.var`` from what it
    runs: the job would find them missing without a word. ``validate`` and ``run`` say so,
    naming the field; the job still runs."""
    out = agent.root / "env.json"
    names = {"B-C": "v", "my.var": "w", "OK": "x"}
    spec = agent.spec(job_with(environment_variables=names, start_commands=[DUMP.format(out=out)]))
    warned = [f"runtime.environment_variables[{json.dumps(n)}]: " for n in ("B-C", "my.var")]
    validate = agent("validate", str(spec), *agent.context_args())
    run = agent("run", str(spec), *agent.context_args())
    for result in (validate, run):
        assert result.code == 0, result.text
        assert all(f"warning: {field}the shell" in result.err for field in warned), result.err
        assert "environment_variables.OK" not in result.err
    assert json.loads(out.read_text())["OK"] == "x"


def test_a_python_commands_prints_reach_the_output_as_they_come(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a pipe, Python holds a ``print`` back until 8 KiB gather: a training loop's lines
    would show hours late, or when it ends. The command prints a line and waits for the test
    to have seen it in the agent's output before it ends. (The container sets nothing here.)"""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    go = agent.root / "go"
    script = (
        f"import os, time\nprint('step', 1, 'loss', 0.5)\ndeadline = time.time() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    process = agent.start(job_with(start_commands=[f"{sys.executable} -c {shlex.quote(script)}"]))
    try:
        wait_for(lambda: "step 1 loss 0.5" in agent.output(), 20, "the print, before the end")
    finally:
        go.touch()
    assert finish(process, 60, agent) == 0, agent.output()


def test_python_buffering_is_the_containers_or_the_specs_where_they_set_it(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    assert _child_env(agent)["PYTHONUNBUFFERED"] == "1"
    assert _child_env(agent, env={"PYTHONUNBUFFERED": ""})["PYTHONUNBUFFERED"] == ""
    spec = {"PYTHONUNBUFFERED": ""}
    assert _child_env(agent, environment_variables=spec)["PYTHONUNBUFFERED"] == ""
