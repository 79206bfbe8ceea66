"""PID-1 duties with real processes and real signals: forwarding, grace period, reaping,
exit codes, logs and scratch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import BIN, Agent, failing_inside, finish, job_with, wait_for

PY = sys.executable


def _node(agent: Agent) -> dict[str, object]:
    record = json.loads(next(agent.store.glob("projects/*/jobs/*/nodes/rank-0.json")).read_text())
    assert isinstance(record, dict)
    return record


def _status(agent: Agent) -> str | None:
    found = list(agent.store.glob("projects/*/jobs/*/nodes/rank-0.json"))
    if not found:
        return None
    try:
        return str(json.loads(found[0].read_text())["status"])
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize(("number", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stop_signal_while_running(agent: Agent, number: int, code: int) -> None:
    signals = agent.root / "signals"
    process = agent.start(
        job_with(start_commands=[f"{PY} {BIN}/record_signals.py {signals}", "echo never"])
    )
    wait_for(signals.exists, what="the command to start")
    sent = time.monotonic()
    process.send_signal(number)
    assert finish(process, 10, agent) == code
    assert time.monotonic() - sent < 5
    assert signal.Signals(number).name in signals.read_text()
    node = _node(agent)
    assert node["status"] == "TRAINING_JOB_STOPPED" and node["exit_code"] == code
    said = f"stopped by {signal.Signals(number).name} (the commands ended "
    assert str(node["error"]).startswith(said), node["error"]
    assert "never" not in agent.output()


def test_stop_signal_while_deploying(agent: Agent) -> None:
    code = agent.root / "code"
    for i in range(60):
        (code / f"d{i}").mkdir(parents=True)
        for j in range(120):
            (code / f"d{i}" / f"f{j}.py").write_bytes(b"x" * 64)
    ran = agent.root / "ran"
    process = agent.start(job_with(start_commands=[f"touch {ran}"]))
    wait_for(lambda: _status(agent) == "TRAINING_JOB_DEPLOYING", what="DEPLOYING")
    process.send_signal(signal.SIGTERM)
    assert finish(process, 10, agent) == 143
    node = _node(agent)
    assert node["status"] == "TRAINING_JOB_STOPPED"
    assert [h["status"] for h in node["history"]][-2:] == [  # type: ignore[attr-defined]
        "TRAINING_JOB_DEPLOYING",
        "TRAINING_JOB_STOPPED",
    ]
    assert not ran.exists(), "no start_command runs after a stop during staging"


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(agent: Agent) -> None:
    ready = agent.root / "ready"
    process = agent.start(
        job_with(start_commands=[f"{PY} {BIN}/ignore_term.py {ready}"]), "--grace-period", "3"
    )
    wait_for(ready.exists, what="the command to start")
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert finish(process, 10, agent) == 143
    elapsed = time.monotonic() - sent
    assert elapsed < 3 + 2, f"agent took {elapsed:.1f} s"
    node = _node(agent)
    assert node["status"] == "TRAINING_JOB_STOPPED"
    assert node["error"] == "killed by SIGKILL after the 3 s grace period (stopped by SIGTERM)"


@pytest.mark.parametrize("name", ["SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"])
def test_other_signals_are_forwarded_and_the_job_goes_on(agent: Agent, name: str) -> None:
    signals = agent.root / "signals"
    process = agent.start(job_with(start_commands=[f"{PY} {BIN}/record_signals.py {signals} 2"]))
    wait_for(signals.exists, what="the command to start")
    process.send_signal(getattr(signal, name))
    assert finish(process, 15, agent) == 0
    assert name in signals.read_text()
    assert _node(agent)["status"] == "TRAINING_JOB_COMPLETED"


@pytest.mark.parametrize("code", [0, 1, 3, 42, 255])
def test_exit_code_passthrough(agent: Agent, code: int) -> None:
    assert agent.run_job(job_with(start_commands=[f"{PY} {BIN}/exit_with.py {code}"])).code == code


def test_orphans_are_reaped_while_the_job_runs(agent: Agent) -> None:
    counted = agent.root / "zombies"
    count_zombies = "ps -o stat= --ppid $PPID | grep -c '^Z' || true"
    script = f"{PY} {BIN}/spawn_orphans.py 200 0.2 && sleep 1.5 && ({count_zombies}) > {counted}"
    result = agent.run_job(job_with(start_commands=[script]))
    assert result.code == 0, result.text
    assert "spawned 200 orphans" in result.out
    assert counted.read_text().strip() == "0"


def test_leftover_background_processes_are_ended(agent: Agent) -> None:
    ready = agent.root / "ready"
    command = f"({PY} {BIN}/ignore_term.py {ready} &) ; sleep 0.5"
    start = time.monotonic()
    result = agent.run_job(job_with(start_commands=[command]))
    assert result.code == 0, result.text
    assert time.monotonic() - start < 10
    assert "killed 1 leftover process" in result.err


def test_descendants_are_found_through_children_a_zombie_included() -> None:
    probe = (
        "import os, signal, subprocess\n"
        "from bt_agent.supervisor import tree\n"
        "seen = [tree.descendants()]\n"
        "child = subprocess.Popen(['sh', '-c', 'sleep 30 & wait'])\n"
        "while len(tree.descendants()) < 2: pass\n"
        "seen.append(len(tree.descendants()))\n"
        "tree.signal_all(tree.descendants(), signal.SIGKILL)\n"
        "os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)\n"
        "seen.append(tree.descendants() == [child.pid] and tree.living([child.pid]) == [])\n"
        "child.wait()\n"
        "seen.append(tree.descendants())\n"
        "print(seen)"
    )
    done = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=20)
    assert done.stdout == "[[], 2, True, []]\n", done.stderr


def test_logs_are_streamed_and_saved_while_running(agent: Agent) -> None:
    process = agent.start(job_with(start_commands=[f"{PY} {BIN}/print_continuously.py 80 0.1"]))
    log = agent.store.glob("projects/*/jobs/*/logs/rank-0.log")

    def saved_lines() -> int:
        found = list(agent.store.glob("projects/*/jobs/*/logs/rank-0.log"))
        return found[0].read_text().count("line ") if found else 0

    wait_for(lambda: saved_lines() >= 5, timeout=8, what="the log to reach the store mid-run")
    assert process.poll() is None, "the log was saved while the job was still running"
    assert finish(process, 30, agent) == 0
    assert saved_lines() == 80 and next(log).is_file()
    out = (agent.root / "agent.out").read_text().splitlines()
    assert out == [f"line {i}" for i in range(80)]


def test_jobs_logs_follow(agent: Agent) -> None:
    process = agent.start(
        job_with(start_commands=[f"{PY} {BIN}/print_continuously.py 30 0.1"]), "--job-id", "follow1"
    )
    wait_for(lambda: _status(agent) == "TRAINING_JOB_RUNNING", what="RUNNING")
    result = agent("jobs", "logs", "follow1", "--follow", "--store", str(agent.store))
    assert finish(process, 30, agent) == 0
    assert result.code == 0
    assert [line for line in result.out.splitlines() if line.startswith("line ")] == [
        f"line {i}" for i in range(30)
    ]


def test_scratch_is_emptied_when_the_job_ends(agent: Agent) -> None:
    command = 'mkdir -p "$BT_SCRATCH_DIR/a/b" && touch "$BT_SCRATCH_DIR/a/b/f" "$BT_SCRATCH_DIR/g"'
    assert agent.run_job(job_with(start_commands=[command, "exit 1"])).code == 1
    scratch = agent.node_root / "mnt" / "bt-scratch"
    assert scratch.is_dir() and list(scratch.iterdir()) == []


def test_agent_is_a_subreaper(agent: Agent) -> None:
    out = agent.root / "parent"
    # a grandchild that outlives its parent names its new parent: the agent
    script = agent.root / "orphan.sh"
    script.write_text(
        f"#!/bin/sh\n(sleep 0.3; awk '/^PPid/ {{print $2}}' /proc/self/status > {out}) &\n"
    )
    script.chmod(0o755)
    process = agent.start(job_with(start_commands=[f"{script}; sleep 1"]))
    assert finish(process, 15, agent) == 0
    assert int(out.read_text()) == process.pid


def test_gpu_mismatch_is_a_warning(agent: Agent) -> None:
    result = agent.run_job(
        {
            "image": {"base_image": "x"},
            "compute": {"accelerator": "H100:8"},
            "runtime": {"start_commands": ["true"]},
        },
        "--num-gpus",
        "0",
    )
    assert result.code == 0
    assert "warning: 0 GPU(s) visible but compute.accelerator asks for 8" in result.err


def test_record_keeps_every_transition_with_time(agent: Agent) -> None:
    assert agent.run_job(job_with(start_commands=["true"])).code == 0
    history = _node(agent)["history"]
    assert isinstance(history, list) and len(history) == 4
    assert all(h["at"].endswith("Z") for h in history)
    assert [h["at"] for h in history] == sorted(h["at"] for h in history)


def test_a_progress_bar_redrawn_with_carriage_returns_shows_as_it_goes(agent: Agent) -> None:
    """A bar that redraws itself with ``\\r`` and no newline (tqdm's, the Hugging Face
    Trainer's) reaches the container's log while the command runs, not once it ends (the
    output was passed on only at a newline: nothing for as long as an epoch's bar lasts)."""
    bar = (
        "i=0; while [ $i -lt 40 ]; do i=$((i+1)); printf '\\r%d%%|step %d' $i $i >&2; "
        "sleep 0.1; done; printf '\\n' >&2"
    )
    process = agent.start(job_with(start_commands=[bar]))
    seen = agent.root / "agent.err"
    wait_for(lambda: b"|step 5" in seen.read_bytes(), timeout=30, what="the bar's fifth redraw")
    assert b"|step 40" not in seen.read_bytes(), "the bar was shown only once it ended"
    assert finish(process, 60, agent) == 0
    assert b"\r39%|step 39\r40%|step 40\n" in seen.read_bytes()


def test_a_reader_of_the_agents_output_that_goes_away_does_not_end_the_job(agent: Agent) -> None:
    """``bt-agent run ... | head -1``, or a log collector gone: the agent's stdout is a pipe no
    one reads. The job goes on to the end and its whole output is in the node log (the pump's
    thread died of the broken pipe, closing the child's: the job failed with it)."""
    lines = "import sys\nfor i in range(100000): print('line', i)\nprint('last', file=sys.stderr)"
    spec = agent.spec(job_with(start_commands=[f'{sys.executable} -c "{lines}"']))
    process = subprocess.Popen(
        [sys.executable, "-m", "bt_agent", "run", str(spec), *agent.context_args()],
        env=agent.full_env(),
        cwd=agent.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline() == b"line 0\n"
    process.stdout.close()  # as `head -1` does
    err = process.stderr.read().decode()
    assert process.wait(60) == 0, err
    assert "COMPLETED (exit 0)" in err and "Traceback" not in err, err
    log = agent("jobs", "logs", agent.only_job_id(), "--store", str(agent.store)).out
    # the two streams are pumped apart: stderr's line may come before stdout's last ones
    assert "\nline 99999\n" in log and "\nlast\n" in log, log[-300:]
    assert sum(line.startswith("line ") for line in log.splitlines()) == 100000


def test_a_command_writes_far_more_than_a_default_pipe_before_the_agent_reads(
    tmp_path: Path,
) -> None:
    """A trainer printing while the agent's reader is held back (a thread of the sidecar at
    the lowest priority holding the interpreter's lock on busy CPUs) goes on printing: its
    output pipes hold a megabyte, not the kernel's 64 KiB. Nothing reads them here."""
    from bt_agent.supervisor.process import Child

    done = tmp_path / "done"
    child = Child.spawn(
        f"head -c 786432 /dev/zero && head -c 786432 /dev/zero >&2 && touch {done}",
        dict(os.environ),
        tmp_path,
    )
    try:
        wait_for(done.exists, 10, "the command to write 768 KiB to each stream unread")
    finally:
        child.signal_group(signal.SIGKILL)
        child.process.communicate()


def test_an_error_of_the_agent_s_own_while_deploying_ends_the_job_deploy_failed(
    agent: Agent,
) -> None:
    """An error the agent has no rule for while it deploys (a library's error it does not
    know, raised from a step of the agent's: :func:`helpers.failing_inside`) fails the job as
    a deploy does, exit 3, DEPLOY_FAILED with the error in the node record, its traceback in
    the log in the store, no command run: not a crash that leaves the record DEPLOYING."""
    ran = agent.root / "ran"
    agent.secret("token", "sk-live-123")
    job = job_with(start_commands=[f"touch {ran}"], environment_variables={"T": {"name": "token"}})
    env = failing_inside(agent, "bt_agent.supervisor.job:JobRunner._copy_code", agent.root)
    result = agent.run_job(job, env=env)
    assert result.code == 3, result.text
    node = _node(agent)
    assert node["status"] == "TRAINING_JOB_DEPLOY_FAILED"
    said = "the agent failed: RuntimeError: Data processing error: CAS service error (token ***)"
    assert node["error"] == said
    log = agent("jobs", "logs", agent.only_job_id(), "--store", str(agent.store)).out
    assert "Traceback (most recent call last)" in log and "in _failing" in log, log
    assert "sk-live-123" not in log + result.text
    assert not ran.exists()


def test_an_error_of_the_agent_s_own_while_running_ends_the_commands_and_keeps_checkpoints(
    agent: Agent,
) -> None:
    """An error the agent has no rule for while the commands run: they get a SIGTERM and the
    grace period, as a stop gives them; the checkpoint they saved is uploaded and committed;
    the job ends FAILED, exit 1, the error in the node record and its traceback in the log."""
    signals = agent.root / "signals"
    save = (
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo w > $BT_CHECKPOINT_DIR/checkpoint-1/a.bin"
    )
    job = job_with(
        start_commands=[f"{save} && {PY} {BIN}/record_signals.py {signals} 30", "echo never"],
        checkpointing_config={"enabled": True},
    )
    env = {
        **failing_inside(agent, "bt_agent.supervisor.job:JobRunner._enforce_deadline", signals),
        "BT_CHECKPOINT_QUIET_SECONDS": "0.1",
    }
    started = time.monotonic()
    result = agent.run_job(job, env=env)
    assert result.code == 1, result.text
    assert time.monotonic() - started < 20
    assert "SIGTERM" in signals.read_text(), "the command was given a SIGTERM"
    node = _node(agent)
    assert node["status"] == "TRAINING_JOB_FAILED"
    assert str(node["error"]).startswith("the agent failed: RuntimeError: "), node["error"]
    assert "never" not in result.out
    listed = agent("checkpoints", "list", "--store", str(agent.store), "-o", "json")
    assert [c["checkpoint"] for c in json.loads(listed.out)] == ["checkpoint-1"], listed.text
    log = agent("jobs", "logs", agent.only_job_id(), "--store", str(agent.store)).out
    assert "Traceback (most recent call last)" in log, log


def test_a_record_write_that_fails_with_an_error_no_rule_reads_is_tried_again(
    agent: Agent,
) -> None:
    """The node record's writes failing with an error no rule reads for a second (the
    catalogue's write raising a ``RuntimeError``, :func:`helpers.failing_inside`) are tried
    again as the store's errors are, and the terminal record written: it ended the writer's
    thread, and the job's end waited ``BT_STORE_OUTAGE_SECONDS`` for records never written."""
    failing = agent.root / "failing"
    env = failing_inside(agent, "bt_agent.catalog:Catalog.write_node", failing)
    env["BT_STORE_OUTAGE_SECONDS"] = "30"
    failing.touch()  # from the first record on
    started = time.monotonic()
    result = agent.run_job(job_with(start_commands=[f"sleep 1 && rm {failing}"]), env=env)
    assert result.code == 0, result.text
    assert time.monotonic() - started < 15
    assert "cannot save the node record and log to the store (RuntimeError: " in result.err
    assert _node(agent)["status"] == "TRAINING_JOB_COMPLETED"


def test_a_node_log_the_disk_refuses_leaves_the_job_and_its_output_going(agent: Agent) -> None:
    """The node log's file refused by the disk mid-job (the agent's file size limit,
    ``RLIMIT_FSIZE``: ``EFBIG``, as a full disk gives ``ENOSPC``): said once, and the job goes
    on, every line of its output on stdout, its end recorded, what the log holds saved. The
    reader of the command's output died at the first refused write, so the command was killed
    by SIGPIPE at its next print (the job FAILED), and the agent crashed at its last message."""
    lines = 40_000  # 2.9 MB of output, past the limit and a pipe's capacity
    printer = f"for i in range({lines}): print('line %06d ' % i + 'x' * 60)"
    job = job_with(start_commands=[f'{PY} -c "{printer}"'])
    result = agent("run", str(agent.spec(job)), *agent.context_args(), file_size_limit=200_000)
    assert result.code == 0, result.err[-2000:]
    assert len(result.out.splitlines()) == lines
    said = "the node log cannot be written (File too large): it ends here"
    assert result.err.count(said) == 1, result.err[-2000:]
    assert _node(agent)["status"] == "TRAINING_JOB_COMPLETED"
    log = agent("jobs", "logs", agent.only_job_id(), "--store", str(agent.store)).out
    assert log.startswith("bt-agent: job ") and "line 000000 " in log
