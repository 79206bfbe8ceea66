"""The user's code copied into the working dir of a local run, as the platform's push uploads it:
regular files, directories and symbolic links; never special files (a named pipe or a socket
beside the spec), never what the agent itself keeps (a node root, a file store, a cache dir, the
secrets dir; other runs' too) nor a version control or tool directory, nor what the code dir's
ignore file (:data:`IGNORE_FILE`, in ``.gitignore`` syntax) names.

The copy is planned first (what would be copied, counted against :data:`MAX_CODE_FILES`), then
made: a code dir that is too large is refused before anything is written.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bt_agent.catalog.layout import INDEX_FORMAT_KEY
from bt_agent.errors import StagingError

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec

#: Directories never copied, wherever they are.
SKIPPED_NAMES = (".git", "__pycache__", ".venv", "node_modules", ".mypy_cache", ".pytest_cache")
#: What makes a directory the agent's own: a node root, or a node or cluster cache.
_AGENT_MARKS = (("var", "lib", "bt-agent"), ("b10", "workspace"), ("objects",), ("locks",))
#: The file in the code dir whose patterns (``.gitignore`` syntax) say what not to copy.
IGNORE_FILE = ".btignore"
#: The most files a code dir may hold (after what is left out): beyond it, the spec most likely
#: sits in a home or data directory rather than beside the code.
MAX_CODE_FILES = 10_000


@dataclass
class Copied:
    files: int = 0
    bytes: int = 0
    special: list[str] = field(default_factory=list)  # relative paths of files left out
    ignored: int = 0  # files and directories left out by the ignore file


@dataclass
class _Plan:
    """What a copy makes, relative to the code dir: directories, links, regular files."""

    directories: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    copied: Copied = field(default_factory=Copied)


def is_agents_own(directory: Path) -> bool:
    """A node root (its state or its workspace), a cache (objects and locks), or a file store
    (its index's format record), this run's or another's."""
    marks = [directory.joinpath(*parts).is_dir() for parts in _AGENT_MARKS]
    store = directory.joinpath(*INDEX_FORMAT_KEY.split("/")).is_file()
    return marks[0] or marks[1] or (marks[2] and marks[3]) or store


def copy_code(
    source: Path,
    target: Path,
    skip: Iterable[Path] = (),
    stopping: Callable[[], bool] = lambda: False,
) -> Copied:
    """Copy ``source`` into ``target`` (merged with what is there), leaving out the paths in
    ``skip``, :data:`SKIPPED_NAMES`, the agent's own directories and what the ignore file
    names; special files are left out and named in the result. Raises :class:`StagingError`
    for a code dir of more than :data:`MAX_CODE_FILES` files (nothing copied) and
    :class:`InterruptedError` when ``stopping()``."""
    plan = _plan(source, {os.path.realpath(path) for path in skip}, _ignore_spec(source))
    for relative in plan.directories:
        (target / relative).mkdir(parents=True, exist_ok=True)
    for relative in plan.links:
        _link(source / relative, target / relative)
    for relative in plan.files:
        if stopping():
            raise InterruptedError("stop requested")
        shutil.copy2(source / relative, target / relative)
    return plan.copied


def _plan(source: Path, left_out: set[str], ignore: GitIgnoreSpec | None) -> _Plan:
    plan = _Plan(directories=["."])
    for directory, dirnames, filenames in os.walk(source):
        here = Path(directory)
        base = here.relative_to(source)
        kept = []
        for name in sorted(dirnames):
            path, relative = here / name, (base / name).as_posix()
            if name in SKIPPED_NAMES or os.path.realpath(path) in left_out:
                continue
            if ignore is not None and ignore.match_file(relative + "/"):
                plan.copied.ignored += 1
            elif path.is_symlink():  # a link to a directory is copied as a link
                plan.links.append(relative)
            elif not is_agents_own(path):
                plan.directories.append(relative)
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            _plan_file(plan, here / name, (base / name).as_posix(), ignore)
        if len(plan.files) > MAX_CODE_FILES:
            raise StagingError(
                f"the code dir {source} holds more than {MAX_CODE_FILES} files; put the spec "
                f"beside your code, pass --code-dir, or name what to leave out in {IGNORE_FILE}"
            )
    return plan


def _plan_file(plan: _Plan, path: Path, relative: str, ignore: GitIgnoreSpec | None) -> None:
    mode = path.lstat().st_mode
    if ignore is not None and ignore.match_file(relative):
        plan.copied.ignored += 1
    elif stat.S_ISLNK(mode):
        plan.links.append(relative)
    elif stat.S_ISREG(mode):
        plan.files.append(relative)
        plan.copied.files += 1
        plan.copied.bytes += path.stat().st_size
    else:
        plan.copied.special.append(relative)


def _ignore_spec(source: Path) -> GitIgnoreSpec | None:
    """The ignore file's patterns, or None without one."""
    try:
        lines = (source / IGNORE_FILE).read_text().splitlines()
    except FileNotFoundError:
        return None
    import pathspec  # only when there is an ignore file: start-up stays lean

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _link(path: Path, target: Path) -> None:
    if target.is_symlink() or target.is_file():
        target.unlink()
    os.symlink(os.readlink(path), target)
