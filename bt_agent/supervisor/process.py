"""One start_command as a child process in its own session, and what its end means."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO


def exit_status(returncode: int) -> int:
    """A shell-style status: the code itself, or ``128 + N`` for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(status: int) -> str:
    """``exited with code 1``, ``was killed by SIGKILL``, ``was not found (exit 127)``."""
    if status == 127:
        return "was not found (exit 127)"
    if status == 126:
        return "could not be executed (exit 126)"
    if status > 128 and status - 128 < signal.NSIG:
        return f"was killed by {signal_name(status - 128)} (exit {status})"
    return f"exited with code {status}"


#: Run before every start_command in its shell. The shell catches (does not ignore) the signals
#: that are forwarded but do not stop the job, so it survives them while its children, which
#: reset caught signals to the default, get them as sent. A stop signal still ends the shell.
SHELL_PRELUDE = "trap : HUP QUIT USR1 USR2; "

#: What each of a child's output pipes holds before its writes wait on the agent's reader (the
#: kernel's default is 64 KiB). The reader needs the interpreter's lock, which a thread of the
#: checkpoint sidecar may hold while it waits for a CPU: at the lowest priority, on CPUs that
#: training keeps busy, that wait lasts up to seconds, and a trainer printing fast would stall
#: on its ``print``. A process may ask for up to ``/proc/sys/fs/pipe-max-size`` (1 MiB by default).
PIPE_BYTES = 1024 * 1024


@dataclass
class Child:
    """A running start_command; its process group id equals its pid."""

    process: subprocess.Popen[bytes]

    @classmethod
    def spawn(cls, command: str, env: dict[str, str], cwd: Path) -> Child:
        process = subprocess.Popen(
            ["/bin/sh", "-c", SHELL_PRELUDE + command],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for stream in (process.stdout, process.stderr):
            _widen(stream)
        return cls(process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal_group(self, number: int) -> None:
        """Send a signal to the whole process group; a group already gone is not an error."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, number)


def _widen(pipe: IO[bytes] | None) -> None:
    """``pipe`` given ``PIPE_BYTES`` of buffer where the system allows it (Linux), else left as
    it is: ``Popen``'s own ``pipesize`` would fail the spawn where it is refused (a user over
    the kernel's pipe limits)."""
    if pipe is None:
        return
    with contextlib.suppress(OSError, AttributeError, ValueError):
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
