"""A large object coming down in ranges, and what of it is already written: the bytes from each
range's start, kept while the download is tried again, and in a record beside its partial file
for a later process that takes the same download up (a staging stopped or killed, run again).

A record never counts more than was written: each piece reaches the partial file (the page
cache) before it is counted, and the record is a copy of the counts, replaced whole. What the
page cache held is gone with a restart of the machine, so a record holds the boot it was written
in, and is of no use in another. It is taken up only for the same object at the same version
(its ETag), size and range size, into a partial file of the object's size.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bt_agent.storage.base import ObjectInfo, is_resumable, ranges_record

#: The least time between two writes of a download's record while its ranges come.
SAVE_SECONDS = 0.2
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the machine ("" where the system does not say: no record is taken up)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(eq=False)
class Ranged:
    """``info`` coming down in ranges of ``part`` bytes into ``target``: ``written`` maps the
    start of each range begun to the bytes written from it (filled from the range threads or
    the event loop)."""

    info: ObjectInfo
    target: Path
    part: int
    written: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _saved_at: float = 0.0

    @property
    def begun(self) -> bool:
        """Whether any byte of the object is in ``target`` (else it is made anew)."""
        return any(self.written.values())

    def to_fetch(self) -> list[tuple[int, int, int]]:
        """``(start, first, end)`` of each range not yet whole: its start, the first byte it
        lacks, and where it ends."""
        size = self.info.size
        wanted = []
        for start in range(0, size, self.part):
            end = min(start + self.part, size)
            first = start + self.written.get(start, 0)
            if first < end:
                wanted.append((start, first, end))
        return wanted

    def wrote(self, start: int, upto: int) -> None:
        """The range from ``start`` is written up to ``upto``; the record says so where it was
        last written long enough ago."""
        self.written[start] = upto - start
        if time.monotonic() - self._saved_at >= SAVE_SECONDS:
            self.save()

    def save(self) -> None:
        """The record beside ``target``, replaced whole, where a later process may take the
        download up (:func:`is_resumable`; a failure to write it costs only what that process
        could have kept)."""
        if not is_resumable(self.target):
            return
        record = ranges_record(self.target)
        with self._lock:
            self._saved_at = time.monotonic()
            state = {
                "boot": boot_id(),
                "key": self.info.key,
                "version": self.info.version,
                "size": self.info.size,
                "part": self.part,
                "written": {str(start): count for start, count in dict(self.written).items()},
            }
            fresh = record.with_name(f"{record.name}.{os.getpid()}.tmp")
            with contextlib.suppress(OSError):
                fresh.write_text(json.dumps(state))
                os.replace(fresh, record)

    @classmethod
    def taken_up(cls, target: Path, info: ObjectInfo, part: int) -> Ranged:
        """The download of ``info`` into ``target`` as its record left it, where one there is of
        this boot, the same object at the same version, and ranges of ``part`` bytes; else a
        download from the first byte."""
        fresh = cls(info, target, part)
        if not info.version or not is_resumable(target):  # no record is kept of it
            return fresh
        try:
            state = json.loads(ranges_record(target).read_text())
            same = (state["boot"], state["key"], state["version"], state["size"], state["part"])
            written = {int(start): int(count) for start, count in state["written"].items()}
            whole = target.stat().st_size == info.size
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return fresh
        if not whole or same != (boot_id() or None, info.key, info.version, info.size, part):
            return fresh
        fresh.written = {
            start: count
            for start, count in written.items()
            if start % part == 0 and 0 <= count <= min(part, info.size - start)
        }
        return fresh


def may_take_up(partial: Path, seconds: float) -> bool:
    """Whether a later download could take up ``partial``: its record is of this boot and was
    written within the last ``seconds``."""
    record = ranges_record(partial)
    try:
        boot = json.loads(record.read_text())["boot"]
        age = time.time() - record.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(boot) and boot == boot_id() and age <= seconds and partial.exists()
