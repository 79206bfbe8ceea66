"""A child that forks a thousand processes and exits: the agent reaps every one (it is PID 1's
stand-in, a child subreaper), ends those that outlive the commands, leaves no zombie and still
exits with the commands' status, promptly."""

from __future__ import annotations

import sys
import time

from helpers import BIN, Agent, job_with, marked_processes, process_tree

STORM = 1000
COUNT_ZOMBIES = "ps -o stat= --ppid $PPID | grep -c '^Z' || true"
COUNT_CHILDREN = "ps -o pid= --ppid $PPID | wc -l"


def test_a_thousand_orphans_that_exit_are_reaped_while_the_job_runs(agent: Agent) -> None:
    zombies, children = agent.root / "zombies", agent.root / "children"
    commands = [
        f"{sys.executable} {BIN}/spawn_orphans.py {STORM} 0.5",
        # The orphans have exited by now; the agent (this shell's parent) must have reaped them.
        f"sleep 3; ({COUNT_ZOMBIES}) > {zombies}; ({COUNT_CHILDREN}) > {children}",
    ]
    result = agent.run_job(job_with(start_commands=commands), timeout=120)
    assert result.code == 0, result.text
    assert f"spawned {STORM} orphans" in result.out
    assert zombies.read_text().strip() == "0"
    assert children.read_text().strip() == "1", "only the shell running the command is left"


def test_a_thousand_orphans_that_outlive_the_commands_are_ended(agent: Agent) -> None:
    started = time.monotonic()
    command = f"{sys.executable} {BIN}/spawn_orphans.py {STORM} 600; exit 3"
    result = agent.run_job(job_with(start_commands=[command]), timeout=120)
    elapsed = time.monotonic() - started
    assert result.code == 3, result.text
    assert f"ended {STORM} leftover processes" in result.err
    left = marked_processes(agent.mark)
    assert left == [], "still running:\n" + process_tree(left)
    assert elapsed < 30, f"the agent took {elapsed:.1f} s to end {STORM} orphans"
