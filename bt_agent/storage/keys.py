"""Object keys and the local paths they map to, refusing any that would escape."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from bt_agent.errors import UnsafeKeyError

MAX_KEY_BYTES = 1024


def check_key(key: str) -> str:
    """``key`` if it is a plain relative ``/``-separated path, else :class:`UnsafeKeyError`."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\0" in key or ".." in parts:
        raise UnsafeKeyError(f"refusing object key {key!r}: it would escape its destination")
    if "" in parts or "." in parts:
        raise UnsafeKeyError(
            f"refusing object key {key!r}: it has an empty or '.' segment (two '/' together, "
            "or a '/' at its end), which no file's path can keep"
        )
    size = len(key.encode("utf-8", "surrogateescape"))
    if size > MAX_KEY_BYTES:
        raise UnsafeKeyError(
            f"refusing object key {key[:60]!r}...: it is {size:,} bytes long, and stores take "
            f"at most {MAX_KEY_BYTES:,}; use shorter file names"
        )
    return key


def join_key(prefix: str, relative: str) -> str:
    return f"{prefix.rstrip('/')}/{relative}" if prefix else relative


def relative_key(prefix: str, key: str) -> str:
    """``key`` relative to ``prefix`` (a directory-like prefix, with or without the slash)."""
    base = prefix.rstrip("/") + "/" if prefix else ""
    if not key.startswith(base):
        raise UnsafeKeyError(f"key {key!r} is not under {prefix!r}")
    return key[len(base) :]


def local_path(root: Path, relative: str) -> Path:
    """Where ``relative`` lands under ``root``; never outside it."""
    check_key(relative)
    return root.joinpath(*PurePosixPath(relative).parts)
