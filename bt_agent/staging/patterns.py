"""``allow_patterns`` / ``ignore_patterns``: shell-style globs over the path relative to the
source root, the same for every scheme (REFERENCE.md §5, ours): ``*`` and ``?`` do not cross
``/``, ``**`` does (``**/`` also matches no directory at all), and ignore wins over allow.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence


@functools.lru_cache(maxsize=512)
def compile_glob(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape("["))
                i += 1
            else:
                body = pattern[i + 1 : end].replace("\\", "\\\\")
                out.append(f"[{'^' + body[1:] if body.startswith('!') else body}]")
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def matches(path: str, patterns: Sequence[str]) -> bool:
    return any(compile_glob(p).match(path) for p in patterns)


def selected(path: str, allow: Sequence[str] | None, ignore: Sequence[str] | None) -> bool:
    """Whether a file is staged: allowed (no allow list = everything) and not ignored."""
    if ignore and matches(path, ignore):
        return False
    return not allow or matches(path, allow)


def anywhere(patterns: Sequence[str]) -> list[str]:
    """``patterns`` as they would match at any depth: one with no ``/`` as ``**/`` before it
    (``*.safetensors`` as ``**/*.safetensors``), the others as they are."""
    return [p if "/" in p else f"**/{p}" for p in patterns]


def left_in_subdirectories(
    paths: Sequence[str], allow: Sequence[str] | None, ignore: Sequence[str] | None
) -> list[str]:
    """The paths in subdirectories that ``allow`` leaves out only because its ``*`` stops at
    ``/``, where huggingface_hub's patterns would take them: what a user of those may have
    meant, worth a word."""
    if not allow or all("/" in p for p in allow):
        return []
    deeper = anywhere(allow)
    return [
        path
        for path in paths
        if "/" in path and not selected(path, allow, ignore) and selected(path, deeper, ignore)
    ]
