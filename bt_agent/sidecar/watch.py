"""watchdog on the checkpoint dir: inotify where the kernel offers it, polling elsewhere. The
handler only enqueues what changed; deciding what to upload happens elsewhere.

Each change is a :class:`Change`: ``whole`` when a directory appeared (created, or renamed into
place as HF Trainer does), so everything under it must be looked at; ``settled`` when what the
path holds was complete as the event came (a file closed after writing, or a file or directory
renamed into place), rather than possibly still being written. A directory's own "modified"
events are not asked for: every entry that changed inside it has its own event; nor are
"opened" and "closed without writing" (reads change nothing).

Before the drain stops the watch, :meth:`Watcher.flush` makes sure every change made until then
has been handed over: inotify reports the events of one watch in order, so once a marker file
created (and removed at once) in the directory is reported, everything before it is too. A
checkpoint renamed in and rotated away while the agent lagged behind is still known, and
reported, rather than forgotten with the events the watch held when it stopped.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

#: Seconds between two scans when watching by polling.
POLL_INTERVAL = 1.0
#: Names of the marker files :meth:`Watcher.flush` creates and removes at once.
MARKER_PREFIX = ".bt-agent-flush-"


class Change(NamedTuple):
    path: str
    whole: bool = False  # a directory: look at everything under it
    settled: bool = False  # complete as of the event: closed after writing, or renamed into place
    writer_ended: bool = False  # closed because the process writing it ended, not by it
    in_place: bool = True  # written where it is (not renamed in whole, nor found by a rescan)


class Watcher:
    """``closed(path)`` is asked at the moment a file's close-after-write event arrives
    whether its writer ended while writing it (:class:`bt_agent.sidecar.writers.Writers`)."""

    def __init__(
        self,
        root: Path,
        changes: queue.SimpleQueue[Change],
        polling: bool = False,
        closed: Callable[[str], bool] = lambda path: False,
    ) -> None:
        self.root = root
        self.changes = changes
        self.polling = polling
        self.closed = closed
        self._observer: Any = None
        self._inode: int | None = None
        self._marker = ""  # the marker :meth:`flush` waits for, while it waits
        self._flushed = threading.Event()

    @property
    def method(self) -> str:
        return "polling" if self.polling else "inotify"

    def start(self) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        changes, closed, marked = self.changes, self.closed, self._marked

        class Enqueue(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if marked(_text(event.src_path)):
                    return
                moved = event.event_type == "moved"
                if event.is_directory:
                    if event.event_type == "created" or moved:
                        path = _text(event.dest_path or event.src_path)
                        changes.put(Change(path, whole=True, settled=moved, in_place=not moved))
                    return
                path = _text(event.src_path)
                kind = event.event_type
                if kind == "closed":
                    changes.put(Change(path, settled=True, writer_ended=closed(path)))
                else:  # a deletion, or a file renamed away, writes nothing
                    changes.put(Change(path, in_place=kind in ("created", "modified")))
                if event.dest_path:  # renamed into place, itself or with its directory
                    dest = _text(event.dest_path)
                    changes.put(Change(dest, settled=True, in_place=not event.is_synthetic))

        self._inode = _inode(self.root)

        if not self.polling:
            try:
                self._observer = self._observe(Enqueue(), polling=False)
                return
            except OSError:  # no inotify here (or out of watches): poll instead
                self.polling = True
        self._observer = self._observe(Enqueue(), polling=True)

    def _observe(self, handler: Any, polling: bool) -> Any:
        from watchdog import events

        # Not opened / closed-without-writing (every read of a file, the sidecar's own
        # included, would be two events to discard) nor a directory's "modified" (one more
        # for each entry created, deleted or renamed in it).
        wanted = [
            events.FileCreatedEvent,
            events.DirCreatedEvent,
            events.FileModifiedEvent,
            events.FileMovedEvent,
            events.DirMovedEvent,
            events.FileDeletedEvent,
            events.DirDeletedEvent,
            events.FileClosedEvent,
        ]
        if polling:
            from watchdog.observers.polling import PollingObserver

            observer: Any = PollingObserver(timeout=POLL_INTERVAL)
        else:
            from watchdog.observers import Observer

            observer = Observer()
        observer.schedule(handler, str(self.root), recursive=True, event_filter=wanted)
        observer.daemon = True
        observer.start()
        return observer

    def _marked(self, path: str) -> bool:
        """Whether ``path`` is a marker of :meth:`flush` (never a change); the awaited one
        ends the wait."""
        name = os.path.basename(path)
        if not name.startswith(MARKER_PREFIX):
            return False
        if name == self._marker:
            self._flushed.set()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every change made before this call has been
        handed over. False when that is not known: when polling (a scan sees no file that came
        and went between two scans anyway), when the directory takes no marker (gone, not a
        directory, read-only, full) or when the watch lags by more than ``timeout``."""
        if self._observer is None or self.polling:
            return False
        self._marker = f"{MARKER_PREFIX}{uuid.uuid4().hex}"
        self._flushed.clear()
        try:
            directory = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(self._marker, flags, 0o600, dir_fd=directory))
            os.unlink(self._marker, dir_fd=directory)
        except OSError:
            return False
        finally:
            os.close(directory)
        return self._flushed.wait(timeout)

    def stop(self) -> None:
        if self._observer is not None:
            # watchdog's own bookkeeping can fail on a watched directory swapped for a symlink
            # (a KeyError in its stop): the watch is over either way.
            with contextlib.suppress(KeyError, OSError, RuntimeError):
                self._observer.stop()
                self._observer.join(5)
            self._observer = None

    def rearm(self) -> bool:
        """Watch again if the directory was replaced (removed and made anew, as
        ``overwrite_output_dir`` does; the old watch died with the old directory). True when
        it was: what the new one holds must be looked at."""
        inode = _inode(self.root)
        if inode is None or inode == self._inode:
            return False
        self.stop()
        self.start()
        return True


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _text(path: str | bytes) -> str:
    return path.decode("utf-8", "surrogateescape") if isinstance(path, bytes) else path
