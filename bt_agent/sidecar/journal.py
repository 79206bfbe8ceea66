"""The sidecar's journal: what is durable in the store, and what was committed, kept in SQLite
on the node's disk so that an agent started again on the same checkpoint dir (the container
restarted) uploads only what is missing and commits what was left uncommitted.

A row is written only after the store has confirmed the upload; an agent killed in between
uploads the file again, which is harmless. One file serves every job and rank of a node root.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from bt_agent.settings import AGENT_STATE_DIR
from bt_agent.sidecar.files import FileSig

#: The journal, as a container path (mapped under the node root on local runs).
JOURNAL_CONTAINER_PATH = f"{AGENT_STATE_DIR}/sidecar-journal.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    job_id TEXT NOT NULL, rank INTEGER NOT NULL, path TEXT NOT NULL,
    size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, inode INTEGER NOT NULL,
    sha256 TEXT NOT NULL, uploaded_at REAL NOT NULL,
    PRIMARY KEY (job_id, rank, path)
);
CREATE INDEX IF NOT EXISTS files_by_path ON files (rank, path);
CREATE TABLE IF NOT EXISTS commits (
    job_id TEXT NOT NULL, rank INTEGER NOT NULL, checkpoint TEXT NOT NULL,
    signature TEXT NOT NULL, committed_at REAL NOT NULL,
    PRIMARY KEY (job_id, rank, checkpoint)
);
"""


class Journal:
    """One job's node's view of the journal; safe to use from several threads."""

    def __init__(self, path: Path, job_id: str, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.job_id = job_id
        self.rank = rank
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable when a process is killed
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def durable(self) -> dict[str, tuple[FileSig, str]]:
        """This job's uploaded files: path -> (signature when uploaded, sha256)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT path, size, mtime_ns, inode, sha256 FROM files WHERE job_id=? AND rank=?",
                (self.job_id, self.rank),
            ).fetchall()
        return {row[0]: (FileSig(row[1], row[2], row[3]), row[4]) for row in rows}

    def record_uploads(self, uploads: list[tuple[str, FileSig, str]]) -> None:
        """Record files the store confirmed: ``(path, signature, sha256)``, one transaction."""
        now = time.time()
        rows = [
            (self.job_id, self.rank, path, sig.size, sig.mtime_ns, sig.inode, sha256, now)
            for path, sig, sha256 in uploads
        ]
        with self._lock, self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def earlier_owner(self, path: str, sig: FileSig) -> str | None:
        """The earlier job on this node root that already made this very file durable (a
        checkpoint dir reused by local runs), if any."""
        with self._lock:
            row = self._db.execute(
                "SELECT job_id FROM files WHERE rank=? AND path=? AND size=? AND mtime_ns=? "
                "AND inode=? AND job_id != ? LIMIT 1",
                (self.rank, path, sig.size, sig.mtime_ns, sig.inode, self.job_id),
            ).fetchone()
        return str(row[0]) if row else None

    def commits(self) -> dict[str, str]:
        """This job's committed checkpoints: name -> signature of what was committed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT checkpoint, signature FROM commits WHERE job_id=? AND rank=?",
                (self.job_id, self.rank),
            ).fetchall()
        return {row[0]: row[1] for row in rows}

    def record_commit(self, checkpoint: str, signature: str) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO commits VALUES (?, ?, ?, ?, ?)",
                (self.job_id, self.rank, checkpoint, signature, time.time()),
            )
