"""The user's code copied into the working dir of a local run, as the platform's push uploads it:
regular files, directories and symbolic links; never special files (a named pipe or a socket
beside the spec), never what the agent itself keeps (a node root, a file store, a cache dir, the
secrets dir) nor a version control or tool directory.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: Directories never copied, wherever they are.
SKIPPED_NAMES = (".git", "__pycache__", ".venv", "node_modules", ".mypy_cache", ".pytest_cache")
#: What makes a directory the agent's own: a node root, or a node or cluster cache.
_AGENT_MARKS = (("var", "lib", "bt-agent"), ("b10", "workspace"), ("objects",), ("locks",))


@dataclass
class Copied:
    files: int = 0
    bytes: int = 0
    special: list[str] = field(default_factory=list)  # relative paths of files left out


def is_agents_own(directory: Path) -> bool:
    """A node root (its state or its workspace) or a cache (objects and locks)."""
    marks = [directory.joinpath(*parts).is_dir() for parts in _AGENT_MARKS]
    return marks[0] or marks[1] or (marks[2] and marks[3])


def copy_code(
    source: Path,
    target: Path,
    skip: Iterable[Path] = (),
    stopping: Callable[[], bool] = lambda: False,
) -> Copied:
    """Copy ``source`` into ``target`` (merged with what is there), leaving out the paths in
    ``skip``, :data:`SKIPPED_NAMES` and the agent's own directories; special files are left
    out and named in the result. Raises :class:`InterruptedError` when ``stopping()``."""
    left_out = {os.path.realpath(path) for path in skip}
    copied = Copied()
    for directory, dirnames, filenames in os.walk(source):
        here = Path(directory)
        dirnames[:] = [
            name
            for name in sorted(dirnames)
            if name not in SKIPPED_NAMES
            and os.path.realpath(here / name) not in left_out
            and not is_agents_own(here / name)
        ]
        into = target / here.relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in dirnames:  # symbolic links to directories are copied as links
            if (here / name).is_symlink():
                _link(here / name, into / name)
        dirnames[:] = [name for name in dirnames if not (here / name).is_symlink()]
        for name in sorted(filenames):
            if stopping():
                raise InterruptedError("stop requested")
            _copy_one(here / name, into / name, source, copied)
    return copied


def _copy_one(path: Path, target: Path, source: Path, copied: Copied) -> None:
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        _link(path, target)
    elif stat.S_ISREG(mode):
        shutil.copy2(path, target)
        copied.files += 1
        copied.bytes += path.stat().st_size
    else:
        copied.special.append(str(path.relative_to(source)))


def _link(path: Path, target: Path) -> None:
    if target.is_symlink() or target.is_file():
        target.unlink()
    os.symlink(os.readlink(path), target)
